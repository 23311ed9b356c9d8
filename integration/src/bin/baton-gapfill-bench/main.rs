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
//!   leaving every 100 ms until it is free, then `baton resume` of the other;
//! - beside (room): the server fits beside the trainer (issue 31): latency-critical with
//!   `baton.io/wait-gpu-free` and `baton.io/gpu-memory: 128Mi` (its 64 MiB and some), on the mock's H200-sized
//!   GPU, so its Start goes through the gate at once and it stays resident; the trainer is a
//!   `baton.io/role: co-runner` with `baton.io/preemptible: park` that yields to it, and the agent's
//!   co-runner controller decides when it runs: its prefill shield freezes the trainer from a request's
//!   `request_start` to its first token, and the bench, like a proxy of a server that streams nothing, sends
//!   no token, so the shield holds to `request_end`. The mock GPU has no compute contention: left running,
//!   the trainer would lose nothing and the server would not slow down, so this arm measures what the
//!   controller's freezes cost the trainer, not what they buy the server (see the CPU analog,
//!   `baton-corunner-bench`, for a contended resource);
//! - beside + governor: the same, with `baton governor TARGET` on and the server's steps sent as its tokens
//!   (`first_token` at its first step for the request, then `token`), so the shield ends at the first step
//!   and the governor duty-cycles the trainer while the server decodes, from the stretch it measures (none
//!   on the mock, whatever its target);
//! - server alone: the beside arms' server, no trainer: the latency the beside arms' are compared with.
//!
//! The room arms need the GPU's memory, which the agent reads from NVML: the bench runs the agent itself,
//! with the fake NVML library (`integration/fake-nvml`, answering from the mock) for those arms and without
//! it for the others (with NVML, the overlapped arm's parked trainer would resume beside the server, since
//! it fits), restarted between two arms when that changes, with no container on the node; containers are
//! created with `agent_autostart = false`, so that no shim starts one of its own.
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
//! those two. Times and rates are in the seed's clock (the bench's times K, its rates / K). For the room arms
//! (and the overlapped one, their baseline on the same arrivals) a second table gives the server's Start
//! (bench ms), the trainer's parks (its restores) and the controller's freezes of it in the window, ratios to
//! the overlapped arm (the trainer's share, request p95) and to the server alone (mean latency, mean time
//! per server step within a request, its TPOT); then the governor's measured stretch and run share. Figures
//! only; nothing is asserted.
//!
//! Run as root: `BATON_SHIM_BIN=$PWD/target/release/containerd-shim-baton-v1 target/release/baton-gapfill-bench
//! [--compress 10] [--minutes 3] [--rates 1,2,4,8,16] [--seed 1]
//! [--arms overlapped,sequential,orchestrator,beside,governor,alone] [--governor-target 0.2]
//! [--governor-window-ms 200]` (`tools/dev bench` runs it).
use std::{
    io::{Read, Seek, SeekFrom},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
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
    analog::generator::{Load, arrivals},
    api::runtime_options_toml,
    cuda::{CudaRig, Trainer},
    fake_nvml::FakeNvml,
    trace_env::workspace_binary,
};
use clap::Parser;

mod report;
mod trial;
use report::{report, report_room};
use serde_json::{Value, json};
use trial::*;

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
    /// The arms to run at each rate, in this order.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "overlapped,sequential,orchestrator,beside,governor,alone"
    )]
    arms: Vec<Arm>,
    /// The governor's target stretch in the `governor` arm.
    #[arg(long, default_value_t = 0.2)]
    governor_target: f64,
    /// The governor's window in the `governor` arm (ms of the bench's clock, not compressed: the agent's
    /// default).
    #[arg(long, default_value_t = 200)]
    governor_window_ms: u64,
}

/// The seed's trainer: stop to GPU free (1.40 s) plus restore (2.41 s), one mock copy each way (seconds).
const TRAINER_COPY_S: f64 = (1.40 + 2.41) / 2.0;
/// The seed's server: restore alone (3.59 s) plus removal to GPU free (0.22 s), one copy each way.
const SERVER_COPY_S: f64 = (3.59 + 0.22) / 2.0;
/// The seed's decode of one request.
const SERVICE_S: f64 = 0.54;
/// Idle time before the server is parked (the seed removed it at once; `park-when-idle` needs a duration).
const IDLE_S: f64 = 0.5;
/// The mock device memory of the trainer and of the server (MiB). Small, because the mock's host copy is
/// real memory (it is charged to the container's memory cgroup, as a real park's is): writing 768 MiB took
/// 0.56 s on the 2-core VM (page faults and a memset), longer than the 0.19 s a copy is modelled to take at
/// K = 10, which added about 0.6 s of the bench's clock (6 s of the seed's) to every preemption. 64 MiB
/// takes about 45 ms, within the modelled copy.
const VRAM_MIB: u64 = 64;
/// The server's `baton.io/gpu-memory` in the room arms: its [`VRAM_MIB`] and some.
const SERVER_NEED: &str = "128Mi";
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

#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
enum Arm {
    Overlapped,
    Sequential,
    Orchestrator,
    Beside,
    Governor,
    Alone,
}

impl Arm {
    fn name(self) -> &'static str {
        match self {
            Arm::Overlapped => "overlapped (Baton)",
            Arm::Sequential => "sequential",
            Arm::Orchestrator => "orchestrator (seed)",
            Arm::Beside => "beside (room)",
            Arm::Governor => "beside + governor",
            Arm::Alone => "server alone",
        }
    }

    /// The server fits beside what runs (the agent needs NVML for it).
    fn room(self) -> bool {
        matches!(self, Arm::Beside | Arm::Governor | Arm::Alone)
    }

    /// The bench hands the GPU over itself.
    fn scheduled(self) -> bool {
        matches!(self, Arm::Sequential | Arm::Orchestrator)
    }

    fn has_trainer(self) -> bool {
        self != Arm::Alone
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
    /// The node's options (the rate gate kept out of the way, its window the arrivals'; no agent started by
    /// a shim: the bench runs it).
    toml: String,
    rates: Vec<f64>,
    seed: u64,
    arms: Vec<Arm>,
    governor_target: f64,
    governor_window_ms: u64,
}

impl Config {
    fn new(args: &Args) -> Result<Self> {
        if args.compress <= 0.0 || args.minutes <= 0.0 {
            bail!("--compress and --minutes are positive");
        }
        if args.arms.is_empty() {
            bail!("--arms names at least one arm");
        }
        let k = args.compress;
        let window = Duration::from_secs_f64(args.minutes * 60.0 / k);
        let idle = Duration::from_millis(((IDLE_S / k) * 1000.0).round().max(1.0) as u64);
        let service_steps = ((SERVICE_S / k * 1000.0) / STEP_MS as f64).round().max(1.0) as u64;
        let toml = format!(
            "gap_fill_min_share = 0.0\ngap_fill_window = \"{}ms\"\nagent_autostart = false\n",
            window.as_millis()
        );
        let mut arms = Vec::new();
        for a in &args.arms {
            if !arms.contains(a) {
                arms.push(*a);
            }
        }
        Ok(Self {
            k,
            window,
            idle,
            service_steps,
            toml,
            rates: args.rates.clone(),
            seed: args.seed,
            arms,
            governor_target: args.governor_target,
            governor_window_ms: args.governor_window_ms,
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

/// The agent the bench runs on the rig's socket: without NVML (the arms that need an empty GPU, as the
/// shims would start it) or with the fake one (the room arms), restarted when that changes.
struct Agents<'a> {
    rig: &'a CudaRig,
    dir: tempfile::TempDir,
    nvml: Option<FakeNvml>,
    /// The running agent and whether it has NVML.
    running: Option<(bool, Child)>,
}

impl<'a> Agents<'a> {
    /// The fake NVML is built and installed when `nvml` (some arm needs it).
    fn new(rig: &'a CudaRig, nvml: bool) -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let nvml = if nvml {
            Some(FakeNvml::install(
                dir.path(),
                rig.gpu.mock_dir.path(),
                Duration::from_millis(1),
            )?)
        } else {
            None
        };
        Ok(Self {
            rig,
            dir,
            nvml,
            running: None,
        })
    }

    /// An agent with NVML or without runs; call with no container on the node.
    fn ensure(&mut self, nvml: bool) -> Result<()> {
        if self.running.as_ref().is_some_and(|(n, _)| *n == nvml) {
            return Ok(());
        }
        self.stop();
        let rig = self.rig;
        let containerd = rig.gpu.env.containerd();
        let socket = containerd.agent_socket();
        if let Some(pid) = containerd.agent_pid() {
            bail!(
                "another agent (pid {pid}) serves {}: the bench runs its own",
                socket.display()
            );
        }
        if let Some(dir) = socket.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let log = self
            .dir
            .path()
            .join(if nvml { "agent-nvml.log" } else { "agent.log" });
        let log_file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)?;
        let mut command = Command::new(baton_program()?);
        command
            .args(["agent", "--metrics-addr", "off", "--socket"])
            .arg(&socket)
            .stdin(Stdio::null())
            .stdout(log_file.try_clone()?)
            .stderr(log_file);
        if nvml {
            let fake = self
                .nvml
                .as_ref()
                .context("the fake NVML was not installed")?;
            command
                .arg("--nvml-library")
                .arg(&fake.library)
                .envs(fake.env());
        }
        let child = command.spawn().context("starting baton agent")?;
        let pid = child.id();
        self.running = Some((nvml, child));
        let answers = wait_until(Duration::from_secs(30), || {
            AgentConn::connect(&socket).is_ok_and(|mut c| c.call(json!({"op": "ping"})).is_ok())
        });
        if !answers || containerd.agent_pid() != i32::try_from(pid).ok() {
            self.stop();
            bail!(
                "baton agent (pid {pid}) did not answer on {}:\n{}",
                socket.display(),
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        Ok(())
    }

    fn stop(&mut self) {
        if let Some((_, mut child)) = self.running.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Agents<'_> {
    fn drop(&mut self) {
        self.stop();
    }
}

/// `baton` beside this binary (the same build), else the workspace's debug one.
fn baton_program() -> Result<PathBuf> {
    let beside = std::env::current_exe()?.with_file_name("baton");
    if beside.is_file() {
        return Ok(beside);
    }
    workspace_binary("baton", "baton")
}

/// One arm at one rate, as measured.
struct Outcome {
    arm: Arm,
    /// The trainer's steps during the arrivals.
    steps: u64,
    latencies: Vec<Duration>,
    /// Each request's mean time per server step (its TPOT).
    tpots: Vec<Duration>,
    failed: usize,
    /// Preemptions asked during the arrivals.
    preemptions: f64,
    /// Mean C (bench clock); `None` when no preemption ended.
    c: Option<Duration>,
    /// Request events the agent refused.
    refused: usize,
    /// How long the server's first Start took (the arms where the agent's gate lets it through).
    start: Option<Duration>,
    /// The trainer's restores over the whole arm (its parks that ended).
    parks: usize,
    /// The controller's confirmed freezes of the trainer during the arrivals, and its time frozen.
    frozen: Option<(u64, Duration)>,
    /// The governor's status at the end of the arrivals.
    governor: Option<Value>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let cfg = Config::new(&args)?;
    let Some(rig) = CudaRig::start("gapfill-bench") else {
        bail!("cannot benchmark: a prerequisite is missing (see above)");
    };
    let mut agents = Agents::new(&rig, cfg.arms.iter().any(|a| a.room()))?;
    print_setup(&cfg);
    let mut n = 0;
    agents.ensure(cfg.arms[0].room())?;
    let solo_before = solo_rate(&rig, &cfg, &mut n)?;
    let mut results = Vec::new();
    for (i, rate) in cfg.rates.iter().enumerate() {
        let load = Load {
            rate_per_s: rate * cfg.k / 60.0,
            duration: cfg.window,
            seed: cfg.seed + i as u64,
        };
        let due = arrivals(&load);
        for arm in &cfg.arms {
            n += 1;
            agents.ensure(arm.room())?;
            let outcome = run_arm(&rig, &cfg, *arm, &due, n)
                .with_context(|| format!("{} at {rate}/min", arm.name()))?;
            results.push((*rate, due.len(), outcome));
        }
    }
    let solo_after = solo_rate(&rig, &cfg, &mut n)?;
    drop(agents);
    let solo = (solo_before + solo_after) / 2.0;
    report(&cfg, solo, &results);
    report_room(&cfg, solo, &results);
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
    if cfg.arms.iter().any(|a| a.room()) {
        println!(
            "room arms: the server declares baton.io/gpu-memory: {SERVER_NEED} on a GPU of the mock's default \
             size (NVML's total from the fake library); the governor arm's target stretch {}, window {} ms \
             (not compressed). The mock GPU has no compute contention: what the controller's freezes buy the \
             server does not show here, only what they cost the trainer.",
            cfg.governor_target, cfg.governor_window_ms
        );
    }
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
/// Baton's arm, a co-runner beside a server that says what it needs in the room arms, none where the bench
/// does the handing over.
fn annotations(arm: Arm, idle: &str) -> (Annotations<'_>, Annotations<'_>) {
    let trainer = vec![
        ("baton.io/role", "co-runner"),
        ("baton.io/preemptible", "park"),
    ];
    let mut server = vec![
        ("baton.io/role", "latency-critical"),
        ("baton.io/wait-gpu-free", "1m"),
    ];
    match arm {
        Arm::Sequential | Arm::Orchestrator => (Vec::new(), Vec::new()),
        Arm::Overlapped => {
            server.push(("baton.io/park-when-idle", idle));
            (trainer, server)
        }
        Arm::Beside | Arm::Governor | Arm::Alone => {
            server.push(("baton.io/gpu-memory", SERVER_NEED));
            (trainer, server)
        }
    }
}

/// Runs `arm` on fresh containers `trainer-N` and `server-N` with requests due at `due` (from the start).
fn run_arm(rig: &CudaRig, cfg: &Config, arm: Arm, due: &[Duration], n: u64) -> Result<Outcome> {
    let trainer_id = format!("trainer-{n}");
    let server_id = format!("server-{n}");
    let idle = format!("{}ms", cfg.idle.as_millis());
    let (trainer_notes, server_notes) = annotations(arm, &idle);
    let trainer = if arm.has_trainer() {
        let t = rig.create_with(&trainer_id, &cfg.trainer(), &trainer_notes, cfg.options());
        rig.gpu.env.api()?.start(&trainer_id, "")?;
        rig.wait_gpu(&trainer_id, "held", WITHIN)?;
        Some(t)
    } else {
        None
    };
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
        refused: AtomicUsize::new(0),
    };
    let outcome = trial.settle(cfg).and_then(|start| {
        let m = trial.drive(cfg, due)?;
        let (steps, parks) = match &trainer {
            Some(t) => {
                let out = output_of(t)?;
                let parks = std::fs::read_to_string(out)?
                    .lines()
                    .filter(|l| l.starts_with("restored checksum"))
                    .count();
                (steps_between(out, m.t0, m.t1)?, parks)
            }
            None => (0, 0),
        };
        for e in m.served.iter().filter_map(|l| l.as_ref().err()) {
            eprintln!("{}: a request failed: {e:#}", arm.name());
        }
        let served: Vec<&Served> = m.served.iter().filter_map(|l| l.as_ref().ok()).collect();
        Ok(Outcome {
            arm,
            steps,
            failed: m.served.len() - served.len(),
            latencies: served.iter().map(|s| s.latency).collect(),
            tpots: served.iter().filter_map(|s| s.tpot).collect(),
            preemptions: m.preemptions,
            c: m.c,
            refused: trial.refused.load(Ordering::Relaxed),
            start,
            parks,
            frozen: m.frozen,
            governor: m.governor,
        })
    });
    if arm == Arm::Governor
        && let Err(e) =
            trial.agent_call(json!({"op": "governor", "target_stretch": 1.0, "off": true}))
    {
        eprintln!("turning the governor off: {e:#}");
    }
    rig.remove(&trial.server)?;
    if arm.has_trainer() {
        rig.remove(&trial.trainer)?;
    }
    outcome
}
