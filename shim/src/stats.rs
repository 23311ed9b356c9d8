//! Task metrics for Stats: containerd's cgroups v1 `Metrics` or v2 `Metrics` protobuf, as the Go
//! shim emits them (type URL `io.containerd.cgroups.v1.Metrics` / `...v2.Metrics`). On a hybrid
//! host (v1 controllers, v2 at /sys/fs/cgroup/unified) the v1 controllers hold the numbers, as
//! with the Go shim.

use cgroups_rs::fs::{Cgroup, cpuacct::CpuAcctController, memory::MemController};
use containerd_shim::cgroup::{collect_metrics, collect_metrics_v2, get_cgroup};
use containerd_shim_protos::{cgroups::metrics::Metrics, protobuf::well_known_types::any::Any};

use crate::errors::{Result, ShimError};

/// Collects the metrics of the cgroup of `pid` (the container's init).
pub fn collect(pid: u32) -> Result<Any> {
    let cgroup = get_cgroup(pid)?;
    let any = if cgroup.v2() {
        containerd_shim::util::convert_to_any(Box::new(collect_metrics_v2(&cgroup)?))
    } else {
        let mut metrics = collect_metrics(&cgroup)?;
        add_cpuacct_usage(&cgroup, &mut metrics);
        add_memory_usage(&cgroup, &mut metrics);
        containerd_shim::util::convert_to_any(Box::new(metrics))
    };
    any.map_err(|e| ShimError::Other(format!("encode metrics of pid {pid}: {e}")))
}

/// cgroup v1 keeps CPU usage in the cpuacct controller (the crate reads only `cpu.stat`, which
/// holds usage on v2 alone): fill `cpu.usage` from it, in nanoseconds as the Go shim does.
fn add_cpuacct_usage(cgroup: &Cgroup, metrics: &mut Metrics) {
    let Some(acct) = cgroup.controller_of::<CpuAcctController>() else {
        return;
    };
    let acct = acct.cpuacct();
    let usage = metrics
        .cpu
        .mut_or_insert_default()
        .usage
        .mut_or_insert_default();
    usage.total = acct.usage;
    usage.kernel = acct.usage_sys;
    usage.user = acct.usage_user;
    usage.per_cpu = acct
        .usage_percpu
        .split_whitespace()
        .filter_map(|v| v.parse().ok())
        .collect();
}

/// Fills `memory.usage` (usage, limit, max, failcnt) from the v1 memory controller.
fn add_memory_usage(cgroup: &Cgroup, metrics: &mut Metrics) {
    let Some(mem) = cgroup.controller_of::<MemController>() else {
        return;
    };
    let m = mem.memory_stat();
    let usage = metrics
        .memory
        .mut_or_insert_default()
        .usage
        .mut_or_insert_default();
    usage.usage = m.usage_in_bytes;
    usage.limit = u64::try_from(m.limit_in_bytes).unwrap_or(u64::MAX);
    usage.max = m.max_usage_in_bytes;
    usage.failcnt = m.fail_cnt;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_cgroup_metrics_have_the_containerd_type() {
        let Ok(any) = collect(std::process::id()) else {
            baton_prereq::missing(
                "cgroup metrics of this process unreadable: mount the cgroup hierarchies",
            );
            return;
        };
        assert!(
            any.type_url == "io.containerd.cgroups.v1.Metrics"
                || any.type_url == "io.containerd.cgroups.v2.Metrics",
            "{}",
            any.type_url
        );
        assert!(baton_cgroups::v2_path_of_pid(std::process::id()).is_some());
    }
}
