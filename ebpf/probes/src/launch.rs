//! Kernel-granular launch telemetry: uprobes on libcuda's `cuLaunchKernel`, `cuLaunchKernelEx` and
//! `cuGraphLaunch` count launches per container (cgroup v2 id) in a per-CPU hash of counters.
//!
//! Counters, not records: the governor needs launches per window, which user space gets as deltas of these
//! counters; a ring-buffer record per launch would add a reserve, a submit and consumer work to every launch
//! (a trainer can launch 100k kernels a second) for nothing the counts do not say. Per CPU, so that launches
//! from several threads never share a cache line and the increment needs no atomic. User space attaches the
//! programs to each distinct libcuda file of a watched container (`baton-tracer`, `launch.rs`); a uprobe fires
//! for every process that maps the file, so the program filters by watched cgroup like the opens do.
use aya_ebpf::{
    macros::{map, uprobe},
    maps::PerCpuHashMap,
    programs::ProbeContext,
};
use baton_probe_common::{LaunchCounts, LaunchFn};

use crate::util::{cgroup_id, current_is_watched};

/// Launches per container: cgroup v2 id -> counts (`baton_probe_common::maps::LAUNCHES`).
#[map(name = "LAUNCHES")]
pub static LAUNCHES: PerCpuHashMap<u64, LaunchCounts> = PerCpuHashMap::with_max_entries(16384, 0);

/// `BPF_NOEXIST`: only create the entry (two CPUs creating it at once must not overwrite each other).
const BPF_NOEXIST: u64 = 1;

#[uprobe]
pub fn cu_launch_kernel(_ctx: ProbeContext) -> u32 {
    count_launch(LaunchFn::Kernel);
    0
}

#[uprobe]
pub fn cu_launch_kernel_ex(_ctx: ProbeContext) -> u32 {
    count_launch(LaunchFn::KernelEx);
    0
}

#[uprobe]
pub fn cu_graph_launch(_ctx: ProbeContext) -> u32 {
    count_launch(LaunchFn::Graph);
    0
}

/// Counts one launch of `f` for the current task's container, if it is watched.
#[inline(always)]
fn count_launch(f: LaunchFn) {
    if !current_is_watched() {
        return;
    }
    let cg = cgroup_id();
    if bump(cg, f) {
        return;
    }
    let mut first = LaunchCounts::default();
    *first.get_mut(f) = 1;
    // Inserted from a program, a per-CPU value is set on this CPU and zeroed on the others.
    if LAUNCHES.insert(cg, first, BPF_NOEXIST).is_err() {
        // Another CPU created it meanwhile (or the map is full, and this launch is not counted).
        bump(cg, f);
    }
}

/// Adds one to this CPU's counter of `f` for `cg`; false when the container has no entry yet.
#[inline(always)]
fn bump(cg: u64, f: LaunchFn) -> bool {
    let Some(counts) = LAUNCHES.get_ptr_mut(cg) else {
        return false;
    };
    // SAFETY: this CPU's slot of a live map value; the program runs with migration disabled and a program on
    // the same CPU cannot run inside it (the kernel's recursion guard), so no other writer touches it now.
    unsafe { *(*counts).get_mut(f) += 1 };
    true
}
