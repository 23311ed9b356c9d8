//! runc, driven so that the reaper never steals its exit status: every runc command is spawned by
//! [`ShimExecutor`], which subscribes to the crate's exit monitor before spawning and takes the
//! status from there instead of from `waitpid` on the child. [`RuncGlobal`] holds the global
//! flags every runc command of a container gets.

use std::{
    os::unix::process::ExitStatusExt,
    path::{Path, PathBuf},
    process::{ExitStatus, Stdio},
    sync::Arc,
};

use async_trait::async_trait;
use containerd_shim::{
    asynchronous::monitor::{monitor_subscribe, monitor_unsubscribe},
    monitor::{Subject, Topic},
};
use containerd_shim_protos::shim::oci::Options as RuncOptions;
use runc::{Command, Runc, Spawner, options::GlobalOpts};
use tokio::io::{AsyncRead, AsyncReadExt};

use crate::{
    errors::{Result, ShimError},
    reaper,
};

/// runc's global flags, the same for every subcommand of one container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuncGlobal {
    /// runc binary.
    pub binary: PathBuf,
    /// `--root` (state directory, per namespace).
    pub root: PathBuf,
    /// `--log` file (JSON) in the bundle.
    pub log: PathBuf,
    /// `--systemd-cgroup`.
    pub systemd_cgroup: bool,
    /// The CRIU of checkpoints and restores ([`RuncGlobal::with_criu`]); `None`: runc's own choice.
    pub criu: Option<PathBuf>,
}

impl RuncGlobal {
    /// The default runc root containerd's runc shim uses.
    pub const DEFAULT_ROOT: &'static str = "/run/containerd/runc";

    /// Global flags for a container of `namespace` in `bundle` with runc `options`.
    pub fn new(options: &RuncOptions, namespace: &str, bundle: &Path) -> Self {
        let binary = if options.binary_name.is_empty() {
            PathBuf::from("runc")
        } else {
            PathBuf::from(&options.binary_name)
        };
        let root = if options.root.is_empty() {
            Path::new(Self::DEFAULT_ROOT)
        } else {
            Path::new(&options.root)
        };
        Self {
            binary,
            root: root.join(namespace),
            log: bundle.join("log.json"),
            systemd_cgroup: options.systemd_cgroup,
            criu: None,
        }
    }

    /// These flags with `criu` as the CRIU of checkpoints and restores.
    pub fn with_criu(self, criu: Option<PathBuf>) -> Self {
        Self { criu, ..self }
    }

    /// What makes runc run [`RuncGlobal::criu`]: `--criu PATH` (runc 1.1 and older; 1.2 ignores it with a
    /// warning) before the subcommand, and the PATH runc is to run with, CRIU's folder first (runc 1.2 and
    /// later look `criu` up in PATH only, so a program of another name is found by the old runcs alone).
    pub fn criu_flags(&self) -> (Vec<String>, Option<std::ffi::OsString>) {
        let Some(criu) = &self.criu else {
            return (Vec::new(), None);
        };
        let flags = vec!["--criu".to_string(), criu.display().to_string()];
        let dir = criu.parent().map(Path::to_path_buf).unwrap_or_default();
        let rest = std::env::var_os("PATH").unwrap_or_default();
        let path =
            std::env::join_paths(std::iter::once(dir).chain(std::env::split_paths(&rest))).ok();
        (flags, path)
    }

    /// The flags in the order go-runc writes them.
    pub fn args(&self) -> Vec<String> {
        let mut args = vec![
            "--root".to_string(),
            self.root.display().to_string(),
            "--log".to_string(),
            self.log.display().to_string(),
            "--log-format".to_string(),
            "json".to_string(),
        ];
        if self.systemd_cgroup {
            args.push("--systemd-cgroup".to_string());
        }
        args
    }
}

/// Spawns runc commands and waits for them through the exit monitor.
#[derive(Debug, Default)]
pub struct ShimExecutor;

async fn read_all(pipe: Option<impl AsyncRead + Unpin>) -> String {
    let mut out = Vec::new();
    if let Some(mut pipe) = pipe {
        // A read error only loses diagnostics; the exit status still decides.
        let _ = pipe.read_to_end(&mut out).await;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The status the monitor reports (exit code, or 128+signal) as an `ExitStatus`.
fn exit_status_from_code(code: i32) -> ExitStatus {
    if code > 128 && code < 128 + 65 {
        ExitStatus::from_raw(code - 128)
    } else {
        ExitStatus::from_raw((code & 0xff) << 8)
    }
}

#[async_trait]
impl Spawner for ShimExecutor {
    async fn execute(&self, cmd: Command) -> runc::Result<(ExitStatus, u32, String, String)> {
        let ran = execute_within(cmd, None).await?;
        Ok((ran.status, ran.pid, ran.stdout, ran.stderr))
    }
}

/// How a program run by [`execute_within`] ended.
struct Ran {
    status: ExitStatus,
    pid: u32,
    stdout: String,
    stderr: String,
    /// It ran past its time limit and was killed.
    timed_out: bool,
}

/// Spawns `cmd` and waits for it through the exit monitor; past `limit` (if any) it is killed (SIGKILL) and
/// waited for.
async fn execute_within(mut cmd: Command, limit: Option<std::time::Duration>) -> runc::Result<Ran> {
    let mut sub = monitor_subscribe(Topic::Pid)
        .await
        .map_err(|e| runc::error::Error::Other(Box::new(e)))?;
    let mut child = match cmd.spawn() {
        Ok(c) => c,
        Err(e) => {
            let _ = monitor_unsubscribe(sub.id).await;
            return Err(runc::error::Error::ProcessSpawnFailed(e));
        }
    };
    // `cmd` may hold fds meant for the child (stdio pipes): drop them now so EOF can come.
    drop(cmd);
    let pid = child.id().unwrap_or_default();
    reaper::register_command(pid as i32);
    let wait = async {
        while let Some(ev) = sub.rx.recv().await {
            if let Subject::Pid(p) = ev.subject
                && p == pid as i32
            {
                return ev.exit_code;
            }
        }
        -1
    };
    let outputs = async {
        tokio::join!(
            read_all(child.stdout.take()),
            read_all(child.stderr.take()),
            wait
        )
    };
    tokio::pin!(outputs);
    let mut timed_out = false;
    let (stdout, stderr, code) = match limit {
        None => outputs.await,
        Some(limit) => match tokio::time::timeout(limit, &mut outputs).await {
            Ok(done) => done,
            Err(_) => {
                timed_out = true;
                // Killed, it exits and closes its pipes (the monitor still reports its exit).
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
                outputs.await
            }
        },
    };
    let _ = monitor_unsubscribe(sub.id).await;
    // Its exit may have come before it was registered: drop the entry either way.
    reaper::forget(pid as i32);
    Ok(Ran {
        status: exit_status_from_code(code),
        pid,
        stdout,
        stderr,
        timed_out,
    })
}

/// Builds the runc client for a container from its global flags.
pub fn runc_client(global: &RuncGlobal) -> Result<Runc> {
    let mut opts = GlobalOpts::new()
        .command(&global.binary)
        .root(&global.root)
        .log(&global.log)
        .log_json()
        .systemd_cgroup(global.systemd_cgroup);
    opts.custom_spawner(Arc::new(ShimExecutor));
    opts.build().map_err(|e| {
        ShimError::Other(format!(
            "runc binary {}: {e}: install runc or set BinaryName in the runtime options",
            global.binary.display()
        ))
    })
}

/// What became of a program the shim ran ([`run_program`]).
#[derive(Debug)]
pub enum ProgramError {
    /// It could not be run.
    Spawn(String),
    /// It ran past its time limit and was killed; what it had printed.
    TimedOut {
        /// Its stdout and stderr.
        output: String,
    },
}

/// Runs any program the shim needs (cuda-checkpoint) through [`ShimExecutor`], so the reaper never steals
/// its exit status: its status, stdout and stderr, or what made it fail to run. Past `limit` it is killed.
pub async fn run_program(
    binary: &Path,
    args: &[String],
    limit: Option<std::time::Duration>,
) -> std::result::Result<(ExitStatus, String, String), ProgramError> {
    let mut cmd = Command::new(binary);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let ran = execute_within(cmd, limit)
        .await
        .map_err(|e| ProgramError::Spawn(e.to_string()))?;
    if ran.timed_out {
        return Err(ProgramError::TimedOut {
            output: format!("{}{}", ran.stdout.trim(), ran.stderr.trim()),
        });
    }
    Ok((ran.status, ran.stdout, ran.stderr))
}

/// Runs runc's `args...` (a checkpoint or restore, which the runc crate does not cover; with the container's
/// CRIU: [`RuncGlobal::criu_flags`]) through the reaper-safe executor. Returns stdout; a non-zero exit is a
/// [`ShimError::Runtime`].
pub async fn run_raw(
    global: &RuncGlobal,
    args: &[String],
    action: &'static str,
    id: &str,
) -> Result<String> {
    let mut cmd = Command::new(&global.binary);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let (_, Some(path)) = global.criu_flags() {
        cmd.env("PATH", path);
    }
    let (status, _pid, stdout, stderr) = ShimExecutor
        .execute(cmd)
        .await
        .map_err(|e| ShimError::runtime(action, id, e))?;
    if status.success() {
        Ok(stdout)
    } else {
        Err(ShimError::Runtime {
            action,
            id: id.to_string(),
            message: format!("{status}: {}{}", stdout.trim(), stderr.trim()),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;
    use crate::checkpoint::{CriuOpts, checkpoint_args};

    /// A fake runc that records its argv and PATH and fails when a `fail` file exists.
    fn fake_runc(dir: &Path) -> std::path::PathBuf {
        let path = dir.join("runc");
        let script = format!(
            "#!/bin/sh\necho \"$@\" > {d}/argv\necho \"$PATH\" > {d}/path\nif [ -e {d}/fail ]; then echo 'criu: dump failed' >&2; exit 1; fi\nexit 0\n",
            d = dir.display()
        );
        std::fs::write(&path, script).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    #[tokio::test]
    async fn checkpoint_runs_runc_with_the_built_argv_and_reports_failure() {
        tokio::spawn(crate::reaper::reap_children());
        let dir = tempfile::tempdir().unwrap();
        let runc = fake_runc(dir.path());
        let global = RuncGlobal {
            binary: runc.clone(),
            root: "/run/test-root".into(),
            log: dir.path().join("log.json"),
            systemd_cgroup: false,
            criu: None,
        };
        let criu = CriuOpts::for_checkpoint("/img", None, &Default::default()).unwrap();
        let args = checkpoint_args(&global, "c1", &criu);
        run_raw(&global, &args, "checkpoint", "c1").await.unwrap();
        let argv = std::fs::read_to_string(dir.path().join("argv")).unwrap();
        assert_eq!(argv.trim(), args.join(" "));
        assert!(argv.contains("checkpoint --image-path /img --leave-running c1"));
        assert!(!argv.contains("--criu"), "{argv}");

        // A node's CRIU: named to runc 1.1 (`--criu`) and first on the PATH runc 1.2 looks it up in.
        let global = global.with_criu(Some("/opt/criu-4/bin/criu".into()));
        let args = checkpoint_args(&global, "c1", &criu);
        run_raw(&global, &args, "checkpoint", "c1").await.unwrap();
        let argv = std::fs::read_to_string(dir.path().join("argv")).unwrap();
        assert!(
            argv.contains("--criu /opt/criu-4/bin/criu checkpoint "),
            "a global flag, before the subcommand: {argv}"
        );
        let path = std::fs::read_to_string(dir.path().join("path")).unwrap();
        assert!(path.starts_with("/opt/criu-4/bin:"), "{path}");

        std::fs::write(dir.path().join("fail"), "").unwrap();
        let err = run_raw(&global, &args, "checkpoint", "c1")
            .await
            .unwrap_err();
        assert!(matches!(
            err,
            ShimError::Runtime {
                action: "checkpoint",
                ..
            }
        ));
        assert!(err.to_string().contains("dump failed"), "{err}");
    }
}
