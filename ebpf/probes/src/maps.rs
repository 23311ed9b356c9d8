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

/// Watched cgroup v2 ids.
#[map(name = "WATCHED")]
pub static WATCHED: HashMap<u64, u32> = HashMap::with_max_entries(16384, 0);

/// Device-directory prefixes.
#[map(name = "PREFIXES")]
pub static PREFIXES: Array<Prefix> = Array::with_max_entries(PREFIX_SLOTS, 0);

/// Global settings.
#[map(name = "CONFIG")]
pub static CONFIG: Array<Config> = Array::with_max_entries(1, 0);

/// Drop and failure counters.
#[map(name = "COUNTERS")]
pub static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(COUNTER_SLOTS, 0);

/// Which syscall a pending entry belongs to.
#[derive(Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Sys {
    Ioctl = 1,
    Open = 2,
    Dup = 3,
    Mmap = 4,
}

/// What a thread's syscall enter left for its exit.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Pending {
    pub ts_ns: u64,
    pub arg: u64,
    pub len: u64,
    pub cmd: u32,
    pub fd: i32,
    pub sys: Sys,
    pub kind: u8,
    pub minor: u8,
    pub flags: u8,
    pub name: [u8; baton_probe_common::NAME_CAP],
}

/// tid -> the syscall in flight (a thread is in one syscall at a time).
#[map(name = "PENDING")]
pub static PENDING: HashMap<u32, Pending> = HashMap::with_max_entries(65536, 0);

/// Scratch space for an opened path (too big for comfort on the 512-byte stack).
#[map(name = "PATH_BUF")]
pub static PATH_BUF: PerCpuArray<[u8; baton_probe_common::PATH_CAP]> =
    PerCpuArray::with_max_entries(1, 0);
