//! Following NVIDIA device fds: open/openat of a device path, dup/dup2/dup3/fcntl(F_DUPFD*), close, and
//! mmap/munmap of those fds.
use aya_ebpf::{
    helpers::bpf_probe_read_user_str_bytes, macros::tracepoint, programs::TracePointContext,
};
use baton_nvidia::fdkind::{self, FdKind};
use baton_probe_common::{
    Counter, FdInfo, FdRecord, NAME_CAP, PATH_CAP, PREFIX_CAP, PREFIX_SLOTS, RecordKind, Sys,
};

use crate::{
    confirm::{await_confirm, confirm_returned},
    maps::{self, NV_PROCS, PATH_BUF, PREFIXES, forget_fd},
    pending::{Pending, put_pending, take_pending},
    util::{arg, count, current_is_watched, header, ids, now_ns},
};

/// fcntl commands that duplicate an fd.
const F_DUPFD: u64 = 0;
const F_DUPFD_CLOEXEC: u64 = 1030;

/// The info of records that concern no one fd.
pub const NO_INFO: FdInfo = FdInfo {
    kind: 0,
    minor: 0,
    _pad: [0; 2],
};

/// Pending flag: a dup2/dup3 whose target was an NVIDIA fd that the call closes.
const DUP_CLOSES_TARGET: u8 = 1;

/// Sends an fd record. `name` is only set for opens.
#[inline(always)]
pub fn emit_fd(
    kind: RecordKind,
    fd: i32,
    aux: i32,
    info: FdInfo,
    addr: u64,
    len: u64,
    name: &[u8; NAME_CAP],
) {
    let Some(mut entry) = crate::maps::EVENTS.reserve::<FdRecord>(0) else {
        count(Counter::RingbufDrops);
        return;
    };
    entry.write(FdRecord {
        hdr: header(kind, now_ns()),
        fd,
        aux,
        fd_kind: info.kind,
        minor: info.minor,
        _pad: [0; 6],
        addr,
        len,
        name: *name,
    });
    // Lifecycle records are rare and carry the release signal: wake the consumer now, even behind a
    // batch of ioctl records that did not.
    entry.submit(aya_ebpf::bindings::BPF_RB_FORCE_WAKEUP as u64);
}

/// The NVIDIA fd `fd` of process `tgid`, if it is one (inherited ones included, see [`maps::nv_fd`]).
#[inline(always)]
pub fn nv_fd(tgid: u32, fd: u64) -> Option<FdInfo> {
    maps::nv_fd(tgid, fd as u32)
}

/// Records that `tgid` now holds NVIDIA fd `fd`, if its cgroup is within its quota (see [`maps::track_fd`]);
/// returns whether it does.
#[inline(always)]
fn track(tgid: u32, fd: u32, info: FdInfo) -> bool {
    if !maps::track_fd(tgid, fd, info) {
        return false;
    }
    let _ = NV_PROCS.insert(tgid, 1, 0);
    true
}

#[inline(always)]
pub fn pending(sys: Sys, fd: i32, info: FdInfo) -> Pending {
    Pending {
        ts_ns: now_ns(),
        arg: 0,
        len: 0,
        arg2: 0,
        cg: 0,
        cmd: 0,
        fd,
        sys,
        kind: info.kind,
        minor: info.minor,
        flags: 0,
        tid: 0,
        name: [0; NAME_CAP],
        enter: baton_probe_common::EnterReading::NONE,
    }
}

/// If `buf` (NUL-terminated) starts with one of the configured device-directory prefixes followed by an NVIDIA
/// device name, that name and its kind.
#[inline(always)]
#[allow(
    clippy::needless_range_loop,
    reason = "explicit bounded index loops are what the BPF verifier can follow"
)]
fn match_device(buf: &[u8; PATH_CAP]) -> Option<([u8; NAME_CAP], FdInfo)> {
    for slot in 0..PREFIX_SLOTS {
        let Some(prefix) = PREFIXES.get(slot) else {
            continue;
        };
        let plen = prefix.len as usize;
        if plen == 0 || plen > PREFIX_CAP {
            continue;
        }
        let mut same = true;
        for i in 0..PREFIX_CAP {
            if i >= plen {
                break;
            }
            if buf[i] != prefix.bytes[i] {
                same = false;
                break;
            }
        }
        if !same {
            continue;
        }
        let mut name = [0u8; NAME_CAP];
        let mut nlen = 0;
        for j in 0..NAME_CAP {
            let idx = plen + j;
            if idx >= PATH_CAP {
                break;
            }
            let c = buf[idx];
            if c == 0 {
                break;
            }
            name[j] = c;
            nlen = j + 1;
        }
        let (kind, minor) = fdkind::classify_name(&name[..nlen])?;
        if kind == FdKind::Unknown {
            return None;
        }
        return Some((
            name,
            FdInfo {
                kind: kind as u8,
                minor,
                _pad: [0; 2],
            },
        ));
    }
    None
}

#[inline(always)]
fn try_enter_open(path: u64) -> Option<()> {
    if !current_is_watched() {
        return None;
    }
    let buf = PATH_BUF.get_ptr_mut(0)?;
    // SAFETY: per-CPU scratch buffer, used only within this program run.
    let buf = unsafe { &mut *buf };
    // SAFETY: reads a NUL-terminated string from the caller's memory into our buffer; failure is handled.
    unsafe { bpf_probe_read_user_str_bytes(path as *const u8, buf) }.ok()?;
    let (name, info) = match_device(buf)?;
    let (_, tid) = ids();
    let mut p = pending(Sys::Open, -1, info);
    p.name = name;
    put_pending(tid, p);
    Some(())
}

#[tracepoint]
pub fn sys_enter_openat(ctx: TracePointContext) -> u32 {
    confirm_returned();
    let _ = try_enter_open(arg(&ctx, 1));
    0
}

#[tracepoint]
pub fn sys_enter_openat2(ctx: TracePointContext) -> u32 {
    confirm_returned();
    let _ = try_enter_open(arg(&ctx, 1));
    0
}

#[tracepoint]
pub fn sys_exit_openat2(ctx: TracePointContext) -> u32 {
    let _ = try_exit_open(arg(&ctx, 0) as i64);
    0
}

#[tracepoint]
pub fn sys_enter_open(ctx: TracePointContext) -> u32 {
    confirm_returned();
    let _ = try_enter_open(arg(&ctx, 0));
    0
}

#[inline(always)]
fn try_exit_open(ret: i64) -> Option<()> {
    let p = take_pending(ids().1, Sys::Open)?;
    if ret < 0 {
        return None;
    }
    let (tgid, _) = ids();
    let info = FdInfo {
        kind: p.kind,
        minor: p.minor,
        _pad: [0; 2],
    };
    // An fd past the cgroup's quota is not followed and not reported: user space follows that cgroup
    // through /proc.
    if track(tgid, ret as u32, info) {
        emit_fd(RecordKind::Open, ret as i32, -1, info, 0, 0, &p.name);
    }
    Some(())
}

#[tracepoint]
pub fn sys_exit_openat(ctx: TracePointContext) -> u32 {
    let _ = try_exit_open(arg(&ctx, 0) as i64);
    0
}

#[tracepoint]
pub fn sys_exit_open(ctx: TracePointContext) -> u32 {
    let _ = try_exit_open(arg(&ctx, 0) as i64);
    0
}

#[tracepoint]
pub fn sys_enter_close(ctx: TracePointContext) -> u32 {
    confirm_returned();
    let fd = arg(&ctx, 0);
    let (tgid, tid) = ids();
    if let Some(info) = nv_fd(tgid, fd) {
        forget_fd(tgid, fd as u32);
        emit_fd(RecordKind::Close, fd as i32, -1, info, 0, 0, &[0; NAME_CAP]);
        put_pending(tid, pending(Sys::Close, fd as i32, info));
    }
    0
}

/// The close of an NVIDIA fd returned: its final release, if this was the last reference, runs as task work
/// before the thread is back in user space (see `confirm.rs`).
#[tracepoint]
pub fn sys_exit_close(_ctx: TracePointContext) -> u32 {
    if take_pending(ids().1, Sys::Close).is_some() {
        await_confirm();
    }
    0
}

/// `close_range` flag that marks the fds close-on-exec instead of closing them.
const CLOSE_RANGE_CLOEXEC: u64 = 1 << 2;

/// A holder's `close_range(first, last, flags)`: the probes cannot walk a range of fds, so the record carries
/// it and user space, which mirrors the holder's fds, drops the NVIDIA ones in it (from the kernel map too).
#[tracepoint]
pub fn sys_enter_close_range(ctx: TracePointContext) -> u32 {
    confirm_returned();
    let flags = arg(&ctx, 2);
    let (tgid, tid) = ids();
    // SAFETY: presence check only.
    if flags & CLOSE_RANGE_CLOEXEC == 0 && unsafe { NV_PROCS.get(tgid).is_some() } {
        let mut p = pending(Sys::CloseRange, -1, NO_INFO);
        p.arg = arg(&ctx, 0);
        p.len = arg(&ctx, 1);
        p.cmd = flags as u32;
        put_pending(tid, p);
    }
    0
}

#[tracepoint]
pub fn sys_exit_close_range(ctx: TracePointContext) -> u32 {
    let Some(p) = take_pending(ids().1, Sys::CloseRange) else {
        return 0;
    };
    if (arg(&ctx, 0) as i64) == 0 {
        emit_fd(
            RecordKind::CloseRange,
            -1,
            p.cmd as i32,
            NO_INFO,
            p.arg,
            p.len,
            &[0; NAME_CAP],
        );
        await_confirm();
    }
    0
}

/// Enter half of dup-like calls: `old` is duplicated, onto `target` when the call names one.
#[inline(always)]
fn try_enter_dup(old: u64, target: Option<u64>) -> Option<()> {
    let (tgid, tid) = ids();
    let p = if let Some(info) = nv_fd(tgid, old) {
        pending(Sys::Dup, old as i32, info)
    } else {
        // dup2/dup3 onto an NVIDIA fd closes it.
        let t = target?;
        let info = nv_fd(tgid, t)?;
        let mut p = pending(Sys::Dup, t as i32, info);
        p.flags = DUP_CLOSES_TARGET;
        p
    };
    put_pending(tid, p);
    Some(())
}

#[inline(always)]
fn try_exit_dup(ret: i64) -> Option<()> {
    let p = take_pending(ids().1, Sys::Dup)?;
    if ret < 0 {
        return None;
    }
    let (tgid, _) = ids();
    let info = FdInfo {
        kind: p.kind,
        minor: p.minor,
        _pad: [0; 2],
    };
    if p.flags == DUP_CLOSES_TARGET {
        forget_fd(tgid, p.fd as u32);
        emit_fd(RecordKind::Close, p.fd, -1, info, 0, 0, &[0; NAME_CAP]);
        await_confirm();
    } else if track(tgid, ret as u32, info) {
        emit_fd(
            RecordKind::Dup,
            ret as i32,
            p.fd,
            info,
            0,
            0,
            &[0; NAME_CAP],
        );
    }
    Some(())
}

#[tracepoint]
pub fn sys_enter_dup(ctx: TracePointContext) -> u32 {
    confirm_returned();
    let _ = try_enter_dup(arg(&ctx, 0), None);
    0
}

#[tracepoint]
pub fn sys_enter_dup2(ctx: TracePointContext) -> u32 {
    confirm_returned();
    let _ = try_enter_dup(arg(&ctx, 0), Some(arg(&ctx, 1)));
    0
}

#[tracepoint]
pub fn sys_enter_dup3(ctx: TracePointContext) -> u32 {
    confirm_returned();
    let _ = try_enter_dup(arg(&ctx, 0), Some(arg(&ctx, 1)));
    0
}

#[tracepoint]
pub fn sys_enter_fcntl(ctx: TracePointContext) -> u32 {
    confirm_returned();
    let cmd = arg(&ctx, 1);
    if cmd == F_DUPFD || cmd == F_DUPFD_CLOEXEC {
        let _ = try_enter_dup(arg(&ctx, 0), None);
    }
    0
}

#[tracepoint]
pub fn sys_exit_dup(ctx: TracePointContext) -> u32 {
    let _ = try_exit_dup(arg(&ctx, 0) as i64);
    0
}

#[tracepoint]
pub fn sys_exit_dup2(ctx: TracePointContext) -> u32 {
    let _ = try_exit_dup(arg(&ctx, 0) as i64);
    0
}

#[tracepoint]
pub fn sys_exit_dup3(ctx: TracePointContext) -> u32 {
    let _ = try_exit_dup(arg(&ctx, 0) as i64);
    0
}

#[tracepoint]
pub fn sys_exit_fcntl(ctx: TracePointContext) -> u32 {
    let _ = try_exit_dup(arg(&ctx, 0) as i64);
    0
}
