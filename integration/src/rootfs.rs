//! A busybox root filesystem made from Debian's busybox-static, and OCI specs for containers that use it.

use std::collections::HashMap;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::Command;

use oci_spec::runtime::{Process, ProcessBuilder, Root, Spec};

/// Where busybox-static installs its static binary.
pub const BUSYBOX: &str = "/bin/busybox";
/// The PATH containers get.
pub const CONTAINER_PATH: &str = "PATH=/bin:/sbin:/usr/bin:/usr/sbin";

/// Errors making the rootfs or a spec.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file operation under the rootfs failed.
    #[error("making the busybox rootfs at {path}: {source}")]
    Io {
        /// The path being written.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// `busybox --list` failed.
    #[error("`{BUSYBOX} --list` failed: install Debian package busybox-static")]
    List,
    /// The OCI spec could not be built.
    #[error("building the OCI spec for {id}: {detail}")]
    Spec {
        /// Container id.
        id: String,
        /// What went wrong.
        detail: String,
    },
}

/// Creates `dir` as a busybox rootfs: /bin/busybox, a symlink per applet in /bin, and the usual empty folders.
pub fn make_busybox_rootfs(dir: &Path) -> Result<(), Error> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| Error::Io { path, source }
    };
    for sub in [
        "bin", "dev", "proc", "sys", "tmp", "etc", "root", "run", "usr",
    ] {
        std::fs::create_dir_all(dir.join(sub)).map_err(io(&dir.join(sub)))?;
    }
    let target = dir.join("bin/busybox");
    std::fs::copy(BUSYBOX, &target).map_err(io(&target))?;
    let list = Command::new(BUSYBOX)
        .arg("--list")
        .output()
        .map_err(|_| Error::List)?;
    if !list.status.success() {
        return Err(Error::List);
    }
    for applet in String::from_utf8_lossy(&list.stdout).lines() {
        let link = dir.join("bin").join(applet);
        if applet != "busybox" && !link.exists() {
            symlink("busybox", &link).map_err(io(&link))?;
        }
    }
    let passwd = dir.join("etc/passwd");
    std::fs::write(&passwd, "root:x:0:0:root:/root:/bin/sh\n").map_err(io(&passwd))?;
    let group = dir.join("etc/group");
    std::fs::write(&group, "root:x:0:\n").map_err(io(&group))?;
    Ok(())
}

/// A process spec running `args` as root in `/` with [`CONTAINER_PATH`].
pub fn process(id: &str, args: &[&str], terminal: bool) -> Result<Process, Error> {
    ProcessBuilder::default()
        .args(args.iter().map(|arg| arg.to_string()).collect::<Vec<_>>())
        .env(vec![CONTAINER_PATH.to_string(), "TERM=xterm".to_string()])
        .cwd("/")
        .terminal(terminal)
        .build()
        .map_err(|error| Error::Spec {
            id: id.to_string(),
            detail: error.to_string(),
        })
}

/// A runc-ready spec for container `id` in `namespace`: root `rootfs` (a bind-mounted copy in the bundle when
/// `root_path` is `None`, otherwise that absolute folder), cgroup `/<namespace>/<id>`, the given annotations.
pub fn spec(
    namespace: &str,
    id: &str,
    args: &[&str],
    root_path: Option<&Path>,
    annotations: &HashMap<String, String>,
) -> Result<Spec, Error> {
    let mut spec = Spec::default();
    spec.set_hostname(Some(id.to_string()));
    spec.set_process(Some(process(id, args, false)?));
    let mut root = Root::default();
    root.set_path(root_path.map_or_else(|| PathBuf::from("rootfs"), Path::to_path_buf));
    root.set_readonly(Some(false));
    spec.set_root(Some(root));
    spec.set_annotations(Some(annotations.clone()));
    if let Some(linux) = spec.linux_mut() {
        linux.set_cgroups_path(Some(PathBuf::from(format!("/{namespace}/{id}"))));
    }
    Ok(spec)
}
