//! Kubernetes through CRI, with no kubelet: containerd's CRI plugin with runtime handler `baton` (what a
//! RuntimeClass names) runs a pod the way the kubelet asks for one (RunPodSandbox, CreateContainer,
//! StartContainer, ExecSync, StopPodSandbox, RemovePodSandbox). The pod runs under one Baton shim; the
//! handler's options TOML (runc's `Root`, Baton's `agent_socket`) and the pod's and container's `baton.io/`
//! annotations reach it; the node agent watches the pod's GPU container (the mock driver's device files
//! mounted in through CRI mounts) and sees its GPU memory. Unknown Baton options or annotations fail
//! RunPodSandbox (or StartContainer) with a message naming the key and listing the known ones, and leave
//! nothing behind.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use std::path::{Path, PathBuf};
use std::time::Duration;

use baton_integration::agent::{AgentProcess, container_status_when, wait_until};
use baton_integration::cri::client::{Error, pid_from_info};
use baton_integration::cri::{CriNode, Handler, runc_root_in};
use baton_integration::shim_binary::BATON_SHIM_NAME;
use baton_integration::{skip, trace_env::missing_trace_prerequisite};
use baton_mock_nvidia::driver::{MockDriver, MountOptions};
use k8s_cri::v1::{
    ContainerConfig, ContainerMetadata, ContainerState, ImageSpec as CriImage,
    LinuxContainerConfig, LinuxContainerSecurityContext, Mount, NamespaceMode, NamespaceOption,
    PodSandboxConfig, PodSandboxState,
};
use serde_json::{Value, json};

const WITHIN: Duration = Duration::from_secs(60);
const GPU_IMAGE: &str = "baton.invalid/gpu:it";
const DEVICES: [&str; 4] = ["nvidiactl", "nvidia0", "nvidia-uvm", "nvidia-uvm-tools"];
const VRAM_MIB: u64 = 64;

/// The agent the handlers' options name (the shim would otherwise use `$BATON_AGENT_SOCKET`, and start one).
fn agent_socket(dir: &Path) -> PathBuf {
    dir.join("node-agent.sock")
}

/// The `baton` handler's options: a private runc root and the test's agent, no autostart.
fn node_options(dir: &Path) -> String {
    format!(
        "Root = \"{}\"\nagent_socket = \"{}\"\nagent_autostart = false\nebpf = true\n",
        runc_root_in(dir).display(),
        agent_socket(dir).display()
    )
}

fn baton_handler(dir: &Path) -> Handler {
    Handler {
        name: "baton".into(),
        options: node_options(dir),
    }
}

fn prerequisites() -> bool {
    if let Some(reason) = missing_trace_prerequisite() {
        skip::missing(&reason);
        return false;
    }
    true
}

fn host_network() -> NamespaceOption {
    NamespaceOption {
        network: NamespaceMode::Node.into(),
        ..Default::default()
    }
}

/// A container of `image` sleeping, with the mock devices at /dev/nvidia* (when `mock_dir` is given).
fn container_config(
    name: &str,
    mock_dir: Option<&Path>,
    annotations: &[(&str, &str)],
) -> ContainerConfig {
    let mounts = mock_dir
        .map(|dir| {
            DEVICES
                .iter()
                .map(|device| Mount {
                    container_path: format!("/dev/{device}"),
                    host_path: dir.join(device).display().to_string(),
                    ..Default::default()
                })
                .collect()
        })
        .unwrap_or_default();
    ContainerConfig {
        metadata: Some(ContainerMetadata {
            name: name.to_string(),
            attempt: 0,
        }),
        image: Some(CriImage {
            image: GPU_IMAGE.to_string(),
            ..Default::default()
        }),
        command: vec!["/bin/sleep".into(), "2147483647".into()],
        mounts,
        annotations: annotations
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        log_path: format!("{name}.log"),
        linux: Some(LinuxContainerConfig {
            security_context: Some(LinuxContainerSecurityContext {
                namespace_options: Some(host_network()),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn ppid(pid: i32) -> i32 {
    procfs::process::Process::new(pid)
        .and_then(|p| p.stat())
        .map(|s| s.ppid)
        .unwrap_or_default()
}

/// The agent's status of container `id`, once `cond` holds for it (polled, with a deadline).
fn agent_status_when(socket: &Path, id: &str, cond: impl Fn(&Value) -> bool) -> Value {
    container_status_when(socket, id, WITHIN, cond)
        .unwrap_or_else(|last| panic!("agent status of {id}: {last}"))
}

#[test]
fn a_baton_pod_runs_under_one_shim_with_its_options_and_annotations_and_is_watched() {
    if !prerequisites() {
        return;
    }
    // The mock driver outlives the node (dropped after it): its devices are unmounted once no container
    // holds them.
    let mock_dir = tempfile::tempdir().unwrap();
    let _mock = MockDriver::mount(MountOptions::new(mock_dir.path())).unwrap();
    let Some(node) = CriNode::start("cri-pod", |dir| vec![baton_handler(dir)]) else {
        return;
    };
    let cri = node.client();
    let workload = node.import_gpu_image(GPU_IMAGE).unwrap();
    let socket = agent_socket(node.dir());
    let _agent = AgentProcess::start(&socket, &node.dir().join("node-agent.log")).unwrap();

    let sandbox = node.sandbox_config("gpu-pod", &[("baton.io/role", "co-runner")]);
    let pod = cri.run_pod_sandbox(&sandbox, "baton").unwrap();
    let config = container_config(
        "trainer",
        Some(mock_dir.path()),
        &[("baton.io/yields-to", "default/llm")],
    );
    let id = cri.create_container(&pod, &config, &sandbox).unwrap();
    cri.start_container(&id).unwrap();

    // One Baton shim serves the pod: the sandbox's process and the container's are its children.
    let shims = node.shims();
    assert_eq!(shims.len(), 1, "one shim for the pod: {shims:?}");
    let shim = &shims[0];
    assert_eq!(
        Path::new(&shim.cmdline[0]).file_name(),
        Some(BATON_SHIM_NAME.as_ref()),
        "{shim:?}"
    );
    let sandbox_pid = pid_from_info(&cri.pod_sandbox_status(&pod).unwrap().info).unwrap();
    let container_pid = pid_from_info(&cri.container_status(&id).unwrap().info).unwrap();
    assert_eq!(ppid(sandbox_pid), shim.pid, "the sandbox's pause process");
    assert_eq!(ppid(container_pid), shim.pid, "the container's init");

    // The options TOML reached the shim (through the file its ConfigPath names on 1.x, as the options table's
    // `config_body` on 2.x, see baton_integration::cri): runc state under its Root (per namespace, as runc-v2
    // keeps it), the agent at its agent_socket (with autostart off, only this agent can have been told of the
    // container).
    for container in [&pod, &id] {
        assert!(
            node.runc_root().join("k8s.io").join(container).is_dir(),
            "runc state of {container} under the handler's Root {}",
            node.runc_root().display()
        );
    }
    // The pod's annotation (role), the container's (yields-to), the pod's name from CRI's annotations, and the
    // mock devices mounted in.
    let status = agent_status_when(&socket, &id, |s| !s.is_null());
    assert_eq!(status["namespace"], json!("k8s.io"), "{status}");
    assert_eq!(status["role"]["role"], json!("co-runner"), "{status}");
    assert_eq!(status["role"]["pod"], json!("default/gpu-pod"), "{status}");
    assert_eq!(
        status["role"]["yields_to"],
        json!(["default/llm"]),
        "{status}"
    );
    let devices = status["devices"].as_array().cloned().unwrap_or_default();
    assert!(
        devices
            .iter()
            .any(|d| d.as_str().is_some_and(|d| d.ends_with("nvidiactl"))),
        "{status}"
    );

    // ExecSync runs the mock CUDA workload in the container; the agent sees its video memory.
    let vram = VRAM_MIB.to_string();
    let run = cri
        .exec_sync(
            &id,
            &[
                &workload,
                "--dev-dir",
                "/dev",
                "--steps",
                "2",
                "--vram-mib",
                &vram,
            ],
            WITHIN,
        )
        .unwrap();
    assert_eq!(
        run.exit_code,
        0,
        "workload: {}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    agent_status_when(&socket, &id, |s| {
        s["peak_vram_bytes"] == json!(VRAM_MIB << 20) && s["gpu"] == json!("released")
    });

    // An exec of a missing binary fails clearly; the pod, its shim and later execs are unharmed.
    match cri.exec_sync(&id, &["/bin/no-such-binary"], WITHIN) {
        Err(error @ Error::Rpc { .. }) => {
            assert!(error.message().contains("no-such-binary"), "{error}")
        }
        Err(other) => panic!("exec of a missing binary: {other}"),
        Ok(reply) => assert_ne!(reply.exit_code, 0, "exec of a missing binary succeeded"),
    }
    let echo = cri
        .exec_sync(&id, &["/bin/busybox", "echo", "still-here"], WITHIN)
        .unwrap();
    assert_eq!(
        (echo.exit_code, String::from_utf8_lossy(&echo.stdout).trim()),
        (0, "still-here")
    );
    let state = cri.container_status(&id).unwrap().status.unwrap().state;
    assert_eq!(state, i32::from(ContainerState::ContainerRunning));
    let pod_state = cri.pod_sandbox_status(&pod).unwrap().status.unwrap().state;
    assert_eq!(pod_state, i32::from(PodSandboxState::SandboxReady));
    let pids: Vec<i32> = node.shims().iter().map(|s| s.pid).collect();
    assert_eq!(pids, vec![shim.pid], "the same shim serves the pod");

    // Stop and remove: nothing of the pod is left.
    cri.stop_pod_sandbox(&pod).unwrap();
    let state = cri.container_status(&id).unwrap().status.unwrap().state;
    assert_eq!(state, i32::from(ContainerState::ContainerExited));
    cri.remove_pod_sandbox(&pod).unwrap();
    assert!(cri.list_pod_sandboxes().unwrap().is_empty());
    assert_nothing_left(&node, "the removed pod");
    agent_status_when(&socket, &id, Value::is_null);
}

/// Nothing of a pod is left: no shim, no sandbox or container in containerd, no runc state, no cgroup, no
/// mount (waited for: a shim exits shortly after containerd has let go of it).
fn assert_nothing_left(node: &CriNode, what: &str) {
    let gone = wait_until(WITHIN, || node.shims().is_empty());
    assert!(gone, "{what}: shims left: {:?}", node.shims());
    let containers = node
        .containerd()
        .ctr_ok(&["containers", "ls", "-q"])
        .unwrap();
    assert!(
        containers.trim().is_empty(),
        "{what}: containers left: {containers}"
    );
    assert!(
        node.runc_containers().is_empty(),
        "{what}: runc containers left: {:?}",
        node.runc_containers()
    );
    let cgroups_gone = wait_until(WITHIN, || node.cgroups_left().is_empty());
    assert!(
        cgroups_gone,
        "{what}: cgroups left: {:?}",
        node.cgroups_left()
    );
    assert!(
        node.mounts_left().is_empty(),
        "{what}: mounts left: {:?}",
        node.mounts_left()
    );
}

/// RunPodSandbox that must fail; returns the runtime's message.
fn refused(node: &CriNode, sandbox: &PodSandboxConfig, handler: &str) -> String {
    match node.client().run_pod_sandbox(sandbox, handler) {
        Ok(pod) => panic!("RunPodSandbox with handler {handler} succeeded: {pod}"),
        Err(error) => error.message(),
    }
}

#[test]
fn unknown_baton_options_or_annotations_fail_the_pod_clearly_and_leave_nothing() {
    if !prerequisites() {
        return;
    }
    let Some(node) = CriNode::start("cri-bad-input", |dir| {
        vec![
            baton_handler(dir),
            Handler {
                name: "baton-typo".into(),
                options: format!("{}Colour = \"blue\"\n", node_options(dir)),
            },
        ]
    }) else {
        return;
    };
    node.import_gpu_image(GPU_IMAGE).unwrap();
    let socket = agent_socket(node.dir());
    let _agent = AgentProcess::start(&socket, &node.dir().join("node-agent.log")).unwrap();
    let cri = node.client();

    // An options table with a key Baton does not know.
    let message = refused(&node, &node.sandbox_config("typo-pod", &[]), "baton-typo");
    assert!(
        message.contains("unknown key \"Colour\"") && message.contains("known keys are BinaryName"),
        "{message}"
    );
    assert!(cri.list_pod_sandboxes().unwrap().is_empty());
    assert_nothing_left(&node, "the pod refused for its options");

    // A pod annotation with a key Baton does not know.
    let colourful = node.sandbox_config("annotated-pod", &[("baton.io/colour", "blue")]);
    let message = refused(&node, &colourful, "baton");
    assert!(
        message.contains("pod annotation \"baton.io/colour\"")
            && message.contains("known annotations are")
            && message.contains("baton.io/role"),
        "{message}"
    );
    assert!(cri.list_pod_sandboxes().unwrap().is_empty());
    assert_nothing_left(&node, "the pod refused for its annotation");

    // The same pod without the typo runs (nothing of the refused one, its name included, was kept); a
    // container with an unknown annotation is refused at start and the pod keeps running.
    let sandbox = node.sandbox_config("annotated-pod", &[]);
    let pod = cri.run_pod_sandbox(&sandbox, "baton").unwrap();
    let typo = container_config("typo", None, &[("baton.io/colour", "blue")]);
    // containerd creates the task (and so asks the shim) at StartContainer.
    let typo_id = cri.create_container(&pod, &typo, &sandbox).unwrap();
    let message = match cri.start_container(&typo_id) {
        Ok(()) => panic!("a container with baton.io/colour was started: {typo_id}"),
        Err(error) => error.message(),
    };
    assert!(
        message.contains("container annotation \"baton.io/colour\""),
        "{message}"
    );
    let pod_state = cri.pod_sandbox_status(&pod).unwrap().status.unwrap().state;
    assert_eq!(pod_state, i32::from(PodSandboxState::SandboxReady));
    let fine = container_config("fine", None, &[]);
    let id = cri.create_container(&pod, &fine, &sandbox).unwrap();
    cri.start_container(&id).unwrap();
    let echo = cri
        .exec_sync(&id, &["/bin/busybox", "echo", "fine"], WITHIN)
        .unwrap();
    assert_eq!(echo.exit_code, 0);
    assert_eq!(node.shims().len(), 1, "{:?}", node.shims());
    cri.stop_pod_sandbox(&pod).unwrap();
    cri.remove_pod_sandbox(&pod).unwrap();
    assert_nothing_left(&node, "the removed pod");
}
