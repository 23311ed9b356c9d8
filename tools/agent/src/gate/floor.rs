//! NVML as the gate's floor. The ledgers count what the probes read of each container's driver calls, and
//! some of that is in memory the tenant can rewrite (`baton_tracer::ledger::readings`): a thread that
//! rewrites a call's params both before the driver's copy-in and after its copy-out, or a process the gate
//! does not see (outside every container), holds GPU memory no ledger counts. NVML's device memory is the
//! driver's own word, so where the node has NVML:
//! - a Start goes through on room only when a reading asked after it came leaves its need on each of its GPUs:
//!   NVML's free memory less the headroom less the needs of the Starts let through that have not allocated
//!   yet (the room the gate uses is never more than that). Gap-fill still plans its parks by the ledgers'
//!   room: NVML cannot say whose memory it sees, and parking a co-runner for memory a stranger holds frees
//!   nothing;
//! - a Start that waits for the whole GPU is let through only once a reading asked after its holders went
//!   shows the GPU's used memory back to its idle baseline plus the tolerance (`--nvml-tolerance-mib`). The
//!   baseline is the least used memory NVML showed while no watched container held the GPU (the driver's
//!   own reservation and the node's daemons): measured from the agent's first reading on, lowered by later
//!   ones, never raised;
//! - used memory past the baseline and every holder's ledger by more than the tolerance, in two readings in
//!   a row, is a disagreement: counted (`baton_nvml_disagreements_total`, and the bytes in
//!   `baton_gpu_memory_unaccounted_bytes`) and logged once, naming the containers that hold the GPU.
//!
//! NVML is asked on the blocking pool ([`crate::nvml::ask_memory`]; a query took 7 ms on the H200), never
//! on the core's thread, one question at a time: when a gate needs a newer reading, after each release, at
//! the core's start and once a second while a container holds a GPU (with the reconcile). `released` is
//! never delayed by it; a Start is, by one reading, and by the question NVML is answering when it is asked
//! (after a release, the cross-check's): about 1 ms with a fast NVML, 57 ms with one that takes 7 ms a call
//! (README, Benchmarks: the handoff bench with the floor on and off). Where NVML is not there (no library, no driver: CI), or with `--nvml-floor false`, the gate
//! decides on the ledgers alone, as before.
use std::collections::{BTreeMap, BTreeSet};

use baton_agent_api::room::show_bytes;
use baton_nvidia::fdkind::FdKind;
use baton_tracer::now_monotonic_ns;

use super::{DeviceKey, Waiter, room::minor_of};
use crate::core::Core;

/// How far NVML's used memory may be above a GPU's idle baseline, and past the ledgers, by default (MiB): a
/// forked DataLoader worker left 4 MiB used after its parent's park on the H200
/// (/work/shared/gpu/580.159.04/README.md), where the ledger's peak matched NVML's exactly.
pub const DEFAULT_TOLERANCE_MIB: u64 = 64;

/// How long a question may go unanswered before it is asked again (the gate stays shut meanwhile).
const ASK_AGAIN_NS: u64 = 2_000_000_000;

/// One GPU's memory as NVML reported it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Memory {
    /// Its memory.
    pub total: u64,
    /// Used by anyone (processes, the driver's reservation).
    pub used: u64,
}

impl Memory {
    /// What is free.
    pub fn free(&self) -> u64 {
        self.total.saturating_sub(self.used)
    }
}

/// A reading: when it was asked and what NVML said, by minor.
#[derive(Clone, Debug, Default)]
struct Reading {
    asked_ns: u64,
    by_minor: BTreeMap<u32, Memory>,
}

/// Why the floor keeps a Start waiting.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Hold {
    /// No reading asked after `since` yet: NVML is to be asked.
    Unread,
    /// NVML's answer had no memory of the GPU.
    Unreadable {
        /// The GPU's minor.
        minor: u32,
    },
    /// NVML shows less free on the GPU (less the headroom and the Starts let through) than the Start needs.
    Short {
        /// The GPU's minor.
        minor: u32,
        /// The Start's need.
        need: u64,
        /// What NVML leaves for it.
        free: u64,
    },
    /// NVML shows the GPU used past its idle baseline and the tolerance.
    Busy {
        /// The GPU's minor.
        minor: u32,
        /// NVML's used memory.
        used: u64,
        /// Its idle baseline.
        baseline: u64,
    },
}

impl Hold {
    /// For logs and a Start's error.
    pub fn describe(&self, tolerance: u64) -> String {
        match self {
            Self::Unread => "NVML had not answered how much of the GPU's memory is used".to_owned(),
            Self::Unreadable { minor } => {
                format!("NVML could not read the memory of nvidia{minor}")
            }
            Self::Short { minor, need, free } => format!(
                "NVML shows {} free on nvidia{minor} for it (less the headroom and the Starts let through), \
                 short of its {}: memory no container's ledger accounts for is held",
                show_bytes(*free),
                show_bytes(*need)
            ),
            Self::Busy {
                minor,
                used,
                baseline,
            } => format!(
                "NVML shows {} used on nvidia{minor}, more than its idle {} and the tolerance ({}): memory \
                 no container's ledger accounts for is still held",
                show_bytes(*used),
                show_bytes(*baseline),
                show_bytes(tolerance)
            ),
        }
    }
}

/// The floor's state in the core.
#[derive(Debug)]
pub struct Floor {
    /// `--nvml-floor false`: the gate decides on the ledgers alone.
    pub off: bool,
    /// `--nvml-tolerance-mib`, bytes.
    pub tolerance: u64,
    /// A reading is to be asked once the event in hand is handled (a release: see `registry/publish.rs`).
    pub wanted: bool,
    /// Whether NVML answered (`None`: not yet; `Some(false)`: the node has none).
    present: Option<bool>,
    latest: Option<Reading>,
    /// The question in flight: when it was asked, and the GPUs (minors) that some container held then
    /// (`None`: every GPU, a holder whose devices are not known).
    asked: Option<(u64, Option<BTreeSet<u32>>)>,
    /// Each GPU's idle baseline.
    baseline: BTreeMap<u32, u64>,
    /// GPUs whose last reading disagreed with the ledgers (a second one in a row counts).
    suspect: BTreeSet<u32>,
    /// GPUs in a counted disagreement (logged once until it ends).
    disagreeing: BTreeSet<u32>,
    /// Per GPU, bytes used past the baseline and the ledgers at the last reading.
    pub unaccounted: BTreeMap<u32, u64>,
    /// Disagreements counted.
    pub disagreements: u64,
}

impl Default for Floor {
    fn default() -> Self {
        Self {
            off: false,
            tolerance: DEFAULT_TOLERANCE_MIB << 20,
            wanted: false,
            present: None,
            latest: None,
            asked: None,
            baseline: BTreeMap::new(),
            suspect: BTreeSet::new(),
            disagreeing: BTreeSet::new(),
            unaccounted: BTreeMap::new(),
            disagreements: 0,
        }
    }
}

impl Floor {
    /// Whether the gate goes by NVML: it is on and the node has NVML (or it has not answered yet).
    pub fn applies(&self) -> bool {
        !self.off && self.present != Some(false)
    }

    /// GPU `minor`'s latest reading, whenever it was asked.
    pub fn latest(&self, minor: u32) -> Option<Memory> {
        self.latest.as_ref()?.by_minor.get(&minor).copied()
    }

    /// GPU `minor`'s reading if one was asked at `since_ns` or later: `Unread` when none was, `Unreadable`
    /// when it has no memory of that GPU (NVML could not read it: the gate stays shut for it, asking again
    /// with the /proc rechecks' growing delay rather than at once).
    fn read_since(&self, minor: u32, since_ns: u64) -> Result<Memory, Hold> {
        let r = self
            .latest
            .as_ref()
            .filter(|r| r.asked_ns >= since_ns)
            .ok_or(Hold::Unread)?;
        r.by_minor
            .get(&minor)
            .copied()
            .ok_or(Hold::Unreadable { minor })
    }

    /// GPU `minor`'s idle baseline, once measured.
    pub fn baseline(&self, minor: u32) -> Option<u64> {
        self.baseline.get(&minor).copied()
    }

    /// Whether GPU `minor` lets a whole-GPU Start through by a reading asked at `since_ns` or later.
    pub fn idle(&self, minor: u32, since_ns: u64) -> Result<(), Hold> {
        let m = self.read_since(minor, since_ns)?;
        // Not measured yet: this reading, asked with no holder, is the baseline (see `answered`).
        let baseline = self.baseline(minor).unwrap_or(m.used);
        if m.used > baseline.saturating_add(self.tolerance) {
            return Err(Hold::Busy {
                minor,
                used: m.used,
                baseline,
            });
        }
        Ok(())
    }

    /// Whether to ask NVML now (none in flight, or one long unanswered); notes the question with the GPUs
    /// held at `now_ns` (`None`: all).
    pub fn ask(&mut self, now_ns: u64, held: Option<BTreeSet<u32>>) -> bool {
        if !self.applies()
            || self
                .asked
                .as_ref()
                .is_some_and(|(t, _)| now_ns.saturating_sub(*t) < ASK_AGAIN_NS)
        {
            return false;
        }
        self.asked = Some((now_ns, held));
        true
    }

    /// NVML answered the question asked at `asked_ns` (`None`: the node has no NVML); `held_now` are the GPUs
    /// held as it came back (`None`: all). A GPU held at neither moment gives its baseline a reading.
    pub fn answered(
        &mut self,
        asked_ns: u64,
        memory: Option<BTreeMap<u32, Memory>>,
        held_now: Option<&BTreeSet<u32>>,
    ) {
        let held_then = match &self.asked {
            Some((t, held)) if *t == asked_ns => {
                let held = held.clone();
                self.asked = None;
                held
            }
            // An answer to a question asked again since: whether the GPUs were held then is not known.
            _ => None,
        };
        let Some(by_minor) = memory else {
            self.present = Some(false);
            return;
        };
        self.present = Some(true);
        if let (Some(then), Some(now)) = (held_then, held_now) {
            for (minor, m) in &by_minor {
                if !then.contains(minor) && !now.contains(minor) {
                    let b = self.baseline.entry(*minor).or_insert(m.used);
                    *b = (*b).min(m.used);
                }
            }
        }
        if self.latest.as_ref().is_none_or(|r| r.asked_ns <= asked_ns) {
            self.latest = Some(Reading { asked_ns, by_minor });
        }
    }

    /// Compares the latest reading of GPU `minor` with the ledgers of its holders (`ledgers`, bytes): returns
    /// the bytes used past them, the baseline and the tolerance when that is the second reading in a row to
    /// say so and the disagreement is new (to log); counts it.
    pub fn compare(&mut self, minor: u32, ledgers: u64) -> Option<u64> {
        let (Some(m), Some(baseline)) = (self.latest(minor), self.baseline(minor)) else {
            return None;
        };
        let over = m
            .used
            .saturating_sub(baseline)
            .saturating_sub(ledgers)
            .checked_sub(self.tolerance)
            .filter(|o| *o > 0);
        let Some(over) = over else {
            self.suspect.remove(&minor);
            self.disagreeing.remove(&minor);
            self.unaccounted.remove(&minor);
            return None;
        };
        let unaccounted = over + self.tolerance;
        if !self.suspect.insert(minor) {
            self.unaccounted.insert(minor, unaccounted);
            if self.disagreeing.insert(minor) {
                self.disagreements += 1;
                return Some(unaccounted);
            }
        }
        None
    }
}

impl Core {
    /// The GPUs (minors of its open `nvidiaN` files, as the probes named them: no /proc read, so that the
    /// once-a-second reading costs the core nothing per fd) that each watched container holding the GPU has
    /// open; `None` for one that holds with no device file open (it counts on every GPU).
    fn held_minors(&self) -> Vec<(&crate::registry::watched::Watched, Option<BTreeSet<u32>>)> {
        let Some(tracer) = self.tracer.as_ref() else {
            return Vec::new();
        };
        let mut by_cgroup: BTreeMap<u64, BTreeSet<u32>> = BTreeMap::new();
        for (_, p) in tracer.fd_table().iter() {
            for nv in p.fds.values().filter(|nv| nv.kind == FdKind::Device) {
                by_cgroup
                    .entry(p.cgroup_id)
                    .or_default()
                    .insert(u32::from(nv.minor));
            }
        }
        self.watched
            .values()
            .filter(|w| w.is_held())
            .map(|w| (w, by_cgroup.remove(&w.cgroup_id)))
            .collect()
    }

    /// The GPUs (minors) a watched container holds or a Start let through has claimed (`None`: all: one
    /// holds with no device file open, or claimed every GPU).
    fn held_gpus(&self) -> Option<BTreeSet<u32>> {
        let mut held = BTreeSet::new();
        for (_, minors) in self.held_minors() {
            held.extend(minors?);
        }
        for (_, on) in self.gapfill.claims() {
            if on.is_empty() {
                return None;
            }
            for d in &on {
                held.insert(minor_of(d)?);
            }
        }
        Some(held)
    }

    /// Asks NVML for each GPU's memory on the blocking pool, unless a question is out or the floor does not
    /// apply; the answer comes back as `What::NvmlMemory`.
    pub(crate) fn ask_floor(&mut self) {
        let now = now_monotonic_ns();
        let held = self.held_gpus();
        if self.floor.ask(now, held) && !crate::nvml::ask_memory(now) {
            // No NVML task (a core in a unit test): as a node without NVML.
            self.floor.answered(now, None, None);
        }
    }

    /// NVML's answer: the floor takes it, the ledgers are compared with it, and the gates checked again.
    pub(crate) fn on_nvml_memory(&mut self, asked_ns: u64, memory: Option<BTreeMap<u32, Memory>>) {
        let held = self.held_gpus();
        let minors: Vec<u32> = memory.iter().flat_map(|m| m.keys().copied()).collect();
        self.floor.answered(asked_ns, memory, held.as_ref());
        for minor in minors {
            self.compare_with_ledgers(minor);
        }
        self.check_gates();
    }

    /// The watched containers holding GPU `minor` (one holding with no device file open holds every GPU),
    /// with their ledgers' video memory.
    fn ledgers_on(&self, minor: u32) -> Vec<(String, u64)> {
        let Some(tracer) = self.tracer.as_ref() else {
            return Vec::new();
        };
        self.held_minors()
            .into_iter()
            .filter(|(_, minors)| minors.as_ref().is_none_or(|m| m.contains(&minor)))
            .map(|(w, _)| {
                let bytes = tracer.gpu_state(w.cgroup_id).vram_bytes;
                (w.registration.container.id.clone(), bytes)
            })
            .collect()
    }

    /// A disagreement between NVML and the ledgers on GPU `minor`, logged once with the containers holding it.
    fn compare_with_ledgers(&mut self, minor: u32) {
        let holders = self.ledgers_on(minor);
        let ledgers = holders
            .iter()
            .map(|(_, b)| *b)
            .fold(0u64, u64::saturating_add);
        let Some(unaccounted) = self.floor.compare(minor, ledgers) else {
            return;
        };
        let named: Vec<String> = holders
            .iter()
            .map(|(id, b)| format!("{id} ({})", show_bytes(*b)))
            .collect();
        let m = self.floor.latest(minor).unwrap_or_default();
        tracing::warn!(
            minor,
            unaccounted,
            "agent: NVML shows {} used on nvidia{minor}, {} more than its idle baseline ({}) and the ledgers of \
             the containers holding it account for: {}; the gate goes by NVML's free memory there (a \
             tenant's rewrite the probes cannot see, or a process outside every container)",
            show_bytes(m.used),
            show_bytes(unaccounted),
            show_bytes(self.floor.baseline(minor).unwrap_or(0)),
            if named.is_empty() {
                "none holds it".to_owned()
            } else {
                named.join(", ")
            }
        );
    }

    /// What NVML leaves on GPU `key` for a Start of container `me` by reading `m`: its free memory less the
    /// headroom less the needs of the other Starts let through that have not allocated yet (NVML does not see
    /// them yet; one with no need takes it all).
    fn nvml_room(&self, key: &DeviceKey, me: &baton_agent_api::ContainerRef, m: Memory) -> u64 {
        let claimed = self
            .gapfill
            .claims()
            .filter(|(c, on)| {
                c != me
                    && (on.is_empty() || on.iter().any(|d| d.same_device(key)))
                    && self.watched.get(c).is_none_or(|w| !w.is_held())
            })
            .try_fold(0u64, |sum, (c, _)| {
                // One no longer watched has gone (its claim lapses); one with no need takes the whole GPU.
                let need = self
                    .watched
                    .get(&c)
                    .map_or(Some(0), |w| w.registration.gpu_memory)?;
                Some(sum.saturating_add(need))
            });
        claimed.map_or(0, |claimed| {
            m.free()
                .saturating_sub(self.gpu_headroom)
                .saturating_sub(claimed)
        })
    }

    /// What `status` shows of GPU `key`'s floor.
    pub(crate) fn floor_status(&self, key: &DeviceKey) -> Option<baton_agent_api::room::NvmlFloor> {
        self.floor_of(minor_of(key)?)
    }

    /// What `status` shows of every GPU's floor.
    pub(crate) fn floor_statuses(&self) -> Vec<baton_agent_api::GpuFloor> {
        let minors = self.floor.latest.iter().flat_map(|r| r.by_minor.keys());
        minors
            .filter_map(|minor| {
                let floor = self.floor_of(*minor)?;
                Some(baton_agent_api::GpuFloor {
                    minor: *minor,
                    floor,
                })
            })
            .collect()
    }

    /// GPU `minor`'s floor for `status`.
    fn floor_of(&self, minor: u32) -> Option<baton_agent_api::room::NvmlFloor> {
        if !self.floor.applies() {
            return None;
        }
        let m = self.floor.latest(minor)?;
        Some(baton_agent_api::room::NvmlFloor {
            used_bytes: m.used,
            free_bytes: m.free(),
            idle_baseline_bytes: self.floor.baseline(minor),
            tolerance_bytes: self.floor.tolerance,
            unaccounted_bytes: self.floor.unaccounted.get(&minor).copied(),
        })
    }

    /// Whether the floor keeps waiter `w` from starting now that the ledgers would let it: `fits` when it
    /// goes through on room (a reading asked after it came must leave its need on each GPU), else it waits for
    /// the whole GPU (a reading asked after its holders went must show each GPU back to its idle baseline).
    /// `None` lets it. Gap-fill plans its parks by the ledgers' room (NVML cannot say whose memory it sees).
    pub(crate) fn floor_holds(&self, w: &Waiter, fits: bool) -> Option<Hold> {
        if !self.floor.applies() {
            return None;
        }
        let since = if fits {
            w.asked_ns
        } else {
            w.clear_since_ns.unwrap_or(w.asked_ns).max(w.asked_ns)
        };
        // A device NVML does not number (not /dev/nvidiaN) has no floor.
        w.devices.iter().find_map(|key| {
            let minor = minor_of(key)?;
            if !fits {
                return self.floor.idle(minor, since).err();
            }
            let m = match self.floor.read_since(minor, since) {
                Ok(m) => m,
                Err(hold) => return Some(hold),
            };
            let (need, free) = (
                w.need.unwrap_or(u64::MAX),
                self.nvml_room(key, &w.container, m),
            );
            (need > free).then_some(Hold::Short { minor, need, free })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn reading(used: u64) -> Option<BTreeMap<u32, Memory>> {
        Some(
            [(
                0,
                Memory {
                    total: 2048 * MIB,
                    used,
                },
            )]
            .into(),
        )
    }

    #[test]
    fn the_baseline_is_the_least_used_memory_seen_with_no_holder() {
        let mut f = Floor::default();
        assert!(f.applies(), "NVML not asked yet: the floor applies");
        assert!(f.ask(10, Some(BTreeSet::new())));
        assert!(!f.ask(11, Some(BTreeSet::new())), "one question at a time");
        f.answered(10, reading(100 * MIB), Some(&BTreeSet::new()));
        assert_eq!(f.baseline(0), Some(100 * MIB));
        // Held when asked: no baseline reading, however low.
        assert!(f.ask(20, Some([0].into())));
        f.answered(20, reading(10 * MIB), Some(&BTreeSet::new()));
        assert_eq!(f.baseline(0), Some(100 * MIB));
        assert!(f.ask(30, Some(BTreeSet::new())));
        f.answered(30, reading(80 * MIB), Some(&BTreeSet::new()));
        assert!(f.ask(40, Some(BTreeSet::new())));
        f.answered(40, reading(900 * MIB), Some(&BTreeSet::new()));
        assert_eq!(f.baseline(0), Some(80 * MIB), "lowered, never raised");
        assert_eq!(f.latest(0).map(|m| m.free()), Some(1148 * MIB));
    }

    #[test]
    fn a_whole_gpu_start_waits_for_a_newer_reading_back_at_the_baseline() {
        let mut f = Floor::default();
        f.ask(10, Some(BTreeSet::new()));
        f.answered(10, reading(100 * MIB), Some(&BTreeSet::new()));
        assert_eq!(
            f.idle(0, 11),
            Err(Hold::Unread),
            "asked before the holders went"
        );
        f.ask(20, None);
        f.answered(20, reading(100 * MIB + f.tolerance + 1), None);
        assert!(matches!(f.idle(0, 11), Err(Hold::Busy { .. })));
        f.ask(30, None);
        f.answered(30, reading(100 * MIB + f.tolerance), None);
        assert_eq!(f.idle(0, 11), Ok(()));
        assert_eq!(
            f.idle(1, 11),
            Err(Hold::Unreadable { minor: 1 }),
            "a GPU the answer has no memory of"
        );
    }

    #[test]
    fn without_nvml_or_switched_off_the_floor_does_not_apply() {
        let mut f = Floor::default();
        f.ask(10, None);
        f.answered(10, None, None);
        assert!(!f.applies());
        assert!(!f.ask(20, None), "nothing to ask");
        let off = Floor {
            off: true,
            ..Floor::default()
        };
        assert!(!off.applies());
    }

    #[test]
    fn memory_past_the_ledgers_twice_in_a_row_is_one_disagreement() {
        let mut f = Floor::default();
        f.ask(10, Some(BTreeSet::new()));
        f.answered(10, reading(0), Some(&BTreeSet::new()));
        f.ask(20, None);
        f.answered(20, reading(1024 * MIB), None);
        assert_eq!(f.compare(0, 1000 * MIB), None, "within the tolerance");
        assert_eq!(f.compare(0, 256 * MIB), None, "the first reading to say so");
        assert_eq!(f.compare(0, 256 * MIB), Some(768 * MIB));
        assert_eq!(f.compare(0, 256 * MIB), None, "counted and logged once");
        assert_eq!(
            (f.disagreements, f.unaccounted.get(&0)),
            (1, Some(&(768 * MIB)))
        );
        assert_eq!(f.compare(0, 1024 * MIB), None);
        assert!(f.unaccounted.is_empty(), "it ended");
    }
}
