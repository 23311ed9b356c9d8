//! Following NVIDIA device mappings as the kernel changes them: mmap of an NVIDIA fd, munmap, an
//! mmap(MAP_FIXED) of anything over a holder's mapping, mremap, and madvise(MADV_DONTFORK/MADV_DOFORK).
//!
//! A mapping of an NVIDIA device file keeps the file (and the driver state it carries) alive after its fd is
//! closed, so each way a mapping can end or move matters to the release signal: the real driver's checkpoint
//! ends every device mapping with an anonymous `mmap(MAP_FIXED, PROT_NONE)` over it, never an munmap
//! (recording: /work/shared/gpu/580.159.04/maps-running.txt against maps-parked.txt). Only holders (`NV_PROCS`)
//! are reported for munmap, MAP_FIXED, mremap and madvise; ranges are resolved against the mirror in user
//! space, which ignores those that held no NVIDIA mapping.
use aya_ebpf::{macros::tracepoint, programs::TracePointContext};
use baton_probe_common::{Counter, FdInfo, MapRecord, NAME_CAP, RecordKind, Sys};

use crate::{
    confirm::{await_confirm, confirm_returned},
    fds::{NO_INFO, emit_fd, nv_fd, pending},
    maps::{EVENTS, NV_PROCS},
    pending::{put_pending, take_pending},
    util::{arg, count, header, ids, now_ns},
};

/// mmap flags: the mapping replaces whatever is at the address, unless `MAP_FIXED_NOREPLACE` asks the call
/// to fail instead (the kernel adds `MAP_FIXED` itself then).
const MAP_FIXED: u64 = 0x10;
const MAP_FIXED_NOREPLACE: u64 = 0x10_0000;
/// madvise advice that changes whether a fork copies a mapping.
const MADV_DONTFORK: u64 = 10;
const MADV_DOFORK: u64 = 11;

/// Pending flags of an mmap: the call replaces a holder's range, and the new mapping is an NVIDIA file's.
const MMAP_REPLACES: u8 = 1;
const MMAP_NVIDIA: u8 = 2;

/// Whether `tgid` holds NVIDIA fds or mappings.
#[inline(always)]
fn is_holder(tgid: u32) -> bool {
    // SAFETY: presence check only.
    unsafe { NV_PROCS.get(tgid).is_some() }
}

/// Whether a syscall's return value is an error (-4095..-1).
#[inline(always)]
fn failed(ret: u64) -> bool {
    (ret as i64) < 0 && (ret as i64) >= -4095
}

#[inline(always)]
fn try_enter_mmap(ctx: &TracePointContext) -> Option<()> {
    let (addr, len, flags, fd) = (arg(ctx, 0), arg(ctx, 1), arg(ctx, 3), arg(ctx, 4));
    let (tgid, tid) = ids();
    // Plain locals, not an `Option<FdInfo>` carried to the end: the verifier refuses the register LLVM
    // leaves undefined on the `None` path.
    let mut pflags = 0u8;
    let mut kind = 0u8;
    let mut minor = 0u8;
    if let Some(info) = nv_fd(tgid, fd) {
        pflags |= MMAP_NVIDIA;
        kind = info.kind;
        minor = info.minor;
    }
    if flags & MAP_FIXED != 0 && flags & MAP_FIXED_NOREPLACE == 0 && is_holder(tgid) {
        pflags |= MMAP_REPLACES;
    }
    if pflags == 0 {
        return None;
    }
    let mut p = pending(Sys::Mmap, fd as i32, NO_INFO);
    p.arg = addr;
    p.len = len;
    p.cmd = flags as u32;
    p.flags = pflags;
    p.kind = kind;
    p.minor = minor;
    put_pending(tid, p);
    Some(())
}

#[tracepoint]
pub fn sys_enter_mmap(ctx: TracePointContext) -> u32 {
    confirm_returned();
    let _ = try_enter_mmap(&ctx);
    0
}

/// An mmap the enter half kept returned: a MAP_FIXED one replaced what was mapped in its range (its file
/// reference, if the last, is dropped as task work before the thread is back in user space), and an NVIDIA
/// one maps a device file. The replacement comes first, as in the kernel.
#[tracepoint]
pub fn sys_exit_mmap(ctx: TracePointContext) -> u32 {
    let ret = arg(&ctx, 0);
    let Some(p) = take_pending(ids().1, Sys::Mmap) else {
        return 0;
    };
    if failed(ret) {
        return 0;
    }
    if p.flags & MMAP_REPLACES != 0 {
        emit_fd(
            RecordKind::MapFixed,
            p.fd,
            p.cmd as i32,
            NO_INFO,
            ret,
            p.len,
            &[0; NAME_CAP],
        );
        await_confirm();
    }
    if p.flags & MMAP_NVIDIA != 0 {
        let info = FdInfo {
            kind: p.kind,
            minor: p.minor,
            _pad: [0; 2],
        };
        emit_fd(RecordKind::Mmap, p.fd, -1, info, ret, p.len, &[0; NAME_CAP]);
    }
    0
}

/// A holder's `munmap(addr, len)`: kept for the exit, where it is known whether it unmapped anything (a
/// failed one, an unaligned address or a range past the address space, leaves every mapping as it was).
#[tracepoint]
pub fn sys_enter_munmap(ctx: TracePointContext) -> u32 {
    confirm_returned();
    let (tgid, tid) = ids();
    if is_holder(tgid) {
        let mut p = pending(Sys::Munmap, -1, NO_INFO);
        p.arg = arg(&ctx, 0);
        p.len = arg(&ctx, 1);
        put_pending(tid, p);
    }
    0
}

/// A holder's munmap succeeded: the range is unmapped, and the mapping's file reference, if it was the last,
/// is dropped as task work before the thread is back in user space. User space only waits for it when the
/// range held NVIDIA mappings.
#[tracepoint]
pub fn sys_exit_munmap(ctx: TracePointContext) -> u32 {
    let Some(p) = take_pending(ids().1, Sys::Munmap) else {
        return 0;
    };
    if arg(&ctx, 0) != 0 {
        return 0;
    }
    emit_fd(
        RecordKind::Munmap,
        -1,
        -1,
        NO_INFO,
        p.arg,
        p.len,
        &[0; NAME_CAP],
    );
    await_confirm();
    0
}

/// A holder's `mremap(old, old_len, new_len, flags, new_addr)`: kept for the exit, where the new address is
/// known.
#[tracepoint]
pub fn sys_enter_mremap(ctx: TracePointContext) -> u32 {
    confirm_returned();
    let (tgid, tid) = ids();
    if is_holder(tgid) {
        let mut p = pending(Sys::Mremap, -1, NO_INFO);
        p.arg = arg(&ctx, 0);
        p.len = arg(&ctx, 1);
        p.arg2 = arg(&ctx, 2);
        p.cmd = arg(&ctx, 3) as u32;
        put_pending(tid, p);
    }
    0
}

/// A holder's mremap returned: the range moved, shrank or grew (a shrink or a MREMAP_FIXED move drops
/// mappings, whose release the thread's return to user space confirms, as after an munmap).
#[tracepoint]
pub fn sys_exit_mremap(ctx: TracePointContext) -> u32 {
    let ret = arg(&ctx, 0);
    let Some(p) = take_pending(ids().1, Sys::Mremap) else {
        return 0;
    };
    if failed(ret) {
        return 0;
    }
    let Some(mut entry) = EVENTS.reserve::<MapRecord>(0) else {
        count(Counter::RingbufDrops);
        return 0;
    };
    entry.write(MapRecord {
        hdr: header(RecordKind::Mremap, now_ns()),
        old_addr: p.arg,
        old_len: p.len,
        new_addr: ret,
        new_len: p.arg2,
        flags: p.cmd,
        _pad: 0,
    });
    entry.submit(aya_ebpf::bindings::BPF_RB_FORCE_WAKEUP as u64);
    await_confirm();
    0
}

/// A holder's `madvise(addr, len, MADV_DONTFORK | MADV_DOFORK)`: other advice changes no mapping's file.
#[tracepoint]
pub fn sys_enter_madvise(ctx: TracePointContext) -> u32 {
    confirm_returned();
    let advice = arg(&ctx, 2);
    if advice != MADV_DONTFORK && advice != MADV_DOFORK {
        return 0;
    }
    let (tgid, tid) = ids();
    if is_holder(tgid) {
        let mut p = pending(Sys::Madvise, -1, NO_INFO);
        p.arg = arg(&ctx, 0);
        p.len = arg(&ctx, 1);
        p.cmd = advice as u32;
        put_pending(tid, p);
    }
    0
}

#[tracepoint]
pub fn sys_exit_madvise(ctx: TracePointContext) -> u32 {
    let Some(p) = take_pending(ids().1, Sys::Madvise) else {
        return 0;
    };
    if arg(&ctx, 0) == 0 {
        emit_fd(
            RecordKind::Madvise,
            -1,
            p.cmd as i32,
            NO_INFO,
            p.arg,
            p.len,
            &[0; NAME_CAP],
        );
    }
    0
}
