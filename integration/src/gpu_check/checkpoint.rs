//! The checkpoint part of the kit: a process holding `--gib` GiB of GPU memory is parked (lock, checkpoint)
//! and resumed (restore, unlock), once through the `cuda-checkpoint` program (one run per action, as the
//! shim falls back to) and once through the CUDA driver helper (`containerd-shim-baton-v1
//! cuda-driver-helper LIBRARY`, the process the shim uses where the library has the calls). For each: the
//! seconds each way and per GiB, the time from the park request to the agent's release signal and to NVML's
//! device memory dropping, and whether the weights came back intact.
use std::{
    io::{BufRead, BufReader, Write},
    path::{Path, PathBuf},
    process::{Child, ChildStdin, ChildStdout, Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use baton_agent_api::{
    driver_helper::{Answer, Call, HELPER_ARG, Ready},
    now_monotonic_ns,
};
use baton_nvidia::cuda_checkpoint::Action;
use serde::Serialize;
use serde_json::json;

use super::{
    nvml_poll,
    rig::Rig,
    trace_run::start_poller,
    watched::{EventLog, NAMESPACE, Watched},
};
use crate::agent::{AgentConn, AgentProcess};

/// How long holding, parking or resuming may take.
const WITHIN: Duration = Duration::from_secs(300);

/// One way of making the checkpoint calls, measured.
#[derive(Clone, Debug, Serialize)]
pub struct WayResult {
    /// `program` or `driver API`.
    pub way: String,
    /// Why it was not measured, when it was not.
    pub unavailable: Option<String>,
    /// Lock + checkpoint, seconds.
    pub park_s: f64,
    /// Restore + unlock, seconds.
    pub resume_s: f64,
    /// From the park request to the agent's release signal (`t_released_ns`), seconds.
    pub request_to_released_s: f64,
    /// From the park request to NVML's device memory having dropped by 90% of what was held, seconds.
    pub request_to_nvml_free_s: Option<f64>,
    /// The weights' checksum after the resume equals the one before.
    pub intact: bool,
}

/// The checkpoint part's findings.
#[derive(Clone, Debug, Serialize)]
pub struct CheckpointResult {
    /// GiB the process held.
    pub gib: u64,
    /// Why NVML figures are missing, when they are.
    pub nvml_unavailable: Option<String>,
    /// The program, then the driver API.
    pub ways: Vec<WayResult>,
}

/// Parks and resumes a holder through each way there is.
pub fn run(rig: &Rig) -> Result<CheckpointResult> {
    let socket = rig.work.path().join("agent-checkpoint.sock");
    let _agent =
        AgentProcess::start_program(&rig.baton, &socket, &rig.out.join("agent-checkpoint.log"))
            .context("starting `baton agent`")?;
    let mut conn = AgentConn::connect(&socket)?;
    let mut events =
        EventLog::start(AgentConn::connect(&socket)?.watch(json!({"namespace": NAMESPACE}))?);
    let poller = start_poller(rig);
    let mut ways = Vec::new();
    let program = match &rig.cuda_checkpoint {
        Some(p) => Ok(Way::Program(p.clone())),
        None => Err("no cuda-checkpoint program on PATH (pass --cuda-checkpoint)".to_owned()),
    };
    let api = Helper::start(&rig.shim, &rig.libcuda).map(Way::Api);
    let mut session = Session {
        rig,
        conn: &mut conn,
        events: &mut events,
        poller: poller.as_ref().ok(),
    };
    for (name, way) in [("program", program), ("driver API", api)] {
        ways.push(match way {
            Ok(mut way) => session.measure(name, &mut way)?,
            Err(why) => WayResult::unavailable(name, why),
        });
    }
    Ok(CheckpointResult {
        gib: rig.gib,
        nvml_unavailable: poller.err(),
        ways,
    })
}

impl WayResult {
    fn unavailable(way: &str, why: String) -> Self {
        Self {
            way: way.to_owned(),
            unavailable: Some(why),
            park_s: 0.0,
            resume_s: 0.0,
            request_to_released_s: 0.0,
            request_to_nvml_free_s: None,
            intact: false,
        }
    }
}

/// What one measurement needs.
struct Session<'a> {
    rig: &'a Rig,
    conn: &'a mut AgentConn,
    events: &'a mut EventLog,
    poller: Option<&'a nvml_poll::Poller>,
}

impl Session<'_> {
    /// Starts a holder, parks and resumes it through `way`, checks its weights.
    fn measure(&mut self, name: &str, way: &mut Way) -> Result<WayResult> {
        let id = format!("hold-{}", name.replace(' ', "-"));
        let mut holder = Watched::start(self.rig, self.conn, &id, &self.rig.holder_program())?;
        if let Some(p) = self.poller {
            p.follow(holder.pid());
        }
        holder.go()?;
        let before = self.checksum(
            &mut holder,
            if self.rig.mock {
                "phase holding"
            } else {
                "ready"
            },
        )?;
        let pid = holder.pid();
        let requested = now_monotonic_ns();
        let t0 = Instant::now();
        way.call(Action::Lock, pid)?;
        way.call(Action::Checkpoint, pid)?;
        let park_s = t0.elapsed().as_secs_f64();
        // The release the park caused (the holder's start-up may have had one of its own before).
        let (_, released) = self.events.released(
            &id,
            |e| e["t_released_ns"].as_u64() >= Some(requested),
            WITHIN,
        )?;
        let t1 = Instant::now();
        way.call(Action::Restore, pid)?;
        way.call(Action::Unlock, pid)?;
        let resume_s = t1.elapsed().as_secs_f64();
        // The mock checks its own weights at the restore (a mismatch fails it); PyTorch's are summed again.
        let intact = self.rig.mock || {
            holder.send_line("check")?;
            self.checksum(&mut holder, "checksum")? == before
        };
        holder.finish(WITHIN)?;
        Ok(WayResult {
            way: name.to_owned(),
            unavailable: None,
            park_s,
            resume_s,
            request_to_released_s: seconds(
                released["t_released_ns"]
                    .as_u64()
                    .unwrap_or(0)
                    .saturating_sub(requested),
            ),
            request_to_nvml_free_s: self.nvml_free_after(requested),
            intact,
        })
    }

    /// The value after `prefix` on the holder's next such line (the mock prints no checksum: `None`).
    fn checksum(&self, holder: &mut Watched, prefix: &str) -> Result<Option<String>> {
        let line = holder.line_starting(prefix, WITHIN)?;
        Ok(line.split_whitespace().nth(1).map(str::to_owned))
    }

    /// From `requested` to NVML's device memory having dropped by 90% of what the holder held.
    fn nvml_free_after(&self, requested: u64) -> Option<f64> {
        let samples = self.poller?.snapshot();
        let baseline = nvml_poll::device_bytes_before(&samples, requested)?;
        let held = self.rig.gib << 30;
        let below = baseline.saturating_sub(held / 10 * 9);
        nvml_poll::first_device_below_ns(&samples, requested, below)
            .map(|t| seconds(t.saturating_sub(requested)))
    }
}

fn seconds(ns: u64) -> f64 {
    ns as f64 / 1e9
}

/// The checkpoint calls through the program or the helper.
enum Way {
    Program(PathBuf),
    Api(Helper),
}

impl Way {
    fn call(&mut self, action: Action, pid: u32) -> Result<()> {
        let name = action.name();
        match self {
            Way::Program(program) => {
                let out = Command::new(&*program)
                    .args(["--action", name, "--pid", &pid.to_string()])
                    .output()
                    .with_context(|| format!("running {}", program.display()))?;
                if !out.status.success() {
                    bail!(
                        "`{} --action {name} --pid {pid}` failed: {}",
                        program.display(),
                        String::from_utf8_lossy(&out.stderr).trim()
                    );
                }
                Ok(())
            }
            Way::Api(helper) => helper.call(name, pid),
        }
    }
}

/// The CUDA driver helper, spoken to as the shim speaks to it.
struct Helper {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    next_id: u64,
}

impl Helper {
    /// Starts the helper; `Err` says why the library cannot be used.
    fn start(shim: &Path, library: &Path) -> Result<Self, String> {
        let mut child = Command::new(shim)
            .arg(HELPER_ARG)
            .arg(library)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("cannot start the CUDA driver helper: {e}"))?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err("the helper has no pipes".to_owned());
        };
        let mut helper = Self {
            child,
            stdin,
            stdout: BufReader::new(stdout),
            next_id: 0,
        };
        let ready: Ready = helper
            .read_line()
            .map_err(|e| format!("the helper did not say it was ready: {e:#}"))?;
        match ready.unavailable {
            None => Ok(helper),
            Some(why) => Err(why),
        }
    }

    fn call(&mut self, action: &str, pid: u32) -> Result<()> {
        self.next_id += 1;
        let call = Call {
            id: self.next_id,
            action: action.to_owned(),
            pid,
            lock_timeout_ms: 0,
        };
        writeln!(self.stdin, "{}", serde_json::to_string(&call)?)?;
        let answer: Answer = self.read_line()?;
        match answer.error {
            None => Ok(()),
            Some(e) => bail!("{action} of pid {pid} through the driver API: {e}"),
        }
    }

    fn read_line<T: serde::de::DeserializeOwned>(&mut self) -> Result<T> {
        let mut line = String::new();
        if self.stdout.read_line(&mut line)? == 0 {
            bail!("the CUDA driver helper ended");
        }
        Ok(serde_json::from_str(&line)?)
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
