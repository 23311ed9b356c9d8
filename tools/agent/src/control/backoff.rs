//! Backing off a co-runner's link after errors. A shim that cannot be reached (its socket gone, the shim
//! dead or wedged) would otherwise be asked again at once after every failure: a busy loop for as long as the
//! controller wants a change, forever under `duty`, with a warning each turn. After a failure the next
//! attempt waits, doubling from [`FIRST_NS`] up to [`CAP_NS`]; the first failure of a streak is worth a
//! warning, the others a debug line, and the first success after a streak a recovery line.
//!
//! A freeze the shim answers "not frozen" (the hold lapsed while the agent was stalled, an exec or a kill
//! ended it, or the shim refuses holds while an exec starts or the container stops) is no failure: the
//! controller takes the hold again once the same wait is over, quietly.

/// The wait after the first failure of a streak.
pub const FIRST_NS: u64 = 20_000_000;
/// The longest wait between two attempts.
pub const CAP_NS: u64 = 1_000_000_000;

/// One link's streak of failures.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Backoff {
    failures: u32,
    declines: u32,
    retry_at_ns: u64,
}

impl Backoff {
    /// An attempt failed at `now_ns`: the next waits. Returns whether it is the first of a streak (warn).
    pub fn failed(&mut self, now_ns: u64) -> bool {
        self.failures = self.failures.saturating_add(1);
        self.retry_at_ns = now_ns.saturating_add(wait(self.failures));
        self.failures == 1
    }

    /// The shim answered but did not freeze, at `now_ns`: a streak of failures ends (returned as by
    /// [`Self::succeeded`]: the shim answers again) and the next freeze waits, doubling like failures.
    pub fn declined(&mut self, now_ns: u64) -> u32 {
        self.declines = self.declines.saturating_add(1);
        self.retry_at_ns = now_ns.saturating_add(wait(self.declines));
        std::mem::take(&mut self.failures)
    }

    /// An attempt succeeded: the streak ends. Returns how many failures it had (0: none).
    pub fn succeeded(&mut self) -> u32 {
        std::mem::take(self).failures
    }

    /// When the next attempt may be made, if that is after `now_ns`.
    pub fn holds_until(&self, now_ns: u64) -> Option<u64> {
        (self.retry_at_ns > now_ns).then_some(self.retry_at_ns)
    }
}

/// The wait after the `n`th failure (or decline) of a streak.
fn wait(n: u32) -> u64 {
    FIRST_NS
        .saturating_mul(1u64 << n.saturating_sub(1).min(32))
        .min(CAP_NS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_double_up_to_the_cap_and_a_success_ends_the_streak() {
        let mut b = Backoff::default();
        assert_eq!(b.holds_until(0), None);
        assert!(b.failed(0), "the first failure of a streak warns");
        assert_eq!(b.holds_until(0), Some(FIRST_NS));
        assert_eq!(b.holds_until(FIRST_NS), None);
        assert!(!b.failed(FIRST_NS), "the others do not");
        assert_eq!(b.holds_until(FIRST_NS), Some(3 * FIRST_NS));
        for _ in 0..40 {
            b.failed(1_000);
        }
        assert_eq!(b.holds_until(1_000), Some(1_000 + CAP_NS));
        assert_eq!(b.succeeded(), 42);
        assert_eq!(b.holds_until(0), None);
        assert_eq!(b.succeeded(), 0);
        assert!(b.failed(5), "a new streak warns again");
    }

    #[test]
    fn a_second_of_failures_makes_a_bounded_number_of_attempts() {
        let mut b = Backoff::default();
        let (mut now, mut attempts) = (0, 0);
        while now < 10 * CAP_NS {
            attempts += 1;
            b.failed(now);
            now = b.holds_until(now).unwrap_or(now);
        }
        // 20, 40, ... 640 ms, then one a second.
        assert!(attempts <= 16, "{attempts} attempts in 10 s");
    }

    #[test]
    fn declines_wait_like_failures_and_are_not_counted_as_failures() {
        let mut b = Backoff::default();
        assert_eq!(b.declined(0), 0);
        assert_eq!(b.holds_until(0), Some(FIRST_NS));
        assert_eq!(b.declined(FIRST_NS), 0);
        assert_eq!(b.holds_until(FIRST_NS), Some(3 * FIRST_NS));
        assert!(
            b.failed(0),
            "a decline is not a failure: the first failure still warns"
        );
        assert_eq!(b.succeeded(), 1);
        assert_eq!(
            b.holds_until(0),
            None,
            "a frozen answer ends the declines too"
        );
    }
}
