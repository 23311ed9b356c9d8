//! Node daemons do not hold the GPU (issue 29, item 2): dcgm-exporter, the device plugin and other NVML users
//! run in pods Baton does not watch and keep the device files open with no context and no device memory.
//! Where the node has NVML, the gate counts such an unwatched holder only when NVML lists it as a GPU user
//! (a context or device memory); where NVML cannot tell, its files count (`hidden_holders.rs`, with no NVML
//! on this machine). Real components: containerd, the Baton shim and agent, the FUSE mock driver, holder
//! containers (the daemon under containerd's own runc shim); NVML is the fake library (integration/fake-nvml),
//! which lists the processes holding a live RM client in the mock's state, as NVML lists those with a context.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use std::time::Duration;

use baton_integration::{
    agent::{container_status, wait_until},
    fake_nvml::FakeNvml,
    holder::{GpuRig, HolderContainer},
};

const WITHIN: Duration = Duration::from_secs(30);

/// Starts holder `id` behind the GPU-free gate (its Start returns once the gate opens).
fn start_behind_gate(rig: &GpuRig, id: &str) -> anyhow::Result<HolderContainer> {
    HolderContainer::start(
        &rig.env,
        id,
        rig.mock_dir.path(),
        &[("baton.io/wait-gpu-free", "1m")],
    )
}

#[test]
fn an_unwatched_daemon_with_open_device_files_does_not_shut_the_gate_and_one_with_a_context_does() {
    let Some(rig) = GpuRig::start("node-daemons") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let nvml =
        FakeNvml::install(dir.path(), rig.mock_dir.path(), Duration::from_millis(1)).unwrap();
    let log = dir.path().join("agent.log");
    let _agent = nvml
        .start_agent(&rig.env.containerd().agent_socket(), &log, &[])
        .unwrap();
    // A daemon as the device plugin is: the GPU's files open, no client.
    let mut daemon = HolderContainer::start_with_runtime(
        &rig.env,
        "daemon",
        rig.mock_dir.path(),
        "io.containerd.runc.v2",
    )
    .unwrap();
    let ctl = daemon.num("open nvidiactl").unwrap();
    daemon.num("open nvidia0").unwrap();
    let mut first = start_behind_gate(&rig, "first").unwrap();
    first.num("stamp").unwrap();
    // It goes (a Start let through holds its GPU's gate for it until it allocates, or goes).
    first.finish().unwrap();

    // The daemon makes a context (a client with device memory): now it holds the GPU.
    let alloc = daemon.cmd(&format!("alloc {ctl}")).unwrap();
    assert_eq!(alloc[1], "0", "{alloc:?}");
    std::thread::scope(|s| {
        let start = s.spawn(|| start_behind_gate(&rig, "second"));
        let socket = rig.env.containerd().agent_socket();
        assert!(
            wait_until(WITHIN, || container_status(&socket, "second")
                .ok()
                .flatten()
                .is_some()),
            "the gated container is registered"
        );
        assert!(
            !wait_until(Duration::from_millis(800), || start.is_finished()),
            "the gate opened while an unwatched process had a context on the GPU"
        );
        daemon.num(&format!("close {ctl}")).unwrap();
        let mut second = start.join().unwrap().unwrap();
        second.num("stamp").unwrap();
    });
    let log = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        log.contains("NVML loaded from"),
        "the agent used the fake NVML:\n{log}"
    );
}

/// CRI's annotations naming a container's pod, as a pod's container under containerd's runc has them.
fn pod_names<'a>(namespace: &'a str, pod: &'a str) -> [(&'a str, &'a str); 2] {
    [
        ("io.kubernetes.cri.sandbox-namespace", namespace),
        ("io.kubernetes.cri.sandbox-name", pod),
    ]
}

#[test]
fn a_daemon_of_an_exempt_pod_does_not_shut_the_gate_even_with_a_context_and_another_pod_does() {
    let Some(rig) = GpuRig::start("exempt-pods") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let nvml =
        FakeNvml::install(dir.path(), rig.mock_dir.path(), Duration::from_millis(1)).unwrap();
    let log = dir.path().join("agent.log");
    let state = rig.env.containerd().state_dir().display().to_string();
    let _agent = nvml
        .start_agent(
            &rig.env.containerd().agent_socket(),
            &log,
            &[
                "--exempt-pod",
                "gpu-operator/nvidia-dcgm-exporter-*",
                "--containerd-state",
                &state,
            ],
        )
        .unwrap();
    // dcgm-exporter of the GPU operator's DaemonSet, with a context on the GPU (NVML lists it): exempt by its
    // pod's name, which the agent reads from containerd's bundle of the container.
    let mut dcgm = HolderContainer::start_with_runtime_annotated(
        &rig.env,
        "dcgm",
        rig.mock_dir.path(),
        "io.containerd.runc.v2",
        &pod_names("gpu-operator", "nvidia-dcgm-exporter-7x2kq"),
    )
    .unwrap();
    let ctl = dcgm.num("open nvidiactl").unwrap();
    dcgm.num("open nvidia0").unwrap();
    assert_eq!(dcgm.cmd(&format!("alloc {ctl}")).unwrap()[1], "0");
    let mut first = start_behind_gate(&rig, "first").unwrap();
    first.num("stamp").unwrap();
    first.finish().unwrap();

    // Another pod's container with a context (its name only begins like the DaemonSet's namespace): held.
    let mut other = HolderContainer::start_with_runtime_annotated(
        &rig.env,
        "other",
        rig.mock_dir.path(),
        "io.containerd.runc.v2",
        &pod_names("default", "nvidia-dcgm-exporter-7x2kq"),
    )
    .unwrap();
    let ctl = other.num("open nvidiactl").unwrap();
    other.num("open nvidia0").unwrap();
    assert_eq!(other.cmd(&format!("alloc {ctl}")).unwrap()[1], "0");
    std::thread::scope(|s| {
        let start = s.spawn(|| start_behind_gate(&rig, "second"));
        let socket = rig.env.containerd().agent_socket();
        assert!(
            wait_until(WITHIN, || container_status(&socket, "second")
                .ok()
                .flatten()
                .is_some()),
            "the gated container is registered"
        );
        assert!(
            !wait_until(Duration::from_millis(800), || start.is_finished()),
            "the gate opened while a process of a pod not exempt had a context on the GPU"
        );
        other.num(&format!("close {ctl}")).unwrap();
        let mut second = start.join().unwrap().unwrap();
        second.num("stamp").unwrap();
    });
}
