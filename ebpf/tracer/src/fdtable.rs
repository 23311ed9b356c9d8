//! User space's mirror of the NVIDIA fds and mappings of every traced process, and of the open files they
//! refer to ([`crate::files`]).
//!
//! The probes keep the authoritative `NV_FDS` map for the fast path, but they cannot iterate it on fork or
//! exit. This mirror, fed by the same records, tells user space which kernel entries to copy (fork) and drop
//! (exit, exec), and which open files each process holds, so that a file's final release (and the driver's
//! freeing of the clients on it) is known. Mappings are tracked as ranges, as the kernel changes them: an
//! munmap or an `mmap(MAP_FIXED)` over part of a range leaves the rest mapped, mremap moves, shrinks and
//! grows them, and `MADV_DONTFORK` ranges are not copied to a forked child.
use std::collections::{BTreeMap, HashMap};

use baton_nvidia::fdkind::FdKind;

use crate::files::{FileId, FileInfo, Files};

/// One NVIDIA fd of a process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NvFd {
    /// Which device file.
    pub kind: FdKind,
    /// Device minor for `nvidiaN`.
    pub minor: u8,
    /// The open file it refers to.
    pub file: FileId,
}

/// One mapping range of an NVIDIA device file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mapping {
    /// Bytes (a multiple of the page size).
    pub len: u64,
    /// The file mapped.
    pub file: FileId,
    /// `MADV_DONTFORK`: a forked child does not get it.
    pub dont_fork: bool,
}

/// The NVIDIA state of one process.
#[derive(Clone, Debug, Default)]
pub struct ProcFds {
    /// cgroup v2 id the process was last seen in.
    pub cgroup_id: u64,
    /// Open NVIDIA fds.
    pub fds: HashMap<i32, NvFd>,
    /// Mappings of NVIDIA device files: start address -> range (ranges never overlap).
    pub maps: BTreeMap<u64, Mapping>,
}

impl ProcFds {
    /// Whether the process still holds an NVIDIA fd or mapping.
    pub fn pins_driver(&self) -> bool {
        !self.fds.is_empty() || !self.maps.is_empty()
    }
}

/// A device file /proc shows a process holding (an fd or a mapping), for [`FdTable::reconcile`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Seen {
    /// Fd `fd` refers to a device file of `kind`.
    Fd {
        /// The fd.
        fd: i32,
        /// Which device file.
        kind: FdKind,
        /// Its minor.
        minor: u8,
    },
    /// `[addr, addr + len)` maps a device file of `kind`.
    Map {
        /// Start.
        addr: u64,
        /// Length.
        len: u64,
        /// Which device file.
        kind: FdKind,
        /// Its minor.
        minor: u8,
    },
}

/// What [`FdTable::reconcile`] changed in the mirror of one process.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Corrections {
    /// Fds the mirror had and /proc does not show.
    pub stale_fds: Vec<i32>,
    /// Mapping ranges the mirror had and /proc does not show (start addresses).
    pub stale_maps: Vec<u64>,
    /// Fds /proc shows that the mirror did not have (now followed, as opaque files).
    pub new_fds: Vec<i32>,
    /// Mappings /proc shows that the mirror did not have (start addresses; now followed, opaque).
    pub new_maps: Vec<u64>,
}

impl Corrections {
    /// Whether the mirror was right.
    pub fn is_empty(&self) -> bool {
        self.stale_fds.is_empty()
            && self.stale_maps.is_empty()
            && self.new_fds.is_empty()
            && self.new_maps.is_empty()
    }
}

/// The page size lengths are rounded up to, as the kernel does for mmap, munmap and mremap.
fn page_size() -> u64 {
    static PAGE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *PAGE.get_or_init(|| {
        nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
            .ok()
            .flatten()
            .map_or(4096, |p| p as u64)
    })
}

/// `len` rounded up to whole pages (saturating).
fn pages(len: u64) -> u64 {
    let p = page_size();
    len.div_ceil(p).saturating_mul(p)
}

/// All traced processes, by tgid, and the files they hold.
#[derive(Debug, Default)]
pub struct FdTable {
    procs: HashMap<u32, ProcFds>,
    files: Files,
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

    /// The open files.
    pub fn files(&self) -> &Files {
        &self.files
    }

    /// The file fd `fd` of `tgid` refers to, if it is an NVIDIA fd the mirror knows.
    pub fn file_of(&self, tgid: u32, fd: i32) -> Option<FileId> {
        self.procs.get(&tgid)?.fds.get(&fd).map(|nv| nv.file)
    }

    /// The files released (their last reference gone) since the last call, with what was known of them.
    pub fn take_released(&mut self) -> Vec<(FileId, FileInfo)> {
        self.files.take_released()
    }

    /// File `holder` keeps file `kept` alive (see [`crate::files`]).
    pub fn keep(&mut self, holder: FileId, kept: FileId) {
        self.files.keep(holder, kept);
    }

    /// Adds `delta` to the GPUs registered with UVM through file `id`.
    pub fn add_uvm_gpus(&mut self, id: FileId, delta: i64) {
        self.files.add_uvm_gpus(id, delta);
    }

    /// What file `id` carries is unknown from now on (see [`crate::files::Files::mark_opaque`]).
    pub fn mark_opaque(&mut self, id: FileId) {
        self.files.mark_opaque(id);
    }

    /// `tgid` opened a device file as `fd` (a new open file). Returns it.
    pub fn open(&mut self, tgid: u32, cgroup_id: u64, fd: i32, kind: FdKind, minor: u8) -> FileId {
        let file = self.files.create(kind, minor, cgroup_id, false);
        self.set_fd(tgid, cgroup_id, fd, NvFd { kind, minor, file });
        file
    }

    /// `tgid` duplicated `old_fd` as `fd` (the same open file; an opaque one when the mirror does not know
    /// `old_fd`).
    pub fn dup(
        &mut self,
        tgid: u32,
        cgroup_id: u64,
        fd: i32,
        old_fd: i32,
        kind: FdKind,
        minor: u8,
    ) {
        // The mirror's own entry for `old_fd` is the file the dup shares, kind and all: records are applied
        // in order, so it is what `old_fd` was when the dup ran.
        let nv = match self.procs.get(&tgid).and_then(|p| p.fds.get(&old_fd)) {
            Some(nv) => *nv,
            None => NvFd {
                kind,
                minor,
                file: self.files.create(kind, minor, cgroup_id, true),
            },
        };
        self.set_fd(tgid, cgroup_id, fd, nv);
    }

    /// `tgid` holds `fd`, a device file of unknown identity (read from /proc).
    pub fn add_opaque_fd(&mut self, tgid: u32, cgroup_id: u64, fd: i32, kind: FdKind, minor: u8) {
        let file = self.files.create(kind, minor, cgroup_id, true);
        self.files.seen_in(file, tgid);
        self.set_fd(tgid, cgroup_id, fd, NvFd { kind, minor, file });
    }

    /// Opaque file `from` is opaque file `into` (the kernel said so, see `crate::tracer::inherit`): every fd
    /// and mapping of `from` refers to `into` from now on. Whether it was merged (both must be opaque).
    pub fn merge_files(&mut self, from: FileId, into: FileId) -> bool {
        if !self.files.absorb(from, into) {
            return false;
        }
        for p in self.procs.values_mut() {
            for nv in p.fds.values_mut().filter(|nv| nv.file == from) {
                nv.file = into;
            }
            for m in p.maps.values_mut().filter(|m| m.file == from) {
                m.file = into;
            }
        }
        true
    }

    /// What opaque file `id` carries is known from now on (see [`crate::files::Files::make_known`]).
    pub fn make_known(&mut self, id: FileId) {
        self.files.make_known(id);
    }

    /// The processes that hold each file now (through an fd or a mapping).
    pub fn holders_by_file(&self) -> HashMap<FileId, std::collections::BTreeSet<u32>> {
        let mut out: HashMap<FileId, std::collections::BTreeSet<u32>> = HashMap::new();
        for (pid, p) in &self.procs {
            let files = p.fds.values().map(|nv| nv.file);
            for file in files.chain(p.maps.values().map(|m| m.file)) {
                out.entry(file).or_default().insert(*pid);
            }
        }
        out
    }

    /// Fd `fd` of `tgid` now refers to `nv` (whatever it referred to before is dropped).
    fn set_fd(&mut self, tgid: u32, cgroup_id: u64, fd: i32, nv: NvFd) {
        self.files.take_ref(nv.file);
        let p = self.procs.entry(tgid).or_default();
        p.cgroup_id = cgroup_id;
        if let Some(old) = p.fds.insert(fd, nv) {
            self.files.drop_ref(old.file);
        }
    }

    /// Forgets an fd; returns what it was.
    pub fn remove_fd(&mut self, tgid: u32, fd: i32) -> Option<NvFd> {
        let nv = self.procs.get_mut(&tgid)?.fds.remove(&fd)?;
        self.files.drop_ref(nv.file);
        self.gc(tgid);
        Some(nv)
    }

    /// Forgets the fds `first..=last` (close_range); returns the NVIDIA ones among them.
    pub fn remove_range(&mut self, tgid: u32, first: u32, last: u32) -> Vec<i32> {
        let Some(p) = self.procs.get(&tgid) else {
            return Vec::new();
        };
        let closed: Vec<i32> = p
            .fds
            .keys()
            .copied()
            .filter(|fd| (first..=last).contains(&(*fd as u32)))
            .collect();
        for fd in &closed {
            self.remove_fd(tgid, *fd);
        }
        closed
    }

    /// `tgid` mapped `[addr, addr + len)` of the file fd `fd` refers to; false when the mirror does not know
    /// that fd as an NVIDIA fd (the record is ignored). Whatever the mirror had in the range is replaced.
    pub fn map_fd(&mut self, tgid: u32, cgroup_id: u64, fd: i32, addr: u64, len: u64) -> bool {
        let Some(file) = self.file_of(tgid, fd) else {
            return false;
        };
        self.insert_map(tgid, cgroup_id, addr, len, file);
        true
    }

    /// `tgid` maps `[addr, addr + len)` of a device file of unknown identity (read from /proc).
    pub fn add_opaque_map(
        &mut self,
        tgid: u32,
        cgroup_id: u64,
        addr: u64,
        len: u64,
        kind: FdKind,
        minor: u8,
    ) {
        let file = self.files.create(kind, minor, cgroup_id, true);
        self.files.seen_in(file, tgid);
        self.insert_map(tgid, cgroup_id, addr, len, file);
    }

    fn insert_map(&mut self, tgid: u32, cgroup_id: u64, addr: u64, len: u64, file: FileId) {
        let len = pages(len);
        if len == 0 {
            return;
        }
        // A new mapping can only be where nothing is mapped (or over what MAP_FIXED replaced, reported
        // before it): anything the mirror still has there is stale.
        self.unmap(tgid, addr, len);
        self.files.take_ref(file);
        let p = self.procs.entry(tgid).or_default();
        p.cgroup_id = cgroup_id;
        p.maps.insert(
            addr,
            Mapping {
                len,
                file,
                dont_fork: false,
            },
        );
    }

    /// Makes a range start at `at` if one covers it strictly inside (the two parts share its file).
    fn split_at(&mut self, tgid: u32, at: u64) {
        let Some(p) = self.procs.get_mut(&tgid) else {
            return;
        };
        let Some((&start, &m)) = p.maps.range(..at).next_back() else {
            return;
        };
        let end = start.saturating_add(m.len);
        if end <= at {
            return;
        }
        p.maps.insert(
            start,
            Mapping {
                len: at - start,
                ..m
            },
        );
        p.maps.insert(at, Mapping { len: end - at, ..m });
        self.files.take_ref(m.file);
    }

    /// The starts of the ranges within `[addr, end)`, after splitting the ranges that cross its bounds.
    fn ranges_within(&mut self, tgid: u32, addr: u64, end: u64) -> Vec<u64> {
        self.split_at(tgid, addr);
        self.split_at(tgid, end);
        self.procs.get(&tgid).map_or_else(Vec::new, |p| {
            p.maps.range(addr..end).map(|(a, _)| *a).collect()
        })
    }

    /// Removes the NVIDIA mappings `[addr, addr + len)` covers entirely or in part (what lies outside the
    /// range stays mapped). Returns the bytes unmapped.
    pub fn unmap(&mut self, tgid: u32, addr: u64, len: u64) -> u64 {
        let end = addr.saturating_add(pages(len));
        let mut gone = 0;
        for start in self.ranges_within(tgid, addr, end) {
            if let Some(m) = self
                .procs
                .get_mut(&tgid)
                .and_then(|p| p.maps.remove(&start))
            {
                gone += m.len;
                self.files.drop_ref(m.file);
            }
        }
        self.gc(tgid);
        gone
    }

    /// `tgid`'s `mremap(old_addr, old_len, new_len, flags)` returned `new_addr`. Returns the bytes of NVIDIA
    /// mappings that went (a shrink, or whatever a `MREMAP_FIXED` move replaced at its target).
    pub fn mremap(
        &mut self,
        tgid: u32,
        cgroup_id: u64,
        (old_addr, old_len): (u64, u64),
        (new_addr, new_len): (u64, u64),
        flags: u32,
    ) -> u64 {
        const MREMAP_FIXED: u32 = 2;
        const MREMAP_DONTUNMAP: u32 = 4;
        let (old_len, new_len) = (pages(old_len), pages(new_len));
        // The one range that holds `old_addr` (mremap works on one mapping), as it was.
        let source = self.procs.get(&tgid).and_then(|p| {
            let (&start, &m) = p.maps.range(..=old_addr).next_back()?;
            (start.saturating_add(m.len) > old_addr).then_some(m)
        });
        // Held across the unmaps below, so that a file only this range kept is not released on the way.
        if let Some(m) = source {
            self.files.take_ref(m.file);
        }
        let mut gone = 0;
        if flags & MREMAP_FIXED != 0 || new_addr != old_addr {
            // The target is replaced (MREMAP_FIXED) or was free.
            gone += self.unmap(tgid, new_addr, new_len);
        }
        let moved = new_addr != old_addr;
        if old_len == 0 {
            // A shared mapping duplicated: the old range stays.
        } else if moved && flags & MREMAP_DONTUNMAP == 0 {
            self.unmap(tgid, old_addr, old_len);
        } else if !moved && new_len < old_len {
            gone += self.unmap(tgid, old_addr + new_len, old_len - new_len);
        } else if !moved {
            self.unmap(tgid, old_addr, old_len);
        }
        if let Some(m) = source {
            self.insert_map(tgid, cgroup_id, new_addr, new_len, m.file);
            if m.dont_fork {
                self.set_dont_fork(tgid, new_addr, new_len, true);
            }
            self.files.drop_ref(m.file);
        }
        gone
    }

    /// `MADV_DONTFORK` (`dont_fork`) or `MADV_DOFORK` over `[addr, addr + len)`.
    pub fn set_dont_fork(&mut self, tgid: u32, addr: u64, len: u64, dont_fork: bool) {
        let end = addr.saturating_add(pages(len));
        for start in self.ranges_within(tgid, addr, end) {
            if let Some(m) = self
                .procs
                .get_mut(&tgid)
                .and_then(|p| p.maps.get_mut(&start))
            {
                m.dont_fork = dont_fork;
            }
        }
    }

    /// A child inherits its parent's fds (the same files) and its mappings but those marked
    /// `MADV_DONTFORK`. Returns the fds to copy into the kernel map.
    pub fn fork(&mut self, parent: u32, child: u32) -> Vec<(i32, NvFd)> {
        let Some(p) = self.procs.get(&parent) else {
            return Vec::new();
        };
        let copy = ProcFds {
            cgroup_id: p.cgroup_id,
            fds: p.fds.clone(),
            maps: p
                .maps
                .iter()
                .filter(|(_, m)| !m.dont_fork)
                .map(|(a, m)| (*a, *m))
                .collect(),
        };
        for nv in copy.fds.values() {
            self.files.take_ref(nv.file);
        }
        for m in copy.maps.values() {
            self.files.take_ref(m.file);
        }
        let fds = copy.fds.iter().map(|(fd, nv)| (*fd, *nv)).collect();
        if let Some(old) = self.procs.insert(child, copy) {
            self.drop_all(old);
        }
        self.gc(child);
        fds
    }

    fn drop_all(&mut self, p: ProcFds) {
        for nv in p.fds.values() {
            self.files.drop_ref(nv.file);
        }
        for m in p.maps.values() {
            self.files.drop_ref(m.file);
        }
    }

    /// The process is gone: everything it held is released. Returns what it held (its fds, to drop from
    /// the kernel map).
    pub fn exit(&mut self, tgid: u32) -> Option<ProcFds> {
        let p = self.procs.remove(&tgid)?;
        self.drop_all(p.clone());
        Some(p)
    }

    /// After exec, only the fds still open (per /proc) remain and no mapping survives.
    pub fn exec(&mut self, tgid: u32, still_open: &dyn Fn(i32) -> bool) -> Vec<i32> {
        let Some(p) = self.procs.get_mut(&tgid) else {
            return Vec::new();
        };
        let maps = std::mem::take(&mut p.maps);
        let closed: Vec<i32> = p
            .fds
            .keys()
            .copied()
            .filter(|fd| !still_open(*fd))
            .collect();
        for m in maps.values() {
            self.files.drop_ref(m.file);
        }
        for fd in &closed {
            self.remove_fd(tgid, *fd);
        }
        self.gc(tgid);
        closed
    }

    /// Makes the mirror of `tgid` agree with what /proc shows it holds (`seen`; `alive` false: the process is
    /// gone): what the mirror had and /proc does not show goes; what /proc shows and the mirror did not have
    /// is followed as opaque files. What both show keeps the mirror's identity (and so its clients).
    pub fn reconcile(
        &mut self,
        tgid: u32,
        cgroup_id: u64,
        alive: bool,
        seen: &[Seen],
    ) -> Corrections {
        let mut c = Corrections::default();
        if !alive {
            if let Some(p) = self.exit(tgid) {
                c.stale_fds = p.fds.keys().copied().collect();
                c.stale_maps = p.maps.keys().copied().collect();
            }
            return c;
        }
        let known = self.procs.get(&tgid).cloned().unwrap_or_default();
        for (fd, nv) in &known.fds {
            let shown = seen
                .iter()
                .any(|s| matches!(s, Seen::Fd { fd: f, kind, .. } if f == fd && *kind == nv.kind));
            if !shown {
                self.remove_fd(tgid, *fd);
                c.stale_fds.push(*fd);
            }
        }
        for (start, m) in &known.maps {
            let end = start.saturating_add(m.len);
            let shown = seen.iter().any(
                |s| matches!(s, Seen::Map { addr, len, .. } if *addr < end && addr.saturating_add(*len) > *start),
            );
            if !shown {
                self.unmap(tgid, *start, m.len);
                c.stale_maps.push(*start);
            }
        }
        for s in seen {
            match *s {
                Seen::Fd { fd, kind, minor } => {
                    if known.fds.get(&fd).is_none_or(|nv| nv.kind != kind) {
                        self.add_opaque_fd(tgid, cgroup_id, fd, kind, minor);
                        c.new_fds.push(fd);
                    }
                }
                Seen::Map {
                    addr,
                    len,
                    kind,
                    minor,
                } => {
                    let end = addr.saturating_add(len);
                    let covered = known
                        .maps
                        .range(..end)
                        .next_back()
                        .is_some_and(|(a, m)| a.saturating_add(m.len) > addr);
                    if !covered {
                        self.add_opaque_map(tgid, cgroup_id, addr, len, kind, minor);
                        c.new_maps.push(addr);
                    }
                }
            }
        }
        if let Some(p) = self.procs.get_mut(&tgid) {
            p.cgroup_id = cgroup_id;
        }
        self.gc(tgid);
        c
    }

    fn gc(&mut self, tgid: u32) {
        if self.procs.get(&tgid).is_some_and(|p| !p.pins_driver()) {
            self.procs.remove(&tgid);
        }
    }
}

#[cfg(test)]
mod tests;
