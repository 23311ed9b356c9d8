//! `baton-agent-bench`: what the node agent costs. A foreground `baton agent` (the release build beside this
//! binary) watches 0, 10 and 100 "containers": cgroups of their own, each with a scripted holder that keeps
//! the FUSE mock's nvidiactl open, registered over the socket as a shim registers a container. For each count
//! it prints the agent's RSS, its CPU and context switches over an idle window, then its CPU while one holder
//! floods ioctls, and the ioctl records per second it keeps up with. Figures only; nothing is asserted.
//!
//! Run as root: `cargo build --release --workspace --bins && target/release/baton-agent-bench`
//! (`tools/dev bench` runs it).
use std::{
    io::{BufRead, BufReader, Write},
    path::Path,
    process::{Child, ChildStdin, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use baton_integration::{
    agent::{AgentConn, AgentProcess},
    procs::{context_switches, rss_bytes},
    trace_env::{missing_trace_prerequisite, sibling_binaries},
};
use baton_mock_nvidia::driver::{MockDriver, MountOptions};
use baton_tracer::cgroups;
use serde_json::{Value, json};

/// Idle window per count.
const IDLE: Duration = Duration::from_secs(5);
/// ioctls of the flood.
const FLOOD: u64 = 200_000;

fn main() -> Result<()> {
    if let Some(reason) = missing_trace_prerequisite() {
        bail!("cannot benchmark: {reason}");
    }
    let [baton, holder] = sibling_binaries(["baton", "baton-mock-holder"])?;
    let work = tempfile::tempdir()?;
    let mock_dir = work.path().join("dev");
    std::fs::create_dir(&mock_dir)?;
    let _mock = MockDriver::mount(MountOptions::new(&mock_dir))?;
    let socket = work.path().join("agent.sock");
    let mut agent = Agent::start(&baton, &socket, &work.path().join("agent.log"))?;
    let root = cgroups::find_v2_root()?;
    let bench_cg = format!("baton-agent-bench-{}", std::process::id());

    println!(
        "| watched containers | agent RSS | idle CPU | idle wakeups/s | flood CPU | ioctls/s | records lost |"
    );
    println!("|---|---|---|---|---|---|---|");
    let mut holders: Vec<Holder> = Vec::new();
    for count in [0usize, 10, 100] {
        while holders.len() < count {
            let i = holders.len();
            let cg = cgroups::create(&root, &format!("{bench_cg}/c{i}"))?;
            let h = Holder::start(&holder, &mock_dir, &cg)?;
            agent.register(
                &format!("c{i}"),
                &format!("/{bench_cg}/c{i}"),
                h.pid(),
                &mock_dir,
            )?;
            holders.push(h);
        }
        let idle = agent.sample(|| {
            std::thread::sleep(IDLE);
            Ok(())
        })?;
        let rss = agent.rss_kib();
        let (flood, records, lost) = match holders.first_mut() {
            Some(h) => {
                let fd = h.fd;
                let s = agent.sample(|| h.cmd(&format!("flood {fd} {FLOOD}")).map(|_| ()))?;
                let lost = agent.call(json!({"op": "status"}))?["ringbuf_drops"].clone();
                (
                    format!("{:.0}%", s.cpu * 100.0),
                    format!("{:.0}", FLOOD as f64 / s.secs),
                    lost.to_string(),
                )
            }
            None => ("-".to_owned(), "-".to_owned(), "-".to_owned()),
        };
        println!(
            "| {count} | {:.1} MiB | {:.2}% | {:.1} | {flood} | {records} | {lost} |",
            rss as f64 / 1024.0,
            idle.cpu * 100.0,
            idle.switches as f64 / idle.secs,
        );
    }
    let programs = agent.call(json!({"op": "status"}))?["programs_attached"].clone();
    println!("eBPF programs attached by the agent with 100 watched containers: {programs}");
    drop(holders);
    for i in 0..100 {
        let _ = cgroups::remove(&root.join(format!("{bench_cg}/c{i}")));
    }
    let _ = cgroups::remove(&root.join(&bench_cg));
    Ok(())
}

/// What one window cost the agent.
struct Sample {
    secs: f64,
    /// CPU seconds per second.
    cpu: f64,
    switches: u64,
}

struct Agent {
    process: AgentProcess,
    conn: AgentConn,
}

impl Agent {
    fn start(baton: &Path, socket: &Path, log: &Path) -> Result<Self> {
        let process = AgentProcess::start_program(baton, socket, log)?;
        let conn = AgentConn::connect(socket)?;
        Ok(Self { process, conn })
    }

    fn call(&mut self, request: Value) -> Result<Value> {
        self.conn.call(request)
    }

    fn register(&mut self, id: &str, cgroup: &str, pid: u32, dev: &Path) -> Result<()> {
        self.call(json!({
            "op": "register", "id": id, "namespace": "bench", "cgroup": cgroup, "init_pid": pid,
            "devices": [dev.join("nvidiactl")],
            "settings": {"trace_prefix": format!("{}/nvidia", dev.display())},
        }))?;
        Ok(())
    }

    fn pid(&self) -> u32 {
        self.process.pid()
    }

    fn rss_kib(&self) -> u64 {
        rss_bytes(self.pid() as i32).unwrap_or(0) / 1024
    }

    /// The agent's CPU and context switches while `during` runs.
    fn sample(&self, during: impl FnOnce() -> Result<()>) -> Result<Sample> {
        let (cpu0, sw0, t0) = (
            cpu_ticks(self.pid()),
            context_switches(self.pid() as i32),
            Instant::now(),
        );
        during()?;
        let secs = t0.elapsed().as_secs_f64();
        let hz = 100.0; // USER_HZ on Linux
        Ok(Sample {
            secs,
            cpu: (cpu_ticks(self.pid()) - cpu0) as f64 / hz / secs,
            switches: context_switches(self.pid() as i32) - sw0,
        })
    }
}

/// A scripted holder with nvidiactl open, in a cgroup of its own.
struct Holder {
    child: Child,
    stdin: ChildStdin,
    out: BufReader<std::process::ChildStdout>,
    fd: u64,
}

impl Holder {
    fn start(program: &Path, dev: &Path, cgroup: &Path) -> Result<Self> {
        let mut child = cgroups::command_in(
            cgroup,
            program,
            &["--dev-dir".to_owned(), dev.display().to_string()],
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
        let stdin = child.stdin.take().context("stdin")?;
        let out = BufReader::new(child.stdout.take().context("stdout")?);
        let mut h = Self {
            child,
            stdin,
            out,
            fd: 0,
        };
        h.fd = h.cmd("open nvidiactl")?[0].parse()?;
        Ok(h)
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn cmd(&mut self, line: &str) -> Result<Vec<String>> {
        writeln!(self.stdin, "{line}")?;
        let mut reply = String::new();
        self.out.read_line(&mut reply)?;
        let mut words = reply.split_whitespace().map(str::to_owned);
        match words.next().as_deref() {
            Some("ok") => Ok(words.collect()),
            _ => bail!("{line}: {reply}"),
        }
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// utime + stime of the process (all its threads), in clock ticks.
fn cpu_ticks(pid: u32) -> u64 {
    procfs::process::Process::new(pid as i32)
        .and_then(|p| p.stat())
        .map_or(0, |s| s.utime + s.stime)
}
