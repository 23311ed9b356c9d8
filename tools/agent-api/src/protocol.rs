//! The messages of the agent's socket, one definition for the agent, the shim, the CLI and docs/api.md.
//!
//! Every line is one JSON object with `"v": PROTOCOL_VERSION`. A client writes a request line
//! (`{"v":1,"op":"ping"}`); the agent answers with one reply line (`{"v":1,"ok":true,"reply":"pong",...}`,
//! or `{"v":1,"ok":false,"reply":"error","error":"..."}`). After the reply to `watch`, the connection carries
//! event lines (`{"v":1,"event":{...}}`) until the client closes it.
use serde::{Deserialize, Serialize};

use crate::{
    control::{
        Accepted, DutyRequest, FreezeRequest, FreezerReply, GovernorRequest, RequestEvent, RoleSpec,
    },
    preempt::{GateRequest, HandoffRequest, Outcome, PreemptRequest, PreemptState, Target},
    status::{ContainerStatus, NodeStatus},
};

/// The protocol version every line carries; the agent refuses lines of another version.
pub const PROTOCOL_VERSION: u32 = 1;

/// A request, as the `op` field names it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Is the agent there?
    Ping,
    /// Watch a container's calls into the NVIDIA driver.
    Register(Box<Registration>),
    /// Stop watching a container.
    Unregister(ContainerRef),
    /// A shim's container changed its preemption state (parked, snapshotted, resumed, killed): the shim
    /// owns that state and pushes each change; only the shim that registered the container may.
    Preemption(PreemptionUpdate),
    /// The watched containers (all, or those matching the filter).
    Status(Filter),
    /// Stream events (all, or those matching the filter) after the reply.
    Watch(Filter),
    /// Stream `baton trace` output of the agent's probe set after the reply, until the client shuts down
    /// its sending side (the summary, if asked, follows; then the agent closes).
    Trace(TraceRequest),
    /// Take the GPU away from a container (park or snapshot); step lines stream until the `done` reply.
    Preempt(PreemptRequest),
    /// Give a parked container its GPU state back; step lines stream until the `done` reply.
    Resume(Target),
    /// Start a created container's program, or resume a parked one (what `handoff` does to its second
    /// container); step lines stream until the `done` reply.
    Start(Target),
    /// Preempt one container and start or resume another; step lines stream until the `done` reply.
    Handoff(HandoffRequest),
    /// Answer (`gpu_free`) once no other container holds a file of the NVIDIA devices this one sees.
    WaitGpuFree(GateRequest),
    /// Freeze a container (not a latency-critical one), confirmed; `freezer` answers.
    Freeze(FreezeRequest),
    /// Thaw a container frozen by `freeze` or by the controller; `freezer` answers.
    Thaw(Target),
    /// A fixed duty cycle for the co-runners.
    Duty(DutyRequest),
    /// A request reached the server: its co-runners are frozen until its first token (the prefill shield).
    RequestStart(RequestEvent),
    /// The request's first token.
    FirstToken(RequestEvent),
    /// The request is done.
    RequestEnd(RequestEvent),
    /// A token of the request was streamed (the governor measures the gaps).
    Token(RequestEvent),
    /// Turn the decode governor on (or off).
    Governor(GovernorRequest),
    /// A parked container is being stopped (SIGTERM from a pod deletion): should its shim resume it first,
    /// so that its way out may use CUDA? Only the shim that registered it asks; `stop_parked` answers.
    StopParked(ContainerRef),
}

/// A container's preemption state now, as its shim pushes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreemptionUpdate {
    /// Which container.
    pub container: ContainerRef,
    /// Its state (none: it runs on the GPU as usual).
    pub state: Option<PreemptState>,
}

/// What `baton trace` asks the agent to trace, and how to print it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceRequest {
    /// Container names (containerd `namespace/id`, an id, or its 12-character prefix); containers started
    /// later are picked up.
    #[serde(default)]
    pub containers: Vec<String>,
    /// cgroup v2 paths.
    #[serde(default)]
    pub cgroups: Vec<String>,
    /// Processes whose container is traced (only their calls are shown).
    #[serde(default)]
    pub pids: Vec<u32>,
    /// Every process on the node.
    #[serde(default)]
    pub all: bool,
    /// Device-directory prefixes to follow besides those followed already.
    #[serde(default)]
    pub prefixes: Vec<String>,
    /// One JSON object per event (the trace schema) instead of text lines.
    #[serde(default)]
    pub json: bool,
    /// With `json`: each ioctl's captured parameter bytes too (`params`, `nested`, hex).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub raw: bool,
    /// No live lines.
    #[serde(default)]
    pub quiet: bool,
    /// A per-container summary at the end.
    #[serde(default)]
    pub summary: bool,
    /// How often a line gives each traced container's CUDA launches since the last one (default 1000 ms).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub launch_interval_ms: Option<u64>,
}

/// One line of trace output.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceLine {
    /// [`PROTOCOL_VERSION`].
    pub v: u32,
    /// The text line or JSON object, as `baton trace` prints it.
    pub line: String,
}

/// A request line: the version and the request.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RequestLine {
    /// [`PROTOCOL_VERSION`].
    pub v: u32,
    /// The request.
    #[serde(flatten)]
    pub request: Request,
}

/// A container as containerd names it.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ContainerRef {
    /// Container id.
    pub id: String,
    /// containerd namespace (`k8s.io` under Kubernetes).
    pub namespace: String,
}

/// What a shim tells the agent about a container it created.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registration {
    /// Which container.
    #[serde(flatten)]
    pub container: ContainerRef,
    /// The container's cgroup v2 path (the `0::` line of /proc/PID/cgroup), which attributes its calls.
    pub cgroup: String,
    /// Host pid of the container's init process.
    pub init_pid: u32,
    /// The NVIDIA device files the container sees (paths inside it).
    #[serde(default)]
    pub devices: Vec<String>,
    /// The container's Baton settings that concern the agent.
    #[serde(default)]
    pub settings: WatchSettings,
    /// The shim's own socket, where the agent sends `preempt`, `resume` and `start` for this container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_socket: Option<String>,
    /// The container's preemption state, as its shim persisted it (parked across an agent restart).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preemption: Option<PreemptState>,
    /// Its role for the co-runner controller (`baton.io/role`), if it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<RoleSpec>,
    /// Its pod and name under Kubernetes, from CRI's annotations (labels of the agent's metrics); boxed,
    /// so that a `Request` stays small.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kubernetes: Option<Box<KubernetesRef>>,
    /// The video memory it needs on each GPU it sees (`baton.io/gpu-memory`), bytes; `None`: the whole GPU.
    /// The gate lets its Start through once that much is free there (see [`crate::room`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_memory: Option<u64>,
}

/// A container as Kubernetes names it (CRI's `io.kubernetes.cri.sandbox-namespace`, `sandbox-name` and
/// `container-name` annotations).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KubernetesRef {
    /// The pod's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// The pod's name.
    pub pod: String,
    /// The container's name in the pod spec.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
}

/// The annotations that name a container's pod, its namespace and the container, as containerd's CRI plugin
/// and CRI-O set them (in that order of preference).
const POD_NAME_KEYS: [&str; 2] = ["io.kubernetes.cri.sandbox-name", "io.kubernetes.pod.name"];
const POD_NAMESPACE_KEYS: [&str; 2] = [
    "io.kubernetes.cri.sandbox-namespace",
    "io.kubernetes.pod.namespace",
];
const CONTAINER_NAME_KEYS: [&str; 2] = [
    "io.kubernetes.cri.container-name",
    "io.kubernetes.container.name",
];

impl KubernetesRef {
    /// The container as Kubernetes names it, from the annotations containerd's CRI plugin or CRI-O put on
    /// it; `None` when no pod name is there (not a Kubernetes container).
    pub fn from_annotations(
        annotations: &std::collections::HashMap<String, String>,
    ) -> Option<Self> {
        let first = |keys: &[&str]| keys.iter().find_map(|k| annotations.get(*k).cloned());
        Some(Self {
            namespace: first(&POD_NAMESPACE_KEYS),
            pod: first(&POD_NAME_KEYS)?,
            container: first(&CONTAINER_NAME_KEYS),
        })
    }

    /// `namespace/pod` (or `pod` without a namespace).
    pub fn pod_path(&self) -> String {
        match &self.namespace {
            Some(ns) => format!("{ns}/{}", self.pod),
            None => self.pod.clone(),
        }
    }
}

/// The settings of a watched container.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatchSettings {
    /// Device path prefix the probes follow for this container (`/dev/nvidia`).
    pub trace_prefix: String,
    /// Gap-fill's rate gate as the node's TOML sets it, when it sets either key: node-wide, the agent
    /// takes it from the latest registration that carries it (every shim of a node reads the same TOML).
    /// Boxed, so that a `Request` stays small.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_gate: Option<Box<crate::gapfill::RateGateSettings>>,
    /// The memory the gate keeps free on each GPU (`gpu_memory_headroom`, node only), bytes, when the TOML
    /// sets it: node-wide, the latest registration that carries it wins.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_memory_headroom: Option<u64>,
    /// The least need a declared `gpu-memory` counts for at the gate (`gpu_memory_minimum`, node only),
    /// bytes, when the TOML sets it: node-wide, the latest registration that carries it wins.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu_memory_minimum: Option<u64>,
    /// What this container's park does when its memory cgroup has no room for the host copy
    /// (`park_memory`, node only): gap-fill never picks a co-runner whose park would be refused.
    #[serde(default, skip_serializing_if = "crate::ParkMemory::is_default")]
    pub park_memory: crate::ParkMemory,
    /// The node's budget for the memory limits parks raise (`parked_host_memory_budget`, node only), bytes,
    /// when the TOML sets it: node-wide, the latest registration that carries it wins.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parked_host_memory_budget: Option<u64>,
}

impl Default for WatchSettings {
    fn default() -> Self {
        Self {
            trace_prefix: "/dev/nvidia".to_owned(),
            rate_gate: None,
            gpu_memory_headroom: None,
            gpu_memory_minimum: None,
            park_memory: crate::ParkMemory::Raise,
            parked_host_memory_budget: None,
        }
    }
}

/// Which containers a `status` or `watch` concerns; empty fields match everything.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Filter {
    /// Only this container id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
    /// Only this namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Only containers registered by the process on the other end of this connection (a shim's own).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub mine: bool,
}

impl Filter {
    /// Whether `c` (registered by process `owner`) matches, asked by process `asker`.
    pub fn matches(&self, c: &ContainerRef, owner: u32, asker: u32) -> bool {
        self.container.as_ref().is_none_or(|id| *id == c.id)
            && self.namespace.as_ref().is_none_or(|ns| *ns == c.namespace)
            && (!self.mine || owner == asker)
    }
}

/// A reply line: the version, whether the request succeeded, and the reply.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReplyLine {
    /// [`PROTOCOL_VERSION`].
    pub v: u32,
    /// False exactly when `reply` is an error.
    pub ok: bool,
    /// The reply.
    #[serde(flatten)]
    pub reply: Reply,
}

impl ReplyLine {
    /// The line carrying `reply` (`ok` is false exactly for an error).
    pub fn new(reply: Reply) -> Self {
        Self {
            v: PROTOCOL_VERSION,
            ok: !matches!(reply, Reply::Error { .. }),
            reply,
        }
    }
}

/// The agent's answer, as the `reply` field names it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub enum Reply {
    /// Answer to `ping`.
    Pong(Pong),
    /// The container is watched; its state now.
    Registered {
        /// What the agent knows of it.
        container: ContainerStatus,
    },
    /// The container is no longer watched.
    Unregistered {
        /// Whether it was watched.
        found: bool,
    },
    /// Answer to `status`.
    Status(NodeStatus),
    /// Events follow on this connection.
    Watching,
    /// Trace lines follow on this connection.
    Tracing {
        /// eBPF programs of the agent's probe set (no other set was loaded).
        programs_attached: usize,
    },
    /// A `preempt`, `resume`, `start` or `handoff` completed; its steps came before as step lines.
    Done(Outcome),
    /// Answer to `freeze` and `thaw`.
    Freezer(FreezerReply),
    /// A control request (`duty`, `governor`, a request event or token) was accepted.
    Accepted(Accepted),
    /// Answer to `wait_gpu_free`: no other container holds the devices.
    GpuFree {
        /// How long the request waited, in ns.
        waited_ns: u64,
        /// CLOCK_MONOTONIC ns when the devices were found free.
        t_free_ns: u64,
    },
    /// Answer to `stop_parked`.
    StopParked {
        /// Resume it before the signal: its GPU is free for it.
        resume_first: bool,
        /// Why (`its GPU is free`, `its GPU is held by server`).
        why: String,
    },
    /// The request failed; `error` says why and what to do.
    Error {
        /// The message.
        error: String,
    },
}

/// Answer to `ping`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pong {
    /// The agent's pid.
    pub agent_pid: u32,
    /// The agent's version.
    pub version: String,
    /// Whether the probes are attached now (only while a container is watched).
    pub probes_attached: bool,
}

/// An event line.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct EventLine {
    /// [`PROTOCOL_VERSION`].
    pub v: u32,
    /// The event.
    pub event: Event,
}

/// Something that happened to a watched container.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// Increases by one per event of this agent.
    pub seq: u64,
    /// CLOCK_MONOTONIC ns when the agent emitted it.
    pub t_ns: u64,
    /// Which container.
    #[serde(flatten)]
    pub container: ContainerRef,
    /// What happened.
    #[serde(flatten)]
    pub body: EventBody,
}

/// What happened, as the `kind` field names it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum EventBody {
    /// The container is watched.
    Registered {
        /// Its cgroup v2 path.
        cgroup: String,
        /// Its init pid.
        init_pid: u32,
        /// Its processes already held NVIDIA files (read from /proc).
        partial: bool,
    },
    /// The container is no longer watched; its ledger at that moment.
    Unregistered {
        /// Live RM objects left.
        live_objects: usize,
        /// Video memory left, in bytes.
        vram_bytes: u64,
        /// Peak video memory, in bytes.
        peak_vram_bytes: u64,
    },
    /// A container that held no NVIDIA file opened one.
    Acquired(Acquired),
    /// The container's CUDA state has left the GPU.
    Released(Released),
    /// The agent could not watch the container again after reloading its probes (its registration failed):
    /// it is not watched now; its shim registers it again.
    WatchLost {
        /// Why.
        error: String,
    },
    /// NVML's view after a `released`: the cross-check, taken after that event was published, so that it
    /// never delays it. Each `released` is followed by one, sooner or later (other events may come between).
    NvmlCheck(NvmlCheck),
    /// An event of a kind this build does not know (from a newer agent): skipped, not an error.
    #[serde(other)]
    Other,
}

/// The acquired signal.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Acquired {
    /// The process that opened the file.
    pub pid: u32,
    /// CLOCK_MONOTONIC ns of the open.
    pub t_acquired_ns: u64,
}

/// The released signal.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Released {
    /// The processes that held NVIDIA files.
    pub pids: Vec<u32>,
    /// CLOCK_MONOTONIC ns when the last NVIDIA file or mapping went (the syscall or exit that dropped it).
    pub t_last_close_ns: u64,
    /// CLOCK_MONOTONIC ns when the kernel had run the final release of every file (confirmed).
    pub t_released_ns: u64,
    /// What confirmed the release.
    pub confirmed_by: String,
    /// RM objects the release freed.
    pub objects_freed: usize,
    /// Video memory the release freed, in bytes.
    pub bytes_freed: u64,
}

/// NVML's cross-check of a release (the `nvml_check` event).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvmlCheck {
    /// `seq` of the `released` event it checks.
    pub released_seq: u64,
    /// That event's `t_released_ns`.
    pub t_released_ns: u64,
    /// That event's `pids`: NVML's processes are looked for among them.
    pub pids: Vec<u32>,
    /// CLOCK_MONOTONIC ns when the agent began asking NVML (0 when it did not: `dropped`); a query still
    /// running from an earlier check is waited for first.
    pub t_asked_ns: u64,
    /// How long NVML took to answer, ns (the time bound when it did not answer within it; 0 when not asked).
    pub took_ns: u64,
    /// What NVML said, or why it said nothing.
    pub nvml: NvmlView,
}

/// NVML's answer: an object, or a string saying why there is none.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum NvmlView {
    /// What NVML listed.
    Seen(NvmlSeen),
    /// Why it listed nothing.
    Missing(NvmlMissing),
}

/// What NVML listed after a release.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvmlSeen {
    /// The compute processes NVML still lists among the released pids (none, after a real release).
    pub processes: Vec<NvmlProcess>,
    /// Each device's used memory.
    pub devices: Vec<NvmlDevice>,
}

/// A compute process NVML lists on a device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvmlProcess {
    /// NVML's device index.
    pub device: u32,
    /// Its pid.
    pub pid: u32,
    /// Device memory NVML counts for it, in bytes; `None` when NVML has no figure.
    pub used_bytes: Option<u64>,
}

/// A device as NVML reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvmlDevice {
    /// NVML's device index.
    pub device: u32,
    /// Its minor number (N of `/dev/nvidiaN`); `None` when NVML does not say.
    pub minor: Option<u32>,
    /// Its used memory, in bytes.
    pub used_bytes: u64,
}

/// Why an `nvml_check` carries no view.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NvmlMissing {
    /// No NVML on this node (no NVIDIA driver, as on the mock), or a query failed.
    Unavailable,
    /// NVML did not answer within the agent's time bound.
    TimedOut,
    /// Not asked: more releases waited for NVML than the agent keeps (the oldest go first).
    Dropped,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pod_comes_from_containerds_or_cri_os_annotations() {
        let of = |pairs: &[(&str, &str)]| {
            let a = pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect();
            KubernetesRef::from_annotations(&a)
        };
        let crio = of(&[
            ("io.kubernetes.pod.name", "llm-0"),
            ("io.kubernetes.pod.namespace", "serving"),
            ("io.kubernetes.container.name", "server"),
        ])
        .unwrap();
        assert_eq!(crio.pod_path(), "serving/llm-0");
        assert_eq!(crio.container.as_deref(), Some("server"));
        let containerd = of(&[("io.kubernetes.cri.sandbox-name", "p")]).unwrap();
        assert_eq!(
            (containerd.pod_path(), containerd.container),
            ("p".to_owned(), None)
        );
        assert_eq!(of(&[("io.kubernetes.pod.namespace", "x")]), None);
    }

    #[test]
    fn a_request_line_is_flat_json_with_version_and_op() {
        let line = RequestLine {
            v: PROTOCOL_VERSION,
            request: Request::Unregister(ContainerRef {
                id: "c1".into(),
                namespace: "default".into(),
            }),
        };
        let text = serde_json::to_string(&line).unwrap();
        assert_eq!(
            text,
            r#"{"v":1,"op":"unregister","id":"c1","namespace":"default"}"#
        );
        assert_eq!(serde_json::from_str::<RequestLine>(&text).unwrap(), line);
        let ping: RequestLine = serde_json::from_str(r#"{"v":1,"op":"ping"}"#).unwrap();
        assert_eq!(ping.request, Request::Ping);
        let watch: RequestLine =
            serde_json::from_str(r#"{"v":1,"op":"watch","container":"c1"}"#).unwrap();
        assert_eq!(
            watch.request,
            Request::Watch(Filter {
                container: Some("c1".into()),
                ..Default::default()
            })
        );
    }

    #[test]
    fn an_event_line_names_its_kind_and_container() {
        let line = EventLine {
            v: 1,
            event: Event {
                seq: 7,
                t_ns: 10,
                container: ContainerRef {
                    id: "c1".into(),
                    namespace: "ns".into(),
                },
                body: EventBody::Acquired(Acquired {
                    pid: 42,
                    t_acquired_ns: 9,
                }),
            },
        };
        let v: serde_json::Value = serde_json::to_value(&line).unwrap();
        assert_eq!(v["event"]["kind"], "acquired");
        assert_eq!(v["event"]["id"], "c1");
        assert_eq!(v["event"]["pid"], 42);
        let back: EventLine = serde_json::from_value(v).unwrap();
        assert_eq!(back, line);
    }

    #[test]
    fn an_nvml_check_carries_nvmls_view_or_why_there_is_none() {
        let check = |nvml| NvmlCheck {
            released_seq: 3,
            t_released_ns: 35_643_870_635,
            pids: vec![444],
            t_asked_ns: 35_643_900_000,
            took_ns: 6_700_000,
            nvml,
        };
        // What NVML said after a release on the H200 (/work/shared/gpu/580.159.04/report.json,
        // trace.released.nvml): a device with no memory used, no process left.
        let seen = check(NvmlView::Seen(NvmlSeen {
            processes: vec![],
            devices: vec![NvmlDevice {
                device: 0,
                minor: Some(0),
                used_bytes: 0,
            }],
        }));
        let v = serde_json::to_value(EventBody::NvmlCheck(seen.clone())).unwrap();
        assert_eq!(v["kind"], "nvml_check");
        assert_eq!(v["released_seq"], 3);
        assert_eq!(
            v["nvml"],
            serde_json::json!({"processes": [], "devices": [{"device": 0, "minor": 0, "used_bytes": 0}]})
        );
        assert_eq!(
            serde_json::from_value::<EventBody>(v).unwrap(),
            EventBody::NvmlCheck(seen)
        );
        let dropped = check(NvmlView::Missing(NvmlMissing::Dropped));
        let v = serde_json::to_value(EventBody::NvmlCheck(dropped.clone())).unwrap();
        assert_eq!(v["nvml"], "dropped");
        assert_eq!(
            serde_json::from_value::<EventBody>(v).unwrap(),
            EventBody::NvmlCheck(dropped)
        );
    }

    #[test]
    fn an_event_of_a_kind_this_build_does_not_know_is_read_as_other() {
        let line =
            r#"{"v":1,"event":{"seq":9,"t_ns":1,"id":"c","namespace":"n","kind":"later","x":1}}"#;
        let e: EventLine = serde_json::from_str(line).unwrap();
        assert_eq!(e.event.body, EventBody::Other);
        assert_eq!(e.event.seq, 9);
    }

    #[test]
    fn a_filter_matches_by_id_namespace_and_owner() {
        let c = ContainerRef {
            id: "a".into(),
            namespace: "n".into(),
        };
        assert!(Filter::default().matches(&c, 1, 2));
        let mine = Filter {
            mine: true,
            ..Default::default()
        };
        assert!(mine.matches(&c, 5, 5));
        assert!(!mine.matches(&c, 5, 6));
        let other = Filter {
            container: Some("b".into()),
            ..Default::default()
        };
        assert!(!other.matches(&c, 1, 1));
    }
}
