//! Room on a GPU: what a container says it needs (`baton.io/gpu-memory`, a quantity as Kubernetes writes
//! it: `24Gi`, `500M`, `25769803776`), the node's headroom (`gpu_memory_headroom`), and what `status` shows of
//! each GPU's memory. A container that says nothing needs the whole GPU.
//!
//! The quantity grammar is Kubernetes' (`resource.Quantity`): a decimal number, then a binary suffix (`Ki`,
//! `Mi`, `Gi`, `Ti`, `Pi`, `Ei`), a decimal one (`k`, `M`, `G`, `T`, `P`, `E`) or a decimal exponent (`e9`).
//! A fraction of a byte rounds up, as Kubernetes rounds memory. Parsed here, not with a crate: the crates that
//! parse quantities bring all of Kubernetes' API types with them.
use serde::{Deserialize, Serialize};

use crate::ContainerRef;

/// The largest need or headroom accepted: 1 PiB (no GPU has that much; anything past its capacity simply
/// never fits).
pub const MAX_GPU_MEMORY: u64 = 1 << 50;

/// What [`parse_quantity`] accepts, for errors.
pub const QUANTITY_SYNTAX: &str = "a memory quantity as Kubernetes writes it (e.g. 24Gi, 500Mi, 80G, 25769803776), more than 0 and at most 1Pi";

/// A memory quantity in bytes (rounded up), or `None` when `s` is not one, is 0, or is past
/// [`MAX_GPU_MEMORY`].
pub fn parse_quantity(s: &str) -> Option<u64> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, suffix) = s.split_at(split);
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && fraction.is_empty() || fraction.contains('.') {
        return None;
    }
    // The value is (whole.fraction) * 2^shift * 10^exp: kept exact as an integer over 10^fraction digits.
    let (shift, exp): (u32, i64) = match suffix {
        "" => (0, 0),
        "Ki" => (10, 0),
        "Mi" => (20, 0),
        "Gi" => (30, 0),
        "Ti" => (40, 0),
        "Pi" => (50, 0),
        "Ei" => (60, 0),
        "k" => (0, 3),
        "M" => (0, 6),
        "G" => (0, 9),
        "T" => (0, 12),
        "P" => (0, 15),
        "E" => (0, 18),
        e if e.starts_with(['e', 'E']) => (0, e[1..].parse::<i64>().ok()?),
        _ => return None,
    };
    if whole.len() + fraction.len() > 30 || !(-30..=30).contains(&exp) {
        return None;
    }
    let digits: u128 = format!("{whole}{fraction}").parse().ok()?;
    let scale = i64::try_from(fraction.len()).ok()? - exp;
    let value = digits.checked_mul(1u128 << shift)?;
    let bytes = if scale <= 0 {
        value.checked_mul(10u128.checked_pow(u32::try_from(-scale).ok()?)?)?
    } else {
        value.div_ceil(10u128.checked_pow(u32::try_from(scale).ok()?)?)
    };
    u64::try_from(bytes)
        .ok()
        .filter(|b| (1..=MAX_GPU_MEMORY).contains(b))
}

/// `bytes` for people: `24 GiB`, `512 MiB`, `1.5 GiB`.
pub fn show_bytes(bytes: u64) -> String {
    const GIB: f64 = (1u64 << 30) as f64;
    const MIB: f64 = (1u64 << 20) as f64;
    let b = bytes as f64;
    if b >= GIB {
        let g = b / GIB;
        if (g - g.round()).abs() < 0.05 {
            format!("{} GiB", g.round())
        } else {
            format!("{g:.1} GiB")
        }
    } else {
        format!("{} MiB", (b / MIB).ceil())
    }
}

/// A holder's memory on a GPU, in `status`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldMemory {
    /// The holder.
    #[serde(flatten)]
    pub container: ContainerRef,
    /// Its video memory there as measured (the ledger, or NVML); `None`: not measurable, it counts as the
    /// whole GPU.
    #[serde(default)]
    pub bytes: Option<u64>,
}

/// A waiter's need, in `status`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NeededMemory {
    /// The container whose Start waits.
    #[serde(flatten)]
    pub container: ContainerRef,
    /// Its `baton.io/gpu-memory`; `None`: the whole GPU.
    #[serde(default)]
    pub bytes: Option<u64>,
}

/// One GPU's memory as the gate counts it, in `status`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuRoom {
    /// Its memory (NVML's total); `None` where the agent has no NVML: then every need is the whole GPU.
    #[serde(default)]
    pub capacity_bytes: Option<u64>,
    /// The node's headroom kept free (`gpu_memory_headroom`).
    #[serde(default)]
    pub headroom_bytes: u64,
    /// What each holder has there (containers let through the gate that have not allocated yet count with
    /// their need).
    #[serde(default)]
    pub held: Vec<HeldMemory>,
    /// Capacity less headroom less what every holder has (0 when a holder counts as the whole GPU); `None`
    /// without a capacity.
    #[serde(default)]
    pub room_bytes: Option<u64>,
    /// The Starts waiting for it and what each needs.
    #[serde(default)]
    pub needs: Vec<NeededMemory>,
    /// NVML's latest reading of it, the gate's floor (absent without NVML, with the floor off, and from an
    /// older agent): `room_bytes` is never more than its free memory less the headroom.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nvml: Option<NvmlFloor>,
}

/// What the gate's floor knows of a GPU from NVML.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NvmlFloor {
    /// Used memory at the latest reading.
    pub used_bytes: u64,
    /// Free memory at the latest reading.
    pub free_bytes: u64,
    /// The least used memory NVML showed while no container held the GPU (`None`: not seen yet): a Start
    /// that needs the whole GPU waits until used memory is back to it, within the tolerance.
    #[serde(default)]
    pub idle_baseline_bytes: Option<u64>,
    /// `--nvml-tolerance-mib`, bytes.
    pub tolerance_bytes: u64,
    /// Used memory past the baseline and the ledgers of its holders, when that disagreement is counted.
    #[serde(default)]
    pub unaccounted_bytes: Option<u64>,
}

/// The most video memory containers of one name held, remembered by the agent past their end, so that a
/// user can set `baton.io/gpu-memory` from what was measured.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PeakMemory {
    /// The namespace: the pod's under Kubernetes, else containerd's.
    pub namespace: String,
    /// The container's name in its pod spec under Kubernetes, else its id.
    pub name: String,
    /// The ledger's peak of video memory over every container of that name the agent watched.
    pub peak_bytes: u64,
    /// How many containers of that name it watched (ended or not).
    pub containers: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_parse_as_kubernetes_writes_them() {
        assert_eq!(parse_quantity("24Gi"), Some(24 << 30));
        assert_eq!(parse_quantity("500Mi"), Some(500 << 20));
        assert_eq!(parse_quantity(" 1.5Gi "), Some(3 << 29));
        assert_eq!(parse_quantity("80G"), Some(80_000_000_000));
        assert_eq!(parse_quantity("1k"), Some(1000));
        assert_eq!(parse_quantity("25769803776"), Some(25_769_803_776));
        assert_eq!(parse_quantity("1e9"), Some(1_000_000_000));
        assert_eq!(
            parse_quantity("0.5"),
            Some(1),
            "a fraction of a byte rounds up"
        );
        assert_eq!(parse_quantity(".5Ki"), Some(512));
        assert_eq!(parse_quantity("1Pi"), Some(MAX_GPU_MEMORY));
    }

    #[test]
    fn what_is_not_a_quantity_or_no_need_is_refused() {
        for bad in [
            "", "Gi", "0", "0Gi", "-1Gi", "24GB", "24gi", "1.2.3", "2Pi", "1Ei", "1e40", "1e",
            "24 Gi", "100m",
        ] {
            assert_eq!(parse_quantity(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn bytes_show_in_gib_or_mib() {
        assert_eq!(show_bytes(24 << 30), "24 GiB");
        assert_eq!(show_bytes(3 << 29), "1.5 GiB");
        assert_eq!(show_bytes(256 << 20), "256 MiB");
    }
}
