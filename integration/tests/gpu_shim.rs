//! The shim and the node agent on the real kernel: a container that sees the mock NVIDIA device files
//! (bind-mounted at /dev/nvidia*) and runs the mock CUDA workload is registered with an agent the shim starts
//! itself (none ran), watched from before its program starts, its acquire and release of the GPU are
//! published, and its ledger is logged at delete; a container without NVIDIA devices starts no agent, and
//! `ebpf = false` in the node's options TOML keeps a GPU container unwatched (a `baton.io/ebpf` annotation
//! is refused).
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use std::time::Duration;

use baton_integration::{
    TestEnv,
    agent::{device_mounts, install_workload},
    skip,
    trace_env::missing_trace_prerequisite,
};
use baton_mock_nvidia::driver::{MockDriver, MountOptions};

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
    let workload = install_workload(env.rootfs()).unwrap();
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

    // No agent ran: the shim started one (the `baton` beside it), detached, which watched the container.
    let log = wait_for_log(&env, "gpu: container released the GPU");
    assert!(
        log.contains("gpu: the agent watches the container"),
        "{log}"
    );
    assert!(log.contains("gpu: container acquired the GPU"), "{log}");
    assert!(
        env.containerd().agent_pid().is_some(),
        "the agent outlives the shim that started it"
    );
    let agent_log = env.containerd().agent_socket().with_file_name("agent.log");
    let mut deleted = String::new();
    let unwatched = baton_integration::agent::wait_until(Duration::from_secs(30), || {
        let text = std::fs::read_to_string(&agent_log).unwrap_or_default();
        deleted = text
            .lines()
            .find(|l| l.contains("agent: no longer watching container"))
            .unwrap_or_default()
            .to_owned();
        !deleted.is_empty()
    });
    assert!(unwatched, "the agent's log {}", agent_log.display());
    assert!(deleted.contains("live_objects=0"), "{deleted}");
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
    let annotated: Vec<&str> = flags.iter().map(String::as_str).collect();
    let annotated = env.run_args(
        "gpu-off-by-annotation",
        &[("baton.io/ebpf", "false")],
        &annotated,
        &["/bin/busybox", "ls", "/dev/nvidiactl"],
    );
    // The node turns the probes off (its options TOML).
    flags.extend(
        env.node_options_flags("ebpf-off.toml", "ebpf = false\n")
            .unwrap(),
    );
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let out = env.run(
        "gpu-but-off",
        &[],
        &flags,
        &["/bin/busybox", "ls", "/dev/nvidiactl"],
    );
    assert!(out.success(), "{}", out.stderr);
    // A shim logs its shutdown last: once both containers' shims have, whatever they logged is in the log.
    let log = wait_for_log_count(&env, "shim shutting down", 2);
    assert!(
        !log.contains("gpu: the agent watches the container"),
        "no agent watches these containers:\n{log}"
    );
    assert!(
        env.containerd().agent_pid().is_none(),
        "no agent was started for them"
    );
    // A tenant cannot: the annotation is refused, naming the key.
    let annotated: Vec<&str> = annotated.iter().map(String::as_str).collect();
    let out = env.ctr(&annotated);
    assert!(
        !out.success() && out.stderr.contains("baton.io/ebpf"),
        "{}",
        out.stderr
    );
}
