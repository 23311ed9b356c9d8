//! Confirming that a removal of NVIDIA state is complete in the kernel, not just requested.
//!
//! The final `fput` of a file defers the driver's release to task work, which runs after the syscall's exit
//! tracepoint and before the thread returns to user space; an exiting thread drops its files and runs that
//! work after `sched_process_exit`. So a thread that removed NVIDIA state (close, close over by dup2/dup3,
//! munmap, exec, exit) is marked in `AWAIT_CONFIRM` at the syscall's exit (or at exec/exit), and a
//! `Confirm` record is sent when it is seen past that work:
//! - at its next entry into a syscall the probes trace (close, ioctl, mmap, ...), it returned to user space
//!   (user space confirms the other cases from /proc);
//! - when it is switched out dead (`sched:sched_switch` with a prev_state of `X` or `Z`), it is past
//!   `exit_task_work`.
//!
//! Miss paths: one array load per traced syscall entry and per context switch on the node (a hash lookup, or
//! an argument read, only while some thread is marked).
use aya_ebpf::{macros::tracepoint, programs::TracePointContext};
use baton_probe_common::{ConfirmReason, Counter, NAME_CAP, RecordKind};

use core::intrinsics::AtomicOrdering;

use crate::{
    fds::{NO_INFO, emit_fd},
    maps::{AWAIT_CONFIRM, AWAITING},
    util::{count, ids, now_ns},
};

/// Offset of `prev_state` in this kernel's `sched:sched_switch` record; user space checks the format
/// before it attaches [`sched_switch`].
const SWITCH_PREV_STATE_OFFSET: usize = 32;
/// `prev_state` bits of a dead task as the tracepoint reports them (`EXIT_DEAD` `X`, `EXIT_ZOMBIE` `Z`).
const PREV_STATE_DEAD: i64 = 0x10 | 0x20;

/// Adds `delta` (wrapping: `u64::MAX` subtracts one) to the number of marked threads.
#[inline(always)]
fn add_awaiting(delta: u64) {
    if let Some(n) = AWAITING.get_ptr_mut(0) {
        // SAFETY: a live, aligned array element; an atomic add (BPF_XADD: the BPF target has no compare-and-
        // swap, so `AtomicU64::fetch_add` does not exist there) is what several CPUs updating it at once need.
        unsafe { core::intrinsics::atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(n, delta) };
    }
}

/// The current thread removed NVIDIA state: report when it is past the kernel's deferred release.
#[inline(always)]
pub fn await_confirm() {
    let (_, tid) = ids();
    // SAFETY: presence check only.
    let known = unsafe { AWAIT_CONFIRM.get(tid).is_some() };
    if AWAIT_CONFIRM.insert(tid, now_ns(), 0).is_err() {
        count(Counter::ConfirmMapFull);
    } else if !known {
        add_awaiting(1);
    }
}

/// Whether any thread is marked.
#[inline(always)]
fn marked_anywhere() -> bool {
    // SAFETY: a live, aligned array element; an aligned 8-byte load is one instruction, so it never sees a
    // torn value (LLVM's BPF backend has no atomic load to ask for it by name).
    AWAITING
        .get_ptr_mut(0)
        .is_some_and(|n| unsafe { core::ptr::read_volatile(n) } != 0)
}

/// Sends the `Confirm` record of the current thread if it was marked. The fast path of every syscall on the
/// node while the probes are attached: an array load, and a hash lookup only while some thread is marked
/// (marks last microseconds: from a removal to the thread's next syscall).
#[inline(always)]
fn confirm(reason: ConfirmReason) {
    if !marked_anywhere() {
        return;
    }
    let (_, tid) = ids();
    // SAFETY: the value is copied out at once.
    let Some(marked) = (unsafe { AWAIT_CONFIRM.get(tid).copied() }) else {
        return;
    };
    if AWAIT_CONFIRM.remove(tid).is_ok() {
        add_awaiting(u64::MAX);
    }
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

/// The current thread entered a syscall the probes trace: if it was marked, it returned to user space since.
/// Called first by every `sys_enter_*` program. (A program on every syscall's entry, `raw_syscalls:sys_enter`,
/// would catch the next syscall whatever it is, but it costs every syscall on the node about 140 ns on this
/// project's VM; user space confirms threads whose next syscall is another one from /proc within a fraction of
/// a millisecond instead: see `baton_tracer::release`.)
#[inline(always)]
pub fn confirm_returned() {
    confirm(ConfirmReason::Returned);
}

#[tracepoint]
pub fn sched_switch(ctx: TracePointContext) -> u32 {
    if !marked_anywhere() {
        return 0;
    }
    // SAFETY: reads a field of the tracepoint record at the offset user space checked in this kernel's format.
    let prev_state: i64 = unsafe { ctx.read_at(SWITCH_PREV_STATE_OFFSET) }.unwrap_or(0);
    if prev_state & PREV_STATE_DEAD != 0 {
        // The tracepoint runs in the context of the task switched out.
        confirm(ConfirmReason::Exited);
    }
    0
}
