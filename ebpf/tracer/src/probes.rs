//! Loading the embedded eBPF object, attaching its tracepoints (and, per libcuda file, its launch uprobes:
//! `launch`), and the typed handles on its maps.
//!
//! Programs and maps are owned by this process: they are detached and freed when the `Probes` value is dropped
//! or the process exits, so no cleanup command is needed.
mod launch;

use std::{
    fs,
    path::{Path, PathBuf},
};

use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap, MapData, PerCpuArray, RingBuf},
    programs::TracePoint,
};
use baton_probe_common::{
    COUNTER_SLOTS, Config, Counter, FdInfo, FdKey, PREFIX_CAP, PREFIX_SLOTS, Prefix, maps,
};

/// The probes, built by build.rs.
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/baton-probes"));

/// (program, tracepoint category, tracepoint name).
const TRACEPOINTS: &[(&str, &str, &str)] = &[
    ("sys_enter_openat", "syscalls", "sys_enter_openat"),
    ("sys_exit_openat", "syscalls", "sys_exit_openat"),
    ("sys_enter_openat2", "syscalls", "sys_enter_openat2"),
    ("sys_exit_openat2", "syscalls", "sys_exit_openat2"),
    ("sys_enter_open", "syscalls", "sys_enter_open"),
    ("sys_exit_open", "syscalls", "sys_exit_open"),
    ("sys_enter_close", "syscalls", "sys_enter_close"),
    ("sys_exit_close", "syscalls", "sys_exit_close"),
    ("sys_enter_close_range", "syscalls", "sys_enter_close_range"),
    ("sys_exit_close_range", "syscalls", "sys_exit_close_range"),
    ("sys_enter_dup", "syscalls", "sys_enter_dup"),
    ("sys_exit_dup", "syscalls", "sys_exit_dup"),
    ("sys_enter_dup2", "syscalls", "sys_enter_dup2"),
    ("sys_exit_dup2", "syscalls", "sys_exit_dup2"),
    ("sys_enter_dup3", "syscalls", "sys_enter_dup3"),
    ("sys_exit_dup3", "syscalls", "sys_exit_dup3"),
    ("sys_enter_fcntl", "syscalls", "sys_enter_fcntl"),
    ("sys_exit_fcntl", "syscalls", "sys_exit_fcntl"),
    ("sys_enter_mmap", "syscalls", "sys_enter_mmap"),
    ("sys_exit_mmap", "syscalls", "sys_exit_mmap"),
    ("sys_enter_munmap", "syscalls", "sys_enter_munmap"),
    ("sys_exit_munmap", "syscalls", "sys_exit_munmap"),
    ("sys_enter_mremap", "syscalls", "sys_enter_mremap"),
    ("sys_exit_mremap", "syscalls", "sys_exit_mremap"),
    ("sys_enter_madvise", "syscalls", "sys_enter_madvise"),
    ("sys_exit_madvise", "syscalls", "sys_exit_madvise"),
    ("sys_enter_ioctl", "syscalls", "sys_enter_ioctl"),
    ("sys_exit_ioctl", "syscalls", "sys_exit_ioctl"),
    ("task_newtask", "task", "task_newtask"),
    ("sched_process_exec", "sched", "sched_process_exec"),
    ("sched_process_exit", "sched", "sched_process_exit"),
];

const TRACEFS: &str = "/sys/kernel/tracing";

/// Why the probes could not be loaded; each message says what to do.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    /// Not root.
    #[error("needs root (loading eBPF programs needs CAP_BPF and CAP_PERFMON): run it with sudo")]
    NeedsRoot,
    /// tracefs is missing and could not be mounted.
    #[error(
        "tracefs is not mounted at {TRACEFS} and mounting it failed ({0}): mount -t tracefs nodev {TRACEFS}"
    )]
    NoTracefs(String),
    /// The kernel refused the object or a program.
    #[error("bpf() refused: {0}")]
    Refused(String),
    /// Attaching a tracepoint failed.
    #[error(
        "attaching tracepoint {category}:{name} failed: {detail} (does this kernel have syscall tracepoints? CONFIG_FTRACE_SYSCALLS)"
    )]
    Attach {
        /// Category.
        category: &'static str,
        /// Name.
        name: &'static str,
        /// The error.
        detail: String,
    },
    /// No launch uprobe could be attached to a library.
    #[error(
        "attaching the launch uprobes to {library} failed: {detail} (is it libcuda, with cuLaunchKernel in its dynamic symbol table?)"
    )]
    Uprobe {
        /// The library, as opened (through /proc/PID/root).
        library: PathBuf,
        /// Why, per entry point.
        detail: String,
    },
    /// A map is missing from the object (a build mismatch).
    #[error("map {0} missing from the embedded eBPF object: rebuild baton")]
    MissingMap(&'static str),
    /// A map operation failed.
    #[error("bpf map {map}: {detail}")]
    Map {
        /// Map name.
        map: &'static str,
        /// The error.
        detail: String,
    },
    /// A prefix is too long.
    #[error("device prefix {0:?} is longer than {PREFIX_CAP} bytes")]
    PrefixTooLong(String),
    /// Too many prefixes.
    #[error("at most {PREFIX_SLOTS} device prefixes can be traced")]
    TooManyPrefixes,
}

/// Settings of the probe set.
#[derive(Clone, Debug)]
pub struct ProbeConfig {
    /// Trace every process, whatever its cgroup.
    pub watch_all: bool,
    /// Device-directory prefixes (`/dev/`): opened paths made of a prefix and an NVIDIA device name are tracked.
    pub prefixes: Vec<String>,
    /// How many fds of one cgroup the probes follow (`Config::fd_quota`; 0: no bound).
    pub fd_quota: u32,
}

/// The loaded, attached probe set and its maps.
pub struct Probes {
    _ebpf: Ebpf,
    /// Watched cgroups.
    pub watched: HashMap<MapData, u64, u32>,
    /// NVIDIA fds per process.
    pub nv_fds: HashMap<MapData, FdKey, FdInfo>,
    /// Processes holding NVIDIA fds.
    pub nv_procs: HashMap<MapData, u32, u32>,
    /// Forked children whose inherited fds are not copied yet: child tgid -> parent tgid.
    pub forked: HashMap<MapData, u32, u32>,
    /// `NV_FDS` entries the probes made per cgroup (wrapping).
    pub cg_fds: HashMap<MapData, u64, u64>,
    /// `NV_FDS` entries user space made per cgroup (wrapping; written here only).
    pub cg_fds_user: HashMap<MapData, u64, u64>,
    /// Cgroups past their fd quota.
    pub cg_over: HashMap<MapData, u64, u32>,
    /// `NV_FDS` entries the probes made (index 0, wrapping) and user space made (index 1, written here only).
    pub nv_fds_used: Array<MapData, u64>,
    fd_quota: u32,
    /// Index 0 set while the consumer sleeps with no timer (see the ioctl probe's wakeup policy).
    pub consumer: Array<MapData, u32>,
    prefixes: Array<MapData, Prefix>,
    prefix_list: Vec<String>,
    counters: PerCpuArray<MapData, u64>,
    launches: launch::LaunchMap,
}

fn map_err(map: &'static str) -> impl Fn(aya::maps::MapError) -> ProbeError {
    move |e| ProbeError::Map {
        map,
        detail: e.to_string(),
    }
}

impl Probes {
    /// How many eBPF programs this probe set holds (all attached once `load` returned).
    pub fn programs(&self) -> usize {
        self._ebpf.programs().count()
    }

    /// Loads the object, fills its configuration and attaches every tracepoint; returns the probes and their
    /// record stream.
    pub fn load(cfg: &ProbeConfig) -> Result<(Self, RingBuf<MapData>), ProbeError> {
        if !nix::unistd::geteuid().is_root() {
            return Err(ProbeError::NeedsRoot);
        }
        ensure_tracefs()?;
        let mut ebpf = EbpfLoader::new()
            .load(OBJECT)
            .map_err(|e| ProbeError::Refused(error_chain(&e)))?;
        if cfg.prefixes.len() > PREFIX_SLOTS as usize {
            return Err(ProbeError::TooManyPrefixes);
        }
        write_config(&mut ebpf, cfg.watch_all, cfg.fd_quota)?;
        for &(prog, category, name) in TRACEPOINTS {
            attach_tracepoint(&mut ebpf, prog, category, name)?;
        }
        if switch_format_matches() {
            attach_tracepoint(&mut ebpf, "sched_switch", "sched", "sched_switch")?;
        } else {
            tracing::warn!(
                "sched:sched_switch has no 8-byte prev_state at offset 32 on this kernel: exits are \
                 confirmed from /proc only"
            );
        }
        let launches = launch::load(&mut ebpf)?;
        let mut take = |name: &'static str| ebpf.take_map(name).ok_or(ProbeError::MissingMap(name));
        let events = RingBuf::try_from(take(maps::EVENTS)?).map_err(map_err(maps::EVENTS))?;
        let watched = HashMap::try_from(take(maps::WATCHED)?).map_err(map_err(maps::WATCHED))?;
        let nv_fds = HashMap::try_from(take(maps::NV_FDS)?).map_err(map_err(maps::NV_FDS))?;
        let nv_procs = HashMap::try_from(take(maps::NV_PROCS)?).map_err(map_err(maps::NV_PROCS))?;
        let forked = HashMap::try_from(take(maps::FORKED)?).map_err(map_err(maps::FORKED))?;
        let cg_fds = HashMap::try_from(take(maps::CG_FDS)?).map_err(map_err(maps::CG_FDS))?;
        let cg_fds_user =
            HashMap::try_from(take(maps::CG_FDS_USER)?).map_err(map_err(maps::CG_FDS_USER))?;
        let cg_over = HashMap::try_from(take(maps::CG_OVER)?).map_err(map_err(maps::CG_OVER))?;
        let nv_fds_used =
            Array::try_from(take(maps::NV_FDS_USED)?).map_err(map_err(maps::NV_FDS_USED))?;
        let mut prefixes =
            Array::try_from(take(maps::PREFIXES)?).map_err(map_err(maps::PREFIXES))?;
        for (slot, p) in cfg.prefixes.iter().enumerate() {
            write_prefix(&mut prefixes, slot, p)?;
        }
        let consumer = Array::try_from(take(maps::CONSUMER)?).map_err(map_err(maps::CONSUMER))?;
        let counters =
            PerCpuArray::try_from(take(maps::COUNTERS)?).map_err(map_err(maps::COUNTERS))?;
        Ok((
            Self {
                _ebpf: ebpf,
                watched,
                nv_fds,
                nv_procs,
                forked,
                cg_fds,
                cg_fds_user,
                cg_over,
                nv_fds_used,
                fd_quota: cfg.fd_quota,
                consumer,
                prefixes,
                prefix_list: cfg.prefixes.clone(),
                counters,
                launches,
            },
            events,
        ))
    }

    /// Also follows opens under `prefix` (a device directory such as `/dev/`); a no-op when it is followed
    /// already. At most `PREFIX_SLOTS` prefixes.
    pub fn add_prefix(&mut self, prefix: &str) -> Result<(), ProbeError> {
        if self.prefix_list.iter().any(|p| p == prefix) {
            return Ok(());
        }
        if self.prefix_list.len() >= PREFIX_SLOTS as usize {
            return Err(ProbeError::TooManyPrefixes);
        }
        write_prefix(&mut self.prefixes, self.prefix_list.len(), prefix)?;
        self.prefix_list.push(prefix.to_owned());
        Ok(())
    }

    /// Stops following opens under `prefix`, freeing its slot; a no-op when it is not followed. The slots
    /// are rewritten in order so that every prefix kept is in some slot at every moment (an open under it
    /// is never missed while the others move down).
    pub fn remove_prefix(&mut self, prefix: &str) -> Result<(), ProbeError> {
        let Some(at) = self.prefix_list.iter().position(|p| p == prefix) else {
            return Ok(());
        };
        self.prefix_list.remove(at);
        for (slot, p) in self.prefix_list.iter().enumerate().skip(at) {
            write_prefix(&mut self.prefixes, slot, p)?;
        }
        write_prefix(&mut self.prefixes, self.prefix_list.len(), "")
    }

    /// Traces every process (`true`) or only the watched cgroups.
    pub fn set_watch_all(&mut self, on: bool) -> Result<(), ProbeError> {
        write_config(&mut self._ebpf, on, self.fd_quota)
    }

    /// How many fds of one cgroup the probes follow (0: no bound).
    pub fn fd_quota(&self) -> u32 {
        self.fd_quota
    }

    /// The device-directory prefixes followed.
    pub fn prefixes(&self) -> &[String] {
        &self.prefix_list
    }

    /// The sum over CPUs of a counter.
    pub fn counter(&self, c: Counter) -> u64 {
        debug_assert!((c as u32) < COUNTER_SLOTS);
        self.counters
            .get(&(c as u32), 0)
            .map(|v| v.iter().sum())
            .unwrap_or(0)
    }
}

/// Writes the probes' `CONFIG`: whether every process is traced, each cgroup's fd quota, and this kernel's
/// record layouts.
fn write_config(ebpf: &mut Ebpf, watch_all: bool, fd_quota: u32) -> Result<(), ProbeError> {
    let config = Config {
        watch_all: u32::from(watch_all),
        newtask_pid_offset: field_offset("task/task_newtask", " pid;"),
        newtask_flags_offset: field_offset("task/task_newtask", " clone_flags;"),
        exit_group_dead_offset: field_offset("sched/sched_process_exit", " group_dead;"),
        fd_quota,
    };
    let mut arr: Array<_, Config> = Array::try_from(
        ebpf.map_mut(maps::CONFIG)
            .ok_or(ProbeError::MissingMap(maps::CONFIG))?,
    )
    .map_err(map_err(maps::CONFIG))?;
    arr.set(0, config, 0).map_err(map_err(maps::CONFIG))?;
    Ok(())
}

/// Writes `prefix` into slot `slot` of `PREFIXES`.
fn write_prefix(
    arr: &mut Array<MapData, Prefix>,
    slot: usize,
    prefix: &str,
) -> Result<(), ProbeError> {
    if prefix.len() > PREFIX_CAP {
        return Err(ProbeError::PrefixTooLong(prefix.to_owned()));
    }
    let mut bytes = [0u8; PREFIX_CAP];
    bytes[..prefix.len()].copy_from_slice(prefix.as_bytes());
    arr.set(
        slot as u32,
        Prefix {
            len: prefix.len() as u32,
            bytes,
        },
        0,
    )
    .map_err(map_err(maps::PREFIXES))
}

/// Mounts tracefs if it is not mounted: aya finds tracepoint ids there.
fn ensure_tracefs() -> Result<(), ProbeError> {
    if Path::new(TRACEFS).join("events").is_dir()
        || Path::new("/sys/kernel/debug/tracing/events").is_dir()
    {
        return Ok(());
    }
    nix::mount::mount(
        Some("nodev"),
        TRACEFS,
        Some("tracefs"),
        nix::mount::MsFlags::empty(),
        None::<&str>,
    )
    .map_err(|e| ProbeError::NoTracefs(e.to_string()))
}

/// Offset of the field whose declaration ends with `field` (e.g. `" child_pid;"`) in this kernel's record of
/// tracepoint `event` (`sched/sched_process_fork`): layouts change across kernels (the fork record's
/// `child_pid` moved when its comm fields became `__data_loc` strings). 0 when it cannot be read, which the
/// probes take as "not available".
fn field_offset(event: &str, field: &str) -> u32 {
    field_layout(event, field).map_or(0, |(offset, _)| offset)
}

/// (offset, size) of a field of a tracepoint record, from tracefs.
fn field_layout(event: &str, field: &str) -> Option<(u32, u32)> {
    let format =
        fs::read_to_string(Path::new(TRACEFS).join("events").join(event).join("format")).ok()?;
    let line = format.lines().find(|l| l.contains(field))?;
    let get = |key: &str| -> Option<u32> {
        line.split(';')
            .find_map(|f| f.trim().strip_prefix(key))
            .and_then(|o| o.parse().ok())
    };
    Some((get("offset:")?, get("size:")?))
}

/// Whether `sched:sched_switch` has its `prev_state` where the probe reads it (8 bytes at offset 32).
fn switch_format_matches() -> bool {
    field_layout("sched/sched_switch", " prev_state;") == Some((32, 8))
}

fn attach_tracepoint(
    ebpf: &mut Ebpf,
    prog: &str,
    category: &'static str,
    name: &'static str,
) -> Result<(), ProbeError> {
    let p: &mut TracePoint = ebpf
        .program_mut(prog)
        .ok_or_else(|| ProbeError::Refused(format!("program {prog} missing from the object")))?
        .try_into()
        .map_err(|e: aya::programs::ProgramError| ProbeError::Refused(e.to_string()))?;
    p.load()
        .map_err(|e| ProbeError::Refused(format!("loading {prog}: {}", error_chain(&e))))?;
    p.attach(category, name).map_err(|e| ProbeError::Attach {
        category,
        name,
        detail: error_chain(&e),
    })?;
    Ok(())
}

/// An error with its sources, one line (aya keeps the verifier log in the source chain).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    if !Path::new("/sys/kernel/btf/vmlinux").exists() {
        s.push_str(" (this kernel has no BTF at /sys/kernel/btf/vmlinux: build it with CONFIG_DEBUG_INFO_BTF=y)");
    }
    if s.contains("Operation not permitted") {
        s.push_str(" (needs root with CAP_BPF/CAP_SYS_ADMIN; is kernel.unprivileged_bpf_disabled or lockdown in the way?)");
    }
    s
}
