//! Seeding the fd maps from /proc for processes that opened NVIDIA devices before the probes were attached.
use std::path::Path;

use baton_nvidia::fdkind::{self, FdKind};

use crate::fdtable::Seen;

/// If `path` is one of `prefixes` followed by an NVIDIA device name: what device file it is (kind and
/// minor) and its name.
pub fn classify_path(path: &Path, prefixes: &[String]) -> Option<((FdKind, u8), String)> {
    let s = path.to_str()?;
    prefixes.iter().find_map(|p| {
        let name = s.strip_prefix(p.as_str())?;
        let (kind, minor) = fdkind::classify_name(name.as_bytes())?;
        (kind != FdKind::Unknown).then(|| ((kind, minor), name.to_owned()))
    })
}

/// What /proc showed of one process at one moment: whether it was alive and the NVIDIA fds and device
/// mappings it held. Read with [`read_process`], on any thread; compared with the mirror by
/// [`crate::Tracer::reconcile_reads`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcRead {
    /// The process.
    pub pid: u32,
    /// Whether it was alive (a zombie is not).
    pub alive: bool,
    /// What it held (nothing when it was gone).
    pub seen: Vec<Seen>,
}

/// Reads process `pid` from /proc ([`ProcRead`]).
pub fn read_process(pid: u32, prefixes: &[String]) -> ProcRead {
    let alive = alive(pid);
    let seen = if alive {
        scan_process(pid as i32, prefixes)
    } else {
        Vec::new()
    };
    ProcRead { pid, alive, seen }
}

/// The NVIDIA fds and device mappings of `pid`, read from /proc (empty if the process is gone).
pub fn scan_process(pid: i32, prefixes: &[String]) -> Vec<Seen> {
    let Ok(proc) = procfs::process::Process::new(pid) else {
        return Vec::new();
    };
    let mut found = Vec::new();
    if let Ok(fds) = proc.fd() {
        for fd in fds.flatten() {
            if let procfs::process::FDTarget::Path(p) = &fd.target
                && let Some(((kind, minor), _)) = classify_path(p, prefixes)
            {
                found.push(Seen::Fd {
                    fd: fd.fd,
                    kind,
                    minor,
                });
            }
        }
    }
    found.extend(device_mappings(pid, prefixes));
    found
}

/// The mappings of NVIDIA device files of `pid`, from its /proc maps read line by line: only lines that
/// name an NVIDIA file are parsed, and the text is never held whole (a process with a million mappings
/// has 50 MB of it).
fn device_mappings(pid: i32, prefixes: &[String]) -> Vec<Seen> {
    use std::io::BufRead;
    let Ok(file) = std::fs::File::open(format!("/proc/{pid}/maps")) else {
        return Vec::new();
    };
    let mut reader = std::io::BufReader::with_capacity(64 * 1024, file);
    let mut line = String::new();
    let mut found = Vec::new();
    loop {
        line.clear();
        match reader.read_line(&mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        // Every NVIDIA device name begins with `nvidia`.
        if !line.contains("nvidia") {
            continue;
        }
        if let Some(seen) = parse_device_mapping(line.trim_end_matches('\n'), prefixes) {
            found.push(seen);
        }
    }
    found
}

/// A maps line (`start-end perms offset MM:mm inode path`) if it maps an NVIDIA device file.
fn parse_device_mapping(line: &str, prefixes: &[String]) -> Option<Seen> {
    let mut fields = line.splitn(6, ' ');
    let range = fields.next()?;
    let path = fields.nth(4)?.trim_start();
    let ((kind, minor), _) = classify_path(Path::new(path), prefixes)?;
    let (start, end) = range.split_once('-')?;
    let start = u64::from_str_radix(start, 16).ok()?;
    let end = u64::from_str_radix(end, 16).ok()?;
    Some(Seen::Map {
        addr: start,
        len: end.checked_sub(start)?,
        kind,
        minor,
    })
}

/// Whether process `pid` exists (a zombie counts as gone: it holds no file).
pub fn alive(pid: u32) -> bool {
    procfs::process::Process::new(pid as i32)
        .and_then(|p| p.stat())
        .is_ok_and(|s| s.state != 'Z' && s.state != 'X')
}

/// Every pid on the host.
pub fn all_pids() -> Vec<i32> {
    procfs::process::all_processes()
        .map(|it| it.flatten().map(|p| p.pid).collect())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_classify_only_under_a_prefix() {
        let prefixes = vec!["/dev/".to_owned(), "/tmp/mock/".to_owned()];
        let ((kind, _), name) = classify_path(Path::new("/dev/nvidiactl"), &prefixes).unwrap();
        assert_eq!((kind, name.as_str()), (FdKind::Ctl, "nvidiactl"));
        assert_eq!(
            classify_path(Path::new("/tmp/mock/nvidia3"), &prefixes)
                .unwrap()
                .0
                .1,
            3
        );
        assert!(classify_path(Path::new("/etc/nvidiactl"), &prefixes).is_none());
        assert!(classify_path(Path::new("/dev/null"), &prefixes).is_none());
    }

    #[test]
    fn only_device_mapping_lines_are_taken_from_maps() {
        let prefixes = vec!["/dev/".to_owned()];
        let line = "7f0000001000-7f0000003000 rw-s 00000000 00:05 520 /dev/nvidia0";
        assert_eq!(
            parse_device_mapping(line, &prefixes),
            Some(Seen::Map {
                addr: 0x7f00_0000_1000,
                len: 0x2000,
                kind: FdKind::Device,
                minor: 0
            })
        );
        let library = "7f0000001000-7f0000003000 r-xp 00000000 fd:00 99 /usr/lib/libnvidia-ml.so.1";
        assert_eq!(parse_device_mapping(library, &prefixes), None);
        let anonymous = "7f0000001000-7f0000003000 rw-p 00000000 00:00 0 ";
        assert_eq!(parse_device_mapping(anonymous, &prefixes), None);
    }

    #[test]
    fn this_process_reads_as_alive_holding_no_nvidia_file() {
        let read = read_process(std::process::id(), &["/dev/".to_owned()]);
        assert!(read.alive);
        assert!(read.seen.is_empty(), "{:?}", read.seen);
    }
}
