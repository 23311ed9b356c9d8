//! The event schema shared by the kernel-side probes (`baton-probes`) and user space (`baton-tracer`):
//! the `#[repr(C)]` records sent through the ring buffer and the keys and values of the probes' maps.
//!
//! This is the one definition of that schema. Both sides compile this file; the records are plain old data
//! with explicit padding so that their layout is the same on the BPF target and on the host.
#![no_std]

/// Bytes of an ioctl's parameter struct captured at syscall exit (`_IOC_SIZE` or the UVM size, clamped).
pub const DATA_CAP: usize = 256;
/// Bytes captured behind the one nested pointer that matters (alloc params, control params, XFER inner params).
pub const NESTED_CAP: usize = 256;
/// Longest device-directory prefix the probes match in open paths (e.g. `/dev/`).
pub const PREFIX_CAP: usize = 64;
/// Number of device-directory prefixes the probes compare an opened path against.
pub const PREFIX_SLOTS: u32 = 4;
/// Bytes of an opened path the probes look at: a prefix plus the device file's name.
pub const PATH_CAP: usize = 96;
/// Bytes of the device file's name kept in an open record (`nvidiactl`, `nvidia-uvm-tools`, ...).
pub const NAME_CAP: usize = 24;

/// Names of the maps in the eBPF object, used by user space to find them.
pub mod maps {
    /// Ring buffer of records for user space.
    pub const EVENTS: &str = "EVENTS";
    /// `FdKey` -> `FdInfo`: the NVIDIA device fds of each process.
    pub const NV_FDS: &str = "NV_FDS";
    /// tgid -> u32: processes holding NVIDIA fds or mappings (munmap, fork, exec and exit are reported for them).
    pub const NV_PROCS: &str = "NV_PROCS";
    /// child tgid -> parent tgid: processes forked by an NVIDIA fd holder whose inherited fds user space has
    /// not copied into `NV_FDS` yet; their lookups fall back to the parent's entries meanwhile.
    pub const FORKED: &str = "FORKED";
    /// cgroup v2 id -> u32: the watched cgroups.
    pub const WATCHED: &str = "WATCHED";
    /// index -> `Prefix`: device-directory prefixes matched in open paths.
    pub const PREFIXES: &str = "PREFIXES";
    /// index 0 -> `Config`.
    pub const CONFIG: &str = "CONFIG";
    /// Per-CPU counters, indexed by `Counter`.
    pub const COUNTERS: &str = "COUNTERS";
    /// tid -> CLOCK_MONOTONIC ns: threads that removed NVIDIA state (close, dup over, munmap, exec, exit) and
    /// whose return to user space or death (past the deferred final release) is still to be reported.
    pub const AWAIT_CONFIRM: &str = "AWAIT_CONFIRM";
    /// index 0 -> u32: non-zero while the consumer sleeps with no timer, so the next ioctl record must wake
    /// it (the probe clears it); see the probes' wakeup policy.
    pub const CONSUMER: &str = "CONSUMER";
    /// cgroup v2 id -> `LaunchCounts`, per CPU: CUDA launches counted by the libcuda uprobes.
    pub const LAUNCHES: &str = "LAUNCHES";
    /// cgroup v2 id -> u64: `NV_FDS` entries the probes made for processes of that cgroup, less those they
    /// removed (added to atomically, wrapping: a removal of an entry user space made counts here too). With
    /// `CG_FDS_USER` it is the cgroup's share of `NV_FDS`, which `Config::fd_quota` bounds.
    pub const CG_FDS: &str = "CG_FDS";
    /// cgroup v2 id -> u64: `NV_FDS` entries user space made for processes of that cgroup (seeds, inherited
    /// fds), less those it removed (an exit's, whoever made them); wrapping. Written by user space only.
    pub const CG_FDS_USER: &str = "CG_FDS_USER";
    /// cgroup v2 id -> u32: cgroups that reached `Config::fd_quota` (or found `NV_FDS` full): their later
    /// fds are not followed by the probes, so user space follows them through /proc.
    pub const CG_OVER: &str = "CG_OVER";
    /// index 0 -> u64: `NV_FDS` entries the probes made, less those they removed (atomic, wrapping); index 1:
    /// those user space made, less those it removed (written by user space only). Their sum is how full the
    /// map is, which [`NV_FDS_RESERVE`](super::NV_FDS_RESERVE) is judged against.
    pub const NV_FDS_USED: &str = "NV_FDS_USED";
}

/// Per-CPU counters kept by the probes.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counter {
    /// Records dropped because the ring buffer was full.
    RingbufDrops = 0,
    /// Parameter reads from user memory that failed.
    ReadFailures = 1,
    /// Calls whose enter could not keep their record for their exit: another thread's call held their
    /// `PENDING` slot and the overflow had no room for them (or for their cgroup). Each sends a
    /// `RecordKind::Lost` record, which user space makes up for from /proc.
    PendingLost = 2,
    /// Removals whose thread could not be put in `AWAIT_CONFIRM` (map full): user space confirms them from
    /// /proc instead.
    ConfirmMapFull = 3,
    /// NVIDIA fds not followed because their cgroup had `Config::fd_quota` entries in `NV_FDS` already.
    FdQuotaRefused = 4,
    /// NVIDIA fds not followed because `NV_FDS` was full, or its shared part was ([`NV_FDS_RESERVE`]) and
    /// their cgroup had its [`NV_FDS_BASE`] already.
    FdMapFull = 5,
    /// Calls whose `PENDING` slot another thread's call held: their record waited in the overflow map
    /// instead (nothing lost).
    PendingOverflow = 6,
}

/// Number of `Counter` slots.
pub const COUNTER_SLOTS: u32 = 7;

/// Records the probes' `PENDING_OVERFLOW` holds for the node: calls in flight whose slot (`tid % 65536`)
/// another thread's call held when they began.
pub const PENDING_OVERFLOW_ENTRIES: u32 = 16384;

/// Records of one cgroup `PENDING_OVERFLOW` takes at most, so that one tenant's colliding threads cannot take
/// the room another's need; a call past it is lost (`Counter::PendingLost`, a `Lost` record).
pub const PENDING_OVERFLOW_PER_CGROUP: u32 = PENDING_OVERFLOW_ENTRIES / 16;

/// Entries `NV_FDS` holds for the whole node.
pub const NV_FDS_ENTRIES: u32 = 131_072;

/// Entries of `NV_FDS` kept for the first [`NV_FDS_BASE`] fds of each cgroup: a cgroup past its base gets no
/// more once the map holds `NV_FDS_ENTRIES - NV_FDS_RESERVE`, so the containers of one tenant, each at its
/// quota, cannot take the entries another container needs to be followed at all.
pub const NV_FDS_RESERVE: u32 = NV_FDS_ENTRIES / 4;

/// How many of a cgroup's fds may come out of [`NV_FDS_RESERVE`]: a CUDA process holds 31 NVIDIA fds with one
/// GPU (../shared/gpu/580.159.04/README.md), so a container of a process and a dozen forked workers fits.
/// The reserve holds the base of 64 containers whatever the others took.
pub const NV_FDS_BASE: u32 = 512;

/// Whether a cgroup that has `cgroup_entries` entries in `NV_FDS` may add one more while the map holds
/// `map_entries` (the probes and user space both judge by this rule): within its [`NV_FDS_BASE`], while the
/// map has room; past it, while the shared part (all but [`NV_FDS_RESERVE`]) has room.
pub const fn fd_entry_allowed(map_entries: u64, cgroup_entries: u64) -> bool {
    let limit = if cgroup_entries < NV_FDS_BASE as u64 {
        NV_FDS_ENTRIES
    } else {
        NV_FDS_ENTRIES - NV_FDS_RESERVE
    };
    map_entries < limit as u64
}

/// The default of `Config::fd_quota`: how many `NV_FDS` entries one cgroup may take (a CUDA process opens a
/// few dozen device files; 32 such processes fit with room to spare), so that 16 containers at their quota
/// are needed to fill the map.
pub const DEFAULT_FD_QUOTA: u32 = NV_FDS_ENTRIES / 16;

/// Why a thread's removal of NVIDIA state is known to be complete (`aux` of a `Confirm` record).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConfirmReason {
    /// The thread entered its next traced syscall: it returned to user space, so it ran its task work, where the
    /// kernel runs the final release of the files it dropped.
    Returned = 1,
    /// The thread is dead (switched out for the last time): past `exit_task_work`, where an exiting thread
    /// runs the release of its files.
    Exited = 2,
}

/// What a record describes; the first field of every record.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordKind {
    /// An ioctl on an NVIDIA fd (`IoctlRecord`).
    Ioctl = 1,
    /// An NVIDIA device file was opened (`FdRecord`, name set).
    Open = 2,
    /// An NVIDIA fd was closed (`FdRecord`).
    Close = 3,
    /// An NVIDIA fd was duplicated: `fd` is the new fd, `aux` the old one (`FdRecord`).
    Dup = 4,
    /// An NVIDIA fd was mapped: `addr`/`len` is the mapping (`FdRecord`).
    Mmap = 5,
    /// A process holding NVIDIA fds unmapped `addr`/`len` (`FdRecord`, fd = -1).
    Munmap = 6,
    /// A process holding NVIDIA fds called exec (`FdRecord`).
    Exec = 7,
    /// A thread of a process holding NVIDIA fds exited; `aux` is 1 when it was the last one, so the process
    /// is gone (`FdRecord`).
    Exit = 8,
    /// A process holding NVIDIA fds forked a new process (threads are not reported): `aux` is the child's
    /// pid (`FdRecord`).
    Fork = 9,
    /// A thread that removed NVIDIA state is past the kernel's deferred release: `aux` is a
    /// `ConfirmReason`, `addr` the time it was marked (`FdRecord`).
    Confirm = 10,
    /// A process holding NVIDIA fds closed the fds `addr..=len` with `close_range` (`FdRecord`, fd = -1,
    /// `aux` the flags; never sent for `CLOSE_RANGE_CLOEXEC`, which closes nothing).
    CloseRange = 11,
    /// A holder's `mmap(MAP_FIXED)` (without `MAP_FIXED_NOREPLACE`) of anything replaced whatever was mapped
    /// at `addr`/`len` (`FdRecord`, fd the new mapping's fd or -1, `aux` the mmap flags): the kernel unmapped
    /// that range first, as munmap would. An NVIDIA mapping made by the same call follows as `Mmap`.
    MapFixed = 12,
    /// A holder's `mremap` succeeded (`MapRecord`): the range moved, shrank or grew.
    Mremap = 13,
    /// A holder's `madvise(MADV_DONTFORK | MADV_DOFORK)` succeeded (`FdRecord`, `addr`/`len` the range,
    /// `aux` the advice): whether a fork copies those mappings to the child.
    Madvise = 14,
    /// A traced call's enter could not keep its record for the exit (`Counter::PendingLost`): what the call
    /// does is unknown (`FdRecord`, sent at its enter: `aux` the call's [`Sys`], `fd` its fd or -1). The
    /// thread is marked for confirmation like a removal, so user space learns when the call has returned.
    Lost = 15,
}

impl RecordKind {
    /// The kind for a raw value read from a record, if it is one.
    pub const fn from_u32(v: u32) -> Option<Self> {
        Some(match v {
            1 => Self::Ioctl,
            2 => Self::Open,
            3 => Self::Close,
            4 => Self::Dup,
            5 => Self::Mmap,
            6 => Self::Munmap,
            7 => Self::Exec,
            8 => Self::Exit,
            9 => Self::Fork,
            10 => Self::Confirm,
            11 => Self::CloseRange,
            12 => Self::MapFixed,
            13 => Self::Mremap,
            14 => Self::Madvise,
            15 => Self::Lost,
            _ => return None,
        })
    }
}

/// Fields every record starts with.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Header {
    /// A `RecordKind` value.
    pub kind: u32,
    /// Thread group id (the pid user space sees).
    pub pid: u32,
    /// Thread id.
    pub tid: u32,
    /// cgroup v2 id of the calling task.
    pub cgroup_id_lo: u32,
    /// cgroup v2 id, high half (split to keep the header free of padding).
    pub cgroup_id_hi: u32,
    /// Explicit padding.
    pub _pad: u32,
    /// CLOCK_MONOTONIC time of the syscall's exit (or of the event), ns.
    pub ts_ns: u64,
}

impl Header {
    /// The cgroup v2 id.
    pub const fn cgroup_id(&self) -> u64 {
        ((self.cgroup_id_hi as u64) << 32) | self.cgroup_id_lo as u64
    }
}

/// An ioctl on an NVIDIA fd, captured at syscall exit.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct IoctlRecord {
    /// Common fields.
    pub hdr: Header,
    /// The fd.
    pub fd: i32,
    /// The ioctl command.
    pub cmd: u32,
    /// `baton_nvidia::fdkind::FdKind` of the fd.
    pub fd_kind: u8,
    /// Device minor for `nvidiaN`.
    pub minor: u8,
    /// Explicit padding.
    pub _pad: [u8; 2],
    /// Valid bytes in `data`.
    pub data_len: u16,
    /// Valid bytes in `nested`.
    pub nested_len: u16,
    /// The syscall's return value.
    pub ret: i64,
    /// The argument pointer.
    pub arg: u64,
    /// Time from syscall enter to exit, ns.
    pub latency_ns: u64,
    /// What the call named when it entered the kernel, before the driver copied its params in (read for the
    /// escapes that allocate or free only: `nr` 0 otherwise).
    pub enter: EnterReading,
    /// The parameter struct at `arg`, read at exit.
    pub data: [u8; DATA_CAP],
    /// The params behind the nested pointer that matters for this call.
    pub nested: [u8; NESTED_CAP],
}

/// The identity of an RM allocation or free as its params said at `sys_enter_ioctl`, before the driver's
/// copy-in: a thread of the caller can rewrite the params between the driver's copy-out and the exit's read,
/// so user space compares this reading with the exit's and keeps the one that holds more (an allocation
/// under both handles, the larger size; a free only when both agree). Read for
/// `baton_nvidia::escape::read_at_enter` escapes, through IOCTL_XFER_CMD too; the fields are raw: what they
/// mean depends on `nr` (`baton_nvidia::decode::op_at_enter` turns them into an operation).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EnterReading {
    /// The escape whose params were read (the inner one of an IOCTL_XFER_CMD); 0: nothing was read.
    pub nr: u32,
    /// Bytes of the params struct read (fields past them read as 0).
    pub len: u32,
    /// hRoot.
    pub client: u32,
    /// hObjectParent.
    pub parent: u32,
    /// hObjectNew (allocations), hObjectOld (RM_FREE), hMemory (RM_VID_HEAP_CONTROL).
    pub object: u32,
    /// hClass (allocations), the function (RM_VID_HEAP_CONTROL).
    pub class: u32,
    /// The size: NV_MEMORY_ALLOCATION_PARAMS.size behind an RM_ALLOC of a memory class, NVOS02's limit,
    /// NVOS32's AllocSize.size; 0 when none.
    pub size: u64,
    /// Whether `size` was read (an RM_ALLOC's nested params can fail to read on their own).
    pub size_read: u32,
    /// Explicit padding.
    pub _pad: u32,
}

impl EnterReading {
    /// Nothing read.
    pub const NONE: Self = Self {
        nr: 0,
        len: 0,
        client: 0,
        parent: 0,
        object: 0,
        class: 0,
        size: 0,
        size_read: 0,
        _pad: 0,
    };
}

/// A change to the set of NVIDIA fds or mappings of a process.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct FdRecord {
    /// Common fields.
    pub hdr: Header,
    /// The fd concerned (-1 when none).
    pub fd: i32,
    /// Kind-specific: old fd for `Dup`, child pid for `Fork`, 1 for an `Exit` of the whole process (0: one
    /// thread of it), a `ConfirmReason` for `Confirm`.
    pub aux: i32,
    /// `FdKind` of the fd (Open, Dup).
    pub fd_kind: u8,
    /// Device minor (Open, Dup).
    pub minor: u8,
    /// Explicit padding.
    pub _pad: [u8; 6],
    /// Mapping address (Mmap, Munmap); when the thread was marked (Confirm); first fd (CloseRange).
    pub addr: u64,
    /// Mapping length (Mmap, Munmap; file offset is not needed); last fd (CloseRange).
    pub len: u64,
    /// Device file name for `Open`, NUL padded.
    pub name: [u8; NAME_CAP],
}

/// A holder's successful `mremap` (`RecordKind::Mremap`).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MapRecord {
    /// Common fields.
    pub hdr: Header,
    /// The range remapped: start.
    pub old_addr: u64,
    /// The range remapped: length (0: a shared mapping duplicated, the old one stays).
    pub old_len: u64,
    /// Where it is now (the syscall's return value).
    pub new_addr: u64,
    /// Its new length.
    pub new_len: u64,
    /// mremap flags (`MREMAP_MAYMOVE` 1, `MREMAP_FIXED` 2, `MREMAP_DONTUNMAP` 4).
    pub flags: u32,
    /// Explicit padding.
    pub _pad: u32,
}

/// Which syscall a call in flight (the probes' `PENDING`) belongs to; also `aux` of a `Lost` record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Sys {
    /// ioctl on an NVIDIA fd.
    Ioctl = 1,
    /// open, openat, openat2 of an NVIDIA device file.
    Open = 2,
    /// dup, dup2, dup3, fcntl(F_DUPFD*) of (or onto) an NVIDIA fd.
    Dup = 3,
    /// mmap of an NVIDIA fd, or a holder's MAP_FIXED mmap.
    Mmap = 4,
    /// close of an NVIDIA fd.
    Close = 5,
    /// A holder's munmap.
    Munmap = 6,
    /// A holder's close_range.
    CloseRange = 7,
    /// A holder's mremap.
    Mremap = 8,
    /// A holder's madvise(MADV_DONTFORK | MADV_DOFORK).
    Madvise = 9,
}

impl Sys {
    /// The call for a raw value read from a record, if it is one.
    pub const fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Self::Ioctl,
            2 => Self::Open,
            3 => Self::Dup,
            4 => Self::Mmap,
            5 => Self::Close,
            6 => Self::Munmap,
            7 => Self::CloseRange,
            8 => Self::Mremap,
            9 => Self::Madvise,
            _ => return None,
        })
    }

    /// The syscall's name, as traces show it.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Ioctl => "ioctl",
            Self::Open => "open",
            Self::Dup => "dup",
            Self::Mmap => "mmap",
            Self::Close => "close",
            Self::Munmap => "munmap",
            Self::CloseRange => "close_range",
            Self::Mremap => "mremap",
            Self::Madvise => "madvise",
        }
    }
}

/// Key of `NV_FDS`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FdKey {
    /// Thread group id.
    pub tgid: u32,
    /// File descriptor.
    pub fd: u32,
}

/// Value of `NV_FDS`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FdInfo {
    /// `FdKind` value.
    pub kind: u8,
    /// Device minor for `nvidiaN`.
    pub minor: u8,
    /// Explicit padding.
    pub _pad: [u8; 2],
}

impl FdInfo {
    /// The entry a forked child leaves for an inherited fd it closed before user space copied its parent's
    /// table (see `FORKED`): it stops that copy from bringing the fd back. Lookups treat it as absent; real
    /// entries never have kind 0 (`FdKind::Unknown`).
    pub const CLOSED: Self = Self {
        kind: 0,
        minor: 0,
        _pad: [0; 2],
    };

    /// Whether this is [`FdInfo::CLOSED`].
    pub const fn is_closed(&self) -> bool {
        self.kind == 0
    }
}

/// A device-directory prefix (`PREFIXES` value): an opened path that starts with it and continues with an
/// NVIDIA device name is tracked.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Prefix {
    /// Bytes in use in `bytes` (0 = slot unused).
    pub len: u32,
    /// The prefix, e.g. `/dev/`.
    pub bytes: [u8; PREFIX_CAP],
}

/// Global settings (`CONFIG[0]`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Config {
    /// Non-zero: every process is traced, whatever its cgroup.
    pub watch_all: u32,
    /// Offset of `pid` (the new task's) in this kernel's `task:task_newtask` record (read from tracefs by
    /// user space: layouts change across kernels); 0 turns fork reporting off.
    pub newtask_pid_offset: u32,
    /// Offset of `clone_flags` (8 bytes) in `task:task_newtask`: `CLONE_THREAD` tells a thread from a child.
    pub newtask_flags_offset: u32,
    /// Offset of `group_dead` in `sched:sched_process_exit` (0: this kernel has none; the leader's exit is
    /// then taken for the process's).
    pub exit_group_dead_offset: u32,
    /// How many `NV_FDS` entries the processes of one cgroup may have (0: no bound); past it the probes do not
    /// follow that cgroup's new fds and mark it in `CG_OVER`.
    pub fd_quota: u32,
}

/// The libcuda entry points whose calls the launch uprobes count.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LaunchFn {
    /// `cuLaunchKernel`.
    Kernel = 0,
    /// `cuLaunchKernelEx`.
    KernelEx = 1,
    /// `cuGraphLaunch`.
    Graph = 2,
}

impl LaunchFn {
    /// Every counted entry point.
    pub const ALL: [Self; 3] = [Self::Kernel, Self::KernelEx, Self::Graph];

    /// The symbol in libcuda's dynamic symbol table (and the uprobe program's name is its snake case).
    pub const fn symbol(self) -> &'static str {
        match self {
            Self::Kernel => "cuLaunchKernel",
            Self::KernelEx => "cuLaunchKernelEx",
            Self::Graph => "cuGraphLaunch",
        }
    }

    /// The name of the uprobe program that counts this entry point (`baton-probes`, `launch.rs`).
    pub const fn program(self) -> &'static str {
        match self {
            Self::Kernel => "cu_launch_kernel",
            Self::KernelEx => "cu_launch_kernel_ex",
            Self::Graph => "cu_graph_launch",
        }
    }
}

/// CUDA launches of one container (a `LAUNCHES` value; per CPU in the map, summed by user space): cumulative
/// since the probe set was loaded, or since the container was watched again after being unwatched.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "user", derive(serde::Serialize, serde::Deserialize))]
pub struct LaunchCounts {
    /// Calls of `cuLaunchKernel`.
    pub kernel: u64,
    /// Calls of `cuLaunchKernelEx`.
    pub kernel_ex: u64,
    /// Calls of `cuGraphLaunch` (one per graph, whatever its kernels).
    pub graph: u64,
}

impl LaunchCounts {
    /// The counter of `f`.
    pub fn get_mut(&mut self, f: LaunchFn) -> &mut u64 {
        match f {
            LaunchFn::Kernel => &mut self.kernel,
            LaunchFn::KernelEx => &mut self.kernel_ex,
            LaunchFn::Graph => &mut self.graph,
        }
    }

    /// The count of `f`.
    pub const fn get(&self, f: LaunchFn) -> u64 {
        match f {
            LaunchFn::Kernel => self.kernel,
            LaunchFn::KernelEx => self.kernel_ex,
            LaunchFn::Graph => self.graph,
        }
    }

    /// Launches of every kind.
    pub const fn total(&self) -> u64 {
        self.kernel + self.kernel_ex + self.graph
    }

    /// The counts of both, added (summing per-CPU values, or per-window deltas).
    pub const fn plus(&self, other: &Self) -> Self {
        Self {
            kernel: self.kernel.wrapping_add(other.kernel),
            kernel_ex: self.kernel_ex.wrapping_add(other.kernel_ex),
            graph: self.graph.wrapping_add(other.graph),
        }
    }

    /// What was launched since `earlier` (an older reading of the same counters; a counter that restarted
    /// counts from zero).
    pub const fn since(&self, earlier: &Self) -> Self {
        const fn delta(now: u64, then: u64) -> u64 {
            if now >= then { now - then } else { now }
        }
        Self {
            kernel: delta(self.kernel, earlier.kernel),
            kernel_ex: delta(self.kernel_ex, earlier.kernel_ex),
            graph: delta(self.graph, earlier.graph),
        }
    }
}

#[cfg(feature = "user")]
mod pod {
    //! `aya::Pod` for the types user space reads from or writes to the maps.
    use super::{Config, FdInfo, FdKey, LaunchCounts, Prefix};
    // SAFETY: plain #[repr(C)] integers with explicit padding: every bit pattern is valid.
    unsafe impl aya::Pod for FdKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for FdInfo {}
    // SAFETY: as above.
    unsafe impl aya::Pod for Prefix {}
    // SAFETY: as above.
    unsafe impl aya::Pod for Config {}
    // SAFETY: as above.
    unsafe impl aya::Pod for LaunchCounts {}
}
