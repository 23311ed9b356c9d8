//! Preempting a GPU container, which the shim does for the agent (`baton preempt`, `baton handoff`) and for
//! containerd's Task Checkpoint:
//! - **park**: ask each process named whether it owns CUDA state (`presence.rs`: a forked worker is left
//!   alone, frozen and thawed with the cgroup), lock every CUDA process (all before any checkpoint),
//!   checkpoint them concurrently (each lets go of the GPU at the end of its copy; the agent's release signal
//!   fires when the last one does), then freeze the cgroup; **resume**: thaw, restore all, unlock all.
//! - **snapshot**: as park up to the release, then `runc checkpoint` (CRIU) of the container.
//!
//! No cgroup is ever frozen while a lock, checkpoint or restore runs in it (cuda-checkpoint needs the
//! process's restore thread to run): the controller takes no hold, and Task Pause is refused, meanwhile.
//! Each cuda-checkpoint run or driver call is stopped after `cuda_checkpoint_timeout` (a wedged process never
//! holds a preemption, or the container, for good), each process's on its own. A failed step undoes what was
//! done, through the program and the driver API alike (`rollback.rs`: thaw after a call that got no answer,
//! ask where such a process got to, restore what was checkpointed, unlock what was locked, follow up a
//! process that does not answer) and the error names the pid and the call. A resume that fails for some
//! processes leaves those parked (a second resume retries them) and the others running; one that gave no
//! process its GPU back freezes the container again, parked as it was.
mod again;
pub mod cuda;
mod driver_api;
mod gpu_checkpoint;
mod host_memory;
mod presence;
mod refusals;
mod rollback;
pub mod state;

use std::{path::Path, time::Duration};

use baton_agent_api::{
    ContainerRef, Phase, PreemptMode, PreemptPhase, PreemptRequest, PreemptState, Step,
    now_monotonic_ns,
};
use baton_cgroups::process_gone;
use tokio::sync::mpsc;

use crate::{
    checkpoint::CriuOpts,
    container::Container,
    errors::{Result, ShimError},
    process::State,
};
use baton_nvidia::cuda_checkpoint::CudaState;
use cuda::{Action, CudaCheckpoint, CudaError};
use presence::Sorted;
use rollback::{Op, first_error, on_all, states_of, succeeded, unknown_outcomes};

pub use gpu_checkpoint::restore_cuda_after_runc_restore;

/// The timeline of one operation: every step is kept, and sent as it happens to whoever listens.
pub struct Steps {
    container: ContainerRef,
    tx: Option<mpsc::UnboundedSender<Step>>,
    /// The steps so far.
    pub all: Vec<Step>,
    /// Told each preemption state the operation enters before it ends (the agent link, so that a
    /// registration with an agent started meanwhile says the container is being preempted).
    on_state: Option<Box<dyn Fn(Option<PreemptState>) + Send + Sync>>,
}

impl Steps {
    /// A timeline for `container`, streamed to `tx` when given.
    pub fn new(container: ContainerRef, tx: Option<mpsc::UnboundedSender<Step>>) -> Self {
        Self {
            container,
            tx,
            all: Vec::new(),
            on_state: None,
        }
    }

    /// These steps, telling `on_state` each preemption state the operation enters before it ends.
    pub fn with_state_hook(
        mut self,
        on_state: impl Fn(Option<PreemptState>) + Send + Sync + 'static,
    ) -> Self {
        self.on_state = Some(Box::new(on_state));
        self
    }

    /// The operation entered preemption state `state`.
    pub fn state_entered(&self, state: Option<PreemptState>) {
        if let Some(hook) = &self.on_state {
            hook(state);
        }
    }

    /// Records (and sends) a step that happens now.
    pub fn emit(&mut self, phase: Phase, pid: Option<u32>, detail: impl Into<String>) {
        self.emit_at(now_monotonic_ns(), phase, pid, detail);
    }

    /// Records (and sends) a step that happened at `t_ns`.
    pub fn emit_at(
        &mut self,
        t_ns: u64,
        phase: Phase,
        pid: Option<u32>,
        detail: impl Into<String>,
    ) {
        let step = Step {
            t_ns,
            container: self.container.clone(),
            phase,
            pid,
            detail: detail.into(),
            no_cuda_state: Vec::new(),
        };
        self.send(step);
    }

    /// Records (and sends) that `pid`'s checkpoint returned: the driver freed its CUDA state. The step also
    /// names the processes the driver has no CUDA state for (`no_cuda_state`, left alone): the agent's word
    /// that the files only such processes share hold none.
    pub fn checkpointed(&mut self, pid: u32, no_cuda_state: &[u32]) {
        self.send(Step {
            t_ns: now_monotonic_ns(),
            container: self.container.clone(),
            phase: Phase::Checkpointed,
            pid: Some(pid),
            detail: String::new(),
            no_cuda_state: no_cuda_state.to_vec(),
        });
    }

    fn send(&mut self, step: Step) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(step.clone());
        }
        self.all.push(step);
    }
}

/// How long a resume waits for the shim to reap an init that is exiting (it closes its files first, which can take
/// a while on a loaded node); past it the step says "exited" without the status.
const REAP_WAIT: Duration = Duration::from_secs(30);

/// Waits up to `within` for `pid` to exit or begin its exit; whether it did.
async fn ends_within(pid: u32, within: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if baton_cgroups::process_ending(pid) {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

impl Container {
    /// The container's preemption state now.
    pub fn preemption(&self) -> Option<PreemptState> {
        self.preemption
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Sets and persists the preemption state.
    fn set_preemption(&self, state: Option<PreemptState>) {
        if let Err(e) = state::save(&self.bundle, state.as_ref()) {
            tracing::warn!(id = %self.id, "cannot persist the preemption state: {e}");
        }
        *self
            .preemption
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = state;
    }

    /// Forgets the preemption state (the container was killed, or exited).
    pub fn clear_preemption(&self) {
        self.set_preemption(None);
    }

    /// The container's cuda-checkpoint (the driver API where the node's library can be used, else the program),
    /// acting only on processes in the cgroups of its init `init`, each call stopped after
    /// `cuda_checkpoint_timeout`.
    async fn cuda_checkpoint(&self, init: u32) -> Result<CudaCheckpoint> {
        let api = self
            .settings
            .cuda_driver_path
            .as_deref()
            .map(driver_api::DriverApi::of);
        CudaCheckpoint::choose(&self.settings.cuda_checkpoint_path, api)
            .await
            .map(|c| c.confined_to(&self.id, init))
            .map(|c| c.within(self.settings.cuda_checkpoint_timeout))
            .map_err(|e| ShimError::FailedPrecondition {
                id: self.id.clone(),
                action: "preempt",
                state: e.to_string(),
            })
    }

    /// The pid of the container's init now.
    async fn init_pid(&self) -> u32 {
        self.procs.lock().await.init.pid
    }

    fn busy(&self) -> ShimError {
        ShimError::FailedPrecondition {
            id: self.id.clone(),
            action: "preempt or resume",
            state:
                "being preempted or resumed already, or rolling back a process that did not answer \
                    (wait for that to finish)"
                    .into(),
        }
    }

    /// Takes the container's operation lock, or refuses: one preemption operation at a time.
    fn begin_op(&self) -> Result<Op> {
        self.preempt_op
            .clone()
            .try_lock_owned()
            .map(Op::new)
            .map_err(|_| self.busy())
    }

    /// Preempts the container as `r` asks: locks and checkpoints the CUDA processes `r.pids`, then freezes it
    /// (park) or dumps it with CRIU (snapshot, into `r.image_path`, absolute, or
    /// `<snapshot_dir>/<namespace>/<id>`: see [`snapshot_image`]). Who asked (`parked_for`, `idle_park`) goes
    /// into the persisted state.
    pub async fn preempt(&self, r: PreemptRequest, steps: &mut Steps) -> Result<PreemptState> {
        if r.again {
            return self.park_again(r, steps).await;
        }
        let PreemptRequest {
            pids,
            mode,
            image_path: image,
            parked_for,
            idle_park,
            vram_bytes,
            host_budget_left_bytes,
            ..
        } = r;
        let pids = &pids;
        let image = match mode {
            PreemptMode::Snapshot => Some(snapshot_image(
                &self.settings.snapshot_dir,
                &self.namespace,
                &self.id,
                image,
            )?),
            PreemptMode::Park => None,
        };
        let mut op = self.begin_op()?;
        self.check_preemptible(pids).await?;
        self.end_hold_for("a preemption").await;
        let cuda = self.cuda_checkpoint(self.init_pid().await).await?;
        if let Some(library) = cuda.driver_api() {
            tracing::info!(id = %self.id, library, "checkpoint calls go through the CUDA driver API");
        }
        let sorted = self.sort_by_cuda_state(&cuda, pids, "preempt").await?;
        self.refuse_without_cuda_state(&sorted)?;
        let raised = self
            .make_room_for_host_copy(self.init_pid().await, vram_bytes, host_budget_left_bytes)
            .await?;
        let since_ns = now_monotonic_ns();
        let mut state = PreemptState {
            state: PreemptPhase::Preempting,
            mode,
            pids: sorted.cuda.clone(),
            since_ns,
            image_path: None,
            parked_for,
            idle_park,
            host_copy_bytes: vram_bytes.filter(|v| *v > 0),
            raised_limit: raised,
            unfrozen: mode == PreemptMode::Park && !self.settings.park_freezes(idle_park),
            no_cuda_state: sorted.left_alone.iter().map(|(pid, _)| *pid).collect(),
        };
        self.set_preemption(Some(state.clone()));
        steps.state_entered(Some(state.clone()));
        if let Err(e) = self.release_gpu(&mut op, &cuda, &sorted, steps).await {
            self.put_back_limit(raised).await;
            self.set_preemption(None);
            return Err(e);
        }
        let done = match mode {
            PreemptMode::Park if state.unfrozen => {
                tracing::info!(
                    id = %self.id,
                    "parked without freezing: its CPU threads run, its CUDA calls wait for the resume"
                );
                Ok(())
            }
            PreemptMode::Park => self.freeze_parked(&mut op, &cuda, &sorted, steps).await,
            PreemptMode::Snapshot => {
                let image = image.unwrap_or_default();
                state.image_path = Some(image.clone());
                self.dump(&mut op, &cuda, &sorted.cuda, &image, steps).await
            }
        };
        if let Err(e) = done {
            self.put_back_limit(raised).await;
            self.set_preemption(None);
            return Err(e);
        }
        state.state = match mode {
            PreemptMode::Park => PreemptPhase::Parked,
            PreemptMode::Snapshot => PreemptPhase::Snapshotted,
        };
        state.since_ns = now_monotonic_ns();
        self.set_preemption(Some(state.clone()));
        steps.emit(Phase::Done, None, mode.label());
        Ok(state)
    }

    async fn check_preemptible(&self, pids: &[u32]) -> Result<()> {
        if let Some(s) = self.preemption() {
            return Err(ShimError::FailedPrecondition {
                id: self.id.clone(),
                action: "preempt",
                state: format!(
                    "{:?} already (baton resume {} gives it its GPU back)",
                    s.state, self.id
                )
                .to_lowercase(),
            });
        }
        let init_state = self.procs.lock().await.init.state;
        if init_state != State::Running {
            return Err(ShimError::FailedPrecondition {
                id: self.id.clone(),
                action: "preempt",
                state: format!("{init_state:?} (only a running container is preempted)")
                    .to_lowercase(),
            });
        }
        if pids.is_empty() {
            return Err(ShimError::FailedPrecondition {
                id: self.id.clone(),
                action: "preempt",
                state:
                    "holding no GPU (no process of it has an NVIDIA file open): nothing to preempt"
                        .into(),
            });
        }
        self.refuse_unpreemptible(pids, "preempt")
    }

    /// Locks every CUDA process of `sorted`, then checkpoints them all concurrently. On failure, rolls it all
    /// back (see `rollback.rs`).
    async fn release_gpu(
        &self,
        op: &mut Op,
        cuda: &CudaCheckpoint,
        sorted: &Sorted,
        steps: &mut Steps,
    ) -> Result<()> {
        let pids = &sorted.cuda;
        let timeout = Some(self.settings.cuda_lock_timeout);
        let locks = on_all(cuda, Action::Lock, pids, timeout, |_, _| {}).await;
        if let Some(e) = first_error(&locks) {
            steps.emit(Phase::RollingBack, e.pid(), e.to_string());
            let locked = succeeded(&locks);
            let left = self.roll_back(op, cuda, &locks, Vec::new(), locked).await;
            return Err(self.failed("lock", &e, &left, steps));
        }
        steps.emit(
            Phase::Locked,
            None,
            format!("{} process(es){}", pids.len(), sorted.note()),
        );
        steps.emit(Phase::CheckpointStarted, None, "");
        let left_alone: Vec<u32> = sorted.left_alone.iter().map(|(pid, _)| *pid).collect();
        let checkpoints = on_all(cuda, Action::Checkpoint, pids, None, |pid, r| {
            if r.is_ok() {
                steps.checkpointed(pid, &left_alone);
            }
        })
        .await;
        if let Some(e) = first_error(&checkpoints) {
            steps.emit(Phase::RollingBack, e.pid(), e.to_string());
            let unknown = unknown_outcomes(&checkpoints);
            // Every process was locked; those whose checkpoint got no answer are asked where they are.
            let locked = pids.iter().copied().filter(|p| !unknown.contains(p));
            let left = self
                .roll_back(
                    op,
                    cuda,
                    &checkpoints,
                    succeeded(&checkpoints),
                    locked.collect(),
                )
                .await;
            return Err(self.failed("checkpoint", &e, &left, steps));
        }
        Ok(())
    }

    async fn freeze_parked(
        &self,
        op: &mut Op,
        cuda: &CudaCheckpoint,
        sorted: &Sorted,
        steps: &mut Steps,
    ) -> Result<()> {
        let pids = &sorted.cuda;
        if let Err(e) = self.set_paused(true).await {
            steps.emit(Phase::RollingBack, None, e.to_string());
            self.roll_back(op, cuda, &[], pids.clone(), pids.clone())
                .await;
            return Err(e);
        }
        let note = sorted.note();
        steps.emit(Phase::Frozen, None, note.trim_start_matches("; "));
        Ok(())
    }

    async fn dump(
        &self,
        op: &mut Op,
        cuda: &CudaCheckpoint,
        pids: &[u32],
        image: &str,
        steps: &mut Steps,
    ) -> Result<()> {
        let criu = CriuOpts {
            image_path: image.to_owned(),
            work_path: self.options.criu_work_path.clone(),
            exit: true,
            ..Default::default()
        };
        let dumped = async {
            std::fs::create_dir_all(image)
                .map_err(|e| ShimError::io(format!("create {image}"), e))?;
            gpu_checkpoint::write_cuda_pids(std::path::Path::new(image), pids)?;
            self.runc_checkpoint(&criu).await
        }
        .await;
        if let Err(e) = dumped {
            steps.emit(Phase::RollingBack, None, e.to_string());
            self.roll_back(op, cuda, &[], pids.to_vec(), pids.to_vec())
                .await;
            return Err(e);
        }
        steps.emit(Phase::Dumped, None, image);
        Ok(())
    }

    /// The error of a preemption whose `what` failed with `e` and was rolled back; `unanswered`: the pids that
    /// did not answer, followed up (each also gets a step).
    fn failed(
        &self,
        what: &str,
        e: &CudaError,
        unanswered: &[u32],
        steps: &mut Steps,
    ) -> ShimError {
        for &pid in unanswered {
            steps.emit(
                Phase::RollingBack,
                Some(pid),
                "no answer: restored and unlocked once it answers",
            );
        }
        let outcome = if unanswered.is_empty() {
            "the container runs as before".to_owned()
        } else {
            format!(
                "the others run as before; pid(s) {unanswered:?} did not answer (wedged in the driver): \
                 each is restored and unlocked once it answers, and the container cannot be preempted or \
                 paused until then"
            )
        };
        ShimError::Other(format!(
            "preempt {}: {what} failed: {e}; rolled back: {outcome}",
            self.id
        ))
    }

    /// The container's preemption state when it is parked (only a park parks: its mode is `park`); else
    /// `action` is refused, saying where it is.
    fn parked_or_refuse(&self, action: &'static str) -> Result<PreemptState> {
        match self.preemption() {
            Some(s) if s.state == PreemptPhase::Parked => Ok(s),
            other => Err(ShimError::FailedPrecondition {
                id: self.id.clone(),
                action,
                state: match other {
                    None => format!("not parked (it runs: nothing to {action})"),
                    Some(s) => format!("{:?}, not parked", s.state).to_lowercase(),
                },
            }),
        }
    }

    /// Persists the preemption state `state` and tells the timeline's hook (the agent) at once.
    fn enter(&self, steps: &Steps, state: Option<PreemptState>) {
        self.set_preemption(state.clone());
        steps.state_entered(state);
    }

    /// Gives a parked container its GPU back: thaw, restore every CUDA process, unlock them. A process that
    /// exits meanwhile (a job that finished) is reported as finished, not as a failed restore; its exit
    /// reaches containerd as a TaskExit with its real status.
    pub async fn resume_parked(&self, steps: &mut Steps) -> Result<()> {
        let _op = self.begin_op()?;
        let parked = self.parked_or_refuse("resume")?;
        let cuda = self.cuda_checkpoint(self.init_pid().await).await?;
        self.enter(
            steps,
            Some(PreemptState {
                state: PreemptPhase::Resuming,
                since_ns: now_monotonic_ns(),
                ..parked.clone()
            }),
        );
        // The hold, if any, ends; a container left running by a resume that failed part-way is not frozen.
        self.end_hold_for("a resume").await;
        let was_frozen = self.procs.lock().await.init.state == State::Paused;
        if was_frozen {
            if let Err(e) = self.set_paused(false).await {
                self.enter(steps, Some(parked));
                return Err(e);
            }
            steps.emit(Phase::Thawed, None, "");
        }
        let failures = self
            .restore_and_unlock_each(&cuda, &parked.pids, true, steps)
            .await;
        if failures.is_empty() {
            // Every process was restored: the host copy is freed, the limit a park raised goes back.
            let limit = self.put_back_limit(parked.raised_limit).await;
            self.enter(steps, None);
            let detail = limit.map_or_else(|| "resumed".to_owned(), |l| format!("resumed; {l}"));
            steps.emit(Phase::Done, None, detail);
            return Ok(());
        }
        // The processes that were not given their GPU back stay parked (a second resume retries them); the
        // others run.
        for (pid, e) in &failures {
            steps.emit(Phase::StillParked, Some(*pid), e.clone());
        }
        let failed: Vec<u32> = failures.iter().map(|(pid, _)| *pid).collect();
        // None was given its GPU back: the container is parked as before, frozen again (its threads would
        // otherwise run against a locked CUDA, and a watchdog among them end the job). When some were
        // restored, those run and the container stays thawed.
        let none_restored = parked.pids.iter().all(|p| failed.contains(p));
        if was_frozen && none_restored {
            match self.set_paused(true).await {
                Ok(()) => steps.emit(
                    Phase::Frozen,
                    None,
                    "frozen again: no process was given its GPU back",
                ),
                Err(e) => steps.emit(
                    Phase::RollingBack,
                    None,
                    format!("freezing it again failed: {e}"),
                ),
            }
        }
        self.enter(
            steps,
            Some(PreemptState {
                state: PreemptPhase::Parked,
                pids: failed.clone(),
                since_ns: now_monotonic_ns(),
                ..parked
            }),
        );
        let detail: Vec<&str> = failures.iter().map(|(_, e)| e.as_str()).collect();
        Err(ShimError::Other(format!(
            "resume {}: {}; still parked: pid(s) {failed:?} (the others run): `baton resume {}` retries them",
            self.id,
            detail.join("; "),
            self.id
        )))
    }

    /// Restores and unlocks `pids`; returns an error naming those that failed and are still alive.
    pub(crate) async fn restore_and_unlock(
        &self,
        cuda: &CudaCheckpoint,
        pids: &[u32],
        steps: &mut Steps,
    ) -> Result<()> {
        let failures = self.restore_and_unlock_each(cuda, pids, false, steps).await;
        if failures.is_empty() {
            return Ok(());
        }
        let detail: Vec<String> = failures.into_iter().map(|(_, e)| e).collect();
        Err(ShimError::Other(format!(
            "resume {}: {}",
            self.id,
            detail.join("; ")
        )))
    }

    /// Restores and unlocks `pids` (`ask_first`: each process is asked where it is first, so that one a
    /// resume left locked is only unlocked); returns each one that failed and is still alive, with why.
    async fn restore_and_unlock_each(
        &self,
        cuda: &CudaCheckpoint,
        pids: &[u32],
        ask_first: bool,
        steps: &mut Steps,
    ) -> Vec<(u32, String)> {
        let mut to_restore = pids.to_vec();
        let mut only_unlock = Vec::new();
        if ask_first {
            // Restored already (a resume that failed at the unlock), or given back already: no restore.
            for (pid, state) in states_of(cuda, pids).await {
                if let Ok(Some(CudaState::Locked | CudaState::Running)) = state {
                    to_restore.retain(|&p| p != pid);
                }
                if let Ok(Some(CudaState::Locked)) = state {
                    only_unlock.push(pid);
                }
            }
        }
        let restores = on_all(cuda, Action::Restore, &to_restore, None, |pid, r| {
            if r.is_ok() {
                steps.emit(Phase::Restored, Some(pid), "");
            }
        })
        .await;
        let mut failures = Vec::new();
        for (pid, r) in &restores {
            if let Err(e) = r {
                if ends_within(*pid, Duration::from_secs(1)).await {
                    let detail = self.exit_detail(*pid).await;
                    steps.emit(Phase::Finished, Some(*pid), detail);
                } else {
                    failures.push((*pid, e.to_string()));
                }
            }
        }
        let mut restored = succeeded(&restores);
        restored.extend(only_unlock);
        let unlocks = on_all(cuda, Action::Unlock, &restored, None, |_, _| {}).await;
        for (pid, r) in &unlocks {
            if let Err(e) = r
                && !process_gone(*pid)
            {
                failures.push((*pid, e.to_string()));
            }
        }
        if !restored.is_empty() {
            steps.emit(
                Phase::Unlocked,
                None,
                format!("{} process(es)", restored.len()),
            );
        }
        failures
    }

    /// "exited with status N" for the init (its exit is the shim's: the status as reaped, without waiting for
    /// its TaskExit, which waits for its execs and its output), "exited" for another process.
    async fn exit_detail(&self, pid: u32) -> String {
        let init = self.procs.lock().await.init.pid;
        if pid != init {
            return "exited".into();
        }
        let mut reaped = self.init_reaped.subscribe();
        match tokio::time::timeout(REAP_WAIT, reaped.wait_for(Option::is_some)).await {
            Ok(Ok(status)) => match *status {
                Some(status) => format!("exited with status {status}"),
                None => "exited".into(),
            },
            _ => "exited".into(),
        }
    }
}

/// Where a snapshot of container `id` in `namespace` puts its image: `requested` when the client named one
/// (absolute only: a relative path would be resolved against the shim's working directory), else
/// `<snapshot_dir>/<namespace>/<id>` on the node's disk (not the bundle, which is on tmpfs and deleted with
/// the task).
pub fn snapshot_image(
    snapshot_dir: &Path,
    namespace: &str,
    id: &str,
    requested: Option<String>,
) -> Result<String> {
    match requested {
        Some(path) => {
            baton_agent_api::check_image_path(&path).map_err(ShimError::InvalidArgument)?;
            Ok(path)
        }
        None => Ok(snapshot_dir.join(namespace).join(id).display().to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_image_is_absolute_and_defaults_to_the_node_snapshot_dir() {
        let dir = Path::new("/var/lib/baton/snapshots");
        assert_eq!(
            snapshot_image(dir, "k8s.io", "c1", None).unwrap(),
            "/var/lib/baton/snapshots/k8s.io/c1"
        );
        assert_eq!(
            snapshot_image(dir, "default", "c1", Some("/data/img".into())).unwrap(),
            "/data/img"
        );
        for relative in ["img", "./img", "../img", ""] {
            let e = snapshot_image(dir, "default", "c1", Some(relative.into())).unwrap_err();
            assert!(
                matches!(e, ShimError::InvalidArgument(_))
                    && e.to_string().contains("absolute path"),
                "{relative:?}: {e}"
            );
        }
    }
}
