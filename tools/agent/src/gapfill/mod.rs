//! Gap-fill: serving-first preemption on the GPU-free gate and the automatic resume that follows.
//!
//! When a latency-critical container's Start waits at the gate, the agent preempts, concurrently, every
//! co-runner that holds one of the server's GPU devices, opted in (`baton.io/preemptible: park | snapshot`)
//! and yields to that server (`baton.io/yields-to`, default every latency-critical container). The gate
//! itself opens the Start on their release signal (overlapped: never after the freeze or the dump). Never
//! the other way: a co-runner behind the gate preempts nobody, and a holder that did not opt in keeps the
//! GPU (the gate's timeout names it). A failed preemption fails the server's Start, naming the co-runner.
//!
//! Once no latency-critical container the co-runner yields to holds, claims (its gate opened, it holds no
//! GPU device yet) or waits for one of its devices, the agent resumes the co-runners it parked, one at a
//! time, highest effective priority first (`baton.io/priority` aged by the time parked, see
//! [`baton_agent_api::gapfill::AGING_PER_SECOND`]). A co-runner that finishes while parked or during its
//! resume is reported `finished` and not resumed again.
//!
//! The rate gate ([`rate_gate`]) holds the resume back while a GPU's projected share is below
//! `gap_fill_min_share`.
//!
//! This module keeps the state and runs the shim calls; the core tells it what the probes and the gate
//! see (it owns the watched containers).
use std::collections::{BTreeMap, BTreeSet, VecDeque};

use baton_agent_api::{
    ContainerRef, FinishedCoRunner, GapFillStatus, Outcome, ParkedCoRunner, Phase, PreemptMode,
    PreemptPhase, PreemptRequest, Preempting, Request, Role, RoleSpec, Step, Target,
    gapfill::{MAX_FINISHED_SHOWN, effective_priority},
    names_container,
};
use tokio::{sync::mpsc, time::Instant};

mod core_side;
mod fit;
mod idle_park;
mod park_again;
mod rate_gate;
mod rate_store;
mod stop;

pub(crate) use idle_park::IdlePark;
use rate_gate::RateGate;

use crate::{
    core::Resolved,
    gate::{self, DeviceKey},
    preempt::run_unattended,
    registry::watched::Watched,
};
use baton_tracer::now_monotonic_ns;

/// How long a container whose gate opened counts as holding its GPU before it holds GPU state there: no
/// other waiter is let onto that GPU, and no parked co-runner is resumed onto it, in the gap between its gate
/// and its first allocation.
pub const CLAIM: std::time::Duration = std::time::Duration::from_secs(30);
/// How long after a failed resume the agent tries that co-runner again (a failing restore must not spin);
/// the wait doubles with each failure in a row, up to [`MAX_RETRY_RESUME`].
pub const RETRY_RESUME: std::time::Duration = std::time::Duration::from_secs(5);
/// The longest wait between two resumes of a co-runner whose resumes keep failing: an operator's `baton
/// resume` tries at once.
pub const MAX_RETRY_RESUME: std::time::Duration = std::time::Duration::from_secs(600);

/// The wait before the next resume of a co-runner after `failed` failed resumes in a row (1 or more).
pub fn retry_resume_after(failed: u32) -> std::time::Duration {
    let doubled = RETRY_RESUME.saturating_mul(1 << failed.saturating_sub(1).min(16));
    doubled.min(MAX_RETRY_RESUME)
}
/// How long a co-runner registered parked by the agent (after the agent restarted) waits before the agent
/// may resume it: the other shims, a server's among them, register their containers again meanwhile.
pub const ADOPT_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// What a shim call the agent ran by itself came to.
pub enum Done {
    /// A step of one, as it came (for the container's traces).
    Step(Step),
    /// A preemption of a co-runner for a server.
    Preempted {
        /// The co-runner.
        container: ContainerRef,
        /// Its steps, and the shim's outcome.
        steps: Vec<Step>,
        /// The outcome, or why it failed.
        result: Result<Outcome, String>,
    },
    /// An idle park of a server (`baton.io/park-when-idle`).
    ServerParked {
        /// The server.
        container: ContainerRef,
        /// The outcome, or why it failed.
        result: Result<Outcome, String>,
    },
    /// The resume of a server the agent parked for idleness, on a request for it.
    ServerResumed {
        /// The server.
        container: ContainerRef,
        /// The outcome, or why it failed.
        result: Result<Outcome, String>,
    },
    /// A park-again of a parked container that acquired GPU state (`park_again.rs`).
    ParkedAgain {
        /// The container.
        container: ContainerRef,
        /// The outcome, or why it failed.
        result: Result<Outcome, String>,
    },
    /// A resume of a co-runner the agent parked.
    Resumed {
        /// The co-runner.
        container: ContainerRef,
        /// Its steps.
        steps: Vec<Step>,
        /// The outcome, or why it failed.
        result: Result<Outcome, String>,
    },
}

/// A co-runner the agent is preempting.
struct InFlight {
    /// The server it is preempted for.
    server: ContainerRef,
    mode: PreemptMode,
    priority: i32,
    devices: BTreeSet<DeviceKey>,
    /// Its video memory when it was picked (`None`: not measurable).
    bytes: Option<u64>,
    /// When the agent asked for the preemption (CLOCK_MONOTONIC ns): where its cost C starts.
    requested_ns: u64,
    /// Whether its release signal came (the probes confirmed every NVIDIA file and mapping gone).
    released: bool,
}

/// A co-runner the agent parked.
struct Parked {
    server: ContainerRef,
    mode: PreemptMode,
    priority: i32,
    devices: BTreeSet<DeviceKey>,
    /// Its video memory when it was parked (`None`: not measurable, or adopted after a restart): it may
    /// resume beside its server once that much is free (`fit.rs`).
    bytes: Option<u64>,
    /// CLOCK_MONOTONIC ns when it was parked.
    since_ns: u64,
    /// When the agent asked for its preemption (CLOCK_MONOTONIC ns).
    requested_ns: u64,
    resuming: bool,
    /// After a failed resume: not before then.
    retry_at: Option<Instant>,
    /// Its resumes that failed in a row, and why the last one did.
    failed_resumes: u32,
    resume_error: Option<String>,
}

/// A container whose gate opened and that holds no GPU state there yet.
struct Claim {
    devices: BTreeSet<DeviceKey>,
    until: Instant,
}

/// A co-runner to preempt for a server, as [`GapFill::to_preempt`] picks them.
pub struct Pick {
    /// The co-runner.
    pub container: ContainerRef,
    /// How.
    pub mode: PreemptMode,
    priority: i32,
    devices: BTreeSet<DeviceKey>,
    /// Its video memory (`None`: not measurable; set by the core, which has the ledger).
    bytes: Option<u64>,
}

/// The gap-fill state of the agent.
pub struct GapFill {
    preempting: BTreeMap<ContainerRef, InFlight>,
    parked: BTreeMap<ContainerRef, Parked>,
    claims: BTreeMap<ContainerRef, Claim>,
    finished: VecDeque<FinishedCoRunner>,
    /// Preemption failures not yet told to the servers waiting for the co-runner: (co-runner, error).
    failures: Vec<(ContainerRef, String)>,
    done_tx: mpsc::UnboundedSender<Done>,
    done_rx: mpsc::UnboundedReceiver<Done>,
    /// Whether the agent fills each GPU.
    pub rate: RateGate,
    /// Parked containers being parked again (`park_again.rs`).
    parking_again: BTreeSet<ContainerRef>,
}

impl Default for GapFill {
    fn default() -> Self {
        let (done_tx, done_rx) = mpsc::unbounded_channel();
        Self {
            preempting: BTreeMap::new(),
            parked: BTreeMap::new(),
            claims: BTreeMap::new(),
            finished: VecDeque::new(),
            failures: Vec::new(),
            done_tx,
            done_rx,
            rate: RateGate::default(),
            parking_again: BTreeSet::new(),
        }
    }
}

/// Whether co-runner `co` yields to latency-critical container `server`.
fn yields_to(co: &RoleSpec, server: &Watched) -> bool {
    let Some(s) = &server.registration.role else {
        return false;
    };
    s.role == Role::LatencyCritical
        && (co.yields_to.is_empty()
            || co
                .yields_to
                .iter()
                .any(|y| names_container(y, &server.registration.container, s.pod.as_deref())))
}

/// Whether `w` is latency-critical.
pub fn is_server(w: &Watched) -> bool {
    w.registration
        .role
        .as_ref()
        .is_some_and(|r| r.role == Role::LatencyCritical)
}

/// Whether two device sets share a device (an empty set, devices not resolved, shares every device).
fn overlap(a: &BTreeSet<DeviceKey>, b: &BTreeSet<DeviceKey>) -> bool {
    a.is_empty() || b.is_empty() || a.iter().any(|x| b.iter().any(|y| x.same_device(y)))
}

/// Why holder `h` keeps the GPU from `waiter` (for the gate's error), when the agent would not preempt it:
/// a server is never preempted; for a latency-critical waiter, a holder that did not opt in or does not
/// yield to it. `None` for a holder the agent preempts, and for any holder of a waiter that is not
/// latency-critical (the plain gate preempts nobody).
pub fn why_kept(waiter: &Watched, h: &Watched) -> Option<&'static str> {
    let role = h.registration.role.as_ref();
    if role.is_some_and(|r| r.role == Role::LatencyCritical) {
        return Some("it is latency-critical, and a server is never preempted");
    }
    if !is_server(waiter) {
        return None;
    }
    let Some(role) = role else {
        return Some("it has no baton.io/role, so the agent never preempts it");
    };
    if role.preemptible.is_none() {
        return Some(
            "it has no baton.io/preemptible, so only an operator's `baton preempt` preempts it",
        );
    }
    if !yields_to(role, waiter) {
        return Some("its baton.io/yields-to does not name this container");
    }
    None
}

impl GapFill {
    /// The co-runners among `holders` (each holding one of its devices) to preempt for `server`, which
    /// waits at the gate: none unless `server` is latency-critical; each preemptible, yielding to it, not
    /// parked and not being preempted already.
    pub fn to_preempt(&self, server: &Watched, holders: &[&Watched]) -> Vec<Pick> {
        if !is_server(server) {
            return Vec::new();
        }
        holders
            .iter()
            .filter(|h| why_kept(server, h).is_none())
            .filter(|h| h.preemption.is_none())
            .filter(|h| !self.preempting.contains_key(&h.registration.container))
            .filter_map(|h| {
                let role = h.registration.role.as_ref()?;
                Some(Pick {
                    container: h.registration.container.clone(),
                    mode: role.preemptible?,
                    priority: role.priority,
                    devices: gate::devices_seen(h.registration.init_pid, &h.registration.devices),
                    bytes: None,
                })
            })
            .collect()
    }

    /// Starts preempting `pick` (resolved as `r`) for `server`, in a task of its own.
    pub fn preempt(&mut self, pick: Pick, r: Resolved, server: &ContainerRef, requested_ns: u64) {
        tracing::info!(
            id = pick.container.id,
            server = server.id,
            mode = pick.mode.label(),
            "agent: gap-fill: preempting a co-runner for a latency-critical container behind the gate"
        );
        let request = Request::Preempt(PreemptRequest {
            target: Target::exact(&r.container),
            mode: pick.mode,
            pids: r.pids.clone(),
            image_path: None,
            parked_for: Some(server.clone()),
            idle_park: false,
            vram_bytes: Some(r.vram_bytes),
            host_budget_left_bytes: Some(r.host_budget_left),
            again: false,
        });
        let done = self.done_tx.clone();
        let container = pick.container.clone();
        let by = format!("gap-fill, for {}", server.id);
        tokio::spawn(async move {
            let (steps, result) = run_unattended(&r, request, &by, show_step(&done)).await;
            let _ = done.send(Done::Preempted {
                container,
                steps,
                result,
            });
        });
        self.preempting.insert(
            pick.container,
            InFlight {
                server: server.clone(),
                mode: pick.mode,
                priority: pick.priority,
                devices: pick.devices,
                bytes: pick.bytes,
                requested_ns,
                released: false,
            },
        );
    }

    /// Container `c`'s release signal came.
    pub fn released(&mut self, c: &ContainerRef) {
        if let Some(f) = self.preempting.get_mut(c) {
            f.released = true;
        }
    }

    /// Whether a co-runner being preempted on one of `devices` has not released the GPU yet: the gate waits
    /// for its release signal (its fds may be closed before the kernel confirmed the release).
    pub fn awaits_release(&self, devices: &BTreeSet<DeviceKey>) -> bool {
        self.preempting
            .values()
            .any(|f| !f.released && overlap(&f.devices, devices))
    }

    /// Where the agent's own shim calls report their end.
    pub fn done_sender(&self) -> mpsc::UnboundedSender<Done> {
        self.done_tx.clone()
    }

    /// The next shim call that ended.
    pub async fn next_done(&mut self) -> Done {
        match self.done_rx.recv().await {
            Some(d) => d,
            // The sender lives in `self`: never.
            None => std::future::pending().await,
        }
    }

    /// Takes note of a preemption's end: parked (to resume later), or a failure for its server's gate.
    pub fn preempted(
        &mut self,
        c: &ContainerRef,
        steps: &[Step],
        result: &Result<Outcome, String>,
    ) {
        let Some(f) = self.preempting.remove(c) else {
            return;
        };
        match result {
            Ok(o) if o.preemption.is_some() => {
                tracing::info!(
                    id = c.id,
                    server = f.server.id,
                    "agent: gap-fill: co-runner parked"
                );
                self.parked.insert(
                    c.clone(),
                    Parked {
                        server: f.server,
                        mode: f.mode,
                        priority: f.priority,
                        devices: f.devices,
                        bytes: f.bytes,
                        since_ns: now_monotonic_ns(),
                        requested_ns: f.requested_ns,
                        resuming: false,
                        retry_at: None,
                        failed_resumes: 0,
                        resume_error: None,
                    },
                );
            }
            Ok(_) => self.finish(c, finished_detail(steps, "it exited during its preemption")),
            Err(e) => {
                tracing::warn!(
                    id = c.id,
                    server = f.server.id,
                    "agent: gap-fill: preemption failed: {e}"
                );
                let error = format!(
                    "the agent could not preempt co-runner {} (namespace {}) for it: {e}; the co-runner \
                     keeps running and the GPU: start this container again, or preempt or stop {} first",
                    c.id, c.namespace, c.id
                );
                self.failures.push((c.clone(), error));
            }
        }
    }

    /// The failed preemptions (co-runner, error), each once.
    pub fn take_failures(&mut self) -> Vec<(ContainerRef, String)> {
        std::mem::take(&mut self.failures)
    }

    /// Takes note of a resume's end: running again, finished, or parked still (tried again later).
    pub fn resumed(&mut self, c: &ContainerRef, steps: &[Step], result: &Result<Outcome, String>) {
        let finished = steps.iter().any(|s| s.phase == Phase::Finished);
        match result {
            _ if finished => self.finish(c, finished_detail(steps, "it exited during its resume")),
            Ok(_) => {
                tracing::info!(id = c.id, "agent: gap-fill: co-runner resumed");
                if let Some(p) = self.parked.remove(c) {
                    self.rate
                        .resumed(&p.devices, p.requested_ns, now_monotonic_ns());
                }
            }
            Err(e) => {
                let Some(p) = self.parked.get_mut(c) else {
                    return;
                };
                p.resuming = false;
                p.failed_resumes = p.failed_resumes.saturating_add(1);
                let wait = retry_resume_after(p.failed_resumes);
                p.retry_at = Some(Instant::now() + wait);
                p.resume_error = Some(e.clone());
                tracing::warn!(
                    id = c.id,
                    failed_resumes = p.failed_resumes,
                    "agent: gap-fill: resume failed ({e}); it stays parked, tried again in {wait:?}"
                );
            }
        }
    }

    /// Co-runner `c` finished (its init exited) instead of being resumed: reported, not resumed again.
    pub fn finish(&mut self, c: &ContainerRef, detail: String) {
        self.parked.remove(c);
        self.preempting.remove(c);
        tracing::info!(id = c.id, detail, "agent: gap-fill: co-runner finished");
        self.finished.push_back(FinishedCoRunner {
            container: c.clone(),
            detail,
            t_ns: now_monotonic_ns(),
        });
        while self.finished.len() > MAX_FINISHED_SHOWN {
            self.finished.pop_front();
        }
    }

    /// The shim of co-runner `c` pushed a state change, `from` -> `to`, that the agent did not ask for: a
    /// parked one that is no longer parked without a resume was killed (the shim thaws it for the signal),
    /// so it finished; one resumed by an operator (through `resuming`) is no longer the agent's to resume.
    pub fn state_pushed(
        &mut self,
        c: &ContainerRef,
        from: Option<PreemptPhase>,
        to: Option<PreemptPhase>,
    ) {
        if self.parked.get(c).is_none_or(|p| p.resuming) || to.is_some() {
            return;
        }
        if from == Some(PreemptPhase::Parked) {
            self.finish(
                c,
                "killed while parked (its exit status is in containerd's TaskExit event)"
                    .to_owned(),
            );
        } else {
            tracing::info!(
                id = c.id,
                "agent: gap-fill: co-runner resumed by someone else"
            );
            self.parked.remove(c);
        }
    }

    /// Co-runner `w` was registered parked by the agent for a server (its shim kept `parked_for` in its
    /// state: the agent restarted since), or its shim pushed that state (a park an earlier agent asked for
    /// ended after this one started): the agent resumes it as if it had parked it itself, after
    /// [`ADOPT_GRACE`]. Not one this agent is parking itself (its answer says how that ended).
    pub fn adopt(&mut self, w: &Watched) {
        let c = &w.registration.container;
        let Some(p) = w.preemption.as_ref() else {
            return;
        };
        let Some(server) = p.parked_for.clone() else {
            return;
        };
        if p.state != PreemptPhase::Parked
            || self.parked.contains_key(c)
            || self.preempting.contains_key(c)
        {
            return;
        }
        tracing::info!(
            id = c.id,
            server = server.id,
            "agent: gap-fill: co-runner registered parked for a server: resumed when no server needs its GPU"
        );
        let priority = w.registration.role.as_ref().map_or(0, |r| r.priority);
        self.parked.insert(
            c.clone(),
            Parked {
                server,
                mode: p.mode,
                priority,
                devices: gate::devices_seen(w.registration.init_pid, &w.registration.devices),
                bytes: None,
                since_ns: p.since_ns,
                requested_ns: p.since_ns,
                resuming: false,
                retry_at: Some(Instant::now() + ADOPT_GRACE),
                failed_resumes: 0,
                resume_error: None,
            },
        );
    }

    /// Container `c` is no longer watched.
    pub fn gone(&mut self, c: &ContainerRef) {
        self.claims.remove(c);
        // One whose resume is in flight is left to that resume's answer: it says how the process ended (a
        // job that exits at its restore is deleted by containerd before the answer comes).
        if self.parked.get(c).is_some_and(|p| !p.resuming) {
            self.finish(c, "its container was deleted while parked".to_owned());
        }
    }

    /// Container `c`'s gate opened: it claims `devices` until it holds GPU state there (or [`CLAIM`] passes,
    /// or it is gone). Meanwhile the gate lets no other waiter onto those devices (two Starts let through by
    /// one release would share the GPU each was to have alone), and gap-fill resumes no co-runner onto them.
    pub fn claim(&mut self, c: &ContainerRef, devices: &BTreeSet<DeviceKey>) {
        self.claims.insert(
            c.clone(),
            Claim {
                devices: devices.clone(),
                until: Instant::now() + CLAIM,
            },
        );
    }

    /// Another container's live claim on one of `devices` (any device when either side names none).
    pub fn claimed_by(
        &self,
        me: &ContainerRef,
        devices: &BTreeSet<DeviceKey>,
    ) -> Option<&ContainerRef> {
        let now = Instant::now();
        self.claims
            .iter()
            .filter(|(c, cl)| *c != me && cl.until > now)
            .find(|(_, cl)| {
                devices.is_empty()
                    || cl.devices.is_empty()
                    || cl
                        .devices
                        .iter()
                        .any(|d| devices.iter().any(|w| w.same_device(d)))
            })
            .map(|(c, _)| c)
    }

    /// Drops the claims of the containers that hold GPU state now, or are gone (`holds`): a hold counts
    /// instead.
    pub fn settle_claims(&mut self, holds: impl Fn(&ContainerRef) -> bool) {
        self.claims.retain(|c, _| !holds(c));
    }

    /// The servers whose gate opened and that have not opened the GPU yet, with their devices.
    pub fn claims(&self) -> impl Iterator<Item = (ContainerRef, BTreeSet<DeviceKey>)> + '_ {
        self.claims
            .iter()
            .map(|(c, cl)| (c.clone(), cl.devices.clone()))
    }

    /// When the first claim expires, a failed resume may be tried again, or a GPU the agent stopped filling
    /// may fill again.
    pub fn next_due(&self) -> Option<Instant> {
        let claims = self.claims.values().map(|c| c.until);
        let retries = self.parked.values().filter_map(|p| p.retry_at);
        let gate = self.rate.next_change(now_monotonic_ns());
        claims.chain(retries).chain(gate).min()
    }

    /// Drops the expired claims, the retry times that have passed and the preemptions out of the window.
    pub fn expire(&mut self) {
        self.rate.expire(now_monotonic_ns());
        let now = Instant::now();
        self.claims.retain(|_, c| c.until > now);
        for p in self.parked.values_mut() {
            p.retry_at = p.retry_at.filter(|t| *t > now);
        }
    }

    /// Whether anything waits to be resumed.
    pub fn has_parked(&self) -> bool {
        !self.parked.is_empty()
    }

    /// The parked co-runner to resume now, if any: none while a resume runs; else the one of highest
    /// effective priority among those no server keeps parked, not waiting to retry a failed resume, and
    /// parked rather than snapshotted (a snapshot's container was stopped: its restore is a new task from
    /// its image, which containerd's client creates, not a resume), on a GPU the rate gate lets the agent
    /// fill. `blocks(co, devices)` says whether a
    /// latency-critical container that `co` yields to holds or waits for one of `devices`.
    pub fn next_resume(
        &self,
        blocks: impl Fn(&ContainerRef, &BTreeSet<DeviceKey>, Option<u64>) -> bool,
    ) -> Option<ContainerRef> {
        if self.parked.values().any(|p| p.resuming) {
            return None;
        }
        let now = now_monotonic_ns();
        self.order(now)
            .into_iter()
            .filter(|(_, p)| p.mode == PreemptMode::Park && p.retry_at.is_none())
            .filter(|(_, p)| self.rate.filling(&p.devices, now))
            .find(|(c, p)| !blocks(c, &p.devices, p.bytes))
            .map(|(c, _)| c.clone())
    }

    /// Starts resuming `r`, which the agent parked.
    pub fn resume(&mut self, r: Resolved) {
        let Some(p) = self.parked.get_mut(&r.container) else {
            return;
        };
        p.resuming = true;
        tracing::info!(
            id = r.container.id,
            "agent: gap-fill: no latency-critical container needs the GPU: resuming the co-runner"
        );
        let done = self.done_tx.clone();
        let container = r.container.clone();
        tokio::spawn(async move {
            let request = Request::Resume(Target::exact(&r.container));
            let (steps, result) = run_unattended(&r, request, "gap-fill", show_step(&done)).await;
            let _ = done.send(Done::Resumed {
                container,
                steps,
                result,
            });
        });
    }

    /// The parked co-runners, highest effective priority first (ties: longest parked, then by name).
    fn order(&self, now: u64) -> Vec<(&ContainerRef, &Parked)> {
        let mut all: Vec<(&ContainerRef, &Parked)> = self.parked.iter().collect();
        let key = |p: &Parked| effective_priority(p.priority, now.saturating_sub(p.since_ns));
        all.sort_by(|a, b| {
            key(b.1)
                .total_cmp(&key(a.1))
                .then(a.1.since_ns.cmp(&b.1.since_ns))
                .then(a.0.cmp(b.0))
        });
        all
    }

    /// What `status` shows.
    pub fn status(&self) -> GapFillStatus {
        let now = now_monotonic_ns();
        GapFillStatus {
            parked: self
                .order(now)
                .into_iter()
                .map(|(c, p)| {
                    let parked_ns = now.saturating_sub(p.since_ns);
                    ParkedCoRunner {
                        container: c.clone(),
                        mode: p.mode,
                        priority: p.priority,
                        parked_ns,
                        effective_priority: effective_priority(p.priority, parked_ns),
                        parked_for: p.server.clone(),
                        resuming: p.resuming,
                        failed_resumes: p.failed_resumes,
                        resume_error: p.resume_error.clone(),
                    }
                })
                .collect(),
            preempting: self
                .preempting
                .iter()
                .map(|(c, f)| Preempting {
                    container: c.clone(),
                    parked_for: f.server.clone(),
                })
                .collect(),
            finished: self.finished.iter().cloned().collect(),
            rate_gate: self.rate.settings(),
            gpus: Vec::new(),
        }
    }

    /// The parked co-runners and their devices.
    pub fn parked_devices(&self) -> impl Iterator<Item = (&ContainerRef, &BTreeSet<DeviceKey>)> {
        self.parked.iter().map(|(c, p)| (c, &p.devices))
    }

    /// Whether co-runner `c` is being preempted by the agent.
    pub fn is_being_preempted(&self, c: &ContainerRef) -> bool {
        self.preempting.contains_key(c)
    }
}

/// Whether some latency-critical container among `watched` that co-runner `co` yields to holds one of
/// `devices` (`held(w)`: the devices `w` holds), or waits for them at the gate (`waiting`: the waiters'
/// containers and devices).
pub fn server_needs(
    co: Option<&Watched>,
    watched: &BTreeMap<ContainerRef, Watched>,
    devices: &BTreeSet<DeviceKey>,
    held: impl Fn(&Watched) -> BTreeSet<DeviceKey>,
    waiting: &[(ContainerRef, BTreeSet<DeviceKey>)],
) -> bool {
    let Some(role) = co.and_then(|c| c.registration.role.as_ref()) else {
        return false;
    };
    watched.values().filter(|s| yields_to(role, s)).any(|s| {
        let held = held(s);
        (!held.is_empty() && overlap(&held, devices))
            || waiting
                .iter()
                .any(|(w, d)| *w == s.registration.container && overlap(d, devices))
    })
}

/// Hands each step of a call the agent runs by itself to the core, which shows it to the container's traces.
pub fn show_step(done: &mpsc::UnboundedSender<Done>) -> impl FnMut(&Step) + use<> {
    let done = done.clone();
    move |s| {
        let _ = done.send(Done::Step(s.clone()));
    }
}

/// What the `finished` step of `steps` says (its exit status), else `otherwise`.
fn finished_detail(steps: &[Step], otherwise: &str) -> String {
    steps
        .iter()
        .find(|s| s.phase == Phase::Finished)
        .map_or_else(
            || otherwise.to_owned(),
            |s| match s.pid {
                Some(pid) => format!("pid {pid}: {}", s.detail),
                None => s.detail.clone(),
            },
        )
}

#[cfg(test)]
mod tests;
