//! The core's loop: one command, one batch of records or one deadline at a time (the gate's, the
//! trace sessions' launch lines, the /proc recheck, gap-fill's), each handed to the job it concerns.
use baton_agent_api::Reply;
use baton_tracer::{Tracer, event::Event as Record};
use tokio::sync::mpsc;

use super::{Command, Core, What};
use crate::{sleep_until_opt, trace_session::TraceSession};

/// What the core answers a command that only carries something to it (its real answer, if any, goes
/// through the command's own channel).
fn acknowledged() -> Reply {
    Reply::Unregistered { found: true }
}

impl Core {
    /// Serves `commands` until every sender is gone.
    pub async fn run(mut self, mut commands: mpsc::Receiver<Command>) {
        // The GPUs' idle memory, while nothing is watched yet (`gate/floor.rs`).
        self.ask_floor();
        loop {
            if std::mem::take(&mut self.floor.wanted) {
                self.ask_floor();
            }
            self.gap_fill_resume();
            self.idle_park_check();
            let launches_due = self.launch_due();
            let reconcile_due = self.reconcile_due();
            let gap_fill_due = [self.gapfill.next_due(), self.idle.next_due()]
                .into_iter()
                .flatten()
                .min();
            tokio::select! {
                cmd = commands.recv() => match cmd {
                    Some(c) => self.serve(c),
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
                () = sleep_until_opt(reconcile_due) => self.reconcile_held(),
                done = self.gapfill.next_done() => self.on_gap_fill_done(done),
                done = self.offload.next_done() => self.on_read_done(done),
                () = sleep_until_opt(gap_fill_due) => {
                    self.gapfill.expire();
                    self.show_rate_gate_changes();
                    // A lapsed claim lets the next waiter through.
                    self.check_gates();
                }
                _ = rescan_tick(self.traces.values().any(TraceSession::has_names)) => {
                    self.refresh_trace_names();
                }
            }
        }
    }

    /// Answers one command, then tells the controller the watched containers if they changed. A Start at
    /// the gate is answered later, when its GPU is free or at its deadline.
    fn serve(&mut self, c: Command) {
        let Command {
            what,
            peer_pid,
            reply,
        } = c;
        let answer = match what {
            What::Gate(request) => {
                self.add_waiter(request, reply);
                return;
            }
            What::Resolve { target, answer } => {
                let _ = answer.send(self.resolve(&target));
                acknowledged()
            }
            What::Launches(answer) => {
                let _ = answer.send(self.launches());
                acknowledged()
            }
            What::RequestSeen { server, start } => {
                self.request_seen(server.as_deref(), start);
                acknowledged()
            }
            What::Note(note) => {
                self.preemption_noted(&note);
                acknowledged()
            }
            What::Metrics(answer) => {
                let _ = answer.send(self.metrics_snapshot());
                acknowledged()
            }
            What::CheckPeer(answer) => {
                let _ = answer.send(self.check_peer(peer_pid));
                acknowledged()
            }
            What::NvmlChecked(checked) => {
                self.publish_nvml_check(*checked);
                acknowledged()
            }
            What::GpuUsers { asked_ns, users } => {
                self.gpu_users.answered(asked_ns, users);
                self.check_gates();
                acknowledged()
            }
            What::NvmlMemory { asked_ns, memory } => {
                self.on_nvml_memory(asked_ns, memory);
                acknowledged()
            }
            What::SetPreemption { container, state } => {
                let found = self.set_preemption(&container, state);
                Reply::Unregistered { found }
            }
            What::Request(r) => self.handle(r, peer_pid),
            What::Trace {
                session,
                request,
                lines,
            } => self.start_trace(session, &request, lines),
            What::EndTrace(session) => self.end_trace(session),
            What::PeerGone(pid) => self.peer_gone(pid),
        };
        let _ = reply.send(answer);
        self.publish_members();
    }
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
