//! The shim's link to the node's `baton agent`, which owns the probes: the shim registers each container
//! that sees NVIDIA device files (before its program runs), unregisters it at delete, and turns the
//! agent's acquired/released events for its containers, and NVML's cross-check of each release, into
//! containerd events (`/baton/gpu/acquired`, `/baton/gpu/released`, `/baton/gpu/nvml_check`) and log lines.
//!
//! Nothing here can fail or hold up a container for long: registration waits at most
//! [`REGISTER_TIMEOUT`], and a shim that cannot reach the agent runs its containers as plain runc and says
//! so once in its log. When the agent goes away (killed, restarted) the link reconnects with a growing
//! delay (starting an agent when allowed) and registers its containers again; the agent rebuilds their
//! fds and mappings from /proc.
//!
//! The link also tells who the agent is: the pid of the process at the other end of its live control
//! connection (SO_PEERCRED). The shim's control socket serves that process alone ([`AgentPid`]).
use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicU32, Ordering},
    },
    time::Duration,
};

use baton_agent_api::{
    Client, ContainerRef, Endpoint, EventBody, Filter, GateRequest, PreemptState, PreemptionUpdate,
    Registration, Reply, Request, WatchSettings,
};
use tokio::sync::{mpsc, oneshot};

use crate::{events::Events, options::BatonSettings};

/// How long Create waits for the agent (started if need be) to watch a container.
const REGISTER_TIMEOUT: Duration = Duration::from_secs(5);
/// How long an unregister may take before the link goes on.
const UNREGISTER_TIMEOUT: Duration = Duration::from_secs(2);
/// The longest delay between two reconnection attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// What the service tells about a container.
#[derive(Debug, Clone, Copy)]
pub struct GpuContainer<'a> {
    /// Container id.
    pub id: &'a str,
    /// containerd namespace.
    pub namespace: &'a str,
    /// Pid of the init process (host pid namespace).
    pub init_pid: u32,
    /// Baton settings after the TOML / pod / container layering.
    pub settings: &'a BatonSettings,
    /// This shim's control socket (where the agent sends preempt, resume and start).
    pub control_socket: Option<&'a Path>,
    /// The container's persisted preemption state.
    pub preemption: Option<&'a PreemptState>,
}

enum LinkMsg {
    Register {
        registration: Box<Registration>,
        endpoint: Endpoint,
        done: Option<oneshot::Sender<Result<(), String>>>,
    },
    Unregister(ContainerRef),
    /// The container's preemption state changed: a re-registration (after an agent restart) carries it.
    Preemption(ContainerRef, Option<PreemptState>),
}

/// The pid of the agent this shim is connected to now: the peer (SO_PEERCRED) of the link's live control
/// connection, 0 while there is none. While that connection is open its peer cannot exit unnoticed (the
/// link drops the pid as soon as a read or a call on it fails), so the pid names the agent, not a process
/// that got its number later.
#[derive(Clone, Default)]
pub struct AgentPid(Arc<AtomicU32>);

impl AgentPid {
    /// The agent's pid, or `None` when the shim has no live connection to an agent.
    pub fn get(&self) -> Option<u32> {
        match self.0.load(Ordering::Acquire) {
            0 => None,
            pid => Some(pid),
        }
    }

    fn set(&self, pid: Option<u32>) {
        self.0.store(pid.unwrap_or(0), Ordering::Release);
    }
}

/// The shim's side of the agent (one per shim, shared by its containers).
pub struct GpuAgent {
    events: Events,
    link: Mutex<Option<mpsc::UnboundedSender<LinkMsg>>>,
    agent_pid: AgentPid,
}

impl GpuAgent {
    /// A link that connects on the first GPU container; events go out through `events`.
    pub fn new(events: Events) -> Self {
        Self {
            events,
            link: Mutex::new(None),
            agent_pid: AgentPid::default(),
        }
    }

    /// The pid of the agent the link is connected to now (`None`: none).
    pub fn agent_pid(&self) -> Option<u32> {
        self.agent_pid.get()
    }

    /// runc created the container: have the agent watch it before its program runs. Never fails it.
    pub async fn container_created(&self, c: &GpuContainer<'_>) {
        let Some(registration) = registration_of(c) else {
            return;
        };
        let (done, ack) = oneshot::channel();
        self.send(LinkMsg::Register {
            registration: Box::new(registration),
            endpoint: endpoint_of(c.settings),
            done: Some(done),
        });
        match tokio::time::timeout(REGISTER_TIMEOUT, ack).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => {
                tracing::warn!(
                    id = c.id,
                    "gpu: the agent does not watch this container: {e}"
                );
            }
            Ok(Err(_)) => {}
            Err(_) => tracing::warn!(
                id = c.id,
                "gpu: the agent did not answer within {REGISTER_TIMEOUT:?}; the container starts without waiting"
            ),
        }
    }

    /// The container's init is running (the pid a restored container gets at Start). Never fails it.
    pub fn container_started(&self, c: &GpuContainer<'_>) {
        if let Some(registration) = registration_of(c) {
            self.send(LinkMsg::Register {
                registration: Box::new(registration),
                endpoint: endpoint_of(c.settings),
                done: None,
            });
        }
    }

    /// The container's preemption state is now `state` (kept for the next registration).
    pub fn preemption_changed(&self, id: &str, namespace: &str, state: Option<PreemptState>) {
        let guard = self.link.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(tx) = guard.as_ref() {
            let c = ContainerRef {
                id: id.to_owned(),
                namespace: namespace.to_owned(),
            };
            let _ = tx.send(LinkMsg::Preemption(c, state));
        }
    }

    /// The container was deleted: the agent stops watching it.
    pub fn container_deleted(&self, id: &str, namespace: &str) {
        let guard = self.link.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(tx) = guard.as_ref() {
            let _ = tx.send(LinkMsg::Unregister(ContainerRef {
                id: id.to_owned(),
                namespace: namespace.to_owned(),
            }));
        }
    }

    fn send(&self, msg: LinkMsg) {
        let mut guard = self.link.lock().unwrap_or_else(|p| p.into_inner());
        let tx = guard.get_or_insert_with(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            tokio::spawn(Link::new(self.events.clone(), self.agent_pid.clone()).run(rx));
            tx
        });
        let _ = tx.send(msg);
    }
}

/// What to register for `c`, or `None` when it is not to be watched (ebpf off, neither NVIDIA devices nor
/// a `baton.io/role`, no pid).
fn registration_of(c: &GpuContainer<'_>) -> Option<Registration> {
    if c.init_pid == 0 {
        return None;
    }
    if !c.settings.ebpf {
        tracing::debug!(id = c.id, "gpu: not watched (ebpf = false)");
        return None;
    }
    let dir = baton_agent_api::device_dir(&c.settings.trace_prefix);
    let devices = nvidia_devices(c.init_pid, dir);
    let role = c.settings.role_spec();
    if devices.is_empty() && role.is_none() {
        tracing::debug!(id = c.id, "gpu: no NVIDIA device files in the container");
        return None;
    }
    let Some(cgroup) = baton_cgroups::v2_path_of_pid(c.init_pid) else {
        tracing::warn!(
            id = c.id,
            "gpu: not watched: the container has no cgroup v2 path, which attributes its calls"
        );
        return None;
    };
    Some(Registration {
        container: ContainerRef {
            id: c.id.to_owned(),
            namespace: c.namespace.to_owned(),
        },
        cgroup,
        init_pid: c.init_pid,
        devices,
        settings: WatchSettings {
            trace_prefix: c.settings.trace_prefix.clone(),
            rate_gate: c.settings.rate_gate.map(Box::new),
            gpu_memory_headroom: c.settings.gpu_memory_headroom,
            gpu_memory_minimum: c.settings.gpu_memory_minimum,
            park_memory: c.settings.park_memory,
            parked_host_memory_budget: c.settings.parked_host_memory_budget,
        },
        control_socket: c.control_socket.map(|p| p.display().to_string()),
        preemption: c.preemption.cloned(),
        role,
        kubernetes: c.settings.kubernetes.clone().map(Box::new),
        gpu_memory: c.settings.gpu_memory,
    })
}

/// Whether the agent is to watch `c` (it sees NVIDIA devices and eBPF is on).
pub fn is_watched(c: &GpuContainer<'_>) -> bool {
    registration_of(c).is_some()
}

/// The agent's socket for `settings`.
pub fn agent_socket(settings: &BatonSettings) -> PathBuf {
    endpoint_of(settings).socket
}

/// Waits, at most `within`, until the agent says no other container holds the NVIDIA devices `c` sees: how
/// long it waited and when (CLOCK_MONOTONIC ns) it found them free; the error says who holds them, or that no
/// agent answered.
pub async fn wait_gpu_free(c: &GpuContainer<'_>, within: Duration) -> Result<(u64, u64), String> {
    let endpoint = endpoint_of(c.settings);
    let asked = tokio::time::Instant::now();
    let deadline = asked + within;
    // Whether the agent went away during this wait (a "not watched" answer then means "not yet").
    let mut lost = false;
    loop {
        let left = deadline.saturating_duration_since(tokio::time::Instant::now());
        match ask_gpu_free(&endpoint, c, left).await {
            Ok((waited_ns, t_free_ns)) => {
                let total = u64::try_from(asked.elapsed().as_nanos()).unwrap_or(u64::MAX);
                return Ok((waited_ns.max(total), t_free_ns));
            }
            // The agent went away while the Start waited (a DaemonSet rollout, a crash): the next agent is
            // asked for the time left, once the shim's link has registered the container with it again.
            Err(Asked::Lost(e)) if left > AGAIN_AFTER => {
                if !lost {
                    tracing::warn!(
                        id = c.id,
                        "wait-gpu-free: {e}; asking the agent again for the {left:?} left"
                    );
                }
                lost = true;
                tokio::time::sleep(AGAIN_AFTER).await;
            }
            Err(Asked::NotYetWatched(_)) if lost && left > AGAIN_AFTER => {
                tokio::time::sleep(AGAIN_AFTER).await;
            }
            Err(Asked::Lost(e) | Asked::NotYetWatched(e) | Asked::Final(e)) => return Err(e),
        }
    }
}

/// How long a gate wait whose agent went away waits before it asks again.
const AGAIN_AFTER: Duration = Duration::from_millis(100);

/// Why one question to the gate got no answer.
enum Asked {
    /// The agent went away (or never answered the connection): ask again.
    Lost(String),
    /// The agent does not watch the container (yet, after an agent restart): ask again once a connection
    /// was lost, final otherwise.
    NotYetWatched(String),
    /// The agent's answer: the GPU stayed held, or the request was refused.
    Final(String),
}

/// Asks the agent once whether container `c`'s GPUs are free, waiting up to `within`.
async fn ask_gpu_free(
    endpoint: &Endpoint,
    c: &GpuContainer<'_>,
    within: Duration,
) -> Result<(u64, u64), Asked> {
    let mut client = baton_agent_api::connect_or_start(endpoint, REGISTER_TIMEOUT.min(within))
        .await
        .map_err(|e| Asked::Lost(format!("cannot tell whether the GPU is free: {e}")))?;
    let request = Request::WaitGpuFree(GateRequest {
        container: ContainerRef {
            id: c.id.to_owned(),
            namespace: c.namespace.to_owned(),
        },
        timeout_ms: u64::try_from(within.as_millis()).unwrap_or(u64::MAX),
    });
    // The agent answers at the deadline itself; the margin only covers an agent that hangs. (Settings bound
    // `within`; the sum saturates all the same, so no value can overflow here.)
    let bound = within.saturating_add(REGISTER_TIMEOUT);
    match tokio::time::timeout(bound, client.call(request)).await {
        Ok(Ok(Reply::GpuFree {
            waited_ns,
            t_free_ns,
        })) => Ok((waited_ns, t_free_ns)),
        Ok(Ok(other)) => Err(Asked::Final(format!(
            "unexpected reply from the agent: {other:?}"
        ))),
        Ok(Err(baton_agent_api::ClientError::Refused(e))) if e.contains(NOT_WATCHED) => {
            Err(Asked::NotYetWatched(e))
        }
        Ok(Err(baton_agent_api::ClientError::Refused(e))) => Err(Asked::Final(e)),
        Ok(Err(e)) => Err(Asked::Lost(format!(
            "cannot tell whether the GPU is free: {e}"
        ))),
        Err(_) => Err(Asked::Final(format!(
            "the baton agent did not answer within {bound:?}"
        ))),
    }
}

/// Asks the agent whether parked container `id` (in `namespace`), being stopped, is to be resumed first (its
/// GPU is free for it), and why; the error says why no answer came (no agent: it is not resumed).
pub async fn stop_parked(
    settings: &BatonSettings,
    id: &str,
    namespace: &str,
) -> Result<(bool, String), String> {
    let endpoint = Endpoint {
        autostart: None,
        ..endpoint_of(settings)
    };
    let ask = async {
        let mut client = baton_agent_api::connect_or_start(&endpoint, REGISTER_TIMEOUT).await?;
        client
            .call(Request::StopParked(ContainerRef {
                id: id.to_owned(),
                namespace: namespace.to_owned(),
            }))
            .await
    };
    match tokio::time::timeout(REGISTER_TIMEOUT, ask).await {
        Ok(Ok(Reply::StopParked { resume_first, why })) => Ok((resume_first, why)),
        Ok(Ok(other)) => Err(format!("unexpected reply from the agent: {other:?}")),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!(
            "the baton agent did not answer within {REGISTER_TIMEOUT:?}"
        )),
    }
}

/// What the agent's refusal of a gate request for a container it does not watch says.
const NOT_WATCHED: &str = "is not watched by the agent";

/// The processes of container `c` that hold NVIDIA files, from the agent's ledger (empty without an
/// agent, or when it does not watch `c`).
pub async fn cuda_pids(settings: &BatonSettings, id: &str, namespace: &str) -> Vec<u32> {
    let endpoint = Endpoint {
        autostart: None,
        ..endpoint_of(settings)
    };
    let status = async {
        let mut client = baton_agent_api::connect_or_start(&endpoint, REGISTER_TIMEOUT).await?;
        client
            .call(Request::Status(Filter {
                container: Some(id.to_owned()),
                namespace: Some(namespace.to_owned()),
                mine: false,
            }))
            .await
    };
    match tokio::time::timeout(REGISTER_TIMEOUT, status).await {
        Ok(Ok(Reply::Status(s))) => s
            .containers
            .iter()
            .flat_map(|c| c.processes.iter().map(|p| p.pid))
            .collect(),
        Ok(Ok(_)) => Vec::new(),
        Ok(Err(e)) => {
            tracing::warn!(id, "gpu: cannot ask the agent for the CUDA processes: {e}");
            Vec::new()
        }
        Err(_) => {
            tracing::warn!(
                id,
                "gpu: the agent did not say which processes use CUDA in time"
            );
            Vec::new()
        }
    }
}

/// Where the agent is for a container with `settings`, and whether this shim may start it.
fn endpoint_of(settings: &BatonSettings) -> Endpoint {
    Endpoint {
        socket: settings
            .agent_socket
            .clone()
            .unwrap_or_else(baton_agent_api::default_socket),
        autostart: if settings.agent_autostart {
            baton_binary()
        } else {
            None
        },
    }
}

/// The `baton` program that starts an agent: next to the shim's binary, else on PATH.
fn baton_binary() -> Option<PathBuf> {
    let beside = std::env::current_exe()
        .ok()
        .and_then(|exe| exe.parent().map(|d| d.join("baton")))
        .filter(|p| p.is_file());
    beside.or_else(|| {
        std::env::var_os("PATH").and_then(|path| {
            std::env::split_paths(&path)
                .map(|d| d.join("baton"))
                .find(|p| p.is_file())
        })
    })
}

/// The NVIDIA device files in `dir` of the root of the container of `pid` (paths inside the container).
fn nvidia_devices(pid: u32, dir: &str) -> Vec<String> {
    baton_agent_api::nvidia_devices_in(Path::new(&format!("/proc/{pid}/root{dir}")), dir)
}

/// The task that talks to the agent: registrations, and the watch stream of this shim's containers.
struct Link {
    events: Events,
    agent_pid: AgentPid,
    registered: BTreeMap<ContainerRef, Registration>,
    endpoint: Option<Endpoint>,
    control: Option<Client>,
    watch: Option<Client>,
    down_logged: bool,
    backoff: Duration,
    /// Containers the agent said it could not watch again (`watch_lost`): registered again after
    /// `retry_backoff`.
    retry: BTreeSet<ContainerRef>,
    retry_backoff: Duration,
}

impl Link {
    fn new(events: Events, agent_pid: AgentPid) -> Self {
        Self {
            events,
            agent_pid,
            registered: BTreeMap::new(),
            endpoint: None,
            control: None,
            watch: None,
            down_logged: false,
            backoff: Duration::from_millis(100),
            retry: BTreeSet::new(),
            retry_backoff: Duration::from_millis(100),
        }
    }

    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<LinkMsg>) {
        loop {
            let reconnect = self.control.is_none() && !self.registered.is_empty();
            tokio::select! {
                msg = rx.recv() => match msg {
                    Some(m) => self.handle(m).await,
                    None => return,
                },
                ev = next_event(self.watch.as_mut()) => match ev {
                    Ok(e) => self.publish(e).await,
                    Err(e) => self.lost(&e.to_string()),
                },
                () = tokio::time::sleep(self.backoff), if reconnect => self.reconnect().await,
                () = tokio::time::sleep(self.retry_backoff), if self.control.is_some() && !self.retry.is_empty() => {
                    self.register_lost().await;
                }
            }
        }
    }

    async fn handle(&mut self, msg: LinkMsg) {
        match msg {
            LinkMsg::Register {
                registration,
                endpoint,
                done,
            } => {
                let registration = *registration;
                // Start re-registers for the pid a restored container gets: nothing to do when it is the same.
                if done.is_none()
                    && self.registered.get(&registration.container) == Some(&registration)
                {
                    return;
                }
                self.endpoint.get_or_insert(endpoint);
                let result = self.register(&registration).await;
                self.registered
                    .insert(registration.container.clone(), registration);
                if let Some(done) = done {
                    let _ = done.send(result);
                }
            }
            LinkMsg::Preemption(c, state) => {
                let Some(r) = self.registered.get_mut(&c) else {
                    return;
                };
                if r.preemption == state {
                    return;
                }
                r.preemption = state.clone();
                // The shim owns the state: the agent learns each change from here, whoever asked for it
                // and whether or not that client is still there.
                if let Some(client) = self.control.as_mut() {
                    let update = PreemptionUpdate {
                        container: c.clone(),
                        state,
                    };
                    let call = client.call(Request::Preemption(update));
                    match tokio::time::timeout(UNREGISTER_TIMEOUT, call).await {
                        Ok(Ok(_)) => {}
                        Ok(Err(e)) => self.lost(&e.to_string()),
                        Err(_) => self.lost("pushing the preemption state timed out"),
                    }
                }
            }
            LinkMsg::Unregister(c) => {
                if self.registered.remove(&c).is_some()
                    && let Some(client) = self.control.as_mut()
                {
                    let call = client.call(Request::Unregister(c.clone()));
                    match tokio::time::timeout(UNREGISTER_TIMEOUT, call).await {
                        Ok(Ok(_)) => {}
                        Ok(Err(e)) => self.lost(&e.to_string()),
                        Err(_) => self.lost("unregister timed out"),
                    }
                }
            }
        }
    }

    /// Registers one container, connecting (and starting the agent) first if need be.
    async fn register(&mut self, reg: &Registration) -> Result<(), String> {
        if self.control.is_none() {
            self.connect().await?;
        }
        let Some(client) = self.control.as_mut() else {
            return Err("not connected".to_owned());
        };
        match client.call(Request::Register(Box::new(reg.clone()))).await {
            Ok(Reply::Registered { container }) => {
                tracing::info!(
                    id = reg.container.id,
                    cgroup = container.cgroup,
                    partial = container.partial,
                    "gpu: the agent watches the container"
                );
                Ok(())
            }
            Ok(other) => Err(format!("unexpected reply {other:?}")),
            Err(baton_agent_api::ClientError::Refused(e)) => Err(e),
            Err(e) => {
                let text = e.to_string();
                self.lost(&text);
                Err(text)
            }
        }
    }

    /// Opens the control and watch connections.
    async fn connect(&mut self) -> Result<(), String> {
        let Some(endpoint) = self.endpoint.clone() else {
            return Err("no agent endpoint configured".to_owned());
        };
        let result = async {
            let control = baton_agent_api::connect_or_start(&endpoint, REGISTER_TIMEOUT).await?;
            let mut watch = Client::connect(control.path()).await?;
            watch
                .watch(Filter {
                    mine: true,
                    ..Default::default()
                })
                .await?;
            Ok::<_, baton_agent_api::ClientError>((control, watch))
        }
        .await;
        match result {
            Ok((control, watch)) => {
                if std::mem::take(&mut self.down_logged) {
                    tracing::info!(
                        "gpu: connected to the baton agent at {} again",
                        endpoint.socket.display()
                    );
                }
                self.agent_pid.set(control.peer_pid());
                self.control = Some(control);
                self.watch = Some(watch);
                self.backoff = Duration::from_millis(100);
                Ok(())
            }
            Err(e) => {
                let text = e.to_string();
                self.log_down(&text);
                Err(text)
            }
        }
    }

    /// The agent went away: drop the connections; the run loop reconnects while containers are registered.
    fn lost(&mut self, why: &str) {
        self.agent_pid.set(None);
        self.control = None;
        self.watch = None;
        self.log_down(why);
    }

    fn log_down(&mut self, why: &str) {
        if !std::mem::replace(&mut self.down_logged, true) {
            tracing::warn!(
                "gpu: no baton agent ({why}); containers run as with plain runc until it is back"
            );
        }
    }

    /// Registers again the containers the agent lost (`watch_lost`); those that fail wait twice as long.
    async fn register_lost(&mut self) {
        for c in std::mem::take(&mut self.retry) {
            let Some(reg) = self.registered.get(&c).cloned() else {
                continue;
            };
            match self.register(&reg).await {
                Ok(()) => self.retry_backoff = Duration::from_millis(100),
                Err(e) => {
                    tracing::warn!(id = c.id, "gpu: registering again failed: {e}");
                    self.retry.insert(c);
                }
            }
        }
        if !self.retry.is_empty() {
            self.retry_backoff = (self.retry_backoff * 2).min(MAX_BACKOFF);
        }
    }

    async fn reconnect(&mut self) {
        self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
        if self.connect().await.is_err() {
            return;
        }
        let all: Vec<Registration> = self.registered.values().cloned().collect();
        for reg in all {
            if let Err(e) = self.register(&reg).await {
                tracing::warn!(id = reg.container.id, "gpu: registering again failed: {e}");
            }
        }
    }

    async fn publish(&mut self, e: baton_agent_api::Event) {
        let id = e.container.id.clone();
        match e.body {
            EventBody::WatchLost { error } => {
                tracing::warn!(id, "gpu: {error}; registering it again");
                if self.registered.contains_key(&e.container) {
                    self.retry.insert(e.container.clone());
                }
            }
            EventBody::Acquired(a) => {
                tracing::info!(id, pid = a.pid, "gpu: container acquired the GPU");
                let payload = serde_json::json!({
                    "container_id": id,
                    "namespace": e.container.namespace,
                    "pid": a.pid,
                    "t_acquired_ns": a.t_acquired_ns.to_string(),
                });
                self.events.gpu(GPU_ACQUIRED_TOPIC, &payload).await;
            }
            EventBody::Released(r) => {
                tracing::info!(
                    id,
                    pids = ?r.pids,
                    t_last_close_ns = r.t_last_close_ns,
                    t_released_ns = r.t_released_ns,
                    confirmed_by = r.confirmed_by,
                    "gpu: container released the GPU"
                );
                let payload = serde_json::json!({
                    "container_id": id,
                    "namespace": e.container.namespace,
                    "pids": r.pids,
                    "t_last_close_ns": r.t_last_close_ns.to_string(),
                    "t_released_ns": r.t_released_ns.to_string(),
                    "confirmed_by": r.confirmed_by,
                    "objects_freed": r.objects_freed,
                    "bytes_freed": r.bytes_freed.to_string(),
                });
                self.events.gpu(GPU_RELEASED_TOPIC, &payload).await;
            }
            EventBody::NvmlCheck(c) => {
                tracing::info!(
                    id,
                    released_seq = c.released_seq,
                    nvml = %serde_json::to_string(&c.nvml).unwrap_or_default(),
                    "gpu: NVML's cross-check of the release"
                );
                let payload = serde_json::json!({
                    "container_id": id,
                    "namespace": e.container.namespace,
                    "released_seq": c.released_seq.to_string(),
                    "t_released_ns": c.t_released_ns.to_string(),
                    "pids": c.pids,
                    "t_asked_ns": c.t_asked_ns.to_string(),
                    "took_ns": c.took_ns.to_string(),
                    "nvml": c.nvml,
                });
                self.events.gpu(GPU_NVML_CHECK_TOPIC, &payload).await;
            }
            EventBody::Unregistered {
                live_objects,
                vram_bytes,
                peak_vram_bytes,
            } => tracing::info!(
                id,
                live_objects,
                vram_bytes,
                peak_vram_bytes,
                "gpu: the agent no longer watches the container"
            ),
            EventBody::Registered { .. } | EventBody::Other => {}
        }
    }
}

/// containerd topic of the acquired signal.
pub const GPU_ACQUIRED_TOPIC: &str = "/baton/gpu/acquired";
/// containerd topic of the released signal.
pub const GPU_RELEASED_TOPIC: &str = "/baton/gpu/released";
/// containerd topic of NVML's cross-check of a release (after `/baton/gpu/released`).
pub const GPU_NVML_CHECK_TOPIC: &str = "/baton/gpu/nvml_check";

/// The next event on the watch connection, or never without one.
async fn next_event(
    watch: Option<&mut Client>,
) -> Result<baton_agent_api::Event, baton_agent_api::ClientError> {
    match watch {
        Some(w) => w.next_event().await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_nvidia_device_files_are_listed() {
        // A device directory of our own, so that the answer does not depend on the machine's /dev.
        let dir = tempfile::tempdir().unwrap();
        let d = format!("{}/", dir.path().display());
        assert!(nvidia_devices(std::process::id(), &d).is_empty());
        std::fs::write(dir.path().join("nvidiactl"), b"").unwrap();
        std::fs::write(dir.path().join("null"), b"").unwrap();
        assert_eq!(
            nvidia_devices(std::process::id(), &d),
            vec![format!("{d}nvidiactl")]
        );
    }
}
