//! Preemption end to end: the mock CUDA workload (with a restore thread) in containers under real
//! containerd, runc, the Baton shim and its agent, the FUSE mock driver, and the cuda-checkpoint stand-in
//! on the shim's PATH. `baton preempt` parks a trainer (lock, checkpoint, GPU released, frozen), `baton
//! resume` gives its state back with its weights' checksum intact; failures at each step roll back.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use baton_integration::{
    agent::AgentWatch,
    cuda::{CudaRig, Running, Trainer, WITHIN},
    trace_env::{BatonTrace, workspace_binary},
};
use serde_json::{Value, json};

/// The phases of `steps`, in order.
fn phases(steps: &[Value]) -> Vec<String> {
    steps
        .iter()
        .map(|s| s["phase"].as_str().unwrap().to_owned())
        .collect()
}

/// The time of the first step of `phase` (of container `id` when given).
fn t_of(steps: &[Value], phase: &str, id: Option<&str>) -> u64 {
    steps
        .iter()
        .find(|s| s["phase"] == json!(phase) && id.is_none_or(|i| s["id"] == json!(i)))
        .and_then(|s| s["t_ns"].as_u64())
        .unwrap_or_else(|| panic!("no {phase} step in {steps:?}"))
}

fn pids_of(rig: &CudaRig, id: &str) -> Vec<u32> {
    rig.gpu.status(id)["processes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["pid"].as_u64().unwrap() as u32)
        .collect()
}

/// The preemption state `baton status --json` shows for `id` (null when none, or no agent answers).
fn preemption_state(rig: &CudaRig, id: &str) -> Value {
    let (out, _, _) = rig.baton(&["status", id, "--json"]);
    serde_json::from_str::<Value>(&out).map_or(Value::Null, |v| {
        v["containers"][0]["preemption"]["state"].clone()
    })
}

fn wait_held(rig: &CudaRig, id: &str, processes: usize) {
    assert!(
        baton_integration::agent::wait_until(WITHIN, || {
            let s = rig.gpu.status(id);
            s["gpu"] == json!("held") && s["processes"].as_array().unwrap().len() == processes
        }),
        "{id} holds the GPU with {processes} process(es): {}",
        rig.gpu.status(id)
    );
}

#[test]
fn park_releases_the_gpu_before_the_freeze_and_resume_restores_the_weights() {
    let Some(rig) = CudaRig::start("preempt-park") else {
        return;
    };
    let mut trainer = rig.run("trainer", &Trainer::default(), &[]);
    wait_held(&rig, "trainer", 1);
    let pid = pids_of(&rig, "trainer")[0];
    let mut w = rig.gpu.watch("trainer");

    let (steps, outcome) = rig.baton_json(&["preempt", "trainer"]);
    let mut order = phases(&steps);
    // The release signal comes from inside the checkpoint call: it may reach the agent before the shim
    // sees cuda-checkpoint return, never before the checkpoint started nor after the freeze.
    let released_at = order.iter().position(|p| p == "gpu_released").unwrap();
    order.remove(released_at);
    assert_eq!(
        order,
        [
            "asked",
            "locked",
            "checkpoint_started",
            "checkpointed",
            "frozen",
            "done"
        ],
        "{steps:?}"
    );
    assert!(
        t_of(&steps, "checkpoint_started", None) < t_of(&steps, "gpu_released", None),
        "{steps:?}"
    );
    assert_eq!(outcome["preemption"]["state"], json!("parked"), "{outcome}");
    assert!(t_of(&steps, "gpu_released", None) < t_of(&steps, "frozen", None));
    let released = w.next_transition("trainer", WITHIN).unwrap();
    assert_eq!(released["kind"], json!("released"), "{released}");
    assert_eq!(released["pids"], json!([pid]), "{released}");
    // (A frozen process cannot answer cuda-checkpoint --get-state: its restore thread is frozen too.)
    assert_eq!(rig.task_status("trainer").as_deref(), Some("PAUSED"));
    let status = rig.gpu.status("trainer");
    assert_eq!(status["preemption"]["state"], json!("parked"), "{status}");
    assert_eq!(status["nvidia_fds"], json!(0), "{status}");
    let (out, _, _) = rig.baton(&["status"]);
    assert!(
        out.contains("parked"),
        "baton status shows it parked:\n{out}"
    );

    // A second preemption, and Task Resume of a parked container, are refused with what to do.
    let (_, err, ok) = rig.baton(&["preempt", "trainer"]);
    assert!(!ok && err.contains("parked already"), "{err}");
    let resume = rig.gpu.env.ctr(&["task", "resume", "trainer"]);
    assert!(
        !resume.success(),
        "ctr task resume of a parked container is refused"
    );
    assert!(resume.stderr.contains("baton resume"), "{}", resume.stderr);

    let (steps, outcome) = rig.baton_json(&["resume", "trainer"]);
    assert_eq!(
        phases(&steps),
        ["asked", "thawed", "restored", "unlocked", "done"],
        "{steps:?}"
    );
    assert_eq!(outcome["preemption"], Value::Null, "{outcome}");
    trainer.wait_line("checkpointed");
    let line = trainer.wait_line("restored checksum");
    assert!(line.ends_with("intact"), "{line}");
    assert_eq!(
        w.next_transition("trainer", WITHIN).unwrap()["kind"],
        json!("acquired")
    );
    assert_eq!(rig.task_status("trainer").as_deref(), Some("RUNNING"));
    assert_eq!(CudaRig::cuda_state(pid), "running");

    // Resuming a running container is refused.
    let (_, err, ok) = rig.baton(&["resume", "trainer"]);
    assert!(!ok && err.contains("not parked"), "{err}");
}

#[test]
fn a_trace_through_the_agent_shows_each_step_of_a_park_and_a_resume() {
    let Some(rig) = CudaRig::start("preempt-trace") else {
        return;
    };
    let _trainer = rig.run("trainer", &Trainer::default(), &[]);
    wait_held(&rig, "trainer", 1);
    let dir = tempfile::tempdir().unwrap();
    let jsonl = dir.path().join("trace.jsonl");
    let mut command = std::process::Command::new(workspace_binary("baton", "baton").unwrap());
    command
        .args(["trace", "--json", "--container", "trainer", "-o"])
        .arg(&jsonl)
        .env(
            baton_agent_api::SOCKET_ENV,
            rig.gpu.env.containerd().agent_socket(),
        );
    let trace = BatonTrace::start(command, WITHIN).unwrap();
    let (parked, _) = rig.baton_json(&["preempt", "trainer"]);
    let (resumed, _) = rig.baton_json(&["resume", "trainer"]);
    let want: Vec<String> = phases(&parked)
        .into_iter()
        .chain(phases(&resumed))
        .collect();
    let traced = || -> Vec<Value> {
        std::fs::read_to_string(&jsonl)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|o| o["event"] == "preemption")
            .collect()
    };
    assert!(
        baton_integration::agent::wait_until(WITHIN, || traced().len() >= want.len()),
        "the trace shows every step: {:?} of {want:?}",
        traced()
    );
    let (status, stderr) = trace.stop().unwrap();
    assert!(status.success(), "{stderr}");
    // The same steps in the same order, named as the timeline names them.
    let shown: Vec<String> = traced()
        .iter()
        .map(|o| {
            o["phase"]
                .as_str()
                .unwrap()
                .replace(' ', "_")
                .to_lowercase()
        })
        .collect();
    assert_eq!(shown, want);
    assert!(traced().iter().all(|o| {
        o["container"]
            .as_str()
            .is_some_and(|c| c.contains("trainer"))
    }));
}

#[test]
fn two_processes_are_both_locked_before_either_checkpoints_and_release_once_both_let_go() {
    let Some(rig) = CudaRig::start("preempt-two") else {
        return;
    };
    let t = Trainer {
        processes: 2,
        ..Trainer::default()
    };
    let _trainer = rig.run("pair", &t, &[]);
    wait_held(&rig, "pair", 2);
    // Both processes' device memory is in the ledger: each owns CUDA state, so the park names both.
    assert!(
        baton_integration::agent::wait_until(WITHIN, || {
            rig.gpu.status("pair")["vram_bytes"] == json!((2 * t.vram_mib) << 20)
        }),
        "{}",
        rig.gpu.status("pair")
    );
    let mut w = rig.gpu.watch("pair");
    let (steps, _) = rig.baton_json(&["preempt", "pair"]);
    let checkpointed: Vec<u64> = steps
        .iter()
        .filter(|s| s["phase"] == json!("checkpointed"))
        .map(|s| s["t_ns"].as_u64().unwrap())
        .collect();
    assert_eq!(checkpointed.len(), 2, "{steps:?}");
    let locked = t_of(&steps, "locked", None);
    let released = t_of(&steps, "gpu_released", None);
    assert!(checkpointed.iter().all(|&t| t > locked), "{steps:?}");
    assert!(released < t_of(&steps, "frozen", None), "{steps:?}");
    let e = w.next_transition("pair", WITHIN).unwrap();
    assert_eq!(e["kind"], json!("released"), "{e}");
    assert_eq!(
        e["pids"].as_array().unwrap().len(),
        2,
        "one release, once both processes let go: {e}"
    );
    let (steps, _) = rig.baton_json(&["resume", "pair"]);
    assert_eq!(
        steps
            .iter()
            .filter(|s| s["phase"] == json!("restored"))
            .count(),
        2,
        "{steps:?}"
    );
    wait_held(&rig, "pair", 2);
}

#[test]
fn a_failure_at_each_step_leaves_the_container_running_and_says_which_pid_and_why() {
    let Some(rig) = CudaRig::start("preempt-fail") else {
        return;
    };
    for action in ["lock", "checkpoint"] {
        let id = format!("fail-{action}");
        let t = Trainer {
            extra: vec!["--fail-at".into(), action.into()],
            ..Trainer::default()
        };
        let trainer = rig.run(&id, &t, &[]);
        wait_held(&rig, &id, 1);
        let pid = pids_of(&rig, &id)[0];
        let (_, err, ok) = rig.baton(&["preempt", &id]);
        assert!(!ok, "preempting {id} fails");
        assert!(
            err.contains(&format!("pid {pid}")) && err.contains(&format!("injected at {action}")),
            "the error names the pid and what cuda-checkpoint printed: {err}"
        );
        assert!(err.contains("rolled back"), "{err}");
        assert_eq!(rig.task_status(&id).as_deref(), Some("RUNNING"));
        assert_eq!(
            CudaRig::cuda_state(pid),
            "running",
            "{id} was unlocked again"
        );
        assert_eq!(rig.gpu.status(&id)["gpu"], json!("held"));
        assert_eq!(rig.gpu.status(&id)["preemption"], Value::Null);
        // It trains on: a second preemption attempt meets the same clear error, not a stuck state.
        let (_, err, _) = rig.baton(&["preempt", &id]);
        assert!(err.contains("injected"), "{err}");
        drop(trainer);
    }

    // A failing restore: resume says which pid; no process got its GPU back, so the container stays parked,
    // frozen again.
    let t = Trainer {
        extra: vec!["--fail-at".into(), "restore".into()],
        ..Trainer::default()
    };
    let _trainer = rig.run("fail-restore", &t, &[]);
    wait_held(&rig, "fail-restore", 1);
    let pid = pids_of(&rig, "fail-restore")[0];
    rig.baton_json(&["preempt", "fail-restore"]);
    let (_, err, ok) = rig.baton(&["resume", "fail-restore"]);
    assert!(!ok && err.contains(&format!("pid {pid}")), "{err}");
    assert!(err.contains("injected at restore"), "{err}");
    assert_eq!(rig.task_status("fail-restore").as_deref(), Some("PAUSED"));
    assert_eq!(
        rig.gpu.status("fail-restore")["preemption"]["state"],
        json!("parked")
    );

    // A failing unlock after the restore: resume says so, naming the pid.
    let t = Trainer {
        extra: vec!["--fail-at".into(), "unlock".into()],
        ..Trainer::default()
    };
    let _trainer = rig.run("fail-unlock", &t, &[]);
    wait_held(&rig, "fail-unlock", 1);
    let pid = pids_of(&rig, "fail-unlock")[0];
    rig.baton_json(&["preempt", "fail-unlock"]);
    let (_, err, ok) = rig.baton(&["resume", "fail-unlock"]);
    assert!(!ok && err.contains(&format!("pid {pid}")), "{err}");
    assert!(err.contains("injected at unlock"), "{err}");

    // A second preemption while one runs is refused (a slow copy keeps the first one busy).
    let slow = Trainer {
        vram_mib: 1024,
        copy_mib_per_s: 256,
        ..Trainer::default()
    };
    let mut busy = rig.run("busy", &slow, &[]);
    wait_held(&rig, "busy", 1);
    std::thread::scope(|scope| {
        let first = scope.spawn(|| rig.baton(&["preempt", "busy"]));
        busy.wait_line("locked");
        let (_, err, ok) = rig.baton(&["preempt", "busy"]);
        assert!(!ok && err.contains("already"), "{err}");
        let (_, err, ok) = first.join().unwrap();
        assert!(ok, "the first preemption completes: {err}");
    });

    // A container that sees the GPU but holds none, and one that does not exist.
    let _idle = rig.gpu.holder("idle");
    let (_, err, ok) = rig.baton(&["preempt", "idle"]);
    assert!(!ok && err.contains("holds no GPU"), "{err}");
    let (_, err, ok) = rig.baton(&["preempt", "no-such-container"]);
    assert!(!ok && err.contains("no watched container"), "{err}");
}

#[test]
fn a_job_that_exits_during_resume_is_reported_finished_with_its_real_status() {
    let Some(rig) = CudaRig::start("preempt-exit") else {
        return;
    };
    let t = Trainer {
        extra: vec!["--exit-at-restore".into(), "7".into()],
        ..Trainer::default()
    };
    let mut trainer = rig.run("finisher", &t, &[]);
    wait_held(&rig, "finisher", 1);
    rig.baton_json(&["preempt", "finisher"]);
    let (steps, outcome) = rig.baton_json(&["resume", "finisher"]);
    let finished = steps
        .iter()
        .find(|s| s["phase"] == json!("finished"))
        .unwrap_or_else(|| panic!("a finished step: {steps:?}"));
    assert_eq!(
        finished["detail"],
        json!("exited with status 7"),
        "{steps:?}"
    );
    assert_eq!(outcome["preemption"], Value::Null);
    assert_eq!(
        trainer.exit_code(),
        Some(7),
        "TaskExit carries the real status"
    );
}

#[test]
fn a_parked_container_survives_a_containerd_restart_and_a_killed_shim_leaves_nothing_frozen() {
    let Some(mut rig) = CudaRig::start("preempt-restart") else {
        return;
    };
    let mut parked = rig.create("parked", &Trainer::default(), &[]);
    rig.gpu.env.api().unwrap().start("parked", "").unwrap();
    wait_held(&rig, "parked", 1);
    rig.baton_json(&["preempt", "parked"]);
    rig.gpu.env.containerd_mut().restart().unwrap();
    assert!(
        rig.wait_status("parked", "PAUSED"),
        "still paused after the restart"
    );
    assert_eq!(preemption_state(&rig, "parked"), json!("parked"));
    rig.baton_json(&["resume", "parked"]);
    let line = parked.wait_line("restored checksum");
    assert!(line.ends_with("intact"), "{line}");
    wait_held(&rig, "parked", 1);

    // The agent dies while the container is parked: the shim starts another and registers the container
    // again with its persisted state, so it is still parked there and can be resumed.
    rig.baton_json(&["preempt", "parked"]);
    rig.gpu.env.containerd().kill_agent();
    assert!(
        baton_integration::agent::wait_until(WITHIN, || preemption_state(&rig, "parked")
            == json!("parked")),
        "parked after an agent restart: {:?}",
        rig.baton(&["status", "parked"])
    );
    rig.baton_json(&["resume", "parked"]);
    wait_held(&rig, "parked", 1);

    // The shim dies while the container is parked: containerd's clean-up (the shim's delete, runc delete
    // --force, which thaws a frozen container to kill it) leaves nothing frozen with nobody to resume it.
    // The job is lost (its GPU state was in its own, now killed, memory), as with plain runc.
    let pid = pids_of(&rig, "parked")[0];
    rig.baton_json(&["preempt", "parked"]);
    let shims = rig.gpu.env.shims();
    assert_eq!(shims.len(), 1, "{shims:?}");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(shims[0].pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    assert!(
        baton_integration::agent::wait_until(WITHIN, || !std::path::Path::new(&format!(
            "/proc/{pid}"
        ))
        .exists()),
        "the parked process is gone after its shim died"
    );
    let left = rig.gpu.env.leftovers("parked");
    assert!(left.processes.is_empty(), "{left:?}");
}

/// A runc for the real-CRIU tests: before runc's own `checkpoint` (real CRIU, the shim's) it records its
/// arguments, how many NVIDIA fds the container's processes hold at that moment, and what the image folder
/// holds; every subcommand is then the real runc's.
fn runc_recording_dumps(dir: &std::path::Path) -> std::path::PathBuf {
    let script = r#"#!/bin/sh
D='@DIR@'
root=""; img=""; prev=""
for a in "$@"; do
  [ "$prev" = "--root" ] && root=$a
  [ "$prev" = "--image-path" ] && img=$a
  prev=$a
done
case " $* " in
  *" checkpoint "*)
    echo "$*" > "$D/checkpoint-args"
    n=0
    for p in $(runc --root "$root" ps --format json "$prev" | tr -d '[]' | tr ',' ' '); do
      n=$((n + $(ls -l /proc/$p/fd 2>/dev/null | grep -c nvidia)))
    done
    echo $n > "$D/nvidia-fds-at-dump"
    ls "$img" > "$D/image-at-dump" ;;
  *" restore "*)
    ls "$img" > "$D/image-at-restore" ;;
esac
exec runc "$@"
"#;
    let path = dir.join("runc-recording-dumps");
    baton_integration::write_script(&path, &script.replace("@DIR@", &dir.display().to_string()))
        .unwrap();
    path
}

#[test]
fn snapshot_and_task_checkpoint_release_the_gpu_before_criu_dumps() {
    let Some(rig) = CudaRig::start("preempt-snapshot") else {
        return;
    };
    let dir = rig.gpu.env.scratch();
    std::fs::create_dir_all(&dir).unwrap();
    let runc = runc_recording_dumps(&dir);
    let options = baton_integration::api::runtime_options_toml(&format!(
        "BinaryName = \"{}\"\n",
        runc.display()
    ));
    let mut snap = rig.create_with("snap", &Trainer::default(), &[], Some(options));
    rig.gpu.env.api().unwrap().start("snap", "").unwrap();
    wait_held(&rig, "snap", 1);

    // containerd's Task Checkpoint (ctr pauses the task first): the CUDA processes are checkpointed
    // before CRIU runs, then restored, as the container is left running.
    let image_arg = dir.join("task-image").display().to_string();
    let out = rig
        .gpu
        .env
        .ctr(&["task", "checkpoint", "--image-path", &image_arg, "snap"]);
    assert!(out.success(), "ctr task checkpoint: {}", out.stderr);
    let args = std::fs::read_to_string(dir.join("checkpoint-args")).unwrap();
    assert!(args.contains("--leave-running"), "{args}");
    assert_eq!(
        std::fs::read_to_string(dir.join("nvidia-fds-at-dump"))
            .unwrap()
            .trim(),
        "0",
        "no NVIDIA file is open when CRIU dumps"
    );
    // (containerd hands the shim a directory of its own and packs it after: look at it at the dump.)
    let listing = std::fs::read_to_string(dir.join("image-at-dump")).unwrap();
    assert!(
        listing.contains("baton-cuda.json"),
        "the image lists its CUDA processes: {listing}"
    );
    let line = snap.wait_line("restored checksum");
    assert!(line.ends_with("intact"), "{line}");
    assert!(rig.wait_status("snap", "RUNNING"));
    wait_held(&rig, "snap", 1);

    // baton preempt --mode snapshot: released, dumped, stopped.
    let image = dir.join("snapshot-image");
    let image_arg = image.display().to_string();
    let (steps, outcome) = rig.baton_json(&[
        "preempt",
        "snap",
        "--mode",
        "snapshot",
        "--image-path",
        &image_arg,
    ]);
    assert!(
        t_of(&steps, "gpu_released", None) < t_of(&steps, "dumped", None),
        "{steps:?}"
    );
    assert_eq!(
        outcome["preemption"]["state"],
        json!("snapshotted"),
        "{outcome}"
    );
    let args = std::fs::read_to_string(dir.join("checkpoint-args")).unwrap();
    assert!(
        !args.contains("--leave-running") && args.contains(&image_arg),
        "{args}"
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("nvidia-fds-at-dump"))
            .unwrap()
            .trim(),
        "0"
    );
    assert!(rig.wait_status("snap", "STOPPED"), "the dump stopped it");
    let dumped: Vec<String> = std::fs::read_dir(&image)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        dumped.iter().any(|f| f == "pstree.img") && dumped.iter().any(|f| f == "baton-cuda.json"),
        "CRIU's dump beside the CUDA processes' list: {dumped:?}"
    );
}

#[test]
fn a_parked_container_that_is_killed_exits_with_its_real_status_and_is_parked_no_more() {
    let Some(rig) = CudaRig::start("preempt-kill") else {
        return;
    };
    let mut trainer = rig.run("victim", &Trainer::default(), &[]);
    wait_held(&rig, "victim", 1);
    rig.baton_json(&["preempt", "victim"]);
    assert_eq!(rig.task_status("victim").as_deref(), Some("PAUSED"));
    let kill = rig
        .gpu
        .env
        .ctr(&["task", "kill", "--signal", "SIGKILL", "victim"]);
    assert!(kill.success(), "{}", kill.stderr);
    assert_eq!(
        trainer.exit_code(),
        Some(137),
        "TaskExit carries the kill's status"
    );
    let (_, err, ok) = rig.baton(&["resume", "victim"]);
    assert!(!ok, "nothing to resume once it was killed: {err}");
}

#[test]
fn a_task_created_from_a_checkpoint_gets_its_cuda_processes_restored_and_unlocked() {
    let Some(rig) = CudaRig::start("preempt-restore") else {
        return;
    };
    let dir = rig.gpu.env.scratch();
    std::fs::create_dir_all(&dir).unwrap();
    let runc = runc_recording_dumps(&dir);
    let options = || {
        Some(baton_integration::api::runtime_options_toml(&format!(
            "BinaryName = \"{}\"\n",
            runc.display()
        )))
    };
    let _snap = rig.create_with("source", &Trainer::default(), &[], options());
    rig.gpu.env.api().unwrap().start("source", "").unwrap();
    wait_held(&rig, "source", 1);
    // A checkpoint in containerd's content store (CRIU's dump, and the list of CUDA processes the shim
    // wrote), of a task paused first as containerd's Go client does, with `exit`: the source stops.
    let mut restored = rig.restore_from_checkpoint_of("source", "restored", options());
    // The image holds CRIU's dump of the process tree beside the list of CUDA processes the shim wrote.
    let listing = std::fs::read_to_string(dir.join("image-at-restore")).unwrap();
    assert!(
        listing.contains("baton-cuda.json") && listing.contains("pstree.img"),
        "{listing}"
    );
    let line = restored.wait_line("restored checksum");
    assert!(line.ends_with("intact"), "{line}");
    restored.wait_line("unlocked");
    wait_held(&rig, "restored", 1);
}

#[test]
fn a_lock_timeout_a_snapshot_and_a_restore_from_an_image_go_through_the_driver_api() {
    let Some(rig) = CudaRig::start("preempt-api-snapshot") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let library = baton_integration::trace_env::fake_libcuda_in(dir.path()).unwrap();
    // No program at all: every checkpoint call has to go through the helper.
    let options = || api_only_options(&library, "cuda_lock_timeout = \"300ms\"\n");

    // A lock that cannot succeed within cuda_lock_timeout: the driver's timeout, named with the call and
    // the pid, and nothing changed.
    let slow = Trainer {
        extra: vec!["--lock-delay-ms".into(), "5000".into()],
        ..Trainer::default()
    };
    let _slow = rig.create_with("slow-lock", &slow, &[], options());
    rig.gpu.env.api().unwrap().start("slow-lock", "").unwrap();
    wait_held(&rig, "slow-lock", 1);
    let pid = pids_of(&rig, "slow-lock")[0];
    let (_, err, ok) = rig.baton(&["preempt", "slow-lock"]);
    assert!(!ok, "the lock times out");
    assert!(
        err.contains(&format!("cuCheckpointProcessLock of pid {pid}"))
            && err.contains("CUDA_ERROR_TIMEOUT")
            && err.contains("rolled back"),
        "{err}"
    );
    assert_eq!(CudaRig::cuda_state(pid), "running");
    assert_eq!(rig.task_status("slow-lock").as_deref(), Some("RUNNING"));

    // baton preempt --mode snapshot through the helper and real CRIU: released before the dump, stopped,
    // the image beside its list of CUDA processes.
    let _snap = rig.create_with("snap", &Trainer::default(), &[], options());
    rig.gpu.env.api().unwrap().start("snap", "").unwrap();
    wait_held(&rig, "snap", 1);
    let image = rig.gpu.env.scratch().join("api-snapshot");
    let image_arg = image.display().to_string();
    let (steps, outcome) = rig.baton_json(&[
        "preempt",
        "snap",
        "--mode",
        "snapshot",
        "--image-path",
        &image_arg,
    ]);
    assert_eq!(
        outcome["preemption"]["state"],
        json!("snapshotted"),
        "{outcome}"
    );
    assert!(
        t_of(&steps, "gpu_released", None) < t_of(&steps, "dumped", None),
        "{steps:?}"
    );
    assert!(rig.wait_status("snap", "STOPPED"), "the dump stopped it");
    assert!(image.join("pstree.img").is_file() && image.join("baton-cuda.json").is_file());

    // A task created from a Task Checkpoint in containerd's content store: CRIU restores the process,
    // then the helper restores and unlocks its CUDA state.
    let _source = rig.create_with("source", &Trainer::default(), &[], options());
    rig.gpu.env.api().unwrap().start("source", "").unwrap();
    wait_held(&rig, "source", 1);
    let mut restored = rig.restore_from_checkpoint_of("source", "restored", options());
    let line = restored.wait_line("restored checksum");
    assert!(line.ends_with("intact"), "{line}");
    restored.wait_line("unlocked");
    wait_held(&rig, "restored", 1);
}

#[test]
fn a_park_whose_client_went_away_midway_is_still_known_to_the_agent_as_parked() {
    let Some(rig) = CudaRig::start("preempt-client-gone") else {
        return;
    };
    // A slow copy (256 MiB at 128 MiB/s: 2 s), so that the client is gone long before the park ends.
    let slow = Trainer {
        copy_mib_per_s: 128,
        ..Trainer::default()
    };
    let _trainer = rig.run("trainer", &slow, &[]);
    wait_held(&rig, "trainer", 1);
    let mut client = std::process::Command::new(workspace_binary("baton", "baton").unwrap())
        .args(["preempt", "trainer", "--json", "--socket"])
        .arg(rig.gpu.env.containerd().agent_socket())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // The first step line: the park is under way. Then the client goes, as a Ctrl-C'd `baton preempt`.
    let mut first = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(client.stdout.take().unwrap()),
        &mut first,
    )
    .unwrap();
    assert!(first.contains("\"phase\""), "a step line: {first}");
    client.kill().unwrap();
    client.wait().unwrap();
    // The shim finishes the park and tells the agent, which owns no copy of its own to get wrong.
    assert!(
        baton_integration::agent::wait_until(WITHIN, || preemption_state(&rig, "trainer")
            == json!("parked")),
        "the agent shows the park the shim finished: {}",
        rig.gpu.status("trainer")
    );
    assert_eq!(rig.task_status("trainer").as_deref(), Some("PAUSED"));
    // And it can be resumed, which needs the agent to know it is parked.
    let (_, outcome) = rig.baton_json(&["resume", "trainer"]);
    assert_eq!(outcome["preemption"], Value::Null, "{outcome}");
}

/// Node options naming `library` as the CUDA driver library and no cuda-checkpoint program at all, so that
/// only the driver API can act; then the TOML lines `extra`.
fn api_only_options(library: &std::path::Path, extra: &str) -> Option<prost_types::Any> {
    Some(baton_integration::api::runtime_options_toml(&format!(
        "cuda_driver_path = \"{}\"\ncuda_checkpoint_path = \"/nonexistent/cuda-checkpoint\"\n{extra}",
        library.display()
    )))
}

/// Sends `request` to the agent on `socket` and returns its reply line (step lines skipped).
fn agent_reply(socket: &std::path::Path, mut request: Value) -> Value {
    use std::io::{BufRead, Write};
    request["v"] = json!(1);
    let mut stream = std::os::unix::net::UnixStream::connect(socket).unwrap();
    stream.set_read_timeout(Some(WITHIN)).unwrap();
    writeln!(stream, "{request}").unwrap();
    for line in std::io::BufReader::new(stream).lines() {
        let v: Value = serde_json::from_str(&line.unwrap()).unwrap();
        if v.get("ok").is_some() {
            return v;
        }
    }
    panic!("the agent closed the connection without a reply to {request}");
}

#[test]
fn a_snapshot_goes_to_the_node_snapshot_dir_and_a_relative_image_path_is_refused() {
    let Some(rig) = CudaRig::start("preempt-snapdir") else {
        return;
    };
    let dir = rig.gpu.env.scratch();
    std::fs::create_dir_all(&dir).unwrap();
    let runc = runc_recording_dumps(&dir);
    let snapshots = dir.join("snapshots");
    let options = baton_integration::api::runtime_options_toml(&format!(
        "BinaryName = \"{}\"\nsnapshot_dir = \"{}\"\n",
        runc.display(),
        snapshots.display()
    ));
    let _snap = rig.create_with("snapdir", &Trainer::default(), &[], Some(options));
    rig.gpu.env.api().unwrap().start("snapdir", "").unwrap();
    wait_held(&rig, "snapdir", 1);

    // The CLI refuses a relative path before it asks anyone.
    let (_, err, ok) = rig.baton(&[
        "preempt",
        "snapdir",
        "--mode",
        "snapshot",
        "--image-path",
        "snapshots/snapdir",
    ]);
    assert!(!ok && err.contains("give an absolute path"), "{err}");
    // A client that sends one all the same: the shim refuses it before anything happens.
    let socket = rig.gpu.env.containerd().agent_socket();
    let reply = agent_reply(
        &socket,
        json!({"op": "preempt", "id": "snapdir", "mode": "snapshot", "image_path": "img"}),
    );
    assert_eq!(reply["ok"], json!(false), "{reply}");
    assert!(
        reply["error"]
            .as_str()
            .is_some_and(|e| e.contains("give an absolute path")),
        "{reply}"
    );
    assert!(
        !std::path::Path::new(&dir).join("checkpoint-args").exists(),
        "runc checkpoint ran for a refused request"
    );
    assert_eq!(rig.task_status("snapdir").as_deref(), Some("RUNNING"));
    assert_eq!(rig.gpu.status("snapdir")["preemption"], Value::Null);

    // No image path: the node's snapshot_dir, a folder per namespace and container, on disk.
    let expected = snapshots
        .join(rig.gpu.env.namespace())
        .join("snapdir")
        .display()
        .to_string();
    let (_, outcome) = rig.baton_json(&["preempt", "snapdir", "--mode", "snapshot"]);
    assert_eq!(
        outcome["preemption"]["state"],
        json!("snapshotted"),
        "{outcome}"
    );
    assert_eq!(
        outcome["preemption"]["image_path"],
        json!(expected),
        "{outcome}"
    );
    let args = std::fs::read_to_string(dir.join("checkpoint-args")).unwrap();
    assert!(
        args.contains(&format!("--image-path {expected} ")),
        "{args}"
    );
    assert!(
        std::path::Path::new(&expected).join("pstree.img").exists(),
        "no CRIU image in {expected}"
    );
}

/// The fake libcuda's driver-API checkpoint calls (`cuCheckpointProcess*`, what a long-lived helper calls
/// instead of running cuda-checkpoint per action) take a trainer in a container through lock, checkpoint,
/// restore and unlock as the program does: its GPU is released and re-acquired and its weights come back
/// intact. Like the real library's, the calls fail before this process called `cuInit`.
#[test]
fn the_driver_api_checkpoint_calls_take_a_trainer_through_a_park_and_back() {
    use baton_nvidia::cuda_checkpoint::{Action, CudaState, driver_api as cu};
    use std::ffi::{c_int, c_uint, c_void};
    let Some(rig) = CudaRig::start("preempt-driver-api") else {
        return;
    };
    let mut trainer = rig.run("trainer", &Trainer::default(), &[]);
    wait_held(&rig, "trainer", 1);
    let pid = pids_of(&rig, "trainer")[0] as c_int;
    let mut w = rig.gpu.watch("trainer");
    let dir = tempfile::tempdir().unwrap();
    let path = baton_integration::trace_env::fake_libcuda_in(dir.path()).unwrap();
    // SAFETY: the fake library has no initialisers that could misbehave in this process.
    let lib = unsafe { libloading::Library::new(&path) }.unwrap();
    type Init = unsafe extern "C" fn(c_uint) -> u32;
    type Call = unsafe extern "C" fn(c_int, *const c_void) -> u32;
    type GetState = unsafe extern "C" fn(c_int, *mut c_uint) -> u32;
    // SAFETY: the symbols have these C signatures (NVIDIA's cuda.h, CUDA 12.8).
    let (init, get_state) = unsafe {
        (
            *lib.get::<Init>(cu::CU_INIT).unwrap(),
            *lib.get::<GetState>(cu::GET_STATE).unwrap(),
        )
    };
    let state = |expect: u32| {
        let mut value = u32::MAX;
        // SAFETY: `value` lives for the call.
        assert_eq!(unsafe { get_state(pid, &mut value) }, expect);
        cu::state_from_value(value)
    };
    let lock_args = cu::LockArgs {
        timeout_ms: 30_000,
        ..Default::default()
    };
    let act = |action: Action| {
        // SAFETY: the symbol has the C signature `Call` names; every args struct lives for the call (the
        // lock's is read as its timeout, the others' reserved fields are zero).
        unsafe {
            let call = *lib.get::<Call>(cu::symbol(action)).unwrap();
            let restore = cu::RestoreArgs::default();
            let reserved = cu::ReservedArgs::default();
            let args: *const c_void = match action {
                Action::Lock => (&raw const lock_args).cast(),
                Action::Restore => (&raw const restore).cast(),
                _ => (&raw const reserved).cast(),
            };
            call(pid, args)
        }
    };
    assert_eq!(state(cu::CUDA_ERROR_NOT_INITIALIZED), None);
    assert_eq!(act(Action::Lock), cu::CUDA_ERROR_NOT_INITIALIZED);
    // SAFETY: cuInit takes its flags by value.
    assert_eq!(unsafe { init(0) }, cu::CUDA_SUCCESS);
    assert_eq!(state(cu::CUDA_SUCCESS), Some(CudaState::Running));
    assert_eq!(act(Action::Checkpoint), cu::CUDA_ERROR_ILLEGAL_STATE);
    assert_eq!(act(Action::Lock), cu::CUDA_SUCCESS);
    assert_eq!(state(cu::CUDA_SUCCESS), Some(CudaState::Locked));
    assert_eq!(act(Action::Checkpoint), cu::CUDA_SUCCESS);
    assert_eq!(state(cu::CUDA_SUCCESS), Some(CudaState::Checkpointed));
    let released = w.next_transition("trainer", WITHIN).unwrap();
    assert_eq!(released["kind"], json!("released"), "{released}");
    assert_eq!(act(Action::Restore), cu::CUDA_SUCCESS);
    assert_eq!(act(Action::Unlock), cu::CUDA_SUCCESS);
    assert_eq!(state(cu::CUDA_SUCCESS), Some(CudaState::Running));
    let line = trainer.wait_line("restored checksum");
    assert!(line.ends_with("intact"), "{line}");
    assert_eq!(
        w.next_transition("trainer", WITHIN).unwrap()["kind"],
        json!("acquired")
    );
}

/// Where the node's driver library has the checkpoint calls (`cuda_driver_path`, here the fake libcuda), a park,
/// a resume and a Task Checkpoint make them through the shim's driver helper: the program is not there at all, so only the API can
/// have parked the trainer. A call the driver refuses names the call, the pid and the driver's error, and the
/// preemption rolls back. A library without the calls leaves the program in charge (the other tests: no
/// libcuda.so.1 on this machine's loader path).
#[test]
fn park_and_resume_go_through_the_driver_api_where_the_library_has_it() {
    let Some(rig) = CudaRig::start("preempt-api") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let library = baton_integration::trace_env::fake_libcuda_in(dir.path()).unwrap();
    let options = || api_only_options(&library, "");
    let mut trainer = rig.create_with("trainer", &Trainer::default(), &[], options());
    rig.gpu.env.api().unwrap().start("trainer", "").unwrap();
    wait_held(&rig, "trainer", 1);
    let pid = pids_of(&rig, "trainer")[0];
    let mut w = rig.gpu.watch("trainer");

    let (steps, outcome) = rig.baton_json(&["preempt", "trainer"]);
    assert_eq!(outcome["preemption"]["state"], json!("parked"), "{outcome}");
    assert!(
        t_of(&steps, "gpu_released", None) < t_of(&steps, "frozen", None),
        "{steps:?}"
    );
    let released = w.next_transition("trainer", WITHIN).unwrap();
    assert_eq!(released["kind"], json!("released"), "{released}");
    assert_eq!(released["pids"], json!([pid]), "{released}");
    let (steps, _) = rig.baton_json(&["resume", "trainer"]);
    assert_eq!(
        phases(&steps),
        ["asked", "thawed", "restored", "unlocked", "done"],
        "{steps:?}"
    );
    let line = trainer.wait_line("restored checksum");
    assert!(line.ends_with("intact"), "{line}");
    assert_eq!(CudaRig::cuda_state(pid), "running");

    // containerd's Task Checkpoint (real CRIU, the task left running): checkpointed before the dump and
    // restored after it, through the same helper.
    let image = rig.gpu.env.scratch().join("api-task-image");
    let image_arg = image.display().to_string();
    let out = rig
        .gpu
        .env
        .ctr(&["task", "checkpoint", "--image-path", &image_arg, "trainer"]);
    assert!(out.success(), "ctr task checkpoint: {}", out.stderr);
    let line = trainer.wait_line("restored checksum");
    assert!(line.ends_with("intact"), "{line}");
    assert!(rig.wait_status("trainer", "RUNNING"));
    assert_eq!(CudaRig::cuda_state(pid), "running");

    let failing = Trainer {
        extra: vec!["--fail-at".into(), "checkpoint".into()],
        ..Trainer::default()
    };
    let _failing = rig.create_with("fail-checkpoint", &failing, &[], options());
    rig.gpu
        .env
        .api()
        .unwrap()
        .start("fail-checkpoint", "")
        .unwrap();
    wait_held(&rig, "fail-checkpoint", 1);
    let pid = pids_of(&rig, "fail-checkpoint")[0];
    let (_, err, ok) = rig.baton(&["preempt", "fail-checkpoint"]);
    assert!(!ok, "the preemption fails");
    assert!(
        err.contains(&format!("cuCheckpointProcessCheckpoint of pid {pid}"))
            && err.contains("CUDA_ERROR_UNKNOWN: unknown error")
            && err.contains("rolled back"),
        "the error names the call, the pid and the driver's error: {err}"
    );
    assert_eq!(CudaRig::cuda_state(pid), "running", "unlocked again");
    assert_eq!(
        rig.task_status("fail-checkpoint").as_deref(),
        Some("RUNNING")
    );

    // A crash inside the library (the fake aborts at the first checkpoint) takes down the helper only: the
    // preemption fails saying so and rolls back through a new helper, and the next one parks.
    let crashing = Trainer {
        extra: vec!["--crash-caller-at".into(), "checkpoint".into()],
        ..Trainer::default()
    };
    let mut crashing = rig.create_with("crash", &crashing, &[], options());
    rig.gpu.env.api().unwrap().start("crash", "").unwrap();
    wait_held(&rig, "crash", 1);
    let pid = pids_of(&rig, "crash")[0];
    let (_, err, ok) = rig.baton(&["preempt", "crash"]);
    assert!(!ok, "the preemption fails");
    assert!(
        err.contains(&format!("cuCheckpointProcessCheckpoint of pid {pid}"))
            && err.contains("the CUDA driver helper")
            && err.contains("died")
            && err.contains("rolled back"),
        "{err}"
    );
    assert_eq!(CudaRig::cuda_state(pid), "running", "unlocked again");
    let (_, outcome) = rig.baton_json(&["preempt", "crash"]);
    assert_eq!(outcome["preemption"]["state"], json!("parked"), "{outcome}");
    rig.baton_json(&["resume", "crash"]);
    let line = crashing.wait_line("restored checksum");
    assert!(line.ends_with("intact"), "{line}");
}

/// A trainer that forked a worker after CUDA init (a DataLoader worker: the H200 recording's point 5) is
/// parked through the program and through the driver API: only the process that owns CUDA state is locked,
/// checkpointed and restored (the agent names both; the shim's get-state leaves the worker alone, which the
/// driver answers CUDA_ERROR_NOT_INITIALIZED for), the worker is frozen with the container and keeps its
/// inherited NVIDIA fds throughout, and the release comes although it holds them.
#[test]
fn a_forked_worker_is_left_alone_and_the_park_releases_the_gpu_while_it_keeps_its_fds() {
    let Some(rig) = CudaRig::start("preempt-worker") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let library = baton_integration::trace_env::fake_libcuda_in(dir.path()).unwrap();
    for (id, options) in [
        ("by-program", None),
        ("by-api", api_only_options(&library, "")),
    ] {
        let mut trainer = rig.create_with(id, &Trainer::with_worker(), &[], options);
        rig.gpu.env.api().unwrap().start(id, "").unwrap();
        let forked = trainer.wait_line("phase worker-forked");
        let in_container: u32 = forked.rsplit(' ').next().unwrap().trim().parse().unwrap();
        // The parent and its worker, both holding NVIDIA fds; the worker's host pid is the one whose last
        // NSpid (its pid in the container) the workload printed.
        wait_held(&rig, id, 2);
        let pids = pids_of(&rig, id);
        let worker = *pids
            .iter()
            .find(|p| ns_pid(**p) == Some(in_container))
            .unwrap_or_else(|| panic!("no pid of {pids:?} is {in_container} in the container"));
        let parent = *pids.iter().find(|p| **p != worker).unwrap();
        let mut w = rig.gpu.watch(id);

        let (steps, outcome) = rig.baton_json(&["preempt", id]);
        assert_eq!(outcome["preemption"]["state"], json!("parked"), "{outcome}");
        assert_eq!(
            outcome["preemption"]["pids"],
            json!([parent]),
            "only the CUDA process is parked: {outcome}"
        );
        assert!(
            t_of(&steps, "gpu_released", None) < t_of(&steps, "frozen", None),
            "{steps:?}"
        );
        let released = w.next_transition(id, WITHIN).unwrap();
        assert_eq!(released["kind"], json!("released"), "{released}");
        let status = rig.gpu.status(id);
        let worker_fds = fds_of(&status, worker);
        assert!(worker_fds > 0, "the worker keeps its fds: {status}");
        assert_eq!(status["gpu"], json!("released"), "{status}");
        assert_eq!(rig.task_status(id).as_deref(), Some("PAUSED"));

        resume_intact(&rig, &mut trainer, &mut w, id);
        assert_eq!(rig.task_status(id).as_deref(), Some("RUNNING"));
    }
}

/// Issue 39, item 3: the agent restarts (a DaemonSet rollout) after the trainer forked its worker and before
/// the park. The new agent reads the container's files from /proc, their contents unknown (opaque), and the
/// worker's inherited fds and mappings would hold the GPU for as long as it lives, so the park was never
/// released. Now the kernel (kcmp) says the worker's fds are its parent's open files, and the shim, which ran
/// the driver's checkpoint, says the parent was checkpointed and the worker has no CUDA state: the release
/// comes while the worker keeps its fds.
#[test]
fn a_park_after_an_agent_restart_is_released_while_the_forked_worker_keeps_its_fds() {
    let Some(rig) = CudaRig::start("preempt-worker-restart") else {
        return;
    };
    let id = "trainer";
    let mut trainer = rig.create(id, &Trainer::with_worker(), &[]);
    rig.gpu.env.api().unwrap().start(id, "").unwrap();
    trainer.wait_line("phase worker-forked");
    wait_held(&rig, id, 2);
    let before = pids_of(&rig, id);

    // The agent goes; the shim starts another and registers the container again.
    rig.gpu.env.containerd().kill_agent();
    wait_held(&rig, id, 2);
    let status = rig.gpu.status(id);
    assert_eq!(status["partial"], json!(true), "read from /proc: {status}");
    let mut pids = pids_of(&rig, id);
    pids.sort_unstable();
    let mut was = before.clone();
    was.sort_unstable();
    assert_eq!(pids, was, "the same processes: {status}");
    let mut w = rig.gpu.watch(id);

    let (steps, outcome) = rig.baton_json(&["preempt", id]);
    assert_eq!(outcome["preemption"]["state"], json!("parked"), "{outcome}");
    let parent = outcome["preemption"]["pids"][0].as_u64().unwrap() as u32;
    let worker = *pids.iter().find(|p| **p != parent).unwrap();
    // The timeline has the release (the park's own `done` waits a while for it, never made up).
    t_of(&steps, "gpu_released", None);
    let released = w.next_transition(id, WITHIN).unwrap();
    assert_eq!(released["kind"], json!("released"), "{released}");
    let status = rig.gpu.status(id);
    assert_eq!(status["gpu"], json!("released"), "{status}");
    let worker_fds = fds_of(&status, worker);
    assert!(worker_fds > 0, "the worker keeps its fds: {status}");
    assert_eq!(
        outcome["preemption"]["no_cuda_state"],
        json!([worker]),
        "the shim says the worker was left alone: {outcome}"
    );

    resume_intact(&rig, &mut trainer, &mut w, id);
}

/// The NVIDIA fds process `pid` holds in container status `status` (0 when it is not listed).
fn fds_of(status: &Value, pid: u32) -> u64 {
    status["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pid"] == json!(pid))
        .map_or(0, |p| p["fds"].as_u64().unwrap())
}

/// Resumes parked trainer `id` through `baton resume`: its weights come back intact and it acquires the GPU.
fn resume_intact(rig: &CudaRig, trainer: &mut Running, w: &mut AgentWatch, id: &str) {
    let (steps, outcome) = rig.baton_json(&["resume", id]);
    assert_eq!(outcome["preemption"], Value::Null, "{outcome}: {steps:?}");
    let line = trainer.wait_line("restored checksum");
    assert!(line.ends_with("intact"), "{line}");
    assert_eq!(
        w.next_transition(id, WITHIN).unwrap()["kind"],
        json!("acquired")
    );
}

/// The pid of host process `pid` in its own pid namespace (the last field of `NSpid` in /proc/PID/status).
fn ns_pid(pid: u32) -> Option<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))?
        .split_whitespace()
        .last()?
        .parse()
        .ok()
}
