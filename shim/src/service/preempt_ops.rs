//! The service's GPU preemption operations: what the agent asks on the shim's control socket (`preempt`,
//! `resume`, `start`), the GPU-free gate of Start (`baton.io/wait-gpu-free`), and Task Checkpoint of a
//! container with CUDA processes. Thin, as the ttrpc handlers: look up, delegate to `preempt/`, publish.
use std::{path::PathBuf, sync::Arc, time::Duration};

use baton_agent_api::{ContainerRef, Outcome, Phase, PreemptRequest, Reply, Request, Step, Target};
use containerd_shim::api::StartRequest;
use containerd_shim_protos::api::CheckpointTaskRequest;
use tokio::sync::mpsc;

use super::TaskService;
use crate::{
    agent::{self, GpuContainer},
    container::Container,
    errors::{Result, ShimError},
    options::BatonSettings,
    preempt::Steps,
    process::State,
};

/// containerd topic: a container was parked (its CUDA state is in host memory, its cgroup frozen).
pub const PARKED_TOPIC: &str = "/baton/preempt/parked";
/// containerd topic: a snapshot preemption dumped a container.
pub const SNAPSHOTTED_TOPIC: &str = "/baton/preempt/snapshotted";
/// containerd topic: a parked container got its GPU state back.
pub const RESUMED_TOPIC: &str = "/baton/preempt/resumed";
/// How long a stop signal to a parked container waits for the resume the agent allowed first: with a 10 s
/// grace period, the rest is the container's own.
const RESUME_BEFORE_STOP: Duration = Duration::from_secs(4);

impl TaskService {
    /// Answers a request of the control socket; steps go to `tx` as they happen.
    pub async fn control(&self, request: Request, tx: mpsc::UnboundedSender<Step>) -> Reply {
        let target = match &request {
            Request::Preempt(r) => Some(r.target.id.clone()),
            Request::Resume(t) | Request::Start(t) => Some(t.id.clone()),
            _ => None,
        };
        let reply = self.control_op(request, tx).await;
        if let Some(c) = target.and_then(|id| self.container(&id).ok()) {
            self.shared
                .gpu
                .preemption_changed(&c.id, &self.shared.namespace, c.preemption());
        }
        reply
    }

    async fn control_op(&self, request: Request, tx: mpsc::UnboundedSender<Step>) -> Reply {
        let result = match request {
            Request::Preempt(r) => self.preempt(r, tx).await,
            Request::Resume(t) => self.resume_parked(&t, tx).await,
            Request::Start(t) => self.start_or_resume(&t, tx).await,
            other => Err(ShimError::InvalidArgument(format!(
                "a shim's control socket does not answer {other:?}: ask the agent"
            ))),
        };
        match result {
            Ok(outcome) => Reply::Done(outcome),
            Err(error) => Reply::Error {
                error: error.to_string(),
            },
        }
    }

    pub(super) fn target(&self, t: &Target) -> Result<Arc<Container>> {
        if let Some(ns) = &t.namespace
            && *ns != self.shared.namespace
        {
            return Err(ShimError::ContainerNotFound {
                id: format!("{ns}/{}", t.id),
            });
        }
        self.container(&t.id)
    }

    fn container_ref(&self, id: &str) -> ContainerRef {
        ContainerRef {
            id: id.to_owned(),
            namespace: self.shared.namespace.clone(),
        }
    }

    async fn preempt(&self, r: PreemptRequest, tx: mpsc::UnboundedSender<Step>) -> Result<Outcome> {
        let c = self.target(&r.target)?;
        let mut steps = self.steps_telling_the_agent(&c.id, Some(tx));
        let mode = r.mode;
        let state = c.preempt(r, &mut steps).await?;
        let topic = match mode {
            baton_agent_api::PreemptMode::Park => PARKED_TOPIC,
            baton_agent_api::PreemptMode::Snapshot => SNAPSHOTTED_TOPIC,
        };
        self.publish_steps(topic, &c.id, &steps).await;
        Ok(Outcome {
            container: self.container_ref(&c.id),
            preemption: Some(state),
            steps: steps.all,
        })
    }

    /// A timeline for container `id` whose preemption states go to the agent as they are entered: an agent
    /// that restarts while the operation runs learns from the re-registration that it is being preempted
    /// (and for whom), so that it neither preempts it again nor loses track of it; and a resume is known to
    /// the agent before the container thaws, so that the GPU state its restore puts back is not taken for
    /// a parked container's own (which the agent would park again).
    fn steps_telling_the_agent(&self, id: &str, tx: Option<mpsc::UnboundedSender<Step>>) -> Steps {
        let shared = self.shared.clone();
        let owned = id.to_owned();
        Steps::new(self.container_ref(id), tx).with_state_hook(move |state| {
            shared
                .gpu
                .preemption_changed(&owned, &shared.namespace, state)
        })
    }

    async fn resume_parked(&self, t: &Target, tx: mpsc::UnboundedSender<Step>) -> Result<Outcome> {
        let c = self.target(t)?;
        let mut steps = self.steps_telling_the_agent(&c.id, Some(tx));
        c.resume_parked(&mut steps).await?;
        self.publish_steps(RESUMED_TOPIC, &c.id, &steps).await;
        Ok(Outcome {
            container: self.container_ref(&c.id),
            preemption: c.preemption(),
            steps: steps.all,
        })
    }

    /// Starts a created container (as Start does, through its gate) or resumes a parked one.
    async fn start_or_resume(
        &self,
        t: &Target,
        tx: mpsc::UnboundedSender<Step>,
    ) -> Result<Outcome> {
        let c = self.target(t)?;
        if c.preemption().is_some() {
            return self.resume_parked(t, tx).await;
        }
        let state = c.procs.lock().await.init.state;
        if !matches!(state, State::Created | State::CreatedCheckpoint) {
            return Err(ShimError::FailedPrecondition {
                id: c.id.clone(),
                action: "start",
                state: format!("{state:?} (neither created nor parked)").to_lowercase(),
            });
        }
        let mut steps = Steps::new(self.container_ref(&c.id), Some(tx));
        // The step is stamped when the start begins (the moment the handoff let it go); its detail says
        // how long runc took to have its program running.
        let begun = baton_agent_api::now_monotonic_ns();
        let started = self
            .do_start(StartRequest {
                id: c.id.clone(),
                ..Default::default()
            })
            .await?;
        let took = baton_agent_api::now_monotonic_ns().saturating_sub(begun);
        steps.emit_at(
            begun,
            Phase::Started,
            Some(started.pid),
            format!("running after {:.1} ms", took as f64 / 1e6),
        );
        Ok(Outcome {
            container: self.container_ref(&c.id),
            preemption: None,
            steps: steps.all,
        })
    }

    /// Before a stop signal (SIGTERM, SIGINT, SIGQUIT, SIGHUP) reaches the init of parked container `c` (a pod
    /// deletion, `ctr task kill`): resumes it first when the agent says its GPU is free for it, so that its way
    /// out (a final checkpoint, exit handlers that call CUDA) runs instead of waiting on a locked CUDA until
    /// the SIGKILL at the end of its grace period. The signal waits for that resume at most
    /// [`RESUME_BEFORE_STOP`]; the resume goes on meanwhile (the CUDA calls of the signal's handler wait for
    /// its unlock). Otherwise the signal goes to the container parked, and the log says what that means.
    pub(super) async fn resume_before_stop(&self, c: &Arc<Container>) {
        let why = match agent::stop_parked(&c.settings, &c.id, &self.shared.namespace).await {
            Ok((true, why)) => why,
            Ok((false, why)) => {
                tracing::warn!(
                    id = %c.id,
                    "stopped while parked, not resumed first: {why}. Its CUDA state stays in host memory and \
                     its CUDA is locked: its CPU threads get the signal and run, a CUDA call it makes on its way \
                     out waits until it is killed (SIGKILL at the end of its grace period)"
                );
                return;
            }
            Err(e) => {
                tracing::warn!(
                    id = %c.id,
                    "stopped while parked: the agent cannot say whether its GPU is free ({e}), so it is not \
                     resumed first; a CUDA call it makes on its way out waits until it is killed"
                );
                return;
            }
        };
        let mut steps = self.steps_telling_the_agent(&c.id, None);
        let container = c.clone();
        let resume = tokio::spawn(async move {
            let result = container.resume_parked(&mut steps).await;
            (result, steps)
        });
        match tokio::time::timeout(RESUME_BEFORE_STOP, resume).await {
            Ok(Ok((Ok(()), steps))) => {
                tracing::info!(id = %c.id, "stopped while parked: resumed first ({why})");
                self.publish_steps(RESUMED_TOPIC, &c.id, &steps).await;
            }
            Ok(Ok((Err(e), _))) => tracing::warn!(
                id = %c.id,
                "stopped while parked: resuming it first ({why}) failed: {e}; the signal goes to it parked"
            ),
            Ok(Err(e)) => {
                tracing::warn!(id = %c.id, "stopped while parked: the resume task failed: {e}")
            }
            Err(_) => tracing::warn!(
                id = %c.id,
                "stopped while parked: its resume ({why}) takes longer than {RESUME_BEFORE_STOP:?}; the \
                 signal goes now, its CUDA calls wait for the resume's unlock"
            ),
        }
        self.shared
            .gpu
            .preemption_changed(&c.id, &self.shared.namespace, c.preemption());
    }

    async fn publish_steps(&self, topic: &str, id: &str, steps: &Steps) {
        let payload = serde_json::json!({
            "container_id": id,
            "namespace": self.shared.namespace,
            "steps": steps.all.iter().map(|s| serde_json::json!({
                "phase": s.phase,
                "t_ns": s.t_ns.to_string(),
                "pid": s.pid,
                "detail": s.detail,
            })).collect::<Vec<_>>(),
        });
        self.shared.events.gpu(topic, &payload).await;
    }

    /// The pid of the agent this shim is connected to now, the one peer its control socket serves.
    pub(crate) fn agent_pid(&self) -> Option<u32> {
        self.shared.gpu.agent_pid()
    }

    /// This shim's control socket (bound on first use, beside the agent's socket of `settings`).
    pub(super) fn control_socket(&self, settings: &BatonSettings) -> Option<PathBuf> {
        self.shared
            .control_socket
            .get_or_init(|| {
                let path = crate::control::socket_path(&agent::agent_socket(settings));
                match crate::control::serve(&path, self.clone()) {
                    Ok(()) => Some(path),
                    Err(e) => {
                        tracing::warn!(
                            socket = %path.display(),
                            "no control socket ({e}): the agent cannot preempt this pod's containers"
                        );
                        None
                    }
                }
            })
            .clone()
    }

    /// `baton.io/wait-gpu-free`: holds Start until no other container holds the GPU this one sees.
    pub(super) async fn wait_gpu_free(&self, c: &Container) -> Result<()> {
        let Some(within) = c.settings.wait_gpu_free else {
            return Ok(());
        };
        let pid = c.procs.lock().await.init.pid;
        let gpu = GpuContainer {
            id: &c.id,
            namespace: &self.shared.namespace,
            init_pid: pid,
            settings: &c.settings,
            control_socket: None,
            preemption: None,
        };
        if !agent::is_watched(&gpu) {
            tracing::warn!(id = %c.id, "wait-gpu-free: the container sees no NVIDIA device: nothing to wait for");
            return Ok(());
        }
        match agent::wait_gpu_free(&gpu, within).await {
            Ok((waited_ns, t_free_ns)) => {
                tracing::info!(
                    id = %c.id,
                    waited = ?Duration::from_nanos(waited_ns),
                    t_free_ns,
                    "wait-gpu-free: the GPU is free: starting"
                );
                Ok(())
            }
            Err(e) => {
                tracing::warn!(id = %c.id, "wait-gpu-free: not starting: {e}");
                Err(ShimError::FailedPrecondition {
                    id: c.id.clone(),
                    action: "start",
                    state: format!("waiting for a free GPU (baton.io/wait-gpu-free): {e}"),
                })
            }
        }
    }

    /// Task Checkpoint: CRIU alone for a container without CUDA processes; cuda-checkpoint first otherwise.
    pub(super) async fn do_checkpoint(&self, req: &CheckpointTaskRequest) -> Result<()> {
        let c = self.container(&req.id)?;
        let criu = c.criu_opts(&req.path, req.options.as_ref())?;
        let pids = agent::cuda_pids(&c.settings, &c.id, &self.shared.namespace).await;
        if pids.is_empty() {
            return c.runc_checkpoint(&criu).await;
        }
        tracing::info!(id = %c.id, pids = ?pids, "checkpoint: cuda-checkpoint first for the CUDA processes");
        let mut steps = Steps::new(self.container_ref(&c.id), None);
        let result = c.checkpoint_gpu(&criu, &pids, &mut steps).await;
        self.publish_steps(SNAPSHOTTED_TOPIC, &c.id, &steps).await;
        result
    }
}
