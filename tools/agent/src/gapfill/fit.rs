//! Gap-fill with room: a server short of room parks only the co-runners it must (lowest priority first, until
//! the deficit is covered), and a parked co-runner resumes beside its server as soon as its memory fits again
//! (see `gate/room.rs` for how room is counted).
use std::collections::BTreeSet;

use baton_agent_api::{ContainerRef, room::show_bytes};

use super::Pick;
use crate::{core::Core, gate::DeviceKey, registry::watched::Watched};

impl Core {
    /// Container `c`'s video memory in the ledger; `None` when the ledger cannot measure it (open files whose
    /// contents the probes never saw) or it is not watched.
    pub(crate) fn ledger_bytes(&self, c: &ContainerRef) -> Option<u64> {
        let w = self.watched.get(c)?;
        let s = self.tracer.as_ref()?.gpu_state(w.cgroup_id);
        (s.opaque_files == 0).then_some(s.vram_bytes)
    }

    /// The need container `c` declared (`baton.io/gpu-memory`), raised to the node's least need
    /// (`gpu_memory_minimum`); `None`: it declared none, and needs the whole GPU.
    pub(crate) fn declared_need(&self, c: &ContainerRef) -> Option<u64> {
        let declared = self.watched.get(c)?.registration.gpu_memory?;
        Some(declared.max(self.gpu_min_need))
    }

    /// What container `c` counts for on a GPU it holds, beside others: its ledger's video memory when it
    /// declared a need; the whole GPU (`None`) when it declared none (room is among declarers: a container
    /// that never said what it needs may grow to the whole GPU, so nothing starts beside it on room), or
    /// when the ledger cannot measure it.
    pub(crate) fn counted_bytes(&self, c: &ContainerRef) -> Option<u64> {
        self.declared_need(c)?;
        self.ledger_bytes(c)
    }

    /// The fewest of `picks`, lowest priority first, whose memory frees `deficit` beside what the co-runners
    /// already being preempted off these GPUs will free (none when those do); all of them when even all
    /// would not (then the server waits for the other holders, as for the whole GPU). A co-runner whose
    /// memory the ledger cannot measure frees the whole GPU.
    pub(super) fn enough_to_fit(
        &self,
        mut picks: Vec<Pick>,
        deficit: u64,
        holders: &[&Watched],
    ) -> Vec<Pick> {
        let mut freed = 0u64;
        for h in holders {
            let c = &h.registration.container;
            if self.gapfill.is_being_preempted(c) {
                freed = freed.saturating_add(self.counted_bytes(c).unwrap_or(u64::MAX));
            }
        }
        if freed >= deficit {
            return Vec::new();
        }
        picks.sort_by_key(|p| p.priority);
        let mut enough = Vec::new();
        for p in picks.drain(..) {
            if freed >= deficit {
                break;
            }
            freed = freed.saturating_add(p.bytes.unwrap_or(u64::MAX));
            enough.push(p);
        }
        enough
    }

    /// Whether parked co-runner `c` (`bytes` of video memory when it was parked) may resume beside the
    /// servers on `devices`: its memory is free on each of them and no Start waits for one of them (a waiting
    /// server comes first). `Some(what a trace says)` when it may.
    pub(super) fn fits_beside(
        &self,
        c: &ContainerRef,
        devices: &BTreeSet<DeviceKey>,
        bytes: Option<u64>,
    ) -> Option<String> {
        let bytes = bytes?;
        if devices.is_empty()
            || self.waiters.iter().any(|w| {
                w.devices
                    .iter()
                    .any(|d| devices.iter().any(|k| k.same_device(d)))
            })
        {
            return None;
        }
        let mut tightest = u64::MAX;
        for d in devices {
            let room = self.room_on(d, c).filter(|r| r.free >= bytes)?;
            tightest = tightest.min(room.free);
        }
        Some(format!(
            "resumed {} beside its servers: it fits again (needs {}, {} free)",
            c.id,
            show_bytes(bytes),
            show_bytes(tightest)
        ))
    }
}
