//! Which of the unwatched processes /proc shows holding a GPU's device files use that GPU. The node's own
//! daemons in pods (dcgm-exporter, the device plugin, any NVML user) keep /dev/nvidiactl and /dev/nvidiaN
//! open with no CUDA context and no device memory: counted by their files, they would keep every gate of the
//! node shut. NVML lists the processes that have a context or device memory on a GPU, so where the node has
//! NVML, an unwatched holder counts only when NVML lists it; where NVML cannot tell (no library, no driver,
//! an error, no answer yet), its files count (the gate fails closed). Watched containers are judged by the
//! ledger, as before.
//!
//! NVML is asked on a blocking thread (on the H200 a query took 7 ms), never on the core's: a gate check with
//! unwatched holders and no fresh answer keeps the gate shut and asks; the answer checks the gates again.
//! An answer is fresh for [`FRESH_NS`] after it was asked: a process that allocated after it is seen at the
//! next answer.
use std::collections::BTreeSet;

use crate::holders::Holding;

/// How long an answer of NVML's stands for the gate, from when it was asked.
pub const FRESH_NS: u64 = 100_000_000;
/// How long a question may go unanswered before it is asked again (a hung NVML keeps the gates closed on
/// files alone meanwhile).
const ASK_AGAIN_NS: u64 = 2_000_000_000;

/// NVML's latest answer and the question in flight.
#[derive(Debug, Default)]
pub struct GpuUsers {
    /// When the latest answer was asked, and the pids it listed (`None`: NVML could not tell).
    latest: Option<(u64, Option<BTreeSet<u32>>)>,
    /// When the question in flight was asked.
    asked_ns: Option<u64>,
}

impl GpuUsers {
    /// The holders of `hidden` that use their GPU at `now_ns` by NVML's fresh answer (all of them without
    /// one), and whether NVML is to be asked.
    pub fn using(&self, hidden: Vec<Holding>, now_ns: u64) -> (Vec<Holding>, bool) {
        if hidden.is_empty() {
            return (hidden, false);
        }
        match &self.latest {
            Some((asked, users)) if now_ns.saturating_sub(*asked) <= FRESH_NS => match users {
                Some(users) => (
                    hidden
                        .into_iter()
                        .filter(|h| users.contains(&h.pid))
                        .collect(),
                    false,
                ),
                None => (hidden, false),
            },
            _ => (hidden, true),
        }
    }

    /// Whether to ask NVML now (no question in flight, or one long unanswered); notes the question.
    pub fn ask(&mut self, now_ns: u64) -> bool {
        if self
            .asked_ns
            .is_some_and(|t| now_ns.saturating_sub(t) < ASK_AGAIN_NS)
        {
            return false;
        }
        self.asked_ns = Some(now_ns);
        true
    }

    /// NVML answered the question asked at `asked_ns`.
    pub fn answered(&mut self, asked_ns: u64, users: Option<BTreeSet<u32>>) {
        if self.asked_ns == Some(asked_ns) {
            self.asked_ns = None;
        }
        if self.latest.as_ref().is_none_or(|(t, _)| *t <= asked_ns) {
            self.latest = Some((asked_ns, users));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{gate::DeviceKey, holders::Via};
    use baton_nvidia::fdkind::FdKind;

    fn holding(pid: u32) -> Holding {
        Holding {
            pid,
            kind: FdKind::Device,
            key: DeviceKey::Number(195, 0),
            via: Via::Fd(3),
        }
    }

    #[test]
    fn files_count_until_nvml_answers_and_then_only_its_users() {
        let mut u = GpuUsers::default();
        let hidden = || vec![holding(10), holding(20)];
        let (kept, ask) = u.using(hidden(), 1_000);
        assert_eq!((kept.len(), ask), (2, true), "no answer yet: files count");
        assert!(u.ask(1_000));
        assert!(!u.ask(2_000), "one question at a time");
        u.answered(1_000, Some([20].into()));
        let (kept, ask) = u.using(hidden(), 5_000);
        assert_eq!(
            (kept.iter().map(|h| h.pid).collect::<Vec<_>>(), ask),
            (vec![20], false)
        );
        let (kept, ask) = u.using(hidden(), 1_000 + FRESH_NS + 1);
        assert_eq!((kept.len(), ask), (2, true), "a stale answer: asked again");
        u.answered(3_000_000_000, None);
        let (kept, ask) = u.using(hidden(), 3_000_000_001);
        assert_eq!(
            (kept.len(), ask),
            (2, false),
            "NVML cannot tell: files count"
        );
        assert!(u.using(Vec::new(), 1).0.is_empty());
    }
}
