//! How `baton agent` becomes the node's one agent: the lock that allows one instance per socket, and
//! detaching (`--daemon`) from whoever started it (a shim, inside a pod's cgroups and session).
use std::{
    fs::{File, OpenOptions},
    io::Write,
    os::unix::fs::OpenOptionsExt,
    path::{Path, PathBuf},
};

use anyhow::Context;
use nix::fcntl::{Flock, FlockArg};

/// The held instance lock (`<socket>.lock`); released when the agent exits, however it exits.
pub struct InstanceLock {
    _lock: Flock<File>,
}

/// Why the lock was not taken.
pub enum LockOutcome {
    /// This process is the agent.
    Taken(InstanceLock),
    /// Another agent holds it (its pid as it wrote it, if readable).
    Held(Option<u32>),
}

/// The lock file of the agent listening on `socket`.
pub fn lock_path(socket: &Path) -> PathBuf {
    let mut p = socket.as_os_str().to_owned();
    p.push(".lock");
    PathBuf::from(p)
}

/// Takes the instance lock without waiting and writes this process's pid into it.
pub fn take_lock(socket: &Path) -> anyhow::Result<LockOutcome> {
    let path = lock_path(socket);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("cannot open the agent's lock file {}", path.display()))?;
    match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(mut lock) => {
            lock.set_len(0)
                .and_then(|()| writeln!(&mut *lock, "{}", std::process::id()))
                .with_context(|| format!("cannot write {}", path.display()))?;
            Ok(LockOutcome::Taken(InstanceLock { _lock: lock }))
        }
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => {
            let pid = std::fs::read_to_string(&path)
                .ok()
                .and_then(|t| t.trim().parse().ok());
            Ok(LockOutcome::Held(pid))
        }
        Err((_, e)) => Err(anyhow::anyhow!("cannot lock {}: {e}", path.display())),
    }
}

/// Detaches this process: a session of its own, the root cgroups (so that killing the pod that started it
/// does not kill it), and stdout/stderr to `log` (appended).
pub fn detach(log: &Path) -> anyhow::Result<()> {
    // setsid fails only for a process group leader, which a freshly spawned child is not.
    let _ = nix::unistd::setsid();
    match baton_tracer::cgroups::move_to_root_cgroups(std::process::id()) {
        Ok(failed) => {
            for (root, e) in failed {
                tracing::warn!("agent: cannot leave my cgroup for {}: {e}", root.display());
            }
        }
        Err(e) => tracing::warn!("agent: cannot leave my cgroups: {e}"),
    }
    if let Some(dir) = log.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    let file = OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .open(log)
        .with_context(|| format!("cannot open the agent's log file {}", log.display()))?;
    nix::unistd::dup2_stdout(&file).context("redirecting stdout to the log file")?;
    nix::unistd::dup2_stderr(&file).context("redirecting stderr to the log file")?;
    Ok(())
}
