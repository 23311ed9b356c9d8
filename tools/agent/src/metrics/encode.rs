//! A [`Snapshot`] and the event metrics as one OpenMetrics text exposition (`prometheus-client`'s encoder,
//! on a registry built for the scrape: the containers' series are those watched now).
use prometheus_client::{
    encoding::{EncodeLabelSet, text::encode},
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::{Registry, Unit},
};

use super::{
    events::events,
    snapshot::{ContainerLabels, Snapshot},
};

/// A container's labels and one more.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClassLabels {
    #[prometheus(flatten)]
    container: ContainerLabels,
    /// The RM class name.
    class: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EscapeLabels {
    #[prometheus(flatten)]
    container: ContainerLabels,
    /// The escape or UVM command name.
    escape: &'static str,
}

fn gauge(v: impl TryInto<i64>) -> i64 {
    v.try_into().unwrap_or(i64::MAX)
}

/// The exposition of `s` and the event metrics.
pub fn exposition(s: &Snapshot) -> Result<String, std::fmt::Error> {
    let mut r = Registry::with_prefix("baton");
    containers(&mut r, s);
    co_runners(&mut r, s);
    gap_fill(&mut r, s);
    parked_host_memory(&mut r, s);
    node(&mut r, s);
    nvml_floor(&mut r, s);
    events().register(&mut r);
    let mut text = String::new();
    encode(&mut text, &r)?;
    Ok(text)
}

/// A gauge family of the containers, one value each.
fn per_container(
    s: &Snapshot,
    value: impl Fn(&super::snapshot::ContainerSample) -> i64,
) -> Family<ContainerLabels, Gauge> {
    let f = Family::<ContainerLabels, Gauge>::default();
    for c in &s.containers {
        f.get_or_create(&c.labels).set(value(c));
    }
    f
}

fn containers(r: &mut Registry, s: &Snapshot) {
    r.register_with_unit(
        "container_gpu_memory",
        "Video memory of the container's live RM objects in the agent's ledger",
        Unit::Bytes,
        per_container(s, |c| gauge(c.vram_bytes)),
    );
    r.register_with_unit(
        "container_gpu_memory_peak",
        "The most video memory the container's ledger held since it was watched",
        Unit::Bytes,
        per_container(s, |c| gauge(c.peak_vram_bytes)),
    );
    r.register_with_unit(
        "container_parked_host_memory",
        "Host memory the container's park holds (the host copy of its device memory, charged to its memory \
         cgroup); 0 while it is not parked",
        Unit::Bytes,
        per_container(s, |c| gauge(c.parked_host_bytes)),
    );
    r.register(
        "container_gpu_held",
        "1 while the container holds the GPU (an NVIDIA file or mapping, or a release not yet confirmed)",
        per_container(s, |c| i64::from(c.gpu_held)),
    );
    r.register(
        "container_nvidia_fds",
        "NVIDIA device fds the container's processes hold",
        per_container(s, |c| gauge(c.nvidia_fds)),
    );
    r.register(
        "container_nvidia_mappings",
        "Mappings of NVIDIA device files in the container's processes",
        per_container(s, |c| gauge(c.mappings)),
    );
    r.register(
        "container_ledger_partial",
        "1 when the container's ledger misses calls (processes traced only after they allocated, or lost records)",
        per_container(s, |c| i64::from(c.partial)),
    );
    r.register(
        "container_ledger_doubtful_allocations",
        "Allocations the container's ledger counted though their status read as refused or their params read \
         differently at the call's entry and exit (a tenant rewriting them after the driver answered)",
        per_container(s, |c| gauge(c.doubtful_allocations)),
    );
    r.register(
        "container_ledger_frees_disputed",
        "Frees read as done that the container's ledger did not apply: the object they named at the call's \
         entry was another",
        per_container(s, |c| gauge(c.frees_disputed)),
    );
    r.register(
        "container_probe_fds",
        "Entries of the probes' fd map the container's processes take (each container has a quota of them)",
        per_container(s, |c| gauge(c.probe_fds)),
    );
    r.register(
        "container_probe_fds_over_quota",
        "1 once the container reached its quota of the probes' fd map: its further NVIDIA fds are followed \
         through /proc only",
        per_container(s, |c| i64::from(c.over_fd_quota)),
    );
    let objects = Family::<ClassLabels, Gauge>::default();
    let calls = Family::<EscapeLabels, Counter>::default();
    let errors = Family::<EscapeLabels, Counter>::default();
    let launches = Family::<ContainerLabels, Counter>::default();
    for c in &s.containers {
        for (class, n) in &c.objects_by_class {
            let labels = ClassLabels {
                container: c.labels.clone(),
                class: class.clone(),
            };
            objects.get_or_create(&labels).set(gauge(*n));
        }
        for (escape, n) in &c.ioctls {
            let labels = EscapeLabels {
                container: c.labels.clone(),
                escape,
            };
            calls.get_or_create(&labels).inc_by(n.calls);
            if n.errors > 0 {
                errors.get_or_create(&labels).inc_by(n.errors);
            }
        }
        launches.get_or_create(&c.labels).inc_by(c.launches);
    }
    r.register(
        "container_rm_objects",
        "Live RM objects of the container in the agent's ledger, by class",
        objects,
    );
    r.register(
        "container_ioctls",
        "NVIDIA driver ioctls the container made, by escape or UVM command (UNKNOWN: not in baton-nvidia)",
        calls,
    );
    r.register(
        "container_ioctl_errors",
        "The container's ioctls that failed (a negative return, or an RM status other than NV_OK)",
        errors,
    );
    r.register(
        "container_cuda_launches",
        "Kernel launches of the container counted by the libcuda uprobes",
        launches,
    );
}

fn co_runners(r: &mut Registry, s: &Snapshot) {
    let labels = s.labels_by_container();
    let freezes = Family::<ContainerLabels, Counter>::default();
    let frozen_time = Family::<ContainerLabels, Counter<f64>>::default();
    let frozen = Family::<ContainerLabels, Gauge>::default();
    for co in &s.controller.co_runners {
        let Some(l) = labels.get(&co.container) else {
            continue;
        };
        freezes.get_or_create(l).inc_by(co.freezes);
        frozen_time
            .get_or_create(l)
            .inc_by(co.frozen_ns as f64 / 1e9);
        frozen.get_or_create(l).set(i64::from(co.frozen));
    }
    r.register(
        "corunner_freezes",
        "Freezes of the co-runner by the agent's controller, confirmed by its shim",
        freezes,
    );
    r.register_with_unit(
        "corunner_frozen",
        "Time the co-runner spent frozen by the agent's controller",
        Unit::Seconds,
        frozen_time,
    );
    r.register(
        "corunner_frozen_now",
        "1 while the controller holds the co-runner frozen",
        frozen,
    );
}

/// The label of a GPU's series: its device file.
#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct GpuLabels {
    device: String,
}

/// Gap-fill's rate gate per GPU: C, the preemptions per hour, the projected share, filling, parked; and the
/// gate's room (capacity, room).
fn gap_fill(r: &mut Registry, s: &Snapshot) {
    let cost = Family::<GpuLabels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
    let rate = Family::<GpuLabels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
    let share = Family::<GpuLabels, Gauge<f64, std::sync::atomic::AtomicU64>>::default();
    let filling = Family::<GpuLabels, Gauge>::default();
    let parked = Family::<GpuLabels, Gauge>::default();
    let capacity = Family::<GpuLabels, Gauge>::default();
    let room = Family::<GpuLabels, Gauge>::default();
    for g in &s.gap_fill.gpus {
        let l = GpuLabels {
            device: g.device.clone(),
        };
        if let Some(c) = g.c_s {
            cost.get_or_create(&l).set(c);
        }
        if let Some(p) = g.projected_share {
            share.get_or_create(&l).set(p);
        }
        rate.get_or_create(&l).set(g.preemptions_per_hour);
        filling.get_or_create(&l).set(i64::from(g.filling));
        parked.get_or_create(&l).set(gauge(g.parked.len()));
        if let Some(c) = g.room.capacity_bytes {
            capacity
                .get_or_create(&l)
                .set(i64::try_from(c).unwrap_or(i64::MAX));
        }
        if let Some(b) = g.room.room_bytes {
            room.get_or_create(&l)
                .set(i64::try_from(b).unwrap_or(i64::MAX));
        }
    }
    r.register_with_unit(
        "gpu_memory_capacity",
        "The GPU's memory as NVML reports it (absent without NVML)",
        Unit::Bytes,
        capacity,
    );
    r.register_with_unit(
        "gpu_memory_room",
        "What the gate counts free on the GPU for a Start with baton.io/gpu-memory: capacity less \
         gpu_memory_headroom less what every holder has (0 when a holder counts as the whole GPU)",
        Unit::Bytes,
        room,
    );
    r.register_with_unit(
        "gapfill_preemption_cost",
        "C: the co-runners' time lost per gap-fill preemption of the GPU (request to running again), \
         the mean over the rate gate's window, else the last measured",
        Unit::Seconds,
        cost,
    );
    r.register(
        "gapfill_preemptions_per_hour",
        "Gap-fill preemptions of the GPU per hour, over the rate gate's window (gap_fill_window)",
        rate,
    );
    r.register(
        "gapfill_projected_share",
        "The co-runners' projected share of the GPU, 1 - rate * C / 3600",
        share,
    );
    r.register(
        "gapfill_filling",
        "1 while the agent fills the GPU (projected share at least gap_fill_min_share)",
        filling,
    );
    r.register(
        "gapfill_parked",
        "Co-runners the agent parked from the GPU",
        parked,
    );
}

/// The host memory parked containers hold, and the node's budget for the limits their parks raised.
fn parked_host_memory(r: &mut Registry, s: &Snapshot) {
    let p = &s.parked_host_memory;
    let series = [
        (
            "parked_host_memory",
            "Host memory every parked container holds, in all (the host copies of their device memory)",
            p.held_bytes,
        ),
        (
            "parked_host_memory_raised",
            "What parks raised the parked containers' memory limits by, in all (counted against the budget)",
            p.raised_bytes,
        ),
        (
            "parked_host_memory_budget",
            "The node's budget for raised memory limits of parked containers (parked_host_memory_budget, \
             default half the node's memory)",
            p.budget_bytes,
        ),
    ];
    for (name, help, bytes) in series {
        let g: Gauge = Gauge::default();
        g.set(gauge(bytes));
        r.register_with_unit(name, help, Unit::Bytes, g);
    }
}

fn node(r: &mut Registry, s: &Snapshot) {
    let watched: Gauge = Gauge::default();
    watched.set(gauge(s.containers.len()));
    r.register(
        "watched_containers",
        "Containers the agent watches",
        watched,
    );
    let attached: Gauge = Gauge::default();
    attached.set(i64::from(s.probes_attached));
    r.register(
        "probes_attached",
        "1 while the agent's eBPF probes are loaded (from the first watched container to the last)",
        attached,
    );
    let lost: Counter = Counter::default();
    lost.inc_by(s.totals.records_lost);
    r.register(
        "probe_records_lost",
        "Probe records dropped because the ring buffer was full",
        lost,
    );
    let resyncs: Counter = Counter::default();
    resyncs.inc_by(s.totals.resyncs);
    r.register(
        "probe_resyncs",
        "Times the agent rebuilt its fd mirror from /proc after lost records",
        resyncs,
    );
    let over_quota: Counter = Counter::default();
    over_quota.inc_by(s.totals.fds_over_quota);
    r.register(
        "probe_fds_over_quota",
        "NVIDIA fds the probes did not follow because their container had its quota of the probes' fd map \
         (the container is followed through /proc)",
        over_quota,
    );
    let map_full: Counter = Counter::default();
    map_full.inc_by(s.totals.fds_map_full);
    r.register(
        "probe_fds_map_full",
        "NVIDIA fds the probes did not follow because their fd map was full (or all but its reserve, for a \
         container past its base)",
        map_full,
    );
    if let Some((free, reserve_free)) = s.fd_map_free {
        let g: Gauge = Gauge::default();
        g.set(gauge(free));
        r.register(
            "probe_fd_map_free_entries",
            "Free entries of the probes' fd map (for the whole node)",
            g,
        );
        let g: Gauge = Gauge::default();
        g.set(gauge(reserve_free));
        r.register(
            "probe_fd_map_reserve_free_entries",
            "Free entries of the fd map's reserve, which only each container's first fds may take",
            g,
        );
    }
    let overflowed: Counter = Counter::default();
    overflowed.inc_by(s.totals.pending_overflowed);
    r.register(
        "probe_pending_overflowed",
        "Calls whose in-flight slot another thread's call held, kept in the probes' overflow (nothing lost)",
        overflowed,
    );
    let pending_lost: Counter = Counter::default();
    pending_lost.inc_by(s.totals.pending_lost);
    r.register(
        "probe_pending_lost",
        "Calls whose record the probes could not keep: their container's ledger was marked partial and its \
         process read again from /proc once the call returned",
        pending_lost,
    );
}

/// The gate's NVML floor: per GPU, the memory NVML shows used that neither the idle baseline nor the
/// ledgers account for, and the disagreements counted.
fn nvml_floor(r: &mut Registry, s: &Snapshot) {
    let unaccounted = Family::<GpuLabels, Gauge>::default();
    for g in &s.nvml_floor {
        let labels = GpuLabels {
            device: format!("nvidia{}", g.minor),
        };
        unaccounted
            .get_or_create(&labels)
            .set(gauge(g.floor.unaccounted_bytes.unwrap_or(0)));
    }
    r.register_with_unit(
        "gpu_memory_unaccounted",
        "Memory NVML shows used on the GPU past its idle baseline and the ledgers of the containers holding \
         it, while that disagreement (past --nvml-tolerance-mib, two readings in a row) lasts; 0 otherwise",
        Unit::Bytes,
        unaccounted,
    );
    let disagreements: Counter = Counter::default();
    disagreements.inc_by(s.nvml_disagreements);
    r.register(
        "nvml_disagreements",
        "Times NVML showed a GPU's used memory past its idle baseline and the ledgers by more than the \
         tolerance (each logged once, naming the containers holding the GPU)",
        disagreements,
    );
}
