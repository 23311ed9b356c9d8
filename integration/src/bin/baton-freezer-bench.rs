//! `baton-freezer-bench`: freeze-confirmed and thaw latency, p50 and p99, in cgroup v1 (this hybrid host's v1
//! freezer) and cgroup v2 (the cgroup2 hierarchy; containers in a private mount namespace with cgroup2 over
//! /sys/fs/cgroup), for `baton-freezer-workload` processes whose threads sleep (1, 64) or spin (1, 16, 64).
//! Side by side on the same processes:
//! - floor: a minimal loop on the same cgroup, control files open: write, then re-read (no yield, no sleep)
//!   until the kernel confirms;
//! - baton: `baton_cgroups::freezer::Freezer`'s async API on a current-thread tokio runtime (what the shim runs);
//! - sigstop: SIGSTOP / SIGCONT of the process, confirmed when every thread shows `T` (or no longer does) in
//!   /proc/PID/task/*/stat;
//! - runc: `runc pause` / `runc resume` of a container running the same workload (through `nsenter` into
//!   containerd's mount namespace in v2), and ctr: `ctr task pause` / `resume` of it (containerd, then Baton's
//!   shim). These take tens of milliseconds a call: they run fewer cycles (the second argument).
//! - cli: the whole `baton freeze ID` and `baton thaw ID` commands (process spawn, the agent, the shim's
//!   control socket, the kernel's confirmation) of the same container, with a release `baton agent` started
//!   for the run (Baton's shim only). Its cycles alternate with runc's, so that both see the same load, and
//!   each workload ends with one line: the pair's p50 (`baton freeze` + `baton thaw`) over the pair's p50
//!   of `runc pause` + `runc resume` (the goal: at most 0.1), and the same for two runs of `true` in the
//!   same cycles: the floor of any pair of commands on this machine.
//!
//! Each cycle freezes, thaws, then lets the threads run 1 ms: cycles this frequent are what the kernel's 10 ms
//! rate limit on cgroup.events notifications holds back, so the re-reads are exercised. Figures only.
//!
//! Run as root: `cargo build --release --workspace --bins && \
//!   BATON_SHIM_BIN=$PWD/target/release/containerd-shim-baton-v1 target/release/baton-freezer-bench [CYCLES [CONTAINER_CYCLES [v1|v2 [WORKLOAD]]]]`
//! (defaults 1000, 50, both versions and every workload, WORKLOAD one of sleepx1, sleepx64, spinx1, spinx16,
//! spinx64; `tools/dev bench` runs it).
use std::{
    fs::{File, OpenOptions},
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use baton_cgroups::freezer::{CgroupVersion, Freezer};
use baton_integration::{
    TestEnv, agent::AgentProcess, cleanup, containerd::CgroupMode, rootfs, trace_env,
};
use nix::{sys::signal, unistd::Pid};

const TIMEOUT: Duration = Duration::from_secs(10);
const GAP: Duration = Duration::from_millis(1);
const WORKLOADS: [(&str, usize); 5] = [
    ("sleep", 1),
    ("sleep", 64),
    ("spin", 1),
    ("spin", 16),
    ("spin", 64),
];

/// Freeze and thaw latencies of one method on one workload.
struct Sample {
    freeze: Vec<Duration>,
    thaw: Vec<Duration>,
    /// Freezes that failed (runc gives up with "unable to freeze" on many spinning threads).
    failed: usize,
}

impl Sample {
    fn new() -> Self {
        Self {
            freeze: Vec::new(),
            thaw: Vec::new(),
            failed: 0,
        }
    }
}

fn percentile(v: &[Duration], p: f64) -> Duration {
    let mut v = v.to_vec();
    v.sort();
    v.get(((v.len() as f64 - 1.0) * p).round() as usize)
        .copied()
        .unwrap_or_default()
}

/// The p50 of a freeze and its thaw summed per cycle (the whole pause + resume a user waits for).
fn pair_p50(s: &Sample) -> Duration {
    let pairs: Vec<Duration> = s.freeze.iter().zip(&s.thaw).map(|(f, t)| *f + *t).collect();
    percentile(&pairs, 0.5)
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

fn workload_binary() -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let bin = exe.with_file_name("baton-freezer-workload");
    if !bin.exists() {
        bail!(
            "{} is missing: cargo build --release -p baton-integration --bins",
            bin.display()
        );
    }
    Ok(bin)
}

fn workload_args(mode: &str, threads: usize) -> Vec<String> {
    vec![
        "--mode".into(),
        mode.into(),
        "--threads".into(),
        threads.to_string(),
    ]
}

/// The workload in a fresh cgroup of its own.
struct Bare {
    dir: PathBuf,
    child: Child,
}

impl Bare {
    fn start(version: CgroupVersion, mode: &str, threads: usize) -> Result<Self> {
        let root = match version {
            CgroupVersion::V1 => PathBuf::from("/sys/fs/cgroup/freezer"),
            CgroupVersion::V2 => baton_cgroups::find_v2_root()?,
        };
        let dir = baton_cgroups::create(
            &root,
            &format!("baton-freezer-bench-{}-{mode}{threads}", std::process::id()),
        )?;
        let child =
            baton_cgroups::command_in(&dir, &workload_binary()?, &workload_args(mode, threads))
                .stdin(Stdio::null())
                .spawn()
                .context("spawn the workload")?;
        let bare = Self { dir, child };
        let deadline = Instant::now() + TIMEOUT;
        while threads_of(bare.child.id()).len() < threads {
            if Instant::now() > deadline {
                bail!("the workload did not start its {threads} threads");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(bare)
    }
}

impl Drop for Bare {
    fn drop(&mut self) {
        let _ = std::fs::write(self.dir.join("freezer.state"), "THAWED");
        let _ = std::fs::write(self.dir.join("cgroup.freeze"), "0");
        let _ = self.child.kill();
        let _ = self.child.wait();
        let deadline = Instant::now() + TIMEOUT;
        while baton_cgroups::remove(&self.dir).is_err() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

fn threads_of(pid: u32) -> Vec<PathBuf> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default()
}

/// The floor: the control files open, write, re-read until confirmed.
fn floor(dir: &Path, version: CgroupVersion, cycles: usize) -> Result<Sample> {
    let open = |name: &str, write: bool| -> Result<File> {
        OpenOptions::new()
            .read(true)
            .write(write)
            .open(dir.join(name))
            .with_context(|| format!("open {}", dir.join(name).display()))
    };
    let (ctl, events, frozen, thawed): (File, File, &[u8], &[u8]) = match version {
        CgroupVersion::V1 => (
            open("freezer.state", true)?,
            open("freezer.state", false)?,
            b"FROZEN",
            b"THAWED",
        ),
        CgroupVersion::V2 => (
            open("cgroup.freeze", true)?,
            open("cgroup.events", false)?,
            b"frozen 1",
            b"frozen 0",
        ),
    };
    let (ask_freeze, ask_thaw): (&[u8], &[u8]) = match version {
        CgroupVersion::V1 => (b"FROZEN", b"THAWED"),
        CgroupVersion::V2 => (b"1", b"0"),
    };
    let mut buf = [0u8; 256];
    let mut until = |want: &[u8]| -> Result<()> {
        loop {
            let n = events.read_at(&mut buf, 0)?;
            if buf[..n].windows(want.len()).any(|w| w == want) {
                return Ok(());
            }
        }
    };
    let mut s = Sample::new();
    for _ in 0..cycles {
        let t = Instant::now();
        ctl.write_at(ask_freeze, 0)?;
        until(frozen)?;
        s.freeze.push(t.elapsed());
        let t = Instant::now();
        ctl.write_at(ask_thaw, 0)?;
        until(thawed)?;
        s.thaw.push(t.elapsed());
        std::thread::sleep(GAP);
    }
    Ok(s)
}

/// Baton's freezer, async API, current-thread runtime.
fn baton(dir: &Path, version: CgroupVersion, cycles: usize) -> Result<Sample> {
    let freezer = Freezer::open(dir, version)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let mut s = Sample::new();
        for _ in 0..cycles {
            s.freeze.push(freezer.freeze(TIMEOUT).await?);
            s.thaw.push(freezer.thaw(TIMEOUT).await?);
            tokio::time::sleep(GAP).await;
        }
        Ok(s)
    })
}

/// Whether every thread of `pid` is stopped (`T`) or, with `stopped` false, none is.
fn all_threads(pid: u32, stopped: bool) -> bool {
    threads_of(pid).iter().all(|t| {
        let stat = std::fs::read_to_string(t.join("stat")).unwrap_or_default();
        let state = stat.rsplit_once(") ").and_then(|(_, r)| r.chars().next());
        (state == Some('T')) == stopped
    })
}

fn sigstop(pid: u32, cycles: usize) -> Result<Sample> {
    let target = Pid::from_raw(i32::try_from(pid)?);
    let mut s = Sample::new();
    for _ in 0..cycles {
        let t = Instant::now();
        signal::kill(target, signal::Signal::SIGSTOP)?;
        while !all_threads(pid, true) {}
        s.freeze.push(t.elapsed());
        let t = Instant::now();
        signal::kill(target, signal::Signal::SIGCONT)?;
        while !all_threads(pid, false) {}
        s.thaw.push(t.elapsed());
        std::thread::sleep(GAP);
    }
    Ok(s)
}

fn timed(mut cmd: Command) -> Result<Duration> {
    let t = Instant::now();
    let out = cmd.output().context("run")?;
    if !out.status.success() {
        bail!("{cmd:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(t.elapsed())
}

/// A rootfs with busybox and the workload binary (and the libraries it links).
fn workload_rootfs(dir: &Path) -> Result<PathBuf> {
    rootfs::make_busybox_rootfs(dir)?;
    let bin = workload_binary()?;
    std::fs::copy(&bin, dir.join("baton-freezer-workload"))?;
    let ldd = Command::new("ldd").arg(&bin).output()?;
    for lib in String::from_utf8_lossy(&ldd.stdout)
        .split_whitespace()
        .filter(|w| w.starts_with('/'))
    {
        let to = dir.join(lib.trim_start_matches('/'));
        std::fs::create_dir_all(to.parent().unwrap_or(dir))?;
        std::fs::copy(lib, &to).with_context(|| format!("copy {lib}"))?;
    }
    Ok(dir.to_path_buf())
}

/// One workload's container figures: (mode, threads), runc pause/resume, ctr task pause/resume, and the
/// `baton freeze`/`thaw` commands with the spawn floor beside them (`None`: not run, with Baton's shim
/// absent or no agent).
type ContainerRow = (
    (&'static str, usize),
    Sample,
    Sample,
    Option<(Sample, Sample)>,
);

/// A release `baton agent` for the `baton freeze`/`thaw` rows, and the `baton` binary that talks to it.
struct Cli {
    baton: PathBuf,
    agent: AgentProcess,
}

impl Cli {
    /// Starts the agent on the socket the shims of `env` register with; `None` (after saying why) when
    /// the runtime is not Baton's or the agent cannot start.
    fn start(env: &TestEnv) -> Option<Self> {
        if !env.is_baton() {
            println!("cli rows not run: the runtime under test is not Baton's");
            return None;
        }
        let started = (|| -> Result<Self> {
            let [baton] = trace_env::sibling_binaries(["baton"])?;
            let socket = env.containerd().agent_socket();
            std::fs::create_dir_all(socket.parent().context("socket folder")?)?;
            let agent =
                AgentProcess::start_program(&baton, &socket, &env.scratch().join("agent.log"))?;
            Ok(Self { baton, agent })
        })();
        match started {
            Ok(cli) => Some(cli),
            Err(e) => {
                println!("cli rows not run: {e:#}");
                None
            }
        }
    }

    /// `baton freeze ID` or `baton thaw ID`, the whole command.
    fn command(&self, verb: &str, id: &str) -> Command {
        let mut cmd = Command::new(&self.baton);
        cmd.arg(verb)
            .arg("--socket")
            .arg(self.agent.socket())
            .arg(id)
            .stdin(Stdio::null());
        cmd
    }

    /// Waits until the agent knows container `id` (its shim registered it) and `baton freeze` reaches it.
    fn wait_for(&self, id: &str) -> Result<()> {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            match timed(self.command("freeze", id)) {
                Ok(_) => return timed(self.command("thaw", id)).map(drop),
                Err(e) if Instant::now() > deadline => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}

/// runc pause/resume and ctr task pause/resume of a container running each workload.
fn containers(
    mode: CgroupMode,
    cycles: usize,
    workload: Option<&str>,
) -> Result<Vec<ContainerRow>> {
    let name = match mode {
        CgroupMode::Host => "freezer-bench-v1",
        CgroupMode::V2 => "freezer-bench-v2",
    };
    let Some(env) = TestEnv::start_in(name, mode) else {
        bail!("containerd prerequisites are missing");
    };
    let root = workload_rootfs(&env.scratch().join("rootfs"))?;
    let cli = Cli::start(&env);
    let containerd_pid = env.containerd().pid().context("containerd runs")?;
    let runc = |verb: &str, id: &str| {
        let mut cmd = match mode {
            CgroupMode::Host => Command::new("runc"),
            CgroupMode::V2 => {
                let mut c = Command::new("nsenter");
                c.args(["-t", &containerd_pid.to_string(), "-m", "runc"]);
                c
            }
        };
        cmd.arg("--root")
            .arg(cleanup::runc_root(env.namespace()))
            .args([verb, id]);
        cmd
    };
    let mut rows = Vec::new();
    for (i, (wmode, threads)) in WORKLOADS.into_iter().enumerate() {
        if workload.is_some_and(|w| w != format!("{wmode}x{threads}")) {
            continue;
        }
        let id = format!("w{i}");
        let mut args: Vec<String> = [
            "run",
            "--runtime",
            env.runtime(),
            "-d",
            "--null-io",
            "--rootfs",
        ]
        .map(String::from)
        .to_vec();
        if cli.is_some() {
            // A role makes the shim register the container with the agent (it sees no GPU here).
            args.extend(["--annotation".into(), "baton.io/role=co-runner".into()]);
        }
        args.extend(env.cgroup_run_flags().iter().map(|f| f.to_string()));
        args.push(root.display().to_string());
        args.push(id.clone());
        args.push("/baton-freezer-workload".into());
        args.extend(workload_args(wmode, threads));
        env.ctr_ok(&args.iter().map(String::as_str).collect::<Vec<_>>())?;
        let (mut r, mut c) = (Sample::new(), Sample::new());
        let mut b = match &cli {
            Some(cli) => match cli.wait_for(&id) {
                Ok(()) => Some((Sample::new(), Sample::new())),
                Err(e) => {
                    println!("w{i} {wmode}x{threads}: cli rows not run: {e:#}");
                    None
                }
            },
            None => None,
        };
        for _ in 0..cycles {
            // runc, then the baton commands: alternated, so that both see the same load.
            match timed(runc("pause", &id)) {
                Ok(took) => {
                    r.freeze.push(took);
                    r.thaw.push(timed(runc("resume", &id))?);
                }
                Err(e) => {
                    eprintln!("w{i} {wmode}x{threads}: {e:#}");
                    r.failed += 1;
                    // runc thawed it again after giving up; a resume of a running container fails.
                    let _ = timed(runc("resume", &id));
                }
            }
            std::thread::sleep(GAP);
            if let (Some(cli), Some((b, spawn))) = (&cli, &mut b) {
                // The floor of any command pair: two processes that do nothing.
                spawn.freeze.push(timed(Command::new("true"))?);
                spawn.thaw.push(timed(Command::new("true"))?);
                match timed(cli.command("freeze", &id)) {
                    Ok(took) => {
                        b.freeze.push(took);
                        b.thaw.push(timed(cli.command("thaw", &id))?);
                    }
                    Err(e) => {
                        eprintln!("w{i} {wmode}x{threads}: {e:#}");
                        b.failed += 1;
                        let _ = timed(cli.command("thaw", &id));
                    }
                }
                std::thread::sleep(GAP);
            }
        }
        for _ in 0..cycles {
            let t = Instant::now();
            env.ctr_ok(&["task", "pause", &id])?;
            c.freeze.push(t.elapsed());
            let t = Instant::now();
            env.ctr_ok(&["task", "resume", &id])?;
            c.thaw.push(t.elapsed());
            std::thread::sleep(GAP);
        }
        env.ctr_ok(&["task", "kill", "-s", "SIGKILL", &id])?;
        let deadline = Instant::now() + TIMEOUT;
        while env.task_status(&id).as_deref() != Some("STOPPED") && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = env.ctr(&["task", "delete", &id]);
        env.ctr_ok(&["container", "delete", &id])?;
        rows.push(((wmode, threads), r, c, b));
    }
    Ok(rows)
}

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let cycles: usize = args.next().map_or(Ok(1000), |a| a.parse())?;
    let container_cycles: usize = args.next().map_or(Ok(50), |a| a.parse())?;
    let only = args.next();
    if only.as_deref().is_some_and(|v| v != "v1" && v != "v2") {
        bail!("the third argument is v1 or v2 (only that cgroup version); without it, both");
    }
    let workload = args.next();
    if workload
        .as_deref()
        .is_some_and(|w| !WORKLOADS.iter().any(|(m, t)| format!("{m}x{t}") == w))
    {
        bail!("the fourth argument is one workload: sleepx1, sleepx64, spinx1, spinx16 or spinx64");
    }
    println!(
        "baton-freezer-bench: {cycles} cycles per bare-cgroup method, {container_cycles} per container method; {} CPUs",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!(
        "{:<3} {:<9} {:<8} {:>10} {:>10} {:>10} {:>10} {:>9} {:>9}",
        "cg",
        "workload",
        "method",
        "frz p50us",
        "frz p99us",
        "thaw p50",
        "thaw p99",
        "p50/floor",
        "runc/p50"
    );
    for (version, mode) in [
        (CgroupVersion::V1, CgroupMode::Host),
        (CgroupVersion::V2, CgroupMode::V2),
    ] {
        if only.as_deref().is_some_and(|v| v != version.to_string()) {
            continue;
        }
        let ctr_rows = containers(mode, container_cycles, workload.as_deref())?;
        for ((wmode, threads), runc, ctr, cli) in ctr_rows {
            let bare = Bare::start(version, wmode, threads)?;
            let floor = floor(&bare.dir, version, cycles)?;
            let baton = baton(&bare.dir, version, cycles)?;
            let stop = sigstop(bare.child.id(), cycles)?;
            drop(bare);
            let floor_p50 = percentile(&floor.freeze, 0.5);
            let runc_p50 = percentile(&runc.freeze, 0.5);
            let mut methods = vec![
                ("floor", &floor),
                ("baton", &baton),
                ("sigstop", &stop),
                ("runc", &runc),
                ("ctr", &ctr),
            ];
            methods.extend(cli.as_ref().map(|(s, _)| ("cli", s)));
            for (method, s) in methods {
                let p50 = percentile(&s.freeze, 0.5);
                println!(
                    "{:<3} {:<9} {:<8} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>9.2} {:>9.1} {:>6}",
                    version.to_string(),
                    format!("{wmode}x{threads}"),
                    method,
                    us(p50),
                    us(percentile(&s.freeze, 0.99)),
                    us(percentile(&s.thaw, 0.5)),
                    us(percentile(&s.thaw, 0.99)),
                    us(p50) / us(floor_p50),
                    us(runc_p50) / us(p50),
                    s.failed,
                );
            }
            if let Some((cli, spawn)) = &cli {
                let (cli_pair, runc_pair) = (pair_p50(cli), pair_p50(&runc));
                let spawn_pair = pair_p50(spawn);
                println!(
                    "{:<3} {:<9} pair: baton freeze + thaw p50 {:.0} us, runc pause + resume p50 {:.0} us: \
                     ratio {:.3} (goal <= 0.1); spawn floor (true + true) {:.0} us: ratio {:.3}",
                    version.to_string(),
                    format!("{wmode}x{threads}"),
                    us(cli_pair),
                    us(runc_pair),
                    us(cli_pair) / us(runc_pair),
                    us(spawn_pair),
                    us(spawn_pair) / us(runc_pair),
                );
            }
        }
    }
    println!(
        "p50/floor: freeze p50 over the floor's; runc/p50: runc pause's freeze p50 over this method's (how many times faster); \
         cli: the whole `baton freeze` / `baton thaw` commands; pair: a freeze and its thaw, summed per cycle."
    );
    Ok(())
}
