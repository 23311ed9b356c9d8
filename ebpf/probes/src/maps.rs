//! The probes' maps and the per-thread state kept between a syscall's enter and exit.
use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, PerCpuArray, RingBuf},
};
use baton_probe_common::{COUNTER_SLOTS, Config, FdInfo, FdKey, PREFIX_SLOTS, Prefix};

/// Records for user space. 16 MiB holds ~25k ioctl records.
#[map(name = "EVENTS")]
pub static EVENTS: RingBuf = RingBuf::with_byte_size(16 << 20, 0);

/// NVIDIA device fds of each process.
#[map(name = "NV_FDS")]
pub static NV_FDS: HashMap<FdKey, FdInfo> = HashMap::with_max_entries(65536, 0);

/// Processes that hold NVIDIA fds or mappings.
#[map(name = "NV_PROCS")]
pub static NV_PROCS: HashMap<u32, u32> = HashMap::with_max_entries(16384, 0);

/// Children of NVIDIA fd holders whose inherited fds user space has not copied yet: child tgid -> parent tgid
/// (`baton_probe_common::maps::FORKED`). Written at fork, removed by user space once it has copied the
/// parent's table into `NV_FDS`, so it only holds the forks of the last moments.
#[map(name = "FORKED")]
pub static FORKED: HashMap<u32, u32> = HashMap::with_max_entries(4096, 0);

/// Watched cgroup v2 ids.
#[map(name = "WATCHED")]
pub static WATCHED: HashMap<u64, u32> = HashMap::with_max_entries(16384, 0);

/// Device-directory prefixes.
#[map(name = "PREFIXES")]
pub static PREFIXES: Array<Prefix> = Array::with_max_entries(PREFIX_SLOTS, 0);

/// Global settings.
#[map(name = "CONFIG")]
pub static CONFIG: Array<Config> = Array::with_max_entries(1, 0);

/// Threads that removed NVIDIA state and whose passage past the kernel's deferred release is still to be
/// reported: tid -> CLOCK_MONOTONIC ns of the mark (see `confirm.rs`).
#[map(name = "AWAIT_CONFIRM")]
pub static AWAIT_CONFIRM: HashMap<u32, u64> = HashMap::with_max_entries(16384, 0);

/// Index 0: how many threads `AWAIT_CONFIRM` holds, so that the syscall-entry check skips its hash lookup
/// while none is marked (nearly always).
#[map(name = "AWAITING")]
pub static AWAITING: Array<u64> = Array::with_max_entries(1, 0);

/// Index 0: non-zero while user space waits with no timer; the next ioctl record wakes it and clears this
/// (`baton_probe_common::maps::CONSUMER`).
#[map(name = "CONSUMER")]
pub static CONSUMER: Array<u32> = Array::with_max_entries(1, 0);

/// Drop and failure counters.
#[map(name = "COUNTERS")]
pub static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(COUNTER_SLOTS, 0);

/// How many generations of not-yet-copied forks a lookup follows (a child forked by a child being copied).
const INHERIT_DEPTH: usize = 4;

/// The NVIDIA fd `fd` of process `tgid`, if it is one: its `NV_FDS` entry, or, while user space has not copied
/// the table of a freshly forked child yet, the entry it inherited from its parent (`FORKED`). Every untraced
/// fd on the node pays the `FORKED` lookup of a miss, a hash lookup in a map that is empty almost always.
#[inline(always)]
pub fn nv_fd(tgid: u32, fd: u32) -> Option<FdInfo> {
    // SAFETY: the value is copied out at once.
    if let Some(info) = unsafe { NV_FDS.get(FdKey { tgid, fd }).copied() } {
        return (!info.is_closed()).then_some(info);
    }
    let mut owner = tgid;
    for _ in 0..INHERIT_DEPTH {
        // SAFETY: as above.
        owner = unsafe { FORKED.get(owner).copied() }?;
        // SAFETY: as above.
        if let Some(info) = unsafe { NV_FDS.get(FdKey { tgid: owner, fd }).copied() } {
            return (!info.is_closed()).then_some(info);
        }
    }
    None
}

/// `tgid` no longer has fd `fd` as an NVIDIA fd. A child whose table is still to be copied keeps a
/// [`FdInfo::CLOSED`] entry instead, which the copy does not overwrite.
#[inline(always)]
pub fn forget_fd(tgid: u32, fd: u32) {
    let key = FdKey { tgid, fd };
    // SAFETY: presence check only.
    if unsafe { FORKED.get(tgid).is_some() } {
        let _ = NV_FDS.insert(key, FdInfo::CLOSED, 0);
    } else {
        let _ = NV_FDS.remove(key);
    }
}

/// Which syscall a pending entry belongs to.
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Sys {
    Ioctl = 1,
    Open = 2,
    Dup = 3,
    Mmap = 4,
    Close = 5,
    Munmap = 6,
    CloseRange = 7,
    Mremap = 8,
    Madvise = 9,
}

/// What a thread's syscall enter left for its exit.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Pending {
    pub ts_ns: u64,
    pub arg: u64,
    pub len: u64,
    /// A third argument (mremap's new length).
    pub arg2: u64,
    pub cmd: u32,
    pub fd: i32,
    pub sys: Sys,
    pub kind: u8,
    pub minor: u8,
    pub flags: u8,
    /// The thread that owns the slot (0: free).
    pub tid: u32,
    pub name: [u8; baton_probe_common::NAME_CAP],
}

/// Slots for the syscalls in flight, indexed by `tid % PENDING_SLOTS` (a thread is in one syscall at a time).
/// An array, not a hash map: its lookups are inlined by the verifier and need no locking or allocation,
/// which matters because every ioctl on the node pays the exit-side lookup. Two threads whose tids share a
/// slot and are inside traced calls at the same moment collide: the later one takes the slot, the older
/// call's record is lost, and the eviction is counted (`Counter::PendingEvicted`, shown in `baton status`).
/// Two such threads on two CPUs may even write the slot at once; the owner tid is checked again at exit,
/// which catches the collision in all but a torn write, whose record then decodes as garbage, never as an
/// out-of-bounds access (the slot is plain data of fixed size).
#[map(name = "PENDING")]
pub static PENDING: Array<Pending> = Array::with_max_entries(PENDING_SLOTS, 0);

/// Slots in `PENDING`.
pub const PENDING_SLOTS: u32 = 65536;

/// Remembers the current thread's syscall `p` until its exit.
#[inline(always)]
pub fn put_pending(tid: u32, mut p: Pending) {
    if let Some(slot) = PENDING.get_ptr_mut(tid % PENDING_SLOTS) {
        p.tid = tid;
        // SAFETY: `slot` points at a live, fixed-size array element; another thread sharing the slot may write
        // it concurrently (see PENDING), which can tear the plain-data contents but cannot make an access go
        // out of bounds.
        unsafe {
            if (*slot).tid != 0 && (*slot).tid != tid {
                crate::util::count(baton_probe_common::Counter::PendingEvicted);
            }
            *slot = p;
        }
    }
}

/// Takes the current thread's pending entry if it belongs to `sys`.
#[inline(always)]
pub fn take_pending(tid: u32, sys: Sys) -> Option<Pending> {
    let slot = PENDING.get_ptr_mut(tid % PENDING_SLOTS)?;
    // SAFETY: as in `put_pending`; the entry is copied out and its owner cleared. A torn copy is possible
    // only in the collision `PENDING` describes.
    unsafe {
        if (*slot).tid != tid || (*slot).sys != sys {
            return None;
        }
        (*slot).tid = 0;
        Some(*slot)
    }
}

/// Scratch space for an opened path (too big for comfort on the 512-byte stack).
#[map(name = "PATH_BUF")]
pub static PATH_BUF: PerCpuArray<[u8; baton_probe_common::PATH_CAP]> =
    PerCpuArray::with_max_entries(1, 0);
