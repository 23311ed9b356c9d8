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
//! resume the parked trainer. Then the same with snapshots, through real CRIU (tools/setup.sh's): a fresh
//! trainer of SNAP_MIB MiB per round is handed off with `--mode snapshot`, overlapped and sequential (the
//! part after the release is now CRIU's dump of the trainer, its weights in host memory), and a trainer
//! restored from a Task Checkpoint image (Task Checkpoint with `exit`, then a Create from the image and
//! Start: CRIU's restore, cuda-checkpoint's restore and unlock) against a park resume of the same trainer. Figures only
//! (no assertions); ratios are against the sequential arm, and the park resume, of the same run.
//!
//! First, what the gate's NVML floor costs (issue 39): FLOOR_ROUNDS overlapped handoffs of a trainer of
//! FLOOR_MIB MiB with the agent's `--nvml-floor false`, then as many with the floor on, each on a rig of its
//! own whose agent the bench starts with the fake NVML (integration/fake-nvml, answering from the mock's
//! state after `BATON_BENCH_NVML_DELAY_US` per call, 0 by default), to a server whose Start goes through the
//! agent's gate (`baton.io/wait-gpu-free`): from the trainer's release to the server's program running (the
//! gate's wait and runc's) and to the server holding the GPU, p50 and p99 both ways.
//!
//! Run as root: `cargo run --release -p baton-integration --bin baton-handoff-bench [-- ROUNDS MIB RATE
//! SNAP_MIB FLOOR_ROUNDS FLOOR_MIB]` (defaults 3, 4096, 4096, 512, 20, 256; ROUNDS 0 runs the floor part
//! only; `tools/dev bench` runs it).
use std::time::Duration;

use anyhow::{Context, Result, bail};
use baton_integration::{
    cuda::{CudaRig, Running, Trainer, step_t_ns},
    fake_nvml::FakeNvml,
    trace_env::workspace_binary,
};

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
    let (rounds, mib, rate, snap_mib) = (arg(1, 3)?, arg(2, 4096)?, arg(3, 4096)?, arg(4, 512)?);
    let (floor_rounds, floor_mib) = (arg(5, 20)?, arg(6, 256)?);
    if floor_rounds > 0 {
        floor_costs(floor_rounds, floor_mib, rate)?;
        println!();
    }
    if rounds == 0 {
        return Ok(());
    }
    let Some(rig) = CudaRig::start("handoff-bench") else {
        bail!("cannot benchmark: a prerequisite is missing (see above)");
    };
    let _trainer = run_trainer(&rig, mib, rate)?;
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
    println!();
    snapshots(&rig, rounds, snap_mib, rate)
}

/// A trainer of `mib` MiB whose checkpoints copy at `rate` MiB/s.
fn trainer_of(mib: u64, rate: u64) -> Trainer {
    Trainer {
        vram_mib: mib,
        copy_mib_per_s: rate,
        ..Trainer::default()
    }
}

/// Runs [`trainer_of`] as container `trainer` on `rig`, once it holds the GPU.
fn run_trainer(rig: &CudaRig, mib: u64, rate: u64) -> Result<Running> {
    let trainer = rig.run("trainer", &trainer_of(mib, rate), &[]);
    rig.wait_gpu("trainer", "held", WITHIN)?;
    Ok(trainer)
}

/// The snapshot handoffs (overlapped, sequential) and restores from a checkpoint image, each round with a
/// fresh trainer of `mib` MiB; a restore against a park resume of the same trainer.
fn snapshots(rig: &CudaRig, rounds: u64, mib: u64, rate: u64) -> Result<()> {
    let trainer = trainer_of(mib, rate);
    println!(
        "snapshot (real CRIU, {}) on the mock GPU: a fresh trainer of {mib} MiB per round, {rounds} rounds \
         per arm (medians)",
        baton_agent_api::option_keys::DEFAULT_CRIU_PATH
    );
    let mut results: Vec<(Arm, Vec<Round>)> =
        vec![(Arm::Overlapped, vec![]), (Arm::Sequential, vec![])];
    let (mut restores, mut resumes) = (Vec::new(), Vec::new());
    let mut n = 0;
    for _ in 0..rounds {
        for (arm, rs) in &mut results {
            n += 1;
            rs.push(snapshot_round(rig, *arm, &trainer, n)?);
        }
        n += 1;
        let (resume, restore) = restore_round(rig, &trainer, n)?;
        resumes.push(resume);
        restores.push(restore);
    }
    report_snapshots(&results, &restores, median(resumes));
    Ok(())
}

/// A fresh trainer handed off to a fresh server with `--mode snapshot`; both are removed after, and the image.
fn snapshot_round(rig: &CudaRig, arm: Arm, trainer: &Trainer, n: u64) -> Result<Round> {
    let (from, to) = (format!("snap-{n}"), format!("snap-server-{n}"));
    let _t = rig.create(&from, trainer, &[]);
    rig.gpu.env.api()?.start(&from, "")?;
    rig.wait_gpu(&from, "held", WITHIN)?;
    let small = Trainer {
        vram_mib: 64,
        ..Trainer::default()
    };
    let _s = rig.create(&to, &small, &[]);
    let order = if arm == Arm::Overlapped {
        "overlapped"
    } else {
        "sequential"
    };
    let (steps, _) = rig.baton_json(&[
        "handoff", "--from", &from, "--to", &to, "--order", order, "--mode", "snapshot",
    ]);
    rig.remove(&to)?;
    remove_stopped(rig, &from)?;
    let image = std::path::Path::new(baton_agent_api::DEFAULT_SNAPSHOT_DIR)
        .join(rig.gpu.env.namespace())
        .join(&from);
    std::fs::remove_dir_all(&image).with_context(|| format!("remove {}", image.display()))?;
    Ok(Round {
        asked: step_t_ns(&steps, "asked", &from),
        released: step_t_ns(&steps, "gpu_released", &from),
        started: step_t_ns(&steps, "started", &to),
        acquired: step_t_ns(&steps, "gpu_acquired", &to),
        frozen: step_t_ns(&steps, "dumped", &from),
    })
}

/// A trainer parked and resumed (the resume's time, ns), then checkpointed by containerd's Task Checkpoint
/// with `exit` and restored into a new task from the image: the time (ns) from the Create to the restored
/// trainer holding the GPU again.
fn restore_round(rig: &CudaRig, trainer: &Trainer, n: u64) -> Result<(u64, u64)> {
    let (source, restored) = (format!("ckpt-{n}"), format!("restored-{n}"));
    let _t = rig.create(&source, trainer, &[]);
    rig.gpu.env.api()?.start(&source, "")?;
    rig.wait_gpu(&source, "held", WITHIN)?;
    rig.baton_json(&["preempt", &source]);
    let resume = resume(rig, &source)?;
    // The client's lease holds the checkpoint's blobs until the restored task is created from them.
    let api = rig.gpu.env.api()?;
    let checkpoint = api.checkpoint(&source, true)?;
    let t0 = baton_agent_api::now_monotonic_ns();
    let _r = rig.create_from(&restored, trainer, &[], None, Some(checkpoint));
    api.start(&restored, "")?;
    rig.wait_gpu(&restored, "held", WITHIN)?;
    let took = baton_agent_api::now_monotonic_ns().saturating_sub(t0);
    rig.remove(&restored)?;
    remove_stopped(rig, &source)?;
    Ok((resume, took))
}

/// Deletes the task and container `id` whose task has stopped (a snapshot or a checkpoint with --exit).
fn remove_stopped(rig: &CudaRig, id: &str) -> Result<()> {
    let api = rig.gpu.env.api()?;
    api.wait(id, "", WITHIN)?;
    api.delete_task(id)?;
    api.delete_container(id)?;
    Ok(())
}

fn report_snapshots(results: &[(Arm, Vec<Round>)], restores: &[u64], park_resume: u64) {
    let baseline = sequential_to_b(results);
    println!(
        "{:<22} {:>18} {:>10} {:>24}",
        "arm", "request->B holds", "ratio", "B holds - A dumped"
    );
    for (arm, rs) in results {
        let total = to_b(rs);
        let before_dumped = median_i64(
            rs.iter()
                .map(|r| r.acquired as i64 - r.frozen as i64)
                .collect(),
        );
        println!(
            "{:<22} {:>15.1} ms {:>9.2}x {:>21.1} ms",
            arm.name(),
            ms(total),
            total as f64 / baseline as f64,
            before_dumped as f64 / 1e6
        );
    }
    let restore = median(restores.to_vec());
    println!(
        "restore from a checkpoint image (Create + Start: CRIU restore, cuda-checkpoint restore and unlock, \
         until the GPU is held): median {:.1} ms over {} restores, {:.2}x a park resume of the same trainer \
         ({:.1} ms)",
        ms(restore),
        restores.len(),
        restore as f64 / park_resume.max(1) as f64,
        ms(park_resume)
    );
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
    resume(rig, "trainer")
}

/// Resumes parked container `id`; returns how long the resume took (ns).
fn resume(rig: &CudaRig, id: &str) -> Result<u64> {
    let (steps, _) = rig.baton_json(&["resume", id]);
    rig.wait_gpu(id, "held", WITHIN)?;
    Ok(step_t_ns(&steps, "done", id).saturating_sub(step_t_ns(&steps, "asked", id)))
}

/// The gate's NVML floor off and on (see the module's doc): `rounds` overlapped handoffs of a trainer of
/// `mib` MiB copied at `rate` MiB/s each way, each way on a rig of its own.
fn floor_costs(rounds: u64, mib: u64, rate: u64) -> Result<()> {
    let delay_us: u64 = std::env::var("BATON_BENCH_NVML_DELAY_US")
        .ok()
        .map_or(Ok(0), |v| v.parse())
        .context("BATON_BENCH_NVML_DELAY_US is a number")?;
    let baton = baton_program()?;
    let ways: [(&str, &[&str]); 2] = [
        ("floor off (--nvml-floor false)", &["--nvml-floor", "false"]),
        ("floor on", &[]),
    ];
    let mut rows = Vec::new();
    for (n, (way, flags)) in ways.into_iter().enumerate() {
        let Some(rig) = CudaRig::start(&format!("handoff-floor-{n}")) else {
            bail!("cannot benchmark: a prerequisite is missing (see above)");
        };
        let dir = tempfile::tempdir()?;
        let nvml = FakeNvml::install(
            dir.path(),
            rig.gpu.mock_dir.path(),
            Duration::from_micros(delay_us),
        )?;
        let socket = rig.gpu.env.containerd().agent_socket();
        let log = dir.path().join("agent.log");
        let _agent = nvml.start_agent_program(&baton, &socket, &log, flags)?;
        let _trainer = run_trainer(&rig, mib, rate)?;
        let mut rs = Vec::new();
        for i in 0..rounds {
            let server = format!("server-{i}");
            rs.push(gated_round(&rig, &server)?);
            finish_round(&rig, &server)?;
        }
        rows.push((way, rs));
    }
    println!(
        "the gate's NVML floor: {rounds} overlapped handoffs each way, a trainer of {mib} MiB copied at {rate} \
         MiB/s, the fake NVML answering {delay_us} us per call"
    );
    println!(
        "| NVML floor | release -> B through the gate and running p50 | p99 | release -> B holds p50 | p99 | \
         request -> B holds p50 |"
    );
    println!("|---|---|---|---|---|---|");
    for (way, rs) in &rows {
        let mut running: Vec<u64> = rs
            .iter()
            .map(|(r, running)| running.saturating_sub(r.released))
            .collect();
        let mut holds: Vec<u64> = rs
            .iter()
            .map(|(r, _)| r.acquired.saturating_sub(r.released))
            .collect();
        running.sort_unstable();
        holds.sort_unstable();
        let rounds: Vec<Round> = rs.iter().map(|(r, _)| *r).collect();
        println!(
            "| {way} | {:.2} ms | {:.2} ms | {:.2} ms | {:.2} ms | {:.1} ms |",
            ms(pct(&running, 50.0)),
            ms(pct(&running, 99.0)),
            ms(pct(&holds, 50.0)),
            ms(pct(&holds, 99.0)),
            ms(to_b(&rounds))
        );
    }
    Ok(())
}

/// An overlapped handoff to a server whose Start goes through the agent's gate (`baton.io/wait-gpu-free`):
/// the round, and when the server's program was running (the Start's beginning plus the time its step says
/// it took: the gate's wait and runc's).
fn gated_round(rig: &CudaRig, server: &str) -> Result<(Round, u64)> {
    let small = Trainer {
        vram_mib: 64,
        ..Trainer::default()
    };
    let _s = rig.create(server, &small, &[("baton.io/wait-gpu-free", "1m")]);
    let (steps, _) = rig.baton_json(&[
        "handoff",
        "--from",
        "trainer",
        "--to",
        server,
        "--order",
        "overlapped",
    ]);
    let started = steps
        .iter()
        .find(|s| s["phase"] == "started" && s["id"] == server)
        .context("no started step")?;
    let took_ms: f64 = started["detail"]
        .as_str()
        .and_then(|d| d.strip_prefix("running after "))
        .and_then(|d| d.strip_suffix(" ms"))
        .and_then(|d| d.parse().ok())
        .context("the started step says how long the start took")?;
    let round = Round {
        asked: step_t_ns(&steps, "asked", "trainer"),
        released: step_t_ns(&steps, "gpu_released", "trainer"),
        started: step_t_ns(&steps, "started", server),
        acquired: step_t_ns(&steps, "gpu_acquired", server),
        frozen: step_t_ns(&steps, "frozen", "trainer"),
    };
    let running = round.started + (took_ms * 1e6) as u64;
    Ok((round, running))
}

/// `baton` beside this binary (the same build), else the workspace's debug one.
fn baton_program() -> Result<std::path::PathBuf> {
    let beside = std::env::current_exe()?.with_file_name("baton");
    if beside.is_file() {
        return Ok(beside);
    }
    workspace_binary("baton", "baton")
}

/// Nearest-rank percentile of sorted values.
fn pct(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn median(mut v: Vec<u64>) -> u64 {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0)
}

fn median_i64(mut v: Vec<i64>) -> i64 {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0)
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

/// The median time from the request to the server holding the GPU of `rs`.
fn to_b(rs: &[Round]) -> u64 {
    median(
        rs.iter()
            .map(|r| r.acquired.saturating_sub(r.asked))
            .collect(),
    )
}

/// [`to_b`] of the sequential arm among `results`, the ratios' baseline (at least 1 ns).
fn sequential_to_b(results: &[(Arm, Vec<Round>)]) -> u64 {
    results
        .iter()
        .find(|(a, _)| *a == Arm::Sequential)
        .map_or(1, |(_, rs)| to_b(rs).max(1))
}

fn report(results: &[(Arm, Vec<Round>)], resumes: &[u64]) {
    let baseline = sequential_to_b(results);
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
        let before_frozen = median_i64(
            rs.iter()
                .map(|r| r.started as i64 - r.frozen as i64)
                .collect(),
        );
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
        "park resume (thaw, restore, unlock) of the trainer: median {:.1} ms over {} resumes",
        ms(median(resumes.to_vec())),
        resumes.len()
    );
}
