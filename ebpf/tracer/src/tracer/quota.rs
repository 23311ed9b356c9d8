//! Each cgroup's share of the probes' fd map. `NV_FDS` holds a fixed number of entries for the whole node;
//! one process could fill it (dup a device file 70,000 times) and blind the probes for every other
//! container. So each cgroup may take `fd_quota` entries: the probes count those they make (`CG_FDS`),
//! this side counts those it makes (`CG_FDS_USER`: seeds from /proc, a forked child's inherited fds), and a
//! removal is taken off whichever side removes it, so the sum is the cgroup's share. Past the quota, or with
//! the map full, neither side adds more for that cgroup and it is marked in `CG_OVER`: its later fds are not
//! followed by the probes (no records), and the agent follows it through /proc (a holder /proc shows that
//! the mirror does not account for holds; see the agent's registry). Nothing it does reaches the other
//! cgroups' entries.
//!
//! A quota alone let sixteen containers of one tenant fill the map. So the map also keeps a node-wide
//! reserve (`NV_FDS_RESERVE`): both sides count the entries they make and remove (`NV_FDS_USED`, the
//! probes' half atomic, this side's written here only), a cgroup's first `NV_FDS_BASE` entries may come out
//! of the reserve, and its later ones only while the shared part has room (`fd_entry_allowed`). However
//! many containers at their quota, another container's first few hundred fds are followed.
use baton_probe_common::{FdInfo, FdKey, NV_FDS_ENTRIES, NV_FDS_RESERVE, fd_entry_allowed};

use super::{BPF_NOEXIST, Tracer, TracerError};

/// `bpf_map_update_elem` errors that mean "no room": the map is full.
const NO_ROOM: [i32; 2] = [
    nix::errno::Errno::E2BIG as i32,
    nix::errno::Errno::ENOMEM as i32,
];

impl Tracer {
    /// How many NVIDIA fds of one cgroup the probes follow (0: no bound).
    pub fn fd_quota(&self) -> u32 {
        self.probes.fd_quota()
    }

    /// Whether cgroup `cg` reached its fd quota (or found the map full): its later fds are followed through
    /// /proc only.
    pub fn over_fd_quota(&self, cg: u64) -> bool {
        self.probes.cg_over.get(&cg, 0).is_ok()
    }

    /// The cgroups that reached their fd quota.
    pub fn over_fd_quota_cgroups(&self) -> Vec<u64> {
        self.probes.cg_over.keys().filter_map(Result::ok).collect()
    }

    /// The entries of the probes' fd map that cgroup `cg` takes now.
    pub fn cgroup_fd_entries(&self, cg: u64) -> u64 {
        let mine = self.probes.cg_fds.get(&cg, 0).unwrap_or(0);
        mine.wrapping_add(self.user_fds(cg)).min(i64::MAX as u64)
    }

    /// Fds the probes did not follow because their cgroup was at its quota, and because the map was full.
    pub fn fds_refused(&self) -> (u64, u64) {
        use baton_probe_common::Counter;
        (
            self.probes.counter(Counter::FdQuotaRefused),
            self.probes.counter(Counter::FdMapFull),
        )
    }

    /// The cgroups that reached their quota since the last call (a look at the map only when the probes
    /// refused an fd since).
    pub fn newly_over_fd_quota(&mut self) -> Vec<u64> {
        let (refused, full) = self.fds_refused();
        if refused + full == self.quota_refusals_seen {
            return Vec::new();
        }
        self.quota_refusals_seen = refused + full;
        let over = self.over_fd_quota_cgroups();
        over.into_iter()
            .filter(|cg| self.over_reported.insert(*cg))
            .collect()
    }

    fn user_fds(&self, cg: u64) -> u64 {
        self.probes.cg_fds_user.get(&cg, 0).unwrap_or(0)
    }

    /// Adds `delta` (wrapping) to cgroup `cg`'s entries made by this side, and to the node's.
    fn add_user_fds(&mut self, cg: u64, delta: u64) {
        let n = self.user_fds(cg).wrapping_add(delta);
        let _ = self.probes.cg_fds_user.insert(cg, n, 0);
        let node = self.probes.nv_fds_used.get(&1, 0).unwrap_or(0);
        let _ = self.probes.nv_fds_used.set(1, node.wrapping_add(delta), 0);
    }

    /// Entries in the probes' fd map now (both sides' counts).
    pub fn fd_map_entries(&self) -> u64 {
        let side = |i: u32| self.probes.nv_fds_used.get(&i, 0).unwrap_or(0);
        let n = side(0).wrapping_add(side(1));
        if (n as i64) < 0 { 0 } else { n }
    }

    /// The probes' fd map: (entries it holds, entries free, entries of its reserve free). The reserve is
    /// what only containers within their base may take (`NV_FDS_RESERVE`): the shared part is used first.
    pub fn fd_map_room(&self) -> (u64, u64, u64) {
        let used = self.fd_map_entries().min(u64::from(NV_FDS_ENTRIES));
        let free = u64::from(NV_FDS_ENTRIES) - used;
        (used, free, free.min(u64::from(NV_FDS_RESERVE)))
    }

    /// Marks cgroup `cg` as past its quota.
    fn mark_over(&mut self, cg: u64, why: &str) {
        if self.probes.cg_over.insert(cg, 1, BPF_NOEXIST).is_ok() {
            tracing::warn!(
                cgroup_id = cg,
                "cgroup {cg} {why}: its further NVIDIA fds are followed through /proc only"
            );
        }
    }

    /// Forgets cgroup `cg`'s counts (it is no longer watched).
    pub(super) fn forget_cgroup_quota(&mut self, cg: u64) {
        self.over_reported.remove(&cg);
        let _ = self.probes.cg_fds.remove(&cg);
        let _ = self.probes.cg_fds_user.remove(&cg);
        let _ = self.probes.cg_over.remove(&cg);
    }

    /// Puts `fd` of `tgid` in the kernel's fd map (replacing an entry there), within its cgroup's quota.
    pub(super) fn kernel_track(
        &mut self,
        tgid: u32,
        fd: i32,
        kind: baton_nvidia::fdkind::FdKind,
        minor: u8,
    ) -> Result<(), TracerError> {
        self.kernel_insert(tgid, fd, kind, minor, 0)
    }

    /// [`Tracer::kernel_track`] that leaves an entry the probes made alone: the process runs ahead of this
    /// consumer, so by the time a record is applied the probe may have put a newer file under that number
    /// (a close and an open of another device since), and overwriting it with the record's kind would
    /// give the process's later calls on it the old file's kind (seen: a dup of a reused fd number taken for
    /// nvidiactl while it was nvidia0).
    pub(super) fn kernel_restore(
        &mut self,
        tgid: u32,
        fd: i32,
        kind: baton_nvidia::fdkind::FdKind,
        minor: u8,
    ) -> Result<(), TracerError> {
        self.kernel_insert(tgid, fd, kind, minor, BPF_NOEXIST)
    }

    fn kernel_insert(
        &mut self,
        tgid: u32,
        fd: i32,
        kind: baton_nvidia::fdkind::FdKind,
        minor: u8,
        flags: u64,
    ) -> Result<(), TracerError> {
        if !self.kernel_fd_entry(tgid, fd, kind, minor, flags)? {
            return Ok(());
        }
        self.probes
            .nv_procs
            .insert(tgid, 1, 0)
            .map_err(|e| TracerError::MapUpdate {
                map: "NV_PROCS",
                pid: tgid,
                detail: e.to_string(),
            })
    }

    /// Puts `fd` of `tgid` in the kernel's fd map; with [`BPF_NOEXIST`], an entry already there is kept.
    /// Returns whether the map has an entry for it now: not when its cgroup is at its quota or the map is
    /// full (the cgroup is then marked, and followed through /proc: not an error, which would reload the
    /// probes for every container).
    pub(super) fn kernel_fd_entry(
        &mut self,
        tgid: u32,
        fd: i32,
        kind: baton_nvidia::fdkind::FdKind,
        minor: u8,
        flags: u64,
    ) -> Result<bool, TracerError> {
        let key = FdKey {
            tgid,
            fd: fd as u32,
        };
        let info = FdInfo {
            kind: kind as u8,
            minor,
            _pad: [0; 2],
        };
        let there = self.probes.nv_fds.get(&key, 0).is_ok();
        if there && flags & BPF_NOEXIST != 0 {
            return Ok(true);
        }
        let cg = self.fds.get(tgid).map_or(0, |p| p.cgroup_id);
        let quota = u64::from(self.fd_quota());
        let mine = self.cgroup_fd_entries(cg);
        if !there && quota != 0 && mine >= quota {
            self.mark_over(cg, &format!("has {quota} NVIDIA fds followed (its quota)"));
            return Ok(false);
        }
        if !there && !fd_entry_allowed(self.fd_map_entries(), mine) {
            self.mark_over(
                cg,
                "found the probes' fd map full but for the reserve kept for other containers' first fds",
            );
            return Ok(false);
        }
        match self.probes.nv_fds.insert(key, info, flags) {
            Ok(()) => {
                if !there {
                    self.add_user_fds(cg, 1);
                }
                Ok(true)
            }
            Err(aya::maps::MapError::SyscallError(e))
                if flags & BPF_NOEXIST != 0
                    && e.io_error.raw_os_error() == Some(nix::errno::Errno::EEXIST as i32) =>
            {
                Ok(true)
            }
            Err(aya::maps::MapError::SyscallError(e))
                if e.io_error
                    .raw_os_error()
                    .is_some_and(|n| NO_ROOM.contains(&n)) =>
            {
                self.mark_over(cg, "found the probes' fd map full");
                Ok(false)
            }
            Err(e) => Err(TracerError::MapUpdate {
                map: "NV_FDS",
                pid: tgid,
                detail: e.to_string(),
            }),
        }
    }

    /// Removes `fd` of `tgid` (of cgroup `cg`) from the kernel's fd map, and from the cgroup's share.
    pub(super) fn kernel_forget(&mut self, tgid: u32, cg: u64, fd: i32) {
        let key = FdKey {
            tgid,
            fd: fd as u32,
        };
        if self.probes.nv_fds.remove(&key).is_ok() {
            self.add_user_fds(cg, u64::MAX);
        }
    }
}

#[cfg(test)]
mod tests {
    use baton_probe_common::{NV_FDS_BASE, NV_FDS_ENTRIES, NV_FDS_RESERVE, fd_entry_allowed};

    #[test]
    fn a_container_within_its_base_may_take_the_reserve_and_one_past_it_may_not() {
        let (all, shared, base) = (
            u64::from(NV_FDS_ENTRIES),
            u64::from(NV_FDS_ENTRIES - NV_FDS_RESERVE),
            u64::from(NV_FDS_BASE),
        );
        // With room in the shared part, anyone may add.
        assert!(fd_entry_allowed(0, 0));
        assert!(fd_entry_allowed(shared - 1, base + 100));
        // The shared part full: only a container within its base, from the reserve.
        assert!(!fd_entry_allowed(shared, base));
        assert!(fd_entry_allowed(shared, base - 1));
        assert!(fd_entry_allowed(all - 1, 0));
        // The whole map full: no one.
        assert!(!fd_entry_allowed(all, 0));
        // Sixteen containers at the default quota stop at the shared part, leaving the reserve whole.
        let quota = u64::from(baton_probe_common::DEFAULT_FD_QUOTA);
        assert!(16 * quota > shared && NV_FDS_RESERVE >= 64 * NV_FDS_BASE);
    }
}
