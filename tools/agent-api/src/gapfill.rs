//! What `status` shows of gap-fill: the co-runners the agent parked by itself for a latency-critical
//! container behind the GPU-free gate, in the order it will resume them, and those that finished while
//! parked or during their resume; and the rate gate: per GPU, the measured cost of a preemption C, the
//! preemptions per hour over a sliding window and the co-runners' projected share `1 - rate * C / 3600`,
//! below `gap_fill_min_share` of which the agent stops filling.
use serde::{Deserialize, Serialize};

use crate::{preempt::PreemptMode, protocol::ContainerRef};

/// How much a parked co-runner's effective priority grows per second parked (the 002 seed's virtual
/// aging): a co-runner of priority 0 parked for 100 s passes one of priority 9 parked just now, so that no
/// co-runner waits forever behind higher-priority ones.
pub const AGING_PER_SECOND: f64 = 0.1;

/// A co-runner's effective priority: its base priority plus [`AGING_PER_SECOND`] per second parked.
pub fn effective_priority(priority: i32, parked_ns: u64) -> f64 {
    let secs = parked_ns as f64 / 1e9;
    f64::from(priority) + AGING_PER_SECOND * secs
}

/// The default `gap_fill_min_share`: the agent fills while the co-runners keep at least a quarter of
/// their GPU.
pub const DEFAULT_MIN_SHARE: f64 = 0.25;
/// The default `gap_fill_window`: preemptions are counted over the last hour.
pub const DEFAULT_WINDOW: std::time::Duration = std::time::Duration::from_secs(3600);

/// Gap-fill's rate gate, from the node's TOML (`gap_fill_min_share`, `gap_fill_window`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct RateGateSettings {
    /// The least projected share of its GPU the co-runners keep while the agent fills, in [0, 1].
    pub min_share: f64,
    /// The sliding window preemptions are counted over, in seconds.
    pub window_s: f64,
}

// `min_share` and `window_s` are never NaN: the shim parses them as finite numbers.
impl Eq for RateGateSettings {}

impl Default for RateGateSettings {
    fn default() -> Self {
        Self {
            min_share: DEFAULT_MIN_SHARE,
            window_s: DEFAULT_WINDOW.as_secs_f64(),
        }
    }
}

/// The co-runners' projected share of a GPU preempted `per_hour` times an hour at a cost of `c_s`
/// seconds each: `1 - per_hour * c_s / 3600`, at least 0.
pub fn projected_share(per_hour: f64, c_s: f64) -> f64 {
    (1.0 - per_hour * c_s / 3600.0).max(0.0)
}

/// One GPU's rate gate, in `status`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuGapFill {
    /// The GPU (its device file).
    pub device: String,
    /// The containers that hold it.
    #[serde(default)]
    pub holders: Vec<ContainerRef>,
    /// The containers whose Start waits for it at the GPU-free gate.
    #[serde(default)]
    pub waiters: Vec<ContainerRef>,
    /// The co-runners the agent parked from it.
    #[serde(default)]
    pub parked: Vec<ContainerRef>,
    /// C, the co-runners' time lost per preemption (its request to the co-runner running again), seconds:
    /// the mean over the window, else the last measured; `None` before the first resume.
    #[serde(default)]
    pub c_s: Option<f64>,
    /// Gap-fill preemptions of this GPU in the window, per hour.
    pub preemptions_per_hour: f64,
    /// `1 - rate * C / 3600` ([`projected_share`]); `None` while C is unknown.
    #[serde(default)]
    pub projected_share: Option<f64>,
    /// Whether the agent fills this GPU (resumes its parked co-runners when no server needs it).
    pub filling: bool,
    /// Its memory as the gate counts it: capacity, what each holder has, the room, the waiters' needs.
    #[serde(default)]
    pub room: crate::room::GpuRoom,
}

/// Gap-fill, in `status`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GapFillStatus {
    /// The co-runners the agent parked by itself, highest effective priority (the next resumed) first.
    #[serde(default)]
    pub parked: Vec<ParkedCoRunner>,
    /// The co-runners the agent is preempting now, each for the latency-critical container named.
    #[serde(default)]
    pub preempting: Vec<Preempting>,
    /// Co-runners parked by the agent that finished (their init exited) while parked or during their
    /// resume: not resumed again. The most recent last; at most [`MAX_FINISHED_SHOWN`].
    #[serde(default)]
    pub finished: Vec<FinishedCoRunner>,
    /// The rate gate's settings.
    #[serde(default)]
    pub rate_gate: RateGateSettings,
    /// Per GPU the agent preempted or that a watched container holds: the rate gate's figures.
    #[serde(default)]
    pub gpus: Vec<GpuGapFill>,
}

/// How many finished co-runners `status` keeps.
pub const MAX_FINISHED_SHOWN: usize = 16;

/// A co-runner the agent parked by itself.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ParkedCoRunner {
    /// Which container.
    #[serde(flatten)]
    pub container: ContainerRef,
    /// How it was preempted.
    pub mode: PreemptMode,
    /// Its base priority (`baton.io/priority`).
    pub priority: i32,
    /// How long it has been parked, ns.
    pub parked_ns: u64,
    /// Its priority aged by the time parked ([`effective_priority`]).
    pub effective_priority: f64,
    /// The latency-critical container it was parked for.
    pub parked_for: ContainerRef,
    /// Whether its resume is under way.
    #[serde(default)]
    pub resuming: bool,
    /// Its resumes that failed in a row: the agent waits longer before each next one (5 s, doubling, up
    /// to 10 minutes); `baton resume` tries at once.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub failed_resumes: u32,
    /// Why its last resume failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resume_error: Option<String>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// A co-runner being preempted by the agent.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Preempting {
    /// Which container.
    #[serde(flatten)]
    pub container: ContainerRef,
    /// The latency-critical container it is preempted for.
    pub parked_for: ContainerRef,
}

/// A co-runner parked by the agent that finished instead of being resumed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FinishedCoRunner {
    /// Which container.
    #[serde(flatten)]
    pub container: ContainerRef,
    /// What its exit said (`exit status 7`), or what is known of it.
    pub detail: String,
    /// CLOCK_MONOTONIC ns when the agent learnt it.
    pub t_ns: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_projected_share_is_what_the_preemptions_leave_and_never_negative() {
        assert_eq!(projected_share(0.0, 5.0), 1.0);
        assert!((projected_share(60.0, 30.0) - 0.5).abs() < 1e-9);
        assert_eq!(projected_share(3600.0, 2.0), 0.0);
    }

    #[test]
    fn aging_lets_a_long_parked_low_priority_co_runner_pass_a_fresh_high_one() {
        let fresh_high = effective_priority(9, 0);
        let old_low = effective_priority(0, 100_000_000_000);
        assert!(old_low > fresh_high, "{old_low} > {fresh_high}");
        assert!(effective_priority(1, 0) > effective_priority(0, 1_000_000_000));
    }
}
