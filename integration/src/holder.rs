//! A container running the mock's scripted NVIDIA file holder (`baton-mock-holder`), driven one command at a
//! time through `ctr run`'s stdin and stdout, for the release-signal tests.
use std::{
    io::Write,
    path::Path,
    process::{Child, ChildStdin, Stdio},
    sync::mpsc,
    time::Duration,
};

use baton_mock_nvidia::driver::{MockDriver, MountOptions, MountedDriver};
use serde_json::{Value, json};

use crate::{
    agent::{
        AgentConn, AgentWatch, container_status_when, device_mounts_at, install_mock_binary,
        read_lines,
    },
    env::TestEnv,
    skip,
    trace_env::missing_trace_prerequisite,
};

/// A containerd with the Baton shim and a mounted mock driver: where holder containers run.
pub struct GpuRig {
    /// The test's containerd.
    pub env: TestEnv,
    /// Where the mock driver's device files are.
    pub mock_dir: tempfile::TempDir,
    _mock: MountedDriver,
}

impl GpuRig {
    /// Starts the rig, or `None` after reporting a skip (a missing prerequisite fails in strict runs).
    pub fn start(name: &str) -> Option<Self> {
        Self::start_with(name, |o| o)
    }

    /// [`GpuRig::start`] with the mock driver's options changed by `options` (slow closes, more GPUs).
    pub fn start_with(
        name: &str,
        options: impl FnOnce(MountOptions) -> MountOptions,
    ) -> Option<Self> {
        if let Some(reason) = missing_trace_prerequisite() {
            skip::missing(&reason);
            return None;
        }
        let env = TestEnv::start(name)?;
        if !env.is_baton() {
            skip::not_applicable("the agent and the release signal are Baton's");
            return None;
        }
        let mock_dir = tempfile::tempdir().ok()?;
        let mock = MockDriver::mount(options(MountOptions::new(mock_dir.path())))
            .unwrap_or_else(|e| panic!("mounting the mock driver: {e}"));
        Some(Self {
            env,
            mock_dir,
            _mock: mock,
        })
    }

    /// Starts holder container `id`; panics when it does not answer.
    pub fn holder(&self, id: &str) -> HolderContainer {
        HolderContainer::start(&self.env, id, self.mock_dir.path(), &[])
            .unwrap_or_else(|e| panic!("holder {id}: {e:#}"))
    }

    /// The agent's events for container `id` (the agent runs once a GPU container was created).
    pub fn watch(&self, id: &str) -> AgentWatch {
        AgentConn::connect(&self.env.containerd().agent_socket())
            .and_then(|c| {
                c.watch(json!({ "container": id }))
                    .map_err(std::io::Error::other)
            })
            .unwrap_or_else(|e| panic!("watching {id}: {e}"))
    }

    /// The agent's status of container `id`, once it is watched; panics when it is not within [`WITHIN`].
    /// A container can start before the agent watches it: Create waits a few seconds for an agent that is
    /// still starting (loading its probes on a loaded machine), then the shim registers it once it answers.
    pub fn status(&self, id: &str) -> Value {
        container_status_when(&self.env.containerd().agent_socket(), id, WITHIN, |s| {
            !s.is_null()
        })
        .unwrap_or_else(|_| panic!("container {id} is not watched"))
    }

    /// The agent's node status.
    pub fn node_status(&self) -> Value {
        AgentConn::connect(&self.env.containerd().agent_socket())
            .map_err(anyhow::Error::from)
            .and_then(|mut c| c.call(json!({"op": "status"})))
            .unwrap_or_else(|e| panic!("agent status: {e:#}"))
    }
}

/// How long a container may take to be watched once its holder answers (an agent loading its probes on a
/// loaded CI machine included).
const WITHIN: Duration = Duration::from_secs(60);

/// How long one command may take (a loaded CI machine included).
const REPLY_TIMEOUT: Duration = Duration::from_secs(30);

/// A running holder container; `ctr run` is killed on drop if the test did not finish it.
pub struct HolderContainer {
    id: String,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
}

impl HolderContainer {
    /// Runs container `id` (with `annotations`) seeing the mock driver's devices in `mock_dir`, and waits
    /// until the holder answers.
    pub fn start(
        env: &TestEnv,
        id: &str,
        mock_dir: &Path,
        annotations: &[(&str, &str)],
    ) -> anyhow::Result<Self> {
        Self::start_at(env, id, mock_dir, annotations, "/dev")
    }

    /// [`HolderContainer::start`] under another runtime than the one under test (`io.containerd.runc.v2`:
    /// a container Baton does not watch).
    pub fn start_with_runtime(
        env: &TestEnv,
        id: &str,
        mock_dir: &Path,
        runtime: &str,
    ) -> anyhow::Result<Self> {
        Self::spawn(env, id, mock_dir, &[], "/dev", &[], Some(runtime))
    }

    /// [`HolderContainer::start_with_runtime`] with `annotations` in its OCI spec (CRI's pod names, as a
    /// pod's container under another runtime has them).
    pub fn start_with_runtime_annotated(
        env: &TestEnv,
        id: &str,
        mock_dir: &Path,
        runtime: &str,
        annotations: &[(&str, &str)],
    ) -> anyhow::Result<Self> {
        Self::spawn(env, id, mock_dir, annotations, "/dev", &[], Some(runtime))
    }

    /// [`HolderContainer::start_with_runtime`] with more `ctr run` flags (`--privileged`).
    pub fn start_with_runtime_and_flags(
        env: &TestEnv,
        id: &str,
        mock_dir: &Path,
        runtime: &str,
        more_flags: &[String],
    ) -> anyhow::Result<Self> {
        Self::spawn(env, id, mock_dir, &[], "/dev", more_flags, Some(runtime))
    }

    /// [`HolderContainer::start`] with the device files in folder `dev_dir` of the container.
    pub fn start_at(
        env: &TestEnv,
        id: &str,
        mock_dir: &Path,
        annotations: &[(&str, &str)],
        dev_dir: &str,
    ) -> anyhow::Result<Self> {
        Self::start_with(env, id, mock_dir, annotations, dev_dir, &[])
    }

    /// [`HolderContainer::start_at`] with more `ctr run` flags (the node's options TOML, see
    /// [`TestEnv::node_options_flags`]).
    pub fn start_with(
        env: &TestEnv,
        id: &str,
        mock_dir: &Path,
        annotations: &[(&str, &str)],
        dev_dir: &str,
        more_flags: &[String],
    ) -> anyhow::Result<Self> {
        Self::spawn(env, id, mock_dir, annotations, dev_dir, more_flags, None)
    }

    fn spawn(
        env: &TestEnv,
        id: &str,
        mock_dir: &Path,
        annotations: &[(&str, &str)],
        dev_dir: &str,
        more_flags: &[String],
        runtime: Option<&str>,
    ) -> anyhow::Result<Self> {
        let holder = install_mock_binary(env.rootfs(), "baton-mock-holder")?;
        let mut flags = device_mounts_at(mock_dir, dev_dir);
        flags.push("--rm".into());
        flags.extend(more_flags.iter().cloned());
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let mut args = env.run_args(id, annotations, &flags, &[&holder, "--dev-dir", dev_dir]);
        if let Some(runtime) = runtime {
            // `run --runtime RUNTIME ...`
            args[2] = runtime.to_owned();
        }
        let child = env
            .containerd()
            .ctr_command()
            .args(&args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        Self::attach(id, child)
    }

    /// Drives holder container `id` through the piped stdin and stdout of `child` (a runtime run in the
    /// foreground that passes the holder's stdio through: `ctr run`, `runc run`, `podman run -i`), and waits
    /// until it answers.
    pub fn attach(id: &str, mut child: Child) -> anyhow::Result<Self> {
        let stdin = child.stdin.take();
        let out = child
            .stdout
            .take()
            .ok_or_else(|| anyhow::anyhow!("no stdout"))?;
        let mut h = Self {
            id: id.to_owned(),
            child,
            stdin,
            lines: read_lines(out),
        };
        h.cmd("stamp")?;
        Ok(h)
    }

    /// The container's id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The pid of the child it drives (the holder itself when it was started directly, not through a
    /// runtime).
    pub fn child_pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends one command and returns the words of its `ok` reply; an error for `err` or no reply.
    pub fn cmd(&mut self, line: &str) -> anyhow::Result<Vec<String>> {
        let stdin = self
            .stdin
            .as_mut()
            .ok_or_else(|| anyhow::anyhow!("the holder's stdin is closed"))?;
        writeln!(stdin, "{line}")?;
        stdin.flush()?;
        self.reply(line)
    }

    /// Sends a command after which the holder gives no reply (`exit`).
    pub fn send(&mut self, line: &str) -> anyhow::Result<()> {
        let stdin = self
            .stdin
            .as_mut()
            .ok_or_else(|| anyhow::anyhow!("the holder's stdin is closed"))?;
        writeln!(stdin, "{line}")?;
        Ok(stdin.flush()?)
    }

    /// The next reply line (for a command sent with [`HolderContainer::send`] whose reply comes later, as
    /// the re-executed program's after `exec`).
    pub fn reply(&mut self, what: &str) -> anyhow::Result<Vec<String>> {
        let reply = self
            .lines
            .recv_timeout(REPLY_TIMEOUT)
            .map_err(|e| anyhow::anyhow!("no reply to {what:?} from {}: {e}", self.id))?;
        let mut words = reply.split_whitespace().map(str::to_owned);
        match words.next().as_deref() {
            Some("ok") => Ok(words.collect()),
            _ => anyhow::bail!("{what:?} in {}: {reply}", self.id),
        }
    }

    /// Sends a command and returns the number its reply starts with (an fd, a time, a pid, an address).
    pub fn num(&mut self, line: &str) -> anyhow::Result<u64> {
        let words = self.cmd(line)?;
        let first = words
            .first()
            .ok_or_else(|| anyhow::anyhow!("{line:?}: empty reply"))?;
        Ok(match first.strip_prefix("0x") {
            Some(hex) => u64::from_str_radix(hex, 16)?,
            None => first.parse()?,
        })
    }

    /// Closes the holder's stdin (it exits) and waits for `ctr run` to return.
    pub fn finish(mut self) -> anyhow::Result<()> {
        drop(self.stdin.take());
        let deadline = std::time::Instant::now() + REPLY_TIMEOUT;
        while std::time::Instant::now() < deadline {
            if self.child.try_wait()?.is_some() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        anyhow::bail!("ctr run of {} did not return", self.id)
    }
}

impl Drop for HolderContainer {
    fn drop(&mut self) {
        drop(self.stdin.take());
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}
