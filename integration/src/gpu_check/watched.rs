//! A process in a cgroup of its own, registered with the agent as a shim registers a container, held at a
//! gate until [`Watched::go`] so that the agent and `baton trace` follow it from its first driver call. Its
//! stdout lines are stamped (CLOCK_MONOTONIC) when they arrive; the first, [`STARTED`], is printed by the
//! gate itself right before it becomes the program: the moment a shim's Start would have started it. On
//! drop, everything in its cgroup (a forked worker too) is killed and the cgroup removed.
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

/// The line the gate prints as it lets the program start.
pub const STARTED: &str = "baton-gpu-check: started";

/// A stdout line and when it arrived (CLOCK_MONOTONIC ns).
pub type Line = (u64, String);

/// A registered process.
pub struct Watched {
    /// Its id with the agent (`gpu-check/ID`).
    pub id: String,
    /// Its cgroup, relative to the v2 root (`/baton-gpu-check-PID-ID`).
    pub cgroup_rel: String,
    cgroup: PathBuf,
    stderr: PathBuf,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<Line>,
}

impl Watched {
    /// Starts `program` in cgroup `baton-gpu-check-PID-ID` behind its gate and registers it as `id`.
    pub fn start(rig: &Rig, agent: &mut AgentConn, id: &str, program: &Program) -> Result<Self> {
        let root = cgroups::find_v2_root().context("finding the cgroup v2 hierarchy")?;
        let rel = format!("baton-gpu-check-{}-{id}", std::process::id());
        let cgroup = cgroups::create(&root, &rel)?;
        // Started in the cgroup by the cgroup crate's own command, as a shell that waits for one line on
        // stdin (the gate), says so and then becomes the program: the registered init pid is the program's.
        let mut gated = vec![
            "-c".to_owned(),
            format!(r#"read _ && echo '{STARTED}' && exec "$@""#),
            "sh".to_owned(),
            program.path.display().to_string(),
        ];
        gated.extend(program.args.iter().cloned());
        let stderr = rig.out.join(format!("{id}.stderr"));
        let mut child = cgroups::command_in(&cgroup, Path::new("/bin/sh"), &gated)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr)?)
            .spawn()
            .with_context(|| format!("starting {}", program.path.display()))?;
        let stdin = child.stdin.take();
        let lines = read_lines(child.stdout.take().context("no stdout")?);
        let mut watched = Self {
            id: id.to_owned(),
            cgroup_rel: format!("/{rel}"),
            cgroup,
            stderr,
            child,
            stdin,
            lines,
        };
        watched.wait_in_cgroup()?;
        agent.call(json!({
            "op": "register", "id": id, "namespace": NAMESPACE, "cgroup": watched.cgroup_rel,
            "init_pid": watched.pid(), "devices": rig.device_files(),
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

    /// The next stdout line that starts with `prefix` (others are skipped), with its arrival; an error
    /// after `within` or when the program ends first.
    pub fn line_starting(&mut self, prefix: &str, within: Duration) -> Result<Line> {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line.1.starts_with(prefix) => return Ok(line),
                Ok(_) => {}
                Err(e) => bail!(
                    "{} printed no `{prefix}` line within {within:?} ({e}); {}",
                    self.id,
                    self.stderr_tail()
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

    /// The end of what it printed on stderr, and where the rest is.
    pub fn stderr_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.stderr).unwrap_or_default();
        format!(
            "its stderr ends: {} (all of it in {})",
            super::bounded::last_lines(&text, 3),
            self.stderr.display()
        )
    }

    /// The other processes in its cgroup (a worker it forked), by pid.
    pub fn other_pids(&self) -> Vec<u32> {
        let me = self.pid();
        std::fs::read_to_string(self.cgroup.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .filter(|p| *p != me)
            .collect()
    }

    /// Tells the agent to forget it (its namespace and id can be used again).
    pub fn unregister(&self, agent: &mut AgentConn) -> Result<()> {
        agent.call(json!({"op": "unregister", "id": self.id, "namespace": NAMESPACE}))?;
        Ok(())
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
        // A forked worker may outlive it: the cgroup's own kill ends every process in it (Linux 5.14).
        let _ = std::fs::write(self.cgroup.join("cgroup.kill"), "1");
        let procs = self.cgroup.join("cgroup.procs");
        wait_until(Duration::from_secs(5), || {
            std::fs::read_to_string(&procs).map_or(true, |t| t.trim().is_empty())
        });
        let _ = cgroups::remove(&self.cgroup);
    }
}

/// The open fds of process `pid` on files whose path starts with `prefix` (`/dev/nvidia`).
pub fn fds_on(pid: u32, prefix: &str) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|dir| {
            dir.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                .filter(|t| t.to_string_lossy().starts_with(prefix))
                .count()
        })
        .unwrap_or(0)
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
        self.first(id, "released", pred, Instant::now() + within)
            .with_context(|| format!("no such `released` event of {id} within {within:?}"))
    }

    /// The first event of `id` of kind `kind` for which `pred` holds, with its arrival; an error at
    /// `deadline`.
    pub fn first(
        &mut self,
        id: &str,
        kind: &str,
        pred: impl Fn(&Value) -> bool,
        deadline: Instant,
    ) -> Result<(u64, Value)> {
        loop {
            if let Some(found) = self
                .seen
                .iter()
                .find(|(_, e)| e["id"] == id && e["kind"] == kind && pred(e))
            {
                return Ok(found.clone());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.rx.recv_timeout(left) {
                Ok(event) => self.seen.push(event),
                Err(e) => bail!("no `{kind}` event of {id} ({e})"),
            }
        }
    }

    /// The kinds of the events of `id` seen so far whose `t_ns` is at or after `since_ns`, in order.
    pub fn kinds_since(&mut self, id: &str, since_ns: u64) -> Vec<String> {
        while let Ok(event) = self.rx.try_recv() {
            self.seen.push(event);
        }
        self.seen
            .iter()
            .filter(|(_, e)| e["id"] == id && e["t_ns"].as_u64() >= Some(since_ns))
            .filter_map(|(_, e)| e["kind"].as_str().map(str::to_owned))
            .collect()
    }
}

fn read_lines(out: impl std::io::Read + Send + 'static) -> mpsc::Receiver<Line> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send((now_monotonic_ns(), line)).is_err() {
                break;
            }
        }
    });
    rx
}
