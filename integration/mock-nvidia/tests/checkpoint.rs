//! `baton-mock-cuda-checkpoint` (the `cuda-checkpoint` stand-in) driving a training `baton-mock-cuda`
//! against the mock driver through a real FUSE mount: the lock / checkpoint / restore / unlock cycle with
//! the device files really closed and reopened, the weights verified, wrong-state and injected failures,
//! a process that exits at restore, a lock that times out, `--toggle`, pids that are not mock CUDA, and a
//! workload in its own pid and mount namespace (reached through `/proc/PID/root`, as in a container).

mod common;

use std::path::Path;
use std::process::Command;

use baton_mock_nvidia::workload::park::QUERY_CONTROLS;
use baton_mock_nvidia::workload::{WorkloadOptions, WorkloadProcess, process};
use common::trainer::{
    MIB, VERSION, action, checkpoint_binary, children, device_fds, fails, restored_line,
    start_command, start_trainer, state, stop, succeeds, trainer_options,
};
use common::{Mock, TIMEOUT, cuda_binary, skip};

/// NVIDIA fds a set-up trainer holds: nvidiactl, nvidia0, two nvidia-uvm, the OS-event fd and its dup.
const NVIDIA_FDS: usize = 6;

#[test]
fn full_cycle_releases_the_gpu_and_restores_the_weights() {
    if skip("full_cycle_releases_the_gpu_and_restores_the_weights") {
        return;
    }
    let mock = Mock::mount(VERSION, 4096);
    let mut trainer = start_trainer(&mock, &[]);
    let pid = trainer.pid();
    assert_eq!(state(pid), "running\n");
    assert_eq!(device_fds(pid, mock.dir()), NVIDIA_FDS);

    action(pid, "lock");
    trainer.wait_for_line("locked", TIMEOUT).unwrap();
    assert_eq!(state(pid), "locked\n");
    let controls_at_lock = mock.state().totals.controls;

    // 512 MiB at the default 4096 MiB/s: the copy takes a while, and the stopped trainer makes no call.
    action(pid, "checkpoint");
    trainer.wait_for_line("checkpointed", TIMEOUT).unwrap();
    assert_eq!(state(pid), "checkpointed\n");
    assert_eq!(device_fds(pid, mock.dir()), 0, "every NVIDIA fd is closed");
    let released = mock.idle_state();
    assert!(released.files.is_empty(), "{:#?}", released.files);
    assert_eq!(released.vram_used_bytes, 0);
    assert_eq!(
        released.totals.controls,
        controls_at_lock + QUERY_CONTROLS,
        "no step while locked: only the park's own driver queries"
    );

    action(pid, "restore");
    trainer.wait_for_line(&restored_line(), TIMEOUT).unwrap();
    assert_eq!(state(pid), "locked\n");
    assert_eq!(
        device_fds(pid, mock.dir()),
        NVIDIA_FDS,
        "the device files are open again"
    );
    let restored = mock.state();
    assert_eq!(restored.vram_used_bytes, 512 * MIB);

    action(pid, "unlock");
    trainer.wait_for_line("unlocked", TIMEOUT).unwrap();
    assert_eq!(state(pid), "running\n");
    // Training resumes.
    mock.state_when(|s| s.totals.controls > restored.totals.controls);

    let finished = stop(trainer);
    assert!(finished.status.success(), "{finished:#?}");
    let summary = finished.summary.expect("summary");
    assert_eq!((summary.releases, summary.reacquires), (1, 1));
    assert!(mock.idle_state().files.is_empty());
}

#[test]
fn the_gpu_is_released_at_the_end_of_the_copy() {
    if skip("the_gpu_is_released_at_the_end_of_the_copy") {
        return;
    }
    let mock = Mock::mount(VERSION, 4096);
    // 512 MiB at 256 MiB/s: a two-second copy; the test looks halfway, a second before the end.
    let mut trainer = start_trainer(&mock, &["--copy-mib-per-s", "256"]);
    let pid = trainer.pid();
    action(pid, "lock");
    let mut checkpoint = Command::new(checkpoint_binary())
        .args(["--action", "checkpoint", "--pid", &pid.to_string()])
        .spawn()
        .expect("start the checkpoint");
    trainer
        .wait_for_line("copying to host: 256 of 512 MiB", TIMEOUT)
        .unwrap();
    assert_eq!(
        device_fds(pid, mock.dir()),
        NVIDIA_FDS - 2,
        "still on the GPU halfway through the copy: only the OS-event fds, closed first, are gone"
    );
    assert_eq!(mock.state().vram_used_bytes, 512 * MIB);
    assert!(checkpoint.wait().unwrap().success());
    assert_eq!(device_fds(pid, mock.dir()), 0, "released after the copy");
    assert_eq!(state(pid), "checkpointed\n");
    let finished = stop(trainer);
    assert!(finished.status.success(), "{finished:#?}");
}

#[test]
fn actions_in_the_wrong_state_are_refused() {
    if skip("actions_in_the_wrong_state_are_refused") {
        return;
    }
    let mock = Mock::mount(VERSION, 4096);
    let trainer = start_trainer(&mock, &[]);
    let pid = trainer.pid();
    for (name, needs) in [
        ("checkpoint", "locked"),
        ("restore", "checkpointed"),
        ("unlock", "locked"),
    ] {
        assert_eq!(
            fails(pid, &["--action", name]),
            format!(
                "cuda-checkpoint: {name} of pid {pid} failed: {name} needs a {needs} process; state is running"
            )
        );
    }
    action(pid, "lock");
    assert_eq!(
        fails(pid, &["--action", "lock"]),
        format!(
            "cuda-checkpoint: lock of pid {pid} failed: lock needs a running process; state is locked"
        )
    );
    assert_eq!(
        fails(pid, &["--action", "restore"]),
        format!(
            "cuda-checkpoint: restore of pid {pid} failed: restore needs a checkpointed process; state is locked"
        )
    );
    assert_eq!(state(pid), "locked\n");
    assert_eq!(device_fds(pid, mock.dir()), NVIDIA_FDS);
    action(pid, "unlock");
    assert!(stop(trainer).status.success());
}

#[test]
fn an_injected_failure_changes_nothing() {
    if skip("an_injected_failure_changes_nothing") {
        return;
    }
    let mock = Mock::mount(VERSION, 4096);
    let steps = ["lock", "checkpoint", "restore", "unlock"];
    for (index, failing) in steps.iter().enumerate() {
        let trainer = start_trainer(&mock, &["--fail-at", failing]);
        let pid = trainer.pid();
        for before in &steps[..index] {
            action(pid, before);
        }
        let state_before = state(pid);
        let fds_before = device_fds(pid, mock.dir());
        assert_eq!(
            fails(pid, &["--action", failing]),
            format!(
                "cuda-checkpoint: {failing} of pid {pid} failed: mock failure injected at {failing}"
            )
        );
        assert_eq!(state(pid), state_before, "{failing}");
        assert_eq!(device_fds(pid, mock.dir()), fds_before, "{failing}");
        let finished = stop(trainer);
        assert!(finished.status.success(), "{failing}: {finished:#?}");
    }
}

/// cuda-checkpoint leaves a process CHECKPOINTED when its restore runs out of GPU memory
/// (/work/shared/reference/nvidia-driver.md; no recording covers it): the agent tries a resume again later,
/// which must then find the process as it was parked.
#[test]
fn a_restore_the_gpu_has_no_room_for_leaves_it_checkpointed_and_a_later_one_restores() {
    if skip("a_restore_the_gpu_has_no_room_for_leaves_it_checkpointed_and_a_later_one_restores") {
        return;
    }
    let mock = Mock::mount(VERSION, 1024);
    let mut trainer = start_trainer(&mock, &[]);
    let pid = trainer.pid();
    action(pid, "lock");
    action(pid, "checkpoint");
    assert_eq!(mock.idle_state().vram_used_bytes, 0);
    // Another process takes 768 MiB of the 1024 while it is parked: its 512 no longer fit.
    let mut other = WorkloadOptions {
        vram_mib: 768,
        ..trainer_options(&mock)
    };
    other.steps = 0;
    let other = start_command(Command::new(cuda_binary()).args(process::args(&other, false)));
    assert_eq!(mock.state().vram_used_bytes, 768 * MIB);

    let error = fails(pid, &["--action", "restore"]);
    assert!(
        error.contains("NV_ERR_INSUFFICIENT_RESOURCES") && error.contains("still checkpointed"),
        "{error}"
    );
    assert_eq!(state(pid), "checkpointed\n");
    assert_eq!(
        device_fds(pid, mock.dir()),
        0,
        "what the attempt opened is closed"
    );
    mock.releases_delivered();
    assert_eq!(
        mock.state().vram_used_bytes,
        768 * MIB,
        "nothing of the attempt is left"
    );

    // Once the other one has gone, the same restore succeeds, weights intact.
    let gone = stop(other);
    assert!(gone.status.success(), "{gone:#?}");
    assert_eq!(mock.idle_state().vram_used_bytes, 0);
    action(pid, "restore");
    trainer.wait_for_line(&restored_line(), TIMEOUT).unwrap();
    assert_eq!(device_fds(pid, mock.dir()), NVIDIA_FDS);
    action(pid, "unlock");
    let finished = stop(trainer);
    let summary = finished.summary.expect("summary");
    assert_eq!((summary.releases, summary.reacquires), (1, 1));
    // The refused allocation is the one RM call that did not return NV_OK (and so the exit is not 0).
    let failed: Vec<(&str, u32)> = summary
        .failed_statuses
        .iter()
        .map(|f| (f.call.as_str(), f.status))
        .collect();
    assert_eq!(
        failed,
        [(
            "RM_ALLOC NV01_MEMORY_LOCAL_USER",
            baton_nvidia::status::NV_ERR_INSUFFICIENT_RESOURCES
        )]
    );
}

#[test]
fn a_process_that_exits_at_restore_is_reported_gone() {
    if skip("a_process_that_exits_at_restore_is_reported_gone") {
        return;
    }
    let mock = Mock::mount(VERSION, 4096);
    let trainer = start_trainer(&mock, &["--exit-at-restore", "7"]);
    let pid = trainer.pid();
    action(pid, "lock");
    action(pid, "checkpoint");
    assert_eq!(
        fails(pid, &["--action", "restore"]),
        format!("cuda-checkpoint: restore of pid {pid} failed: process {pid} has exited")
    );
    // Not reaped yet: a zombie.
    assert_eq!(
        fails(pid, &["--get-state"]),
        format!("cuda-checkpoint: get-state of pid {pid} failed: process {pid} has exited")
    );
    let finished = trainer.finish(TIMEOUT).unwrap();
    assert_eq!(finished.status.code(), Some(7), "{finished:#?}");
    assert_eq!(
        fails(pid, &["--get-state"]),
        format!("cuda-checkpoint: get-state of pid {pid} failed: no process with pid {pid}")
    );
}

#[test]
fn a_slow_lock_times_out_and_training_goes_on() {
    if skip("a_slow_lock_times_out_and_training_goes_on") {
        return;
    }
    let mock = Mock::mount(VERSION, 4096);
    let trainer = start_trainer(&mock, &["--lock-delay-ms", "500"]);
    let pid = trainer.pid();
    assert_eq!(
        fails(pid, &["--action", "lock", "--timeout", "20"]),
        format!("cuda-checkpoint: lock of pid {pid} failed: lock timed out after 20 ms")
    );
    assert_eq!(state(pid), "running\n");
    let controls = mock.state().totals.controls;
    mock.state_when(|s| s.totals.controls > controls);
    // Without a limit the same lock waits out the delay and succeeds.
    succeeds(pid, &["--action", "lock"]);
    assert_eq!(state(pid), "locked\n");
    action(pid, "unlock");
    assert!(stop(trainer).status.success());
}

#[test]
fn toggle_checkpoints_and_restores() {
    if skip("toggle_checkpoints_and_restores") {
        return;
    }
    let mock = Mock::mount(VERSION, 4096);
    let mut trainer = start_trainer(&mock, &["--copy-mib-per-s", "65536"]);
    let pid = trainer.pid();
    succeeds(pid, &["--toggle"]);
    trainer.wait_for_line("locked", TIMEOUT).unwrap();
    trainer.wait_for_line("checkpointed", TIMEOUT).unwrap();
    assert_eq!(state(pid), "checkpointed\n");
    assert_eq!(device_fds(pid, mock.dir()), 0);
    succeeds(pid, &["--toggle"]);
    trainer.wait_for_line(&restored_line(), TIMEOUT).unwrap();
    trainer.wait_for_line("unlocked", TIMEOUT).unwrap();
    assert_eq!(state(pid), "running\n");
    assert_eq!(device_fds(pid, mock.dir()), NVIDIA_FDS);
    action(pid, "lock");
    assert_eq!(
        fails(pid, &["--toggle"]),
        format!(
            "cuda-checkpoint: toggle of pid {pid} failed: it needs a running or checkpointed process; state is locked"
        )
    );
    action(pid, "unlock");
    assert!(stop(trainer).status.success());
}

#[test]
fn pids_that_are_not_mock_cuda_processes_are_refused() {
    let own = std::process::id();
    let message = fails(own, &["--get-state"]);
    assert!(
        message.starts_with(&format!(
            "cuda-checkpoint: get-state of pid {own} failed: pid {own} is not a CUDA process"
        )),
        "{message}"
    );
    let mut gone = Command::new("true").spawn().expect("run true");
    let gone_pid = gone.id();
    gone.wait().expect("reap true");
    assert_eq!(
        fails(gone_pid, &["--action", "lock"]),
        format!("cuda-checkpoint: lock of pid {gone_pid} failed: no process with pid {gone_pid}")
    );
    assert_eq!(
        fails(own, &["--action", "checkpoint", "--timeout", "5"]),
        "cuda-checkpoint: --timeout applies to --action lock only"
    );
}

/// The host pid of the one child of `parent` (unshare's forked child).
fn only_child(parent: u32) -> u32 {
    children(parent)
        .first()
        .copied()
        .unwrap_or_else(|| panic!("unshare {parent} has no child"))
}

fn ns_pid(pid: u32) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read status");
    status
        .lines()
        .find_map(|line| line.strip_prefix("NSpid:"))
        .and_then(|pids| pids.split_whitespace().next_back())
        .expect("an NSpid line")
        .to_owned()
}

#[test]
fn a_process_in_its_own_pid_and_mount_namespace_is_reached_through_proc_root() {
    if skip("a_process_in_its_own_pid_and_mount_namespace_is_reached_through_proc_root") {
        return;
    }
    let mock = Mock::mount(VERSION, 4096);
    let options = trainer_options(&mock);
    // Like a container: its own pid namespace, and a socket folder only its mount namespace sees.
    let mut command = Command::new("unshare");
    command
        .args([
            "--pid",
            "--kill-child",
            "--mount",
            "--propagation",
            "private",
        ])
        .args(["sh", "-c"])
        .arg(
            "mkdir -p /tmp/baton-mock-cuda && mount -t tmpfs mock-cuda /tmp/baton-mock-cuda \
             && exec \"$0\" \"$@\"",
        )
        .arg(cuda_binary())
        .args(process::args(&options, false));
    let mut trainer =
        WorkloadProcess::start_command(&mut command, Path::new("unshare")).expect("start unshare");
    trainer
        .wait_for_line("phase setup-done", TIMEOUT)
        .expect("trainer set up");
    let pid = only_child(trainer.pid());
    assert_eq!(ns_pid(pid), "1", "pid 1 of its own namespace");
    assert!(
        !Path::new("/tmp/baton-mock-cuda/1.sock").exists(),
        "the socket is not visible from the host's mount namespace"
    );

    assert_eq!(state(pid), "running\n");
    action(pid, "lock");
    action(pid, "checkpoint");
    assert_eq!(state(pid), "checkpointed\n");
    assert_eq!(device_fds(pid, mock.dir()), 0);
    action(pid, "restore");
    trainer.wait_for_line(&restored_line(), TIMEOUT).unwrap();
    action(pid, "unlock");
    assert_eq!(state(pid), "running\n");
    assert_eq!(device_fds(pid, mock.dir()), NVIDIA_FDS);
}
