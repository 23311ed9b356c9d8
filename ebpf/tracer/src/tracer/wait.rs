//! Waiting for the probes' records without periodic wakeups when nothing happens.
//!
//! Fd lifecycle and confirmation records wake this consumer at once. Ioctl records do not wake it each: while
//! they flow it drains them every `poll_interval`; when a drain finds the ring empty it sets the probes'
//! `CONSUMER` flag and waits with no timer, and the next ioctl record wakes it (clearing the flag). The only
//! other timer is the /proc check of removals still awaiting confirmation (see `crate::release`), armed only
//! while some do.
use std::time::Duration;

use super::{Tracer, TracerError};
use crate::{
    event::{self, Body, Event},
    release::ConfirmKind,
};

/// Most records returned in one batch.
const BATCH_CAP: usize = 4096;

impl Tracer {
    /// Waits for records and returns the next batch of events, applied to the mirror and the ledgers.
    /// Records that do not parse are skipped (logged at debug level).
    pub async fn next_events(&mut self) -> Result<Vec<Event>, TracerError> {
        loop {
            let timeout = self.next_timeout();
            let woke = match timeout {
                Some(t) => tokio::time::timeout(t, self.ring.readable_mut()).await.ok(),
                None => Some(self.ring.readable_mut().await),
            };
            let batch = match woke {
                Some(ready) => {
                    let mut guard = ready.map_err(TracerError::Poll)?;
                    let out = read_ring(guard.get_inner_mut(), &self.layout);
                    if out.is_empty() {
                        guard.clear_ready();
                    }
                    out
                }
                None => self.on_timer()?,
            };
            let batch = self.with_proc_confirmations(batch);
            if !batch.is_empty() {
                self.consumer_sleeping = false;
                let mut applied = self.apply_all(batch)?;
                applied.extend(self.resync_if_records_lost()?);
                if !applied.is_empty() {
                    return Ok(applied);
                }
            }
        }
    }

    /// Non-blocking: every event already in the ring buffer, applied.
    pub fn drain_now(&mut self) -> Result<Vec<Event>, TracerError> {
        let out = read_ring(self.ring.get_mut(), &self.layout);
        let out = self.with_proc_confirmations(out);
        self.apply_all(out)
    }

    /// How long to wait for the ring: the drain interval while records flow, the next /proc check, or
    /// forever.
    fn next_timeout(&self) -> Option<Duration> {
        let drain = (!self.consumer_sleeping).then_some(self.poll_interval);
        let check = self
            .releases
            .next_check_ns()
            .map(|due| Duration::from_nanos(due.saturating_sub(now_monotonic_ns())));
        match (drain, check) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// The timer fired: drain what did not wake us; when nothing did, tell the probes we sleep.
    fn on_timer(&mut self) -> Result<Vec<Event>, TracerError> {
        let out = read_ring(self.ring.get_mut(), &self.layout);
        if !out.is_empty() || self.consumer_sleeping {
            return Ok(out);
        }
        self.probes
            .consumer
            .set(0, 1, 0)
            .map_err(|e| TracerError::MapUpdate {
                map: "CONSUMER",
                pid: 0,
                detail: e.to_string(),
            })?;
        self.consumer_sleeping = true;
        // A record submitted between the drain and the flag did not wake us: look once more.
        Ok(read_ring(self.ring.get_mut(), &self.layout))
    }

    /// `batch` plus a confirmation event for each awaiting thread that /proc shows past its release.
    fn with_proc_confirmations(&mut self, mut batch: Vec<Event>) -> Vec<Event> {
        let now = now_monotonic_ns();
        if self.releases.next_check_ns().is_some_and(|due| due <= now) {
            for c in self.releases.check_proc(now) {
                batch.push(Event {
                    ts_ns: now,
                    cgroup_id: c.cgroup_id,
                    pid: c.pid,
                    tid: c.tid,
                    body: Body::Confirm {
                        kind: ConfirmKind::Proc,
                        marked_ns: c.marked_ns,
                    },
                });
            }
        }
        batch
    }
}

/// Parses the records now in the ring (at most [`BATCH_CAP`]).
pub(super) fn read_ring(
    ring: &mut aya::maps::RingBuf<aya::maps::MapData>,
    layout: &baton_nvidia::layout::Layout,
) -> Vec<Event> {
    let mut out = Vec::new();
    while let Some(item) = ring.next() {
        match event::parse(&item, layout) {
            Ok(e) => out.push(e),
            Err(e) => tracing::debug!("skipping record: {e}"),
        }
        if out.len() >= BATCH_CAP {
            break;
        }
    }
    out
}

/// CLOCK_MONOTONIC now, ns (the clock of the records' stamps).
pub fn now_monotonic_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map(|t| t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64)
        .unwrap_or(0)
}
