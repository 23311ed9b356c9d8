//! `baton-handoff-bench`: what overlapping buys. A trainer (the mock CUDA workload, MIB MiB of "device
//! memory" copied at RATE MiB/s by the cuda-checkpoint stand-in) holds the mock GPU under the Baton shim; a
//! server container is created and waits. Each round hands the GPU from the trainer to a fresh server and
//! measures, from the request, when the server holds the GPU, three ways in the same run:
//! - `baton handoff --order overlapped` (the server starts on the release signal);
//! - `baton handoff --order sequential` (after the trainer is parked: frozen);
//! - the 000 seed's orchestrator: `baton preempt`, polling the agent's view of the trainer's GPU memory every
//!   100 ms, then starting the server.
//!
//! It also reports, for the overlapped arm, the gap from the release to the server's start, and the time to
//! resume the parked trainer. A snapshot restore needs CRIU, which cannot run on this kernel, so it is not
//! measured. Figures only (no assertions); ratios are against the sequential arm of the same run.
//!
//! Run as root: `cargo run --release -p baton-integration --bin baton-handoff-bench [-- ROUNDS MIB RATE]`
//! (defaults 3, 4096, 4096; `tools/dev bench` runs it).
use std::time::Duration;

use anyhow::{Context, Result, bail};
use baton_integration::cuda::{CudaRig, Trainer, step_t_ns};

const WITHIN: Duration = Duration::from_secs(120);

/// When things happened in one round (CLOCK_MONOTONIC ns).
#[derive(Default, Clone, Copy)]
struct Round {
    asked: u64,
    released: u64,
    started: u64,
    acquired: u64,
    frozen: u64,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Arm {
    Overlapped,
    Sequential,
    Poller,
}

impl Arm {
    fn name(self) -> &'static str {
        match self {
            Arm::Overlapped => "overlapped handoff",
            Arm::Sequential => "sequential handoff",
            Arm::Poller => "100 ms poller (seed)",
        }
    }
}

fn main() -> Result<()> {
    let arg = |i: usize, default: u64| -> Result<u64> {
        std::env::args().nth(i).map_or(Ok(default), |s| {
            s.parse().context("ROUNDS, MIB and RATE are numbers")
        })
    };
    let (rounds, mib, rate) = (arg(1, 3)?, arg(2, 4096)?, arg(3, 4096)?);
    let Some(rig) = CudaRig::start("handoff-bench") else {
        bail!("cannot benchmark: a prerequisite is missing (see above)");
    };
    let trainer = Trainer {
        vram_mib: mib,
        copy_mib_per_s: rate,
        ..Trainer::default()
    };
    let _trainer = rig.run("trainer", &trainer, &[]);
    rig.wait_gpu("trainer", "held", WITHIN)?;
    println!(
        "handoff on the mock GPU: the trainer's {mib} MiB copied at {rate} MiB/s, {rounds} rounds per arm \
         (medians)"
    );
    let arms = [Arm::Overlapped, Arm::Sequential, Arm::Poller];
    let mut results: Vec<(Arm, Vec<Round>)> = arms.iter().map(|a| (*a, Vec::new())).collect();
    let mut resumes = Vec::new();
    let mut n = 0;
    for _ in 0..rounds {
        for (arm, rs) in &mut results {
            n += 1;
            let server = format!("server-{n}");
            rs.push(round(&rig, *arm, &server)?);
            resumes.push(finish_round(&rig, &server)?);
        }
    }
    report(&results, &resumes);
    Ok(())
}

fn round(rig: &CudaRig, arm: Arm, server: &str) -> Result<Round> {
    let small = Trainer {
        vram_mib: 64,
        ..Trainer::default()
    };
    let _s = rig.create(server, &small, &[]);
    if arm == Arm::Poller {
        return poller_round(rig, server);
    }
    let order = if arm == Arm::Overlapped {
        "overlapped"
    } else {
        "sequential"
    };
    let (steps, _) = rig.baton_json(&[
        "handoff", "--from", "trainer", "--to", server, "--order", order,
    ]);
    Ok(Round {
        asked: step_t_ns(&steps, "asked", "trainer"),
        released: step_t_ns(&steps, "gpu_released", "trainer"),
        started: step_t_ns(&steps, "started", server),
        acquired: step_t_ns(&steps, "gpu_acquired", server),
        frozen: step_t_ns(&steps, "frozen", "trainer"),
    })
}

/// The seed's method: preempt, poll the trainer's GPU memory every 100 ms, start the server when it is 0.
fn poller_round(rig: &CudaRig, server: &str) -> Result<Round> {
    let asked = baton_agent_api::now_monotonic_ns();
    std::thread::scope(|scope| {
        let preempt = scope.spawn(|| rig.baton_json(&["preempt", "trainer"]));
        rig.poll_until_gpu_free("trainer", Duration::from_millis(100));
        let started = baton_agent_api::now_monotonic_ns();
        rig.gpu.env.api()?.start(server, "")?;
        rig.wait_gpu(server, "held", WITHIN)?;
        let acquired = rig.gpu.status(server)["since_ns"].as_u64().unwrap_or(0);
        let (steps, _) = preempt
            .join()
            .map_err(|_| anyhow::anyhow!("the preempt thread panicked"))?;
        Ok(Round {
            asked,
            released: step_t_ns(&steps, "gpu_released", "trainer"),
            started,
            acquired,
            frozen: step_t_ns(&steps, "frozen", "trainer"),
        })
    })
}

/// Stops the server and resumes the trainer; returns how long the resume took (ns).
fn finish_round(rig: &CudaRig, server: &str) -> Result<u64> {
    rig.remove(server)?;
    let (steps, _) = rig.baton_json(&["resume", "trainer"]);
    rig.wait_gpu("trainer", "held", WITHIN)?;
    Ok(step_t_ns(&steps, "done", "trainer").saturating_sub(step_t_ns(&steps, "asked", "trainer")))
}

fn median(mut v: Vec<u64>) -> u64 {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0)
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

fn report(results: &[(Arm, Vec<Round>)], resumes: &[u64]) {
    let to_b = |rs: &[Round]| {
        median(
            rs.iter()
                .map(|r| r.acquired.saturating_sub(r.asked))
                .collect(),
        )
    };
    let baseline = results
        .iter()
        .find(|(a, _)| *a == Arm::Sequential)
        .map_or(1, |(_, rs)| to_b(rs).max(1));
    println!(
        "{:<22} {:>18} {:>10} {:>20} {:>22}",
        "arm", "request->B holds", "ratio", "release->B started", "B started - A frozen"
    );
    for (arm, rs) in results {
        let total = to_b(rs);
        let gap = median(
            rs.iter()
                .map(|r| r.started.saturating_sub(r.released))
                .collect(),
        );
        let vs_frozen: Vec<i64> = rs
            .iter()
            .map(|r| r.started as i64 - r.frozen as i64)
            .collect();
        let mut sorted = vs_frozen.clone();
        sorted.sort_unstable();
        let before_frozen = sorted.get(sorted.len() / 2).copied().unwrap_or(0);
        println!(
            "{:<22} {:>15.1} ms {:>9.2}x {:>17.3} ms {:>19.1} ms",
            arm.name(),
            ms(total),
            total as f64 / baseline as f64,
            ms(gap),
            before_frozen as f64 / 1e6
        );
    }
    println!(
        "park resume (thaw, restore, unlock) of the trainer: median {:.1} ms over {} resumes; a snapshot \
         restore needs CRIU, which fails on this kernel: not measured",
        ms(median(resumes.to_vec())),
        resumes.len()
    );
}
