//! cgroup v1 freezer: `freezer.state` is written `FROZEN` or `THAWED` and read back; the kernel reports
//! `FREEZING` until every task is in the refrigerator (reading the file is what checks). No notification
//! exists, so the state is re-read.
//!
//! runc's recovery (libcontainer/cgroups/fs/freezer.go) for cgroups that will not freeze, mostly because new
//! tasks keep appearing (fork, `runc exec`): `FROZEN` is written again before every re-read (that also freezes
//! tasks that joined since), and a freeze stuck for a while is undone for a moment and started again.
use std::{path::Path, time::Duration};

use super::{FreezerError, FreezerState, Target, files::ControlFile};

/// How long a freeze may stay FREEZING before it is thawed for [`RECOVERY_PAUSE`] and started again (runc
/// does that every 50 attempts, a few milliseconds).
pub(super) const RECOVER_AFTER: Duration = Duration::from_millis(10);
/// How long a recovering freeze stays thawed (runc: 10 ms).
pub(super) const RECOVERY_PAUSE: Duration = Duration::from_millis(10);

/// The control file name.
pub(super) const STATE_FILE: &str = "freezer.state";

/// An open v1 freezer cgroup.
#[derive(Debug)]
pub(super) struct V1 {
    state: ControlFile,
}

impl V1 {
    /// Opens the freezer of the cgroup at `dir`.
    pub(super) fn open(dir: &Path) -> Result<Self, FreezerError> {
        Ok(Self {
            state: ControlFile::open(dir, STATE_FILE, true)?,
        })
    }

    /// Asks the kernel for `target`.
    pub(super) fn request(&self, target: Target) -> Result<(), FreezerError> {
        self.state.write(match target {
            Target::Frozen => "FROZEN",
            Target::Thawed => "THAWED",
        })
    }

    /// The state the kernel reports now.
    pub(super) fn state(&self) -> Result<FreezerState, FreezerError> {
        let mut buf = [0; 256];
        let text = self.state.read(&mut buf)?;
        match text.trim() {
            "FROZEN" => Ok(FreezerState::Frozen),
            "FREEZING" => Ok(FreezerState::Freezing),
            "THAWED" => Ok(FreezerState::Thawed),
            other => Err(self.state.unexpected(other)),
        }
    }

    /// Before a re-read while freezing: write FROZEN again, so that tasks that joined since are frozen too.
    pub(super) fn nudge(&self, target: Target) -> Result<(), FreezerError> {
        match target {
            Target::Frozen => self.request(Target::Frozen),
            Target::Thawed => Ok(()),
        }
    }
}
