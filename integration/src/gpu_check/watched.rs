//! A process in a cgroup of its own, registered with the agent as a shim registers a container, held at a
//! gate until [`Watched::go`] so that the agent and `baton trace` follow it from its first driver call.
use std::{
    io::{BufRead, BufReader, Write},
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use baton_agent_api::now_monotonic_ns;
use baton_tracer::cgroups;
use serde_json::{Value, json};

use super::rig::{Program, Rig};
use crate::agent::{AgentConn, AgentWatch, wait_until};

/// The namespace the kit registers its processes in.
pub const NAMESPACE: &str = "gpu-check";

/// A registered process.
pub struct Watched {
    /// Its id with the agent (`gpu-check/ID`).
    pub id: String,
    /// Its cgroup, relative to the v2 root (`/baton-gpu-check-PID-ID`).
    pub cgroup_rel: String,
    cgroup: PathBuf,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
}

impl Watched {
    /// Starts `program` in cgroup `baton-gpu-check-PID-ID` behind its gate and registers it as `id`.
    pub fn start(rig: &Rig, agent: &mut AgentConn, id: &str, program: &Program) -> Result<Self> {
        let root = cgroups::find_v2_root().context("finding the cgroup v2 hierarchy")?;
        let rel = format!("baton-gpu-check-{}-{id}", std::process::id());
        let cgroup = cgroups::create(&root, &rel)?;
        // Started in the cgroup by the cgroup crate's own command, as a shell that waits for one line on
        // stdin (the gate) and then becomes the program: the registered init pid is the program's.
        let mut gated = vec![
            "-c".to_owned(),
            r#"read _ && exec "$@""#.to_owned(),
            "sh".to_owned(),
            program.path.display().to_string(),
        ];
        gated.extend(program.args.iter().cloned());
        let mut child = cgroups::command_in(&cgroup, Path::new("/bin/sh"), &gated)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(rig.out.join(format!("{id}.stderr")))?)
            .spawn()
            .with_context(|| format!("starting {}", program.path.display()))?;
        let stdin = child.stdin.take();
        let lines = read_lines(child.stdout.take().context("no stdout")?);
        let mut watched = Self {
            id: id.to_owned(),
            cgroup_rel: format!("/{rel}"),
            cgroup,
            child,
            stdin,
            lines,
        };
        watched.wait_in_cgroup()?;
        agent.call(json!({
            "op": "register", "id": id, "namespace": NAMESPACE, "cgroup": watched.cgroup_rel,
            "init_pid": watched.pid(), "devices": [rig.control_device()],
            "settings": {"trace_prefix": rig.trace_prefix()},
        }))?;
        Ok(watched)
    }

    /// The program's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Opens the gate: the program starts.
    pub fn go(&mut self) -> Result<()> {
        self.send_line("go")
    }

    /// Writes `line` to the program's stdin.
    pub fn send_line(&mut self, line: &str) -> Result<()> {
        let stdin = self.stdin.as_mut().context("stdin already closed")?;
        writeln!(stdin, "{line}")?;
        stdin.flush()?;
        Ok(())
    }

    /// The next stdout line that starts with `prefix` (others are skipped); an error after `within` or
    /// when the program ends first.
    pub fn line_starting(&mut self, prefix: &str, within: Duration) -> Result<String> {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.starts_with(prefix) => return Ok(line),
                Ok(_) => {}
                Err(e) => bail!(
                    "{} printed no `{prefix}` line within {within:?} ({e}); see {}.stderr",
                    self.id,
                    self.id
                ),
            }
        }
    }

    /// Closes stdin and waits for the program to exit (killed after `within`); whether it exited with 0.
    pub fn finish(&mut self, within: Duration) -> Result<bool> {
        self.stdin = None;
        let mut status = None;
        if !wait_until(within, || {
            status = self.child.try_wait().ok().flatten();
            status.is_some()
        }) {
            let _ = self.child.kill();
            let _ = self.child.wait();
            bail!("{} did not exit within {within:?}: killed", self.id);
        }
        Ok(status.is_some_and(|s| s.success()))
    }

    fn wait_in_cgroup(&mut self) -> Result<()> {
        let procs = self.cgroup.join("cgroup.procs");
        let pid = self.pid().to_string();
        let moved = wait_until(Duration::from_secs(10), || {
            std::fs::read_to_string(&procs).is_ok_and(|t| t.lines().any(|l| l == pid))
                || self.child.try_wait().ok().flatten().is_some()
        });
        if !moved || self.child.try_wait()?.is_some() {
            bail!("{} did not move into {}", self.id, self.cgroup.display());
        }
        Ok(())
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        self.stdin = None;
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = cgroups::remove(&self.cgroup);
    }
}

/// The agent's events, each stamped (CLOCK_MONOTONIC ns) when it reached this process, read by a thread of
/// their own so that the stamp is the arrival, not the moment the kit looked.
pub struct EventLog {
    rx: mpsc::Receiver<(u64, Value)>,
    seen: Vec<(u64, Value)>,
}

impl EventLog {
    /// Reads `watch` until the agent closes it.
    pub fn start(mut watch: AgentWatch) -> Self {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            while let Ok(event) = watch.next_matching(Duration::from_secs(3600), |_| true) {
                if tx.send((now_monotonic_ns(), event)).is_err() {
                    break;
                }
            }
        });
        Self {
            rx,
            seen: Vec::new(),
        }
    }

    /// The first `released` event of `id` for which `pred` holds, with its arrival; an error after `within`.
    /// A program that opens and closes a device file during its start-up is released then too: `pred`
    /// picks the release that is meant.
    pub fn released(
        &mut self,
        id: &str,
        pred: impl Fn(&Value) -> bool,
        within: Duration,
    ) -> Result<(u64, Value)> {
        let deadline = Instant::now() + within;
        loop {
            if let Some(found) = self
                .seen
                .iter()
                .find(|(_, e)| e["id"] == id && e["kind"] == "released" && pred(e))
            {
                return Ok(found.clone());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(event) => self.seen.push(event),
                Err(e) => bail!("no such `released` event of {id} within {within:?} ({e})"),
            }
        }
    }
}

fn read_lines(out: impl std::io::Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}
