//! Small helpers shared by the programs: syscall arguments, ids, counters and record headers.
use aya_ebpf::{
    EbpfContext,
    helpers::{
        bpf_get_current_pid_tgid, generated::bpf_get_current_cgroup_id, generated::bpf_ktime_get_ns,
    },
    programs::TracePointContext,
};
use baton_probe_common::{Counter, Header, RecordKind};

use crate::maps::{CONFIG, COUNTERS, WATCHED};

/// Offset of the first syscall argument in a `syscalls:sys_enter_*` record (after the common fields and
/// `__syscall_nr`); each argument is 8 bytes. Also the offset of `ret` in `sys_exit_*`.
const SYSCALL_ARGS_OFFSET: usize = 16;

/// Argument `n` of a `sys_enter_*` tracepoint, or `ret` of a `sys_exit_*` one (n = 0).
#[inline(always)]
pub fn arg(ctx: &TracePointContext, n: usize) -> u64 {
    // SAFETY: syscall tracepoint records hold at least the syscall's arguments as 8-byte fields from offset 16;
    // callers only ask for arguments their syscall has. A direct context load is what the verifier expects.
    unsafe {
        *(ctx
            .as_ptr()
            .cast::<u8>()
            .add(SYSCALL_ARGS_OFFSET + 8 * n)
            .cast::<u64>())
    }
}

/// (tgid, tid) of the current task.
#[inline(always)]
pub fn ids() -> (u32, u32) {
    let v = bpf_get_current_pid_tgid();
    ((v >> 32) as u32, v as u32)
}

/// CLOCK_MONOTONIC now, ns.
#[inline(always)]
pub fn now_ns() -> u64 {
    // SAFETY: helper without arguments.
    unsafe { bpf_ktime_get_ns() }
}

/// cgroup v2 id of the current task.
#[inline(always)]
pub fn cgroup_id() -> u64 {
    // SAFETY: helper without arguments.
    unsafe { bpf_get_current_cgroup_id() }
}

/// Whether the current task is to be traced: everything in `--all` mode, else a watched cgroup.
#[inline(always)]
pub fn current_is_watched() -> bool {
    if let Some(cfg) = CONFIG.get(0) {
        if cfg.watch_all != 0 {
            return true;
        }
    }
    let id = cgroup_id();
    // SAFETY: the value is read and not kept.
    unsafe { WATCHED.get(id).is_some() }
}

/// Adds one to a counter.
#[inline(always)]
pub fn count(c: Counter) {
    if let Some(p) = COUNTERS.get_ptr_mut(c as u32) {
        // SAFETY: per-CPU slot, no concurrent writer on this CPU while the program runs.
        unsafe { *p += 1 };
    }
}

/// A record header for the current task.
#[inline(always)]
pub fn header(kind: RecordKind, ts_ns: u64) -> Header {
    let (pid, tid) = ids();
    let cg = cgroup_id();
    Header {
        kind: kind as u32,
        pid,
        tid,
        cgroup_id_lo: cg as u32,
        cgroup_id_hi: (cg >> 32) as u32,
        _pad: 0,
        ts_ns,
    }
}
