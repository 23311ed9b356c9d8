//! User-space half of Baton's NVIDIA driver probes.
//!
//! [`Tracer`] loads the eBPF object that build.rs built from `ebpf/probes` and embedded here, attaches it,
//! seeds its fd maps from /proc, and turns the ring-buffer records into decoded [`event::Event`]s while it
//! keeps, per container (cgroup v2 id), a [`ledger::ContainerLedger`] of live RM objects, GPU memory and UVM
//! state, and a [`fdtable::FdTable`] of the NVIDIA fds and mappings of every traced process and the open
//! files they refer to ([`files`]).
//!
//! Uprobes on the libcuda files of traced processes count each container's CUDA launches
//! ([`Tracer::launches`], [`launch`]).
//!
//! `baton trace` and `baton agent` use it; [`release`] confirms that the kernel has really released what a
//! container dropped, which the agent's release signal rests on.
pub use baton_cgroups as cgroups;
pub mod event;
pub mod fdtable;
pub mod files;
pub mod launch;
pub mod ledger;
pub mod probes;
pub mod proc_read;
pub mod release;
pub mod schema;
pub mod seed;
mod tracer;

pub use baton_probe_common::{
    DEFAULT_FD_QUOTA, LaunchCounts, LaunchFn, NV_FDS_BASE, NV_FDS_ENTRIES, NV_FDS_RESERVE,
    PENDING_OVERFLOW_PER_CGROUP,
};
pub use tracer::{
    GpuState, ReadTicket, ReconciledReads, Tracer, TracerConfig, TracerError, now_monotonic_ns,
};
