//! Freezes the node agent's co-runner controller asks for ("holds"), kept apart from the user's Task
//! Pause: containerd still sees the container running, a user's Pause always wins (a hold's release never
//! thaws a container the user paused, or a parked one), and a hold never outlives its bounds:
//! - a lease: the agent renews a hold (`renew`); one not renewed in time is released by the shim. A renewal
//!   never creates a hold: a renewal of a hold that ended (for an exec, a kill, a lapse) answers "not frozen";
//! - its connection: when the agent's connection to this shim ends (the agent died or restarted), the holds
//!   it made are released;
//! - a kill or an exec releases the hold first (the v1 freezer keeps fatal signals from a frozen task, and
//!   runc refuses to exec into a frozen container), and so does a preemption (cuda-checkpoint needs the
//!   processes' restore threads), during which no hold is taken;
//! - no new hold while an exec starts or a fatal signal is sent (the guard of [`Container::block_holds`]),
//!   nor for [`KILL_GRACE`] after a SIGTERM or SIGKILL of the init: a container told to stop gets to stop.
use std::{
    sync::{Arc, Weak},
    time::Duration,
};

use baton_agent_api::{ContainerRef, FreezerReply, now_monotonic_ns};
use tokio::time::Instant;

use super::Container;
use crate::{
    errors::{Result, ShimError},
    process::State,
};

/// A controller's freeze of a container.
#[derive(Debug, Clone, Copy)]
pub struct Hold {
    /// The connection (of this shim's control socket) that made it.
    pub conn: u64,
    /// When it lapses unless renewed (`None`: when released or its connection ends).
    pub deadline: Option<Instant>,
    /// Which hold of the container this is (its lease watcher ends with it).
    pub generation: u64,
}

/// The controller's hold of a container, and what keeps a new one from being taken.
#[derive(Debug, Default)]
pub struct HoldSlot {
    /// The hold in force.
    current: Option<Hold>,
    /// A hold is being taken (its freeze runs, under `init_op`).
    freezing: bool,
    /// Exec starts and signals in flight ([`HoldBlock`]s): no new hold meanwhile.
    blockers: u32,
    /// The init was told to stop (SIGTERM, SIGKILL): no new hold before this.
    stopping_until: Option<Instant>,
}

impl HoldSlot {
    /// Why no new hold may be taken now, if so.
    fn refusal(&self) -> Option<&'static str> {
        if self.blockers > 0 {
            return Some("not frozen: an exec is starting in it, or a signal is being sent to it");
        }
        if self.stopping_until.is_some_and(|t| Instant::now() < t) {
            return Some("not frozen: it was told to stop (SIGTERM or SIGKILL)");
        }
        None
    }
}

/// How long after a SIGTERM or SIGKILL of its init a container is not frozen again, so that it stops
/// promptly (a graceful shutdown runs at full speed); after it, a container that ignored the signal is
/// controlled again.
pub const KILL_GRACE: Duration = Duration::from_secs(30);

/// While alive, no new hold is taken of its container (see [`Container::block_holds`]).
pub struct HoldBlock<'a> {
    c: &'a Container,
}

impl Drop for HoldBlock<'_> {
    fn drop(&mut self) {
        let mut slot = lock(&self.c.hold);
        slot.blockers = slot.blockers.saturating_sub(1);
    }
}

/// Numbers the holds, so that a lease watcher only ever watches its own.
static GENERATION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl Container {
    /// Freezes the container for the controller of connection `conn`, or renews its hold; `lease`: lapse
    /// after this long unless renewed. A `renew` of a hold that is gone creates none: the reply says it is
    /// not frozen (and why), and so does a freeze while an exec starts or a kill is sent.
    pub async fn hold(
        self: &Arc<Self>,
        conn: u64,
        lease: Option<Duration>,
        renew: bool,
    ) -> Result<FreezerReply> {
        let _op = self.init_op.lock().await;
        // cuda-checkpoint needs the processes' restore threads running: no hold while a preemption runs
        // (a preemption that starts after this ends the hold first).
        if self.preempt_op.try_lock().is_err() {
            return Err(ShimError::FailedPrecondition {
                id: self.id.clone(),
                action: "freeze",
                state: "being preempted".to_owned(),
            });
        }
        let state = self.procs.lock().await.init.state;
        let deadline = lease.map(|l| Instant::now() + l);
        match state {
            State::Running => {}
            State::Paused => return Ok(self.freezer_reply(true, 0, Some(self.paused_by()))),
            other => {
                return Err(ShimError::FailedPrecondition {
                    id: self.id.clone(),
                    action: "freeze",
                    state: other.name().to_owned(),
                });
            }
        }
        {
            let mut slot = lock(&self.hold);
            if let Some(h) = slot.current.as_mut() {
                h.conn = conn;
                h.deadline = deadline;
                return Ok(self.freezer_reply(true, 0, None));
            }
            if renew {
                let note = "not frozen: the hold is gone (it ended for an exec, a kill, a user's pause or \
                            resume, or its lease lapsed): freeze again to take a new one";
                return Ok(self.freezer_reply(false, 0, Some(note.to_owned())));
            }
            if let Some(why) = slot.refusal() {
                return Ok(self.freezer_reply(false, 0, Some(why.to_owned())));
            }
            slot.freezing = true;
        }
        let frozen = self.freeze_cgroup(true).await;
        let mut slot = lock(&self.hold);
        slot.freezing = false;
        let latency = frozen?;
        let generation = GENERATION.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        slot.current = Some(Hold {
            conn,
            deadline,
            generation,
        });
        drop(slot);
        if deadline.is_some() {
            tokio::spawn(watch_lease(Arc::downgrade(self), generation));
        }
        Ok(self.freezer_reply(true, nanos(latency), None))
    }

    /// No new hold is taken while the returned guard lives; the hold in force (or being taken) ends now.
    /// For an exec start (runc refuses to exec into a frozen container, and a process joining one hangs)
    /// and for a fatal signal (the v1 freezer keeps it from a frozen task).
    pub(crate) async fn block_holds(&self, what: &str) -> HoldBlock<'_> {
        lock(&self.hold).blockers += 1;
        let block = HoldBlock { c: self };
        self.end_hold_for(what).await;
        block
    }

    /// The init was told to stop: no new hold for [`KILL_GRACE`].
    pub(crate) fn stopping(&self) {
        lock(&self.hold).stopping_until = Some(Instant::now() + KILL_GRACE);
    }

    /// Thaws a container the controller froze (`conn`: only if that connection holds it); a container
    /// the user paused, or a parked one, stays frozen and the reply says why.
    pub async fn release_hold(&self, conn: Option<u64>, why: &str) -> Result<FreezerReply> {
        let _op = self.init_op.lock().await;
        let held = {
            let mut slot = lock(&self.hold);
            match slot.current {
                Some(h) if conn.is_none_or(|c| c == h.conn) => slot.current.take().is_some(),
                _ => false,
            }
        };
        let paused = self.procs.lock().await.init.state == State::Paused;
        if paused {
            return Ok(self.freezer_reply(true, 0, Some(self.paused_by())));
        }
        if !held {
            return Ok(self.freezer_reply(false, 0, None));
        }
        let latency = self.freeze_cgroup(false).await?;
        tracing::debug!(id = %self.id, "controller hold released ({why})");
        Ok(self.freezer_reply(false, nanos(latency), None))
    }

    /// Whether connection `conn` holds the container frozen.
    pub fn held_by(&self, conn: u64) -> bool {
        lock(&self.hold).current.is_some_and(|h| h.conn == conn)
    }

    /// Whether the controller holds it frozen.
    pub fn is_held(&self) -> bool {
        lock(&self.hold).current.is_some()
    }

    /// The user paused or resumed it: the controller's hold (if any) is over, the cgroup left as it is.
    pub(super) fn forget_hold(&self) {
        lock(&self.hold).current.take();
    }

    /// Before a kill or an exec, and when the user pauses or resumes: the controller's hold ends (the
    /// user's word is the latest; the controller freezes again when it next decides).
    pub(crate) async fn end_hold_for(&self, what: &str) {
        {
            let slot = lock(&self.hold);
            if slot.current.is_none() && !slot.freezing {
                return;
            }
        }
        // A hold being taken is in force once `init_op` is ours.
        let _op = self.init_op.lock().await;
        let paused = self.procs.lock().await.init.state == State::Paused;
        let taken = lock(&self.hold).current.take().is_some();
        if taken && !paused {
            if let Err(e) = self.freeze_cgroup(false).await {
                tracing::warn!(id = %self.id, "thawing the controller's hold before {what}: {e}");
            } else {
                tracing::info!(id = %self.id, "the controller's hold ended for {what}");
            }
        }
    }

    fn paused_by(&self) -> String {
        if self.preemption().is_some() {
            "parked".to_owned()
        } else {
            "user-paused".to_owned()
        }
    }

    fn freezer_reply(&self, frozen: bool, latency_ns: u64, note: Option<String>) -> FreezerReply {
        FreezerReply {
            container: ContainerRef {
                id: self.id.clone(),
                namespace: self.namespace.clone(),
            },
            frozen,
            latency_ns,
            t_confirmed_ns: now_monotonic_ns(),
            note,
        }
    }
}

/// Releases hold `generation` of the container behind `weak` when its lease lapses without a renewal; ends
/// with that hold.
async fn watch_lease(weak: Weak<Container>, generation: u64) {
    let mine = |h: &Option<Hold>| h.filter(|h| h.generation == generation);
    loop {
        let deadline = {
            let Some(c) = weak.upgrade() else { return };
            let Some(Hold {
                deadline: Some(d), ..
            }) = mine(&lock(&c.hold).current)
            else {
                return;
            };
            d
        };
        tokio::time::sleep_until(deadline).await;
        let Some(c) = weak.upgrade() else { return };
        let lapsed = mine(&lock(&c.hold).current)
            .is_some_and(|h| h.deadline.is_some_and(|d| d <= Instant::now()));
        if lapsed {
            tracing::warn!(
                id = %c.id,
                "the agent did not renew its freeze in time: thawing (fail-safe)"
            );
            if let Err(e) = c.release_hold(None, "lease lapsed").await {
                tracing::warn!(id = %c.id, "thawing after the lease lapsed: {e}");
            }
            return;
        }
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
