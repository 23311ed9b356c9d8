//! `baton-park-release-bench`: how soon the agent's release signal follows a park, on the mock GPU that parks
//! as the real driver does (its checkpoint thread frees the process's objects and root client, closes the
//! NVIDIA files and leaves PROT_NONE reservations where the device mappings were: recording
//! /work/shared/gpu/580.159.04/park-program.jsonl.gz), with a forked worker that keeps the inherited fds.
//! Per park: the park request -> `released` (its `t_released_ns`), and the checkpoint call's return (the
//! shim's `checkpointed` step) -> `released`, signed (negative: the release came before the call returned),
//! through the `cuda-checkpoint` program and through the driver API (the shim's helper with the fake libcuda),
//! against the goal of 1 ms after the checkpoint returns. Rounds alternate between the two ways.
//!
//! Figures only (no assertions). Run as root: `cargo build --release -p baton-integration --bins`, then
//! `BATON_SHIM_BIN=$PWD/target/release/containerd-shim-baton-v1 target/release/baton-park-release-bench
//! [ROUNDS MIB RATE]` (defaults 50, 256, 4096: 256 MiB copied at 4096 MiB/s, about 60 ms per checkpoint).
use std::{collections::BTreeMap, time::Duration};

use anyhow::{Context, Result, bail};
use baton_integration::cuda::{
    CudaRig, Trainer, checkpoint_ways, start_per_way, step_t_ns, way_id,
};
use serde_json::Value;

const WITHIN: Duration = Duration::from_secs(120);

/// One park's figures, ns.
struct Park {
    request_to_released: i64,
    return_to_released: i64,
    confirmed_by: String,
}

fn main() -> Result<()> {
    let arg = |i: usize, default: u64| -> Result<u64> {
        std::env::args().nth(i).map_or(Ok(default), |s| {
            s.parse().context("ROUNDS, MIB and RATE are numbers")
        })
    };
    let (rounds, mib, rate) = (arg(1, 50)?, arg(2, 256)?, arg(3, 4096)?);
    let Some(rig) = CudaRig::start("park-release-bench") else {
        bail!("cannot benchmark: a prerequisite is missing (see above)");
    };
    let dir = tempfile::tempdir()?;
    let library = baton_integration::trace_env::fake_libcuda_in(dir.path())?;
    let trainer = Trainer {
        vram_mib: mib,
        copy_mib_per_s: rate,
        ..Trainer::with_worker()
    };
    let ways = checkpoint_ways(&library);
    let running = start_per_way(&rig, &ways, &trainer, WITHIN)?;
    eprintln!(
        "baton-park-release-bench: {rounds} parks per way of a mock trainer with a forked worker ({mib} MiB \
         copied at {rate} MiB/s) ..."
    );
    let mut parks: Vec<Vec<Park>> = vec![Vec::new(), Vec::new()];
    for round in 0..=rounds {
        for (i, (name, _)) in ways.iter().enumerate() {
            let id = way_id(name);
            let park = park_and_resume(&rig, &id)?;
            // The first round of each way warms up (the API's starts the helper).
            if round > 0 {
                parks[i].push(park);
            }
        }
    }
    println!(
        "park of a mock trainer with a forked worker ({mib} MiB copied at {rate} MiB/s), {rounds} parks per way, \
         alternating; ms, p50 / p99 (negative: before the checkpoint call returned; goal: at most +1 ms)"
    );
    println!("| way | park request -> released | checkpoint return -> released | confirmed by |");
    println!("|---|---|---|---|");
    for ((name, _), p) in ways.iter().zip(&parks) {
        let mut by: BTreeMap<&str, usize> = BTreeMap::new();
        for park in p {
            *by.entry(park.confirmed_by.as_str()).or_default() += 1;
        }
        let by: Vec<String> = by.iter().map(|(k, n)| format!("{k} {n}")).collect();
        let request: Vec<i64> = p.iter().map(|x| x.request_to_released).collect();
        let ret: Vec<i64> = p.iter().map(|x| x.return_to_released).collect();
        println!(
            "| {name} | {} | {} | {} |",
            p50_p99(request),
            p50_p99(ret),
            by.join(", ")
        );
    }
    drop(running);
    Ok(())
}

/// `baton preempt` then `baton resume` of `id`; the park's figures.
fn park_and_resume(rig: &CudaRig, id: &str) -> Result<Park> {
    let (steps, outcome) = rig.baton_json(&["preempt", id]);
    if outcome["preemption"]["state"] != "parked" {
        bail!("the park of {id} failed: {outcome}");
    }
    let asked = step_t_ns(&steps, "asked", id) as i64;
    let returned = steps
        .iter()
        .filter(|s| s["phase"] == "checkpointed" && s["id"] == id)
        .filter_map(|s| s["t_ns"].as_u64())
        .max()
        .context("no checkpointed step")? as i64;
    let released_step = steps
        .iter()
        .find(|s| s["phase"] == "gpu_released" && s["id"] == id)
        .context("no gpu_released step")?;
    let released = released_step["t_ns"].as_u64().unwrap_or(0) as i64;
    let confirmed_by = released_step["detail"]
        .as_str()
        .map_or_else(|| "?".to_owned(), str::to_owned);
    let (resumed, _) = rig.baton_json(&["resume", id]);
    if !resumed.iter().any(|s: &Value| s["phase"] == "done") {
        bail!("the resume of {id} did not finish: {resumed:?}");
    }
    rig.wait_gpu(id, "held", WITHIN)?;
    Ok(Park {
        request_to_released: released - asked,
        return_to_released: released - returned,
        confirmed_by,
    })
}

/// `p50 / p99` of `v` (ns) in ms.
fn p50_p99(mut v: Vec<i64>) -> String {
    if v.is_empty() {
        return "-".to_owned();
    }
    v.sort_unstable();
    let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize] as f64 / 1e6;
    format!("{:.3} / {:.3}", at(0.5), at(0.99))
}
