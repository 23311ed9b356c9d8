//! The mock NVIDIA kernel driver: a FUSE filesystem whose regular files stand in for `/dev/nvidiactl`,
//! `/dev/nvidiaN`, `/dev/nvidia-uvm` and `/dev/nvidia-uvm-tools`, answering NVIDIA ioctls through real
//! syscalls (FUSE restricted ioctls), plus `version` (like `/proc/driver/nvidia/version`) and
//! `state.json` (what the mock holds, for assertions).
//!
//! Start it in-process with [`MockDriver::mount`] or as a child process with [`MockDriverProcess::start`].
//!
//! Fidelity, and where it ends:
//! - FUSE restricted ioctls copy exactly `_IOC_SIZE(cmd)` bytes in and out, so the top-level params
//!   struct arrives and its status field goes back like with the real driver. RM_ALLOC tells NVOS21 from
//!   NVOS64 by size for the configured driver band and refuses other sizes with `EINVAL`.
//! - Nested pointers (a memory class's `NV_MEMORY_ALLOCATION_PARAMS`, `IOCTL_XFER_CMD`'s inner params)
//!   do not cross FUSE. The mock follows them itself in the caller's memory with `process_vm_readv` /
//!   `process_vm_writev` (as root), as the driver's `copy_from_user` would. When it cannot, a memory
//!   object is accounted with size 0 and `size_known: false`, and `IOCTL_XFER_CMD` fails with `EFAULT`.
//!   RM_CONTROL params behind the pointer are not read or filled.
//! - UVM commands are bare numbers: no data crosses FUSE, so they are accepted (return 0, `rmStatus`
//!   left as sent) and counted per file.
//! - A file's objects are freed at its FUSE RELEASE, the final release of the open file (after the last
//!   dup'd fd closes and the last mapping goes), as in the driver. FUSE sends RELEASE asynchronously, so
//!   it lands shortly after `close()` returns: poll with [`DriverState::wait_for`]. `REGISTER_FD` is
//!   recorded but does not pin the ctl file as it does in the driver.
//! - Device files are regular files served through the page cache: `mmap(MAP_SHARED)` of `nvidiaN` or
//!   `nvidiactl` works within the file size (the configured VRAM); pages read as zeros and written-back
//!   pages are dropped.
//! - Each GPU has `vram_mib` of video memory (default an H200's, [`DEFAULT_VRAM_MIB`]); video memory that
//!   does not fit in its GPU's free memory is refused with `NV_ERR_INSUFFICIENT_RESOURCES` (see [`rm`] for
//!   how an allocation's GPU is known and what is not modelled).

pub mod classes;
pub mod escapes;
pub mod fs;
pub mod nodes;
pub mod process;
pub mod rm;
pub mod state;
pub mod user_memory;

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use fuser::{BackgroundSession, Config, MountOption, SessionACL};

pub use process::{MockDriverProcess, ProcessError};
pub use state::{DriverState, StateError};

use self::fs::MockFs;
use self::nodes::Tree;
use self::rm::{Rm, RmConfig};

/// Driver version the mock reports unless told otherwise.
pub const DEFAULT_DRIVER_VERSION: &str = "595.45.04";

/// Video memory per GPU the mock has unless told otherwise, in MiB: an H200's, the GPU of the 580.159.04
/// recordings (/work/shared/gpu/580.159.04/README.md: "one NVIDIA H200 (143,771 MiB, ..."; nvidia-smi's
/// `memory.total` there: integration/golden/580.159.04/gpu-check-quick.report.json, machine.gpus).
/// Allocations past it are refused (see [`rm`]).
pub const DEFAULT_VRAM_MIB: u64 = 143_771;

/// How to mount the mock.
#[derive(Debug, Clone)]
pub struct MountOptions {
    /// Empty directory to mount on.
    pub mountpoint: PathBuf,
    /// Driver version to report and whose struct layouts to use, e.g. `595.45.04`.
    pub driver_version: String,
    /// Number of GPUs (`nvidia0`..`nvidia{gpus-1}`).
    pub gpus: u32,
    /// Video memory per GPU in MiB: each GPU's capacity, which its allocations never exceed.
    pub vram_mib: u64,
    /// How long each close of a device file takes (its FUSE flush, which close waits for): the driver's
    /// teardown in a close, which the release signal must wait out.
    pub close_delay: std::time::Duration,
}

impl MountOptions {
    /// Defaults (595.45.04, one GPU of [`DEFAULT_VRAM_MIB`], an H200's 143,771 MiB) at `mountpoint`.
    pub fn new(mountpoint: impl Into<PathBuf>) -> Self {
        Self {
            mountpoint: mountpoint.into(),
            driver_version: DEFAULT_DRIVER_VERSION.to_owned(),
            gpus: 1,
            vram_mib: DEFAULT_VRAM_MIB,
            close_delay: std::time::Duration::ZERO,
        }
    }

    /// The same options with closes of device files that take `delay`.
    pub fn with_close_delay(mut self, delay: std::time::Duration) -> Self {
        self.close_delay = delay;
        self
    }

    /// The same options with another driver version.
    pub fn with_driver_version(mut self, version: impl Into<String>) -> Self {
        self.driver_version = version.into();
        self
    }

    /// The same options with `gpus` GPUs.
    pub fn with_gpus(mut self, gpus: u32) -> Self {
        self.gpus = gpus;
        self
    }

    /// The same options with `vram_mib` MiB of video memory per GPU.
    pub fn with_vram_mib(mut self, vram_mib: u64) -> Self {
        self.vram_mib = vram_mib;
        self
    }

    fn vram_bytes(&self) -> u64 {
        self.vram_mib.saturating_mul(1024 * 1024)
    }
}

/// Failure to mount or unmount the mock.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    /// The options are unusable.
    #[error("invalid mock driver options for {mountpoint}: {reason}")]
    InvalidOptions {
        /// The mount point.
        mountpoint: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The FUSE mount failed.
    #[error(
        "cannot mount the mock NVIDIA driver on {mountpoint}: {source} (needs root or fusermount3 \
         from the fuse3 package, /dev/fuse, and an existing empty directory)"
    )]
    Mount {
        /// The mount point.
        mountpoint: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The unmount failed.
    #[error("cannot unmount the mock NVIDIA driver at {mountpoint}: {source}")]
    Unmount {
        /// The mount point.
        mountpoint: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

/// Namespace for starting the mock in this process.
#[derive(Debug)]
pub struct MockDriver;

impl MockDriver {
    /// Mounts the mock at `options.mountpoint` and serves it from a background thread until the
    /// returned handle is unmounted or dropped.
    pub fn mount(options: MountOptions) -> Result<MountedDriver, DriverError> {
        let invalid = |reason: String| DriverError::InvalidOptions {
            mountpoint: options.mountpoint.clone(),
            reason,
        };
        if options.gpus == 0 || options.gpus > escapes::MAX_GPUS {
            return Err(invalid(format!(
                "--gpus must be 1..={}, got {}",
                escapes::MAX_GPUS,
                options.gpus
            )));
        }
        let layout = escapes::layout_for(&options.driver_version).map_err(invalid)?;
        let rm = Arc::new(Mutex::new(Rm::new(RmConfig {
            driver_version: options.driver_version.clone(),
            gpus: options.gpus,
            vram_bytes_per_gpu: options.vram_bytes(),
        })));
        let tree = Tree::new(options.gpus, options.vram_bytes().max(1 << 20));
        let fs = MockFs::new(
            tree,
            Arc::clone(&rm),
            escapes::Escapes::new(layout),
            version_text(&options.driver_version),
        )
        .with_close_delay(options.close_delay);
        let mut config = Config::default();
        config.mount_options = vec![
            MountOption::FSName("baton-mock-nvidia".to_owned()),
            MountOption::Subtype("baton-mock-nvidia".to_owned()),
            MountOption::DefaultPermissions,
            MountOption::RW,
            MountOption::NoSuid,
        ];
        // allow_other: root, other users and containers' processes may all use the files.
        config.acl = SessionACL::All;
        let session = fuser::spawn_mount(fs, &options.mountpoint, &config).map_err(|source| {
            DriverError::Mount {
                mountpoint: options.mountpoint.clone(),
                source,
            }
        })?;
        Ok(MountedDriver {
            session: Some(session),
            mountpoint: options.mountpoint,
            rm,
        })
    }
}

/// A mounted mock; dropping it unmounts.
#[derive(Debug)]
pub struct MountedDriver {
    session: Option<BackgroundSession>,
    mountpoint: PathBuf,
    rm: Arc<Mutex<Rm>>,
}

impl MountedDriver {
    /// The mount point.
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// Path of a file of the mount, e.g. `nvidiactl`.
    pub fn path(&self, name: &str) -> PathBuf {
        self.mountpoint.join(name)
    }

    /// What the mock holds now (the same data as `state.json`).
    pub fn state(&self) -> DriverState {
        self.rm
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .snapshot()
    }

    /// Unmounts and waits for the serving thread. Files still open are cut off (lazy unmount and
    /// connection abort), like a driver unload would.
    pub fn unmount(mut self) -> Result<(), DriverError> {
        self.unmount_now()
    }

    fn unmount_now(&mut self) -> Result<(), DriverError> {
        let Some(session) = self.session.take() else {
            return Ok(());
        };
        let device = std::fs::metadata(&self.mountpoint).map(|m| m.dev()).ok();
        match session.umount_and_join() {
            Ok(()) => Ok(()),
            Err(source) => {
                force_unmount(&self.mountpoint, device);
                Err(DriverError::Unmount {
                    mountpoint: self.mountpoint.clone(),
                    source,
                })
            }
        }
    }
}

impl Drop for MountedDriver {
    fn drop(&mut self) {
        if let Err(error) = self.unmount_now() {
            eprintln!("baton-mock-nvidia: {error} (detached it instead)");
        }
    }
}

/// Detaches a busy mount and aborts its FUSE connection so nothing waits on it.
fn force_unmount(mountpoint: &Path, device: Option<u64>) {
    // Lazy unmount: new lookups fail at once, open files stay valid until closed.
    let _ = nix::mount::umount2(mountpoint, nix::mount::MntFlags::MNT_DETACH);
    if let Some(device) = device {
        let minor = nix::sys::stat::minor(device);
        let abort = format!("/sys/fs/fuse/connections/{minor}/abort");
        let _ = std::fs::write(abort, "1");
    }
}

/// The text of `/proc/driver/nvidia/version` for `driver_version`.
pub fn version_text(driver_version: &str) -> String {
    format!(
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  {driver_version}  Release Build  \
         (baton-mock-nvidia)  Thu Jan  1 00:00:00 UTC 2026\nGCC version:  gcc version 12.2.0 (Debian \
         12.2.0-14)\n"
    )
}

/// Why the mock cannot be mounted here, if it cannot: not root (tests mount with `allow_other`, which
/// needs root or `user_allow_other`) or no `/dev/fuse`. Tests hand it to `baton_prereq::missing`.
pub fn fuse_unavailable_reason() -> Option<String> {
    if !nix::unistd::geteuid().is_root() {
        return Some("mounting the mock NVIDIA driver needs root".to_owned());
    }
    if !Path::new("/dev/fuse").exists() {
        return Some("/dev/fuse is missing: load the fuse module (modprobe fuse)".to_owned());
    }
    None
}
