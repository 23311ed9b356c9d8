//! A private containerd (Debian 12's 1.6, or the 2.x that `BATON_CONTAINERD` names): its own root, state, socket and config in a temporary folder, the shim under test
//! first on its PATH, the CRI plugin disabled (it is not needed and slows startup) unless a test asks for it
//! ([`Containerd::start_with_cri`]). Also runs `ctr` against it.
//!
//! `BATON_CONTAINERD=/path/to/containerd` and `BATON_CTR=/path/to/ctr` choose other binaries, e.g. the containerd
//! 2.1 that tools/setup.sh caches (tools/dev test runs a second pass with it); the config is written for the
//! major version `containerd --version` reports (format 2 for 1.x, format 3 for 2.x).

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// How long containerd may take to open its socket.
const START_TIMEOUT: Duration = Duration::from_secs(20);
/// How long one `ctr` command may run before it is killed.
pub const CTR_TIMEOUT: Duration = Duration::from_secs(60);

/// The containerd namespace of the CRI plugin's pods and images.
pub const CRI_NAMESPACE: &str = "k8s.io";

/// Names the containerd binary the harness starts (default: `containerd` on PATH).
pub const CONTAINERD_ENV: &str = "BATON_CONTAINERD";
/// Names the ctr binary the harness runs (default: `ctr` on PATH).
pub const CTR_ENV: &str = "BATON_CTR";

/// The containerd binary: `$BATON_CONTAINERD`, or `containerd` (looked up on PATH).
pub fn containerd_program() -> PathBuf {
    program_from_env(CONTAINERD_ENV, "containerd")
}

/// The ctr binary: `$BATON_CTR`, or `ctr` (looked up on PATH).
pub fn ctr_program() -> PathBuf {
    program_from_env(CTR_ENV, "ctr")
}

fn program_from_env(variable: &str, default: &str) -> PathBuf {
    std::env::var_os(variable)
        .filter(|value| !value.is_empty())
        .map_or_else(|| PathBuf::from(default), PathBuf::from)
}

/// Errors starting, stopping or talking to containerd.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file in the private folder could not be written.
    #[error("writing {path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// containerd or ctr could not be spawned.
    #[error(
        "spawning {program}: {source}: install Debian package containerd (or fix {CONTAINERD_ENV} / {CTR_ENV})"
    )]
    Spawn {
        /// The program.
        program: String,
        /// The cause.
        source: std::io::Error,
    },
    /// `containerd --version` could not be run or did not name a version.
    #[error("asking `{program} --version`: {detail}")]
    Version {
        /// The program.
        program: String,
        /// The spawn error or what it printed.
        detail: String,
    },
    /// containerd exited or never opened its socket.
    #[error(
        "containerd did not open {socket} within {START_TIMEOUT:?}; its log ({log}) ends with:\n{tail}"
    )]
    NotReady {
        /// The socket path.
        socket: PathBuf,
        /// The log file.
        log: PathBuf,
        /// The log's last lines.
        tail: String,
    },
    /// A ctr command failed.
    #[error("`ctr {args}` failed ({status}): {stderr}")]
    Ctr {
        /// The arguments.
        args: String,
        /// How it ended.
        status: String,
        /// Its stderr.
        stderr: String,
    },
}

/// What a `ctr` command printed and how it ended.
#[derive(Debug, Clone)]
pub struct CtrOutput {
    /// Exit code (`None` when killed by a signal or the timeout).
    pub code: Option<i32>,
    /// Standard output.
    pub stdout: String,
    /// Standard error.
    pub stderr: String,
}

impl CtrOutput {
    /// Whether ctr exited 0.
    pub fn success(&self) -> bool {
        self.code == Some(0)
    }
}

/// Which cgroup layout containerd, its shims and runc see.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CgroupMode {
    /// The host's (hybrid here: runc uses the v1 freezer and controllers).
    #[default]
    Host,
    /// cgroup v2 only: containerd runs in a private mount namespace (`unshare -m --propagation private`) where
    /// cgroup2 is mounted over /sys/fs/cgroup, so runc (which looks at /sys/fs/cgroup) runs in v2 mode. The v2
    /// hierarchy is the host's own (seen at /sys/fs/cgroup/unified from outside); only the v1 controllers stay
    /// out of reach.
    V2,
}

/// A containerd instance owned by a test. Dropping it only stops containerd; [`crate::TestEnv`] does the full
/// cleanup of containers, shims, mounts and cgroups.
pub struct Containerd {
    dir: PathBuf,
    namespace: String,
    child: Option<Child>,
    cgroups: CgroupMode,
    node: Option<PathBuf>,
}

/// The node's own folders in [`Containerd::start_as_node`]: each `<host root>/X` is bind-mounted over `/X`
/// in containerd's mount namespace, so that what the node's config, binaries and runtime state name by
/// their usual paths (a DaemonSet's hostPath volumes, `baton install`'s entry, runc's default root) are the
/// test's, not this machine's.
pub const NODE_FOLDERS: [&str; 4] = [
    "etc/containerd",
    "usr/local/bin",
    "run/baton",
    "run/containerd",
];

impl Containerd {
    /// Writes the config into `dir` (which must exist) and starts containerd with `shim_dir` first on its PATH.
    pub fn start(dir: &Path, namespace: &str, shim_dir: &Path) -> Result<Self, Error> {
        Self::start_in(dir, namespace, shim_dir, CgroupMode::Host)
    }

    /// [`Containerd::start`] with the cgroup layout `cgroups`.
    pub fn start_in(
        dir: &Path,
        namespace: &str,
        shim_dir: &Path,
        cgroups: CgroupMode,
    ) -> Result<Self, Error> {
        Self::start_configured(dir, namespace, shim_dir, cgroups, Config::Plain)
    }

    /// [`Containerd::start`] with the CRI plugin enabled and configured by `cri` (its TOML tables, in the
    /// config format of the containerd's major version, [`major_version`]: format 2 and
    /// `[plugins."io.containerd.grpc.v1.cri"]` for 1.x, format 3 and the `io.containerd.cri.v1.*` plugins
    /// for 2.x), for namespace `k8s.io` (the only one CRI uses).
    pub fn start_with_cri(dir: &Path, shim_dir: &Path, cri: &str) -> Result<Self, Error> {
        Self::start_configured(
            dir,
            CRI_NAMESPACE,
            shim_dir,
            CgroupMode::Host,
            Config::Cri(cri),
        )
    }

    /// containerd as a Kubernetes node's: in a mount namespace of its own where the folders
    /// [`NODE_FOLDERS`] of `host_root` are bind-mounted over the machine's (its config is
    /// `/etc/containerd/config.toml` there, written here with the CRI tables `cri`; its PATH is the
    /// machine's, so shims are found in the node's /usr/local/bin), in the cgroup layout `cgroups`, and with
    /// no agent socket in its environment (shims use what their runtime's options say). Root, state and
    /// sockets are under `dir`, as for every test's containerd.
    pub fn start_as_node(
        dir: &Path,
        host_root: &Path,
        cgroups: CgroupMode,
        cri: &str,
    ) -> Result<Self, Error> {
        for sub in NODE_FOLDERS {
            let path = host_root.join(sub);
            std::fs::create_dir_all(&path).map_err(|source| Error::Io { path, source })?;
        }
        let config = host_root.join("etc/containerd/config.toml");
        let text = cri_config_toml(dir, major_version()?, cri);
        std::fs::write(&config, text).map_err(|source| Error::Io {
            path: config,
            source,
        })?;
        Self::start_configured(
            dir,
            CRI_NAMESPACE,
            Path::new(""),
            cgroups,
            Config::Node(host_root),
        )
    }

    fn start_configured(
        dir: &Path,
        namespace: &str,
        shim_dir: &Path,
        cgroups: CgroupMode,
        config: Config<'_>,
    ) -> Result<Self, Error> {
        for sub in ["root", "state"] {
            std::fs::create_dir_all(dir.join(sub)).map_err(|source| Error::Io {
                path: dir.join(sub),
                source,
            })?;
        }
        let text = match config {
            Config::Plain => Some(config_toml(dir, major_version()?)),
            Config::Cri(cri) => Some(cri_config_toml(dir, major_version()?, cri)),
            Config::Node(_) => None,
        };
        if let Some(text) = text {
            let config = dir.join("config.toml");
            std::fs::write(&config, text).map_err(|source| Error::Io {
                path: config,
                source,
            })?;
        }
        let node = match config {
            Config::Node(root) => Some(root.to_path_buf()),
            _ => None,
        };
        let path = match node {
            Some(_) => std::env::var("PATH").unwrap_or_default(),
            None => format!(
                "{}:{}",
                shim_dir.display(),
                std::env::var("PATH").unwrap_or_default()
            ),
        };
        std::fs::write(dir.join("path"), &path).map_err(|source| Error::Io {
            path: dir.join("path"),
            source,
        })?;
        let mut containerd = Self {
            dir: dir.to_path_buf(),
            namespace: namespace.to_string(),
            child: None,
            cgroups,
            node,
        };
        containerd.spawn()?;
        Ok(containerd)
    }

    /// The cgroup layout containerd and its shims see.
    pub fn cgroup_mode(&self) -> CgroupMode {
        self.cgroups
    }

    /// containerd's gRPC socket.
    pub fn socket(&self) -> PathBuf {
        self.dir.join("containerd.sock")
    }

    /// The containerd namespace this test uses.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// containerd's state folder (bundles live in `<state>/io.containerd.runtime.v2.task/<ns>/<id>`).
    pub fn state_dir(&self) -> PathBuf {
        self.dir.join("state")
    }

    /// The private temporary folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// containerd's log file.
    pub fn log_path(&self) -> PathBuf {
        self.dir.join("containerd.log")
    }

    /// The pid of the running containerd, if any.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Stops containerd (SIGTERM, then SIGKILL after 10 s). Shims and containers keep running.
    pub fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if let Ok(pid) = i32::try_from(child.id()) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if matches!(child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
    }

    /// The socket of the baton agent this containerd's shims use (`BATON_AGENT_SOCKET` in its environment).
    pub fn agent_socket(&self) -> PathBuf {
        self.dir.join("agent").join("agent.sock")
    }

    /// The pid of the agent serving [`Containerd::agent_socket`], from its lock file, if it runs.
    pub fn agent_pid(&self) -> Option<i32> {
        let mut lock = self.agent_socket().into_os_string();
        lock.push(".lock");
        let pid: i32 = std::fs::read_to_string(lock).ok()?.trim().parse().ok()?;
        Path::new(&format!("/proc/{pid}")).exists().then_some(pid)
    }

    /// Kills the agent (SIGKILL, as a crash would) and waits until it is gone.
    pub fn kill_agent(&self) {
        let Some(pid) = self.agent_pid() else { return };
        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline && Path::new(&format!("/proc/{pid}")).exists() {
            // A zombie until its parent (a shim, or init) reaps it; it holds nothing then.
            let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            if state.contains(") Z ") {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Stops and starts containerd on the same root, state and socket.
    pub fn restart(&mut self) -> Result<(), Error> {
        self.stop();
        self.spawn()
    }

    fn spawn(&mut self) -> Result<(), Error> {
        let log_path = self.log_path();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(|source| Error::Io {
                path: log_path.clone(),
                source,
            })?;
        let log_err = log.try_clone().map_err(|source| Error::Io {
            path: log_path.clone(),
            source,
        })?;
        let path = std::fs::read_to_string(self.dir.join("path")).unwrap_or_default();
        let mut mounts = Vec::new();
        if self.cgroups == CgroupMode::V2 {
            mounts.push("mount -t cgroup2 none /sys/fs/cgroup".to_owned());
        }
        if let Some(root) = &self.node {
            for sub in NODE_FOLDERS {
                let from = root.join(sub).display().to_string();
                mounts.push(format!("mkdir -p /{sub} && mount --bind '{from}' /{sub}"));
            }
        }
        let mut command = if mounts.is_empty() {
            Command::new(containerd_program())
        } else {
            // unshare and sh exec in place: the child's pid is containerd's.
            let mut c = Command::new("unshare");
            c.args(["-m", "--propagation", "private", "sh", "-c"])
                .arg(format!(r#"{} && exec "$0" "$@""#, mounts.join(" && ")))
                .arg(containerd_program());
            c
        };
        let config = match self.node {
            Some(_) => PathBuf::from("/etc/containerd/config.toml"),
            None => self.dir.join("config.toml"),
        };
        // containerd unpacks a checkpoint it restores from into a temporary folder that it never removes
        // (plugins/services/tasks/local.go, Create: MkdirTemp($XDG_RUNTIME_DIR or $TMPDIR, "ctrd-checkpoint")):
        // with the node's /tmp, each restored park left its whole memory image behind (258 MB each, 19 GB after
        // a few runs, and CI ran out of disk). Kept in the test's folder, it goes with it.
        let tmp = self.dir.join("tmp");
        std::fs::create_dir_all(&tmp).map_err(|source| Error::Io {
            path: tmp.clone(),
            source,
        })?;
        command
            .arg("--config")
            .arg(config)
            .env("PATH", path)
            .env("TMPDIR", &tmp)
            .env_remove("XDG_RUNTIME_DIR");
        if self.node.is_none() {
            // Every shim of this containerd talks to (and starts) an agent of the test's own.
            command.env(baton_agent_api::SOCKET_ENV, self.agent_socket());
        } else {
            command.env_remove(baton_agent_api::SOCKET_ENV);
        }
        let child = command
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .spawn()
            .map_err(|source| Error::Spawn {
                program: containerd_program().display().to_string(),
                source,
            })?;
        self.child = Some(child);
        self.wait_ready()
    }

    fn wait_ready(&mut self) -> Result<(), Error> {
        let deadline = Instant::now() + START_TIMEOUT;
        while Instant::now() < deadline {
            if UnixStream::connect(self.socket()).is_ok() && self.ctr(&["version"]).success() {
                return Ok(());
            }
            let exited = self
                .child
                .as_mut()
                .is_none_or(|child| matches!(child.try_wait(), Ok(Some(_))));
            if exited {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(Error::NotReady {
            socket: self.socket(),
            log: self.log_path(),
            tail: self.log_tail(30),
        })
    }

    /// The last `lines` lines of containerd's log.
    pub fn log_tail(&self, lines: usize) -> String {
        tail_of(&self.log_path(), lines)
    }

    /// The last `lines` lines of the log of the agent the shims started (next to its socket), if any.
    pub fn agent_log_tail(&self, lines: usize) -> Option<String> {
        let log = self.agent_socket().with_file_name("agent.log");
        log.exists().then(|| tail_of(&log, lines))
    }

    /// Runs `ctr --address <socket> --namespace <ns> ARGS` and returns what it printed (never fails: look at
    /// [`CtrOutput::code`]).
    pub fn ctr(&self, args: &[&str]) -> CtrOutput {
        self.ctr_with_stdin(args, None)
    }

    /// Like [`Containerd::ctr`], feeding `stdin` to ctr (then closing it).
    pub fn ctr_with_stdin(&self, args: &[&str], stdin: Option<&[u8]>) -> CtrOutput {
        let mut command = self.ctr_command();
        command.args(args);
        run_with_timeout(command, stdin, CTR_TIMEOUT)
    }

    /// Like [`Containerd::ctr`] but an error when ctr does not exit 0; returns stdout.
    pub fn ctr_ok(&self, args: &[&str]) -> Result<String, Error> {
        let output = self.ctr(args);
        if output.success() {
            Ok(output.stdout)
        } else {
            Err(Error::Ctr {
                args: args.join(" "),
                status: format!("{:?}", output.code),
                stderr: output.stderr,
            })
        }
    }

    /// A `ctr` command bound to this containerd and namespace, for callers that need to spawn it themselves.
    pub fn ctr_command(&self) -> Command {
        let mut command = Command::new(ctr_program());
        command
            .arg("--address")
            .arg(self.socket())
            .arg("--namespace")
            .arg(&self.namespace);
        command
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        self.stop();
        self.kill_agent();
    }
}

/// Writes `data` into ctr's stdin and keeps it open until ctr's stdout has echoed it (the commands that
/// tests give input to are `cat`-like): ctr closes the task's stdin on EOF only once the task exists, so an
/// EOF that comes earlier would be lost. Returns the thread that reads ctr's stdout to its end.
fn feed_until_echoed(
    data: &[u8],
    mut pipe: std::process::ChildStdin,
    mut stdout: std::process::ChildStdout,
    timeout: Duration,
) -> std::thread::JoinHandle<Vec<u8>> {
    /// ctr's stdout so far, and whether it ended.
    #[derive(Default)]
    struct Seen {
        out: Vec<u8>,
        ended: bool,
    }
    let data = data.to_vec();
    let seen = Arc::new((Mutex::new(Seen::default()), Condvar::new()));
    let reader_seen = seen.clone();
    let reader = std::thread::spawn(move || {
        let (state, changed) = &*reader_seen;
        let lock = || state.lock().unwrap_or_else(PoisonError::into_inner);
        let mut buf = [0u8; 4096];
        while let Ok(n) = stdout.read(&mut buf) {
            if n == 0 {
                break;
            }
            lock().out.extend_from_slice(&buf[..n]);
            changed.notify_all();
        }
        let mut s = lock();
        s.ended = true;
        changed.notify_all();
        s.out.clone()
    });
    std::thread::spawn(move || {
        let _ = pipe.write_all(&data);
        let (state, changed) = &*seen;
        let waiting = |s: &mut Seen| {
            !s.ended && !data.is_empty() && !s.out.windows(data.len()).any(|w| w == data)
        };
        let guard = state.lock().unwrap_or_else(PoisonError::into_inner);
        let _ = changed.wait_timeout_while(guard, timeout, waiting);
        drop(pipe);
    });
    reader
}

/// Runs `command` with piped output, optional stdin, killing it after `timeout`.
pub fn run_with_timeout(
    mut command: Command,
    stdin: Option<&[u8]>,
    timeout: Duration,
) -> CtrOutput {
    command
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = match command.spawn() {
        Ok(child) => child,
        Err(error) => {
            return CtrOutput {
                code: None,
                stdout: String::new(),
                stderr: format!("spawn failed: {error}"),
            };
        }
    };
    let echo = stdin.and_then(|data| {
        let (pipe, stdout) = (child.stdin.take()?, child.stdout.take()?);
        Some(feed_until_echoed(data, pipe, stdout, timeout))
    });
    let pid = child.id();
    let (sender, receiver) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = sender.send(child.wait_with_output());
    });
    match receiver.recv_timeout(timeout) {
        Ok(Ok(output)) => CtrOutput {
            code: exit_code(output.status),
            stdout: String::from_utf8_lossy(&match echo {
                Some(reader) => reader.join().unwrap_or_default(),
                None => output.stdout,
            })
            .into_owned(),
            stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        },
        Ok(Err(error)) => CtrOutput {
            code: None,
            stdout: String::new(),
            stderr: error.to_string(),
        },
        Err(_) => {
            if let Ok(pid) = i32::try_from(pid) {
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
            CtrOutput {
                code: None,
                stdout: String::new(),
                stderr: format!("timed out after {timeout:?}"),
            }
        }
    }
}

fn exit_code(status: ExitStatus) -> Option<i32> {
    status.code()
}

/// The major version of [`containerd_program`], from `containerd --version`
/// (`containerd github.com/containerd/containerd[/v2] [v]X.Y.Z ...`).
pub fn major_version() -> Result<u32, Error> {
    let program = containerd_program();
    let error = |detail: String| Error::Version {
        program: program.display().to_string(),
        detail,
    };
    let output = Command::new(&program)
        .arg("--version")
        .output()
        .map_err(|source| error(source.to_string()))?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    parse_major_version(&stdout).ok_or_else(|| error(format!("unexpected output {stdout:?}")))
}

fn parse_major_version(version_line: &str) -> Option<u32> {
    let version = version_line.split_whitespace().nth(2)?;
    let digits: String = version
        .trim_start_matches('v')
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

/// Where a containerd's config comes from.
#[derive(Clone, Copy)]
enum Config<'a> {
    /// No CRI (the tests that drive containerd's own API).
    Plain,
    /// The CRI plugin with these tables.
    Cri(&'a str),
    /// A node's, written into this host root's etc/containerd/config.toml ([`Containerd::start_as_node`]).
    Node(&'a Path),
}

/// The config for a containerd of major version `major`: format 2 for 1.x; format 3 for 2.x, where CRI is
/// split into more plugins (the sandbox controller needs the runtime one) and NRI (whose socket is
/// machine-wide, /var/run/nri) is on by default.
fn config_toml(dir: &Path, major: u32) -> String {
    let (format, extra_disabled) = if major >= 2 {
        (
            3,
            r#", "io.containerd.cri.v1.images", "io.containerd.cri.v1.runtime", "io.containerd.podsandbox.controller.v1.podsandbox", "io.containerd.nri.v1.nri""#,
        )
    } else {
        (2, "")
    };
    config_with(
        dir,
        format,
        &format!(r#""io.containerd.grpc.v1.cri", {SNAPSHOTTERS_OFF}{extra_disabled}"#),
        "",
    )
}

/// The config of a containerd with the CRI plugin on, `cri` appended: format 2 for 1.x, format 3 for 2.x,
/// where NRI stays off (its socket is machine-wide).
fn cri_config_toml(dir: &Path, major: u32, cri: &str) -> String {
    let (format, nri) = if major >= 2 {
        (3, r#", "io.containerd.nri.v1.nri""#)
    } else {
        (2, "")
    };
    config_with(
        dir,
        format,
        &format!("{SNAPSHOTTERS_OFF}{nri}"),
        &format!("\n{cri}"),
    )
}

/// The snapshotters no test uses (they probe for their backing stores at start).
const SNAPSHOTTERS_OFF: &str = r#""io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs""#;

/// A config of format `format` with its root, state and sockets under `dir`, plugins `disabled` (a TOML
/// list's items) off, and `tail` appended.
fn config_with(dir: &Path, format: u32, disabled: &str, tail: &str) -> String {
    let dir = dir.display();
    format!(
        r#"version = {format}
root = "{dir}/root"
state = "{dir}/state"
disabled_plugins = [{disabled}]

[grpc]
  address = "{dir}/containerd.sock"

[ttrpc]
  address = "{dir}/containerd.sock.ttrpc"

[debug]
  level = "info"
{tail}"#
    )
}

/// The last `lines` lines of the text file at `path` (empty when it cannot be read).
/// The last `lines` lines of the file at `path` (empty when it cannot be read).
pub(crate) fn tail_of(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let tail: Vec<&str> = text.lines().rev().take(lines).collect();
    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
}

#[cfg(test)]
mod tests {
    use super::parse_major_version;

    #[test]
    fn reads_the_major_version_of_debian_and_upstream_builds() {
        let debian = "containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1+b1\n";
        let upstream = "containerd github.com/containerd/containerd/v2 v2.3.4 0123abc\n";
        // Debian unstable's package, which tools/setup.sh caches (no "v", no commit).
        let debian_2 = "containerd github.com/containerd/containerd/v2 2.1.9+unknown \n";
        assert_eq!(parse_major_version(debian), Some(1));
        assert_eq!(parse_major_version(upstream), Some(2));
        assert_eq!(parse_major_version(debian_2), Some(2));
        assert_eq!(parse_major_version("containerd\n"), None);
    }
}
