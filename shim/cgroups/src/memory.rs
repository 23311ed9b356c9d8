//! A process's memory cgroup: its limit, its use, and a limit raised for a while. A park's host copy of the
//! GPU's memory is charged there (recorded on the H200: 4 GiB of VRAM under memory.max 2 GiB, the checkpoint
//! failed with 304 and the kernel OOM-killed the process: /work/shared/gpu/580.159.04/README.md, point 6).
//!
//! Found as the freezer is ([`crate::freezer::Roots`]): the v1 memory hierarchy where /proc/PID/cgroup has a
//! `memory` line under a mounted v1 memory root (hybrid hosts: `memory.limit_in_bytes`,
//! `memory.usage_in_bytes`), else the process's cgroup v2 directory (`memory.max`, `memory.current`).
use std::path::{Path, PathBuf};

use crate::freezer::{CgroupVersion, Roots};

/// A v1 limit at or above this is no limit (the kernel shows "unlimited" as the largest page multiple below
/// `i64::MAX`).
const V1_UNLIMITED: u64 = 1 << 62;

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// The process has no memory cgroup this module can find.
    #[error(
        "process {pid} has no memory cgroup under a mounted hierarchy (neither a v1 `memory` line nor a cgroup v2 directory with memory.max)"
    )]
    NotFound {
        /// The process.
        pid: u32,
    },
    /// A control file could not be read or written.
    #[error("cannot {action} {path}: {source}")]
    Io {
        /// "read" or "write".
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A control file held something else than a number.
    #[error("{path} holds {text:?}, not a number of bytes")]
    Parse {
        /// The file.
        path: PathBuf,
        /// What it held.
        text: String,
    },
}

/// One memory cgroup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryCgroup {
    dir: PathBuf,
    version: CgroupVersion,
}

impl MemoryCgroup {
    /// The memory cgroup of process `pid`.
    pub fn for_pid(pid: u32) -> Result<Self, MemoryError> {
        let cgroups = crate::of_pid(pid).ok_or(MemoryError::NotFound { pid })?;
        let roots = Roots::detect().map_err(|_| MemoryError::NotFound { pid })?;
        Self::for_pid_in(pid, &cgroups, &roots)
    }

    /// The memory cgroup of process `pid` whose cgroups (/proc/PID/cgroup) are `cgroups`, under `roots`.
    pub fn for_pid_in(
        pid: u32,
        cgroups: &[procfs::ProcessCGroup],
        roots: &Roots,
    ) -> Result<Self, MemoryError> {
        let under = |root: &Path, rel: &str| root.join(rel.trim_start_matches('/'));
        let v1 = roots.v1_memory.as_ref().and_then(|root| {
            cgroups
                .iter()
                .find(|cg| cg.hierarchy != 0 && cg.controllers.iter().any(|c| c == "memory"))
                .map(|cg| (under(root, &cg.pathname), CgroupVersion::V1))
        });
        let v2 = || {
            let root = roots.v2.as_ref()?;
            let cg = cgroups.iter().find(|cg| cg.hierarchy == 0)?;
            Some((under(root, &cg.pathname), CgroupVersion::V2))
        };
        let (dir, version) = v1.or_else(v2).ok_or(MemoryError::NotFound { pid })?;
        let m = Self { dir, version };
        if !m.limit_file().exists() {
            return Err(MemoryError::NotFound { pid });
        }
        Ok(m)
    }

    /// The cgroup directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    fn limit_file(&self) -> PathBuf {
        self.dir.join(match self.version {
            CgroupVersion::V1 => "memory.limit_in_bytes",
            CgroupVersion::V2 => "memory.max",
        })
    }

    fn usage_file(&self) -> PathBuf {
        self.dir.join(match self.version {
            CgroupVersion::V1 => "memory.usage_in_bytes",
            CgroupVersion::V2 => "memory.current",
        })
    }

    /// Its limit in bytes; `None` when it has none.
    pub fn limit(&self) -> Result<Option<u64>, MemoryError> {
        let path = self.limit_file();
        let text = read(&path)?;
        if text == "max" {
            return Ok(None);
        }
        let n = number(&path, &text)?;
        Ok((n < V1_UNLIMITED).then_some(n))
    }

    /// What it uses now, in bytes.
    pub fn usage(&self) -> Result<u64, MemoryError> {
        let path = self.usage_file();
        number(&path, &read(&path)?)
    }

    /// Sets its limit (`None`: none). Lowering it below what the cgroup uses makes the kernel reclaim, and
    /// fails (v1: EBUSY) where it cannot.
    ///
    /// v1 with swap accounting keeps `memory.limit_in_bytes` at or below `memory.memsw.limit_in_bytes` (EINVAL
    /// otherwise), and the kubelet's pods have both at their limit (no swap). So the memory+swap limit moves
    /// with the memory limit, keeping the swap it allowed: raised first when the limit goes up, lowered after
    /// it when the limit goes down.
    pub fn set_limit(&self, bytes: Option<u64>) -> Result<(), MemoryError> {
        let path = self.limit_file();
        let text = |bytes: Option<u64>| match (bytes, self.version) {
            (Some(n), _) => n.to_string(),
            (None, CgroupVersion::V1) => "-1".to_owned(),
            (None, CgroupVersion::V2) => "max".to_owned(),
        };
        let memsw = self.dir.join("memory.memsw.limit_in_bytes");
        let with_swap = match self.version {
            CgroupVersion::V1 if memsw.exists() => {
                let old_memsw = number(&memsw, &read(&memsw)?)?;
                let old = number(&path, &read(&path)?)?;
                (old_memsw < V1_UNLIMITED).then(|| {
                    let swap = old_memsw.saturating_sub(old);
                    let new = bytes.map(|n| n.saturating_add(swap));
                    (new, bytes.is_none_or(|n| n > old))
                })
            }
            _ => None,
        };
        let write = |path: &Path, text: String| {
            std::fs::write(path, text).map_err(|source| MemoryError::Io {
                action: "write",
                path: path.to_path_buf(),
                source,
            })
        };
        match with_swap {
            Some((memsw_bytes, true)) => {
                write(&memsw, text(memsw_bytes))?;
                write(&path, text(bytes))
            }
            Some((memsw_bytes, false)) => {
                write(&path, text(bytes))?;
                write(&memsw, text(memsw_bytes))
            }
            None => write(&path, text(bytes)),
        }
    }
}

fn read(path: &Path) -> Result<String, MemoryError> {
    std::fs::read_to_string(path)
        .map(|t| t.trim().to_owned())
        .map_err(|source| MemoryError::Io {
            action: "read",
            path: path.to_path_buf(),
            source,
        })
}

fn number(path: &Path, text: &str) -> Result<u64, MemoryError> {
    text.parse().map_err(|_| MemoryError::Parse {
        path: path.to_path_buf(),
        text: text.to_owned(),
    })
}

/// The node's MemAvailable (/proc/meminfo), in bytes.
pub fn node_available() -> Option<u64> {
    meminfo("MemAvailable:")
}

/// The node's MemTotal (/proc/meminfo), in bytes.
pub fn node_total() -> Option<u64> {
    meminfo("MemTotal:")
}

/// One line of /proc/meminfo, in bytes.
fn meminfo(key: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix(key))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cg(hierarchy: u32, controllers: &[&str], path: &str) -> procfs::ProcessCGroup {
        procfs::ProcessCGroup {
            hierarchy,
            controllers: controllers.iter().map(|c| c.to_string()).collect(),
            pathname: path.into(),
        }
    }

    #[test]
    fn a_hybrid_host_uses_the_v1_memory_cgroup_and_a_v2_host_memory_max() {
        let dir = tempfile::tempdir().unwrap();
        let v1 = dir.path().join("memory/pod/c");
        let v2 = dir.path().join("unified/pod/c");
        std::fs::create_dir_all(&v1).unwrap();
        std::fs::create_dir_all(&v2).unwrap();
        std::fs::write(v1.join("memory.limit_in_bytes"), "9223372036854771712\n").unwrap();
        std::fs::write(v1.join("memory.usage_in_bytes"), "1048576\n").unwrap();
        std::fs::write(v2.join("memory.max"), "max\n").unwrap();
        std::fs::write(v2.join("memory.current"), "4096\n").unwrap();
        let roots = Roots {
            v1_freezer: None,
            v1_memory: Some(dir.path().join("memory")),
            v2: Some(dir.path().join("unified")),
        };
        let hybrid = [cg(4, &["memory"], "/pod/c"), cg(0, &[], "/pod/c")];
        let m = MemoryCgroup::for_pid_in(1, &hybrid, &roots).unwrap();
        assert_eq!(m.path(), v1);
        assert_eq!(m.limit().unwrap(), None, "v1's unlimited");
        assert_eq!(m.usage().unwrap(), 1 << 20);
        m.set_limit(Some(3 << 20)).unwrap();
        assert_eq!(m.limit().unwrap(), Some(3 << 20));
        m.set_limit(None).unwrap();
        assert_eq!(
            std::fs::read_to_string(v1.join("memory.limit_in_bytes")).unwrap(),
            "-1"
        );

        // A kubelet's pod on v1: memory+swap at the memory limit (no swap); both move together.
        std::fs::write(v1.join("memory.limit_in_bytes"), "134217728\n").unwrap();
        std::fs::write(v1.join("memory.memsw.limit_in_bytes"), "134217728\n").unwrap();
        m.set_limit(Some(512 << 20)).unwrap();
        assert_eq!(m.limit().unwrap(), Some(512 << 20));
        let memsw = || std::fs::read_to_string(v1.join("memory.memsw.limit_in_bytes")).unwrap();
        assert_eq!(memsw(), (512u64 << 20).to_string());
        m.set_limit(Some(128 << 20)).unwrap();
        assert_eq!(memsw(), (128u64 << 20).to_string());
        std::fs::write(
            v1.join("memory.memsw.limit_in_bytes"),
            "9223372036854771712\n",
        )
        .unwrap();
        m.set_limit(Some(1 << 30)).unwrap();
        assert_eq!(
            memsw(),
            "9223372036854771712\n",
            "an unlimited memory+swap stays"
        );

        let pure = [cg(0, &[], "/pod/c")];
        let m = MemoryCgroup::for_pid_in(1, &pure, &roots).unwrap();
        assert_eq!(m.path(), v2);
        assert_eq!(m.limit().unwrap(), None);
        assert_eq!(m.usage().unwrap(), 4096);
        m.set_limit(Some(1 << 30)).unwrap();
        assert_eq!(m.limit().unwrap(), Some(1 << 30));
        m.set_limit(None).unwrap();
        assert_eq!(m.limit().unwrap(), None);
        assert!(MemoryCgroup::for_pid_in(1, &[], &roots).is_err());
    }
}
