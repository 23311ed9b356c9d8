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
    if let Ok(maps) = proc.maps() {
        for m in maps {
            if let procfs::process::MMapPath::Path(p) = &m.pathname
                && let Some(((kind, minor), _)) = classify_path(p, prefixes)
            {
                found.push(Seen::Map {
                    addr: m.address.0,
                    len: m.address.1 - m.address.0,
                    kind,
                    minor,
                });
            }
        }
    }
    found
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
}
