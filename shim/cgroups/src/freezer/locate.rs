//! Where a process's freezer is: the cgroup runc put it in. runc uses the v1 freezer when /sys/fs/cgroup is
//! not a cgroup2 mount (legacy and hybrid hosts), else cgroup v2; so a process whose `/proc/PID/cgroup` has a
//! `freezer` line below the root of a mounted v1 freezer is frozen there, and otherwise through its `0::` line
//! under the cgroup2 mount. Mounts come from /proc/self/mountinfo and are checked with statfs: a mount that
//! another one hides (a private mount namespace that mounted cgroup2 over /sys/fs/cgroup) is not used.
use std::path::{Path, PathBuf};

use nix::sys::statfs::{CGROUP_SUPER_MAGIC, CGROUP2_SUPER_MAGIC, FsType, statfs};

use super::{CgroupVersion, FreezerError};

const MOUNTINFO: &str = "/proc/self/mountinfo";

/// The mount points of the hierarchies a freezer can live in.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Roots {
    /// The v1 freezer hierarchy (`/sys/fs/cgroup/freezer`), if mounted.
    pub v1_freezer: Option<PathBuf>,
    /// The v1 memory hierarchy (`/sys/fs/cgroup/memory`), if mounted (see [`crate::memory`]).
    pub v1_memory: Option<PathBuf>,
    /// The cgroup2 hierarchy (`/sys/fs/cgroup/unified` on a hybrid host, `/sys/fs/cgroup` on a v2 one).
    pub v2: Option<PathBuf>,
}

impl Roots {
    /// The roots of this process's mount namespace (mountinfo, checked with statfs).
    pub fn detect() -> Result<Self, FreezerError> {
        let text = std::fs::read_to_string(MOUNTINFO).map_err(|source| FreezerError::Io {
            action: "read",
            path: MOUNTINFO.into(),
            source,
        })?;
        let mut roots = Self::from_mountinfo(&text);
        roots.v1_freezer = roots.v1_freezer.filter(|p| is_fs(p, CGROUP_SUPER_MAGIC));
        roots.v1_memory = roots.v1_memory.filter(|p| is_fs(p, CGROUP_SUPER_MAGIC));
        roots.v2 = roots.v2.filter(|p| is_fs(p, CGROUP2_SUPER_MAGIC));
        Ok(roots)
    }

    /// The roots named in mountinfo `text` (not checked against the file system): the v1 mounts whose super
    /// options name `freezer` and `memory` and the shortest cgroup2 mount point, each mounted at its
    /// hierarchy's root.
    pub fn from_mountinfo(text: &str) -> Self {
        let mut roots = Self::default();
        for line in text.lines() {
            let Some((pre, post)) = line.split_once(" - ") else {
                continue;
            };
            let pre: Vec<&str> = pre.split_whitespace().collect();
            let post: Vec<&str> = post.split_whitespace().collect();
            let (Some(root), Some(point), Some(fstype)) = (pre.get(3), pre.get(4), post.first())
            else {
                continue;
            };
            if *root != "/" {
                continue;
            }
            let point = PathBuf::from(point);
            let v1_has = |controller: &str| {
                *fstype == "cgroup"
                    && post
                        .get(2)
                        .is_some_and(|opts| opts.split(',').any(|o| o == controller))
            };
            if v1_has("memory") {
                roots.v1_memory.get_or_insert(point.clone());
            }
            match *fstype {
                "cgroup" if v1_has("freezer") => {
                    roots.v1_freezer.get_or_insert(point);
                }
                "cgroup2"
                    if roots
                        .v2
                        .as_ref()
                        .is_none_or(|p| p.as_os_str().len() > point.as_os_str().len()) =>
                {
                    roots.v2 = Some(point);
                }
                _ => {}
            }
        }
        roots
    }
}

fn is_fs(path: &Path, magic: FsType) -> bool {
    statfs(path).is_ok_and(|s| s.filesystem_type() == magic)
}

/// The cgroup directory and version of the freezer that holds process `pid`, whose cgroups are `cgroups` (from
/// /proc/PID/cgroup), under `roots`.
pub(super) fn freezer_dir(
    pid: u32,
    cgroups: &[procfs::ProcessCGroup],
    roots: &Roots,
) -> Result<(PathBuf, CgroupVersion), FreezerError> {
    let v1 = roots.v1_freezer.as_ref().and_then(|root| {
        cgroups
            .iter()
            .find(|cg| cg.hierarchy != 0 && cg.controllers.iter().any(|c| c == "freezer"))
            .filter(|cg| cg.pathname != "/")
            .map(|cg| (under(root, &cg.pathname), CgroupVersion::V1))
    });
    let v2 = || {
        let root = roots.v2.as_ref()?;
        let cg = cgroups.iter().find(|cg| cg.hierarchy == 0)?;
        Some((under(root, &cg.pathname), CgroupVersion::V2))
    };
    let (dir, version) = v1.or_else(v2).ok_or(FreezerError::NoHierarchy { pid })?;
    let file = version.control_file();
    if !dir.join(file).exists() {
        return Err(FreezerError::NotFreezable {
            pid,
            path: dir,
            file,
        });
    }
    Ok((dir, version))
}

fn under(root: &Path, rel: &str) -> PathBuf {
    root.join(rel.trim_start_matches('/'))
}
