//! NVML's view, the cross-check of the ledger and the release signal: the compute processes and used memory
//! of each device, attached to each `released` event (after a release, NVML should list none of the
//! container's processes), and each device's used memory beside the ledger's in `baton status`. Without NVML
//! (no driver, as on CI) the view is `"unavailable"`.
use std::{
    collections::{BTreeMap, BTreeSet},
    sync::OnceLock,
};

use nvml_wrapper::{Nvml, enums::device::UsedGpuMemory};
use serde_json::{Value, json};

/// NVML, initialised once (`None` when the library or the driver is missing).
fn nvml() -> Option<&'static Nvml> {
    static NVML: OnceLock<Option<Nvml>> = OnceLock::new();
    NVML.get_or_init(|| match Nvml::init() {
        Ok(n) => Some(n),
        Err(e) => {
            tracing::info!(
                "agent: NVML unavailable ({e}); released events carry nvml: \"unavailable\""
            );
            None
        }
    })
    .as_ref()
}

/// Loads and initialises NVML now, on a thread of its own: the first `released` event would otherwise wait
/// for it (a `released` event carries NVML's view, taken before it is published), and loading the library
/// and `nvmlInit` take milliseconds without a driver and can take far longer with one. A release that comes
/// while it runs waits for it, as it did before.
pub fn initialise_in_background() {
    std::thread::spawn(|| {
        nvml();
    });
}

/// NVML's devices with their indices; `None` without NVML.
fn devices() -> Option<Vec<(u32, nvml_wrapper::Device<'static>)>> {
    let nvml = nvml()?;
    let count = nvml.device_count().ok()?;
    Some(
        (0..count)
            .filter_map(|index| nvml.device_by_index(index).ok().map(|d| (index, d)))
            .collect(),
    )
}

/// Each device's used memory by its minor number (N of `/dev/nvidiaN`); `None` without NVML.
pub fn used_by_minor() -> Option<BTreeMap<u32, u64>> {
    Some(
        devices()?
            .iter()
            .filter_map(|(_, d)| Some((d.minor_number().ok()?, d.memory_info().ok()?.used)))
            .collect(),
    )
}

/// What NVML says now of `pids` and the devices: `{"processes":[{"device":I,"pid":P,"used_bytes":N}],
/// "devices":[{"device":I,"minor":M,"used_bytes":N}]}` (I is NVML's index), or `"unavailable"`.
pub fn view(pids: &BTreeSet<u32>) -> Value {
    let Some(all) = devices() else {
        return Value::String("unavailable".to_owned());
    };
    let mut seen = Vec::new();
    let mut devices = Vec::new();
    for (index, device) in &all {
        if let Ok(memory) = device.memory_info() {
            let minor = device.minor_number().ok();
            devices.push(json!({"device": index, "minor": minor, "used_bytes": memory.used}));
        }
        for p in device.running_compute_processes().unwrap_or_default() {
            if pids.contains(&p.pid) {
                let used = match p.used_gpu_memory {
                    UsedGpuMemory::Used(b) => json!(b),
                    UsedGpuMemory::Unavailable => Value::Null,
                };
                seen.push(json!({"device": index, "pid": p.pid, "used_bytes": used}));
            }
        }
    }
    json!({"processes": seen, "devices": devices})
}
