//! The co-runner controller: one task of the agent that takes the control requests (`freeze`, `thaw`,
//! `duty`, the request events, tokens, `governor`), decides when each co-runner may run (`plan.rs`), and
//! has each container's shim freeze or thaw it (`link.rs`). The core tells it which containers have which
//! role; it writes what `status` shows into a shared [`ControllerStatus`].
//!
//! Only co-runners are frozen by the shield, the duty cycle and the governor; a latency-critical
//! container is never frozen at all. Fail-safes: every freeze carries a lease the shim enforces, the
//! shim releases what a connection froze when it ends (an agent that dies), silence on the input drops the
//! open requests, and no co-runner stays frozen longer than `max_frozen_ms` at a stretch. A link whose shim
//! cannot be reached is retried with a capped exponential backoff (`backoff.rs`), one warning per streak.
mod backoff;
mod gaps;
mod link;
mod plan;
mod requests;

use std::{
    collections::{BTreeMap, HashMap},
    path::PathBuf,
    sync::{Arc, Mutex},
    time::Duration,
};

use baton_agent_api::{
    CoRunnerStatus, ContainerRef, ControllerStatus, Reply, Request, Role, RoleSpec,
    now_monotonic_ns,
};
use tokio::sync::{mpsc, oneshot};

pub use plan::Bounds;

use super::{
    core::{Command, Note, NoteKind, What},
    sleep_until_opt,
};

/// A watched container as the controller needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// Which container.
    pub container: ContainerRef,
    /// Its role, if it has one.
    pub role: Option<RoleSpec>,
    /// Its shim's control socket.
    pub control_socket: Option<String>,
}

/// What reaches the controller.
pub enum Input {
    /// A control request of a client.
    Request {
        /// The request.
        request: Box<Request>,
        /// Where its reply goes.
        reply: oneshot::Sender<Reply>,
    },
    /// The watched containers changed.
    Members(Vec<Member>),
    /// A hand-back of an idle-parked server to a request began (`true`) or ended (`false`).
    HandBack(bool),
}

/// How connections and the core reach the controller.
#[derive(Clone)]
pub struct Handle {
    tx: mpsc::UnboundedSender<Input>,
    status: Arc<Mutex<ControllerStatus>>,
}

impl Handle {
    /// Hands a control request to the controller and waits for its reply.
    pub async fn ask(&self, request: Request) -> Reply {
        let (reply, rx) = oneshot::channel();
        let request = Box::new(request);
        if self.tx.send(Input::Request { request, reply }).is_err() {
            return stopping();
        }
        rx.await.unwrap_or_else(|_| stopping())
    }

    /// The watched containers are now `members`.
    pub fn members(&self, members: Vec<Member>) {
        let _ = self.tx.send(Input::Members(members));
    }

    /// A hand-back of an idle-parked server to a request began (`true`) or ended (`false`): the request
    /// waits, silent, for as long as the co-runners' park and the server's resume take (seconds on a real
    /// GPU), which the input-silence bound must not take for a dead proxy.
    pub fn hand_back(&self, active: bool) {
        let _ = self.tx.send(Input::HandBack(active));
    }

    /// What `status` shows of the controller.
    pub fn status(&self) -> ControllerStatus {
        self.status
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

fn stopping() -> Reply {
    Reply::Error {
        error: "the agent's controller is stopping".to_owned(),
    }
}

/// Starts the controller with `bounds`; it asks the core (`core`) for launch counts.
///
/// It runs on a thread of its own, with its links: a lease renewal is never behind the core's work (a slow
/// /proc read, a burst of records), so a co-runner does not thaw because the core was busy. A panic there
/// ends the agent (its panic hook), as anywhere else.
pub fn spawn(bounds: Bounds, core: mpsc::Sender<Command>) -> Handle {
    let (tx, rx) = mpsc::unbounded_channel();
    let status = Arc::new(Mutex::new(ControllerStatus::default()));
    let controller = Controller::new(bounds, status.clone(), core);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build();
    let started = runtime.and_then(|rt| {
        std::thread::Builder::new()
            .name("baton-controller".into())
            .spawn(move || rt.block_on(controller.run(rx)))
    });
    if let Err(e) = started {
        // Without its thread the controller cannot run at all: every control request gets this error.
        tracing::error!("agent: the co-runner controller cannot start its thread: {e}");
    }
    Handle { tx, status }
}

/// Tells the core's trace sessions of a confirmed freeze or thaw.
fn note(core: &mpsc::Sender<Command>, container: &ContainerRef, t_ns: u64, kind: NoteKind) {
    Note {
        container: container.clone(),
        t_ns,
        kind,
    }
    .send(core);
}

/// What the controller measured of a co-runner.
#[derive(Debug, Default)]
struct Stats {
    registered_ns: u64,
    frozen_since: Option<u64>,
    frozen_ns: u64,
    longest_ns: u64,
    freezes: u64,
    last_freeze_ns: Option<u64>,
    last_thaw_ns: Option<u64>,
    error: Option<String>,
    /// Why the shim left it frozen after the last thaw (`user-paused`, `parked`).
    note: Option<String>,
}

struct Controller {
    plan: plan::Plan,
    members: BTreeMap<ContainerRef, Member>,
    links: HashMap<ContainerRef, mpsc::UnboundedSender<link::Want>>,
    /// What each link was last told (`None`: unknown, after an error).
    applied: HashMap<ContainerRef, Option<bool>>,
    reasons: HashMap<ContainerRef, Option<&'static str>>,
    /// Each link's streak of failures: no new attempt before its wait is over (unless a client waits).
    backoff: HashMap<ContainerRef, backoff::Backoff>,
    stats: HashMap<ContainerRef, Stats>,
    reports_tx: mpsc::UnboundedSender<link::Report>,
    reports: mpsc::UnboundedReceiver<link::Report>,
    status: Arc<Mutex<ControllerStatus>>,
    core: mpsc::Sender<Command>,
    /// Per co-runner, the governor's mark: its launch total when the current window began, and its launches
    /// in the last window. The totals' one owner is the core's tracer: `status` and the metrics show them
    /// from there, never from this mark.
    launches: HashMap<ContainerRef, (u64, u64)>,
    launches_due: Option<tokio::time::Instant>,
}

impl Controller {
    fn new(
        bounds: Bounds,
        status: Arc<Mutex<ControllerStatus>>,
        core: mpsc::Sender<Command>,
    ) -> Self {
        let (reports_tx, reports) = mpsc::unbounded_channel();
        Self {
            plan: plan::Plan::new(bounds),
            members: BTreeMap::new(),
            links: HashMap::new(),
            applied: HashMap::new(),
            reasons: HashMap::new(),
            backoff: HashMap::new(),
            stats: HashMap::new(),
            reports_tx,
            reports,
            status,
            core,
            launches: HashMap::new(),
            launches_due: None,
        }
    }

    async fn run(mut self, mut inputs: mpsc::UnboundedReceiver<Input>) {
        loop {
            let next = self.decide_and_apply(None);
            self.publish_status();
            let sleep = async {
                match next {
                    Some(t) => {
                        let wait = t.saturating_sub(now_monotonic_ns());
                        tokio::time::sleep(Duration::from_nanos(wait)).await;
                    }
                    None => std::future::pending().await,
                }
            };
            // Launches are read once per governor window (a deadline that inputs do not push back).
            let window = self
                .plan
                .governor
                .as_ref()
                .filter(|_| !self.plan.co.is_empty())
                .map(|g| Duration::from_nanos(g.cycle.window_ns));
            let due = match (window, self.launches_due) {
                (None, _) => None,
                (Some(_), Some(d)) => Some(d),
                (Some(w), None) => Some(tokio::time::Instant::now() + w),
            };
            self.launches_due = due;
            tokio::select! {
                input = inputs.recv() => match input {
                    Some(Input::Request { request, reply }) => self.request(*request, reply),
                    Some(Input::Members(m)) => self.set_members(m),
                    Some(Input::HandBack(active)) => self.plan.hand_back(active, now_monotonic_ns()),
                    None => return,
                },
                Some(report) = self.reports.recv() => self.on_report(report),
                () = sleep => {}
                () = sleep_until_opt(due) => {
                    self.launches_due = None;
                    self.count_launches().await;
                }
            }
        }
    }

    /// Each governor window: the co-runners' kernel launches in it (libcuda uprobes), for `status` and
    /// the governor's log line.
    async fn count_launches(&mut self) {
        let (tx, rx) = oneshot::channel();
        let (reply, _) = oneshot::channel();
        let cmd = Command {
            what: What::Launches(tx),
            peer_pid: 0,
            reply,
        };
        if self.core.send(cmd).await.is_err() {
            return;
        }
        let Ok(totals) = rx.await else { return };
        for (c, total) in totals {
            let e = self.launches.entry(c).or_insert((total, 0));
            e.1 = total.saturating_sub(e.0);
            e.0 = total;
        }
        if let Some(g) = self.plan.governor_status() {
            tracing::debug!(
                share = g.run_share,
                stretch = ?g.stretch,
                launches = self.window_launches(),
                "governor window"
            );
        }
    }

    /// The co-runners' launches in the last governor window.
    fn window_launches(&self) -> u64 {
        self.controlled()
            .filter_map(|c| self.launches.get(c))
            .map(|l| l.1)
            .sum()
    }

    /// Decides every co-runner now and tells the links what changed; `answer` waits for `who`'s change.
    fn decide_and_apply(
        &mut self,
        mut answer: Option<(ContainerRef, oneshot::Sender<Reply>)>,
    ) -> Option<u64> {
        let now = now_monotonic_ns();
        let (decisions, mut next) = self.plan.decide(now);
        for (c, reason) in decisions {
            let want = reason.is_some();
            self.reasons.insert(c.clone(), reason);
            let waiter = match &answer {
                Some((who, _)) if *who == c => answer.take().map(|(_, tx)| tx),
                _ => None,
            };
            if self.applied.get(&c).copied().flatten() == Some(want) {
                if let Some(tx) = waiter {
                    let _ = tx.send(self.unchanged_reply(&c, reason));
                }
                continue;
            }
            let backing_off = self.backoff.get(&c).and_then(|b| b.holds_until(now));
            if let (Some(retry_at), None) = (backing_off, &waiter) {
                // The link failed lately: try again when its wait is over (a client's request goes now).
                next = Some(next.map_or(retry_at, |n| n.min(retry_at)));
                continue;
            }
            self.send(&c, want, waiter);
        }
        if let Some((c, tx)) = answer {
            let _ = tx.send(Reply::Error {
                error: format!("{} is not controlled by this agent", c.id),
            });
        }
        next
    }

    /// Tells `c`'s link to freeze or thaw; the shim's answer goes to `waiter` as a reply.
    fn send(&mut self, c: &ContainerRef, frozen: bool, waiter: Option<oneshot::Sender<Reply>>) {
        let Some(link) = self.link(c) else {
            if let Some(tx) = waiter {
                let _ = tx.send(Reply::Error {
                    error: format!(
                        "the shim of {} has no control socket: it cannot be frozen from here",
                        c.id
                    ),
                });
            }
            return;
        };
        self.applied.insert(c.clone(), Some(frozen));
        let answer = waiter.map(|tx| {
            let (a_tx, a_rx) = oneshot::channel();
            tokio::spawn(async move {
                let reply = match a_rx.await {
                    Ok(Ok(r)) => Reply::Freezer(r),
                    Ok(Err(error)) => Reply::Error { error },
                    Err(_) => stopping(),
                };
                let _ = tx.send(reply);
            });
            a_tx
        });
        let _ = link.send(link::Want { frozen, answer });
    }

    fn link(&mut self, c: &ContainerRef) -> Option<mpsc::UnboundedSender<link::Want>> {
        if let Some(l) = self.links.get(c) {
            return Some(l.clone());
        }
        let socket = self.members.get(c)?.control_socket.clone()?;
        let lease = Duration::from_nanos(self.plan.bounds.lease_ns);
        let l = link::spawn(
            c.clone(),
            PathBuf::from(socket),
            lease,
            self.reports_tx.clone(),
        );
        self.links.insert(c.clone(), l.clone());
        Some(l)
    }

    /// The answer to a freeze or thaw that changes nothing: what the shim last confirmed.
    fn unchanged_reply(&self, c: &ContainerRef, reason: Option<&str>) -> Reply {
        let stats = self.stats.get(c);
        let note = match reason {
            Some("manual") | None => stats
                .and_then(|s| s.note.clone())
                .unwrap_or_else(|| "nothing to change".to_owned()),
            Some(r) => format!("the controller keeps it frozen ({r})"),
        };
        Reply::Freezer(baton_agent_api::FreezerReply {
            container: c.clone(),
            frozen: stats.is_some_and(|s| s.frozen_since.is_some()),
            latency_ns: 0,
            t_confirmed_ns: now_monotonic_ns(),
            note: Some(note),
        })
    }

    fn on_report(&mut self, r: link::Report) {
        let Some(stats) = self.stats.get_mut(&r.container) else {
            return;
        };
        let backoff = self.backoff.entry(r.container.clone()).or_default();
        match r.result {
            Ok(f) => {
                let failures = if r.freeze && !f.frozen {
                    // The hold is gone or was refused (a lapsed lease, an exec, a kill): the container
                    // runs, and the controller freezes it again at its next decision after a wait.
                    self.applied.insert(r.container.clone(), Some(false));
                    backoff.declined(now_monotonic_ns())
                } else {
                    backoff.succeeded()
                };
                if failures > 0 {
                    tracing::info!(
                        id = r.container.id,
                        failures,
                        "controller: the shim answers again"
                    );
                }
                stats.error = None;
                stats.note = f.note.clone();
                let t = f.t_confirmed_ns;
                match (f.frozen, stats.frozen_since) {
                    (true, None) => {
                        stats.frozen_since = Some(t);
                        stats.freezes += 1;
                        note(
                            &self.core,
                            &r.container,
                            t,
                            NoteKind::Frozen {
                                latency_ns: f.latency_ns,
                            },
                        );
                    }
                    (false, Some(since)) => {
                        note(
                            &self.core,
                            &r.container,
                            t,
                            NoteKind::Thawed {
                                latency_ns: f.latency_ns,
                            },
                        );
                        let d = t.saturating_sub(since);
                        stats.frozen_ns += d;
                        stats.longest_ns = stats.longest_ns.max(d);
                        stats.frozen_since = None;
                    }
                    _ => {}
                }
                if f.latency_ns > 0 {
                    super::metrics::events::events().freeze_confirmed(r.freeze, f.latency_ns);
                    if r.freeze {
                        stats.last_freeze_ns = Some(f.latency_ns);
                    } else {
                        stats.last_thaw_ns = Some(f.latency_ns);
                    }
                }
                let all = self
                    .controlled()
                    .all(|c| self.stats.get(c).is_some_and(|s| s.frozen_since.is_some()));
                self.plan.timeline.record(t, all);
            }
            Err(e) => {
                if backoff.failed(now_monotonic_ns()) {
                    tracing::warn!(
                        id = r.container.id,
                        "controller: {e} (retrying, at most once a second; logged again when it answers)"
                    );
                } else {
                    tracing::debug!(id = r.container.id, "controller: again: {e}");
                }
                stats.error = Some(e);
                self.applied.insert(r.container, None);
            }
        }
    }

    /// The co-runners (not the containers only frozen by hand).
    fn controlled(&self) -> impl Iterator<Item = &ContainerRef> {
        self.plan
            .co
            .iter()
            .filter(|(_, co)| !co.manual_only)
            .map(|(c, _)| c)
    }

    fn set_members(&mut self, members: Vec<Member>) {
        let members: BTreeMap<_, _> = members
            .into_iter()
            .map(|m| (m.container.clone(), m))
            .collect();
        if members == self.members {
            return;
        }
        self.plan.servers = members
            .values()
            .filter(|m| {
                m.role
                    .as_ref()
                    .is_some_and(|r| r.role == Role::LatencyCritical)
            })
            .map(|m| plan::Server {
                container: m.container.clone(),
                pod: m.role.as_ref().and_then(|r| r.pod.clone()),
            })
            .collect();
        let now = now_monotonic_ns();
        for m in members.values() {
            let co_runner = m.role.as_ref().filter(|r| r.role == Role::CoRunner);
            let latency_critical = m.role.is_some() && co_runner.is_none();
            if latency_critical {
                self.plan.co.remove(&m.container);
                continue;
            }
            let co = self.plan.co.entry(m.container.clone()).or_default();
            co.manual_only = co_runner.is_none();
            co.yields_to = co_runner.map(|r| r.yields_to.clone()).unwrap_or_default();
            self.stats
                .entry(m.container.clone())
                .or_insert_with(|| Stats {
                    registered_ns: now,
                    ..Default::default()
                });
        }
        self.plan.co.retain(|c, _| members.contains_key(c));
        self.stats.retain(|c, _| members.contains_key(c));
        self.links.retain(|c, _| members.contains_key(c));
        self.launches.retain(|c, _| members.contains_key(c));
        self.applied.retain(|c, _| members.contains_key(c));
        self.backoff.retain(|c, _| members.contains_key(c));
        self.members = members;
    }

    fn publish_status(&self) {
        let now = now_monotonic_ns();
        let co_runners = self
            .plan
            .co
            .iter()
            .filter(|(_, co)| !co.manual_only || co.manual.is_some())
            .map(|(c, co)| self.co_status(c, co, now))
            .collect();
        let status = ControllerStatus {
            settings: Some(self.plan.bounds.settings()),
            shielded: self.plan.shielded(),
            live_requests: self.plan.requests.len(),
            governor: self.plan.governor_status().map(|mut g| {
                g.launches_last_window = Some(self.window_launches());
                g
            }),
            duty: self
                .plan
                .co
                .values()
                .find_map(|co| co.duty)
                .map(|(run, c)| (run / 1_000_000, c.window_ns / 1_000_000)),
            silence_thaws: self.plan.silence_thaws,
            co_runners,
        };
        *self.status.lock().unwrap_or_else(|p| p.into_inner()) = status;
    }

    fn co_status(&self, c: &ContainerRef, co: &plan::Co, now: u64) -> CoRunnerStatus {
        let s = self.stats.get(c);
        let current = s
            .and_then(|s| s.frozen_since)
            .map_or(0, |t| now.saturating_sub(t));
        let frozen_ns = s.map_or(0, |s| s.frozen_ns) + current;
        let lifetime = now
            .saturating_sub(s.map_or(now, |s| s.registered_ns))
            .max(1);
        CoRunnerStatus {
            container: c.clone(),
            yields_to: co.yields_to.clone(),
            frozen_for: self.reasons.get(c).copied().flatten().map(str::to_owned),
            frozen: s.is_some_and(|s| s.frozen_since.is_some()),
            freezes: s.map_or(0, |s| s.freezes),
            frozen_ns,
            longest_frozen_ns: s.map_or(0, |s| s.longest_ns).max(current),
            starvation_thaws: co.starvation_thaws,
            run_share: 1.0 - (frozen_ns as f64 / lifetime as f64).min(1.0),
            last_freeze_ns: s.and_then(|s| s.last_freeze_ns),
            last_thaw_ns: s.and_then(|s| s.last_thaw_ns),
            error: s.and_then(|s| s.error.clone()),
            // The core fills it in from the tracer (`Core::controller_status`).
            launches: None,
        }
    }
}
