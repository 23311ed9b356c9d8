//! The `baton trace` sessions the agent serves from its probe set: started and ended on their connections'
//! requests, fed the freezes, thaws and preemption steps, their launch lines on time, and their container
//! names looked for again.
use baton_agent_api::{Reply, TraceRequest};
use baton_tracer::Tracer;
use tokio::sync::mpsc;

use super::{Core, Note};
use crate::trace_session::{DEFAULT_DEVICE_DIR, TraceSession};

impl Core {
    /// Starts trace session `session` (loading the probes if need be); its lines go to `lines`.
    pub(super) fn start_trace(
        &mut self,
        session: u64,
        request: &TraceRequest,
        lines: mpsc::Sender<String>,
    ) -> Reply {
        let default_dir = [DEFAULT_DEVICE_DIR.to_owned()];
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

    /// Ends trace session `session`: its last lines, then the cgroups, device directories and probes that
    /// nothing else uses are let go.
    pub(super) fn end_trace(&mut self, session: u64) -> Reply {
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

    /// Shows `note` to the trace sessions that trace its container.
    pub(crate) fn note(&mut self, note: &Note) {
        let (Some(t), Some(w)) = (self.tracer.as_mut(), self.watched.get(&note.container)) else {
            return;
        };
        for s in self.traces.values_mut() {
            if s.traces_cgroup(w.cgroup_id) {
                s.note(w.cgroup_id, note, t);
            }
        }
    }

    /// The next launch lines of the trace sessions, while there are sessions.
    pub(super) fn launch_due(&mut self) -> Option<tokio::time::Instant> {
        let every = self.traces.values().map(|s| s.launch_every).min()?;
        Some(
            *self
                .launches_due
                .get_or_insert_with(|| tokio::time::Instant::now() + every),
        )
    }

    /// Every trace session's launch lines.
    pub(super) fn trace_launches(&mut self) {
        self.launches_due = None;
        let Some(t) = self.tracer.as_mut() else {
            return;
        };
        for s in self.traces.values_mut() {
            s.launches(t);
        }
    }

    /// Watches the containers started since that the sessions' names match.
    pub(super) fn refresh_trace_names(&mut self) {
        if let Some(t) = self.tracer.as_mut() {
            for s in self.traces.values_mut() {
                s.refresh(t);
            }
        }
    }
}
