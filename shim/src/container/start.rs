//! Starting a container's processes: `runc create` of the init, its start or its restore from a
//! checkpoint, and `runc exec` of exec processes. Each gets its stdio the same way
//! ([`StdioSetup`]): a console socket for a TTY, pipes otherwise, connected to containerd's
//! fifos (or `file://` / `binary://` targets) once runc returns. The process table is locked
//! only to check the state before, and to commit the pid and copies after.

use std::{path::Path, sync::Arc};

use containerd_shim::asynchronous::io::IoTasks;
use runc::options::{CreateOpts, ExecOpts};

use super::{Container, with_log};
use crate::{
    checkpoint::{self, CriuOpts, RestoreTarget},
    console::{Console, ConsoleSocket},
    errors::{Result, ShimError},
    io::{
        OutputDrain, ProcessPipes, StdinCloser, StdioSpec, start_console_copies, start_pipe_copies,
    },
    process::{Op, Process, State},
    reaper::{Exit, ExitSubscription},
    runtime,
};

/// Pid file of the init process in the bundle.
const INIT_PID_FILE: &str = "init.pid";

/// What runc is given for a process's stdio.
enum StdioSetup {
    /// A TTY: runc sends the pty master over this socket.
    Console(ConsoleSocket),
    /// Pipes runc hands to the process.
    Pipes(Arc<ProcessPipes>),
}

impl StdioSetup {
    fn console_socket(&self) -> Option<std::path::PathBuf> {
        match self {
            Self::Console(socket) => Some(socket.path()),
            Self::Pipes(_) => None,
        }
    }

    fn pipes(&self) -> Option<Arc<ProcessPipes>> {
        match self {
            Self::Console(_) => None,
            Self::Pipes(p) => Some(p.clone()),
        }
    }
}

/// What `runc exec` of an exec process gave (its pid and copies, or the error), to commit.
pub struct StartedExec {
    started: Result<(u32, Attached)>,
}

/// The copies of a started process, made before they are committed to its table entry.
struct Attached {
    console: Option<Console>,
    file_copies: Vec<tokio::task::JoinHandle<()>>,
}

async fn read_pid(path: &Path) -> Result<u32> {
    let text = tokio::fs::read_to_string(path)
        .await
        .map_err(|e| ShimError::io(format!("read pid file {}", path.display()), e))?;
    text.trim()
        .parse()
        .map_err(|_| ShimError::Other(format!("pid file {} holds {text:?}", path.display())))
}

impl Container {
    fn stdio_setup(&self, stdio: &StdioSpec) -> Result<StdioSetup> {
        if stdio.terminal {
            return Ok(StdioSetup::Console(ConsoleSocket::new()?));
        }
        let pipes = ProcessPipes::new(stdio, self.options.io_uid, self.options.io_gid)?;
        Ok(StdioSetup::Pipes(Arc::new(pipes)))
    }

    /// Connects a process runc created to containerd's side of its stdio.
    async fn attach_io(
        &self,
        setup: StdioSetup,
        stdio: &StdioSpec,
        io: &IoTasks,
        stdin: &StdinCloser,
        output: &OutputDrain,
    ) -> Result<Attached> {
        match setup {
            StdioSetup::Console(socket) => {
                let pty = socket.receive_master().await?;
                start_console_copies(&pty, stdio, io, output)?;
                Ok(Attached {
                    console: Some(pty),
                    file_copies: Vec::new(),
                })
            }
            StdioSetup::Pipes(pipes) => {
                let file_copies =
                    start_pipe_copies(&pipes, stdio, io, stdin, output, &self.id, &self.namespace)
                        .await?;
                Ok(Attached {
                    console: None,
                    file_copies,
                })
            }
        }
    }

    /// `runc create` of the init; fills in its pid and copies.
    pub(super) async fn runc_create(&self, init: &mut Process) -> Result<()> {
        let pid_file = self.bundle.join(INIT_PID_FILE);
        let setup = self.stdio_setup(&init.stdio)?;
        let mut opts = CreateOpts::new()
            .pid_file(&pid_file)
            .no_pivot(self.options.no_pivot_root)
            .no_new_keyring(self.options.no_new_keyring);
        opts.console_socket = setup.console_socket();
        opts.io = setup.pipes().map(|p| p as Arc<dyn runc::Io>);
        self.runc
            .create(&self.id, &self.bundle, Some(&opts))
            .await
            .map_err(|e| ShimError::runtime("create", &self.id, e))?;
        let attached = self
            .attach_io(setup, &init.stdio, &init.io, &init.stdin, &init.output)
            .await?;
        commit(init, attached);
        init.pid = read_pid(&pid_file).await?;
        Ok(())
    }

    /// Starts the init process (restoring it when created from a checkpoint). Returns its pid
    /// and, for a restored init that died at once, its exit (to publish after TaskStart).
    pub async fn start_init(&self, exits: &ExitSubscription) -> Result<(u32, Option<Exit>)> {
        let _op = self.init_op.lock().await;
        let (next, restore, pid) = {
            let procs = self.procs.lock().await;
            let next = procs.init.check(Op::Start)?;
            (next, procs.init.restore.clone(), procs.init.pid)
        };
        let (pid, early) = match restore {
            Some(criu) => {
                let pid = self
                    .restore(&criu)
                    .await
                    .map_err(|e| with_log(e, &self.global.log))?;
                (pid, self.register(pid, "", exits))
            }
            None => {
                self.runc.start(&self.id).await.map_err(|e| {
                    with_log(ShimError::runtime("start", &self.id, e), &self.global.log)
                })?;
                (pid, None)
            }
        };
        let mut procs = self.procs.lock().await;
        procs.init.restore = None;
        // An exit seen meanwhile wins over Running.
        if procs.init.state != State::Stopped {
            procs.init.state = next;
        }
        Ok((pid, early))
    }

    /// `runc restore` of the init; commits its pid and copies. Returns the pid.
    async fn restore(&self, criu: &CriuOpts) -> Result<u32> {
        let (stdio, io, stdin, output) = {
            let procs = self.procs.lock().await;
            let init = &procs.init;
            let output = init.output.clone();
            (
                init.stdio.clone(),
                init.io.clone(),
                init.stdin.clone(),
                output,
            )
        };
        let pid_file = self.bundle.join(INIT_PID_FILE);
        let setup = self.stdio_setup(&stdio)?;
        let target = RestoreTarget {
            bundle: self.bundle.clone(),
            pid_file: pid_file.clone(),
            console_socket: setup.console_socket(),
            no_pivot: self.options.no_pivot_root,
        };
        let args = checkpoint::restore_args(&self.global, &self.id, criu, &target);
        match setup.pipes() {
            None => {
                runtime::run_raw(&self.global, &args, "restore", &self.id).await?;
            }
            Some(pipes) => self.run_restore_with_pipes(&args, &pipes).await?,
        }
        let attached = self.attach_io(setup, &stdio, &io, &stdin, &output).await?;
        let pid = read_pid(&pid_file).await?;
        let mut procs = self.procs.lock().await;
        commit(&mut procs.init, attached);
        procs.init.pid = pid;
        Ok(pid)
    }

    /// `runc restore` whose (and so CRIU's) stdio are the process's pipes.
    async fn run_restore_with_pipes(&self, args: &[String], pipes: &ProcessPipes) -> Result<()> {
        let mut cmd = runc::Command::new(&self.global.binary);
        // What runc (and so CRIU's inherited stdio) gets; the pipes replace these below.
        cmd.args(args)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        if let (_, Some(path)) = self.global.criu_flags() {
            cmd.env("PATH", path);
        }
        runc::Io::set(pipes, &mut cmd)
            .await
            .map_err(|e| ShimError::io("set restore stdio", e))?;
        let (status, _, out, err) = runc::Spawner::execute(&runtime::ShimExecutor, cmd)
            .await
            .map_err(|e| ShimError::runtime("restore", &self.id, e))?;
        runc::Io::close_after_start(pipes).await;
        if !status.success() {
            return Err(ShimError::Runtime {
                action: "restore",
                id: self.id.clone(),
                message: format!("{status}: {}{}", out.trim(), err.trim()),
            });
        }
        Ok(())
    }

    /// Runs `runc exec --detach` of exec process `exec_id`, holding neither the process table nor the
    /// event gate across runc: a second exec of the container, its Kill, State and its init's exit go on
    /// while this one's runc is slow or stuck. Its outcome goes to [`Self::commit_exec`].
    pub async fn run_exec(&self, exec_id: &str) -> Result<StartedExec> {
        // runc refuses to exec into a frozen container: the controller's hold gives way, and no new one is
        // taken until runc is done.
        let _no_hold = self.block_holds("an exec").await;
        let (spec, stdio, io, stdin) = self.begin_exec(exec_id).await?;
        let started = self.runc_exec(exec_id, &spec, &stdio, &io, &stdin).await;
        Ok(StartedExec { started })
    }

    /// Commits the outcome of [`Self::run_exec`] to exec `exec_id`: its pid and copies, or back to created.
    /// Called under the event gate, so that its exit (registered here) comes after its TaskExecStarted.
    /// Returns its pid and, when it already died, its exit.
    pub async fn commit_exec(
        &self,
        exec_id: &str,
        started: StartedExec,
        exits: &ExitSubscription,
    ) -> Result<(u32, Option<Exit>)> {
        let mut procs = self.procs.lock().await;
        let p = procs.get_mut(&self.id, exec_id)?;
        match started.started {
            Ok((pid, attached)) => {
                commit(p, attached);
                p.pid = pid;
                if p.state == State::Starting {
                    p.state = State::Running;
                }
                Ok((pid, self.register(pid, exec_id, exits)))
            }
            Err(e) => {
                p.state = State::Created;
                self.running_execs.send_modify(|n| *n = n.saturating_sub(1));
                Err(e)
            }
        }
    }

    /// Checks and marks exec `exec_id` as starting; counts it as running for the init's exit.
    async fn begin_exec(
        &self,
        exec_id: &str,
    ) -> Result<(oci_spec::runtime::Process, StdioSpec, IoTasks, StdinCloser)> {
        let mut procs = self.procs.lock().await;
        if self.init_reaped.borrow().is_some()
            || matches!(procs.init.state, State::Stopped | State::Deleted)
        {
            return Err(ShimError::FailedPrecondition {
                id: self.id.clone(),
                action: "exec in",
                state: "stopped".into(),
            });
        }
        let p = procs.get_mut(&self.id, exec_id)?;
        p.state = p.check(Op::Start)?;
        let spec = p
            .exec_spec
            .clone()
            .ok_or_else(|| ShimError::Other(format!("{} has no spec", p.name())))?;
        self.running_execs.send_modify(|n| *n += 1);
        Ok((spec, p.stdio.clone(), p.io.clone(), p.stdin.clone()))
    }

    async fn runc_exec(
        &self,
        exec_id: &str,
        spec: &oci_spec::runtime::Process,
        stdio: &StdioSpec,
        io: &IoTasks,
        stdin: &StdinCloser,
    ) -> Result<(u32, Attached)> {
        let output = self
            .procs
            .lock()
            .await
            .get(&self.id, exec_id)?
            .output
            .clone();
        let pid_file = self.bundle.join(format!("{exec_id}.pid"));
        let setup = self.stdio_setup(stdio)?;
        let mut opts = ExecOpts::new().pid_file(&pid_file).detach(true);
        opts.console_socket = setup.console_socket();
        opts.io = setup.pipes().map(|p| p as Arc<dyn runc::Io>);
        if let Err(e) = self.runc.exec(&self.id, spec, Some(&opts)).await {
            return Err(with_log(
                ShimError::runtime("exec", &self.id, e),
                &self.global.log,
            ));
        }
        let attached = match self.attach_io(setup, stdio, io, stdin, &output).await {
            Ok(a) => a,
            Err(e) => {
                io.abort().await;
                return Err(e);
            }
        };
        let pid = read_pid(&pid_file).await?;
        let _ = tokio::fs::remove_file(&pid_file).await;
        Ok((pid, attached))
    }
}

fn commit(p: &mut Process, attached: Attached) {
    if attached.console.is_some() {
        p.console = attached.console;
    }
    p.file_copies.extend(attached.file_copies);
}
