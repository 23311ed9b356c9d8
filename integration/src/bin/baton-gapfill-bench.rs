//! `baton-gapfill-bench`: the 000 seed's §3 (batch work in serving gaps) on the mock GPU, its clock
//! compressed by a factor K that the bench prints: every duration of the seed divided by K, every rate
//! multiplied by it. A trainer (the mock CUDA workload, counting its steps) fills the GPU of a server that
//! leaves it when idle; seeded Poisson requests (the seed's 1, 2, 4, 8 and 16 per minute, one seed per rate,
//! the same arrivals for every arm) each need the server to run a few steps (its decode). Arms:
//! - overlapped: Baton's own loop. The server is latency-critical with `baton.io/wait-gpu-free` and
//!   `baton.io/park-when-idle`, the trainer `baton.io/preemptible: park`; the bench only tells the agent
//!   `request_start` / `request_end`, as a request proxy does, and the agent parks and resumes both;
//! - sequential: the bench parks the trainer (`baton preempt`, which returns once it is frozen) and only
//!   then resumes the server; when idle, it parks the server, then resumes the trainer;
//! - orchestrator (the seed's): `baton preempt`, polling the agent's view of the GPU memory of the one
//!   leaving every 100 ms until it is free, then `baton resume` of the other.
//!
//! The mock's copies mirror the seed's: each trainer copy (checkpoint or restore) takes half the seed's
//! trainer stop to GPU-free plus restore, (1.40 + 2.41) / 2 s, each server copy half its restore plus removal,
//! (3.59 + 0.22) / 2 s, a request takes 0.54 s of server steps, and the server is parked after 0.5 s idle (the
//! seed removed it at once): so the known part of C, the trainer's time lost per preemption, is 8.66 s of the
//! seed's time, and the rest is the arm's own.
//!
//! Per rate and arm it prints the trainer's share of its solo rate (measured in the same run: the trainer
//! alone, before and after, for as long), request p50/p95 (from the scheduled arrival to the server's last
//! step of it), preemptions per hour, C (overlapped: the agent's own figure from `baton status`, its mean
//! over a window set to the arm's arrivals; the others: the same span, the bench's preemption request to
//! the trainer's resume returning, measured by the bench), and the seed's line `1 - rate * C / 3600` from
//! those two. Times and rates are in the seed's clock (the bench's times K, its rates / K). Figures only;
//! nothing is asserted.
//!
//! Run as root: `BATON_SHIM_BIN=$PWD/target/release/containerd-shim-baton-v1 target/release/baton-gapfill-bench
//! [--compress 10] [--minutes 3] [--rates 1,2,4,8,16] [--seed 1]` (`tools/dev bench` runs it).
use std::{
    io::{Read, Seek, SeekFrom},
    path::{Path, PathBuf},
    sync::{
        Condvar, Mutex, MutexGuard, PoisonError,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use baton_agent_api::now_monotonic_ns;
use baton_integration::{
    agent::{AgentConn, wait_until},
    analog::{
        arms::percentile,
        generator::{Load, arrivals},
    },
    api::runtime_options_toml,
    cuda::{CudaRig, Trainer},
};
use clap::Parser;
use serde_json::{Value, json};

/// The benchmark's flags.
#[derive(Parser)]
struct Args {
    /// Time compression K: the bench's clock runs K times the seed's (rates times K, durations over K).
    #[arg(long, default_value_t = 10.0)]
    compress: f64,
    /// Minutes of arrivals per arm and rate, in the seed's clock.
    #[arg(long, default_value_t = 3.0)]
    minutes: f64,
    /// Requests per minute, in the seed's clock.
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16")]
    rates: Vec<f64>,
    /// Seed of the arrivals (rate number I uses SEED + I, the same for every arm).
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// The seed's trainer: stop to GPU free (1.40 s) plus restore (2.41 s), one mock copy each way (seconds).
const TRAINER_COPY_S: f64 = (1.40 + 2.41) / 2.0;
/// The seed's server: restore alone (3.59 s) plus removal to GPU free (0.22 s), one copy each way.
const SERVER_COPY_S: f64 = (3.59 + 0.22) / 2.0;
/// The seed's decode of one request.
const SERVICE_S: f64 = 0.54;
/// Idle time before the server is parked (the seed removed it at once; `park-when-idle` needs a duration).
const IDLE_S: f64 = 0.5;
/// The mock device memory of the trainer and of the server (MiB).
const VRAM_MIB: u64 = 768;
/// One mock step (ms), of the trainer and of the server.
const STEP_MS: u64 = 5;
/// The seed's §3 and §5: requests per minute, overlapped share and p95 (s), sequential share and p95.
const SEED_FIGURES: [(f64, f64, f64, f64, f64); 5] = [
    (1.0, 0.91, 7.6, 0.89, 10.6),
    (2.0, 0.76, 8.4, 0.71, 10.7),
    (4.0, 0.60, 8.8, 0.56, 11.2),
    (8.0, 0.34, 8.1, 0.25, 11.9),
    (16.0, 0.11, 8.8, 0.07, 12.0),
];
/// The seed's median C, overlapped and sequential (s).
const SEED_C_S: (f64, f64) = (9.47, 12.40);
/// How long a request, a state or a setup may take before the bench gives up on it.
const WITHIN: Duration = Duration::from_secs(60);
/// The seed's orchestrator polls GPU memory this often (not compressed: it is the seed's poller's period).
const POLL: Duration = Duration::from_millis(100);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Arm {
    Overlapped,
    Sequential,
    Orchestrator,
}

impl Arm {
    const ALL: [Arm; 3] = [Arm::Overlapped, Arm::Sequential, Arm::Orchestrator];

    fn name(self) -> &'static str {
        match self {
            Arm::Overlapped => "overlapped (Baton)",
            Arm::Sequential => "sequential",
            Arm::Orchestrator => "orchestrator (seed)",
        }
    }
}

/// The run's settings, in the bench's clock.
struct Config {
    /// The compression factor K.
    k: f64,
    /// Arrivals per arm and rate.
    window: Duration,
    /// The server's `park-when-idle`.
    idle: Duration,
    /// Server steps per request.
    service_steps: u64,
    /// The node's options (the rate gate kept out of the way, its window the arrivals').
    toml: String,
    rates: Vec<f64>,
    seed: u64,
}

impl Config {
    fn new(args: &Args) -> Result<Self> {
        if args.compress <= 0.0 || args.minutes <= 0.0 {
            bail!("--compress and --minutes are positive");
        }
        let k = args.compress;
        let window = Duration::from_secs_f64(args.minutes * 60.0 / k);
        let idle = Duration::from_millis(((IDLE_S / k) * 1000.0).round().max(1.0) as u64);
        let service_steps = ((SERVICE_S / k * 1000.0) / STEP_MS as f64).round().max(1.0) as u64;
        let toml = format!(
            "gap_fill_min_share = 0.0\ngap_fill_window = \"{}ms\"\n",
            window.as_millis()
        );
        Ok(Self {
            k,
            window,
            idle,
            service_steps,
            toml,
            rates: args.rates.clone(),
            seed: args.seed,
        })
    }

    /// The mock copy rate (MiB/s) that makes one copy of [`VRAM_MIB`] take `seed_s` of the seed's clock.
    fn copy_rate(&self, seed_s: f64) -> u64 {
        (VRAM_MIB as f64 / (seed_s / self.k)).round().max(1.0) as u64
    }

    fn workload(&self, copy_s: f64, progress_every: u64) -> Trainer {
        Trainer {
            vram_mib: VRAM_MIB,
            copy_mib_per_s: self.copy_rate(copy_s),
            step_ms: STEP_MS,
            extra: vec!["--progress-every".into(), progress_every.to_string()],
            ..Trainer::default()
        }
    }

    fn trainer(&self) -> Trainer {
        self.workload(TRAINER_COPY_S, 20)
    }

    fn server(&self) -> Trainer {
        self.workload(SERVER_COPY_S, 1)
    }

    fn options(&self) -> Option<prost_types::Any> {
        Some(runtime_options_toml(&self.toml))
    }

    /// Seconds of the seed's clock for `d` of the bench's.
    fn seed_s(&self, d: Duration) -> f64 {
        d.as_secs_f64() * self.k
    }
}

/// One arm at one rate, as measured.
struct Outcome {
    arm: Arm,
    /// The trainer's steps during the arrivals.
    steps: u64,
    latencies: Vec<Duration>,
    failed: usize,
    /// Preemptions asked during the arrivals.
    preemptions: f64,
    /// Mean C (bench clock); `None` when no preemption ended.
    c: Option<Duration>,
    /// `request_end`s the agent refused.
    ends_refused: usize,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let cfg = Config::new(&args)?;
    let Some(rig) = CudaRig::start("gapfill-bench") else {
        bail!("cannot benchmark: a prerequisite is missing (see above)");
    };
    print_setup(&cfg);
    let mut n = 0;
    let solo_before = solo_rate(&rig, &cfg, &mut n)?;
    let mut results = Vec::new();
    for (i, rate) in cfg.rates.iter().enumerate() {
        let load = Load {
            rate_per_s: rate * cfg.k / 60.0,
            duration: cfg.window,
            seed: cfg.seed + i as u64,
        };
        let due = arrivals(&load);
        for arm in Arm::ALL {
            n += 1;
            let outcome = run_arm(&rig, &cfg, arm, &due, n)
                .with_context(|| format!("{} at {rate}/min", arm.name()))?;
            results.push((*rate, due.len(), outcome));
        }
    }
    let solo_after = solo_rate(&rig, &cfg, &mut n)?;
    report(&cfg, (solo_before + solo_after) / 2.0, &results);
    println!(
        "solo rate of the trainer: {solo_before:.1} steps/s before the arms, {solo_after:.1} after (shares \
         are of their mean)"
    );
    Ok(())
}

fn print_setup(cfg: &Config) {
    let known = 2.0 * TRAINER_COPY_S + 2.0 * SERVER_COPY_S + SERVICE_S + IDLE_S;
    println!(
        "gap-fill on the mock GPU, the seed's clock compressed {k}x: {m:.1} s of arrivals per arm and rate \
         ({s:.0} s of the seed's), trainer and server {VRAM_MIB} MiB each, copied at {tr} and {sr} MiB/s \
         ({tc:.0} ms and {sc:.0} ms per copy), {steps} server steps of {STEP_MS} ms per request, \
         park-when-idle {idle} ms; the known part of C is {known:.2} s in the seed's clock. Times and rates \
         below are in the seed's clock.",
        k = cfg.k,
        m = cfg.window.as_secs_f64(),
        s = cfg.seed_s(cfg.window),
        tr = cfg.copy_rate(TRAINER_COPY_S),
        sr = cfg.copy_rate(SERVER_COPY_S),
        tc = TRAINER_COPY_S / cfg.k * 1000.0,
        sc = SERVER_COPY_S / cfg.k * 1000.0,
        steps = cfg.service_steps,
        idle = cfg.idle.as_millis(),
    );
}

/// The trainer alone for one window: its steps per second (bench clock).
fn solo_rate(rig: &CudaRig, cfg: &Config, n: &mut u64) -> Result<f64> {
    *n += 1;
    let id = format!("solo-{n}");
    let trainer = rig.create_with(&id, &cfg.trainer(), &[], cfg.options());
    rig.gpu.env.api()?.start(&id, "")?;
    rig.wait_gpu(&id, "held", WITHIN)?;
    let t0 = now_monotonic_ns();
    std::thread::sleep(cfg.window);
    let t1 = now_monotonic_ns();
    std::thread::sleep(Duration::from_millis(200));
    let steps = steps_between(output_of(&trainer)?, t0, t1)?;
    rig.remove(&id)?;
    Ok(steps as f64 / cfg.window.as_secs_f64())
}

fn output_of(r: &baton_integration::cuda::Running) -> Result<&Path> {
    r.output_file()
        .context("a created container has an output file")
}

/// The trainer's steps from `t0` to `t1` (CLOCK_MONOTONIC ns), from its `progress` lines.
fn steps_between(out: &Path, t0: u64, t1: u64) -> Result<u64> {
    let text = std::fs::read_to_string(out)?;
    let progress: Vec<(u64, u64)> = text.lines().filter_map(progress_line).collect();
    let at = |t: u64| {
        progress
            .iter()
            .take_while(|(_, ts)| *ts <= t)
            .last()
            .map_or(0, |(steps, _)| *steps)
    };
    Ok(at(t1).saturating_sub(at(t0)))
}

/// `progress STEPS T_NS` parsed.
fn progress_line(line: &str) -> Option<(u64, u64)> {
    let mut words = line.strip_prefix("progress ")?.split(' ');
    Some((words.next()?.parse().ok()?, words.next()?.parse().ok()?))
}

/// A container's annotations.
type Annotations<'a> = Vec<(&'a str, &'a str)>;

/// The trainer's and the server's annotations in `arm` (the server parked after `idle`): gap-fill's in
/// Baton's arm, none where the bench does the handing over.
fn annotations(arm: Arm, idle: &str) -> (Annotations<'_>, Annotations<'_>) {
    if arm != Arm::Overlapped {
        return (Vec::new(), Vec::new());
    }
    (
        vec![
            ("baton.io/role", "co-runner"),
            ("baton.io/preemptible", "park"),
        ],
        vec![
            ("baton.io/role", "latency-critical"),
            ("baton.io/wait-gpu-free", "1m"),
            ("baton.io/park-when-idle", idle),
        ],
    )
}

/// Runs `arm` on fresh containers `trainer-N` and `server-N` with requests due at `due` (from the start).
fn run_arm(rig: &CudaRig, cfg: &Config, arm: Arm, due: &[Duration], n: u64) -> Result<Outcome> {
    let trainer_id = format!("trainer-{n}");
    let server_id = format!("server-{n}");
    let idle = format!("{}ms", cfg.idle.as_millis());
    let (trainer_notes, server_notes) = annotations(arm, &idle);
    let trainer = rig.create_with(&trainer_id, &cfg.trainer(), &trainer_notes, cfg.options());
    rig.gpu.env.api()?.start(&trainer_id, "")?;
    rig.wait_gpu(&trainer_id, "held", WITHIN)?;
    let server = rig.create_with(&server_id, &cfg.server(), &server_notes, cfg.options());
    let trial = Trial {
        rig,
        arm,
        trainer: trainer_id,
        server: server_id,
        server_out: output_of(&server)?.to_owned(),
        service_steps: cfg.service_steps,
        idle: cfg.idle,
        sched: Mutex::new(Sched::default()),
        wake: Condvar::new(),
        ends_refused: AtomicUsize::new(0),
    };
    trial.settle()?;
    let measured = trial.drive(cfg, due);
    let outcome = measured.and_then(|m| {
        let steps = steps_between(output_of(&trainer)?, m.t0, m.t1)?;
        for e in m.latencies.iter().filter_map(|l| l.as_ref().err()) {
            eprintln!("{}: a request failed: {e:#}", arm.name());
        }
        Ok(Outcome {
            arm,
            steps,
            failed: m.latencies.iter().filter(|l| l.is_err()).count(),
            latencies: m.latencies.into_iter().filter_map(Result::ok).collect(),
            preemptions: m.preemptions,
            c: m.c,
            ends_refused: trial.ends_refused.load(Ordering::Relaxed),
        })
    });
    rig.remove(&trial.server)?;
    rig.remove(&trial.trainer)?;
    outcome
}

/// The bench's scheduler of the sequential and orchestrator arms.
#[derive(Default)]
struct Sched {
    /// Requests arrived and not yet served.
    in_flight: u32,
    /// When the last request was served.
    last_end: Option<Instant>,
    /// No request will come any more.
    done: bool,
}

/// One arm at one rate, running.
struct Trial<'a> {
    rig: &'a CudaRig,
    arm: Arm,
    trainer: String,
    server: String,
    server_out: PathBuf,
    service_steps: u64,
    idle: Duration,
    sched: Mutex<Sched>,
    wake: Condvar,
    /// `request_end`s the agent refused (see [`Trial::end`]).
    ends_refused: AtomicUsize,
}

/// What one window of arrivals gave.
struct Measured {
    t0: u64,
    t1: u64,
    latencies: Vec<Result<Duration>>,
    preemptions: f64,
    c: Option<Duration>,
}

impl Trial<'_> {
    /// Brings both containers where every arm starts: the server started once and parked, the trainer
    /// running.
    fn settle(&self) -> Result<()> {
        if self.arm == Arm::Overlapped {
            // The server's Start waits at the gate until the agent parked the trainer; idle, the agent
            // parks the server and resumes the trainer by itself.
            self.rig.gpu.env.api()?.start(&self.server, "")?;
        } else {
            self.baton(&["preempt", &self.trainer])?;
            self.rig.gpu.env.api()?.start(&self.server, "")?;
            self.rig.wait_gpu(&self.server, "held", WITHIN)?;
            self.baton(&["preempt", &self.server])?;
            self.baton(&["resume", &self.trainer])?;
        }
        let settled = wait_until(WITHIN, || {
            self.preemption(&self.server)["state"] == json!("parked")
                && self.preemption(&self.trainer).is_null()
                && self.rig.gpu.status(&self.trainer)["gpu"] == json!("held")
        });
        if !settled {
            bail!(
                "the server was not parked with the trainer running: {} {}",
                self.rig.gpu.status(&self.server),
                self.rig.gpu.status(&self.trainer)
            );
        }
        Ok(())
    }

    fn preemption(&self, id: &str) -> Value {
        self.rig.gpu.status(id)["preemption"].clone()
    }

    /// Runs `baton ARGS`, which must succeed.
    fn baton(&self, args: &[&str]) -> Result<()> {
        let (out, err, ok) = self.rig.baton(args);
        if !ok {
            bail!("baton {args:?}: {err}{out}");
        }
        Ok(())
    }

    /// Sends the requests due at `due`, each from a thread of its own, and measures the window.
    fn drive(&self, cfg: &Config, due: &[Duration]) -> Result<Measured> {
        let start = Instant::now();
        let t0 = now_monotonic_ns();
        std::thread::scope(|s| {
            let scheduler = (self.arm != Arm::Overlapped).then(|| s.spawn(|| self.schedule()));
            let requests: Vec<_> = due
                .iter()
                .enumerate()
                .map(|(i, at)| {
                    sleep_until(start + *at);
                    let due_ns = t0 + at.as_nanos() as u64;
                    s.spawn(move || self.request(i, due_ns))
                })
                .collect();
            sleep_until(start + cfg.window);
            let t1 = now_monotonic_ns();
            let agent = (self.arm == Arm::Overlapped).then(|| self.agent_figures(cfg));
            let latencies = requests
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| bail!("a request panicked")))
                .collect();
            self.lock().done = true;
            self.wake.notify_all();
            let (preemptions, c) = match (scheduler, agent) {
                (Some(h), _) => {
                    let cycles = h
                        .join()
                        .unwrap_or_else(|_| bail!("the scheduler panicked"))?;
                    cycles_in(&cycles, t0, t1)
                }
                (None, Some(agent)) => agent?,
                (None, None) => (0.0, None),
            };
            Ok(Measured {
                t0,
                t1,
                latencies,
                preemptions,
                c,
            })
        })
    }

    /// The agent's rate gate for the mock GPU now: preemptions in its window and its mean C.
    fn agent_figures(&self, cfg: &Config) -> Result<(f64, Option<Duration>)> {
        let (out, err, ok) = self.rig.baton(&["status", "--json"]);
        if !ok {
            bail!("baton status: {err}");
        }
        let status: Value = serde_json::from_str(&out)?;
        let row = status["gap_fill"]["gpus"]
            .as_array()
            .and_then(|gpus| gpus.iter().find(|r| r["device"] == json!("nvidia0")))
            .with_context(|| format!("no gap-fill row for nvidia0: {}", status["gap_fill"]))?;
        let per_hour = row["preemptions_per_hour"].as_f64().unwrap_or(0.0);
        let c = row["c_s"].as_f64().map(Duration::from_secs_f64);
        Ok((per_hour * cfg.window.as_secs_f64() / 3600.0, c))
    }

    fn lock(&self) -> MutexGuard<'_, Sched> {
        self.sched.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// One request: announced, served by `service_steps` server steps, ended; its latency from `due_ns`.
    fn request(&self, i: usize, due_ns: u64) -> Result<Duration> {
        let from = std::fs::metadata(&self.server_out).map_or(0, |m| m.len());
        let id = format!("{}-r{i}", self.server);
        let conn = self.begin(&id)?;
        let served = wait_steps(&self.server_out, from, self.service_steps);
        self.end(&id, conn)?;
        Ok(Duration::from_nanos(served?.saturating_sub(due_ns)))
    }

    /// A request arrives: the agent is told (overlapped), or the bench's scheduler.
    fn begin(&self, id: &str) -> Result<Option<AgentConn>> {
        if self.arm == Arm::Overlapped {
            let mut conn = AgentConn::connect(&self.rig.gpu.env.containerd().agent_socket())?;
            conn.call(json!({"op": "request_start", "id": id, "server": self.server}))?;
            return Ok(Some(conn));
        }
        self.lock().in_flight += 1;
        self.wake.notify_all();
        Ok(None)
    }

    /// A request was served.
    fn end(&self, id: &str, conn: Option<AgentConn>) -> Result<()> {
        if let Some(mut conn) = conn {
            let end = json!({"op": "request_end", "id": id, "server": self.server});
            if let Err(e) = conn.call(end) {
                // The co-runner controller drops open requests after its input silence (1 s by default),
                // which a request waiting for a hand-back can outlast; the idle park saw the end anyway.
                eprintln!("overlapped: the agent refused request_end of {id}: {e:#}");
                self.ends_refused.fetch_add(1, Ordering::Relaxed);
            }
            return Ok(());
        }
        let mut s = self.lock();
        s.in_flight -= 1;
        s.last_end = Some(Instant::now());
        self.wake.notify_all();
        Ok(())
    }

    /// The bench's scheduler: on a request, hands the GPU to the server; once nothing was in flight for the
    /// idle time, hands it back. Each cycle's (preemption asked, trainer resumed), CLOCK_MONOTONIC ns.
    fn schedule(&self) -> Result<Vec<(u64, u64)>> {
        let mut cycles = Vec::new();
        loop {
            {
                let s = self.lock();
                let s = self
                    .wake
                    .wait_while(s, |s| s.in_flight == 0 && !s.done)
                    .unwrap_or_else(PoisonError::into_inner);
                if s.in_flight == 0 {
                    return Ok(cycles);
                }
            }
            let asked = now_monotonic_ns();
            self.hand_over(&self.trainer, &self.server)?;
            self.wait_idle();
            self.hand_over(&self.server, &self.trainer)?;
            cycles.push((asked, now_monotonic_ns()));
        }
    }

    /// Waits until no request was in flight for the idle time.
    fn wait_idle(&self) {
        let mut s = self.lock();
        loop {
            let quiet = s.last_end.map_or(self.idle, |t| t.elapsed());
            s = match s.in_flight {
                0 if quiet >= self.idle => return,
                0 => {
                    self.wake
                        .wait_timeout(s, self.idle - quiet)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0
                }
                _ => self.wake.wait(s).unwrap_or_else(PoisonError::into_inner),
            };
        }
    }

    /// Parks `from` and resumes `to`: after the park returned (sequential), or once the agent shows `from`'s
    /// GPU memory free, polled every 100 ms (the seed's orchestrator).
    fn hand_over(&self, from: &str, to: &str) -> Result<()> {
        if self.arm == Arm::Sequential {
            self.baton(&["preempt", from])?;
            return self.baton(&["resume", to]);
        }
        std::thread::scope(|s| {
            let park = s.spawn(|| self.baton(&["preempt", from]));
            self.rig.poll_until_gpu_free(from, POLL);
            let resumed = self.baton(&["resume", to]);
            park.join()
                .unwrap_or_else(|_| bail!("the preempt thread panicked"))?;
            resumed
        })
    }
}

/// Preemptions asked in `[t0, t1)` and their mean C.
fn cycles_in(cycles: &[(u64, u64)], t0: u64, t1: u64) -> (f64, Option<Duration>) {
    let costs: Vec<u64> = cycles
        .iter()
        .filter(|(asked, _)| (t0..t1).contains(asked))
        .map(|(asked, resumed)| resumed - asked)
        .collect();
    let mean = (!costs.is_empty())
        .then(|| Duration::from_nanos(costs.iter().sum::<u64>() / costs.len() as u64));
    (costs.len() as f64, mean)
}

/// Waits until the server printed `steps` `progress` lines after byte `from` of its output: when the last
/// was (CLOCK_MONOTONIC ns).
fn wait_steps(out: &Path, from: u64, steps: u64) -> Result<u64> {
    let deadline = Instant::now() + WITHIN;
    let mut file = std::fs::File::open(out)?;
    file.seek(SeekFrom::Start(from))?;
    let mut text = String::new();
    while Instant::now() < deadline {
        file.read_to_string(&mut text)?;
        let complete = &text[..text.rfind('\n').map_or(0, |i| i + 1)];
        if let Some((_, t)) = complete
            .lines()
            .filter_map(progress_line)
            .nth(steps as usize - 1)
        {
            return Ok(t);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    bail!("the server did not run {steps} steps within {WITHIN:?}")
}

fn sleep_until(t: Instant) {
    std::thread::sleep(t.saturating_duration_since(Instant::now()));
}

fn report(cfg: &Config, solo: f64, results: &[(f64, usize, Outcome)]) {
    println!(
        "\n| req/min | arm | requests | trainer share | 1 - rate*C/3600 | p50 | p95 | preemptions/h | C | C vs \
         sequential | seed: share, p95 |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for (rate, count, o) in results {
        let window = cfg.window.as_secs_f64();
        let share = o.steps as f64 / window / solo;
        let per_hour = o.preemptions * 3600.0 / cfg.seed_s(cfg.window);
        let c = o.c.map(|c| cfg.seed_s(c));
        let line = c.map_or("-".into(), |c| pct(1.0 - per_hour * c / 3600.0));
        let sequential = results
            .iter()
            .find(|(r, _, s)| r == rate && s.arm == Arm::Sequential)
            .and_then(|(_, _, s)| s.c);
        let vs = match (o.c, sequential) {
            (Some(a), Some(b)) => format!("{:.2}x", a.as_secs_f64() / b.as_secs_f64()),
            _ => "-".into(),
        };
        let failed = if o.failed > 0 {
            format!(" ({} failed)", o.failed)
        } else {
            String::new()
        };
        println!(
            "| {rate} | {} | {}{failed} of {count} | {} | {line} | {} | {} | {per_hour:.0} | {} | {vs} | {} |",
            o.arm.name(),
            o.latencies.len(),
            pct(share),
            secs(cfg, percentile(o.latencies.clone(), 0.5)),
            secs(cfg, percentile(o.latencies.clone(), 0.95)),
            c.map_or("-".into(), |c| format!("{c:.2} s")),
            seed_figures(*rate, o.arm),
        );
    }
    let refused: usize = results.iter().map(|(_, _, o)| o.ends_refused).sum();
    println!(
        "\nthe seed's C: {:.2} s overlapped, {:.2} s sequential (its orchestrator is its overlapped arm); \
         request_end refused by the agent's controller (its input silence passed while the request waited): \
         {refused}",
        SEED_C_S.0, SEED_C_S.1
    );
}

/// The seed's share and p95 of `arm` at `rate`, where it measured them.
fn seed_figures(rate: f64, arm: Arm) -> String {
    let Some(&(_, o_share, o_p95, s_share, s_p95)) = SEED_FIGURES.iter().find(|(r, ..)| *r == rate)
    else {
        return "-".into();
    };
    match arm {
        Arm::Sequential => format!("{}, {s_p95} s", pct(s_share)),
        // The seed's overlapped arm polled GPU memory: its orchestrator.
        _ => format!("{}, {o_p95} s", pct(o_share)),
    }
}

fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

fn secs(cfg: &Config, d: Duration) -> String {
    format!("{:.2} s", cfg.seed_s(d))
}
