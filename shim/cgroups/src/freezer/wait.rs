//! How a freeze or thaw waits for the kernel's confirmation: re-reads between `sched_yield`s for a short inline
//! budget (a sleeping task freezes within tens of microseconds, and yielding lets it run on this CPU), then
//! sleeps between re-reads, woken early by a `cgroup.events` notification in v2. The async waiter never holds
//! its thread for longer than the inline budget and a read.
use std::time::Duration;

use tokio::io::{Interest, unix::AsyncFd};

use super::v2::V2;

/// Re-reads between `sched_yield`s for this long after the write.
pub(super) const INLINE_BUDGET: Duration = Duration::from_micros(300);

/// The pause before the next re-read once the inline budget is spent.
#[derive(Debug)]
pub(super) struct Backoff {
    next: Duration,
    max: Duration,
}

impl Backoff {
    /// Blocking waiters sleep with microsecond resolution: start short.
    pub(super) fn blocking() -> Self {
        Self {
            next: Duration::from_micros(50),
            max: Duration::from_millis(2),
        }
    }

    /// tokio's timers have millisecond resolution; v2 notifications usually come first. At most 5 ms between
    /// re-reads, less than the 10 ms that the kernel's rate limit can hold a notification back.
    pub(super) fn asynchronous() -> Self {
        Self {
            next: Duration::from_millis(1),
            max: Duration::from_millis(5),
        }
    }

    /// The next pause (doubling up to the maximum), at most `left`.
    pub(super) fn step(&mut self, left: Duration) -> Duration {
        let wait = self.next.min(left);
        self.next = (self.next * 2).min(self.max);
        wait
    }
}

/// Gives this CPU to whatever else is runnable (the tasks being frozen, often).
pub(super) fn yield_cpu() {
    // sched_yield cannot fail on Linux.
    let _ = nix::sched::sched_yield();
}

/// The events file of a v2 cgroup registered with tokio's reactor for priority (EPOLLPRI) readiness. `None`
/// where it cannot be registered (a regular file in a test fixture): then the waiter only re-reads on its timer.
pub(super) fn notifier(v2: &V2) -> Option<AsyncFd<std::os::fd::OwnedFd>> {
    use std::os::fd::AsFd;
    // A duplicate of the open file: each waiter registers its own descriptor, so concurrent waits do not clash.
    let fd = v2.events().file().as_fd().try_clone_to_owned().ok()?;
    // SAFETY: the AsyncFd owns `fd` (an OwnedFd), which stays open and names the same open file until the AsyncFd
    // is dropped, and OwnedFd::as_raw_fd always returns that descriptor.
    unsafe { AsyncFd::register_with_interest(fd, Interest::PRIORITY) }.ok()
}

/// Waits for a notification on `notifier` or for `wait`, whichever comes first.
pub(super) async fn wait_async(notifier: Option<&AsyncFd<std::os::fd::OwnedFd>>, wait: Duration) {
    match notifier {
        Some(fd) => {
            if let Ok(Ok(mut guard)) =
                tokio::time::timeout(wait, fd.ready(Interest::PRIORITY)).await
            {
                // The re-read that follows consumes the event; the next one needs a fresh notification.
                guard.clear_ready();
            }
        }
        None => tokio::time::sleep(wait).await,
    }
}
