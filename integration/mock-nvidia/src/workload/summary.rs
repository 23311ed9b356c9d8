//! What the workload did, written as JSON at the end (`--summary-json`) so tests can compare a tracer's
//! view with the truth.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Counts of everything the workload did over its whole life (all setup/release cycles).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// The workload's process id.
    pub pid: u32,
    /// The driver version whose struct layouts it used.
    pub driver_version: String,
    /// Successful allocations by class id (clients included, as `NV01_ROOT_CLIENT`).
    pub allocs_by_class: BTreeMap<u32, u64>,
    /// Successful `RM_FREE` calls.
    pub frees: u64,
    /// `RM_CONTROL` calls.
    pub controls: u64,
    /// Bytes of video memory asked for by successful allocations.
    pub vram_bytes_allocated: u64,
    /// Device files opened, by file name (`nvidiactl`, `nvidia0`, `nvidia-uvm`).
    pub fds_opened: BTreeMap<String, u64>,
    /// Device-file fds closed.
    pub fds_closed: u64,
    /// Frontend escapes sent (RM and others), by escape name.
    pub escapes: BTreeMap<String, u64>,
    /// UVM commands sent, by name.
    pub uvm_commands: BTreeMap<String, u64>,
    /// Successful `mmap`s of device files (a resume's, back at the old addresses, included).
    pub mmaps: u64,
    /// Training steps completed.
    pub steps: u64,
    /// Releases completed: SIGUSR1's orderly ones and parks.
    pub releases: u64,
    /// Re-acquires completed: SIGUSR2's and resumes.
    pub reacquires: u64,
    /// RM calls that answered a status other than `NV_OK`.
    pub failed_statuses: Vec<FailedCall>,
}

/// An RM call whose status was not `NV_OK`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FailedCall {
    /// What was called, e.g. `RM_ALLOC HOPPER_COMPUTE_A`.
    pub call: String,
    /// The status.
    pub status: u32,
    /// Its name from `baton-nvidia`, when known.
    pub status_name: Option<String>,
}

impl Summary {
    /// Whether every RM status was `NV_OK`.
    pub fn all_ok(&self) -> bool {
        self.failed_statuses.is_empty()
    }

    /// Number of successful allocations of `class`.
    pub fn allocs_of(&self, class: u32) -> u64 {
        self.allocs_by_class.get(&class).copied().unwrap_or(0)
    }
}
