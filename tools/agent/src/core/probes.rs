//! The probe set's lifetime in the agent (loaded with the first user, its device directories followed
//! while used, dropped with the last), and its records: each batch turned into the watched containers'
//! transitions and the trace sessions' lines; a failed read loads it again.
use std::collections::{BTreeSet, HashMap, HashSet};

use baton_agent_api::{ContainerRef, Reply};
use baton_tracer::{
    Tracer, TracerConfig,
    event::{Body, Event as Record},
};

use super::Core;
use crate::{metrics::snapshot::IoctlCounts, registry::watched::Watched};

impl Core {
    /// Loads the probes on first use, and follows the device directory of the container's settings.
    pub(crate) fn load_tracer(&mut self, trace_prefix: &str) -> Result<(), String> {
        self.load_tracer_for(baton_agent_api::device_dir(trace_prefix))
    }

    /// Loads the probes on first use, and follows device directory `dir`.
    pub(super) fn load_tracer_for(&mut self, dir: &str) -> Result<(), String> {
        let dir = dir.to_owned();
        match self.tracer.as_mut() {
            None => {
                let t = Tracer::start(TracerConfig {
                    prefixes: vec![dir.clone()],
                    fd_quota: self.fd_quota,
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

    /// Drops the probes, keeping their counters for the metrics.
    fn retire_tracer(&mut self) -> bool {
        let Some(t) = self.tracer.take() else {
            return false;
        };
        self.retired = self.retired.with(Some(&t));
        true
    }

    /// Frees the probe set's device-directory slots (at most 4) that no watched container and no trace
    /// follows any more, so that containers come and go without using them up for the node.
    pub(crate) fn free_unused_prefixes(&mut self) {
        let in_use = self.prefixes_in_use();
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

    /// The device directories the watched containers and the trace sessions follow.
    fn prefixes_in_use(&self) -> BTreeSet<String> {
        self.watched
            .values()
            .map(|w| baton_agent_api::device_dir(&w.registration.settings.trace_prefix).to_owned())
            .chain(
                self.traces
                    .values()
                    .flat_map(|s| s.prefixes.iter().cloned()),
            )
            .collect()
    }

    /// Drops (detaches) the probes when no container is watched and no trace runs.
    pub(crate) fn drop_tracer_if_unused(&mut self) {
        if self.watched.is_empty() && self.traces.is_empty() && self.retire_tracer() {
            tracing::info!("agent: probes detached (no watched container or trace left)");
        }
    }

    /// Takes a read of the probes: the records go to the containers and the trace sessions; a failed read
    /// loads the probes again.
    pub(super) fn on_batch(&mut self, batch: Result<Vec<Record>, baton_tracer::TracerError>) {
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
    /// fds and mappings re-read from /proc); one that cannot be is dropped with an error in the log, and
    /// its shim is told (`watch_lost`), which registers it again.
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
                    "agent: container no longer watched after the probes failed: {e}; its shim is told \
                     and registers it again"
                );
                let error = format!("the agent could not watch the container again: {e}");
                self.publish(&c, w.owner, baton_agent_api::EventBody::WatchLost { error });
            }
        }
    }

    /// Turns a batch of records into the containers' transitions. Only the containers the batch concerns are
    /// looked at (one pass over the records, not one per watched container), all of them after a resync.
    pub(crate) fn apply(&mut self, records: &[Record]) {
        IoctlCounts::count(&mut self.ioctls, records);
        let Some(tracer) = self.tracer.as_mut() else {
            return;
        };
        let mut out = Vec::new();
        for cgroup_id in touched_cgroups(records, &self.by_cgroup) {
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
        self.log_new_fd_quotas();
        if self.watched.values().any(Watched::awaits_hidden_holders) {
            self.schedule_recheck();
        }
    }

    /// Logs each watched container that reached its quota of the probes' fd map since the last look.
    pub(crate) fn log_new_fd_quotas(&mut self) {
        let Some(tracer) = self.tracer.as_mut() else {
            return;
        };
        let quota = tracer.fd_quota();
        for cg in tracer.newly_over_fd_quota() {
            let Some(c) = self.by_cgroup.get(&cg) else {
                continue;
            };
            tracing::warn!(
                id = c.id,
                namespace = c.namespace,
                "agent: container {} has {quota} NVIDIA fds followed by the probes (its quota, \
                 --probe-fd-quota): its further NVIDIA fds are followed through /proc only, and the gate \
                 judges it by /proc (and NVML) as an unwatched process",
                c.id
            );
        }
    }
}

/// The cgroups a batch of records concerns: every watched one after a resync (`by_cgroup`'s keys), else
/// those the records name (one pass over the records, not one per watched container).
fn touched_cgroups(records: &[Record], by_cgroup: &HashMap<u64, ContainerRef>) -> Vec<u64> {
    let resynced = records
        .iter()
        .any(|r| matches!(r.body, Body::Resync { .. }));
    if resynced {
        by_cgroup.keys().copied().collect()
    } else {
        let set: HashSet<u64> = records.iter().map(|r| r.cgroup_id).collect();
        set.into_iter().collect()
    }
}

#[cfg(test)]
mod tests {
    use baton_tracer::now_monotonic_ns;
    use tokio::sync::{broadcast, mpsc, oneshot};

    use super::*;
    use crate::{control, gate::Waiter, holders::Exempt};

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
            clear_since_ns: None,
            devices: Default::default(),
            need: None,
            asked_ns: now_monotonic_ns(),
            deadline: tokio::time::Instant::now() + std::time::Duration::from_secs(60),
            reply,
            unparkable: Default::default(),
            floor: None,
            floor_logged: false,
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
}
