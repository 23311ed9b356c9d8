//! One container: its runc client, init process and exec processes, and the operations on them.
//! Each operation checks the process state machine first, runs runc, and commits the new state
//! only when runc succeeded; a failed Create undoes what it did (runc delete, unmount rootfs).
//!
//! Locking: `procs` (the process table) is only ever held for a check or a commit, never across
//! a runc call, so State, Kill and Wait answer while a slow `runc exec` runs. `init_op`
//! serialises the operations that change the init's state through runc (start, pause, resume,
//! update, delete). Starting processes lives in `container/start.rs`, pausing in `container/pause.rs`.

mod hold;
mod pause;
mod start;

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, SystemTime},
};

use containerd_shim::asynchronous::util::{mount_rootfs, write_options, write_runtime};
use containerd_shim_protos::{
    api::{CreateTaskRequest, ProcessInfo},
    protobuf::{Message, well_known_types::any::Any},
    shim::oci::{Options as RuncOptions, ProcessDetails},
};
use oci_spec::runtime::{LinuxNamespaceType, Spec};
use runc::{
    Runc,
    options::{DeleteOpts, KillOpts},
};
use tokio::sync::{Mutex, watch};

use crate::{
    checkpoint::{self, CriuOpts},
    errors::{Result, ShimError},
    io::StdioSpec,
    options::BatonSettings,
    process::{ExitInfo, Op, Process, State},
    reaper::{self, ExitSubscription},
    runtime::{self, RuncGlobal},
};

/// How long Delete lets `file://` copies finish writing what the process printed.
const FILE_COPY_DRAIN: Duration = Duration::from_secs(5);

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
    /// The container has no pid namespace of its own: when its init exits, the kernel does not
    /// kill the other processes, so the shim does (`runc kill --all`), as the Go shim does.
    pub kill_all_on_exit: bool,
    /// The processes.
    pub procs: Mutex<Procs>,
    /// The init's exit status as the shim reaped it (its TaskExit may still wait for the execs' and the output):
    /// once set, no exec starts. Set under the `procs` lock, so that what is read under it is consistent.
    pub init_reaped: watch::Sender<Option<u32>>,
    /// Serialises the runc operations that change the init's state.
    init_op: Mutex<()>,
    /// Exec processes starting or running (their TaskExit comes before the init's).
    pub running_execs: watch::Sender<usize>,
    /// Background tasks (OOM watch) to stop on delete.
    pub tasks: std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>,
    /// OOM counter of the container's memory cgroup, once known.
    pub oom: std::sync::OnceLock<Arc<crate::oom::OomWatch>>,
    /// Held while a start and its event are published, and while an exit is claimed, so that
    /// TaskExit never overtakes TaskStart / TaskExecStarted.
    pub event_gate: Mutex<()>,
    /// Held while a preemption or resume runs (a second one is refused, not queued), and after a rollback
    /// while a process whose call got no answer is followed up (`preempt/rollback.rs`).
    pub preempt_op: Arc<Mutex<()>>,
    /// Parked, or being preempted or resumed (persisted in the bundle, see `preempt/state.rs`).
    pub preemption: std::sync::Mutex<Option<baton_agent_api::PreemptState>>,
    /// Frozen for the agent's co-runner controller (see `container/hold.rs`).
    hold: std::sync::Mutex<hold::HoldSlot>,
    /// The cgroup freezer of the init (pid, freezer), looked up at the first pause (`container/pause.rs`).
    freezer: std::sync::Mutex<Option<(u32, Option<Arc<baton_cgroups::freezer::Freezer>>)>>,
}

/// SIGKILL or SIGTERM: what a frozen container must be thawed for (the v1 freezer holds them, runc#2105).
fn is_fatal(signal: u32) -> bool {
    signal == libc::SIGKILL as u32 || signal == libc::SIGTERM as u32
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

/// Checks the bundle before anything is mounted: it must exist and hold a valid config.json.
pub fn load_spec(bundle: &Path) -> Result<Spec> {
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

/// True unless the spec gives the container a new pid namespace of its own (the Go shim's
/// `ShouldKillAllOnExit`): sharing the host's, or joining another by path.
fn shares_a_pid_namespace(spec: &Spec) -> bool {
    let own = spec
        .linux()
        .as_ref()
        .and_then(|l| l.namespaces().as_ref())
        .is_some_and(|nss| {
            nss.iter()
                .any(|ns| ns.typ() == LinuxNamespaceType::Pid && ns.path().is_none())
        });
    !own
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
    /// Exits of its init are kept by `exits`; the caller registers the init with
    /// [`Self::register_init`] once TaskCreate is published.
    pub async fn create(
        req: &CreateTaskRequest,
        namespace: &str,
        options: RuncOptions,
        settings: BatonSettings,
    ) -> Result<Self> {
        let id = req.id.clone();
        let bundle = PathBuf::from(&req.bundle);
        let spec = load_spec(&bundle)?;
        write_options(&bundle, &options).await?;
        let global =
            RuncGlobal::new(&options, namespace, &bundle).with_criu(settings.criu_program());
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
            kill_all_on_exit: shares_a_pid_namespace(&spec),
            procs: Mutex::new(Procs {
                init: Process::new(&id, "", StdioSpec::default()),
                execs: HashMap::new(),
            }),
            init_reaped: watch::channel(None).0,
            init_op: Mutex::new(()),
            hold: std::sync::Mutex::default(),
            running_execs: watch::channel(0).0,
            tasks: std::sync::Mutex::new(Vec::new()),
            oom: std::sync::OnceLock::new(),
            event_gate: Mutex::new(()),
            preempt_op: Arc::new(Mutex::new(())),
            preemption: std::sync::Mutex::new(crate::preempt::state::load(&bundle)),
            freezer: std::sync::Mutex::new(None),
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

    /// Registers the init's pid with the reaper. Returns its exit when it already died (since
    /// `exits` was taken, before its Create): the caller publishes it.
    pub async fn register_init(&self, exits: &ExitSubscription) -> Option<reaper::Exit> {
        let procs = self.procs.lock().await;
        self.register(procs.init.pid, "", exits)
    }

    fn register(&self, pid: u32, exec_id: &str, exits: &ExitSubscription) -> Option<reaper::Exit> {
        if pid == 0 {
            return None;
        }
        let key = reaper::ProcessKey {
            id: self.id.clone(),
            exec_id: exec_id.to_string(),
        };
        exits.register(pid as i32, key)
    }

    /// Adds an exec process (not started yet). The request's `terminal` decides whether it gets
    /// a TTY, whatever its process spec says (as in the Go shim).
    pub async fn add_exec(&self, exec_id: &str, stdio: StdioSpec, spec: &Any) -> Result<()> {
        let mut process: oci_spec::runtime::Process =
            serde_json::from_slice(&spec.value).map_err(|e| {
                ShimError::InvalidArgument(format!("exec {exec_id}: invalid process spec: {e}"))
            })?;
        process.set_terminal(Some(stdio.terminal));
        if exec_id.is_empty() {
            return Err(ShimError::InvalidArgument(
                "exec id must not be empty".into(),
            ));
        }
        let mut procs = self.procs.lock().await;
        procs.init.check(Op::Exec)?;
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

    /// Signals a process (`all`: every process of the container, init only).
    pub async fn kill(&self, exec_id: &str, signal: u32, all: bool) -> Result<()> {
        let (pid, name) = {
            let procs = self.procs.lock().await;
            let p = procs.get(&self.id, exec_id)?;
            p.check(Op::Kill)?;
            (p.pid, p.name())
        };
        // A fatal signal first ends the controller's hold (the v1 freezer keeps it from a frozen task), and
        // no new hold is taken while it is sent.
        let _no_hold = if is_fatal(signal) {
            Some(self.block_holds("a kill").await)
        } else {
            None
        };
        if exec_id.is_empty() {
            self.runc_kill(signal, all).await?;
            self.thaw_if_killed(signal).await;
            if is_fatal(signal) {
                self.stopping();
            }
            return Ok(());
        }
        let sig = nix::sys::signal::Signal::try_from(signal as i32)
            .map_err(|_| ShimError::InvalidArgument(format!("invalid signal {signal}")))?;
        // The state check above guarantees a pid (an exec is signalled only once started).
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), sig).map_err(|e| {
            if e == nix::errno::Errno::ESRCH {
                ShimError::ProcessFinished { id: name }
            } else {
                ShimError::io(format!("kill {name}"), e.into())
            }
        })
    }

    async fn runc_kill(&self, signal: u32, all: bool) -> Result<()> {
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
    }

    /// After the init of a container without a pid namespace of its own exited: kills every
    /// process left in it, so that its exec processes exit before the init's TaskExit.
    pub async fn kill_all_after_init_exit(&self) {
        if !self.kill_all_on_exit {
            return;
        }
        match self.runc_kill(libc::SIGKILL as u32, true).await {
            Ok(()) | Err(ShimError::ProcessFinished { .. }) => {}
            Err(e) => tracing::warn!(id = %self.id, error = %e, "kill --all after init exit"),
        }
    }

    /// After the init of a paused container exited (a SIGKILL reaches a task frozen by the v2 freezer, an OOM
    /// kill): thaws its cgroup before the exit is published, as the Go shim's paused state does on exit, so that
    /// the cgroup is not left frozen and what is left in it can die. Takes no operation lock: a Delete holding
    /// one waits for this exit.
    pub async fn thaw_after_init_exit(&self) {
        if self.procs.lock().await.init.state != State::Paused {
            return;
        }
        match self.freeze_cgroup(false).await {
            Ok(took) => {
                tracing::info!(id = %self.id, ?took, "thawed the paused container after its init exited")
            }
            Err(e) => {
                tracing::warn!(id = %self.id, "thawing the paused container after its init exited: {e}")
            }
        }
    }

    /// The CRIU options of a Task Checkpoint request.
    pub fn criu_opts(&self, path: &str, options: Option<&Any>) -> Result<CriuOpts> {
        CriuOpts::for_checkpoint(path, options, &self.options)
    }

    /// `runc checkpoint` with `criu`.
    pub async fn runc_checkpoint(&self, criu: &CriuOpts) -> Result<()> {
        self.procs.lock().await.init.check(Op::Checkpoint)?;
        let args = checkpoint::checkpoint_args(&self.global, &self.id, criu);
        runtime::run_raw(&self.global, &args, "checkpoint", &self.id)
            .await
            .map(|_| ())
            .map_err(|e| with_log(e, &self.global.log))
    }

    /// Updates the container's resources (JSON of an OCI `LinuxResources`).
    pub async fn update(&self, resources: &Any) -> Result<()> {
        let _op = self.init_op.lock().await;
        let state = self.procs.lock().await.init.state;
        if state == State::CreatedCheckpoint {
            // runc-v2 passes it to runc, which does not know the container yet ("container does not exist").
            return Err(ShimError::FailedPrecondition {
                id: self.id.clone(),
                action: "update",
                state: concat!(
                    "created from a checkpoint and not restored yet: runc has no container to update ",
                    "until Start restores it; update it after Start"
                )
                .into(),
            });
        }
        self.procs.lock().await.init.check(Op::Update)?;
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

    /// Deletes exec `exec_id`, or the container itself when empty. Returns pid and exit.
    pub async fn delete(&self, exec_id: &str) -> Result<(u32, ExitInfo)> {
        if !exec_id.is_empty() {
            return self.delete_exec(exec_id).await;
        }
        let _op = self.init_op.lock().await;
        // An init whose exit was seen is deleted only once its TaskExit is queued, so that
        // TaskDelete can never come first.
        let mut exited = self.exit_receiver("").await?;
        if self.init_reaped.borrow().is_some() {
            let _ = exited.wait_for(Option::is_some).await;
        }
        let (pid, exit) = {
            let procs = self.procs.lock().await;
            procs.init.check(Op::Delete)?;
            (procs.init.pid, exit_or_now(&procs.init))
        };
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
        let mut procs = self.procs.lock().await;
        finish_output(&mut procs.init).await;
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

    async fn delete_exec(&self, exec_id: &str) -> Result<(u32, ExitInfo)> {
        let mut p = {
            let mut procs = self.procs.lock().await;
            let p = procs.get(&self.id, exec_id)?;
            p.check(Op::Delete)?;
            procs
                .execs
                .remove(exec_id)
                .ok_or_else(|| ShimError::ProcessNotFound {
                    id: self.id.clone(),
                    exec_id: exec_id.to_string(),
                })?
        };
        finish_output(&mut p).await;
        reaper::forget(p.pid as i32);
        Ok((p.pid, exit_or_now(&p)))
    }
}

fn exit_or_now(p: &Process) -> ExitInfo {
    p.exit_info().unwrap_or(ExitInfo {
        status: 0,
        at: Some(SystemTime::now()),
    })
}

/// Lets the output copies of a deleted process finish (`file://` ones included), then stops
/// what is left.
async fn finish_output(p: &mut Process) {
    let name = p.name();
    for copy in p.file_copies.drain(..) {
        let abort = copy.abort_handle();
        if tokio::time::timeout(FILE_COPY_DRAIN, copy).await.is_err() {
            tracing::warn!(process = %name, "file:// copy still running at delete: stopped");
            abort.abort();
        }
    }
    p.io.shutdown().await;
}

#[cfg(test)]
mod tests;
