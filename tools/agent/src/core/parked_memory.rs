//! The host memory parked containers hold, which the agent keeps within the node's budget. A park copies the
//! container's device memory into host memory charged to its own memory cgroup; where the cgroup has no room
//! the shim raises the limit while it is parked (`park_memory = "raise"`). What those raises add up to is
//! memory no pod's limit accounts for, so the agent, which sees every parked container, keeps it within
//! `parked_host_memory_budget` (default half the node's memory): each park it forwards carries what the
//! budget has left, and gap-fill checks, before it picks a co-runner, that its park would fit at all (the
//! same decision as the shim's, [`baton_agent_api::room_for_host_copy`]).
use baton_agent_api::{
    ContainerRef, HostMemory, ParkedHostMemory, PreemptPhase, host_copy::default_parked_budget,
    room_for_host_copy,
};
use baton_cgroups::memory::{MemoryCgroup, node_available};

use super::Core;

impl Core {
    /// What the parked containers hold now, what their raised limits add up to, and the node's budget.
    pub(crate) fn parked_host_memory(&self) -> ParkedHostMemory {
        let mut p = ParkedHostMemory {
            budget_bytes: self
                .parked_budget
                .unwrap_or_else(|| default_parked_budget(self.mem_total)),
            ..ParkedHostMemory::default()
        };
        for s in self.watched.values().filter_map(|w| w.preemption.as_ref()) {
            if s.state == PreemptPhase::Snapshotted {
                // Dumped to disk and stopped: its host copy went with its processes.
                continue;
            }
            p.held_bytes = p.held_bytes.saturating_add(s.host_copy_bytes.unwrap_or(0));
            p.raised_bytes = p
                .raised_bytes
                .saturating_add(s.raised_limit.map_or(0, |r| r.raised_by()));
        }
        p
    }

    /// Whether watched container `c` can be parked now as far as host memory goes, within `budget_left`
    /// bytes of raise: what its limit would be raised by (0 when it has room), or why its shim would refuse
    /// (the shim's own words). A container whose memory cgroup the agent cannot find is taken to fit (its
    /// shim checks again at the park).
    pub(crate) fn park_raise_of(&self, c: &ContainerRef, budget_left: u64) -> Result<u64, String> {
        let Some(w) = self.watched.get(c) else {
            return Ok(0);
        };
        let vram = self
            .tracer
            .as_ref()
            .and_then(|t| t.ledger().container(w.cgroup_id))
            .map_or(0, |l| l.vram_bytes());
        if vram == 0 {
            return Ok(0);
        }
        let Ok(memory) = MemoryCgroup::for_pid(w.registration.init_pid) else {
            return Ok(0);
        };
        let unreadable = |e: baton_cgroups::memory::MemoryError| {
            format!("its memory cgroup cannot be read ({e}), so its park would be refused")
        };
        let room = HostMemory {
            limit: memory.limit().map_err(unreadable)?,
            used: memory.usage().map_err(unreadable)?,
            available: node_available(),
            budget_left: Some(budget_left),
        };
        room_for_host_copy(vram, w.registration.settings.park_memory, &room)
            .map(|raised| raised.map_or(0, |r| r.raised_by()))
    }
}
