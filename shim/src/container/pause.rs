//! Task Pause and Resume through the cgroup freezer (`baton_cgroups::freezer`): the container's cgroup is frozen
//! where runc put its init (v1 `freezer.state` on a hybrid host, `cgroup.freeze` on a v2 one), and the call
//! returns once the kernel confirms it, in microseconds where `runc pause` takes tens of milliseconds. runc reads
//! the same file for `runc state`, so it sees the container paused. Where no freezer of the container's own is
//! found (the init is gone, or sits in the shim's own cgroup, as with a runtime that makes none), `runc pause` /
//! `runc resume` do it, as before.
//!
//! Traps: a task frozen by the v1 freezer holds even SIGKILL until thawed (runc#2105, runc#3134), so a SIGKILL
//! of a paused container thaws it (runc 1.1 does the same in `runc kill`); exec into a paused container is
//! refused by the state machine ("cannot exec a process that is paused", as runc and the Go shim refuse it),
//! since a process joining a frozen cgroup would hang; delete of a paused container is refused until it is
//! killed, as in the Go shim.

use std::{sync::Arc, time::Duration};

use baton_cgroups::freezer::Freezer;

use super::Container;
use crate::{
    errors::{Result, ShimError},
    process::{Op, State},
};

/// How long a freeze or thaw may take before it fails (and a freeze is undone).
pub const FREEZE_TIMEOUT: Duration = Duration::from_secs(5);

/// The freezer of the cgroup that runc put `init_pid` in, unless that is the shim's own cgroup (freezing it
/// would freeze the shim).
fn freezer_of_init(id: &str, init_pid: u32) -> Option<Freezer> {
    let freezer = match Freezer::for_pid(init_pid) {
        Ok(f) => f,
        Err(e) => {
            tracing::info!(
                id,
                "no cgroup freezer for the container, runc pauses it: {e}"
            );
            return None;
        }
    };
    let own = Freezer::for_pid(std::process::id()).ok();
    if own.is_some_and(|own| own.path() == freezer.path()) {
        tracing::info!(id, path = %freezer.path().display(), "the container shares the shim's cgroup: runc pauses it");
        return None;
    }
    Some(freezer)
}

impl Container {
    /// The freezer of this container's cgroup, looked up once per init process (`None` where runc pauses it).
    /// For callers that freeze the container without changing its task state (the co-runner controller).
    pub async fn cgroup_freezer(&self) -> Option<Arc<Freezer>> {
        let pid = self.procs.lock().await.init.pid;
        if pid == 0 {
            return None;
        }
        let mut cached = self
            .freezer
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match &*cached {
            Some((for_pid, freezer)) if *for_pid == pid => freezer.clone(),
            _ => {
                let freezer = freezer_of_init(&self.id, pid).map(Arc::new);
                *cached = Some((pid, freezer.clone()));
                freezer
            }
        }
    }

    /// Pauses (true) or resumes (false) the container: through its cgroup freezer, confirmed by the kernel, or
    /// through runc where it has none. A container the controller holds frozen is frozen already: the user's
    /// Pause takes the hold over. Either way the user's word is the latest, and the hold ends.
    pub async fn set_paused(&self, pause: bool) -> Result<()> {
        let _op = self.init_op.lock().await;
        let op = if pause { Op::Pause } else { Op::Resume };
        let next = self.procs.lock().await.init.check(op)?;
        if !(pause && self.is_held()) {
            let took = self.freeze_cgroup(pause).await?;
            let action = if pause { "pause" } else { "resume" };
            let version = self.freezer_version().await;
            tracing::info!(id = %self.id, %version, ?took, "{action} confirmed by the cgroup freezer");
        }
        self.forget_hold();
        let mut procs = self.procs.lock().await;
        if procs.init.state != State::Stopped {
            procs.init.state = next;
        }
        Ok(())
    }

    /// The user's Task Pause: refused while cuda-checkpoint runs in the container (a park, a resume, a Task
    /// Checkpoint, a restore after runc restore), since a frozen process cannot answer it and the operation,
    /// and the container, would hang.
    pub async fn pause_by_user(&self) -> Result<()> {
        let _no_preemption = self
            .preempt_op
            .try_lock()
            .map_err(|_| ShimError::FailedPrecondition {
                id: self.id.clone(),
                action: "pause",
                state: "parking, resuming or checkpointing its CUDA processes (cuda-checkpoint runs in \
                        it and cannot while it is frozen): pause it once that is done"
                    .into(),
            })?;
        self.set_paused(true).await
    }

    /// After cuda-checkpoint timed out: thaws the container's cgroup (frozen by someone else meanwhile, or
    /// not at all) unless the user paused it, so that what rolls back can run.
    pub(crate) async fn thaw_for_rollback(&self) {
        let _op = self.init_op.lock().await;
        if self.procs.lock().await.init.state == State::Paused {
            return;
        }
        if let Err(e) = self.freeze_cgroup(false).await {
            tracing::warn!(id = %self.id, "thawing for the rollback: {e}");
        }
    }

    /// `v1` or `v2`, or `runc` where runc freezes it.
    async fn freezer_version(&self) -> String {
        self.cgroup_freezer()
            .await
            .map_or_else(|| "runc".to_owned(), |f| f.version().to_string())
    }

    /// Freezes (true) or thaws (false) the container's cgroup without changing its task state: through its
    /// freezer, confirmed, or through runc where it has none. The confirmed latency.
    pub(super) async fn freeze_cgroup(&self, freeze: bool) -> Result<Duration> {
        let action = if freeze { "freeze" } else { "thaw" };
        match self.cgroup_freezer().await {
            Some(freezer) => {
                let done = if freeze {
                    freezer.freeze(FREEZE_TIMEOUT).await
                } else {
                    freezer.thaw(FREEZE_TIMEOUT).await
                };
                let took = done.map_err(|source| ShimError::Freezer {
                    action,
                    id: self.id.clone(),
                    source,
                })?;
                tracing::debug!(id = %self.id, version = %freezer.version(), ?took, "{action} confirmed");
                Ok(took)
            }
            None => {
                let t0 = std::time::Instant::now();
                let res = if freeze {
                    self.runc.pause(&self.id).await
                } else {
                    self.runc.resume(&self.id).await
                };
                res.map_err(|e| ShimError::runtime(action, &self.id, e))?;
                Ok(t0.elapsed())
            }
        }
    }

    /// After a signal to the init: a frozen container gets a SIGKILL (and a parked one a SIGTERM too) only once
    /// it is thawed (the cgroup v1 freezer holds fatal signals, runc#2105), so it is thawed now. A parked
    /// container is no longer parked: what exits reaches containerd as a TaskExit with its real status. A
    /// user-paused container that runc pauses is left to runc, whose `kill` thaws it.
    pub(super) async fn thaw_if_killed(&self, signal: u32) {
        let parked = self.preemption().is_some();
        let fatal = signal == libc::SIGKILL as u32 || (parked && signal == libc::SIGTERM as u32);
        if !fatal || self.procs.lock().await.init.state != State::Paused {
            if parked && fatal {
                self.clear_preemption();
            }
            return;
        }
        if (parked || self.cgroup_freezer().await.is_some())
            && let Err(e) = self.set_paused(false).await
        {
            tracing::warn!(id = %self.id, "thawing the paused container after a kill: {e}");
        }
        if parked {
            self.clear_preemption();
        }
    }
}
