//! Which CUDA driver library the driver helper loads, on the nodes where it lives elsewhere than the loader's
//! path, and whether it matches the kernel module.
//!
//! The node's TOML names the library (`cuda_driver_path`), by default the bare `libcuda.so.1`. A bare name is
//! looked up by the dynamic loader first (as on the H200, where `/usr/local/nvidia/lib64` was on the loader's
//! path: /work/shared/gpu/580.159.04/README.md), then in the folders where the common installs put it: the GPU
//! operator's driver container (its root at `/run/nvidia/driver`), GKE and other `nvidia-container` layouts
//! (`/usr/local/nvidia/lib64`), and the distributions' library folders. The helper says which file it loaded.
//!
//! The user-mode driver must be the kernel module's version (the library's file name,
//! `libcuda.so.580.159.04`, against `/proc/driver/nvidia/version`): a mismatch is refused naming both, before
//! `cuInit` fails with `CUDA_ERROR_SYSTEM_DRIVER_MISMATCH`. Where either is unknown (no driver, as on CI; a
//! library named otherwise) nothing is refused.
use std::{
    ffi::OsStr,
    path::{Path, PathBuf},
};

/// Where a bare library name is looked for when the dynamic loader does not find it, in this order.
pub const DRIVER_DIRS: [&str; 6] = [
    "/run/nvidia/driver/usr/lib/x86_64-linux-gnu",
    "/run/nvidia/driver/usr/lib64",
    "/usr/local/nvidia/lib64",
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
];

/// The kernel module's version file.
pub const KERNEL_VERSION_FILE: &str = "/proc/driver/nvidia/version";

/// What to try to load for `name`: itself (a path, or a bare name for the loader), then, for a bare name,
/// the files of that name in `dirs` that exist.
pub fn candidates(name: &OsStr, dirs: &[&str]) -> Vec<PathBuf> {
    let mut out = vec![PathBuf::from(name)];
    if !name.as_encoded_bytes().contains(&b'/') {
        out.extend(
            dirs.iter()
                .map(|d| Path::new(d).join(name))
                .filter(|p| p.exists()),
        );
    }
    out
}

/// The driver version in a library's file name (`libcuda.so.580.159.04` -> `580.159.04`), following
/// symlinks: `None` for `libcuda.so.1` itself or a name without one.
pub fn library_version(loaded: &Path) -> Option<String> {
    let real = std::fs::canonicalize(loaded).unwrap_or_else(|_| loaded.to_path_buf());
    let name = real.file_name()?.to_str()?;
    let version = name.split_once(".so.")?.1;
    (version.split('.').count() >= 2 && version.split('.').all(|p| p.parse::<u32>().is_ok()))
        .then(|| version.to_owned())
}

/// The kernel module's version in the text of `/proc/driver/nvidia/version` (`NVRM version: NVIDIA UNIX Open
/// Kernel Module for x86_64  580.159.04  Release Build ...`).
pub fn kernel_version(text: &str) -> Option<String> {
    let line = text.lines().find(|l| l.starts_with("NVRM version:"))?;
    line.split_whitespace()
        .find(|w| w.split('.').count() >= 2 && w.split('.').all(|p| p.parse::<u32>().is_ok()))
        .map(str::to_owned)
}

/// Why `library` (its version `library_version`) cannot serve a kernel module of `kernel_version`: both
/// named; `None` when they match or either is unknown.
pub fn mismatch(
    library: &Path,
    library_version: Option<&str>,
    kernel_version: Option<&str>,
) -> Option<String> {
    let (user, kernel) = (library_version?, kernel_version?);
    (user != kernel).then(|| {
        format!(
            "{} is the user-mode driver {user} but the kernel module is {kernel} ({KERNEL_VERSION_FILE}): \
             they must be the same version; point cuda_driver_path at the {kernel} library (the GPU \
             operator's is under /run/nvidia/driver)",
            library.display()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bare_name_is_the_loaders_then_each_known_folder_that_has_it() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (dir.path().join("a"), dir.path().join("b"));
        std::fs::create_dir_all(&a).unwrap();
        std::fs::create_dir_all(&b).unwrap();
        std::fs::write(b.join("libcuda.so.1"), "").unwrap();
        let dirs = [a.to_str().unwrap(), b.to_str().unwrap()];
        assert_eq!(
            candidates(OsStr::new("libcuda.so.1"), &dirs),
            vec![PathBuf::from("libcuda.so.1"), b.join("libcuda.so.1")]
        );
        assert_eq!(
            candidates(OsStr::new("/opt/libcuda.so.1"), &dirs),
            vec![PathBuf::from("/opt/libcuda.so.1")],
            "a path is taken as it is"
        );
    }

    #[test]
    fn versions_come_from_the_file_name_and_the_kernel_modules_line() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("libcuda.so.580.159.04");
        std::fs::write(&real, "").unwrap();
        let link = dir.path().join("libcuda.so.1");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        assert_eq!(library_version(&link).as_deref(), Some("580.159.04"));
        assert_eq!(
            library_version(Path::new("/nonexistent/libcuda.so.1")),
            None
        );
        let proc = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  \
                    (dvs-builder@U22-I3-AM02-24-3)  Wed Oct  1 2025\nGCC version:  gcc version 12.2.0\n";
        assert_eq!(kernel_version(proc).as_deref(), Some("580.159.04"));
        assert_eq!(kernel_version("nothing"), None);
        let why = mismatch(&link, Some("575.57.08"), Some("580.159.04")).unwrap();
        assert!(
            why.contains("575.57.08") && why.contains("580.159.04"),
            "{why}"
        );
        assert_eq!(
            mismatch(&link, Some("580.159.04"), Some("580.159.04")),
            None
        );
        assert_eq!(mismatch(&link, None, Some("580.159.04")), None);
    }
}
