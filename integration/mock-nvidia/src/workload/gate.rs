//! The gate between the workload's main thread (training steps, signal-driven release / re-acquire) and
//! its restore thread: the process's CUDA state, whether the main thread is inside a CUDA call, and the
//! events the signal and stdin threads post. A lock closes the gate; the main thread then waits, issuing
//! no ioctl, until an unlock opens it (only a stop gets through a closed gate).

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::control::CudaState;

/// What the signal and stdin threads tell the main thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// SIGUSR1: release everything.
    Release,
    /// SIGUSR2: set everything up again.
    Reacquire,
    /// SIGTERM, SIGINT, or stdin closing under `--hold`.
    Stop,
}

/// What the main thread does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Handle this event (call [`Gate::done`] after).
    Event(Event),
    /// Run one step (call [`Gate::done`] after).
    Step,
}

#[derive(Debug)]
struct Inner {
    state: CudaState,
    /// A lock is waiting for the main thread to leave its CUDA call: start no new one.
    locking: bool,
    /// The main thread is inside CUDA calls (setup, a step, a signal-driven release or re-acquire).
    busy: bool,
    events: VecDeque<Event>,
}

/// Shared by the main, restore, signal and stdin threads.
#[derive(Debug)]
pub struct Gate {
    inner: Mutex<Inner>,
    changed: Condvar,
}

impl Default for Gate {
    fn default() -> Self {
        Self::new()
    }
}

impl Gate {
    /// A running process whose main thread is busy setting up (it calls [`Gate::done`] when set up).
    pub fn new() -> Self {
        Self {
            inner: Mutex::new(Inner {
                state: CudaState::Running,
                locking: false,
                busy: true,
                events: VecDeque::new(),
            }),
            changed: Condvar::new(),
        }
    }

    fn inner(&self) -> MutexGuard<'_, Inner> {
        // The state stays consistent even if a holder panicked: every update is a single assignment.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Posts `event` for the main thread.
    pub fn post(&self, event: Event) {
        self.inner().events.push_back(event);
        self.changed.notify_all();
    }

    /// Waits for the main thread's next piece of work: a stop at any time; other events, and a step
    /// when `want_step`, only while the process runs and no lock is pending. Marks the thread busy.
    pub fn next(&self, want_step: bool) -> Next {
        let mut inner = self.inner();
        loop {
            if inner.events.contains(&Event::Stop) {
                inner.busy = true;
                return Next::Event(Event::Stop);
            }
            if inner.state == CudaState::Running && !inner.locking {
                if let Some(event) = inner.events.pop_front() {
                    inner.busy = true;
                    return Next::Event(event);
                }
                if want_step {
                    inner.busy = true;
                    return Next::Step;
                }
            }
            inner = self
                .changed
                .wait(inner)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Waits until the process runs with no lock pending, as a CUDA call of a locked process waits for its
    /// unlock (cuda-checkpoint: "any CUDA calls made by the process will block"), then marks the main thread
    /// busy: a stop's last CUDA work (`--save-at-stop`) goes through here.
    pub fn wait_running(&self) {
        let mut inner = self.inner();
        while inner.state != CudaState::Running || inner.locking {
            inner = self
                .changed
                .wait(inner)
                .unwrap_or_else(PoisonError::into_inner);
        }
        inner.busy = true;
    }

    /// The main thread left its CUDA calls.
    pub fn done(&self) {
        self.inner().busy = false;
        self.changed.notify_all();
    }

    /// The CUDA state now.
    pub fn state(&self) -> CudaState {
        self.inner().state
    }

    /// Sets the CUDA state (the restore thread's transitions).
    pub fn set_state(&self, state: CudaState) {
        self.inner().state = state;
        self.changed.notify_all();
    }

    /// Locks a running process: closes the gate, then waits until the main thread is out of its CUDA
    /// calls and `delay` has passed. Gives up (and opens the gate again) after `timeout`, if any.
    pub fn lock(&self, delay: Duration, timeout: Option<Duration>) -> Result<(), LockError> {
        let mut inner = self.inner();
        if inner.state != CudaState::Running {
            return Err(LockError::NotRunning(inner.state));
        }
        inner.locking = true;
        let start = Instant::now();
        let ready_at = start + delay;
        let deadline = timeout.map(|timeout| start + timeout);
        loop {
            let now = Instant::now();
            if !inner.busy && now >= ready_at {
                inner.locking = false;
                inner.state = CudaState::Locked;
                self.changed.notify_all();
                return Ok(());
            }
            if deadline.is_some_and(|deadline| now >= deadline) {
                inner.locking = false;
                self.changed.notify_all();
                return Err(LockError::TimedOut);
            }
            let wake = if now < ready_at {
                Some(deadline.map_or(ready_at, |deadline| deadline.min(ready_at)))
            } else {
                deadline
            };
            inner = match wake {
                Some(wake) => {
                    self.changed
                        .wait_timeout(inner, wake.saturating_duration_since(now))
                        .unwrap_or_else(PoisonError::into_inner)
                        .0
                }
                None => self
                    .changed
                    .wait(inner)
                    .unwrap_or_else(PoisonError::into_inner),
            };
        }
    }
}

/// Why [`Gate::lock`] did not lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockError {
    /// The process was not running.
    NotRunning(CudaState),
    /// The main thread stayed in its CUDA calls (or the delay lasted) past the timeout.
    TimedOut,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_closed_gate_holds_steps_and_events_but_not_a_stop() {
        let gate = Gate::new();
        gate.done();
        gate.lock(Duration::ZERO, None)
            .expect("lock an idle process");
        assert_eq!(gate.state(), CudaState::Locked);
        gate.post(Event::Release);
        gate.post(Event::Stop);
        assert_eq!(gate.next(true), Next::Event(Event::Stop));
    }

    #[test]
    fn a_busy_main_thread_times_the_lock_out_and_reopens_the_gate() {
        let gate = Gate::new();
        assert_eq!(
            gate.lock(Duration::ZERO, Some(Duration::from_millis(1))),
            Err(LockError::TimedOut)
        );
        assert_eq!(gate.state(), CudaState::Running);
        gate.done();
        assert_eq!(gate.next(true), Next::Step);
    }

    #[test]
    fn only_a_running_process_locks() {
        let gate = Gate::new();
        gate.set_state(CudaState::Checkpointed);
        assert_eq!(
            gate.lock(Duration::ZERO, None),
            Err(LockError::NotRunning(CudaState::Checkpointed))
        );
    }
}
