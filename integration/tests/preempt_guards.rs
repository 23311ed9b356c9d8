//! What keeps a preemption from hanging or losing track, end to end (the mock CUDA workload under real
//! containerd, runc, the Baton shim and its agent, the cuda-checkpoint stand-in): Task Pause is refused while
//! cuda-checkpoint runs in the container; a checkpoint that runs past `cuda_checkpoint_timeout` (its process
//! frozen under it) is stopped and rolled back; a resume that fails for a process keeps that process
//! parked, and a second resume gives it its GPU back.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use std::{path::PathBuf, sync::mpsc};

use baton_integration::{
    api,
    cuda::{CudaRig, Trainer, WITHIN},
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
    assert!(
        baton_integration::agent::wait_until(WITHIN, || {
            let s = rig.gpu.status(id);
            s["gpu"] == json!("held") && s["processes"].as_array().unwrap().len() == 1
        }),
        "{id} holds the GPU: {}",
        rig.gpu.status(id)
    );
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
    assert_eq!(CudaRig::cuda_state(pid), "checkpointed");

    let (_, outcome) = rig.baton_json(&["resume", "retry"]);
    assert_eq!(outcome["preemption"], Value::Null, "{outcome}");
    let line = trainer.wait_line("restored checksum");
    assert!(line.ends_with("intact"), "{line}");
    assert_eq!(CudaRig::cuda_state(pid), "running");
    assert_eq!(rig.gpu.status("retry")["preemption"], Value::Null);
}
