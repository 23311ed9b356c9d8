//! The cgroup freezer: freeze and thaw a container's cgroup and return once the kernel confirms it, with the
//! confirmed latency; v1 (`freezer.state`) and v2 (`cgroup.freeze` / `cgroup.events`) behind one interface,
//! chosen from where runc put the process ([`Freezer::for_pid`]).
//!
//! A freeze writes the request, then re-reads until the kernel reports the cgroup frozen: inline, yielding the
//! CPU, for a short budget (sleeping tasks freeze in tens of microseconds), then with pauses woken early by v2's
//! `cgroup.events` notification. A freeze that is not confirmed within its timeout is undone and returns
//! [`FreezerError::Timeout`] naming the state it stuck in. The async API ([`Freezer::freeze`]) is for the shim's
//! current-thread runtime; the blocking one ([`Freezer::freeze_blocking`]) for benchmarks and tools.
//!
//! Traps (the callers handle them): in v1 a frozen task holds even SIGKILL until thawed (runc#2105, runc#3134),
//! and a process that joins a frozen cgroup (`runc exec`) hangs until it is thawed.

mod error;
mod files;
mod locate;
mod v1;
mod v2;
mod wait;

#[cfg(test)]
mod tests;

use std::{
    fmt,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

pub use error::FreezerError;
pub use locate::Roots;

use v1::V1;
use v2::V2;
use wait::Backoff;

/// Which cgroup version a freezer uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupVersion {
    /// The v1 freezer controller (`freezer.state`).
    V1,
    /// cgroup v2 (`cgroup.freeze`).
    V2,
}

impl CgroupVersion {
    /// The control file a cgroup of this version must have to be frozen.
    pub fn control_file(self) -> &'static str {
        match self {
            Self::V1 => v1::STATE_FILE,
            Self::V2 => v2::FREEZE_FILE,
        }
    }
}

impl fmt::Display for CgroupVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::V1 => "v1",
            Self::V2 => "v2",
        })
    }
}

/// A cgroup's freezer state as the kernel reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FreezerState {
    /// Running.
    Thawed,
    /// Asked to freeze, not every task frozen yet.
    Freezing,
    /// Every task frozen.
    Frozen,
}

impl fmt::Display for FreezerState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Thawed => "thawed",
            Self::Freezing => "freezing",
            Self::Frozen => "frozen",
        })
    }
}

/// What a freeze or thaw asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    Frozen,
    Thawed,
}

impl Target {
    fn state(self) -> FreezerState {
        match self {
            Self::Frozen => FreezerState::Frozen,
            Self::Thawed => FreezerState::Thawed,
        }
    }
}

#[derive(Debug)]
enum Backend {
    V1(V1),
    V2(V2),
}

/// The freezer of one cgroup, its control files kept open.
#[derive(Debug)]
pub struct Freezer {
    backend: Backend,
    path: PathBuf,
}

impl Freezer {
    /// The freezer of the cgroup that process `pid` is in (see `locate.rs` for the rule).
    pub fn for_pid(pid: u32) -> Result<Self, FreezerError> {
        let cgroups = crate::of_pid(pid).ok_or_else(|| FreezerError::Process {
            pid,
            source: std::io::Error::from(std::io::ErrorKind::NotFound),
        })?;
        Self::for_pid_in(pid, &cgroups, &Roots::detect()?)
    }

    /// The freezer of process `pid` whose cgroups (/proc/PID/cgroup) are `cgroups`, under `roots` (tests point
    /// this at fixtures).
    pub fn for_pid_in(
        pid: u32,
        cgroups: &[procfs::ProcessCGroup],
        roots: &Roots,
    ) -> Result<Self, FreezerError> {
        let (dir, version) = locate::freezer_dir(pid, cgroups, roots)?;
        Self::open(&dir, version)
    }

    /// The freezer of the cgroup directory `dir` of version `version`.
    pub fn open(dir: &Path, version: CgroupVersion) -> Result<Self, FreezerError> {
        let backend = match version {
            CgroupVersion::V1 => Backend::V1(V1::open(dir)?),
            CgroupVersion::V2 => Backend::V2(V2::open(dir)?),
        };
        Ok(Self {
            backend,
            path: dir.to_path_buf(),
        })
    }

    /// The cgroup directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The cgroup version.
    pub fn version(&self) -> CgroupVersion {
        match self.backend {
            Backend::V1(_) => CgroupVersion::V1,
            Backend::V2(_) => CgroupVersion::V2,
        }
    }

    /// The state the kernel reports now.
    pub fn state(&self) -> Result<FreezerState, FreezerError> {
        match &self.backend {
            Backend::V1(v1) => v1.state(),
            Backend::V2(v2) => v2.state(),
        }
    }

    /// Freezes the cgroup; returns once the kernel reports it frozen, with the time that took. Waits at most
    /// `timeout`, then thaws it again and fails with [`FreezerError::Timeout`].
    pub async fn freeze(&self, timeout: Duration) -> Result<Duration, FreezerError> {
        self.run_async(Target::Frozen, timeout).await
    }

    /// Thaws the cgroup; returns once the kernel reports it thawed, with the time that took.
    pub async fn thaw(&self, timeout: Duration) -> Result<Duration, FreezerError> {
        self.run_async(Target::Thawed, timeout).await
    }

    /// [`Self::freeze`], blocking the calling thread.
    pub fn freeze_blocking(&self, timeout: Duration) -> Result<Duration, FreezerError> {
        self.run_blocking(Target::Frozen, timeout)
    }

    /// [`Self::thaw`], blocking the calling thread.
    pub fn thaw_blocking(&self, timeout: Duration) -> Result<Duration, FreezerError> {
        self.run_blocking(Target::Thawed, timeout)
    }

    fn request(&self, target: Target) -> Result<(), FreezerError> {
        match &self.backend {
            Backend::V1(v1) => v1.request(target),
            Backend::V2(v2) => v2.request(target),
        }
    }

    /// Whether the kernel reports `target`; else the state it reports.
    fn confirmed(&self, target: Target) -> Result<Result<(), FreezerState>, FreezerError> {
        let state = match &self.backend {
            Backend::V1(v1) => v1.state()?,
            // One read of cgroup.events: `frozen` is all that tells the two apart while a request stands.
            Backend::V2(v2) => match (v2.frozen()?, target) {
                (true, _) => FreezerState::Frozen,
                (false, Target::Frozen) => FreezerState::Freezing,
                (false, Target::Thawed) => FreezerState::Thawed,
            },
        };
        Ok(if state == target.state() {
            Ok(())
        } else {
            Err(state)
        })
    }

    /// Before a re-read: v1 writes FROZEN again (runc's retry).
    fn nudge(&self, target: Target) -> Result<(), FreezerError> {
        match &self.backend {
            Backend::V1(v1) => v1.nudge(target),
            Backend::V2(_) => Ok(()),
        }
    }

    /// Whether a v1 freeze stuck since `since` is due for runc's thaw-and-retry.
    fn recovery_due(&self, target: Target, since: Instant) -> bool {
        matches!(self.backend, Backend::V1(_))
            && target == Target::Frozen
            && since.elapsed() >= v1::RECOVER_AFTER
    }

    /// The timeout error; an unconfirmed freeze is undone first.
    fn give_up(&self, target: Target, stuck_in: FreezerState, after: Duration) -> FreezerError {
        if target == Target::Frozen
            && let Err(e) = self.request(Target::Thawed)
        {
            return e;
        }
        FreezerError::Timeout {
            path: self.path.clone(),
            wanted: target.state(),
            stuck_in,
            after,
        }
    }

    fn run_blocking(&self, target: Target, timeout: Duration) -> Result<Duration, FreezerError> {
        let start = Instant::now();
        self.request(target)?;
        let mut backoff = Backoff::blocking();
        let mut attempt_since = start;
        loop {
            let stuck_in = match self.confirmed(target)? {
                Ok(()) => return Ok(start.elapsed()),
                Err(state) => state,
            };
            let elapsed = start.elapsed();
            let Some(left) = timeout.checked_sub(elapsed).filter(|l| !l.is_zero()) else {
                return Err(self.give_up(target, stuck_in, elapsed));
            };
            if elapsed < wait::INLINE_BUDGET {
                wait::yield_cpu();
            } else if self.recovery_due(target, attempt_since) {
                self.request(Target::Thawed)?;
                std::thread::sleep(v1::RECOVERY_PAUSE.min(left));
                attempt_since = Instant::now();
            } else {
                let pause = backoff.step(left);
                match &self.backend {
                    Backend::V2(v2) => v2.wait_blocking(pause),
                    Backend::V1(_) => std::thread::sleep(pause),
                }
            }
            self.nudge(target)?;
        }
    }

    async fn run_async(&self, target: Target, timeout: Duration) -> Result<Duration, FreezerError> {
        let start = Instant::now();
        self.request(target)?;
        let mut backoff = Backoff::asynchronous();
        let mut attempt_since = start;
        let mut notifier = None;
        loop {
            let stuck_in = match self.confirmed(target)? {
                Ok(()) => return Ok(start.elapsed()),
                Err(state) => state,
            };
            let elapsed = start.elapsed();
            let Some(left) = timeout.checked_sub(elapsed).filter(|l| !l.is_zero()) else {
                return Err(self.give_up(target, stuck_in, elapsed));
            };
            if elapsed < wait::INLINE_BUDGET {
                wait::yield_cpu();
            } else if self.recovery_due(target, attempt_since) {
                self.request(Target::Thawed)?;
                tokio::time::sleep(v1::RECOVERY_PAUSE.min(left)).await;
                attempt_since = Instant::now();
            } else {
                if notifier.is_none()
                    && let Backend::V2(v2) = &self.backend
                {
                    notifier = wait::notifier(v2);
                }
                wait::wait_async(notifier.as_ref(), backoff.step(left)).await;
            }
            self.nudge(target)?;
        }
    }
}
