//! Task options as containerd's Go client (and so `ctr`) builds them: runc's `containerd.runc.v1.Options` for a
//! runtime named `io.containerd.runc.*`, the legacy `containerd.linux.runc.CreateOptions` for any other runtime
//! (containerd 1.6 client/task_opts_unix.go: WithNoPivotRoot, WithShimCgroup, WithUIDOwner, WithGIDOwner).
//! containerd 2.x dropped the legacy type (its task service answers "type with url
//! containerd.linux.runc.CreateOptions: not found") and its client sends `containerd.runc.v1.Options` for every
//! runtime, so the harness does as the client of the containerd under test does.

use prost::Message;
use prost_types::Any;

/// Type URL of runc's options.
pub const RUNC_OPTIONS_TYPE: &str = "containerd.runc.v1.Options";
/// Type URL of the legacy options the Go client sends a non-runc runtime.
pub const LEGACY_CREATE_OPTIONS_TYPE: &str = "containerd.linux.runc.CreateOptions";

/// The subset of `containerd.runc.v1.Options` (containerd api/types/runc/options/oci.proto) the tests set.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RuncOptions {
    /// Field 1.
    #[prost(bool, tag = "1")]
    pub no_pivot_root: bool,
    /// Field 2.
    #[prost(bool, tag = "2")]
    pub no_new_keyring: bool,
    /// Field 3.
    #[prost(string, tag = "3")]
    pub shim_cgroup: String,
    /// Field 4.
    #[prost(uint32, tag = "4")]
    pub io_uid: u32,
    /// Field 5.
    #[prost(uint32, tag = "5")]
    pub io_gid: u32,
    /// Field 6.
    #[prost(string, tag = "6")]
    pub binary_name: String,
}

/// Type URL of runc's checkpoint options.
pub const CHECKPOINT_OPTIONS_TYPE: &str = "containerd.runc.v1.CheckpointOptions";

/// The subset of `containerd.runc.v1.CheckpointOptions` (containerd api/types/runc/options/oci.proto) the
/// tests set.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CheckpointOptions {
    /// Field 1: stop the task after the dump.
    #[prost(bool, tag = "1")]
    pub exit: bool,
}

/// The subset of `containerd.linux.runc.CreateOptions` (containerd runtime/linux/runctypes/runc.proto) the
/// Go client fills in.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LegacyCreateOptions {
    /// Field 1.
    #[prost(bool, tag = "1")]
    pub no_pivot_root: bool,
    /// Field 8.
    #[prost(bool, tag = "8")]
    pub no_new_keyring: bool,
    /// Field 9.
    #[prost(string, tag = "9")]
    pub shim_cgroup: String,
    /// Field 10.
    #[prost(uint32, tag = "10")]
    pub io_uid: u32,
    /// Field 11.
    #[prost(uint32, tag = "11")]
    pub io_gid: u32,
}

/// What a test asks of the task, whatever the runtime.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TaskOptions {
    /// No pivot_root.
    pub no_pivot_root: bool,
    /// The cgroup the shim moves into.
    pub shim_cgroup: String,
    /// Owner of the stdio pipes.
    pub io_uid: u32,
    /// Group of the stdio pipes.
    pub io_gid: u32,
}

impl TaskOptions {
    /// The options `runtime` gets from the Go client of the containerd under test
    /// ([`crate::containerd::containerd_program`]) for these settings.
    pub fn for_runtime(&self, runtime: &str) -> Any {
        let major = crate::containerd::major_version()
            .unwrap_or_else(|error| panic!("choosing the task options' type: {error}"));
        if runtime.starts_with("io.containerd.runc") || major >= 2 {
            let options = RuncOptions {
                no_pivot_root: self.no_pivot_root,
                shim_cgroup: self.shim_cgroup.clone(),
                io_uid: self.io_uid,
                io_gid: self.io_gid,
                ..Default::default()
            };
            Any {
                type_url: RUNC_OPTIONS_TYPE.to_string(),
                value: options.encode_to_vec(),
            }
        } else {
            let options = LegacyCreateOptions {
                no_pivot_root: self.no_pivot_root,
                shim_cgroup: self.shim_cgroup.clone(),
                io_uid: self.io_uid,
                io_gid: self.io_gid,
                ..Default::default()
            };
            Any {
                type_url: LEGACY_CREATE_OPTIONS_TYPE.to_string(),
                value: options.encode_to_vec(),
            }
        }
    }
}
