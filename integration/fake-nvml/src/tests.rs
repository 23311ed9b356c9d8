//! The entry points as a C caller (nvml-wrapper) uses them, on a `state.json` written by the test: one
//! test, since the configuration and `nvmlInit_v2` are the process's.
use super::*;

/// A mock state of one 1 GiB GPU where this process holds a client with 4 KiB of memory on nvidiactl.
fn state_json() -> serde_json::Value {
    serde_json::json!({
        "driver_version": "580.159.04", "gpus": 1, "vram_bytes": 1u64 << 30, "vram_used_bytes": 4096,
        "files": [{"fh": 1, "node": "nvidiactl", "pid": std::process::id(),
            "clients": [{"handle": 0xc1, "objects": [{"handle": 2, "class": 0x40, "class_name": null,
                "parent": 0xc1, "bytes": 4096, "size_known": true}]}],
            "registered_ctl_fd": null, "attached_gpus": [], "mappings": [], "uvm_commands": {}, "ioctls": 1}],
        "totals": {"opens": 1, "releases": 0, "allocs": 2, "frees": 0, "controls": 0, "uvm_commands": 0,
            "failed_statuses": 0}
    })
}

#[test]
fn the_entry_points_answer_from_the_mock_state_as_nvml_h_says() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("state.json"), state_json().to_string()).unwrap();
    CONFIG
        .set(Config {
            mock: Some(dir.path().to_owned()),
            ..Config::default()
        })
        .unwrap();
    let mut count: c_uint = 0;
    let count_of = |count: &mut c_uint| {
        // SAFETY: `count` lives for the call.
        unsafe { nvmlDeviceGetCount_v2(count) }
    };
    assert_eq!(count_of(&mut count), code::UNINITIALIZED);
    assert_eq!(nvmlInit_v2(), code::SUCCESS);
    assert_eq!(count_of(&mut count), code::SUCCESS);
    assert_eq!(count, 1);

    let mut device: nvmlDevice_t = std::ptr::null_mut();
    let handle_of = |index, device: &mut nvmlDevice_t| {
        // SAFETY: `device` lives for the call.
        unsafe { nvmlDeviceGetHandleByIndex_v2(index, device) }
    };
    assert_eq!(handle_of(1, &mut device), code::INVALID_ARGUMENT);
    assert_eq!(handle_of(0, &mut device), code::SUCCESS);
    let mut minor: c_uint = 9;
    // SAFETY: `minor` lives for the call.
    let asked = unsafe { nvmlDeviceGetMinorNumber(device, &mut minor) };
    assert_eq!((asked, minor), (code::SUCCESS, 0));

    // SAFETY: nvmlMemory_v2_t is plain integers.
    let mut memory: nvmlMemory_v2_t = unsafe { std::mem::zeroed() };
    let memory_of = |memory: &mut nvmlMemory_v2_t| {
        // SAFETY: `memory` lives for the call.
        unsafe { nvmlDeviceGetMemoryInfo_v2(device, memory) }
    };
    assert_eq!(
        memory_of(&mut memory),
        code::ARGUMENT_VERSION_MISMATCH,
        "version 0 is refused"
    );
    memory.version = (size_of::<nvmlMemory_v2_t>() | (2 << 24)) as c_uint;
    assert_eq!(memory_of(&mut memory), code::SUCCESS);
    assert_eq!(
        (memory.total, memory.used, memory.free),
        (1 << 30, 4096, (1 << 30) - 4096)
    );

    // The count first (no room, no array), then the list.
    let mut room: c_uint = 0;
    // SAFETY: `room` lives for the call; no array is passed with room 0.
    let asked =
        unsafe { nvmlDeviceGetComputeRunningProcesses_v3(device, &mut room, std::ptr::null_mut()) };
    assert_eq!((asked, room), (code::INSUFFICIENT_SIZE, 1));
    // SAFETY: nvmlProcessInfo_t is plain integers.
    let mut infos: Vec<nvmlProcessInfo_t> = vec![unsafe { std::mem::zeroed() }; 3];
    room = 3;
    // SAFETY: `infos` holds `room` entries.
    let listed =
        unsafe { nvmlDeviceGetComputeRunningProcesses_v3(device, &mut room, infos.as_mut_ptr()) };
    assert_eq!((listed, room), (code::SUCCESS, 1));
    assert_eq!(
        (infos[0].pid, infos[0].usedGpuMemory),
        (std::process::id(), 4096)
    );

    // SAFETY: nvmlErrorString returns a static NUL-terminated string.
    let text = unsafe { CStr::from_ptr(nvmlErrorString(code::DRIVER_NOT_LOADED)) };
    assert_eq!(text, c"Driver Not Loaded");
    assert_eq!(nvmlShutdown(), code::SUCCESS);
    assert_eq!(count_of(&mut count), code::UNINITIALIZED);
}
