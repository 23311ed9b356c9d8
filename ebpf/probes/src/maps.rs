//! The probes' maps and the per-thread state kept between a syscall's enter and exit.
use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap, PerCpuArray, RingBuf},
};
use baton_probe_common::{
    COUNTER_SLOTS, Config, Counter, FdInfo, FdKey, NV_FDS_ENTRIES, PREFIX_SLOTS, Prefix,
    fd_entry_allowed,
};
use core::intrinsics::AtomicOrdering;

use crate::util::{cgroup_id, count};

/// Records for user space. 16 MiB holds ~25k ioctl records.
#[map(name = "EVENTS")]
pub static EVENTS: RingBuf = RingBuf::with_byte_size(16 << 20, 0);

/// NVIDIA device fds of each process. Each cgroup may take `Config::fd_quota` of them (see [`track_fd`]).
#[map(name = "NV_FDS")]
pub static NV_FDS: HashMap<FdKey, FdInfo> = HashMap::with_max_entries(NV_FDS_ENTRIES, 0);

/// Index 0: `NV_FDS` entries made here, less those removed here (atomic, wrapping); index 1: user space's
/// (`baton_probe_common::maps::NV_FDS_USED`).
#[map(name = "NV_FDS_USED")]
pub static NV_FDS_USED: Array<u64> = Array::with_max_entries(2, 0);

/// `NV_FDS` entries made here per cgroup (`baton_probe_common::maps::CG_FDS`).
#[map(name = "CG_FDS")]
pub static CG_FDS: HashMap<u64, u64> = HashMap::with_max_entries(16384, 0);

/// `NV_FDS` entries user space made per cgroup (`baton_probe_common::maps::CG_FDS_USER`); read here only.
#[map(name = "CG_FDS_USER")]
pub static CG_FDS_USER: HashMap<u64, u64> = HashMap::with_max_entries(16384, 0);

/// Cgroups past their quota (`baton_probe_common::maps::CG_OVER`).
#[map(name = "CG_OVER")]
pub static CG_OVER: HashMap<u64, u32> = HashMap::with_max_entries(16384, 0);

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
/// [`FdInfo::CLOSED`] entry instead, which the copy does not overwrite; like every `CLOSED` entry it counts
/// in no share (user space removes it uncounted).
#[inline(always)]
pub fn forget_fd(tgid: u32, fd: u32) {
    let key = FdKey { tgid, fd };
    // SAFETY: presence check only.
    if unsafe { FORKED.get(tgid).is_some() } {
        // SAFETY: the value is copied out at once.
        let had = unsafe { NV_FDS.get(key).copied() }.is_some_and(|i| !i.is_closed());
        if NV_FDS.insert(key, FdInfo::CLOSED, 0).is_ok() && had {
            count_entry(cgroup_id(), u64::MAX);
        }
    } else if NV_FDS.remove(key).is_ok() {
        count_entry(cgroup_id(), u64::MAX);
    }
}

/// Adds `delta` (wrapping: `u64::MAX` takes one away) to cgroup `cg`'s count in `CG_FDS` and to the node's
/// in `NV_FDS_USED`.
#[inline(always)]
fn count_entry(cg: u64, delta: u64) {
    add_cgroup_fds(cg, delta);
    if let Some(n) = NV_FDS_USED.get_ptr_mut(0) {
        // SAFETY: a live, aligned map value, added to atomically as in `add_cgroup_fds`.
        unsafe { core::intrinsics::atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(n, delta) };
    }
}

/// Adds `delta` (wrapping: `u64::MAX` takes one away) to cgroup `cg`'s count in `CG_FDS`.
#[inline(always)]
fn add_cgroup_fds(cg: u64, delta: u64) {
    if let Some(n) = CG_FDS.get_ptr_mut(cg) {
        // SAFETY: a live, aligned map value; an atomic add because several CPUs update it at once (see
        // `confirm::add_awaiting`).
        unsafe { core::intrinsics::atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(n, delta) };
    }
}

/// Entries in `NV_FDS` now, by both sides' counts.
#[inline(always)]
fn map_entries() -> u64 {
    let side = |i: u32| {
        NV_FDS_USED
            .get_ptr_mut(i)
            // SAFETY: a live, aligned array element; an aligned 8-byte load is one instruction.
            .map_or(0, |n| unsafe { core::ptr::read_volatile(n) })
    };
    let n = side(0).wrapping_add(side(1));
    // Counts that went below zero for a moment (a removal counted before its add): empty.
    if (n as i64) < 0 { 0 } else { n }
}

/// `BPF_NOEXIST`: only add.
const BPF_NOEXIST: u64 = 1;

/// Puts NVIDIA fd `fd` of `tgid` in `NV_FDS` if the current cgroup is within its quota and the map has room
/// for it (an entry already there is replaced, which takes no more room). Returns whether the fd is
/// followed. A cgroup at its quota, or past its base with the map's shared part full
/// (`baton_probe_common::fd_entry_allowed`), or finding the map full, gets nothing more and is marked in
/// `CG_OVER` (user space then follows it through /proc): one tenant cannot take the map, and so the probes,
/// from the others, however many containers it runs.
#[inline(always)]
pub fn track_fd(tgid: u32, fd: u32, info: FdInfo) -> bool {
    let key = FdKey { tgid, fd };
    // SAFETY: presence check only.
    if unsafe { NV_FDS.get(key).is_some() } {
        return NV_FDS.insert(key, info, 0).is_ok();
    }
    let cg = cgroup_id();
    let quota = CONFIG.get(0).map_or(0, |c| c.fd_quota);
    // SAFETY: the values are copied out at once.
    let mine = unsafe { CG_FDS.get(cg).copied() };
    // SAFETY: as above.
    let theirs = unsafe { CG_FDS_USER.get(cg).copied() }.unwrap_or(0);
    let used = mine.unwrap_or(0).wrapping_add(theirs) as i64;
    if quota != 0 && used >= i64::from(quota) {
        count(Counter::FdQuotaRefused);
        let _ = CG_OVER.insert(cg, 1, BPF_NOEXIST);
        return false;
    }
    if !fd_entry_allowed(map_entries(), used.max(0) as u64) {
        count(Counter::FdMapFull);
        let _ = CG_OVER.insert(cg, 1, BPF_NOEXIST);
        return false;
    }
    if mine.is_none() {
        let _ = CG_FDS.insert(cg, 0, BPF_NOEXIST);
    }
    count_entry(cg, 1);
    if NV_FDS.insert(key, info, 0).is_err() {
        count_entry(cg, u64::MAX);
        count(Counter::FdMapFull);
        let _ = CG_OVER.insert(cg, 1, BPF_NOEXIST);
        return false;
    }
    true
}

/// Scratch space for an opened path (too big for comfort on the 512-byte stack).
#[map(name = "PATH_BUF")]
pub static PATH_BUF: PerCpuArray<[u8; baton_probe_common::PATH_CAP]> =
    PerCpuArray::with_max_entries(1, 0);
