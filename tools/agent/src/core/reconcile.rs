//! The mirror cannot be wrong forever: while a container holds the GPU, the core checks the probes' mirror
//! of its processes against the kernel's view (/proc fds and map_files of every process of its cgroup tree)
//! at a bounded interval, and at once when a checkpoint call of one of its processes returns (the shim's
//! `checkpointed` step). What the mirror had and /proc does not show goes; what /proc shows and the mirror
//! lacked is followed (as files whose contents are unknown, which hold the GPU until they go: a holder /proc
//! shows still wins over the mirror). A container the corrected view shows free is released with
//! `confirmed_by: proc`, logged with what the mirror thought, and counted in the `mirror_corrections` metric:
//! a non-zero count is a probe bug to report.
use std::{collections::BTreeSet, time::Duration};

use baton_agent_api::ContainerRef;
use baton_tracer::fdtable::Corrections;
use tokio::time::Instant;

use super::Core;
use crate::{holders::pids_of_cgroup_tree, metrics::events::events};

/// How often a held container's mirror is checked against /proc.
pub(super) const RECONCILE_EVERY: Duration = Duration::from_secs(1);

impl Core {
    /// When the next check of the held containers is due; none while no watched container holds the GPU.
    pub(super) fn reconcile_due(&mut self) -> Option<Instant> {
        if !self.watched.values().any(|w| w.is_held()) {
            self.reconcile_at = None;
            return None;
        }
        Some(
            *self
                .reconcile_at
                .get_or_insert_with(|| Instant::now() + RECONCILE_EVERY),
        )
    }

    /// The periodic check: every held container.
    pub(super) fn reconcile_held(&mut self) {
        self.reconcile_at = None;
        self.log_new_fd_quotas();
        let held: Vec<ContainerRef> = self
            .watched
            .iter()
            .filter(|(_, w)| w.is_held())
            .map(|(c, _)| c.clone())
            .collect();
        self.reconcile(&held);
    }

    /// Checks the mirror of `containers` against /proc now (those that hold the GPU), after applying the
    /// records already in the ring; publishes what that changes.
    pub(crate) fn reconcile(&mut self, containers: &[ContainerRef]) {
        let Some(tracer) = self.tracer.as_mut() else {
            return;
        };
        match tracer.drain_now() {
            Ok(records) if records.is_empty() => {}
            Ok(records) => {
                self.on_batch(Ok(records));
                self.check_gates();
            }
            Err(e) => {
                self.on_batch(Err(e));
                return;
            }
        }
        let mut out = Vec::new();
        for c in containers {
            let (Some(tracer), Some(w)) = (self.tracer.as_mut(), self.watched.get_mut(c)) else {
                continue;
            };
            if !w.is_held() {
                continue;
            }
            let mut pids: BTreeSet<u32> = tracer
                .fd_table()
                .iter()
                .filter(|(_, p)| p.cgroup_id == w.cgroup_id)
                .map(|(pid, _)| pid)
                .collect();
            if let Some(dir) = tracer.cgroup_dir(w.cgroup_id) {
                pids.extend(pids_of_cgroup_tree(&dir));
            }
            let before = tracer.gpu_state(w.cgroup_id);
            let corrections = match tracer.reconcile(pids) {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(
                        id = c.id,
                        "agent: checking the mirror against /proc failed: {e}"
                    );
                    continue;
                }
            };
            if corrections.is_empty() {
                continue;
            }
            let bodies = w.update_as(tracer, &[], &self.classifier, true);
            let released = bodies
                .iter()
                .any(|b| matches!(b, baton_agent_api::EventBody::Released(_)));
            if released {
                events().mirror_corrected();
                tracing::warn!(
                    id = c.id,
                    namespace = c.namespace,
                    "agent: /proc shows container {} free while the probes' mirror held it ({}): released \
                     (confirmed by proc); this is a probe bug, please report it with this log",
                    c.id,
                    describe(&before, &corrections)
                );
            } else {
                tracing::debug!(
                    id = c.id,
                    "agent: the mirror was corrected from /proc ({})",
                    describe(&before, &corrections)
                );
            }
            for body in bodies {
                out.push((c.clone(), w.owner, body));
            }
        }
        for (c, owner, body) in out {
            self.publish(&c, owner, body);
        }
        self.check_gates();
    }
}

/// What the mirror thought (`before`) and what /proc corrected, for the log.
fn describe(before: &baton_tracer::GpuState, corrections: &[(u32, Corrections)]) -> String {
    let each: Vec<String> = corrections
        .iter()
        .map(|(pid, c)| {
            format!(
                "pid {pid}: {} fd(s) and {} mapping(s) gone, {} fd(s) and {} mapping(s) not seen before",
                c.stale_fds.len(),
                c.stale_maps.len(),
                c.new_fds.len(),
                c.new_maps.len()
            )
        })
        .collect();
    format!(
        "the mirror had {} fd(s), {} mapping(s), {} object(s) holding GPU state, {} unconfirmed; {}",
        before.open_fds,
        before.mappings,
        before.state_objects,
        before.unconfirmed,
        each.join("; ")
    )
}
