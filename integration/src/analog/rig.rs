//! The analog's rig: a test containerd with the Baton shim, a foreground `baton agent` on the socket its
//! shims use, the server and co-runner containers (both pinned to one CPU, their sockets and report in a
//! folder bind-mounted from the host) and the example request proxy in front of the server.
use std::{
    io::{BufRead, BufReader},
    os::unix::net::UnixStream,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::Duration,
};

use anyhow::{Context, Result, bail};
use nix::{
    sched::{CpuSet, sched_getaffinity, sched_setaffinity},
    sys::signal::{Signal, kill},
    unistd::Pid,
};
use serde_json::{Value, json};

use crate::{
    agent::{AgentConn, AgentProcess, install_binary, wait_until},
    env::TestEnv,
    shim_binary::{target_dir, workspace_root},
    trace_env::workspace_binary,
};

/// How long a start or a state change may take (a loaded machine included).
pub const WITHIN: Duration = Duration::from_secs(60);
/// The folder the containers see the host's share at.
const SHARE_IN_CONTAINER: &str = "/run/analog";
/// The server's container id.
pub const SERVER: &str = "server";
/// The co-runner's container id.
pub const CO_RUNNER: &str = "corunner";

/// The programs the rig runs.
#[derive(Clone, Debug)]
pub struct Binaries {
    /// `baton` (the agent).
    pub baton: PathBuf,
    /// `baton-analog-server`.
    pub server: PathBuf,
    /// `baton-analog-corunner`.
    pub corunner: PathBuf,
    /// The `request_proxy` example of the `baton` crate.
    pub proxy: PathBuf,
}

impl Binaries {
    /// The builds in profile folder `dir` (`target/release` for a benchmark); an error names what to build.
    pub fn in_dir(dir: &Path) -> Result<Self> {
        let b = Self {
            baton: dir.join("baton"),
            server: dir.join("baton-analog-server"),
            corunner: dir.join("baton-analog-corunner"),
            proxy: dir.join("examples").join("request_proxy"),
        };
        for bin in [&b.baton, &b.server, &b.corunner, &b.proxy] {
            if !bin.is_file() {
                bail!(
                    "{} missing: cargo build --release --workspace --bins && cargo build --release -p baton --examples",
                    bin.display()
                );
            }
        }
        Ok(b)
    }

    /// The debug builds, built where missing (tests).
    pub fn debug_built() -> Result<Self> {
        let proxy = target_dir().join("debug/examples/request_proxy");
        if !proxy.is_file() {
            let status = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
                .args([
                    "build",
                    "--quiet",
                    "-p",
                    "baton",
                    "--example",
                    "request_proxy",
                ])
                .arg("--manifest-path")
                .arg(workspace_root().join("Cargo.toml"))
                .env("CARGO_TARGET_DIR", target_dir())
                .status()
                .context("running cargo build --example request_proxy")?;
            anyhow::ensure!(
                status.success(),
                "cargo build -p baton --example request_proxy failed"
            );
        }
        Ok(Self {
            baton: workspace_binary("baton", "baton")?,
            server: workspace_binary("baton-integration", "baton-analog-server")?,
            corunner: workspace_binary("baton-integration", "baton-analog-corunner")?,
            proxy,
        })
    }
}

/// The server's request shape.
#[derive(Clone, Copy, Debug)]
pub struct Workload {
    /// CPU time of a prefill, ms.
    pub prefill_ms: f64,
    /// Tokens per request.
    pub tokens: u32,
    /// CPU time per token, ms.
    pub token_ms: f64,
}

impl Workload {
    /// One request's CPU time alone, s.
    pub fn service_s(&self) -> f64 {
        (self.prefill_ms + f64::from(self.tokens) * self.token_ms) / 1e3
    }

    /// The arrival rate that keeps the server busy `load` of the time (0.1: 10% of its capacity).
    pub fn rate_at(&self, load: f64) -> f64 {
        load / self.service_s()
    }
}

/// The CPU the server and co-runner share (the last this process may use), and, when there is another, this
/// process moved off it so that everything it starts (containerd, the shims, the agent, the proxy, the
/// request generator) runs on the others, as a GPU node's host CPUs are apart from the GPU.
pub fn take_contended_cpu() -> Result<usize> {
    let mine = sched_getaffinity(Pid::from_raw(0)).context("reading this process's CPUs")?;
    let cpus: Vec<usize> = (0..CpuSet::count())
        .filter(|c| mine.is_set(*c).unwrap_or(false))
        .collect();
    let Some((&contended, others)) = cpus.split_last() else {
        bail!("this process may run on no CPU");
    };
    if !others.is_empty() {
        let mut set = CpuSet::new();
        for c in others {
            set.set(*c)?;
        }
        sched_setaffinity(Pid::from_raw(0), &set).context("moving off the contended CPU")?;
    }
    Ok(contended)
}

/// containerd, the agent, and the analog's containers.
pub struct AnalogRig {
    /// The test's containerd and the Baton shim.
    pub env: TestEnv,
    /// The agent the shims register with.
    pub agent: AgentProcess,
    bins: Binaries,
    share: PathBuf,
    cpu: usize,
    workload: Workload,
}

impl AnalogRig {
    /// Starts the agent for `env` and installs the workloads into its rootfs; the containers come later.
    pub fn new(env: TestEnv, bins: Binaries, cpu: usize, workload: Workload) -> Result<Self> {
        let socket = env.containerd().agent_socket();
        if let Some(dir) = socket.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let agent =
            AgentProcess::start_program(&bins.baton, &socket, &env.scratch().join("agent.log"))?;
        install_binary(env.rootfs(), &bins.server)?;
        install_binary(env.rootfs(), &bins.corunner)?;
        let share = env.scratch().join("analog");
        std::fs::create_dir_all(&share)?;
        Ok(Self {
            env,
            agent,
            bins,
            share,
            cpu,
            workload,
        })
    }

    /// The server's request shape.
    pub fn workload(&self) -> Workload {
        self.workload
    }

    /// The server's socket, on the host.
    pub fn server_socket(&self) -> PathBuf {
        self.share.join("server.sock")
    }

    fn report(&self) -> PathBuf {
        self.share.join("corunner.count")
    }

    fn run_container(
        &self,
        id: &str,
        annotations: &[(&str, &str)],
        command: &[String],
    ) -> Result<()> {
        let mount = format!(
            "type=bind,src={},dst={SHARE_IN_CONTAINER},options=rbind:rw",
            self.share.display()
        );
        let command: Vec<&str> = command.iter().map(String::as_str).collect();
        let args = self.env.run_args(
            id,
            annotations,
            &["-d", "--null-io", "--mount", &mount],
            &command,
        );
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.env
            .ctr_ok(&args)
            .with_context(|| format!("ctr run {id}"))?;
        Ok(())
    }

    /// Starts the latency-critical server and waits until it accepts connections.
    pub fn start_server(&self) -> Result<()> {
        let w = self.workload;
        let command = vec![
            "/bin/baton-analog-server".into(),
            "--socket".into(),
            format!("{SHARE_IN_CONTAINER}/server.sock"),
            "--prefill-ms".into(),
            w.prefill_ms.to_string(),
            "--tokens".into(),
            w.tokens.to_string(),
            "--token-ms".into(),
            w.token_ms.to_string(),
            "--cpu".into(),
            self.cpu.to_string(),
        ];
        self.run_container(SERVER, &[("baton.io/role", "latency-critical")], &command)?;
        // A connection closed without a request line is no request: the server skips it.
        let socket = self.server_socket();
        if !wait_until(WITHIN, || UnixStream::connect(&socket).is_ok()) {
            bail!(
                "the server did not listen on {} within {WITHIN:?}",
                socket.display()
            );
        }
        Ok(())
    }

    /// Starts the co-runner (yielding to the server) and waits for its first report.
    pub fn start_co_runner(&self) -> Result<()> {
        let command = vec![
            "/bin/baton-analog-corunner".into(),
            "--report".into(),
            format!("{SHARE_IN_CONTAINER}/corunner.count"),
            "--cpu".into(),
            self.cpu.to_string(),
        ];
        self.run_container(
            CO_RUNNER,
            &[
                ("baton.io/role", "co-runner"),
                ("baton.io/yields-to", SERVER),
            ],
            &command,
        )?;
        if !wait_until(WITHIN, || self.co_runner_units().is_ok()) {
            bail!(
                "the co-runner wrote no report to {} within {WITHIN:?}",
                self.report().display()
            );
        }
        Ok(())
    }

    /// The co-runner's units of work so far (its last report).
    pub fn co_runner_units(&self) -> Result<u64> {
        let text = std::fs::read_to_string(self.report())?;
        let units = text.split_whitespace().next().context("an empty report")?;
        Ok(units.parse()?)
    }

    /// The co-runner's host pid.
    pub fn co_runner_pid(&self) -> Result<u32> {
        Ok(self.env.api()?.state(CO_RUNNER, "")?.1)
    }

    /// Sends `signal` to the co-runner's process.
    pub fn signal_co_runner(&self, signal: Signal) -> Result<()> {
        let pid = Pid::from_raw(i32::try_from(self.co_runner_pid()?)?);
        kill(pid, signal).with_context(|| format!("{signal} to the co-runner ({pid})"))
    }

    /// Waits until the co-runner makes progress again (SIGCONT first: nothing may leave it stopped).
    pub fn wait_co_runner_running(&self) -> Result<()> {
        self.signal_co_runner(Signal::SIGCONT)?;
        let first = self.co_runner_units()?;
        if !wait_until(WITHIN, || self.co_runner_units().is_ok_and(|u| u > first)) {
            bail!("the co-runner made no progress within {WITHIN:?}: is it frozen?");
        }
        Ok(())
    }

    /// Starts the request proxy in front of the server, shielding as `shield` says.
    pub fn proxy(&self, shield: ProxyShield) -> Result<Proxy> {
        let listen = self.share.join("proxy.sock");
        let mut command = Command::new(&self.bins.proxy);
        command
            .arg("--listen")
            .arg(&listen)
            .arg("--server")
            .arg(self.server_socket());
        match shield {
            ProxyShield::Forward => {}
            ProxyShield::Agent => {
                command.arg("--agent").arg(self.agent.socket());
            }
            ProxyShield::Sigstop => {
                command
                    .arg("--sigstop")
                    .arg(self.co_runner_pid()?.to_string());
            }
        }
        Proxy::start(command, listen, self.env.scratch().join("proxy.log"))
    }

    /// Sends one control request to the agent; its reply, or the agent's refusal.
    pub fn agent_call(&self, request: Value) -> Result<Value> {
        AgentConn::connect(self.agent.socket())?.call(request)
    }

    /// Whether the agent runs the co-runner controller: `Err` with its answer when it does not.
    pub fn controller_available(&self) -> Result<()> {
        self.agent_call(json!({"op": "governor", "target_stretch": 1.0, "off": true}))
            .map(drop)
            .context("the agent does not take co-runner control requests")
    }

    /// Freezes nothing more: turns the governor off.
    pub fn governor_off(&self) -> Result<()> {
        self.agent_call(json!({"op": "governor", "target_stretch": 1.0, "off": true}))
            .map(drop)
    }

    /// Turns the governor on at `target` stretch, 200 ms windows.
    pub fn governor_on(&self, target: f64) -> Result<()> {
        self.agent_call(json!({"op": "governor", "target_stretch": target, "window_ms": 200}))
            .map(drop)
    }
}

/// How the proxy protects requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProxyShield {
    /// Forwarding only.
    Forward,
    /// Request events and tokens to the agent.
    Agent,
    /// SIGSTOP/SIGCONT of the co-runner (the seed's shield).
    Sigstop,
}

/// A running request proxy; killed on drop.
pub struct Proxy {
    child: Child,
    listen: PathBuf,
    log: PathBuf,
}

impl Proxy {
    /// Runs `command` (the proxy with its flags, `--listen listen` among them), its stderr in `log`; returns
    /// once it listens.
    pub fn start(mut command: Command, listen: PathBuf, log: PathBuf) -> Result<Self> {
        let stderr = std::fs::File::create(&log)?;
        let mut child = command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .context("starting the request proxy")?;
        let mut ready = String::new();
        if let Some(out) = child.stdout.take() {
            BufReader::new(out).read_line(&mut ready)?;
        }
        let proxy = Proxy { child, listen, log };
        if !ready.starts_with("listening") {
            bail!("the request proxy did not start: {}", proxy.errors());
        }
        Ok(proxy)
    }

    /// Where clients connect.
    pub fn socket(&self) -> &Path {
        &self.listen
    }

    /// What it printed on stderr (refusals, failed requests).
    pub fn errors(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
