//! Room for a park's host copy, defined once for the shim (which makes the room or refuses, as it parks) and
//! the agent (whose gap-fill never picks a co-runner it cannot park, and which keeps the node's budget for
//! parked host memory). The checkpoint copies a container's device memory into the host memory of each parked
//! process, charged to the container's memory cgroup: recorded on the H200, 4 GiB of VRAM under memory.max
//! 2 GiB made the checkpoint fail with 304 and the kernel OOM-kill the process
//! (/work/shared/gpu/580.159.04/README.md, point 6).
use serde::{Deserialize, Serialize};

const MIB: u64 = 1 << 20;

/// A container's memory limit raised while it is parked (`park_memory = "raise"`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RaisedLimit {
    /// Its limit before the park, bytes.
    pub was_bytes: u64,
    /// Its limit while parked, bytes.
    pub raised_to_bytes: u64,
}

impl RaisedLimit {
    /// By how much the limit was raised: host memory the container holds beyond its own limit, which the
    /// node's budget for parked host memory counts.
    pub fn raised_by(&self) -> u64 {
        self.raised_to_bytes.saturating_sub(self.was_bytes)
    }
}

/// What a park does when the container's memory cgroup has no room for the host copy of its device memory
/// (`park_memory`, node only).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ParkMemory {
    /// Raise the limit by what is missing while it is parked, if the node has that much available and its
    /// budget for parked host memory has that much left; put it back at the resume.
    #[default]
    Raise,
    /// Refuse the park, naming the numbers.
    Refuse,
}

impl ParkMemory {
    /// Whether it is the default (left out of a registration).
    pub fn is_default(&self) -> bool {
        *self == ParkMemory::default()
    }
}

/// What a park copying `vram` bytes of device memory is taken to need in host memory: the device memory,
/// a sixteenth more, and 64 MiB (the checkpoint's own buffers; no recording says how much more than the
/// device memory a checkpoint takes).
pub fn host_copy_need(vram: u64) -> u64 {
    vram.saturating_add(vram / 16).saturating_add(64 * MIB)
}

/// The node's budget for parked host memory when the runtime's options set none
/// (`parked_host_memory_budget`): half of the node's memory, so that limits raised for parks never take more
/// than half of what the scheduler placed pods against.
pub fn default_parked_budget(mem_total: u64) -> u64 {
    mem_total / 2
}

/// `bytes` in MiB, rounded up, as the messages show it.
fn mib(bytes: u64) -> u64 {
    bytes.div_ceil(MIB)
}

/// What a container's memory cgroup and the node have for a park's host copy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostMemory {
    /// The cgroup's limit, bytes (`None`: unlimited).
    pub limit: Option<u64>,
    /// The cgroup's use, bytes.
    pub used: u64,
    /// The node's MemAvailable, bytes (`None`: unknown).
    pub available: Option<u64>,
    /// What the node's budget for parked host memory has left for raising this container's limit, bytes
    /// (`None`: no budget was sent).
    pub budget_left: Option<u64>,
}

/// Whether a park copying `vram` bytes of device memory fits in `m`, as `mode` says: `Ok(None)` when the
/// cgroup has room, `Ok(Some(limit))` when the limit is to be raised to `limit` while the container is
/// parked, and `Err(why)` (with the numbers and what to do) when the park would get the container
/// OOM-killed.
pub fn room_for_host_copy(
    vram: u64,
    mode: ParkMemory,
    m: &HostMemory,
) -> Result<Option<RaisedLimit>, String> {
    if vram == 0 {
        return Ok(None);
    }
    let need = host_copy_need(vram);
    let Some(limit) = m.limit else {
        return match m.available {
            Some(a) if a < need => Err(format!(
                "the park would copy {} MiB of device memory into host memory (with its margin) and the \
                 node has {} MiB available: free memory on the node or park another container",
                mib(need),
                mib(a)
            )),
            _ => Ok(None),
        };
    };
    let room = limit.saturating_sub(m.used);
    if room >= need {
        return Ok(None);
    }
    let missing = need - room;
    let numbers = format!(
        "the park copies {} MiB of device memory into host memory charged to its memory cgroup ({} MiB \
         with the margin), which has {} MiB of room (limit {} MiB, used {} MiB)",
        mib(vram),
        mib(need),
        mib(room),
        mib(limit),
        mib(m.used)
    );
    if mode == ParkMemory::Refuse {
        return Err(format!(
            "{numbers}: parking it would have the kernel OOM-kill it; raise its memory limit by {} MiB, \
             or set park_memory = \"raise\" in the runtime's options on the node",
            mib(missing)
        ));
    }
    if let Some(a) = m.available.filter(|a| *a < missing) {
        return Err(format!(
            "{numbers}; raising its limit by the {} MiB missing needs that much on the node, which has {} MiB \
             available: free memory on the node or raise its memory limit",
            mib(missing),
            mib(a)
        ));
    }
    if let Some(left) = m.budget_left.filter(|l| *l < missing) {
        return Err(format!(
            "{numbers}; raising its limit by the {} MiB missing would pass the node's budget for parked host \
             memory, which has {} MiB left (parked_host_memory_budget in the runtime's options on the node): \
             resume a parked container, raise the budget or raise its memory limit",
            mib(missing),
            mib(left)
        ));
    }
    Ok(Some(RaisedLimit {
        was_bytes: limit,
        raised_to_bytes: limit.saturating_add(missing),
    }))
}

/// The host memory parked containers hold, as `status` shows it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParkedHostMemory {
    /// The host copies of every parked container's device memory, bytes.
    pub held_bytes: u64,
    /// What their parks raised their memory limits by, in all, bytes: what the budget counts.
    pub raised_bytes: u64,
    /// The node's budget for raised limits (`parked_host_memory_budget`, or half the node's memory), bytes.
    pub budget_bytes: u64,
}

impl ParkedHostMemory {
    /// What the budget has left for another park's raise.
    pub fn budget_left(&self) -> u64 {
        self.budget_bytes.saturating_sub(self.raised_bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_need_is_the_device_memory_and_a_margin() {
        assert_eq!(host_copy_need(0), 64 * MIB);
        assert_eq!(host_copy_need(1 << 30), (1 << 30) + (64 << 20) + 64 * MIB);
        assert_eq!(host_copy_need(u64::MAX), u64::MAX);
    }

    fn limited(limit_mib: u64, used_mib: u64) -> HostMemory {
        HostMemory {
            limit: Some(limit_mib * MIB),
            used: used_mib * MIB,
            available: Some(1 << 40),
            budget_left: None,
        }
    }

    #[test]
    fn a_cgroup_with_room_needs_nothing_raised() {
        assert_eq!(
            room_for_host_copy(256 * MIB, ParkMemory::Refuse, &limited(1024, 8)),
            Ok(None)
        );
        assert_eq!(
            room_for_host_copy(0, ParkMemory::Refuse, &limited(1, 1)),
            Ok(None)
        );
    }

    #[test]
    fn raise_raises_by_what_is_missing_and_refuse_names_the_numbers() {
        // 256 MiB copied: 256 + 16 + 64 = 336 MiB needed, 120 MiB of room: 216 MiB missing.
        let raised = room_for_host_copy(256 * MIB, ParkMemory::Raise, &limited(128, 8))
            .unwrap()
            .unwrap();
        assert_eq!(raised.was_bytes, 128 * MIB);
        assert_eq!(raised.raised_by(), 216 * MIB);
        let why = room_for_host_copy(256 * MIB, ParkMemory::Refuse, &limited(128, 8)).unwrap_err();
        for needle in [
            "256 MiB of device memory",
            "120 MiB of room",
            "limit 128 MiB",
            "by 216 MiB",
        ] {
            assert!(why.contains(needle), "{needle:?} in {why}");
        }
    }

    #[test]
    fn a_raise_stays_within_the_node_and_its_budget() {
        let mut m = limited(128, 8);
        m.budget_left = Some(100 * MIB);
        let why = room_for_host_copy(256 * MIB, ParkMemory::Raise, &m).unwrap_err();
        assert!(why.contains("100 MiB left"), "{why}");
        assert!(why.contains("parked_host_memory_budget"), "{why}");
        m.budget_left = Some(216 * MIB);
        assert!(room_for_host_copy(256 * MIB, ParkMemory::Raise, &m).is_ok());
        m.available = Some(10 * MIB);
        let why = room_for_host_copy(256 * MIB, ParkMemory::Raise, &m).unwrap_err();
        assert!(why.contains("10 MiB available"), "{why}");
    }

    #[test]
    fn the_budget_counts_what_limits_were_raised_by() {
        let p = ParkedHostMemory {
            held_bytes: 900,
            raised_bytes: 300,
            budget_bytes: 1000,
        };
        assert_eq!(p.budget_left(), 700);
        let over = ParkedHostMemory {
            raised_bytes: 2000,
            ..p
        };
        assert_eq!(over.budget_left(), 0);
    }
}
