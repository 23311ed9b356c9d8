//! The FUSE side of the mock driver: maps lookups, opens, reads, ioctls and releases of the mount's files
//! onto the [`Rm`] model. Device files keep the page cache (so `mmap(MAP_SHARED)` works); the text files
//! (`version`, `state.json`) use direct I/O and a snapshot taken at open, so each open sees fresh content.

use std::collections::HashMap;
use std::ffi::OsStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use fuser::{
    Errno, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, IoctlFlags,
    LockOwner, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyIoctl,
    ReplyOpen, ReplyWrite, Request, WriteFlags,
};

use super::escapes::Escapes;
use super::nodes::{ATTR_TTL, Node, ROOT_INO, Tree};
use super::rm::Rm;

/// Text-file handles live above this, device-file handles (chosen by [`Rm`]) below.
const TEXT_FH_BASE: u64 = 1 << 48;

/// The mounted filesystem: the file tree plus the shared RM model.
pub struct MockFs {
    tree: Tree,
    rm: Arc<Mutex<Rm>>,
    escapes: Escapes,
    version_text: String,
    snapshots: Mutex<HashMap<u64, Vec<u8>>>,
    next_text_fh: AtomicU64,
    close_delay: std::time::Duration,
}

impl MockFs {
    /// A filesystem serving `tree`, answering ioctls with `escapes` on `rm`, and `version_text` for the
    /// `version` file.
    pub fn new(tree: Tree, rm: Arc<Mutex<Rm>>, escapes: Escapes, version_text: String) -> Self {
        Self {
            tree,
            rm,
            escapes,
            version_text,
            snapshots: Mutex::new(HashMap::new()),
            next_text_fh: AtomicU64::new(TEXT_FH_BASE),
            close_delay: std::time::Duration::ZERO,
        }
    }

    /// The same filesystem with closes of device files that take `delay` (see `MountOptions::close_delay`).
    pub fn with_close_delay(mut self, delay: std::time::Duration) -> Self {
        self.close_delay = delay;
        self
    }

    fn rm(&self) -> MutexGuard<'_, Rm> {
        // A panic while holding the lock leaves the model as it was at the panic: keep serving it.
        self.rm
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn snapshots(&self) -> MutexGuard<'_, HashMap<u64, Vec<u8>>> {
        self.snapshots
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn text_content(&self, node: Node) -> Vec<u8> {
        match node {
            Node::Version => self.version_text.clone().into_bytes(),
            _ => self.rm().state_json().into_bytes(),
        }
    }
}

impl Filesystem for MockFs {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let node = name.to_str().and_then(|name| self.tree.by_name(name));
        match node {
            Some(node) if parent.0 == ROOT_INO => {
                reply.entry(&ATTR_TTL, &self.tree.node_attr(node), Generation(0));
            }
            _ => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        if ino.0 == ROOT_INO {
            reply.attr(&ATTR_TTL, &self.tree.root_attr());
            return;
        }
        match self.tree.by_ino(ino) {
            Some(node) => reply.attr(&ATTR_TTL, &self.tree.node_attr(node)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        if ino.0 != ROOT_INO {
            reply.error(Errno::ENOTDIR);
            return;
        }
        let mut entries = vec![
            (ROOT_INO, FileType::Directory, ".".to_owned()),
            (ROOT_INO, FileType::Directory, "..".to_owned()),
        ];
        entries.extend(
            self.tree
                .nodes()
                .into_iter()
                .map(|node| (node.ino(), FileType::RegularFile, node.name())),
        );
        let start = usize::try_from(offset).unwrap_or(usize::MAX);
        for (index, (ino, kind, name)) in entries.into_iter().enumerate().skip(start) {
            if reply.add(INodeNo(ino), index as u64 + 1, kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn open(&self, req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let Some(node) = self.tree.by_ino(ino) else {
            reply.error(Errno::ENOENT);
            return;
        };
        if node.is_device() {
            let fh = self.rm().open(node, req.pid());
            reply.opened(FileHandle(fh), FopenFlags::empty());
        } else {
            let fh = self.next_text_fh.fetch_add(1, Ordering::Relaxed);
            self.snapshots().insert(fh, self.text_content(node));
            reply.opened(FileHandle(fh), FopenFlags::FOPEN_DIRECT_IO);
        }
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        if fh.0 < TEXT_FH_BASE {
            // Device memory reads back as zeros (pages written through a mapping stay in the page cache).
            reply.data(&vec![0u8; size as usize]);
            return;
        }
        let snapshots = self.snapshots();
        let Some(content) = snapshots.get(&fh.0) else {
            reply.error(Errno::EBADF);
            return;
        };
        let start = usize::try_from(offset)
            .unwrap_or(usize::MAX)
            .min(content.len());
        let end = start.saturating_add(size as usize).min(content.len());
        reply.data(&content[start..end]);
    }

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        // Write-back of pages dirtied through a shared mapping of a device file: accepted, not stored.
        if fh.0 < TEXT_FH_BASE {
            reply.written(u32::try_from(data.len()).unwrap_or(u32::MAX));
        } else {
            reply.error(Errno::EBADF);
        }
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        // close(2) waits for the flush: a slow one is a slow close. (FUSE serves one request at a time here,
        // so other calls wait too; the tests that slow closes make no other call meanwhile.)
        if !self.close_delay.is_zero() && fh.0 < TEXT_FH_BASE {
            std::thread::sleep(self.close_delay);
        }
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        if fh.0 < TEXT_FH_BASE {
            // The driver frees a file's RM objects at its final release, which is this call.
            self.rm().release(fh.0);
        } else {
            self.snapshots().remove(&fh.0);
        }
        reply.ok();
    }

    fn ioctl(
        &self,
        req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: IoctlFlags,
        cmd: u32,
        in_data: &[u8],
        out_size: u32,
        reply: ReplyIoctl,
    ) {
        if fh.0 >= TEXT_FH_BASE {
            reply.error(Errno::ENOTTY);
            return;
        }
        let result = self
            .escapes
            .handle(&mut self.rm(), fh.0, req.pid(), cmd, in_data);
        match result {
            Ok(mut out) => {
                out.resize(out_size as usize, 0);
                reply.ioctl(0, &out);
            }
            Err(errno) => reply.error(errno),
        }
    }
}
