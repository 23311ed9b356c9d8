//! The controller's decisions, without I/O: from the live requests (the prefill shield), the duty cycle,
//! the governor's run share and the manual freezes, which co-runners are to be frozen now and why, bounded
//! by the anti-starvation rule, and when to decide again. Times are CLOCK_MONOTONIC ns.
use std::collections::{BTreeMap, HashMap};

use baton_agent_api::{ContainerRef, ControlSettings, GovernorStatus};

use super::gaps::{FrozenTimeline, GapStats};

/// The controller's bounds, in ns.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// Longest continuous freeze by the controller (manual freezes excepted).
    pub max_frozen_ns: u64,
    /// Least share of running time, enforced after each `max_frozen_ns` and in every governor window.
    pub min_run_share: f64,
    /// Input silence after which open requests are dropped.
    pub input_silence_ns: u64,
    /// The lease a shim gets with each freeze.
    pub lease_ns: u64,
}

impl Bounds {
    /// As `status` shows them.
    pub fn settings(&self) -> ControlSettings {
        ControlSettings {
            max_frozen_ms: self.max_frozen_ns / 1_000_000,
            min_run_share: self.min_run_share,
            input_silence_ms: self.input_silence_ns / 1_000_000,
            lease_ms: self.lease_ns / 1_000_000,
        }
    }

    /// How long a co-runner runs after `max_frozen_ns` of freeze, so that it keeps `min_run_share`.
    fn forced_run_ns(&self) -> u64 {
        let share = self.min_run_share.clamp(0.0, 0.9);
        ((self.max_frozen_ns as f64 * share / (1.0 - share)) as u64).max(1_000_000)
    }
}

/// A request between its start and its end.
#[derive(Debug, Clone)]
pub struct Live {
    /// The latency-critical container serving it (`None`: every co-runner yields to it).
    pub server: Option<ContainerRef>,
    /// When its first token came.
    pub first_token_ns: Option<u64>,
    /// When its last token came.
    pub last_token_ns: Option<u64>,
}

/// A fixed duty cycle, or the governor's windows.
#[derive(Debug, Clone, Copy)]
pub struct Cycle {
    /// Window length.
    pub window_ns: u64,
    /// Where windows start.
    pub epoch_ns: u64,
}

impl Cycle {
    /// Whether `now` is in the first `run_ns` of its window, and when that changes.
    fn phase(&self, now: u64, run_ns: u64) -> (bool, u64) {
        let w = self.window_ns.max(1);
        let into = now.saturating_sub(self.epoch_ns) % w;
        let start = now - into;
        if into < run_ns {
            (true, start + run_ns)
        } else {
            (false, start + w)
        }
    }
}

/// The governor.
#[derive(Debug)]
pub struct Governor {
    /// Its target stretch.
    pub target: f64,
    /// Its windows.
    pub cycle: Cycle,
    /// The gaps it measured.
    pub gaps: GapStats,
}

impl Governor {
    /// The run share of a window with decoding.
    pub fn share(&self, min: f64) -> f64 {
        match self.gaps.stretch() {
            None => 0.5,
            Some(s) if s <= f64::EPSILON => 0.9,
            Some(s) => (self.target / s).clamp(min.min(0.9), 0.9),
        }
    }
}

/// One co-runner (or a container only frozen by hand), as the plan sees it.
#[derive(Debug, Clone, Default)]
pub struct Co {
    /// Not a co-runner: only `freeze` and `thaw` apply to it.
    pub manual_only: bool,
    /// A fixed duty cycle: run ns per window.
    pub duty: Option<(u64, Cycle)>,
    /// What it yields to (empty: every latency-critical container).
    pub yields_to: Vec<String>,
    /// A manual freeze, and when it ends by itself.
    pub manual: Option<Option<u64>>,
    /// Since when the controller has wanted it frozen (not counting manual freezes).
    pub wanted_since: Option<u64>,
    /// A forced run (anti-starvation) lasts until then.
    pub forced_run_until: Option<u64>,
    /// Times the anti-starvation bound thawed it.
    pub starvation_thaws: u64,
}

/// A latency-critical container and the names a co-runner may give it.
#[derive(Debug, Clone)]
pub struct Server {
    /// Which container.
    pub container: ContainerRef,
    /// Its pod (`namespace/name`), if any.
    pub pod: Option<String>,
}

impl Server {
    /// Whether `name` (an id, `namespace/id`, a pod or `namespace/pod`) names it.
    pub fn is_named(&self, name: &str) -> bool {
        baton_agent_api::names_container(name, &self.container, self.pod.as_deref())
    }
}

/// Everything the controller decides from.
#[derive(Debug)]
pub struct Plan {
    /// Its bounds.
    pub bounds: Bounds,
    /// Live requests by id.
    pub requests: HashMap<String, Live>,
    /// The last request event or token.
    pub last_input_ns: u64,
    /// The governor, when on.
    pub governor: Option<Governor>,
    /// When the co-runners were all frozen (confirmed).
    pub timeline: FrozenTimeline,
    /// The co-runners.
    pub co: BTreeMap<ContainerRef, Co>,
    /// The latency-critical containers.
    pub servers: Vec<Server>,
    /// Times silence dropped the open requests.
    pub silence_thaws: u64,
    /// Hand-backs of idle-parked servers in progress: the input-silence bound waits while there are any.
    pub handing_back: u32,
}

/// What a co-runner is to be, and why it is frozen.
pub type Decision = (ContainerRef, Option<&'static str>);

impl Plan {
    /// A plan with nothing to do.
    pub fn new(bounds: Bounds) -> Self {
        Self {
            bounds,
            requests: HashMap::new(),
            last_input_ns: 0,
            governor: None,
            timeline: FrozenTimeline::default(),
            co: BTreeMap::new(),
            servers: Vec::new(),
            silence_thaws: 0,
            handing_back: 0,
        }
    }

    /// A hand-back began (`active`) or ended at `now`. The silence bound counts again from the end of the
    /// last one: a request that waited for it was silent for a reason.
    pub fn hand_back(&mut self, active: bool, now: u64) {
        if active {
            self.handing_back += 1;
        } else {
            self.handing_back = self.handing_back.saturating_sub(1);
            if self.handing_back == 0 {
                self.last_input_ns = self.last_input_ns.max(now);
            }
        }
    }

    /// Requests between start and first token.
    pub fn shielded(&self) -> usize {
        self.requests
            .values()
            .filter(|r| r.first_token_ns.is_none())
            .count()
    }

    /// Whether co-runner `co` yields to the server of a request.
    fn yields(&self, co: &Co, server: Option<&ContainerRef>) -> bool {
        let Some(server) = server else { return true };
        co.yields_to.is_empty()
            || self
                .servers
                .iter()
                .filter(|s| s.container == *server)
                .any(|s| co.yields_to.iter().any(|y| s.is_named(y)))
    }

    /// Decides every co-runner at `now`; also returns when to decide again.
    pub fn decide(&mut self, now: u64) -> (Vec<Decision>, Option<u64>) {
        let mut next: Option<u64> = None;
        let mut at = |t: u64| next = Some(next.map_or(t, |n| n.min(t)));
        if !self.requests.is_empty() && self.handing_back == 0 {
            let silent_at = self.last_input_ns + self.bounds.input_silence_ns;
            if now >= silent_at {
                tracing::warn!(
                    requests = self.requests.len(),
                    "controller: no request event or token for {} ms: dropping the open requests and thawing",
                    self.bounds.input_silence_ns / 1_000_000
                );
                self.requests.clear();
                self.silence_thaws += 1;
            } else {
                at(silent_at);
            }
        }
        let share = self
            .governor
            .as_ref()
            .map(|g| g.share(self.bounds.min_run_share));
        let keys: Vec<ContainerRef> = self.co.keys().cloned().collect();
        let mut out = Vec::with_capacity(keys.len());
        for key in keys {
            let reason = self.wanted(&key, now, share, &mut at);
            let reason = self.bound(&key, now, reason, &mut at);
            out.push((key, reason));
        }
        (out, next)
    }

    /// Why the controller wants `key` frozen at `now`, before the anti-starvation bound.
    fn wanted(
        &mut self,
        key: &ContainerRef,
        now: u64,
        share: Option<f64>,
        at: &mut impl FnMut(u64),
    ) -> Option<&'static str> {
        let co = self.co.get(key)?;
        if co.manual_only {
            return None;
        }
        let shield = self
            .requests
            .values()
            .any(|r| r.first_token_ns.is_none() && self.yields(co, r.server.as_ref()));
        if shield {
            return Some("shield");
        }
        if let Some((run_ns, cycle)) = co.duty {
            let (running, change) = cycle.phase(now, run_ns);
            at(change);
            return (!running).then_some("duty");
        }
        let (Some(g), Some(share)) = (&self.governor, share) else {
            return None;
        };
        let window = g.cycle.window_ns;
        let decoding = self.requests.values().any(|r| {
            r.first_token_ns.is_some()
                && r.last_token_ns
                    .is_some_and(|t| now.saturating_sub(t) < 2 * window)
                && self.yields(co, r.server.as_ref())
        });
        if !decoding {
            return None;
        }
        let run_ns = (window as f64 * share) as u64;
        let (running, change) = g.cycle.phase(now, run_ns);
        at(change);
        (!running).then_some("governor")
    }

    /// Applies the manual freeze and the anti-starvation bound to what the controller wants.
    fn bound(
        &mut self,
        key: &ContainerRef,
        now: u64,
        wanted: Option<&'static str>,
        at: &mut impl FnMut(u64),
    ) -> Option<&'static str> {
        let bounds = self.bounds;
        let co = self.co.get_mut(key)?;
        if let Some(until) = co.manual {
            match until {
                Some(t) if t <= now => co.manual = None,
                Some(t) => {
                    at(t);
                    return Some("manual");
                }
                None => return Some("manual"),
            }
        }
        if let Some(t) = co.forced_run_until {
            if t > now {
                at(t);
                return None;
            }
            co.forced_run_until = None;
        }
        let Some(reason) = wanted else {
            co.wanted_since = None;
            return None;
        };
        let since = *co.wanted_since.get_or_insert(now);
        let limit = since + bounds.max_frozen_ns;
        if now < limit {
            at(limit);
            return Some(reason);
        }
        co.wanted_since = None;
        co.starvation_thaws += 1;
        let until = now + bounds.forced_run_ns();
        co.forced_run_until = Some(until);
        at(until);
        tracing::info!(
            id = key.id,
            "controller: frozen for {} ms at a stretch: running it for {} ms (anti-starvation)",
            bounds.max_frozen_ns / 1_000_000,
            bounds.forced_run_ns() / 1_000_000
        );
        None
    }

    /// A token of request `id` at `t`: the gap since its previous one goes to the governor.
    pub fn token(&mut self, id: &str, t: u64) -> Result<(), String> {
        let r = self.requests.get_mut(id).ok_or_else(|| unknown(id))?;
        if r.first_token_ns.is_none() {
            r.first_token_ns = Some(t);
        }
        if let (Some(prev), Some(g)) = (r.last_token_ns, self.governor.as_mut())
            && t > prev
        {
            g.gaps.add(prev, t, &self.timeline);
        }
        r.last_token_ns = Some(t);
        Ok(())
    }

    /// The governor as `status` shows it.
    pub fn governor_status(&self) -> Option<GovernorStatus> {
        let g = self.governor.as_ref()?;
        Some(GovernorStatus {
            target_stretch: g.target,
            window_ms: g.cycle.window_ns / 1_000_000,
            stretch: g.gaps.stretch(),
            run_share: g.share(self.bounds.min_run_share),
            gaps_running: g.gaps.counted.0,
            gaps_frozen: g.gaps.counted.1,
            mean_gap_running_ns: g.gaps.mean_running(),
            mean_gap_frozen_ns: g.gaps.mean_frozen(),
            launches_last_window: None,
        })
    }
}

/// The error for an event of a request the controller does not know.
pub fn unknown(id: &str) -> String {
    format!("unknown request id {id:?}: send request_start for it first (or it already ended)")
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn plan() -> Plan {
        let mut p = Plan::new(Bounds {
            max_frozen_ns: 1000 * MS,
            min_run_share: 0.05,
            input_silence_ns: 500 * MS,
            lease_ns: 2000 * MS,
        });
        p.co.insert(c("trainer"), Co::default());
        p
    }

    fn c(id: &str) -> ContainerRef {
        ContainerRef {
            id: id.into(),
            namespace: "n".into(),
        }
    }

    fn start(p: &mut Plan, id: &str, t: u64) {
        p.requests.insert(
            id.into(),
            Live {
                server: None,
                first_token_ns: None,
                last_token_ns: None,
            },
        );
        p.last_input_ns = t;
    }

    fn reason(p: &mut Plan, now: u64) -> Option<&'static str> {
        p.decide(now).0[0].1
    }

    #[test]
    fn the_shield_freezes_from_request_start_to_first_token() {
        let mut p = plan();
        assert_eq!(reason(&mut p, 0), None);
        start(&mut p, "r1", 10 * MS);
        assert_eq!(reason(&mut p, 10 * MS), Some("shield"));
        p.token("r1", 20 * MS).unwrap();
        p.last_input_ns = 20 * MS;
        assert_eq!(reason(&mut p, 20 * MS), None);
        assert!(
            p.token("nope", 1)
                .unwrap_err()
                .contains("unknown request id")
        );
    }

    #[test]
    fn silence_waits_for_a_hand_back_and_counts_again_from_its_end() {
        let mut p = plan();
        p.requests.insert(
            "r".into(),
            Live {
                server: None,
                first_token_ns: None,
                last_token_ns: None,
            },
        );
        p.last_input_ns = 0;
        p.hand_back(true, 0);
        p.decide(10 * p.bounds.input_silence_ns);
        assert_eq!(
            p.requests.len(),
            1,
            "a request waiting for a hand-back is kept"
        );
        let end = 10 * p.bounds.input_silence_ns;
        p.hand_back(false, end);
        p.decide(end + p.bounds.input_silence_ns - 1);
        assert_eq!(
            p.requests.len(),
            1,
            "silence counts from the hand-back's end"
        );
        p.decide(end + p.bounds.input_silence_ns);
        assert!(p.requests.is_empty());
    }

    #[test]
    fn a_silent_input_drops_the_requests_and_thaws() {
        let mut p = plan();
        start(&mut p, "r1", 0);
        let (d, next) = p.decide(100 * MS);
        assert_eq!(d[0].1, Some("shield"));
        assert_eq!(
            next,
            Some(500 * MS),
            "decides again when the input would be silent"
        );
        assert_eq!(reason(&mut p, 500 * MS), None);
        assert_eq!(p.silence_thaws, 1);
        assert!(p.requests.is_empty());
    }

    #[test]
    fn anti_starvation_bounds_a_continuous_freeze_and_then_runs_the_co_runner() {
        let mut p = plan();
        p.bounds.input_silence_ns = u64::MAX / 4;
        start(&mut p, "r1", 0);
        assert_eq!(reason(&mut p, 0), Some("shield"));
        let (_, next) = p.decide(500 * MS);
        assert_eq!(next, Some(1000 * MS));
        assert_eq!(reason(&mut p, 1000 * MS), None, "thawed at the bound");
        let forced = p.bounds.forced_run_ns();
        assert!(
            (52 * MS..=53 * MS).contains(&forced),
            "{forced}: 5% of the time over a cycle"
        );
        assert_eq!(reason(&mut p, 1000 * MS + forced - 1), None);
        assert_eq!(reason(&mut p, 1000 * MS + forced), Some("shield"));
        assert_eq!(p.co[&c("trainer")].starvation_thaws, 1);
    }

    #[test]
    fn a_manual_freeze_is_not_bounded_by_anti_starvation_but_ends_at_its_hold() {
        let mut p = plan();
        p.co.get_mut(&c("trainer")).unwrap().manual = Some(Some(5000 * MS));
        assert_eq!(reason(&mut p, 0), Some("manual"));
        assert_eq!(reason(&mut p, 4999 * MS), Some("manual"));
        assert_eq!(reason(&mut p, 5000 * MS), None);
    }

    #[test]
    fn a_duty_cycle_runs_the_first_part_of_each_window() {
        let mut p = plan();
        p.co.get_mut(&c("trainer")).unwrap().duty = Some((
            50 * MS,
            Cycle {
                window_ns: 200 * MS,
                epoch_ns: 0,
            },
        ));
        let (d, next) = p.decide(10 * MS);
        assert_eq!((d[0].1, next), (None, Some(50 * MS)));
        let (d, next) = p.decide(60 * MS);
        assert_eq!((d[0].1, next), (Some("duty"), Some(200 * MS)));
        assert_eq!(reason(&mut p, 210 * MS), None);
    }

    #[test]
    fn the_governor_gives_target_over_stretch_of_each_decoding_window() {
        let mut p = plan();
        p.bounds.input_silence_ns = u64::MAX / 4;
        p.governor = Some(Governor {
            target: 0.2,
            cycle: Cycle {
                window_ns: 200 * MS,
                epoch_ns: 0,
            },
            gaps: GapStats::default(),
        });
        // Gaps of 10 ms while running (before 1 s), 5 ms while frozen (after): stretch 1.0.
        p.timeline.record(1000 * MS, true);
        start(&mut p, "r", 0);
        for i in 0..20 {
            p.token("r", i * 10 * MS).unwrap();
        }
        p.requests.get_mut("r").unwrap().last_token_ns = None;
        for i in 0..20 {
            p.token("r", 1000 * MS + i * 5 * MS).unwrap();
        }
        let g = p.governor_status().unwrap();
        assert!((g.stretch.unwrap() - 1.0).abs() < 1e-9, "{g:?}");
        assert!((g.run_share - 0.2).abs() < 1e-9, "{g:?}");
        // Decoding (a token within two windows): runs the first 40 ms of each 200 ms.
        let last = p.requests["r"].last_token_ns.unwrap();
        let w0 = (last / (200 * MS) + 1) * 200 * MS;
        assert_eq!(reason(&mut p, w0 + 10 * MS), None);
        assert_eq!(reason(&mut p, w0 + 50 * MS), Some("governor"));
        // No decoding for two windows: free.
        assert_eq!(reason(&mut p, last + 400 * MS + 50 * MS), None);
    }

    #[test]
    fn a_co_runner_yields_only_to_the_servers_it_names() {
        let mut p = plan();
        p.co.get_mut(&c("trainer")).unwrap().yields_to = vec!["serving/llm".into()];
        p.servers = vec![
            Server {
                container: c("a"),
                pod: Some("serving/llm".into()),
            },
            Server {
                container: c("b"),
                pod: None,
            },
        ];
        p.requests.insert(
            "x".into(),
            Live {
                server: Some(c("b")),
                first_token_ns: None,
                last_token_ns: None,
            },
        );
        assert_eq!(reason(&mut p, 0), None, "b is not what it yields to");
        p.requests.get_mut("x").unwrap().server = Some(c("a"));
        assert_eq!(reason(&mut p, 0), Some("shield"));
        assert!(p.servers[0].is_named("llm") && p.servers[0].is_named("n/a"));
    }
}
