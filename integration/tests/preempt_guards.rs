//! What keeps a preemption from hanging or losing track, end to end (the mock CUDA workload under real
//! containerd, runc, the Baton shim and its agent, the cuda-checkpoint stand-in, the fake libcuda behind the
//! shim's driver helper): Task Pause is refused while cuda-checkpoint runs in the container; a checkpoint that
//! runs past `cuda_checkpoint_timeout` (its process frozen under it) is stopped and rolled back; a driver call
//! wedged in one of two processes fails that pid only, and everything is rolled back, the wedged process once
//! it answers; a process the driver has no CUDA state for is never locked or checkpointed; a resume that fails
//! for a process keeps that process parked, and a second resume gives it its GPU back; a rank of a distributed
//! job and an MPS client are refused up front, and keep running.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use std::{path::PathBuf, sync::mpsc};

use baton_integration::{
    api,
    cuda::{CudaRig, PREEMPTIBLE, SERVER, Trainer, WITHIN},
};
use serde_json::{Value, json};

fn pids_of(rig: &CudaRig, id: &str) -> Vec<u32> {
    rig.gpu.status(id)["processes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["pid"].as_u64().unwrap() as u32)
        .collect()
}

fn wait_held(rig: &CudaRig, id: &str) {
    wait_held_by(rig, id, 1);
}

fn wait_held_by(rig: &CudaRig, id: &str, processes: usize) {
    assert!(
        baton_integration::agent::wait_until(WITHIN, || {
            let s = rig.gpu.status(id);
            s["gpu"] == json!("held") && s["processes"].as_array().unwrap().len() == processes
        }),
        "{id} holds the GPU with {processes} process(es): {}",
        rig.gpu.status(id)
    );
}

/// Node options naming the fake libcuda `library` as the CUDA driver library and no cuda-checkpoint program,
/// so that only the driver API (the shim's helper) can act; then the TOML lines `extra`.
fn api_only_options(library: &std::path::Path, extra: &str) -> Option<prost_types::Any> {
    Some(api::runtime_options_toml(&format!(
        "cuda_driver_path = \"{}\"\ncuda_checkpoint_path = \"/nonexistent/cuda-checkpoint\"\n{extra}",
        library.display()
    )))
}

/// The control socket of the mock CUDA process `pid` (host pid), as seen from the host.
fn control_socket_of(pid: u32) -> PathBuf {
    baton_mock_nvidia::workload::control::host_socket_path(pid).unwrap()
}

/// The step lines of a `baton ... --json` run's stdout.
fn step_lines(out: &str) -> Vec<Value> {
    out.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v.get("phase").is_some())
        .collect()
}

/// The v1 `freezer.state` of `pid`'s cgroup (`None` on a host without the v1 freezer).
fn freezer_state_file(pid: u32) -> Option<PathBuf> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    text.lines().find_map(|line| {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next(), parts.next()?, parts.next()?);
        controllers
            .split(',')
            .any(|c| c == "freezer")
            .then(|| PathBuf::from(format!("/sys/fs/cgroup/freezer{path}/freezer.state")))
    })
}

/// Freezes (or thaws) `pid`'s cgroup behind the shim's back, as a wedged process would hang.
fn set_frozen_behind_the_shims_back(pid: u32, frozen: bool) {
    let file = freezer_state_file(pid).expect("a v1 freezer cgroup");
    std::fs::write(&file, if frozen { "FROZEN" } else { "THAWED" }).unwrap();
}

fn kernel_says_frozen(pid: u32) -> bool {
    freezer_state_file(pid)
        .and_then(|f| std::fs::read_to_string(f).ok())
        .is_some_and(|s| s.trim() != "THAWED")
}

#[test]
fn task_pause_is_refused_while_a_park_runs_and_the_park_completes() {
    let Some(rig) = CudaRig::start("preempt-pause-guard") else {
        return;
    };
    // A 4 s checkpoint copy: the Pause comes in the middle of it.
    let slow = Trainer {
        vram_mib: 1024,
        copy_mib_per_s: 256,
        ..Trainer::default()
    };
    let mut busy = rig.run("busy", &slow, &[]);
    wait_held(&rig, "busy");
    let pid = pids_of(&rig, "busy")[0];
    std::thread::scope(|scope| {
        let park = scope.spawn(|| rig.baton(&["preempt", "busy"]));
        busy.wait_line("locked");
        let pause = rig.gpu.env.ctr(&["task", "pause", "busy"]);
        if pause.success() {
            // Before: the cgroup froze under cuda-checkpoint and the park hung for good (and Task Resume of
            // a container being preempted is refused); let it go.
            set_frozen_behind_the_shims_back(pid, false);
        }
        assert!(!pause.success(), "Task Pause during a park is refused");
        assert!(
            pause.stderr.contains("parking, resuming or checkpointing"),
            "the refusal says why: {}",
            pause.stderr
        );
        let (_, err, ok) = park.join().unwrap();
        assert!(ok, "the park completes: {err}");
    });
    assert_eq!(rig.task_status("busy").as_deref(), Some("PAUSED"));
    rig.baton_json(&["resume", "busy"]);
    let line = busy.wait_line("restored checksum");
    assert!(line.ends_with("intact"), "{line}");
    // Once nothing runs in it, Task Pause works as ever.
    rig.gpu.env.ctr_ok(&["task", "pause", "busy"]).unwrap();
    rig.gpu.env.ctr_ok(&["task", "resume", "busy"]).unwrap();
}

#[test]
fn a_checkpoint_past_its_timeout_is_stopped_and_rolled_back() {
    let Some(rig) = CudaRig::start("preempt-timeout") else {
        return;
    };
    // A 2 s copy each way, well within the 5 s limit; frozen under cuda-checkpoint, it never ends.
    let t = Trainer {
        vram_mib: 512,
        copy_mib_per_s: 256,
        ..Trainer::default()
    };
    let options = api::runtime_options_toml("cuda_checkpoint_timeout = \"5s\"\n");
    let mut trainer = rig.create_with("wedged", &t, &[], Some(options));
    rig.gpu.env.api().unwrap().start("wedged", "").unwrap();
    wait_held(&rig, "wedged");
    let pid = pids_of(&rig, "wedged")[0];

    let (tx, rx) = mpsc::channel();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            let _ = tx.send(rig.baton(&["preempt", "wedged"]));
        });
        trainer.wait_line("copying to host");
        set_frozen_behind_the_shims_back(pid, true);
        let answer = rx.recv_timeout(WITHIN);
        if answer.is_err() {
            // Before: no timeout, the preemption hung for good; let it go.
            set_frozen_behind_the_shims_back(pid, false);
        }
        let (_, err, ok) = answer.expect("the preemption answers");
        assert!(!ok, "the preemption fails");
        assert!(
            err.contains(&format!("--action checkpoint --pid {pid}"))
                && err.contains("did not finish within 5s"),
            "the error names the pid, the step and the limit: {err}"
        );
        assert!(err.contains("rolled back"), "{err}");
    });
    assert!(!kernel_says_frozen(pid), "the rollback thawed it");
    assert_eq!(rig.task_status("wedged").as_deref(), Some("RUNNING"));
    assert_eq!(CudaRig::cuda_state(pid), "running", "restored and unlocked");
    assert_eq!(rig.gpu.status("wedged")["preemption"], Value::Null);
    wait_held(&rig, "wedged");
    // It trains on, and parks and resumes within the limit.
    rig.baton_json(&["preempt", "wedged"]);
    rig.baton_json(&["resume", "wedged"]);
    assert_eq!(CudaRig::cuda_state(pid), "running");
}

#[test]
fn a_failed_resume_keeps_the_failed_pid_parked_and_a_second_resume_retries_it() {
    let Some(rig) = CudaRig::start("preempt-resume-retry") else {
        return;
    };
    let t = Trainer {
        extra: vec!["--fail-at".into(), "restore".into(), "--fail-once".into()],
        ..Trainer::default()
    };
    let mut trainer = rig.run("retry", &t, &[]);
    wait_held(&rig, "retry");
    let pid = pids_of(&rig, "retry")[0];
    rig.baton_json(&["preempt", "retry"]);

    let (out, err, ok) = rig.baton(&["resume", "retry", "--json"]);
    assert!(!ok, "the first resume fails");
    assert!(
        err.contains(&format!("pid {pid}")) && err.contains("injected at restore"),
        "{err}"
    );
    assert!(err.contains("still parked"), "{err}");
    assert!(
        out.lines()
            .any(|l| l.contains("still_parked") && l.contains(&pid.to_string())),
        "a still_parked step names the pid: {out}"
    );
    let status = rig.gpu.status("retry");
    assert_eq!(status["preemption"]["state"], json!("parked"), "{status}");
    assert_eq!(status["preemption"]["pids"], json!([pid]), "{status}");
    // No process got its GPU back: frozen again, parked as before (a frozen process answers no CUDA call,
    // so its state is asked after the second resume).
    assert_eq!(rig.task_status("retry").as_deref(), Some("PAUSED"));
    assert!(
        out.lines()
            .any(|l| l.contains("frozen again: no process was given its GPU back")),
        "{out}"
    );

    let (_, outcome) = rig.baton_json(&["resume", "retry"]);
    assert_eq!(outcome["preemption"], Value::Null, "{outcome}");
    let line = trainer.wait_line("restored checksum");
    assert!(line.ends_with("intact"), "{line}");
    assert_eq!(CudaRig::cuda_state(pid), "running");
    assert_eq!(rig.gpu.status("retry")["preemption"], Value::Null);
}

/// One of two CUDA processes wedges in its checkpoint (its restore thread does not answer while its hang file
/// exists), through the driver API: its call is given up at `cuda_checkpoint_timeout` and the park fails
/// naming that pid and that call; the other process is restored and unlocked, the container runs on, and the
/// wedged one is restored and unlocked too once it answers. A later park of the container works.
#[test]
fn a_wedged_driver_call_fails_its_pid_alone_and_every_process_is_rolled_back() {
    let Some(rig) = CudaRig::start("preempt-api-wedged") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let library = baton_integration::trace_env::fake_libcuda_in(dir.path()).unwrap();
    let t = Trainer {
        processes: 2,
        extra: vec!["--hang-at".into(), "checkpoint".into()],
        ..Trainer::default()
    };
    let options = api_only_options(&library, "cuda_checkpoint_timeout = \"2s\"\n");
    let trainer = rig.create_with("pair", &t, &[], options);
    rig.gpu.env.api().unwrap().start("pair", "").unwrap();
    wait_held_by(&rig, "pair", 2);
    let pids = pids_of(&rig, "pair");
    let (wedged, other) = (pids[0], pids[1]);
    let hang = control_socket_of(wedged).with_extension("hang");
    std::fs::write(&hang, "").unwrap();

    let (out, err, ok) = rig.baton(&["preempt", "pair", "--json"]);
    assert!(!ok, "the park fails: {out}");
    assert!(
        err.contains(&format!("cuCheckpointProcessCheckpoint of pid {wedged}"))
            && err.contains("no answer within 2s")
            && err.contains(&format!("pid(s) [{wedged}] did not answer")),
        "the error names the pid, the call and what is left to do: {err}"
    );
    assert!(
        !err.contains(&format!("pid {other}")),
        "the other process did not fail: {err}"
    );
    assert!(
        step_lines(&out)
            .iter()
            .any(|s| s["phase"] == json!("rolling_back")
                && s["pid"] == json!(wedged)
                && s["detail"].as_str().unwrap().contains("no answer")),
        "a step says the wedged pid is rolled back once it answers: {out}"
    );
    // The other one runs again (its restore thread answers: it is not frozen either), so does the container.
    assert_eq!(
        CudaRig::cuda_state(other),
        "running",
        "restored and unlocked"
    );
    assert!(!kernel_says_frozen(other), "the container is thawed");
    assert_eq!(rig.task_status("pair").as_deref(), Some("RUNNING"));
    assert_eq!(rig.gpu.status("pair")["preemption"], Value::Null);

    // The wedged one answers: its checkpoint completes, and the follow-up restores and unlocks it.
    std::fs::remove_file(&hang).unwrap();
    assert!(
        baton_integration::agent::wait_until(WITHIN, || CudaRig::cuda_state(wedged) == "running"),
        "the wedged process is restored and unlocked once it answers: {}",
        CudaRig::cuda_state(wedged)
    );
    let output = std::fs::read_to_string(trainer.output_file().unwrap()).unwrap();
    let restored: Vec<&str> = output
        .lines()
        .filter(|l| l.starts_with("restored checksum"))
        .collect();
    assert!(
        restored.len() == 2 && restored.iter().all(|l| l.ends_with("intact")),
        "both processes got their weights back: {restored:?}"
    );
    assert!(!kernel_says_frozen(wedged));
    wait_held_by(&rig, "pair", 2);

    // Once the follow-up lets the container go (a park meanwhile is refused as busy), a park works.
    let mut park = (String::new(), String::new(), false);
    assert!(
        baton_integration::agent::wait_until(WITHIN, || {
            park = rig.baton(&["preempt", "pair"]);
            !park
                .1
                .contains("rolling back a process that did not answer")
        }),
        "the follow-up ends"
    );
    assert!(park.2, "a later park works: {}", park.1);
    assert_eq!(rig.task_status("pair").as_deref(), Some("PAUSED"));
    rig.baton_json(&["resume", "pair"]);
    assert_eq!(CudaRig::cuda_state(wedged), "running");
    assert_eq!(CudaRig::cuda_state(other), "running");
}

/// A process the driver has no CUDA state for (here one whose restore thread is gone, so the fake libcuda
/// answers CUDA_ERROR_INVALID_VALUE for it, as for any process that never initialised CUDA) is left alone by
/// a park: never locked or checkpointed, frozen with the cgroup, thawed at resume, named in the timeline. A
/// park of a container none of whose processes has CUDA state is refused, saying so.
#[test]
fn a_process_without_cuda_state_is_frozen_with_the_container_and_never_locked() {
    let Some(rig) = CudaRig::start("preempt-api-no-state") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let library = baton_integration::trace_env::fake_libcuda_in(dir.path()).unwrap();
    let t = Trainer {
        processes: 2,
        ..Trainer::default()
    };
    let _trainer = rig.create_with("mixed", &t, &[], api_only_options(&library, ""));
    rig.gpu.env.api().unwrap().start("mixed", "").unwrap();
    wait_held_by(&rig, "mixed", 2);
    let pids = pids_of(&rig, "mixed");
    let (plain, cuda) = (pids[0], pids[1]);
    // Its NVIDIA files and RM client stay; the driver API no longer reaches it.
    std::fs::remove_file(control_socket_of(plain)).unwrap();

    let (steps, outcome) = rig.baton_json(&["preempt", "mixed"]);
    assert_eq!(outcome["preemption"]["state"], json!("parked"), "{outcome}");
    assert_eq!(outcome["preemption"]["pids"], json!([cuda]), "{outcome}");
    let locked = steps
        .iter()
        .find(|s| s["phase"] == json!("locked"))
        .unwrap();
    assert_eq!(
        locked["detail"],
        json!(format!(
            "1 process(es); left alone (no CUDA state): pid {plain} (CUDA_ERROR_INVALID_VALUE)"
        )),
        "{steps:?}"
    );
    let checkpointed: Vec<&Value> = steps
        .iter()
        .filter(|s| s["phase"] == json!("checkpointed"))
        .map(|s| &s["pid"])
        .collect();
    assert_eq!(checkpointed, [&json!(cuda)], "{steps:?}");
    assert!(kernel_says_frozen(plain), "frozen with the container");
    assert_eq!(rig.task_status("mixed").as_deref(), Some("PAUSED"));

    let (steps, _) = rig.baton_json(&["resume", "mixed"]);
    let restored: Vec<&Value> = steps
        .iter()
        .filter(|s| s["phase"] == json!("restored"))
        .map(|s| &s["pid"])
        .collect();
    assert_eq!(restored, [&json!(cuda)], "{steps:?}");
    assert!(!kernel_says_frozen(plain), "thawed with the container");
    assert_eq!(CudaRig::cuda_state(cuda), "running");
    wait_held_by(&rig, "mixed", 2);

    // No process with CUDA state left: the park is refused before anything changes.
    std::fs::remove_file(control_socket_of(cuda)).unwrap();
    let (_, err, ok) = rig.baton(&["preempt", "mixed"]);
    assert!(!ok, "the park is refused");
    assert!(
        err.contains("holding no CUDA state")
            && err.contains(&plain.to_string())
            && err.contains(&cuda.to_string())
            && err.contains("nothing to park"),
        "{err}"
    );
    assert_eq!(rig.task_status("mixed").as_deref(), Some("RUNNING"));
    assert_eq!(rig.gpu.status("mixed")["preemption"], Value::Null);
}

#[test]
fn a_distributed_rank_and_an_mps_client_are_refused_up_front_and_keep_running() {
    let Some(rig) = CudaRig::start("preempt-refusals") else {
        return;
    };
    let t = Trainer::default();
    let _rank = rig.run_with("rank", &t, &PREEMPTIBLE, &["--env", "WORLD_SIZE=2"]);
    wait_held(&rig, "rank");
    let pid = pids_of(&rig, "rank")[0];
    let refused = |id: &str, pid: u32, why: &str| {
        let (_, err, ok) = rig.baton(&["preempt", id]);
        assert!(!ok, "the preemption of {id} is refused");
        assert!(
            err.contains(&format!("pid {pid}: {why}")) && err.contains("nothing was locked"),
            "the refusal names the pid and why: {err}"
        );
        assert_eq!(rig.task_status(id).as_deref(), Some("RUNNING"));
        assert_eq!(CudaRig::cuda_state(pid), "running", "never locked");
        assert_eq!(rig.gpu.status(id)["preemption"], Value::Null);
        assert_eq!(rig.gpu.status(id)["gpu"], json!("held"));
        err
    };
    let err = refused("rank", pid, "WORLD_SIZE=2");
    assert!(err.contains("a rank of a distributed job"), "{err}");
    // Gap-fill asks the same park: the server's Start fails at once, naming the co-runner and why.
    let _server = rig.create("server", &t, &SERVER);
    let err = rig.start_error("server");
    assert!(
        err.contains("could not preempt co-runner rank") && err.contains("WORLD_SIZE=2"),
        "the server's Start names the co-runner and why: {err}"
    );
    assert_eq!(rig.task_status("server").as_deref(), Some("CREATED"));
    assert_eq!(CudaRig::cuda_state(pid), "running");

    // The default MPS pipe directory mounted in, as a daemon's reaches a client in another container.
    let mount = [
        "--mount",
        "type=tmpfs,src=tmpfs,dst=/tmp/nvidia-mps,options=rw",
    ];
    let _client = rig.run_with("client", &t, &[], &mount);
    wait_held(&rig, "client");
    let pid = pids_of(&rig, "client")[0];
    let err = refused(
        "client",
        pid,
        "the MPS pipe directory /tmp/nvidia-mps is mounted",
    );
    assert!(err.contains("Run it outside MPS"), "{err}");
}
