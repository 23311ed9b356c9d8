//! Process lifecycle of NVIDIA fd holders: new processes (fds are inherited; new threads share them), exec (CLOEXEC fds go away) and exit.
//! The kernel side only reports these for processes in `NV_PROCS`; user space, which mirrors each process's
//! fds, copies or drops the `NV_FDS` entries and confirms from /proc where it matters. A forked child is a
//! holder from its first instruction: the fork probe puts it in `NV_PROCS` and `FORKED`, so its calls on
//! inherited fds are seen before user space has copied them (see `maps::nv_fd`).
use aya_ebpf::{macros::tracepoint, programs::TracePointContext};
use baton_probe_common::{NAME_CAP, RecordKind};

use crate::{
    confirm::await_confirm,
    fds::{NO_INFO, emit_fd},
    maps::{CONFIG, FORKED, NV_PROCS},
    pending::forget_pending,
    util::ids,
};

#[inline(always)]
fn holds_nvidia(tgid: u32) -> bool {
    // SAFETY: presence check only.
    unsafe { NV_PROCS.get(tgid).is_some() }
}

/// `CLONE_THREAD`: the new task is a thread of the caller's process, which shares its fd table.
const CLONE_THREAD: u64 = 0x0001_0000;

/// A new task of a holder (`task:task_newtask`, in the parent, before the new task can run). A new thread
/// shares the fd table and is not reported: only a new process inherits copies of the fds.
#[tracepoint]
pub fn task_newtask(ctx: TracePointContext) -> u32 {
    let _ = try_newtask(&ctx);
    0
}

#[inline(always)]
fn try_newtask(ctx: &TracePointContext) -> Option<()> {
    let (tgid, _) = ids();
    if !holds_nvidia(tgid) {
        return None;
    }
    let cfg = CONFIG.get(0)?;
    let (pid_off, flags_off) = (
        cfg.newtask_pid_offset as usize,
        cfg.newtask_flags_offset as usize,
    );
    if pid_off == 0 || pid_off > 64 || flags_off == 0 || flags_off > 64 {
        return None;
    }
    // SAFETY: reads the tracepoint record at offsets user space took from this kernel's tracefs format.
    let flags: u64 = unsafe { ctx.read_at(flags_off) }.ok()?;
    if flags & CLONE_THREAD != 0 {
        return None;
    }
    // SAFETY: as above.
    let child: i32 = unsafe { ctx.read_at(pid_off) }.ok()?;
    let child_tgid = child as u32;
    let _ = FORKED.insert(child_tgid, tgid, 0);
    let _ = NV_PROCS.insert(child_tgid, 1, 0);
    emit_fd(RecordKind::Fork, -1, child, NO_INFO, 0, 0, &[0; NAME_CAP]);
    Some(())
}

#[tracepoint]
pub fn sched_process_exec(_ctx: TracePointContext) -> u32 {
    let (tgid, _) = ids();
    if holds_nvidia(tgid) {
        // The new program's fds are its own (CLOEXEC ones are gone): no more falling back to the parent's
        // entries; user space, which reads /proc after exec, settles which inherited fds survived.
        let _ = FORKED.remove(tgid);
        emit_fd(RecordKind::Exec, -1, -1, NO_INFO, 0, 0, &[0; NAME_CAP]);
        // The old mm and the CLOEXEC files were dropped in this exec: their releases run as task work on the
        // way back to user space.
        await_confirm();
    }
    0
}

/// Every exiting thread of a holder is reported and marked: the one that drops the last reference to the
/// fd table (not necessarily the last to exit) runs the files' releases in its `exit_task_work`, after this
/// tracepoint. `NV_PROCS` is left to user space, which drops it once every thread is confirmed dead (the
/// process's other threads are still to be marked). Any thread's exit, holder or not, gives back what it left
/// in `PENDING` (see `pending.rs`).
#[tracepoint]
pub fn sched_process_exit(ctx: TracePointContext) -> u32 {
    let (tgid, tid) = ids();
    forget_pending(tid);
    if !holds_nvidia(tgid) {
        return 0;
    }
    let group_dead = match CONFIG.get(0) {
        Some(cfg) if cfg.exit_group_dead_offset != 0 && cfg.exit_group_dead_offset < 64 => {
            // SAFETY: reads the tracepoint record at an offset user space took from this kernel's format.
            unsafe { ctx.read_at::<u8>(cfg.exit_group_dead_offset as usize) }.unwrap_or(0) != 0
        }
        _ => tgid == tid,
    };
    if group_dead {
        let _ = FORKED.remove(tgid);
    }
    emit_fd(
        RecordKind::Exit,
        -1,
        i32::from(group_dead),
        NO_INFO,
        0,
        0,
        &[0; NAME_CAP],
    );
    await_confirm();
    0
}
