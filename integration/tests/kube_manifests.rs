//! The Kubernetes manifests under tools/kubernetes/, run as a kubelet runs them (through CRI: no kubelet runs
//! here) on a node whose containerd has only runc configured: the DaemonSet's pod, from the node image that
//! tools/image/build makes (imported, nothing pulled), installs Baton with its init container (`baton install
//! --agent daemonset` edits the node's containerd config and copies the binaries to the node's
//! /usr/local/bin), containerd is restarted as the manifest says, and the agent container runs the node's
//! agent. Then the example pair of example-pods.yaml runs under the RuntimeClass of runtimeclass.yaml: the
//! agent watches both pods (roles, pod names) and serves its metrics on the node's network; the server pod's
//! StartContainer parks the trainer pod by itself; the agent container is killed and made again as a kubelet
//! restarts a crashed container, and the new agent rebuilds its view; containerd restarts; deleting the server
//! pod resumes the trainer, its weights intact, and nothing stays frozen. Once in this machine's cgroup layout
//! (hybrid: v1 controllers, the v2 tree at /sys/fs/cgroup/unified) and once in cgroup v2 mode (containerd in a
//! mount namespace with cgroup2 at /sys/fs/cgroup, where pods get cgroup namespaces of their own).
//!
//! What the test substitutes, and why: the example pods' images and commands (placeholders for the user's own
//! server and trainer) become the mock CUDA workload; `nvidia.com/gpu` becomes the mock driver's device files,
//! as the NVIDIA device plugin would give /dev/nvidia*; every pod shares the node's network (no CNI here);
//! the node's /etc/containerd, /usr/local/bin, /run/baton and /run/containerd are folders of the test
//! (bind-mounted in containerd's mount namespace), so the manifests' hostPaths are used as written.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use baton_integration::agent::{container_status_when, wait_until};
use baton_integration::containerd::CgroupMode;
use baton_integration::cri::CriNode;
use baton_integration::kube::manifest::{self, Pod, Substitutes};
use baton_integration::kube::{Kubelet, import_node_image, manifests_dir};
use baton_integration::trace_env::{missing_trace_prerequisite, workspace_binary};
use baton_integration::{cri::client::pid_from_info, skip};
use baton_mock_nvidia::driver::{MockDriver, MountOptions};
use serde_json::{Value, json};

const WITHIN: Duration = Duration::from_secs(60);
/// The image the example pods' placeholders become: busybox and the mock CUDA workload.
const GPU_IMAGE: &str = "baton.invalid/gpu:it";
const DEVICES: [&str; 4] = ["nvidiactl", "nvidia0", "nvidia-uvm", "nvidia-uvm-tools"];
/// The agent's default metrics address (the DaemonSet passes none).
const METRICS: &str = "http://127.0.0.1:9477/metrics";

fn prerequisites() -> bool {
    if let Some(reason) = missing_trace_prerequisite() {
        skip::missing(&reason);
        return false;
    }
    if std::process::Command::new("podman")
        .arg("--version")
        .output()
        .is_err()
    {
        skip::missing("podman (Debian package podman) builds the node image");
        return false;
    }
    true
}

fn manifest(name: &str) -> PathBuf {
    manifests_dir().join(name)
}

/// The mock workload's command line: it allocates `vram_mib` and trains until stopped.
fn workload_command(workload: &str, vram_mib: u64) -> Vec<String> {
    vec![
        "/bin/sh".into(),
        "-c".into(),
        format!(
            "exec {workload} --dev-dir /dev --steps 0 --step-ms 5 --vram-mib {vram_mib} --copy-mib-per-s 2048"
        ),
    ]
}

/// The agent's status of container `id` once `cond` holds (polled, with a deadline).
fn status_when(socket: &Path, id: &str, what: &str, cond: impl Fn(&Value) -> bool) -> Value {
    container_status_when(socket, id, WITHIN, cond)
        .unwrap_or_else(|last| panic!("{what}: agent status of {id}: {last}"))
}

/// The pid of container `id`'s init, from CRI.
fn init_pid(node: &CriNode, id: &str) -> i32 {
    pid_from_info(&node.client().container_status(id).unwrap().info).unwrap()
}

/// The agent's metrics text, scraped from the node's network.
fn scrape() -> Option<String> {
    ureq::get(METRICS)
        .call()
        .ok()?
        .body_mut()
        .read_to_string()
        .ok()
}

/// Prints the agent's container logs (every attempt) when the test fails: the agent decides what the test
/// checks.
struct AgentLogOnPanic(PathBuf);

impl Drop for AgentLogOnPanic {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        let mut logs: Vec<PathBuf> = std::fs::read_dir(&self.0)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.path())
            .collect();
        logs.sort();
        for log in logs {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(40).collect();
            eprintln!("agent log {} ends with:", log.display());
            for line in tail.into_iter().rev() {
                eprintln!("{line}");
            }
        }
    }
}

/// The whole story in cgroup layout `mode`.
fn daemonset_installs_baton_and_runs_the_example_pair(test: &str, mode: CgroupMode) {
    if !prerequisites() {
        return;
    }
    // The mock driver first: containerd's mount namespace is a copy of this one, made at its start.
    let mock_dir = tempfile::tempdir().unwrap();
    let _mock = MockDriver::mount(MountOptions::new(mock_dir.path())).unwrap();
    let Some(mut node) = CriNode::start_as_node(test, mode) else {
        return;
    };
    assert!(
        scrape().is_none(),
        "something already serves {METRICS}, where the DaemonSet's agent serves its metrics: stop it (a baton \
         agent running on this machine?)"
    );
    let image = import_node_image(&node).unwrap();
    let workload = node.import_gpu_image(GPU_IMAGE).unwrap();
    // NVIDIA's cuda-checkpoint on the node's PATH, as an administrator installs it (here its stand-in).
    let standin = workspace_binary("baton-mock-nvidia", "baton-mock-cuda-checkpoint").unwrap();
    std::fs::copy(
        standin,
        node.host_root().join("usr/local/bin/cuda-checkpoint"),
    )
    .unwrap();

    // The DaemonSet's pod, from the image tools/image/build makes.
    let daemonset =
        manifest::object(&manifest("baton-agent.yaml"), "DaemonSet", "baton-agent").unwrap();
    let agent_pod = Pod::from_daemonset(&daemonset, "node");
    for c in ["install", "agent"] {
        assert_eq!(
            agent_pod.container(c).unwrap()["image"],
            json!(image),
            "the DaemonSet's {c} container names the image tools/image/build makes"
        );
    }
    let classes = manifest::documents(&manifest("runtimeclass.yaml")).unwrap();
    let subs = Substitutes {
        images: HashMap::from([
            ("registry.example/llm-server:1.0".into(), GPU_IMAGE.into()),
            ("registry.example/trainer:1.0".into(), GPU_IMAGE.into()),
        ]),
        commands: HashMap::from([
            ("server".into(), workload_command(&workload, 128)),
            ("trainer".into(), workload_command(&workload, 256)),
        ]),
        devices: DEVICES
            .iter()
            .map(|d| (mock_dir.path().join(d), format!("/dev/{d}")))
            .collect(),
    };
    let kubelet = Kubelet::new(subs);
    let config = node.host_root().join("etc/containerd/config.toml");
    let before = std::fs::read_to_string(&config).unwrap();
    let mut agent = kubelet.run(&node, &agent_pod, &classes).unwrap();
    let _agent_log = AgentLogOnPanic(agent.log_dir.join("agent"));

    // The init container installed Baton on the node: the runtime in the node's config, the binaries on its
    // PATH. containerd loads a new runtime when it restarts, as the manifest says.
    let after = std::fs::read_to_string(&config).unwrap();
    assert_ne!(
        before,
        after,
        "install changed nothing:\n{}",
        agent.log("install")
    );
    assert!(after.contains("io.containerd.baton.v1"), "{after}");
    for b in ["baton", "containerd-shim-baton-v1"] {
        assert!(
            node.host_root().join("usr/local/bin").join(b).is_file(),
            "{b} installed on the node"
        );
    }
    node.restart_containerd().unwrap();

    // The agent runs in its container and serves the node: its socket is the node's /run/baton/agent.sock.
    let socket = node.host_root().join("run/baton/agent.sock");
    assert!(
        wait_until(WITHIN, || baton_integration::agent::AgentConn::connect(
            &socket
        )
        .is_ok()),
        "the agent's socket {}; agent log:\n{}",
        socket.display(),
        agent.log("agent")
    );

    // The example pair, the trainer first: the agent watches it (role, pod name) and sees its GPU memory.
    let examples = manifest("example-pods.yaml");
    let trainer_pod = Pod::from_pod(&manifest::object(&examples, "Pod", "trainer").unwrap());
    let server_pod = Pod::from_pod(&manifest::object(&examples, "Pod", "llm-server").unwrap());
    let trainer = kubelet.run(&node, &trainer_pod, &classes).unwrap();
    let trainer_id = trainer.id("trainer").to_owned();
    // Traced from the agent's pod: the ledger holds the trainer's 256 MiB, from its driver calls.
    let status = status_when(&socket, &trainer_id, "the trainer holds its GPU", |s| {
        s["gpu"] == json!("held") && s["vram_bytes"] == json!(256u64 << 20)
    });
    assert_eq!(status["role"]["role"], json!("co-runner"), "{status}");
    assert_eq!(status["role"]["pod"], json!("default/trainer"), "{status}");

    // Its metrics, scraped from the node's network.
    let mut text = String::new();
    assert!(
        wait_until(WITHIN, || {
            text = scrape().unwrap_or_default();
            text.contains(&trainer_id)
        }),
        "the agent's metrics at {METRICS} name the trainer:\n{text}\nagent log:\n{}",
        agent.log("agent")
    );

    // The server pod: its StartContainer returns once the agent has parked the trainer for it.
    let server = kubelet.run(&node, &server_pod, &classes).unwrap();
    let server_id = server.id("server").to_owned();
    let status = status_when(&socket, &server_id, "the server holds the GPU", |s| {
        s["gpu"] == json!("held")
    });
    assert_eq!(
        status["role"]["role"],
        json!("latency-critical"),
        "{status}"
    );
    status_when(&socket, &trainer_id, "the trainer is parked", |s| {
        s["preemption"]["state"] == json!("parked")
    });

    // The agent crashes; the kubelet makes its container again; the new agent rebuilds its view from the
    // shims (both pods, the trainer still parked for the server).
    let old_agent = init_pid(&node, agent.id("agent"));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(old_agent),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    kubelet.restart_crashed(&node, &mut agent, "agent").unwrap();
    status_when(
        &socket,
        &trainer_id,
        "the new agent knows the parked trainer",
        |s| {
            s["preemption"]["state"] == json!("parked")
                && s["role"]["pod"] == json!("default/trainer")
        },
    );
    status_when(&socket, &server_id, "the new agent knows the server", |s| {
        s["gpu"] == json!("held")
    });

    // containerd restarts: every pod keeps running.
    node.restart_containerd().unwrap();
    for (pod, name) in [
        (&agent, "agent"),
        (&server, "server"),
        (&trainer, "trainer"),
    ] {
        let state = node
            .client()
            .container_status(pod.id(name))
            .unwrap()
            .status
            .unwrap()
            .state;
        assert_eq!(
            state,
            i32::from(k8s_cri::v1::ContainerState::ContainerRunning),
            "{name} after containerd's restart"
        );
    }

    // The server pod is deleted: the agent resumes the trainer by itself, its weights intact.
    kubelet.delete(&node, &server).unwrap();
    status_when(&socket, &trainer_id, "the trainer is resumed", |s| {
        s["preemption"].is_null() && s["gpu"] == json!("held")
    });
    assert!(
        wait_until(WITHIN, || trainer
            .log("trainer")
            .contains("restored checksum")),
        "the trainer restored its weights:\n{}",
        trainer.log("trainer")
    );
    let log = trainer.log("trainer");
    let line = log
        .lines()
        .find(|l| l.contains("restored checksum"))
        .unwrap_or_default();
    assert!(line.ends_with("intact"), "{line}");
    let frozen = frozen_cgroups(&node);
    assert!(frozen.is_empty(), "frozen after the resume: {frozen:?}");

    // Everything goes as a node drain would take it.
    for pod in [&trainer, &agent] {
        kubelet.delete(&node, pod).unwrap();
    }
    assert!(node.client().list_pod_sandboxes().unwrap().is_empty());
}

/// The cgroups under the node's pods' parent whose freezer says FROZEN (v1) or `frozen 1` (v2).
fn frozen_cgroups(node: &CriNode) -> Vec<PathBuf> {
    let parent = node.cgroup_parent().trim_start_matches('/');
    let mut out = Vec::new();
    for root in baton_integration::cleanup::cgroup_roots() {
        let mut stack = vec![root.join(parent)];
        while let Some(dir) = stack.pop() {
            let frozen = std::fs::read_to_string(dir.join("freezer.state"))
                .is_ok_and(|s| s.trim() == "FROZEN")
                || std::fs::read_to_string(dir.join("cgroup.freeze"))
                    .is_ok_and(|s| s.trim() == "1");
            if frozen {
                out.push(dir.clone());
            }
            if let Ok(entries) = std::fs::read_dir(&dir) {
                stack.extend(
                    entries
                        .flatten()
                        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                        .map(|e| e.path()),
                );
            }
        }
    }
    out
}

#[test]
fn the_daemonset_installs_baton_and_the_example_pair_gap_fills_in_the_hosts_cgroup_layout() {
    daemonset_installs_baton_and_runs_the_example_pair("kube-hybrid", CgroupMode::Host);
}

#[test]
fn the_daemonset_installs_baton_and_the_example_pair_gap_fills_in_cgroup_v2_mode() {
    daemonset_installs_baton_and_runs_the_example_pair("kube-v2", CgroupMode::V2);
}
