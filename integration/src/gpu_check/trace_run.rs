//! The trace part of the kit: the agent (the node's one probe loader) watches the traced program's cgroup,
//! `baton trace --json` writes its calls to the golden file, NVML is polled every millisecond beside it; then
//! the ledger's peak against NVML's, and the time from the program's last close to the agent's release signal
//! and to NVML no longer listing the process.
use std::{
    io::{BufRead, BufReader},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::Duration,
};

use anyhow::{Context, Result, bail};
use nix::{sys::signal::Signal, unistd::Pid};
use serde::Serialize;
use serde_json::{Value, json};

use super::{
    count::{self, Counts},
    nvml_poll::{self, Poller},
    report::Part,
    rig::Rig,
    watched::{EventLog, NAMESPACE, Watched},
};
use crate::{
    agent::{AgentConn, AgentProcess, container_status_when, wait_until},
    trace_env::BATON_TRACE_READY,
};

/// How long the agent may take to show the traced program's GPU released once it exited.
const RELEASE_WITHIN: Duration = Duration::from_secs(30);

/// The trace part's findings.
#[derive(Clone, Debug, Serialize)]
pub struct TraceResult {
    /// The golden trace (`baton trace --json`).
    pub golden: PathBuf,
    /// What it holds, and what the decoder could not name.
    pub counts: Option<Counts>,
    /// The ledger's peak GPU memory of the program.
    pub ledger_peak_bytes: Option<u64>,
    /// NVML's peak for the process (`None` without NVML).
    pub nvml_peak_bytes: Option<u64>,
    /// Why NVML figures are missing, when they are.
    pub nvml_unavailable: Option<String>,
    /// From the last close to the kernel being past the release (the agent's confirmation), ns.
    pub close_to_released_ns: Option<u64>,
    /// From the last close to the `released` event reaching a `watch` subscriber, ns.
    pub close_to_event_ns: Option<u64>,
    /// From the last close to the first 1 ms NVML poll that no longer lists the process, ns.
    pub close_to_nvml_gone_ns: Option<u64>,
    /// The `released` event as the agent sent it (its `nvml` field included).
    pub released: Option<Value>,
}

/// Runs the traced program under the agent and `baton trace`: what it found, also when a step failed.
pub fn run(rig: &Rig) -> Part<TraceResult> {
    if let Err(why) = &rig.cuda_programs {
        return Part::unavailable(why.clone());
    }
    let mut problems = Vec::new();
    let found = trace(rig, &mut problems)
        .map_err(|e| problems.push(format!("{e:#}")))
        .ok();
    Part::ran(found, problems)
}

/// The part's steps: an `Err` is one that ended it; `problems` gets the checks that failed.
fn trace(rig: &Rig, problems: &mut Vec<String>) -> Result<TraceResult> {
    let b = &rig.bounds;
    let socket = rig.work.path().join("agent.sock");
    let _agent = AgentProcess::start_program(&rig.baton, &socket, &rig.out.join("agent.log"))
        .context("starting `baton agent`")?;
    let mut conn = AgentConn::connect(&socket)?;
    let mut events =
        EventLog::start(AgentConn::connect(&socket)?.watch(json!({"namespace": NAMESPACE}))?);
    let poller = start_poller(rig);
    let mut program = Watched::start(rig, &mut conn, "trace", &rig.traced_program())?;
    let golden = golden_path(rig)?;
    let mut trace = start_trace(rig, &socket, &program.cgroup_rel, &golden)?;
    if let Ok(p) = &poller {
        p.follow(program.pid());
    }
    program.go()?;
    match program.finish(b.within(b.program_ready)) {
        Ok(true) => {}
        Ok(false) => problems.push(format!(
            "the traced program failed; {}",
            program.stderr_tail()
        )),
        Err(e) => problems.push(format!("{e:#}")),
    }
    // The release that counts is the one the agent shows once the program has exited (a start-up that
    // opened and closed a device file was released before).
    let status = container_status_when(&socket, "trace", b.within(RELEASE_WITHIN), |s| {
        s["gpu"] == "released"
    });
    let released = match &status {
        Ok(status) => {
            let since_ns = status["since_ns"].as_u64();
            events
                .released(
                    "trace",
                    |e| e["t_released_ns"].as_u64() == since_ns,
                    b.within(RELEASE_WITHIN),
                )
                .map_err(|e| problems.push(format!("{e:#}")))
                .ok()
        }
        Err(last) => {
            problems.push(format!(
                "the agent did not show the traced program's GPU released within {RELEASE_WITHIN:?} of its \
                 exit: {last}"
            ));
            None
        }
    };
    if let Err(e) = trace.stop(b.within(b.exit)) {
        problems.push(format!("{e:#}"));
    }
    let (samples, nvml_unavailable) = match poller {
        Ok(p) => (p.stop(), None),
        Err(why) => (Vec::new(), Some(why)),
    };
    let last_close = released
        .as_ref()
        .and_then(|(_, e)| e["t_last_close_ns"].as_u64());
    let since = |t: u64| last_close.map(|c| t.saturating_sub(c));
    let counts = count::count_file(&golden)
        .map_err(|e| problems.push(format!("{e:#}")))
        .ok();
    let ledger_peak_bytes = status
        .as_ref()
        .unwrap_or_else(|last| last)
        .get("peak_vram_bytes")
        .and_then(Value::as_u64);
    if let (Some(counts), Some(peak)) = (&counts, ledger_peak_bytes) {
        write_expectation(rig, &golden, counts, peak)?;
    }
    Ok(TraceResult {
        counts,
        golden,
        ledger_peak_bytes,
        nvml_peak_bytes: nvml_poll::peak_process_bytes(&samples),
        nvml_unavailable,
        close_to_released_ns: released
            .as_ref()
            .and_then(|(_, e)| e["t_released_ns"].as_u64())
            .and_then(since),
        close_to_event_ns: released.as_ref().and_then(|(t, _)| since(*t)),
        close_to_nvml_gone_ns: nvml_poll::first_gone_ns(&samples).and_then(since),
        released: released.map(|(_, e)| e),
    })
}

/// The 1 ms NVML poller; on the mock there is no NVML to ask, whatever the machine has.
pub fn start_poller(rig: &Rig) -> Result<Poller, String> {
    if rig.mock {
        return Err("unavailable on the mock (no NVIDIA driver behind it)".to_owned());
    }
    Poller::start(rig.bounds.within(rig.bounds.command))
}

/// `OUT/golden/<driver version>/pytorch-1gib.jsonl` (`mock-1gib.jsonl` on the mock).
fn golden_path(rig: &Rig) -> Result<PathBuf> {
    let dir = rig.out.join("golden").join(&rig.driver_version);
    std::fs::create_dir_all(&dir)?;
    let name = if rig.mock {
        "mock-1gib.jsonl"
    } else {
        "pytorch-1gib.jsonl"
    };
    Ok(dir.join(name))
}

/// Beside the golden trace, `NAME.expect.json`: what a replay of it must find (integration/tests/golden_replay.rs).
fn write_expectation(rig: &Rig, golden: &Path, counts: &Counts, peak: u64) -> Result<()> {
    let expect = json!({
        "driver_version": rig.driver_version,
        "mock": rig.mock,
        "ioctls": counts.ioctls,
        "unknowns": counts.unknowns(),
        "ledger_peak_bytes": peak,
    });
    std::fs::write(
        golden.with_extension("expect.json"),
        serde_json::to_string_pretty(&expect)? + "\n",
    )?;
    Ok(())
}

/// A running `baton trace`, killed on drop unless [`Trace::stop`] ended it.
struct Trace(Child);

impl Trace {
    /// Ends `baton trace` as Ctrl-C does and waits (up to `within`) for it to write everything out.
    fn stop(&mut self, within: Duration) -> Result<()> {
        let pid = Pid::from_raw(i32::try_from(self.0.id())?);
        nix::sys::signal::kill(pid, Signal::SIGINT)?;
        if !wait_until(within, || self.0.try_wait().ok().flatten().is_some()) {
            bail!("`baton trace` did not end within {within:?} of SIGINT: killed");
        }
        Ok(())
    }
}

impl Drop for Trace {
    fn drop(&mut self) {
        if self.0.try_wait().ok().flatten().is_none() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// `baton trace --json` of the traced program's cgroup through the agent, once its ready line is out.
fn start_trace(rig: &Rig, socket: &Path, cgroup: &str, golden: &Path) -> Result<Trace> {
    let mut command = Command::new(&rig.baton);
    command.args(["trace", "--json", "--raw", "--cgroup", cgroup]);
    if rig.mock {
        command
            .arg("--prefix")
            .arg(format!("{}/", rig.dev_dir.display()));
    }
    let mut child = command
        .arg("--output")
        .arg(golden)
        .env(baton_agent_api::SOCKET_ENV, socket)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting `baton trace`")?;
    let stderr = child.stderr.take().context("no stderr")?;
    let log = rig.out.join("trace.log");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut kept = Vec::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if line.contains(BATON_TRACE_READY) {
                let _ = tx.send(());
            }
            kept.push(line);
            let _ = std::fs::write(&log, kept.join("\n"));
        }
    });
    let trace = Trace(child);
    let within = rig.bounds.within(Duration::from_secs(60));
    if rx.recv_timeout(within).is_err() {
        bail!(
            "`baton trace` did not say it was tracing within {within:?}: see {}",
            rig.out.join("trace.log").display()
        );
    }
    Ok(trace)
}
