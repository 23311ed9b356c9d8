//! `binary://` logging, the Go shim's contract: the logging binary gets the process's stdout pipe on fd 3,
//! its stderr pipe on fd 4 and a ready pipe on fd 5 that it closes once it reads, with CONTAINER_ID and
//! CONTAINER_NAMESPACE in its environment. Nothing else of the shim's reaches it: every other shim fd is
//! close-on-exec, the ready pipe included, so the logger's close is the last one and the shim sees EOF.
//! The process's output counts as written out once the logger exited (it reads its pipes to their end and
//! exits), watched through a pidfd; Wait and TaskExit wait for that, bounded as for the other targets.

use std::{
    fs::File,
    os::fd::OwnedFd,
    path::Path,
    process::{Command, Stdio},
    time::Duration,
};

use command_fds::{CommandFdExt, FdMapping};

use crate::errors::{Result, ShimError};
use crate::io::{OutputDrain, Tracked};

/// How long a logging binary may take to signal it is ready (closing fd 5).
const READY_TIMEOUT: Duration = Duration::from_secs(10);

/// The logger's fds: stdout pipe, stderr pipe, ready pipe.
const STDOUT_FD: i32 = 3;
const STDERR_FD: i32 = 4;
const READY_FD: i32 = 5;

/// A dup of `fd`, or `/dev/null` for a stream the process does not have.
fn fd_or_null(fd: Option<&OwnedFd>) -> Result<OwnedFd> {
    match fd {
        Some(fd) => fd.try_clone().map_err(|e| ShimError::io("dup log pipe", e)),
        None => File::open("/dev/null")
            .map(OwnedFd::from)
            .map_err(|e| ShimError::io("open /dev/null", e)),
    }
}

/// Starts the logging binary `path` with `args` on the read ends of the process's `stdout` and
/// `stderr` pipes, and waits until it closes its ready fd.
pub async fn start(
    path: &Path,
    args: &[String],
    stdout: Option<&OwnedFd>,
    stderr: Option<&OwnedFd>,
    id: &str,
    namespace: &str,
    output: &OutputDrain,
) -> Result<()> {
    let (ready_r, ready_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
        .map_err(|e| ShimError::io("create logger ready pipe", e.into()))?;
    let mappings = vec![
        FdMapping {
            parent_fd: fd_or_null(stdout)?,
            child_fd: STDOUT_FD,
        },
        FdMapping {
            parent_fd: fd_or_null(stderr)?,
            child_fd: STDERR_FD,
        },
        FdMapping {
            parent_fd: ready_w,
            child_fd: READY_FD,
        },
    ];
    let mut cmd = Command::new(path);
    cmd.args(args)
        .env("CONTAINER_ID", id)
        .env("CONTAINER_NAMESPACE", namespace)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .fd_mappings(mappings)
        .map_err(|e| ShimError::Other(format!("logging binary fds: {e}")))?;
    let child = cmd
        .spawn()
        .map_err(|e| ShimError::io(format!("start logging binary {}", path.display()), e))?;
    // The command owns the parent's copies of the mapped fds: drop them, so that the ready pipe's
    // only write end left is the logger's.
    drop(cmd);
    tracing::debug!(pid = child.id(), binary = %path.display(), "logging binary started");
    watch_exit(&child, output.track(tokio::io::empty()));
    // The shim's reaper collects the logger when it exits.
    let ready = tokio::task::spawn_blocking(move || {
        let mut buf = [0u8; 1];
        std::io::Read::read(&mut File::from(ready_r), &mut buf)
    });
    match tokio::time::timeout(READY_TIMEOUT, ready).await {
        Ok(_) => Ok(()),
        Err(_) => Err(ShimError::Other(format!(
            "logging binary {} did not close its ready fd ({READY_FD}) within {READY_TIMEOUT:?}",
            path.display()
        ))),
    }
}

/// Keeps `open` (the process's output, as [`OutputDrain`] counts it) until the logger `child` exited. The pidfd is
/// opened at once, before the logger can have read its pipes to their end; a logger already gone (it failed
/// at start) holds nothing.
fn watch_exit(child: &std::process::Child, open: Tracked<tokio::io::Empty>) {
    let Some(pid) = rustix::process::Pid::from_raw(child.id() as i32) else {
        return;
    };
    let pidfd = match rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::NONBLOCK) {
        Ok(fd) => fd,
        Err(e) => {
            tracing::debug!(
                pid = child.id(),
                "logging binary gone before its exit was watched: {e}"
            );
            return;
        }
    };
    tokio::spawn(async move {
        // A pidfd reads as ready once its process exited.
        // SAFETY: the AsyncFd owns the pidfd, which stays open and unchanged until the AsyncFd is dropped.
        let watched = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(pidfd, tokio::io::Interest::READABLE)
        };
        if let Ok(fd) = watched {
            let _ = fd.readable().await;
        }
        drop(open);
    });
}
