//! Loud skips: a test that cannot run on this machine says why on stderr (`skipped: <reason>`) and returns.

use std::path::Path;

/// Prints `skipped: <reason>` to stderr, the one format all Baton tests use for a skip.
pub fn announce(reason: &str) {
    eprintln!("skipped: {reason}");
}

/// The reason the containerd-based tests cannot run here, or `None` when everything they need is present.
pub fn missing_containerd_prerequisite() -> Option<String> {
    if !nix::unistd::geteuid().is_root() {
        return Some(
            "needs root (starts containerd, runc and cgroups): run the tests as root".into(),
        );
    }
    for tool in ["containerd", "ctr", "runc"] {
        if which(tool).is_none() {
            return Some(format!(
                "`{tool}` not found on PATH: install Debian packages containerd and runc"
            ));
        }
    }
    if !Path::new(crate::rootfs::BUSYBOX).exists() {
        return Some(format!(
            "{} not found: install Debian package busybox-static",
            crate::rootfs::BUSYBOX
        ));
    }
    if !Path::new("/sys/fs/cgroup").exists() {
        return Some("/sys/fs/cgroup is not mounted: containers need cgroups".into());
    }
    None
}

/// Finds `tool` on PATH, like `which`.
pub fn which(tool: &str) -> Option<std::path::PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(tool))
        .find(|candidate| candidate.is_file())
}
