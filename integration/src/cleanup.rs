//! Cleaning up after a test's containerd namespace, and finding what a crash left behind.
//!
//! Containers of namespace `ns` live in cgroup `/<ns>/<id>` (ctr's default and [`crate::rootfs::spec`]), under
//! runc root `/run/containerd/runc/<ns>`, with bundles (and rootfs mounts) in the private state folder.

use std::path::{Path, PathBuf};
use std::process::Command;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

/// Where containerd's runc shims keep runc state for namespace `ns`.
pub fn runc_root(namespace: &str) -> PathBuf {
    Path::new("/run/containerd/runc").join(namespace)
}

/// The cgroup hierarchies to look in: `/sys/fs/cgroup` on a pure v2 host, else every mounted v1 controller
/// folder plus `unified` (symlinked aliases such as `cpu` -> `cpu,cpuacct` are skipped).
pub fn cgroup_roots() -> Vec<PathBuf> {
    let base = Path::new("/sys/fs/cgroup");
    if base.join("cgroup.controllers").exists() {
        return vec![base.to_path_buf()];
    }
    let Ok(entries) = std::fs::read_dir(base) else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter(|entry| entry.file_type().is_ok_and(|kind| kind.is_dir()))
        .map(|entry| entry.path())
        .collect()
}

/// Whether the host is cgroup v2 only (unified).
pub fn cgroup_v2_only() -> bool {
    Path::new("/sys/fs/cgroup/cgroup.controllers").exists()
}

/// The cgroup folder of container `id` in `namespace` for controller `controller` (`"memory"`, `"cpu"`,
/// `"freezer"`, or `"unified"`). On a pure v2 host every controller maps to the same folder.
pub fn container_cgroup(controller: &str, namespace: &str, id: &str) -> PathBuf {
    if cgroup_v2_only() {
        return Path::new("/sys/fs/cgroup").join(namespace).join(id);
    }
    Path::new("/sys/fs/cgroup")
        .join(controller)
        .join(namespace)
        .join(id)
}

/// Every folder under `root`, deepest first, including `root` itself when it exists.
fn subtree_deepest_first(root: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        if !dir.is_dir() {
            continue;
        }
        if let Ok(entries) = std::fs::read_dir(&dir) {
            for entry in entries.filter_map(Result::ok) {
                if entry.file_type().is_ok_and(|kind| kind.is_dir()) {
                    stack.push(entry.path());
                }
            }
        }
        found.push(dir);
    }
    found.sort_by_key(|dir| std::cmp::Reverse(dir.components().count()));
    found
}

/// Pids listed in `cgroup.procs` anywhere under `dir`.
pub fn pids_in_cgroup_tree(dir: &Path) -> Vec<i32> {
    let mut pids: Vec<i32> = subtree_deepest_first(dir)
        .iter()
        .filter_map(|sub| std::fs::read_to_string(sub.join("cgroup.procs")).ok())
        .flat_map(|text| {
            text.lines()
                .filter_map(|line| line.trim().parse().ok())
                .collect::<Vec<i32>>()
        })
        .collect();
    pids.sort_unstable();
    pids.dedup();
    pids
}

/// Thaws every frozen cgroup of `namespace` (v1 freezer and v2 cgroup.freeze), so SIGKILL can land.
fn thaw(namespace: &str) {
    for root in cgroup_roots() {
        for dir in subtree_deepest_first(&root.join(namespace)) {
            let _ = std::fs::write(dir.join("freezer.state"), "THAWED");
            let _ = std::fs::write(dir.join("cgroup.freeze"), "0");
        }
    }
}

/// SIGKILLs every process in the cgroups of `namespace`.
fn kill_cgroup_processes(namespace: &str) {
    for root in cgroup_roots() {
        for pid in pids_in_cgroup_tree(&root.join(namespace)) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
    }
}

/// Removes the cgroup folders of `namespace` (retrying briefly while killed processes exit).
fn remove_cgroups(namespace: &str) {
    for _ in 0..50 {
        let mut left = false;
        for root in cgroup_roots() {
            for dir in subtree_deepest_first(&root.join(namespace)) {
                left |= std::fs::remove_dir(&dir).is_err() && dir.exists();
            }
        }
        if !left {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// `runc delete --force` for containers `ids` under `root` (those runc does not know are skipped).
pub fn runc_delete(root: &Path, ids: &[String]) {
    for id in ids.iter().filter(|id| root.join(id).exists()) {
        let _ = Command::new("runc")
            .arg("--root")
            .arg(root)
            .args(["delete", "--force", id])
            .output();
    }
}

/// `runc delete --force` for every container runc knows under `root`, then removes `root`.
pub fn runc_delete_all(root: &Path) {
    if !root.exists() {
        return;
    }
    let ids = Command::new("runc")
        .arg("--root")
        .arg(root)
        .args(["list", "-q"])
        .output();
    if let Ok(output) = ids {
        for id in String::from_utf8_lossy(&output.stdout)
            .lines()
            .filter(|line| !line.is_empty())
        {
            let _ = Command::new("runc")
                .arg("--root")
                .arg(root)
                .args(["delete", "--force", id])
                .output();
        }
    }
    let _ = std::fs::remove_dir_all(root);
}

/// Mount points at or below `dir` (from /proc/self/mountinfo), deepest first.
pub fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let Ok(mounts) = procfs::process::Process::myself().and_then(|me| me.mountinfo()) else {
        return Vec::new();
    };
    let mut found: Vec<PathBuf> = mounts
        .into_iter()
        .map(|mount| mount.mount_point)
        .filter(|point| point.starts_with(dir))
        .collect();
    found.sort_by_key(|point| std::cmp::Reverse(point.components().count()));
    found
}

/// Lazily unmounts everything at or below `dir`.
fn unmount_under(dir: &Path) {
    for point in mounts_under(dir) {
        let _ = nix::mount::umount2(&point, nix::mount::MntFlags::MNT_DETACH);
    }
}

/// Everything a test's namespace may have left: container processes, runc state, shims, mounts, cgroups.
/// `shims` are the shim pids to kill; `private_dir` the containerd's temporary folder.
pub fn clean_namespace(namespace: &str, shims: &[i32], private_dir: &Path) {
    thaw(namespace);
    kill_cgroup_processes(namespace);
    runc_delete_all(&runc_root(namespace));
    for pid in shims {
        let _ = kill(Pid::from_raw(*pid), Signal::SIGKILL);
    }
    unmount_under(private_dir);
    remove_cgroups(namespace);
}

/// What is left of container `id` after its shim and containerd cleaned up (all empty when nothing is).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Leftovers {
    /// Live processes still in the container's cgroups.
    pub processes: Vec<i32>,
    /// Mount points in its bundle.
    pub mounts: Vec<PathBuf>,
    /// Its cgroup folders that still exist.
    pub cgroups: Vec<PathBuf>,
    /// runc's state folder for it, when still there.
    pub runc_state: Option<PathBuf>,
}

impl Leftovers {
    /// Looks for what container `id` of `namespace` left, its bundle being under `state_dir`.
    pub fn of(namespace: &str, id: &str, state_dir: &Path) -> Self {
        let mut left = Self::default();
        for root in cgroup_roots() {
            let dir = root.join(namespace).join(id);
            if dir.exists() {
                left.processes.extend(
                    pids_in_cgroup_tree(&dir)
                        .into_iter()
                        .filter(|pid| crate::procs::alive(*pid)),
                );
                left.cgroups.push(dir);
            }
        }
        left.processes.sort_unstable();
        left.processes.dedup();
        let bundle = state_dir
            .join("io.containerd.runtime.v2.task")
            .join(namespace)
            .join(id);
        left.mounts = mounts_under(&bundle);
        let runc_state = runc_root(namespace).join(id);
        left.runc_state = runc_state.exists().then_some(runc_state);
        left
    }

    /// Whether nothing is left.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}
