//! The mock CUDA workload against the mock driver, through a real FUSE mount: statuses, the object tree
//! while it holds, everything freed after teardown, and release / re-acquire through signals.

mod common;

use baton_mock_nvidia::driver::DriverState;
use baton_mock_nvidia::workload::WorkloadProcess;
use baton_nvidia::class;
use common::{Mock, TIMEOUT, cuda_binary, skip};
use nix::sys::signal::Signal;

const VERSION: &str = "595.45.04";
const MIB: u64 = 1024 * 1024;

fn assert_nothing_held(state: &DriverState) {
    assert!(
        state.files.is_empty(),
        "files still open: {:#?}",
        state.files
    );
    assert_eq!(state.vram_used_bytes, 0);
    assert_eq!(
        state.totals.allocs, state.totals.frees,
        "{:?}",
        state.totals
    );
}

#[test]
fn full_run_succeeds_and_leaves_nothing_behind() {
    if skip("full_run_succeeds_and_leaves_nothing_behind") {
        return;
    }
    let mock = Mock::mount(VERSION, 4096);
    let finished = mock.run_workload(&mock.workload(VERSION));
    assert!(finished.status.success(), "{finished:#?}");
    for phase in [
        "phase setup-done",
        "phase steps-done",
        "phase teardown-done",
    ] {
        assert!(
            finished.lines.iter().any(|l| l == phase),
            "{phase} missing: {:?}",
            finished.lines
        );
    }
    let summary = finished.summary.expect("summary line");
    assert!(summary.all_ok(), "{:?}", summary.failed_statuses);
    assert_eq!(summary.allocs_of(class::NV01_ROOT_CLIENT), 1);
    assert_eq!(summary.allocs_of(class::HOPPER_COMPUTE_A), 1);
    assert_eq!(summary.vram_bytes_allocated, 512 * MIB);
    assert_eq!(summary.mmaps, 2, "video memory and system memory");
    assert_eq!(summary.fds_opened.get("nvidia-uvm"), Some(&2));
    let state = mock.idle_state();
    assert_nothing_held(&state);
    // The driver saw every allocation the workload made, and as many controls.
    let workload_allocs: u64 = summary.allocs_by_class.values().sum();
    assert_eq!(state.totals.allocs, workload_allocs);
    assert_eq!(state.totals.controls, summary.controls);
    assert_eq!(state.totals.failed_statuses, 0);
}

#[test]
fn holding_workload_shows_its_object_tree() {
    if skip("holding_workload_shows_its_object_tree") {
        return;
    }
    let mock = Mock::mount(VERSION, 4096);
    let mut workload =
        WorkloadProcess::start(&cuda_binary(), &mock.workload(VERSION), true).unwrap();
    workload.wait_for_line("phase holding", TIMEOUT).unwrap();
    let state = mock.state();
    let pid = workload.pid();
    assert!(
        state.files.iter().all(|f| f.pid == pid),
        "{:#?}",
        state.files
    );
    let ctl = state
        .files_named("nvidiactl")
        .next()
        .expect("nvidiactl open");
    assert_eq!(ctl.clients.len(), 1);
    assert_eq!(ctl.mappings.len(), 2, "video memory and system memory");
    assert_eq!(ctl.attached_gpus.len(), 1);
    let client = &ctl.clients[0];
    let by_class = |class_id| {
        client
            .objects
            .iter()
            .find(|o| o.class == class_id)
            .unwrap_or_else(|| panic!("no object of class {class_id:#x}: {client:#?}"))
    };
    let device = by_class(class::NV01_DEVICE_0);
    assert_eq!(device.parent, client.handle);
    assert_eq!(by_class(class::NV20_SUBDEVICE_0).parent, device.handle);
    assert_eq!(by_class(class::FERMI_VASPACE_A).parent, device.handle);
    let group = by_class(class::KEPLER_CHANNEL_GROUP_A);
    assert_eq!(group.parent, device.handle);
    let channel = by_class(class::HOPPER_CHANNEL_GPFIFO_A);
    assert_eq!(channel.parent, group.handle);
    assert_eq!(by_class(class::HOPPER_COMPUTE_A).parent, channel.handle);
    // The memory size was read from the workload's NV_MEMORY_ALLOCATION_PARAMS behind pAllocParms.
    let memory = by_class(class::NV01_MEMORY_LOCAL_USER);
    assert_eq!((memory.bytes, memory.size_known), (512 * MIB, true));
    assert_eq!(by_class(class::NV01_MEMORY_SYSTEM).parent, device.handle);
    assert_eq!(state.vram_used_bytes, 512 * MIB, "system memory is no VRAM");
    // nvidia0: the device fd and the OS-event fd (both with REGISTER_FD), and the file the video memory
    // mapping holds (its fd was closed once mapped, as libcuda does); nvidiactl: the ctl fd and the system
    // memory mapping's file.
    let gpus: Vec<_> = state.files_named("nvidia0").collect();
    assert_eq!(gpus.len(), 3, "{gpus:#?}");
    assert_eq!(
        gpus.iter()
            .filter(|f| f.registered_ctl_fd.is_some())
            .count(),
        2,
        "REGISTER_FD recorded"
    );
    assert_eq!(state.files_named("nvidiactl").count(), 2);
    assert_eq!(state.files_named("nvidia-uvm").count(), 2);
    let uvm_commands: u64 = state
        .files_named("nvidia-uvm")
        .flat_map(|f| f.uvm_commands.values())
        .sum();
    assert_eq!(
        uvm_commands, 4,
        "INITIALIZE, MM_INITIALIZE, REGISTER_GPU, REGISTER_GPU_VASPACE"
    );

    let finished = workload.finish(TIMEOUT).unwrap();
    assert!(finished.status.success(), "{finished:#?}");
    assert_nothing_held(&mock.idle_state());
}

#[test]
fn release_and_reacquire_through_signals() {
    if skip("release_and_reacquire_through_signals") {
        return;
    }
    let mock = Mock::mount(VERSION, 4096);
    let mut workload =
        WorkloadProcess::start(&cuda_binary(), &mock.workload(VERSION), true).unwrap();
    workload.wait_for_line("phase holding", TIMEOUT).unwrap();
    let held = mock.state();
    assert_eq!(held.vram_used_bytes, 512 * MIB);

    workload.signal(Signal::SIGUSR1).unwrap();
    workload.wait_for_line("released", TIMEOUT).unwrap();
    let released = mock.idle_state();
    assert_nothing_held(&released);
    assert_eq!(
        released.totals.releases, 7,
        "every NVIDIA file was released: nvidiactl, nvidia0, two nvidia-uvm, the OS-event file, and the \
         two files the mappings held"
    );

    workload.signal(Signal::SIGUSR2).unwrap();
    workload.wait_for_line("reacquired", TIMEOUT).unwrap();
    let again = mock.state_when(|s| s.vram_used_bytes > 0);
    assert_eq!(again.vram_used_bytes, 512 * MIB);
    assert_eq!(again.objects().count(), held.objects().count());
    let handle = |state: &DriverState| state.clients().map(|c| c.handle).collect::<Vec<_>>();
    assert_eq!(handle(&again).len(), 1);
    assert_ne!(
        handle(&again),
        handle(&held),
        "a new client after re-acquire"
    );

    let finished = workload.finish(TIMEOUT).unwrap();
    assert!(finished.status.success(), "{finished:#?}");
    let summary = finished.summary.expect("summary");
    assert_eq!((summary.releases, summary.reacquires), (1, 1));
    assert_eq!(summary.allocs_of(class::NV01_MEMORY_LOCAL_USER), 2);
    assert_nothing_held(&mock.idle_state());
}

#[test]
fn sigterm_ends_a_hold_with_an_orderly_teardown() {
    if skip("sigterm_ends_a_hold_with_an_orderly_teardown") {
        return;
    }
    let mock = Mock::mount(VERSION, 4096);
    let mut workload =
        WorkloadProcess::start(&cuda_binary(), &mock.workload(VERSION), true).unwrap();
    workload.wait_for_line("phase holding", TIMEOUT).unwrap();
    workload.signal(Signal::SIGTERM).unwrap();
    workload
        .wait_for_line("phase teardown-done", TIMEOUT)
        .unwrap();
    let finished = workload.finish(TIMEOUT).unwrap();
    assert!(finished.status.success(), "{finished:#?}");
    assert_nothing_held(&mock.idle_state());
}

#[test]
fn vram_exhaustion_fails_the_workload_with_a_status() {
    if skip("vram_exhaustion_fails_the_workload_with_a_status") {
        return;
    }
    let mock = Mock::mount(VERSION, 256);
    let finished = mock.run_workload(&mock.workload(VERSION));
    assert!(
        !finished.status.success(),
        "512 MiB cannot fit in 256 MiB: {finished:#?}"
    );
    let summary = finished.summary.expect("summary");
    let failed = &summary.failed_statuses;
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(
        failed[0].status,
        baton_nvidia::status::NV_ERR_INSUFFICIENT_RESOURCES
    );
    assert_nothing_held(&mock.idle_state());
}
