//! What goes into the core: the commands the connections (and the agent's own tasks) send it, the notes
//! its trace sessions show, and the answer to a `resolve`.
use baton_agent_api::{ContainerRef, GateRequest, PreemptState, Reply, Target, TraceRequest};
use tokio::sync::{mpsc, oneshot};

use crate::metrics::snapshot::Snapshot;

/// What a connection asks of the core.
pub enum What {
    /// A request of the protocol (not `trace`, which comes as `Trace`).
    Request(baton_agent_api::Request),
    /// Start trace session `session`, whose lines go to `lines`.
    Trace {
        /// The connection's session number.
        session: u64,
        /// What to trace.
        request: TraceRequest,
        /// Where its lines go.
        lines: mpsc::Sender<String>,
    },
    /// The client ended trace session `session`.
    EndTrace(u64),
    /// A connection of process `pid` ended (a shim that exited, or was killed, ends both of its own).
    PeerGone(u32),
    /// A Start waits for a free GPU: the reply comes when the devices are free, or at the deadline.
    Gate(GateRequest),
    /// A request proxy's `request_start` (`start`) or `request_end` for `server` (gap-fill's idle park).
    RequestSeen {
        /// The server as the proxy named it; `None`: the node's only one.
        server: Option<String>,
        /// `request_start`.
        start: bool,
    },
    /// Which watched container a user means, its shim's socket and its CUDA processes.
    Resolve {
        /// As the user named it.
        target: Target,
        /// The answer.
        answer: oneshot::Sender<Result<Resolved, String>>,
    },
    /// Kernel launches (libcuda uprobes) counted so far per watched container.
    Launches(oneshot::Sender<Vec<(ContainerRef, u64)>>),
    /// A freeze, thaw or preemption step of a container, for the trace sessions that trace it.
    Note(Note),
    /// What the metrics endpoint shows ([`crate::metrics`]).
    Metrics(oneshot::Sender<Snapshot>),
    /// Whether the connection's peer may ask anything: a process inside a watched container may not.
    CheckPeer(oneshot::Sender<Result<(), String>>),
    /// NVML's cross-check of a release, to publish (`nvml_check`).
    NvmlChecked(Box<crate::nvml::Checked>),
    /// NVML's answer to which processes use a GPU, asked at `asked_ns` (`None`: NVML cannot tell).
    GpuUsers {
        /// When it was asked (CLOCK_MONOTONIC ns).
        asked_ns: u64,
        /// The pids NVML lists.
        users: Option<std::collections::BTreeSet<u32>>,
    },
    /// NVML's answer to each GPU's memory, asked at `asked_ns` (`None`: no NVML): the gate's floor.
    NvmlMemory {
        /// When it was asked (CLOCK_MONOTONIC ns).
        asked_ns: u64,
        /// Each GPU's memory by minor.
        memory: Option<std::collections::BTreeMap<u32, crate::gate::floor::Memory>>,
    },
    /// A preemption changed a container's state.
    SetPreemption {
        /// Which container.
        container: ContainerRef,
        /// Its state now.
        state: Option<PreemptState>,
    },
}

/// Something the agent did to a container that its traces show (`+++ frozen +++`) and timelines draw.
#[derive(Clone, Debug)]
pub struct Note {
    /// Which container.
    pub container: ContainerRef,
    /// CLOCK_MONOTONIC ns of it (the kernel's confirmation, for a freeze or a thaw).
    pub t_ns: u64,
    /// What happened.
    pub kind: NoteKind,
}

/// What a [`Note`] says.
#[derive(Clone, Debug)]
pub enum NoteKind {
    /// The controller froze it; the freeze took `latency_ns` to confirm.
    Frozen {
        /// Write to confirmation, ns.
        latency_ns: u64,
    },
    /// The controller thawed it.
    Thawed {
        /// Write to confirmation, ns.
        latency_ns: u64,
    },
    /// The rate gate started or stopped filling a GPU the container is on.
    GapFill {
        /// Whether the agent fills it now.
        filling: bool,
        /// The GPU and the rule with its figures.
        detail: String,
    },
    /// The gate's room decided for it: `what` is `beside` (its Start went through beside holders),
    /// `parked` (a co-runner was parked to make room), `resumed` (a parked co-runner fits again) or
    /// `stopping` (a parked container being stopped is resumed first, or not, and why).
    Room {
        /// What happened.
        what: &'static str,
        /// Who, and the figures (`started beside trainer (fits: needs 1 GiB, 61 GiB free)`).
        detail: String,
    },
    /// A step of a preemption, resume or handoff.
    Preemption {
        /// The step.
        phase: baton_agent_api::Phase,
        /// What the step says.
        detail: String,
        /// The process it concerns, if one.
        pid: Option<u32>,
        /// On a `checkpointed` step, the processes the shim says have no CUDA state (see
        /// `registry::shims_word`).
        no_cuda_state: Vec<u32>,
    },
}

impl Note {
    /// The note of a preemption's step.
    pub fn of_step(step: &baton_agent_api::Step) -> Self {
        Self {
            container: step.container.clone(),
            t_ns: step.t_ns,
            kind: NoteKind::Preemption {
                phase: step.phase,
                detail: step.detail.clone(),
                pid: step.pid,
                no_cuda_state: step.no_cuda_state.clone(),
            },
        }
    }

    /// Hands the note to the core without waiting: a full inbox drops it (a trace line is not worth
    /// stalling a freeze or a preemption for).
    pub fn send(self, core: &mpsc::Sender<Command>) {
        let (reply, _) = oneshot::channel();
        let _ = core.try_send(Command {
            what: What::Note(self),
            peer_pid: 0,
            reply,
        });
    }
}

/// A watched container as a preemption needs it.
#[derive(Clone, Debug)]
pub struct Resolved {
    /// Which container.
    pub container: ContainerRef,
    /// Its shim's control socket.
    pub control_socket: Option<String>,
    /// Its processes that hold NVIDIA files (its CUDA processes).
    pub pids: Vec<u32>,
    /// Its preemption state.
    pub preemption: Option<PreemptState>,
    /// Its device memory in the ledger, bytes (what a park copies into its host memory).
    pub vram_bytes: u64,
    /// What the node's budget for parked host memory has left for raising its memory limit, bytes.
    pub host_budget_left: u64,
}

/// A request from a connection.
pub struct Command {
    /// What is asked.
    pub what: What,
    /// The asking process (SO_PEERCRED).
    pub peer_pid: u32,
    /// Where the reply goes.
    pub reply: oneshot::Sender<Reply>,
}
