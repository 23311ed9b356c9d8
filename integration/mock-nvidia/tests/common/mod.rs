//! Shared helpers of the mock driver's integration tests: skip loudly (fail in strict mode) without root/FUSE, mount a mock in
//! a temp dir, run the workload binary against it.

#![allow(dead_code)]

pub mod trainer;

use std::path::{Path, PathBuf};
use std::time::Duration;

use baton_mock_nvidia::driver::{self, MockDriver, MountOptions, MountedDriver};
use baton_mock_nvidia::workload::{Finished, WorkloadOptions, WorkloadProcess};
use tempfile::TempDir;

/// How long a workload may take for anything.
pub const TIMEOUT: Duration = Duration::from_secs(30);

/// The workload binary built with these tests.
pub fn cuda_binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_baton-mock-cuda"))
}

/// The driver binary built with these tests.
pub fn driver_binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_baton-mock-nvidia"))
}

/// `true` when FUSE mounts cannot be made here, after [`baton_prereq::missing`] printed why (`skipped: <test>:
/// <reason>`); in strict mode (tools/dev test, CI) that fails the test instead. `_test` is the caller's name,
/// which the prerequisite check takes from the test thread.
pub fn skip(_test: &str) -> bool {
    match driver::fuse_unavailable_reason() {
        Some(reason) => {
            baton_prereq::missing(&reason);
            true
        }
        None => false,
    }
}

/// A mock mounted in a fresh temp dir (unmounted before the dir is removed).
pub struct Mock {
    pub driver: MountedDriver,
    _dir: TempDir,
}

impl Mock {
    /// Mounts a mock of `version` with `vram_mib` MiB on one GPU.
    pub fn mount(version: &str, vram_mib: u64) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let options = MountOptions::new(dir.path())
            .with_driver_version(version)
            .with_vram_mib(vram_mib);
        let driver = MockDriver::mount(options).expect("mount the mock driver");
        Self { driver, _dir: dir }
    }

    /// The mount point (the workload's `--dev-dir`).
    pub fn dir(&self) -> &Path {
        self.driver.mountpoint()
    }

    /// State as any process sees it: read through the mount's `state.json`.
    pub fn state(&self) -> driver::DriverState {
        driver::DriverState::read(self.dir()).expect("read state.json")
    }

    /// State once `done` holds (FUSE releases arrive asynchronously after `close()`), or after
    /// [`TIMEOUT`]; the caller asserts on it.
    pub fn state_when(
        &self,
        done: impl FnMut(&driver::DriverState) -> bool,
    ) -> driver::DriverState {
        driver::DriverState::wait_for(self.dir(), TIMEOUT, done).expect("read state.json")
    }

    /// Returns once every RELEASE the kernel queued before this call has reached the mock, so that a test
    /// can assert that one was *not* sent. Closing a file queues its RELEASE before close() returns, and FUSE
    /// delivers them in order: this closes a file of its own and waits for that file's release.
    pub fn releases_delivered(&self) {
        let before = self.state().files_named("nvidiactl").count();
        let own = std::fs::File::open(self.dir().join("nvidiactl")).expect("open nvidiactl");
        assert_eq!(self.state().files_named("nvidiactl").count(), before + 1);
        drop(own);
        self.state_when(|s| s.files_named("nvidiactl").count() <= before);
    }

    /// State once every file is released (or after [`TIMEOUT`]).
    pub fn idle_state(&self) -> driver::DriverState {
        self.state_when(driver::DriverState::is_idle)
    }

    /// Workload options against this mock.
    pub fn workload(&self, version: &str) -> WorkloadOptions {
        WorkloadOptions {
            driver_version: version.to_owned(),
            vram_mib: 512,
            steps: 2,
            step_ms: 5,
            ..WorkloadOptions::new(self.dir())
        }
    }

    /// Runs the workload binary to completion.
    pub fn run_workload(&self, options: &WorkloadOptions) -> Finished {
        WorkloadProcess::start(&cuda_binary(), options, false)
            .expect("start baton-mock-cuda")
            .finish(TIMEOUT)
            .expect("wait for baton-mock-cuda")
    }
}
