//! The preemption messages of the agent's socket (and of a shim's socket, which the agent forwards them to):
//! `preempt`, `resume`, `start`, `handoff` and `wait_gpu_free`, the step lines a preemption streams while it
//! runs, and the state a parked container shows in `status`.
use serde::{Deserialize, Serialize};

use crate::protocol::ContainerRef;

/// A container as a user names it: its id as containerd shows it, and the namespace only when the id is
/// ambiguous.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Target {
    /// Container id.
    pub id: String,
    /// containerd namespace; `None`: whichever namespace has a container of that id (an error if several).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
}

impl Target {
    /// The target naming exactly `c`.
    pub fn exact(c: &ContainerRef) -> Self {
        Self {
            id: c.id.clone(),
            namespace: Some(c.namespace.clone()),
        }
    }
}

/// How a container gives up the GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PreemptMode {
    /// cuda-checkpoint every CUDA process into host memory, then freeze the cgroup (resume: thaw, restore,
    /// unlock).
    #[default]
    Park,
    /// As park up to the release, then `runc checkpoint` (CRIU) of the whole container.
    Snapshot,
}

impl PreemptMode {
    /// Its name on the command line and in JSON.
    pub fn label(self) -> &'static str {
        match self {
            PreemptMode::Park => "park",
            PreemptMode::Snapshot => "snapshot",
        }
    }

    /// The mode a label names (surrounding blanks allowed), as [`PreemptMode::label`] writes it.
    pub fn parse(text: &str) -> Option<Self> {
        [PreemptMode::Park, PreemptMode::Snapshot]
            .into_iter()
            .find(|m| m.label() == text.trim())
    }
}

/// `preempt`: take the GPU away from a container.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreemptRequest {
    /// Which container.
    #[serde(flatten)]
    pub target: Target,
    /// Park (default) or snapshot.
    #[serde(default)]
    pub mode: PreemptMode,
    /// The CUDA processes (host pids). The agent fills them from its ledger (the processes that hold
    /// NVIDIA files) before it forwards the request to the container's shim; a client leaves them empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pids: Vec<u32>,
    /// Snapshot only: where the checkpoint image goes, an absolute path (a relative one is refused: the shim
    /// writes it, from a working directory the client does not know). Default:
    /// `<snapshot_dir>/<namespace>/<id>`, with the node's `snapshot_dir` ([`DEFAULT_SNAPSHOT_DIR`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_path: Option<String>,
    /// Gap-fill: the agent preempts the container by itself for this latency-critical container; the shim
    /// keeps it in the container's state, so that an agent restarted meanwhile resumes it still. The agent
    /// drops it from a client's request (what an operator preempts, an operator resumes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parked_for: Option<ContainerRef>,
    /// Idle park: the agent parks a latency-critical container by itself after its `park-when-idle`; the
    /// shim keeps it in the container's state, so that an agent restarted meanwhile hands its GPU back on the
    /// next request still. The agent drops it from a client's request.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub idle_park: bool,
    /// The container's device memory in the agent's ledger, bytes: what the checkpoint copies into host
    /// memory charged to the container's memory cgroup (the shim makes room for it, or refuses). The agent
    /// fills it before it forwards the request to the container's shim; a client leaves it out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vram_bytes: Option<u64>,
    /// What the node's budget for parked host memory has left for raising this container's memory limit,
    /// bytes (the budget less what other parked containers' limits were raised by). The agent, which keeps
    /// the budget, fills it before it forwards the request; a client leaves it out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_budget_left_bytes: Option<u64>,
    /// Park again: the container is parked and acquired GPU state meanwhile (a fresh CUDA process in a
    /// container parked without freezing); its shim parks the processes of `pids` that run CUDA now beside
    /// the parked ones, or freezes the container when none can be. Only the agent asks it; it drops it
    /// from a client's request.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub again: bool,
}

/// Where snapshot images go when neither the request nor the node's `snapshot_dir` names a place: on disk,
/// not in the bundle (tmpfs, deleted with the task).
pub const DEFAULT_SNAPSHOT_DIR: &str = "/var/lib/baton/snapshots";

/// Checks a snapshot's `image_path`: an absolute path, else an error that says so.
pub fn check_image_path(path: &str) -> Result<(), String> {
    if std::path::Path::new(path).is_absolute() {
        Ok(())
    } else {
        Err(format!(
            "image path {path:?} is relative: give an absolute path (the shim writes the image, and a \
             relative path would be resolved against its working directory, not yours)"
        ))
    }
}

/// When `handoff` starts the second container.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HandoffOrder {
    /// As soon as the first container's GPU state has left the GPU (the release signal).
    #[default]
    Overlapped,
    /// Once the first container's preemption has completed (frozen or dumped).
    Sequential,
}

impl HandoffOrder {
    /// Its name on the command line and in JSON.
    pub fn label(self) -> &'static str {
        match self {
            HandoffOrder::Overlapped => "overlapped",
            HandoffOrder::Sequential => "sequential",
        }
    }
}

/// `handoff`: preempt `from`, and start (a created task) or resume (a parked one) `to`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HandoffRequest {
    /// The container that gives the GPU up.
    pub from: Target,
    /// The container that gets it.
    pub to: Target,
    /// How `from` gives it up.
    #[serde(default)]
    pub mode: PreemptMode,
    /// When `to` starts.
    #[serde(default)]
    pub order: HandoffOrder,
}

/// `wait_gpu_free`: a shim's Start of a container with `baton.io/wait-gpu-free` waits until no other
/// container holds a file of the NVIDIA devices it sees.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GateRequest {
    /// The container about to start (registered already).
    #[serde(flatten)]
    pub container: ContainerRef,
    /// How long to wait, in milliseconds.
    pub timeout_ms: u64,
}

/// A phase of a preemption, a resume or a handoff.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// The request arrived.
    Asked,
    /// Every CUDA process is locked (no new CUDA call runs).
    Locked,
    /// The checkpoints (device memory to host memory) began.
    CheckpointStarted,
    /// One process's checkpoint finished (`pid`); it holds no NVIDIA file any more.
    Checkpointed,
    /// The container's CUDA state has left the GPU (the agent's release signal).
    GpuReleased,
    /// The cgroup is frozen.
    Frozen,
    /// `runc checkpoint` (CRIU) has written the container's image.
    Dumped,
    /// The cgroup is thawed.
    Thawed,
    /// One process's CUDA state is back on the GPU (`pid`).
    Restored,
    /// Every CUDA process is unlocked and runs again.
    Unlocked,
    /// A created container's program was started.
    Started,
    /// The container opened an NVIDIA file (the agent's acquired signal).
    GpuAcquired,
    /// A step failed and what was done is being undone (`detail` says what failed).
    RollingBack,
    /// A process exited during the operation (`pid`, `detail` has its exit status).
    Finished,
    /// A resume could not give this process (`pid`) its GPU back (`detail` says why): it stays parked, and
    /// a second resume retries it.
    StillParked,
    /// The operation is complete.
    Done,
}

impl Phase {
    /// Its name in the timeline.
    pub fn label(self) -> &'static str {
        match self {
            Phase::Asked => "asked",
            Phase::Locked => "locked",
            Phase::CheckpointStarted => "checkpoint started",
            Phase::Checkpointed => "checkpointed",
            Phase::GpuReleased => "GPU released",
            Phase::Frozen => "frozen",
            Phase::Dumped => "dumped",
            Phase::Thawed => "thawed",
            Phase::Restored => "restored",
            Phase::Unlocked => "unlocked",
            Phase::Started => "started",
            Phase::GpuAcquired => "GPU acquired",
            Phase::RollingBack => "rolling back",
            Phase::Finished => "finished",
            Phase::StillParked => "still parked",
            Phase::Done => "done",
        }
    }
}

/// One step of a timeline.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Step {
    /// CLOCK_MONOTONIC ns when it happened.
    pub t_ns: u64,
    /// Which container.
    #[serde(flatten)]
    pub container: ContainerRef,
    /// What happened.
    pub phase: Phase,
    /// The process it concerns, if one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    /// More about it (an error, an exit status, what confirmed a release).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub detail: String,
    /// On a `checkpointed` step, the shim's word: the container's processes that the driver answered having
    /// no CUDA state for (CUDA_ERROR_NOT_INITIALIZED: a worker forked after CUDA init), left alone by the
    /// park. With the process checkpointed (`pid`), they hold no CUDA state now (see the agent's
    /// `registry::shims_word`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub no_cuda_state: Vec<u32>,
}

/// A step line, streamed before the reply of `preempt`, `resume`, `start` and `handoff`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepLine {
    /// [`crate::PROTOCOL_VERSION`].
    pub v: u32,
    /// The step.
    pub step: Step,
}

/// Where a preempted container is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PreemptPhase {
    /// Being preempted.
    Preempting,
    /// Parked: checkpointed into host memory, and frozen unless `unfrozen`.
    Parked,
    /// Being resumed.
    Resuming,
    /// Its image was dumped (snapshot) and it was stopped.
    Snapshotted,
}

/// The preemption state of a container (persisted by its shim in the bundle).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreemptState {
    /// Where it is.
    pub state: PreemptPhase,
    /// How it was preempted.
    pub mode: PreemptMode,
    /// Its CUDA processes (host pids).
    pub pids: Vec<u32>,
    /// CLOCK_MONOTONIC ns of the state's start.
    pub since_ns: u64,
    /// Snapshot: the image directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_path: Option<String>,
    /// Gap-fill: the latency-critical container the agent preempted it for by itself (the agent resumes it
    /// when no such container needs its GPU any more, after a restart of the agent too).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parked_for: Option<ContainerRef>,
    /// Idle park: the agent parked this latency-critical container for its idleness (a request for it hands
    /// the GPU back, after a restart of the agent too).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub idle_park: bool,
    /// The host memory its park charged to its memory cgroup (the device memory copied, as the agent's
    /// ledger counted it), bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_copy_bytes: Option<u64>,
    /// The memory limit the park raised to make room for that copy, put back at the resume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub raised_limit: Option<crate::RaisedLimit>,
    /// Parked without freezing (`baton.io/park-freeze: "false"`, or an idle park): its CPU threads run (a
    /// liveness probe is answered), its CUDA calls wait for the resume.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unfrozen: bool,
    /// The processes the preemption named that the driver answered having no CUDA state for (a worker
    /// forked after CUDA init): left alone, never checkpointed (host pids).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub no_cuda_state: Vec<u32>,
}

/// What a `preempt`, `resume`, `start` or `handoff` did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Outcome {
    /// The container it concerned (the preempted one for a handoff).
    #[serde(flatten)]
    pub container: ContainerRef,
    /// Its preemption state after it (`None`: running, or gone).
    #[serde(default)]
    pub preemption: Option<PreemptState>,
    /// Every step, in order.
    pub steps: Vec<Step>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{Request, RequestLine};

    #[test]
    fn a_preempt_request_names_the_container_flat() {
        let line: RequestLine =
            serde_json::from_str(r#"{"v":1,"op":"preempt","id":"trainer","mode":"park"}"#).unwrap();
        assert_eq!(
            line.request,
            Request::Preempt(PreemptRequest {
                target: Target {
                    id: "trainer".into(),
                    namespace: None
                },
                mode: PreemptMode::Park,
                pids: vec![],
                image_path: None,
                parked_for: None,
                idle_park: false,
                vram_bytes: None,
                host_budget_left_bytes: None,
                again: false,
            })
        );
        let handoff: RequestLine = serde_json::from_str(
            r#"{"v":1,"op":"handoff","from":{"id":"a"},"to":{"id":"b","namespace":"n"},"order":"sequential"}"#,
        )
        .unwrap();
        let Request::Handoff(h) = handoff.request else {
            panic!("not a handoff")
        };
        assert_eq!(h.order, HandoffOrder::Sequential);
        assert_eq!(h.mode, PreemptMode::Park);
        assert_eq!(h.to.namespace.as_deref(), Some("n"));
    }

    #[test]
    fn a_step_line_is_flat() {
        let step = Step {
            t_ns: 5,
            container: ContainerRef {
                id: "a".into(),
                namespace: "n".into(),
            },
            phase: Phase::GpuReleased,
            pid: None,
            detail: String::new(),
            no_cuda_state: Vec::new(),
        };
        let text = serde_json::to_string(&StepLine { v: 1, step }).unwrap();
        assert_eq!(
            text,
            r#"{"v":1,"step":{"t_ns":5,"id":"a","namespace":"n","phase":"gpu_released"}}"#
        );
    }
}
