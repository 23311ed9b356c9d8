//! The [`Tracer`]: probes, record stream, fd mirror, ledgers and the cgroup index, kept consistent.
use std::{
    collections::HashMap,
    path::{Path, PathBuf},
};

use aya::maps::{MapData, RingBuf};
use baton_nvidia::layout::{DriverVersion, Layout};
use baton_probe_common::{Counter, FdInfo, FdKey};
use tokio::io::unix::AsyncFd;

use crate::{
    cgroups::{self, CgroupError, CgroupIndex},
    event::{self, Body, Event},
    fdtable::{FdTable, NvFd},
    ledger::Ledger,
    probes::{ProbeConfig, ProbeError, Probes},
    seed::{self, Found},
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
    /// How often the consumer looks for ioctl records that did not wake it (see the probes' wakeup policy).
    pub poll_interval: std::time::Duration,
}

impl Default for TracerConfig {
    fn default() -> Self {
        Self {
            watch_all: false,
            prefixes: vec!["/dev/".to_owned()],
            cgroup_root: None,
            driver_version: None,
            poll_interval: std::time::Duration::from_millis(1),
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

/// What a container holds in the driver right now, for release detection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuState {
    /// Live RM objects.
    pub live_objects: usize,
    /// Bytes of live video memory.
    pub vram_bytes: u64,
    /// Open NVIDIA fds across the container's processes.
    pub open_fds: usize,
    /// NVIDIA device mappings across the container's processes.
    pub mappings: usize,
}

impl GpuState {
    /// Whether anything of the container is still on, or pinned in, the driver.
    pub fn holds_gpu(&self) -> bool {
        self.live_objects > 0 || self.open_fds > 0 || self.mappings > 0
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
    prefixes: Vec<String>,
    watch_all: bool,
    names: HashMap<u64, String>,
    poll_interval: std::time::Duration,
}

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
        })?;
        // SAFETY: the ring buffer owns its map fd, which stays open and unchanged until the RingBuf (and so
        // the AsyncFd holding it) is dropped.
        let ring = unsafe { AsyncFd::register(events) }
            .map_err(|e| TracerError::Poll(e.into_parts().1))?;
        let mut t = Self {
            probes,
            ring,
            fds: FdTable::default(),
            ledger: Ledger::default(),
            cgroups: CgroupIndex::new(root),
            layout,
            prefixes: cfg.prefixes,
            watch_all: cfg.watch_all,
            names: HashMap::new(),
            poll_interval: cfg.poll_interval,
        };
        if t.watch_all {
            for pid in seed::all_pids() {
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

    /// Starts tracing cgroup `id` and seeds the fds its processes already hold.
    pub fn watch_cgroup(&mut self, id: u64) -> Result<(), TracerError> {
        self.probes
            .watched
            .insert(id, 1, 0)
            .map_err(|e| TracerError::MapUpdate {
                map: "WATCHED",
                pid: 0,
                detail: e.to_string(),
            })?;
        let Some(path) = self.cgroups.path_of(id).map(str::to_owned) else {
            return Ok(());
        };
        let procs = self
            .cgroups
            .root()
            .join(path.trim_start_matches('/'))
            .join("cgroup.procs");
        let pids: Vec<i32> = std::fs::read_to_string(procs)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect();
        for pid in pids {
            self.seed_pid(pid)?;
        }
        Ok(())
    }

    /// Stops tracing cgroup `id` (fds already followed stay followed until closed).
    pub fn unwatch_cgroup(&mut self, id: u64) {
        let _ = self.probes.watched.remove(&id);
    }

    /// Seeds one process's fds and mappings from /proc into the kernel map and the mirror.
    fn seed_pid(&mut self, pid: i32) -> Result<(), TracerError> {
        let found = seed::scan_process(pid, &self.prefixes);
        if found.is_empty() {
            return Ok(());
        }
        let tgid = pid as u32;
        let cg = cgroups::cgroup_id_of_pid(self.cgroups.root(), pid).unwrap_or(0);
        for f in found {
            match f {
                Found::Fd { fd, nv, .. } => {
                    self.kernel_track(tgid, fd, nv)?;
                    self.fds.add_fd(tgid, cg, fd, nv);
                }
                Found::Map { addr, len } => self.fds.add_map(tgid, cg, addr, len),
            }
        }
        self.ledger.container_mut(cg).partial = true;
        Ok(())
    }

    fn kernel_track(&mut self, tgid: u32, fd: i32, nv: NvFd) -> Result<(), TracerError> {
        let key = FdKey {
            tgid,
            fd: fd as u32,
        };
        let info = FdInfo {
            kind: nv.kind as u8,
            minor: nv.minor,
            _pad: [0; 2],
        };
        let err = |map| {
            move |e: aya::maps::MapError| TracerError::MapUpdate {
                map,
                pid: tgid,
                detail: e.to_string(),
            }
        };
        self.probes
            .nv_fds
            .insert(key, info, 0)
            .map_err(err("NV_FDS"))?;
        self.probes
            .nv_procs
            .insert(tgid, 1, 0)
            .map_err(err("NV_PROCS"))
    }

    fn kernel_forget(&mut self, tgid: u32, fd: i32) {
        let _ = self.probes.nv_fds.remove(&FdKey {
            tgid,
            fd: fd as u32,
        });
    }

    /// Waits for records and returns the next batch of events, applied to the mirror and the ledgers.
    /// Records that do not parse are counted in [`Tracer::unparsed`] and skipped.
    pub async fn next_events(&mut self) -> Result<Vec<Event>, TracerError> {
        loop {
            // The probes wake us for fd lifecycle records and once ioctl records pile up; the timer picks up
            // the rest, so an ioctl waits at most about one poll interval.
            let mut guard =
                match tokio::time::timeout(self.poll_interval, self.ring.readable_mut()).await {
                    Ok(ready) => ready.map_err(TracerError::Poll)?,
                    Err(_) => {
                        let batch = self.drain_now()?;
                        if batch.is_empty() {
                            continue;
                        }
                        return Ok(batch);
                    }
                };
            let mut out = Vec::new();
            {
                let ring = guard.get_inner_mut();
                while let Some(item) = ring.next() {
                    match event::parse(&item, &self.layout) {
                        Ok(e) => out.push(e),
                        Err(e) => tracing::debug!("skipping record: {e}"),
                    }
                    if out.len() >= 4096 {
                        break;
                    }
                }
            }
            if out.is_empty() {
                guard.clear_ready();
                continue;
            }
            return self.apply_all(out);
        }
    }

    /// Non-blocking: every event already in the ring buffer.
    pub fn drain_now(&mut self) -> Result<Vec<Event>, TracerError> {
        let mut out = Vec::new();
        {
            let ring = self.ring.get_mut();
            while let Some(item) = ring.next() {
                if let Ok(e) = event::parse(&item, &self.layout) {
                    out.push(e);
                }
            }
        }
        self.apply_all(out)
    }

    fn apply_all(&mut self, events: Vec<Event>) -> Result<Vec<Event>, TracerError> {
        let mut kept = Vec::with_capacity(events.len());
        for e in events {
            if self.apply(&e)? {
                kept.push(e);
            }
        }
        Ok(kept)
    }

    /// Applies one event to the mirror, the kernel maps and the ledgers. Returns false for events that turn
    /// out not to concern NVIDIA state (an munmap of an ordinary mapping by a holder), which callers drop.
    fn apply(&mut self, e: &Event) -> Result<bool, TracerError> {
        let (pid, cg) = (e.pid, e.cgroup_id);
        match &e.body {
            Body::Ioctl(io) => {
                if io.ret == 0 {
                    self.ledger
                        .container_mut(cg)
                        .apply(pid, &io.decoded.op, io.decoded.status);
                }
            }
            Body::Open {
                fd, kind, minor, ..
            }
            | Body::Dup {
                fd, kind, minor, ..
            } => {
                self.fds.add_fd(
                    pid,
                    cg,
                    *fd,
                    NvFd {
                        kind: *kind,
                        minor: *minor,
                    },
                );
            }
            Body::Close { fd } => {
                self.fds.remove_fd(pid, *fd);
                self.release_if_unpinned(pid, cg);
            }
            Body::Mmap { addr, len, .. } => self.fds.add_map(pid, cg, *addr, *len),
            Body::Munmap { addr, len } => {
                if self.fds.unmap(pid, *addr, *len) == 0 {
                    return Ok(false);
                }
                self.release_if_unpinned(pid, cg);
            }
            Body::Fork { child } => self.fork(pid, *child)?,
            Body::Exec => {
                let still_open = |fd: i32| {
                    std::fs::read_link(format!("/proc/{pid}/fd/{fd}"))
                        .is_ok_and(|p| seed::classify_path(&p, &self.prefixes).is_some())
                };
                let closed = self.fds.exec(pid, &still_open);
                for fd in closed {
                    self.kernel_forget(pid, fd);
                }
                self.release_if_unpinned(pid, cg);
            }
            Body::Exit => {
                if let Some(p) = self.fds.exit(pid) {
                    for fd in p.fds.keys() {
                        self.kernel_forget(pid, *fd);
                    }
                }
                self.ledger.container_mut(cg).release_process(pid);
            }
        }
        Ok(true)
    }

    /// A holder forked: unless the child is a thread, it inherits the fds, copied into the kernel map here.
    ///
    /// The child may already have run: the fork probe put it in `FORKED`, so until the copy its lookups fell
    /// back to the parent's entries, and an inherited fd it closed meanwhile left a `FdInfo::CLOSED` entry.
    /// The copy does not overwrite entries the child made itself (BPF_NOEXIST); then `FORKED` is dropped and
    /// the `CLOSED` entries, which only mattered during the copy, are removed.
    fn fork(&mut self, parent: u32, child: u32) -> Result<(), TracerError> {
        if seed::tgid_of(child).is_some_and(|t| t != child) {
            // A new thread: the fork probe's entries for its tid are of no use.
            let _ = self.probes.forked.remove(&child);
            let _ = self.probes.nv_procs.remove(&child);
            return Ok(());
        }
        let inherited = self.fds.fork(parent, child);
        for (fd, nv) in &inherited {
            self.kernel_inherit(child, *fd, *nv)?;
        }
        let _ = self.probes.forked.remove(&child);
        for (fd, _) in &inherited {
            let key = FdKey {
                tgid: child,
                fd: *fd as u32,
            };
            if self.probes.nv_fds.get(&key, 0).is_ok_and(|i| i.is_closed()) {
                let _ = self.probes.nv_fds.remove(&key);
            }
        }
        if self.fds.get(child).is_none() {
            let _ = self.probes.nv_procs.remove(&child);
        }
        Ok(())
    }

    /// Copies an inherited fd into the kernel map unless the child already has an entry for that fd.
    fn kernel_inherit(&mut self, child: u32, fd: i32, nv: NvFd) -> Result<(), TracerError> {
        const BPF_NOEXIST: u64 = 1;
        let key = FdKey {
            tgid: child,
            fd: fd as u32,
        };
        let info = FdInfo {
            kind: nv.kind as u8,
            minor: nv.minor,
            _pad: [0; 2],
        };
        match self.probes.nv_fds.insert(key, info, BPF_NOEXIST) {
            Ok(()) => Ok(()),
            Err(aya::maps::MapError::SyscallError(e))
                if e.io_error.raw_os_error() == Some(nix::errno::Errno::EEXIST as i32) =>
            {
                Ok(())
            }
            Err(e) => Err(TracerError::MapUpdate {
                map: "NV_FDS",
                pid: child,
                detail: e.to_string(),
            }),
        }
    }

    /// A process that pins no NVIDIA file any more has had all its driver state released; the probes stop
    /// reporting its munmaps, forks and exit.
    fn release_if_unpinned(&mut self, pid: u32, cg: u64) {
        if self.fds.get(pid).is_none() {
            self.ledger.container_mut(cg).release_process(pid);
            let _ = self.probes.nv_procs.remove(&pid);
        }
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
        let l = self.ledger.container(cgroup_id);
        GpuState {
            live_objects: l.map_or(0, |l| l.live_objects()),
            vram_bytes: l.map_or(0, |l| l.vram_bytes()),
            open_fds,
            mappings,
        }
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
