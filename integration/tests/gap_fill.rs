//! Gap-fill end to end (real containerd, runc, the Baton shim and agent, the FUSE mock driver, the mock CUDA
//! workload and the cuda-checkpoint stand-in): a latency-critical server created behind
//! `baton.io/wait-gpu-free` while a `baton.io/preemptible` co-runner holds its GPU starts by itself on the
//! co-runner's release, and the co-runner is resumed by itself, its weights intact, once the server is
//! gone. A holder that did not opt in keeps the GPU and the gate's error names it and why; a co-runner
//! behind the gate never preempts a server; a failed preemption fails the server's Start, naming the
//! co-runner, which keeps running; parked co-runners resume highest priority first, and one that finishes
//! during its resume, or is killed while parked, is reported `finished` and not resumed.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use std::{path::Path, time::Duration};

use baton_integration::{
    agent::wait_until,
    agent_steps::{AgentSteps, tell_agent},
    analog::rig::{Binaries, Proxy},
    api::Api,
    cuda::{CudaRig, PREEMPTIBLE, Running, SERVER, Trainer, WITHIN},
};
use serde_json::{Value, json};

/// A server that the agent parks after 3 s without a request event.
const IDLE_SERVER: [(&str, &str); 3] = [
    ("baton.io/role", "latency-critical"),
    ("baton.io/wait-gpu-free", "1m"),
    ("baton.io/park-when-idle", "3s"),
];

/// Starts task `id` through containerd's API in a thread: its result, and when it returned (monotonic ns).
fn start_in_background(
    rig: &CudaRig,
    id: &str,
) -> std::thread::JoinHandle<(Result<u32, String>, u64)> {
    let socket = rig.gpu.env.containerd().socket();
    let namespace = rig.gpu.env.namespace().to_owned();
    let id = id.to_owned();
    std::thread::spawn(move || {
        let api = Api::connect(&socket, &namespace).unwrap();
        let result = api.start(&id, "").map_err(|e| e.to_string());
        (result, baton_agent_api::now_monotonic_ns())
    })
}

/// The agent's gap-fill status (`baton status --json`).
fn gap_fill(rig: &CudaRig) -> Value {
    let (out, err, ok) = rig.baton(&["status", "--json"]);
    assert!(ok, "baton status: {err}");
    serde_json::from_str::<Value>(&out).unwrap()["gap_fill"].clone()
}

fn preemption(rig: &CudaRig, id: &str) -> Value {
    rig.gpu.status(id)["preemption"].clone()
}

/// Starts task `id`, which must fail: the error.
fn start_fails(rig: &CudaRig, id: &str) -> String {
    let api = rig.gpu.env.api().unwrap();
    api.start(id, "").unwrap_err().to_string()
}

/// `holder` was left alone: running, never preempted, still holding the GPU.
fn expect_untouched(rig: &CudaRig, holder: &str) {
    assert_eq!(rig.task_status(holder).as_deref(), Some("RUNNING"));
    assert_eq!(preemption(rig, holder), Value::Null);
    assert_eq!(rig.gpu.status(holder)["gpu"], json!("held"));
}

/// Kills and deletes task `id`.
fn delete_task(api: &Api, id: &str) {
    api.kill(id, "", 9, true).unwrap();
    api.wait(id, "", WITHIN).unwrap();
    api.delete_task(id).unwrap();
}

#[test]
fn a_server_behind_the_gate_starts_on_the_preemptible_trainers_release_and_the_trainer_resumes_when_it_goes()
 {
    let Some(rig) = CudaRig::start("gapfill-loop") else {
        return;
    };
    let mut trainer = rig.run("trainer", &Trainer::with_worker(), &PREEMPTIBLE);
    rig.wait_held("trainer");
    // `baton status` shows the GPU the trainer sees, the ledger's memory beside NVML's (none on the mock).
    let (out, err, ok) = rig.baton(&["status", "--json"]);
    assert!(ok, "baton status: {err}");
    let gpus = serde_json::from_str::<Value>(&out).unwrap()["gpus"].clone();
    assert_eq!(
        gpus,
        json!([{"device": "nvidia0", "minor": 0, "containers": 1,
                "ledger_vram_bytes": Trainer::with_worker().vram_mib << 20, "nvml_used_bytes": null}]),
        "{out}"
    );
    let (out, _, _) = rig.baton(&["status"]);
    assert!(
        out.lines()
            .any(|l| l.starts_with("nvidia0") && l.trim_end().ends_with("unavailable")),
        "{out}"
    );
    let mut events = rig.gpu.watch("trainer");
    let _server = rig.create("server", &Trainer::with_worker(), &SERVER);
    let start = start_in_background(&rig, "server");

    // Nobody but the agent acts: the server's Start returns once the trainer's GPU state has left the GPU.
    let released = events.next_of("trainer", "released", WITHIN).unwrap();
    let (result, returned_ns) = start.join().unwrap();
    result.unwrap();
    let released_ns = released["t_released_ns"].as_u64().unwrap();
    assert!(
        returned_ns > released_ns,
        "the server's Start returned ({returned_ns}) after the trainer's release ({released_ns})"
    );
    rig.wait_held("server");
    assert!(
        wait_until(WITHIN, || preemption(&rig, "trainer")["state"]
            == json!("parked")),
        "the trainer was parked by the agent: {}",
        rig.gpu.status("trainer")
    );
    assert_eq!(rig.task_status("trainer").as_deref(), Some("PAUSED"));
    let g = gap_fill(&rig);
    assert_eq!(g["parked"][0]["id"], json!("trainer"), "{g}");
    assert_eq!(g["parked"][0]["parked_for"]["id"], json!("server"), "{g}");
    let (out, _, _) = rig.baton(&["status"]);
    assert!(
        out.contains("gap-fill: resume order"),
        "baton status shows the resume order:\n{out}"
    );
    // The trainer stays parked while the server holds the GPU.
    assert!(
        !wait_until(Duration::from_millis(500), || preemption(&rig, "trainer")
            .is_null()),
        "the trainer was resumed while the server held its GPU"
    );

    // The server goes: the agent resumes the trainer by itself, its weights intact.
    let api = rig.gpu.env.api().unwrap();
    delete_task(&api, "server");
    let line = trainer.wait_line("restored checksum");
    assert!(line.ends_with("intact"), "{line}");
    assert!(
        wait_until(WITHIN, || preemption(&rig, "trainer").is_null()),
        "the trainer is running again: {}",
        rig.gpu.status("trainer")
    );
    rig.wait_held("trainer");
    assert_eq!(rig.task_status("trainer").as_deref(), Some("RUNNING"));
    assert!(
        wait_until(WITHIN, || gap_fill(&rig)["parked"] == json!([])),
        "{}",
        gap_fill(&rig)
    );
}

#[test]
fn a_holder_without_preemptible_keeps_the_gpu_and_the_gates_error_names_it_and_why() {
    let Some(rig) = CudaRig::start("gapfill-kept") else {
        return;
    };
    let co_runner = [("baton.io/role", "co-runner")];
    let _trainer = rig.run("trainer", &Trainer::with_worker(), &co_runner);
    rig.wait_held("trainer");
    let short = [
        ("baton.io/role", "latency-critical"),
        ("baton.io/wait-gpu-free", "1s"),
    ];
    let _server = rig.create("server", &Trainer::with_worker(), &short);
    let err = start_fails(&rig, "server");
    assert!(
        err.contains("still held by container trainer") && err.contains("baton.io/preemptible"),
        "the error names the holder and why it was not preempted: {err}"
    );
    assert_eq!(rig.task_status("server").as_deref(), Some("CREATED"));
    expect_untouched(&rig, "trainer");
}

#[test]
fn a_co_runner_behind_the_gate_never_preempts_a_server() {
    let Some(rig) = CudaRig::start("gapfill-never-back") else {
        return;
    };
    let server = [("baton.io/role", "latency-critical")];
    let _server = rig.run("server", &Trainer::with_worker(), &server);
    rig.wait_held("server");
    let co_runner = [
        ("baton.io/role", "co-runner"),
        ("baton.io/preemptible", "park"),
        ("baton.io/wait-gpu-free", "1s"),
    ];
    let _trainer = rig.create("trainer", &Trainer::with_worker(), &co_runner);
    let err = start_fails(&rig, "trainer");
    assert!(
        err.contains("still held by container server") && err.contains("never preempted"),
        "the error names the server and says it is never preempted: {err}"
    );
    expect_untouched(&rig, "server");
    assert_eq!(gap_fill(&rig)["preempting"], json!([]));
}

#[test]
fn a_failed_preemption_fails_the_servers_start_naming_the_co_runner_which_keeps_running() {
    let Some(rig) = CudaRig::start("gapfill-fails") else {
        return;
    };
    let failing = Trainer {
        extra: vec!["--fail-at".into(), "checkpoint".into()],
        ..Trainer::with_worker()
    };
    let _trainer: Running = rig.run("trainer", &failing, &PREEMPTIBLE);
    rig.wait_held("trainer");
    let _server = rig.create("server", &Trainer::with_worker(), &SERVER);
    let asked = std::time::Instant::now();
    let err = start_fails(&rig, "server");
    assert!(
        err.contains("could not preempt co-runner trainer")
            && err.contains("injected at checkpoint"),
        "the error names the co-runner and why: {err}"
    );
    assert!(
        asked.elapsed() < Duration::from_secs(50),
        "the Start failed on the preemption's failure, not at the gate's 1m timeout"
    );
    assert_eq!(rig.task_status("server").as_deref(), Some("CREATED"));
    expect_untouched(&rig, "trainer");
}

#[test]
fn parked_co_runners_resume_highest_priority_first_and_one_that_finishes_or_is_killed_is_reported_not_resumed()
 {
    let Some(rig) = CudaRig::start("gapfill-order") else {
        return;
    };
    let small = |extra: &[&str]| Trainer {
        vram_mib: 64,
        extra: extra.iter().map(|e| e.to_string()).collect(),
        ..Trainer::with_worker()
    };
    let with_priority = |p: &'static str| {
        [
            ("baton.io/role", "co-runner"),
            ("baton.io/preemptible", "park"),
            ("baton.io/priority", p),
        ]
    };
    let mut low = rig.run("low", &small(&[]), &with_priority("0"));
    let _high = rig.run(
        "high",
        &small(&["--exit-at-restore", "7"]),
        &with_priority("5"),
    );
    let _victim = rig.run("victim", &small(&[]), &with_priority("1"));
    for id in ["low", "high", "victim"] {
        rig.wait_held(id);
    }
    let mut low_events = rig.gpu.watch("low");
    let _server = rig.create("server", &Trainer::with_worker(), &SERVER);
    let api = rig.gpu.env.api().unwrap();
    api.start("server", "").unwrap();
    for id in ["low", "high", "victim"] {
        assert!(
            wait_until(WITHIN, || preemption(&rig, id)["state"] == json!("parked")),
            "{id} was parked: {}",
            rig.gpu.status(id)
        );
    }
    let order = |g: &Value| -> Vec<String> {
        g["parked"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["id"].as_str().unwrap().to_owned())
            .collect()
    };
    let g = gap_fill(&rig);
    assert_eq!(order(&g), ["high", "victim", "low"], "{g}");
    assert!(g["parked"][0]["parked_ns"].as_u64().unwrap() > 0, "{g}");

    // Killed while parked: finished, never resumed.
    api.kill("victim", "", 9, true).unwrap();
    assert!(
        wait_until(WITHIN, || order(&gap_fill(&rig)) == ["high", "low"]),
        "{}",
        gap_fill(&rig)
    );
    let g = gap_fill(&rig);
    assert_eq!(g["finished"][0]["id"], json!("victim"), "{g}");
    assert!(
        g["finished"][0]["detail"]
            .as_str()
            .unwrap()
            .contains("killed while parked"),
        "{g}"
    );

    // The server goes: `high` is resumed first and exits at its restore (status 7): finished, not resumed
    // again; then `low` is resumed, its weights intact.
    delete_task(&api, "server");
    let line = low.wait_line("restored checksum");
    assert!(line.ends_with("intact"), "{line}");
    let acquired = low_events.next_of("low", "acquired", WITHIN).unwrap();
    let g = gap_fill(&rig);
    let high = g["finished"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["id"] == json!("high"))
        .unwrap_or_else(|| panic!("high finished: {g}"));
    assert!(
        high["detail"].as_str().unwrap().contains('7'),
        "its exit status: {high}"
    );
    assert!(
        acquired["t_ns"].as_u64().unwrap() > high["t_ns"].as_u64().unwrap(),
        "low was resumed after high's resume ended: {acquired} {high}"
    );
    assert!(
        wait_until(WITHIN, || gap_fill(&rig)["parked"] == json!([])),
        "{}",
        gap_fill(&rig)
    );
}

#[test]
fn two_servers_behind_the_gate_start_one_at_a_time_on_one_preemption_and_the_trainer_resumes_once_neither_needs_the_gpu()
 {
    let Some(rig) = CudaRig::start("gapfill-two") else {
        return;
    };
    let mut trainer = rig.run("trainer", &Trainer::with_worker(), &PREEMPTIBLE);
    rig.wait_held("trainer");
    let mut events = rig.gpu.watch("trainer");
    let _a = rig.create("server-a", &Trainer::with_worker(), &SERVER);
    let _b = rig.create("server-b", &Trainer::with_worker(), &SERVER);
    let start_a = start_in_background(&rig, "server-a");
    let start_b = start_in_background(&rig, "server-b");
    let released = events.next_of("trainer", "released", WITHIN).unwrap();
    let released_ns = released["t_released_ns"].as_u64().unwrap();
    // One Start per GPU at a time: the release lets one server through, and the other waits while it holds
    // the GPU (before, both went through together and shared the GPU each was to have alone).
    assert!(
        wait_until(WITHIN, || start_a.is_finished() || start_b.is_finished()),
        "the release let a server through"
    );
    let ((first, first_start), (second, second_start)) = if start_a.is_finished() {
        (("server-a", start_a), ("server-b", start_b))
    } else {
        (("server-b", start_b), ("server-a", start_a))
    };
    let (result, returned_ns) = first_start.join().unwrap();
    result.unwrap_or_else(|e| panic!("{first}'s Start: {e}"));
    assert!(
        returned_ns > released_ns,
        "{first} started after the release"
    );
    rig.wait_held(first);
    assert!(
        !wait_until(Duration::from_millis(500), || second_start.is_finished()),
        "{second} waits while {first} holds the GPU"
    );
    // One preemption served both: the trainer was parked once and is not preempted again.
    assert_eq!(preemption(&rig, "trainer")["state"], json!("parked"));
    let g = gap_fill(&rig);
    assert_eq!(g["parked"].as_array().unwrap().len(), 1, "{g}");
    assert_eq!(g["preempting"], json!([]), "{g}");

    // The first server goes: the second starts, and the trainer stays parked while it holds the GPU. The
    // second is parked by an operator: no server needs the GPU any more, and the trainer resumes by itself.
    let api = rig.gpu.env.api().unwrap();
    delete_task(&api, first);
    let (result, _) = second_start.join().unwrap();
    result.unwrap_or_else(|e| panic!("{second}'s Start: {e}"));
    rig.wait_held(second);
    assert!(
        !wait_until(Duration::from_millis(500), || preemption(&rig, "trainer")
            .is_null()),
        "the trainer was resumed while {second} held its GPU"
    );
    rig.baton_json(&["preempt", second]);
    let line = trainer.wait_line("restored checksum");
    assert!(line.ends_with("intact"), "{line}");
    assert!(
        wait_until(WITHIN, || preemption(&rig, "trainer").is_null()),
        "{}",
        rig.gpu.status("trainer")
    );
    assert_eq!(preemption(&rig, second)["state"], json!("parked"));
}

#[test]
fn a_server_that_exits_by_itself_gives_the_gpu_back_to_the_trainer_it_parked() {
    let Some(rig) = CudaRig::start("gapfill-crash") else {
        return;
    };
    let mut trainer = rig.run("trainer", &Trainer::with_worker(), &PREEMPTIBLE);
    rig.wait_held("trainer");
    // A server that stops after a few hundred steps (a crash, as far as the agent can tell): not deleted.
    let short_lived = Trainer {
        steps: 300,
        ..Trainer::with_worker()
    };
    let _server = rig.create("server", &short_lived, &SERVER);
    rig.gpu.env.api().unwrap().start("server", "").unwrap();
    assert!(
        wait_until(WITHIN, || rig.task_status("server").as_deref()
            == Some("STOPPED")),
        "the server exited"
    );
    let line = trainer.wait_line("restored checksum");
    assert!(line.ends_with("intact"), "{line}");
    assert!(
        wait_until(WITHIN, || preemption(&rig, "trainer").is_null()),
        "{}",
        rig.gpu.status("trainer")
    );
    assert_eq!(rig.task_status("server").as_deref(), Some("STOPPED"));
}

/// [`gap_fill`], or `None` while no agent answers.
fn try_gap_fill(rig: &CudaRig) -> Option<Value> {
    let (out, _, ok) = rig.baton(&["status", "--json"]);
    ok.then(|| serde_json::from_str::<Value>(&out).ok())
        .flatten()
        .map(|v| v["gap_fill"].clone())
}

#[test]
fn an_agent_restarted_while_the_trainer_is_parked_for_a_server_still_resumes_it_when_the_server_goes()
 {
    let Some(rig) = CudaRig::start("gapfill-agent-restart") else {
        return;
    };
    let mut trainer = rig.run("trainer", &Trainer::with_worker(), &PREEMPTIBLE);
    rig.wait_held("trainer");
    let _server = rig.create("server", &Trainer::with_worker(), &SERVER);
    let api = rig.gpu.env.api().unwrap();
    api.start("server", "").unwrap();
    rig.wait_held("server");
    assert!(
        wait_until(WITHIN, || preemption(&rig, "trainer")["state"]
            == json!("parked")),
        "{}",
        rig.gpu.status("trainer")
    );

    // The agent dies: the shims start another and register their containers again, the trainer with the
    // state its shim kept (parked for the server), which the new agent takes up.
    rig.gpu.env.containerd().kill_agent();
    assert!(
        wait_until(WITHIN, || try_gap_fill(&rig)
            .is_some_and(|g| g["parked"][0]["id"] == json!("trainer"))),
        "the new agent knows the trainer was parked for the server: {:?}",
        try_gap_fill(&rig)
    );
    assert_eq!(
        try_gap_fill(&rig).unwrap()["parked"][0]["parked_for"]["id"],
        json!("server")
    );

    // The server goes: the new agent resumes the trainer by itself.
    delete_task(&api, "server");
    let line = trainer.wait_line("restored checksum");
    assert!(line.ends_with("intact"), "{line}");
    assert!(
        wait_until(WITHIN, || preemption(&rig, "trainer").is_null()),
        "{}",
        rig.gpu.status("trainer")
    );
}

/// The agent dies while it parks the trainer for a server waiting behind the gate (a DaemonSet rollout in the
/// middle of a scale-from-zero start): the shim finishes the park it was asked for, the server's Start asks the
/// next agent for the time it has left instead of failing, the new agent adopts the park (parked for the
/// server) and resumes the trainer when the server goes. The trainer has a forked worker, which the new agent
/// sees holding opaque files: the kernel (kcmp) says they are its parent's, and the shim's word on the
/// driver's checkpoint, which the parked state carries, says they carry nothing (issue 39, item 3). The
/// checkpoint waits (the mock's hang file) until the new agent watches the trainer, so that it reads the
/// parent's files before the checkpoint closes them: files it sees only in the worker would hold (they could
/// be ones the worker opened itself).
#[test]
fn an_agent_restarted_while_it_parks_the_trainer_still_starts_the_server_and_adopts_the_park() {
    let Some(rig) = CudaRig::start("gapfill-restart-mid-park") else {
        return;
    };
    // A park that waits in its checkpoint while the hang files exist.
    let slow = Trainer {
        extra: vec!["--hang-at".into(), "checkpoint".into()],
        ..Trainer::with_worker()
    };
    let mut trainer = rig.run("trainer", &slow, &PREEMPTIBLE);
    let hangs = hang_files(&rig, "trainer");
    let _server = rig.create("server", &Trainer::default(), &SERVER);
    let start = start_in_background(&rig, "server");
    assert!(
        wait_until(WITHIN, || gap_fill(&rig)["preempting"]
            .to_string()
            .contains("\"trainer\"")),
        "the agent began to park the trainer: {}",
        gap_fill(&rig)
    );
    assert!(preemption(&rig, "trainer")["state"] != json!("parked"));
    rig.gpu.env.containerd().kill_agent();
    // The next agent (the shims start it) watches the trainer, both processes holding their files.
    assert!(
        wait_until(WITHIN, || try_status(&rig, "trainer").is_some_and(|s| {
            s["processes"].as_array().is_some_and(|p| p.len() == 2)
        })),
        "the new agent watches the trainer and its worker: {:?}",
        try_status(&rig, "trainer")
    );
    for hang in &hangs {
        std::fs::remove_file(hang).unwrap();
    }

    let (result, _) = start.join().unwrap();
    result.unwrap_or_else(|e| panic!("the server's Start survives the agent's restart: {e}"));
    rig.wait_held("server");
    assert!(
        wait_until(WITHIN, || try_gap_fill(&rig)
            .is_some_and(|g| g["parked"][0]["id"] == json!("trainer"))),
        "the new agent took up the park: {:?}",
        try_gap_fill(&rig)
    );
    assert_eq!(
        try_gap_fill(&rig).unwrap()["parked"][0]["parked_for"]["id"],
        json!("server")
    );
    assert_eq!(preemption(&rig, "trainer")["state"], json!("parked"));

    // The server goes: the new agent resumes the trainer by itself, its weights intact.
    let api = rig.gpu.env.api().unwrap();
    delete_task(&api, "server");
    let line = trainer.wait_line("restored checksum");
    assert!(line.ends_with("intact"), "{line}");
    assert!(
        wait_until(WITHIN, || preemption(&rig, "trainer").is_null()),
        "{}",
        rig.gpu.status("trainer")
    );
}

/// Container `id`'s status from the agent now (`None` while no agent watches it).
fn try_status(rig: &CudaRig, id: &str) -> Option<Value> {
    baton_integration::agent::container_status(&rig.gpu.env.containerd().agent_socket(), id)
        .ok()
        .flatten()
}

/// Creates the hang file of each process of container `id` once both its workload process and the worker it
/// forked hold the GPU's files (a `--hang-at` action waits while its process's file exists); returns them.
fn hang_files(rig: &CudaRig, id: &str) -> Vec<std::path::PathBuf> {
    assert!(
        wait_until(WITHIN, || rig.gpu.status(id)["processes"]
            .as_array()
            .is_some_and(|p| p.len() == 2)),
        "{id} and its worker hold the GPU's files: {}",
        rig.gpu.status(id)
    );
    let pids: Vec<u32> = rig.gpu.status(id)["processes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["pid"].as_u64().unwrap() as u32)
        .collect();
    pids.into_iter()
        .map(|pid| {
            let hang = baton_mock_nvidia::workload::control::host_socket_path(pid)
                .unwrap()
                .with_extension("hang");
            std::fs::write(&hang, "").unwrap();
            hang
        })
        .collect()
}

/// The rate gate's row of the trainer's GPU (the mock's `nvidia0`).
fn gpu_row(rig: &CudaRig) -> Value {
    let g = gap_fill(rig);
    g["gpus"]
        .as_array()
        .and_then(|gpus| gpus.iter().find(|r| r["device"] == json!("nvidia0")))
        .cloned()
        .unwrap_or_else(|| panic!("no row for nvidia0: {g}"))
}

/// A server `id` (with `annotations` and the node's TOML `toml`) starts, parks the trainer and holds the GPU.
fn server_comes(rig: &CudaRig, id: &str, annotations: &[(&str, &str)], toml: &str) {
    let options = baton_integration::api::runtime_options_toml(toml);
    let _server = rig.create_with(id, &Trainer::with_worker(), annotations, Some(options));
    rig.gpu.env.api().unwrap().start(id, "").unwrap();
    rig.wait_held(id);
    assert!(
        wait_until(WITHIN, || preemption(rig, "trainer")["state"]
            == json!("parked")),
        "the trainer was parked for {id}: {}",
        rig.gpu.status("trainer")
    );
}

/// Server `id` is deleted.
fn server_goes(rig: &CudaRig, id: &str) {
    let api = rig.gpu.env.api().unwrap();
    delete_task(&api, id);
    api.delete_container(id).unwrap();
}

#[test]
fn the_rate_gate_stops_filling_when_preemptions_cost_too_much_and_fills_again_once_they_left_the_window()
 {
    let Some(rig) = CudaRig::start("gapfill-rate-gate") else {
        return;
    };
    // A 15 s window and a least share of 0.99: any preemption costing more than 0.15 s stops filling
    // until it has left the window.
    const WINDOW: Duration = Duration::from_secs(15);
    let toml = "gap_fill_min_share = 0.99\ngap_fill_window = \"15s\"\n";
    // Every shim of a node has the node's TOML. The trainer has no forked worker: the server-1 park and resume
    // below happen before the agent's restart, so a worker would keep the files of the trainer's first CUDA
    // session, which the next agent sees in the worker alone; nothing the kernel or the driver says tells
    // them from files the worker opened itself, so they hold (see hand_back.rs).
    let options = baton_integration::api::runtime_options_toml(toml);
    let mut trainer = rig.create_with("trainer", &Trainer::default(), &PREEMPTIBLE, Some(options));
    rig.gpu.env.api().unwrap().start("trainer", "").unwrap();
    rig.wait_held("trainer");
    let steps = AgentSteps::start(&rig, "trainer");

    // The first preemption: C is unknown until the trainer runs again, so the agent fills.
    server_comes(&rig, "server-1", &SERVER, toml);
    server_goes(&rig, "server-1");
    let line = trainer.wait_line("restored checksum");
    assert!(line.ends_with("intact"), "{line}");
    assert!(
        wait_until(WITHIN, || preemption(&rig, "trainer").is_null()),
        "{}",
        rig.gpu.status("trainer")
    );
    let row = gpu_row(&rig);
    let c = row["c_s"]
        .as_f64()
        .unwrap_or_else(|| panic!("C measured: {row}"));
    assert!(c > 0.15, "C is the whole time lost: {row}");
    assert_eq!(gap_fill(&rig)["rate_gate"]["min_share"], json!(0.99));
    assert_eq!(row["filling"], json!(false), "over the bound now: {row}");
    // The trainer's trace says so, with the rule's figures.
    steps.wait_for_matching("off", |d| {
        d.starts_with("nvidia0: 1 - ") && d.ends_with(" < 0.99")
    });

    // A DaemonSet rollout: the agent's process goes, its window does not. The next agent (started by the
    // shims, which register again) has the same preemptions and C, and keeps the GPU closed.
    rig.gpu.env.containerd().kill_agent();
    assert!(
        wait_until(WITHIN, || try_gap_fill(&rig).is_some_and(|g| g["gpus"]
            .as_array()
            .is_some_and(|gpus| gpus
                .iter()
                .any(|r| r["device"] == json!("nvidia0"))))),
        "the new agent answers with a row for nvidia0: {:?}",
        try_gap_fill(&rig)
    );
    let after = gpu_row(&rig);
    assert_eq!(after["c_s"], row["c_s"], "C survives the restart: {after}");
    assert_eq!(after["filling"], json!(false), "still closed: {after}");
    assert!(
        after["preemptions_per_hour"].as_f64() >= Some(3600.0 / 15.0),
        "{after}"
    );
    // The trace of the earlier agent ended with it.
    let steps = AgentSteps::start(&rig, "trainer");

    // The next server parks the trainer again. Idle for longer than its park-when-idle, it stays resident while
    // the gate is closed; once it goes, the trainer stays parked.
    server_comes(&rig, "server-2", &IDLE_SERVER, toml);
    assert!(
        !wait_until(Duration::from_secs(6), || !preemption(&rig, "server-2")
            .is_null()),
        "the idle server was parked although the rate gate is closed: {}",
        rig.gpu.status("server-2")
    );
    assert_eq!(gpu_row(&rig)["filling"], json!(false));
    server_goes(&rig, "server-2");
    assert!(
        !wait_until(Duration::from_secs(2), || preemption(&rig, "trainer")
            .is_null()),
        "the trainer was resumed although the rate gate is closed"
    );
    let row = gpu_row(&rig);
    assert_eq!(row["filling"], json!(false), "{row}");
    assert_eq!(row["parked"][0]["id"], json!("trainer"), "{row}");
    let per_hour = row["preemptions_per_hour"].as_f64().unwrap();
    assert!(per_hour >= 3600.0 / 15.0, "{row}");
    assert!(row["projected_share"].as_f64().unwrap() < 0.99, "{row}");
    let (out, _, _) = rig.baton(&["status"]);
    assert!(
        out.contains("gap-fill: rate gate") && out.contains(" off "),
        "baton status shows the rate gate closed:\n{out}"
    );

    // The preemptions leave the window: the agent fills again and resumes the trainer by itself.
    let line = trainer
        .try_wait_line("restored checksum", WINDOW + WITHIN)
        .expect("the trainer resumed once the preemptions left the window");
    assert!(line.ends_with("intact"), "{line}");
    assert!(
        wait_until(WINDOW + WITHIN, || preemption(&rig, "trainer").is_null()),
        "{}",
        rig.gpu.status("trainer")
    );
    let row = gpu_row(&rig);
    assert_eq!(row["filling"], json!(true), "{row}");
    steps.wait_for_matching("on", |d| d.ends_with(" >= 0.99"));
}

#[test]
fn an_idle_server_is_parked_for_the_trainer_and_a_request_for_it_hands_the_gpu_back() {
    let Some(rig) = CudaRig::start("gapfill-idle-park") else {
        return;
    };
    // No request event for 3 s: the agent parks the server, and the trainer gets the GPU back by itself.
    let (_trainer, _server) =
        rig.idle_server_parked_for_a_trainer(&Trainer::with_worker(), &IDLE_SERVER);
    assert!(
        wait_until(WITHIN, || preemption(&rig, "trainer").is_null()),
        "{}",
        rig.gpu.status("trainer")
    );
    rig.wait_held("trainer");
    // Parked unfrozen, the idle park's default: its CPU threads answer a liveness probe.
    assert_eq!(rig.task_status("server").as_deref(), Some("RUNNING"));
    assert_eq!(preemption(&rig, "server")["unfrozen"], json!(true));

    // A request for the server: the trainer is parked and the server resumed on its release.
    let reply = tell_agent(
        &rig,
        r#"{"v":1,"op":"request_start","id":"r1","server":"server"}"#,
    );
    assert!(reply.contains("\"ok\":true"), "{reply}");
    assert!(
        wait_until(WITHIN, || preemption(&rig, "trainer")["state"]
            == json!("parked")),
        "the trainer was parked for the request: {}",
        rig.gpu.status("trainer")
    );
    assert!(
        wait_until(WITHIN, || preemption(&rig, "server").is_null()),
        "the server was resumed: {}",
        rig.gpu.status("server")
    );
    rig.wait_held("server");
    assert_eq!(rig.task_status("server").as_deref(), Some("RUNNING"));
    // A request in flight: the server is not idle, it keeps the GPU.
    assert!(
        !wait_until(Duration::from_secs(5), || !preemption(&rig, "server")
            .is_null()),
        "the server was parked with a request in flight"
    );
}

#[test]
fn a_request_that_comes_while_the_idle_server_is_being_parked_hands_the_gpu_back_once_it_is_parked()
{
    let Some(rig) = CudaRig::start("gapfill-park-race") else {
        return;
    };
    let _trainer = rig.run("trainer", &Trainer::with_worker(), &PREEMPTIBLE);
    rig.wait_held("trainer");
    // A park that takes 4 s: 512 MiB copied at 128 MiB/s.
    let slow = Trainer {
        vram_mib: 512,
        copy_mib_per_s: 128,
        ..Trainer::with_worker()
    };
    let _server = rig.create("server", &slow, &IDLE_SERVER);
    rig.gpu.env.api().unwrap().start("server", "").unwrap();
    rig.wait_held("server");
    let steps = AgentSteps::start(&rig, "server");

    // The request comes while the agent parks the idle server (its trace shows who asked at once; the shim's
    // steps come with its answer).
    steps.wait_for("asked", "park by idle park");
    let reply = tell_agent(
        &rig,
        r#"{"v":1,"op":"request_start","id":"r1","server":"server"}"#,
    );
    assert!(reply.contains("\"ok\":true"), "{reply}");
    steps.wait_for("done", "park");
    steps.wait_for("asked", "by a request for it");
    assert!(
        wait_until(WITHIN, || preemption(&rig, "server").is_null()
            && rig.gpu.status("server")["gpu"] == json!("held")),
        "the server was handed the GPU back once parked: {}; its steps: {:?}",
        rig.gpu.status("server"),
        steps.seen()
    );
    assert_eq!(preemption(&rig, "trainer")["state"], json!("parked"));
}

/// The example request proxy (`tools/baton/examples/request_proxy.rs`) in front of `upstream`, fed to the agent,
/// with `flags`.
fn start_proxy(rig: &CudaRig, dir: &Path, name: &str, upstream: &Path, flags: &[&str]) -> Proxy {
    let bin = Binaries::debug_built().unwrap().proxy;
    let listen = dir.join(format!("{name}.sock"));
    let mut command = std::process::Command::new(bin);
    command
        .arg("--listen")
        .arg(&listen)
        .arg("--server")
        .arg(upstream)
        .arg("--agent")
        .arg(rig.gpu.env.containerd().agent_socket())
        .args(flags);
    Proxy::start(command, listen, dir.join(format!("{name}.log"))).unwrap()
}

/// Sends request `id` through the proxy at `socket`: the first line of its answer.
fn ask(socket: &Path, id: &str) -> String {
    use std::io::{BufRead, Write};
    let mut s = std::os::unix::net::UnixStream::connect(socket).unwrap();
    writeln!(s, "{id}").unwrap();
    let mut line = String::new();
    std::io::BufReader::new(s).read_line(&mut line).unwrap();
    line.trim_end().to_owned()
}

#[test]
fn the_example_proxy_holds_a_request_until_its_parked_server_holds_the_gpu_and_refuses_past_its_bounds()
 {
    let Some(rig) = CudaRig::start("gapfill-proxy") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let (_trainer, _server) =
        rig.idle_server_parked_for_a_trainer(&Trainer::with_worker(), &IDLE_SERVER);

    // The server's front end (here, in the test) answers each request with whether the server container held
    // its GPU, unparked, when the request reached it.
    let upstream = dir.path().join("upstream.sock");
    let listener = std::os::unix::net::UnixListener::bind(&upstream).unwrap();
    let agent = rig.gpu.env.containerd().agent_socket();
    let front_end = std::thread::spawn(move || {
        use std::io::{BufRead, Write};
        let (conn, _) = listener.accept().unwrap();
        let mut id = String::new();
        std::io::BufReader::new(&conn).read_line(&mut id).unwrap();
        let s = baton_integration::agent::container_status(&agent, "server")
            .unwrap()
            .unwrap();
        let resident = s["gpu"] == json!("held") && s["preemption"].is_null();
        writeln!(&conn, "{} resident={resident}", id.trim()).unwrap();
    });
    let proxy = start_proxy(
        &rig,
        dir.path(),
        "hold",
        &upstream,
        &["--hold-for", "server"],
    );
    assert_eq!(
        ask(proxy.socket(), "r1"),
        "r1 resident=true",
        "the request reached the server only once it held its GPU; the proxy said: {}",
        proxy.errors()
    );
    front_end.join().unwrap();
    assert_eq!(preemption(&rig, "trainer")["state"], json!("parked"));

    // A server that never gets its GPU: past the bound on waiting requests, and past the wait, a clear 503.
    for (name, flags, why) in [
        ("full", ["--max-waiting", "0"], "--max-waiting 0"),
        (
            "slow",
            ["--hold-timeout", "1"],
            "absent did not hold its GPU within 1s",
        ),
    ] {
        let proxy = start_proxy(
            &rig,
            dir.path(),
            name,
            &upstream,
            &[&["--hold-for", "absent"][..], &flags[..]].concat(),
        );
        let refused = ask(proxy.socket(), name);
        assert!(
            refused.starts_with("503 ") && refused.contains(why),
            "{refused}"
        );
    }
}
