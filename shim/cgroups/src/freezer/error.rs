//! The freezer's errors: each names the cgroup (or the process) it is about and says what to do.
use std::{path::PathBuf, time::Duration};

use super::FreezerState;

/// Errors of [`super::Freezer`].
#[derive(Debug, thiserror::Error)]
pub enum FreezerError {
    /// /proc/PID/cgroup could not be read: the process is gone, or /proc is not mounted.
    #[error("cannot read the cgroups of process {pid}: {source} (has it exited?)")]
    Process {
        /// The process.
        pid: u32,
        /// The cause.
        source: std::io::Error,
    },
    /// The process is in no freezer cgroup Baton can use: no v1 freezer line with a mounted v1 freezer, and no
    /// cgroup v2 line with a mounted cgroup2 hierarchy.
    #[error(
        "process {pid} is in no freezable cgroup (no cgroup v1 freezer and no cgroup v2 hierarchy mounted, see /proc/self/mountinfo)"
    )]
    NoHierarchy {
        /// The process.
        pid: u32,
    },
    /// The process's cgroup is a hierarchy's root, or has no freezer control file.
    #[error(
        "process {pid} is in cgroup {path}, which cannot be frozen (a hierarchy's root, or no {file}): run it in a cgroup of its own"
    )]
    NotFreezable {
        /// The process.
        pid: u32,
        /// The cgroup directory.
        path: PathBuf,
        /// The control file that is missing.
        file: &'static str,
    },
    /// A control file could not be opened, read or written.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was being done ("open", "read", "write").
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A control file held something the kernel never writes there.
    #[error("unexpected content {text:?} in {path}")]
    Unexpected {
        /// The file.
        path: PathBuf,
        /// What it held.
        text: String,
    },
    /// The kernel did not report the wanted state in time. A freeze that times out is undone (thawed), so that
    /// nothing stays half frozen.
    #[error(
        "cgroup {path} did not become {wanted} within {after:?}: it stayed {stuck_in}{undone} (a task in uninterruptible sleep, e.g. on a device or NFS, holds a freeze up)"
    , undone = if *wanted == FreezerState::Frozen { ", so it was thawed again" } else { "" })]
    Timeout {
        /// The cgroup directory.
        path: PathBuf,
        /// The state asked for.
        wanted: FreezerState,
        /// The last state read.
        stuck_in: FreezerState,
        /// How long it waited.
        after: Duration,
    },
}
