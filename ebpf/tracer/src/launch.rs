//! Which libcuda files the launch uprobes are attached to, found from the maps of the traced processes.
//!
//! A container's libcuda lives in its own mount namespace: `/proc/PID/maps` names it as the process sees it,
//! so it is opened as `/proc/PID/root/<that path>`. A uprobe belongs to a file (its inode) and fires for every
//! process that maps it, so each distinct file (device, inode) is probed once, whichever container and
//! process it was found through. The tracer looks when a traced process opens an NVIDIA device (CUDA loads
//! libcuda before `cuInit` opens the device files) and when it seeds a process from /proc.
use std::{
    collections::{HashMap, HashSet},
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

use baton_probe_common::LaunchFn;

/// The file name every libcuda has (`libcuda.so`, `libcuda.so.1`, `libcuda.so.550.54.15`).
const LIBCUDA: &str = "libcuda.so";

/// A library file the launch uprobes are attached to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchLibrary {
    /// The path it was opened by (through the finding process's `/proc/PID/root`).
    pub path: PathBuf,
    /// The process it was found through.
    pub pid: u32,
    /// Device of the file.
    pub dev: u64,
    /// Inode of the file.
    pub ino: u64,
    /// The entry points it exports and that are probed.
    pub probed: Vec<LaunchFn>,
}

/// Whether `path` names a libcuda (by its file name).
pub fn is_libcuda(path: &Path) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n == LIBCUDA || n.starts_with(&format!("{LIBCUDA}.")))
}

/// The libcuda files process `pid` maps, as `/proc/PID/root/...` paths with their (device, inode); empty
/// when it maps none or is gone.
pub fn libcuda_files(pid: u32) -> Vec<(PathBuf, (u64, u64))> {
    let Ok(maps) = procfs::process::Process::new(pid as i32).and_then(|p| p.maps()) else {
        return Vec::new();
    };
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for m in maps {
        let procfs::process::MMapPath::Path(p) = &m.pathname else {
            continue;
        };
        if !is_libcuda(p) || !seen.insert(p.clone()) {
            continue;
        }
        let inside = Path::new("/proc")
            .join(pid.to_string())
            .join("root")
            .join(p.strip_prefix("/").unwrap_or(p));
        if let Ok(meta) = std::fs::metadata(&inside) {
            out.push((inside, (meta.dev(), meta.ino())));
        }
    }
    out
}

/// The probed files, and the processes already looked at.
#[derive(Debug, Default)]
pub struct LaunchLibraries {
    probed: HashMap<(u64, u64), LaunchLibrary>,
    /// Files whose attachment failed (not a real libcuda, say): not tried again.
    failed: HashSet<(u64, u64)>,
    /// Processes whose maps showed a libcuda (looked at again after an exec).
    looked_at: HashSet<u32>,
}

impl LaunchLibraries {
    /// Whether `pid` was already found mapping a libcuda.
    pub fn looked_at(&self, pid: u32) -> bool {
        self.looked_at.contains(&pid)
    }

    /// `pid` exec'd or exited: its next open looks at its maps again.
    pub fn forget_pid(&mut self, pid: u32) {
        self.looked_at.remove(&pid);
    }

    /// Whether the file (device, inode) is probed or failed already.
    pub fn known(&self, file: (u64, u64)) -> bool {
        self.probed.contains_key(&file) || self.failed.contains(&file)
    }

    /// Records that `pid` maps a libcuda.
    pub fn saw_pid(&mut self, pid: u32) {
        self.looked_at.insert(pid);
    }

    /// Records a probed file.
    pub fn add(&mut self, lib: LaunchLibrary) {
        self.probed.insert((lib.dev, lib.ino), lib);
    }

    /// Records a file whose attachment failed.
    pub fn add_failed(&mut self, file: (u64, u64)) {
        self.failed.insert(file);
    }

    /// The probed files.
    pub fn iter(&self) -> impl Iterator<Item = &LaunchLibrary> {
        self.probed.values()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn libcuda_is_recognized_by_its_file_name_with_or_without_version() {
        assert!(is_libcuda(Path::new(
            "/usr/lib/x86_64-linux-gnu/libcuda.so.1"
        )));
        assert!(is_libcuda(Path::new("/usr/lib64/libcuda.so.550.54.15")));
        assert!(is_libcuda(Path::new("libcuda.so")));
        assert!(!is_libcuda(Path::new("/usr/lib/libcudart.so.12")));
        assert!(!is_libcuda(Path::new("/usr/lib/libcuda.sox")));
        assert!(!is_libcuda(Path::new("/opt/libcuda.so.1/other.so")));
    }
}
