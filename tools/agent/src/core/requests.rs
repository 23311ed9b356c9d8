//! The protocol requests the core answers itself (`ping`, `register`, `unregister`, `status`, a shim's
//! preemption state), and what it tells about the node: status, launches, the metrics' snapshot.
use std::collections::HashMap;

use baton_agent_api::{ContainerRef, Filter, NodeStatus, Pong, Reply};
use baton_tracer::Tracer;

use super::Core;
use crate::metrics::snapshot::{ContainerSample, Snapshot};

impl Core {
    /// Answers a protocol request that the core serves itself (the others are the connection's).
    pub(super) fn handle(&mut self, request: baton_agent_api::Request, peer: u32) -> Reply {
        use baton_agent_api::Request as R;
        match request {
            R::Ping => Reply::Pong(Pong {
                agent_pid: std::process::id(),
                version: env!("CARGO_PKG_VERSION").to_owned(),
                probes_attached: self.tracer.is_some(),
            }),
            R::Register(reg) => {
                self.prune_orphans();
                self.register_reply(*reg, peer)
            }
            R::Unregister(c) => Reply::Unregistered {
                found: self.unregister(&c),
            },
            R::Preemption(update) => self.preemption_pushed(update, peer),
            R::StopParked(c) => self.stop_parked(&c, peer),
            R::Status(filter) => {
                self.prune_orphans();
                Reply::Status(self.status(&filter, peer))
            }
            R::Watch(_)
            | R::Trace(_)
            | R::Preempt(_)
            | R::Resume(_)
            | R::Start(_)
            | R::Handoff(_)
            | R::WaitGpuFree(_)
            | R::Freeze(_)
            | R::Thaw(_)
            | R::Duty(_)
            | R::RequestStart(_)
            | R::FirstToken(_)
            | R::RequestEnd(_)
            | R::Token(_)
            | R::Governor(_) => Reply::Error {
                error: "this request is answered by the connection, not the core".to_owned(),
            },
        }
    }

    /// The node's status, with the watched containers `filter` selects for `asker`.
    fn status(&self, filter: &Filter, asker: u32) -> NodeStatus {
        let containers = match &self.tracer {
            Some(t) => self
                .watched
                .iter()
                .filter(|(c, w)| filter.matches(c, w.owner, asker))
                .map(|(_, w)| w.status(t))
                .collect(),
            None => Vec::new(),
        };
        let gpus = gpu_memory(&containers);
        NodeStatus {
            agent_pid: std::process::id(),
            probes_attached: self.tracer.is_some(),
            programs_attached: self.tracer.as_ref().map_or(0, Tracer::programs_attached),
            ringbuf_drops: self.tracer.as_ref().map_or(0, Tracer::dropped),
            resyncs: self.tracer.as_ref().map_or(0, Tracer::resyncs),
            pending_lost: self.tracer.as_ref().map_or(0, Tracer::pending_lost),
            pending_overflowed: self.tracer.as_ref().map_or(0, Tracer::pending_overflowed),
            probe_fd_map: self.tracer.as_ref().map(probe_fd_map),
            confirmed_by_proc: self.tracer.as_ref().map_or(0, Tracer::confirmed_by_proc),
            containers,
            controller: self.controller_status(),
            gap_fill: self.gap_fill_status(),
            gpus,
            peaks: self.peaks_status(),
            parked_host_memory: self.parked_host_memory(),
            nvml_floor: self.floor_statuses(),
        }
    }

    /// The peaks per container name, the watched containers' own so far counted in.
    fn peaks_status(&self) -> Vec<baton_agent_api::room::PeakMemory> {
        let Some(t) = self.tracer.as_ref() else {
            return self.peaks.list([]);
        };
        let live = self.watched.values().map(|w| {
            let peak = t
                .ledger()
                .container(w.cgroup_id)
                .map_or(0, |l| l.peak_vram_bytes());
            (crate::registry::peaks::name_of(w), peak)
        });
        self.peaks.list(live)
    }

    /// The controller's status, with each co-runner's launches counted up to now (the tracer's counts: the
    /// controller keeps none to show).
    fn controller_status(&self) -> baton_agent_api::ControllerStatus {
        let mut status = self.controller.status();
        let launches: HashMap<ContainerRef, u64> = self.launches().into_iter().collect();
        for c in &mut status.co_runners {
            if let Some(&n) = launches.get(&c.container) {
                c.launches = Some(n);
            }
        }
        status
    }

    /// Launches counted per watched container (none without probes).
    pub(crate) fn launches(&self) -> Vec<(ContainerRef, u64)> {
        let Some(t) = self.tracer.as_ref() else {
            return Vec::new();
        };
        self.watched
            .iter()
            .map(|(c, w)| (c.clone(), t.launches(w.cgroup_id).total()))
            .collect()
    }

    /// What the metrics endpoint shows now.
    pub(super) fn metrics_snapshot(&self) -> Snapshot {
        let containers = match &self.tracer {
            Some(t) => self
                .watched
                .values()
                .map(|w| ContainerSample::of(w, t, self.ioctls.get(&w.cgroup_id)))
                .collect(),
            None => Vec::new(),
        };
        Snapshot {
            containers,
            probes_attached: self.tracer.is_some(),
            totals: self.retired.with(self.tracer.as_ref()),
            fd_map_free: self.tracer.as_ref().map(|t| {
                let (_, free, reserve_free) = t.fd_map_room();
                (free, reserve_free)
            }),
            controller: self.controller_status(),
            gap_fill: self.gap_fill_status(),
            parked_host_memory: self.parked_host_memory(),
            nvml_floor: self.floor_statuses(),
            nvml_disagreements: self.floor.disagreements,
        }
    }
}

/// Each GPU `containers` see (their `/dev/nvidiaN` files), with the ledger's video memory of those containers
/// beside NVML's used memory of the device.
fn gpu_memory(containers: &[baton_agent_api::ContainerStatus]) -> Vec<baton_agent_api::GpuMemory> {
    let mut by_minor: std::collections::BTreeMap<u8, (String, usize, u64)> = Default::default();
    for c in containers {
        let mut seen = std::collections::BTreeSet::new();
        for path in &c.devices {
            let name = path.rsplit('/').next().unwrap_or(path);
            if let Some((baton_nvidia::fdkind::FdKind::Device, minor)) =
                baton_nvidia::fdkind::classify_name(name.as_bytes())
                && seen.insert(minor)
            {
                let e = by_minor
                    .entry(minor)
                    .or_insert_with(|| (name.to_owned(), 0, 0));
                e.1 += 1;
                e.2 += c.vram_bytes;
            }
        }
    }
    let nvml = crate::nvml::used_by_minor();
    by_minor
        .into_iter()
        .map(
            |(minor, (device, containers, ledger))| baton_agent_api::GpuMemory {
                device,
                minor,
                containers,
                ledger_vram_bytes: ledger,
                nvml_used_bytes: nvml
                    .as_ref()
                    .and_then(|m| m.get(&u32::from(minor)).copied()),
            },
        )
        .collect()
}

/// How full the probes' fd map is.
fn probe_fd_map(t: &Tracer) -> baton_agent_api::ProbeFdMap {
    let (used, _, reserve_free) = t.fd_map_room();
    baton_agent_api::ProbeFdMap {
        entries: u64::from(baton_tracer::NV_FDS_ENTRIES),
        used,
        reserve: u64::from(baton_tracer::NV_FDS_RESERVE),
        reserve_free,
    }
}
