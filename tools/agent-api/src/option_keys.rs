//! The names of the shim's settings, one definition for the shim that parses them (a runtime's TOML
//! `options` table and `baton.io/` annotations) and `baton install`, which writes them into containerd's
//! config.

/// Prefix of Baton's annotations (`baton.io/role`, ...); CRI passes a pod's and a container's annotations
/// with this prefix to the shim when the runtime's `pod_annotations` / `container_annotations` list it.
pub const ANNOTATION_PREFIX: &str = "baton.io/";

/// Trace the container's NVIDIA driver calls (true | false).
pub const EBPF: &str = "ebpf";
/// NVIDIA's cuda-checkpoint binary (node only).
pub const CUDA_CHECKPOINT_PATH: &str = "cuda_checkpoint_path";
/// The CUDA driver library whose checkpoint calls (`cuCheckpointProcess*`, drivers 570 and later) the shim uses
/// instead of running cuda-checkpoint (node only; default [`DEFAULT_CUDA_DRIVER`] through the dynamic loader;
/// empty: always run the program).
pub const CUDA_DRIVER_PATH: &str = "cuda_driver_path";
/// The library the shim's driver helper loads when the node's TOML names none.
pub const DEFAULT_CUDA_DRIVER: &str = "libcuda.so.1";
/// The CRIU program runc runs for checkpoints and restores (node only; default
/// [`DEFAULT_CRIU_PATH`] where it exists, else `criu` on PATH).
pub const CRIU_PATH: &str = "criu_path";
/// Where `tools/setup.sh` leaves CRIU 4 (Debian unstable's, through its own loader): the shim's CRIU when
/// the node's TOML names none and this exists.
pub const DEFAULT_CRIU_PATH: &str = "/var/cache/baton/criu/bin/criu";
/// How co-runners are paused ("cgroup" | "signal").
pub const FREEZER: &str = "freezer";
/// Where the container's NVIDIA device files are.
pub const TRACE_PREFIX: &str = "trace_prefix";
/// The node agent's socket (node only).
pub const AGENT_SOCKET: &str = "agent_socket";
/// Start an agent when nothing answers on its socket (node only; false where systemd or a DaemonSet runs it).
pub const AGENT_AUTOSTART: &str = "agent_autostart";
/// How long cuda-checkpoint's lock of each process may take (node only: a tenant's 1 ms made its container
/// impossible to preempt, and failed the Start of a server waiting for its GPU).
pub const CUDA_LOCK_TIMEOUT: &str = "cuda_lock_timeout";
/// How long each cuda-checkpoint run (a checkpoint, a restore) may take before the shim stops it and rolls back
/// (node only: a tiny one would make a tenant's container impossible to preempt).
pub const CUDA_CHECKPOINT_TIMEOUT: &str = "cuda_checkpoint_timeout";
/// Start waits until no other container holds the GPU.
pub const WAIT_GPU_FREE: &str = "wait-gpu-free";
/// "latency-critical" | "co-runner".
pub const ROLE: &str = "role";
/// The servers a co-runner yields to.
pub const YIELDS_TO: &str = "yields-to";
/// `CUDA_LAUNCH_BLOCKING=1` for a co-runner.
pub const LAUNCH_BLOCKING: &str = "launch-blocking";
/// A co-runner the agent may preempt by itself for a latency-critical container behind the GPU-free gate:
/// "park" | "snapshot" (gap-fill).
pub const PREEMPTIBLE: &str = "preemptible";
/// A co-runner's base priority among the parked ones the agent resumes (an integer, default 0).
pub const PRIORITY: &str = "priority";
/// Where snapshot preemptions put their images by default, one folder per namespace and container (node
/// only; default [`crate::DEFAULT_SNAPSHOT_DIR`]).
pub const SNAPSHOT_DIR: &str = "snapshot_dir";
/// A latency-critical container with no request event for this long is parked by the agent, its GPU going
/// to the parked co-runners; a `request_start` naming it hands the GPU back (a duration; gap-fill).
pub const PARK_WHEN_IDLE: &str = "park-when-idle";
/// Gap-fill's rate gate (node only): the least share of its GPU a parked co-runner is to keep, a number in
/// [0, 1] (default [`crate::gapfill::DEFAULT_MIN_SHARE`]); below it the agent stops filling.
pub const GAP_FILL_MIN_SHARE: &str = "gap_fill_min_share";
/// Gap-fill's rate gate (node only): the sliding window over which the agent counts preemptions per GPU (a
/// duration, default [`crate::gapfill::DEFAULT_WINDOW`]).
pub const GAP_FILL_WINDOW: &str = "gap_fill_window";
/// What a park does when the container's memory cgroup has no room for the host copy of its device memory:
/// "raise" (its limit, while parked) or "refuse" (node only; [`crate::ParkMemory`]).
pub const PARK_MEMORY: &str = "park_memory";
/// The node's budget for the memory limits parks raise (`park_memory = "raise"`), in all (node only; a
/// quantity, default half the node's memory).
pub const PARKED_HOST_MEMORY_BUDGET: &str = "parked_host_memory_budget";
/// Whether a park freezes the container's cgroup after the checkpoint ("true" | "false"; node only; default
/// true, and false for the agent's idle park, whose servers answer liveness probes): unfrozen, its CPU
/// threads run and its CUDA calls wait for the resume. Node only: a tenant that opted out of the freeze of a
/// park for a server could start a fresh CUDA process beside that server (the agent parks such a process
/// again, see `park_again.rs`; the freeze is the node's to decide).
pub const PARK_FREEZE: &str = "park-freeze";

/// The video memory a container needs on each GPU it sees (a quantity, `24Gi`): its Start goes through the
/// GPU-free gate once that much is free beside the holders, instead of waiting for an empty GPU.
pub const GPU_MEMORY: &str = "gpu-memory";
/// The memory the gate keeps free on each GPU beside what the holders have (node only; a quantity,
/// default none).
pub const GPU_MEMORY_HEADROOM: &str = "gpu_memory_headroom";
/// The least need a container's `gpu-memory` counts for (node only; a quantity, default none): a tenant's
/// `gpu-memory: "1"` then counts as this much at the gate.
pub const GPU_MEMORY_MINIMUM: &str = "gpu_memory_minimum";

/// Every Baton key, in TOML and (prefixed with [`ANNOTATION_PREFIX`]) in annotations.
pub const BATON_KEYS: [&str; 26] = [
    EBPF,
    CUDA_CHECKPOINT_PATH,
    CUDA_DRIVER_PATH,
    CRIU_PATH,
    FREEZER,
    TRACE_PREFIX,
    AGENT_SOCKET,
    AGENT_AUTOSTART,
    CUDA_LOCK_TIMEOUT,
    CUDA_CHECKPOINT_TIMEOUT,
    WAIT_GPU_FREE,
    ROLE,
    YIELDS_TO,
    LAUNCH_BLOCKING,
    SNAPSHOT_DIR,
    PREEMPTIBLE,
    PRIORITY,
    GAP_FILL_MIN_SHARE,
    GAP_FILL_WINDOW,
    PARK_WHEN_IDLE,
    PARK_MEMORY,
    PARKED_HOST_MEMORY_BUDGET,
    PARK_FREEZE,
    GPU_MEMORY,
    GPU_MEMORY_HEADROOM,
    GPU_MEMORY_MINIMUM,
];

/// The keys only the node's TOML may set, as annotations come from whoever writes the pod spec: they name
/// programs or libraries the shim (root) runs, the agent it trusts or where it writes, or decide what the probes see (a
/// container that turned `ebpf` off, or moved `trace_prefix` elsewhere, would hold a GPU no other
/// container's gate sees, and distinct prefixes would use up the probe set's few slots for the whole node), or
/// bound a preemption (a tiny `cuda_checkpoint_timeout` would make a container impossible to preempt, and
/// `park-freeze: "false"` would let a parked co-runner run on beside the server it was parked for), or
/// concern every container of the node (gap-fill's rate gate, the gate's headroom and least need).
pub const NODE_ONLY_KEYS: [&str; 17] = [
    CUDA_CHECKPOINT_PATH,
    CUDA_DRIVER_PATH,
    CRIU_PATH,
    AGENT_SOCKET,
    AGENT_AUTOSTART,
    SNAPSHOT_DIR,
    EBPF,
    TRACE_PREFIX,
    CUDA_CHECKPOINT_TIMEOUT,
    CUDA_LOCK_TIMEOUT,
    PARK_MEMORY,
    PARKED_HOST_MEMORY_BUDGET,
    GAP_FILL_MIN_SHARE,
    GAP_FILL_WINDOW,
    GPU_MEMORY_HEADROOM,
    GPU_MEMORY_MINIMUM,
    PARK_FREEZE,
];

/// runc's `Options` keys (Go spelling) that `baton install` copies from the node's runc runtime, so that
/// Baton's runc runs as the node's does: the cgroup driver must match the kubelet's.
pub const RUNC_SYSTEMD_CGROUP: &str = "SystemdCgroup";
/// The runc binary (empty: runc on PATH).
pub const RUNC_BINARY_NAME: &str = "BinaryName";
