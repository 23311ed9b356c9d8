//! A park never kills (issue 29): the checkpoint's host copy is charged to the parked process's own memory
//! cgroup (recorded on the H200: 4 GiB of VRAM under memory.max 2 GiB, checkpoint error 304, then the kernel's
//! OOM kill: /work/shared/gpu/580.159.04/README.md, point 6; the mock charges its copy the same way). A
//! trainer whose limit is below its (mock) VRAM is parked with its limit raised while parked and put back at
//! the resume, or, with `park_memory = "refuse"`, refused with the numbers and left running. Before this, the
//! park below killed the trainer. The raises stay within the node's budget for parked host memory
//! (`parked_host_memory_budget`), which `baton status` and the metrics show with what each parked container
//! holds, and gap-fill never picks a co-runner whose park would be refused: it parks another that frees
//! enough, or none. End to end: real containerd, runc, the Baton shim and agent, the FUSE mock driver, the
//! cuda-checkpoint stand-in, and the fake NVML where the room of a GPU matters.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use baton_cgroups::memory::MemoryCgroup;
use baton_integration::{
    agent_steps::AgentSteps,
    api::runtime_options_toml,
    cuda::{CudaRig, PREEMPTIBLE, Running, SERVER, Trainer, WITHIN},
    fake_nvml::FakeNvml,
    metrics::{client, scrape, url_from_log},
};
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

/// Creates and starts trainer `id` (`t`) with the runtime's options `toml` and `annotations`, once it holds
/// the GPU: its running workload and its CUDA process.
fn start_with_options(
    rig: &CudaRig,
    id: &str,
    t: &Trainer,
    annotations: &[(&str, &str)],
    toml: &str,
) -> (Running, u32) {
    let mut running = rig.create_with(id, t, annotations, Some(runtime_options_toml(toml)));
    rig.gpu.env.api().unwrap().start(id, "").unwrap();
    running.wait_line("phase setup-done");
    let pid = held_by(rig, id);
    (running, pid)
}

/// The agent's `status --json`, whole.
fn node_status(rig: &CudaRig) -> Value {
    let (out, err, ok) = rig.baton(&["status", "--json"]);
    assert!(ok, "baton status: {err}");
    serde_json::from_str(&out).unwrap()
}

#[test]
fn gap_fill_parks_a_co_runner_it_can_park_and_skips_one_whose_park_would_be_refused() {
    // A GPU of 512 MiB: two trainers of 192 MiB leave 128 MiB, and a server that needs 256 MiB must have one
    // of them parked. The lowest-priority one would be picked, but its memory limit (128 MiB) has no room for
    // its host copy and the node refuses to raise it: gap-fill parks the other, which has no limit.
    let Some((rig, _agent, _dir)) = FakeNvml::rig("park-memory-skip", 512, &[]) else {
        return;
    };
    let refuse = "park_memory = \"refuse\"\n";
    // Each says what it needs: room is among declarers (a co-runner that declares nothing counts as the
    // whole GPU).
    let declared = ("baton.io/gpu-memory", "192Mi");
    let low = [
        PREEMPTIBLE.as_slice(),
        &[("baton.io/priority", "0"), declared],
    ]
    .concat();
    let high = [
        PREEMPTIBLE.as_slice(),
        &[("baton.io/priority", "5"), declared],
    ]
    .concat();
    let limited = Trainer {
        vram_mib: 192,
        memory_limit_bytes: Some(128 * MIB),
        ..Trainer::default()
    };
    let roomy = Trainer {
        vram_mib: 192,
        ..Trainer::default()
    };
    let (_limited, limited_pid) = start_with_options(&rig, "limited", &limited, &low, refuse);
    let (mut roomy_run, _) = start_with_options(&rig, "roomy", &roomy, &high, refuse);
    let limited_steps = AgentSteps::start(&rig, "limited");
    let roomy_steps = AgentSteps::start(&rig, "roomy");

    let server = [SERVER.as_slice(), &[("baton.io/gpu-memory", "256Mi")]].concat();
    let _server = rig.create("server", &Trainer::default(), &server);
    rig.gpu
        .env
        .api()
        .unwrap()
        .start("server", "")
        .expect("the server starts once a co-runner is parked");
    rig.wait_held("server");
    assert_eq!(
        rig.preemption("roomy")["state"],
        json!("parked"),
        "the co-runner that can be parked was: {}",
        rig.gpu.status("roomy")
    );
    roomy_steps.wait_for_matching("parked", |d| d.starts_with("parked roomy for server"));
    assert!(
        rig.preemption("limited").is_null(),
        "the one whose park would be refused was not preempted: {}",
        rig.gpu.status("limited")
    );
    limited_steps.wait_for_matching("skipped", |d| {
        d.starts_with("skipped limited for server: ")
            && d.contains("192 MiB of device memory")
            && d.contains("limit 128 MiB")
    });
    assert_eq!(rig.task_status("limited").as_deref(), Some("RUNNING"));
    assert_eq!(CudaRig::cuda_state(limited_pid), "running");
    assert_eq!(limit_of(limited_pid), Some(128 * MIB));

    // What the parked one holds in host memory shows; nothing was raised.
    let p = &node_status(&rig)["parked_host_memory"];
    assert_eq!(p["held_bytes"], json!(192 * MIB), "{p}");
    assert_eq!(p["raised_bytes"], json!(0), "{p}");

    // The server goes: the parked trainer resumes intact.
    rig.remove("server").unwrap();
    let line = roomy_run.wait_line("restored checksum");
    assert!(line.ends_with("intact"), "{line}");
}

#[test]
fn raised_limits_stay_within_the_nodes_budget_which_status_and_the_metrics_show() {
    // A budget of 300 MiB: the first trainer's raise (about 216 MiB) fits in it, the second's then does not,
    // and fits again once the first is resumed.
    let Some((rig, _agent, _dir)) = FakeNvml::rig(
        "park-memory-budget",
        2048,
        &["--metrics-addr", "127.0.0.1:0"],
    ) else {
        return;
    };
    let toml = "parked_host_memory_budget = \"300Mi\"\n";
    let (mut first, first_pid) = start_with_options(&rig, "first", &small_trainer(), &[], toml);
    let (_second, second_pid) = start_with_options(&rig, "second", &small_trainer(), &[], toml);

    let (steps, outcome) = rig.baton_json(&["preempt", "first"]);
    let parked = &outcome["preemption"];
    assert_eq!(parked["state"], json!("parked"), "{outcome}: {steps:?}");
    let raised = parked["raised_limit"]["raised_to_bytes"].as_u64().unwrap() - 128 * MIB;
    assert!(raised > 200 * MIB && raised < 300 * MIB, "{parked}");

    let (_, err, ok) = rig.baton(&["preempt", "second"]);
    assert!(!ok, "the second park is refused: {err}");
    for needle in [
        "256 MiB of device memory",
        "parked_host_memory_budget",
        &format!("{} MiB left", (300 * MIB - raised).div_ceil(MIB)),
    ] {
        assert!(err.contains(needle), "the error names {needle:?}: {err}");
    }
    assert_eq!(CudaRig::cuda_state(second_pid), "running");
    assert_eq!(limit_of(second_pid), Some(128 * MIB), "left as it was");

    // Status and the metrics show what the parked one holds and what the budget has.
    let p = &node_status(&rig)["parked_host_memory"];
    assert_eq!(p["held_bytes"], json!(256 * MIB), "{p}");
    assert_eq!(p["raised_bytes"], json!(raised), "{p}");
    assert_eq!(p["budget_bytes"], json!(300 * MIB), "{p}");
    let (text, _, _) = rig.baton(&["status"]);
    assert!(
        text.contains("parked host memory: 256 MiB held")
            && text.contains("a budget of 300 MiB")
            && text.contains("first (namespace "),
        "baton status:\n{text}"
    );
    let log = rig
        .gpu
        .env
        .containerd()
        .agent_socket()
        .with_file_name("agent.log");
    let url = url_from_log(&log, WITHIN).unwrap();
    let metrics = scrape(&client(), &url).unwrap();
    assert_eq!(
        metrics
            .value("baton_parked_host_memory_bytes", &[])
            .unwrap(),
        (256 * MIB) as f64
    );
    assert_eq!(
        metrics
            .value("baton_parked_host_memory_raised_bytes", &[])
            .unwrap(),
        raised as f64
    );
    assert_eq!(
        metrics
            .value("baton_parked_host_memory_budget_bytes", &[])
            .unwrap(),
        (300 * MIB) as f64
    );
    for (id, want) in [("first", 256 * MIB), ("second", 0)] {
        assert_eq!(
            metrics
                .value(
                    "baton_container_parked_host_memory_bytes",
                    &[("container_id", id)]
                )
                .unwrap(),
            want as f64,
            "{id}"
        );
    }

    // Resumed, the first gives its raise back, and the second's park fits.
    let (steps, outcome) = rig.baton_json(&["resume", "first"]);
    assert_eq!(outcome["preemption"], Value::Null, "{outcome}: {steps:?}");
    let line = first.wait_line("restored checksum");
    assert!(line.ends_with("intact"), "{line}");
    assert_eq!(limit_of(first_pid), Some(128 * MIB));
    let (steps, outcome) = rig.baton_json(&["preempt", "second"]);
    assert_eq!(
        outcome["preemption"]["state"],
        json!("parked"),
        "{outcome}: {steps:?}"
    );
    let p = &node_status(&rig)["parked_host_memory"];
    assert_eq!(
        p["held_bytes"],
        json!(256 * MIB),
        "only the second now: {p}"
    );
}

#[test]
fn a_server_whose_only_co_runner_cannot_be_parked_fails_at_its_deadline_saying_why() {
    let Some(rig) = CudaRig::start("park-memory-unparkable") else {
        return;
    };
    let (_trainer, pid) = start_with_options(
        &rig,
        "limited",
        &small_trainer(),
        &PREEMPTIBLE,
        "park_memory = \"refuse\"\n",
    );
    let server = [
        ("baton.io/role", "latency-critical"),
        ("baton.io/wait-gpu-free", "3s"),
    ];
    let _server = rig.create("server", &Trainer::default(), &server);
    let err = rig.start_error("server");
    for needle in [
        "still held by container limited",
        "limited was not parked: ",
        "256 MiB of device memory",
        "park_memory",
    ] {
        assert!(err.contains(needle), "the error names {needle:?}: {err}");
    }
    assert!(rig.preemption("limited").is_null());
    assert_eq!(CudaRig::cuda_state(pid), "running");
    assert_eq!(limit_of(pid), Some(128 * MIB));
}
