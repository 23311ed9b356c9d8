//! The governor's measurement: the server's inter-token gaps, each classed by what the co-runners did
//! during it (running, or all frozen: from the shims' confirmed freeze and thaw times), and the stretch a
//! running co-runner causes, `mean gap running / mean gap frozen - 1`.
use std::collections::VecDeque;

/// Gaps kept per class (the estimate follows the last few seconds of decoding).
const KEPT: usize = 256;
/// A gap counts for a class when at least this share of it was spent in that state.
const PURE: f64 = 0.9;

/// When the co-runners were all frozen: a history of confirmed transitions, oldest first.
#[derive(Debug, Default)]
pub struct FrozenTimeline {
    /// (CLOCK_MONOTONIC ns, all frozen from then on).
    changes: VecDeque<(u64, bool)>,
}

impl FrozenTimeline {
    /// From `t_ns` on, the co-runners are all frozen (`true`) or some run.
    pub fn record(&mut self, t_ns: u64, all_frozen: bool) {
        if self.changes.back().is_some_and(|&(_, f)| f == all_frozen) {
            return;
        }
        self.changes.push_back((t_ns, all_frozen));
        while self.changes.len() > 4 * KEPT {
            self.changes.pop_front();
        }
    }

    /// The share of `[from, to)` during which all were frozen (state before the first record: running).
    pub fn frozen_share(&self, from: u64, to: u64) -> f64 {
        if to <= from {
            return 0.0;
        }
        let mut frozen_ns = 0u64;
        let mut state = false;
        let mut at = from;
        for &(t, f) in &self.changes {
            if t <= from {
                state = f;
                continue;
            }
            if t >= to {
                break;
            }
            if state {
                frozen_ns += t - at;
            }
            at = t;
            state = f;
        }
        if state {
            frozen_ns += to - at;
        }
        frozen_ns as f64 / (to - from) as f64
    }
}

/// Gaps with a co-runner running and with all frozen.
#[derive(Debug, Default)]
pub struct GapStats {
    running: VecDeque<u64>,
    frozen: VecDeque<u64>,
    /// Gaps measured per class since the governor was set.
    pub counted: (u64, u64),
}

impl GapStats {
    /// Classes the gap `[from, to)` by `timeline`; a mixed gap is not counted.
    pub fn add(&mut self, from: u64, to: u64, timeline: &FrozenTimeline) {
        let share = timeline.frozen_share(from, to);
        let gap = to.saturating_sub(from);
        let kept = if share >= PURE {
            self.counted.1 += 1;
            &mut self.frozen
        } else if share <= 1.0 - PURE {
            self.counted.0 += 1;
            &mut self.running
        } else {
            return;
        };
        kept.push_back(gap);
        if kept.len() > KEPT {
            kept.pop_front();
        }
    }

    /// Mean gap with a co-runner running, ns.
    pub fn mean_running(&self) -> Option<u64> {
        mean(&self.running)
    }

    /// Mean gap with all frozen, ns.
    pub fn mean_frozen(&self) -> Option<u64> {
        mean(&self.frozen)
    }

    /// `mean running / mean frozen - 1` (at least 0), once each class has a few gaps.
    pub fn stretch(&self) -> Option<f64> {
        if self.running.len() < 8 || self.frozen.len() < 8 {
            return None;
        }
        let (r, f) = (self.mean_running()?, self.mean_frozen()?);
        (f > 0).then(|| (r as f64 / f as f64 - 1.0).max(0.0))
    }
}

fn mean(v: &VecDeque<u64>) -> Option<u64> {
    (!v.is_empty()).then(|| v.iter().sum::<u64>() / v.len() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_frozen_share_of_an_interval_follows_the_transitions() {
        let mut t = FrozenTimeline::default();
        assert_eq!(t.frozen_share(0, 100), 0.0);
        t.record(100, true);
        t.record(150, true); // no change
        t.record(200, false);
        assert_eq!(t.frozen_share(100, 200), 1.0);
        assert_eq!(t.frozen_share(50, 150), 0.5);
        assert_eq!(t.frozen_share(200, 300), 0.0);
        assert_eq!(t.frozen_share(150, 250), 0.5);
        t.record(300, true);
        assert_eq!(t.frozen_share(350, 400), 1.0);
        assert_eq!(t.frozen_share(400, 400), 0.0);
    }

    #[test]
    fn stretch_compares_running_and_frozen_gaps_and_mixed_gaps_are_left_out() {
        let mut t = FrozenTimeline::default();
        let mut g = GapStats::default();
        // Running until 10_000, frozen after.
        t.record(10_000, true);
        for i in 0..8 {
            g.add(i * 1000, i * 1000 + 150, &t); // running gaps of 150
        }
        assert_eq!(g.stretch(), None, "no frozen gaps yet");
        for i in 0..8 {
            g.add(20_000 + i * 1000, 20_000 + i * 1000 + 100, &t); // frozen gaps of 100
        }
        g.add(9_500, 10_500, &t); // half and half: not counted
        assert_eq!(g.counted, (8, 8));
        assert_eq!(g.mean_running(), Some(150));
        assert_eq!(g.mean_frozen(), Some(100));
        let s = g.stretch().unwrap();
        assert!((s - 0.5).abs() < 1e-9, "{s}");
    }
}
