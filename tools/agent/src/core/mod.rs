//! The agent's one task that owns the probes and the watched containers: it answers requests (from the
//! connections, through a channel), reads the probes' records, and publishes each container's transitions.
//! This module holds its state; its jobs are the modules below, and the registry ([`crate::registry`]), the
//! gate ([`crate::gate`]) and gap-fill ([`crate::gapfill`]) add theirs in `impl Core` blocks of their own.
//!
//! The probes are loaded at the first registration and dropped (detached) with the last one, so a node
//! without watched containers pays nothing for them.
mod event_loop;
mod messages;
mod offload;
mod parked_memory;
mod probes;
mod recheck;
mod reconcile;
mod requests;
mod traces;

use std::collections::{BTreeMap, HashMap};

use baton_agent_api::ContainerRef;
use baton_tracer::Tracer;
use tokio::sync::broadcast;

pub use messages::{Command, Note, NoteKind, Resolved, What};

use crate::{
    control,
    gapfill::{GapFill, IdlePark},
    gate::Waiter,
    holders::{Classifier, Exempt},
    metrics::snapshot::{IoctlCounts, TracerTotals},
    registry::{Published, watched::Watched},
    trace_session::TraceSession,
};

/// The probes, the watched containers, and the event stream.
pub struct Core {
    /// The probe set, while a container is watched or a trace runs.
    pub(crate) tracer: Option<Tracer>,
    /// The registry: the watched containers.
    pub(crate) watched: BTreeMap<ContainerRef, Watched>,
    /// Each watched container by its cgroup id.
    pub(crate) by_cgroup: HashMap<u64, ContainerRef>,
    /// The event stream the `watch` connections read.
    pub(crate) events: broadcast::Sender<Published>,
    /// The last event's number.
    pub(crate) seq: u64,
    /// The `baton trace` sessions it serves, by session number.
    pub(crate) traces: BTreeMap<u64, TraceSession>,
    /// The Starts waiting at the gate.
    pub(crate) waiters: Vec<Waiter>,
    /// The preemptions and resumes the agent runs by itself for the gate's latency-critical containers.
    pub(crate) gapfill: GapFill,
    /// Gap-fill's idle park of servers.
    pub(crate) idle: IdlePark,
    /// The co-runner controller.
    pub(crate) controller: control::Handle,
    /// The watched containers as last told to the controller.
    pub(crate) members_sent: Vec<control::Member>,
    /// When the trace sessions' next launch lines are due (a deadline that records do not push back).
    pub(crate) launches_due: Option<tokio::time::Instant>,
    /// Each watched cgroup's ioctls, for the metrics.
    pub(crate) ioctls: HashMap<u64, IoctlCounts>,
    /// The counters of the probe sets loaded before the current one.
    pub(crate) retired: TracerTotals,
    /// Tells NVIDIA files apart in /proc (the hidden-holder checks).
    pub(crate) classifier: Classifier,
    /// The node's own processes, which never count as holders.
    pub(crate) exempt: Exempt,
    /// When to look at /proc again for holders the probes cannot see (a release or a gate waits for one).
    pub(crate) recheck_due: Option<tokio::time::Instant>,
    /// The delay before the next such look (grows while nothing changes).
    pub(crate) recheck_every: std::time::Duration,
    /// When the held containers' mirror is next checked against /proc (see `reconcile`).
    pub(crate) reconcile_at: Option<tokio::time::Instant>,
    /// NVML's latest word on which processes use a GPU (the gate's unwatched holders).
    pub(crate) gpu_users: crate::gate::gpu_users::GpuUsers,
    /// NVML's latest word on each GPU's memory: the gate's floor.
    pub floor: crate::gate::floor::Floor,
    /// The /proc reads out on the blocking pool.
    pub(crate) offload: offload::Offload,
    /// The latest look at the node's /proc for the gate.
    pub(crate) node_scan: Option<crate::holders::NodeScan>,
    /// How many NVIDIA fds of one container the probes follow (`--probe-fd-quota`).
    pub fd_quota: u32,
    /// The memory the gate keeps free on each GPU (`gpu_memory_headroom`, from the shims' registrations).
    pub(crate) gpu_headroom: u64,
    /// The least need a declared `gpu-memory` counts for (`gpu_memory_minimum`, from the shims'
    /// registrations).
    pub(crate) gpu_min_need: u64,
    /// The node's budget for the memory limits parks raise (`parked_host_memory_budget`, from the shims'
    /// registrations; `None`: half the node's memory).
    pub(crate) parked_budget: Option<u64>,
    /// The node's memory (MemTotal, read at the start), bytes.
    pub(crate) mem_total: u64,
    /// The ledger's peak per container name, past each container's end.
    pub(crate) peaks: crate::registry::peaks::Peaks,
}

impl Core {
    /// A core with nothing watched, publishing on `events`; the co-runner controller learns the watched
    /// containers' roles from it.
    pub fn new(
        events: broadcast::Sender<Published>,
        controller: control::Handle,
        exempt: Exempt,
    ) -> Self {
        Self {
            tracer: None,
            watched: BTreeMap::new(),
            by_cgroup: HashMap::new(),
            events,
            seq: 0,
            traces: BTreeMap::new(),
            waiters: Vec::new(),
            controller,
            members_sent: Vec::new(),
            launches_due: None,
            ioctls: HashMap::new(),
            retired: TracerTotals::default(),
            classifier: Classifier::new(),
            exempt,
            recheck_due: None,
            recheck_every: recheck::RECHECK_FIRST,
            reconcile_at: None,
            gpu_users: Default::default(),
            floor: Default::default(),
            offload: Default::default(),
            node_scan: None,
            gapfill: GapFill::default(),
            idle: Default::default(),
            fd_quota: baton_tracer::DEFAULT_FD_QUOTA,
            gpu_headroom: 0,
            gpu_min_need: 0,
            parked_budget: None,
            mem_total: baton_cgroups::memory::node_total().unwrap_or(0),
            peaks: Default::default(),
        }
    }
}
