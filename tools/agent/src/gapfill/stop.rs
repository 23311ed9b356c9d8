//! A parked container being stopped (a pod deletion's SIGTERM, a `ctr task kill`): its shim asks whether to
//! resume it first, so that what it does on its way out (a final checkpoint, a flush, the CUDA calls of its
//! exit handlers) runs instead of waiting on a locked CUDA until the kubelet's SIGKILL. The agent owns the
//! answer, as it owns every cross-pod decision: yes only when its GPU is free for it, that is, no Start waits
//! for that GPU, no server was just let through for it, and no other watched container holds it, or (the
//! GPU's memory known) its memory at the park fits beside those that do. A resume never pushes a server off
//! its GPU or out of its memory for a container that is going away.
use std::collections::BTreeSet;

use baton_agent_api::{ContainerRef, Reply, now_monotonic_ns, room::show_bytes};

use crate::{
    core::{Core, Note, NoteKind},
    gate::{self, DeviceKey},
};

impl Core {
    /// Answers `stop_parked` for container `c`, asked by `peer` (only the shim that registered it may ask);
    /// the answer goes into the container's trace too.
    pub(crate) fn stop_parked(&mut self, c: &ContainerRef, peer: u32) -> Reply {
        let Some(w) = self.watched.get(c) else {
            return Reply::Error {
                error: format!(
                    "container {} (namespace {}) is not watched by the agent",
                    c.id, c.namespace
                ),
            };
        };
        if w.owner != peer {
            return Reply::Error {
                error: format!(
                    "only the shim that registered container {} (pid {}) asks about its stop",
                    c.id, w.owner
                ),
            };
        }
        let devices = gate::devices_seen(w.registration.init_pid, &w.registration.devices);
        let bytes = w.preemption.as_ref().and_then(|p| p.host_copy_bytes);
        let (resume_first, why) = self.free_for_parked(c, &devices, bytes);
        let detail = if resume_first {
            format!("stopped while parked: resumed first ({why}), so that its exit may use CUDA")
        } else {
            format!(
                "stopped while parked, not resumed first: {why}; its CPU threads get the signal, a CUDA call \
                 it makes on its way out waits until it is killed"
            )
        };
        tracing::info!(id = c.id, "agent: {detail}");
        self.note(&Note {
            container: c.clone(),
            t_ns: now_monotonic_ns(),
            kind: NoteKind::Room {
                what: "stopping",
                detail,
            },
        });
        Reply::StopParked { resume_first, why }
    }

    /// Whether GPU `devices` are free for parked container `c` (`bytes`: its memory at the park), and why.
    fn free_for_parked(
        &self,
        c: &ContainerRef,
        devices: &BTreeSet<DeviceKey>,
        bytes: Option<u64>,
    ) -> (bool, String) {
        if devices.is_empty() {
            return (false, "the agent sees no GPU device in it".to_owned());
        }
        let on_its_gpu = |on: &BTreeSet<DeviceKey>| {
            on.is_empty() || on.iter().any(|d| devices.iter().any(|k| k.same_device(d)))
        };
        if let Some(w) = self
            .waiters
            .iter()
            .find(|w| w.container != *c && on_its_gpu(&w.devices))
        {
            return (
                false,
                format!("the Start of {} waits for its GPU", w.container.id),
            );
        }
        if let Some((s, _)) = self
            .gapfill
            .claims()
            .find(|(s, on)| s != c && on_its_gpu(on))
        {
            return (
                false,
                format!("{} was just let through the gate for its GPU", s.id),
            );
        }
        let holders: Vec<String> = self
            .holders(c, devices)
            .iter()
            .map(|h| h.registration.container.id.clone())
            .collect();
        if holders.is_empty() {
            return (true, "its GPU is free".to_owned());
        }
        let names = holders.join(", ");
        let Some(bytes) = bytes else {
            return (false, format!("its GPU is held by {names}"));
        };
        let mut tightest = u64::MAX;
        for d in devices {
            match self.room_on(d, c) {
                Some(room) if room.free >= bytes => tightest = tightest.min(room.free),
                Some(room) => {
                    return (
                        false,
                        format!(
                            "its GPU is held by {names} (it needs {}, {} free)",
                            show_bytes(bytes),
                            show_bytes(room.free)
                        ),
                    );
                }
                None => return (false, format!("its GPU is held by {names}")),
            }
        }
        (
            true,
            format!(
                "it fits beside {names} (needs {}, {} free)",
                show_bytes(bytes),
                show_bytes(tightest)
            ),
        )
    }
}
