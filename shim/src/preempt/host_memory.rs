//! Room for a park's host copy. The checkpoint copies the container's device memory into the host memory of
//! each parked process, charged to the container's memory cgroup (recorded on the H200: see
//! [`baton_agent_api::host_copy`]). So before it locks anything the park compares what it will copy (the
//! agent's ledger of the container's device memory, plus a margin) with the cgroup's room (limit less use);
//! with too little room it raises the limit by what is missing while the container is parked, when the node
//! has that much available and its budget for parked host memory (kept by the agent, sent with the request)
//! has that much left (`park_memory = "raise"`, the default), or refuses, naming the numbers (`"refuse"`).
//! The decision is the agent-api's, which the agent's gap-fill also uses to skip co-runners it cannot park.
//! The raised limit is kept in the persisted preemption state and put back once the resume has restored every
//! process (the host copy is freed by then), or when the park fails.
use baton_agent_api::{HostMemory, RaisedLimit, room_for_host_copy};
use baton_cgroups::memory::{MemoryCgroup, node_available};

use crate::{
    container::Container,
    errors::{Result, ShimError},
};

fn mib(bytes: u64) -> u64 {
    bytes.div_ceil(1 << 20)
}

impl Container {
    /// Makes room in the memory cgroup of the container (its init `init`) for the host copy of `vram` bytes
    /// of device memory, as the node's `park_memory` says, within `budget_left` bytes of raise (the node's
    /// budget, as the agent sent it); the limit it raised, if any.
    pub(super) async fn make_room_for_host_copy(
        &self,
        init: u32,
        vram: Option<u64>,
        budget_left: Option<u64>,
    ) -> Result<Option<RaisedLimit>> {
        let Some(vram) = vram.filter(|v| *v > 0) else {
            return Ok(None);
        };
        let memory = match MemoryCgroup::for_pid(init) {
            Ok(m) => m,
            Err(e) => {
                tracing::debug!(id = %self.id, "park: no memory cgroup to check: {e}");
                return Ok(None);
            }
        };
        let refuse = |why: String| ShimError::FailedPrecondition {
            id: self.id.clone(),
            action: "park",
            state: why,
        };
        let io = |e: baton_cgroups::memory::MemoryError| refuse(format!("{e}"));
        let room = HostMemory {
            limit: memory.limit().map_err(io)?,
            used: memory.usage().map_err(io)?,
            available: node_available(),
            budget_left,
        };
        let Some(raised) =
            room_for_host_copy(vram, self.settings.park_memory, &room).map_err(refuse)?
        else {
            return Ok(None);
        };
        memory.set_limit(Some(raised.raised_to_bytes)).map_err(io)?;
        tracing::info!(
            id = %self.id,
            "park: its {} MiB of device memory do not fit in its memory limit of {} MiB (used {} MiB): \
             the limit is raised to {} MiB while it is parked",
            mib(vram),
            mib(raised.was_bytes),
            mib(room.used),
            mib(raised.raised_to_bytes)
        );
        Ok(Some(raised))
    }

    /// Puts back the memory limit a park raised (after the resume, or when the park failed); says what
    /// happened, for the step's detail.
    pub(super) async fn put_back_limit(&self, raised: Option<RaisedLimit>) -> Option<String> {
        let raised = raised?;
        let init = self.procs.lock().await.init.pid;
        let put = MemoryCgroup::for_pid(init)
            .map_err(|e| e.to_string())
            .and_then(|m| {
                m.set_limit(Some(raised.was_bytes))
                    .map_err(|e| e.to_string())
            });
        Some(match put {
            Ok(()) => format!("memory limit back to {} MiB", mib(raised.was_bytes)),
            Err(e) => {
                tracing::warn!(
                    id = %self.id,
                    "cannot put its memory limit back to {} MiB after the park ({e}): it stays at {} MiB",
                    mib(raised.was_bytes),
                    mib(raised.raised_to_bytes)
                );
                format!(
                    "its memory limit stays at {} MiB (putting back {} MiB failed: {e})",
                    mib(raised.raised_to_bytes),
                    mib(raised.was_bytes)
                )
            }
        })
    }
}
