//! The shim server (containerd runs the binary with no action after `start`): serves the Task
//! API on the socket under both `containerd.task.v2.Task` (containerd 1.6/1.7) and
//! `containerd.task.v3.Task` (containerd 2.x), reaps children for the exit monitor, and exits
//! once Shutdown, SIGTERM or SIGINT signals it (see [`crate::service::TaskService::shutdown_on_signal`]).

use std::{os::unix::net::UnixListener, path::Path, sync::Arc};

use anyhow::{Context as _, Result};
use containerd_shim::{
    Flags, Shim,
    asynchronous::util::write_str_to_file,
    protos::{
        shim_async::{Client, create_task},
        ttrpc::r#async::{Server, transport::Listener},
    },
};
use tokio::signal::unix::{SignalKind, signal};

use crate::{shim::BatonShim, shim::SHIM_CGROUP_ENV};

const TASK_V3: &str = "containerd.task.v3.Task";
const TASK_V2: &str = "containerd.task.v2.Task";

fn socket_path(address: &str) -> &str {
    address.strip_prefix("unix://").unwrap_or(address)
}

/// Binds the socket. `None` when another live shim already serves it (then this one exits).
async fn bind(address: &str) -> Result<Option<UnixListener>> {
    let path = socket_path(address);
    if let Some(dir) = Path::new(path).parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    }
    match UnixListener::bind(path) {
        Ok(l) => Ok(Some(l)),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
            if Client::connect(address).await.is_ok() {
                write_str_to_file("address", address).await?;
                return Ok(None);
            }
            std::fs::remove_file(path).with_context(|| format!("remove stale socket {path}"))?;
            Ok(Some(
                UnixListener::bind(path).with_context(|| format!("bind {path}"))?,
            ))
        }
        Err(e) => Err(e).with_context(|| format!("bind {path}")),
    }
}

/// Runs the shim server until Shutdown.
pub async fn serve(flags: Flags) -> Result<()> {
    nix::sys::prctl::set_child_subreaper(true).context("become child subreaper")?;
    // Listening is enough to keep SIGPIPE's default action (exit) from happening.
    let mut pipe = signal(SignalKind::pipe()).context("install signal handler")?;
    tokio::spawn(async move { while pipe.recv().await.is_some() {} });
    let mut terminate = signal(SignalKind::terminate()).context("install signal handler")?;
    let mut interrupt = signal(SignalKind::interrupt()).context("install signal handler")?;
    tokio::spawn(crate::reaper::reap_children());
    if let Ok(cgroup) = std::env::var(SHIM_CGROUP_ENV)
        && let Err(e) = containerd_shim::cgroup::add_task_to_cgroup(&cgroup, std::process::id())
    {
        tracing::warn!(%cgroup, error = %e, "cannot move the shim into ShimCgroup");
    }
    let ttrpc_address = std::env::var("TTRPC_ADDRESS").context("TTRPC_ADDRESS not set")?;
    let mut config = containerd_shim::Config::default();
    let mut shim = BatonShim::new(crate::RUNTIME_ID, &flags, &mut config).await;
    let service = Arc::new(shim.task_service(&ttrpc_address));
    let on_signal = service.clone();
    tokio::spawn(async move {
        let name = tokio::select! {
            _ = terminate.recv() => "SIGTERM",
            _ = interrupt.recv() => "SIGINT",
        };
        on_signal.shutdown_on_signal(name).await;
    });

    let Some(listener) = bind(&flags.socket).await? else {
        signal_started();
        return Ok(());
    };
    let listener = Listener::try_from(listener).context("ttrpc listener")?;
    let mut v2 = create_task(service.clone());
    if let Some(svc) = v2.remove(TASK_V3) {
        v2.insert(TASK_V2.to_string(), svc);
    }
    let mut server = Server::new()
        .add_listener(listener)
        .register_service(create_task(service))
        .register_service(v2);
    server.start().await.context("start ttrpc server")?;
    signal_started();
    tracing::info!(socket = %flags.socket, "shim serving");
    containerd_shim::Shim::wait(&mut shim).await;
    tracing::info!("shim shutting down");
    let _ = server.shutdown().await;
    let _ = std::fs::remove_file(socket_path(&flags.socket));
    Ok(())
}

/// Closes stdout (containerd's `start` waits for EOF on it) by pointing it at stderr.
fn signal_started() {
    // SAFETY: dup2 on the process's own standard descriptors; no Rust object owns fd 1.
    let rc = unsafe { libc::dup2(libc::STDERR_FILENO, libc::STDOUT_FILENO) };
    if rc < 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(), "cannot close stdout");
    }
}
