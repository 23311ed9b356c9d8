//! Scale to zero without removal: a latency-critical container with `baton.io/park-when-idle: <duration>`
//! that has had no request event (`request_start` / `request_end` from a request proxy) for that long, and
//! no request in flight, is parked by the agent; the automatic resume then gives its GPU to the co-runners
//! parked for it. A `request_start` that names it hands the GPU back: the agent puts the server behind the
//! GPU-free gate (which preempts the preemptible co-runners, as for a Start) and resumes it on their
//! release. While the rate gate keeps a GPU from filling, its server stays resident.
use std::collections::{BTreeMap, BTreeSet};

use baton_agent_api::{
    ContainerRef, Outcome, Phase, PreemptMode, PreemptRequest, Reply, Request, Role, Step, Target,
};
use tokio::{sync::oneshot, time::Instant};

use crate::{
    core::Core,
    gapfill::{Done, show_step},
    gate::{self, Waiter},
    preempt::run_unattended,
};
use baton_tracer::now_monotonic_ns;

/// How long a hand-back waits for the GPU to be free when the server has no `baton.io/wait-gpu-free` of its
/// own (a server registered by an older shim). Past it (or its own wait), the server stays parked.
pub const HAND_BACK_WITHIN: std::time::Duration = std::time::Duration::from_secs(600);

/// The idle-park state of the agent.
#[derive(Default)]
pub struct IdlePark {
    /// When each server with `park-when-idle` last saw a request event (or was first seen, or resumed).
    last: BTreeMap<ContainerRef, Instant>,
    /// Requests in flight per server.
    live: BTreeMap<ContainerRef, u32>,
    /// Servers the agent parked for idleness.
    parked: BTreeSet<ContainerRef>,
    /// Servers being parked or handed the GPU back.
    busy: BTreeSet<ContainerRef>,
    /// Servers a `request_start` named while they were being parked: handed the GPU back once parked.
    wanted: BTreeSet<ContainerRef>,
    /// When the first running idle period ends.
    wake: Option<Instant>,
}

impl IdlePark {
    /// When the first watched idle period may end.
    pub fn next_due(&self) -> Option<Instant> {
        self.wake
    }

    /// Server `w` was registered parked by the agent for its idleness (its shim kept `idle_park` in its
    /// state: the agent restarted since, a DaemonSet rollout): the next request for it hands the GPU back,
    /// as if this agent had parked it.
    pub fn adopt(&mut self, w: &crate::registry::watched::Watched) {
        let Some(p) = &w.preemption else {
            return;
        };
        if p.state != baton_agent_api::PreemptPhase::Parked
            || !p.idle_park
            || idle_after(w).is_none()
        {
            return;
        }
        let c = &w.registration.container;
        tracing::info!(
            id = c.id,
            "agent: idle park: the server was registered idle-parked: a request for it hands the GPU back"
        );
        self.parked.insert(c.clone());
        self.last.insert(c.clone(), Instant::now());
    }
}

/// The server's `park-when-idle`, if it is latency-critical and has one.
fn idle_after(w: &crate::registry::watched::Watched) -> Option<std::time::Duration> {
    let r = w.registration.role.as_ref()?;
    (r.role == Role::LatencyCritical)
        .then_some(r.park_when_idle_ms)
        .flatten()
        .map(std::time::Duration::from_millis)
}

impl Core {
    /// Parks the servers idle for their `park-when-idle`, on GPUs the rate gate lets the agent fill.
    pub(crate) fn idle_park_check(&mut self) {
        let now = Instant::now();
        let mut due = Vec::new();
        let mut next: Option<Instant> = None;
        for (c, w) in &self.watched {
            let Some(after) = idle_after(w) else {
                continue;
            };
            let last = *self.idle.last.entry(c.clone()).or_insert(now);
            let idle = self.idle.live.get(c).copied().unwrap_or(0) == 0;
            let free = w.preemption.is_none() && !self.idle.busy.contains(c);
            if !(idle && free) {
                continue;
            }
            if last + after > now {
                next = next.into_iter().chain([last + after]).min();
                continue;
            }
            let devices = gate::devices_seen(w.registration.init_pid, &w.registration.devices);
            if self.gapfill.rate.filling(&devices, now_monotonic_ns()) {
                due.push(c.clone());
            }
        }
        for c in due {
            self.idle_park(&c, now);
        }
        self.idle.wake = next;
    }

    /// Starts parking idle server `c`.
    fn idle_park(&mut self, c: &ContainerRef, now: Instant) {
        self.idle.last.insert(c.clone(), now);
        let r = match self.resolve(&Target::exact(c)) {
            Ok(r) if !r.pids.is_empty() => r,
            Ok(_) => return,
            Err(e) => {
                tracing::warn!(id = c.id, "agent: idle park: {e}");
                return;
            }
        };
        tracing::info!(
            id = c.id,
            "agent: idle park: no request event for its park-when-idle: parking the server"
        );
        self.idle.busy.insert(c.clone());
        let request = Request::Preempt(PreemptRequest {
            target: Target::exact(c),
            mode: PreemptMode::Park,
            pids: r.pids.clone(),
            image_path: None,
            parked_for: None,
            idle_park: true,
            vram_bytes: Some(r.vram_bytes),
            host_budget_left_bytes: Some(r.host_budget_left),
            again: false,
        });
        let done = self.gapfill.done_sender();
        let container = c.clone();
        tokio::spawn(async move {
            let (_, result) = run_unattended(&r, request, "idle park", show_step(&done)).await;
            let _ = done.send(Done::ServerParked { container, result });
        });
    }

    /// An idle park ended.
    pub(crate) fn idle_parked(&mut self, c: &ContainerRef, result: &Result<Outcome, String>) {
        self.idle.busy.remove(c);
        self.idle.last.insert(c.clone(), Instant::now());
        let wanted = self.idle.wanted.remove(c);
        match result {
            Ok(o) if o.preemption.is_some() => {
                self.set_preemption(c, o.preemption.clone());
                self.idle.parked.insert(c.clone());
                if wanted {
                    self.hand_back(c);
                }
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(id = c.id, "agent: idle park failed: {e}"),
        }
    }

    /// A hand-back's resume of server `c` ended.
    pub(crate) fn idle_resumed(&mut self, c: &ContainerRef, result: &Result<Outcome, String>) {
        self.idle.busy.remove(c);
        self.controller.hand_back(false);
        self.idle.last.insert(c.clone(), Instant::now());
        match result {
            Ok(o) => {
                self.set_preemption(c, o.preemption.clone());
                self.idle.parked.remove(c);
                tracing::info!(id = c.id, "agent: idle park: server resumed for a request");
            }
            Err(e) => tracing::warn!(
                id = c.id,
                "agent: idle park: the server was not resumed: {e}"
            ),
        }
    }

    /// The watched latency-critical container a request proxy names (`None`: the node's only one).
    fn named_server(&self, name: Option<&str>) -> Option<ContainerRef> {
        let servers = self
            .watched
            .iter()
            .filter(|(_, w)| crate::gapfill::is_server(w));
        let mut named = servers.filter(|(c, w)| {
            name.is_none_or(|n| {
                let pod = w.registration.role.as_ref().and_then(|r| r.pod.as_deref());
                baton_agent_api::names_container(n, c, pod)
            })
        });
        let first = named.next().map(|(c, _)| c.clone());
        if name.is_none() && named.next().is_some() {
            return None;
        }
        first
    }

    /// A request proxy's `request_start` (`start`) or `request_end` for `server`.
    pub(crate) fn request_seen(&mut self, server: Option<&str>, start: bool) {
        let Some(c) = self.named_server(server) else {
            return;
        };
        self.idle.last.insert(c.clone(), Instant::now());
        let live = self.idle.live.entry(c.clone()).or_insert(0);
        *live = if start {
            live.saturating_add(1)
        } else {
            live.saturating_sub(1)
        };
        if !start {
            return;
        }
        let parking = self.idle.busy.contains(&c) && !self.idle.parked.contains(&c);
        if parking {
            self.idle.wanted.insert(c);
        } else if self.idle.parked.contains(&c) && !self.idle.busy.contains(&c) {
            self.hand_back(&c);
        }
    }

    /// Hands the GPU back to idle-parked server `c`: it waits at the gate (which preempts the co-runners)
    /// and is resumed on their release.
    fn hand_back(&mut self, c: &ContainerRef) {
        let Some(w) = self.watched.get(c) else {
            return;
        };
        tracing::info!(
            id = c.id,
            "agent: idle park: a request for the parked server: handing the GPU back"
        );
        self.idle.busy.insert(c.clone());
        self.controller.hand_back(true);
        // As long as the server's own Start would wait at the gate.
        let within = w
            .registration
            .role
            .as_ref()
            .and_then(|r| r.wait_gpu_free_ms)
            .map_or(HAND_BACK_WITHIN, std::time::Duration::from_millis);
        let (reply, answer) = oneshot::channel();
        self.waiters.push(Waiter {
            container: c.clone(),
            cgroup: w.registration.cgroup.clone(),
            hidden_logged: false,
            clear_since_ns: None,
            devices: gate::devices_seen(w.registration.init_pid, &w.registration.devices),
            need: self.declared_need(c),
            asked_ns: now_monotonic_ns(),
            deadline: Instant::now() + within,
            reply,
            unparkable: Default::default(),
            floor: None,
            floor_logged: false,
        });
        let r = self.resolve(&Target::exact(c));
        let done = self.gapfill.done_sender();
        let container = c.clone();
        tokio::spawn(async move {
            // A gate that fails leaves the server parked: resumed onto a GPU that another container still
            // holds, it would fail its restore or run short of device memory beside it.
            let gate = match answer.await {
                Ok(Reply::Error { error }) => Err(error),
                Ok(_) => Ok(()),
                Err(_) => Err("the agent is stopping".to_owned()),
            };
            if let Err(error) = gate {
                let detail = format!(
                    "the GPU was not handed back: {error}; it stays parked, and the next request for it \
                     tries again"
                );
                let _ = done.send(Done::Step(Step {
                    t_ns: now_monotonic_ns(),
                    container: container.clone(),
                    phase: Phase::StillParked,
                    pid: None,
                    detail: detail.clone(),
                    no_cuda_state: Vec::new(),
                }));
                let _ = done.send(Done::ServerResumed {
                    container,
                    result: Err(detail),
                });
                return;
            }
            let result = match r {
                Ok(r) => {
                    let by = "a request for it";
                    run_unattended(
                        &r,
                        Request::Resume(Target::exact(&container)),
                        by,
                        show_step(&done),
                    )
                    .await
                    .1
                }
                Err(e) => Err(e),
            };
            let _ = done.send(Done::ServerResumed { container, result });
        });
        self.check_gates();
    }

    /// The idle-parked servers being handed the GPU back, and those being parked that a request wants back, with
    /// the devices they see: they need their GPU until their resume ends, although they neither wait at the gate
    /// nor hold it meanwhile.
    pub(crate) fn servers_handed_back(&self) -> Vec<(ContainerRef, BTreeSet<gate::DeviceKey>)> {
        self.idle
            .busy
            .iter()
            .filter(|c| self.idle.parked.contains(*c) || self.idle.wanted.contains(*c))
            .filter_map(|c| {
                let w = self.watched.get(c)?;
                let devices = gate::devices_seen(w.registration.init_pid, &w.registration.devices);
                Some((c.clone(), devices))
            })
            .collect()
    }

    /// Container `c` is no longer watched.
    pub(crate) fn idle_gone(&mut self, c: &ContainerRef) {
        self.idle.last.remove(c);
        self.idle.live.remove(c);
        self.idle.parked.remove(c);
        self.idle.busy.remove(c);
        self.idle.wanted.remove(c);
    }
}
