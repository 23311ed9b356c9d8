//! Applying the probes' records to the fd mirror, the kernel maps, the ledgers and the release tracker.
use baton_nvidia::{decode::Op, fdkind::FdKind};
use baton_probe_common::FdKey;

use super::{Tracer, TracerError};
use crate::{
    event::{Body, Event, Ioctl},
    fdtable::NvFd,
    ledger::{Readings, readings::UvmCount},
    release::syscalls,
    seed,
};

impl Tracer {
    pub(super) fn apply_all(&mut self, events: Vec<Event>) -> Result<Vec<Event>, TracerError> {
        let mut kept = Vec::with_capacity(events.len());
        for e in events {
            let keep = self.apply(&e)?;
            if self.settle_released_files() {
                // What the event removed released GPU state: its confirmation is what a release waits for.
                self.releases.freed_state(e.pid, e.cgroup_id, e.ts_ns);
            }
            if keep {
                kept.push(e);
            }
        }
        Ok(kept)
    }

    /// Applies one event. Returns false for events that turn out not to concern NVIDIA state (an munmap of
    /// an ordinary mapping by a holder, a confirmation nobody awaited), which callers drop.
    fn apply(&mut self, e: &Event) -> Result<bool, TracerError> {
        let (pid, cg) = (e.pid, e.cgroup_id);
        match &e.body {
            Body::Ioctl(_) | Body::ThreadExit | Body::Confirm { .. } | Body::Resync { .. } => {}
            Body::Fork { child } => {
                self.proc_changed(pid);
                self.proc_changed(*child);
            }
            _ => self.proc_changed(pid),
        }
        match &e.body {
            Body::Ioctl(io) => self.apply_ioctl(pid, cg, io),
            Body::Open {
                fd, kind, minor, ..
            } => {
                self.fds.open(pid, cg, *fd, *kind, *minor);
                self.opened(pid, *fd, *kind, *minor)?;
            }
            Body::Dup {
                fd,
                old_fd,
                kind,
                minor,
            } => {
                self.fds.dup(pid, cg, *fd, *old_fd, *kind, *minor);
                self.opened(pid, *fd, *kind, *minor)?;
            }
            Body::Close { fd } => {
                if self.fds.remove_fd(pid, *fd).is_none() {
                    return Ok(false);
                }
                self.removed(e, syscalls::CLOSE);
            }
            Body::CloseRange { first, last, .. } => {
                let closed = self.fds.remove_range(pid, *first, *last);
                if closed.is_empty() {
                    return Ok(false);
                }
                for fd in closed {
                    self.kernel_forget(pid, cg, fd);
                }
                self.removed(e, syscalls::CLOSE_RANGE);
            }
            Body::Mmap { fd, addr, len } => {
                // After an exec the probes may still take a reused fd number for the NVIDIA fd it replaced
                // until the exec is handled here: the mirror, which has handled it, has the last word.
                if !self.fds.map_fd(pid, cg, *fd, *addr, *len) {
                    return Ok(false);
                }
            }
            Body::Munmap { addr, len } => {
                if self.fds.unmap(pid, *addr, *len) == 0 {
                    return Ok(false);
                }
                self.removed(e, syscalls::MUNMAP);
            }
            Body::MapFixed { addr, len } => {
                if self.fds.unmap(pid, *addr, *len) == 0 {
                    return Ok(false);
                }
                self.removed(e, syscalls::MMAP);
            }
            Body::Mremap {
                old_addr,
                old_len,
                new_addr,
                new_len,
                flags,
            } => {
                let held = self.fds.get(pid).is_some_and(|p| !p.maps.is_empty());
                let gone = self.fds.mremap(
                    pid,
                    cg,
                    (*old_addr, *old_len),
                    (*new_addr, *new_len),
                    *flags,
                );
                if gone > 0 {
                    self.removed(e, syscalls::MREMAP);
                } else if !held {
                    return Ok(false);
                }
            }
            Body::Madvise {
                addr,
                len,
                dont_fork,
            } => {
                if self.fds.get(pid).is_none_or(|p| p.maps.is_empty()) {
                    return Ok(false);
                }
                self.fds.set_dont_fork(pid, *addr, *len, *dont_fork);
            }
            Body::Fork { child } => self.fork(pid, *child)?,
            Body::Exec => {
                let prefixes = self.probes.prefixes().to_vec();
                // An fd whose link cannot be read stays (what it is is unknown); one closed by the exec goes.
                let dir = crate::proc_read::ProcDir::open(pid);
                let still_open = |fd: i32| match &dir {
                    Ok(dir) => match dir.fd_target(fd) {
                        Ok(Some(t)) => {
                            seed::classify_path(t.as_encoded_bytes(), &prefixes).is_some()
                        }
                        Ok(None) => false,
                        Err(e) => e != crate::proc_read::ProcError::Gone,
                    },
                    Err(e) => *e != crate::proc_read::ProcError::Gone,
                };
                self.launch_libs.forget_pid(pid);
                let closed = self.fds.exec(pid, &still_open);
                for fd in closed {
                    self.kernel_forget(pid, cg, fd);
                }
                self.removed(e, syscalls::EXEC);
            }
            Body::ThreadExit => {
                self.releases.removed(e.tid, pid, cg, e.ts_ns, true, &[]);
            }
            Body::Exit => {
                self.launch_libs.forget_pid(pid);
                if let Some(p) = self.fds.exit(pid) {
                    for fd in p.fds.keys() {
                        self.kernel_forget(pid, p.cgroup_id, *fd);
                    }
                }
                self.ledger.container_mut(cg).release_process(pid);
                self.releases.removed(e.tid, pid, cg, e.ts_ns, true, &[]);
                self.releases.process_exiting(pid, cg, e.ts_ns);
                self.forget_proc_if_done(pid);
            }
            Body::Confirm { kind, .. } => {
                if self.releases.confirmed(e.tid, *kind, e.ts_ns).is_none() {
                    return Ok(false);
                }
                if let Some((lost_pid, _)) = self.lost_calls.remove(&e.tid) {
                    // The call whose record was lost has returned: /proc shows what it did, read once the
                    // ring is drained (`resync::resync_if_records_lost`).
                    self.lost_reseeds.insert(lost_pid);
                }
                self.forget_proc_if_done(pid);
            }
            Body::Lost { call, fd } => self.call_lost(e, *call, *fd),
            Body::Resync { .. } => {}
        }
        Ok(true)
    }

    /// An ioctl the kernel returned 0 for: the ledger follows it as its readings allow (`ledger::readings`),
    /// attributed to the open file it came through; a device file registered with a ctl file (REGISTER_FD)
    /// and a file that client memory is mapped through (RM_MAP_MEMORY's fd) keep that file alive (whatever
    /// the status read: a kept file only makes a release later); UVM registrations are counted on their file
    /// as the ledger counts them (up whatever the status, down on NV_OK only).
    fn apply_ioctl(&mut self, pid: u32, cg: u64, io: &Ioctl) {
        if io.ret != 0 {
            return;
        }
        let file = self.fds.file_of(pid, io.fd);
        let op = &io.decoded.op;
        let readings = Readings {
            exit: op,
            status: io.decoded.status,
            enter: io.enter.as_ref(),
        };
        let verdict = self.ledger.container_mut(cg).apply(pid, file, &readings);
        if verdict.free_disputed {
            tracing::debug!(
                pid,
                cgroup_id = cg,
                ?op,
                enter = ?io.enter,
                "tracer: a free read as done named another object at its entry: not applied"
            );
        }
        let Some(file) = file else {
            return;
        };
        match *op {
            Op::RegisterFd { ctl_fd } => {
                if let Some(ctl) = self.fds.file_of(pid, ctl_fd) {
                    self.fds.keep(file, ctl);
                }
            }
            Op::MapMemory {
                client,
                fd: Some(map_fd),
                ..
            } => {
                let client_file = self
                    .ledger
                    .container(cg)
                    .and_then(|l| l.clients().find(|(h, _)| *h == client))
                    .and_then(|(_, c)| c.file);
                if let (Some(through), Some(kept)) = (self.fds.file_of(pid, map_fd), client_file) {
                    self.fds.keep(through, kept);
                }
            }
            _ => {}
        }
        if let Some((UvmCount::GpusRegistered, delta)) = verdict.uvm {
            self.fds.add_uvm_gpus(file, i64::from(delta));
        }
    }

    /// The probes lost the record of a call `e`'s thread began (`Body::Lost`): whatever it does the records
    /// will not say, so the ledger is partial. A driver call may have created anything on its file: that
    /// file counts as holding GPU state (opaque) until its final release, which frees all it carries. Any
    /// other call may have opened, mapped or closed something: once the thread is past it (its next traced
    /// syscall, its death, or /proc) the process is read again from /proc, and until then it holds its
    /// container's release back.
    fn call_lost(&mut self, e: &Event, call: baton_probe_common::Sys, fd: i32) {
        let (pid, cg) = (e.pid, e.cgroup_id);
        tracing::debug!(
            pid,
            tid = e.tid,
            fd,
            "the probes lost the record of a {call:?} call: made up for from /proc"
        );
        self.ledger.container_mut(cg).partial = true;
        if call == baton_probe_common::Sys::Ioctl {
            if let Some(file) = self.fds.file_of(pid, fd) {
                self.fds.mark_opaque(file);
            }
            return;
        }
        self.releases
            .call_lost(e.tid, pid, cg, e.ts_ns, syscalls::of(call));
        self.lost_calls.insert(e.tid, (pid, cg));
    }

    /// `pid` has NVIDIA fd `fd` now (an open or a dup): the kernel map has it, the launch probes look at it.
    fn opened(&mut self, pid: u32, fd: i32, kind: FdKind, minor: u8) -> Result<(), TracerError> {
        // The probe made the kernel entry; made again (unless the probe has a newer one) in case handling an
        // earlier close_range or exec of this process removed it after the fd number was reused.
        self.kernel_restore(pid, fd, kind, minor)?;
        if !self.launch_libs.looked_at(pid) {
            self.probe_launches_of(pid);
        }
        Ok(())
    }

    /// The files whose last reference went: the driver freed the clients on them (in its final release,
    /// which the release tracker confirms), and their UVM registrations. Returns whether that released GPU
    /// state (objects that were more than handles, a UVM registration, a file of unknown contents).
    pub(super) fn settle_released_files(&mut self) -> bool {
        let mut freed = false;
        for (file, info) in self.fds.take_released() {
            freed |= self.ledger.release_file(file) > 0 || info.opaque || info.uvm_gpus > 0;
            if info.uvm_gpus > 0 {
                let l = self.ledger.container_mut(info.cgroup_id);
                l.uvm.gpus_registered = (l.uvm.gpus_registered - info.uvm_gpus).max(0);
            }
        }
        freed
    }

    /// `e`'s thread removed NVIDIA state: it awaits confirmation; a process left with nothing has had its
    /// driver state released and stops being reported once its threads are confirmed.
    fn removed(&mut self, e: &Event, syscalls: &'static [i64]) {
        self.releases
            .removed(e.tid, e.pid, e.cgroup_id, e.ts_ns, false, syscalls);
        if self.fds.get(e.pid).is_none() {
            self.ledger
                .container_mut(e.cgroup_id)
                .release_process(e.pid);
        }
    }

    /// The probes stop reporting `pid` (munmaps, forks, exec, exit) once it pins nothing and none of its
    /// threads awaits a confirmation.
    fn forget_proc_if_done(&mut self, pid: u32) {
        if self.fds.get(pid).is_none() && !self.releases.pid_awaits(pid) {
            let _ = self.probes.nv_procs.remove(&pid);
        }
    }

    /// A holder forked a new process (the probes do not report new threads): the child inherits the fds,
    /// copied into the kernel map here.
    ///
    /// The child may already have run: the fork probe put it in `FORKED`, so until the copy its lookups fell
    /// back to the parent's entries, and an inherited fd it closed meanwhile left a `FdInfo::CLOSED` entry.
    /// The copy does not overwrite entries the child made itself (BPF_NOEXIST); then `FORKED` is dropped and
    /// the `CLOSED` entries, which only mattered during the copy, are removed. A child that is already gone
    /// has its exit record behind this one, which undoes the copy.
    fn fork(&mut self, parent: u32, child: u32) -> Result<(), TracerError> {
        let inherited = self.fds.fork(parent, child);
        for (fd, nv) in &inherited {
            self.kernel_inherit(child, *fd, *nv)?;
        }
        let _ = self.probes.forked.remove(&child);
        for (fd, _) in &inherited {
            let key = FdKey {
                tgid: child,
                fd: *fd as u32,
            };
            if self.probes.nv_fds.get(&key, 0).is_ok_and(|i| i.is_closed()) {
                let _ = self.probes.nv_fds.remove(&key);
            }
        }
        if self.fds.get(child).is_none() {
            let _ = self.probes.nv_procs.remove(&child);
        }
        Ok(())
    }

    /// Copies an inherited fd into the kernel map unless the child already has an entry for that fd.
    fn kernel_inherit(&mut self, child: u32, fd: i32, nv: NvFd) -> Result<(), TracerError> {
        self.kernel_fd_entry(child, fd, nv.kind, nv.minor, super::BPF_NOEXIST)
            .map(drop)
    }
}
