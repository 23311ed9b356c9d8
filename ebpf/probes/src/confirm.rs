//! Confirming that a removal of NVIDIA state is complete in the kernel, not just requested.
//!
//! The final `fput` of a file defers the driver's release to task work, which runs after the syscall's exit
//! tracepoint and before the thread returns to user space; an exiting thread drops its files and runs that
//! work after `sched_process_exit`. So a thread that removed NVIDIA state (close, close over by dup2/dup3,
//! munmap, exec, exit) is marked in `AWAIT_CONFIRM` at the syscall's exit (or at exec/exit), and a
//! `Confirm` record is sent when it is seen past that work:
//! - at its next syscall entry (`raw_syscalls:sys_enter`, as a raw tracepoint: no arguments are read), it
//!   returned to user space;
//! - when it is switched out dead (`sched:sched_switch` with a prev_state of `X` or `Z`), it is past
//!   `exit_task_work`.
//!
//! Miss paths: one hash lookup per syscall entry on the node, one argument read per context switch.
use aya_ebpf::{
    macros::{raw_tracepoint, tracepoint},
    programs::{RawTracePointContext, TracePointContext},
};
use baton_probe_common::{ConfirmReason, Counter, NAME_CAP, RecordKind};

use crate::{
    fds::{NO_INFO, emit_fd},
    maps::AWAIT_CONFIRM,
    util::{count, ids, now_ns},
};

/// Offset of `prev_state` in this kernel's `sched:sched_switch` record; user space checks the format
/// before it attaches [`sched_switch`].
const SWITCH_PREV_STATE_OFFSET: usize = 32;
/// `prev_state` bits of a dead task as the tracepoint reports them (`EXIT_DEAD` `X`, `EXIT_ZOMBIE` `Z`).
const PREV_STATE_DEAD: i64 = 0x10 | 0x20;

/// The current thread removed NVIDIA state: report when it is past the kernel's deferred release.
#[inline(always)]
pub fn await_confirm() {
    let (_, tid) = ids();
    if AWAIT_CONFIRM.insert(tid, now_ns(), 0).is_err() {
        count(Counter::ConfirmMapFull);
    }
}

/// Sends the `Confirm` record of the current thread if it was marked.
#[inline(always)]
fn confirm(reason: ConfirmReason) {
    let (_, tid) = ids();
    // SAFETY: the value is copied out at once.
    let Some(marked) = (unsafe { AWAIT_CONFIRM.get(tid).copied() }) else {
        return;
    };
    let _ = AWAIT_CONFIRM.remove(tid);
    emit_fd(
        RecordKind::Confirm,
        -1,
        reason as i32,
        NO_INFO,
        marked,
        0,
        &[0; NAME_CAP],
    );
}

#[raw_tracepoint(tracepoint = "sys_enter")]
pub fn confirm_sys_enter(_ctx: RawTracePointContext) -> i32 {
    confirm(ConfirmReason::Returned);
    0
}

#[tracepoint]
pub fn sched_switch(ctx: TracePointContext) -> u32 {
    // SAFETY: reads a field of the tracepoint record at the offset user space checked in this kernel's format.
    let prev_state: i64 = unsafe { ctx.read_at(SWITCH_PREV_STATE_OFFSET) }.unwrap_or(0);
    if prev_state & PREV_STATE_DEAD != 0 {
        // The tracepoint runs in the context of the task switched out.
        confirm(ConfirmReason::Exited);
    }
    0
}
