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
        arms::{
            Arm, ArmRun, Figures, Sample, controller_line, rate, sample_arm, solo_sample, table,
        },
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
    /// Measured seconds per arm, load and round (after a 3 s warm-up).
    #[arg(long, default_value_t = 10)]
    seconds: u64,
    /// Rounds: each runs every arm once, in turn, so that a change in the machine's load falls on all.
    #[arg(long, default_value_t = 4)]
    rounds: u64,
    /// Loads, as shares of the server's capacity.
    #[arg(long, value_delimiter = ',', default_value = "0.1,0.3")]
    loads: Vec<f64>,
    /// Seed of the arrivals (round R uses SEED+R, the same for every arm).
    #[arg(long, default_value_t = 9)]
    seed: u64,
}

const WORKLOAD: Workload = Workload {
    prefill_ms: 30.0,
    tokens: 10,
    token_ms: 5.0,
};
const WARMUP: Duration = Duration::from_secs(3);
/// The co-runner alone (no request), per round.
const SOLO: Duration = Duration::from_secs(3);

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
    rig.start_co_runner()?;
    let mut arms = vec![Arm::Alone, Arm::Free, Arm::SigstopShield];
    match rig.controller_available() {
        Ok(()) => arms.extend([Arm::Shield, Arm::Governor(0.2), Arm::Governor(0.4)]),
        Err(e) => println!("agent arms not run: {e:#}\n"),
    }
    println!(
        "co-runner control, CPU analog: server and co-runner pinned to CPU {cpu}; per request {} ms prefill + \
         {} tokens x {} ms of CPU; per load {} rounds of every arm in turn, {} s each after a {} s warm-up, \
         seeds {}..; the co-runner's solo rate measured for {} s in each round",
        WORKLOAD.prefill_ms,
        WORKLOAD.tokens,
        WORKLOAD.token_ms,
        args.rounds,
        args.seconds,
        WARMUP.as_secs(),
        args.seed,
        SOLO.as_secs()
    );
    let mut lowest: Option<(Figures, Vec<ArmRun>, f64)> = None;
    for share in &args.loads {
        let rate_per_s = WORKLOAD.rate_at(*share);
        let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); arms.len()];
        let mut solo: Vec<Sample> = Vec::new();
        for round in 0..args.rounds {
            solo.push(solo_sample(&rig, SOLO)?);
            let load = Load {
                rate_per_s,
                duration: Duration::from_secs(args.seconds),
                seed: args.seed + round,
            };
            for (arm, s) in arms.iter().zip(&mut samples) {
                s.push(sample_arm(&rig, *arm, &load, WARMUP)?);
            }
        }
        let mut runs: Vec<ArmRun> = arms
            .iter()
            .zip(&samples)
            .map(|(a, s)| ArmRun::of(*a, s))
            .collect();
        let alone = runs.remove(0).figures;
        let solo_rate = rate(&solo)?;
        println!(
            "\nload {:.0}% of capacity ({rate_per_s:.2} requests/s); co-runner solo {solo_rate:.0} units/s \
             (rounds: {}):",
            share * 100.0,
            solo.iter()
                .map(|s| format!("{:.0}", s.units as f64 / s.secs))
                .collect::<Vec<_>>()
                .join(", ")
        );
        println!("{}", table(&alone, &runs, solo_rate));
        for line in runs.iter().filter_map(controller_line) {
            println!("{line}");
        }
        if lowest.is_none() {
            lowest = Some((alone, runs, solo_rate));
        }
    }
    if let Some((alone, runs, solo)) = lowest {
        println!();
        goal_line(&runs, &alone, solo);
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
