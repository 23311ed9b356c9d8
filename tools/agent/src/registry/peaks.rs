//! The ledger's peak of video memory per container name and namespace, remembered past each container's end
//! (`baton status` shows it, so that a user can set `baton.io/gpu-memory` from what was measured). A name is
//! the container's name in its pod spec under Kubernetes (a Deployment's pods differ, their containers' names
//! do not), else its containerd id. At most [`MAX_NAMES`] names are kept: the one seen longest ago goes first.
use std::collections::BTreeMap;

use baton_agent_api::room::PeakMemory;

use super::watched::Watched;

/// The most names remembered.
pub const MAX_NAMES: usize = 4096;

/// What is remembered of one name.
#[derive(Clone, Copy, Debug, Default)]
struct Seen {
    peak_bytes: u64,
    containers: u64,
    /// When it was last recorded (a counter).
    last: u64,
}

/// The peaks by (namespace, name).
#[derive(Debug, Default)]
pub struct Peaks {
    names: BTreeMap<(String, String), Seen>,
    clock: u64,
}

/// The (namespace, name) that container `w` counts under.
pub fn name_of(w: &Watched) -> (String, String) {
    let c = &w.registration.container;
    match w.registration.kubernetes.as_deref() {
        Some(k) => (
            k.namespace.clone().unwrap_or_else(|| "default".to_owned()),
            k.container.clone().unwrap_or_else(|| c.id.clone()),
        ),
        None => (c.namespace.clone(), c.id.clone()),
    }
}

impl Peaks {
    /// A container of `name` ended with `peak_bytes` as its ledger's peak.
    pub fn ended(&mut self, name: (String, String), peak_bytes: u64) {
        self.clock += 1;
        if !self.names.contains_key(&name) && self.names.len() >= MAX_NAMES {
            let oldest = self
                .names
                .iter()
                .min_by_key(|(_, s)| s.last)
                .map(|(k, _)| k.clone());
            if let Some(k) = oldest {
                self.names.remove(&k);
            }
        }
        let seen = self.names.entry(name).or_default();
        seen.peak_bytes = seen.peak_bytes.max(peak_bytes);
        seen.containers += 1;
        seen.last = self.clock;
    }

    /// The peaks, with the live containers' (`live`: each one's name and ledger peak so far) counted in.
    pub fn list(&self, live: impl IntoIterator<Item = ((String, String), u64)>) -> Vec<PeakMemory> {
        let mut all: BTreeMap<(String, String), (u64, u64)> = self
            .names
            .iter()
            .map(|(k, s)| (k.clone(), (s.peak_bytes, s.containers)))
            .collect();
        for (name, peak) in live {
            let e = all.entry(name).or_default();
            e.0 = e.0.max(peak);
            e.1 += 1;
        }
        all.into_iter()
            .map(|((namespace, name), (peak_bytes, containers))| PeakMemory {
                namespace,
                name,
                peak_bytes,
                containers,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn n(ns: &str, name: &str) -> (String, String) {
        (ns.to_owned(), name.to_owned())
    }

    #[test]
    fn a_name_keeps_its_highest_peak_over_its_containers_ended_and_live() {
        let mut p = Peaks::default();
        p.ended(n("ml", "vllm"), 20 << 30);
        p.ended(n("ml", "vllm"), 18 << 30);
        let list = p.list([(n("ml", "vllm"), 22 << 30), (n("ml", "trainer"), 60 << 30)]);
        assert_eq!(
            list,
            vec![
                PeakMemory {
                    namespace: "ml".into(),
                    name: "trainer".into(),
                    peak_bytes: 60 << 30,
                    containers: 1,
                },
                PeakMemory {
                    namespace: "ml".into(),
                    name: "vllm".into(),
                    peak_bytes: 22 << 30,
                    containers: 3,
                },
            ]
        );
    }

    #[test]
    fn past_the_bound_the_name_seen_longest_ago_goes() {
        let mut p = Peaks::default();
        for i in 0..MAX_NAMES {
            p.ended(n("ns", &format!("c{i}")), 1);
        }
        p.ended(n("ns", "c0"), 2);
        p.ended(n("ns", "new"), 3);
        let list = p.list([]);
        assert_eq!(list.len(), MAX_NAMES);
        assert!(list.iter().any(|x| x.name == "c0" && x.peak_bytes == 2));
        assert!(
            !list.iter().any(|x| x.name == "c1"),
            "c1 was seen longest ago"
        );
    }
}
