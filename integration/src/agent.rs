//! What the agent tests drive: a `baton agent` run in the foreground, a plain blocking client of its socket
//! (newline-delimited JSON, as any third-party client would speak it), `ctr events` read line by line, and
//! the set-up of GPU containers (the mock driver's device files bind-mounted in, the mock CUDA workload
//! copied into the rootfs).
use std::{
    io::{BufRead, BufReader, Write},
    os::unix::net::UnixStream,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use serde_json::{Value, json};

use crate::{containerd::Containerd, trace_env::workspace_binary};

/// A `baton agent` started by the test (in the foreground, as a DaemonSet runs it); killed on drop.
pub struct AgentProcess {
    child: Child,
    socket: PathBuf,
    log: PathBuf,
    /// The log, open for reading: its lines can still be shown after the test's folder is gone.
    log_reader: Option<std::fs::File>,
}

impl AgentProcess {
    /// Starts `baton agent --socket SOCKET`, logging to `log`, and waits until it answers `ping`.
    pub fn start(socket: &Path, log: &Path) -> anyhow::Result<Self> {
        Self::start_program(&workspace_binary("baton", "baton")?, socket, log)
    }

    /// [`AgentProcess::start`] with more flags of `baton agent` (the controller's bounds).
    pub fn start_with(socket: &Path, log: &Path, flags: &[&str]) -> anyhow::Result<Self> {
        Self::start_program_with(&workspace_binary("baton", "baton")?, socket, log, flags)
    }

    /// [`AgentProcess::start`] with the `baton` binary at `baton` (a release build, for benchmarks).
    pub fn start_program(baton: &Path, socket: &Path, log: &Path) -> anyhow::Result<Self> {
        Self::start_program_with(baton, socket, log, &[])
    }

    /// [`AgentProcess::start_program`] with more flags.
    pub fn start_program_with(
        baton: &Path,
        socket: &Path,
        log: &Path,
        flags: &[&str],
    ) -> anyhow::Result<Self> {
        Self::start_program_with_env(baton, socket, log, flags, &[])
    }

    /// [`AgentProcess::start_program_with`] with more variables in the agent's environment.
    pub fn start_program_with_env(
        baton: &Path,
        socket: &Path,
        log: &Path,
        flags: &[&str],
        env: &[(&str, std::ffi::OsString)],
    ) -> anyhow::Result<Self> {
        if let Some(folder) = log.parent() {
            std::fs::create_dir_all(folder)?;
        }
        let log_file = std::fs::File::create(log)?;
        let log_reader = std::fs::File::open(log).ok();
        let child = Command::new(baton)
            .args(["agent", "--socket"])
            .arg(socket)
            .args(flags)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log_file.try_clone()?)
            .stderr(log_file)
            .spawn()?;
        let agent = Self {
            child,
            socket: socket.to_owned(),
            log: log.to_owned(),
            log_reader,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(mut c) = AgentConn::connect(socket)
                && c.call(json!({"op": "ping"})).is_ok()
            {
                return Ok(agent);
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "baton agent did not answer on {} within 20 s:\n{}",
                socket.display(),
                std::fs::read_to_string(log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// The agent's pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // A failed test shows the agent's side (what gap-fill, the gate and the room decided), unless the log
        // is the one next to a test containerd's agent socket, which the test's `TestEnv` shows.
        if std::thread::panicking()
            && self.log != self.socket.with_file_name("agent.log")
            && let Some(mut reader) = self.log_reader.take()
        {
            let mut text = String::new();
            let _ = std::io::Read::read_to_string(&mut reader, &mut text);
            let lines: Vec<&str> = text.lines().collect();
            eprintln!(
                "agent log ({}) ends with:\n{}",
                self.log.display(),
                lines[lines.len().saturating_sub(60)..].join("\n")
            );
        }
    }
}

/// The lines `source` yields, read by a thread of their own until it ends (so that callers can wait with a
/// deadline).
pub(crate) fn read_lines(source: impl std::io::Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(source).lines() {
            let Ok(line) = line else { return };
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    lines
}

/// One connection to an agent.
pub struct AgentConn {
    write: UnixStream,
    lines: mpsc::Receiver<String>,
}

impl AgentConn {
    /// Connects to `socket`.
    pub fn connect(socket: &Path) -> std::io::Result<Self> {
        let write = UnixStream::connect(socket)?;
        let lines = read_lines(write.try_clone()?);
        Ok(Self { write, lines })
    }

    /// Sends `request` (the version is added) and returns the reply line; an error when `ok` is false.
    pub fn call(&mut self, mut request: Value) -> anyhow::Result<Value> {
        request["v"] = json!(1);
        writeln!(self.write, "{request}")?;
        let line = self
            .lines
            .recv_timeout(Duration::from_secs(20))
            .map_err(|e| anyhow::anyhow!("no reply to {request}: {e}"))?;
        let reply: Value = serde_json::from_str(&line)?;
        anyhow::ensure!(
            reply["ok"] == json!(true),
            "agent refused {request}: {reply}"
        );
        Ok(reply)
    }

    /// Turns this connection into a watch of the events matching `filter` (`{"container": ID}` or `{}`).
    pub fn watch(mut self, mut filter: Value) -> anyhow::Result<AgentWatch> {
        filter["op"] = json!("watch");
        self.call(filter)?;
        Ok(AgentWatch { conn: self })
    }
}

/// An event stream from the agent.
pub struct AgentWatch {
    conn: AgentConn,
}

impl AgentWatch {
    /// The next event for which `pred` holds, skipping others; an error after `within`.
    pub fn next_matching(
        &mut self,
        within: Duration,
        pred: impl Fn(&Value) -> bool,
    ) -> anyhow::Result<Value> {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line =
                self.conn.lines.recv_timeout(left).map_err(|e| {
                    anyhow::anyhow!("no matching agent event within {within:?}: {e}")
                })?;
            let v: Value = serde_json::from_str(&line)?;
            if pred(&v["event"]) {
                return Ok(v["event"].clone());
            }
        }
    }

    /// The next transition (acquired or released) of container `id`.
    pub fn next_transition(&mut self, id: &str, within: Duration) -> anyhow::Result<Value> {
        self.next_matching(within, |e| {
            e["id"] == json!(id)
                && (e["kind"] == json!("acquired") || e["kind"] == json!("released"))
        })
    }

    /// The next event of kind `kind` for container `id`.
    pub fn next_of(&mut self, id: &str, kind: &str, within: Duration) -> anyhow::Result<Value> {
        self.next_matching(within, |e| e["id"] == json!(id) && e["kind"] == json!(kind))
    }

    /// Every event that arrives within `within` (for asserting that something did not happen).
    pub fn drain_for(&mut self, within: Duration) -> Vec<Value> {
        let deadline = Instant::now() + within;
        let mut out = Vec::new();
        while let Ok(line) = self
            .conn
            .lines
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            if let Ok(v) = serde_json::from_str::<Value>(&line) {
                out.push(v["event"].clone());
            }
        }
        out
    }
}

/// `ctr events` running against a containerd, its lines collected.
pub struct CtrEvents {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl CtrEvents {
    /// Starts `ctr events` (every namespace's events: ctr events does not filter by namespace).
    pub fn start(containerd: &Containerd) -> anyhow::Result<Self> {
        let (child, out) = spawn_ctr_events(containerd)?;
        Ok(Self {
            child,
            lines: read_lines(out),
        })
    }

    /// The next line on `topic` that contains `needle`; an error after `within`.
    pub fn wait_for(&self, topic: &str, needle: &str, within: Duration) -> anyhow::Result<String> {
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self
                .lines
                .recv_timeout(left)
                .map_err(|e| anyhow::anyhow!("no {topic} event with {needle:?}: {e}"))?;
            if line.contains(&format!(" {topic} ")) && line.contains(needle) {
                return Ok(line);
            }
        }
    }
}

impl Drop for CtrEvents {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `ctr events` against `containerd`, and its stdout.
pub fn spawn_ctr_events(
    containerd: &Containerd,
) -> anyhow::Result<(Child, std::process::ChildStdout)> {
    let mut child = containerd
        .ctr_command()
        .arg("events")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let out = child
        .stdout
        .take()
        .ok_or_else(|| anyhow::anyhow!("no stdout"))?;
    Ok((child, out))
}

/// Copies the mock CUDA workload and the shared libraries it links into `rootfs`; returns its path there.
pub fn install_workload(rootfs: &Path) -> anyhow::Result<String> {
    install_mock_binary(rootfs, "baton-mock-cuda")
}

/// Copies binary `name` of the mock driver's package and the shared libraries it links into `rootfs`;
/// returns its path there (`/bin/NAME`).
pub fn install_mock_binary(rootfs: &Path, name: &str) -> anyhow::Result<String> {
    install_binary(rootfs, &workspace_binary("baton-mock-nvidia", name)?)
}

/// Copies binary `bin` and the shared libraries it links into `rootfs`; returns its path there
/// (`/bin/NAME`).
pub fn install_binary(rootfs: &Path, bin: &Path) -> anyhow::Result<String> {
    let name = bin
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| anyhow::anyhow!("{} has no file name", bin.display()))?;
    let ldd = Command::new("ldd").arg(bin).output()?;
    for lib in String::from_utf8_lossy(&ldd.stdout)
        .split_whitespace()
        .filter(|w| w.starts_with('/'))
    {
        let dst = rootfs.join(lib.trim_start_matches('/'));
        if let Some(dir) = dst.parent() {
            std::fs::create_dir_all(dir)?;
        }
        copy_replacing(Path::new(lib), &dst)?;
    }
    copy_replacing(bin, &rootfs.join("bin").join(name))?;
    Ok(format!("/bin/{name}"))
}

/// Copies `src` to `dst` through a temporary file renamed over it, so that a container of the same rootfs
/// that runs the old copy keeps it (writing over a running binary fails with ETXTBSY). The temporary file is
/// this call's own, so that threads starting containers at once do not rename each other's.
fn copy_replacing(src: &Path, dst: &Path) -> anyhow::Result<()> {
    static COPIES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = COPIES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dst.with_extension(format!("tmp-{}-{n}", std::process::id()));
    std::fs::copy(src, &tmp)?;
    std::fs::rename(&tmp, dst)?;
    Ok(())
}

/// `ctr run` flags that bind-mount the mock driver's device files at /dev/nvidia*.
pub fn device_mounts(mock_dir: &Path) -> Vec<String> {
    device_mounts_at(mock_dir, "/dev")
}

/// `ctr run` flags that bind-mount the mock driver's device files into folder `dir` of the container.
pub fn device_mounts_at(mock_dir: &Path, dir: &str) -> Vec<String> {
    ["nvidiactl", "nvidia0", "nvidia-uvm", "nvidia-uvm-tools"]
        .iter()
        .flat_map(|n| {
            [
                "--mount".to_owned(),
                format!(
                    "type=bind,src={}/{n},dst={dir}/{n},options=rbind:rw",
                    mock_dir.display()
                ),
            ]
        })
        .collect()
}

/// The `status` of container `id` from the agent at `socket` (`None` when it is not watched).
pub fn container_status(socket: &Path, id: &str) -> anyhow::Result<Option<Value>> {
    let mut c = AgentConn::connect(socket)?;
    let reply = c.call(json!({"op": "status", "container": id}))?;
    Ok(reply["containers"]
        .as_array()
        .and_then(|a| a.first().cloned()))
}

/// The `status` of container `id` once `cond` holds for it (polled until `within` passes; a container not
/// watched, or an agent not answering, reads as `null`): `Ok` with it, or `Err` with the last one read.
pub fn container_status_when(
    socket: &Path,
    id: &str,
    within: Duration,
    cond: impl Fn(&Value) -> bool,
) -> Result<Value, Value> {
    let mut last = Value::Null;
    let held = wait_until(within, || {
        last = container_status(socket, id)
            .ok()
            .flatten()
            .unwrap_or(Value::Null);
        cond(&last)
    });
    if held { Ok(last) } else { Err(last) }
}

/// Polls `cond` until it holds or `within` passes; returns whether it held.
pub fn wait_until(within: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    loop {
        if cond() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A stand-in for the node agent, listening on the agent's socket in its place: it answers a shim's `watch`
/// (`watching`), keeps each `register` it gets (answering that it does not watch the container) and
/// refuses anything else. The shim's link to it is live, so to the shim this process is the agent: a test
/// speaks to the shim's control socket as the agent would (a lease the agent would always send left out,
/// pids it would never send), which no other process may.
pub struct FakeAgent {
    registrations: std::sync::Arc<std::sync::Mutex<Vec<Value>>>,
    socket: PathBuf,
}

impl FakeAgent {
    /// Listens on `socket` (its folder made if need be).
    pub fn start(socket: &Path) -> anyhow::Result<Self> {
        if let Some(dir) = socket.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let _ = std::fs::remove_file(socket);
        let listener = std::os::unix::net::UnixListener::bind(socket)?;
        let registrations = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let kept = registrations.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { return };
                let kept = kept.clone();
                std::thread::spawn(move || fake_agent_connection(stream, &kept));
            }
        });
        Ok(Self {
            registrations,
            socket: socket.to_owned(),
        })
    }

    /// The first registration of container `id`, waiting at most `within`.
    pub fn registration(&self, id: &str, within: Duration) -> Option<Value> {
        let mut found = None;
        wait_until(within, || {
            found = self
                .registrations
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .iter()
                .find(|r| r["id"] == json!(id))
                .cloned();
            found.is_some()
        });
        found
    }
}

impl Drop for FakeAgent {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// Serves one connection of a shim to a [`FakeAgent`].
fn fake_agent_connection(stream: UnixStream, kept: &std::sync::Mutex<Vec<Value>>) {
    let Ok(mut write) = stream.try_clone() else {
        return;
    };
    for line in BufReader::new(stream).lines() {
        let Ok(line) = line else { return };
        let request: Value = serde_json::from_str(&line).unwrap_or(Value::Null);
        let reply = match request["op"].as_str() {
            Some("watch") => json!({"v": 1, "ok": true, "reply": "watching"}),
            Some("register") => {
                kept.lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .push(request.clone());
                json!({"v": 1, "ok": false, "reply": "error",
                    "error": "a test's stand-in for the agent: not watched"})
            }
            _ => json!({"v": 1, "ok": false, "reply": "error",
                "error": "a test's stand-in for the agent answers watch and register only"}),
        };
        if writeln!(write, "{reply}").is_err() {
            return;
        }
    }
}
