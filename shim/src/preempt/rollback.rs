//! Undoing a preemption step that failed, the same way whether the calls go through the `cuda-checkpoint`
//! program or the CUDA driver API. What is known to have succeeded is undone (what was checkpointed is
//! restored, what was locked unlocked). A call whose outcome is unknown (the program stopped after
//! `cuda_checkpoint_timeout`, a driver call given up at that limit, a helper that died under it) is settled by
//! asking its process's state: the container is thawed first unless the user paused it (a process answers
//! from its restore thread), then every such process is asked at once, each ask bounded on its own (on the
//! driver-API path through a fresh helper: the one that timed out is retired, the one that died is gone).
//!
//! A process that does not answer that either (its restore thread is wedged) does not hold the others: the
//! rollback undoes what it can, the error says which pid did not answer, and a follow-up in the background
//! asks that process again until it answers, then restores and unlocks it as its state says. The follow-up
//! holds the container's operation lock until then, so that no park, resume, Task Pause or controller hold
//! freezes the container under the wedged call.

use std::time::Duration;

use baton_nvidia::cuda_checkpoint::CudaState;
use futures::stream::{FuturesUnordered, StreamExt};
use tokio::sync::OwnedMutexGuard;

use super::cuda::{Action, CudaCheckpoint, CudaError};
use crate::container::Container;

/// Each pid's result of one action.
pub(super) type Results = [(u32, Result<(), CudaError>)];

/// How many times a follow-up asks a process that does not answer (each ask bounded by
/// `cuda_checkpoint_timeout`) before it gives up and lets the container be preempted and paused again.
const FOLLOW_UP_ASKS: u32 = 6;

/// The container's operation lock, held by one preemption operation (a second one is refused); a rollback
/// that leaves processes unanswered hands it over to their follow-up.
pub struct Op(Option<OwnedMutexGuard<()>>);

impl Op {
    /// The operation lock `guard`, taken by the operation.
    pub(super) fn new(guard: OwnedMutexGuard<()>) -> Self {
        Self(Some(guard))
    }

    /// Whether a follow-up holds the lock now (the operation's rollback left a process unanswered).
    pub(super) fn handed_over(&self) -> bool {
        self.0.is_none()
    }
}

/// Runs `action` on every pid at once, each call bounded on its own; returns each pid's result in the order
/// they finish, after `each` has seen it.
pub(super) async fn on_all(
    cuda: &CudaCheckpoint,
    action: Action,
    pids: &[u32],
    timeout: Option<Duration>,
    mut each: impl FnMut(u32, &Result<(), CudaError>),
) -> Vec<(u32, Result<(), CudaError>)> {
    let mut running: FuturesUnordered<_> = pids
        .iter()
        .map(|&pid| async move { (pid, cuda.run(action, pid, timeout).await) })
        .collect();
    let mut out = Vec::with_capacity(pids.len());
    while let Some((pid, result)) = running.next().await {
        each(pid, &result);
        out.push((pid, result));
    }
    out
}

/// Each pid's state (`None`: an answer that names no state), asked of all at once, each ask bounded on its
/// own; in the order of `pids`.
pub(super) async fn states_of(
    cuda: &CudaCheckpoint,
    pids: &[u32],
) -> Vec<(u32, Result<Option<CudaState>, CudaError>)> {
    futures::future::join_all(
        pids.iter()
            .map(|&pid| async move { (pid, cuda.state(pid).await.map(|s| CudaState::parse(&s))) }),
    )
    .await
}

/// The pids whose call succeeded.
pub(super) fn succeeded(results: &Results) -> Vec<u32> {
    results
        .iter()
        .filter(|(_, r)| r.is_ok())
        .map(|(p, _)| *p)
        .collect()
}

/// The pids whose call may or may not have done its work.
pub(super) fn unknown_outcomes(results: &Results) -> Vec<u32> {
    results
        .iter()
        .filter(|(_, r)| r.as_ref().err().is_some_and(CudaError::outcome_unknown))
        .map(|(p, _)| *p)
        .collect()
}

/// The first error, in the order the calls finished.
pub(super) fn first_error(results: &Results) -> Option<CudaError> {
    results.iter().find_map(|(_, r)| r.as_ref().err().cloned())
}

impl Container {
    /// Rolls back after a failed step whose calls gave `results`: `checkpointed` are restored and `locked`
    /// unlocked (a restore leaves a process locked, so `locked` names the checkpointed ones too), and those
    /// of `results` whose outcome is unknown are asked first and undone as their state says. Returns the pids
    /// that did not answer, now followed up in the background with the operation lock of `op`.
    pub(super) async fn roll_back(
        &self,
        op: &mut Op,
        cuda: &CudaCheckpoint,
        results: &Results,
        mut checkpointed: Vec<u32>,
        mut locked: Vec<u32>,
    ) -> Vec<u32> {
        let unknown = unknown_outcomes(results);
        let mut unanswered = Vec::new();
        if !unknown.is_empty() {
            self.thaw_for_rollback().await;
            for (pid, state) in states_of(cuda, &unknown).await {
                match state {
                    Ok(Some(CudaState::Checkpointed)) => {
                        checkpointed.push(pid);
                        locked.push(pid);
                    }
                    Ok(Some(CudaState::Locked)) => locked.push(pid),
                    Ok(_) => {}
                    Err(e) if e.outcome_unknown() => unanswered.push(pid),
                    Err(e) => tracing::error!(id = %self.id, pid, "rollback: {e}"),
                }
            }
        }
        unanswered.extend(self.undo(cuda, &checkpointed, &locked).await);
        unanswered.sort_unstable();
        unanswered.dedup();
        if !unanswered.is_empty() {
            self.follow_up(op, cuda, &unanswered);
        }
        unanswered
    }

    /// Restores `checkpointed` and unlocks `locked`, logging what fails (the error being reported is the
    /// one that caused the undo); returns the pids whose call got no answer (not unlocked after a restore
    /// that got none).
    async fn undo(&self, cuda: &CudaCheckpoint, checkpointed: &[u32], locked: &[u32]) -> Vec<u32> {
        let mut unanswered = Vec::new();
        for (action, pids) in [(Action::Restore, checkpointed), (Action::Unlock, locked)] {
            let pids: Vec<u32> = pids
                .iter()
                .copied()
                .filter(|p| !unanswered.contains(p))
                .collect();
            for (pid, r) in on_all(cuda, action, &pids, None, |_, _| {}).await {
                if let Err(e) = r {
                    if e.outcome_unknown() {
                        unanswered.push(pid);
                    }
                    tracing::error!(id = %self.id, pid, "rollback: {} failed: {e}", action.name());
                }
            }
        }
        unanswered
    }

    /// Follows `pids` up in the background (see the module comment), holding the operation lock of `op`.
    fn follow_up(&self, op: &mut Op, cuda: &CudaCheckpoint, pids: &[u32]) {
        tracing::warn!(
            id = %self.id,
            ?pids,
            "rollback: no answer from pid(s) {pids:?}: each is asked again until it answers, then restored \
             and unlocked; the container cannot be preempted or paused until then"
        );
        let guard = op.0.take();
        let (id, cuda, pids) = (self.id.clone(), cuda.clone(), pids.to_vec());
        let task = tokio::spawn(async move {
            let _op = guard;
            futures::future::join_all(pids.iter().map(|&pid| settle_later(&id, &cuda, pid))).await;
        });
        self.tasks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(task);
    }
}

/// Asks `pid` until it answers (at most [`FOLLOW_UP_ASKS`] times, each bounded on its own), then undoes what
/// its state says: a checkpointed process is restored and unlocked, a locked one unlocked.
async fn settle_later(id: &str, cuda: &CudaCheckpoint, pid: u32) {
    for _ in 0..FOLLOW_UP_ASKS {
        if baton_cgroups::process_gone(pid) {
            tracing::info!(
                id,
                pid,
                "rollback: pid {pid} exited without answering: nothing to undo"
            );
            return;
        }
        let state = match cuda.state(pid).await.map(|s| CudaState::parse(&s)) {
            Ok(state) => state,
            Err(e) if e.outcome_unknown() => {
                tracing::warn!(id, pid, "rollback: still no answer: {e}");
                continue;
            }
            Err(e) => {
                tracing::error!(id, pid, "rollback: {e}");
                return;
            }
        };
        let undo: &[Action] = match state {
            Some(CudaState::Checkpointed) => &[Action::Restore, Action::Unlock],
            Some(CudaState::Locked) => &[Action::Unlock],
            other => {
                tracing::info!(
                    id,
                    pid,
                    "rollback: pid {pid} answered at last ({other:?}): nothing to undo"
                );
                return;
            }
        };
        match run_in_turn(cuda, pid, undo).await {
            Ok(()) => {
                tracing::info!(
                    id,
                    pid,
                    "rollback: pid {pid} answered at last ({state:?}): it runs again"
                );
                return;
            }
            Err(e) if e.outcome_unknown() => {
                tracing::warn!(id, pid, "rollback: no answer again: {e}");
            }
            Err(e) => {
                tracing::error!(
                    id,
                    pid,
                    "rollback: pid {pid} answered at last ({state:?}), but: {e}"
                );
                return;
            }
        }
    }
    tracing::error!(
        id,
        pid,
        "rollback: pid {pid} did not answer {FOLLOW_UP_ASKS} times (each within cuda_checkpoint_timeout): \
         its CUDA state is unknown and it may stay locked or checkpointed; the container can be preempted and \
         paused again (kill the process if it stays wedged)"
    );
}

/// Runs `actions` on `pid` one after the other, stopping at the first failure.
async fn run_in_turn(cuda: &CudaCheckpoint, pid: u32, actions: &[Action]) -> Result<(), CudaError> {
    for &action in actions {
        cuda.run(action, pid, None).await?;
    }
    Ok(())
}
