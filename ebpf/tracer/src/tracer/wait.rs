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
            let check_due = self.releases.next_check_ns();
            self.arm_check_timer(check_due)?;
            let drain = (!self.consumer_sleeping).then_some(self.poll_interval);
            let (records, from_ring) = tokio::select! {
                ready = self.ring.readable_mut() => {
                    let mut guard = ready.map_err(TracerError::Poll)?;
                    let out = read_ring(guard.get_inner_mut(), &self.layout);
                    if out.is_empty() {
                        guard.clear_ready();
                    }
                    (out, true)
                }
                _ = sleep_or_never(drain) => (self.on_timer()?, true),
                ready = self.check_timer.readable(), if check_due.is_some() => {
                    let mut guard = ready.map_err(TracerError::Poll)?;
                    // Reading the expiry count clears it; the timer is armed again above.
                    let _ = guard.get_inner().0.wait();
                    guard.clear_ready();
                    self.check_armed_for = None;
                    (Vec::new(), false)
                }
            };
            if from_ring && !records.is_empty() {
                self.consumer_sleeping = false;
            }
            let batch = self.with_proc_confirmations(records);
            if !batch.is_empty() {
                let mut applied = self.apply_all(batch)?;
                applied.extend(self.resync_if_records_lost()?);
                if !applied.is_empty() {
                    return Ok(applied);
                }
            }
        }
    }

    /// Arms the /proc-check timer for `due` (CLOCK_MONOTONIC ns), or disarms it. A timerfd, not a tokio
    /// timer: those tick in milliseconds, and the first check comes a tenth of one after a removal.
    /// Only a change of the deadline costs a syscall.
    fn arm_check_timer(&mut self, due: Option<u64>) -> Result<(), TracerError> {
        if due == self.check_armed_for {
            return Ok(());
        }
        use nix::sys::{
            time::TimeSpec,
            timerfd::{Expiration, TimerSetTimeFlags},
        };
        let timer = &self.check_timer.get_ref().0;
        let result = match due {
            Some(ns) => timer.set(
                Expiration::OneShot(TimeSpec::from_duration(Duration::from_nanos(ns.max(1)))),
                TimerSetTimeFlags::TFD_TIMER_ABSTIME,
            ),
            None => timer.unset(),
        };
        result.map_err(|e| TracerError::Poll(e.into()))?;
        self.check_armed_for = due;
        Ok(())
    }

    /// Non-blocking: every event already in the ring buffer, applied.
    pub fn drain_now(&mut self) -> Result<Vec<Event>, TracerError> {
        let out = read_ring(self.ring.get_mut(), &self.layout);
        let out = self.with_proc_confirmations(out);
        self.apply_all(out)
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

/// The timerfd of the /proc checks, as tokio's `AsyncFd` needs it.
pub struct CheckTimer(pub nix::sys::timerfd::TimerFd);

impl std::os::fd::AsRawFd for CheckTimer {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        std::os::fd::AsFd::as_fd(&self.0).as_raw_fd()
    }
}

impl CheckTimer {
    /// A disarmed CLOCK_MONOTONIC timerfd registered with the runtime (call inside one).
    pub fn new() -> std::io::Result<tokio::io::unix::AsyncFd<Self>> {
        use nix::sys::timerfd::{ClockId, TimerFd, TimerFlags};
        let fd = TimerFd::new(
            ClockId::CLOCK_MONOTONIC,
            TimerFlags::TFD_NONBLOCK | TimerFlags::TFD_CLOEXEC,
        )?;
        // SAFETY: `CheckTimer` owns the timerfd, which stays open and unchanged until it (and so the AsyncFd
        // holding it) is dropped.
        unsafe { tokio::io::unix::AsyncFd::register(Self(fd)) }.map_err(|e| e.into_parts().1)
    }
}

/// Sleeps for `d`, or forever when there is none.
async fn sleep_or_never(d: Option<Duration>) {
    match d {
        Some(d) => tokio::time::sleep(d).await,
        None => std::future::pending().await,
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
