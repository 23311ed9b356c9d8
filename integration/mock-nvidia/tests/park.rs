//! The park and the resume as the H200 recorded them with driver 580.159.04 (/work/shared/gpu/580.159.04/),
//! seen from outside the trainer through /proc and the mock's state: after a park no NVIDIA fd is left
//! (the uvm and OS-event numbers are kept by eventfds) and each device mapping is an anonymous PROT_NONE
//! range at the same address; a resume puts those fd numbers and addresses back. A worker forked after CUDA
//! init keeps the inherited files and mappings (the MADV_DONTFORK one excepted), has no CUDA state
//! (`CUDA_ERROR_NOT_INITIALIZED`, exit code 3), lets its parent's park free the GPU, and dies with its
//! parent. The host copy is charged to the parked process: its resident memory grows by the copy, and a
//! memory limit below the copy gets it OOM-killed.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use baton_mock_nvidia::workload::{MAP_BYTES, SYSTEM_MAP_BYTES, process};
use common::trainer::{
    MIB, MapLine, VERSION, action, children, cuda_checkpoint, device_maps, fails, fails_with,
    fd_links, fds_of, maps, restored_line, start_command, start_trainer, state, status_kib, stop,
    trainer_options,
};
use common::{Mock, TIMEOUT, cuda_binary, skip};

/// NVIDIA fds a set-up trainer holds: nvidiactl, nvidia0, two nvidia-uvm, the OS-event fd and its dup.
const NVIDIA_FDS: usize = 6;

/// Whether `range` lies inside one anonymous PROT_NONE line of `lines` (neighbouring reservations may merge).
fn reserved(lines: &[MapLine], range: &MapLine) -> bool {
    lines.iter().any(|line| {
        line.start <= range.start
            && range.end <= line.end
            && line.perms == "---p"
            && line.inode == 0
            && line.path.is_empty()
    })
}

/// The device mappings' address ranges.
fn ranges(lines: &[MapLine]) -> Vec<(u64, u64)> {
    lines.iter().map(|line| (line.start, line.end)).collect()
}

#[test]
fn a_park_leaves_prot_none_reservations_and_no_nvidia_fd_and_a_resume_puts_them_back() {
    if skip("a_park_leaves_prot_none_reservations_and_no_nvidia_fd_and_a_resume_puts_them_back") {
        return;
    }
    let mock = Mock::mount(VERSION, 4096);
    let mut trainer = start_trainer(&mock, &[]);
    let pid = trainer.pid();
    let running = device_maps(pid, mock.dir());
    let mut sizes: Vec<u64> = running.iter().map(|l| l.end - l.start).collect();
    sizes.sort_unstable();
    assert_eq!(
        sizes,
        [SYSTEM_MAP_BYTES as u64, MAP_BYTES as u64],
        "system and video memory mapped: {running:#?}"
    );
    let fds_running = fd_links(pid);
    let uvm = fds_of(pid, mock.dir(), "nvidia-uvm");
    assert_eq!(uvm.len(), 2);
    assert_eq!(
        fds_of(pid, mock.dir(), "nvidia0").len() + fds_of(pid, mock.dir(), "nvidiactl").len(),
        NVIDIA_FDS - 2
    );

    action(pid, "lock");
    action(pid, "checkpoint");
    trainer.wait_for_line("checkpointed", TIMEOUT).unwrap();
    let parked = maps(pid);
    assert!(
        !parked
            .iter()
            .any(|line| Path::new(&line.path).starts_with(mock.dir())),
        "no device mapping is left: {parked:#?}"
    );
    for range in &running {
        assert!(
            reserved(&parked, range),
            "{range:?} is an anonymous PROT_NONE reservation at the same address: {parked:#?}"
        );
    }
    let fds_parked = fd_links(pid);
    assert!(
        !fds_parked
            .values()
            .any(|target| Path::new(target).starts_with(mock.dir())),
        "no NVIDIA fd is left: {fds_parked:?}"
    );
    // The uvm fds' numbers and the OS-event dup's are kept by eventfds; nvidiactl's and nvidia0's are not.
    let placeholders: Vec<i32> = fds_parked
        .iter()
        .filter(|(number, target)| {
            target.as_str() == "anon_inode:[eventfd]" && fds_running.contains_key(number)
        })
        .map(|(number, _)| *number)
        .collect();
    assert_eq!(placeholders.len(), 3, "{fds_parked:?}");
    for number in &uvm {
        assert!(placeholders.contains(number), "{number}: {fds_parked:?}");
    }
    let driver = mock.idle_state();
    assert!(driver.files.is_empty(), "{:#?}", driver.files);
    assert_eq!(driver.vram_used_bytes, 0);

    action(pid, "restore");
    trainer.wait_for_line(&restored_line(), TIMEOUT).unwrap();
    action(pid, "unlock");
    let resumed = device_maps(pid, mock.dir());
    assert_eq!(
        ranges(&resumed),
        ranges(&running),
        "every mapping back at its address"
    );
    let fds_resumed = fd_links(pid);
    for number in &placeholders {
        assert_eq!(
            fds_resumed.get(number),
            fds_running.get(number),
            "fd {number} holds the same file again"
        );
    }
    assert_eq!(fds_of(pid, mock.dir(), "nvidia-uvm"), uvm);
    assert_eq!(
        fds_resumed
            .values()
            .filter(|target| Path::new(target).starts_with(mock.dir()))
            .count(),
        NVIDIA_FDS
    );
    assert_eq!(mock.state().vram_used_bytes, 512 * MIB);

    let finished = stop(trainer);
    assert!(finished.status.success(), "{finished:#?}");
    let summary = finished.summary.expect("summary");
    assert!(summary.all_ok(), "{:?}", summary.failed_statuses);
    assert_eq!((summary.releases, summary.reacquires), (1, 1));
    // RM_UNMAP_MEMORY came only from the final teardown's two unmaps: the park made none.
    assert_eq!(summary.escapes.get("NV_ESC_RM_UNMAP_MEMORY"), Some(&2));
    assert!(mock.idle_state().files.is_empty());
}

/// The worker `trainer` forked (its only child).
fn worker_of(trainer: u32) -> u32 {
    let children = children(trainer);
    assert_eq!(children.len(), 1, "one worker: {children:?}");
    children[0]
}

/// Waits until no process `pid` is left (gone or reaped); whether it went within [`TIMEOUT`].
fn gone(pid: u32) -> bool {
    let deadline = Instant::now() + TIMEOUT;
    while Instant::now() < deadline {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status"));
        match status {
            Err(_) => return true,
            // A zombie holds nothing; its parent (init, for an orphan) reaps it.
            Ok(text)
                if text
                    .lines()
                    .any(|l| l.starts_with("State:") && l.contains('Z')) =>
            {
                return true;
            }
            Ok(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
    false
}

#[test]
fn a_forked_worker_keeps_the_files_has_no_cuda_state_and_dies_with_its_parent() {
    if skip("a_forked_worker_keeps_the_files_has_no_cuda_state_and_dies_with_its_parent") {
        return;
    }
    let mock = Mock::mount(VERSION, 4096);
    let mut trainer = start_trainer(&mock, &["--fork-worker"]);
    let pid = trainer.pid();
    let worker = worker_of(pid);
    // Every NVIDIA fd is inherited at its number; every mapping but the MADV_DONTFORK one.
    let device_fds = |pid| {
        fd_links(pid)
            .into_iter()
            .filter(|(_, target)| Path::new(target).starts_with(mock.dir()))
            .collect::<Vec<_>>()
    };
    assert_eq!(device_fds(worker), device_fds(pid));
    assert_eq!(device_fds(worker).len(), NVIDIA_FDS);
    let parent_maps = device_maps(pid, mock.dir());
    let worker_maps = device_maps(worker, mock.dir());
    assert_eq!(parent_maps.len(), 2);
    assert_eq!(
        ranges(&worker_maps),
        ranges(&parent_maps)
            .into_iter()
            .filter(|(start, end)| end - start == MAP_BYTES as u64)
            .collect::<Vec<_>>(),
        "the video memory mapping only"
    );

    // No CUDA state: the stand-in fails as cuda-checkpoint does, with CUDA_ERROR_NOT_INITIALIZED's code.
    for (args, what) in [
        (&["--get-state"][..], "get-state"),
        (&["--action", "lock"][..], "lock"),
        (&["--action", "checkpoint"][..], "checkpoint"),
    ] {
        let (line, code) = fails_with(worker, args);
        assert!(
            line.starts_with(&format!(
                "cuda-checkpoint: {what} of pid {worker} failed: CUDA_ERROR_NOT_INITIALIZED (initialization error)"
            )),
            "{line}"
        );
        assert_eq!(code, Some(3), "{line}");
    }

    // The parent's park frees the GPU while the worker still holds its files and its mapping.
    action(pid, "lock");
    action(pid, "checkpoint");
    trainer.wait_for_line("checkpointed", TIMEOUT).unwrap();
    let driver = mock.state_when(|s| s.vram_used_bytes == 0 && s.clients().count() == 0);
    assert_eq!(driver.vram_used_bytes, 0);
    assert_eq!(driver.clients().count(), 0, "{:#?}", driver.files);
    assert!(
        driver.files.iter().all(|f| f.mappings.is_empty()),
        "{:#?}",
        driver.files
    );
    assert!(!driver.files.is_empty(), "the worker holds the files open");
    assert_eq!(device_fds(worker).len(), NVIDIA_FDS);
    assert_eq!(ranges(&device_maps(worker, mock.dir())).len(), 1);
    assert_eq!(state(pid), "checkpointed\n");

    action(pid, "restore");
    trainer.wait_for_line(&restored_line(), TIMEOUT).unwrap();
    action(pid, "unlock");
    assert_eq!(mock.state().vram_used_bytes, 512 * MIB);

    // Stopped, the parent takes its worker with it.
    let finished = stop(trainer);
    assert!(finished.status.success(), "{finished:#?}");
    assert!(
        finished.lines.iter().any(|l| l == "worker exited"),
        "{finished:#?}"
    );
    assert!(gone(worker), "the worker outlived its parent");
    assert!(mock.idle_state().files.is_empty());

    // Killed, too: the kernel kills the worker with it.
    let trainer = start_trainer(&mock, &["--fork-worker"]);
    let worker = worker_of(trainer.pid());
    trainer
        .signal(nix::sys::signal::Signal::SIGKILL)
        .expect("SIGKILL the trainer");
    drop(trainer.finish(TIMEOUT).expect("the trainer is reaped"));
    assert!(gone(worker), "the worker survived its parent as an orphan");
    assert!(mock.idle_state().files.is_empty());
}

#[test]
fn the_host_copy_is_charged_to_the_parked_process_until_the_restore() {
    if skip("the_host_copy_is_charged_to_the_parked_process_until_the_restore") {
        return;
    }
    let mock = Mock::mount(VERSION, 4096);
    let mut trainer = start_trainer(&mock, &[]);
    let pid = trainer.pid();
    let copy_kib = 512 * 1024;
    let before = status_kib(pid, "VmRSS");
    action(pid, "lock");
    action(pid, "checkpoint");
    trainer.wait_for_line("checkpointed", TIMEOUT).unwrap();
    let parked = status_kib(pid, "VmRSS");
    assert!(
        parked >= before + copy_kib,
        "resident memory grew by the 512 MiB copy: {before} kB -> {parked} kB"
    );
    action(pid, "restore");
    trainer.wait_for_line(&restored_line(), TIMEOUT).unwrap();
    let restored = status_kib(pid, "VmRSS");
    assert!(
        restored < before + copy_kib / 2,
        "the copy is freed by the restore: {before} kB -> {parked} kB -> {restored} kB"
    );
    action(pid, "unlock");
    assert!(stop(trainer).status.success());
}

/// A memory cgroup with a limit, removed on drop (once its processes are gone).
struct MemoryCgroup {
    path: PathBuf,
    /// The file counting OOM kills (`oom_kill N` in it).
    events: PathBuf,
}

impl MemoryCgroup {
    /// A new memory cgroup limited to `bytes`: cgroup v2 (`memory.max`) when /sys/fs/cgroup is the unified
    /// hierarchy, else the v1 memory controller's (`memory.limit_in_bytes`). `None` without either.
    fn create(name: &str, bytes: u64) -> Option<Self> {
        let v2 = Path::new("/sys/fs/cgroup/cgroup.controllers");
        let (path, limit, events) = if std::fs::read_to_string(v2)
            .is_ok_and(|controllers| controllers.split_whitespace().any(|c| c == "memory"))
        {
            std::fs::write("/sys/fs/cgroup/cgroup.subtree_control", "+memory").ok()?;
            let path = Path::new("/sys/fs/cgroup").join(name);
            (
                path.clone(),
                path.join("memory.max"),
                path.join("memory.events"),
            )
        } else if Path::new("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists() {
            let path = Path::new("/sys/fs/cgroup/memory").join(name);
            (
                path.clone(),
                path.join("memory.limit_in_bytes"),
                path.join("memory.oom_control"),
            )
        } else {
            return None;
        };
        std::fs::create_dir(&path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
        let cgroup = Self { path, events };
        std::fs::write(&limit, bytes.to_string())
            .unwrap_or_else(|e| panic!("write {}: {e}", limit.display()));
        Some(cgroup)
    }

    /// OOM kills in the cgroup so far.
    fn oom_kills(&self) -> u64 {
        std::fs::read_to_string(&self.events)
            .unwrap_or_default()
            .lines()
            .find_map(|line| line.strip_prefix("oom_kill "))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0)
    }
}

impl Drop for MemoryCgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.path);
    }
}

#[test]
fn a_memory_limit_below_the_host_copy_gets_the_parked_process_oom_killed() {
    if skip("a_memory_limit_below_the_host_copy_gets_the_parked_process_oom_killed") {
        return;
    }
    let name = format!("baton-mock-park-oom-{}", std::process::id());
    let Some(cgroup) = MemoryCgroup::create(&name, 128 * MIB) else {
        baton_prereq::missing("no memory cgroup controller (cgroup v2 or v1) to limit the trainer");
        return;
    };
    let mock = Mock::mount(VERSION, 4096);
    // The trainer joins the cgroup before it execs: 512 MiB of video memory, a 128 MiB limit.
    let procs = cgroup.path.join("cgroup.procs");
    let mut command = Command::new("sh");
    command
        .arg("-c")
        .arg("echo $$ > \"$0\" && exec \"$@\"")
        .arg(&procs)
        .arg(cuda_binary())
        .args(process::args(&trainer_options(&mock), false));
    let trainer = start_command(&mut command);
    let pid = trainer.pid();
    action(pid, "lock");
    let output = cuda_checkpoint(pid, &["--action", "checkpoint"]);
    assert!(!output.status.success(), "{output:?}");
    let finished = trainer.finish(TIMEOUT).expect("the trainer is gone");
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        finished.status.signal(),
        Some(libc::SIGKILL),
        "killed by the kernel: {finished:#?}"
    );
    assert!(cgroup.oom_kills() >= 1, "the kill was an OOM kill");
    assert!(
        !finished.lines.iter().any(|l| l == "checkpointed"),
        "{finished:#?}"
    );
    assert_eq!(
        fails(pid, &["--get-state"]),
        format!("cuda-checkpoint: get-state of pid {pid} failed: no process with pid {pid}")
    );
    assert!(mock.idle_state().files.is_empty());
}
