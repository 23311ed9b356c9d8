//! A park never kills (issue 29): the checkpoint's host copy is charged to the parked process's own memory
//! cgroup (recorded on the H200: 4 GiB of VRAM under memory.max 2 GiB, checkpoint error 304, then the kernel's
//! OOM kill: /work/shared/gpu/580.159.04/README.md, point 6; the mock charges its copy the same way). A
//! trainer whose limit is below its (mock) VRAM is parked with its limit raised while parked and put back at
//! the resume, or, with `park_memory = "refuse"`, refused with the numbers and left running. Before this, the
//! park below killed the trainer. End to end: real containerd, runc, the Baton shim and agent, the FUSE mock
//! driver, the cuda-checkpoint stand-in.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use baton_cgroups::memory::MemoryCgroup;
use baton_integration::cuda::{CudaRig, Trainer, WITHIN};
use serde_json::{Value, json};

const MIB: u64 = 1 << 20;

/// A trainer of 256 MiB of (mock) VRAM in a container limited to 128 MiB.
fn small_trainer() -> Trainer {
    Trainer {
        vram_mib: 256,
        memory_limit_bytes: Some(128 * MIB),
        ..Trainer::default()
    }
}

/// Its one CUDA process, once it holds the GPU.
fn held_by(rig: &CudaRig, id: &str) -> u32 {
    assert!(
        baton_integration::agent::wait_until(WITHIN, || rig.gpu.status(id)["gpu"] == json!("held")),
        "{id} holds the GPU: {}",
        rig.gpu.status(id)
    );
    rig.gpu.status(id)["processes"][0]["pid"].as_u64().unwrap() as u32
}

fn limit_of(pid: u32) -> Option<u64> {
    MemoryCgroup::for_pid(pid).unwrap().limit().unwrap()
}

#[test]
fn a_trainer_whose_memory_limit_is_below_its_vram_is_parked_with_room_and_resumed_intact() {
    let Some(rig) = CudaRig::start("park-memory") else {
        return;
    };
    let mut running = rig.run("small", &small_trainer(), &[]);
    let pid = held_by(&rig, "small");
    assert_eq!(limit_of(pid), Some(128 * MIB));
    let (steps, outcome) = rig.baton_json(&["preempt", "small"]);
    let parked = &outcome["preemption"];
    assert_eq!(parked["state"], json!("parked"), "{outcome}: {steps:?}");
    assert_eq!(parked["host_copy_bytes"], json!(256 * MIB), "{parked}");
    assert_eq!(
        parked["raised_limit"]["was_bytes"],
        json!(128 * MIB),
        "{parked}"
    );
    let raised = parked["raised_limit"]["raised_to_bytes"].as_u64().unwrap();
    assert!(raised >= 256 * MIB, "{parked}");
    assert_eq!(
        limit_of(pid),
        Some(raised),
        "the cgroup's limit while parked"
    );
    assert_eq!(
        rig.gpu.status("small")["preemption"]["raised_limit"]["raised_to_bytes"],
        json!(raised),
        "the agent's status shows it"
    );

    let (steps, outcome) = rig.baton_json(&["resume", "small"]);
    assert_eq!(outcome["preemption"], Value::Null, "{outcome}: {steps:?}");
    let done = steps.iter().find(|s| s["phase"] == json!("done")).unwrap();
    assert!(
        done["detail"]
            .as_str()
            .unwrap()
            .contains("memory limit back to 128 MiB"),
        "{done}"
    );
    let line = running.wait_line("restored checksum");
    assert!(line.ends_with("intact"), "{line}");
    assert_eq!(rig.task_status("small").as_deref(), Some("RUNNING"));
    assert_eq!(limit_of(pid), Some(128 * MIB), "put back at the resume");
}

#[test]
fn with_park_memory_refuse_the_park_is_refused_with_the_numbers_and_the_trainer_runs_on() {
    let Some(rig) = CudaRig::start("park-memory-refuse") else {
        return;
    };
    let options = baton_integration::api::runtime_options_toml("park_memory = \"refuse\"\n");
    let mut running = rig.create_with("refused", &small_trainer(), &[], Some(options));
    rig.gpu.env.api().unwrap().start("refused", "").unwrap();
    running.wait_line("phase setup-done");
    let pid = held_by(&rig, "refused");
    let (_, err, ok) = rig.baton(&["preempt", "refused"]);
    assert!(!ok, "refused: {err}");
    for needle in ["256 MiB of device memory", "limit 128 MiB", "park_memory"] {
        assert!(err.contains(needle), "the error names {needle:?}: {err}");
    }
    assert_eq!(rig.task_status("refused").as_deref(), Some("RUNNING"));
    assert_eq!(CudaRig::cuda_state(pid), "running");
    assert_eq!(limit_of(pid), Some(128 * MIB), "left as it was");
    assert_eq!(rig.gpu.status("refused")["preemption"], Value::Null);
}
