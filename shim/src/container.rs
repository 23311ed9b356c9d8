//! One container: its runc client, init process and exec processes, and the operations on them.
//! Each operation checks the process state machine first, runs runc, and commits the new state
//! only when runc succeeded; a failed Create undoes what it did (runc delete, unmount rootfs).

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::Arc,
    time::SystemTime,
};

use containerd_shim::asynchronous::util::{mount_rootfs, write_options, write_runtime};
use containerd_shim_protos::{
    api::{CreateTaskRequest, ProcessInfo},
    protobuf::{Message, well_known_types::any::Any},
    shim::oci::{Options as RuncOptions, ProcessDetails},
};
use runc::{
    Runc,
    options::{CreateOpts, DeleteOpts, ExecOpts, KillOpts},
};
use tokio::sync::{Mutex, watch};

use crate::{
    checkpoint::{self, CriuOpts, RestoreTarget, RuncGlobal},
    console::ConsoleSocket,
    errors::{Result, ShimError},
    io::{ProcessPipes, StdioSpec, start_console_copies, start_pipe_copies},
    options::BatonSettings,
    process::{ExitInfo, Op, Process, State},
    reaper::{self, ProcessKey},
    runtime,
};

/// Pid file of the init process in the bundle.
const INIT_PID_FILE: &str = "init.pid";

/// The processes of a container, behind one lock.
pub struct Procs {
    /// The init process.
    pub init: Process,
    /// Exec processes by exec id.
    pub execs: HashMap<String, Process>,
}

impl Procs {
    /// The process `exec_id` (empty: init).
    pub fn get(&self, id: &str, exec_id: &str) -> Result<&Process> {
        if exec_id.is_empty() {
            return Ok(&self.init);
        }
        self.execs
            .get(exec_id)
            .ok_or_else(|| ShimError::ProcessNotFound {
                id: id.to_string(),
                exec_id: exec_id.to_string(),
            })
    }

    /// Mutable [`Self::get`].
    pub fn get_mut(&mut self, id: &str, exec_id: &str) -> Result<&mut Process> {
        if exec_id.is_empty() {
            return Ok(&mut self.init);
        }
        self.execs
            .get_mut(exec_id)
            .ok_or_else(|| ShimError::ProcessNotFound {
                id: id.to_string(),
                exec_id: exec_id.to_string(),
            })
    }
}

/// A container served by this shim.
pub struct Container {
    /// Container id.
    pub id: String,
    /// Bundle directory.
    pub bundle: PathBuf,
    /// containerd namespace.
    pub namespace: String,
    /// runc global flags (also used for checkpoint/restore).
    pub global: RuncGlobal,
    /// runc client.
    pub runc: Runc,
    /// runc options from Create.
    pub options: RuncOptions,
    /// Baton settings after layering.
    pub settings: BatonSettings,
    /// The processes.
    pub procs: Mutex<Procs>,
    /// Background tasks (OOM watch) to stop on delete.
    pub tasks: std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>,
    /// OOM counter of the container's memory cgroup, once known.
    pub oom: std::sync::OnceLock<Arc<crate::oom::OomWatch>>,
    /// Held while a start and its event are published, and while an exit is published, so that
    /// TaskExit never overtakes TaskStart / TaskExecStarted.
    pub event_gate: Mutex<()>,
}

/// Reads the last error runc wrote to its JSON log, for error messages.
fn last_runc_error(log: &Path) -> String {
    let Ok(text) = std::fs::read_to_string(log) else {
        return String::new();
    };
    text.lines()
        .rev()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["level"] == "error")
        .and_then(|v| v["msg"].as_str().map(str::to_string))
        .unwrap_or_default()
}

fn with_log(err: ShimError, log: &Path) -> ShimError {
    match err {
        ShimError::Runtime {
            action,
            id,
            message,
        } => {
            let detail = last_runc_error(log);
            let message = if detail.is_empty() || message.contains(&detail) {
                message
            } else {
                format!("{message}: {detail}")
            };
            ShimError::Runtime {
                action,
                id,
                message,
            }
        }
        other => other,
    }
}

async fn read_pid(path: &Path) -> Result<u32> {
    let text = tokio::fs::read_to_string(path)
        .await
        .map_err(|e| ShimError::io(format!("read pid file {}", path.display()), e))?;
    text.trim()
        .parse()
        .map_err(|_| ShimError::Other(format!("pid file {} holds {text:?}", path.display())))
}

/// Checks the bundle before anything is mounted: it must exist and hold a valid config.json.
pub fn load_spec(bundle: &Path) -> Result<oci_spec::runtime::Spec> {
    let config = bundle.join("config.json");
    if !bundle.is_dir() {
        return Err(ShimError::InvalidArgument(format!(
            "bundle {} does not exist",
            bundle.display()
        )));
    }
    let text = std::fs::read_to_string(&config)
        .map_err(|e| ShimError::io(format!("read {}", config.display()), e))?;
    serde_json::from_str(&text)
        .map_err(|e| ShimError::InvalidArgument(format!("invalid {}: {e}", config.display())))
}

fn unmount_rootfs(bundle: &Path) {
    let rootfs = bundle.join("rootfs");
    if let Some(path) = rootfs.to_str()
        && let Err(e) = containerd_shim::mount::umount_recursive(Some(path), 0)
    {
        tracing::warn!(rootfs = path, error = %e, "unmount rootfs failed");
    }
}

impl Container {
    /// Creates the container (runc create, or the checkpointed state that Start restores).
    pub async fn create(
        req: &CreateTaskRequest,
        namespace: &str,
        options: RuncOptions,
        settings: BatonSettings,
    ) -> Result<Self> {
        let id = req.id.clone();
        let bundle = PathBuf::from(&req.bundle);
        load_spec(&bundle)?;
        write_options(&bundle, &options).await?;
        let global = RuncGlobal::new(&options, namespace, &bundle);
        write_runtime(&bundle, &global.binary.display().to_string()).await?;
        let runc = runtime::runc_client(&global)?;

        if !req.rootfs.is_empty() {
            let rootfs = bundle.join("rootfs");
            tokio::fs::create_dir_all(&rootfs)
                .await
                .map_err(|e| ShimError::io(format!("create {}", rootfs.display()), e))?;
            for m in &req.rootfs {
                if let Err(e) = mount_rootfs(m, &rootfs).await {
                    unmount_rootfs(&bundle);
                    return Err(e.into());
                }
            }
        }
        let stdio = StdioSpec {
            stdin: req.stdin.clone(),
            stdout: req.stdout.clone(),
            stderr: req.stderr.clone(),
            terminal: req.terminal,
        };
        let mut init = Process::new(&id, "", stdio);
        let container = Self {
            id: id.clone(),
            bundle: bundle.clone(),
            namespace: namespace.to_string(),
            global,
            runc,
            options,
            settings,
            procs: Mutex::new(Procs {
                init: Process::new(&id, "", StdioSpec::default()),
                execs: HashMap::new(),
            }),
            tasks: std::sync::Mutex::new(Vec::new()),
            oom: std::sync::OnceLock::new(),
            event_gate: Mutex::new(()),
        };
        if !req.checkpoint.is_empty() {
            init.restore = Some(CriuOpts::for_restore(
                &req.checkpoint,
                &req.parent_checkpoint,
                &container.options,
            ));
            init.state = State::CreatedCheckpoint;
        } else if let Err(e) = container.runc_create(&mut init).await {
            init.io.abort().await;
            let _ = container
                .runc
                .delete(&id, Some(&DeleteOpts::new().force(true)))
                .await;
            unmount_rootfs(&bundle);
            return Err(with_log(e, &container.global.log));
        }
        container.procs.lock().await.init = init;
        Ok(container)
    }

    async fn runc_create(&self, init: &mut Process) -> Result<()> {
        let pid_file = self.bundle.join(INIT_PID_FILE);
        let mut opts = CreateOpts::new()
            .pid_file(&pid_file)
            .no_pivot(self.options.no_pivot_root)
            .no_new_keyring(self.options.no_new_keyring);
        let console = if init.stdio.terminal {
            let socket = ConsoleSocket::new()?;
            opts.console_socket = Some(socket.path());
            Some(socket)
        } else {
            None
        };
        let pipes = if init.stdio.terminal {
            None
        } else {
            let p = Arc::new(ProcessPipes::new(
                &init.stdio,
                self.options.io_uid,
                self.options.io_gid,
            )?);
            opts.io = Some(p.clone());
            Some(p)
        };
        self.runc
            .create(&self.id, &self.bundle, Some(&opts))
            .await
            .map_err(|e| ShimError::runtime("create", &self.id, e))?;
        self.attach_io(init, console, pipes).await?;
        init.pid = read_pid(&pid_file).await?;
        self.register(init, "");
        Ok(())
    }

    async fn attach_io(
        &self,
        p: &mut Process,
        console: Option<ConsoleSocket>,
        pipes: Option<Arc<ProcessPipes>>,
    ) -> Result<()> {
        if let Some(socket) = console {
            let pty = socket.receive_master().await?;
            start_console_copies(&pty, &p.stdio, &p.io)?;
            p.console = Some(pty);
        } else if let Some(pipes) = pipes {
            start_pipe_copies(&pipes, &p.stdio, &p.io, &p.stdin, &self.id, &self.namespace).await?;
        }
        Ok(())
    }

    /// Registers the pid with the reaper; an exit that already happened is applied at once.
    fn register(&self, p: &mut Process, exec_id: &str) {
        let key = ProcessKey {
            id: self.id.clone(),
            exec_id: exec_id.to_string(),
        };
        if let Some(exit) = reaper::register_process(p.pid as i32, key) {
            p.set_exited(exit.code as u32, exit.at);
            p.exit_unpublished = true;
        }
    }

    /// Starts the init process (restoring it when created from a checkpoint). Returns its pid.
    pub async fn start_init(&self) -> Result<u32> {
        let mut procs = self.procs.lock().await;
        let next = procs.init.check(Op::Start)?;
        if let Some(criu) = procs.init.restore.clone() {
            self.restore(&mut procs.init, &criu)
                .await
                .map_err(|e| with_log(e, &self.global.log))?;
            procs.init.restore = None;
        } else {
            self.runc.start(&self.id).await.map_err(|e| {
                with_log(ShimError::runtime("start", &self.id, e), &self.global.log)
            })?;
        }
        // An exit seen meanwhile wins over Running.
        if procs.init.state != State::Stopped {
            procs.init.state = next;
        }
        Ok(procs.init.pid)
    }

    async fn restore(&self, init: &mut Process, criu: &CriuOpts) -> Result<()> {
        let pid_file = self.bundle.join(INIT_PID_FILE);
        let console = if init.stdio.terminal {
            Some(ConsoleSocket::new()?)
        } else {
            None
        };
        let target = RestoreTarget {
            bundle: self.bundle.clone(),
            pid_file: pid_file.clone(),
            console_socket: console.as_ref().map(ConsoleSocket::path),
            no_pivot: self.options.no_pivot_root,
        };
        let args = checkpoint::restore_args(&self.global, &self.id, criu, &target);
        if init.stdio.terminal {
            runtime::run_raw(&self.global.binary, &args, "restore", &self.id).await?;
        } else {
            let pipes = Arc::new(ProcessPipes::new(
                &init.stdio,
                self.options.io_uid,
                self.options.io_gid,
            )?);
            let mut cmd = runc::Command::new(&self.global.binary);
            // What runc (and so CRIU's inherited stdio) gets; the pipes replace these below.
            cmd.args(&args)
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped());
            runc::Io::set(pipes.as_ref(), &mut cmd)
                .await
                .map_err(|e| ShimError::io("set restore stdio", e))?;
            let (status, _, out, err) = runc::Spawner::execute(&runtime::ShimExecutor, cmd)
                .await
                .map_err(|e| ShimError::runtime("restore", &self.id, e))?;
            runc::Io::close_after_start(pipes.as_ref()).await;
            if !status.success() {
                return Err(ShimError::Runtime {
                    action: "restore",
                    id: self.id.clone(),
                    message: format!("{status}: {}{}", out.trim(), err.trim()),
                });
            }
            self.attach_io(init, None, Some(pipes)).await?;
        }
        if let Some(socket) = console {
            self.attach_io(init, Some(socket), None).await?;
        }
        init.pid = read_pid(&pid_file).await?;
        self.register(init, "");
        Ok(())
    }

    /// Adds an exec process (not started yet).
    pub async fn add_exec(&self, exec_id: &str, stdio: StdioSpec, spec: &Any) -> Result<()> {
        let process: oci_spec::runtime::Process =
            serde_json::from_slice(&spec.value).map_err(|e| {
                ShimError::InvalidArgument(format!("exec {exec_id}: invalid process spec: {e}"))
            })?;
        let mut procs = self.procs.lock().await;
        procs.init.check(Op::Exec)?;
        if exec_id.is_empty() {
            return Err(ShimError::InvalidArgument(
                "exec id must not be empty".into(),
            ));
        }
        if procs.execs.contains_key(exec_id) {
            return Err(ShimError::AlreadyExists {
                what: "exec",
                id: format!("{}/{exec_id}", self.id),
            });
        }
        let mut p = Process::new(&self.id, exec_id, stdio);
        p.exec_spec = Some(process);
        procs.execs.insert(exec_id.to_string(), p);
        Ok(())
    }

    /// Starts exec process `exec_id` (`runc exec --detach`). Returns its pid.
    pub async fn start_exec(&self, exec_id: &str) -> Result<u32> {
        let mut procs = self.procs.lock().await;
        if matches!(procs.init.state, State::Stopped | State::Deleted) {
            return Err(ShimError::FailedPrecondition {
                id: self.id.clone(),
                action: "exec in",
                state: "stopped".into(),
            });
        }
        let p = procs.get_mut(&self.id, exec_id)?;
        let next = p.check(Op::Start)?;
        let spec = p
            .exec_spec
            .clone()
            .ok_or_else(|| ShimError::Other(format!("{} has no spec", p.name())))?;
        let pid_file = self.bundle.join(format!("{exec_id}.pid"));
        let mut opts = ExecOpts::new().pid_file(&pid_file).detach(true);
        let console = if p.stdio.terminal {
            let socket = ConsoleSocket::new()?;
            opts.console_socket = Some(socket.path());
            Some(socket)
        } else {
            None
        };
        let pipes = if p.stdio.terminal {
            None
        } else {
            let pipes = Arc::new(ProcessPipes::new(
                &p.stdio,
                self.options.io_uid,
                self.options.io_gid,
            )?);
            opts.io = Some(pipes.clone());
            Some(pipes)
        };
        if let Err(e) = self.runc.exec(&self.id, &spec, Some(&opts)).await {
            return Err(with_log(
                ShimError::runtime("exec", &self.id, e),
                &self.global.log,
            ));
        }
        if let Err(e) = self.attach_io(p, console, pipes).await {
            p.io.abort().await;
            return Err(e);
        }
        p.pid = read_pid(&pid_file).await?;
        let _ = tokio::fs::remove_file(&pid_file).await;
        p.state = next;
        self.register(p, exec_id);
        Ok(p.pid)
    }

    /// Signals a process (`all`: every process of the container, init only).
    pub async fn kill(&self, exec_id: &str, signal: u32, all: bool) -> Result<()> {
        let procs = self.procs.lock().await;
        let p = procs.get(&self.id, exec_id)?;
        p.check(Op::Kill)?;
        if exec_id.is_empty() {
            let opts = KillOpts::new().all(all);
            self.runc
                .kill(&self.id, signal, Some(&opts))
                .await
                .map_err(|e| {
                    let err = ShimError::runtime("kill", &self.id, e);
                    if err.to_string().contains("not running")
                        || err.to_string().contains("process already finished")
                    {
                        ShimError::ProcessFinished {
                            id: self.id.clone(),
                        }
                    } else {
                        err
                    }
                })
        } else {
            let sig = nix::sys::signal::Signal::try_from(signal as i32)
                .map_err(|_| ShimError::InvalidArgument(format!("invalid signal {signal}")))?;
            nix::sys::signal::kill(nix::unistd::Pid::from_raw(p.pid as i32), sig).map_err(|e| {
                if e == nix::errno::Errno::ESRCH {
                    ShimError::ProcessFinished { id: p.name() }
                } else {
                    ShimError::io(format!("kill {}", p.name()), e.into())
                }
            })
        }
    }

    /// Pauses (true) or resumes (false) the container.
    pub async fn set_paused(&self, pause: bool) -> Result<()> {
        let mut procs = self.procs.lock().await;
        let next = procs
            .init
            .check(if pause { Op::Pause } else { Op::Resume })?;
        let res = if pause {
            self.runc.pause(&self.id).await
        } else {
            self.runc.resume(&self.id).await
        };
        res.map_err(|e| ShimError::runtime(if pause { "pause" } else { "resume" }, &self.id, e))?;
        if procs.init.state != State::Stopped {
            procs.init.state = next;
        }
        Ok(())
    }

    /// Checkpoints the container with CRIU (`runc checkpoint`).
    pub async fn checkpoint(&self, path: &str, options: Option<&Any>) -> Result<()> {
        let procs = self.procs.lock().await;
        procs.init.check(Op::Checkpoint)?;
        let criu = CriuOpts::for_checkpoint(path, options, &self.options)?;
        let args = checkpoint::checkpoint_args(&self.global, &self.id, &criu);
        drop(procs);
        runtime::run_raw(&self.global.binary, &args, "checkpoint", &self.id)
            .await
            .map(|_| ())
            .map_err(|e| with_log(e, &self.global.log))
    }

    /// Updates the container's resources (JSON of an OCI `LinuxResources`).
    pub async fn update(&self, resources: &Any) -> Result<()> {
        let procs = self.procs.lock().await;
        procs.init.check(Op::Update)?;
        let res: oci_spec::runtime::LinuxResources = serde_json::from_slice(&resources.value)
            .map_err(|e| {
                ShimError::InvalidArgument(format!("update {}: invalid resources: {e}", self.id))
            })?;
        self.runc
            .update(&self.id, &res)
            .await
            .map_err(|e| ShimError::runtime("update", &self.id, e))
    }

    /// The container's pids, exec processes labelled with their exec id.
    pub async fn pids(&self) -> Result<Vec<ProcessInfo>> {
        let pids = self
            .runc
            .ps(&self.id)
            .await
            .map_err(|e| ShimError::runtime("ps", &self.id, e))?;
        let procs = self.procs.lock().await;
        let by_pid: HashMap<u32, &str> = procs
            .execs
            .values()
            .map(|p| (p.pid, p.exec_id.as_str()))
            .collect();
        Ok(pids
            .into_iter()
            .map(|pid| {
                let pid = pid as u32;
                let mut info = ProcessInfo {
                    pid,
                    ..Default::default()
                };
                if let Some(exec_id) = by_pid.get(&pid) {
                    let details = ProcessDetails {
                        exec_id: exec_id.to_string(),
                        ..Default::default()
                    };
                    if let Ok(value) = details.write_to_bytes() {
                        info.info = Some(Any {
                            type_url: "containerd.runc.v1.ProcessDetails".into(),
                            value,
                            ..Default::default()
                        })
                        .into();
                    }
                }
                info
            })
            .collect())
    }

    /// A receiver that yields the exit of `exec_id` (empty: init).
    pub async fn exit_receiver(&self, exec_id: &str) -> Result<watch::Receiver<Option<ExitInfo>>> {
        let procs = self.procs.lock().await;
        Ok(procs.get(&self.id, exec_id)?.exit_tx.subscribe())
    }

    /// Takes an exit that was applied at registration and not yet published.
    pub async fn take_unpublished_exit(&self, exec_id: &str) -> Option<(u32, ExitInfo)> {
        let mut procs = self.procs.lock().await;
        let p = procs.get_mut(&self.id, exec_id).ok()?;
        if !std::mem::take(&mut p.exit_unpublished) {
            return None;
        }
        Some((p.pid, p.exit_info()?))
    }

    /// Deletes exec `exec_id`, or the container itself when empty. Returns pid and exit.
    pub async fn delete(&self, exec_id: &str) -> Result<(u32, ExitInfo)> {
        let mut procs = self.procs.lock().await;
        let p = procs.get(&self.id, exec_id)?;
        p.check(Op::Delete)?;
        let pid = p.pid;
        let exit = p.exit_info().unwrap_or(ExitInfo {
            status: 0,
            at: Some(SystemTime::now()),
        });
        if !exec_id.is_empty() {
            if let Some(p) = procs.execs.remove(exec_id) {
                p.io.shutdown().await;
                reaper::forget(p.pid as i32);
            }
            return Ok((pid, exit));
        }
        if let Err(e) = self
            .runc
            .delete(&self.id, Some(&DeleteOpts::new().force(true)))
            .await
        {
            let err = ShimError::runtime("delete", &self.id, e);
            // A container runc no longer knows is deleted already.
            if !err.to_string().contains("does not exist") {
                return Err(err);
            }
        }
        procs.init.io.shutdown().await;
        for p in procs.execs.values() {
            p.io.abort().await;
        }
        procs.init.state = State::Deleted;
        reaper::forget(pid as i32);
        unmount_rootfs(&self.bundle);
        for t in self
            .tasks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .drain(..)
        {
            t.abort();
        }
        Ok((pid, exit))
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write as _;

    use super::*;
    use crate::fake_runc::{FakeRunc, exclusive};

    fn runc_options(fake: &FakeRunc) -> RuncOptions {
        let mut o = RuncOptions::new();
        o.binary_name = fake.binary.display().to_string();
        o.root = fake.dir().join("root").display().to_string();
        o
    }

    /// A container created from a checkpoint (non-TTY, with stdin): Start restores it, and the
    /// restored process reads what containerd writes into the request's stdin fifo, until
    /// CloseIO ends its input.
    #[tokio::test]
    async fn restore_hands_the_request_stdin_to_the_restored_process() {
        let _guard = exclusive().await;
        let fake = FakeRunc::new();
        let stdin = fake.fifo("r1-stdin");
        let req = CreateTaskRequest {
            id: "r1".into(),
            bundle: fake.bundle("r1").display().to_string(),
            stdin: stdin.display().to_string(),
            checkpoint: "/ckpt/r1".into(),
            ..Default::default()
        };
        let c = Container::create(&req, "test", runc_options(&fake), BatonSettings::default())
            .await
            .unwrap();
        let global = c.global.args();
        assert!(
            fake.take_calls(&global).is_empty(),
            "restore waits for Start"
        );
        assert_eq!(c.procs.lock().await.init.state, State::CreatedCheckpoint);

        let pid = c.start_init().await.unwrap();
        assert_eq!(Some(pid as i32), fake.pid_of("r1"));
        let calls = fake.take_calls(&global);
        assert_eq!(calls.len(), 1, "{calls:?}");
        assert!(
            calls[0].starts_with("restore --image-path /ckpt/r1 --detach"),
            "{calls:?}"
        );
        assert!(
            fake.stdin_of("r1", "restore").starts_with("pipe:"),
            "runc restore got stdin {:?}, not the stdin pipe",
            fake.stdin_of("r1", "restore")
        );

        let mut containerd = std::fs::OpenOptions::new()
            .write(true)
            .open(&stdin)
            .unwrap();
        containerd.write_all(b"hello\n").unwrap();
        assert_eq!(fake.wait_for_input("r1", "hello\n").await, "hello\n");
        assert!(!fake.input_ended("r1"), "no EOF before CloseIO");

        drop(containerd);
        {
            let procs = c.procs.lock().await;
            procs.init.io.close_input();
            procs.init.stdin.close_soon();
        }
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
        while !fake.input_ended("r1") && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        assert!(
            fake.input_ended("r1"),
            "CloseIO ends the restored process's stdin"
        );
    }
}
