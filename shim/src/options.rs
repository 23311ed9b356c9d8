//! Runtime options: runc's `Options` protobuf, CRI's `runtimeoptions.v1.Options` (whose TOML
//! `config_body` / `config_path` carries a non-runc runtime's `options` table: the "options
//! trap"), the legacy `containerd.linux.runc.CreateOptions` containerd's Go client (and so `ctr`)
//! sends a runtime not named `io.containerd.runc.*`, and Baton's own settings from that TOML and
//! from `baton.io/` annotations.
//!
//! Layering rule for Baton settings: the TOML is the node default; the pod's annotations (those
//! on the sandbox container, remembered by the shim that serves the pod) override it; a
//! container's own annotations override the pod. A value that cannot be parsed, or a key Baton does
//! not know (a typo would otherwise be silently ignored), fails Create with a message naming the key
//! and listing the known ones.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
};

use containerd_shim_protos::{
    protobuf::{self, CodedInputStream, Message, rt::WireType, well_known_types::any::Any},
    shim::oci::Options as RuncOptions,
};

use baton_agent_api::{
    DURATION_SYNTAX, MAX_WAIT_GPU_FREE, ParkMemory, PreemptMode, Role, RoleSpec, limits,
    parse_duration,
};

use crate::errors::{Result, ShimError};

/// Prefix of Baton's annotations.
pub use baton_agent_api::option_keys::ANNOTATION_PREFIX;
/// Annotation CRI puts on a pod's sandbox container.
pub const CONTAINER_TYPE_ANNOTATION: &str = "io.kubernetes.cri.container-type";
/// Annotation naming the pod sandbox a container belongs to.
pub const SANDBOX_ID_ANNOTATION: &str = "io.kubernetes.cri.sandbox-id";
/// Grouping annotation the Go runc shim honours as well.
pub const GROUP_ANNOTATION: &str = "io.containerd.runc.v2.group";

/// How Baton freezes a container when it has to (used by later issues).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Freezer {
    /// Through the cgroup freezer (default).
    Cgroup,
    /// By signalling the processes (SIGSTOP / SIGCONT).
    Signal,
}

/// How long a cuda-checkpoint run may take by default: the copy of a large GPU's memory to host memory
/// takes seconds to minutes.
pub const DEFAULT_CUDA_CHECKPOINT_TIMEOUT: std::time::Duration =
    std::time::Duration::from_secs(600);

/// Baton's own per-container settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatonSettings {
    /// Have the node agent watch this container's GPU calls (`ebpf`, default true).
    pub ebpf: bool,
    /// The cuda-checkpoint binary (`cuda_checkpoint_path`, default `cuda-checkpoint` from PATH).
    pub cuda_checkpoint_path: PathBuf,
    /// The CUDA driver library whose checkpoint calls replace the program (`cuda_driver_path`, node only; a
    /// path, or a name for the dynamic loader; default `libcuda.so.1`); `None`: the program only (set empty).
    pub cuda_driver_path: Option<String>,
    /// The CRIU program runc runs for checkpoints and restores (`criu_path`, node only, absolute); `None`:
    /// see [`BatonSettings::criu_program`].
    pub criu_path: Option<PathBuf>,
    /// Freezer kind (`freezer`: "cgroup" | "signal").
    pub freezer: Freezer,
    /// Device path prefix the tracer watches (`trace_prefix`, default "/dev/nvidia").
    pub trace_prefix: String,
    /// The node agent's socket (`agent_socket`; default `$BATON_AGENT_SOCKET`, else /run/baton/agent.sock).
    pub agent_socket: Option<PathBuf>,
    /// Start the agent (the `baton` binary beside the shim, else on PATH) when nothing answers on its
    /// socket (`agent_autostart`, default true; a DaemonSet-run agent makes it unnecessary).
    pub agent_autostart: bool,
    /// How long cuda-checkpoint's lock of each process may take (`cuda_lock_timeout`, e.g. "10s"; node only).
    pub cuda_lock_timeout: std::time::Duration,
    /// How long any one cuda-checkpoint run (a checkpoint or a restore of a process) may take before the
    /// shim stops it and rolls back (`cuda_checkpoint_timeout`, e.g. "10m").
    pub cuda_checkpoint_timeout: std::time::Duration,
    /// What a park does when the container's memory cgroup has no room for the host copy of its device
    /// memory (`park_memory`, node only; default raise).
    pub park_memory: ParkMemory,
    /// Whether a park freezes the container after its checkpoint (`park-freeze`, "true" | "false"); `None`:
    /// yes, except for the agent's idle park (see [`BatonSettings::park_freezes`]).
    pub park_freeze: Option<bool>,
    /// Start waits until no other container holds the NVIDIA devices this one sees, at most this long
    /// (`wait-gpu-free`, e.g. "20s"; `baton.io/wait-gpu-free` on a pod or container). `None`: no wait.
    pub wait_gpu_free: Option<std::time::Duration>,
    /// The container's role for the node agent's co-runner controller (`role`: "latency-critical" |
    /// "co-runner"). A container with a role is registered with the agent even without NVIDIA devices.
    pub role: Option<Role>,
    /// A co-runner yields to these containers or pods (`yields-to`, comma-separated; empty: every
    /// latency-critical container on the node).
    pub yields_to: Vec<String>,
    /// Put `CUDA_LAUNCH_BLOCKING=1` in a co-runner's environment, so that at most one of its kernels is in
    /// flight when it is frozen (`launch-blocking`, default true for a co-runner, ignored otherwise).
    pub launch_blocking: bool,
    /// Where snapshot images go by default, in a folder per namespace and container (`snapshot_dir`, node
    /// only, absolute; default /var/lib/baton/snapshots).
    pub snapshot_dir: PathBuf,
    /// A co-runner the agent may preempt by itself for a latency-critical container behind the GPU-free
    /// gate, and how (`preemptible`: "park" | "snapshot"; none: only an operator preempts it). Ignored
    /// without `role: co-runner`.
    pub preemptible: Option<PreemptMode>,
    /// A co-runner's base priority among the parked co-runners the agent resumes (`priority`, an integer,
    /// default 0).
    pub priority: i32,
    /// Gap-fill's rate gate (`gap_fill_min_share`, `gap_fill_window`; node only), when the TOML sets either:
    /// the shim passes it to the agent with its registrations.
    pub rate_gate: Option<baton_agent_api::RateGateSettings>,
    /// A latency-critical container the agent parks after this long without a request event
    /// (`park-when-idle`, a duration).
    pub park_when_idle: Option<std::time::Duration>,
    /// The video memory the container needs on each GPU it sees (`gpu-memory`, a Kubernetes quantity,
    /// bytes); `None`: the whole GPU.
    pub gpu_memory: Option<u64>,
    /// The memory the gate keeps free on each GPU (`gpu_memory_headroom`, node only, bytes).
    pub gpu_memory_headroom: Option<u64>,
    /// The least need a declared `gpu-memory` counts for at the gate (`gpu_memory_minimum`, node only,
    /// bytes).
    pub gpu_memory_minimum: Option<u64>,
    /// The node's budget for the memory limits parks raise, in all (`parked_host_memory_budget`, node
    /// only, bytes); `None`: the agent's default, half the node's memory.
    pub parked_host_memory_budget: Option<u64>,
    /// The pod (`pod-namespace/pod-name`) from CRI's sandbox annotations; not a key.
    pub pod: Option<String>,
    /// The pod and container names from CRI's annotations (for the agent's metrics); not a key.
    pub kubernetes: Option<baton_agent_api::KubernetesRef>,
}

impl BatonSettings {
    /// The CRIU runc is to run: `criu_path`, else [`baton_agent_api::option_keys::DEFAULT_CRIU_PATH`]
    /// where it exists; `None`: runc's own choice (`criu` on its PATH).
    pub fn criu_program(&self) -> Option<PathBuf> {
        self.criu_path.clone().or_else(|| {
            let cached = Path::new(baton_agent_api::option_keys::DEFAULT_CRIU_PATH);
            cached.exists().then(|| cached.to_path_buf())
        })
    }

    /// Whether a park of this container freezes it after the checkpoint: `park-freeze` when set, else yes,
    /// except for an idle park (`idle_park`). An idle-parked server nearly always has liveness probes, which
    /// the kubelet runs in it (ExecSync) or against it (HTTP, gRPC): frozen, every probe fails and the
    /// kubelet restarts the container, losing the park. Unfrozen, its CPU threads answer and only its CUDA
    /// calls wait for the resume. A co-runner parked for a server is frozen: its CPU work (data loading)
    /// would otherwise compete with the server, and trainers seldom have probes.
    pub fn park_freezes(&self, idle_park: bool) -> bool {
        self.park_freeze.unwrap_or(!idle_park)
    }

    /// These (a pod's) settings as they apply to the pod's sandbox container itself: its process (pause)
    /// runs no GPU work, so the pod's role, gate, preemption and idle park are its containers', not its
    /// own. Otherwise a pod's `baton.io/wait-gpu-free` would hold its own sandbox's start, and with it
    /// RunPodSandbox, until the GPU is free, before any container of the pod exists.
    pub fn for_sandbox(&self) -> Self {
        Self {
            wait_gpu_free: None,
            role: None,
            yields_to: Vec::new(),
            launch_blocking: false,
            preemptible: None,
            park_when_idle: None,
            gpu_memory: None,
            ..self.clone()
        }
    }
}

impl Default for BatonSettings {
    fn default() -> Self {
        Self {
            ebpf: true,
            cuda_checkpoint_path: PathBuf::from("cuda-checkpoint"),
            cuda_driver_path: Some(baton_agent_api::option_keys::DEFAULT_CUDA_DRIVER.to_owned()),
            criu_path: None,
            freezer: Freezer::Cgroup,
            trace_prefix: "/dev/nvidia".to_string(),
            agent_socket: None,
            agent_autostart: true,
            cuda_lock_timeout: std::time::Duration::from_secs(10),
            cuda_checkpoint_timeout: DEFAULT_CUDA_CHECKPOINT_TIMEOUT,
            park_memory: ParkMemory::Raise,
            park_freeze: None,
            wait_gpu_free: None,
            role: None,
            yields_to: Vec::new(),
            launch_blocking: true,
            snapshot_dir: PathBuf::from(baton_agent_api::DEFAULT_SNAPSHOT_DIR),
            preemptible: None,
            priority: 0,
            rate_gate: None,
            park_when_idle: None,
            gpu_memory: None,
            gpu_memory_headroom: None,
            gpu_memory_minimum: None,
            parked_host_memory_budget: None,
            pod: None,
            kubernetes: None,
        }
    }
}

// The keys Baton knows, in TOML and (prefixed with `baton.io/`) in annotations; the keys only the node's
// TOML may set (one definition with `baton install`).
use baton_agent_api::option_keys::{BATON_KEYS, NODE_ONLY_KEYS};

/// runc's `Options` keys in their Go spelling, as a runtime's options table spells them.
const RUNC_KEYS: [&str; 10] = [
    "BinaryName",
    "Root",
    "SystemdCgroup",
    "NoPivotRoot",
    "NoNewKeyring",
    "IoUid",
    "IoGid",
    "ShimCgroup",
    "CriuImagePath",
    "CriuWorkPath",
];

/// Keys accepted in the options table and ignored: `runtimeoptions.v1.Options`' own fields (containerd
/// reads them: `ConfigPath` names the file this TOML may come from) and runc's `CriuPath`, which containerd
/// 1.6's default runc options still list (removed in containerd 2.0).
const IGNORED_KEYS: [&str; 3] = ["TypeUrl", "ConfigPath", "CriuPath"];

impl BatonSettings {
    /// Sets `key` from its textual form; `origin` names where it came from for the error.
    fn set(&mut self, key: &str, value: &str, origin: &str) -> Result<bool> {
        let invalid = |what: &str| {
            ShimError::InvalidArgument(format!("{origin} {key}={value:?}: expected {what}"))
        };
        match key {
            "ebpf" => {
                self.ebpf = match value.trim() {
                    "true" | "1" | "yes" => true,
                    "false" | "0" | "no" => false,
                    _ => return Err(invalid("true or false")),
                }
            }
            "cuda_checkpoint_path" => {
                if value.trim().is_empty() {
                    return Err(invalid("a path"));
                }
                self.cuda_checkpoint_path = PathBuf::from(value.trim());
            }
            "cuda_driver_path" => {
                let value = value.trim();
                if value.contains('/') && !value.starts_with('/') {
                    return Err(invalid(
                        "an absolute path, a library name for the dynamic loader, or empty (the program only)",
                    ));
                }
                self.cuda_driver_path = (!value.is_empty()).then(|| value.to_owned());
            }
            "criu_path" => {
                if !value.trim().starts_with('/') {
                    return Err(invalid("an absolute path to CRIU"));
                }
                self.criu_path = Some(PathBuf::from(value.trim()));
            }
            "freezer" => {
                self.freezer = match value.trim() {
                    "cgroup" => Freezer::Cgroup,
                    "signal" => Freezer::Signal,
                    _ => return Err(invalid("\"cgroup\" or \"signal\"")),
                }
            }
            "agent_socket" => {
                if !value.starts_with('/') {
                    return Err(invalid("an absolute socket path"));
                }
                self.agent_socket = Some(PathBuf::from(value));
            }
            "agent_autostart" => {
                self.agent_autostart = match value.trim() {
                    "true" | "1" | "yes" => true,
                    "false" | "0" | "no" => false,
                    _ => return Err(invalid("true or false")),
                }
            }
            "trace_prefix" => {
                if !value.starts_with('/') {
                    return Err(invalid("an absolute path prefix"));
                }
                self.trace_prefix = value.to_string();
            }
            "cuda_lock_timeout" => {
                self.cuda_lock_timeout =
                    parse_duration(value).ok_or_else(|| invalid(DURATION_SYNTAX))?;
            }
            "cuda_checkpoint_timeout" => {
                self.cuda_checkpoint_timeout = parse_duration(value)
                    .filter(|d| !d.is_zero())
                    .ok_or_else(|| invalid(DURATION_SYNTAX))?;
            }
            "wait-gpu-free" => {
                let within = parse_duration(value).ok_or_else(|| invalid(DURATION_SYNTAX))?;
                if within > MAX_WAIT_GPU_FREE {
                    let hours = MAX_WAIT_GPU_FREE.as_secs() / 3600;
                    return Err(invalid(&format!("a duration of at most {hours}h")));
                }
                self.wait_gpu_free = Some(within);
            }
            "role" => {
                self.role = Some(
                    Role::parse(value)
                        .ok_or_else(|| invalid("\"latency-critical\" or \"co-runner\""))?,
                );
            }
            "yields-to" => {
                self.yields_to = value
                    .split(',')
                    .map(str::trim)
                    .filter(|v| !v.is_empty())
                    .map(str::to_owned)
                    .collect();
            }
            "launch-blocking" => {
                self.launch_blocking = match value.trim() {
                    "true" | "1" | "yes" => true,
                    "false" | "0" | "no" => false,
                    _ => return Err(invalid("true or false")),
                }
            }
            "snapshot_dir" => {
                if !value.starts_with('/') {
                    return Err(invalid("an absolute directory"));
                }
                self.snapshot_dir = PathBuf::from(value);
            }
            "preemptible" => {
                self.preemptible = Some(
                    PreemptMode::parse(value).ok_or_else(|| invalid("\"park\" or \"snapshot\""))?,
                );
            }
            "priority" => {
                self.priority = value
                    .trim()
                    .parse()
                    .map_err(|_| invalid("an integer (a 32-bit one, higher resumes first)"))?;
            }
            "gap_fill_min_share" => {
                let share: f64 = value
                    .trim()
                    .parse()
                    .ok()
                    .filter(|s: &f64| (0.0..=1.0).contains(s))
                    .ok_or_else(|| invalid("a number from 0 to 1 (the least share, e.g. 0.25)"))?;
                self.rate_gate
                    .get_or_insert_with(Default::default)
                    .min_share = share;
            }
            "park_memory" => {
                self.park_memory = match value.trim() {
                    "raise" => ParkMemory::Raise,
                    "refuse" => ParkMemory::Refuse,
                    _ => return Err(invalid("\"raise\" or \"refuse\"")),
                };
            }
            "park-freeze" => {
                self.park_freeze = Some(match value.trim() {
                    "true" | "1" | "yes" => true,
                    "false" | "0" | "no" => false,
                    _ => return Err(invalid("true or false")),
                });
            }
            "park-when-idle" => {
                let after = parse_duration(value)
                    .filter(|d| limits::check_park_when_idle(*d).is_ok())
                    .ok_or_else(|| invalid(&format!("{DURATION_SYNTAX} of at most 7 days")))?;
                self.park_when_idle = Some(after);
            }
            "gap_fill_window" => {
                let window = parse_duration(value)
                    .filter(|d| !d.is_zero() && *d <= limits::MAX_RATE_WINDOW)
                    .ok_or_else(|| invalid(&format!("{DURATION_SYNTAX} of at most a week")))?;
                self.rate_gate.get_or_insert_with(Default::default).window_s = window.as_secs_f64();
            }
            "gpu-memory" => {
                self.gpu_memory = Some(
                    baton_agent_api::room::parse_quantity(value)
                        .ok_or_else(|| invalid(baton_agent_api::room::QUANTITY_SYNTAX))?,
                );
            }
            "gpu_memory_headroom" => {
                self.gpu_memory_headroom = Some(
                    baton_agent_api::room::parse_quantity(value)
                        .ok_or_else(|| invalid(baton_agent_api::room::QUANTITY_SYNTAX))?,
                );
            }
            "gpu_memory_minimum" => {
                self.gpu_memory_minimum = Some(
                    baton_agent_api::room::parse_quantity(value)
                        .ok_or_else(|| invalid(baton_agent_api::room::QUANTITY_SYNTAX))?,
                );
            }
            "parked_host_memory_budget" => {
                self.parked_host_memory_budget = Some(
                    baton_agent_api::room::parse_quantity(value)
                        .ok_or_else(|| invalid(baton_agent_api::room::QUANTITY_SYNTAX))?,
                );
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// The role the agent registers, if the container has one.
    pub fn role_spec(&self) -> Option<RoleSpec> {
        let role = self.role?;
        let co_runner = role == Role::CoRunner;
        Some(RoleSpec {
            role,
            yields_to: if co_runner {
                self.yields_to.clone()
            } else {
                Vec::new()
            },
            pod: self.pod.clone(),
            launch_blocking: co_runner && self.launch_blocking,
            preemptible: self.preemptible.filter(|_| co_runner),
            priority: if co_runner { self.priority } else { 0 },
            park_when_idle_ms: self
                .park_when_idle
                .filter(|_| !co_runner)
                .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            wait_gpu_free_ms: self
                .wait_gpu_free
                .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        })
    }

    /// Applies `baton.io/` annotations on top of `self`. `layer` ("pod" or "container") appears
    /// in error messages; a `baton.io/` key Baton does not know is an error listing the known ones.
    pub fn with_annotations(
        &self,
        annotations: &HashMap<String, String>,
        layer: &str,
    ) -> Result<Self> {
        let mut out = self.clone();
        let mut keys: Vec<_> = annotations.keys().collect();
        keys.sort();
        for full_key in keys {
            let Some(key) = full_key.strip_prefix(ANNOTATION_PREFIX) else {
                continue;
            };
            let origin = format!("{layer} annotation");
            if NODE_ONLY_KEYS.contains(&key) {
                return Err(ShimError::InvalidArgument(format!(
                    "{origin} {full_key}: not allowed in annotations (they come from pod specs, and \
                     {key} is the node's to decide: it names a program the shim runs as root or the \
                     agent it trusts, what the GPU probes see, how a preemption is bounded or held, or \
                     what the gate counts): set {key} in the runtime's options TOML on the node instead"
                )));
            }
            if !out.set(key, &annotations[full_key], &origin)? {
                return Err(unknown_annotation(&origin, full_key));
            }
        }
        Ok(out)
    }
}

/// The error for a `baton.io/` annotation Baton does not know.
fn unknown_annotation(origin: &str, full_key: &str) -> ShimError {
    let known: Vec<String> = BATON_KEYS
        .iter()
        .filter(|key| !NODE_ONLY_KEYS.contains(key))
        .map(|key| format!("{ANNOTATION_PREFIX}{key}"))
        .collect();
    ShimError::InvalidArgument(format!(
        "{origin} {full_key:?}: unknown Baton key; known annotations are {}: fix the pod's or \
         container's annotation",
        known.join(", ")
    ))
}

/// The error for an options-table key nobody knows.
fn unknown_toml_key(origin: &str, key: &str) -> ShimError {
    let known: Vec<&str> = RUNC_KEYS
        .iter()
        .chain(BATON_KEYS.iter())
        .chain(IGNORED_KEYS.iter())
        .copied()
        .collect();
    ShimError::InvalidArgument(format!(
        "{origin}: unknown key {key:?}; known keys are {}: fix the runtime's options table in \
         containerd's config (or the file its ConfigPath names)",
        known.join(", ")
    ))
}

/// Everything a Create's `options` field says.
#[derive(Debug, Clone, Default)]
pub struct RuntimeConfig {
    /// runc's options (binary, root, cgroup driver, ...).
    pub runc: RuncOptions,
    /// Baton's node defaults.
    pub baton: BatonSettings,
    /// Legacy `CreateOptions` fields nobody honours (logged as warnings).
    pub unknown_keys: Vec<String>,
}

/// The type URL CRI and ctr use for runc's options.
const RUNC_OPTIONS_TYPE: &str = "containerd.runc.v1.Options";
/// The type URL CRI uses for any non-runc runtime type.
const RUNTIME_OPTIONS_TYPE: &str = "runtimeoptions.v1.Options";
/// The type URL containerd's Go client uses for a runtime not named `io.containerd.runc.*`.
const LEGACY_CREATE_OPTIONS_TYPE: &str = "containerd.linux.runc.CreateOptions";

/// Decodes the `options` of a Create (or of the shim's start) into a [`RuntimeConfig`].
pub fn decode_options(any: Option<&Any>) -> Result<RuntimeConfig> {
    let Some(any) = any.filter(|a| !a.type_url.is_empty() || !a.value.is_empty()) else {
        return Ok(RuntimeConfig::default());
    };
    let type_name = any.type_url.rsplit('/').next().unwrap_or_default();
    match type_name {
        RUNC_OPTIONS_TYPE => {
            let runc = RuncOptions::parse_from_bytes(&any.value).map_err(|e| {
                ShimError::InvalidArgument(format!("options: bad {RUNC_OPTIONS_TYPE}: {e}"))
            })?;
            Ok(RuntimeConfig {
                runc,
                ..Default::default()
            })
        }
        RUNTIME_OPTIONS_TYPE => {
            let ro = decode_runtime_options(&any.value)?;
            runtime_options_config(&ro)
        }
        LEGACY_CREATE_OPTIONS_TYPE => decode_legacy_create_options(&any.value),
        other => Err(ShimError::InvalidArgument(format!(
            "options: unsupported type {other:?}: expected {RUNC_OPTIONS_TYPE}, \
             {RUNTIME_OPTIONS_TYPE} or {LEGACY_CREATE_OPTIONS_TYPE}"
        ))),
    }
}

/// `runtimeoptions.v1.Options` (containerd/api/types/runtimeoptions/v1), which the protos crate
/// does not ship: `type_url = 1`, `config_path = 2`, `config_body = 3`, all strings.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct RuntimeOptionsMessage {
    /// Field 1.
    pub type_url: String,
    /// Field 2: a TOML file to read.
    pub config_path: String,
    /// Field 3: the TOML text of the runtime's `options` table.
    pub config_body: String,
}

/// Walks the fields of a protobuf message of type `what` (for errors): `read` consumes the
/// fields it knows (returning true); the others are skipped.
fn walk_fields(
    bytes: &[u8],
    what: &str,
    mut read: impl FnMut(u32, WireType, &mut CodedInputStream) -> protobuf::Result<bool>,
) -> Result<()> {
    let bad =
        |e: &dyn std::fmt::Display| ShimError::InvalidArgument(format!("options: bad {what}: {e}"));
    let mut input = CodedInputStream::from_bytes(bytes);
    while let Some(tag) = input.read_raw_tag_or_eof().map_err(|e| bad(&e))? {
        let field = tag >> 3;
        let wire = WireType::new(tag & 7).ok_or_else(|| bad(&format!("wire type {}", tag & 7)))?;
        if !read(field, wire, &mut input).map_err(|e| bad(&e))? {
            input.skip_field(wire).map_err(|e| bad(&e))?;
        }
    }
    Ok(())
}

/// Decodes the wire form of `runtimeoptions.v1.Options`.
pub fn decode_runtime_options(bytes: &[u8]) -> Result<RuntimeOptionsMessage> {
    let mut msg = RuntimeOptionsMessage::default();
    walk_fields(bytes, RUNTIME_OPTIONS_TYPE, |field, wire, input| {
        let target = match (field, wire) {
            (1, WireType::LengthDelimited) => &mut msg.type_url,
            (2, WireType::LengthDelimited) => &mut msg.config_path,
            (3, WireType::LengthDelimited) => &mut msg.config_body,
            _ => return Ok(false),
        };
        *target = input.read_string()?;
        Ok(true)
    })?;
    Ok(msg)
}

/// Fields of `containerd.linux.runc.CreateOptions` (containerd runtime/linux/runctypes/runc.proto)
/// that runc's `Options` cannot carry: restore flags of containerd's removed v1 runtime.
const LEGACY_CREATE_OPTIONS_IGNORED: [(u32, &str); 6] = [
    (2, "open_tcp"),
    (3, "external_unix_sockets"),
    (4, "terminal"),
    (5, "file_locks"),
    (6, "empty_namespaces"),
    (7, "cgroups_mode"),
];

/// Decodes `containerd.linux.runc.CreateOptions` (which the protos crate does not ship) into the
/// runc options it stands for: no_pivot_root = 1, no_new_keyring = 8, shim_cgroup = 9,
/// io_uid = 10, io_gid = 11, criu_work_path = 12, criu_image_path = 13. The fields in
/// [`LEGACY_CREATE_OPTIONS_IGNORED`] are reported in `unknown_keys` when set.
pub fn decode_legacy_create_options(bytes: &[u8]) -> Result<RuntimeConfig> {
    let mut cfg = RuntimeConfig::default();
    let mut ignored = Vec::new();
    walk_fields(bytes, LEGACY_CREATE_OPTIONS_TYPE, |field, wire, input| {
        let r = &mut cfg.runc;
        use WireType::{LengthDelimited, Varint};
        match (field, wire) {
            (1, Varint) => r.no_pivot_root = input.read_bool()?,
            (8, Varint) => r.no_new_keyring = input.read_bool()?,
            (9, LengthDelimited) => r.shim_cgroup = input.read_string()?,
            (10, Varint) => r.io_uid = input.read_uint32()?,
            (11, Varint) => r.io_gid = input.read_uint32()?,
            (12, LengthDelimited) => r.criu_work_path = input.read_string()?,
            (13, LengthDelimited) => r.criu_image_path = input.read_string()?,
            _ => {
                if let Some((_, name)) = LEGACY_CREATE_OPTIONS_IGNORED
                    .iter()
                    .find(|(number, _)| *number == field)
                {
                    ignored.push(format!("CreateOptions.{name} (not supported; ignored)"));
                }
                return Ok(false);
            }
        }
        Ok(true)
    })?;
    ignored.dedup();
    cfg.unknown_keys = ignored;
    Ok(cfg)
}

/// The settings a `runtimeoptions.v1.Options` carries: the file `config_path` names (what containerd 1.6
/// sends: its options table reaches the shim only through `ConfigPath`), then the TOML of `config_body`
/// (containerd 2.x: the whole options table) on top.
fn runtime_options_config(ro: &RuntimeOptionsMessage) -> Result<RuntimeConfig> {
    let mut table = toml::Table::new();
    if !ro.config_path.is_empty() {
        let text = std::fs::read_to_string(&ro.config_path).map_err(|e| {
            ShimError::InvalidArgument(format!(
                "options: cannot read ConfigPath {}: {e}",
                ro.config_path
            ))
        })?;
        let origin = format!("options file {}", ro.config_path);
        table = parse_table(&text, &origin)?;
        // Checked on its own first, so that an error names the file its key is in.
        options_from_table(&table, &origin)?;
    }
    if !ro.config_body.is_empty() {
        table.extend(parse_table(&ro.config_body, "options TOML")?);
    }
    options_from_table(&table, "options TOML")
}

fn parse_table(text: &str, origin: &str) -> Result<toml::Table> {
    text.parse()
        .map_err(|e| ShimError::InvalidArgument(format!("{origin}: {e}")))
}

/// Parses the TOML `options` table of a Baton runtime: runc's keys in their Go spelling
/// (`BinaryName`, `SystemdCgroup`, ...) plus Baton's (`ebpf`, `freezer`, ...).
#[cfg(test)]
fn parse_toml_options(body: &str) -> Result<RuntimeConfig> {
    options_from_table(&parse_table(body, "options TOML")?, "options TOML")
}

/// The settings of an options table; `origin` names it in errors.
fn options_from_table(table: &toml::Table, origin: &str) -> Result<RuntimeConfig> {
    let mut cfg = RuntimeConfig::default();
    for (key, value) in table {
        let wrong = |what: &str| {
            ShimError::InvalidArgument(format!("{origin} {key} = {value:?}: expected {what}"))
        };
        let string = || {
            value
                .as_str()
                .map(str::to_string)
                .ok_or_else(|| wrong("a string"))
        };
        let boolean = || value.as_bool().ok_or_else(|| wrong("true or false"));
        let id = || {
            value
                .as_integer()
                .and_then(|v| u32::try_from(v).ok())
                .ok_or_else(|| wrong("a uid/gid number"))
        };
        let r = &mut cfg.runc;
        match key.as_str() {
            "BinaryName" => r.binary_name = string()?,
            "Root" => r.root = string()?,
            "SystemdCgroup" => r.systemd_cgroup = boolean()?,
            "NoPivotRoot" => r.no_pivot_root = boolean()?,
            "NoNewKeyring" => r.no_new_keyring = boolean()?,
            "IoUid" => r.io_uid = id()?,
            "IoGid" => r.io_gid = id()?,
            "ShimCgroup" => r.shim_cgroup = string()?,
            "CriuImagePath" => r.criu_image_path = string()?,
            "CriuWorkPath" => r.criu_work_path = string()?,
            "ebpf" => cfg.baton.ebpf = boolean()?,
            "agent_autostart" => cfg.baton.agent_autostart = boolean()?,
            "gap_fill_min_share" if value.as_float().is_some() || value.as_integer().is_some() => {
                let share = value
                    .as_float()
                    .or_else(|| value.as_integer().map(|i| i as f64));
                let text = share.map(|f| f.to_string()).unwrap_or_default();
                cfg.baton.set("gap_fill_min_share", &text, origin)?;
            }
            k if BATON_KEYS.contains(&k) => {
                let text = string()?;
                cfg.baton.set(k, &text, origin)?;
            }
            k if IGNORED_KEYS.contains(&k) => {}
            _ => return Err(unknown_toml_key(origin, key)),
        }
    }
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn any(type_url: &str, value: Vec<u8>) -> Any {
        Any {
            type_url: type_url.to_string(),
            value,
            ..Default::default()
        }
    }

    fn encode_runtime_options(path: &str, body: &str) -> Vec<u8> {
        let mut out = Vec::new();
        let mut os = containerd_shim_protos::protobuf::CodedOutputStream::vec(&mut out);
        os.write_string(1, "io.containerd.baton.v1").unwrap();
        if !path.is_empty() {
            os.write_string(2, path).unwrap();
        }
        os.write_string(3, body).unwrap();
        os.write_uint32(9, 7).unwrap(); // unknown field must be skipped
        os.flush().unwrap();
        drop(os);
        out
    }

    #[test]
    fn runc_options_are_decoded() {
        let mut o = RuncOptions::new();
        o.binary_name = "/usr/sbin/runc".into();
        o.systemd_cgroup = true;
        let cfg = decode_options(Some(&any(
            "containerd.runc.v1.Options",
            o.write_to_bytes().unwrap(),
        )))
        .unwrap();
        assert_eq!(cfg.runc.binary_name, "/usr/sbin/runc");
        assert!(cfg.runc.systemd_cgroup);
        assert_eq!(cfg.baton, BatonSettings::default());
    }

    #[test]
    fn runtime_options_toml_body_carries_runc_and_baton_keys() {
        let body = "BinaryName = \"/opt/runc\"\nSystemdCgroup = true\nIoUid = 1000\n\
                    ebpf = false\nfreezer = \"signal\"\ntrace_prefix = \"/dev/fake\"\nCriuPath = \"\"\n";
        let cfg = decode_options(Some(&any(
            "type.googleapis.com/runtimeoptions.v1.Options",
            encode_runtime_options("", body),
        )))
        .unwrap();
        assert_eq!(cfg.runc.binary_name, "/opt/runc");
        assert!(cfg.runc.systemd_cgroup);
        assert_eq!(cfg.runc.io_uid, 1000);
        assert!(!cfg.baton.ebpf);
        assert_eq!(cfg.baton.freezer, Freezer::Signal);
        assert_eq!(cfg.baton.role, None);
        assert_eq!(cfg.baton.trace_prefix, "/dev/fake");
        assert!(cfg.unknown_keys.is_empty());
    }

    #[test]
    fn an_unknown_key_names_itself_and_the_known_ones() {
        let body = encode_runtime_options("", "ebpf = true\nColour = 3\n");
        let err = decode_options(Some(&any("runtimeoptions.v1.Options", body)))
            .unwrap_err()
            .to_string();
        assert!(err.contains("\"Colour\""), "{err}");
        assert!(err.contains("known keys are BinaryName"), "{err}");
        assert!(
            err.contains("wait-gpu-free") && err.contains("SystemdCgroup"),
            "{err}"
        );
    }

    #[test]
    fn the_config_path_file_comes_first_and_the_body_overrides_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("baton.toml");
        std::fs::write(&path, "freezer = \"signal\"\nebpf = false\n").unwrap();
        let path = path.to_str().unwrap();
        let body = format!("ConfigPath = \"{path}\"\nebpf = true\n");
        let bytes = encode_runtime_options(path, &body);
        let cfg = decode_options(Some(&any("runtimeoptions.v1.Options", bytes))).unwrap();
        assert_eq!(cfg.baton.freezer, Freezer::Signal);
        assert!(cfg.baton.ebpf);
        std::fs::write(dir.path().join("baton.toml"), "Colour = 1\n").unwrap();
        let err = decode_options(Some(&any(
            "runtimeoptions.v1.Options",
            encode_runtime_options(path, ""),
        )))
        .unwrap_err()
        .to_string();
        assert!(
            err.contains(&format!("options file {path}")) && err.contains("Colour"),
            "{err}"
        );
    }

    #[test]
    fn runtime_options_config_path_is_read_when_body_is_empty() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("baton.toml");
        std::fs::write(&path, "NoPivotRoot = true\n").unwrap();
        let bytes = encode_runtime_options(path.to_str().unwrap(), "");
        let cfg = decode_options(Some(&any("runtimeoptions.v1.Options", bytes))).unwrap();
        assert!(cfg.runc.no_pivot_root);
    }

    #[test]
    fn malformed_toml_and_bad_types_name_the_problem() {
        let err = parse_toml_options("ebpf = ").unwrap_err();
        assert!(err.to_string().contains("options TOML"), "{err}");
        let err = parse_toml_options("ebpf = \"maybe\"").unwrap_err();
        assert!(err.to_string().contains("ebpf"), "{err}");
        let err = parse_toml_options("freezer = \"ice\"").unwrap_err();
        assert!(err.to_string().contains("freezer"), "{err}");
        let err = parse_toml_options("IoUid = -1").unwrap_err();
        assert!(err.to_string().contains("IoUid"), "{err}");
    }

    #[test]
    fn unknown_type_url_is_refused() {
        let err = decode_options(Some(&any("foo.Bar", vec![1, 2]))).unwrap_err();
        assert!(matches!(err, ShimError::InvalidArgument(_)));
        assert!(decode_options(None).is_ok());
    }

    #[test]
    fn container_annotations_override_pod_which_overrides_node() {
        let node = BatonSettings::default();
        let pod: HashMap<String, String> = [
            ("baton.io/launch-blocking".to_string(), "false".to_string()),
            ("baton.io/freezer".to_string(), "signal".to_string()),
        ]
        .into();
        let pod_settings = node.with_annotations(&pod, "pod").unwrap();
        assert!(!pod_settings.launch_blocking);
        let ctr: HashMap<String, String> = [
            ("baton.io/launch-blocking".to_string(), "true".to_string()),
            ("other.io/x".to_string(), "y".to_string()),
        ]
        .into();
        let c = pod_settings.with_annotations(&ctr, "container").unwrap();
        assert!(c.launch_blocking);
        assert_eq!(c.freezer, Freezer::Signal);
    }

    #[test]
    fn a_pods_gate_role_and_preemption_are_its_containers_not_its_sandboxs() {
        let pod: HashMap<String, String> = [
            ("baton.io/role", "latency-critical"),
            ("baton.io/wait-gpu-free", "1m"),
            ("baton.io/park-when-idle", "30s"),
            ("baton.io/freezer", "signal"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        let pod_settings = BatonSettings::default()
            .with_annotations(&pod, "pod")
            .unwrap();
        assert!(pod_settings.wait_gpu_free.is_some() && pod_settings.role.is_some());
        let sandbox = pod_settings.for_sandbox();
        assert_eq!(sandbox.wait_gpu_free, None);
        assert_eq!(sandbox.role, None);
        assert_eq!(sandbox.park_when_idle, None);
        assert!(!sandbox.launch_blocking);
        // What is not about GPU work stays the pod's.
        assert_eq!(sandbox.freezer, Freezer::Signal);
    }

    #[test]
    fn an_unknown_annotation_names_itself_and_the_known_ones() {
        let typo: HashMap<String, String> =
            [("baton.io/sparkle".to_string(), "1".to_string())].into();
        let err = BatonSettings::default()
            .with_annotations(&typo, "pod")
            .unwrap_err()
            .to_string();
        assert!(err.contains("pod annotation \"baton.io/sparkle\""), "{err}");
        assert!(
            err.contains("baton.io/role") && err.contains("baton.io/freezer"),
            "{err}"
        );
        assert!(
            !err.contains("baton.io/agent_socket") && !err.contains("baton.io/ebpf"),
            "node-only keys are not offered: {err}"
        );
    }

    #[test]
    fn preemptible_and_priority_reach_a_co_runners_role_spec_and_bad_values_name_the_key() {
        let a: HashMap<String, String> = [
            ("baton.io/role".to_string(), "co-runner".to_string()),
            ("baton.io/preemptible".to_string(), "snapshot".to_string()),
            ("baton.io/priority".to_string(), "-3".to_string()),
        ]
        .into();
        let c = BatonSettings::default()
            .with_annotations(&a, "container")
            .unwrap();
        let spec = c.role_spec().unwrap();
        assert_eq!(spec.preemptible, Some(PreemptMode::Snapshot));
        assert_eq!(spec.priority, -3);
        // A server is never preempted by the agent, whatever its annotations say.
        let server: HashMap<String, String> = [
            ("baton.io/role".to_string(), "latency-critical".to_string()),
            ("baton.io/preemptible".to_string(), "park".to_string()),
        ]
        .into();
        let s = BatonSettings::default()
            .with_annotations(&server, "pod")
            .unwrap();
        assert_eq!(s.role_spec().unwrap().preemptible, None);
        for (key, value, expected) in [
            ("baton.io/preemptible", "yes", "\"park\" or \"snapshot\""),
            ("baton.io/priority", "high", "an integer"),
            ("baton.io/priority", "99999999999", "an integer"),
        ] {
            let bad: HashMap<String, String> = [(key.to_string(), value.to_string())].into();
            let err = BatonSettings::default()
                .with_annotations(&bad, "container")
                .unwrap_err()
                .to_string();
            let short = key.trim_start_matches("baton.io/");
            assert!(
                err.contains(&format!("container annotation {short}=")) && err.contains(expected),
                "{err}"
            );
        }
    }

    #[test]
    fn role_annotations_make_a_role_spec() {
        let a: HashMap<String, String> = [
            ("baton.io/role".to_string(), "co-runner".to_string()),
            (
                "baton.io/yields-to".to_string(),
                "srv, k8s.io/llm ,".to_string(),
            ),
        ]
        .into();
        let c = BatonSettings::default()
            .with_annotations(&a, "container")
            .unwrap();
        let spec = c.role_spec().unwrap();
        assert_eq!(spec.role, Role::CoRunner);
        assert_eq!(
            spec.yields_to,
            vec!["srv".to_string(), "k8s.io/llm".to_string()]
        );
        assert!(spec.launch_blocking);
        let opt_out: HashMap<String, String> =
            [("baton.io/launch-blocking".to_string(), "false".to_string())].into();
        let c = c.with_annotations(&opt_out, "container").unwrap();
        assert!(!c.role_spec().unwrap().launch_blocking);
        let server: HashMap<String, String> =
            [("baton.io/role".to_string(), "latency-critical".to_string())].into();
        let s = BatonSettings::default()
            .with_annotations(&server, "container")
            .unwrap();
        let spec = s.role_spec().unwrap();
        assert!(!spec.launch_blocking && spec.yields_to.is_empty());
        assert!(BatonSettings::default().role_spec().is_none());
        let bad: HashMap<String, String> =
            [("baton.io/role".to_string(), "boss".to_string())].into();
        let err = BatonSettings::default()
            .with_annotations(&bad, "pod")
            .unwrap_err();
        assert!(err.to_string().contains("latency-critical"), "{err}");
    }

    #[test]
    fn a_park_freezes_unless_it_is_an_idle_park_or_the_nodes_park_freeze_says_otherwise() {
        let d = BatonSettings::default();
        assert!(d.park_freezes(false), "a park for a server freezes");
        assert!(!d.park_freezes(true), "an idle park does not (probes)");
        for (value, freezes) in [("false", false), ("true", true)] {
            let s = parse_toml_options(&format!("park-freeze = \"{value}\"\n"))
                .unwrap()
                .baton;
            assert_eq!(
                (s.park_freezes(false), s.park_freezes(true)),
                (freezes, freezes)
            );
        }
        // A tenant does not opt out of the freeze (issue 39): the annotation is refused, naming the TOML.
        for layer in ["pod", "container"] {
            let a: HashMap<String, String> =
                [("baton.io/park-freeze".to_string(), "false".to_string())].into();
            let err = d.with_annotations(&a, layer).unwrap_err().to_string();
            assert!(
                err.contains("not allowed in annotations") && err.contains("options TOML"),
                "{err}"
            );
        }
        let err = parse_toml_options("park-freeze = \"sometimes\"\n").unwrap_err();
        assert!(
            err.to_string().contains("park-freeze") && err.to_string().contains("true or false"),
            "{err}"
        );
    }

    #[test]
    fn unparsable_annotation_names_the_key() {
        let bad: HashMap<String, String> =
            [("baton.io/freezer".to_string(), "perhaps".to_string())].into();
        let err = BatonSettings::default()
            .with_annotations(&bad, "container")
            .unwrap_err();
        assert!(err.to_string().contains("freezer") && err.to_string().contains("container"));
    }

    #[test]
    fn what_the_probes_see_is_the_nodes_to_decide() {
        for (key, value) in [
            ("baton.io/ebpf", "false"),
            ("baton.io/trace_prefix", "/elsewhere/nvidia"),
        ] {
            let a: HashMap<String, String> = [(key.to_string(), value.to_string())].into();
            let err = BatonSettings::default()
                .with_annotations(&a, "pod")
                .unwrap_err()
                .to_string();
            assert!(err.contains(key) && err.contains("options TOML"), "{err}");
        }
        let cfg = parse_toml_options("ebpf = false\ntrace_prefix = \"/gpu/nvidia\"\n").unwrap();
        assert!(!cfg.baton.ebpf);
        assert_eq!(cfg.baton.trace_prefix, "/gpu/nvidia");
    }

    #[test]
    fn a_wait_for_a_free_gpu_is_bounded() {
        let huge: HashMap<String, String> = [(
            "baton.io/wait-gpu-free".to_string(),
            "18446744073709551615s".to_string(),
        )]
        .into();
        let err = BatonSettings::default()
            .with_annotations(&huge, "container")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("wait-gpu-free") && err.contains("24h"),
            "{err}"
        );
        let day: HashMap<String, String> =
            [("baton.io/wait-gpu-free".to_string(), "24h".to_string())].into();
        let ok = BatonSettings::default()
            .with_annotations(&day, "container")
            .unwrap();
        assert_eq!(ok.wait_gpu_free, Some(MAX_WAIT_GPU_FREE));
    }

    #[test]
    fn annotations_cannot_name_a_program_for_the_shim() {
        let evil: HashMap<String, String> = [(
            "baton.io/cuda_checkpoint_path".to_string(),
            "/tmp/evil".to_string(),
        )]
        .into();
        for layer in ["pod", "container"] {
            let err = BatonSettings::default()
                .with_annotations(&evil, layer)
                .unwrap_err()
                .to_string();
            assert!(err.contains("baton.io/cuda_checkpoint_path"), "{err}");
            assert!(err.contains("options TOML"), "{err}");
        }
        let cfg = parse_toml_options("cuda_checkpoint_path = \"/opt/cuda-checkpoint\"\n").unwrap();
        assert_eq!(
            cfg.baton.cuda_checkpoint_path,
            PathBuf::from("/opt/cuda-checkpoint")
        );
    }

    #[test]
    fn the_cuda_driver_library_comes_from_the_node_only_and_empty_turns_the_api_off() {
        let tenant: HashMap<String, String> = [(
            "baton.io/cuda_driver_path".to_string(),
            "/tmp/evil.so".to_string(),
        )]
        .into();
        let err = BatonSettings::default()
            .with_annotations(&tenant, "container")
            .unwrap_err()
            .to_string();
        assert!(err.contains("baton.io/cuda_driver_path"), "{err}");
        assert_eq!(
            BatonSettings::default().cuda_driver_path.as_deref(),
            Some("libcuda.so.1")
        );
        let cfg = parse_toml_options("cuda_driver_path = \"/opt/nvidia/libcuda.so.1\"\n").unwrap();
        assert_eq!(
            cfg.baton.cuda_driver_path.as_deref(),
            Some("/opt/nvidia/libcuda.so.1")
        );
        let cfg = parse_toml_options("cuda_driver_path = \"\"\n").unwrap();
        assert_eq!(cfg.baton.cuda_driver_path, None);
        let err = parse_toml_options("cuda_driver_path = \"lib/libcuda.so.1\"\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("absolute"), "{err}");
    }

    #[test]
    fn the_cuda_checkpoint_and_lock_timeouts_come_from_the_node_only() {
        for key in ["cuda_checkpoint_timeout", "cuda_lock_timeout"] {
            let tenant: HashMap<String, String> =
                [(format!("baton.io/{key}"), "1ms".to_string())].into();
            let err = BatonSettings::default()
                .with_annotations(&tenant, "container")
                .unwrap_err()
                .to_string();
            assert!(err.contains(&format!("baton.io/{key}")), "{err}");
        }
        let cfg = parse_toml_options("cuda_lock_timeout = \"3s\"\n").unwrap();
        assert_eq!(
            cfg.baton.cuda_lock_timeout,
            std::time::Duration::from_secs(3)
        );
        let cfg = parse_toml_options("cuda_checkpoint_timeout = \"90s\"\n").unwrap();
        assert_eq!(
            cfg.baton.cuda_checkpoint_timeout,
            std::time::Duration::from_secs(90)
        );
        assert_eq!(
            BatonSettings::default().cuda_checkpoint_timeout,
            DEFAULT_CUDA_CHECKPOINT_TIMEOUT
        );
        assert!(parse_toml_options("cuda_checkpoint_timeout = \"0s\"\n").is_err());
    }

    #[test]
    fn park_when_idle_is_a_servers_duration_and_a_co_runner_does_not_register_it() {
        let annotations: HashMap<String, String> = [
            ("baton.io/role".to_string(), "latency-critical".to_string()),
            ("baton.io/park-when-idle".to_string(), "30s".to_string()),
        ]
        .into();
        let s = BatonSettings::default()
            .with_annotations(&annotations, "container")
            .unwrap();
        assert_eq!(s.role_spec().unwrap().park_when_idle_ms, Some(30_000));
        let co = BatonSettings {
            role: Some(Role::CoRunner),
            ..s
        };
        assert_eq!(co.role_spec().unwrap().park_when_idle_ms, None);
        for value in ["0s", "8days", "100000000000000h"] {
            let bad: HashMap<String, String> =
                [("baton.io/park-when-idle".to_string(), value.to_string())].into();
            let e = BatonSettings::default()
                .with_annotations(&bad, "container")
                .unwrap_err()
                .to_string();
            assert!(e.contains("at most 7 days"), "{value}: {e}");
        }
    }

    #[test]
    fn the_rate_gate_comes_from_the_node_only_and_is_bounded() {
        assert_eq!(BatonSettings::default().rate_gate, None);
        let cfg = parse_toml_options("gap_fill_min_share = \"0.5\"\n").unwrap();
        let gate = cfg.baton.rate_gate.unwrap();
        assert_eq!(gate.min_share, 0.5);
        assert_eq!(gate.window_s, 3600.0, "the default window");
        let cfg = parse_toml_options("gap_fill_window = \"10s\"\n").unwrap();
        assert_eq!(cfg.baton.rate_gate.unwrap().window_s, 10.0);
        assert_eq!(cfg.baton.rate_gate.unwrap().min_share, 0.25);
        let cfg = parse_toml_options("gap_fill_min_share = 0.75\n").unwrap();
        assert_eq!(
            cfg.baton.rate_gate.unwrap().min_share,
            0.75,
            "a TOML number"
        );
        for bad in [
            "gap_fill_min_share = \"1.5\"\n",
            "gap_fill_min_share = \"NaN\"\n",
            "gap_fill_window = \"0s\"\n",
        ] {
            assert!(parse_toml_options(bad).is_err(), "{bad}");
        }
        let annotations: HashMap<String, String> =
            [("baton.io/gap_fill_min_share".to_string(), "0.9".to_string())].into();
        let err = BatonSettings::default()
            .with_annotations(&annotations, "container")
            .unwrap_err()
            .to_string();
        assert!(err.contains("baton.io/gap_fill_min_share"), "{err}");
    }

    #[test]
    fn a_containers_gpu_memory_is_a_quantity_and_the_headroom_the_nodes() {
        let a =
            |k: &str, v: &str| -> HashMap<String, String> { [(k.to_owned(), v.to_owned())].into() };
        let s = BatonSettings::default()
            .with_annotations(&a("baton.io/gpu-memory", "24Gi"), "container")
            .unwrap();
        assert_eq!(s.gpu_memory, Some(24 << 30));
        assert_eq!(
            s.for_sandbox().gpu_memory,
            None,
            "the pause process needs none"
        );
        let err = BatonSettings::default()
            .with_annotations(&a("baton.io/gpu-memory", "24GB"), "container")
            .unwrap_err()
            .to_string();
        assert!(err.contains("24Gi") && err.contains("quantity"), "{err}");
        let cfg = parse_toml_options("gpu_memory_headroom = \"2Gi\"\n").unwrap();
        assert_eq!(cfg.baton.gpu_memory_headroom, Some(2 << 30));
        let err = BatonSettings::default()
            .with_annotations(&a("baton.io/gpu_memory_headroom", "0"), "pod")
            .unwrap_err()
            .to_string();
        assert!(err.contains("not allowed in annotations"), "{err}");
        let cfg = parse_toml_options("gpu_memory_minimum = \"1Gi\"\n").unwrap();
        assert_eq!(cfg.baton.gpu_memory_minimum, Some(1 << 30));
        let err = BatonSettings::default()
            .with_annotations(&a("baton.io/gpu_memory_minimum", "1"), "pod")
            .unwrap_err()
            .to_string();
        assert!(err.contains("not allowed in annotations"), "{err}");
        let cfg = parse_toml_options("parked_host_memory_budget = \"64Gi\"\n").unwrap();
        assert_eq!(cfg.baton.parked_host_memory_budget, Some(64 << 30));
        let err = BatonSettings::default()
            .with_annotations(&a("baton.io/parked_host_memory_budget", "1Ei"), "pod")
            .unwrap_err()
            .to_string();
        assert!(err.contains("not allowed in annotations"), "{err}");
    }

    #[test]
    fn the_snapshot_dir_is_a_node_default_on_disk_absolute_and_node_only() {
        assert_eq!(
            BatonSettings::default().snapshot_dir,
            PathBuf::from("/var/lib/baton/snapshots")
        );
        let cfg = parse_toml_options("snapshot_dir = \"/data/baton-snapshots\"\n").unwrap();
        assert_eq!(
            cfg.baton.snapshot_dir,
            PathBuf::from("/data/baton-snapshots")
        );
        let err = parse_toml_options("snapshot_dir = \"snapshots\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("snapshot_dir") && err.contains("absolute"),
            "{err}"
        );
        let tenant: HashMap<String, String> =
            [("baton.io/snapshot_dir".to_string(), "/tmp/x".to_string())].into();
        let err = BatonSettings::default()
            .with_annotations(&tenant, "container")
            .unwrap_err()
            .to_string();
        assert!(err.contains("baton.io/snapshot_dir"), "{err}");
    }

    #[test]
    fn criu_is_a_node_only_absolute_path_and_defaults_to_the_cached_one_where_it_exists() {
        let cfg = parse_toml_options("criu_path = \"/opt/criu/bin/criu\"\n").unwrap();
        assert_eq!(
            cfg.baton.criu_program(),
            Some(PathBuf::from("/opt/criu/bin/criu"))
        );
        let err = parse_toml_options("criu_path = \"criu\"\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("criu_path") && err.contains("absolute"),
            "{err}"
        );
        let tenant: HashMap<String, String> =
            [("baton.io/criu_path".to_string(), "/tmp/x".to_string())].into();
        let err = BatonSettings::default()
            .with_annotations(&tenant, "container")
            .unwrap_err()
            .to_string();
        assert!(err.contains("baton.io/criu_path"), "{err}");
        let cached = Path::new(baton_agent_api::option_keys::DEFAULT_CRIU_PATH);
        assert_eq!(
            BatonSettings::default().criu_program(),
            cached.exists().then(|| cached.to_path_buf())
        );
    }

    #[test]
    fn legacy_create_options_map_onto_runc_options() {
        let mut value = Vec::new();
        let mut os = containerd_shim_protos::protobuf::CodedOutputStream::vec(&mut value);
        os.write_bool(1, true).unwrap();
        os.write_bool(2, true).unwrap(); // open_tcp: no runc option carries it
        os.write_string(6, "network").unwrap();
        os.write_string(6, "ipc").unwrap();
        os.write_bool(8, true).unwrap();
        os.write_string(9, "/shims").unwrap();
        os.write_uint32(10, 100000).unwrap();
        os.write_uint32(11, 100001).unwrap();
        os.write_string(12, "/work").unwrap();
        os.write_string(13, "/image").unwrap();
        os.write_uint64(99, 5).unwrap(); // unknown field must be skipped
        os.flush().unwrap();
        drop(os);
        let cfg = decode_options(Some(&any("containerd.linux.runc.CreateOptions", value))).unwrap();
        let r = &cfg.runc;
        assert!(r.no_pivot_root && r.no_new_keyring);
        assert_eq!(r.shim_cgroup, "/shims");
        assert_eq!((r.io_uid, r.io_gid), (100000, 100001));
        assert_eq!(r.criu_work_path, "/work");
        assert_eq!(r.criu_image_path, "/image");
        assert!(r.binary_name.is_empty());
        assert_eq!(
            cfg.unknown_keys,
            vec![
                "CreateOptions.open_tcp (not supported; ignored)".to_string(),
                "CreateOptions.empty_namespaces (not supported; ignored)".to_string(),
            ]
        );
        let empty = decode_options(Some(&any("containerd.linux.runc.CreateOptions", vec![])));
        assert!(empty.unwrap().unknown_keys.is_empty());
        let truncated = decode_legacy_create_options(&[0x4a, 0x10, b'x']).unwrap_err();
        assert!(
            truncated.to_string().contains("CreateOptions"),
            "{truncated}"
        );
    }
}
