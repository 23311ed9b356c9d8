//! Room for a park's host copy. The checkpoint copies the container's device memory into the host memory of
//! each parked process, charged to the container's memory cgroup: recorded on the H200, 4 GiB of VRAM under
//! memory.max 2 GiB made the checkpoint fail with 304 and the kernel OOM-kill the process
//! (/work/shared/gpu/580.159.04/README.md, point 6). So before it locks anything the park compares what it
//! will copy (the agent's ledger of the container's device memory, plus a margin: no recording says how much
//! more than the device memory a checkpoint takes) with the cgroup's room (limit less use); with too little
//! room it raises the limit by what is missing while the container is parked, when the node has that much
//! available (`park_memory = "raise"`, the default), or refuses, naming the numbers (`"refuse"`). The raised
//! limit is kept in the persisted preemption state and put back once the resume has restored every process
//! (the host copy is freed by then), or when the park fails.
use baton_agent_api::{ParkMemory, RaisedLimit};
use baton_cgroups::memory::{MemoryCgroup, node_available};

use crate::{
    container::Container,
    errors::{Result, ShimError},
};

const MIB: u64 = 1 << 20;

/// What a park copying `vram` bytes of device memory is taken to need in host memory: the device memory,
/// a sixteenth more, and 64 MiB (the checkpoint's own buffers; not measured).
pub fn host_copy_need(vram: u64) -> u64 {
    vram.saturating_add(vram / 16).saturating_add(64 * MIB)
}

fn mib(bytes: u64) -> u64 {
    bytes.div_ceil(MIB)
}

impl Container {
    /// Makes room in the memory cgroup of the container (its init `init`) for the host copy of `vram` bytes
    /// of device memory, as the node's `park_memory` says; the limit it raised, if any.
    pub(super) async fn make_room_for_host_copy(
        &self,
        init: u32,
        vram: Option<u64>,
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
        let need = host_copy_need(vram);
        let refuse = |why: String| ShimError::FailedPrecondition {
            id: self.id.clone(),
            action: "park",
            state: why,
        };
        let io = |e: baton_cgroups::memory::MemoryError| refuse(format!("{e}"));
        let available = node_available();
        let Some(limit) = memory.limit().map_err(io)? else {
            return match available {
                Some(a) if a < need => Err(refuse(format!(
                    "the park would copy {} MiB of device memory into host memory (with its margin) and the \
                     node has {} MiB available: free memory on the node or park another container",
                    mib(need),
                    mib(a)
                ))),
                _ => Ok(None),
            };
        };
        let used = memory.usage().map_err(io)?;
        let room = limit.saturating_sub(used);
        if room >= need {
            return Ok(None);
        }
        let missing = need - room;
        let numbers = format!(
            "the park copies {} MiB of device memory into host memory charged to its memory cgroup ({} MiB \
             with the margin), which has {} MiB of room (limit {} MiB, used {} MiB)",
            mib(vram),
            mib(need),
            mib(room),
            mib(limit),
            mib(used)
        );
        if self.settings.park_memory == ParkMemory::Refuse {
            return Err(refuse(format!(
                "{numbers}: parking it would have the kernel OOM-kill it; raise its memory limit by {} MiB, \
                 or set park_memory = \"raise\" in the runtime's options on the node",
                mib(missing)
            )));
        }
        if let Some(a) = available.filter(|a| *a < missing) {
            return Err(refuse(format!(
                "{numbers}; raising its limit by the {} MiB missing needs that much on the node, which has {} MiB \
                 available: free memory on the node or raise its memory limit",
                mib(missing),
                mib(a)
            )));
        }
        let raised = RaisedLimit {
            was_bytes: limit,
            raised_to_bytes: limit.saturating_add(missing),
        };
        memory.set_limit(Some(raised.raised_to_bytes)).map_err(io)?;
        tracing::info!(
            id = %self.id,
            "park: {numbers}: its limit is raised to {} MiB while it is parked",
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_need_is_the_device_memory_and_a_margin() {
        assert_eq!(host_copy_need(0), 64 * MIB);
        assert_eq!(host_copy_need(1 << 30), (1 << 30) + (64 << 20) + 64 * MIB);
        assert_eq!(host_copy_need(u64::MAX), u64::MAX);
    }
}
