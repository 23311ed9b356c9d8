//! A tenant can make itself look bigger, never smaller or gone (issue 39, item 2). The probes read an RM
//! call's status, handles and sizes from the caller's memory at the syscall's exit, which a second thread can
//! rewrite after the driver's copy-out; the ledger judges each call by the kernel's return and by readings at
//! the entry and the exit (`baton_tracer::ledger::readings`), and where the node has NVML the gate's room and
//! whole-GPU Starts are floored by NVML's device memory (`tools/agent/src/gate/floor.rs`). Real components:
//! containerd, runc, the Baton shim and agent, the kernel's probes, the FUSE mock driver (the driver's truth);
//! the hostile tenant is the mock holder's `race-alloc` / `race-free` (`workload::race`); NVML is the fake
//! library (integration/fake-nvml), which answers from the mock driver's state.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use std::{
    process::{Command, Stdio},
    time::Duration,
};

use baton_integration::{
    agent::{AgentConn, container_status, wait_until},
    api::Api,
    cuda::{SERVER, Trainer},
    fake_nvml::FakeNvml,
    holder::{GpuRig, HolderContainer},
    trace_env::workspace_binary,
};
use baton_mock_nvidia::driver::DriverState;
use serde_json::{Value, json};

const WITHIN: Duration = Duration::from_secs(30);
const MIB: u64 = 1 << 20;
/// Allocations the racing tenant makes, and the size of each.
const RACED: u64 = 64;
const RACED_KIB: u64 = 4096;

/// The agent's status of `id` (null until it is watched).
fn status_of(rig: &GpuRig, id: &str) -> Value {
    container_status(&rig.env.containerd().agent_socket(), id)
        .ok()
        .flatten()
        .unwrap_or(Value::Null)
}

/// The mock driver's video memory in use now: the driver's truth.
fn driver_used(rig: &GpuRig) -> u64 {
    DriverState::read(rig.mock_dir.path())
        .unwrap()
        .vram_used_bytes
}

#[test]
fn a_thread_rewriting_statuses_during_64_allocations_hides_none_and_its_forged_frees_free_none() {
    let Some(rig) = GpuRig::start("ledger-trust") else {
        return;
    };
    let mut h = rig.holder("racer");
    let fd = h.num("open nvidiactl").unwrap();
    let raced = h
        .cmd(&format!("race-alloc {fd} {RACED} {RACED_KIB}"))
        .unwrap();
    assert_eq!(
        raced[2],
        RACED.to_string(),
        "every call was rewritten: {raced:?}"
    );
    let (client, device) = (raced[0].clone(), raced[1].clone());
    let bytes = RACED * RACED_KIB * 1024;
    assert_eq!(driver_used(&rig), bytes, "the driver made all 64");

    // All 64 are in the ledger at their full size, whatever status and size each read at its exit.
    let counted = |s: &Value| s["vram_bytes"] == json!(bytes);
    assert!(
        wait_until(WITHIN, || counted(&status_of(&rig, "racer"))),
        "the ledger counts the 64 allocations the driver made ({bytes} bytes): {}",
        status_of(&rig, "racer")
    );
    let s = status_of(&rig, "racer");
    assert_eq!(
        s["live_objects"],
        json!(RACED + 2),
        "client, device, 64: {s}"
    );
    eprintln!(
        "doubtful after the raced allocations (readings the rewrite won): {}",
        s["doubtful"]
    );

    // 64 refused frees of handles that do not exist, rewritten after the driver's answer to read as NV_OK
    // frees of the 64 allocations: none frees anything. A client allocated after them is the marker that
    // the agent has applied their records (records are applied in order).
    let forged = h
        .cmd(&format!("race-free {fd} {client} {device} {RACED}"))
        .unwrap();
    assert_eq!(forged[0], RACED.to_string(), "{forged:?}");
    h.cmd(&format!("alloc-client {fd}")).unwrap();
    assert!(
        wait_until(WITHIN, || status_of(&rig, "racer")["live_objects"]
            .as_u64()
            .is_some_and(|n| n >= RACED + 3)),
        "the marker client is counted: {}",
        status_of(&rig, "racer")
    );
    let s = status_of(&rig, "racer");
    assert_eq!(driver_used(&rig), bytes, "the driver freed nothing");
    assert_eq!(
        (s["vram_bytes"].clone(), s["live_objects"].clone()),
        (json!(bytes), json!(RACED + 3)),
        "the forged frees freed nothing in the ledger: {s}"
    );
    eprintln!("doubtful after the forged frees: {}", s["doubtful"]);

    // The file's release frees it all, as the driver does.
    h.num(&format!("close {fd}")).unwrap();
    assert!(
        wait_until(WITHIN, || status_of(&rig, "racer")["gpu"]
            == json!("released")),
        "{}",
        status_of(&rig, "racer")
    );
    assert_eq!(status_of(&rig, "racer")["vram_bytes"], json!(0));
    h.finish().unwrap();
}

/// The agent's node status.
fn node_status(socket: &std::path::Path) -> Value {
    AgentConn::connect(socket)
        .map_err(anyhow::Error::from)
        .and_then(|mut c| c.call(json!({"op": "status"})))
        .unwrap_or(Value::Null)
}

/// The floor of GPU 0 in the node status.
fn floor_of_gpu0(socket: &std::path::Path) -> Value {
    node_status(socket)["nvml_floor"]
        .as_array()
        .and_then(|f| f.iter().find(|g| g["minor"] == json!(0)).cloned())
        .unwrap_or(Value::Null)
}

/// Starts task `id` through containerd's API in a thread.
fn start_in_background(
    socket: std::path::PathBuf,
    namespace: String,
    id: &str,
) -> std::thread::JoinHandle<Result<u32, String>> {
    let id = id.to_owned();
    std::thread::spawn(move || {
        let api = Api::connect(&socket, &namespace).unwrap();
        api.start(&id, "").map_err(|e| e.to_string())
    })
}

/// Kills and deletes task `id`.
fn delete_task(api: &Api, id: &str) {
    api.kill(id, "", 9, true).unwrap();
    api.wait(id, "", WITHIN).unwrap();
    api.delete_task(id).unwrap();
}

#[test]
fn with_nvml_a_server_needing_more_than_is_really_free_does_not_start_and_one_that_fits_does() {
    let Some((rig, _agent, _dir)) = FakeNvml::rig("ledger-floor", 2048, &[]) else {
        return;
    };
    let socket = rig.gpu.env.containerd().agent_socket();
    let (containerd, namespace) = (
        rig.gpu.env.containerd().socket(),
        rig.gpu.env.namespace().to_owned(),
    );
    let start = |id: &str| start_in_background(containerd.clone(), namespace.clone(), id);
    // The agent read the idle GPU from NVML before anything used it.
    assert!(
        wait_until(WITHIN, || floor_of_gpu0(&socket)["idle_baseline_bytes"]
            == json!(0)),
        "the agent measured GPU 0's idle memory: {}",
        node_status(&socket)
    );

    // A server that needs 512 MiB starts (and holds the mock trainer's 256 MiB).
    let mut fits = SERVER.to_vec();
    fits.push(("baton.io/gpu-memory", "512Mi"));
    let _fits = rig.create("server-fits", &Trainer::default(), &fits);
    start("server-fits")
        .join()
        .unwrap()
        .expect("a server whose need NVML shows free starts");
    rig.wait_held("server-fits");
    assert!(
        wait_until(WITHIN, || rig.gpu.status("server-fits")["vram_bytes"]
            == json!(256 * MIB)),
        "{}",
        rig.gpu.status("server-fits")
    );

    // A process of the node, outside every container, takes 1 GiB: no ledger sees it (the gate leaves the
    // node's own processes alone), NVML does. By the ledgers 1792 MiB are free; on the GPU, 768 MiB.
    let holder = workspace_binary("baton-mock-nvidia", "baton-mock-holder").unwrap();
    let child = Command::new(holder)
        .arg("--dev-dir")
        .arg(rig.gpu.mock_dir.path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut node = HolderContainer::attach("node-process", child).unwrap();
    let fd = node.num("open nvidiactl").unwrap();
    let alloc = node.cmd(&format!("alloc {fd} 1024")).unwrap();
    assert_eq!(alloc[1], "0", "{alloc:?}");

    // That disagreement between NVML and the ledgers is shown, counted, and logged once naming the holder.
    assert!(
        wait_until(WITHIN, || floor_of_gpu0(&socket)["unaccounted_bytes"]
            == json!(1024 * MIB)),
        "the 1 GiB no ledger accounts for: {}",
        floor_of_gpu0(&socket)
    );
    let log = std::fs::read_to_string(socket.with_file_name("agent.log")).unwrap_or_default();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("more than its idle baseline"))
        .collect();
    assert!(
        lines.len() == 1 && lines[0].contains("server-fits (256 MiB)"),
        "one log line names the holder: {lines:?}"
    );

    // Needs 1.5 GiB: the ledgers have it beside server-fits, the GPU does not. It does not start.
    let wait_3s = |need| {
        let mut a = vec![
            ("baton.io/role", "latency-critical"),
            ("baton.io/wait-gpu-free", "3s"),
        ];
        a.extend(need);
        a
    };
    let _big = rig.create(
        "server-big",
        &Trainer::default(),
        &wait_3s(Some(("baton.io/gpu-memory", "1536Mi"))),
    );
    let error = start("server-big")
        .join()
        .unwrap()
        .expect_err("a server that needs more than NVML shows free does not start");
    assert!(
        error.contains("needs 1.5 GiB, 1.8 GiB free")
            && error.contains("NVML shows 768 MiB free on nvidia0"),
        "its error gives the room the ledgers see and the room NVML leaves: {error}"
    );

    // With server-fits gone no container holds the GPU, but NVML shows it used past its idle memory: a Start
    // that needs the whole GPU does not start either.
    delete_task(&rig.gpu.env.api().unwrap(), "server-fits");
    let _whole = rig.create("server-whole", &Trainer::default(), &wait_3s(None));
    let error = start("server-whole")
        .join()
        .unwrap()
        .expect_err("a whole-GPU server does not start while NVML shows the GPU used");
    assert!(
        error.contains("NVML shows 1 GiB used on nvidia0"),
        "its error names NVML's figures: {error}"
    );
    node.finish().unwrap();
}
