//! A training `baton-mock-cuda` driven by the `cuda-checkpoint` stand-in, and what /proc shows of a process:
//! its fds and its mappings.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use baton_mock_nvidia::workload::weights::{DEFAULT_SEED, Weights};
use baton_mock_nvidia::workload::{Finished, WorkloadOptions, WorkloadProcess, process};
use nix::sys::signal::Signal;

use super::{Mock, TIMEOUT, cuda_binary};

/// The driver version the trainers use.
pub const VERSION: &str = "595.45.04";
/// A mebibyte.
pub const MIB: u64 = 1024 * 1024;

/// The stand-in built with these tests.
pub fn checkpoint_binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_baton-mock-cuda-checkpoint"))
}

/// Options of a trainer against `mock`: steps until stopped, 5 ms each, 512 MiB.
pub fn trainer_options(mock: &Mock) -> WorkloadOptions {
    WorkloadOptions {
        steps: 0,
        step_ms: 5,
        ..mock.workload(VERSION)
    }
}

/// Starts a trainer that steps until stopped, with `extra` flags, and waits until it is set up.
pub fn start_trainer(mock: &Mock, extra: &[&str]) -> WorkloadProcess {
    let mut command = Command::new(cuda_binary());
    command
        .args(process::args(&trainer_options(mock), false))
        .args(extra);
    start_command(&mut command)
}

/// Starts a trainer through `command` (the trainer's own command line, or a wrapper that ends by exec'ing
/// it) and waits until it is set up.
pub fn start_command(command: &mut Command) -> WorkloadProcess {
    let mut trainer =
        WorkloadProcess::start_command(command, &cuda_binary()).expect("start baton-mock-cuda");
    trainer
        .wait_for_line("phase setup-done", TIMEOUT)
        .expect("trainer set up");
    trainer
}

/// Runs the stand-in with `args` on `pid`.
pub fn cuda_checkpoint(pid: u32, args: &[&str]) -> Output {
    Command::new(checkpoint_binary())
        .args(args)
        .args(["--pid", &pid.to_string()])
        .output()
        .expect("run baton-mock-cuda-checkpoint")
}

/// Runs the stand-in and asserts that it succeeded quietly.
pub fn succeeds(pid: u32, args: &[&str]) {
    let output = cuda_checkpoint(pid, args);
    assert!(output.status.success(), "{args:?}: {output:?}");
    assert!(
        output.stdout.is_empty() && output.stderr.is_empty(),
        "{output:?}"
    );
}

/// Runs the stand-in, asserts that it failed with one line on stderr, and returns that line.
pub fn fails(pid: u32, args: &[&str]) -> String {
    fails_with(pid, args).0
}

/// [`fails`], with the exit code.
pub fn fails_with(pid: u32, args: &[&str]) -> (String, Option<i32>) {
    let output = cuda_checkpoint(pid, args);
    assert!(!output.status.success(), "{args:?} should fail: {output:?}");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(stderr.lines().count(), 1, "{stderr:?}");
    (stderr.trim_end().to_owned(), output.status.code())
}

/// The stand-in's `--get-state` of `pid` (which must succeed).
pub fn state(pid: u32) -> String {
    let output = cuda_checkpoint(pid, &["--get-state"]);
    assert!(output.status.success(), "{output:?}");
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// `--action NAME`, which must succeed quietly.
pub fn action(pid: u32, name: &str) {
    succeeds(pid, &["--action", name]);
}

/// The process's fds that point into the mock's device folder.
pub fn device_fds(pid: u32, dev_dir: &Path) -> usize {
    fd_links(pid)
        .values()
        .filter(|target| Path::new(target).starts_with(dev_dir))
        .count()
}

/// The process's fd table: fd number -> what it links to (`/path`, `anon_inode:[eventfd]`, ...).
pub fn fd_links(pid: u32) -> BTreeMap<i32, String> {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("read the fd table")
        .filter_map(|entry| {
            let entry = entry.ok()?;
            let number = entry.file_name().to_str()?.parse().ok()?;
            let target = std::fs::read_link(entry.path()).ok()?;
            Some((number, target.to_string_lossy().into_owned()))
        })
        .collect()
}

/// The numbers of the fds of `pid` that link to `name` in `dev_dir`.
pub fn fds_of(pid: u32, dev_dir: &Path, name: &str) -> Vec<i32> {
    let path = dev_dir.join(name);
    fd_links(pid)
        .into_iter()
        .filter(|(_, target)| Path::new(target) == path)
        .map(|(number, _)| number)
        .collect()
}

/// One line of /proc/PID/maps.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MapLine {
    /// First address.
    pub start: u64,
    /// First address past the end.
    pub end: u64,
    /// `rw-s`, `---p`, ...
    pub perms: String,
    /// The inode (0 for anonymous memory).
    pub inode: u64,
    /// The path, empty for anonymous memory.
    pub path: String,
}

/// The process's mappings.
pub fn maps(pid: u32) -> Vec<MapLine> {
    std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .expect("read the maps")
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let (start, end) = fields.next()?.split_once('-')?;
            let perms = fields.next()?.to_owned();
            let inode = fields.nth(2)?.parse().ok()?;
            Some(MapLine {
                start: u64::from_str_radix(start, 16).ok()?,
                end: u64::from_str_radix(end, 16).ok()?,
                perms,
                inode,
                path: fields.collect::<Vec<_>>().join(" "),
            })
        })
        .collect()
}

/// The process's mappings of files in `dev_dir`.
pub fn device_maps(pid: u32, dev_dir: &Path) -> Vec<MapLine> {
    maps(pid)
        .into_iter()
        .filter(|line| Path::new(&line.path).starts_with(dev_dir))
        .collect()
}

/// A field of /proc/PID/status in kB (`VmRSS`, ...).
pub fn status_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .expect("read the status")
        .lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|value| value.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

/// The line a restore with intact weights prints.
pub fn restored_line() -> String {
    format!(
        "restored checksum {:#010x} intact",
        Weights::new(DEFAULT_SEED).checksum()
    )
}

/// SIGTERM, then waits for the trainer to end.
pub fn stop(trainer: WorkloadProcess) -> Finished {
    trainer
        .signal(Signal::SIGTERM)
        .expect("SIGTERM the trainer");
    trainer.finish(TIMEOUT).expect("trainer exits")
}

/// The pids of `parent`'s children.
pub fn children(parent: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|pid| pid.parse().ok())
        .collect()
}
