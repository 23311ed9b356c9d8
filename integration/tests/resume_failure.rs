//! A co-runner whose resume fails stays parked as it was (issue 30, item 6): the shim freezes it again when no
//! process got its GPU back (before, it was left thawed, its threads running against a locked CUDA), and the
//! agent tries again after 5 s, then after twice as long with each failure in a row (before, every 5 s for
//! good), showing the count and the last error in `baton status`. Real containerd, runc, the Baton shim and
//! agent, the FUSE mock driver, the mock CUDA workload (whose restore is made to fail) and the cuda-checkpoint
//! stand-in.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use std::time::{Duration, Instant};

use baton_integration::{
    agent::wait_until,
    agent_steps::AgentSteps,
    cuda::{CudaRig, PREEMPTIBLE, SERVER, Trainer, WITHIN},
};
use serde_json::{Value, json};

/// The agent's entry for parked co-runner `id` in `baton status --json` (`null` when not listed).
fn parked_entry(rig: &CudaRig, id: &str) -> Value {
    let (out, err, ok) = rig.baton(&["status", "--json"]);
    assert!(ok, "baton status: {err}");
    let status: Value = serde_json::from_str(&out).unwrap();
    status["gap_fill"]["parked"]
        .as_array()
        .and_then(|a| a.iter().find(|p| p["id"] == json!(id)).cloned())
        .unwrap_or(Value::Null)
}

/// How many resumes the agent asked for, as the co-runner's trace shows them.
fn resumes_asked(steps: &AgentSteps) -> usize {
    steps
        .seen()
        .iter()
        .filter(|(phase, detail)| phase == "asked" && detail == "by gap-fill")
        .count()
}

#[test]
fn a_failed_resume_freezes_the_co_runner_again_and_the_agent_waits_longer_before_each_retry() {
    let Some(rig) = CudaRig::start("resume-fails") else {
        return;
    };
    let failing = Trainer {
        extra: vec!["--fail-at".into(), "restore".into()],
        ..Trainer::with_worker()
    };
    let _trainer = rig.run("trainer", &failing, &PREEMPTIBLE);
    rig.wait_held("trainer");
    let steps = AgentSteps::start(&rig, "trainer");

    // A server parks the trainer, then goes: the agent resumes the trainer, whose restore fails.
    let _server = rig.create("server", &Trainer::with_worker(), &SERVER);
    let api = rig.gpu.env.api().unwrap();
    api.start("server", "").unwrap();
    rig.wait_held("server");
    assert_eq!(
        rig.gpu.status("trainer")["preemption"]["state"],
        json!("parked")
    );
    api.kill("server", "", 9, true).unwrap();
    api.wait("server", "", WITHIN).unwrap();
    api.delete_task("server").unwrap();
    api.delete_container("server").unwrap();

    // The failed resume leaves it parked and frozen, as before the resume.
    steps.wait_for("frozen", "frozen again: no process was given its GPU back");
    let failed_at = Instant::now();
    assert!(
        wait_until(WITHIN, || parked_entry(&rig, "trainer")["failed_resumes"]
            .as_u64()
            .is_some_and(|n| n >= 1)),
        "the agent counts the failed resume: {}",
        parked_entry(&rig, "trainer")
    );
    let entry = parked_entry(&rig, "trainer");
    assert!(
        entry["resume_error"]
            .as_str()
            .is_some_and(|e| e.contains("restore")),
        "{entry}"
    );
    assert_eq!(rig.task_status("trainer").as_deref(), Some("PAUSED"));
    assert_eq!(
        rig.gpu.status("trainer")["preemption"]["state"],
        json!("parked")
    );
    let (out, _, _) = rig.baton(&["status"]);
    assert!(
        out.contains("resume(s) failed in a row, the last: "),
        "baton status says why:\n{out}"
    );

    // Retries after 5 s, then 10 s: at most two resumes within 12 s of the first failure (every 5 s, there
    // were three).
    assert!(
        wait_until(WITHIN, || resumes_asked(&steps) >= 2),
        "the agent tried again: {:?}",
        steps.seen()
    );
    let until = failed_at + Duration::from_secs(12);
    while Instant::now() < until {
        assert!(
            resumes_asked(&steps) <= 2,
            "a third resume within 12 s of the first failure: {:?}",
            steps.seen()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(rig.task_status("trainer").as_deref(), Some("PAUSED"));
}
