//! The [`Tracer`]: probes, record stream, fd mirror, ledgers and the cgroup index, kept consistent.
mod apply;
mod inherit;
mod quota;
mod resync;
mod wait;

pub use resync::{ReadTicket, ReconciledReads};
pub use wait::now_monotonic_ns;

use std::{
    collections::{HashMap, HashSet},
    path::{Path, PathBuf},
};

use aya::maps::{MapData, RingBuf};
use baton_nvidia::layout::{DriverVersion, Layout};
use baton_probe_common::{Counter, LaunchCounts};
use tokio::io::unix::AsyncFd;

use crate::{
    cgroups::{self, CgroupError, CgroupIndex},
    fdtable::FdTable,
    launch::{self, LaunchLibraries, LaunchLibrary},
    ledger::Ledger,
    probes::{ProbeConfig, ProbeError, Probes},
    release::{Confirmation, Releases},
    seed,
};

/// Settings of a tracer.
#[derive(Clone, Debug)]
pub struct TracerConfig {
    /// Trace every process.
    pub watch_all: bool,
    /// Device-directory prefixes (default `/dev/`).
    pub prefixes: Vec<String>,
    /// The cgroup v2 root; found from /proc/self/mountinfo when `None`.
    pub cgroup_root: Option<PathBuf>,
    /// Driver version whose struct layouts decode the calls; the host's, else the default, when `None`.
    pub driver_version: Option<DriverVersion>,
    /// How often the consumer drains ioctl records, which do not wake it each, while they flow; when a drain
    /// finds none it sleeps with no timer until a record wakes it (see the probes' wakeup policy).
    pub poll_interval: std::time::Duration,
    /// How many NVIDIA fds of one cgroup the probes follow (0: no bound); past it that cgroup is followed
    /// through /proc (see `quota`).
    pub fd_quota: u32,
}

impl Default for TracerConfig {
    fn default() -> Self {
        Self {
            watch_all: false,
            prefixes: vec!["/dev/".to_owned()],
            cgroup_root: None,
            driver_version: None,
            poll_interval: std::time::Duration::from_millis(1),
            fd_quota: baton_probe_common::DEFAULT_FD_QUOTA,
        }
    }
}

/// Errors of the tracer.
#[derive(Debug, thiserror::Error)]
pub enum TracerError {
    /// The probes could not be loaded.
    #[error(transparent)]
    Probes(#[from] ProbeError),
    /// cgroup trouble.
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    /// The ring buffer could not be polled.
    #[error("polling the eBPF ring buffer: {0}")]
    Poll(std::io::Error),
    /// /proc could not be listed.
    #[error(
        "listing /proc: {0}: the tracer reads every process's /proc to follow what they already hold \
         (run it as root, with /proc mounted)"
    )]
    ListProc(std::io::Error),
    /// A kernel map update failed.
    #[error("updating bpf map {map} for pid {pid}: {detail}")]
    MapUpdate {
        /// The map.
        map: &'static str,
        /// The process concerned.
        pid: u32,
        /// The error.
        detail: String,
    },
}

/// `bpf_map_update_elem` flag: only add, keep an entry that is there.
const BPF_NOEXIST: u64 = 1;

/// What a container holds in the driver right now, for release detection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuState {
    /// Live RM objects (clients and handles included).
    pub live_objects: usize,
    /// Live RM objects that hold GPU state (memory, address spaces, channels, contexts: not handles).
    pub state_objects: usize,
    /// Bytes of live video memory.
    pub vram_bytes: u64,
    /// Open NVIDIA fds across the container's processes.
    pub open_fds: usize,
    /// NVIDIA device mapping ranges across the container's processes.
    pub mappings: usize,
    /// Open files of the container whose identity and contents the records never showed (read from /proc):
    /// each may carry GPU state.
    pub opaque_files: usize,
    /// GPUs registered with UVM through the container's open UVM files.
    pub uvm_gpus: i64,
    /// Threads of the container whose removal of NVIDIA state the kernel has not finished (see
    /// `crate::release`).
    pub unconfirmed: usize,
}

impl GpuState {
    /// Whether the GPU holds state of the container: a live object that is more than a handle, a GPU
    /// registered with UVM, or an open file whose contents are unknown. Open files that carry none of these
    /// (a forked worker's inherited fds, the reservations a park leaves) do not count. Kernel facts only:
    /// the objects are those the driver answered NV_OK for, freed by an RM_FREE it answered NV_OK for or by
    /// the final release of the file they live on; nothing a process writes into its parameters afterwards
    /// changes them.
    pub fn holds_state(&self) -> bool {
        self.state_objects > 0 || self.uvm_gpus > 0 || self.opaque_files > 0
    }

    /// Whether anything of the container is left in the driver: GPU state, a live object (a handle
    /// included), an open NVIDIA fd or mapping, or a removal the kernel has not finished.
    pub fn holds_anything(&self) -> bool {
        self.holds_state() || self.live_objects > 0 || self.has_files() || self.unconfirmed > 0
    }

    /// Whether a process of the container has an NVIDIA fd or mapping open now.
    pub fn has_files(&self) -> bool {
        self.open_fds > 0 || self.mappings > 0
    }
}

/// Probes plus the user-space state derived from their records.
pub struct Tracer {
    probes: Probes,
    ring: AsyncFd<RingBuf<MapData>>,
    fds: FdTable,
    ledger: Ledger,
    cgroups: CgroupIndex,
    layout: Layout,
    watch_all: bool,
    names: HashMap<u64, String>,
    poll_interval: std::time::Duration,
    releases: Releases,
    /// Fires when the next /proc check of an awaiting removal is due.
    check_timer: AsyncFd<wait::CheckTimer>,
    /// The deadline `check_timer` is armed for (`None`: disarmed).
    check_armed_for: Option<u64>,
    /// Whether the probes were told that this consumer sleeps with no timer (see `wait`).
    consumer_sleeping: bool,
    /// Watched cgroups (the kernel map's keys), for a resync.
    watched: HashSet<u64>,
    /// Ring-buffer drops already resynced.
    drops_seen: u64,
    resyncs: u64,
    /// libcuda files the launch uprobes are attached to.
    launch_libs: LaunchLibraries,
    /// Fds refused for a quota or a full map, as last looked at (see `quota`).
    quota_refusals_seen: u64,
    /// Cgroups already reported past their quota.
    over_reported: HashSet<u64>,
    /// The processes whose fds or mappings changed in the mirror, with the [`Tracer::change_seq`] of their
    /// last change, while a /proc read made off the consumer's thread may be compared with the mirror (see
    /// `resync`); cleared when none is.
    proc_changes: HashMap<u32, u64>,
    /// Counts the changes to the mirror's fds and mappings.
    change_seq: u64,
    /// Tickets of /proc reads handed out and not handed back.
    reads_in_flight: usize,
    /// Which tracer of this process this is (a ticket of another one is refused).
    instance: u64,
    /// Threads inside a call whose record the probes lost (`Body::Lost`), with their (pid, cgroup): the
    /// process is read again from /proc once the thread is confirmed past the call.
    lost_calls: HashMap<u32, (u32, u64)>,
    /// Processes to read again from /proc once the ring is drained: a call of theirs whose record was lost
    /// has returned.
    lost_reseeds: std::collections::BTreeSet<u32>,
}

/// `pids` in the order they started (a parent before its children); one whose start cannot be read last.
fn by_start_time(pids: impl IntoIterator<Item = u32>) -> Vec<u32> {
    let mut pids: Vec<(Option<u64>, u32)> = pids
        .into_iter()
        .map(|pid| (cgroups::start_ticks(pid), pid))
        .collect();
    pids.sort_by_key(|(start, pid)| (start.is_none(), *start, *pid));
    pids.into_iter().map(|(_, pid)| pid).collect()
}

/// Numbers the tracers of this process.
static INSTANCES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

impl Tracer {
    /// Loads and attaches the probes. Must be called inside a tokio runtime.
    pub fn start(cfg: TracerConfig) -> Result<Self, TracerError> {
        let root = match cfg.cgroup_root {
            Some(r) => r,
            None => cgroups::find_v2_root()?,
        };
        let version = cfg
            .driver_version
            .or_else(baton_nvidia::layout::host_driver_version);
        let layout = version.map(Layout::for_version).unwrap_or(Layout::DEFAULT);
        let (probes, events) = Probes::load(&ProbeConfig {
            watch_all: cfg.watch_all,
            prefixes: cfg.prefixes.clone(),
            fd_quota: cfg.fd_quota,
        })?;
        // SAFETY: the ring buffer owns its map fd, which stays open and unchanged until the RingBuf (and so
        // the AsyncFd holding it) is dropped.
        let ring = unsafe { AsyncFd::register(events) }
            .map_err(|e| TracerError::Poll(e.into_parts().1))?;
        let check_timer = wait::CheckTimer::new().map_err(TracerError::Poll)?;
        let mut t = Self {
            probes,
            ring,
            fds: FdTable::default(),
            ledger: Ledger::default(),
            cgroups: CgroupIndex::new(root),
            layout,
            watch_all: cfg.watch_all,
            names: HashMap::new(),
            poll_interval: cfg.poll_interval,
            releases: Releases::default(),
            check_timer,
            check_armed_for: None,
            consumer_sleeping: false,
            watched: HashSet::new(),
            drops_seen: 0,
            resyncs: 0,
            launch_libs: LaunchLibraries::default(),
            quota_refusals_seen: 0,
            over_reported: HashSet::new(),
            proc_changes: HashMap::new(),
            change_seq: 0,
            reads_in_flight: 0,
            instance: INSTANCES.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            lost_calls: HashMap::new(),
            lost_reseeds: std::collections::BTreeSet::new(),
        };
        if t.watch_all {
            for pid in seed::all_pids().map_err(TracerError::ListProc)? {
                t.seed_pid(pid)?;
            }
        }
        Ok(t)
    }

    /// The cgroup v2 root.
    pub fn cgroup_root(&self) -> &Path {
        self.cgroups.root()
    }

    /// Mutable access to the cgroup index (resolving `--container` and `--cgroup`).
    pub fn cgroups_mut(&mut self) -> &mut CgroupIndex {
        &mut self.cgroups
    }

    /// Starts tracing cgroup `id` and seeds the fds its processes already hold (within its fd quota: past
    /// it the cgroup is followed through /proc); on an error nothing of it stays watched.
    pub fn watch_cgroup(&mut self, id: u64) -> Result<(), TracerError> {
        self.probes
            .watched
            .insert(id, 1, 0)
            .map_err(|e| TracerError::MapUpdate {
                map: "WATCHED",
                pid: 0,
                detail: e.to_string(),
            })?;
        self.watched.insert(id);
        // Parents before their children, so that a child's inherited files are found in its parent's.
        let pids = by_start_time(self.cgroup_pids(id));
        for pid in pids {
            if let Err(e) = self.seed_pid(pid) {
                // Rolled back: a cgroup half watched would look followed while it is not.
                self.unwatch_cgroup(id);
                return Err(e);
            }
        }
        Ok(())
    }

    /// The processes of watched cgroup `id` now.
    fn cgroup_pids(&mut self, id: u64) -> Vec<u32> {
        let Some(path) = self.cgroups.path_of(id).map(str::to_owned) else {
            return Vec::new();
        };
        let procs = self
            .cgroups
            .root()
            .join(path.trim_start_matches('/'))
            .join("cgroup.procs");
        std::fs::read_to_string(procs)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }

    /// The folder of watched cgroup `id` under the v2 mount, when its path is known.
    pub fn cgroup_dir(&mut self, id: u64) -> Option<PathBuf> {
        let path = self.cgroups.path_of(id)?.to_owned();
        Some(self.cgroups.root().join(path.trim_start_matches('/')))
    }

    /// Stops tracing cgroup `id` (fds already followed stay followed until closed).
    pub fn unwatch_cgroup(&mut self, id: u64) {
        let _ = self.probes.watched.remove(&id);
        self.forget_cgroup_quota(id);
        self.watched.remove(&id);
        self.releases.forget_cgroup(id);
        self.lost_calls.retain(|_, (_, cg)| *cg != id);
        self.probes.forget_launches(id);
    }

    /// Seeds one process's fds and mappings from /proc into the kernel map and the mirror (as opaque files:
    /// the records never showed what they carry).
    fn seed_pid(&mut self, pid: u32) -> Result<(), TracerError> {
        self.reseed_pid(pid).map(drop)
    }

    /// Attaches the launch uprobes to every libcuda file process `pid` maps that is not probed yet (opened
    /// through its `/proc/PID/map_files` and checked against its maps entry, once per file); returns how many
    /// files it probed now. The tracer calls it when a traced process opens an NVIDIA device and when it
    /// seeds one from /proc; a caller that knows a process of a watched container loaded libcuda later can
    /// call it too. A file that cannot be probed is logged and not tried again.
    pub fn probe_launches_of(&mut self, pid: u32) -> usize {
        let files = launch::libcuda_files(pid);
        if files.is_empty() {
            return 0;
        }
        self.launch_libs.saw_pid(pid);
        let mut probed = 0;
        for lib in files {
            if self.launch_libs.known(lib.id) {
                continue;
            }
            match self.probes.attach_launch_probes(&lib.file, &lib.path) {
                Ok(fns) => {
                    tracing::debug!(pid, library = %lib.path.display(), "launch uprobes attached");
                    probed += 1;
                    self.launch_libs.add(LaunchLibrary {
                        path: lib.path,
                        pid,
                        dev: lib.id.0,
                        ino: lib.id.1,
                        probed: fns,
                    });
                }
                Err(e) => {
                    tracing::warn!("{e}: launches through it are not counted");
                    self.launch_libs.add_failed(lib.id);
                }
            }
        }
        probed
    }

    /// CUDA launches counted for container `cgroup_id` (cumulative: take deltas for a window) by the
    /// uprobes on the libcuda files of watched containers' processes. Launches made before its libcuda was
    /// probed (between a process's first NVIDIA open and the tracer handling it) are not counted.
    pub fn launches(&self, cgroup_id: u64) -> LaunchCounts {
        self.probes.launch_counts(cgroup_id)
    }

    /// Every container with counted launches, and its counts.
    pub fn all_launches(&self) -> Vec<(u64, LaunchCounts)> {
        self.probes.all_launch_counts()
    }

    /// The libcuda files the launch uprobes are attached to.
    pub fn launch_libraries(&self) -> impl Iterator<Item = &LaunchLibrary> {
        self.launch_libs.iter()
    }

    /// The ledgers.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// The fd mirror.
    pub fn fd_table(&self) -> &FdTable {
        &self.fds
    }

    /// What container `cgroup_id` holds in the driver now.
    pub fn gpu_state(&self, cgroup_id: u64) -> GpuState {
        let (mut open_fds, mut mappings) = (0, 0);
        for (_, p) in self.fds.iter().filter(|(_, p)| p.cgroup_id == cgroup_id) {
            open_fds += p.fds.len();
            mappings += p.maps.len();
        }
        let (mut opaque_files, mut uvm_gpus) = (0, 0);
        for (_, f) in self
            .fds
            .files()
            .iter()
            .filter(|(_, f)| f.cgroup_id == cgroup_id)
        {
            opaque_files += usize::from(f.opaque);
            uvm_gpus += f.uvm_gpus;
        }
        let l = self.ledger.container(cgroup_id);
        GpuState {
            live_objects: l.map_or(0, |l| l.live_objects()),
            state_objects: l.map_or(0, |l| l.state_objects()),
            vram_bytes: l.map_or(0, |l| l.vram_bytes()),
            open_fds,
            mappings,
            opaque_files,
            uvm_gpus,
            unconfirmed: self.releases.unconfirmed(cgroup_id),
        }
    }

    /// When container `cgroup_id` last removed NVIDIA state (the record's time), and the confirmation that
    /// last completed one of its removals.
    pub fn release_times(&self, cgroup_id: u64) -> (Option<u64>, Option<Confirmation>) {
        (
            self.releases.last_removal_ns(cgroup_id),
            self.releases.last_confirmation(cgroup_id),
        )
    }

    /// Calls whose record the probes could not keep (their in-flight slot was another thread's and the
    /// overflow was full: see the probes' `pending.rs`); each made its container partial and its process
    /// read again from /proc.
    pub fn pending_lost(&self) -> u64 {
        self.probes.counter(Counter::PendingLost)
    }

    /// Calls whose in-flight slot another thread's call held, kept in the overflow instead (nothing lost).
    pub fn pending_overflowed(&self) -> u64 {
        self.probes.counter(Counter::PendingOverflow)
    }

    /// Removals confirmed from /proc rather than by a probe.
    pub fn confirmed_by_proc(&self) -> u64 {
        self.releases.confirmed_by_proc()
    }

    /// Times the mirror was rebuilt from /proc after records were lost.
    pub fn resyncs(&self) -> u64 {
        self.resyncs
    }

    /// Traces every process on the node (`true`, seeding what they hold from /proc) or only the watched
    /// cgroups again (processes already followed stay followed until they let go).
    pub fn set_watch_all(&mut self, on: bool) -> Result<(), TracerError> {
        if on == self.watch_all {
            return Ok(());
        }
        self.probes.set_watch_all(on)?;
        self.watch_all = on;
        if on {
            for pid in seed::all_pids().map_err(TracerError::ListProc)? {
                self.seed_pid(pid)?;
            }
        }
        Ok(())
    }

    /// Also follows opens of NVIDIA device files under `prefix` (a device directory such as `/dev/`).
    pub fn add_prefix(&mut self, prefix: &str) -> Result<(), TracerError> {
        Ok(self.probes.add_prefix(prefix)?)
    }

    /// Stops following opens under `prefix` (freeing one of the probe set's few prefix slots).
    pub fn remove_prefix(&mut self, prefix: &str) -> Result<(), TracerError> {
        Ok(self.probes.remove_prefix(prefix)?)
    }

    /// The device-directory prefixes followed now.
    pub fn prefixes(&self) -> &[String] {
        self.probes.prefixes()
    }

    /// eBPF programs attached by this tracer.
    pub fn programs_attached(&self) -> usize {
        self.probes.programs()
    }

    /// Records dropped because the ring buffer was full.
    pub fn dropped(&self) -> u64 {
        self.probes.counter(Counter::RingbufDrops)
    }

    /// Failed reads of call parameters from user memory.
    pub fn read_failures(&self) -> u64 {
        self.probes.counter(Counter::ReadFailures)
    }

    /// The container name of a cgroup (cached).
    pub fn container_name(&mut self, cgroup_id: u64) -> String {
        if let Some(n) = self.names.get(&cgroup_id) {
            return n.clone();
        }
        let name = match self.cgroups.path_of(cgroup_id) {
            Some(p) => cgroups::container_name(p),
            None => format!("cgroup:{cgroup_id}"),
        };
        self.names.insert(cgroup_id, name.clone());
        name
    }
}
