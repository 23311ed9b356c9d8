//! The containerd tests' prerequisites, and the harness's door to [`baton_prereq`]: a test whose prerequisite is
//! missing skips loudly in a developer's plain `cargo test` and fails in strict mode (tools/dev test, CI).

use std::path::Path;

pub use baton_prereq::{cannot_run_here, missing, not_applicable};

/// A prerequisite is missing: the same as [`baton_prereq::missing`] (fails in strict mode, else prints
/// `skipped: <test>: <reason>`); return from the test after it. Use [`not_applicable`] when the test is
/// about a Baton feature and another runtime is under test.
pub fn announce(reason: &str) {
    missing(reason);
}

/// The reason the containerd-based tests cannot run here, or `None` when everything they need is present.
pub fn missing_containerd_prerequisite() -> Option<String> {
    if !nix::unistd::geteuid().is_root() {
        return Some(
            "needs root (starts containerd, runc and cgroups): run the tests as root".into(),
        );
    }
    let tools = [
        (
            crate::containerd::containerd_program(),
            Some(crate::containerd::CONTAINERD_ENV),
        ),
        (
            crate::containerd::ctr_program(),
            Some(crate::containerd::CTR_ENV),
        ),
        ("runc".into(), None),
    ];
    for (tool, variable) in tools {
        if find_program(&tool).is_none() {
            let chosen_by = variable.filter(|variable| std::env::var_os(variable).is_some());
            return Some(match chosen_by {
                Some(variable) => format!(
                    "`{}` (named by ${variable}) not found: run tools/setup.sh, which caches containerd 2.x \
                     under /var/cache/baton, and point ${variable} at its binary, or unset it to use Debian's",
                    tool.display()
                ),
                None => format!(
                    "`{}` not found: install Debian packages containerd and runc",
                    tool.display()
                ),
            });
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

/// `program` itself when it is a path (has a `/`), else [`which`].
fn find_program(program: &Path) -> Option<std::path::PathBuf> {
    if program.components().count() > 1 {
        return program.is_file().then(|| program.to_path_buf());
    }
    which(program.to_str()?)
}

/// Finds `tool` on PATH, like `which`.
pub fn which(tool: &str) -> Option<std::path::PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(tool))
        .find(|candidate| candidate.is_file())
}
