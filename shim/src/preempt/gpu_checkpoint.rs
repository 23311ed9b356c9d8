//! containerd's Task Checkpoint (`ctr task checkpoint`, CRI's CheckpointContainer) of a GPU container, and
//! the restore of such a checkpoint: CRIU cannot dump GPU state, so the CUDA processes (those the driver has
//! CUDA state for: `presence.rs`) are checkpointed by cuda-checkpoint first (their GPU state goes to host
//! memory, the release signal fires), then CRIU dumps;
//! a container left running is restored and unlocked after the dump. The CUDA processes are written into
//! the image (`baton-cuda.json`, pids as the container sees them) so that a restore knows whom to restore.
use std::path::Path;

use baton_agent_api::Phase;
use baton_nvidia::cuda_checkpoint::CudaState;

use super::{Steps, rollback::states_of};
use crate::{
    checkpoint::CriuOpts,
    container::Container,
    errors::{Result, ShimError},
    process::State,
};

/// The file in a checkpoint image that lists its CUDA processes.
pub const CUDA_PIDS_FILE: &str = "baton-cuda.json";

/// The pid of host process `pid` inside its own pid namespace (the last `NSpid` field).
fn ns_pid(pid: u32) -> Option<u32> {
    let status = procfs::process::Process::new(pid as i32)
        .and_then(|p| p.status())
        .ok()?;
    status
        .nspid
        .and_then(|v| v.last().copied())
        .map(|p| p as u32)
}

/// Writes the CUDA processes (in-namespace pids) into the image directory.
pub fn write_cuda_pids(image: &Path, pids: &[u32]) -> Result<()> {
    let ns: Vec<u32> = pids.iter().filter_map(|&p| ns_pid(p)).collect();
    let path = image.join(CUDA_PIDS_FILE);
    let text = serde_json::json!({ "ns_pids": ns }).to_string();
    std::fs::write(&path, text).map_err(|e| ShimError::io(format!("write {}", path.display()), e))
}

/// The host pids, in the pid namespace of `init`, of the in-namespace pids listed in `image`.
fn restored_pids(image: &Path, init: u32) -> Vec<u32> {
    let Ok(text) = std::fs::read_to_string(image.join(CUDA_PIDS_FILE)) else {
        return Vec::new();
    };
    let wanted: Vec<u32> = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| serde_json::from_value(v["ns_pids"].clone()).ok())
        .unwrap_or_default();
    let ns_of = |pid: u32| std::fs::read_link(format!("/proc/{pid}/ns/pid")).ok();
    let Some(init_ns) = ns_of(init) else {
        return Vec::new();
    };
    let Ok(all) = procfs::process::all_processes() else {
        return Vec::new();
    };
    all.flatten()
        .map(|p| p.pid() as u32)
        .filter(|&pid| ns_of(pid).as_ref() == Some(&init_ns))
        .filter(|&pid| ns_pid(pid).is_some_and(|n| wanted.contains(&n)))
        .collect()
}

/// After `runc restore` of a checkpoint with CUDA processes: restores and unlocks those that CRIU's CUDA
/// plugin did not (cuda-checkpoint's `--get-state` tells: `checkpointed` is restored and unlocked, `locked`
/// unlocked, `running` left alone).
pub async fn restore_cuda_after_runc_restore(c: &Container, image: &Path, init: u32) -> Result<()> {
    let pids = restored_pids(image, init);
    if pids.is_empty() {
        return Ok(());
    }
    // No Task Pause while cuda-checkpoint runs in it.
    let _op = c.preempt_op.lock().await;
    let cuda = c.cuda_checkpoint(init).await?;
    let mut steps = Steps::new(
        baton_agent_api::ContainerRef {
            id: c.id.clone(),
            namespace: c.namespace.clone(),
        },
        None,
    );
    let mut checkpointed = Vec::new();
    let mut locked = Vec::new();
    for (pid, state) in states_of(&cuda, &pids).await {
        match state {
            Ok(Some(CudaState::Checkpointed)) => checkpointed.push(pid),
            Ok(Some(CudaState::Locked)) => locked.push(pid),
            Ok(_) => {}
            Err(e) => tracing::warn!(id = %c.id, pid, "after restore: {e}"),
        }
    }
    c.restore_and_unlock(&cuda, &checkpointed, &mut steps)
        .await?;
    for pid in locked {
        if let Err(e) = cuda.run(super::cuda::Action::Unlock, pid, None).await {
            tracing::warn!(id = %c.id, pid, "after restore: {e}");
        }
    }
    tracing::info!(id = %c.id, pids = ?pids, "restored the CUDA processes after runc restore");
    Ok(())
}

impl Container {
    /// Task Checkpoint of a container whose CUDA processes are `pids` (see the module comment). A container
    /// that containerd paused first (its Go client does) is thawed while cuda-checkpoint runs and frozen
    /// again before CRIU.
    pub async fn checkpoint_gpu(
        &self,
        criu: &CriuOpts,
        pids: &[u32],
        steps: &mut Steps,
    ) -> Result<()> {
        self.refuse_unpreemptible(pids, "checkpoint")?;
        let mut op = self.begin_op()?;
        let cuda = self.cuda_checkpoint(self.init_pid().await).await?;
        self.end_hold_for("a checkpoint").await;
        let was_paused = self.procs.lock().await.init.state == State::Paused;
        if was_paused {
            self.set_paused(false).await?;
            steps.emit(
                Phase::Thawed,
                None,
                "cuda-checkpoint needs the process running",
            );
        }
        let dumped = async {
            let sorted = self.sort_by_cuda_state(&cuda, pids, "checkpoint").await?;
            let pids = &sorted.cuda;
            if !pids.is_empty() {
                self.release_gpu(&mut op, &cuda, &sorted, steps).await?;
            }
            let image = Path::new(&criu.image_path);
            std::fs::create_dir_all(image)
                .map_err(|e| ShimError::io(format!("create {}", image.display()), e))?;
            write_cuda_pids(image, pids)?;
            if let Err(e) = self.runc_checkpoint(criu).await {
                steps.emit(Phase::RollingBack, None, e.to_string());
                self.restore_and_unlock(&cuda, pids, steps).await?;
                return Err(e);
            }
            steps.emit(Phase::Dumped, None, criu.image_path.clone());
            if !criu.exit {
                self.restore_and_unlock(&cuda, pids, steps).await?;
            }
            Ok(())
        }
        .await;
        let running = self.procs.lock().await.init.state == State::Running;
        if was_paused && running && op.handed_over() {
            // A process did not answer and is followed up: freezing would wedge it for good.
            tracing::warn!(id = %self.id, "checkpoint: left running, not paused again as containerd left it: a process that did not answer is being rolled back");
        } else if was_paused && running && !(criu.exit && dumped.is_ok()) {
            // Not after a dump with `exit`: CRIU stopped the container, whose cgroup goes (a freeze raced
            // the exit's reaping and failed with ENODEV, CI: preempt.rs's checkpoint restore test).
            self.set_paused(true).await?;
            steps.emit(Phase::Frozen, None, "paused again, as containerd left it");
        }
        dumped
    }
}
