//! Metrics of events, updated where they happen: the release signal (the core, as it publishes a
//! `released` event), the controller's confirmed freezes and thaws, and preemptions with their phases (the
//! connection that ran them). Each update is a few atomic operations under the crate's short per-metric
//! lock, never a wait on the scrape. Label values come from fixed sets (phases, modes, confirmation kinds),
//! so no series is added per container and nothing grows with the containers a node has run.
use std::sync::LazyLock;

use baton_agent_api::{Phase, Released, Step};
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{
        counter::Counter,
        family::Family,
        histogram::{Histogram, exponential_buckets},
    },
    registry::{Registry, Unit},
};

/// Labels of the release histograms.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ConfirmedBy {
    /// What confirmed the kernel's release (`syscall_return`, `thread_dead`, `proc`, `resync`).
    pub confirmed_by: String,
}

/// Labels of the freeze latency histogram.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FreezeOp {
    /// `freeze` or `thaw`.
    pub op: &'static str,
}

/// Labels of the preemption counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PreemptionLabels {
    /// `preempt`, `resume`, `start` or `handoff`.
    pub operation: &'static str,
    /// `park` or `snapshot` (empty for resume and start).
    pub mode: &'static str,
    /// `ok` or `error`.
    pub outcome: &'static str,
}

/// Labels of the phase histogram.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabels {
    /// As in [`PreemptionLabels`].
    pub operation: &'static str,
    /// The timeline's phase (`locked`, `checkpointed`, `gpu_released`, `frozen`, ...).
    pub phase: String,
}

type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

/// 10 us to 1.3 s: release confirmations and freezes.
fn fast() -> Histogram {
    Histogram::new(exponential_buckets(1e-5, 2.0, 18))
}

/// 1 ms to 131 s: preemption phases (a checkpoint takes as long as its copy).
fn slow() -> Histogram {
    Histogram::new(exponential_buckets(1e-3, 2.0, 18))
}

/// The event metrics of the agent (one set per process).
pub struct EventMetrics {
    release_confirm: Histograms<ConfirmedBy>,
    release_signal: Histograms<ConfirmedBy>,
    freeze_latency: Histograms<FreezeOp>,
    preemptions: Family<PreemptionLabels, Counter>,
    phases: Histograms<PhaseLabels>,
    mirror_corrections: Counter,
}

static EVENTS: LazyLock<EventMetrics> = LazyLock::new(EventMetrics::new);

/// The agent's event metrics.
pub fn events() -> &'static EventMetrics {
    &EVENTS
}

fn seconds(ns: u64) -> f64 {
    ns as f64 / 1e9
}

impl EventMetrics {
    fn new() -> Self {
        Self {
            release_confirm: Family::new_with_constructor(fast),
            release_signal: Family::new_with_constructor(fast),
            freeze_latency: Family::new_with_constructor(fast),
            preemptions: Family::default(),
            phases: Family::new_with_constructor(slow),
            mirror_corrections: Counter::default(),
        }
    }

    /// A `released` event published at `published_ns`.
    pub fn released(&self, r: &Released, published_ns: u64) {
        let labels = ConfirmedBy {
            confirmed_by: r.confirmed_by.clone(),
        };
        let confirm = r.t_released_ns.saturating_sub(r.t_last_close_ns);
        let signal = published_ns.saturating_sub(r.t_last_close_ns);
        self.release_confirm
            .get_or_create(&labels)
            .observe(seconds(confirm));
        self.release_signal
            .get_or_create(&labels)
            .observe(seconds(signal));
    }

    /// /proc showed a held container free that the probes' mirror still held (it was released, confirmed by
    /// proc): a probe bug to report.
    pub fn mirror_corrected(&self) {
        self.mirror_corrections.inc();
    }

    /// A shim confirmed a freeze (`freeze`) or a thaw after `latency_ns`.
    pub fn freeze_confirmed(&self, freeze: bool, latency_ns: u64) {
        let op = if freeze { "freeze" } else { "thaw" };
        self.freeze_latency
            .get_or_create(&FreezeOp { op })
            .observe(seconds(latency_ns));
    }

    /// A preemption operation ended (`ok` or not) with timeline `steps` (sorted by time, `asked` first).
    pub fn preemption(
        &self,
        operation: &'static str,
        mode: &'static str,
        ok: bool,
        steps: &[Step],
    ) {
        let outcome = if ok { "ok" } else { "error" };
        self.preemptions
            .get_or_create(&PreemptionLabels {
                operation,
                mode,
                outcome,
            })
            .inc();
        let Some(asked) = steps.iter().find(|s| s.phase == Phase::Asked) else {
            return;
        };
        let mut seen = Vec::new();
        for s in steps.iter().filter(|s| s.phase != Phase::Asked) {
            if seen.contains(&s.phase) {
                continue;
            }
            seen.push(s.phase);
            let phase = s.phase.label().to_lowercase().replace(' ', "_");
            self.phases
                .get_or_create(&PhaseLabels { operation, phase })
                .observe(seconds(s.t_ns.saturating_sub(asked.t_ns)));
        }
    }

    /// Registers these (shared, not copied) in `r`.
    pub fn register(&self, r: &mut Registry) {
        r.register_with_unit(
            "release_confirm",
            "Time from a container's last removal of an NVIDIA file or mapping to the confirmation that \
             the kernel ran its deferred release (t_released_ns - t_last_close_ns of `released` events)",
            Unit::Seconds,
            self.release_confirm.clone(),
        );
        r.register_with_unit(
            "release_signal",
            "Time from a container's last removal to the agent publishing its `released` event",
            Unit::Seconds,
            self.release_signal.clone(),
        );
        r.register_with_unit(
            "freeze_latency",
            "Confirmed latency of the co-runner controller's freezes and thaws, as the shims report them",
            Unit::Seconds,
            self.freeze_latency.clone(),
        );
        r.register(
            "preemptions",
            "Preemption operations (preempt, resume, start, handoff) run through the agent, by outcome",
            self.preemptions.clone(),
        );
        r.register(
            "mirror_corrections",
            "Releases that /proc showed and the probes' records did not (the agent's mirror of a held \
             container was wrong; a non-zero count is a probe bug to report, with the agent's log)",
            self.mirror_corrections.clone(),
        );
        r.register_with_unit(
            "preemption_phase",
            "Time from a preemption's request to each phase of its timeline (its first occurrence)",
            Unit::Seconds,
            self.phases.clone(),
        );
    }
}

#[cfg(test)]
mod tests {
    use baton_agent_api::ContainerRef;

    use super::*;

    fn step(phase: Phase, t_ns: u64) -> Step {
        Step {
            t_ns,
            container: ContainerRef {
                id: "c".into(),
                namespace: "n".into(),
            },
            phase,
            pid: None,
            detail: String::new(),
            no_cuda_state: Vec::new(),
        }
    }

    fn text(m: &EventMetrics) -> String {
        let mut r = Registry::with_prefix("baton");
        m.register(&mut r);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &r).unwrap();
        out
    }

    #[test]
    fn a_preemption_counts_once_and_times_each_phase_from_the_request() {
        let m = EventMetrics::new();
        let steps = [
            step(Phase::Asked, 1_000_000_000),
            step(Phase::Locked, 1_010_000_000),
            step(Phase::Checkpointed, 1_500_000_000),
            step(Phase::Checkpointed, 1_600_000_000),
            step(Phase::GpuReleased, 1_550_000_000),
            step(Phase::Done, 1_700_000_000),
        ];
        m.preemption("preempt", "park", true, &steps);
        m.preemption("resume", "", false, &[]);
        let t = text(&m);
        assert!(
            t.contains(
                r#"baton_preemptions_total{operation="preempt",mode="park",outcome="ok"} 1"#
            ),
            "{t}"
        );
        assert!(
            t.contains(r#"baton_preemptions_total{operation="resume",mode="",outcome="error"} 1"#),
            "{t}"
        );
        assert!(
            t.contains(r#"baton_preemption_phase_seconds_count{operation="preempt",phase="checkpointed"} 1"#),
            "the first checkpointed only: {t}"
        );
        assert!(
            t.contains(r#"baton_preemption_phase_seconds_sum{operation="preempt",phase="gpu_released"} 0.55"#),
            "{t}"
        );
        assert!(!t.contains(r#"phase="asked""#), "{t}");
    }

    #[test]
    fn a_release_is_timed_from_the_last_removal() {
        let m = EventMetrics::new();
        let r = Released {
            pids: vec![1],
            t_last_close_ns: 1_000,
            t_released_ns: 51_000,
            confirmed_by: "syscall_return".into(),
            objects_freed: 0,
            bytes_freed: 0,
        };
        m.released(&r, 101_000);
        m.freeze_confirmed(true, 200_000);
        let t = text(&m);
        assert!(
            t.contains(
                r#"baton_release_confirm_seconds_sum{confirmed_by="syscall_return"} 0.00005"#
            ),
            "{t}"
        );
        assert!(
            t.contains(r#"baton_release_signal_seconds_sum{confirmed_by="syscall_return"} 0.0001"#),
            "{t}"
        );
        assert!(
            t.contains(r#"baton_freeze_latency_seconds_count{op="freeze"} 1"#),
            "{t}"
        );
    }
}
