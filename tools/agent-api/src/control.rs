//! The co-runner control messages of the agent's socket: roles, `freeze`/`thaw` (also what the agent sends a
//! shim's socket, with a lease), `duty`, the prefill shield's request events, token timing, the governor, and
//! what `status` shows of the controller.
//!
//! A request proxy keeps one connection open and writes one line per event; each line gets one reply line,
//! in order, sent as soon as the event is accepted (the freezes it causes follow on their own).
use serde::{Deserialize, Serialize};

use crate::{
    preempt::{PreemptMode, Target},
    protocol::ContainerRef,
};

/// What a container is to the controller (`baton.io/role`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Role {
    /// A server whose requests are protected; never frozen by the controller.
    LatencyCritical,
    /// Low-priority work that yields to the containers it names; the only kind the controller freezes.
    CoRunner,
}

impl Role {
    /// Its annotation value.
    pub fn label(self) -> &'static str {
        match self {
            Role::LatencyCritical => "latency-critical",
            Role::CoRunner => "co-runner",
        }
    }

    /// The role an annotation value names.
    pub fn parse(value: &str) -> Option<Self> {
        match value.trim() {
            "latency-critical" => Some(Role::LatencyCritical),
            "co-runner" => Some(Role::CoRunner),
            _ => None,
        }
    }
}

/// Whether `name`, as `baton.io/yields-to` and the request events write it (a container id, `namespace/id`, a
/// pod name or `pod-namespace/pod-name`), names container `c` of pod `pod`.
pub fn names_container(name: &str, c: &crate::ContainerRef, pod: Option<&str>) -> bool {
    name == c.id
        || name == format!("{}/{}", c.namespace, c.id)
        || pod.is_some_and(|p| name == p || p.rsplit_once('/').is_some_and(|(_, n)| n == name))
}

/// A container's role as its shim registers it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoleSpec {
    /// Latency-critical or co-runner.
    pub role: Role,
    /// A co-runner: the containers or pods it yields to (`baton.io/yields-to`, comma-separated: a container
    /// id, `namespace/id`, a pod name or `pod-namespace/pod-name`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub yields_to: Vec<String>,
    /// The pod the container belongs to (`pod-namespace/pod-name`, from CRI's annotations), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<String>,
    /// A co-runner: whether `CUDA_LAUNCH_BLOCKING=1` was put in its environment (`baton.io/launch-blocking`).
    #[serde(default)]
    pub launch_blocking: bool,
    /// A co-runner the agent may preempt by itself, and how (`baton.io/preemptible`): for a latency-critical
    /// container it yields to whose Start waits at the GPU-free gate. `None`: only an operator's `baton
    /// preempt` preempts it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preemptible: Option<PreemptMode>,
    /// A co-runner's base priority among the parked co-runners the agent resumes (`baton.io/priority`,
    /// default 0; higher first, aged while parked).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub priority: i32,
    /// A latency-critical container the agent parks after this long without a request event
    /// (`baton.io/park-when-idle`), ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub park_when_idle_ms: Option<u64>,
    /// How long its Start waits at the GPU-free gate (`baton.io/wait-gpu-free`), ms: a latency-critical
    /// container the agent idle-parked waits as long for its GPU to be handed back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub wait_gpu_free_ms: Option<u64>,
}

fn is_zero(p: &i32) -> bool {
    *p == 0
}

/// The lease a shim gives a `freeze` that carries none (ms): every freeze of a shim ends by itself unless
/// renewed. The agent's default lease (`--freeze-lease-ms`).
pub const DEFAULT_FREEZE_LEASE_MS: u64 = 2_000;
/// The longest lease a shim grants (ms); a `freeze` asking more is refused. The agent's
/// `--freeze-lease-ms` may not exceed it.
pub const MAX_FREEZE_LEASE_MS: u64 = 30_000;

/// The lease a shim grants a `freeze` that asked `lease_ms`: the default when it asked none, an error
/// above the maximum (refused rather than clamped, so that a controller renewing on its own schedule never
/// sees a freeze lapse sooner than it asked).
pub fn freeze_lease(lease_ms: Option<u64>) -> Result<std::time::Duration, String> {
    match lease_ms {
        None => Ok(std::time::Duration::from_millis(DEFAULT_FREEZE_LEASE_MS)),
        Some(0) => Err("lease_ms must be > 0".to_owned()),
        Some(ms) if ms > MAX_FREEZE_LEASE_MS => Err(format!(
            "lease_ms {ms} is above the longest lease a shim grants ({MAX_FREEZE_LEASE_MS} ms): renew \
             a shorter lease instead"
        )),
        Some(ms) => Ok(std::time::Duration::from_millis(ms)),
    }
}

/// `freeze`: freeze a container through its shim's cgroup freezer, confirmed.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FreezeRequest {
    /// Which container.
    #[serde(flatten)]
    pub target: Target,
    /// From a client: thaw by itself after this long (default: until `thaw`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hold_ms: Option<u64>,
    /// From the agent to a shim: the shim thaws the container by itself if the agent has not renewed the
    /// freeze (sent it again) within this long ([`DEFAULT_FREEZE_LEASE_MS`] when left out, at most
    /// [`MAX_FREEZE_LEASE_MS`]); a client of the agent leaves it out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_ms: Option<u64>,
    /// From the agent to a shim: only renew the hold in force; a hold that is gone (it ended for an exec, a
    /// kill, a user's pause) is not taken again, and the reply says `frozen: false` with why.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub renew: bool,
}

/// The answer to `freeze` and `thaw`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FreezerReply {
    /// Which container.
    #[serde(flatten)]
    pub container: ContainerRef,
    /// Whether its cgroup is frozen now (a thaw of a container the user paused leaves it frozen).
    pub frozen: bool,
    /// From the write to the kernel's confirmation, in ns (0 when nothing had to change).
    pub latency_ns: u64,
    /// CLOCK_MONOTONIC ns of the confirmation.
    pub t_confirmed_ns: u64,
    /// Why it stays frozen after a thaw, or a note (`"user-paused"`, `"parked"`, `"already frozen"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// Which co-runners a `duty` or `governor` concerns: one (by id) or, with no id, every co-runner.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CoRunnerSel {
    /// A co-runner's container id; `None`: every co-runner on the node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// Its namespace, when the id is ambiguous.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
}

/// `duty`: let the co-runner(s) run `run_ms` of every `window_ms` (`run_ms == window_ms`: always; clears it).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DutyRequest {
    /// Which co-runners.
    #[serde(flatten)]
    pub co_runner: CoRunnerSel,
    /// Running time per window, ms.
    pub run_ms: u64,
    /// Window, ms (> 0).
    pub window_ms: u64,
}

/// `request_start`, `first_token`, `request_end`: a served request's life, as a request proxy sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestEvent {
    /// The request's id (the proxy's own: any string unique among live requests).
    pub id: String,
    /// The latency-critical container serving it (id, `namespace/id` or pod); `None`: the node's only one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server: Option<String>,
    /// CLOCK_MONOTONIC ns when it happened; `None`: when the agent reads the line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub t_ns: Option<u64>,
}

/// `governor`: hold the co-runners' stretch of the server's inter-token gaps at or under a target.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GovernorRequest {
    /// The allowed mean stretch of a decode step (0.2: gaps at most 20% longer on average); > 0.
    pub target_stretch: f64,
    /// The window the run share applies to, ms (> 0; the seed used 200).
    #[serde(default = "default_window_ms")]
    pub window_ms: u64,
    /// Turn the governor off (the other fields are ignored).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub off: bool,
}

fn default_window_ms() -> u64 {
    200
}

/// Answer to a control request that changes the controller (events, `duty`, `governor`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Accepted {
    /// Co-runners the controller wants frozen now.
    pub frozen: usize,
    /// Requests between their start and their first token (the shield is up while this is not 0).
    pub shielded: usize,
}

/// The controller's bounds (the agent's flags).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ControlSettings {
    /// A co-runner is never frozen by the controller longer than this at a stretch (anti-starvation), ms.
    pub max_frozen_ms: u64,
    /// And over time it runs at least this share, whatever the shield and the governor ask.
    pub min_run_share: f64,
    /// With no request event or token for this long, the controller drops its open requests and thaws, ms.
    pub input_silence_ms: u64,
    /// A shim thaws a co-runner by itself when the agent has not renewed its freeze for this long, ms.
    pub lease_ms: u64,
}

/// The controller, in `status`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ControllerStatus {
    /// Its bounds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub settings: Option<ControlSettings>,
    /// Requests between start and first token.
    pub shielded: usize,
    /// Requests started and not ended.
    pub live_requests: usize,
    /// The governor, when on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub governor: Option<GovernorStatus>,
    /// The fixed duty cycle, when set: (run_ms, window_ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub duty: Option<(u64, u64)>,
    /// Times the input went silent and the controller thawed.
    pub silence_thaws: u64,
    /// The co-runners.
    pub co_runners: Vec<CoRunnerStatus>,
}

/// The governor's state.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GovernorStatus {
    /// Its target.
    pub target_stretch: f64,
    /// Its window, ms.
    pub window_ms: u64,
    /// Measured stretch of a gap while a co-runner runs (mean gap running / mean gap frozen - 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stretch: Option<f64>,
    /// The run share it gives the co-runners in windows with decoding.
    pub run_share: f64,
    /// Gaps measured with a co-runner running / with all frozen.
    pub gaps_running: u64,
    /// See `gaps_running`.
    pub gaps_frozen: u64,
    /// Mean gap with a co-runner running, ns.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mean_gap_running_ns: Option<u64>,
    /// Mean gap with every co-runner frozen, ns.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mean_gap_frozen_ns: Option<u64>,
    /// Kernel launches of the co-runners in the last window (libcuda uprobes), when counted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub launches_last_window: Option<u64>,
}

/// One co-runner, in `status`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CoRunnerStatus {
    /// Which container.
    #[serde(flatten)]
    pub container: ContainerRef,
    /// What it yields to.
    pub yields_to: Vec<String>,
    /// Whether the controller wants it frozen now, and why (`manual`, `shield`, `governor`, `duty`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frozen_for: Option<String>,
    /// Whether its shim confirmed it frozen.
    pub frozen: bool,
    /// Freezes confirmed.
    pub freezes: u64,
    /// Time spent frozen by the controller, ns.
    pub frozen_ns: u64,
    /// The longest continuous freeze, ns (bounded by `max_frozen_ms`).
    pub longest_frozen_ns: u64,
    /// Times the anti-starvation bound thawed it.
    pub starvation_thaws: u64,
    /// Its share of running time since it was registered.
    pub run_share: f64,
    /// The last confirmed freeze and thaw latencies, ns.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_freeze_ns: Option<u64>,
    /// See `last_freeze_ns`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_thaw_ns: Option<u64>,
    /// The last error from its shim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Kernel launches (libcuda uprobes): total, and in the last governor window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub launches: Option<u64>,
}

#[cfg(test)]
mod tests {
    use crate::protocol::{Request, RequestLine};

    fn parse(text: &str) -> Request {
        serde_json::from_str::<RequestLine>(text).unwrap().request
    }

    #[test]
    fn control_requests_read_as_documented() {
        let Request::RequestStart(e) = parse(r#"{"v":1,"op":"request_start","id":"r1"}"#) else {
            panic!("not a request_start");
        };
        assert_eq!((e.id.as_str(), e.server, e.t_ns), ("r1", None, None));
        let Request::Token(t) = parse(r#"{"v":1,"op":"token","id":"r1","t_ns":5}"#) else {
            panic!("not a token");
        };
        assert_eq!(t.t_ns, Some(5));
        let Request::Duty(d) = parse(r#"{"v":1,"op":"duty","run_ms":50,"window_ms":200}"#) else {
            panic!("not a duty");
        };
        assert_eq!((d.co_runner.id, d.run_ms, d.window_ms), (None, 50, 200));
        let Request::Governor(g) = parse(r#"{"v":1,"op":"governor","target_stretch":0.2}"#) else {
            panic!("not a governor");
        };
        assert_eq!((g.target_stretch, g.window_ms, g.off), (0.2, 200, false));
        let Request::Freeze(f) = parse(r#"{"v":1,"op":"freeze","id":"c1"}"#) else {
            panic!("not a freeze");
        };
        assert_eq!(
            (f.target.id.as_str(), f.hold_ms, f.lease_ms),
            ("c1", None, None)
        );
        assert!(matches!(
            parse(r#"{"v":1,"op":"thaw","id":"c1","namespace":"n"}"#),
            Request::Thaw(_)
        ));
    }

    #[test]
    fn roles_are_kebab_case() {
        assert_eq!(super::Role::parse("co-runner"), Some(super::Role::CoRunner));
        assert_eq!(
            super::Role::parse(" latency-critical "),
            Some(super::Role::LatencyCritical)
        );
        assert_eq!(super::Role::parse("batch"), None);
        assert_eq!(
            serde_json::to_string(&super::Role::LatencyCritical).unwrap(),
            "\"latency-critical\""
        );
    }
}
