//! Opaque files after a restart: which are one open file, and when the driver's checkpoint says what they
//! carry.
//!
//! A new tracer (an agent restarted by a DaemonSet rollout) learns the NVIDIA files its containers already
//! hold from /proc only, as opaque files (their clients unknown, so each holds the GPU). A worker forked after
//! CUDA init (a DataLoader worker) inherited its parent's fds and mappings; left opaque files of their own,
//! they would hold the GPU for as long as the worker lives, though the parent's park frees it (the H200:
//! ../shared/gpu/580.159.04/README.md, point 5). Two facts tell them apart:
//!
//! - **The kernel says two fds are one open file** (kcmp(2) `KCMP_FILE`). When /proc shows a process holding
//!   opaque fds, each is compared with its parent's opaque fds of the same device (the same number first):
//!   one the kernel says is the parent's file becomes that file in the mirror, not a file of its own. A
//!   mapping has no fd to compare: an opaque mapping of the same device at the very range its parent maps is
//!   taken for the inherited one (a fork copies the address space). Each opaque file remembers the processes
//!   /proc showed holding it ([`crate::files::FileInfo::seen_in`]).
//! - **The driver says a process holds no CUDA state**: the shim, which ran the checkpoint, says which
//!   processes it checkpointed (the driver freed their CUDA state, and closed every NVIDIA fd CUDA had) and
//!   which the driver answered CUDA_ERROR_NOT_INITIALIZED for (no CUDA state of their own).
//!   [`Tracer::clear_checkpointed_files`] then takes an opaque file for one that carries nothing when it was
//!   a checkpointed process's file (seen in it), that process let go of it (its checkpoint closed CUDA's
//!   files), and only such processes hold it now.
//!
//! What stays opaque and holds: a file a process opened on its own before the restart and shared with no
//! checkpointed process (the kernel never showed it to be CUDA's), one a checkpointed process still holds
//! after its checkpoint (not CUDA's), and one held by any process the shim did not speak for. What could
//! still fool it: a worker that, before the restart, replaced an inherited mapping at the very same range by
//! a mapping of a file it opened itself and then closed, holding state it allocated with raw RM calls outside
//! CUDA; and state such calls put on an inherited file before the restart (the probes follow every call made
//! after it). Only the driver could tell those; NVML's used memory shows them.
use std::collections::BTreeSet;

use super::Tracer;
use crate::{fdtable::Corrections, files::FileId, proc_read::ProcDir};

/// How many kcmp calls one process's grouping may make (a tenant with thousands of distinct files costs a
/// bounded time; past it, what is left keeps files of its own and holds, failing closed).
const KCMP_BUDGET: usize = 4096;

/// Whether fd `fd1` of `pid1` and fd `fd2` of `pid2` are one open file, as the kernel says (`None`: it
/// could not say: a process gone, an fd closed, no ptrace access).
fn same_open_file(pid1: u32, fd1: i32, pid2: u32, fd2: i32) -> Option<bool> {
    const KCMP_FILE: libc::c_int = 0;
    // SAFETY: kcmp takes five integers and reads or writes no memory of this process.
    let r = unsafe {
        libc::syscall(
            libc::SYS_kcmp,
            pid1 as libc::pid_t,
            pid2 as libc::pid_t,
            KCMP_FILE,
            fd1 as libc::c_ulong,
            fd2 as libc::c_ulong,
        )
    };
    (r >= 0).then_some(r == 0)
}

impl Tracer {
    /// Process `pid` was just read from /proc and the mirror follows `c.new_fds` and `c.new_maps` as opaque
    /// files: those that are its parent's (see the module comment) become the parent's file. Returns how many
    /// were merged.
    pub(super) fn share_with_parent(&mut self, pid: u32, c: &Corrections) -> usize {
        if c.new_fds.is_empty() && c.new_maps.is_empty() {
            return 0;
        }
        let Some(parent) = ProcDir::open(pid).ok().and_then(|d| d.parent()) else {
            return 0;
        };
        let (Some(mine), Some(theirs)) = (self.fds.get(pid), self.fds.get(parent)) else {
            return 0;
        };
        if mine.cgroup_id != theirs.cgroup_id {
            return 0;
        }
        let opaque = |id: FileId| self.fds.files().get(id).is_some_and(|f| f.opaque);
        let mut merges: Vec<(FileId, FileId)> = Vec::new();
        let mut budget = KCMP_BUDGET;
        for fd in &c.new_fds {
            let Some(nv) = mine.fds.get(fd).copied() else {
                continue;
            };
            if !opaque(nv.file) {
                continue;
            }
            // The parent's opaque fds of the same device, the same number first.
            let mut candidates: Vec<(i32, FileId)> = theirs
                .fds
                .iter()
                .filter(|(_, p)| p.kind == nv.kind && p.minor == nv.minor && opaque(p.file))
                .map(|(n, p)| (*n, p.file))
                .collect();
            candidates.sort_by_key(|(n, _)| (*n != *fd, *n));
            for (theirs_fd, file) in candidates {
                if budget == 0 {
                    break;
                }
                budget -= 1;
                if same_open_file(pid, *fd, parent, theirs_fd) == Some(true) {
                    merges.push((nv.file, file));
                    break;
                }
            }
        }
        for addr in &c.new_maps {
            let Some(m) = mine.maps.get(addr).copied() else {
                continue;
            };
            let Some(p) = theirs.maps.get(addr).copied() else {
                continue;
            };
            let kind = |id: FileId| self.fds.files().get(id).map(|f| (f.kind, f.minor));
            if p.len == m.len && opaque(m.file) && opaque(p.file) && kind(m.file) == kind(p.file) {
                merges.push((m.file, p.file));
            }
        }
        merges
            .into_iter()
            .filter(|(from, into)| self.fds.merge_files(*from, *into))
            .count()
    }

    /// The shim's word after a checkpoint of container `cgroup_id`: the processes `checkpointed` had their
    /// CUDA state freed by the driver's checkpoint, and `no_state` (which includes them) hold no CUDA state
    /// now. Each opaque file of the container that a checkpointed process held when /proc showed it, that no
    /// checkpointed process holds any more, and that only processes of `no_state` hold now carries nothing
    /// from now on (see the module comment). Returns the files it cleared.
    pub fn clear_checkpointed_files(
        &mut self,
        cgroup_id: u64,
        checkpointed: &BTreeSet<u32>,
        no_state: &BTreeSet<u32>,
    ) -> Vec<FileId> {
        if checkpointed.is_empty() {
            return Vec::new();
        }
        let holders = self.fds.holders_by_file();
        let none = BTreeSet::new();
        let cleared: Vec<FileId> = self
            .fds
            .files()
            .iter()
            .filter(|(_, f)| f.opaque && f.cgroup_id == cgroup_id)
            .filter(|(_, f)| f.seen_in.iter().any(|p| checkpointed.contains(p)))
            .filter(|(id, _)| {
                let now = holders.get(id).unwrap_or(&none);
                now.iter()
                    .all(|p| no_state.contains(p) && !checkpointed.contains(p))
            })
            .map(|(id, _)| id)
            .collect();
        for id in &cleared {
            self.fds.make_known(*id);
        }
        cleared
    }
}
