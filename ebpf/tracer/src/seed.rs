//! Seeding the fd maps from /proc for processes that opened NVIDIA devices before the probes were attached,
//! and every later look at what /proc shows a process holding (reconcile, adopt, resync): read through
//! [`crate::proc_read`], on bytes, with its failure rule.
use std::ops::ControlFlow;

use baton_nvidia::fdkind::{self, FdKind};

use crate::{
    fdtable::Seen,
    proc_read::{ProcDir, ProcError},
};

/// If `path` (raw bytes) is one of `prefixes` followed by an NVIDIA device name: what device file it is
/// (kind and minor) and its name.
pub fn classify_path(path: &[u8], prefixes: &[String]) -> Option<((FdKind, u8), String)> {
    prefixes.iter().find_map(|p| {
        let name = path.strip_prefix(p.as_bytes())?;
        let (kind, minor) = fdkind::classify_name(name)?;
        // Every NVIDIA device name is ASCII.
        let name = std::str::from_utf8(name).ok()?;
        (kind != FdKind::Unknown).then(|| ((kind, minor), name.to_owned()))
    })
}

/// What /proc showed of one process at one moment. Read with [`read_process`], on any thread; compared with
/// the mirror by [`crate::Tracer::reconcile_reads`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcRead {
    /// The process.
    pub pid: u32,
    /// What it showed.
    pub shown: Shown,
}

/// What /proc showed a process holding.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Shown {
    /// It is gone (exited, or a zombie whose threads all exited): it holds nothing.
    Gone,
    /// Its NVIDIA fds and device mappings, read whole.
    Holds(Vec<Seen>),
    /// What it holds could not be read whole (this says which entry and why): unknown, so nothing the
    /// mirror has of it is dropped.
    Unreadable(String),
}

impl ProcRead {
    /// Whether it was alive (a process that could not be read counts as alive).
    pub fn alive(&self) -> bool {
        !matches!(self.shown, Shown::Gone)
    }
}

/// Reads process `pid` from /proc ([`ProcRead`]).
pub fn read_process(pid: u32, prefixes: &[String]) -> ProcRead {
    let shown = match scan_process(pid, prefixes) {
        Ok(seen) => Shown::Holds(seen),
        Err(ProcError::Gone) => Shown::Gone,
        Err(e) => Shown::Unreadable(e.to_string()),
    };
    ProcRead { pid, shown }
}

/// The NVIDIA fds and device mappings of `pid`, read from /proc.
pub fn scan_process(pid: u32, prefixes: &[String]) -> Result<Vec<Seen>, ProcError> {
    let dir = ProcDir::open(pid)?;
    let mut found = Vec::new();
    for fd in dir.fd_numbers()? {
        let Some(target) = dir.fd_target(fd)? else {
            continue;
        };
        if let Some(((kind, minor), _)) = classify_path(target.as_encoded_bytes(), prefixes) {
            found.push(Seen::Fd { fd, kind, minor });
        }
    }
    found.extend(device_mappings(&dir, prefixes)?);
    Ok(found)
}

/// The mappings of NVIDIA device files of the process, from its /proc maps read line by line: only lines
/// that name an NVIDIA file are classified, and the text is never held whole (a process with a million
/// mappings has 50 MB of it).
fn device_mappings(dir: &ProcDir, prefixes: &[String]) -> Result<Vec<Seen>, ProcError> {
    let mut found = Vec::new();
    // Every NVIDIA device name begins with `nvidia`.
    let wanted = |line: &[u8]| crate::proc_read::mentions(line, b"nvidia");
    dir.for_each_mapping(wanted, |m| {
        if let Some(seen) = device_mapping(m, prefixes) {
            found.push(seen);
        }
        ControlFlow::Continue(())
    })?;
    Ok(found)
}

/// A maps line if it maps an NVIDIA device file.
fn device_mapping(m: &crate::proc_read::MapLine<'_>, prefixes: &[String]) -> Option<Seen> {
    // Every NVIDIA device name begins with `nvidia`.
    if !m.base_name().starts_with(b"nvidia") {
        return None;
    }
    let ((kind, minor), _) = classify_path(m.path, prefixes)?;
    Some(Seen::Map {
        addr: m.start,
        len: m.end.checked_sub(m.start)?,
        kind,
        minor,
    })
}

/// Whether process `pid` exists (a zombie whose threads all exited counts as gone: it holds no file; one
/// that cannot be read counts as there).
pub fn alive(pid: u32) -> bool {
    crate::proc_read::alive(pid)
}

/// Every pid on the host; an error when /proc cannot be listed.
pub fn all_pids() -> std::io::Result<Vec<u32>> {
    crate::proc_read::all_pids()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_classify_only_under_a_prefix() {
        let prefixes = vec!["/dev/".to_owned(), "/tmp/mock/".to_owned()];
        let ((kind, _), name) = classify_path(b"/dev/nvidiactl", &prefixes).unwrap();
        assert_eq!((kind, name.as_str()), (FdKind::Ctl, "nvidiactl"));
        assert_eq!(
            classify_path(b"/tmp/mock/nvidia3", &prefixes).unwrap().0.1,
            3
        );
        assert!(classify_path(b"/etc/nvidiactl", &prefixes).is_none());
        assert!(classify_path(b"/dev/null", &prefixes).is_none());
        assert!(classify_path(b"/dev/\xff\xfe", &prefixes).is_none());
    }

    #[test]
    fn only_device_mapping_lines_are_taken_from_maps() {
        let prefixes = vec!["/dev/".to_owned()];
        let parse = |line: &[u8]| {
            device_mapping(&crate::proc_read::MapLine::parse(line).unwrap(), &prefixes)
        };
        assert_eq!(
            parse(b"7f0000001000-7f0000003000 rw-s 00000000 00:05 520 /dev/nvidia0"),
            Some(Seen::Map {
                addr: 0x7f00_0000_1000,
                len: 0x2000,
                kind: FdKind::Device,
                minor: 0
            })
        );
        let library =
            b"7f0000001000-7f0000003000 r-xp 00000000 fd:00 99 /usr/lib/libnvidia-ml.so.1";
        assert_eq!(parse(library), None);
        assert_eq!(
            parse(b"7f0000001000-7f0000003000 rw-p 00000000 00:00 0 "),
            None
        );
    }

    #[test]
    fn this_process_reads_as_alive_holding_no_nvidia_file() {
        let read = read_process(std::process::id(), &["/dev/".to_owned()]);
        assert_eq!(read.shown, Shown::Holds(Vec::new()));
    }
}
