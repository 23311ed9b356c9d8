//! A parked container that acquires GPU state again is parked again. A park that leaves its container thawed
//! (the idle park by default, or every park where the node's TOML says `park-freeze = "false"`) lets it run
//! CPU work, and so start a fresh CUDA process that allocates beside the container the GPU went to: the
//! probes show it as an `acquired` of a container whose preemption state is parked. The agent, which owns
//! every cross-pod decision, asks the container's shim to park the processes that run CUDA now beside the
//! parked ones ([`baton_agent_api::PreemptRequest::again`]); the shim freezes the container when that
//! checkpoint fails. Meanwhile, and when nothing could be parked, the container holds the GPU in the ledger,
//! so the gate lets no other Start onto it.
use baton_agent_api::{
    ContainerRef, Outcome, PreemptMode, PreemptPhase, PreemptRequest, Request, Target,
};

use super::{Done, show_step};
use crate::{core::Core, preempt::run_unattended};

impl Core {
    /// Container `c` acquired GPU state: when it is parked (by a park), has its shim park again what it put
    /// back on the GPU. At most one such request per container runs at a time.
    pub(crate) fn park_again_if_parked(&mut self, c: &ContainerRef) {
        let Some(state) = self.watched.get(c).and_then(|w| w.preemption.clone()) else {
            return;
        };
        if state.state != PreemptPhase::Parked || state.mode != PreemptMode::Park {
            return;
        }
        if !self.gapfill.parking_again.insert(c.clone()) {
            return;
        }
        let r = match self.resolve(&Target::exact(c)) {
            Ok(r) if !r.pids.is_empty() => r,
            _ => {
                self.gapfill.parking_again.remove(c);
                return;
            }
        };
        tracing::debug!(
            id = c.id,
            pids = ?r.pids,
            "agent: a parked container acquired GPU state: asking its shim to park it again"
        );
        let request = Request::Preempt(PreemptRequest {
            target: Target::exact(c),
            mode: PreemptMode::Park,
            pids: r.pids.clone(),
            image_path: None,
            parked_for: state.parked_for.clone(),
            idle_park: state.idle_park,
            vram_bytes: Some(r.vram_bytes),
            host_budget_left_bytes: Some(r.host_budget_left),
            again: true,
        });
        let done = self.gapfill.done_sender();
        let container = c.clone();
        tokio::spawn(async move {
            let (_, result) = run_unattended(
                &r,
                request,
                "the agent: it acquired GPU state while parked",
                show_step(&done),
            )
            .await;
            let _ = done.send(Done::ParkedAgain { container, result });
        });
    }

    /// A park-again of container `c` ended.
    pub(crate) fn parked_again(&mut self, c: &ContainerRef, result: &Result<Outcome, String>) {
        self.gapfill.parking_again.remove(c);
        match result {
            Ok(o) => {
                self.set_preemption(c, o.preemption.clone());
                tracing::warn!(
                    id = c.id,
                    "agent: a parked container acquired GPU state again: parked again"
                );
            }
            // A resume that began meanwhile (the shim refuses while one runs, or once it ran) is no failure.
            Err(e) if e.contains("not parked") || e.contains("resumed already") => {
                tracing::debug!(id = c.id, "agent: no park again: {e}");
            }
            Err(e) => tracing::warn!(
                id = c.id,
                "agent: a parked container acquired GPU state and was not parked again: {e}; it counts as \
                 holding its GPU at the gate until that state goes"
            ),
        }
    }
}
