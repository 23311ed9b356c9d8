//! The mock's files bind-mounted one by one onto plain files elsewhere (what a container runtime does
//! for /dev/nvidiactl etc.) still work: the workload runs through the bind mounts.

mod common;

use std::path::PathBuf;

use common::{Mock, skip};
use nix::mount::{MntFlags, MsFlags, mount, umount2};

/// Bind mounts made by the test, undone on drop even when the test fails.
struct Binds(Vec<PathBuf>);

impl Drop for Binds {
    fn drop(&mut self) {
        for target in &self.0 {
            let _ = umount2(target, MntFlags::MNT_DETACH);
        }
    }
}

#[test]
fn workload_runs_through_bind_mounted_device_files() {
    if skip("workload_runs_through_bind_mounted_device_files") {
        return;
    }
    let mock = Mock::mount("595.45.04", 4096);
    let dev = tempfile::tempdir().expect("temp dev dir");
    let mut binds = Binds(Vec::new());
    for name in ["nvidiactl", "nvidia0", "nvidia-uvm", "nvidia-uvm-tools"] {
        let target = dev.path().join(name);
        std::fs::write(&target, b"").expect("bind target");
        mount(
            Some(&mock.dir().join(name)),
            &target,
            None::<&str>,
            MsFlags::MS_BIND,
            None::<&str>,
        )
        .expect("bind mount");
        binds.0.push(target);
    }
    let mut options = mock.workload("595.45.04");
    options.dev_dir = dev.path().to_owned();
    let finished = mock.run_workload(&options);
    assert!(finished.status.success(), "{finished:#?}");
    let summary = finished.summary.expect("summary");
    let state = mock.idle_state();
    assert!(state.is_idle(), "{state:#?}");
    // The mock served every open made through the bind mounts.
    let opened: u64 = summary.fds_opened.values().sum();
    assert_eq!(state.totals.opens, opened);
    drop(binds);
}
