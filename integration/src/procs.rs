//! Finding processes: the shims of one containerd instance, and a process's memory (RSS and PSS).

use std::path::Path;

/// A process found by a scan of /proc.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    /// Its pid.
    pub pid: i32,
    /// Its command line.
    pub cmdline: Vec<String>,
}

/// Every live `containerd-shim*` process started for the containerd listening on `socket`
/// (the shim's `-address` argument is that socket).
pub fn shims_of(socket: &Path) -> Vec<Found> {
    let socket = socket.to_string_lossy();
    scan(|cmdline| {
        let is_shim = cmdline
            .first()
            .and_then(|arg0| Path::new(arg0).file_name())
            .is_some_and(|name| name.to_string_lossy().starts_with("containerd-shim"));
        is_shim && cmdline.iter().any(|arg| *arg == socket)
    })
}

/// Every live process whose command line satisfies `keep` (zombies and vanished processes are left out).
pub fn scan(keep: impl Fn(&[String]) -> bool) -> Vec<Found> {
    let Ok(all) = procfs::process::all_processes() else {
        return Vec::new();
    };
    all.filter_map(Result::ok)
        .filter(|process| process.stat().is_ok_and(|stat| stat.state != 'Z'))
        .filter_map(|process| {
            let cmdline = process.cmdline().ok()?;
            keep(&cmdline).then_some(Found {
                pid: process.pid,
                cmdline,
            })
        })
        .collect()
}

/// Resident set size of `pid` in bytes (VmRSS), or `None` when the process is gone.
pub fn rss_bytes(pid: i32) -> Option<u64> {
    let status = procfs::process::Process::new(pid).ok()?.status().ok()?;
    status.vmrss.map(|kib| kib * 1024)
}

/// Proportional set size of `pid` in bytes (`Pss` in /proc/PID/smaps_rollup: each shared page counted as
/// its share among the processes mapping it, so the sum over processes is what they really occupy), or
/// `None` when the process is gone.
pub fn pss_bytes(pid: i32) -> Option<u64> {
    let rollup = procfs::process::Process::new(pid)
        .ok()?
        .smaps_rollup()
        .ok()?;
    rollup
        .memory_map_rollup
        .iter()
        .map(|map| map.extension.map.get("Pss").copied())
        .sum()
}

/// Whether `pid` is alive (exists and is not a zombie).
pub fn alive(pid: i32) -> bool {
    procfs::process::Process::new(pid)
        .and_then(|process| process.stat())
        .is_ok_and(|stat| stat.state != 'Z')
}

/// Voluntary plus involuntary context switches so far of every thread of `pid` (0 when it is gone).
pub fn context_switches(pid: i32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("status")).ok())
        .map(|s| {
            s.lines()
                .filter(|l| l.contains("ctxt_switches:"))
                .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                .sum::<u64>()
        })
        .sum()
}
