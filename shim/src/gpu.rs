//! The seam where Baton's eBPF GPU tracer plugs into the shim.
//!
//! The task service calls [`GpuTracing::container_started`] once a container's init process runs
//! (after Start, or after a restore), and [`GpuTracing::container_deleted`] when the container is
//! deleted. Neither can fail the container: the requirement is "if the eBPF probes cannot load,
//! containers still run (plain runc wrapper) and the reason is logged once". Until the tracer is
//! wired in, it only logs that tracing is disabled, once per shim.

use std::sync::atomic::{AtomicBool, Ordering};

use crate::options::BatonSettings;

/// What the tracer needs to know about a started container.
#[derive(Debug, Clone, Copy)]
pub struct StartedContainer<'a> {
    /// Container id.
    pub id: &'a str,
    /// Pid of the init process (host pid namespace).
    pub init_pid: u32,
    /// cgroup v2 path of the container (the `0::` line of /proc/<pid>/cgroup), if any.
    pub cgroup_v2_path: Option<&'a str>,
    /// Baton settings after the TOML / pod / container layering.
    pub settings: &'a BatonSettings,
}

/// The GPU tracing hook of one shim (one per shim, shared by its containers).
#[derive(Debug, Default)]
pub struct GpuTracing {
    reason_logged: AtomicBool,
}

impl GpuTracing {
    /// A hook with tracing not yet wired.
    pub fn new() -> Self {
        Self::default()
    }

    fn log_disabled_once(&self) {
        if !self.reason_logged.swap(true, Ordering::SeqCst) {
            tracing::info!("gpu tracing: disabled (not yet wired)");
        }
    }

    /// A container's init process is running. Never fails the container.
    pub fn container_started(&self, container: &StartedContainer<'_>) {
        if container.settings.ebpf {
            self.log_disabled_once();
        }
        tracing::debug!(
            id = container.id,
            pid = container.init_pid,
            cgroup = container.cgroup_v2_path.unwrap_or(""),
            "gpu seam: container started"
        );
    }

    /// A container was deleted: drop whatever was attached for it.
    pub fn container_deleted(&self, id: &str) {
        tracing::debug!(id, "gpu seam: container deleted");
    }
}
