//! The controller's requests, checked: bad input gets an error that says what to send instead, and
//! changes nothing.
use baton_agent_api::{
    Accepted, ContainerRef, DutyRequest, FreezeRequest, GovernorRequest, Reply, Request,
    RequestEvent, Target, now_monotonic_ns,
};
use tokio::sync::oneshot;

use super::{
    Controller,
    gaps::GapStats,
    plan::{self, Cycle, Governor, Live},
};

const MS: u64 = 1_000_000;
/// How far in the past an event's `t_ns` may be.
const T_PAST_NS: u64 = 10_000 * MS;

impl Controller {
    /// Answers `request` on `reply` (a freeze or thaw once its shim confirmed it).
    pub(crate) fn request(&mut self, request: Request, reply: oneshot::Sender<Reply>) {
        let now = now_monotonic_ns();
        let result = match request {
            Request::Freeze(f) => return self.freeze(f, now, reply),
            Request::Thaw(t) => return self.thaw(&t, reply),
            Request::Duty(d) => self.duty(&d, now),
            Request::Governor(g) => self.governor(&g, now),
            Request::RequestStart(e) => self.request_start(e, now),
            Request::FirstToken(e) => self.token(&e, now, true),
            Request::Token(e) => self.token(&e, now, false),
            Request::RequestEnd(e) => self.request_end(&e, now),
            other => Err(format!("the controller does not answer {other:?}")),
        };
        let reply_now = match result {
            Ok(()) => self.accepted(),
            Err(error) => Reply::Error { error },
        };
        let _ = reply.send(reply_now);
    }

    /// Sends the freezes the change causes (before the reply), then says how many are wanted frozen.
    fn accepted(&mut self) -> Reply {
        self.decide_and_apply(None);
        Reply::Accepted(Accepted {
            frozen: self.reasons.values().filter(|r| r.is_some()).count(),
            shielded: self.plan.shielded(),
        })
    }

    fn freeze(&mut self, f: FreezeRequest, now: u64, reply: oneshot::Sender<Reply>) {
        let c = match self.controllable(&f.target) {
            Ok(c) => c,
            Err(error) => {
                let _ = reply.send(Reply::Error { error });
                return;
            }
        };
        let until = f.hold_ms.map(|ms| now + ms.saturating_mul(MS));
        if let Some(co) = self.plan.co.get_mut(&c) {
            co.manual = Some(until);
        }
        self.decide_and_apply(Some((c, reply)));
    }

    fn thaw(&mut self, t: &Target, reply: oneshot::Sender<Reply>) {
        let c = match self.controllable(t) {
            Ok(c) => c,
            Err(error) => {
                let _ = reply.send(Reply::Error { error });
                return;
            }
        };
        if let Some(co) = self.plan.co.get_mut(&c) {
            co.manual = None;
            // A thaw by hand also ends a forced freeze streak.
            co.wanted_since = None;
        }
        self.decide_and_apply(Some((c, reply)));
    }

    /// The container `t` names, if the controller may freeze it.
    fn controllable(&self, t: &Target) -> Result<ContainerRef, String> {
        let found: Vec<&ContainerRef> = self
            .members
            .keys()
            .filter(|c| c.id == t.id && t.namespace.as_ref().is_none_or(|ns| *ns == c.namespace))
            .collect();
        let c = match found.as_slice() {
            [one] => (*one).clone(),
            [] => {
                return Err(format!(
                    "no container {} is known to the agent (only containers its shims registered: \
                     see `baton status`)",
                    t.id
                ));
            }
            _ => {
                return Err(format!(
                    "container id {} is in several namespaces: name one with -n",
                    t.id
                ));
            }
        };
        if !self.plan.co.contains_key(&c) {
            return Err(format!(
                "{} is latency-critical: the controller never freezes it (only co-runners yield; \
                 preemption flows from serving to checkpointable work)",
                c.id
            ));
        }
        Ok(c)
    }

    fn duty(&mut self, d: &DutyRequest, now: u64) -> Result<(), String> {
        if d.window_ms == 0 {
            return Err("duty: window_ms must be > 0".to_owned());
        }
        if d.run_ms > d.window_ms {
            return Err(format!(
                "duty: run_ms {} is longer than window_ms {}: a co-runner runs at most the whole window",
                d.run_ms, d.window_ms
            ));
        }
        let targets =
            self.co_runners(d.co_runner.id.as_deref(), d.co_runner.namespace.as_deref())?;
        let duty = (d.run_ms < d.window_ms).then(|| {
            (
                d.run_ms * MS,
                Cycle {
                    window_ns: d.window_ms * MS,
                    epoch_ns: now,
                },
            )
        });
        for c in targets {
            if let Some(co) = self.plan.co.get_mut(&c) {
                co.duty = duty;
            }
        }
        Ok(())
    }

    /// The co-runners `id` names (all of them without an id).
    fn co_runners(&self, id: Option<&str>, ns: Option<&str>) -> Result<Vec<ContainerRef>, String> {
        let all: Vec<ContainerRef> = self.controlled().cloned().collect();
        let Some(id) = id else {
            return Ok(all);
        };
        let picked: Vec<ContainerRef> = all
            .into_iter()
            .filter(|c| c.id == id && ns.is_none_or(|n| n == c.namespace))
            .collect();
        if picked.is_empty() {
            return Err(format!(
                "{id} is not a co-runner known to the agent (annotate it baton.io/role: co-runner)"
            ));
        }
        Ok(picked)
    }

    fn governor(&mut self, g: &GovernorRequest, now: u64) -> Result<(), String> {
        if g.off {
            self.plan.governor = None;
            return Ok(());
        }
        if !(g.target_stretch.is_finite() && g.target_stretch > 0.0) {
            return Err(format!(
                "governor: target_stretch must be a number > 0 (0.2: gaps at most 20% longer), not {}",
                g.target_stretch
            ));
        }
        if g.window_ms == 0 {
            return Err("governor: window_ms must be > 0".to_owned());
        }
        self.plan.governor = Some(Governor {
            target: g.target_stretch,
            cycle: Cycle {
                window_ns: g.window_ms * MS,
                epoch_ns: now,
            },
            gaps: GapStats::default(),
        });
        Ok(())
    }

    fn request_start(&mut self, e: RequestEvent, now: u64) -> Result<(), String> {
        let server = self.server(e.server.as_deref())?;
        event_time(&e, now)?;
        if self.plan.requests.contains_key(&e.id) {
            return Err(format!(
                "request {:?} has started already: ids must be unique among live requests",
                e.id
            ));
        }
        self.plan.requests.insert(
            e.id,
            Live {
                server,
                first_token_ns: None,
                last_token_ns: None,
            },
        );
        self.plan.last_input_ns = now;
        Ok(())
    }

    fn token(&mut self, e: &RequestEvent, now: u64, first: bool) -> Result<(), String> {
        let t = event_time(e, now)?;
        let r = self
            .plan
            .requests
            .get(&e.id)
            .ok_or_else(|| plan::unknown(&e.id))?;
        if first && r.first_token_ns.is_some() {
            return Err(format!("request {:?} had its first token already", e.id));
        }
        self.plan.token(&e.id, t)?;
        self.plan.last_input_ns = now;
        Ok(())
    }

    fn request_end(&mut self, e: &RequestEvent, now: u64) -> Result<(), String> {
        self.plan
            .requests
            .remove(&e.id)
            .ok_or_else(|| plan::unknown(&e.id))?;
        self.plan.last_input_ns = now;
        Ok(())
    }

    /// The latency-critical container a request event names (`None`: every co-runner yields to it).
    fn server(&self, name: Option<&str>) -> Result<Option<ContainerRef>, String> {
        let Some(name) = name else { return Ok(None) };
        self.plan
            .servers
            .iter()
            .find(|s| s.is_named(name))
            .map(|s| Some(s.container.clone()))
            .ok_or_else(|| {
                format!(
                    "no latency-critical container {name:?} is known to the agent (annotate the server \
                     baton.io/role: latency-critical, or leave \"server\" out)"
                )
            })
    }
}

/// The event's time, which must be this node's CLOCK_MONOTONIC (the agent's time when left out).
fn event_time(e: &RequestEvent, now: u64) -> Result<u64, String> {
    match e.t_ns {
        None => Ok(now),
        Some(t) if t <= now + MS && t + T_PAST_NS >= now => Ok(t),
        Some(t) => Err(format!(
            "t_ns {t} is not CLOCK_MONOTONIC ns of this node (now {now}): leave it out to use the agent's"
        )),
    }
}
