//! What the agent's `status` reply says: the node, each watched container's GPU state, the probes' fd map and
//! NVML's floor (part of the one definition of the agent's messages, [`crate::protocol`]).
use serde::{Deserialize, Serialize};

use crate::{
    ContainerRef,
    control::{ControllerStatus, RoleSpec},
    preempt::PreemptState,
};

/// The node as the agent sees it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeStatus {
    /// The agent's pid.
    pub agent_pid: u32,
    /// Whether the probes are attached now.
    pub probes_attached: bool,
    /// eBPF programs the agent has attached (one probe set whatever the number of containers).
    pub programs_attached: usize,
    /// Records the kernel dropped because the ring buffer was full.
    pub ringbuf_drops: u64,
    /// Times the agent re-read every traced process from /proc because records were lost.
    #[serde(default)]
    pub resyncs: u64,
    /// Calls whose record the probes could not keep (their in-flight slot was another thread's and the
    /// overflow had no room): each made its container's ledger partial and its process read again from
    /// /proc once the call returned. (An older agent's `pending_evicted`: records another thread's call
    /// overwrote.)
    #[serde(default, alias = "pending_evicted")]
    pub pending_lost: u64,
    /// Calls whose in-flight slot another thread's call held, kept in the probes' overflow instead: nothing
    /// lost.
    #[serde(default)]
    pub pending_overflowed: u64,
    /// How full the probes' fd map is (absent while the probes are detached, and from an older agent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probe_fd_map: Option<ProbeFdMap>,
    /// Removals of NVIDIA files confirmed complete from /proc rather than by a probe (a thread with no
    /// further syscall, a lost record).
    #[serde(default)]
    pub confirmed_by_proc: u64,
    /// The watched containers.
    pub containers: Vec<ContainerStatus>,
    /// The co-runner controller.
    #[serde(default)]
    pub controller: ControllerStatus,
    /// Gap-fill: the co-runners the agent parked by itself, in resume order.
    #[serde(default)]
    pub gap_fill: crate::gapfill::GapFillStatus,
    /// Each GPU the watched containers see, its video memory by the ledger beside NVML's.
    #[serde(default)]
    pub gpus: Vec<GpuMemory>,
    /// The ledger's peak per container name and namespace, over the containers watched since the agent
    /// started (what to set `baton.io/gpu-memory` from).
    #[serde(default)]
    pub peaks: Vec<crate::room::PeakMemory>,
    /// The host memory parked containers hold, and the node's budget for the limits their parks raised.
    #[serde(default)]
    pub parked_host_memory: crate::ParkedHostMemory,
    /// The gate's NVML floor of each GPU NVML reported (empty without NVML, with the floor off, and from an
    /// older agent).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nvml_floor: Vec<GpuFloor>,
}

/// One GPU's NVML floor in the node's status.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuFloor {
    /// Its minor number (N of `/dev/nvidiaN`).
    pub minor: u32,
    /// What the floor knows of it.
    #[serde(flatten)]
    pub floor: crate::room::NvmlFloor,
}

/// A GPU's video memory as the agent's ledger counts it and as NVML reports it (the cross-check).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuMemory {
    /// Its device file's name (`nvidia0`).
    pub device: String,
    /// Its minor number (N of `/dev/nvidiaN`, NVML's minor number).
    pub minor: u8,
    /// The watched containers that see it.
    pub containers: usize,
    /// The ledger's video memory of those containers (a container that sees several GPUs counts on each:
    /// the ledger does not split a container's memory by GPU).
    pub ledger_vram_bytes: u64,
    /// NVML's used memory of the device; `None` without NVML (no driver, as on the mock).
    pub nvml_used_bytes: Option<u64>,
}

/// Whether a container holds the GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GpuHold {
    /// It has not opened an NVIDIA device file since it was registered.
    Never,
    /// One of its processes holds an NVIDIA file.
    Held,
    /// None holds one any more.
    Released,
}

/// A watched container's GPU state.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ContainerStatus {
    /// Which container.
    #[serde(flatten)]
    pub container: ContainerRef,
    /// Its cgroup v2 path.
    pub cgroup: String,
    /// Its cgroup v2 id (what the probes see).
    pub cgroup_id: u64,
    /// Its init pid.
    pub init_pid: u32,
    /// The NVIDIA device files it sees.
    pub devices: Vec<String>,
    /// Its processes that hold NVIDIA files.
    pub processes: Vec<ProcessStatus>,
    /// NVIDIA fds across its processes.
    pub nvidia_fds: usize,
    /// Mappings of NVIDIA device files across its processes.
    pub mappings: usize,
    /// Threads whose removal of an NVIDIA file the kernel has not finished (the release is not confirmed
    /// while this is not 0).
    #[serde(default)]
    pub unconfirmed: usize,
    /// Live RM objects in its ledger.
    pub live_objects: usize,
    /// Video memory its live objects hold, in bytes.
    pub vram_bytes: u64,
    /// The most video memory it held at once.
    pub peak_vram_bytes: u64,
    /// Held, released or never.
    pub gpu: GpuHold,
    /// CLOCK_MONOTONIC ns of the last transition (registration when none).
    pub since_ns: u64,
    /// Part of its state was read from /proc (created while no probe watched), so the ledger is incomplete.
    pub partial: bool,
    /// Calls its ledger doubted (absent when none, and from an older agent): allocations counted though
    /// they read as refused or their readings differed, frees not applied because their readings differed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub doubtful: Option<Doubtful>,
    /// Parked, or being preempted or resumed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preemption: Option<PreemptState>,
    /// Its role for the co-runner controller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<RoleSpec>,
    /// Its share of the probes' fd map (absent from an older agent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probe_fds: Option<ProbeFds>,
    /// The last periodic check of its processes against /proc while it held the GPU (absent before the
    /// first, and from an older agent): what reading its processes costs the agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proc_check: Option<ProcCheck>,
}

/// What a container's ledger doubted: the params it reads live in the tenant's memory, which another thread
/// can rewrite after the driver answered, so the ledger takes the reading that holds more.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Doubtful {
    /// Live objects counted though their call read as refused, their readings differed, or their handle
    /// was live already.
    pub objects: usize,
    /// Such allocations since the container was watched.
    pub allocations: u64,
    /// Frees read as done that were not applied: the object they named at the call's entry was another.
    pub frees_disputed: u64,
}

/// One check of a container's processes against /proc, read on the agent's blocking pool (never on the
/// thread that publishes releases and answers requests).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcCheck {
    /// How long reading its processes' fds and maps took (µs).
    pub took_us: u64,
    /// How many processes were read.
    pub processes: usize,
    /// When it came back (CLOCK_MONOTONIC ns).
    pub at_ns: u64,
}

/// A container's share of the probes' fd map: each container may have `quota` NVIDIA fds followed by the
/// probes, so that one tenant cannot fill the map and blind them for the others. Past it its later fds are
/// followed through /proc alone (its release then waits for /proc to show them gone).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProbeFds {
    /// Fds of its processes in the probes' map.
    pub followed: u64,
    /// How many it may have there (0: no bound).
    pub quota: u64,
    /// It reached the quota (or found the map full): followed through /proc from then on.
    pub over_quota: bool,
}

/// The probes' fd map for the whole node: `entries` in all, of which `reserve` are kept for each container's
/// first few hundred fds (a container past those gets no more once only the reserve is left), so that no
/// tenant's containers, however many, can leave another container unfollowed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProbeFdMap {
    /// Entries it holds.
    pub entries: u64,
    /// Entries in use.
    pub used: u64,
    /// Entries kept as the reserve.
    pub reserve: u64,
    /// Entries of the reserve still free.
    pub reserve_free: u64,
}

/// One process's NVIDIA files.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessStatus {
    /// Host pid.
    pub pid: u32,
    /// Its NVIDIA fds.
    pub fds: usize,
    /// Its mappings of NVIDIA device files.
    pub mappings: usize,
}
