//! User space's mirror of the NVIDIA fds and mappings of every traced process.
//!
//! The probes keep the authoritative `NV_FDS` map for the fast path, but they cannot iterate it on fork or
//! exit. This mirror, fed by the same records, tells user space which kernel entries to copy (fork), drop
//! (exit, exec) and whether a process still pins driver state (open fds or mappings).
use std::collections::{BTreeMap, HashMap};

use baton_nvidia::fdkind::FdKind;

/// One NVIDIA fd of a process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NvFd {
    /// Which device file.
    pub kind: FdKind,
    /// Device minor for `nvidiaN`.
    pub minor: u8,
}

/// The NVIDIA state of one process.
#[derive(Clone, Debug, Default)]
pub struct ProcFds {
    /// cgroup v2 id the process was last seen in.
    pub cgroup_id: u64,
    /// Open NVIDIA fds.
    pub fds: HashMap<i32, NvFd>,
    /// Mappings of NVIDIA device files: address -> length.
    pub maps: BTreeMap<u64, u64>,
}

impl ProcFds {
    /// Whether the process still holds anything that keeps the driver's per-file state alive.
    pub fn pins_driver(&self) -> bool {
        !self.fds.is_empty() || !self.maps.is_empty()
    }
}

/// All traced processes, by tgid.
#[derive(Debug, Default)]
pub struct FdTable {
    procs: HashMap<u32, ProcFds>,
}

impl FdTable {
    /// The state of `tgid`, if it holds NVIDIA fds or mappings.
    pub fn get(&self, tgid: u32) -> Option<&ProcFds> {
        self.procs.get(&tgid)
    }

    /// Every traced process.
    pub fn iter(&self) -> impl Iterator<Item = (u32, &ProcFds)> {
        self.procs.iter().map(|(k, v)| (*k, v))
    }

    /// Records an fd that now refers to an NVIDIA device file.
    pub fn add_fd(&mut self, tgid: u32, cgroup_id: u64, fd: i32, nv: NvFd) {
        let p = self.procs.entry(tgid).or_default();
        p.cgroup_id = cgroup_id;
        p.fds.insert(fd, nv);
    }

    /// Forgets an fd; returns what it was.
    pub fn remove_fd(&mut self, tgid: u32, fd: i32) -> Option<NvFd> {
        let p = self.procs.get_mut(&tgid)?;
        let nv = p.fds.remove(&fd);
        self.gc(tgid);
        nv
    }

    /// Forgets the fds `first..=last` (close_range); returns the NVIDIA ones among them.
    pub fn remove_range(&mut self, tgid: u32, first: u32, last: u32) -> Vec<i32> {
        let Some(p) = self.procs.get_mut(&tgid) else {
            return Vec::new();
        };
        let closed: Vec<i32> = p
            .fds
            .keys()
            .copied()
            .filter(|fd| (first..=last).contains(&(*fd as u32)))
            .collect();
        for fd in &closed {
            p.fds.remove(fd);
        }
        self.gc(tgid);
        closed
    }

    /// Replaces what the mirror holds of `tgid` (a resync from /proc).
    pub fn replace(&mut self, tgid: u32, state: ProcFds) {
        if state.pins_driver() {
            self.procs.insert(tgid, state);
        } else {
            self.procs.remove(&tgid);
        }
    }

    /// Records a mapping of an NVIDIA device file.
    pub fn add_map(&mut self, tgid: u32, cgroup_id: u64, addr: u64, len: u64) {
        let p = self.procs.entry(tgid).or_default();
        p.cgroup_id = cgroup_id;
        p.maps.insert(addr, len);
    }

    /// Removes the NVIDIA mappings that `[addr, addr+len)` covers entirely or in part (a partial unmap of a
    /// device mapping keeps the rest mapped: it is trimmed). Returns the bytes unmapped.
    pub fn unmap(&mut self, tgid: u32, addr: u64, len: u64) -> u64 {
        let Some(p) = self.procs.get_mut(&tgid) else {
            return 0;
        };
        let end = addr.saturating_add(len);
        let hit: Vec<(u64, u64)> = p
            .maps
            .iter()
            .filter(|(a, l)| **a < end && a.saturating_add(**l) > addr)
            .map(|(a, l)| (*a, *l))
            .collect();
        let mut gone = 0;
        for (a, l) in hit {
            p.maps.remove(&a);
            let m_end = a.saturating_add(l);
            if a < addr {
                p.maps.insert(a, addr - a);
            }
            if m_end > end {
                p.maps.insert(end, m_end - end);
            }
            gone += m_end.min(end) - a.max(addr);
        }
        self.gc(tgid);
        gone
    }

    /// A child inherits its parent's fds and mappings. Returns the fds to copy into the kernel map.
    pub fn fork(&mut self, parent: u32, child: u32) -> Vec<(i32, NvFd)> {
        let Some(p) = self.procs.get(&parent).cloned() else {
            return Vec::new();
        };
        let fds = p.fds.iter().map(|(fd, nv)| (*fd, *nv)).collect();
        self.procs.insert(child, p);
        fds
    }

    /// The process is gone: everything it held is released. Returns its fds (to drop from the kernel map).
    pub fn exit(&mut self, tgid: u32) -> Option<ProcFds> {
        self.procs.remove(&tgid)
    }

    /// After exec, only the fds still open (per /proc) remain and no mapping survives.
    pub fn exec(&mut self, tgid: u32, still_open: &dyn Fn(i32) -> bool) -> Vec<i32> {
        let Some(p) = self.procs.get_mut(&tgid) else {
            return Vec::new();
        };
        p.maps.clear();
        let closed: Vec<i32> = p
            .fds
            .keys()
            .copied()
            .filter(|fd| !still_open(*fd))
            .collect();
        for fd in &closed {
            p.fds.remove(fd);
        }
        self.gc(tgid);
        closed
    }

    fn gc(&mut self, tgid: u32) {
        if self.procs.get(&tgid).is_some_and(|p| !p.pins_driver()) {
            self.procs.remove(&tgid);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CTL: NvFd = NvFd {
        kind: FdKind::Ctl,
        minor: 255,
    };

    #[test]
    fn partial_unmap_trims_and_full_unmap_releases() {
        let mut t = FdTable::default();
        t.add_map(7, 1, 0x1000, 0x3000);
        assert_eq!(t.unmap(7, 0x2000, 0x1000), 0x1000);
        assert_eq!(t.get(7).unwrap().maps.len(), 2);
        assert_eq!(t.unmap(7, 0, 0x10000), 0x2000);
        assert!(
            t.get(7).is_none(),
            "a process with nothing left is forgotten"
        );
    }

    #[test]
    fn fork_copies_and_exec_drops_closed_fds() {
        let mut t = FdTable::default();
        t.add_fd(1, 9, 3, CTL);
        t.add_fd(
            1,
            9,
            4,
            NvFd {
                kind: FdKind::Device,
                minor: 0,
            },
        );
        let copied = t.fork(1, 2);
        assert_eq!(copied.len(), 2);
        assert_eq!(t.exec(2, &|fd| fd == 3), vec![4]);
        assert!(t.get(2).unwrap().fds.contains_key(&3));
        assert_eq!(t.remove_fd(2, 3), Some(CTL));
        assert!(t.get(2).is_none());
        assert!(t.exit(1).is_some());
    }

    #[test]
    fn close_range_forgets_only_the_fds_in_its_range() {
        let mut t = FdTable::default();
        for fd in [3, 7, 9] {
            t.add_fd(1, 9, fd, CTL);
        }
        let mut closed = t.remove_range(1, 4, 9);
        closed.sort();
        assert_eq!(closed, vec![7, 9]);
        assert!(t.get(1).unwrap().fds.contains_key(&3));
        assert_eq!(t.remove_range(1, 0, u32::MAX), vec![3]);
        assert!(t.get(1).is_none());
    }
}
