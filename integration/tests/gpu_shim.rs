//! The shim's GPU tracing on the real kernel: a container that sees the mock NVIDIA device files (bind-mounted
//! at /dev/nvidia*) and runs the mock CUDA workload is watched from before its program starts, its release of
//! the GPU is noticed, and its ledger is logged at delete; a container without NVIDIA devices loads nothing,
//! and `baton.io/ebpf=false` turns tracing off.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use std::{path::Path, time::Duration};

use baton_integration::{
    TestEnv, skip,
    trace_env::{missing_trace_prerequisite, workspace_binary},
};
use baton_mock_nvidia::driver::{MockDriver, MountOptions};

/// Copies the mock workload and the shared libraries it links into the container's rootfs.
fn install_workload(rootfs: &Path) -> String {
    let bin = workspace_binary("baton-mock-nvidia", "baton-mock-cuda").unwrap();
    let ldd = std::process::Command::new("ldd")
        .arg(&bin)
        .output()
        .unwrap();
    for lib in String::from_utf8_lossy(&ldd.stdout)
        .split_whitespace()
        .filter(|w| w.starts_with('/'))
    {
        let dst = rootfs.join(lib.trim_start_matches('/'));
        std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
        std::fs::copy(lib, &dst).unwrap();
    }
    std::fs::copy(&bin, rootfs.join("bin/baton-mock-cuda")).unwrap();
    "/bin/baton-mock-cuda".to_owned()
}

fn device_mounts(mock_dir: &Path) -> Vec<String> {
    ["nvidiactl", "nvidia0", "nvidia-uvm", "nvidia-uvm-tools"]
        .iter()
        .flat_map(|n| {
            [
                "--mount".to_owned(),
                format!(
                    "type=bind,src={}/{n},dst=/dev/{n},options=rbind:rw",
                    mock_dir.display()
                ),
            ]
        })
        .collect()
}

fn wait_for_log(env: &TestEnv, needle: &str) -> String {
    wait_for_log_count(env, needle, 1)
}

/// containerd's log once it holds `needle` at least `count` times (polled, with a deadline).
fn wait_for_log_count(env: &TestEnv, needle: &str, count: usize) -> String {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while std::time::Instant::now() < deadline {
        let log = std::fs::read_to_string(env.containerd().log_path()).unwrap_or_default();
        if log.matches(needle).count() >= count {
            return log;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!(
        "{needle:?} not {count} times in containerd's log:\n{}",
        env.containerd().log_tail(60)
    );
}

fn prerequisites() -> bool {
    if let Some(reason) = missing_trace_prerequisite() {
        skip::missing(&reason);
        return false;
    }
    true
}

#[test]
fn a_gpu_container_is_traced_from_its_first_call_and_its_release_is_noticed() {
    if !prerequisites() {
        return;
    }
    let Some(env) = TestEnv::start("gpu-traced") else {
        return;
    };
    if !env.is_baton() {
        skip::not_applicable("GPU tracing is Baton's: not checked against another runtime");
        return;
    }
    let mock_dir = tempfile::tempdir().unwrap();
    let _mock = MockDriver::mount(MountOptions::new(mock_dir.path())).unwrap();
    let workload = install_workload(env.rootfs());
    let mut flags: Vec<String> = device_mounts(mock_dir.path());
    flags.push("--rm".into());
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let out = env.run(
        "trainer",
        &[],
        &flags,
        &[
            &workload,
            "--dev-dir",
            "/dev",
            "--steps",
            "2",
            "--vram-mib",
            "640",
        ],
    );
    assert!(
        out.success(),
        "workload in the container failed: {}\n{}",
        out.stderr,
        env.containerd().log_tail(40)
    );

    let log = wait_for_log(&env, "gpu tracing: container deleted");
    assert!(log.contains("gpu tracing: probes loaded"), "{log}");
    assert!(log.contains("gpu tracing: watching container"), "{log}");
    assert!(log.contains("container acquired GPU state"), "{log}");
    assert!(log.contains("container released the GPU"), "{log}");
    let deleted = log
        .lines()
        .find(|l| l.contains("gpu tracing: container deleted"))
        .unwrap();
    assert!(
        deleted.contains("live_objects=0") && deleted.contains("open_fds=0"),
        "{deleted}"
    );
    assert!(
        deleted.contains(&format!("peak_vram_bytes={}", 640u64 << 20)),
        "the allocation was seen: {deleted}"
    );
}

#[test]
fn containers_without_nvidia_devices_or_with_ebpf_off_load_no_probes() {
    if !prerequisites() {
        return;
    }
    let Some(env) = TestEnv::start("gpu-off") else {
        return;
    };
    if !env.is_baton() {
        skip::not_applicable("GPU tracing is Baton's: not checked against another runtime");
        return;
    }
    let out = env.run("plain", &[], &["--rm"], &["/bin/busybox", "true"]);
    assert!(out.success(), "{}", out.stderr);

    let mock_dir = tempfile::tempdir().unwrap();
    let _mock = MockDriver::mount(MountOptions::new(mock_dir.path())).unwrap();
    let mut flags = device_mounts(mock_dir.path());
    flags.push("--rm".into());
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let out = env.run(
        "gpu-but-off",
        &[("baton.io/ebpf", "false")],
        &flags,
        &["/bin/busybox", "ls", "/dev/nvidiactl"],
    );
    assert!(out.success(), "{}", out.stderr);
    // A shim logs its shutdown last: once both containers' shims have, whatever they logged is in the log.
    let log = wait_for_log_count(&env, "shim shutting down", 2);
    assert!(
        !log.contains("gpu tracing: probes loaded"),
        "no probes for these containers:\n{log}"
    );
}
