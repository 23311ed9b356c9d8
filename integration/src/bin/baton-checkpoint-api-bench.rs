//! `baton-checkpoint-api-bench`: a park and a resume of one CUDA process through the `cuda-checkpoint` program
//! against the same through the driver API (the shim's driver helper and the fake libcuda), on the mock GPU.
//! Two trainers of MIB MiB (copied at RATE MiB/s by the mock's restore thread, the same for both ways) run side
//! by side under the Baton shim: one whose node TOML turns the API off (`cuda_driver_path = ""`), one whose TOML
//! names the fake libcuda and no program at all. Rounds alternate between them; each times `baton preempt`
//! (asked -> done) and `baton resume` (asked -> done) from the steps the shim reports. The first API round also
//! pays for starting the helper (loading the library, `cuInit`): it is printed apart.
//!
//! Figures only (no assertions); the ratio is the API's against the program's of the same run. On the mock, the
//! program costs a process start per action (four per park and resume); a real program also initialises the
//! driver library each time, which this bench cannot measure without a GPU.
//!
//! Run as root: `cargo build --release -p baton-integration --bin baton-checkpoint-api-bench` then
//! `BATON_SHIM_BIN=$PWD/target/release/containerd-shim-baton-v1 target/release/baton-checkpoint-api-bench
//! [ROUNDS MIB RATE]` (defaults 10, 64, 65536).
use std::time::Duration;

use anyhow::{Context, Result, bail};
use baton_integration::cuda::{
    CudaRig, Trainer, checkpoint_ways, start_per_way, step_t_ns, way_id,
};

const WITHIN: Duration = Duration::from_secs(120);

fn main() -> Result<()> {
    let arg = |i: usize, default: u64| -> Result<u64> {
        std::env::args().nth(i).map_or(Ok(default), |s| {
            s.parse().context("ROUNDS, MIB and RATE are numbers")
        })
    };
    let (rounds, mib, rate) = (arg(1, 10)?, arg(2, 64)?, arg(3, 65536)?);
    let Some(rig) = CudaRig::start("checkpoint-api-bench") else {
        bail!("cannot benchmark: a prerequisite is missing (see above)");
    };
    let dir = tempfile::tempdir()?;
    let library = baton_integration::trace_env::fake_libcuda_in(dir.path())?;
    let trainer = Trainer {
        vram_mib: mib,
        copy_mib_per_s: rate,
        ..Trainer::default()
    };
    let ways = checkpoint_ways(&library);
    let running = start_per_way(&rig, &ways, &trainer, WITHIN)?;
    println!(
        "park + resume of one mock CUDA process ({mib} MiB copied at {rate} MiB/s), {rounds} rounds each way, \
         alternating (medians, ms)"
    );
    let mut times: Vec<(Vec<f64>, Vec<f64>)> = vec![(Vec::new(), Vec::new()); ways.len()];
    let mut first_api = None;
    for round in 0..=rounds {
        for (i, (name, _)) in ways.iter().enumerate() {
            let id = way_id(name);
            let (park, resume) = park_and_resume(&rig, &id)?;
            if round == 0 {
                // The first round of each way warms up; the API's also starts the helper.
                if i == 1 {
                    first_api = Some(park);
                }
                continue;
            }
            times[i].0.push(park);
            times[i].1.push(resume);
        }
    }
    println!("| way | park | resume | park + resume | vs program |");
    println!("|---|---|---|---|---|");
    let total = |t: &(Vec<f64>, Vec<f64>)| median(t.0.clone()) + median(t.1.clone());
    let base = total(&times[0]);
    for ((name, _), t) in ways.iter().zip(&times) {
        println!(
            "| {name} | {:.1} | {:.1} | {:.1} | {:.2}x |",
            median(t.0.clone()),
            median(t.1.clone()),
            total(t),
            total(t) / base
        );
    }
    if let Some(first) = first_api {
        println!("first park through the API (starts the helper: load, cuInit): {first:.1} ms");
    }
    drop(running);
    Ok(())
}

/// `baton preempt` then `baton resume` of `id`: each one's time from asked to done, in ms.
fn park_and_resume(rig: &CudaRig, id: &str) -> Result<(f64, f64)> {
    let span = |steps: &[serde_json::Value]| {
        let (asked, done) = (step_t_ns(steps, "asked", id), step_t_ns(steps, "done", id));
        done.saturating_sub(asked) as f64 / 1e6
    };
    let (steps, _) = rig.baton_json(&["preempt", id]);
    let park = span(&steps);
    let (steps, _) = rig.baton_json(&["resume", id]);
    let resume = span(&steps);
    rig.wait_gpu(id, "held", WITHIN)?;
    Ok((park, resume))
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
