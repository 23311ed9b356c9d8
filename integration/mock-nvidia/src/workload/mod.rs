//! The mock CUDA workload: drives a realistic CUDA call sequence through the NVIDIA device files with
//! real syscalls (open, ioctl, mmap, close), against the mock driver or anything else at `dev_dir`.
//!
//! [`Workload`] is the sequence, [`calls`] the single calls (tests use them for error cases), and
//! [`Summary`] what it did. [`restore`] is the in-process restore thread that `cuda-checkpoint` (or its
//! stand-in, `baton-mock-cuda-checkpoint`) drives over the [`control`] protocol; it parks and resumes the
//! workload as the real driver does ([`park`]), keeping the copy of device memory in the process's own
//! memory ([`host_copy`]); [`gate`] keeps the training loop out of CUDA calls while the process is locked.
//! [`worker`] forks a child after CUDA init that holds the inherited files and has no CUDA state of its own
//! (a DataLoader worker). [`launch`] calls kernel launches through a (fake) libcuda for the
//! launch-telemetry tests. [`race`] rewrites its own params after the driver answered (a hostile tenant).

pub mod callers;
pub mod calls;
pub mod control;
pub mod gate;
pub mod host_copy;
pub mod launch;
pub mod nvfile;
mod ops;
pub mod park;
pub mod process;
pub mod race;
pub mod receiver;
pub mod restore;
pub mod session;
pub mod summary;
pub mod weights;
pub mod worker;

use std::path::PathBuf;

pub use process::{Finished, WorkloadProcess, WorkloadProcessError};
pub use session::{Handles, MAP_BYTES, MemoryKind, SYSTEM_MAP_BYTES, Workload};
pub use summary::{FailedCall, Summary};

/// Prints `line` on stdout at once (tests wait for these lines); a closed stdout is ignored, so that it
/// cannot kill the workload mid-teardown.
pub fn say(line: &str) {
    use std::io::Write;
    let mut stdout = std::io::stdout().lock();
    let _ = writeln!(stdout, "{line}");
    let _ = stdout.flush();
}

/// How to run the workload.
#[derive(Debug, Clone)]
pub struct WorkloadOptions {
    /// Folder holding `nvidiactl`, `nvidia0`, `nvidia-uvm` (`/dev` on a real host).
    pub dev_dir: PathBuf,
    /// Training steps to run (`baton-mock-cuda` runs steps until stopped when 0).
    pub steps: u64,
    /// Milliseconds between steps.
    pub step_ms: u64,
    /// Video memory to allocate, in MiB.
    pub vram_mib: u64,
    /// Driver version whose struct layouts to use (and to present in `CHECK_VERSION_STR`).
    pub driver_version: String,
}

impl WorkloadOptions {
    /// Defaults against `dev_dir`: 3 steps 10 ms apart, 1024 MiB, driver 595.45.04.
    pub fn new(dev_dir: impl Into<PathBuf>) -> Self {
        Self {
            dev_dir: dev_dir.into(),
            steps: 3,
            step_ms: 10,
            vram_mib: 1024,
            driver_version: crate::driver::DEFAULT_DRIVER_VERSION.to_owned(),
        }
    }
}

/// Why the workload stopped.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// A device file could not be opened.
    #[error("cannot open {path}: {source} (is the NVIDIA driver or baton-mock-nvidia there?)")]
    Open {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// An ioctl failed at the syscall level (not an RM status).
    #[error("{call} on {path} failed: {source}")]
    Ioctl {
        /// The file.
        path: PathBuf,
        /// The escape or UVM command.
        call: String,
        /// The error.
        source: std::io::Error,
    },
    /// A params struct does not fit the 14-bit `_IOC` size field.
    #[error("{escape} params of {size} bytes do not fit an ioctl command")]
    ParamsTooLarge {
        /// The escape.
        escape: String,
        /// Its size.
        size: usize,
    },
    /// An RM call answered a status other than `NV_OK`.
    #[error("{call} returned RM status {status:#x} ({})", baton_nvidia::status::name(*status).unwrap_or("unknown"))]
    Status {
        /// The call.
        call: String,
        /// The status.
        status: u32,
    },
    /// mmap/munmap of the device file failed.
    #[error("mapping {path} failed: {source}")]
    Mmap {
        /// The device file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// `CARD_INFO` listed no GPU.
    #[error("the driver behind {path} reports no GPU")]
    NoGpu {
        /// The ctl file.
        path: PathBuf,
    },
    /// The driver did not recognize our version string.
    #[error(
        "driver version mismatch: workload built for {ours}, driver is {driver} (pass --driver-version {driver})"
    )]
    VersionMismatch {
        /// Our version.
        ours: String,
        /// The driver's.
        driver: String,
    },
    /// The driver version is not like `595.45.04`.
    #[error("driver version {version:?} is not like 595.45.04")]
    BadVersion {
        /// What was given.
        version: String,
    },
    /// A call needs a setup that is not there (released or never set up).
    #[error("the workload holds no GPU resources now (not set up, or released)")]
    NotSetUp,
    /// A resume found no park to resume from.
    #[error("the workload is not parked: there is nothing to resume")]
    NotParked,
    /// An fd could not be duplicated or reserved.
    #[error("{what} failed: {source}")]
    Fd {
        /// What was done.
        what: String,
        /// The error.
        source: std::io::Error,
    },
}

impl WorkloadError {
    /// Whether the driver refused an allocation for lack of GPU memory (the mock's status for a GPU past its
    /// capacity, `NV_ERR_INSUFFICIENT_RESOURCES`, or `NV_ERR_NO_MEMORY`).
    pub fn is_out_of_memory(&self) -> bool {
        use baton_nvidia::status::{NV_ERR_INSUFFICIENT_RESOURCES, NV_ERR_NO_MEMORY};
        matches!(self, Self::Status { status, .. }
            if *status == NV_ERR_INSUFFICIENT_RESOURCES || *status == NV_ERR_NO_MEMORY)
    }
}
