//! Parking again what a parked container put back on the GPU by itself. A park that leaves the container
//! thawed (the idle park by default, or every park where the node's TOML says `park-freeze = "false"`) lets
//! its CPU threads run, and so lets it start a fresh CUDA process that allocates beside the container the GPU
//! went to. The agent sees that process acquire GPU state while the container is parked and asks this: every
//! process of the container that the driver says runs CUDA now is locked and checkpointed as the first park
//! did, and joins the parked ones (the resume restores them all). When that checkpoint fails, the container is
//! frozen instead: the node owns the freeze, never the tenant, and nothing of it runs on beside the server.
//! GPU state no checkpoint can take (a process the driver has no CUDA state for: raw RM calls) is refused
//! here and left to the gate, where the container counts as a holder until that state goes.
use baton_agent_api::{Phase, PreemptRequest, PreemptState};
use baton_nvidia::cuda_checkpoint::CudaState;

use super::{Steps, presence::Sorted, rollback::states_of};
use crate::{
    container::Container,
    errors::{Result, ShimError},
};

impl Container {
    /// Parks again the processes of `r.pids` that run CUDA now, in a container that is parked (see the module
    /// comment). Refused when the container is not parked by a park, or another preemption operation runs.
    pub(super) async fn park_again(
        &self,
        r: PreemptRequest,
        steps: &mut Steps,
    ) -> Result<PreemptState> {
        let mut op = self.begin_op()?;
        let mut parked = self.parked_or_refuse("park again")?;
        let cuda = self.cuda_checkpoint(self.init_pid().await).await?;
        let fresh: Vec<u32> = states_of(&cuda, &r.pids)
            .await
            .into_iter()
            .filter(|(pid, state)| {
                !parked.pids.contains(pid) && matches!(state, Ok(Some(CudaState::Running)))
            })
            .map(|(pid, _)| pid)
            .collect();
        if fresh.is_empty() {
            return Err(ShimError::FailedPrecondition {
                id: self.id.clone(),
                action: "park again",
                state: "no process of it runs CUDA that a checkpoint could take: it stays parked as it is, \
                        and the agent counts its GPU state as a holder at the gate until it goes"
                    .into(),
            });
        }
        steps.emit(
            Phase::Asked,
            None,
            format!("park again: pid(s) {fresh:?} put GPU state back while parked"),
        );
        let sorted = Sorted {
            cuda: fresh.clone(),
            left_alone: Vec::new(),
        };
        let checkpointed = self
            .release_gpu(&mut op, &cuda, &sorted, steps)
            .await
            .map_err(|e| e.to_string());
        match checkpointed {
            Ok(()) => {
                tracing::info!(
                    id = %self.id,
                    "parked again: pid(s) {fresh:?} acquired GPU state while the container was parked"
                );
                parked.pids.extend(fresh);
            }
            Err(why) => {
                // Frozen, as the node decides: what the container holds on the GPU stays there, but nothing
                // of it runs beside the server.
                tracing::warn!(
                    id = %self.id,
                    "parked container acquired GPU state whose park failed ({why}): frozen"
                );
                if !parked.unfrozen {
                    return Err(ShimError::Other(format!(
                        "park again {}: {why}; it is frozen already",
                        self.id
                    )));
                }
                self.set_paused(true).await?;
                parked.unfrozen = false;
                steps.emit(
                    Phase::Frozen,
                    None,
                    format!(
                        "frozen: the park of GPU state it acquired while parked failed ({why})"
                    ),
                );
            }
        }
        parked.since_ns = baton_agent_api::now_monotonic_ns();
        self.set_preemption(Some(parked.clone()));
        steps.state_entered(Some(parked.clone()));
        steps.emit(Phase::Done, None, "parked again");
        Ok(parked)
    }
}
