//! The gate's room on a GPU: a Start whose container says what it needs (`baton.io/gpu-memory`) goes through
//! once that much is free on every GPU it sees, beside the holders, instead of waiting for an empty GPU.
//! Free is the GPU's capacity (NVML's total; without NVML, or before it answered, only an empty GPU lets a
//! Start through, as before) less the node's headroom (`gpu_memory_headroom`) less what each holder has there:
//! - a watched holder that declared a need: its ledger's video memory. One whose ledger cannot say (open
//!   NVIDIA files whose contents the probes never saw: a container past its fd quota, a ledger rebuilt after
//!   an agent restart) counts as the whole GPU;
//! - a watched holder that declared none: the whole GPU. Room is among declarers: a container that never
//!   said what it needs may grow to the whole GPU (a tenant's `gpu-memory: "1"` must not start beside a
//!   container that expected the GPU alone);
//! - a container let through the gate that has not allocated yet: its need (the whole GPU without one);
//!
//! A declared need counts for at least the node's `gpu_memory_minimum`.
//! - a process only /proc shows: not counted here, it keeps the gate shut as before (the gate's hidden
//!   holders), since nothing measures it.
//!
//! A holder on several GPUs counts its whole ledger on each (the ledger does not split by GPU): more than it
//! has there, never less. A container that allocates past what it declared is not stopped by the gate: the
//! driver refuses what does not fit on the GPU.
use std::collections::BTreeSet;

use baton_agent_api::{
    ContainerRef,
    room::{GpuRoom, HeldMemory, NeededMemory, show_bytes},
};

use super::{DeviceKey, Waiter};
use crate::core::Core;

/// The minor number of a GPU device (N of `/dev/nvidiaN`), which NVML's capacities go by.
pub fn minor_of(key: &DeviceKey) -> Option<u32> {
    match key {
        DeviceKey::Number(_, minor) => u32::try_from(*minor).ok(),
        DeviceKey::File { name, .. } => name
            .rsplit('/')
            .next()?
            .strip_prefix("nvidia")?
            .parse()
            .ok(),
        DeviceKey::Unknown => None,
    }
}

/// GPU `key`'s memory, where NVML told it.
fn capacity_of(key: &DeviceKey) -> Option<u64> {
    crate::nvml::capacity_by_minor()?
        .get(&minor_of(key)?)
        .copied()
}

/// Whether a waiter fits beside the holders of the GPUs it sees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fit {
    /// It says nothing of its need: it needs the whole GPU.
    Whole,
    /// A GPU it sees has no known capacity: it needs the whole GPU.
    Unknown,
    /// Its need is free on every GPU it sees (`free`: on the tightest).
    Fits {
        /// Its need.
        need: u64,
        /// Free memory on the tightest GPU.
        free: u64,
    },
    /// Its need is more than a GPU it sees has, less the headroom: it never fits, and nothing is parked
    /// for it.
    Never {
        /// Its need.
        need: u64,
        /// What that GPU has for containers (capacity less headroom).
        most: u64,
    },
    /// Its need is not free on some GPU (`free`: on the tightest).
    Short {
        /// Its need.
        need: u64,
        /// Free memory on the tightest GPU.
        free: u64,
    },
}

impl Fit {
    /// Whether it fits now.
    pub fn fits(self) -> bool {
        matches!(self, Self::Fits { .. })
    }

    /// How much more must be freed for it to fit (none unless `Short`).
    pub fn deficit(self) -> Option<u64> {
        match self {
            Self::Short { need, free } => Some(need - free.min(need)),
            _ => None,
        }
    }

    /// `(needs 24 GiB, 9 GiB free)`, for logs and errors.
    pub fn describe(self) -> String {
        match self {
            Self::Whole => "it needs the whole GPU (no baton.io/gpu-memory)".to_owned(),
            Self::Unknown => {
                "it needs the whole GPU: the GPU's memory is not known (no NVML on the node)"
                    .to_owned()
            }
            Self::Fits { need, free } | Self::Short { need, free } => {
                format!("needs {}, {} free", show_bytes(need), show_bytes(free))
            }
            Self::Never { need, most } => format!(
                "needs {}, more than the GPU has for containers ({}): it never fits; lower its \
                 baton.io/gpu-memory",
                show_bytes(need),
                show_bytes(most)
            ),
        }
    }
}

/// One GPU's room.
pub struct Room {
    /// Its memory.
    pub capacity: u64,
    /// What each holder has there (`None`: the whole GPU).
    pub held: Vec<HeldMemory>,
    /// What is left for another container.
    pub free: u64,
}

impl Core {
    /// What holds GPU `key`, besides `me`, and how much.
    fn held_on(&self, key: &DeviceKey, me: &ContainerRef) -> Vec<HeldMemory> {
        let mut held = Vec::new();
        let devices: BTreeSet<DeviceKey> = [key.clone()].into();
        for h in self.holders(me, &devices) {
            let c = &h.registration.container;
            held.push(HeldMemory {
                container: c.clone(),
                bytes: self.counted_bytes(c),
            });
        }
        for (c, on) in self.gapfill.claims() {
            let here = on.is_empty() || on.iter().any(|d| d.same_device(key));
            if c == *me || !here || held.iter().any(|h| h.container == c) {
                continue;
            }
            let need = self.declared_need(&c);
            held.push(HeldMemory {
                container: c,
                bytes: need,
            });
        }
        held
    }

    /// GPU `key`'s room for anyone but `me`; `None` without its capacity.
    pub(crate) fn room_on(&self, key: &DeviceKey, me: &ContainerRef) -> Option<Room> {
        let capacity = capacity_of(key)?;
        let held = self.held_on(key, me);
        let used = held
            .iter()
            .try_fold(0u64, |sum, h| h.bytes.map(|b| sum.saturating_add(b)));
        let free = used.map_or(0, |used| {
            capacity
                .saturating_sub(self.gpu_headroom)
                .saturating_sub(used)
        });
        Some(Room {
            capacity,
            held,
            free,
        })
    }

    /// Whether waiter `w` fits beside the holders of every GPU it sees.
    pub(crate) fn fit_of(&self, w: &Waiter) -> Fit {
        let Some(need) = w.need else {
            return Fit::Whole;
        };
        if w.devices.is_empty() {
            return Fit::Unknown;
        }
        let mut tightest = u64::MAX;
        for key in &w.devices {
            let Some(room) = self.room_on(key, &w.container) else {
                return Fit::Unknown;
            };
            let most = room.capacity.saturating_sub(self.gpu_headroom);
            if need > most {
                return Fit::Never { need, most };
            }
            tightest = tightest.min(room.free);
        }
        if need <= tightest {
            Fit::Fits {
                need,
                free: tightest,
            }
        } else {
            Fit::Short {
                need,
                free: tightest,
            }
        }
    }

    /// Why each holder of waiter `w`'s GPUs that counts as the whole GPU does (`"C counts as the whole GPU:
    /// it declared no baton.io/gpu-memory"`), for the gate's messages.
    pub(crate) fn whole_gpu_holders(&self, w: &Waiter) -> Vec<String> {
        let mut seen = BTreeSet::new();
        let mut out = Vec::new();
        for key in &w.devices {
            for h in self.held_on(key, &w.container) {
                if h.bytes.is_some() || !seen.insert(h.container.clone()) {
                    continue;
                }
                let why = if self.declared_need(&h.container).is_none() {
                    "it declared no baton.io/gpu-memory (room is among containers that say what they need)"
                } else {
                    "the ledger cannot measure its memory (NVIDIA files whose contents the probes never saw)"
                };
                out.push(format!("{} counts as the whole GPU: {why}", h.container.id));
            }
        }
        out
    }

    /// GPU `key`'s room as `status` shows it, with the needs of the Starts waiting for it.
    pub(crate) fn room_status(&self, key: &DeviceKey) -> GpuRoom {
        let nobody = ContainerRef {
            id: String::new(),
            namespace: String::new(),
        };
        let room = self.room_on(key, &nobody);
        let needs = self
            .waiters
            .iter()
            .filter(|w| w.devices.iter().any(|d| d.same_device(key)))
            .map(|w| NeededMemory {
                container: w.container.clone(),
                bytes: w.need,
            })
            .collect();
        GpuRoom {
            capacity_bytes: room.as_ref().map(|r| r.capacity),
            headroom_bytes: self.gpu_headroom,
            held: room
                .as_ref()
                .map_or_else(|| self.held_on(key, &nobody), |r| r.held.clone()),
            room_bytes: room.map(|r| r.free),
            needs,
            nvml: self.floor_status(key),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gpus_minor_is_its_device_number_or_the_n_of_its_name() {
        assert_eq!(minor_of(&DeviceKey::Number(195, 3)), Some(3));
        let file = |name: &str| DeviceKey::File {
            dev: 1,
            ino: 2,
            name: name.into(),
        };
        assert_eq!(minor_of(&file("nvidia0")), Some(0));
        assert_eq!(minor_of(&file("/dev/nvidia12")), Some(12));
        assert_eq!(minor_of(&file("nvidiactl")), None);
        assert_eq!(minor_of(&DeviceKey::Unknown), None);
    }

    #[test]
    fn a_fit_says_what_is_needed_and_free() {
        let short = Fit::Short {
            need: 24 << 30,
            free: 9 << 30,
        };
        assert_eq!(short.deficit(), Some(15 << 30));
        assert_eq!(short.describe(), "needs 24 GiB, 9 GiB free");
        assert!(!short.fits() && Fit::Whole.deficit().is_none());
    }
}
