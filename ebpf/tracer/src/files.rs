//! The open NVIDIA files of traced processes, as the kernel counts them: one [`FileId`] per open file
//! description (an `open` makes one; `dup`, `fork`, `fcntl(F_DUPFD)` and a mapping share it), with the
//! references that keep it alive. A file's final release, when its last reference goes, is where the driver
//! frees the RM clients allocated through it (NVIDIA's `nvidia_close` frees the clients registered to the
//! closing file), so the ledger keys clients by the file they live on.
//!
//! References: every fd entry and every mapping range of a process holds one; a file can also keep another
//! alive: a device file registered with a ctl file (`NV_ESC_REGISTER_FD`, which pins the ctl file) and a
//! file through which a client's memory was mapped (`NV_ESC_RM_MAP_MEMORY`'s fd: the mapping keeps that
//! memory, and so its client's file, alive). Both are modelled as the holder keeping the other file alive:
//! when the driver holds less, the release comes later than it could, never earlier.
//!
//! Opaque files are those whose identity the records never showed: read from /proc (a process followed only
//! once it already held them, a holder found by a /proc check). Which clients they carry is unknown, so each
//! counts as holding GPU state until it goes, or until the driver's checkpoint says what they carry (see
//! `crate::tracer::inherit`): each remembers the processes /proc showed holding it when it was read.
use std::collections::HashMap;

use baton_nvidia::fdkind::FdKind;

/// One open file description of an NVIDIA device file, as the mirror numbers them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FileId(pub u64);

/// What the mirror knows of one open NVIDIA file.
#[derive(Clone, Debug)]
pub struct FileInfo {
    /// Which device file.
    pub kind: FdKind,
    /// Device minor for `nvidiaN`.
    pub minor: u8,
    /// The cgroup v2 id of the process that opened it (or in which /proc showed it).
    pub cgroup_id: u64,
    /// Read from /proc: its identity and what it carries are unknown.
    pub opaque: bool,
    /// GPUs registered with UVM through it (`UVM_REGISTER_GPU` less `UVM_UNREGISTER_GPU`; UVM files only).
    pub uvm_gpus: i64,
    /// For an opaque file: the processes /proc showed holding it when it was read (the kernel said that their
    /// fds are this one open file: see `crate::tracer::inherit`).
    pub seen_in: Vec<u32>,
    /// References: fd entries, mapping ranges and the files that keep it alive.
    refs: u32,
    /// The files it keeps alive while it lives.
    keeps: Vec<FileId>,
}

/// Every open NVIDIA file the mirror follows.
#[derive(Debug, Default)]
pub struct Files {
    files: HashMap<FileId, FileInfo>,
    next: u64,
    /// Files whose last reference went since [`Files::take_released`] was last called.
    released: Vec<(FileId, FileInfo)>,
}

impl Files {
    /// A new file with no reference yet (the caller takes the first).
    pub fn create(&mut self, kind: FdKind, minor: u8, cgroup_id: u64, opaque: bool) -> FileId {
        self.next += 1;
        let id = FileId(self.next);
        self.files.insert(
            id,
            FileInfo {
                kind,
                minor,
                cgroup_id,
                opaque,
                uvm_gpus: 0,
                seen_in: Vec::new(),
                refs: 0,
                keeps: Vec::new(),
            },
        );
        id
    }

    /// What is known of file `id`, while it is open.
    pub fn get(&self, id: FileId) -> Option<&FileInfo> {
        self.files.get(&id)
    }

    /// Every open file.
    pub fn iter(&self) -> impl Iterator<Item = (FileId, &FileInfo)> {
        self.files.iter().map(|(k, v)| (*k, v))
    }

    /// One more reference to `id` (a file that is gone is not brought back).
    pub fn take_ref(&mut self, id: FileId) {
        if let Some(f) = self.files.get_mut(&id) {
            f.refs += 1;
        }
    }

    /// One reference to `id` went; at the last, the file is released (and so are those only it kept).
    pub fn drop_ref(&mut self, id: FileId) {
        let mut todo = vec![id];
        while let Some(id) = todo.pop() {
            let Some(f) = self.files.get_mut(&id) else {
                continue;
            };
            f.refs = f.refs.saturating_sub(1);
            if f.refs == 0
                && let Some(gone) = self.files.remove(&id)
            {
                todo.extend(gone.keeps.iter().copied());
                self.released.push((id, gone));
            }
        }
    }

    /// File `holder` keeps file `kept` alive from now on, until it is released itself (once per pair).
    pub fn keep(&mut self, holder: FileId, kept: FileId) {
        if holder == kept || !self.files.contains_key(&kept) {
            return;
        }
        let Some(h) = self.files.get_mut(&holder) else {
            return;
        };
        if h.keeps.contains(&kept) {
            return;
        }
        h.keeps.push(kept);
        self.take_ref(kept);
    }

    /// /proc showed process `pid` holding opaque file `id`.
    pub fn seen_in(&mut self, id: FileId, pid: u32) {
        if let Some(f) = self.files.get_mut(&id)
            && !f.seen_in.contains(&pid)
        {
            f.seen_in.push(pid);
        }
    }

    /// Opaque file `from` is file `into` (the kernel said so): `into` takes its references, the processes it
    /// was seen in and the files it keeps, and `from` is gone without being released (its references now
    /// point to `into`: the caller re-points them). Nothing happens unless both are opaque.
    pub fn absorb(&mut self, from: FileId, into: FileId) -> bool {
        let both_opaque = [from, into]
            .iter()
            .all(|id| self.files.get(id).is_some_and(|f| f.opaque));
        if from == into || !both_opaque {
            return false;
        }
        let Some(gone) = self.files.remove(&from) else {
            return false;
        };
        if let Some(f) = self.files.get_mut(&into) {
            f.refs += gone.refs;
            for pid in gone.seen_in {
                if !f.seen_in.contains(&pid) {
                    f.seen_in.push(pid);
                }
            }
            f.keeps.extend(gone.keeps);
        }
        true
    }

    /// What opaque file `id` carries is known from now on (none of the clients the ledger does not have).
    pub fn make_known(&mut self, id: FileId) {
        if let Some(f) = self.files.get_mut(&id) {
            f.opaque = false;
        }
    }

    /// What file `id` carries is unknown from now on (a call on it went unrecorded): it counts as holding
    /// GPU state until its final release, which frees whatever it carries.
    pub fn mark_opaque(&mut self, id: FileId) {
        if let Some(f) = self.files.get_mut(&id) {
            f.opaque = true;
        }
    }

    /// Adds `delta` to the GPUs registered with UVM through file `id`.
    pub fn add_uvm_gpus(&mut self, id: FileId, delta: i64) {
        if let Some(f) = self.files.get_mut(&id) {
            f.uvm_gpus = (f.uvm_gpus + delta).max(0);
        }
    }

    /// The files released since the last call, with what was known of them.
    pub fn take_released(&mut self) -> Vec<(FileId, FileInfo)> {
        std::mem::take(&mut self.released)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_goes_with_its_last_reference_and_takes_what_only_it_kept() {
        let mut f = Files::default();
        let ctl = f.create(FdKind::Ctl, 255, 1, false);
        let dev = f.create(FdKind::Device, 0, 1, false);
        f.take_ref(ctl);
        f.take_ref(dev);
        f.keep(dev, ctl);
        f.keep(dev, ctl);
        f.drop_ref(ctl);
        assert!(
            f.get(ctl).is_some(),
            "the registered device file keeps the ctl file"
        );
        assert!(f.take_released().is_empty());
        f.drop_ref(dev);
        let gone: Vec<FileId> = f.take_released().into_iter().map(|(id, _)| id).collect();
        assert_eq!(gone, vec![dev, ctl]);
        assert!(f.iter().next().is_none());
    }

    #[test]
    fn an_opaque_file_absorbs_another_with_its_references_and_is_released_with_the_last() {
        let mut f = Files::default();
        let parent = f.create(FdKind::Ctl, 255, 1, true);
        let child = f.create(FdKind::Ctl, 255, 1, true);
        let known = f.create(FdKind::Ctl, 255, 1, false);
        f.take_ref(parent);
        f.take_ref(child);
        f.take_ref(known);
        f.seen_in(parent, 10);
        f.seen_in(child, 11);
        assert!(
            !f.absorb(child, known),
            "a file the records know is never merged"
        );
        assert!(f.absorb(child, parent));
        assert!(f.get(child).is_none());
        assert_eq!(f.get(parent).unwrap().seen_in, [10, 11]);
        f.drop_ref(parent);
        assert!(
            f.take_released().is_empty(),
            "the child's reference holds it"
        );
        f.drop_ref(parent);
        let gone: Vec<FileId> = f.take_released().into_iter().map(|(id, _)| id).collect();
        assert_eq!(gone, vec![parent]);
    }
}
