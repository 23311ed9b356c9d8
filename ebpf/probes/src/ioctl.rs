//! Capturing ioctls on NVIDIA fds: the enter half remembers the call (and, for allocations and frees, what
//! their params name before the driver reads them), the exit half reads the parameter struct (the driver
//! writes its RM status into it) and the one nested buffer that matters, and sends the record.
use aya_ebpf::{
    bindings::{BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP},
    cty::c_void,
    helpers::generated::bpf_probe_read_user,
    macros::tracepoint,
    programs::TracePointContext,
};
use baton_nvidia::{class, escape, fdkind::FdKind, ioc, params, uvm};
use baton_probe_common::{
    Counter, DATA_CAP, EnterReading, IoctlRecord, NAME_CAP, NESTED_CAP, RecordKind, Sys,
};

use crate::{
    confirm::confirm_returned,
    maps::{CONSUMER, EVENTS, nv_fd},
    pending::{Pending, put_pending, take_pending},
    util::{arg, count, header, ids, now_ns},
};

/// Pending bytes in the ring buffer at which an ioctl record wakes the consumer (about 400 records).
const WAKEUP_BYTES: u64 = 256 << 10;

#[tracepoint]
pub fn sys_enter_ioctl(ctx: TracePointContext) -> u32 {
    confirm_returned();
    let fd = arg(&ctx, 0);
    let (tgid, tid) = ids();
    let Some(info) = nv_fd(tgid, fd as u32) else {
        return 0;
    };
    let mut p = Pending {
        ts_ns: now_ns(),
        arg: arg(&ctx, 2),
        len: 0,
        arg2: 0,
        cg: 0,
        cmd: arg(&ctx, 1) as u32,
        fd: fd as i32,
        sys: Sys::Ioctl,
        kind: info.kind,
        minor: info.minor,
        flags: 0,
        tid: 0,
        name: [0; NAME_CAP],
        enter: EnterReading::NONE,
    };
    let frontend = info.kind == FdKind::Ctl as u8
        || info.kind == FdKind::Device as u8
        || (info.kind == FdKind::Unknown as u8 && ioc::is_nvidia(p.cmd));
    if frontend {
        read_at_enter(&mut p.enter, p.cmd, p.arg);
    }
    put_pending(tid, p);
    0
}

/// Bytes of an allocating or freeing escape's params read at entry: up to NVOS32's AllocSize.size, the
/// furthest field the ledger needs.
const ENTER_HEAD: usize = params::nvos32::ALLOC_SIZE_OFFSET as usize + 8;

/// Reads what an RM allocation or free names (`escape::read_at_enter`, also wrapped in IOCTL_XFER_CMD)
/// before the driver copies its params in, into `out`: the ledger compares it with the exit's reading,
/// which another thread of the caller may have rewritten after the driver's copy-out. Other escapes (the
/// hot RM_CONTROL among them) cost one compare here; an IOCTL_XFER_CMD reads its 16-byte header.
#[inline(always)]
fn read_at_enter(out: &mut EnterReading, cmd: u32, arg: u64) {
    let mut nr = ioc::nr(cmd);
    let mut size = ioc::size(cmd);
    let mut src = arg;
    if nr == escape::IOCTL_XFER_CMD {
        let mut x = [0u8; params::xfer::SIZE as usize];
        if read_user(x.as_mut_ptr(), x.len(), arg, size) < params::xfer::SIZE as u16 {
            return;
        }
        nr = u32_at(&x, params::xfer::CMD_OFFSET as usize);
        size = u32_at(&x, params::xfer::SIZE_OFFSET as usize);
        src = u64_at(&x, params::xfer::PTR_OFFSET as usize);
    }
    if !escape::read_at_enter(nr) {
        return;
    }
    let mut head = [0u8; ENTER_HEAD];
    let n = read_user(head.as_mut_ptr(), ENTER_HEAD, src, size) as usize;
    if n == 0 {
        return;
    }
    out.nr = nr;
    out.len = n as u32;
    out.client = u32_at(&head, params::rm_alloc::H_ROOT_OFFSET as usize);
    out.parent = u32_at(&head, params::rm_alloc::H_OBJECT_PARENT_OFFSET as usize);
    if nr == escape::RM_VID_HEAP_CONTROL {
        out.class = u32_at(&head, params::nvos32::FUNCTION_OFFSET as usize);
        out.object = u32_at(&head, params::nvos32::H_MEMORY_OFFSET as usize);
        out.size = u64_at(&head, params::nvos32::ALLOC_SIZE_OFFSET as usize);
        out.size_read = (n >= ENTER_HEAD) as u32;
        return;
    }
    // hObjectNew of the allocations and hObjectOld of RM_FREE share the offset, as hClass does.
    out.object = u32_at(&head, params::rm_alloc::H_OBJECT_NEW_OFFSET as usize);
    out.class = u32_at(&head, params::rm_alloc::H_CLASS_OFFSET as usize);
    if nr == escape::RM_ALLOC_MEMORY {
        out.size = u64_at(&head, params::nvos02::LIMIT_OFFSET as usize);
        out.size_read = (n >= params::nvos02::LIMIT_OFFSET as usize + 8) as u32;
    } else if nr == escape::RM_ALLOC
        && class::is_memory(out.class)
        && n >= params::rm_alloc::P_ALLOC_PARMS_OFFSET as usize + 8
    {
        let ptr = u64_at(&head, params::rm_alloc::P_ALLOC_PARMS_OFFSET as usize);
        let mut bytes = [0u8; 8];
        let at = ptr.wrapping_add(params::memory_alloc::SIZE_OFFSET as u64);
        if ptr != 0 && read_user(bytes.as_mut_ptr(), bytes.len(), at, 8) == 8 {
            out.size = u64::from_ne_bytes(bytes);
            out.size_read = 1;
        }
    }
}

#[tracepoint]
pub fn sys_exit_ioctl(ctx: TracePointContext) -> u32 {
    if let Some(p) = take_pending(ids().1, Sys::Ioctl) {
        send_ioctl(&p, arg(&ctx, 0) as i64);
    }
    0
}

/// Ring-buffer submit flags for an ioctl record. Waking the consumer costs more than the rest of the probe
/// (about 2 us a call, measured by `baton bench`), so ioctl records wake it only when it sleeps with no timer
/// (`CONSUMER` set: the first record after a quiet spell) and when a backlog has piled up. While records
/// flow, the consumer drains on a short timer instead (see `Tracer::next_events`), and when a drain finds
/// nothing it sets `CONSUMER` and stops its timer: an idle node has no periodic wakeups. Fd lifecycle and
/// confirmation records always wake it: they carry the release signal.
#[inline(always)]
fn wakeup_flags() -> u64 {
    if let Some(sleeping) = CONSUMER.get_ptr_mut(0) {
        // SAFETY: a live array element; a racing write by another CPU at worst wakes the consumer twice.
        unsafe {
            if *sleeping != 0 {
                *sleeping = 0;
                return BPF_RB_FORCE_WAKEUP as u64;
            }
        }
    }
    // Wake once as the backlog crosses the threshold, not for every record above it.
    let backlog = EVENTS.query(BPF_RB_AVAIL_DATA as u64);
    if backlog >= WAKEUP_BYTES && backlog < WAKEUP_BYTES + 4 * size_of::<IoctlRecord>() as u64 {
        BPF_RB_FORCE_WAKEUP as u64
    } else {
        BPF_RB_NO_WAKEUP as u64
    }
}

/// Reads `len` (clamped to `cap`) bytes of user memory at `src` into `dst`; returns the bytes read.
#[inline(always)]
fn read_user(dst: *mut u8, cap: usize, src: u64, len: u32) -> u16 {
    let mut n = len as usize;
    if n > cap {
        n = cap;
    }
    if n == 0 || src == 0 {
        return 0;
    }
    // SAFETY: `dst` points at `cap` writable bytes (of a reserved ring-buffer record, or a stack buffer) and
    // `n <= cap`; the helper reads user memory safely and reports faults.
    let r = unsafe { bpf_probe_read_user(dst.cast::<c_void>(), n as u32, src as *const c_void) };
    if r < 0 {
        count(Counter::ReadFailures);
        return 0;
    }
    n as u16
}

#[inline(always)]
fn u32_at<const N: usize>(data: &[u8; N], off: usize) -> u32 {
    if off + 4 > N {
        return 0;
    }
    u32::from_ne_bytes([data[off], data[off + 1], data[off + 2], data[off + 3]])
}

#[inline(always)]
fn u64_at<const N: usize>(data: &[u8; N], off: usize) -> u64 {
    (u32_at(data, off) as u64) | ((u32_at(data, off + 4) as u64) << 32)
}

/// Where the nested buffer of a frontend call lives and how long it is, from the captured params: the
/// memory-allocation params of an RM_ALLOC of a memory class (the size the ledger needs) and the inner
/// params of IOCTL_XFER_CMD. RM_CONTROL params are not read: nothing decodes them yet, and RM_CONTROL is the
/// most frequent call of a running CUDA process, so the extra read would be paid on the hot path.
#[inline(always)]
fn nested_source(nr: u32, data: &[u8; DATA_CAP], data_len: u16) -> Option<(u64, u32)> {
    let have = data_len as usize;
    match nr {
        escape::RM_ALLOC if have >= params::rm_alloc::P_ALLOC_PARMS_OFFSET as usize + 8 => {
            let cls = u32_at(data, params::rm_alloc::H_CLASS_OFFSET as usize);
            if !class::is_memory(cls) {
                return None;
            }
            let ptr = u64_at(data, params::rm_alloc::P_ALLOC_PARMS_OFFSET as usize);
            Some((ptr, params::memory_alloc::SIZE))
        }
        escape::IOCTL_XFER_CMD if have >= params::xfer::SIZE as usize => Some((
            u64_at(data, params::xfer::PTR_OFFSET as usize),
            u32_at(data, params::xfer::SIZE_OFFSET as usize),
        )),
        _ => None,
    }
}

#[inline(always)]
fn send_ioctl(p: &Pending, ret: i64) {
    let Some(mut entry) = EVENTS.reserve::<IoctlRecord>(0) else {
        count(Counter::RingbufDrops);
        return;
    };
    let rec = entry.as_mut_ptr();
    let is_uvm = p.kind == FdKind::Uvm as u8 || p.kind == FdKind::UvmTools as u8;
    let size = if is_uvm {
        uvm::capture_size(p.cmd)
    } else {
        ioc::size(p.cmd)
    };
    let now = now_ns();
    // SAFETY: `rec` points at a reserved, writable IoctlRecord; fields are written through raw pointers before
    // the record is submitted, and the arrays are only read where `read_user` filled them.
    unsafe {
        (*rec).hdr = header(RecordKind::Ioctl, now);
        (*rec).fd = p.fd;
        (*rec).cmd = p.cmd;
        (*rec).fd_kind = p.kind;
        (*rec).minor = p.minor;
        (*rec)._pad = [0; 2];
        (*rec).ret = ret;
        (*rec).arg = p.arg;
        (*rec).latency_ns = now.wrapping_sub(p.ts_ns);
        (*rec).enter = p.enter;
        let data_len = read_user((*rec).data.as_mut_ptr(), DATA_CAP, p.arg, size);
        (*rec).data_len = data_len;
        (*rec).nested_len = 0;
        if !is_uvm {
            if let Some((ptr, len)) = nested_source(ioc::nr(p.cmd), &(*rec).data, data_len) {
                (*rec).nested_len = read_user((*rec).nested.as_mut_ptr(), NESTED_CAP, ptr, len);
            }
        }
    }
    entry.submit(wakeup_flags());
}
