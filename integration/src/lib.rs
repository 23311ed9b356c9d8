//! Test harness for Baton's integration tests: private containerd instances, busybox rootfs bundles, the mock NVIDIA driver mounted through FUSE, and loud skips.
//!
//! The containerd side: [`TestEnv::start`] checks the prerequisites (a missing one skips loudly, or fails the
//! test in strict mode: see [`skip`] and the `baton-prereq` crate), builds or finds the shim under test, makes a busybox rootfs and starts a private containerd 1.6 with
//! its own root, state and socket in a temporary folder. Tests drive it with `ctr` ([`Containerd::ctr`]) and with
//! containerd's gRPC API ([`Api`]) for what `ctr` 1.6 cannot do (update, resize, runtime options, events).
//! Dropping the environment kills what the test left (container processes, shims, containerd), deletes runc
//! state, unmounts and removes the cgroups, even when the test panicked.

pub mod agent;
pub mod agent_steps;
pub mod analog;
pub mod api;
pub mod browser;
pub mod cleanup;
pub mod containerd;
pub mod cri;
pub mod cuda;
pub mod env;
pub mod fake_nvml;
pub mod fifo;
pub mod gpu_check;
pub mod holder;
pub mod kube;
pub mod metrics;
pub mod oci_hooks;
pub mod procs;
pub mod rootfs;
pub mod shim_binary;
pub mod shim_ttrpc;
pub mod skip;
pub mod task_options;
pub mod trace_env;

pub use api::{Api, EventLog, TaskEvent};
pub use containerd::{Containerd, CtrOutput};
pub use env::TestEnv;

/// Writes `text` to `path` as an executable script (mode 0755): a runc wrapper, a logging binary, a hook.
pub fn write_script(path: &std::path::Path, text: &str) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::write(path, text)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
}
