//! cgroup v2 freezer: `cgroup.freeze` is written `1` or `0`; `frozen 1` in `cgroup.events` confirms that every
//! task of the cgroup (and of its descendants) is frozen. The kernel notifies `cgroup.events` changes
//! (POLLPRI, or EPOLLPRI through tokio's `Interest::PRIORITY`), at most once per 10 ms per file: under frequent
//! cycles a notification can come late, so the waiters also re-read on a short timer.
use std::{os::fd::AsFd, path::Path, time::Duration};

use nix::poll::{PollFd, PollFlags, ppoll};

use super::{FreezerError, FreezerState, Target, files::ControlFile};

/// The control file names.
pub(super) const FREEZE_FILE: &str = "cgroup.freeze";
const EVENTS_FILE: &str = "cgroup.events";

/// An open v2 cgroup.
#[derive(Debug)]
pub(super) struct V2 {
    freeze: ControlFile,
    events: ControlFile,
}

impl V2 {
    /// Opens the freezer of the cgroup at `dir`.
    pub(super) fn open(dir: &Path) -> Result<Self, FreezerError> {
        Ok(Self {
            freeze: ControlFile::open(dir, FREEZE_FILE, true)?,
            events: ControlFile::open(dir, EVENTS_FILE, false)?,
        })
    }

    /// Asks the kernel for `target`.
    pub(super) fn request(&self, target: Target) -> Result<(), FreezerError> {
        self.freeze.write(match target {
            Target::Frozen => "1",
            Target::Thawed => "0",
        })
    }

    /// Whether `cgroup.events` says `frozen 1`.
    pub(super) fn frozen(&self) -> Result<bool, FreezerError> {
        let mut buf = [0; 256];
        let text = self.events.read(&mut buf)?;
        let value = text
            .lines()
            .find_map(|line| line.strip_prefix("frozen "))
            .ok_or_else(|| self.events.unexpected(text))?;
        match value.trim() {
            "1" => Ok(true),
            "0" => Ok(false),
            _ => Err(self.events.unexpected(text)),
        }
    }

    /// What was asked (`cgroup.freeze`).
    fn asked_frozen(&self) -> Result<bool, FreezerError> {
        let mut buf = [0; 256];
        let text = self.freeze.read(&mut buf)?;
        match text.trim() {
            "1" => Ok(true),
            "0" => Ok(false),
            other => Err(self.freeze.unexpected(other)),
        }
    }

    /// The state: frozen when the kernel says so, freezing when asked but not done yet, else thawed.
    pub(super) fn state(&self) -> Result<FreezerState, FreezerError> {
        if self.frozen()? {
            Ok(FreezerState::Frozen)
        } else if self.asked_frozen()? {
            Ok(FreezerState::Freezing)
        } else {
            Ok(FreezerState::Thawed)
        }
    }

    /// The events file (for an async waiter to register).
    pub(super) fn events(&self) -> &ControlFile {
        &self.events
    }

    /// Blocks until `cgroup.events` is notified or `wait` passed (microsecond resolution).
    pub(super) fn wait_blocking(&self, wait: Duration) {
        let mut fds = [PollFd::new(self.events.file().as_fd(), PollFlags::POLLPRI)];
        // An error (EINTR) only ends this wait early: the caller re-reads either way.
        let _ = ppoll(&mut fds, Some(wait.into()), None);
    }
}
