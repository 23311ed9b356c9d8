//! The GPU-free gate and `baton handoff`, end to end (real containerd, runc, the Baton shim and agent, the
//! FUSE mock driver, the mock CUDA workload and the cuda-checkpoint stand-in): a server created behind
//! `baton.io/wait-gpu-free` starts on the trainer's release, or fails past its timeout naming the holder;
//! `handoff` starts the second container on the release (overlapped: before the first is even frozen) or
//! after the preemption (sequential), and resumes a parked one.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use baton_integration::{
    agent::wait_until,
    agent_steps::AgentSteps,
    cuda::{CudaRig, Trainer},
    trace_env::workspace_binary,
};
use serde_json::{Value, json};

fn t_of(steps: &[Value], phase: &str, id: &str) -> u64 {
    steps
        .iter()
        .find(|s| s["phase"] == json!(phase) && s["id"] == json!(id))
        .and_then(|s| s["t_ns"].as_u64())
        .unwrap_or_else(|| panic!("no {phase} step of {id} in {steps:?}"))
}

#[test]
fn the_gate_holds_a_start_until_the_release_and_fails_past_its_timeout_naming_the_holder() {
    let Some(rig) = CudaRig::start("gate") else {
        return;
    };
    let _trainer = rig.run("trainer", &Trainer::with_worker(), &[]);
    rig.wait_held("trainer");
    let gate = [("baton.io/wait-gpu-free", "1m")];
    let _server = rig.create("server", &Trainer::with_worker(), &gate);
    let api = rig.gpu.env.api().unwrap();
    let socket = rig.gpu.env.containerd().socket();
    let namespace = rig.gpu.env.namespace().to_owned();
    let start = std::thread::spawn(move || {
        let api = baton_integration::api::Api::connect(&socket, &namespace).unwrap();
        let result = api.start("server", "");
        (result, baton_agent_api::now_monotonic_ns())
    });
    // The gate holds: the server stays created while the trainer holds the GPU.
    assert!(
        !wait_until(std::time::Duration::from_millis(500), || start
            .is_finished()),
        "Start returned while the trainer held the GPU"
    );
    assert_eq!(rig.task_status("server").as_deref(), Some("CREATED"));
    let (steps, _) = rig.baton_json(&["preempt", "trainer"]);
    let (result, returned_ns) = start.join().unwrap();
    result.unwrap();
    assert!(
        returned_ns > t_of(&steps, "gpu_released", "trainer"),
        "the server started after the release"
    );
    rig.wait_held("server");

    // Past its timeout the gate fails the Start, naming the container that holds the GPU.
    let short = [("baton.io/wait-gpu-free", "300ms")];
    let _late = rig.create("late", &Trainer::with_worker(), &short);
    let err = api.start("late", "").unwrap_err().to_string();
    assert!(
        err.contains("still held by container server"),
        "the error names the holder: {err}"
    );
    assert_eq!(rig.task_status("late").as_deref(), Some("CREATED"));
    drop(api);
}

#[test]
fn overlapped_handoff_starts_the_server_on_the_release_sequential_after_the_freeze() {
    let Some(rig) = CudaRig::start("handoff") else {
        return;
    };
    let _trainer = rig.run("trainer", &Trainer::with_worker(), &[]);
    rig.wait_held("trainer");
    let _server = rig.create("server", &Trainer::with_worker(), &[]);
    let (steps, outcome) = rig.baton_json(&["handoff", "--from", "trainer", "--to", "server"]);
    let released = t_of(&steps, "gpu_released", "trainer");
    let started = t_of(&steps, "started", "server");
    assert!(started >= released, "overlapped: on the release: {steps:?}");
    // Whether the server's start also beats the trainer's freeze (about 2 ms after the release here) is a
    // race of two processes, not an order Baton promises: a figure of baton-handoff-bench, not asserted
    // (it failed 1 of 3 clean CI runs on an idle machine).
    t_of(&steps, "frozen", "trainer");
    assert!(
        t_of(&steps, "gpu_acquired", "server") > started,
        "{steps:?}"
    );
    assert_eq!(outcome["preemption"]["state"], json!("parked"), "{outcome}");
    let (out, _, _) = rig.baton(&["status"]);
    assert!(out.contains("parked"), "{out}");

    // The other way round, sequentially: the server is parked, the trainer (parked) is resumed after.
    let (steps, _) = rig.baton_json(&[
        "handoff",
        "--from",
        "server",
        "--to",
        "trainer",
        "--order",
        "sequential",
    ]);
    let done = t_of(&steps, "done", "server");
    let resumed_from = t_of(&steps, "thawed", "trainer");
    assert!(
        resumed_from > done,
        "sequential: after the preemption: {steps:?}"
    );
    assert!(
        t_of(&steps, "gpu_acquired", "trainer") > resumed_from,
        "{steps:?}"
    );

    // A handoff from a parked container is refused, and says what to do.
    let (_, err, ok) = rig.baton(&["handoff", "--from", "server", "--to", "trainer"]);
    assert!(!ok && err.contains("parked already"), "{err}");
}

/// A runc that fails every checkpoint (a CRIU dump that fails), after the CUDA processes were checkpointed
/// and once container `server` (under the same runc root) runs: the failure comes after the server was
/// started on the release, which is the case under test (a dump failing before the release was published
/// fails the handoff without starting the server). It gives up waiting after 10 s, and fails all the same.
fn runc_whose_dump_fails(dir: &std::path::Path) -> std::path::PathBuf {
    let script = r#"#!/bin/sh
case " $* " in
  *" checkpoint "*)
    root=$(echo " $* " | sed -n 's/.* --root \([^ ]*\) .*/\1/p')
    tries=0
    until runc --root "$root" state server 2>/dev/null | grep -q '"status": "running"'; do
      tries=$((tries + 1))
      [ "$tries" -gt 1000 ] && break
      sleep 0.01
    done
    echo "criu: dump failed (a runc wrapper of the test)" >&2; exit 1 ;;
esac
exec runc "$@"
"#;
    let path = dir.join("runc-dump-fails");
    baton_integration::write_script(&path, script).unwrap();
    path
}

#[test]
fn an_overlapped_handoff_whose_preemption_fails_after_the_server_started_says_where_both_are() {
    let Some(rig) = CudaRig::start("handoff-a-fails") else {
        return;
    };
    let dir = rig.gpu.env.scratch();
    std::fs::create_dir_all(&dir).unwrap();
    let runc = runc_whose_dump_fails(&dir);
    let options = baton_integration::api::runtime_options_toml(&format!(
        "BinaryName = \"{}\"\n",
        runc.display()
    ));
    let _trainer = rig.create_with("trainer", &Trainer::with_worker(), &[], Some(options));
    rig.gpu.env.api().unwrap().start("trainer", "").unwrap();
    rig.wait_held("trainer");
    let _server = rig.create("server", &Trainer::with_worker(), &[]);
    // Snapshot: the trainer's GPU state goes (the release starts the server), then its dump fails.
    let (out, err, ok) = rig.baton(&[
        "handoff", "--from", "trainer", "--to", "server", "--mode", "snapshot",
    ]);
    assert!(!ok, "the handoff failed: {out}");
    assert!(
        err.contains("failed after server was started on its release")
            && err.contains("server is running")
            && err.contains("dump failed"),
        "the answer says what failed and where the server is: {err}"
    );
    assert_eq!(rig.task_status("server").as_deref(), Some("RUNNING"));
    rig.wait_held("server");
    // The trainer was rolled back: running, its GPU state restored.
    assert_eq!(rig.task_status("trainer").as_deref(), Some("RUNNING"));
    rig.wait_held("trainer");
}

#[test]
fn a_handoff_whose_preemption_leaves_gpu_state_behind_never_starts_the_server_and_resumes_the_trainer()
 {
    let Some(rig) = CudaRig::start("handoff-unreleased") else {
        return;
    };
    // Each lock takes 4 s: a second CUDA process starts in the trainer while its first one is being locked,
    // after the agent named the processes to preempt.
    let trainer = Trainer {
        extra: vec!["--lock-delay-ms".into(), "4000".into()],
        late_process: true,
        ..Trainer::with_worker()
    };
    let mut running = rig.run("trainer", &trainer, &[]);
    rig.wait_held("trainer");
    let _server = rig.create("server", &Trainer::with_worker(), &[]);
    let steps = AgentSteps::start(&rig, "trainer");
    let handoff = {
        let socket = rig.gpu.env.containerd().agent_socket();
        std::thread::spawn(move || {
            let baton = workspace_binary("baton", "baton").unwrap();
            std::process::Command::new(baton)
                .args(["handoff", "--from", "trainer", "--to", "server"])
                .env(baton_agent_api::SOCKET_ENV, socket)
                .output()
                .unwrap()
        })
    };
    steps.wait_for_matching("asked", |d| d.contains("-> server"));
    rig.start_late_process("trainer");
    running.wait_line("phase setup-done");
    let out = handoff.join().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the handoff failed: {err}");
    // Before, the agent made up a release 2 s after the preemption and started the server beside it.
    assert!(
        err.contains("trainer was parked, but its GPU state did not leave within")
            && err.contains("still hold GPU state there")
            && err.contains("server was not started, and it was resumed"),
        "the answer says what holds the GPU and where both are: {err}"
    );
    assert_eq!(rig.task_status("server").as_deref(), Some("CREATED"));
    assert_eq!(rig.task_status("trainer").as_deref(), Some("RUNNING"));
    assert_eq!(rig.gpu.status("trainer")["preemption"], Value::Null);
    assert!(
        !steps
            .seen()
            .iter()
            .any(|(phase, _)| phase == "GPU released"),
        "no release was made up: {:?}",
        steps.seen()
    );
}
