//! Process exits, in the Go shim's order: an exec's TaskExit after its TaskExecStarted; the
//! init's TaskExit after TaskStart, after any TaskOOM, and after the TaskExit of every exec
//! process that was starting or running (in a container without a pid namespace of its own
//! they are killed first, `runc kill --all`; a paused container is thawed before that). A
//! process's exit becomes visible (State, Wait) only once its TaskExit is queued, so a client's
//! Delete, and so TaskDelete, always comes after; and only once its output copies wrote out what
//! it printed (or no output flowed for a while), so Wait never returns before the output.
//! Nothing here holds the event gate or the process table while waiting.

use std::{sync::Arc, time::Duration};

use containerd_shim::{
    asynchronous::monitor::monitor_subscribe,
    monitor::{Subject, Topic},
};

use super::TaskService;
use crate::{container::Container, reaper};

/// How long the init's TaskExit waits for the exits of its exec processes. They die with the
/// init (the kernel kills a pid namespace's processes, the shim kills the others), so this
/// only bounds a lost exit.
const EXEC_EXITS_WAIT: Duration = Duration::from_secs(10);

impl TaskService {
    /// Routes every reaped exit of a container process to [`Self::process_exited`].
    pub(super) fn spawn_exit_loop(&self) {
        let svc = self.clone();
        tokio::spawn(async move {
            let mut sub = match monitor_subscribe(Topic::Pid).await {
                Ok(s) => s,
                Err(e) => {
                    tracing::error!(error = %e, "cannot subscribe to process exits");
                    return;
                }
            };
            while let Some(ev) = sub.rx.recv().await {
                let Subject::Pid(pid) = ev.subject else {
                    continue;
                };
                if let Some((key, exit)) = reaper::route_exit(pid, ev.exit_code) {
                    svc.spawn_exit(key.id, key.exec_id, exit);
                }
            }
        });
    }

    /// Handles an exit on a task of its own (the init's waits for its execs').
    pub(super) fn spawn_exit(&self, id: String, exec_id: String, exit: reaper::Exit) {
        let svc = self.clone();
        tokio::spawn(async move { svc.process_exited(&id, &exec_id, exit).await });
    }

    async fn process_exited(&self, id: &str, exec_id: &str, exit: reaper::Exit) {
        let Ok(c) = self.container(id) else { return };
        if exec_id.is_empty() {
            self.init_exited(&c, exit).await;
        } else {
            self.exec_exited(&c, exec_id, exit).await;
        }
    }

    /// Waits for the output copies of process `exec_id` (empty: the init) to write out all it printed, so that
    /// no client sees the exit (TaskExit, Wait) before the output; bounded by [`crate::io::OUTPUT_STALL`] once no
    /// more output flows.
    async fn drain_output(&self, c: &Container, exec_id: &str) {
        let Ok(output) = c
            .procs
            .lock()
            .await
            .get(&c.id, exec_id)
            .map(|p| p.output.clone())
        else {
            return;
        };
        output.process_exited();
        if !output.drained().await {
            tracing::warn!(
                id = %c.id,
                exec_id,
                bytes = output.bytes(),
                "output still open {:?} after the exit with nothing flowing (unread, or held by another process): exit published",
                crate::io::OUTPUT_STALL
            );
        }
    }

    async fn exec_exited(&self, c: &Container, exec_id: &str, exit: reaper::Exit) {
        let status = exit.code as u32;
        self.drain_output(c, exec_id).await;
        {
            // After TaskExecStarted, which is published under the gate.
            let _gate = c.event_gate.lock().await;
            let pid = {
                let procs = c.procs.lock().await;
                let Ok(p) = procs.get(&c.id, exec_id) else {
                    return;
                };
                if p.exit_info().is_some() {
                    return;
                }
                p.pid
            };
            self.shared
                .events
                .exit(&c.id, exec_id, pid, status, exit.at)
                .await;
        }
        if let Ok(p) = c.procs.lock().await.get_mut(&c.id, exec_id) {
            p.set_exited(status, exit.at);
        }
        c.running_execs.send_modify(|n| *n = n.saturating_sub(1));
    }

    async fn init_exited(&self, c: &Arc<Container>, exit: reaper::Exit) {
        let pid = {
            // After TaskStart, which is published under the gate.
            let _gate = c.event_gate.lock().await;
            let procs = c.procs.lock().await;
            if c.init_reaped.borrow().is_some() {
                return;
            }
            c.init_reaped.send_replace(Some(exit.code as u32));
            procs.init.pid
        };
        c.thaw_after_init_exit().await;
        c.kill_all_after_init_exit().await;
        let mut running = c.running_execs.subscribe();
        if tokio::time::timeout(EXEC_EXITS_WAIT, running.wait_for(|n| *n == 0))
            .await
            .is_err()
        {
            tracing::warn!(id = %c.id, "exec processes still running {EXEC_EXITS_WAIT:?} after the init exited");
        }
        self.drain_output(c, "").await;
        if c.oom.get().is_some_and(|w| w.check()) {
            tracing::info!(id = %c.id, "container OOM killed");
            self.shared.events.oom(&c.id).await;
        }
        let status = exit.code as u32;
        self.shared
            .events
            .exit(&c.id, &c.id, pid, status, exit.at)
            .await;
        c.procs.lock().await.init.set_exited(status, exit.at);
    }
}
