//! The mirror cannot be wrong forever: while a container holds the GPU, the core checks the probes' mirror
//! of its processes against the kernel's view (/proc fds and maps of every process of its cgroup tree) at a
//! bounded interval, read on the blocking pool ([`super::offload`]: a tenant with a million mappings takes
//! most of a second to read), and at once, on the core, when a checkpoint call of one of its processes
//! returns (the shim's `checkpointed` step, the release path of a park). What the mirror had and /proc does
//! not show goes; what /proc shows and the mirror lacked is followed (as files whose contents are unknown,
//! which hold the GPU until they go: a holder /proc shows still wins over the mirror). A container the
//! corrected view shows free is released with `confirmed_by: proc`, logged with what the mirror thought, and
//! counted in the `mirror_corrections` metric: a non-zero count is a probe bug to report.
use std::{collections::BTreeSet, time::Duration};

use baton_agent_api::ContainerRef;
use baton_tracer::{ReadTicket, fdtable::Corrections, seed::ProcRead};
use tokio::time::Instant;

use super::{Core, offload::Done};
use crate::{holders::pids_of_cgroup_tree, metrics::events::events};

/// How often a held container's mirror is checked against /proc.
pub(super) const RECONCILE_EVERY: Duration = Duration::from_secs(1);
/// A container check that took longer is logged (debug).
const SLOW_CHECK: Duration = Duration::from_millis(100);

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

    /// The periodic check: every held container whose last check is back, read on the blocking pool.
    pub(super) fn reconcile_held(&mut self) {
        self.reconcile_at = None;
        self.log_new_fd_quotas();
        // NVML's memory beside the ledgers of the containers holding a GPU, once a second (`gate/floor.rs`).
        self.ask_floor();
        let Some(tracer) = self.tracer.as_mut() else {
            return;
        };
        for (c, w) in self.watched.iter().filter(|(_, w)| w.is_held()) {
            if self.offload.is_checking(c) {
                continue;
            }
            let pids = mirror_pids(tracer, w.cgroup_id);
            let dir = tracer.cgroup_dir(w.cgroup_id);
            let ticket = tracer.proc_read_ticket();
            self.offload
                .check(c.clone(), ticket, dir, pids, tracer.proc_prefixes());
        }
    }

    /// A read of the blocking pool came back.
    pub(super) fn on_read_done(&mut self, done: Done) {
        match done {
            Done::Checked {
                container,
                ticket,
                reads,
                took,
            } => self.on_checked(&container, ticket, reads, took),
            Done::Scanned(scan) => self.on_node_scanned(scan),
        }
    }

    /// Container `c`'s processes were read (`reads`, begun at `ticket`): its mirror is corrected by what no
    /// record overtook, and what that changes is published.
    fn on_checked(
        &mut self,
        c: &ContainerRef,
        ticket: ReadTicket,
        reads: Vec<ProcRead>,
        took: Duration,
    ) {
        if took > SLOW_CHECK {
            tracing::debug!(
                id = c.id,
                took_ms = took.as_millis() as u64,
                processes = reads.len(),
                "agent: reading the container's processes from /proc was slow (on the blocking pool)"
            );
        }
        if let Some(w) = self.watched.get_mut(c) {
            w.proc_check = Some(baton_agent_api::ProcCheck {
                took_us: took.as_micros().try_into().unwrap_or(u64::MAX),
                processes: reads.len(),
                at_ns: baton_tracer::now_monotonic_ns(),
            });
        }
        let drained = self.drain_for_proc();
        // Without a tracer the ticket went with the one that issued it.
        let Some(tracer) = self.tracer.as_mut() else {
            return;
        };
        let cgroup_id = match self.watched.get(c) {
            Some(w) if drained && w.is_held() => w.cgroup_id,
            _ => {
                tracer.proc_reads_dropped(ticket);
                return;
            }
        };
        let before = tracer.gpu_state(cgroup_id);
        match tracer.reconcile_reads(ticket, reads) {
            Ok(done) => {
                for (pid, why) in &done.unreadable {
                    tracing::debug!(
                        id = c.id,
                        pid,
                        "agent: /proc of pid {pid} could not be read whole ({why}): the mirror keeps what it \
                         has of it (the check before a release counts it as holding)"
                    );
                }
                if !done.skipped.is_empty() {
                    tracing::debug!(
                        id = c.id,
                        "agent: pid(s) {:?} changed while /proc was read: checked at the next round",
                        done.skipped
                    );
                }
                let out = self.corrected(c, &before, &done.corrected);
                for (c, owner, body) in out {
                    self.publish(&c, owner, body);
                }
                self.check_gates();
            }
            Err(e) => tracing::warn!(
                id = c.id,
                "agent: checking the mirror against /proc failed: {e}"
            ),
        }
    }

    /// Applies the records still in the ring, so that /proc is compared with everything the probes saw.
    /// False when the ring could not be read (the failure is handled as any batch's).
    pub(crate) fn drain_for_proc(&mut self) -> bool {
        let Some(tracer) = self.tracer.as_mut() else {
            return false;
        };
        match tracer.drain_now() {
            Ok(records) if records.is_empty() => true,
            Ok(records) => {
                self.on_batch(Ok(records));
                self.check_gates();
                true
            }
            Err(e) => {
                self.on_batch(Err(e));
                false
            }
        }
    }

    /// Checks the mirror of `containers` against /proc now, on the core (those that hold the GPU), after
    /// applying the records already in the ring; publishes what that changes.
    pub(crate) fn reconcile(&mut self, containers: &[ContainerRef]) {
        if !self.drain_for_proc() {
            return;
        }
        let mut out = Vec::new();
        for c in containers {
            let (Some(tracer), Some(w)) = (self.tracer.as_mut(), self.watched.get(c)) else {
                continue;
            };
            if !w.is_held() {
                continue;
            }
            let mut pids = mirror_pids(tracer, w.cgroup_id);
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
            out.extend(self.corrected(c, &before, &corrections));
        }
        for (c, owner, body) in out {
            self.publish(&c, owner, body);
        }
        self.check_gates();
    }

    /// What the `corrections` of container `c`'s mirror (which showed `before`) change: its events, to
    /// publish. A release it brings is logged as the probe bug it is and counted.
    fn corrected(
        &mut self,
        c: &ContainerRef,
        before: &baton_tracer::GpuState,
        corrections: &[(u32, Corrections)],
    ) -> Vec<(ContainerRef, u32, baton_agent_api::EventBody)> {
        let (Some(tracer), Some(w)) = (self.tracer.as_mut(), self.watched.get_mut(c)) else {
            return Vec::new();
        };
        if corrections.is_empty() {
            return Vec::new();
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
                describe(before, corrections)
            );
        } else {
            tracing::debug!(
                id = c.id,
                "agent: the mirror was corrected from /proc ({})",
                describe(before, corrections)
            );
        }
        let owner = w.owner;
        bodies
            .into_iter()
            .map(|body| (c.clone(), owner, body))
            .collect()
    }
}

/// The processes the mirror has in cgroup `cgroup_id` (a check reads them with those of its cgroup tree).
fn mirror_pids(tracer: &baton_tracer::Tracer, cgroup_id: u64) -> BTreeSet<u32> {
    tracer
        .fd_table()
        .iter()
        .filter(|(_, p)| p.cgroup_id == cgroup_id)
        .map(|(pid, _)| pid)
        .collect()
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
