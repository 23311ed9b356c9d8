//! Parked pods as a kubelet drives them, through containerd's CRI plugin with runtime handler `baton` (no
//! kubelet runs here; the test makes its calls): memory limits kept in the pod specs, liveness probes as
//! ExecSync calls with the kubelet's 1 s timeout, and pod deletion as StopContainer with a 10 s grace period
//! followed by StopPodSandbox.
//! - An idle-parked server (`baton.io/park-when-idle`) is parked without freezing, the idle park's default: its
//!   liveness probes keep passing (frozen, each would fail and the kubelet would restart it, losing the park).
//! - Deleted while parked with its GPU free, it is resumed first: its SIGTERM handler's CUDA work (the mock
//!   workload's `--save-at-stop`) runs, and it exits cleanly well within its grace period.
//! - A trainer whose memory limit (128 MiB) is below its device memory (256 MiB) is parked by gap-fill for a
//!   server (its limit raised while parked, never OOM-killed); deleted while the server holds its GPU, it is
//!   not resumed (that would push the server off its GPU): the signal reaches it, its CUDA work waits on the
//!   locked CUDA, and containerd's SIGKILL at the end of the grace period ends it; the pod is gone within
//!   the grace period and its margin.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use baton_integration::agent::{AgentProcess, container_status_when, wait_until};
use baton_integration::cri::{CriNode, Handler, runc_root_in};
use baton_integration::skip;
use baton_integration::trace_env::{missing_trace_prerequisite, workspace_binary};
use baton_mock_nvidia::driver::{MockDriver, MountOptions};
use k8s_cri::v1::{
    ContainerConfig, ContainerMetadata, ContainerState, ImageSpec as CriImage,
    LinuxContainerConfig, LinuxContainerResources, LinuxContainerSecurityContext, Mount,
    NamespaceMode, NamespaceOption, PodSandboxConfig,
};
use serde_json::{Value, json};

const WITHIN: Duration = Duration::from_secs(60);
const GPU_IMAGE: &str = "baton.invalid/gpu:it";
const DEVICES: [&str; 4] = ["nvidiactl", "nvidia0", "nvidia-uvm", "nvidia-uvm-tools"];
/// The grace period of the pod deletions.
const GRACE: Duration = Duration::from_secs(10);
/// What containerd's SIGKILL at the end of a grace period and the pod's teardown may take beyond it.
const GRACE_MARGIN: Duration = Duration::from_secs(5);
const MIB: u64 = 1 << 20;

fn agent_socket(dir: &Path) -> PathBuf {
    dir.join("node-agent.sock")
}

/// The `baton` handler: a private runc root, the test's agent, and the cuda-checkpoint stand-in.
fn baton_handler(dir: &Path) -> Handler {
    let standin = workspace_binary("baton-mock-nvidia", "baton-mock-cuda-checkpoint").unwrap();
    Handler {
        name: "baton".into(),
        options: format!(
            "Root = \"{}\"\nagent_socket = \"{}\"\nagent_autostart = false\nebpf = true\n\
             cuda_checkpoint_path = \"{}\"\ncuda_driver_path = \"\"\n",
            runc_root_in(dir).display(),
            agent_socket(dir).display(),
            standin.display()
        ),
    }
}

/// A container of the mock CUDA workload holding `vram_mib` of device memory (and saving at its stop), with
/// the mock devices, `annotations` and a memory limit when given, logging to `<pod log dir>/<name>.log`.
fn gpu_container(
    name: &str,
    workload: &str,
    mock_dir: &Path,
    vram_mib: u64,
    memory_limit: Option<u64>,
    annotations: &[(&str, &str)],
) -> ContainerConfig {
    let command = format!(
        "exec {workload} --dev-dir /dev --steps 0 --step-ms 5 --vram-mib {vram_mib} \
         --copy-mib-per-s 2048 --save-at-stop"
    );
    ContainerConfig {
        metadata: Some(ContainerMetadata {
            name: name.to_string(),
            attempt: 0,
        }),
        image: Some(CriImage {
            image: GPU_IMAGE.to_string(),
            ..Default::default()
        }),
        command: vec!["/bin/sh".into(), "-c".into(), command],
        mounts: DEVICES
            .iter()
            .map(|device| Mount {
                container_path: format!("/dev/{device}"),
                host_path: mock_dir.join(device).display().to_string(),
                ..Default::default()
            })
            .collect(),
        annotations: annotations
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        log_path: format!("{name}.log"),
        linux: Some(LinuxContainerConfig {
            resources: memory_limit.map(|bytes| LinuxContainerResources {
                memory_limit_in_bytes: i64::try_from(bytes).unwrap(),
                ..Default::default()
            }),
            security_context: Some(LinuxContainerSecurityContext {
                namespace_options: Some(NamespaceOption {
                    network: NamespaceMode::Node.into(),
                    ..Default::default()
                }),
                ..Default::default()
            }),
        }),
        ..Default::default()
    }
}

/// A pod of one GPU container, started: its sandbox, the container and where its log is.
struct RunPod {
    pod: String,
    id: String,
    log: PathBuf,
}

fn run_pod(
    node: &CriNode,
    name: &str,
    pod_annotations: &[(&str, &str)],
    config: &ContainerConfig,
) -> RunPod {
    let cri = node.client();
    let sandbox: PodSandboxConfig = node.sandbox_config(name, pod_annotations);
    let pod = cri.run_pod_sandbox(&sandbox, "baton").unwrap();
    let id = cri.create_container(&pod, config, &sandbox).unwrap();
    cri.start_container(&id).unwrap();
    let log = PathBuf::from(&sandbox.log_directory).join(&config.log_path);
    RunPod { pod, id, log }
}

impl RunPod {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The kubelet's deletion: StopContainer with the grace period, then the sandbox; how long the
    /// container's stop took, and its exit code and reason.
    fn delete(&self, node: &CriNode) -> (Duration, i32, String) {
        let cri = node.client();
        let t0 = Instant::now();
        cri.stop_container(&self.id, GRACE).unwrap();
        let took = t0.elapsed();
        let status = cri.container_status(&self.id).unwrap().status.unwrap();
        assert_eq!(
            status.state,
            i32::from(ContainerState::ContainerExited),
            "{status:?}"
        );
        cri.stop_pod_sandbox(&self.pod).unwrap();
        cri.remove_pod_sandbox(&self.pod).unwrap();
        (took, status.exit_code, status.reason)
    }
}

/// The agent's status of container `id` once `cond` holds.
fn status_when(socket: &Path, id: &str, what: &str, cond: impl Fn(&Value) -> bool) -> Value {
    container_status_when(socket, id, WITHIN, cond)
        .unwrap_or_else(|last| panic!("{what}: agent status of {id}: {last}"))
}

/// A liveness probe as the kubelet runs an exec probe: ExecSync with its 1 s timeout; whether it passed.
fn probe(node: &CriNode, id: &str) -> Result<(), String> {
    match node
        .client()
        .exec_sync(id, &["/bin/busybox", "true"], Duration::from_secs(1))
    {
        Ok(r) if r.exit_code == 0 => Ok(()),
        Ok(r) => Err(format!(
            "exit {}: {}",
            r.exit_code,
            String::from_utf8_lossy(&r.stderr)
        )),
        Err(e) => Err(e.to_string()),
    }
}

#[test]
fn parked_pods_answer_probes_unfrozen_and_a_deleted_one_is_gone_within_its_grace_period() {
    if let Some(reason) = missing_trace_prerequisite() {
        skip::missing(&reason);
        return;
    }
    let mock_dir = tempfile::tempdir().unwrap();
    let _mock = MockDriver::mount(MountOptions::new(mock_dir.path())).unwrap();
    let Some(node) = CriNode::start("cri-parked", |dir| vec![baton_handler(dir)]) else {
        return;
    };
    let workload = node.import_gpu_image(GPU_IMAGE).unwrap();
    let socket = agent_socket(node.dir());
    let agent_log = node.dir().join("node-agent.log");
    let _agent = AgentProcess::start(&socket, &agent_log).unwrap();
    let mock = mock_dir.path();

    // An idle server: the agent parks it after 1 s without a request, unfrozen (the idle park's default).
    let server = gpu_container("server", &workload, mock, 64, None, &[]);
    let idle = run_pod(
        &node,
        "idle-server",
        &[
            ("baton.io/role", "latency-critical"),
            ("baton.io/park-when-idle", "1s"),
        ],
        &server,
    );
    let parked = status_when(&socket, &idle.id, "the idle server is parked", |s| {
        s["preemption"]["state"] == json!("parked")
    });
    assert_eq!(parked["preemption"]["idle_park"], json!(true), "{parked}");
    assert_eq!(parked["preemption"]["unfrozen"], json!(true), "{parked}");
    // The kubelet's liveness probe, three periods in a row: each passes, so the kubelet never restarts it.
    for n in 1..=3 {
        probe(&node, &idle.id).unwrap_or_else(|e| panic!("probe {n} of the parked server: {e}"));
    }
    let still = status_when(&socket, &idle.id, "the server is still parked", |s| {
        !s.is_null()
    });
    assert_eq!(still["preemption"]["state"], json!("parked"), "{still}");

    // Deleted while parked, with nothing else on its GPU: resumed first, so its SIGTERM handler's CUDA work
    // runs and it exits cleanly, well within its grace period.
    let (took, code, _) = idle.delete(&node);
    let log = idle.log();
    assert!(
        log.contains("phase saved-at-stop"),
        "the server's stop saved (resumed first):\n{log}"
    );
    assert_eq!(code, 0, "the server's exit code; log:\n{log}");
    assert!(took < GRACE, "the stop took {took:?}");
    assert!(
        std::fs::read_to_string(&agent_log)
            .unwrap_or_default()
            .contains("resumed first (its GPU is free)"),
        "the agent's answer is in its log"
    );

    // A trainer whose memory limit is below its device memory, then a server behind the gate: gap-fill parks
    // the trainer (frozen, its limit raised for the host copy) and the server starts.
    let trainer_config = gpu_container(
        "trainer",
        &workload,
        mock,
        256,
        Some(128 * MIB),
        &[
            ("baton.io/role", "co-runner"),
            ("baton.io/preemptible", "park"),
        ],
    );
    let trainer = run_pod(&node, "trainer", &[], &trainer_config);
    status_when(&socket, &trainer.id, "the trainer holds its GPU", |s| {
        s["gpu"] == json!("held") && s["vram_bytes"] == json!(256 * MIB)
    });
    let server_config = gpu_container(
        "server",
        &workload,
        mock,
        64,
        None,
        &[
            ("baton.io/role", "latency-critical"),
            ("baton.io/wait-gpu-free", "1m"),
        ],
    );
    let busy = run_pod(&node, "busy-server", &[], &server_config);
    let parked = status_when(&socket, &trainer.id, "the trainer is parked", |s| {
        s["preemption"]["state"] == json!("parked")
    });
    let p = &parked["preemption"];
    assert_eq!(p["host_copy_bytes"], json!(256 * MIB), "{parked}");
    assert_eq!(p["raised_limit"]["was_bytes"], json!(128 * MIB), "{parked}");
    assert!(p["unfrozen"].is_null(), "a gap-fill park freezes: {parked}");
    status_when(&socket, &busy.id, "the server holds the GPU", |s| {
        s["gpu"] == json!("held")
    });
    let running = node.client().container_status(&trainer.id).unwrap();
    assert_eq!(
        running.status.unwrap().state,
        i32::from(ContainerState::ContainerRunning),
        "the parked trainer is not OOM-killed"
    );

    // Deleted while the server holds its GPU: not resumed. The signal reaches it, its save waits on the
    // locked CUDA, and the SIGKILL at the grace period's end ends it.
    let (took, code, reason) = trainer.delete(&node);
    let log = trainer.log();
    assert!(
        log.contains("phase stopping") && !log.contains("phase saved-at-stop"),
        "the trainer got the signal and its CUDA work waited:\n{log}"
    );
    assert_ne!(reason, "OOMKilled", "the trainer's exit (code {code})");
    assert_eq!(code, 137, "SIGKILL at the grace period's end; log:\n{log}");
    assert!(
        took < GRACE + GRACE_MARGIN,
        "the stop took {took:?}, grace {GRACE:?}"
    );
    let agent_said = std::fs::read_to_string(&agent_log).unwrap_or_default();
    assert!(
        agent_said.contains("not resumed first: its GPU is held by"),
        "the agent's answer is in its log:\n{agent_said}"
    );

    // The server runs on, untouched.
    status_when(&socket, &busy.id, "the server still holds the GPU", |s| {
        s["gpu"] == json!("held") && s["preemption"].is_null()
    });
    busy.delete(&node);
    assert!(
        wait_until(WITHIN, || node.shims().is_empty()),
        "shims left: {:?}",
        node.shims()
    );
}
