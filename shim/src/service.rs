//! The ttrpc Task service: thin handlers that look the container up, delegate to
//! [`Container`], publish the event and let `?` map the error (errors.rs is the only mapping).
//! Exits are handled in `service/exits.rs`, the id table in `service/registry.rs`.

mod exits;
mod hold_ops;
mod preempt_ops;
mod registry;

use std::{
    path::Path,
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use async_trait::async_trait;
use containerd_shim::{
    ExitSignal, TtrpcContext, TtrpcResult,
    api::{
        CloseIORequest, ConnectRequest, ConnectResponse, CreateTaskRequest, CreateTaskResponse,
        DeleteRequest, DeleteResponse, ExecProcessRequest, KillRequest, PauseRequest, PidsRequest,
        PidsResponse, ResizePtyRequest, ResumeRequest, ShutdownRequest, StartRequest,
        StartResponse, StateRequest, StateResponse, StatsRequest, StatsResponse,
        Status as ApiStatus, UpdateTaskRequest, WaitRequest, WaitResponse,
    },
    protos::{
        api::CheckpointTaskRequest, protobuf::MessageField,
        protobuf::well_known_types::empty::Empty, shim_async::Task,
    },
};

use crate::{
    agent::{GpuAgent, GpuContainer},
    container::Container,
    errors::{Result, ShimError},
    events::{Events, timestamp},
    io::StdioSpec,
    oom::{MemoryCgroup, OomWatch},
    options::{self, BatonSettings, CONTAINER_TYPE_ANNOTATION},
    process::State,
    reaper::ExitSubscription,
    stats,
};
use registry::Registry;

/// How long Shutdown waits for queued events to reach containerd (as the Go shim does).
const SHUTDOWN_EVENT_DRAIN: Duration = Duration::from_secs(5);
/// How long Shutdown waits for the agent's operations in flight to send their replies.
const SHUTDOWN_CONTROL_DRAIN: Duration = Duration::from_secs(5);

/// State shared by the handlers and the exit loop.
pub struct Shared {
    namespace: String,
    events: Events,
    containers: Registry,
    pod_settings: Mutex<Option<BatonSettings>>,
    gpu: GpuAgent,
    exit: Arc<ExitSignal>,
    /// This shim's control socket for the agent, once bound (`None`: binding it failed).
    control_socket: std::sync::OnceLock<Option<std::path::PathBuf>>,
    /// The agent's operations (preempt, resume, start) in flight on the control socket, their replies not
    /// sent yet.
    control_ops: tokio::sync::watch::Sender<usize>,
}

/// One of the agent's operations in flight, counted in `Shared::control_ops` until dropped.
pub struct ControlOp(Arc<Shared>);

impl Drop for ControlOp {
    fn drop(&mut self) {
        self.0.control_ops.send_modify(|n| *n = n.saturating_sub(1));
    }
}

/// The Task service containerd talks to.
#[derive(Clone)]
pub struct TaskService {
    shared: Arc<Shared>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The status State reports for process `exec_id` of container `c` in state `state`: its own, except that a
/// Kubernetes (CRI) container parked by Baton is reported running. CRI has no paused state: when containerd
/// restarts, its CRI plugin reloads a paused task as exited (code 255, reason Unknown), and the kubelet would
/// then restart the pod's container while its parked process still exists, losing the work the park kept.
/// Parking is Baton's own preemption, which it ends by itself; a pause asked through the Task API (`ctr task
/// pause`) is still reported paused, as runc-v2 does.
fn reported_status(c: &Container, state: State, exec_id: &str) -> ApiStatus {
    let parked_by_baton = state == State::Paused && c.preemption().is_some();
    if exec_id.is_empty() && parked_by_baton && c.settings.kubernetes.is_some() {
        ApiStatus::RUNNING
    } else {
        state.api_status()
    }
}

/// A signal that asks a process to end (what a pod deletion or `ctr task kill` sends first), not SIGKILL.
fn is_stop_signal(signal: u32) -> bool {
    [libc::SIGTERM, libc::SIGINT, libc::SIGQUIT, libc::SIGHUP]
        .iter()
        .any(|s| u32::try_from(*s) == Ok(signal))
}

impl TaskService {
    /// A service for `namespace` publishing through `events`; Shutdown signals `exit`.
    pub fn new(namespace: &str, events: Events, exit: Arc<ExitSignal>) -> Self {
        let svc = Self {
            shared: Arc::new(Shared {
                namespace: namespace.to_string(),
                gpu: GpuAgent::new(events.clone()),
                events,
                containers: Registry::default(),
                pod_settings: Mutex::new(None),
                exit,
                control_socket: std::sync::OnceLock::new(),
                control_ops: tokio::sync::watch::channel(0).0,
            }),
        };
        svc.spawn_exit_loop();
        svc
    }

    /// SIGTERM or SIGINT (a node shutting down, a supervisor stopping the shim), as the Go runc-v2 shim takes
    /// them: the shim stops serving and exits once its queued events reached containerd (5 s at most), whatever
    /// it still holds. The containers keep running, orphaned; containerd, seeing the shim gone, runs the shim
    /// binary's `delete` action, which kills them (`runc delete --force`) and unmounts their rootfs (at once when
    /// containerd is up, else at its next start).
    pub async fn shutdown_on_signal(&self, signal: &str) {
        let held = self.shared.containers.all().len();
        tracing::info!(
            "{signal}: shutting down, leaving {held} container(s) to containerd's cleanup"
        );
        if !self.shared.events.flush(SHUTDOWN_EVENT_DRAIN).await {
            tracing::warn!("events still queued after {SHUTDOWN_EVENT_DRAIN:?}: dropped");
        }
        self.shared.exit.signal();
    }

    /// Counts one of the agent's operations in flight until the guard is dropped (after its reply is sent).
    pub(crate) fn control_op_begun(&self) -> ControlOp {
        self.shared.control_ops.send_modify(|n| *n += 1);
        ControlOp(self.shared.clone())
    }

    /// Waits (up to [`SHUTDOWN_CONTROL_DRAIN`]) until no operation of the agent is in flight: a resume whose
    /// job exits at its restore is deleted by containerd, which then shuts the shim down, while the resume
    /// still reports it; its reply must reach the agent first.
    async fn control_ops_done(&self) {
        let mut ops = self.shared.control_ops.subscribe();
        let done = tokio::time::timeout(SHUTDOWN_CONTROL_DRAIN, ops.wait_for(|n| *n == 0)).await;
        if done.is_err() {
            tracing::warn!(
                "an operation of the agent is still running {SHUTDOWN_CONTROL_DRAIN:?} after the last \
                 container was deleted: shutting down without its reply"
            );
        }
    }

    fn container(&self, id: &str) -> Result<Arc<Container>> {
        self.shared.containers.get(id)
    }

    /// Baton settings for a new container: node TOML < pod (sandbox annotations) < container.
    fn settings_for(&self, node: &BatonSettings, bundle: &Path) -> Result<BatonSettings> {
        let spec = crate::container::load_spec(bundle)?;
        let annotations = spec.annotations().clone().unwrap_or_default();
        let is_sandbox = annotations
            .get(CONTAINER_TYPE_ANNOTATION)
            .is_some_and(|t| t == "sandbox");
        let mut pod = lock(&self.shared.pod_settings);
        let base = if is_sandbox {
            let pod_settings = node.with_annotations(&annotations, "pod")?;
            *pod = Some(pod_settings.clone());
            return Ok(pod_settings.for_sandbox());
        } else {
            pod.clone().unwrap_or_else(|| node.clone())
        };
        let mut settings = base.with_annotations(&annotations, "container")?;
        settings.pod = crate::roles::pod_of(&annotations);
        settings.kubernetes = crate::roles::kubernetes_of(&annotations);
        Ok(settings)
    }

    async fn do_create(&self, req: CreateTaskRequest) -> Result<CreateTaskResponse> {
        let reservation = self.shared.containers.reserve(&req.id)?;
        let cfg = options::decode_options(req.options.as_ref())?;
        warn_unknown("runtime option", &cfg.unknown_keys);
        let settings = self.settings_for(&cfg.baton, Path::new(&req.bundle))?;
        if settings.role_spec().is_some_and(|r| r.launch_blocking) {
            crate::roles::inject_launch_blocking(Path::new(&req.bundle), &req.id)?;
        }
        let exits = ExitSubscription::new();
        let c =
            Arc::new(Container::create(&req, &self.shared.namespace, cfg.runc, settings).await?);
        reservation.fill(c.clone());
        let pid = c.procs.lock().await.init.pid;
        self.watch_oom(&c, pid);
        let control_socket = self.control_socket(&c.settings);
        let preemption = c.preemption();
        self.shared
            .gpu
            .container_created(&GpuContainer {
                id: &req.id,
                namespace: &self.shared.namespace,
                init_pid: pid,
                settings: &c.settings,
                control_socket: control_socket.as_deref(),
                preemption: preemption.as_ref(),
            })
            .await;
        self.shared
            .events
            .create(
                &req.id,
                &req.bundle,
                pid,
                &StdioSpec {
                    stdin: req.stdin.clone(),
                    stdout: req.stdout.clone(),
                    stderr: req.stderr.clone(),
                    terminal: req.terminal,
                },
            )
            .await;
        if let Some(exit) = c.register_init(&exits).await {
            self.spawn_exit(c.id.clone(), String::new(), exit);
        }
        Ok(CreateTaskResponse {
            pid,
            ..Default::default()
        })
    }

    fn watch_oom(&self, c: &Arc<Container>, pid: u32) {
        if pid == 0 || c.oom.get().is_some() {
            return;
        }
        let Some(cgroup) = MemoryCgroup::of_pid(pid) else {
            tracing::warn!(id = %c.id, pid, "no memory cgroup found: OOM events disabled");
            return;
        };
        let watch = OomWatch::new(cgroup);
        let _ = c.oom.set(watch.clone());
        let events = self.shared.events.clone();
        let id = c.id.clone();
        let task = tokio::spawn(async move {
            let mut n = match watch.notifications().await {
                Ok(n) => n,
                Err(e) => {
                    tracing::warn!(%id, error = %e, "OOM notifications unavailable");
                    return;
                }
            };
            while n.next().await {
                if watch.check() {
                    events.oom(&id).await;
                }
            }
        });
        lock(&c.tasks).push(task);
    }

    async fn do_start(&self, req: StartRequest) -> Result<StartResponse> {
        let c = self.container(&req.id)?;
        let exits = ExitSubscription::new();
        if req.exec_id.is_empty() {
            self.wait_gpu_free(&c).await?;
        }
        let (pid, early) = if req.exec_id.is_empty() {
            self.start_init(&c, &req.id, &exits).await?
        } else {
            // runc runs outside the gate: a second exec, or the init's exit, never waits on this one's runc.
            let started = c.run_exec(&req.exec_id).await?;
            let _gate = c.event_gate.lock().await;
            let (pid, early) = c.commit_exec(&req.exec_id, started, &exits).await?;
            self.shared
                .events
                .exec_started(&req.id, &req.exec_id, pid)
                .await;
            (pid, early)
        };
        if let Some(exit) = early {
            self.spawn_exit(c.id.clone(), req.exec_id.clone(), exit);
        }
        Ok(StartResponse {
            pid,
            ..Default::default()
        })
    }

    /// Starts (or restores) the init under the event gate and publishes TaskStart.
    async fn start_init(
        &self,
        c: &Arc<Container>,
        id: &str,
        exits: &ExitSubscription,
    ) -> Result<(u32, Option<crate::reaper::Exit>)> {
        let restoring = c.procs.lock().await.init.restore.clone();
        let _gate = c.event_gate.lock().await;
        let (pid, early) = c.start_init(exits).await?;
        self.shared.events.start(id, pid).await;
        // A restored init gets its pid (and so its memory cgroup) only now.
        self.watch_oom(c, pid);
        let control_socket = self.control_socket(&c.settings);
        self.shared.gpu.container_started(&GpuContainer {
            id,
            namespace: &self.shared.namespace,
            init_pid: pid,
            settings: &c.settings,
            control_socket: control_socket.as_deref(),
            preemption: None,
        });
        if let Some(criu) = restoring
            && let Err(e) =
                crate::preempt::restore_cuda_after_runc_restore(c, Path::new(&criu.image_path), pid)
                    .await
        {
            tracing::warn!(id, "restoring the CUDA processes after runc restore: {e}");
        }
        Ok((pid, early))
    }

    async fn do_delete(&self, req: DeleteRequest) -> Result<DeleteResponse> {
        let c = self.container(&req.id)?;
        let (pid, exit) = c.delete(&req.exec_id).await?;
        let at = exit.at.unwrap_or_else(SystemTime::now);
        if req.exec_id.is_empty() {
            self.shared.containers.remove(&req.id);
            self.shared
                .gpu
                .container_deleted(&req.id, &self.shared.namespace);
            self.shared
                .events
                .delete(&req.id, pid, exit.status, at)
                .await;
        }
        Ok(DeleteResponse {
            pid,
            exit_status: exit.status,
            exited_at: MessageField::some(timestamp(at)),
            ..Default::default()
        })
    }

    async fn do_state(&self, req: StateRequest) -> Result<StateResponse> {
        let c = self.container(&req.id)?;
        let procs = c.procs.lock().await;
        let p = procs.get(&req.id, &req.exec_id)?;
        let exit = p.exit_info();
        Ok(StateResponse {
            id: if req.exec_id.is_empty() {
                req.id.clone()
            } else {
                req.exec_id.clone()
            },
            bundle: c.bundle.display().to_string(),
            pid: p.pid,
            status: reported_status(&c, p.state, &req.exec_id).into(),
            stdin: p.stdio.stdin.clone(),
            stdout: p.stdio.stdout.clone(),
            stderr: p.stdio.stderr.clone(),
            terminal: p.stdio.terminal,
            exit_status: exit.map_or(0, |e| e.status),
            exited_at: MessageField::some(
                exit.and_then(|e| e.at)
                    .map_or_else(crate::events::zero_time, timestamp),
            ),
            exec_id: req.exec_id.clone(),
            ..Default::default()
        })
    }

    async fn do_wait(&self, req: WaitRequest) -> Result<WaitResponse> {
        let c = self.container(&req.id)?;
        let mut rx = c.exit_receiver(&req.exec_id).await?;
        drop(c);
        let exit = rx
            .wait_for(Option::is_some)
            .await
            .map_err(|_| {
                ShimError::Other(format!("{}: process went away without an exit", req.id))
            })?
            .unwrap_or_default();
        Ok(WaitResponse {
            exit_status: exit.status,
            exited_at: MessageField::some(timestamp(exit.at.unwrap_or_else(SystemTime::now))),
            ..Default::default()
        })
    }
}

fn warn_unknown(what: &str, keys: &[String]) {
    for key in keys {
        tracing::warn!("unknown {what} {key:?} ignored");
    }
}

#[async_trait]
impl Task for TaskService {
    async fn state(&self, _: &TtrpcContext, req: StateRequest) -> TtrpcResult<StateResponse> {
        Ok(self.do_state(req).await?)
    }

    async fn create(
        &self,
        _: &TtrpcContext,
        req: CreateTaskRequest,
    ) -> TtrpcResult<CreateTaskResponse> {
        tracing::info!(id = %req.id, bundle = %req.bundle, "create");
        Ok(self
            .do_create(req)
            .await
            .inspect_err(|e| tracing::warn!(error = %e, "create failed"))?)
    }

    async fn start(&self, _: &TtrpcContext, req: StartRequest) -> TtrpcResult<StartResponse> {
        Ok(self.do_start(req).await?)
    }

    async fn delete(&self, _: &TtrpcContext, req: DeleteRequest) -> TtrpcResult<DeleteResponse> {
        Ok(self.do_delete(req).await?)
    }

    async fn pids(&self, _: &TtrpcContext, req: PidsRequest) -> TtrpcResult<PidsResponse> {
        let processes = self.container(&req.id)?.pids().await?;
        Ok(PidsResponse {
            processes,
            ..Default::default()
        })
    }

    async fn pause(&self, _: &TtrpcContext, req: PauseRequest) -> TtrpcResult<Empty> {
        self.container(&req.id)?.pause_by_user().await?;
        self.shared.events.paused(&req.id).await;
        Ok(Empty::new())
    }

    async fn resume(&self, _: &TtrpcContext, req: ResumeRequest) -> TtrpcResult<Empty> {
        let c = self.container(&req.id)?;
        if let Some(p) = c.preemption() {
            return Err(ShimError::FailedPrecondition {
                id: req.id.clone(),
                action: "resume",
                state: format!(
                    "{:?} by baton (its CUDA processes are checkpointed): `baton resume {}` gives it \
                     its GPU state back",
                    p.state, req.id
                )
                .to_lowercase(),
            }
            .into());
        }
        c.set_paused(false).await?;
        self.shared.events.resumed(&req.id).await;
        Ok(Empty::new())
    }

    async fn checkpoint(&self, _: &TtrpcContext, req: CheckpointTaskRequest) -> TtrpcResult<Empty> {
        self.do_checkpoint(&req).await?;
        self.shared.events.checkpointed(&req.id, &req.path).await;
        Ok(Empty::new())
    }

    async fn kill(&self, _: &TtrpcContext, req: KillRequest) -> TtrpcResult<Empty> {
        let c = self.container(&req.id)?;
        if req.exec_id.is_empty()
            && is_stop_signal(req.signal)
            && c.preemption()
                .is_some_and(|p| p.state == baton_agent_api::PreemptPhase::Parked)
        {
            self.resume_before_stop(&c).await;
        }
        let was = c.preemption();
        c.kill(&req.exec_id, req.signal, req.all).await?;
        // A fatal signal to a parked container ends its parking: the agent learns it from the shim.
        if c.preemption() != was {
            self.shared
                .gpu
                .preemption_changed(&c.id, &self.shared.namespace, c.preemption());
        }
        Ok(Empty::new())
    }

    async fn exec(&self, _: &TtrpcContext, req: ExecProcessRequest) -> TtrpcResult<Empty> {
        let c = self.container(&req.id)?;
        let stdio = StdioSpec {
            stdin: req.stdin.clone(),
            stdout: req.stdout.clone(),
            stderr: req.stderr.clone(),
            terminal: req.terminal,
        };
        let spec = req.spec.clone().into_option().ok_or_else(|| {
            ShimError::InvalidArgument(format!("exec {}: no process spec", req.exec_id))
        })?;
        c.add_exec(&req.exec_id, stdio, &spec).await?;
        self.shared.events.exec_added(&req.id, &req.exec_id).await;
        Ok(Empty::new())
    }

    async fn resize_pty(&self, _: &TtrpcContext, req: ResizePtyRequest) -> TtrpcResult<Empty> {
        let c = self.container(&req.id)?;
        let procs = c.procs.lock().await;
        let p = procs.get(&req.id, &req.exec_id)?;
        if let Some(console) = &p.console {
            crate::console::resize(console, req.width, req.height)?;
        }
        Ok(Empty::new())
    }

    async fn close_io(&self, _: &TtrpcContext, req: CloseIORequest) -> TtrpcResult<Empty> {
        let c = self.container(&req.id)?;
        let procs = c.procs.lock().await;
        let p = procs.get(&req.id, &req.exec_id)?;
        if req.stdin {
            p.io.close_input();
            p.stdin.close_soon();
        }
        Ok(Empty::new())
    }

    async fn update(&self, _: &TtrpcContext, req: UpdateTaskRequest) -> TtrpcResult<Empty> {
        let c = self.container(&req.id)?;
        let resources = req.resources.clone().into_option().unwrap_or_default();
        c.update(&resources).await?;
        Ok(Empty::new())
    }

    async fn wait(&self, _: &TtrpcContext, req: WaitRequest) -> TtrpcResult<WaitResponse> {
        Ok(self.do_wait(req).await?)
    }

    async fn stats(&self, _: &TtrpcContext, req: StatsRequest) -> TtrpcResult<StatsResponse> {
        let c = self.container(&req.id)?;
        let pid = c.procs.lock().await.init.pid;
        let stats = stats::collect(pid)?;
        Ok(StatsResponse {
            stats: MessageField::some(stats),
            ..Default::default()
        })
    }

    async fn connect(&self, _: &TtrpcContext, req: ConnectRequest) -> TtrpcResult<ConnectResponse> {
        let task_pid = match self.container(&req.id) {
            Ok(c) => c.procs.lock().await.init.pid,
            Err(_) => 0,
        };
        Ok(ConnectResponse {
            shim_pid: std::process::id(),
            task_pid,
            version: env!("CARGO_PKG_VERSION").to_string(),
            ..Default::default()
        })
    }

    async fn shutdown(&self, _: &TtrpcContext, _req: ShutdownRequest) -> TtrpcResult<Empty> {
        if self.shared.containers.is_empty() {
            tracing::info!("no containers left: shutting down");
            self.control_ops_done().await;
            if !self.shared.events.flush(SHUTDOWN_EVENT_DRAIN).await {
                tracing::warn!("events still queued after {SHUTDOWN_EVENT_DRAIN:?}: dropped");
            }
            self.shared.exit.signal();
        }
        Ok(Empty::new())
    }
}

#[cfg(test)]
mod lifecycle_tests;
#[cfg(test)]
mod parity_tests;
