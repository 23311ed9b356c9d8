//! The core's side of gap-fill: the preemptions a waiter behind the gate calls for, the answers of the shim
//! calls the agent ran by itself, and the resume of the next parked co-runner.
use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};

use baton_agent_api::{ContainerRef, Reply, Target};

use super::{Done, is_server, server_needs};
use crate::{
    core::{Core, Note, NoteKind},
    gate::{self, DeviceKey, Waiter},
    registry::watched::Watched,
};
use baton_tracer::now_monotonic_ns;

/// The core's side of gap-fill: what it does on the gate, on a shim call's end and on each turn.
impl Core {
    /// Starts the preemptions waiter `w`, still blocked at the gate, calls for (none unless it is
    /// latency-critical). A co-runner whose park would be refused for host memory (no room in its memory
    /// cgroup under `park_memory = "refuse"`, or a raise past the node or its budget) is never picked: it
    /// stays as a holder the server waits for, and `w` keeps why.
    pub(crate) fn gap_fill_preempt_for(&mut self, w: &mut Waiter) {
        let Some(server) = self.watched.get(&w.container) else {
            return;
        };
        let holders = self.holders(&w.container, &w.devices);
        let mut picks = self.gapfill.to_preempt(server, &holders);
        for p in &mut picks {
            p.bytes = self.counted_bytes(&p.container);
        }
        let fit = self.fit_of(w);
        if matches!(fit, crate::gate::room::Fit::Never { .. }) {
            // Parking every co-runner would not make room for it.
            return;
        }
        let mut budget_left = self.parked_host_memory().budget_left();
        let mut unparkable = Vec::new();
        picks.retain(|p| {
            self.park_raise_of(&p.container, budget_left)
                .map_err(|why| unparkable.push((p.container.clone(), why)))
                .is_ok()
        });
        if let Some(deficit) = fit.deficit() {
            picks = self.enough_to_fit(picks, deficit, &holders);
        }
        // Those chosen, each with what the budget has left for its raise once the ones before it raised theirs.
        let mut chosen = Vec::new();
        for p in picks {
            match self.park_raise_of(&p.container, budget_left) {
                Ok(raise) => {
                    chosen.push((p, budget_left));
                    budget_left = budget_left.saturating_sub(raise);
                }
                Err(why) => unparkable.push((p.container.clone(), why)),
            }
        }
        self.tell_unparkable(w, unparkable);
        if fit.deficit().is_some() {
            for (p, _) in &chosen {
                let detail = format!(
                    "parked {} for {} ({})",
                    p.container.id,
                    w.container.id,
                    fit.describe()
                );
                tracing::info!(id = p.container.id, "agent: gap-fill: {detail}");
                self.note_room(&[&p.container, &w.container], "parked", &detail);
            }
        }
        let requested_ns = now_monotonic_ns();
        let mut gpus = BTreeSet::new();
        for (pick, budget_left) in chosen {
            match self.resolve(&Target::exact(&pick.container)) {
                Ok(mut r) if !r.pids.is_empty() => {
                    r.host_budget_left = budget_left;
                    gpus.extend(pick.devices.iter().cloned());
                    self.gapfill.preempt(pick, r, &w.container, requested_ns);
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(id = pick.container.id, "agent: gap-fill: {e}"),
            }
        }
        if !gpus.is_empty() {
            // One preemption of each GPU per server arrival, however many co-runners it parks.
            self.gapfill.rate.preempted(&gpus, requested_ns);
        }
    }

    /// Keeps in waiter `w` the co-runners gap-fill cannot park for it now, and shows each on both traces the
    /// first time (the gate is checked again and again while `w` waits).
    fn tell_unparkable(&mut self, w: &mut Waiter, now: Vec<(ContainerRef, String)>) {
        let before = std::mem::take(&mut w.unparkable);
        for (c, why) in now {
            if !before.contains_key(&c) {
                let detail = format!("skipped {} for {}: {why}", c.id, w.container.id);
                tracing::warn!(id = c.id, "agent: gap-fill: {detail}");
                self.note_room(&[&c, &w.container], "skipped", &detail);
            }
            w.unparkable.insert(c, why);
        }
    }

    /// Shows a room line (`what`, `detail`) on the traces of `containers`.
    fn note_room(&mut self, containers: &[&ContainerRef], what: &'static str, detail: &str) {
        for c in containers {
            self.note(&Note {
                container: (*c).clone(),
                t_ns: now_monotonic_ns(),
                kind: NoteKind::Room {
                    what,
                    detail: detail.to_owned(),
                },
            });
        }
    }

    /// A shim call the agent ran by itself ended.
    pub(crate) fn on_gap_fill_done(&mut self, done: Done) {
        match done {
            Done::Preempted {
                container,
                steps,
                result,
            } => {
                self.gapfill.preempted(&container, &steps, &result);
                if let Ok(o) = &result {
                    self.set_preemption(&container, o.preemption.clone());
                }
                for (co, error) in self.gapfill.take_failures() {
                    self.fail_waiters_for(&co, &error);
                }
            }
            Done::Resumed {
                container,
                steps,
                result,
            } => {
                self.gapfill.resumed(&container, &steps, &result);
                if let Ok(o) = &result {
                    self.set_preemption(&container, o.preemption.clone());
                }
            }
            Done::Step(step) => {
                self.preemption_noted(&Note::of_step(&step));
                return;
            }
            Done::ServerParked { container, result } => self.idle_parked(&container, &result),
            Done::ServerResumed { container, result } => self.idle_resumed(&container, &result),
            Done::ParkedAgain { container, result } => self.parked_again(&container, &result),
        }
        self.show_rate_gate_changes();
        self.check_gates();
    }

    /// Answers with `error` the latency-critical waiters that co-runner `co`, whose preemption failed, keeps
    /// waiting (it still holds their GPU).
    fn fail_waiters_for(&mut self, co: &ContainerRef, error: &str) {
        let waiters = std::mem::take(&mut self.waiters);
        let (failed, kept): (Vec<Waiter>, Vec<Waiter>) = waiters.into_iter().partition(|w| {
            self.watched.get(&w.container).is_some_and(is_server)
                && self
                    .holders(&w.container, &w.devices)
                    .iter()
                    .any(|h| h.registration.container == *co)
        });
        self.waiters = kept;
        for w in failed {
            let _ = w.reply.send(Reply::Error {
                error: error.to_owned(),
            });
        }
    }

    /// Resumes the next parked co-runner no latency-critical container needs the GPU of, if any.
    pub(crate) fn gap_fill_resume(&mut self) {
        if !self.gapfill.has_parked() {
            return;
        }
        let Some(tracer) = self.tracer.as_ref() else {
            return;
        };
        let watched = &self.watched;
        // One view of what each container holds for the whole decision: read afresh for each candidate,
        // a server exiting between two reads blocked the first candidate (it still held the GPU) and not
        // the next (it no longer did), and a lower-priority co-runner was resumed first.
        let seen: RefCell<BTreeMap<u64, BTreeSet<DeviceKey>>> = RefCell::default();
        let held = |w: &Watched| {
            seen.borrow_mut()
                .entry(w.cgroup_id)
                .or_insert_with(|| gate::devices_holding(tracer, w))
                .clone()
        };
        self.gapfill
            .settle_claims(|c| watched.get(c).is_none_or(Watched::is_held));
        let mut waiting: Vec<(ContainerRef, BTreeSet<DeviceKey>)> = self
            .waiters
            .iter()
            .map(|w| (w.container.clone(), w.devices.clone()))
            .collect();
        waiting.extend(self.gapfill.claims());
        waiting.extend(self.servers_handed_back());
        // Why the one chosen may resume while a server needs its GPU: it fits beside (the figures).
        let beside: RefCell<Option<String>> = RefCell::default();
        let next = self.gapfill.next_resume(|c, devices, bytes| {
            if !server_needs(watched.get(c), watched, devices, held, &waiting) {
                return false;
            }
            let fits = self.fits_beside(c, devices, bytes);
            *beside.borrow_mut() = fits.clone();
            fits.is_none()
        });
        let Some(c) = next else {
            return;
        };
        if let Some(detail) = beside.into_inner() {
            tracing::info!(id = c.id, "agent: gap-fill: {detail}");
            self.note(&Note {
                container: c.clone(),
                t_ns: now_monotonic_ns(),
                kind: NoteKind::Room {
                    what: "resumed",
                    detail,
                },
            });
        }
        match self.resolve(&Target::exact(&c)) {
            Ok(r) => self.gapfill.resume(r),
            Err(e) => self
                .gapfill
                .finish(&c, format!("it can no longer be resumed: {e}")),
        }
    }
}
