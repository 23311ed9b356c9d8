//! Which of the processes a preemption names own CUDA state: only those are locked, checkpointed and
//! restored. Before anything is locked, the driver's get-state is asked of each (`cuda-checkpoint --get-state`
//! or `cuCheckpointProcessGetState`, all at once, each bounded on its own). A process the driver has no CUDA
//! state for ([`super::cuda::no_cuda_state`]: a worker forked after CUDA init, which inherited its parent's
//! NVIDIA files, or a process that never initialised CUDA) is left alone: frozen with the cgroup at the end of
//! a park and thawed with it at resume, never locked, checkpointed or restored, and named in the timeline and
//! the log. A process that exited meanwhile is dropped; any other failure to answer refuses the preemption
//! before anything changed.

use super::{cuda::CudaCheckpoint, rollback::states_of};
use crate::{
    container::Container,
    errors::{Result, ShimError},
};

/// The processes of a preemption, by whether they own CUDA state.
#[derive(Debug, Default)]
pub struct Sorted {
    /// Those to lock and checkpoint, in the order given.
    pub cuda: Vec<u32>,
    /// Those left alone, with the driver's answer for each.
    pub left_alone: Vec<(u32, &'static str)>,
}

impl Sorted {
    /// What the timeline says of the processes left alone: "" when none, else "; left alone (no CUDA
    /// state): pid 12 (CUDA_ERROR_NOT_INITIALIZED)".
    pub fn note(&self) -> String {
        if self.left_alone.is_empty() {
            return String::new();
        }
        let each: Vec<String> = self
            .left_alone
            .iter()
            .map(|(pid, code)| format!("pid {pid} ({code})"))
            .collect();
        format!("; left alone (no CUDA state): {}", each.join(", "))
    }
}

impl Container {
    /// Sorts `pids` by whether they own CUDA state (see the module comment); `action` names the operation in
    /// a refusal.
    pub(super) async fn sort_by_cuda_state(
        &self,
        cuda: &CudaCheckpoint,
        pids: &[u32],
        action: &str,
    ) -> Result<Sorted> {
        let mut sorted = Sorted::default();
        for (pid, state) in states_of(cuda, pids).await {
            let Err(e) = state else {
                sorted.cuda.push(pid);
                continue;
            };
            if let Some(code) = e.no_cuda_state() {
                tracing::info!(
                    id = %self.id,
                    pid,
                    "pid {pid} has no CUDA state (the driver answers {code}: a forked worker, or a process \
                     that never initialised CUDA): left alone, never locked or checkpointed, frozen and thawed \
                     with the container"
                );
                sorted.left_alone.push((pid, code));
            } else if baton_cgroups::process_gone(pid) {
                tracing::info!(id = %self.id, pid, "pid {pid} exited: nothing to {action}");
            } else {
                return Err(ShimError::Other(format!(
                    "{action} {}: cannot tell whether pid {pid} has CUDA state: {e}; nothing was locked: \
                     the container runs as before",
                    self.id
                )));
            }
        }
        Ok(sorted)
    }

    /// Refuses a park whose processes all have no CUDA state.
    pub(super) fn refuse_without_cuda_state(&self, sorted: &Sorted) -> Result<()> {
        if !sorted.cuda.is_empty() {
            return Ok(());
        }
        let pids: Vec<u32> = sorted.left_alone.iter().map(|(pid, _)| *pid).collect();
        let codes: Vec<&str> = sorted.left_alone.iter().map(|(_, code)| *code).collect();
        Err(ShimError::FailedPrecondition {
            id: self.id.clone(),
            action: "preempt",
            state: format!(
                "holding no CUDA state: the driver has none for pid(s) {pids:?} ({}: forked workers, which \
                 inherit their parent's NVIDIA files, or processes that never initialised CUDA): nothing to \
                 park",
                codes.join(", ")
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_timeline_names_each_process_left_alone_with_the_drivers_answer() {
        let mut sorted = Sorted {
            cuda: vec![10],
            left_alone: Vec::new(),
        };
        assert_eq!(sorted.note(), "");
        sorted.left_alone = vec![
            (11, "CUDA_ERROR_NOT_INITIALIZED"),
            (12, "CUDA_ERROR_INVALID_VALUE"),
        ];
        assert_eq!(
            sorted.note(),
            "; left alone (no CUDA state): pid 11 (CUDA_ERROR_NOT_INITIALIZED), pid 12 \
             (CUDA_ERROR_INVALID_VALUE)"
        );
    }
}
