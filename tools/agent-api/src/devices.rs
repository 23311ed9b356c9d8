//! Which NVIDIA device files a container sees: what a registration's `devices` lists (paths inside the
//! container), read from the container's device folder as the registering process sees it. The shim
//! reads it through `/proc/<init>/root`; an OCI hook that runs before `pivot_root` reads it under the
//! container's rootfs through the same link.
use std::path::Path;

use baton_nvidia::fdkind::{FdKind, classify_name};

/// The NVIDIA device files in `host_dir` (the container's folder `dir`, e.g. `/dev/`, as reached from the
/// caller), named by their path inside the container (`/dev/nvidia0`), sorted; empty when `host_dir`
/// cannot be read.
pub fn nvidia_devices_in(host_dir: &Path, dir: &str) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(host_dir) else {
        return Vec::new();
    };
    let mut found: Vec<String> = entries
        .flatten()
        .filter(|e| {
            classify_name(e.file_name().as_encoded_bytes())
                .is_some_and(|(kind, _)| kind != FdKind::Unknown)
        })
        .map(|e| format!("{dir}{}", e.file_name().to_string_lossy()))
        .collect();
    found.sort();
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_nvidia_device_files_are_listed_by_their_path_inside() {
        // A device directory of our own, so that the answer does not depend on the machine's /dev.
        let dir = tempfile::tempdir().unwrap();
        assert!(nvidia_devices_in(dir.path(), "/dev/").is_empty());
        for name in ["nvidiactl", "nvidia0", "null"] {
            std::fs::write(dir.path().join(name), b"").unwrap();
        }
        assert_eq!(
            nvidia_devices_in(dir.path(), "/dev/"),
            vec!["/dev/nvidia0".to_owned(), "/dev/nvidiactl".to_owned()]
        );
        assert!(nvidia_devices_in(&dir.path().join("missing"), "/dev/").is_empty());
    }
}
