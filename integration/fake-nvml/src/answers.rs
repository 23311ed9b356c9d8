//! What the fake answers, from the mock driver's state (`state.json`): its GPUs, and as compute processes
//! the processes that hold a live RM client on it, with the bytes their video-memory objects hold.
//!
//! Where the mock says less than the driver: it does not say which GPU a memory object is on, so a
//! process's memory is counted on the lowest-numbered GPU whose device file (`nvidiaN`) it has open (GPU 0
//! when it has none); and a process with a client but no context is listed (NVML lists those with a
//! compute context).
use std::collections::BTreeMap;

use baton_mock_nvidia::driver::DriverState;

/// A compute process as NVML lists it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Process {
    /// Its pid (thread group).
    pub pid: u32,
    /// Bytes its memory objects hold.
    pub used_bytes: u64,
}

/// One GPU as NVML reports it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Gpu {
    /// Its memory.
    pub total_bytes: u64,
    /// Memory its processes hold. After a release, nothing: on the H200 NVML's used memory was 0 once the
    /// traced program's state was gone (/work/shared/gpu/580.159.04/report.json, trace.released.nvml).
    pub used_bytes: u64,
    /// Its compute processes, by pid.
    pub processes: Vec<Process>,
}

/// The GPUs of `state`, numbered as its device files; `tgid_of` names a file opener's process (the mock
/// records the opening thread).
pub fn gpus(state: &DriverState, tgid_of: impl Fn(u32) -> u32) -> Vec<Gpu> {
    let count = state.gpus.max(1);
    let mut gpus = vec![
        Gpu {
            total_bytes: state.vram_bytes / u64::from(count),
            ..Gpu::default()
        };
        count as usize
    ];
    // Per process: whether it holds a client, the bytes of its objects, the GPUs whose files it has open.
    let mut by_process: BTreeMap<u32, (bool, u64, Option<u32>)> = BTreeMap::new();
    for file in &state.files {
        let entry = by_process
            .entry(tgid_of(file.pid))
            .or_insert((false, 0, None));
        entry.0 |= !file.clients.is_empty();
        // Device memory: video-memory objects only (system memory is the host's, which NVML does not count).
        entry.1 += file
            .clients
            .iter()
            .flat_map(|c| c.objects.iter())
            .filter(|o| baton_nvidia::class::is_video_memory(o.class))
            .map(|o| o.bytes)
            .sum::<u64>();
        if let Some(n) = gpu_of_node(&file.node).filter(|n| *n < count) {
            entry.2 = Some(entry.2.map_or(n, |m: u32| m.min(n)));
        }
    }
    for (pid, (holds_client, used_bytes, gpu)) in by_process {
        if holds_client && let Some(g) = gpus.get_mut(gpu.unwrap_or(0) as usize) {
            g.used_bytes += used_bytes;
            g.processes.push(Process { pid, used_bytes });
        }
    }
    gpus
}

/// N of a device file named `nvidiaN`.
fn gpu_of_node(node: &str) -> Option<u32> {
    node.strip_prefix("nvidia")?.parse().ok()
}

/// The thread group of thread `tid` (itself when /proc does not say: it is gone).
pub fn tgid_from_proc(tid: u32) -> u32 {
    std::fs::read_to_string(format!("/proc/{tid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Tgid:"))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(tid)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A state with `gpus` GPUs of 1 GiB each and `files`: (opener, node, client handles, object bytes).
    fn state(gpus: u32, files: &[(u32, &str, &[u32], &[u64])]) -> DriverState {
        let files: Vec<serde_json::Value> = files
            .iter()
            .enumerate()
            .map(|(fh, (pid, node, clients, bytes))| {
                let objects: Vec<serde_json::Value> = bytes
                    .iter()
                    .map(|b| {
                        serde_json::json!({"handle": 2, "class": 0x40, "class_name": null,
                        "parent": 1, "bytes": b, "size_known": true})
                    })
                    .collect();
                let clients: Vec<serde_json::Value> = clients
                    .iter()
                    .map(|h| serde_json::json!({"handle": h, "objects": objects}))
                    .collect();
                serde_json::json!({"fh": fh, "node": node, "pid": pid, "clients": clients,
                    "registered_ctl_fd": null, "attached_gpus": [], "mappings": [],
                    "uvm_commands": {}, "ioctls": 0})
            })
            .collect();
        serde_json::from_value(serde_json::json!({
            "driver_version": "580.159.04", "gpus": gpus, "vram_bytes": u64::from(gpus) << 30,
            "vram_used_bytes": 0, "files": files, "totals": {"opens": 0, "releases": 0, "allocs": 0,
            "frees": 0, "controls": 0, "uvm_commands": 0, "failed_statuses": 0}
        }))
        .unwrap()
    }

    #[test]
    fn a_process_with_a_client_is_listed_with_its_memory_on_its_gpu() {
        // 10 (thread 11 opened its ctl file) holds a client with 4096 + 512 bytes and has nvidia1 open; 20
        // has nvidia0 open without a client; 30 holds a client with no memory.
        let s = state(
            2,
            &[
                (11, "nvidiactl", &[0xc1], &[4096, 512]),
                (10, "nvidia1", &[], &[]),
                (20, "nvidia0", &[], &[]),
                (30, "nvidiactl", &[0xc2], &[]),
            ],
        );
        let tgid = |tid| if tid == 11 { 10 } else { tid };
        let g = gpus(&s, tgid);
        assert_eq!(g.len(), 2);
        assert_eq!(g[0].total_bytes, 1 << 30);
        assert_eq!(
            g[0].processes,
            [Process {
                pid: 30,
                used_bytes: 0
            }]
        );
        assert_eq!(g[0].used_bytes, 0);
        assert_eq!(
            g[1].processes,
            [Process {
                pid: 10,
                used_bytes: 4608
            }]
        );
        assert_eq!(g[1].used_bytes, 4608);
    }

    /// NVML's device memory is video memory: a client's system memory (the host's) is not counted.
    #[test]
    fn system_memory_is_not_device_memory() {
        let mut s = state(1, &[(10, "nvidiactl", &[0xc1], &[4096])]);
        s.files[0].clients[0].objects[0].class = baton_nvidia::class::NV01_MEMORY_SYSTEM;
        let g = gpus(&s, |t| t);
        assert_eq!(g[0].used_bytes, 0);
        assert_eq!(
            g[0].processes,
            [Process {
                pid: 10,
                used_bytes: 0
            }]
        );
    }

    #[test]
    fn nothing_held_is_no_process_and_no_memory_used() {
        let g = gpus(&state(1, &[]), |t| t);
        assert_eq!(
            g,
            [Gpu {
                total_bytes: 1 << 30,
                used_bytes: 0,
                processes: vec![]
            }]
        );
        assert_eq!(tgid_from_proc(std::process::id()), std::process::id());
    }
}
