//! The GPU-free gate (`wait_gpu_free`): a container's Start waits until no other watched container holds the
//! GPU (its GPU state, or a release not confirmed yet) on the NVIDIA GPU device(s) it sees, and no process in
//! a container holds a file of them that the probes do not follow. Devices are told apart by device number
//! where the files are character devices (the real driver), and by name where they are not (the FUSE mock).
pub(crate) mod floor;
pub(crate) mod gpu_users;
pub(crate) mod room;
mod waiters;

use std::{
    collections::BTreeSet,
    os::unix::fs::{FileTypeExt, MetadataExt},
    path::Path,
};

use baton_nvidia::fdkind::{FdKind, classify_chrdev, classify_name};
use baton_tracer::Tracer;
use tokio::{sync::oneshot, time::Instant};

use baton_agent_api::{ContainerRef, Reply};

/// One GPU device, as the gate compares them (and as the rate gate saves them across restarts).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub enum DeviceKey {
    /// A character device: its major and minor.
    Number(u64, u64),
    /// Not a character device (the FUSE mock): the file itself, by its file system and inode, whatever
    /// folder it is mounted at; its name for messages.
    File {
        /// The file system's device number.
        dev: u64,
        /// The inode.
        ino: u64,
        /// Its file name (`nvidia0`).
        name: String,
    },
    /// Not known: the files of a process the agent could not read. It is every device, for the gate.
    Unknown,
}

impl std::fmt::Display for DeviceKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Number(major, minor) => write!(f, "device {major}:{minor}"),
            Self::File { name, .. } => write!(f, "{name}"),
            Self::Unknown => f.write_str("an unknown device"),
        }
    }
}

impl DeviceKey {
    /// The key of the file at `path` (through /proc links too), or `None` when it is not a GPU device
    /// file (`nvidiactl` and `nvidia-uvm` are shared by every CUDA process: holding them is not holding a
    /// GPU).
    pub fn of(path: &Path, name: &str) -> Option<Self> {
        Self::classify(path, name, 0)
            .filter(|(kind, _)| *kind == FdKind::Device)
            .map(|(_, key)| key)
    }

    /// What NVIDIA file `path` (followed) is, and its key: a character device by its numbers (`uvm_major`:
    /// the dynamic UVM major, 0 when unknown), else by its name `name` (the FUSE mock), then known by its
    /// file system and inode. The one classification of a device file, for the gate and the /proc checks.
    pub fn classify(path: &Path, name: &str, uvm_major: u32) -> Option<(FdKind, Self)> {
        let meta = std::fs::metadata(path).ok()?;
        Self::classify_meta(&meta, name.as_bytes(), uvm_major)
    }

    /// [`DeviceKey::classify`] of a file already looked at (`meta`, its link followed), named `name` (raw
    /// bytes: a path as /proc prints it).
    pub fn classify_meta(
        meta: &std::fs::Metadata,
        name: &[u8],
        uvm_major: u32,
    ) -> Option<(FdKind, Self)> {
        let base = baton_tracer::proc_read::base_name(name);
        let (kind, key) = if meta.file_type().is_char_device() {
            let dev = meta.rdev();
            let (major, minor) = (nix::sys::stat::major(dev), nix::sys::stat::minor(dev));
            let (kind, _) = classify_chrdev(major as u32, minor as u32, uvm_major)
                .or_else(|| classify_name(base))?;
            (kind, Self::Number(major, minor))
        } else {
            let (kind, _) = classify_name(base)?;
            let key = Self::File {
                dev: meta.dev(),
                ino: meta.ino(),
                // Every NVIDIA device name is ASCII.
                name: String::from_utf8_lossy(base).into_owned(),
            };
            (kind, key)
        };
        (kind != FdKind::Unknown).then_some((kind, key))
    }

    /// Whether two keys name the same device.
    pub fn same_device(&self, other: &Self) -> bool {
        match (self, other) {
            (Self::Unknown, _) | (_, Self::Unknown) => true,
            (Self::Number(..), Self::Number(..)) => self == other,
            (
                Self::File { dev, ino, .. },
                Self::File {
                    dev: dev2,
                    ino: ino2,
                    ..
                },
            ) if (*dev, *ino) != (0, 0) && (*dev2, *ino2) != (0, 0) => dev == dev2 && ino == ino2,
            // Known by name only (a file registered in io_uring): any device of that name.
            (Self::File { name, .. }, Self::File { name: name2, .. }) => name == name2,
            _ => false,
        }
    }
}

/// The GPU devices container `init` sees among `devices` (paths inside it).
pub fn devices_seen(init: u32, devices: &[String]) -> BTreeSet<DeviceKey> {
    devices
        .iter()
        .filter_map(|d| DeviceKey::of(Path::new(&format!("/proc/{init}/root{d}")), d))
        .collect()
}

/// The GPU devices of the open NVIDIA fds of the processes of cgroup `cgroup_id`.
pub fn devices_held(tracer: &Tracer, cgroup_id: u64) -> BTreeSet<DeviceKey> {
    let mut out = BTreeSet::new();
    for (pid, p) in tracer.fd_table().iter() {
        if p.cgroup_id != cgroup_id {
            continue;
        }
        for (fd, nv) in &p.fds {
            if nv.kind != FdKind::Device {
                continue;
            }
            let link = format!("/proc/{pid}/fd/{fd}");
            let name = std::fs::read_link(&link)
                .map(|t| t.display().to_string())
                .unwrap_or_else(|_| format!("nvidia{}", nv.minor));
            if let Some(key) = DeviceKey::of(Path::new(&link), &name) {
                out.insert(key);
            }
        }
    }
    out
}

/// The GPU devices watched container `w` holds the GPU on now: none while it holds no GPU state (a parked
/// container whose forked worker keeps the inherited device files holds none), else the devices of its open
/// device files (none known when its state is kept by a ctl file or a mapping alone).
pub fn devices_holding(
    tracer: &Tracer,
    w: &crate::registry::watched::Watched,
) -> BTreeSet<DeviceKey> {
    if w.is_held() {
        devices_held(tracer, w.cgroup_id)
    } else {
        BTreeSet::new()
    }
}

/// A Start waiting for its GPU.
pub struct Waiter {
    /// The container about to start.
    pub container: ContainerRef,
    /// Its cgroup v2 path (its own processes never keep it waiting).
    pub cgroup: String,
    /// Whether the holders only /proc shows were logged already.
    pub hidden_logged: bool,
    /// Since when no watched container has kept it waiting (monotonic ns): only a look at the node's /proc
    /// asked since then may open its gate.
    pub clear_since_ns: Option<u64>,
    /// The devices it sees.
    pub devices: BTreeSet<DeviceKey>,
    /// The video memory it needs on each (`baton.io/gpu-memory`); `None`: the whole GPU.
    pub need: Option<u64>,
    /// When it asked (monotonic ns).
    pub asked_ns: u64,
    /// When it gives up.
    pub deadline: Instant,
    /// Where the answer goes.
    pub reply: oneshot::Sender<Reply>,
    /// The co-runners gap-fill could not park for it, and why (shown once on their traces, and in its
    /// error at the deadline).
    pub unparkable: std::collections::BTreeMap<ContainerRef, String>,
    /// Why NVML keeps it waiting once the ledgers would let it through (`floor.rs`).
    pub floor: Option<floor::Hold>,
    /// Whether that was logged.
    pub floor_logged: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_gpu_device_files_count_and_plain_files_go_by_file_identity() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["nvidia0", "nvidiactl", "nvidia-uvm"] {
            std::fs::write(dir.path().join(name), b"").unwrap();
        }
        let key = |n: &str| DeviceKey::of(&dir.path().join(n), n);
        let meta = std::fs::metadata(dir.path().join("nvidia0")).unwrap();
        assert_eq!(
            key("nvidia0"),
            Some(DeviceKey::File {
                dev: meta.dev(),
                ino: meta.ino(),
                name: "nvidia0".into()
            })
        );
        assert_eq!(key("nvidiactl"), None);
        assert_eq!(key("nvidia-uvm"), None);
        // A character device goes by its number, whatever its name.
        assert_eq!(
            DeviceKey::of(Path::new("/dev/null"), "/dev/nvidia3"),
            Some(DeviceKey::Number(1, 3))
        );
    }

    #[test]
    fn mig_slices_of_one_gpu_share_its_key_so_they_wait_on_each_other() {
        // Two containers, each given one MIG slice of the same GPU: the GPU's /dev/nvidia0 and the slice's
        // capability file (/dev/nvidia-caps/nvidia-capN; CUDA opens capability files without MIG too:
        // /work/shared/gpu/580.159.04/maps-running.txt, fds 20 and 21).
        let dir = tempfile::tempdir().unwrap();
        for name in ["nvidia0", "nvidia-cap12", "nvidia-cap21"] {
            std::fs::write(dir.path().join(name), b"").unwrap();
        }
        let seen = |files: &[&str]| -> BTreeSet<DeviceKey> {
            files
                .iter()
                .filter_map(|n| DeviceKey::of(&dir.path().join(n), n))
                .collect()
        };
        let first = seen(&["nvidia0", "nvidia-cap12"]);
        let second = seen(&["nvidia0", "nvidia-cap21"]);
        assert_eq!(
            first.len(),
            1,
            "the capability file is no GPU device: {first:?}"
        );
        assert_eq!(first, second, "both slices key on the whole GPU");
        assert!(
            first
                .iter()
                .all(|a| second.iter().any(|b| a.same_device(b)))
        );
    }
}
