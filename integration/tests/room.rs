//! Room, not emptiness (issue 31): a server that says what it needs (`baton.io/gpu-memory`) starts at once
//! beside running co-runners when that much is free on its GPU, two that both fit start together, and one that
//! does not fit parks the lowest-priority co-runners until it fits, and no more; a parked co-runner resumes
//! beside the server as soon as its memory fits again. Real components: containerd,
//! runc, the Baton shim and agent, the FUSE mock driver (a GPU of 2 GiB here), the mock CUDA trainers and the
//! cuda-checkpoint stand-in; NVML is the fake library (integration/fake-nvml), which reports the mock's
//! capacity as NVML reports a GPU's total memory.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]

use baton_integration::{
    agent::{AgentProcess, container_status, wait_until},
    agent_steps::AgentSteps,
    api::Api,
    cuda::{CudaRig, PREEMPTIBLE, Running, SERVER, Trainer, WITHIN},
    fake_nvml::FakeNvml,
};
use serde_json::{Value, json};

const MIB: u64 = 1 << 20;

/// The rig with a GPU of 2 GiB and an agent that has NVML (the fake one), started before any container.
fn rig_with_nvml(name: &str) -> Option<(CudaRig, AgentProcess, tempfile::TempDir)> {
    FakeNvml::rig(name, 2048, &[])
}

/// A trainer of `mib` MiB the agent may park, with base priority `priority`, that says what it needs (room
/// is among declarers: one that declares nothing counts as the whole GPU).
fn run_trainer(rig: &CudaRig, id: &str, mib: u64, priority: &str) -> Running {
    let need = format!("{mib}Mi");
    let mut annotations = PREEMPTIBLE.to_vec();
    annotations.push(("baton.io/priority", priority));
    annotations.push(("baton.io/gpu-memory", &need));
    let t = Trainer {
        vram_mib: mib,
        ..Trainer::default()
    };
    let running = rig.run(id, &t, &annotations);
    rig.wait_held(id);
    running
}

/// Creates server `id` (256 MiB) that says it needs `need`.
fn create_server(rig: &CudaRig, id: &str, need: &str) -> Running {
    let mut annotations = SERVER.to_vec();
    annotations.push(("baton.io/gpu-memory", need));
    rig.create(id, &Trainer::default(), &annotations)
}

/// Starts task `id` through containerd's API in a thread.
fn start_in_background(rig: &CudaRig, id: &str) -> std::thread::JoinHandle<Result<u32, String>> {
    let socket = rig.gpu.env.containerd().socket();
    let namespace = rig.gpu.env.namespace().to_owned();
    let id = id.to_owned();
    std::thread::spawn(move || {
        let api = Api::connect(&socket, &namespace).unwrap();
        api.start(&id, "").map_err(|e| e.to_string())
    })
}

/// `baton status --json`'s row of the mock's `nvidia0` in gap-fill, once there is one.
fn gpu_row(rig: &CudaRig) -> Value {
    let (out, _, _) = rig.baton(&["status", "--json"]);
    let v: Value = serde_json::from_str(&out).unwrap_or(Value::Null);
    v["gap_fill"]["gpus"]
        .as_array()
        .and_then(|g| g.iter().find(|r| r["device"] == json!("nvidia0")))
        .cloned()
        .unwrap_or(Value::Null)
}

/// The container's preemption state in the agent (null: never preempted).
fn preemption(rig: &CudaRig, id: &str) -> Value {
    rig.gpu.status(id)["preemption"].clone()
}

#[test]
fn servers_that_fit_start_beside_the_co_runners_and_one_that_does_not_parks_the_lowest_priority_one_only()
 {
    let Some((rig, _agent, _dir)) = rig_with_nvml("room") else {
        return;
    };
    let mut low = run_trainer(&rig, "trainer-low", 768, "0");
    let _high = run_trainer(&rig, "trainer-high", 768, "5");
    assert!(
        wait_until(WITHIN, || gpu_row(&rig)["room"]["capacity_bytes"]
            == json!(2048 * MIB)),
        "the agent knows the GPU's memory from NVML: {}",
        gpu_row(&rig)
    );
    assert_eq!(gpu_row(&rig)["room"]["room_bytes"], json!(512 * MIB));

    // Two servers of 256 MiB each: both fit beside the trainers (512 MiB free) and start together, without
    // a park.
    let _a = create_server(&rig, "server-a", "256Mi");
    let _b = create_server(&rig, "server-b", "256Mi");
    let server_a_steps = AgentSteps::start(&rig, "server-a");
    let low_steps = AgentSteps::start(&rig, "trainer-low");
    let a = start_in_background(&rig, "server-a");
    let b = start_in_background(&rig, "server-b");
    a.join()
        .unwrap()
        .expect("server-a starts beside the trainers");
    b.join()
        .unwrap()
        .expect("server-b starts beside the trainers");
    rig.wait_held("server-a");
    rig.wait_held("server-b");
    for t in ["trainer-low", "trainer-high"] {
        assert!(
            preemption(&rig, t).is_null(),
            "{t} was not preempted: {}",
            rig.gpu.status(t)
        );
    }
    assert!(
        wait_until(WITHIN, || gpu_row(&rig)["room"]["room_bytes"] == json!(0)),
        "the room is taken: {}",
        gpu_row(&rig)
    );
    let (out, _, _) = rig.baton(&["status"]);
    assert!(
        out.contains("GPU memory") && out.contains("server-a 256 MiB"),
        "baton status shows each holder's memory:\n{out}"
    );
    // Its trace says where it started and why.
    server_a_steps.wait_for_matching("beside", |d| {
        d.starts_with("started beside ")
            && d.contains("trainer-low")
            && d.contains("(fits: needs 256 MiB, ")
    });

    // A server that needs 512 MiB does not fit (none free): the agent parks the lowest-priority co-runner,
    // whose 768 MiB are enough, and not the other.
    let _c = create_server(&rig, "server-c", "512Mi");
    let c = start_in_background(&rig, "server-c");
    c.join()
        .unwrap()
        .expect("server-c starts once the low-priority trainer is parked");
    rig.wait_held("server-c");
    assert_eq!(
        preemption(&rig, "trainer-low")["state"],
        json!("parked"),
        "{}",
        rig.gpu.status("trainer-low")
    );
    assert!(
        preemption(&rig, "trainer-high").is_null(),
        "the high-priority trainer keeps running beside the servers: {}",
        rig.gpu.status("trainer-high")
    );
    low_steps.wait_for(
        "parked",
        "parked trainer-low for server-c (needs 512 MiB, 0 MiB free)",
    );
    let row = gpu_row(&rig);
    assert_eq!(row["parked"][0]["id"], json!("trainer-low"), "{row}");
    let held: u64 = row["room"]["held"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["bytes"].as_u64().unwrap())
        .sum();
    assert!(
        held <= 2048 * MIB,
        "nothing oversubscribes the GPU: {held} bytes held: {row}"
    );

    // Two servers go: with the first 768 MiB are free beside the others, and the parked trainer's 768 MiB
    // fit: it resumes while server-c still runs, its weights intact.
    let api = rig.gpu.env.api().unwrap();
    for id in ["server-a", "server-b"] {
        delete_task(&api, id);
    }
    let line = low.wait_line("restored checksum");
    assert!(line.ends_with("intact"), "{line}");
    assert!(
        wait_until(WITHIN, || preemption(&rig, "trainer-low").is_null()),
        "{}",
        rig.gpu.status("trainer-low")
    );
    low_steps.wait_for_matching("resumed", |d| {
        d.starts_with("resumed trainer-low beside its servers: it fits again (needs 768 MiB, ")
    });
    assert_eq!(rig.gpu.status("server-c")["gpu"], json!("held"));
    assert!(preemption(&rig, "server-c").is_null());
    assert_eq!(gpu_row(&rig)["room"]["room_bytes"], json!(256 * MIB));

    // The agent remembers each name's peak past its end, to set baton.io/gpu-memory from.
    let (out, _, _) = rig.baton(&["status", "--json"]);
    let v: Value = serde_json::from_str(&out).unwrap();
    let peak = |name: &str| {
        v["peaks"]
            .as_array()
            .and_then(|p| p.iter().find(|x| x["name"] == json!(name)))
            .map(|x| x["peak_bytes"].clone())
    };
    assert_eq!(peak("server-a"), Some(json!(256 * MIB)), "{}", v["peaks"]);
    assert_eq!(
        peak("trainer-high"),
        Some(json!(768 * MIB)),
        "{}",
        v["peaks"]
    );
    let (out, _, _) = rig.baton(&["status"]);
    assert!(out.contains("peak GPU memory per container name"), "{out}");
}

/// Kills and deletes task `id`.
fn delete_task(api: &Api, id: &str) {
    api.kill(id, "", 9, true).unwrap();
    api.wait(id, "", WITHIN).unwrap();
    api.delete_task(id).unwrap();
}

#[test]
fn a_server_that_can_never_fit_parks_nothing_and_its_start_fails_naming_the_figures() {
    let Some((rig, _agent, _dir)) = rig_with_nvml("room-never") else {
        return;
    };
    let _trainer = run_trainer(&rig, "trainer", 768, "0");
    assert!(
        wait_until(WITHIN, || gpu_row(&rig)["room"]["capacity_bytes"]
            == json!(2048 * MIB)),
        "{}",
        gpu_row(&rig)
    );
    let annotations = [
        ("baton.io/role", "latency-critical"),
        ("baton.io/wait-gpu-free", "3s"),
        ("baton.io/gpu-memory", "4Gi"),
    ];
    let _server = rig.create("server", &Trainer::default(), &annotations);
    let error = start_in_background(&rig, "server")
        .join()
        .unwrap()
        .expect_err("a server that needs more than the GPU has never starts");
    assert!(
        error.contains("needs 4 GiB, more than the GPU has for containers (2 GiB)")
            && error.contains("trainer"),
        "{error}"
    );
    assert!(
        preemption(&rig, "trainer").is_null(),
        "nothing was parked for it: {}",
        rig.gpu.status("trainer")
    );
}

#[test]
fn a_one_byte_declaration_waits_beside_a_holder_that_declared_nothing_and_counts_for_the_nodes_minimum()
 {
    let Some((rig, _agent, _dir)) = rig_with_nvml("room-declarers") else {
        return;
    };
    // A holder that says nothing of its need (and may not be parked): it may grow to the whole GPU.
    let undeclared = Trainer {
        vram_mib: 256,
        ..Trainer::default()
    };
    let _holder = rig.run("holder", &undeclared, &[]);
    rig.wait_held("holder");
    assert!(
        wait_until(WITHIN, || gpu_row(&rig)["room"]["capacity_bytes"]
            == json!(2048 * MIB)),
        "{}",
        gpu_row(&rig)
    );
    assert_eq!(
        gpu_row(&rig)["room"]["room_bytes"],
        json!(0),
        "a holder that declared nothing leaves no room: {}",
        gpu_row(&rig)
    );
    // A tenant that declares one byte does not start beside it, and the error says why.
    let tiny = [
        ("baton.io/role", "latency-critical"),
        ("baton.io/wait-gpu-free", "3s"),
        ("baton.io/gpu-memory", "1"),
    ];
    let _tiny = rig.create("tiny", &Trainer::default(), &tiny);
    let error = start_in_background(&rig, "tiny")
        .join()
        .unwrap()
        .expect_err("a 1-byte declaration does not start beside an undeclared holder");
    assert!(
        error.contains("holder counts as the whole GPU: it declared no baton.io/gpu-memory"),
        "{error}"
    );
    assert_eq!(rig.gpu.status("holder")["gpu"], json!("held"));
    // The holder goes (`ctr run --rm` deletes it).
    rig.gpu
        .env
        .api()
        .unwrap()
        .kill("holder", "", 9, true)
        .unwrap();
    let socket = rig.gpu.env.containerd().agent_socket();
    assert!(
        wait_until(WITHIN, || container_status(&socket, "holder")
            .is_ok_and(|s| s.is_none_or(|s| s["gpu"] != json!("held")))),
        "the holder let go: {}",
        rig.gpu.node_status()
    );

    // Beside a holder that declared its 1,536 MiB, 512 MiB are free: a 1-byte declaration counts for the
    // node's least need (1 GiB here), which is not free.
    let declared = Trainer {
        vram_mib: 1536,
        ..Trainer::default()
    };
    let _big = rig.run("declared", &declared, &[("baton.io/gpu-memory", "1536Mi")]);
    rig.wait_held("declared");
    let minimum = baton_integration::api::runtime_options_toml("gpu_memory_minimum = \"1Gi\"\n");
    let _small = rig.create_with("small", &Trainer::default(), &tiny, Some(minimum));
    let error = start_in_background(&rig, "small")
        .join()
        .unwrap()
        .expect_err("a 1-byte declaration counts as the node's minimum of 1 GiB");
    assert!(error.contains("needs 1 GiB, 512 MiB free"), "{error}");
}
