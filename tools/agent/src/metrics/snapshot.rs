//! What a scrape reads of the core: a [`Snapshot`] of the watched containers, built by the core when asked
//! (plain data, encoded elsewhere), and the counters the core keeps for it as records pass
//! ([`IoctlCounts`], [`TracerTotals`]). [`Source`] asks the core, with a timeout.
use std::{
    collections::{BTreeMap, HashMap},
    time::Duration,
};

use baton_agent_api::{ContainerRef, ControllerStatus, GpuHold};
use baton_tracer::{Tracer, event::Body, event::Event as Record};
use prometheus_client::encoding::EncodeLabelSet;
use tokio::sync::{mpsc, oneshot};

use super::super::{
    core::{Command, What},
    registry::watched::Watched,
};

/// Scrapes closer together than this share one snapshot.
pub const MIN_INTERVAL: Duration = Duration::from_millis(100);
/// How long a scrape waits for the core (busy with a long batch, or stuck) before answering 503.
pub const CORE_TIMEOUT: Duration = Duration::from_secs(2);

/// The labels of a container's series. `namespace` is the pod's namespace under Kubernetes, else the
/// containerd namespace; `container` the pod spec's container name, else the containerd id.
#[derive(Clone, Debug, Hash, PartialEq, Eq, PartialOrd, Ord, EncodeLabelSet)]
pub struct ContainerLabels {
    /// Pod namespace, or containerd namespace.
    pub namespace: String,
    /// Pod name (empty when not run by CRI).
    pub pod: String,
    /// Container name, or id.
    pub container: String,
    /// containerd's container id.
    pub container_id: String,
}

impl ContainerLabels {
    /// The labels of `c`, named by Kubernetes when CRI's annotations were registered.
    pub fn of(c: &ContainerRef, k8s: Option<&baton_agent_api::KubernetesRef>) -> Self {
        Self {
            namespace: k8s
                .and_then(|k| k.namespace.clone())
                .unwrap_or_else(|| c.namespace.clone()),
            pod: k8s.map(|k| k.pod.clone()).unwrap_or_default(),
            container: k8s
                .and_then(|k| k.container.clone())
                .unwrap_or_else(|| c.id.clone()),
            container_id: c.id.clone(),
        }
    }
}

/// Ioctl calls and failures of one escape (or UVM command).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CallCount {
    /// Calls traced.
    pub calls: u64,
    /// Calls that failed: a negative return, or an RM status other than NV_OK.
    pub errors: u64,
}

/// A watched container's ioctls by escape name, counted by the core as records pass (one map lookup per
/// record). Names are `baton-nvidia`'s; a command it does not know counts as `UNKNOWN`, so a container
/// cannot grow the map with made-up commands.
#[derive(Clone, Debug, Default)]
pub struct IoctlCounts(HashMap<&'static str, CallCount>);

impl IoctlCounts {
    /// Counts the ioctls of `records` into `per_cgroup` for the cgroups it has (the watched ones).
    pub fn count(per_cgroup: &mut HashMap<u64, IoctlCounts>, records: &[Record]) {
        for r in records {
            let Body::Ioctl(io) = &r.body else { continue };
            let Some(counts) = per_cgroup.get_mut(&r.cgroup_id) else {
                continue;
            };
            let name = match &io.decoded.escape {
                std::borrow::Cow::Borrowed(n) => n,
                std::borrow::Cow::Owned(_) => "UNKNOWN",
            };
            let c = counts.0.entry(name).or_default();
            c.calls += 1;
            if io.ret < 0
                || io
                    .decoded
                    .status
                    .is_some_and(|s| s != baton_nvidia::status::NV_OK)
            {
                c.errors += 1;
            }
        }
    }

    /// By name, sorted.
    pub fn sorted(&self) -> Vec<(&'static str, CallCount)> {
        let mut v: Vec<_> = self.0.iter().map(|(n, c)| (*n, *c)).collect();
        v.sort_unstable_by_key(|(n, _)| *n);
        v
    }
}

/// The tracer's own counters summed over every probe set the agent loaded (the probes go with the last
/// watched container and come back with the next, and counters must not go back).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TracerTotals {
    /// Ring-buffer records lost.
    pub records_lost: u64,
    /// Resyncs from /proc after lost records.
    pub resyncs: u64,
    /// NVIDIA fds the probes did not follow: their cgroup was at its quota.
    pub fds_over_quota: u64,
    /// NVIDIA fds the probes did not follow: their fd map was full (or all but its reserve, for a container
    /// past its base).
    pub fds_map_full: u64,
    /// Calls kept in the probes' overflow because another thread's call held their in-flight slot.
    pub pending_overflowed: u64,
    /// Calls whose record the probes could not keep (made up for from /proc).
    pub pending_lost: u64,
}

impl TracerTotals {
    /// These plus `t`'s.
    pub fn with(self, t: Option<&Tracer>) -> Self {
        let refused = t.map_or((0, 0), Tracer::fds_refused);
        Self {
            records_lost: self.records_lost + t.map_or(0, Tracer::dropped),
            resyncs: self.resyncs + t.map_or(0, Tracer::resyncs),
            fds_over_quota: self.fds_over_quota + refused.0,
            fds_map_full: self.fds_map_full + refused.1,
            pending_overflowed: self.pending_overflowed + t.map_or(0, Tracer::pending_overflowed),
            pending_lost: self.pending_lost + t.map_or(0, Tracer::pending_lost),
        }
    }
}

/// One watched container as a scrape sees it.
#[derive(Clone, Debug)]
pub struct ContainerSample {
    /// Its labels.
    pub labels: ContainerLabels,
    /// Which container (to join the controller's view).
    pub container: ContainerRef,
    /// It holds the GPU.
    pub gpu_held: bool,
    /// Video memory of its live objects in the ledger.
    pub vram_bytes: u64,
    /// The most it held.
    pub peak_vram_bytes: u64,
    /// NVIDIA fds open.
    pub nvidia_fds: usize,
    /// Mappings of NVIDIA files.
    pub mappings: usize,
    /// Live RM objects by class name (`baton-nvidia`'s, `0x....` when unknown).
    pub objects_by_class: Vec<(String, usize)>,
    /// Ioctls by escape.
    pub ioctls: Vec<(&'static str, CallCount)>,
    /// Kernel launches counted (libcuda uprobes).
    pub launches: u64,
    /// Its ledger misses what happened before it was watched, or records were lost.
    pub partial: bool,
    /// Its share of the probes' fd map, and whether it reached its quota (followed through /proc since).
    pub probe_fds: u64,
    /// See `probe_fds`.
    pub over_fd_quota: bool,
    /// The host copy of its device memory while it is parked (0 when it is not), bytes.
    pub parked_host_bytes: u64,
    /// Allocations its ledger counted though they read as refused or their readings differed.
    pub doubtful_allocations: u64,
    /// Frees read as done its ledger did not apply: their readings differed.
    pub frees_disputed: u64,
}

impl ContainerSample {
    /// `w` now.
    pub fn of(w: &Watched, tracer: &Tracer, ioctls: Option<&IoctlCounts>) -> Self {
        let status = w.status(tracer);
        let objects_by_class = tracer
            .ledger()
            .container(w.cgroup_id)
            .map(|l| {
                l.live_by_class()
                    .into_iter()
                    .map(|(class, n)| (class_label(class), n))
                    .collect()
            })
            .unwrap_or_default();
        Self {
            labels: ContainerLabels::of(
                &w.registration.container,
                w.registration.kubernetes.as_deref(),
            ),
            container: w.registration.container.clone(),
            gpu_held: status.gpu == GpuHold::Held,
            vram_bytes: status.vram_bytes,
            peak_vram_bytes: status.peak_vram_bytes,
            nvidia_fds: status.nvidia_fds,
            mappings: status.mappings,
            objects_by_class,
            ioctls: ioctls.map(IoctlCounts::sorted).unwrap_or_default(),
            launches: tracer.launches(w.cgroup_id).total(),
            partial: status.partial,
            probe_fds: status.probe_fds.as_ref().map_or(0, |p| p.followed),
            over_fd_quota: status.probe_fds.as_ref().is_some_and(|p| p.over_quota),
            parked_host_bytes: w
                .preemption
                .as_ref()
                .filter(|p| p.state != baton_agent_api::PreemptPhase::Snapshotted)
                .and_then(|p| p.host_copy_bytes)
                .unwrap_or(0),
            doubtful_allocations: status.doubtful.map_or(0, |d| d.allocations),
            frees_disputed: status.doubtful.map_or(0, |d| d.frees_disputed),
        }
    }
}

/// The class's name in `baton-nvidia`, else its number.
fn class_label(class: u32) -> String {
    baton_nvidia::class::name(class).map_or_else(|| format!("{class:#06x}"), str::to_owned)
}

/// Everything a scrape reads of the core.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// The watched containers.
    pub containers: Vec<ContainerSample>,
    /// Whether the probes are loaded.
    pub probes_attached: bool,
    /// The tracer's counters, summed over its probe sets.
    pub totals: TracerTotals,
    /// The probes' fd map: (entries free, entries of its reserve free); `None` while they are detached.
    pub fd_map_free: Option<(u64, u64)>,
    /// The co-runner controller's view (freezes).
    pub controller: ControllerStatus,
    /// Gap-fill's view (per GPU: the rate gate).
    pub gap_fill: baton_agent_api::GapFillStatus,
    /// The host memory parked containers hold, and the node's budget for their raised limits.
    pub parked_host_memory: baton_agent_api::ParkedHostMemory,
    /// The gate's NVML floor of each GPU.
    pub nvml_floor: Vec<baton_agent_api::GpuFloor>,
    /// Disagreements between NVML and the ledgers counted so far.
    pub nvml_disagreements: u64,
}

impl Snapshot {
    /// The labels of every watched container, for the controller's co-runners.
    pub fn labels_by_container(&self) -> BTreeMap<&ContainerRef, &ContainerLabels> {
        self.containers
            .iter()
            .map(|c| (&c.container, &c.labels))
            .collect()
    }
}

/// Scrapes' way to the core (the endpoint makes sure at most one question is in flight).
#[derive(Clone)]
pub struct Source {
    core: mpsc::Sender<Command>,
}

impl Source {
    /// Asks `core`.
    pub fn new(core: mpsc::Sender<Command>) -> Self {
        Self { core }
    }

    /// The core's snapshot now, or why there is none within [`CORE_TIMEOUT`].
    pub async fn snapshot(&self) -> Result<Snapshot, String> {
        let (tx, rx) = oneshot::channel();
        let (reply, _) = oneshot::channel();
        let cmd = Command {
            what: What::Metrics(tx),
            peer_pid: 0,
            reply,
        };
        let asked = async {
            self.core.send(cmd).await.map_err(|_| stopping())?;
            rx.await.map_err(|_| stopping())
        };
        tokio::time::timeout(CORE_TIMEOUT, asked)
            .await
            .map_err(|_| {
                format!(
                    "the agent's core did not answer within {CORE_TIMEOUT:?} (it is busy or stuck; its \
                     socket and log say more)"
                )
            })?
    }
}

fn stopping() -> String {
    "the agent is stopping".to_owned()
}
