//! Rebuilding the fd mirror from /proc after the ring buffer lost records: a lost open, close, mmap or exit
//! would otherwise leave the mirror (and so "holds the GPU") wrong for good.
use std::collections::BTreeSet;

use super::{Tracer, TracerError, wait::now_monotonic_ns};
use crate::{
    event::{Body, Event},
    fdtable::{Corrections, Seen},
    seed,
};

impl Tracer {
    /// If records were dropped since the last look, or calls whose record the probes lost have returned:
    /// applies every record still in the ring (older than what /proc shows now), then re-reads from /proc
    /// every traced process (records dropped: a `Resync` event, saying how many, follows the records
    /// returned) or those processes (each once, however many of its calls were lost).
    pub(super) fn resync_if_records_lost(&mut self) -> Result<Vec<Event>, TracerError> {
        let drops = self.dropped();
        if drops <= self.drops_seen && self.lost_reseeds.is_empty() {
            return Ok(Vec::new());
        }
        let mut out = Vec::new();
        loop {
            let batch = super::wait::read_ring(self.ring.get_mut(), &self.layout);
            if batch.is_empty() {
                break;
            }
            out.extend(self.apply_all(batch)?);
        }
        let drops = self.dropped();
        if drops <= self.drops_seen {
            for pid in std::mem::take(&mut self.lost_reseeds) {
                self.reseed_pid(pid)?;
            }
            self.resyncs += 1;
            return Ok(out);
        }
        self.lost_reseeds.clear();
        let lost = drops - self.drops_seen;
        self.drops_seen = drops;
        self.resync()?;
        self.resyncs += 1;
        tracing::warn!(
            lost,
            "the probes' ring buffer was full and {lost} records were lost: NVIDIA fds and mappings were \
             re-read from /proc (objects created meanwhile are missing from the ledgers, marked partial)"
        );
        out.push(Event {
            ts_ns: now_monotonic_ns(),
            cgroup_id: 0,
            pid: 0,
            tid: 0,
            body: Body::Resync { lost },
        });
        Ok(out)
    }

    /// Re-reads from /proc every process the mirror knows and every process of a watched cgroup.
    pub(super) fn resync(&mut self) -> Result<(), TracerError> {
        let mut pids: BTreeSet<u32> = self.fds.iter().map(|(pid, _)| pid).collect();
        if self.watch_all {
            match seed::all_pids() {
                Ok(all) => pids.extend(all),
                // The processes the mirror knows are read again all the same; none is dropped unread.
                Err(e) => tracing::warn!(
                    "resync: cannot list /proc ({e}): only the followed processes are read again"
                ),
            }
        } else {
            let cgroups: Vec<u64> = self.watched.iter().copied().collect();
            for id in cgroups {
                pids.extend(self.cgroup_pids(id));
            }
        }
        // Records were lost, whose they were the ring does not say: calls made meanwhile (allocations among
        // them) may be missing from the ledger of every container traced.
        let mut cgroups: BTreeSet<u64> = self.watched.iter().copied().collect();
        cgroups.extend(self.fds.iter().map(|(_, p)| p.cgroup_id));
        // Parents before their children, so that a child's inherited files are found in its parent's.
        for pid in super::by_start_time(pids) {
            self.reseed_pid(pid)?;
        }
        for cg in cgroups {
            self.ledger.container_mut(cg).partial = true;
        }
        Ok(())
    }

    /// Follows process `pid` from now on with what /proc shows it holds: a holder the records never showed
    /// taking its NVIDIA files (an fd passed over a unix socket or taken with pidfd_getfd), found by the
    /// agent's /proc check before a release. Its later calls, closes, mappings and exit are traced.
    pub fn adopt(&mut self, pid: u32) -> Result<(), TracerError> {
        self.reseed_pid(pid).map(drop)
    }

    /// Makes the mirror agree with /proc for the processes `pids` (the processes of a container's cgroup
    /// tree, and those the mirror has in it): what the mirror had and /proc does not show goes (as if closed
    /// or unmapped now), what /proc shows and the mirror lacked is followed as opaque files. Apply the records
    /// still in the ring first ([`Tracer::drain_now`]), so that /proc is compared with everything the probes
    /// saw. Returns what was corrected, per process.
    pub fn reconcile(
        &mut self,
        pids: impl IntoIterator<Item = u32>,
    ) -> Result<Vec<(u32, Corrections)>, TracerError> {
        let mut out = Vec::new();
        for pid in pids {
            let c = self.reseed_pid(pid)?;
            if !c.is_empty() {
                out.push((pid, c));
            }
        }
        Ok(out)
    }

    /// Replaces the mirror's and the kernel map's view of `pid` with what /proc shows (keeping what both show
    /// as the mirror knows it). Returns what changed.
    pub(super) fn reseed_pid(&mut self, pid: u32) -> Result<Corrections, TracerError> {
        let read = seed::read_process(pid, self.probes.prefixes());
        self.reseed_with(read)
    }

    /// The device-directory prefixes the probes follow, for [`seed::read_process`] on another thread.
    pub fn proc_prefixes(&self) -> Vec<String> {
        self.probes.prefixes().to_vec()
    }

    /// A ticket for /proc reads made off the consumer's thread, taken before they begin: from now until it
    /// is handed back ([`Tracer::reconcile_reads`] or [`Tracer::proc_reads_dropped`]), the mirror notes which
    /// processes' fds and mappings change, so that a read a change overtook is not taken for the truth.
    pub fn proc_read_ticket(&mut self) -> ReadTicket {
        self.reads_in_flight += 1;
        ReadTicket {
            tracer: self.instance,
            seq: self.change_seq,
        }
    }

    /// Hands back a ticket whose reads will not be compared.
    pub fn proc_reads_dropped(&mut self, ticket: ReadTicket) {
        if ticket.tracer != self.instance {
            return;
        }
        self.reads_in_flight = self.reads_in_flight.saturating_sub(1);
        if self.reads_in_flight == 0 {
            self.proc_changes.clear();
        }
    }

    /// [`Tracer::reconcile`] with /proc read elsewhere (`reads`, begun after `ticket` was taken): a process
    /// whose fds or mappings changed in the mirror since (a record applied meanwhile) is left as the mirror
    /// has it, since the read may predate the change; it is returned among the skipped, to be read again.
    /// Apply the records still in the ring first ([`Tracer::drain_now`]).
    pub fn reconcile_reads(
        &mut self,
        ticket: ReadTicket,
        reads: Vec<seed::ProcRead>,
    ) -> Result<ReconciledReads, TracerError> {
        let since = ticket.seq;
        // A ticket of a tracer loaded before this one: its reads predate this mirror's seeding.
        let foreign = ticket.tracer != self.instance;
        let changed: BTreeSet<u32> = reads
            .iter()
            .filter(|r| foreign || self.proc_changes.get(&r.pid).is_some_and(|&at| at > since))
            .map(|r| r.pid)
            .collect();
        self.proc_reads_dropped(ticket);
        let mut out = ReconciledReads::default();
        for read in reads {
            if changed.contains(&read.pid) {
                out.skipped.push(read.pid);
                continue;
            }
            let pid = read.pid;
            if let seed::Shown::Unreadable(why) = &read.shown {
                out.unreadable.push((pid, why.clone()));
                continue;
            }
            let c = self.reseed_with(read)?;
            if !c.is_empty() {
                out.corrected.push((pid, c));
            }
        }
        Ok(out)
    }

    /// Notes that the mirror's view of `pid`'s fds or mappings changed (while reads are in flight).
    pub(super) fn proc_changed(&mut self, pid: u32) {
        self.change_seq += 1;
        if self.reads_in_flight > 0 {
            self.proc_changes.insert(pid, self.change_seq);
        }
    }

    /// [`Tracer::reseed_pid`] with what /proc showed (`read`). A process whose /proc could not be read whole
    /// is left as the mirror has it: nothing is dropped on a read that may have missed it, and nothing is
    /// added (the agent's checks count such a process as holding every GPU).
    fn reseed_with(&mut self, read: seed::ProcRead) -> Result<Corrections, TracerError> {
        let pid = read.pid;
        let (alive, seen) = match read.shown {
            seed::Shown::Gone => (false, Vec::new()),
            seed::Shown::Holds(seen) => (true, seen),
            seed::Shown::Unreadable(why) => {
                tracing::debug!(
                    pid,
                    "/proc of pid {pid} could not be read ({why}): the mirror keeps what it has of it"
                );
                return Ok(Corrections::default());
            }
        };
        let known = self.fds.get(pid).map(|p| p.cgroup_id);
        if known.is_none() && seen.is_empty() {
            return Ok(Corrections::default());
        }
        let cgroup_id = crate::cgroups::cgroup_id_of_pid(self.cgroups.root(), pid as i32)
            .or(known)
            .unwrap_or(0);
        let c = self.fds.reconcile(pid, cgroup_id, alive, &seen);
        if !c.is_empty() {
            self.proc_changed(pid);
        }
        self.share_with_parent(pid, &c);
        for fd in &c.stale_fds {
            self.kernel_forget(pid, cgroup_id, *fd);
        }
        for s in &seen {
            if let Seen::Fd { fd, kind, minor } = *s {
                self.kernel_track(pid, fd, kind, minor)?;
            }
        }
        if !c.new_fds.is_empty() || !c.new_maps.is_empty() {
            self.ledger.container_mut(cgroup_id).partial = true;
            self.probe_launches_of(pid);
        }
        if self.fds.get(pid).is_none() {
            self.ledger.container_mut(cgroup_id).release_process(pid);
            if !self.releases.pid_awaits(pid) {
                let _ = self.probes.nv_procs.remove(&pid);
            }
        }
        let _ = self.settle_released_files();
        Ok(c)
    }
}

/// The mirror's change count when /proc reads made elsewhere began ([`Tracer::proc_read_ticket`]).
#[derive(Debug)]
#[must_use = "hand the ticket back, with the reads or without them"]
pub struct ReadTicket {
    tracer: u64,
    seq: u64,
}

/// What [`Tracer::reconcile_reads`] did.
#[derive(Debug, Default)]
pub struct ReconciledReads {
    /// What was corrected, per process.
    pub corrected: Vec<(u32, Corrections)>,
    /// The processes left as the mirror has them: a record changed them after the read began.
    pub skipped: Vec<u32>,
    /// The processes left as the mirror has them: their /proc could not be read whole (why).
    pub unreadable: Vec<(u32, String)>,
}
