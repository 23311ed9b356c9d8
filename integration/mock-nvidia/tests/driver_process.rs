//! The `baton-mock-nvidia` binary: prints `ready`, serves the device files, `version` and `state.json`
//! to other processes, and unmounts on SIGTERM.

mod common;

use baton_mock_nvidia::driver::{MockDriverProcess, MountOptions};
use baton_nvidia::layout::DriverVersion;
use common::{TIMEOUT, cuda_binary, driver_binary, skip};

fn is_mounted(dir: &std::path::Path) -> bool {
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").expect("read mountinfo");
    let dir = dir.to_str().expect("UTF-8 temp dir");
    mounts
        .lines()
        .any(|line| line.split(' ').nth(4) == Some(dir))
}

#[test]
fn binary_serves_until_sigterm_and_unmounts() {
    if skip("binary_serves_until_sigterm_and_unmounts") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let options = MountOptions::new(dir.path())
        .with_driver_version("535.183.01")
        .with_gpus(2);
    let driver = MockDriverProcess::start(&driver_binary(), &options).unwrap();
    assert!(is_mounted(dir.path()));
    let mut names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|entry| entry.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "nvidia-uvm",
            "nvidia-uvm-tools",
            "nvidia0",
            "nvidia1",
            "nvidiactl",
            "state.json",
            "version"
        ]
    );
    let version = std::fs::read_to_string(dir.path().join("version")).unwrap();
    assert_eq!(
        DriverVersion::find_in_text(&version),
        DriverVersion::parse("535.183.01"),
        "{version}"
    );
    let mut workload = baton_mock_nvidia::workload::WorkloadProcess::start(
        &cuda_binary(),
        &baton_mock_nvidia::workload::WorkloadOptions {
            driver_version: "535.183.01".to_owned(),
            ..baton_mock_nvidia::workload::WorkloadOptions::new(dir.path())
        },
        true,
    )
    .unwrap();
    workload.wait_for_line("phase holding", TIMEOUT).unwrap();
    let state = driver.state().unwrap();
    assert_eq!(state.gpus, 2);
    assert_eq!(
        state.files.len(),
        7,
        "ctl, nvidia0, two uvm, the OS-event nvidia0, and the two files the mappings hold: {:#?}",
        state.files
    );
    let finished = workload.finish(TIMEOUT).unwrap();
    assert!(finished.status.success(), "{finished:#?}");
    driver.stop().unwrap();
    assert!(!is_mounted(dir.path()), "unmounted on SIGTERM");
}

#[test]
fn bad_options_are_refused_before_mounting() {
    let dir = tempfile::tempdir().unwrap();
    let options = MountOptions::new(dir.path()).with_driver_version("not-a-version");
    let error = baton_mock_nvidia::driver::MockDriver::mount(options).unwrap_err();
    assert!(error.to_string().contains("595.45.04"), "{error}");
    let options = MountOptions::new(dir.path()).with_gpus(0);
    let error = baton_mock_nvidia::driver::MockDriver::mount(options).unwrap_err();
    assert!(error.to_string().contains("--gpus"), "{error}");
}
