//! Freezes the node agent's co-runner controller asks for ("holds"), kept apart from the user's Task
//! Pause: containerd still sees the container running, a user's Pause always wins (a hold's release never
//! thaws a container the user paused, or a parked one), and a hold never outlives its bounds:
//! - a lease: the agent renews a hold by asking again; one not renewed in time is released by the shim;
//! - its connection: when the agent's connection to this shim ends (the agent died or restarted), the holds
//!   it made are released;
//! - a kill or an exec releases the hold first (the v1 freezer keeps fatal signals from a frozen task, and
//!   runc refuses to exec into a frozen container), and so does a preemption (cuda-checkpoint needs the
//!   processes' restore threads), during which no hold is taken.
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

/// Numbers the holds, so that a lease watcher only ever watches its own.
static GENERATION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl Container {
    /// Freezes the container for the controller of connection `conn`, or renews its hold; `lease`: lapse
    /// after this long unless renewed.
    pub async fn hold(
        self: &Arc<Self>,
        conn: u64,
        lease: Option<Duration>,
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
        let renewed = {
            let mut hold = lock(&self.hold);
            match hold.as_mut() {
                Some(h) => {
                    h.conn = conn;
                    h.deadline = deadline;
                    true
                }
                None => false,
            }
        };
        if renewed {
            return Ok(self.freezer_reply(true, 0, None));
        }
        let latency = self.freeze_cgroup(true).await?;
        let generation = GENERATION.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        *lock(&self.hold) = Some(Hold {
            conn,
            deadline,
            generation,
        });
        if deadline.is_some() {
            tokio::spawn(watch_lease(Arc::downgrade(self), generation));
        }
        Ok(self.freezer_reply(true, nanos(latency), None))
    }

    /// Thaws a container the controller froze (`conn`: only if that connection holds it); a container
    /// the user paused, or a parked one, stays frozen and the reply says why.
    pub async fn release_hold(&self, conn: Option<u64>, why: &str) -> Result<FreezerReply> {
        let _op = self.init_op.lock().await;
        let held = {
            let mut hold = lock(&self.hold);
            match *hold {
                Some(h) if conn.is_none_or(|c| c == h.conn) => hold.take().is_some(),
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
        lock(&self.hold).is_some_and(|h| h.conn == conn)
    }

    /// Whether the controller holds it frozen.
    pub fn is_held(&self) -> bool {
        lock(&self.hold).is_some()
    }

    /// The user paused or resumed it: the controller's hold (if any) is over, the cgroup left as it is.
    pub(super) fn forget_hold(&self) {
        lock(&self.hold).take();
    }

    /// Before a kill or an exec, and when the user pauses or resumes: the controller's hold ends (the
    /// user's word is the latest; the controller freezes again when it next decides).
    pub(crate) async fn end_hold_for(&self, what: &str) {
        if !self.is_held() {
            return;
        }
        let _op = self.init_op.lock().await;
        let paused = self.procs.lock().await.init.state == State::Paused;
        let taken = lock(&self.hold).take().is_some();
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
            }) = mine(&lock(&c.hold))
            else {
                return;
            };
            d
        };
        tokio::time::sleep_until(deadline).await;
        let Some(c) = weak.upgrade() else { return };
        let lapsed =
            mine(&lock(&c.hold)).is_some_and(|h| h.deadline.is_some_and(|d| d <= Instant::now()));
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
