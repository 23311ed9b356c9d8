//! Rebuilding the fd mirror from /proc after the ring buffer lost records: a lost open, close, mmap or exit
//! would otherwise leave the mirror (and so "holds the GPU") wrong for good.
use std::collections::BTreeSet;

use super::{Tracer, TracerError, wait::now_monotonic_ns};
use crate::{
    event::{Body, Event},
    fdtable::ProcFds,
    seed::{self, Found},
};

impl Tracer {
    /// If records were dropped since the last look: applies every record still in the ring (older than what
    /// /proc shows now), then re-reads every traced process from /proc, and returns those records followed by
    /// a `Resync` event saying how many were lost.
    pub(super) fn resync_if_records_lost(&mut self) -> Result<Vec<Event>, TracerError> {
        let drops = self.dropped();
        if drops <= self.drops_seen {
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
            pids.extend(seed::all_pids().into_iter().map(|p| p as u32));
        } else {
            let cgroups: Vec<u64> = self.watched.iter().copied().collect();
            for id in cgroups {
                pids.extend(self.cgroup_pids(id).into_iter().map(|p| p as u32));
            }
        }
        for pid in pids {
            self.reseed_pid(pid)?;
        }
        Ok(())
    }

    /// Follows process `pid` from now on with what /proc shows it holds: a holder the records never showed
    /// taking its NVIDIA files (an fd passed over a unix socket or taken with pidfd_getfd), found by the
    /// agent's /proc check before a release. Its later calls, closes, mappings and exit are traced.
    pub fn adopt(&mut self, pid: u32) -> Result<(), TracerError> {
        self.reseed_pid(pid)
    }

    /// Replaces the mirror's and the kernel map's view of `pid` with what /proc shows.
    fn reseed_pid(&mut self, pid: u32) -> Result<(), TracerError> {
        let found = seed::scan_process(pid as i32, self.probes.prefixes());
        let old = self.fds.get(pid).cloned();
        let cgroup_id = crate::cgroups::cgroup_id_of_pid(self.cgroups.root(), pid as i32)
            .or(old.as_ref().map(|p| p.cgroup_id))
            .unwrap_or(0);
        let mut now = ProcFds {
            cgroup_id,
            ..Default::default()
        };
        for f in found {
            match f {
                Found::Fd { fd, nv, .. } => {
                    now.fds.insert(fd, nv);
                }
                Found::Map { addr, len } => {
                    now.maps.insert(addr, len);
                }
            }
        }
        if let Some(old) = &old {
            for fd in old.fds.keys().filter(|fd| !now.fds.contains_key(fd)) {
                self.kernel_forget(pid, *fd);
            }
        }
        for (fd, nv) in &now.fds {
            self.kernel_track(pid, *fd, *nv)?;
        }
        if old.is_some() || now.pins_driver() {
            self.ledger.container_mut(cgroup_id).partial = true;
        }
        if old.is_some() && !now.pins_driver() {
            self.ledger.container_mut(cgroup_id).release_process(pid);
        }
        self.fds.replace(pid, now);
        Ok(())
    }
}
