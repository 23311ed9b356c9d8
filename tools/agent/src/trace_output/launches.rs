//! The launch lines of `baton trace`: every interval, each traced container's CUDA launches since the
//! previous interval (the deltas of the tracer's cumulative counters), only while it launches.
use std::collections::{HashMap, HashSet};

use baton_tracer::{LaunchCounts, Tracer};

/// The counters as last read, per container.
#[derive(Default)]
pub struct LaunchMeter {
    last: HashMap<u64, LaunchCounts>,
}

impl LaunchMeter {
    /// The containers that launched since the last call, with what they launched: the cgroups of `only`,
    /// or every container the probes count (`--all`) when it is `None`. A standalone trace's probe set
    /// counts from its start, so the first reading is all new.
    pub fn tick(
        &mut self,
        tracer: &Tracer,
        only: Option<&HashSet<u64>>,
    ) -> Vec<(u64, LaunchCounts)> {
        let now: Vec<(u64, LaunchCounts)> = match only {
            Some(ids) => ids.iter().map(|id| (*id, tracer.launches(*id))).collect(),
            None => tracer.all_launches(),
        };
        let mut out = Vec::new();
        for (id, counts) in now {
            let last = self.last.insert(id, counts).unwrap_or_default();
            let delta = counts.since(&last);
            if delta.total() > 0 {
                out.push((id, delta));
            }
        }
        out.sort_unstable_by_key(|(id, _)| *id);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_restarted_counter_counts_from_zero() {
        let before = LaunchCounts {
            kernel: 10,
            kernel_ex: 5,
            graph: 1,
        };
        let after = LaunchCounts {
            kernel: 3,
            kernel_ex: 7,
            graph: 1,
        };
        assert_eq!(
            after.since(&before),
            LaunchCounts {
                kernel: 3,
                kernel_ex: 2,
                graph: 0
            }
        );
    }
}
