//! How `baton agent` becomes the node's one agent: the lock that allows one instance per socket, and
//! detaching (`--daemon`) from whoever started it (a shim, inside a pod's cgroups and session), with its
//! stdout and stderr to a log file that is bounded and rotated: the default one is on tmpfs (RAM), next to
//! the socket. Before a line that would take the file past its cap, it becomes `<log>.1` (the older one is
//! dropped) and a new file takes its place on stdout and stderr; the log's lines all go through
//! [`LogWriter`], which does that check.
use std::{
    fs::{File, OpenOptions},
    io::Write,
    os::{
        fd::{AsRawFd, BorrowedFd, RawFd},
        unix::fs::OpenOptionsExt,
    },
    path::{Path, PathBuf},
    sync::Mutex,
};

use nix::fcntl::{Flock, FlockArg};

use crate::error::{AgentError, at, doing};

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
pub fn take_lock(socket: &Path) -> Result<LockOutcome, AgentError> {
    let path = lock_path(socket);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&path)
        .map_err(at("cannot open the agent's lock file", &path))?;
    match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
        Ok(mut lock) => {
            lock.set_len(0)
                .and_then(|()| writeln!(&mut *lock, "{}", std::process::id()))
                .map_err(at("cannot write", &path))?;
            Ok(LockOutcome::Taken(InstanceLock { _lock: lock }))
        }
        Err((_, nix::errno::Errno::EWOULDBLOCK)) => {
            let pid = std::fs::read_to_string(&path)
                .ok()
                .and_then(|t| t.trim().parse().ok());
            Ok(LockOutcome::Held(pid))
        }
        Err((_, errno)) => Err(AgentError::Lock {
            path: path.display().to_string(),
            errno,
        }),
    }
}

/// Detaches this process: a session of its own, the root cgroups (so that killing the pod that started it
/// does not kill it), and stdout/stderr to `log` (appended), kept under `max_bytes` with one older file.
pub fn detach(log: &Path, max_bytes: u64) -> Result<(), AgentError> {
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
        std::fs::create_dir_all(dir).map_err(at("cannot create", dir))?;
    }
    let rotation = Rotation {
        path: log.to_owned(),
        max_bytes,
        fds: vec![libc::STDOUT_FILENO, libc::STDERR_FILENO],
    };
    rotation.reopen(false)?;
    *ROTATION.lock().unwrap_or_else(|p| p.into_inner()) = Some(rotation);
    Ok(())
}

/// The log under rotation, once the agent detached.
static ROTATION: Mutex<Option<Rotation>> = Mutex::new(None);

/// A log file on fixed fds (stdout, stderr) that is moved to `<path>.1` before it would exceed its cap.
#[derive(Debug)]
struct Rotation {
    path: PathBuf,
    max_bytes: u64,
    /// The fds that write to the log.
    fds: Vec<RawFd>,
}

impl Rotation {
    /// Opens the log (appended, or emptied) and puts it on every fd of the rotation.
    fn reopen(&self, truncate: bool) -> Result<(), AgentError> {
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&self.path)
            .map_err(at("cannot open the agent's log file", &self.path))?;
        if truncate {
            file.set_len(0).map_err(at("cannot empty", &self.path))?;
        }
        for fd in &self.fds {
            // SAFETY: both fds are open (the rotation's are stdout and stderr, or a test's own); dup2 only
            // makes `fd` point to the log file, atomically, and closes nothing else.
            if unsafe { libc::dup2(file.as_raw_fd(), *fd) } < 0 {
                let redirecting = format!("redirecting fd {fd} to {}", self.path.display());
                return Err(doing(redirecting)(std::io::Error::last_os_error()));
            }
        }
        Ok(())
    }

    /// The size of the log as its first fd sees it.
    fn size(&self) -> u64 {
        let Some(fd) = self.fds.first() else { return 0 };
        // SAFETY: as in `reopen`, the fd stays open while the rotation exists.
        let fd = unsafe { BorrowedFd::borrow_raw(*fd) };
        nix::sys::stat::fstat(fd).map_or(0, |st| u64::try_from(st.st_size).unwrap_or(0))
    }

    /// Rotates first when `len` more bytes would take the log past its cap.
    fn make_room(&self, len: usize) {
        let size = self.size();
        if size == 0 || size.saturating_add(len as u64) <= self.max_bytes {
            return;
        }
        let mut old = self.path.as_os_str().to_owned();
        old.push(".1");
        // A failed rename (the file removed by hand) starts a new file all the same.
        let _ = std::fs::rename(&self.path, PathBuf::from(old));
        let _ = self.reopen(true);
    }
}

/// The writer of the agent's log lines (stderr): keeps a detached agent's log file under its cap.
pub struct LogWriter;

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let rotation = ROTATION.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(r) = rotation.as_ref() {
            r.make_room(buf.len());
        }
        std::io::stderr().write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        std::io::stderr().flush()
    }
}

/// The agent's log writer, for `tracing_subscriber::fmt().with_writer`.
pub fn log_writer() -> LogWriter {
    LogWriter
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_is_rotated_before_it_would_pass_its_cap_and_keeps_one_old_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("agent.log");
        // A fd of this test that stands for stdout/stderr.
        let spare = File::open("/dev/null").unwrap();
        let fd = spare.as_raw_fd();
        let rotation = Rotation {
            path: path.clone(),
            max_bytes: 1000,
            fds: vec![fd],
        };
        rotation.reopen(false).unwrap();
        let line = format!("{}\n", "x".repeat(99));
        for _ in 0..35 {
            rotation.make_room(line.len());
            // SAFETY: `spare` owns fd and outlives this borrow.
            let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
            nix::unistd::write(borrowed, line.as_bytes()).unwrap();
        }
        let len = |p: &Path| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0);
        let old = dir.path().join("agent.log.1");
        assert!(len(&path) <= 1000, "{} bytes", len(&path));
        assert_eq!(
            len(&path),
            500,
            "3500 bytes: 1000, 1000, 1000, then 500 in the current file"
        );
        assert_eq!(len(&old), 1000);
        assert!(!dir.path().join("agent.log.2").exists());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
        drop(spare);
    }
}
