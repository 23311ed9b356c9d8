//! Gap-fill's rate gate: per GPU, the agent measures C, the co-runners' time lost per preemption (from the
//! agent's preemption request to the co-runner running again after its resume), and counts its gap-fill
//! preemptions of that GPU over a sliding window (`gap_fill_window`, default 1 h). The co-runners' projected
//! share of the GPU is `1 - rate * C / 3600` (rate per hour, C in seconds: the 000 seed's line, within 1.7
//! points of its measured shares). While it is below `gap_fill_min_share` (default 0.25) the agent stops
//! filling that GPU: the co-runners it parked stay parked when the server goes. It fills again once enough
//! preemptions have left the window.
//!
//! C is the mean over the resumes whose preemption is in the window, else the last one measured (a property
//! of the co-runners and the GPU, not of the rate); before the first resume it is unknown, and the agent
//! fills. A preemption counts once per server arrival, however many co-runners it parks.
//!
//! The window outlives the agent's process: it is written through to a file the next agent reads
//! (`rate_store.rs`).
use std::collections::{BTreeSet, VecDeque};

use baton_agent_api::{
    ContainerRef, GapFillStatus, GpuGapFill, RateGateSettings, gapfill::projected_share,
};
use tokio::time::Instant;

use super::rate_store::{SavedGpu, Store};
use crate::{
    core::{Core, Note, NoteKind},
    gate,
    gate::DeviceKey,
};
use baton_tracer::now_monotonic_ns;

/// One GPU's preemptions and costs.
struct Gpu {
    key: DeviceKey,
    /// When the agent asked for each gap-fill preemption in the window (CLOCK_MONOTONIC ns), oldest first.
    preemptions: VecDeque<u64>,
    /// (request ns, C ns) of the resumes whose preemption is in the window, oldest request first.
    costs: VecDeque<(u64, u64)>,
    /// The last C measured, whatever its age.
    last_c_ns: Option<u64>,
    /// Whether the agent filled it when the traces were last told ([`RateGate::changes`]).
    told_filling: bool,
}

/// What the rate gate says of one GPU now.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Figures {
    /// C, seconds; `None` before the first resume.
    pub c_s: Option<f64>,
    /// Preemptions in the window, per hour.
    pub per_hour: f64,
    /// The projected share; `None` while C is unknown.
    pub share: Option<f64>,
    /// Whether the agent fills this GPU.
    pub filling: bool,
}

/// The rate gate of every GPU the agent preempted co-runners from.
#[derive(Default)]
pub struct RateGate {
    settings: RateGateSettings,
    gpus: Vec<Gpu>,
    /// Where the window is written through to (none in unit tests).
    store: Option<Store>,
}

impl RateGate {
    /// Takes the node's settings (from a shim's registration).
    pub fn set(&mut self, settings: RateGateSettings) {
        if settings == self.settings {
            return;
        }
        tracing::info!(
            min_share = settings.min_share,
            window_s = settings.window_s,
            "agent: gap-fill: rate gate settings"
        );
        self.settings = settings;
        self.save();
    }

    /// Writes the window through to the file at `path` from now on, after taking up what an earlier agent of
    /// this boot wrote there.
    pub fn persist_at(&mut self, path: &std::path::Path) {
        let store = Store::at(path);
        let window = store.load(now_monotonic_ns());
        if let Some(settings) = window.settings {
            self.settings = settings;
        }
        for saved in window.gpus {
            let g = self.gpu_mut(&saved.key);
            g.preemptions = saved.preemptions.into();
            g.costs = saved.costs.into();
            g.last_c_ns = saved.last_c_ns;
        }
        self.store = Some(store);
    }

    /// Writes the window through to the store, if there is one.
    fn save(&mut self) {
        let Some(store) = self.store.as_mut() else {
            return;
        };
        let gpus = self
            .gpus
            .iter()
            .map(|g| SavedGpu {
                key: g.key.clone(),
                preemptions: g.preemptions.iter().copied().collect(),
                costs: g.costs.iter().copied().collect(),
                last_c_ns: g.last_c_ns,
            })
            .collect();
        store.save(self.settings, gpus);
    }

    /// The settings in force.
    pub fn settings(&self) -> RateGateSettings {
        self.settings
    }

    fn window_ns(&self) -> u64 {
        (self.settings.window_s * 1e9) as u64
    }

    fn gpu_mut(&mut self, key: &DeviceKey) -> &mut Gpu {
        let i = match self.gpus.iter().position(|g| g.key.same_device(key)) {
            Some(i) => i,
            None => {
                self.gpus.push(Gpu {
                    key: key.clone(),
                    preemptions: VecDeque::new(),
                    costs: VecDeque::new(),
                    last_c_ns: None,
                    told_filling: true,
                });
                self.gpus.len() - 1
            }
        };
        &mut self.gpus[i]
    }

    /// The agent asked, at `t_ns`, to preempt the co-runners of `devices` for a server.
    pub fn preempted(&mut self, devices: &BTreeSet<DeviceKey>, t_ns: u64) {
        for d in devices {
            self.gpu_mut(d).preemptions.push_back(t_ns);
        }
        self.save();
    }

    /// A co-runner of `devices` whose preemption was asked at `requested_ns` runs again at `now_ns`.
    pub fn resumed(&mut self, devices: &BTreeSet<DeviceKey>, requested_ns: u64, now_ns: u64) {
        let c = now_ns.saturating_sub(requested_ns);
        for d in devices {
            let g = self.gpu_mut(d);
            g.costs.push_back((requested_ns, c));
            g.last_c_ns = Some(c);
        }
        self.save();
    }

    /// Drops what left the window.
    pub fn expire(&mut self, now_ns: u64) {
        let since = now_ns.saturating_sub(self.window_ns());
        let mut dropped = false;
        for g in &mut self.gpus {
            while g.preemptions.front().is_some_and(|t| *t < since) {
                g.preemptions.pop_front();
                dropped = true;
            }
            let before = g.costs.len();
            g.costs.retain(|(t, _)| *t >= since);
            dropped |= g.costs.len() != before;
        }
        if dropped {
            self.save();
        }
    }

    fn figures_of(&self, g: &Gpu, now_ns: u64) -> Figures {
        let since = now_ns.saturating_sub(self.window_ns());
        let count = g.preemptions.iter().filter(|t| **t >= since).count();
        let per_hour = count as f64 * 3600.0 / self.settings.window_s;
        let recent: Vec<u64> = g
            .costs
            .iter()
            .filter(|(t, _)| *t >= since)
            .map(|(_, c)| *c)
            .collect();
        let c_ns = if recent.is_empty() {
            g.last_c_ns.map(|c| c as f64)
        } else {
            Some(recent.iter().map(|c| *c as f64).sum::<f64>() / recent.len() as f64)
        };
        let c_s = c_ns.map(|c| c / 1e9);
        let share = c_s.map(|c| projected_share(per_hour, c));
        Figures {
            c_s,
            per_hour,
            share,
            filling: share.is_none_or(|s| s >= self.settings.min_share),
        }
    }

    /// The figures of the GPU `key` names (no preemption yet: rate 0, C unknown, filling).
    pub fn figures(&self, key: &DeviceKey, now_ns: u64) -> Figures {
        match self.gpus.iter().find(|g| g.key.same_device(key)) {
            Some(g) => self.figures_of(g, now_ns),
            None => Figures {
                c_s: None,
                per_hour: 0.0,
                share: None,
                filling: true,
            },
        }
    }

    /// Whether the agent fills `devices` (every GPU when empty: devices not resolved share every GPU).
    pub fn filling(&self, devices: &BTreeSet<DeviceKey>, now_ns: u64) -> bool {
        self.gpus
            .iter()
            .filter(|g| devices.is_empty() || devices.iter().any(|d| d.same_device(&g.key)))
            .all(|g| self.figures_of(g, now_ns).filling)
    }

    /// The GPUs whose filling changed since the last call, with their figures now.
    pub fn changes(&mut self, now_ns: u64) -> Vec<(DeviceKey, Figures)> {
        let figures: Vec<Figures> = self
            .gpus
            .iter()
            .map(|g| self.figures_of(g, now_ns))
            .collect();
        let mut changed = Vec::new();
        for (g, f) in self.gpus.iter_mut().zip(figures) {
            if g.told_filling != f.filling {
                g.told_filling = f.filling;
                changed.push((g.key.clone(), f));
            }
        }
        changed
    }

    /// What a trace says of GPU `key`'s `f`: the rule with its figures.
    pub fn explain(&self, key: &DeviceKey, f: &Figures) -> String {
        let min = self.settings.min_share;
        match (f.c_s, f.share) {
            (Some(c), Some(share)) => format!(
                "{key}: 1 - {:.0}/h * {c:.2} s / 3600 = {share:.2} {} {min}",
                f.per_hour,
                if f.filling { ">=" } else { "<" }
            ),
            _ => format!("{key}: C not measured yet"),
        }
    }

    /// The GPUs the rate gate knows.
    pub fn keys(&self) -> impl Iterator<Item = &DeviceKey> {
        self.gpus.iter().map(|g| &g.key)
    }

    /// When the first GPU that is not filling sees its oldest preemption leave the window (it may fill
    /// again then).
    pub fn next_change(&self, now_ns: u64) -> Option<Instant> {
        let window = self.window_ns();
        self.gpus
            .iter()
            .filter(|g| !self.figures_of(g, now_ns).filling)
            .filter_map(|g| g.preemptions.front())
            .map(|t| (t + window).saturating_sub(now_ns) + 1)
            .min()
            .map(|ns| Instant::now() + std::time::Duration::from_nanos(ns))
    }
}

/// The containers among `all` (each with its devices) that have `key`.
fn on(key: &DeviceKey, all: &[(ContainerRef, BTreeSet<DeviceKey>)]) -> Vec<ContainerRef> {
    all.iter()
        .filter(|(_, d)| d.iter().any(|k| k.same_device(key)))
        .map(|(c, _)| c.clone())
        .collect()
}

/// Adds `key` to `gpus` unless a key of the same device is there.
fn add_gpu(gpus: &mut Vec<DeviceKey>, key: &DeviceKey) {
    if !gpus.iter().any(|g| g.same_device(key)) {
        gpus.push(key.clone());
    }
}

/// Gap-fill's part of `status` and of the metrics: the parked co-runners, and per GPU its holders, waiters,
/// parked co-runners and the rate gate's figures.
impl Core {
    /// [`GapFillStatus`], with a row per GPU that the rate gate knows or a watched container holds or
    /// waits for.
    pub(crate) fn gap_fill_status(&self) -> GapFillStatus {
        let now = now_monotonic_ns();
        let [holders, waiters, parked] = self.gap_fill_devices();
        let mut gpus = Vec::new();
        let listed = [&holders, &waiters, &parked];
        let keys = self.gapfill.rate.keys().chain(
            listed
                .iter()
                .flat_map(|l| l.iter().flat_map(|(_, d)| d.iter())),
        );
        for k in keys {
            add_gpu(&mut gpus, k);
        }
        let mut status = self.gapfill.status();
        status.gpus = gpus
            .iter()
            .map(|k| {
                let f = self.gapfill.rate.figures(k, now);
                GpuGapFill {
                    device: k.to_string(),
                    holders: on(k, &holders),
                    waiters: on(k, &waiters),
                    parked: on(k, &parked),
                    c_s: f.c_s,
                    preemptions_per_hour: f.per_hour,
                    projected_share: f.share,
                    filling: f.filling,
                    room: self.room_status(k),
                }
            })
            .collect();
        status
    }

    /// Tells the traces of the containers on each GPU whose filling changed (`+++ gap_fill: off (...) +++`).
    pub(crate) fn show_rate_gate_changes(&mut self) {
        let now = now_monotonic_ns();
        let changes = self.gapfill.rate.changes(now);
        if changes.is_empty() {
            return;
        }
        let lists = self.gap_fill_devices();
        for (key, f) in changes {
            let detail = self.gapfill.rate.explain(&key, &f);
            tracing::info!(device = %key, filling = f.filling, "agent: gap-fill: rate gate: {detail}");
            let mut told = Vec::new();
            for c in lists.iter().flat_map(|l| on(&key, l)) {
                if !told.contains(&c) {
                    self.note(&Note {
                        container: c.clone(),
                        t_ns: now,
                        kind: NoteKind::GapFill {
                            filling: f.filling,
                            detail: detail.clone(),
                        },
                    });
                    told.push(c);
                }
            }
        }
    }

    /// The watched containers with the devices each holds, the waiters with theirs, the parked co-runners with
    /// theirs.
    fn gap_fill_devices(&self) -> [Vec<(ContainerRef, BTreeSet<DeviceKey>)>; 3] {
        let holders: Vec<(ContainerRef, BTreeSet<DeviceKey>)> = match self.tracer.as_ref() {
            Some(t) => self
                .watched
                .iter()
                .map(|(c, w)| (c.clone(), gate::devices_holding(t, w)))
                .collect(),
            None => Vec::new(),
        };
        let waiters: Vec<(ContainerRef, BTreeSet<DeviceKey>)> = self
            .waiters
            .iter()
            .map(|w| (w.container.clone(), w.devices.clone()))
            .collect();
        let parked: Vec<(ContainerRef, BTreeSet<DeviceKey>)> = self
            .gapfill
            .parked_devices()
            .map(|(c, d)| (c.clone(), d.clone()))
            .collect();
        [holders, waiters, parked]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: u64 = 1_000_000_000;

    fn gpu(n: u64) -> BTreeSet<DeviceKey> {
        [DeviceKey::Number(195, n)].into()
    }

    fn gate(min_share: f64, window_s: f64) -> RateGate {
        let mut g = RateGate::default();
        g.set(RateGateSettings {
            min_share,
            window_s,
        });
        g
    }

    #[test]
    fn without_a_measured_cost_the_agent_fills_and_c_is_the_mean_over_the_window() {
        let mut g = gate(0.5, 3600.0);
        let t0 = 10_000 * S;
        g.preempted(&gpu(0), t0);
        let f = g.figures(&DeviceKey::Number(195, 0), t0);
        assert_eq!(
            (f.c_s, f.per_hour, f.share, f.filling),
            (None, 1.0, None, true)
        );
        g.resumed(&gpu(0), t0, t0 + 10 * S);
        g.preempted(&gpu(0), t0 + 20 * S);
        g.resumed(&gpu(0), t0 + 20 * S, t0 + 50 * S);
        let f = g.figures(&DeviceKey::Number(195, 0), t0 + 60 * S);
        assert_eq!(f.c_s, Some(20.0), "(10 + 30) / 2");
        assert_eq!(f.per_hour, 2.0);
        assert!((f.share.unwrap() - (1.0 - 40.0 / 3600.0)).abs() < 1e-9);
        assert!(f.filling);
        assert!(g.filling(&gpu(1), t0), "another GPU is not concerned");
    }

    #[test]
    fn filling_stops_below_the_least_share_and_restarts_once_the_preemptions_left_the_window() {
        // A 10 s window: 3 preemptions of 2 s each leave 1 - 3 * 2 / 10 = 0.4 < 0.5.
        let mut g = gate(0.5, 10.0);
        let t0 = 10_000 * S;
        for i in 0..3 {
            let t = t0 + i * 2 * S;
            g.preempted(&gpu(0), t);
            g.resumed(&gpu(0), t, t + 2 * S);
        }
        let now = t0 + 6 * S;
        let f = g.figures(&DeviceKey::Number(195, 0), now);
        assert_eq!(f.per_hour, 3.0 * 360.0);
        assert!((f.share.unwrap() - 0.4).abs() < 1e-9, "{f:?}");
        assert!(!f.filling && !g.filling(&gpu(0), now));
        let told = g.changes(now);
        assert_eq!(told.len(), 1, "the traces are told once: {told:?}");
        assert_eq!(
            g.explain(&told[0].0, &told[0].1),
            format!("{}: 1 - 1080/h * 2.00 s / 3600 = 0.40 < 0.5", told[0].0)
        );
        assert!(g.changes(now).is_empty(), "and not again");
        assert!(
            !g.filling(&BTreeSet::new(), now),
            "unresolved devices: any GPU"
        );
        assert!(
            g.next_change(now).is_some(),
            "a wake-up when the oldest leaves"
        );
        // The first preemption leaves the window at t0 + 10 s: 2 left, 1 - 2 * 2 / 10 = 0.6.
        let later = t0 + 10 * S + 1;
        g.expire(later);
        assert!(g.filling(&gpu(0), later));
        let told = g.changes(later);
        assert!(
            told.len() == 1 && told[0].1.filling,
            "filling again: {told:?}"
        );
        assert_eq!(g.next_change(later), None);
        // Long after: no preemption in the window, C the last measured.
        let f = g.figures(&DeviceKey::Number(195, 0), t0 + 3600 * S);
        assert_eq!((f.per_hour, f.c_s, f.share), (0.0, Some(2.0), Some(1.0)));
    }

    #[test]
    fn a_closed_gate_stays_closed_for_the_next_agent_of_the_node() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("rate-gate.json");
        let mut g = gate(0.99, 60.0);
        g.persist_at(&path);
        let now = now_monotonic_ns();
        let t = now.saturating_sub(5 * S);
        g.preempted(&gpu(0), t);
        g.resumed(&gpu(0), t, t + 2 * S);
        let key = DeviceKey::Number(195, 0);
        let before = g.figures(&key, now);
        assert!(!before.filling, "1 - 60/h * 2 s / 3600 < 0.99: {before:?}");

        // The agent restarts: the next one has not heard the node's settings yet.
        let mut next = RateGate::default();
        next.persist_at(&path);
        assert_eq!(next.figures(&key, now), before);
        assert_eq!(next.settings().min_share, 0.99);
        assert!(!next.filling(&gpu(0), now));
    }
}
