//! Finding processes: the shims of one containerd instance, a process's memory (RSS and PSS), and whether
//! its cgroup is frozen.

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

/// The freezer cgroup of `pid` (v1 `freezer.state`, or v2 `cgroup.events`); the root's when `pid` is gone.
pub fn freezer_file(pid: u32) -> std::path::PathBuf {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next(), parts.next(), parts.next().unwrap_or("/"));
        if controllers.is_some_and(|c| c.split(',').any(|c| c == "freezer")) {
            return std::path::PathBuf::from(format!("/sys/fs/cgroup/freezer{path}/freezer.state"));
        }
    }
    let v2 = text
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .unwrap_or("/");
    std::path::PathBuf::from(format!("/sys/fs/cgroup/unified{v2}/cgroup.events"))
}

/// Whether the kernel reports `pid`'s cgroup frozen.
pub fn cgroup_frozen(pid: u32) -> bool {
    let file = freezer_file(pid);
    let text = std::fs::read_to_string(&file).unwrap_or_default();
    if file.ends_with("freezer.state") {
        text.trim() == "FROZEN"
    } else {
        text.lines().any(|l| l == "frozen 1")
    }
}
