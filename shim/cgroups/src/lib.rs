//! cgroup v2 ids and paths, the container names derived from them, whether a process is gone, the cgroup
//! freezer ([`freezer`]) and a process's memory limit ([`memory`]).
//!
//! `bpf_get_current_cgroup_id()` returns the kernfs id of the task's cgroup v2 directory, which is that
//! directory's inode number. On a hybrid host the v2 tree is mounted at /sys/fs/cgroup/unified; on a pure v2
//! host at /sys/fs/cgroup. The root is found from /proc/self/mountinfo unless the caller names one.
pub mod freezer;
pub mod memory;

use std::{
    collections::HashMap,
    fs,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
};

/// Errors of this module.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// No cgroup2 file system is mounted.
    #[error(
        "no cgroup v2 hierarchy is mounted (looked in /proc/self/mountinfo): per-container attribution needs one"
    )]
    NoCgroup2,
    /// A path could not be read.
    #[error("cannot read cgroup {path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A cgroup path with a `..` component (or not valid UTF-8): it could name a cgroup above the one it
    /// spells.
    #[error(
        "cgroup path {path:?} has a `..` component: give the cgroup's path relative to the v2 root without `..`"
    )]
    NotCanonical {
        /// The path given.
        path: String,
    },
    /// A path is not under the v2 root.
    #[error("{path} is not a cgroup v2 directory under {root}")]
    NotUnderRoot {
        /// The path given.
        path: PathBuf,
        /// The v2 root.
        root: PathBuf,
    },
}

/// The mount point of the cgroup v2 hierarchy, from /proc/self/mountinfo.
pub fn find_v2_root() -> Result<PathBuf, CgroupError> {
    let text = fs::read_to_string("/proc/self/mountinfo").map_err(|source| CgroupError::Io {
        path: "/proc/self/mountinfo".into(),
        source,
    })?;
    text.lines()
        .filter_map(|line| {
            let (pre, post) = line.split_once(" - ")?;
            (post.split_whitespace().next()? == "cgroup2")
                .then(|| pre.split_whitespace().nth(4).map(PathBuf::from))?
        })
        .min_by_key(|p| p.as_os_str().len())
        .ok_or(CgroupError::NoCgroup2)
}

/// The one spelling of cgroup path `path` (relative to a hierarchy's root, as /proc/PID/cgroup and
/// registrations write it): `/` then its components joined by single `/`, with `.` components dropped;
/// the root is `/`. Refuses a `..` component, which could climb above (or out of) the cgroup it seems to
/// name. Every comparison of cgroup paths (the root, the shim's, the init's) uses this spelling.
pub fn canonical_path(path: &str) -> Result<String, CgroupError> {
    let mut out = String::with_capacity(path.len() + 1);
    for part in path.split('/').filter(|p| !p.is_empty() && *p != ".") {
        if part == ".." {
            return Err(CgroupError::NotCanonical {
                path: path.to_owned(),
            });
        }
        out.push('/');
        out.push_str(part);
    }
    if out.is_empty() {
        out.push('/');
    }
    Ok(out)
}

/// Whether cgroup path `path` (canonical, see [`canonical_path`]) is a hierarchy's root.
pub fn is_root(canonical: &str) -> bool {
    canonical == "/"
}

/// Maps cgroup v2 ids to paths (relative to the v2 root, starting with `/`) and back.
#[derive(Debug)]
pub struct CgroupIndex {
    root: PathBuf,
    by_id: HashMap<u64, String>,
}

impl CgroupIndex {
    /// An index of the hierarchy mounted at `root`, scanned once.
    pub fn new(root: PathBuf) -> Self {
        let mut idx = Self {
            root,
            by_id: HashMap::new(),
        };
        idx.rescan();
        idx
    }

    /// The v2 root this index walks.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Walks the whole hierarchy again (cgroups come and go with containers).
    pub fn rescan(&mut self) {
        self.by_id.clear();
        let mut stack = vec![self.root.clone()];
        while let Some(dir) = stack.pop() {
            if let Ok(meta) = fs::metadata(&dir) {
                self.by_id.insert(meta.ino(), self.relative(&dir));
            }
            let Ok(entries) = fs::read_dir(&dir) else {
                continue;
            };
            stack.extend(
                entries
                    .flatten()
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .map(|e| e.path()),
            );
        }
    }

    fn relative(&self, dir: &Path) -> String {
        let rel = dir.strip_prefix(&self.root).unwrap_or(dir);
        format!("/{}", rel.display())
    }

    /// The path of cgroup `id`, rescanning once if it is not known yet.
    pub fn path_of(&mut self, id: u64) -> Option<&str> {
        if !self.by_id.contains_key(&id) {
            self.rescan();
        }
        self.by_id.get(&id).map(String::as_str)
    }

    /// Every known (id, path).
    pub fn entries(&self) -> impl Iterator<Item = (u64, &str)> {
        self.by_id.iter().map(|(id, p)| (*id, p.as_str()))
    }

    /// The id of a cgroup given as a path relative to the root (`/default/c1`) or absolute under it; a path
    /// with a `..` component is refused ([`canonical_path`]).
    pub fn id_of_path(&self, path: &Path) -> Result<u64, CgroupError> {
        let text = path.to_str().ok_or_else(|| CgroupError::NotCanonical {
            path: path.display().to_string(),
        })?;
        let canonical = canonical_path(text)?;
        let rel = match Path::new(&canonical).strip_prefix(&self.root) {
            Ok(under_root) => under_root.to_path_buf(),
            Err(_) => PathBuf::from(canonical.trim_start_matches('/')),
        };
        let abs = self.root.join(rel);
        let meta = fs::metadata(&abs).map_err(|source| CgroupError::Io {
            path: abs.clone(),
            source,
        })?;
        if !meta.is_dir() {
            return Err(CgroupError::NotUnderRoot {
                path: path.into(),
                root: self.root.clone(),
            });
        }
        Ok(meta.ino())
    }
}

/// Process `pid`'s /proc/PID/stat, if it still has one.
fn stat_of(pid: u32) -> Option<procfs::process::Stat> {
    procfs::process::Process::new(pid as i32)
        .and_then(|p| p.stat())
        .ok()
}

/// Whether `stat` is a zombie's or a dead process's (it runs nothing any more).
fn is_dead(stat: &procfs::process::Stat) -> bool {
    matches!(stat.state, 'Z' | 'X' | 'x')
}

/// Whether process `pid` has exited: no such process, or a zombie (it runs nothing any more).
pub fn process_gone(pid: u32) -> bool {
    instance_gone(pid, None)
}

/// When process `pid` started (`starttime` of /proc/PID/stat, clock ticks after boot), to tell it from a later
/// process given the same pid; `None` when there is no such process.
pub fn start_ticks(pid: u32) -> Option<u64> {
    stat_of(pid).map(|s| s.starttime)
}

/// Whether the process that was `pid` when it started at `started` ([`start_ticks`]) has exited: [`process_gone`],
/// or `pid` now names another process. Pids are reused (pid_max is 32768 by default), so a dead process's pid
/// alone can name a live stranger. Without a start time, the pid alone decides.
pub fn instance_gone(pid: u32, started: Option<u64>) -> bool {
    stat_of(pid).is_none_or(|s| is_dead(&s) || started.is_some_and(|t| s.starttime != t))
}

/// Whether process `pid` has exited or is exiting: [`process_gone`], or inside the kernel's exit (`PF_EXITING`:
/// it has called `exit` or was killed, and closes its files and memory before it becomes a zombie, which can take
/// a while on a loaded node or with files on a slow FUSE driver).
pub fn process_ending(pid: u32) -> bool {
    stat_of(pid).is_none_or(|s| {
        is_dead(&s)
            || s.flags()
                .is_ok_and(|f| f.contains(procfs::process::StatFlags::PF_EXITING))
    })
}

/// The cgroups of a process, one per hierarchy (/proc/PID/cgroup, read by procfs): the one place Baton reads it.
pub fn of_pid(pid: u32) -> Option<Vec<procfs::ProcessCGroup>> {
    let pid = i32::try_from(pid).ok()?;
    Some(procfs::process::Process::new(pid).ok()?.cgroups().ok()?.0)
}

/// The cgroup v2 path of a process (relative to the v2 root, starting with `/`): its hierarchy 0 entry, as
/// the node names it ([`adopt_node_paths`]).
pub fn v2_path_of_pid(pid: u32) -> Option<String> {
    of_pid(pid)?
        .into_iter()
        .find(|cg| cg.hierarchy == 0)
        .map(|cg| on_node(&cg.pathname))
}

/// The node path of this process's cgroup namespace root, once [`adopt_node_paths`] found one.
static NAMESPACE_ROOT: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// For a process in a cgroup namespace of its own (a pod's, on cgroup v2 nodes) that sees the node's whole
/// v2 hierarchy at `root` (mounted from the node): finds the cgroup holding this process there (its pid in
/// a `cgroup.procs`), and when /proc/self/cgroup names it otherwise (the namespace makes it read `/`),
/// takes that cgroup as the namespace's root, so that [`v2_path_of_pid`] from then on gives node paths (the
/// kernel writes a path relative to the reader's namespace, `/..` climbing out of it). Returns that root, or
/// `None` where the paths /proc gives are the node's already. Call once, first thing.
pub fn adopt_node_paths(root: &Path) -> Result<Option<String>, CgroupError> {
    let seen = of_pid(std::process::id())
        .and_then(|cgs| cgs.into_iter().find(|cg| cg.hierarchy == 0))
        .map(|cg| cg.pathname)
        .ok_or(CgroupError::NoCgroup2)?;
    let me = std::process::id().to_string();
    let index = CgroupIndex::new(root.to_path_buf());
    let holds_me = |rel: &str| {
        fs::read_to_string(root.join(rel.trim_start_matches('/')).join("cgroup.procs"))
            .is_ok_and(|procs| procs.lines().any(|p| p == me))
    };
    if let Some((_, on_node)) = index.entries().find(|(_, rel)| holds_me(rel)) {
        if canonical_path(&seen).ok() == canonical_path(on_node).ok() {
            return Ok(None);
        }
        let _ = NAMESPACE_ROOT.set(on_node.to_owned());
        return Ok(Some(on_node.to_owned()));
    }
    Err(CgroupError::NotUnderRoot {
        path: PathBuf::from(format!("the cgroup of process {me} ({seen})")),
        root: root.to_path_buf(),
    })
}

/// Cgroup path `seen` (as /proc wrote it for this process) as the node names it.
fn on_node(seen: &str) -> String {
    match NAMESPACE_ROOT.get() {
        Some(ns_root) => resolve_under(ns_root, seen),
        None => seen.to_owned(),
    }
}

/// Path `rel` (from /proc, relative to a namespace root, with `..` to climb out of it) joined to `base`,
/// `..` resolved: `/a/b` + `/../c` = `/a/c`.
fn resolve_under(base: &str, rel: &str) -> String {
    let mut parts: Vec<&str> = base.split('/').filter(|p| !p.is_empty()).collect();
    for part in rel.split('/') {
        match part {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            p => parts.push(p),
        }
    }
    format!("/{}", parts.join("/"))
}

/// The cgroup v2 id of a process.
pub fn cgroup_id_of_pid(root: &Path, pid: i32) -> Option<u64> {
    let rel = v2_path_of_pid(u32::try_from(pid).ok()?)?;
    fs::metadata(root.join(rel.trim_start_matches('/')))
        .ok()
        .map(|m| m.ino())
}

/// Creates the cgroup `rel` (a path relative to the v2 `root`) and its parents; returns its absolute path.
pub fn create(root: &Path, rel: &str) -> Result<PathBuf, CgroupError> {
    let path = root.join(rel.trim_start_matches('/'));
    fs::create_dir_all(&path).map_err(|source| CgroupError::Io {
        path: path.clone(),
        source,
    })?;
    Ok(path)
}

/// Moves process `pid` into the cgroup at `path` (absolute).
pub fn move_pid(path: &Path, pid: u32) -> Result<(), CgroupError> {
    let procs = path.join("cgroup.procs");
    fs::write(&procs, pid.to_string()).map_err(|source| CgroupError::Io {
        path: procs,
        source,
    })
}

/// A command that runs `program args...` inside the cgroup at `path` (absolute) from its first instruction:
/// a shell moves itself into the cgroup, then execs the program, so nothing runs outside it.
pub fn command_in(path: &Path, program: &Path, args: &[String]) -> std::process::Command {
    let mut cmd = std::process::Command::new("/bin/sh");
    cmd.arg("-c")
        .arg(r#"echo $$ > "$0/cgroup.procs" && exec "$@""#)
        .arg(path)
        .arg(program)
        .args(args);
    cmd
}

/// Removes an empty cgroup (after its processes exited); missing is fine.
pub fn remove(path: &Path) -> Result<(), CgroupError> {
    match fs::remove_dir(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(CgroupError::Io {
            path: path.into(),
            source: e,
        }),
        _ => Ok(()),
    }
}

/// The mount points of the cgroup hierarchies (v1 and v2) mounted at their root, from
/// /proc/self/mountinfo.
pub fn hierarchy_roots() -> Result<Vec<PathBuf>, CgroupError> {
    let text = fs::read_to_string("/proc/self/mountinfo").map_err(|source| CgroupError::Io {
        path: "/proc/self/mountinfo".into(),
        source,
    })?;
    Ok(text
        .lines()
        .filter_map(|line| {
            let (pre, post) = line.split_once(" - ")?;
            let fstype = post.split_whitespace().next()?;
            let root = pre.split_whitespace().nth(3)?;
            ((fstype == "cgroup" || fstype == "cgroup2") && root == "/")
                .then(|| pre.split_whitespace().nth(4).map(PathBuf::from))?
        })
        .collect())
}

/// Moves `pid` into the root cgroup of every mounted hierarchy (v1 controllers and v2), out of the
/// cgroups of whoever started it (a pod's, which is killed with the pod). Returns the roots it could not
/// join, with why.
pub fn move_to_root_cgroups(pid: u32) -> Result<Vec<(PathBuf, std::io::Error)>, CgroupError> {
    let mut failed = Vec::new();
    for root in hierarchy_roots()? {
        if let Err(e) = fs::write(root.join("cgroup.procs"), pid.to_string()) {
            failed.push((root, e));
        }
    }
    Ok(failed)
}

/// A short, human name for the container a cgroup path belongs to, following the naming of containerd
/// (`/<namespace>/<id>`), the CRI plugin with the cgroupfs driver (`/kubepods/<qos>/pod<uid>/<id>`) or the
/// systemd driver (`.../cri-containerd-<id>.scope`), and Docker (`/docker/<id>`, `docker-<id>.scope`). Falls
/// back to the path itself.
pub fn container_name(path: &str) -> String {
    let last = path.rsplit('/').next().unwrap_or(path);
    for (prefix, suffix) in [
        ("cri-containerd-", ".scope"),
        ("docker-", ".scope"),
        ("crio-", ".scope"),
    ] {
        if let Some(id) = last
            .strip_prefix(prefix)
            .and_then(|s| s.strip_suffix(suffix))
        {
            return short_id(id).to_owned();
        }
    }
    let parts: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    match parts.as_slice() {
        ["kubepods" | "kubepods.slice", .., pod, id] if pod.contains("pod") => {
            short_id(id).to_owned()
        }
        ["docker", id] => short_id(id).to_owned(),
        [ns, id] if !ns.ends_with(".slice") && !ns.ends_with(".scope") => format!("{ns}/{id}"),
        _ if path.is_empty() || path == "/" => "/".to_owned(),
        _ => path.to_owned(),
    }
}

/// The first 12 characters of a 64-hex container id, as `docker ps` and `crictl ps` show them.
fn short_id(id: &str) -> &str {
    if id.len() == 64 && id.bytes().all(|b| b.is_ascii_hexdigit()) {
        &id[..12]
    } else {
        id
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn paths_read_in_a_cgroup_namespace_resolve_on_the_node() {
        assert_eq!(
            resolve_under("/kubepods/pod1/agent", "/"),
            "/kubepods/pod1/agent"
        );
        assert_eq!(
            resolve_under("/kubepods/pod1/agent", "/../../pod2/c"),
            "/kubepods/pod2/c"
        );
        assert_eq!(
            resolve_under("/kubepods/pod1/agent", "/sub"),
            "/kubepods/pod1/agent/sub"
        );
        assert_eq!(resolve_under("/a", "/../../.."), "/");
        // Outside a namespace of its own, the paths read are the node's.
        assert_eq!(on_node("/default/c1"), "/default/c1");
    }

    use super::*;

    #[test]
    fn a_process_is_told_from_a_later_one_with_its_pid_by_its_start_time() {
        let me = std::process::id();
        let started = start_ticks(me);
        assert!(started.is_some());
        assert!(!instance_gone(me, started), "this very process");
        assert!(!instance_gone(me, None), "the pid alone");
        let other = started.map(|t| t + 1);
        assert!(instance_gone(me, other), "another process with this pid");
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let started = start_ticks(pid);
        child.wait().unwrap();
        assert!(instance_gone(pid, started), "exited and reaped");
    }

    #[test]
    fn names_follow_runtime_conventions() {
        let id = "0123456789abcdef".repeat(4);
        assert_eq!(container_name("/default/trainer"), "default/trainer");
        assert_eq!(
            container_name(&format!("/kubepods/burstable/pod1234-56/{id}")),
            "0123456789ab"
        );
        assert_eq!(
            container_name(&format!(
                "/kubepods.slice/kubepods-pod9.slice/cri-containerd-{id}.scope"
            )),
            "0123456789ab"
        );
        assert_eq!(container_name(&format!("/docker/{id}")), "0123456789ab");
        assert_eq!(
            container_name("/user.slice/user-0.slice/session-1.scope"),
            "/user.slice/user-0.slice/session-1.scope"
        );
        assert_eq!(container_name("/"), "/");
    }

    #[test]
    fn index_maps_ids_to_paths_on_a_tempdir_tree() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("default/c1")).unwrap();
        let mut idx = CgroupIndex::new(dir.path().to_path_buf());
        let id = idx.id_of_path(Path::new("/default/c1")).unwrap();
        assert_eq!(idx.path_of(id), Some("/default/c1"));
        assert!(idx.id_of_path(Path::new("/missing")).is_err());
        // Other spellings of the same cgroup find it; `..` is refused, even where it would land on a
        // cgroup (here the root).
        assert_eq!(idx.id_of_path(Path::new("//default/./c1/")).unwrap(), id);
        let abs = dir.path().join("default//c1");
        assert_eq!(idx.id_of_path(&abs).unwrap(), id);
        for climbing in ["/default/..", "/default/c1/../../..", "../etc"] {
            let e = idx.id_of_path(Path::new(climbing)).unwrap_err();
            assert!(
                matches!(e, CgroupError::NotCanonical { .. }),
                "{climbing}: {e}"
            );
        }
    }

    #[test]
    fn cgroup_paths_have_one_spelling_and_no_parent_components() {
        for (given, canonical) in [
            ("/", "/"),
            ("", "/"),
            ("/.", "/"),
            ("//", "/"),
            ("/./", "/"),
            ("/a/./b", "/a/b"),
            ("//a//b/", "/a/b"),
            ("a/b", "/a/b"),
            ("/kubepods/pod1/c.scope", "/kubepods/pod1/c.scope"),
        ] {
            assert_eq!(canonical_path(given).unwrap(), canonical, "{given:?}");
        }
        assert!(is_root(&canonical_path("/.").unwrap()));
        assert!(is_root(&canonical_path("//").unwrap()));
        for climbing in ["/a/..", "/a/../", "/..", "/a/b/../../c", ".."] {
            let e = canonical_path(climbing).unwrap_err();
            assert!(e.to_string().contains("`..`"), "{climbing}: {e}");
        }
    }
}
