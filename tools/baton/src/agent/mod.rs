//! `baton agent`: the node's one owner of the probes, the watched containers' fd mirrors and ledgers, and
//! the acquired/released signal. Shims register their containers over its socket (docs/api.md); the CLI
//! reads `status` and `watch` there.
//!
//! Started by a DaemonSet, by hand (foreground, for debugging), or by the first shim that finds nothing on
//! the socket (`--daemon`: detached, one instance guaranteed by the lock next to the socket).
mod core;
mod daemon;
mod gate;
mod nvml;
mod preempt;
mod server;
mod trace_session;
mod watched;

use std::{os::unix::fs::PermissionsExt, path::PathBuf};

use anyhow::{Context, bail};
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
}

/// Runs the agent until SIGTERM or SIGINT.
pub async fn run(args: AgentArgs) -> anyhow::Result<()> {
    if !nix::unistd::geteuid().is_root() {
        bail!("baton agent needs root: it loads eBPF programs and reads other processes' /proc");
    }
    let socket = args.socket.unwrap_or_else(baton_agent_api::default_socket);
    let dir = socket
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    if args.daemon {
        let log = args.log_file.unwrap_or_else(|| dir.join("agent.log"));
        daemon::detach(&log)?;
    }
    let _lock = match daemon::take_lock(&socket)? {
        daemon::LockOutcome::Taken(lock) => lock,
        daemon::LockOutcome::Held(pid) => {
            let who = pid.map_or_else(String::new, |p| format!(" (pid {p})"));
            let lock = daemon::lock_path(&socket);
            if args.daemon {
                tracing::info!(
                    "agent: another agent{who} holds {}; exiting",
                    lock.display()
                );
                return Ok(());
            }
            bail!(
                "another baton agent{who} serves {} (it holds {})",
                socket.display(),
                lock.display()
            );
        }
    };
    // Holding the lock, whatever is at the socket path is a dead agent's.
    let _ = std::fs::remove_file(&socket);
    let listener = UnixListener::bind(&socket)
        .with_context(|| format!("cannot listen on {}", socket.display()))?;
    std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("cannot restrict {} to root", socket.display()))?;
    tracing::info!(
        "agent: listening on {} (pid {})",
        socket.display(),
        std::process::id()
    );

    let (events, _) = broadcast::channel(4096);
    let (commands, rx) = mpsc::channel(64);
    let core = tokio::spawn(self::core::Core::new(events.clone()).run(rx));
    let mut term = signal(SignalKind::terminate()).context("SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("SIGINT handler")?;
    let result = tokio::select! {
        r = server::serve(listener, commands, events) => r.context("accepting connections"),
        _ = term.recv() => Ok(()),
        _ = int.recv() => Ok(()),
    };
    core.abort();
    let _ = std::fs::remove_file(&socket);
    tracing::info!("agent: stopped");
    result
}
