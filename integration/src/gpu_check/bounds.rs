//! How long each thing the kit waits for may take. A GPU session has little device time, so nothing waits
//! without a bound: a program that does not start, a checkpoint call that does not return, a release that
//! never comes, each ends its wait, is recorded as a failure with what was seen, and the run goes on. With
//! `--time-limit` every bound also ends by the run's own deadline, and the parts not reached by then are
//! recorded as not run.
use std::time::{Duration, Instant};

/// The bounds of one run.
#[derive(Clone, Debug)]
pub struct Bounds {
    /// A PyTorch program's start (import, CUDA initialisation, allocation, checksum) up to its ready line.
    pub program_ready: Duration,
    /// One checkpoint call (lock, checkpoint, restore or unlock), the program's or the helper's.
    pub call: Duration,
    /// What a lock waits for in-flight work before it fails (the program's `--timeout`, the helper's
    /// `lock_timeout_ms`): CRIU's CUDA plugin's default.
    pub lock_timeout: Duration,
    /// After the checkpoint call returned: how long `released` (and the gate) may still take before the
    /// release counts as missing. The goal is 100 ms; this only tells "late" from "never".
    pub release: Duration,
    /// A program's exit once its stdin closed, and `baton trace`'s end.
    pub exit: Duration,
    /// A short external command (`nvidia-smi`).
    pub command: Duration,
    deadline: Option<Instant>,
}

impl Bounds {
    /// The bounds of a full run, or of a `--quick` one; `time_limit` ends every wait by then.
    pub fn new(quick: bool, time_limit: Option<Duration>) -> Self {
        let deadline = time_limit.map(|l| Instant::now() + l);
        if quick {
            Self {
                program_ready: Duration::from_secs(120),
                call: Duration::from_secs(60),
                lock_timeout: Duration::from_secs(10),
                release: Duration::from_secs(5),
                exit: Duration::from_secs(20),
                command: Duration::from_secs(20),
                deadline,
            }
        } else {
            Self {
                program_ready: Duration::from_secs(300),
                // The H200 took 10.3 s to checkpoint 24.6 GiB (/work/shared/gpu/580.159.04/README.md).
                call: Duration::from_secs(180),
                lock_timeout: Duration::from_secs(10),
                release: Duration::from_secs(10),
                exit: Duration::from_secs(30),
                command: Duration::from_secs(30),
                deadline,
            }
        }
    }

    /// `bound`, cut short where the run's deadline comes first.
    pub fn within(&self, bound: Duration) -> Duration {
        match self.deadline {
            Some(d) => bound.min(d.saturating_duration_since(Instant::now())),
            None => bound,
        }
    }

    /// Whether the run's deadline has passed: what is left is not run.
    pub fn expired(&self) -> bool {
        self.deadline.is_some_and(|d| Instant::now() >= d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_time_limit_cuts_every_bound_and_expires() {
        let unlimited = Bounds::new(true, None);
        assert_eq!(
            unlimited.within(Duration::from_secs(60)),
            Duration::from_secs(60)
        );
        assert!(!unlimited.expired());
        let spent = Bounds::new(false, Some(Duration::ZERO));
        assert_eq!(spent.within(Duration::from_secs(60)), Duration::ZERO);
        assert!(spent.expired());
        let some = Bounds::new(false, Some(Duration::from_secs(30)));
        assert!(some.within(Duration::from_secs(60)) <= Duration::from_secs(30));
        assert_eq!(some.within(Duration::from_secs(1)), Duration::from_secs(1));
    }
}
