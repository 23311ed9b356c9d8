//! The agent's one task that owns the probes and the watched containers: it answers requests (from the
//! connections, through a channel), reads the probes' records, and publishes each container's transitions.
//!
//! The probes are loaded at the first registration and dropped (detached) with the last one, so a node
//! without watched containers pays nothing for them.
use std::collections::{BTreeMap, HashMap};

use baton_agent_api::{
    ContainerRef, ContainerStatus, Event, EventBody, Filter, GateRequest, NodeStatus, Pong,
    PreemptState, PreemptionUpdate, Registration, Reply, Target, TraceRequest,
};
use baton_tracer::cgroups::process_gone;
use baton_tracer::{
    Tracer, TracerConfig,
    event::{Body, Event as Record},
};
use tokio::sync::{broadcast, mpsc, oneshot};

use super::{
    control,
    gate::{self, Waiter},
    holders::{Classifier, Exempt, Holding, node_gpu_holders},
    metrics::{
        events::events,
        snapshot::{ContainerSample, IoctlCounts, Snapshot, TracerTotals},
    },
    sleep_until_opt,
    trace_session::TraceSession,
    watched::Watched,
};
use crate::trace::now_monotonic_ns;

/// An event on its way to the watchers, with the pid of the process that registered its container.
#[derive(Clone, Debug)]
pub struct Published {
    /// The event.
    pub event: Event,
    /// Who registered the container (for `watch {"mine": true}`).
    pub owner: u32,
}

/// What a connection asks of the core.
pub enum What {
    /// A request of the protocol (not `trace`, which comes as `Trace`).
    Request(baton_agent_api::Request),
    /// Start trace session `session`, whose lines go to `lines`.
    Trace {
        /// The connection's session number.
        session: u64,
        /// What to trace.
        request: TraceRequest,
        /// Where its lines go.
        lines: mpsc::Sender<String>,
    },
    /// The client ended trace session `session`.
    EndTrace(u64),
    /// A connection of process `pid` ended (a shim that exited, or was killed, ends both of its own).
    PeerGone(u32),
    /// A Start waits for a free GPU: the reply comes when the devices are free, or at the deadline.
    Gate(GateRequest),
    /// Which watched container a user means, its shim's socket and its CUDA processes.
    Resolve {
        /// As the user named it.
        target: Target,
        /// The answer.
        answer: oneshot::Sender<Result<Resolved, String>>,
    },
    /// Kernel launches (libcuda uprobes) counted so far per watched container.
    Launches(oneshot::Sender<Vec<(ContainerRef, u64)>>),
    /// A freeze, thaw or preemption step of a container, for the trace sessions that trace it.
    Note(Note),
    /// What the metrics endpoint shows (`agent/metrics`).
    Metrics(oneshot::Sender<Snapshot>),
    /// Whether the connection's peer may ask anything: a process inside a watched container may not.
    CheckPeer(oneshot::Sender<Result<(), String>>),
    /// A preemption changed a container's state.
    SetPreemption {
        /// Which container.
        container: ContainerRef,
        /// Its state now.
        state: Option<PreemptState>,
    },
}

/// Something the agent did to a container that its traces show (`+++ frozen +++`) and timelines draw.
#[derive(Clone, Debug)]
pub struct Note {
    /// Which container.
    pub container: ContainerRef,
    /// CLOCK_MONOTONIC ns of it (the kernel's confirmation, for a freeze or a thaw).
    pub t_ns: u64,
    /// What happened.
    pub kind: NoteKind,
}

/// What a [`Note`] says.
#[derive(Clone, Debug)]
pub enum NoteKind {
    /// The controller froze it; the freeze took `latency_ns` to confirm.
    Frozen {
        /// Write to confirmation, ns.
        latency_ns: u64,
    },
    /// The controller thawed it.
    Thawed {
        /// Write to confirmation, ns.
        latency_ns: u64,
    },
    /// A step of a preemption, resume or handoff.
    Preemption {
        /// The step.
        phase: baton_agent_api::Phase,
        /// What the step says.
        detail: String,
    },
}

impl Note {
    /// Hands the note to the core without waiting: a full inbox drops it (a trace line is not worth
    /// stalling a freeze or a preemption for).
    pub fn send(self, core: &mpsc::Sender<Command>) {
        let (reply, _) = oneshot::channel();
        let _ = core.try_send(Command {
            what: What::Note(self),
            peer_pid: 0,
            reply,
        });
    }
}

/// A watched container as a preemption needs it.
#[derive(Clone, Debug)]
pub struct Resolved {
    /// Which container.
    pub container: ContainerRef,
    /// Its shim's control socket.
    pub control_socket: Option<String>,
    /// Its processes that hold NVIDIA files (its CUDA processes).
    pub pids: Vec<u32>,
    /// Its preemption state.
    pub preemption: Option<PreemptState>,
}

/// A request from a connection.
pub struct Command {
    /// What is asked.
    pub what: What,
    /// The asking process (SO_PEERCRED).
    pub peer_pid: u32,
    /// Where the reply goes.
    pub reply: oneshot::Sender<Reply>,
}

/// The probes, the watched containers, and the event stream.
pub struct Core {
    tracer: Option<Tracer>,
    watched: BTreeMap<ContainerRef, Watched>,
    by_cgroup: HashMap<u64, ContainerRef>,
    events: broadcast::Sender<Published>,
    seq: u64,
    traces: BTreeMap<u64, TraceSession>,
    waiters: Vec<Waiter>,
    controller: control::Handle,
    members_sent: Vec<control::Member>,
    /// When the trace sessions' next launch lines are due (a deadline that records do not push back).
    launches_due: Option<tokio::time::Instant>,
    /// Each watched cgroup's ioctls, for the metrics.
    ioctls: HashMap<u64, IoctlCounts>,
    /// The counters of the probe sets loaded before the current one.
    retired: TracerTotals,
    /// Tells NVIDIA files apart in /proc (the hidden-holder checks).
    classifier: Classifier,
    /// The node's own processes, which never count as holders.
    exempt: Exempt,
    /// When to look at /proc again for holders the probes cannot see (a release or a gate waits for one).
    recheck_due: Option<tokio::time::Instant>,
    /// The delay before the next such look (grows while nothing changes).
    recheck_every: std::time::Duration,
}

/// The first delay before /proc is read again for a hidden holder, and the longest.
const RECHECK_FIRST: std::time::Duration = std::time::Duration::from_millis(5);
const RECHECK_MAX: std::time::Duration = std::time::Duration::from_millis(200);

impl Core {
    /// A core with nothing watched, publishing on `events`; the co-runner controller learns the watched
    /// containers' roles from it.
    pub fn new(
        events: broadcast::Sender<Published>,
        controller: control::Handle,
        exempt: Exempt,
    ) -> Self {
        Self {
            tracer: None,
            watched: BTreeMap::new(),
            by_cgroup: HashMap::new(),
            events,
            seq: 0,
            traces: BTreeMap::new(),
            waiters: Vec::new(),
            controller,
            members_sent: Vec::new(),
            launches_due: None,
            ioctls: HashMap::new(),
            retired: TracerTotals::default(),
            classifier: Classifier::new(),
            exempt,
            recheck_due: None,
            recheck_every: RECHECK_FIRST,
        }
    }

    /// What the metrics endpoint shows now.
    fn metrics_snapshot(&self) -> Snapshot {
        let containers = match &self.tracer {
            Some(t) => self
                .watched
                .values()
                .map(|w| ContainerSample::of(w, t, self.ioctls.get(&w.cgroup_id)))
                .collect(),
            None => Vec::new(),
        };
        Snapshot {
            containers,
            probes_attached: self.tracer.is_some(),
            totals: self.retired.with(self.tracer.as_ref()),
            controller: self.controller.status(),
        }
    }

    /// Drops the probes, keeping their counters for the metrics.
    fn retire_tracer(&mut self) -> bool {
        let Some(t) = self.tracer.take() else {
            return false;
        };
        self.retired = self.retired.with(Some(&t));
        true
    }

    /// The next launch lines of the trace sessions, while there are sessions.
    fn launch_due(&mut self) -> Option<tokio::time::Instant> {
        let every = self.traces.values().map(|s| s.launch_every).min()?;
        Some(
            *self
                .launches_due
                .get_or_insert_with(|| tokio::time::Instant::now() + every),
        )
    }

    /// Every trace session's launch lines.
    fn trace_launches(&mut self) {
        self.launches_due = None;
        let Some(t) = self.tracer.as_mut() else {
            return;
        };
        for s in self.traces.values_mut() {
            s.launches(t);
        }
    }

    /// The controller's status, with each co-runner's launches counted up to now.
    fn controller_status(&self) -> baton_agent_api::ControllerStatus {
        let mut status = self.controller.status();
        let launches: HashMap<ContainerRef, u64> = self.launches().into_iter().collect();
        for c in &mut status.co_runners {
            if let Some(&n) = launches.get(&c.container) {
                c.launches = Some(n);
            }
        }
        status
    }

    /// Launches counted per watched container (none without probes).
    fn launches(&self) -> Vec<(ContainerRef, u64)> {
        let Some(t) = self.tracer.as_ref() else {
            return Vec::new();
        };
        self.watched
            .iter()
            .map(|(c, w)| (c.clone(), t.launches(w.cgroup_id).total()))
            .collect()
    }

    /// Tells the controller the watched containers, when they changed.
    fn publish_members(&mut self) {
        let members: Vec<control::Member> = self
            .watched
            .values()
            .map(|w| control::Member {
                container: w.registration.container.clone(),
                role: w.registration.role.clone(),
                control_socket: w.registration.control_socket.clone(),
            })
            .collect();
        if members != self.members_sent {
            self.controller.members(members.clone());
            self.members_sent = members;
        }
    }

    /// Serves `commands` until every sender is gone.
    pub async fn run(mut self, mut commands: mpsc::Receiver<Command>) {
        loop {
            let launches_due = self.launch_due();
            tokio::select! {
                cmd = commands.recv() => match cmd {
                    Some(c) => {
                        let reply = match c.what {
                            What::Gate(request) => {
                                self.add_waiter(request, c.reply);
                                continue;
                            }
                            What::Resolve { target, answer } => {
                                let _ = answer.send(self.resolve(&target));
                                Reply::Unregistered { found: true }
                            }
                            What::Launches(answer) => {
                                let _ = answer.send(self.launches());
                                Reply::Unregistered { found: true }
                            }
                            What::Note(note) => {
                                self.note(&note);
                                Reply::Unregistered { found: true }
                            }
                            What::Metrics(answer) => {
                                let _ = answer.send(self.metrics_snapshot());
                                Reply::Unregistered { found: true }
                            }
                            What::CheckPeer(answer) => {
                                let _ = answer.send(self.check_peer(c.peer_pid));
                                Reply::Unregistered { found: true }
                            }
                            What::SetPreemption { container, state } => {
                                let found = self.set_preemption(&container, state);
                                Reply::Unregistered { found }
                            }
                            What::Request(r) => self.handle(r, c.peer_pid),
                            What::Trace { session, request, lines } => {
                                self.start_trace(session, &request, lines)
                            }
                            What::EndTrace(session) => self.end_trace(session),
                            What::PeerGone(pid) => self.peer_gone(pid),
                        };
                        let _ = c.reply.send(reply);
                        self.publish_members();
                    }
                    None => return,
                },
                batch = next_batch(self.tracer.as_mut()) => {
                    self.on_batch(batch);
                    self.check_gates();
                }
                () = sleep_until_opt(self.waiters.iter().map(|w| w.deadline).min()) => {
                    self.expire_gates();
                }
                () = sleep_until_opt(launches_due) => self.trace_launches(),
                () = sleep_until_opt(self.recheck_due) => self.recheck(),
                _ = rescan_tick(self.traces.values().any(TraceSession::has_names)) => {
                    if let Some(t) = self.tracer.as_mut() {
                        for s in self.traces.values_mut() {
                            s.refresh(t);
                        }
                    }
                }
            }
        }
    }

    fn handle(&mut self, request: baton_agent_api::Request, peer: u32) -> Reply {
        use baton_agent_api::Request as R;
        match request {
            R::Ping => Reply::Pong(Pong {
                agent_pid: std::process::id(),
                version: env!("CARGO_PKG_VERSION").to_owned(),
                probes_attached: self.tracer.is_some(),
            }),
            R::Register(reg) => {
                self.prune_orphans();
                self.register_reply(reg, peer)
            }
            R::Unregister(c) => Reply::Unregistered {
                found: self.unregister(&c),
            },
            R::Preemption(update) => self.preemption_pushed(update, peer),
            R::Status(filter) => {
                self.prune_orphans();
                Reply::Status(self.status(&filter, peer))
            }
            R::Watch(_)
            | R::Trace(_)
            | R::Preempt(_)
            | R::Resume(_)
            | R::Start(_)
            | R::Handoff(_)
            | R::WaitGpuFree(_)
            | R::Freeze(_)
            | R::Thaw(_)
            | R::Duty(_)
            | R::RequestStart(_)
            | R::FirstToken(_)
            | R::RequestEnd(_)
            | R::Token(_)
            | R::Governor(_) => Reply::Error {
                error: "this request is answered by the connection, not the core".to_owned(),
            },
        }
    }

    /// Refuses peer `pid` when it sits in a watched container's cgroup (or below it): the agent commands
    /// freezes, preemptions and gates of every container on the node, and a tenant's process is not to.
    fn check_peer(&self, pid: u32) -> Result<(), String> {
        if pid == 0 || self.watched.is_empty() {
            return Ok(());
        }
        let Some(path) = baton_tracer::cgroups::v2_path_of_pid(pid) else {
            return Ok(());
        };
        let path = path.trim_end_matches('/');
        let inside = self.watched.values().find(|w| {
            let cg = w.registration.cgroup.trim_end_matches('/');
            !cg.is_empty()
                && (path == cg || path.strip_prefix(cg).is_some_and(|r| r.starts_with('/')))
        });
        match inside {
            Some(w) => Err(format!(
                "the baton agent does not serve processes inside a watched container: pid {pid} is in \
                 cgroup {path}, container {} (namespace {})",
                w.registration.container.id, w.registration.container.namespace
            )),
            None => Ok(()),
        }
    }

    fn register_reply(&mut self, reg: Registration, owner: u32) -> Reply {
        match self.register(reg, owner) {
            Ok(container) => Reply::Registered { container },
            Err(error) => {
                self.free_unused_prefixes();
                self.drop_tracer_if_unused();
                Reply::Error { error }
            }
        }
    }

    fn register(&mut self, reg: Registration, owner: u32) -> Result<ContainerStatus, String> {
        check_cgroup_is_its_own(&reg, owner)?;
        let key = reg.container.clone();
        if let Some(w) = self.watched.get_mut(&key) {
            // A shim re-registering (after a reconnect) or giving a restored container's new pid: only the
            // process that registered it, for the same cgroup (its init checked to be in it above).
            let tracer = self.tracer.as_mut().ok_or("the probes are not loaded")?;
            let cgroup_id = tracer
                .cgroups_mut()
                .id_of_path(std::path::Path::new(&reg.cgroup))
                .map_err(|e| format!("cannot watch container {}: {e}", key.id))?;
            check_same_registrant(&key, w, cgroup_id, owner)?;
            w.registration.init_pid = reg.init_pid;
            w.registration.control_socket = reg.control_socket;
            w.registration.role = reg.role;
            w.registration.kubernetes = reg.kubernetes;
            w.owner = owner;
            let tracer = self.tracer.as_ref().ok_or("the probes are not loaded")?;
            return Ok(w.status(tracer));
        }
        self.load_tracer(&reg.settings.trace_prefix)?;
        let tracer = self.tracer.as_mut().ok_or("the probes are not loaded")?;
        let cgroup_id = tracer
            .cgroups_mut()
            .id_of_path(std::path::Path::new(&reg.cgroup))
            .map_err(|e| format!("cannot watch container {}: {e}", key.id))?;
        if let Some(other) = self.by_cgroup.get(&cgroup_id) {
            return Err(format!(
                "cgroup {} is already watched for container {} in namespace {}: each watched container \
                 needs a cgroup of its own",
                reg.cgroup, other.id, other.namespace
            ));
        }
        tracer
            .watch_cgroup(cgroup_id)
            .map_err(|e| format!("cannot watch container {}: {e}", key.id))?;
        let w = Watched::new(reg, owner, cgroup_id, tracer, now_monotonic_ns());
        let status = w.status(tracer);
        tracing::info!(
            id = key.id,
            namespace = key.namespace,
            cgroup = status.cgroup,
            cgroup_id,
            partial = status.partial,
            "agent: watching container"
        );
        let body = EventBody::Registered {
            cgroup: status.cgroup.clone(),
            init_pid: status.init_pid,
            partial: status.partial,
        };
        self.by_cgroup.insert(cgroup_id, key.clone());
        self.ioctls.insert(cgroup_id, IoctlCounts::default());
        self.watched.insert(key.clone(), w);
        self.publish(&key, owner, body);
        Ok(status)
    }

    /// Loads the probes on first use, and follows the device directory of the container's settings.
    fn load_tracer(&mut self, trace_prefix: &str) -> Result<(), String> {
        self.load_tracer_for(baton_agent_api::device_dir(trace_prefix))
    }

    /// Loads the probes on first use, and follows device directory `dir`.
    fn load_tracer_for(&mut self, dir: &str) -> Result<(), String> {
        let dir = dir.to_owned();
        match self.tracer.as_mut() {
            None => {
                let t = Tracer::start(TracerConfig {
                    prefixes: vec![dir.clone()],
                    ..Default::default()
                })
                .map_err(|e| format!("cannot load the probes: {e}"))?;
                tracing::info!("agent: probes attached (device directory {dir})");
                self.tracer = Some(t);
            }
            Some(t) => t.add_prefix(&dir).map_err(|e| {
                format!("cannot follow device directory {dir}: {e} (the probes follow at most 4)")
            })?,
        }
        Ok(())
    }

    /// Shows `note` to the trace sessions that trace its container.
    fn note(&mut self, note: &Note) {
        let (Some(t), Some(w)) = (self.tracer.as_mut(), self.watched.get(&note.container)) else {
            return;
        };
        for s in self.traces.values_mut() {
            if s.traces_cgroup(w.cgroup_id) {
                s.note(w.cgroup_id, note, t);
            }
        }
    }

    fn unregister(&mut self, c: &ContainerRef) -> bool {
        if let Some(t) = self.tracer.as_mut()
            && let Ok(batch) = t.drain_now()
        {
            self.apply(&batch);
        }
        let Some(w) = self.watched.remove(c) else {
            return false;
        };
        self.by_cgroup.remove(&w.cgroup_id);
        self.ioctls.remove(&w.cgroup_id);
        let body = match self.tracer.as_mut() {
            Some(t) => {
                t.unwatch_cgroup(w.cgroup_id);
                w.unregistered(t)
            }
            None => EventBody::Unregistered {
                live_objects: 0,
                vram_bytes: 0,
                peak_vram_bytes: 0,
            },
        };
        if let EventBody::Unregistered {
            live_objects,
            vram_bytes,
            peak_vram_bytes,
        } = &body
        {
            tracing::info!(
                id = c.id,
                namespace = c.namespace,
                live_objects,
                vram_bytes,
                peak_vram_bytes,
                "agent: no longer watching container"
            );
        }
        self.publish(c, w.owner, body);
        self.free_unused_prefixes();
        self.drop_tracer_if_unused();
        self.check_gates();
        true
    }

    fn resolve(&self, target: &Target) -> Result<Resolved, String> {
        let matching: Vec<(&ContainerRef, &Watched)> = self
            .watched
            .iter()
            .filter(|(c, _)| {
                c.id == target.id && target.namespace.as_ref().is_none_or(|n| *n == c.namespace)
            })
            .collect();
        let (c, w) = match matching.as_slice() {
            [] => {
                return Err(format!(
                    "no watched container {}{}: `baton status` lists the containers the agent watches \
                     (a container is watched when it sees NVIDIA devices and runs under the baton runtime)",
                    target.id,
                    target
                        .namespace
                        .as_ref()
                        .map_or_else(String::new, |n| format!(" in namespace {n}"))
                ));
            }
            [one] => *one,
            many => {
                let namespaces: Vec<&str> =
                    many.iter().map(|(c, _)| c.namespace.as_str()).collect();
                return Err(format!(
                    "container id {} is in several namespaces ({}): add -n NAMESPACE",
                    target.id,
                    namespaces.join(", ")
                ));
            }
        };
        let mut pids: Vec<u32> = self
            .tracer
            .as_ref()
            .map(|t| {
                t.fd_table()
                    .iter()
                    .filter(|(_, p)| p.cgroup_id == w.cgroup_id && p.pins_driver())
                    .map(|(pid, _)| pid)
                    .collect()
            })
            .unwrap_or_default();
        pids.sort_unstable();
        Ok(Resolved {
            container: c.clone(),
            control_socket: w.registration.control_socket.clone(),
            pids,
            preemption: w.preemption.clone(),
        })
    }

    /// The shim that registered a container pushes its preemption state (it owns it): kept as it says.
    fn preemption_pushed(&mut self, update: PreemptionUpdate, peer: u32) -> Reply {
        let Some(w) = self.watched.get_mut(&update.container) else {
            return Reply::Unregistered { found: false };
        };
        if w.owner != peer {
            return Reply::Error {
                error: format!(
                    "only the shim that registered container {} (pid {}) sets its preemption state",
                    update.container.id, w.owner
                ),
            };
        }
        w.preemption = update.state;
        Reply::Unregistered { found: true }
    }

    fn set_preemption(&mut self, c: &ContainerRef, state: Option<PreemptState>) -> bool {
        match self.watched.get_mut(c) {
            Some(w) => {
                w.preemption = state;
                true
            }
            None => false,
        }
    }

    fn add_waiter(&mut self, request: GateRequest, reply: oneshot::Sender<Reply>) {
        let Some(w) = self.watched.get(&request.container) else {
            let _ = reply.send(Reply::Error {
                error: format!(
                    "container {} is not watched by the agent: nothing tells whether its GPU is free",
                    request.container.id
                ),
            });
            return;
        };
        let devices = gate::devices_seen(w.registration.init_pid, &w.registration.devices);
        let timeout = std::time::Duration::from_millis(request.timeout_ms);
        let cgroup = w.registration.cgroup.clone();
        self.waiters.push(Waiter {
            container: request.container,
            cgroup,
            hidden_logged: false,
            devices,
            asked_ns: now_monotonic_ns(),
            deadline: tokio::time::Instant::now() + timeout,
            reply,
        });
        self.check_gates();
    }

    /// The other containers holding a file of a device in `devices` (any GPU device when empty).
    fn holders(
        &self,
        me: &ContainerRef,
        devices: &std::collections::BTreeSet<gate::DeviceKey>,
    ) -> Vec<&Watched> {
        let Some(tracer) = self.tracer.as_ref() else {
            return Vec::new();
        };
        self.watched
            .iter()
            .filter(|(c, _)| *c != me)
            .filter(|(_, w)| {
                let held = gate::devices_held(tracer, w.cgroup_id);
                if devices.is_empty() {
                    !held.is_empty()
                } else {
                    held.iter()
                        .any(|d| devices.iter().any(|w| w.same_device(d)))
                }
            })
            .map(|(_, w)| w)
            .collect()
    }

    /// Who keeps waiter `w` from starting: the other watched containers the probes see holding one of its
    /// devices and, once those are gone, every process /proc shows holding one (in any container, watched
    /// or not: a file passed over a socket, a mapping kept after its fd was closed, a container Baton does
    /// not watch). Both empty when its GPU is free.
    fn gate_holders(&self, w: &Waiter) -> (Vec<String>, Vec<Holding>) {
        let watched: Vec<String> = self
            .holders(&w.container, &w.devices)
            .iter()
            .map(|h| {
                format!(
                    "container {} (namespace {})",
                    h.registration.container.id, h.registration.container.namespace
                )
            })
            .collect();
        if !watched.is_empty() {
            return (watched, Vec::new());
        }
        // A container whose GPU devices could not be resolved (its root not set up yet, under a hook) waits
        // for the watched holders only: "any GPU on the node" would make it wait for every other GPU.
        if w.devices.is_empty() {
            return (watched, Vec::new());
        }
        let hidden = node_gpu_holders(&self.classifier, &self.exempt, &w.devices, Some(&w.cgroup));
        (watched, hidden)
    }

    /// Answers every waiter whose devices nobody else holds now.
    fn check_gates(&mut self) {
        if self.waiters.is_empty() {
            return;
        }
        let waiters = std::mem::take(&mut self.waiters);
        let mut hidden_wait = false;
        for mut w in waiters {
            let (watched, hidden) = self.gate_holders(&w);
            if watched.is_empty() && hidden.is_empty() {
                let now = now_monotonic_ns();
                tracing::info!(
                    id = w.container.id,
                    "agent: the GPU is free: the gate opens"
                );
                let _ = w.reply.send(Reply::GpuFree {
                    waited_ns: now.saturating_sub(w.asked_ns),
                    t_free_ns: now,
                });
                continue;
            }
            if !hidden.is_empty() {
                hidden_wait = true;
                if !w.hidden_logged {
                    w.hidden_logged = true;
                    tracing::warn!(
                        id = w.container.id,
                        "agent: the gate stays shut: {}",
                        describe_hidden(&hidden)
                    );
                }
            }
            self.waiters.push(w);
        }
        if hidden_wait {
            self.schedule_recheck();
        }
    }

    /// Looks at /proc again in a while: a release or a gate waits for a holder the probes cannot see.
    fn schedule_recheck(&mut self) {
        if self.recheck_due.is_none() {
            self.recheck_due = Some(tokio::time::Instant::now() + self.recheck_every);
            self.recheck_every = (self.recheck_every * 2).min(RECHECK_MAX);
        }
    }

    /// The look at /proc [`Core::schedule_recheck`] asked for: the releases that wait for hidden holders,
    /// then the gates.
    fn recheck(&mut self) {
        self.recheck_due = None;
        let mut out = Vec::new();
        if let Some(tracer) = self.tracer.as_mut() {
            for (c, w) in self
                .watched
                .iter_mut()
                .filter(|(_, w)| w.awaits_hidden_holders())
            {
                for body in w.update(tracer, &[], &self.classifier) {
                    out.push((c.clone(), w.owner, body));
                }
            }
        }
        for (c, owner, body) in out {
            self.publish(&c, owner, body);
        }
        self.check_gates();
        if self.watched.values().any(Watched::awaits_hidden_holders) {
            self.schedule_recheck();
        }
        if self.recheck_due.is_none() {
            self.recheck_every = RECHECK_FIRST;
        }
    }

    /// Fails the waiters past their deadline, naming who still holds the GPU.
    fn expire_gates(&mut self) {
        let now = tokio::time::Instant::now();
        let waiters = std::mem::take(&mut self.waiters);
        for w in waiters {
            if w.deadline > now {
                self.waiters.push(w);
                continue;
            }
            let (watched, hidden) = self.gate_holders(&w);
            let waited =
                std::time::Duration::from_nanos(now_monotonic_ns().saturating_sub(w.asked_ns));
            let error = if !watched.is_empty() {
                format!(
                    "the GPU is still held by {} after {waited:?}",
                    watched.join(", ")
                )
            } else if !hidden.is_empty() {
                format!(
                    "the GPU is still held after {waited:?}: {}",
                    describe_hidden(&hidden)
                )
            } else {
                format!("the GPU was not free within {waited:?}")
            };
            let _ = w.reply.send(Reply::Error { error });
        }
    }

    /// Process `pid`'s connection ended: when it is gone, its orphans go (see [`Core::prune_orphans`]).
    fn peer_gone(&mut self, pid: u32) -> Reply {
        let found = pid != 0 && process_gone(pid) && self.prune_orphans() > 0;
        Reply::Unregistered { found }
    }

    /// Stops watching the containers whose registering shim is gone and whose init is gone too (a shim
    /// killed with -9 never unregisters them). Those still running stay watched. Looked at when a connection
    /// ends and before `register` and `status`, never on a timer. Returns how many went.
    fn prune_orphans(&mut self) -> usize {
        let orphans: Vec<ContainerRef> = self
            .watched
            .iter()
            .filter(|(_, w)| process_gone(w.owner) && process_gone(w.registration.init_pid))
            .map(|(c, _)| c.clone())
            .collect();
        for c in &orphans {
            tracing::info!(
                id = c.id,
                namespace = c.namespace,
                "agent: its shim and its init are gone: no longer watched"
            );
            self.unregister(c);
        }
        orphans.len()
    }

    /// Frees the probe set's device-directory slots (at most 4) that no watched container and no trace
    /// follows any more, so that containers come and go without using them up for the node.
    fn free_unused_prefixes(&mut self) {
        let in_use: std::collections::BTreeSet<String> = self
            .watched
            .values()
            .map(|w| baton_agent_api::device_dir(&w.registration.settings.trace_prefix).to_owned())
            .chain(
                self.traces
                    .values()
                    .flat_map(|s| s.prefixes.iter().cloned()),
            )
            .collect();
        let Some(t) = self.tracer.as_mut() else {
            return;
        };
        let unused: Vec<String> = t
            .prefixes()
            .iter()
            .filter(|p| !in_use.contains(*p))
            .cloned()
            .collect();
        // The probes keep one directory while they are loaded (they go with the last user anyway).
        if unused.len() == t.prefixes().len() {
            return;
        }
        for dir in unused {
            match t.remove_prefix(&dir) {
                Ok(()) => tracing::info!("agent: no longer following device directory {dir}"),
                Err(e) => {
                    tracing::warn!("agent: cannot stop following device directory {dir}: {e}")
                }
            }
        }
    }

    /// Drops (detaches) the probes when no container is watched and no trace runs.
    fn drop_tracer_if_unused(&mut self) {
        if self.watched.is_empty() && self.traces.is_empty() && self.retire_tracer() {
            tracing::info!("agent: probes detached (no watched container or trace left)");
        }
    }

    fn start_trace(
        &mut self,
        session: u64,
        request: &TraceRequest,
        lines: mpsc::Sender<String>,
    ) -> Reply {
        let default_dir = [super::trace_session::DEFAULT_DEVICE_DIR.to_owned()];
        let first_dir = request.prefixes.first().unwrap_or(&default_dir[0]);
        let started = self.load_tracer_for(first_dir).and_then(|()| {
            let tracer = self.tracer.as_mut().ok_or("the probes are not loaded")?;
            TraceSession::start(request, tracer, lines)
        });
        match started {
            Ok(s) => {
                tracing::info!(session, "agent: trace started");
                self.traces.insert(session, s);
                Reply::Tracing {
                    programs_attached: self.tracer.as_ref().map_or(0, Tracer::programs_attached),
                }
            }
            Err(error) => {
                self.free_unused_prefixes();
                self.drop_tracer_if_unused();
                Reply::Error { error }
            }
        }
    }

    fn end_trace(&mut self, session: u64) -> Reply {
        let Some(s) = self.traces.remove(&session) else {
            return Reply::Unregistered { found: false };
        };
        if let Some(t) = self.tracer.as_mut() {
            let was_all = s.all;
            let cgroups = s.finish(t);
            for id in cgroups {
                let in_use = self.by_cgroup.contains_key(&id)
                    || self.traces.values().any(|o| o.traces_cgroup(id));
                if !in_use {
                    t.unwatch_cgroup(id);
                }
            }
            if was_all && !self.traces.values().any(|o| o.all) {
                let _ = t.set_watch_all(false);
            }
        }
        tracing::info!(session, "agent: trace ended");
        self.free_unused_prefixes();
        self.drop_tracer_if_unused();
        Reply::Unregistered { found: true }
    }

    fn status(&self, filter: &Filter, asker: u32) -> NodeStatus {
        let containers = match &self.tracer {
            Some(t) => self
                .watched
                .iter()
                .filter(|(c, w)| filter.matches(c, w.owner, asker))
                .map(|(_, w)| w.status(t))
                .collect(),
            None => Vec::new(),
        };
        NodeStatus {
            agent_pid: std::process::id(),
            probes_attached: self.tracer.is_some(),
            programs_attached: self.tracer.as_ref().map_or(0, Tracer::programs_attached),
            ringbuf_drops: self.tracer.as_ref().map_or(0, Tracer::dropped),
            resyncs: self.tracer.as_ref().map_or(0, Tracer::resyncs),
            pending_evicted: self.tracer.as_ref().map_or(0, Tracer::pending_evicted),
            confirmed_by_proc: self.tracer.as_ref().map_or(0, Tracer::confirmed_by_proc),
            containers,
            controller: self.controller_status(),
        }
    }

    fn on_batch(&mut self, batch: Result<Vec<Record>, baton_tracer::TracerError>) {
        match batch {
            Ok(records) => {
                self.apply(&records);
                if let Some(t) = self.tracer.as_mut() {
                    for s in self.traces.values_mut() {
                        s.take(&records, t);
                    }
                }
            }
            Err(e) => self.probes_failed(&e.to_string()),
        }
    }

    /// Reading the probes failed: the gate fails closed (every waiting Start gets an error, never "free"),
    /// the probes are loaded again and every container is watched again as its shim registered it (its
    /// fds and mappings re-read from /proc); one that cannot be is dropped with an error in the log.
    fn probes_failed(&mut self, error: &str) {
        tracing::error!("agent: reading the probes failed ({error}); loading them again");
        let refusal = format!(
            "the agent's probes failed ({error}): whether the GPU is free cannot be told, so the gate stays \
             shut; start the container again"
        );
        for w in std::mem::take(&mut self.waiters) {
            let _ = w.reply.send(Reply::Error {
                error: refusal.clone(),
            });
        }
        self.retire_tracer();
        self.traces.clear();
        self.by_cgroup.clear();
        self.ioctls.clear();
        let watched = std::mem::take(&mut self.watched);
        for (c, w) in watched {
            let mut reg = w.registration;
            reg.preemption = w.preemption;
            if let Err(e) = self.register(reg, w.owner) {
                tracing::error!(
                    id = c.id,
                    namespace = c.namespace,
                    "agent: container no longer watched after the probes failed: {e}"
                );
            }
        }
    }

    /// Turns a batch of records into the containers' transitions. Only the containers the batch concerns are
    /// looked at (one pass over the records, not one per watched container), all of them after a resync.
    fn apply(&mut self, records: &[Record]) {
        IoctlCounts::count(&mut self.ioctls, records);
        let Some(tracer) = self.tracer.as_mut() else {
            return;
        };
        let resynced = records
            .iter()
            .any(|r| matches!(r.body, Body::Resync { .. }));
        let touched: Vec<u64> = if resynced {
            self.by_cgroup.keys().copied().collect()
        } else {
            let set: std::collections::HashSet<u64> = records.iter().map(|r| r.cgroup_id).collect();
            set.into_iter().collect()
        };
        let mut out = Vec::new();
        for cgroup_id in touched {
            let Some(c) = self.by_cgroup.get(&cgroup_id) else {
                continue;
            };
            let Some(w) = self.watched.get_mut(c) else {
                continue;
            };
            for body in w.update(tracer, records, &self.classifier) {
                out.push((c.clone(), w.owner, body));
            }
        }
        for (c, owner, body) in out {
            self.publish(&c, owner, body);
        }
        if self.watched.values().any(Watched::awaits_hidden_holders) {
            self.schedule_recheck();
        }
    }

    fn publish(&mut self, c: &ContainerRef, owner: u32, body: EventBody) {
        self.seq += 1;
        match &body {
            EventBody::Acquired(a) => {
                tracing::info!(id = c.id, pid = a.pid, "agent: container acquired the GPU");
            }
            EventBody::Released(r) => tracing::info!(
                id = c.id,
                t_last_close_ns = r.t_last_close_ns,
                t_released_ns = r.t_released_ns,
                confirmed_by = r.confirmed_by,
                "agent: container released the GPU"
            ),
            _ => {}
        }
        let event = Event {
            seq: self.seq,
            t_ns: now_monotonic_ns(),
            container: c.clone(),
            body,
        };
        if let EventBody::Released(r) = &event.body {
            events().released(r, event.t_ns);
        }
        // No watcher is not an error: the state is in `status`.
        let _ = self.events.send(Published { event, owner });
    }
}

/// The processes of `hidden` and what they hold, for a log line or an error: each with its cgroup, since
/// the probes may not know its container.
fn describe_hidden(hidden: &[Holding]) -> String {
    let mut pids: Vec<u32> = hidden.iter().map(|h| h.pid).collect();
    pids.dedup();
    let each: Vec<String> = hidden
        .iter()
        .take(8)
        .map(|h| {
            let cgroup = baton_tracer::cgroups::v2_path_of_pid(h.pid)
                .unwrap_or_else(|| "an unknown cgroup".to_owned());
            format!("{h} in cgroup {cgroup}")
        })
        .collect();
    format!(
        "{} process(es) hold its device files as /proc shows: {}",
        pids.len(),
        each.join("; ")
    )
}

/// Every 500 ms while `active` (a trace names containers, which may start later), else never.
async fn rescan_tick(active: bool) {
    if active {
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    } else {
        std::future::pending::<()>().await;
    }
}

/// The next batch of records, or never when the probes are not loaded.
async fn next_batch(tracer: Option<&mut Tracer>) -> Result<Vec<Record>, baton_tracer::TracerError> {
    match tracer {
        Some(t) => t.next_events().await,
        None => std::future::pending().await,
    }
}

/// Refuses a re-registration of `key`, watched as `w`, for another cgroup (`cgroup_id`), or from another
/// process (`owner`) while the one that registered it lives: either would let a peer take over where the
/// container's freezes and preemptions go. An agent restarted since has no entry, so its shims register
/// afresh; a shim giving a restored container's new init at Start is the same owner, same cgroup; an OCI
/// hook registers and exits, so the next hook of the same container (same cgroup) takes its place.
fn check_same_registrant(
    key: &ContainerRef,
    w: &Watched,
    cgroup_id: u64,
    owner: u32,
) -> Result<(), String> {
    if w.cgroup_id != cgroup_id {
        return Err(format!(
            "refusing to register container {} (namespace {}) again for another cgroup: it is watched in \
             cgroup {} (id {}), not id {cgroup_id}; delete the container first",
            key.id, key.namespace, w.registration.cgroup, w.cgroup_id
        ));
    }
    if w.owner != owner && !process_gone(w.owner) {
        return Err(format!(
            "refusing to register container {} (namespace {}) again from pid {owner}: pid {} registered \
             it, and only that process may change where its freezes and preemptions go",
            key.id, key.namespace, w.owner
        ));
    }
    Ok(())
}

/// Refuses a cgroup that is not the container's own: the root, or the registering process's (on a host
/// where runc put the container in v1 cgroups only, its v2 path is its shim's), or one its init is not in.
fn check_cgroup_is_its_own(reg: &Registration, owner: u32) -> Result<(), String> {
    let v2 = baton_tracer::cgroups::v2_path_of_pid;
    let init = if reg.init_pid == 0 {
        None
    } else {
        v2(reg.init_pid)
    };
    check_cgroup_paths(reg, v2(owner).as_deref(), init.as_deref())
}

/// [`check_cgroup_is_its_own`] on paths already read: the registering process's and the init's cgroup.
/// Every path is compared in its one spelling (`/.`, `//` and `/a/./b` are `/`, `/` and `/a/b`); a path
/// with `..` is refused.
fn check_cgroup_paths(
    reg: &Registration,
    owner_cgroup: Option<&str>,
    init_cgroup: Option<&str>,
) -> Result<(), String> {
    let id = &reg.container.id;
    let canonical = baton_tracer::cgroups::canonical_path;
    let path =
        canonical(&reg.cgroup).map_err(|e| format!("refusing to watch container {id}: {e}"))?;
    if baton_tracer::cgroups::is_root(&path) {
        return Err(format!(
            "refusing to watch container {id}: its cgroup v2 path is the root, which every process on \
             the node shares (is runc putting containers into cgroup v2 here?)"
        ));
    }
    // Paths the kernel wrote (/proc/PID/cgroup) have no `..`; one that does not parse matches nothing.
    let same = |other: &str| canonical(other).is_ok_and(|o| o == path);
    if owner_cgroup.is_some_and(same) {
        return Err(format!(
            "refusing to watch container {id}: its cgroup v2 path {path} is its shim's, so its calls \
             could not be told from the shim's (runc did not give it a cgroup v2 of its own)"
        ));
    }
    if let Some(actual) = init_cgroup
        && !same(actual)
    {
        return Err(format!(
            "refusing to watch container {id}: its init (pid {}) is in cgroup {actual}, not {path}",
            reg.init_pid
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn when_the_probes_fail_a_waiting_start_gets_an_error_never_free() {
        let (events, _) = broadcast::channel(16);
        let (commands, _rx) = mpsc::channel(16);
        let bounds = control::Bounds {
            max_frozen_ns: 1_000_000_000,
            min_run_share: 0.05,
            input_silence_ns: 1_000_000_000,
            lease_ns: 2_000_000_000,
        };
        let mut core = Core::new(events, control::spawn(bounds, commands), Exempt::default());
        let (reply, answer) = oneshot::channel();
        core.waiters.push(Waiter {
            container: ContainerRef {
                id: "server".into(),
                namespace: "n".into(),
            },
            cgroup: "/n/server".into(),
            hidden_logged: false,
            devices: Default::default(),
            asked_ns: now_monotonic_ns(),
            deadline: tokio::time::Instant::now() + std::time::Duration::from_secs(60),
            reply,
        });
        // What the core's loop does with a failed read of the ring buffer.
        let read_failed = std::io::Error::other("the ring buffer could not be read");
        core.on_batch(Err(baton_tracer::TracerError::Poll(read_failed)));
        core.check_gates();
        match answer.await.unwrap() {
            Reply::Error { error } => assert!(error.contains("gate stays shut"), "{error}"),
            other => panic!("a waiting Start got {other:?} when the probes failed"),
        }
        assert!(core.waiters.is_empty());
    }

    fn reg(cgroup: &str, init_pid: u32) -> Registration {
        Registration {
            container: ContainerRef {
                id: "c".into(),
                namespace: "n".into(),
            },
            cgroup: cgroup.into(),
            init_pid,
            devices: vec![],
            settings: Default::default(),
            control_socket: None,
            preemption: None,
            role: None,
            kubernetes: None,
        }
    }

    #[test]
    fn the_root_and_the_shims_own_cgroup_are_refused() {
        let e = check_cgroup_paths(&reg("/", 0), None, None).unwrap_err();
        assert!(e.contains("root"), "{e}");
        let e = check_cgroup_paths(&reg("/pods/shim/", 0), Some("/pods/shim"), None).unwrap_err();
        assert!(e.contains("shim's"), "{e}");
        let e = check_cgroup_paths(&reg("/elsewhere", 7), Some("/pods/shim"), Some("/pods/c1"))
            .unwrap_err();
        assert!(e.contains("not /elsewhere"), "{e}");
        check_cgroup_paths(&reg("/pods/c1", 7), Some("/pods/shim"), Some("/pods/c1")).unwrap();
    }

    #[test]
    fn cgroup_paths_are_compared_in_one_spelling() {
        for root in ["/.", "//", "/./", "/a/../"] {
            let e = check_cgroup_paths(&reg(root, 0), None, None).unwrap_err();
            assert!(e.contains("root") || e.contains("`..`"), "{root}: {e}");
        }
        let e = check_cgroup_paths(&reg("/a/../", 0), None, None).unwrap_err();
        assert!(e.contains("`..`"), "{e}");
        let e = check_cgroup_paths(&reg("/pods/./c1/../shim", 7), None, Some("/pods/shim"))
            .unwrap_err();
        assert!(e.contains("`..`"), "{e}");
        let e = check_cgroup_paths(&reg("/pods//shim", 0), Some("/pods/shim"), None).unwrap_err();
        assert!(e.contains("shim's"), "{e}");
        check_cgroup_paths(&reg("/pods/./c1", 7), Some("/pods/shim"), Some("/pods/c1")).unwrap();
        check_cgroup_paths(&reg("//pods/c1/", 7), Some("/pods/shim"), Some("/pods/c1")).unwrap();
    }
}
