//! Which libcuda files the launch uprobes are attached to, found from the maps of the traced processes.
//!
//! A container's libcuda lives in its own mount namespace, and its path there is the tenant's to change: a
//! path looked up through `/proc/PID/root` after the process mapped the file may lead elsewhere (a symlink to
//! a host file, resolved against the agent's root; a mount over it). So the file is never looked up by its
//! path: it is opened through `/proc/PID/map_files/<start>-<end>`, which the kernel resolves to the very file
//! of that mapping, its (device, inode) is checked against the maps entry's (a mismatch is refused and
//! logged), and the uprobes are attached through that open file. A uprobe belongs to a file (its inode) and
//! fires for every process that maps it, so each distinct file (device, inode) is probed once, whichever
//! container and process it was found through. The tracer looks when a traced process opens an NVIDIA device
//! (CUDA loads libcuda before `cuInit` opens the device files) and when it seeds a process from /proc.
use std::{
    collections::{HashMap, HashSet},
    fs::File,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

use baton_probe_common::LaunchFn;

/// The file name every libcuda has (`libcuda.so`, `libcuda.so.1`, `libcuda.so.550.54.15`).
const LIBCUDA: &str = "libcuda.so";

/// A library file the launch uprobes are attached to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchLibrary {
    /// Its path as the finding process names it, under that process's `/proc/PID/root` (shown to users; the
    /// file was opened through `/proc/PID/map_files`, never by this path).
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

/// A libcuda file a process maps, opened.
#[derive(Debug)]
pub struct MappedLibcuda {
    /// Its path as the process names it, under `/proc/PID/root` (for messages only).
    pub path: PathBuf,
    /// The mapped file itself, opened through `/proc/PID/map_files`.
    pub file: File,
    /// Its (device, inode), the maps entry's and the opened file's alike.
    pub id: (u64, u64),
}

/// The libcuda files process `pid` maps, each opened through `/proc/PID/map_files` and checked against its
/// maps entry; empty when it maps none or is gone. A file whose (device, inode) is not the entry's is left
/// out with a warning.
pub fn libcuda_files(pid: u32) -> Vec<MappedLibcuda> {
    use std::os::unix::ffi::OsStrExt;
    let Ok(dir) = crate::proc_read::ProcDir::open(pid) else {
        return Vec::new();
    };
    /// A libcuda mapping: its path, its range and its file's (device, inode).
    type Found = (PathBuf, (u64, u64), (u64, u64));
    // Each distinct libcuda file, from the maps read as bytes.
    let mut found: Vec<Found> = Vec::new();
    let mut seen = HashSet::new();
    let wanted = |line: &[u8]| crate::proc_read::mentions(line, LIBCUDA.as_bytes());
    let read = dir.for_each_mapping(wanted, |m| {
        let path = Path::new(std::ffi::OsStr::from_bytes(m.path));
        if m.path.starts_with(b"/") && is_libcuda(path) && seen.insert((m.dev, m.inode)) {
            found.push((path.to_owned(), (m.start, m.end), (m.dev, m.inode)));
        }
        std::ops::ControlFlow::Continue(())
    });
    if read.is_err() {
        return Vec::new();
    }
    let mut out = Vec::new();
    for (p, (start, end), entry_id) in found {
        let shown = Path::new("/proc")
            .join(pid.to_string())
            .join("root")
            .join(p.strip_prefix("/").unwrap_or(&p));
        let map_file = format!("/proc/{pid}/map_files/{start:x}-{end:x}");
        match open_checked(Path::new(&map_file), entry_id) {
            Ok(file) => out.push(MappedLibcuda {
                path: shown,
                file,
                id: entry_id,
            }),
            Err(why) => tracing::warn!(
                pid,
                library = %shown.display(),
                "not probing launches through this libcuda: {why}"
            ),
        }
    }
    out
}

/// Opens `path` (a `map_files` link) and checks that it is the file (device, inode) `expected`.
fn open_checked(path: &Path, expected: (u64, u64)) -> Result<File, String> {
    let file = File::open(path).map_err(|e| format!("cannot open {}: {e}", path.display()))?;
    let meta = file
        .metadata()
        .map_err(|e| format!("cannot stat {}: {e}", path.display()))?;
    let opened = (meta.dev(), meta.ino());
    if opened != expected {
        return Err(format!(
            "{} opened file (device, inode) {opened:?}, not the mapping's {expected:?}",
            path.display()
        ));
    }
    Ok(file)
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

    /// A process that maps `mapped` at `dir/libcuda.so.1`, then (in a mount namespace of its own) covers
    /// `dir` with a tmpfs where `libcuda.so.1` is a symlink to `elsewhere`: its maps still name the path,
    /// which now leads to another file. Returns its pid once that is done; it pauses until killed.
    fn process_that_swaps_its_libcuda(dir: &Path, elsewhere: &Path) -> nix::unistd::Pid {
        use std::ffi::CString;
        let lib = CString::new(dir.join("libcuda.so.1").to_str().unwrap()).unwrap();
        let dir_c = CString::new(dir.to_str().unwrap()).unwrap();
        let target = CString::new(elsewhere.to_str().unwrap()).unwrap();
        let (tmpfs, root) = (CString::new("tmpfs").unwrap(), CString::new("/").unwrap());
        let (ready_r, ready_w) = nix::unistd::pipe().unwrap();
        // SAFETY: the child makes only raw syscalls (no allocation, no lock) on values prepared above, then
        // pauses until killed or exits at once.
        match unsafe { nix::unistd::fork() }.unwrap() {
            // SAFETY: raw syscalls on the C strings and fds prepared before the fork, which stay valid.
            nix::unistd::ForkResult::Child => unsafe {
                let fd = libc::open(lib.as_ptr(), libc::O_RDONLY);
                let addr = libc::mmap(
                    std::ptr::null_mut(),
                    4096,
                    libc::PROT_READ,
                    libc::MAP_PRIVATE,
                    fd,
                    0,
                );
                let ok = fd >= 0
                    && addr != libc::MAP_FAILED
                    && libc::close(fd) == 0
                    && libc::unshare(libc::CLONE_NEWNS) == 0
                    && libc::mount(
                        std::ptr::null(),
                        root.as_ptr(),
                        std::ptr::null(),
                        libc::MS_REC | libc::MS_PRIVATE,
                        std::ptr::null(),
                    ) == 0
                    && libc::mount(
                        tmpfs.as_ptr(),
                        dir_c.as_ptr(),
                        tmpfs.as_ptr(),
                        0,
                        std::ptr::null(),
                    ) == 0
                    && libc::symlink(target.as_ptr(), lib.as_ptr()) == 0;
                if !ok {
                    libc::_exit(1);
                }
                libc::write(
                    std::os::fd::AsRawFd::as_raw_fd(&ready_w),
                    b"r".as_ptr().cast(),
                    1,
                );
                loop {
                    libc::pause();
                }
            },
            nix::unistd::ForkResult::Parent { child } => {
                drop(ready_w);
                let mut byte = [0u8; 1];
                let n = nix::unistd::read(&ready_r, &mut byte).unwrap();
                assert_eq!(
                    n, 1,
                    "the child could not map and swap its libcuda (needs root)"
                );
                child
            }
        }
    }

    #[test]
    fn a_libcuda_path_swapped_for_a_symlink_leads_to_the_mapped_file_only() {
        if !nix::unistd::geteuid().is_root() {
            baton_prereq::missing("needs root (a mount namespace and a tmpfs mount)");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let lib_dir = dir.path().join("lib");
        std::fs::create_dir(&lib_dir).unwrap();
        std::fs::write(lib_dir.join("libcuda.so.1"), vec![b'M'; 4096]).unwrap();
        let host_file = dir.path().join("host-file");
        std::fs::write(&host_file, vec![b'H'; 4096]).unwrap();
        let mapped = std::fs::metadata(lib_dir.join("libcuda.so.1")).unwrap();
        let host = std::fs::metadata(&host_file).unwrap();
        let child = process_that_swaps_its_libcuda(&lib_dir, &host_file);
        let pid = child.as_raw() as u32;
        // What the old lookup did: the path in the process's root now leads to the host file.
        let through_root = Path::new(&format!("/proc/{pid}/root"))
            .join(lib_dir.join("libcuda.so.1").strip_prefix("/").unwrap());
        let via_root = std::fs::metadata(&through_root).unwrap();
        assert_eq!((via_root.dev(), via_root.ino()), (host.dev(), host.ino()));

        let files = libcuda_files(pid);
        let _ = nix::sys::signal::kill(child, nix::sys::signal::Signal::SIGKILL);
        let _ = nix::sys::wait::waitpid(child, None);
        assert_eq!(files.len(), 1, "{files:?}");
        let f = &files[0];
        assert_eq!(f.id, (mapped.dev(), mapped.ino()), "not the mapped file");
        let opened = f.file.metadata().unwrap();
        assert_eq!((opened.dev(), opened.ino()), (mapped.dev(), mapped.ino()));
        let mut first = [0u8; 1];
        std::os::unix::fs::FileExt::read_at(&f.file, &mut first, 0).unwrap();
        assert_eq!(first, [b'M'], "the opened file is the host file");
    }

    #[test]
    fn a_file_that_is_not_the_mappings_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        std::fs::write(&p, b"x").unwrap();
        let m = std::fs::metadata(&p).unwrap();
        assert!(open_checked(&p, (m.dev(), m.ino())).is_ok());
        let e = open_checked(&p, (m.dev(), m.ino() + 1)).unwrap_err();
        assert!(e.contains("not the mapping's"), "{e}");
    }
}
