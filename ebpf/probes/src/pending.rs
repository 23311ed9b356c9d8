//! What a thread's syscall enter leaves for its exit (`PENDING`), kept so that no thread's call can push out
//! another's record.
//!
//! Slots are indexed by `tid % PENDING_SLOTS`: an array, whose lookup the verifier inlines, because every
//! ioctl on the node pays the exit-side lookup. Two threads whose tids share a slot (a node whose `pid_max`
//! is above 65,536, as systemd sets it: 4,194,304) may be inside traced calls at once. The slot is then
//! *claimed*, never overwritten: a call that finds it held by another thread's call keeps its record in
//! `PENDING_OVERFLOW`, a hash map by tid, which the exit looks in only while it holds something (one array
//! load otherwise). Each cgroup may have `PENDING_OVERFLOW_PER_CGROUP` records there, so one tenant's
//! colliding threads cannot take the room another's need. A call whose record finds no room at all is
//! *lost*: it is counted, a `Lost` record names it, and its thread is marked for confirmation. User space
//! marks the container's ledger partial, counts a lost driver call's file as holding GPU state until its
//! final release, and re-reads the process from /proc once any other lost call has returned
//! (`baton_tracer::tracer::apply`).
//!
//! A claim needs no compare-and-swap (the BPF target has none before v3 atomics): a claimant adds one to the
//! slot's `claims` and reads it back; only the claimant that reads 1 owns the slot (coherence orders the adds
//! on that one word), the others take one back and go to the overflow. So only the owner writes the record,
//! and no two calls' records are ever mixed in one slot.
use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap},
};
use baton_probe_common::{
    Counter, NAME_CAP, PENDING_OVERFLOW_ENTRIES, PENDING_OVERFLOW_PER_CGROUP, RecordKind, Sys,
};
use core::intrinsics::AtomicOrdering;

use crate::{
    confirm::await_confirm,
    fds::{NO_INFO, emit_fd},
    util::{cgroup_id, count},
};

/// What a thread's syscall enter left for its exit.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Pending {
    pub ts_ns: u64,
    pub arg: u64,
    pub len: u64,
    /// A third argument (mremap's new length).
    pub arg2: u64,
    /// The cgroup whose overflow share a record in `PENDING_OVERFLOW` takes (set there only).
    pub cg: u64,
    pub cmd: u32,
    pub fd: i32,
    pub sys: Sys,
    pub kind: u8,
    pub minor: u8,
    pub flags: u8,
    /// The thread whose record this is (0 in a slot: none).
    pub tid: u32,
    pub name: [u8; NAME_CAP],
    /// An ioctl's params as they were at its entry (allocations and frees only: see `ioctl::read_at_enter`).
    pub enter: baton_probe_common::EnterReading,
}

/// A `PENDING` slot: its claim count and the record of the thread that owns it.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Slot {
    /// Threads that claimed the slot and have not given it back (1: owned, by `rec.tid`).
    claims: u64,
    rec: Pending,
}

/// Slots for the syscalls in flight, indexed by `tid % PENDING_SLOTS` (a thread is in one syscall at a time).
#[map(name = "PENDING")]
pub static PENDING: Array<Slot> = Array::with_max_entries(PENDING_SLOTS, 0);

/// Slots in `PENDING`.
pub const PENDING_SLOTS: u32 = 65536;

/// Records of calls whose slot another thread's call held, by tid.
#[map(name = "PENDING_OVERFLOW")]
static PENDING_OVERFLOW: HashMap<u32, Pending> =
    HashMap::with_max_entries(PENDING_OVERFLOW_ENTRIES, 0);

/// Records in `PENDING_OVERFLOW` per cgroup (atomic; entries stay, at 0, once made).
#[map(name = "PENDING_OVERFLOW_CG")]
static PENDING_OVERFLOW_CG: HashMap<u64, u64> = HashMap::with_max_entries(16384, 0);

/// Index 0: records in `PENDING_OVERFLOW`, so that an exit looks there only while it holds one.
#[map(name = "PENDING_OVERFLOWED")]
static PENDING_OVERFLOWED: Array<u64> = Array::with_max_entries(1, 0);

/// `BPF_NOEXIST`: only add.
const BPF_NOEXIST: u64 = 1;

/// Adds `delta` (wrapping: `u64::MAX` takes one away) to the word at `p`, atomically.
#[inline(always)]
fn atomic_add(p: *mut u64, delta: u64) {
    // SAFETY: `p` points at a live, aligned map value; BPF_XADD is what several CPUs updating it at once
    // need (see `confirm::add_awaiting`).
    unsafe { core::intrinsics::atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(p, delta) };
}

/// Whether `PENDING_OVERFLOW` holds any record.
#[inline(always)]
fn overflow_in_use() -> bool {
    // SAFETY: a live, aligned array element; an aligned 8-byte load is one instruction.
    PENDING_OVERFLOWED
        .get_ptr_mut(0)
        .is_some_and(|n| unsafe { core::ptr::read_volatile(n) } != 0)
}

/// Remembers the current thread's syscall `p` until its exit: in its slot, or, while another thread's call
/// holds that, in the overflow; a call with no room anywhere is reported lost.
#[inline(always)]
pub fn put_pending(tid: u32, mut p: Pending) {
    p.tid = tid;
    let Some(slot) = PENDING.get_ptr_mut(tid % PENDING_SLOTS) else {
        return;
    };
    // SAFETY: `slot` points at a live, fixed-size array element. Only the thread that owns the slot (the one
    // claimant that read a claim count of 1) writes or reads its record; others only read `rec.tid`, to
    // compare it with their own tid, and add to `claims` atomically.
    unsafe {
        if (*slot).rec.tid == tid {
            // Its own earlier record (an enter whose exit never came): replaced.
            (*slot).rec = p;
            return;
        }
        let claims = core::ptr::addr_of_mut!((*slot).claims);
        atomic_add(claims, 1);
        if core::ptr::read_volatile(claims) == 1 {
            (*slot).rec = p;
            return;
        }
        atomic_add(claims, u64::MAX);
    }
    put_overflow(tid, p);
}

/// Keeps `p` (the current thread's, `tid`) in the overflow, within its cgroup's share.
#[inline(always)]
fn put_overflow(tid: u32, mut p: Pending) {
    if let Some(there) = PENDING_OVERFLOW.get_ptr_mut(tid) {
        // Its own earlier record: replaced, in the share it took.
        // SAFETY: a live map value of this thread's; no other thread uses this key.
        unsafe {
            p.cg = (*there).cg;
            *there = p;
        }
        count(Counter::PendingOverflow);
        return;
    }
    let cg = cgroup_id();
    p.cg = cg;
    if PENDING_OVERFLOW_CG.get_ptr_mut(cg).is_none() {
        let _ = PENDING_OVERFLOW_CG.insert(cg, 0, BPF_NOEXIST);
    }
    let Some(share) = PENDING_OVERFLOW_CG.get_ptr_mut(cg) else {
        lost(&p);
        return;
    };
    // SAFETY: a live, aligned map value; racing claimants of one cgroup may pass the check together, which
    // overshoots the share by at most one record per CPU.
    if unsafe { core::ptr::read_volatile(share) } >= u64::from(PENDING_OVERFLOW_PER_CGROUP) {
        lost(&p);
        return;
    }
    atomic_add(share, 1);
    if PENDING_OVERFLOW.insert(tid, p, BPF_NOEXIST).is_err() {
        atomic_add(share, u64::MAX);
        lost(&p);
        return;
    }
    if let Some(n) = PENDING_OVERFLOWED.get_ptr_mut(0) {
        atomic_add(n, 1);
    }
    count(Counter::PendingOverflow);
}

/// A call whose record could not be kept: counted, and reported with a `Lost` record; its thread is marked,
/// so that its next traced syscall (or /proc) tells user space the call has returned.
#[inline(always)]
fn lost(p: &Pending) {
    count(Counter::PendingLost);
    emit_fd(
        RecordKind::Lost,
        p.fd,
        p.sys as i32,
        NO_INFO,
        p.arg,
        p.len,
        &[0; NAME_CAP],
    );
    await_confirm();
}

/// Takes the current thread's pending entry if it belongs to `sys`. The miss path, which every untraced
/// ioctl on the node takes: one array lookup and compare, and one array load.
#[inline(always)]
pub fn take_pending(tid: u32, sys: Sys) -> Option<Pending> {
    let slot = PENDING.get_ptr_mut(tid % PENDING_SLOTS)?;
    // SAFETY: as in `put_pending`: a slot whose `rec.tid` is this thread's is owned by it.
    unsafe {
        if (*slot).rec.tid == tid {
            let p = (*slot).rec;
            (*slot).rec.tid = 0;
            atomic_add(core::ptr::addr_of_mut!((*slot).claims), u64::MAX);
            return (p.sys == sys).then_some(p);
        }
    }
    if !overflow_in_use() {
        return None;
    }
    let p = take_overflow(tid)?;
    (p.sys == sys).then_some(p)
}

/// Removes the current thread's (`tid`) record from the overflow, if it has one there.
#[inline(always)]
fn take_overflow(tid: u32) -> Option<Pending> {
    // SAFETY: the value is copied out at once.
    let p = unsafe { PENDING_OVERFLOW.get(tid).copied() }?;
    if PENDING_OVERFLOW.remove(tid).is_ok() {
        if let Some(n) = PENDING_OVERFLOWED.get_ptr_mut(0) {
            atomic_add(n, u64::MAX);
        }
        if let Some(share) = PENDING_OVERFLOW_CG.get_ptr_mut(p.cg) {
            atomic_add(share, u64::MAX);
        }
    }
    Some(p)
}

/// Thread `tid` is exiting: whatever it left pending (a call whose exit never came) goes, so that a dead
/// thread holds no slot and no share of the overflow. Every task exit on the node pays an array lookup and an
/// array load.
#[inline(always)]
pub fn forget_pending(tid: u32) {
    if let Some(slot) = PENDING.get_ptr_mut(tid % PENDING_SLOTS) {
        // SAFETY: as in `take_pending`.
        unsafe {
            if (*slot).rec.tid == tid {
                (*slot).rec.tid = 0;
                atomic_add(core::ptr::addr_of_mut!((*slot).claims), u64::MAX);
            }
        }
    }
    if overflow_in_use() {
        let _ = take_overflow(tid);
    }
}
