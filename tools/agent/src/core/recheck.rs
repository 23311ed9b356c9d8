//! Looking at /proc again, with a growing delay, while a release or a gate waits for a holder the probes
//! cannot see (a file passed over a socket, a mapping kept after its fd was closed).
use super::Core;
use crate::registry::watched::Watched;

/// The first delay before /proc is read again for a hidden holder, and the longest.
pub(super) const RECHECK_FIRST: std::time::Duration = std::time::Duration::from_millis(5);
const RECHECK_MAX: std::time::Duration = std::time::Duration::from_millis(200);

impl Core {
    /// Looks at /proc again in a while: a release or a gate waits for a holder the probes cannot see.
    pub(crate) fn schedule_recheck(&mut self) {
        if self.recheck_due.is_none() {
            self.recheck_due = Some(tokio::time::Instant::now() + self.recheck_every);
            self.recheck_every = (self.recheck_every * 2).min(RECHECK_MAX);
        }
    }

    /// The look at /proc [`Core::schedule_recheck`] asked for: the releases that wait for hidden holders,
    /// then the gates.
    pub(super) fn recheck(&mut self) {
        self.recheck_due = None;
        // The records still in the ring first: /proc is compared with everything the probes saw.
        if let Some(tracer) = self.tracer.as_mut() {
            match tracer.drain_now() {
                Ok(records) if records.is_empty() => {}
                other => self.on_batch(other),
            }
        }
        let mut out = Vec::new();
        if let Some(tracer) = self.tracer.as_mut() {
            for (c, w) in self
                .watched
                .iter_mut()
                .filter(|(_, w)| w.awaits_hidden_holders())
            {
                for body in w.update_after_drain(tracer, &self.classifier) {
                    out.push((c.clone(), w.owner, body));
                }
            }
        }
        for (c, owner, body) in out {
            self.publish(&c, owner, body);
        }
        // A Start NVML keeps waiting (memory still used, or too little free) needs a newer reading.
        if self.waiters.iter().any(|w| {
            w.floor
                .as_ref()
                .is_some_and(|h| *h != crate::gate::floor::Hold::Unread)
        }) {
            self.ask_floor();
        }
        self.check_gates();
        self.rescan_for_gates();
        if self.watched.values().any(Watched::awaits_hidden_holders) {
            self.schedule_recheck();
        }
        if self.recheck_due.is_none() {
            self.recheck_every = RECHECK_FIRST;
        }
    }
}
