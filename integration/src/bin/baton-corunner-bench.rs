//! `baton-corunner-bench`: the co-runner controller on the CPU analog (issue 9 §3). A latency-critical
//! server container (per request a 30 ms prefill of CPU work, then 10 tokens of 5 ms, streamed) and a
//! CPU-bound co-runner container, pinned to one CPU, under containerd with the Baton shim and a `baton
//! agent`; everything else runs on the other CPUs. Requests come from seeded Poisson arrivals through the
//! example request proxy (`tools/baton/examples/request_proxy.rs`). Arms, at each load: server alone;
//! co-runner free; the agent's prefill shield; the agent's governor at targets 0.2 and 0.4; the 000 seed's
//! SIGSTOP shield (done by the proxy). Per arm: request latency p50/p95, first-token p95, token-gap p95 and
//! TPOT p95 as ratios to the server alone at the same load, and the co-runner's throughput as a share of
//! its solo rate, all measured in the same run. Figures only; nothing is asserted.
//!
//! Run as root: `cargo build --release --workspace --bins && cargo build --release -p baton --examples &&
//! target/release/baton-corunner-bench [--seconds 40] [--loads 0.1,0.3]` (`tools/dev bench` runs it).
use std::time::Duration;

use anyhow::{Context, Result, bail};
use baton_integration::{
    analog::{
        arms::{Arm, ArmRun, Figures, run_arm, solo_rate, table},
        generator::Load,
        rig::{AnalogRig, Binaries, Workload, take_contended_cpu},
    },
    env::TestEnv,
    shim_binary::{self, BATON_RUNTIME},
    skip,
};
use clap::Parser;

/// The benchmark's flags.
#[derive(Parser)]
struct Args {
    /// Measured seconds per arm and load (after a 3 s warm-up).
    #[arg(long, default_value_t = 40)]
    seconds: u64,
    /// Loads, as shares of the server's capacity.
    #[arg(long, value_delimiter = ',', default_value = "0.1,0.3")]
    loads: Vec<f64>,
    /// Seed of the arrivals (each load and arm gets the same arrivals).
    #[arg(long, default_value_t = 9)]
    seed: u64,
}

const WORKLOAD: Workload = Workload {
    prefill_ms: 30.0,
    tokens: 10,
    token_ms: 5.0,
};
const WARMUP: Duration = Duration::from_secs(3);
const SOLO: Duration = Duration::from_secs(5);

fn main() -> Result<()> {
    let args = Args::parse();
    if let Some(reason) = skip::missing_containerd_prerequisite() {
        bail!("cannot benchmark: {reason}");
    }
    let cpu = take_contended_cpu()?;
    let dir = std::env::current_exe()?
        .parent()
        .context("no binary folder")?
        .to_owned();
    let bins = Binaries::in_dir(&dir)?;
    let shim = match std::env::var_os("BATON_SHIM_BIN") {
        Some(path) => path.into(),
        None => shim_binary::baton_shim_release_binary().context("building the Baton shim")?,
    };
    let env = TestEnv::with_shim("corunner-bench", BATON_RUNTIME, Some(&shim))?;
    let rig = AnalogRig::new(env, bins, cpu, WORKLOAD)?;
    rig.start_server()?;
    let loads: Vec<Load> = args
        .loads
        .iter()
        .map(|share| Load {
            rate_per_s: WORKLOAD.rate_at(*share),
            duration: Duration::from_secs(args.seconds),
            seed: args.seed,
        })
        .collect();
    let alone: Vec<Figures> = loads
        .iter()
        .map(|load| run_arm(&rig, Arm::Alone, load, WARMUP).map(|r| r.figures))
        .collect::<Result<_>>()?;
    rig.start_co_runner()?;
    let solo_before = solo_rate(&rig, SOLO)?;
    let controller = rig.controller_available();
    let mut arms = vec![Arm::Free, Arm::SigstopShield];
    match &controller {
        Ok(()) => arms.extend([Arm::Shield, Arm::Governor(0.2), Arm::Governor(0.4)]),
        Err(e) => println!("agent arms not run: {e:#}\n"),
    }
    let mut runs: Vec<Vec<ArmRun>> = Vec::new();
    for load in &loads {
        runs.push(
            arms.iter()
                .map(|arm| run_arm(&rig, *arm, load, WARMUP))
                .collect::<Result<_>>()?,
        );
    }
    let solo_after = solo_rate(&rig, SOLO)?;
    let solo = (solo_before + solo_after) / 2.0;
    println!(
        "co-runner control, CPU analog: server and co-runner pinned to CPU {cpu}; per request {} ms prefill + \
         {} tokens x {} ms of CPU; {} s per arm after a {} s warm-up, seed {}",
        WORKLOAD.prefill_ms,
        WORKLOAD.tokens,
        WORKLOAD.token_ms,
        args.seconds,
        WARMUP.as_secs(),
        args.seed
    );
    println!(
        "co-runner solo: {solo_before:.0} units/s before the arms, {solo_after:.0} after (shares are of the mean)\n"
    );
    for ((share, load), (alone, runs)) in args.loads.iter().zip(&loads).zip(alone.iter().zip(&runs))
    {
        println!(
            "load {:.0}% of capacity ({:.2} requests/s):",
            share * 100.0,
            load.rate_per_s
        );
        println!("{}", table(alone, runs, solo));
    }
    if let (Some(low), Some(alone)) = (runs.first(), alone.first()) {
        goal_line(low, alone, solo);
    }
    Ok(())
}

/// The goal for the governor at 0.2 at the lowest load.
fn goal_line(runs: &[ArmRun], alone: &Figures, solo: f64) {
    let Some(g) = runs.iter().find(|r| r.arm == Arm::Governor(0.2)) else {
        println!(
            "goal (governor 0.2: token-gap p95 <= 1.2x alone, co-runner >= 30%): not measured"
        );
        return;
    };
    let gap = g.figures.gap_p95.as_secs_f64() / alone.gap_p95.as_secs_f64().max(1e-9);
    let share = g.co_runner_rate.unwrap_or(0.0) / solo.max(1e-9);
    println!(
        "goal (governor 0.2 at the lowest load: token-gap p95 <= 1.2x alone, co-runner >= 30% of solo; the seed \
         got 23.1% on a GPU): {gap:.2}x, {:.1}%: {}",
        share * 100.0,
        if gap <= 1.2 && share >= 0.3 {
            "met"
        } else {
            "not met"
        }
    );
}
