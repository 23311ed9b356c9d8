//! The Baton node agent, `baton agent`: the node's one owner of the probes, the watched containers' fd
//! mirrors and ledgers, and the acquired/released signal. Shims register their containers over its socket
//! (docs/api.md); the CLI reads `status` and `watch` there. The `baton` CLI runs [`run`] for `baton agent`
//! and shares [`trace_output`] with it for `baton trace`.
//!
//! Started by a DaemonSet, by hand (foreground, for debugging), or by the first shim that finds nothing on
//! the socket (`--daemon`: detached, one instance guaranteed by the lock next to the socket).
mod control;
mod core;
mod daemon;
mod error;
mod gapfill;
mod gate;
mod holders;
mod metrics;
mod nvml;
mod pods;
mod preempt;
mod registry;
mod server;
pub mod trace_output;
mod trace_session;

pub use daemon::log_writer;
pub use error::AgentError;

use std::{
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
};

use error::{at, doing};
use tokio::{
    net::UnixListener,
    signal::unix::{SignalKind, signal},
    sync::{broadcast, mpsc},
};

/// Arguments of `baton agent`.
#[derive(clap::Args, Debug)]
pub struct AgentArgs {
    /// The socket to listen on (default: $BATON_AGENT_SOCKET, else /run/baton/agent.sock).
    #[arg(long)]
    socket: Option<PathBuf>,
    /// Detach (new session, root cgroups, log to --log-file) and exit quietly if an agent already runs.
    #[arg(long)]
    daemon: bool,
    /// The log file under --daemon (default: agent.log next to the socket).
    #[arg(long)]
    log_file: Option<PathBuf>,
    /// Under --daemon, the log file's size cap in bytes (at least 65536): before a line would pass it, the
    /// file becomes `<log>.1` (replacing the older one) and a new one starts.
    #[arg(long, default_value_t = 8 << 20, value_parser = clap::value_parser!(u64).range(65536..))]
    log_max_bytes: u64,
    /// Co-runner controller: never keep a co-runner frozen longer than this at a stretch (ms).
    #[arg(long, default_value_t = 1000)]
    max_frozen_ms: u64,
    /// Co-runner controller: the least share of time a co-runner runs, whatever the shield and the
    /// governor ask (after each --max-frozen-ms, and in each governor window).
    #[arg(long, default_value_t = 0.05)]
    min_run_share: f64,
    /// Co-runner controller: with no request event or token for this long (ms), drop the open requests
    /// and thaw the co-runners.
    #[arg(long, default_value_t = 1000)]
    input_silence_ms: u64,
    /// Co-runner controller: a shim thaws a co-runner by itself when the agent has not renewed its freeze
    /// for this long (ms): an agent that hangs leaves nothing frozen for longer.
    #[arg(long, default_value_t = baton_agent_api::DEFAULT_FREEZE_LEASE_MS)]
    freeze_lease_ms: u64,
    /// Serve Prometheus metrics at http://ADDR/metrics (IP:PORT; port 0 picks a free one), or `off`. A port
    /// that cannot be bound is logged and the agent runs without metrics.
    #[arg(long, default_value = metrics::DEFAULT_ADDR)]
    metrics_addr: metrics::MetricsAddr,
    /// A cgroup v2 path whose processes (and those of the cgroups below it) are the node's own GPU daemons
    /// (DCGM, a device plugin) and never count as holders of a GPU; repeatable. Processes outside any
    /// container (in the node's mount namespace) never count anyway.
    #[arg(long = "exempt-cgroup", value_name = "PATH")]
    exempt_cgroups: Vec<String>,
    /// A pod whose containers are the node's own GPU daemons (dcgm-exporter, the device plugin): NAMESPACE/NAME,
    /// NAME ending in `*` for the pods of a DaemonSet (gpu-operator/nvidia-dcgm-exporter-*) or `*` for the whole
    /// namespace; repeatable. Its processes never count as holders of a GPU. Read from containerd's bundles
    /// (see --containerd-state), never from what the container says.
    #[arg(long = "exempt-pod", value_name = "NAMESPACE/NAME")]
    exempt_pods: Vec<pods::PodPattern>,
    /// containerd's state directory on the node, where its bundles name each container's pod (read through
    /// /proc/1/root: the DaemonSet's agent needs no mount of it).
    #[arg(long, value_name = "DIR", default_value = pods::DEFAULT_CONTAINERD_STATE)]
    containerd_state: PathBuf,
    /// How many NVIDIA fds of one container the probes follow (16 to the map's size): a container past it
    /// (one that dups a device file tens of thousands of times) is followed through /proc alone, so that it
    /// cannot fill the probes' fd map and blind them for the other containers of the node.
    #[arg(long, default_value_t = baton_tracer::DEFAULT_FD_QUOTA,
          value_parser = clap::value_parser!(u32).range(16..=i64::from(baton_tracer::NV_FDS_ENTRIES)))]
    probe_fd_quota: u32,
    /// The NVML library for the cross-check of each release (`nvml_check` events) and `status`'s NVML
    /// column: a path, or a name the dynamic loader finds (default: libnvidia-ml.so.1, NVIDIA's). A node
    /// setting: where an image mounts the driver's libraries elsewhere (/usr/local/nvidia/lib64).
    #[arg(long, value_name = "PATH")]
    nvml_library: Option<PathBuf>,
    /// How long NVML may take to answer one release's cross-check (ms, 1 to 60000): past it the check says
    /// `timed_out`, and the next waits for that query within its own bound (NVML is asked one query at a
    /// time).
    #[arg(long, default_value_t = nvml::DEFAULT_QUERY_BOUND_MS,
          value_parser = clap::value_parser!(u64).range(1..=60_000))]
    nvml_timeout_ms: u64,
    /// Whether NVML, where the node has it, is the gate's floor: a GPU's room is never more than NVML's free
    /// memory less the headroom, and a Start that needs the whole GPU waits until NVML's used memory is back
    /// to the GPU's idle baseline. `false` leaves the gate to the ledgers alone (a tenant that hides an
    /// allocation from the probes is then believed).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "true|false")]
    nvml_floor: bool,
    /// How far (MiB) NVML's used memory of a GPU may be above its idle baseline for a Start that needs the
    /// whole GPU, and past the ledgers of the containers holding it before the agent counts a disagreement.
    #[arg(long, default_value_t = gate::floor::DEFAULT_TOLERANCE_MIB,
          value_parser = clap::value_parser!(u64).range(0..=1 << 20))]
    nvml_tolerance_mib: u64,
}

impl AgentArgs {
    /// The controller's bounds, checked.
    fn bounds(&self) -> Result<control::Bounds, AgentError> {
        if !(0.0..0.9).contains(&self.min_run_share) {
            return Err(AgentError::Options(
                "--min-run-share must be at least 0 and below 0.9".to_owned(),
            ));
        }
        let lease_max = baton_agent_api::MAX_FREEZE_LEASE_MS;
        if self.max_frozen_ms == 0
            || self.input_silence_ms == 0
            || !(30..=lease_max).contains(&self.freeze_lease_ms)
        {
            return Err(AgentError::Options(format!(
                "--max-frozen-ms and --input-silence-ms must be > 0, --freeze-lease-ms from 30 to \
                 {lease_max} (the longest lease a shim grants)"
            )));
        }
        Ok(control::Bounds {
            max_frozen_ns: self.max_frozen_ms * 1_000_000,
            min_run_share: self.min_run_share,
            input_silence_ns: self.input_silence_ms * 1_000_000,
            lease_ns: self.freeze_lease_ms * 1_000_000,
        })
    }
}

/// Runs the agent until SIGTERM or SIGINT.
pub async fn run(args: AgentArgs) -> Result<(), AgentError> {
    if !nix::unistd::geteuid().is_root() {
        return Err(AgentError::NotRoot);
    }
    let bounds = args.bounds()?;
    exit_on_panic();
    adopt_node_cgroup_paths();
    let socket = args
        .socket
        .clone()
        .unwrap_or_else(baton_agent_api::default_socket);
    let dir = socket_dir(&socket);
    std::fs::create_dir_all(&dir).map_err(at("cannot create", &dir))?;
    if args.daemon {
        let log = args
            .log_file
            .clone()
            .unwrap_or_else(|| dir.join("agent.log"));
        daemon::detach(&log, args.log_max_bytes)?;
    }
    let Some(_lock) = instance_lock(&socket, args.daemon)? else {
        return Ok(());
    };
    let listener = listen(&socket)?;
    warn_when_proc_is_unreadable();
    let result = serve_until_signal(listener, bounds, &args, &dir).await;
    let _ = std::fs::remove_file(&socket);
    tracing::info!("agent: stopped");
    result
}

/// Says at start when the agent cannot read what the node's init holds (/proc/1/maps, which the kernel's
/// ptrace access check guards as it does the links in /proc/1/fd): confined, or without CAP_SYS_PTRACE, it
/// cannot see who holds a GPU, and every process it cannot read counts as holding one (the gates stay shut,
/// naming them).
fn warn_when_proc_is_unreadable() {
    if let Err(e) = std::fs::read("/proc/1/maps") {
        tracing::warn!(
            "agent: cannot read /proc/1/maps ({e}): every process whose files it cannot read counts as \
             holding every GPU (the gates stay shut and name them): {}",
            holders::UNREADABLE_FIX
        );
    }
}

/// Where the agent runs in a cgroup namespace of its own (a pod on a cgroup v2 node), makes the cgroup paths
/// it reads from /proc/PID/cgroup the node's: they read relative to that namespace (`/../..` for other pods'),
/// while the shims register node paths and the node's hierarchy is mounted at /sys/fs/cgroup
/// (tools/kubernetes/baton-agent.yaml). The namespace's root is found in that hierarchy as the cgroup that
/// holds the agent; no other namespace is joined and no other process's /proc/PID/ns is read.
fn adopt_node_cgroup_paths() {
    let Ok(root) = baton_tracer::cgroups::find_v2_root() else {
        return;
    };
    match baton_tracer::cgroups::adopt_node_paths(&root) {
        Ok(Some(ns_root)) => tracing::info!(
            "agent: runs in a cgroup namespace of its own, rooted at {ns_root} in the node's hierarchy \
             ({}): cgroup paths read from /proc are taken as the node's",
            root.display()
        ),
        Ok(None) => {}
        Err(e) => tracing::warn!("agent: {e}"),
    }
}

/// The directory of `socket` (its lock and, under `--daemon`, its log go there).
fn socket_dir(socket: &Path) -> PathBuf {
    socket
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// Takes the lock that makes this the socket's one agent; `None` when another agent holds it and this one
/// is a `--daemon` (which then exits quietly).
fn instance_lock(socket: &Path, daemon: bool) -> Result<Option<daemon::InstanceLock>, AgentError> {
    let pid = match daemon::take_lock(socket)? {
        daemon::LockOutcome::Taken(lock) => return Ok(Some(lock)),
        daemon::LockOutcome::Held(pid) => pid,
    };
    let who = pid.map_or_else(String::new, |p| format!(" (pid {p})"));
    let lock = daemon::lock_path(socket);
    if daemon {
        tracing::info!(
            "agent: another agent{who} holds {}; exiting",
            lock.display()
        );
        return Ok(None);
    }
    Err(AgentError::AnotherAgent {
        who,
        socket: socket.display().to_string(),
        lock: lock.display().to_string(),
    })
}

/// Listens on `socket`, root only. Called holding the lock: whatever is at the path is a dead agent's.
fn listen(socket: &Path) -> Result<UnixListener, AgentError> {
    let _ = std::fs::remove_file(socket);
    let listener = UnixListener::bind(socket).map_err(at("cannot listen on", socket))?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600)).map_err(doing(
        format!("cannot restrict {} to root", socket.display()),
    ))?;
    tracing::info!(
        "agent: listening on {} (pid {})",
        socket.display(),
        std::process::id()
    );
    Ok(listener)
}

/// Starts the core, the controller and the metrics, and serves `listener` until SIGTERM or SIGINT.
async fn serve_until_signal(
    listener: UnixListener,
    bounds: control::Bounds,
    args: &AgentArgs,
    state_dir: &Path,
) -> Result<(), AgentError> {
    nvml::configure(args.nvml_library.clone());
    nvml::initialise_in_background();
    let (events, _) = broadcast::channel(4096);
    let (commands, rx) = mpsc::channel(64);
    nvml::start(
        commands.clone(),
        std::time::Duration::from_millis(args.nvml_timeout_ms),
    );
    let controller = control::spawn(bounds, commands.clone());
    let exempt = holders::Exempt {
        cgroups: args.exempt_cgroups.clone(),
        pods: pods::ExemptPods {
            patterns: args.exempt_pods.clone(),
            containerd_state: args.containerd_state.clone(),
        },
    };
    let mut core = self::core::Core::new(events.clone(), controller.clone(), exempt);
    core.fd_quota = args.probe_fd_quota;
    core.floor.off = !args.nvml_floor;
    core.floor.tolerance = args.nvml_tolerance_mib << 20;
    core.gapfill
        .rate
        .persist_at(&state_dir.join(RATE_GATE_FILE));
    let core = tokio::spawn(core.run(rx));
    metrics::spawn(&args.metrics_addr, commands.clone());
    let mut term = signal(SignalKind::terminate()).map_err(doing("SIGTERM handler"))?;
    let mut int = signal(SignalKind::interrupt()).map_err(doing("SIGINT handler"))?;
    let result = tokio::select! {
        r = server::serve(listener, commands, events, controller) => r.map_err(doing("accepting connections")),
        _ = term.recv() => Ok(()),
        _ = int.recv() => Ok(()),
    };
    core.abort();
    result
}

/// The rate gate's window, next to the socket (see `gapfill/rate_store.rs`).
const RATE_GATE_FILE: &str = "rate-gate.json";

/// The agent's exit status after a panic (sysexits' EX_SOFTWARE).
const EXIT_AFTER_PANIC: i32 = 70;

/// A panic in any task or thread of the agent ends the agent. Left to tokio, a panic ends only its task: the
/// core's, and every shim of the node was answered "the agent is stopping" from then on. A dead agent loses
/// its lock with its process; the shims reconnect, start a fresh agent and register their containers again,
/// and the new agent rebuilds their files and mappings from /proc.
fn exit_on_panic() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        report(info);
        tracing::error!(
            "agent: {info}: this is a bug (please report it with the lines above); the agent exits and the \
             next shim or client starts a fresh one"
        );
        std::process::exit(EXIT_AFTER_PANIC);
    }));
}

/// Resolves at `t`, or never without one: a `select!` branch for an optional deadline (the gate's, the
/// controller's next decision, the next launch lines).
async fn sleep_until_opt(t: Option<tokio::time::Instant>) {
    match t {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}
