//! NVML's view of a container's processes, attached to the released signal as a cross-check: after a
//! release, NVML should list none of them. Without NVML (no driver, as on CI) the view is `"unavailable"`.
use std::{collections::BTreeSet, sync::OnceLock};

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

/// The compute processes NVML reports among `pids`, per device: `[{"device":0,"pid":P,"used_bytes":N}]`.
pub fn view(pids: &BTreeSet<u32>) -> Value {
    let Some(nvml) = nvml() else {
        return Value::String("unavailable".to_owned());
    };
    let Ok(count) = nvml.device_count() else {
        return Value::String("unavailable".to_owned());
    };
    let mut seen = Vec::new();
    for index in 0..count {
        let Ok(device) = nvml.device_by_index(index) else {
            continue;
        };
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
    Value::Array(seen)
}
