//! Process lifecycle of NVIDIA fd holders: fork (fds are inherited), exec (CLOEXEC fds go away) and exit.
//! The kernel side only reports these for processes in `NV_PROCS`; user space, which mirrors each process's
//! fds, copies or drops the `NV_FDS` entries and confirms from /proc where it matters. A forked child is a
//! holder from its first instruction: the fork probe puts it in `NV_PROCS` and `FORKED`, so its calls on
//! inherited fds are seen before user space has copied them (see `maps::nv_fd`).
use aya_ebpf::{macros::tracepoint, programs::TracePointContext};
use baton_probe_common::{FdInfo, NAME_CAP, RecordKind};

use crate::{
    fds::emit_fd,
    maps::{CONFIG, FORKED, NV_PROCS},
    util::ids,
};

const NO_INFO: FdInfo = FdInfo {
    kind: 0,
    minor: 0,
    _pad: [0; 2],
};

#[inline(always)]
fn holds_nvidia(tgid: u32) -> bool {
    // SAFETY: presence check only.
    unsafe { NV_PROCS.get(tgid).is_some() }
}

#[tracepoint]
pub fn sched_process_fork(ctx: TracePointContext) -> u32 {
    let (tgid, _) = ids();
    if !holds_nvidia(tgid) {
        return 0;
    }
    let Some(cfg) = CONFIG.get(0) else { return 0 };
    let off = cfg.fork_child_pid_offset as usize;
    if off == 0 || off > 64 {
        return 0;
    }
    // SAFETY: reads the tracepoint record at an offset user space took from this kernel's tracefs format.
    let child: i32 = match unsafe { ctx.read_at(off) } {
        Ok(c) => c,
        Err(_) => return 0,
    };
    // The child cannot run before this returns (the tracepoint fires before it is woken up).
    let child_tgid = child as u32;
    let _ = FORKED.insert(child_tgid, tgid, 0);
    let _ = NV_PROCS.insert(child_tgid, 1, 0);
    emit_fd(RecordKind::Fork, -1, child, NO_INFO, 0, 0, &[0; NAME_CAP]);
    0
}

#[tracepoint]
pub fn sched_process_exec(_ctx: TracePointContext) -> u32 {
    let (tgid, _) = ids();
    if holds_nvidia(tgid) {
        // The new program's fds are its own (CLOEXEC ones are gone): no more falling back to the parent's
        // entries; user space, which reads /proc after exec, settles which inherited fds survived.
        let _ = FORKED.remove(tgid);
        emit_fd(RecordKind::Exec, -1, -1, NO_INFO, 0, 0, &[0; NAME_CAP]);
    }
    0
}

#[tracepoint]
pub fn sched_process_exit(_ctx: TracePointContext) -> u32 {
    let (tgid, tid) = ids();
    if tgid == tid && holds_nvidia(tgid) {
        let _ = NV_PROCS.remove(tgid);
        let _ = FORKED.remove(tgid);
        emit_fd(RecordKind::Exit, -1, -1, NO_INFO, 0, 0, &[0; NAME_CAP]);
    }
    0
}
