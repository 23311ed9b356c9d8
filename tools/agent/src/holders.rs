//! Who holds NVIDIA files, from kernel facts: `/proc/PID/fd` and `/proc/PID/map_files` of each process,
//! read when the probes' mirror says a container let go (before its `released` is published) and when the
//! gate is about to open. The probes follow opens, dups, forks, closes and mappings, but a file can also
//! move in ways they do not see (SCM_RIGHTS, pidfd_getfd, a shared fd table, io_uring, a device node made
//! with mknod under another name); these reads see every holder whatever way it came by the file.
//!
//! A file is an NVIDIA file when it is a character device with NVIDIA's numbers (`baton_nvidia::fdkind`),
//! or, for a file that is not a device (the FUSE mock driver), when its name is an NVIDIA device's. Each
//! distinct mapped file is looked at once per scan, and only shared mappings and those named as an NVIDIA
//! device are looked at: device memory is mapped shared, and a CUDA process has hundreds of private library
//! mappings (a private mapping of a device node of another name is not seen; see the README).
use std::{
    collections::{BTreeSet, HashMap},
    ops::ControlFlow,
    os::unix::fs::MetadataExt,
    path::Path,
};

use baton_nvidia::fdkind::{self, FdKind};
use baton_tracer::{
    fdtable::ProcFds,
    proc_read::{MapLine, ProcDir, ProcError, base_name, mentions, raw_shared},
};

use super::gate::DeviceKey;

/// One NVIDIA file a process holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holding {
    /// The holding process.
    pub pid: u32,
    /// What kind of NVIDIA file.
    pub kind: FdKind,
    /// Which device (the gate compares these).
    pub key: DeviceKey,
    /// How it holds it.
    pub via: Via,
}

/// How a process holds a file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Via {
    /// Open as this fd.
    Fd(i32),
    /// Mapped at this address.
    Map(u64),
    /// Registered in the io_uring instance open as this fd (a fixed file, in no fd table).
    Ring(i32),
    /// Its files could not be read (this says which and why): it counts as holding every GPU, so that what
    /// the agent cannot see never opens a gate or confirms a release (the check fails closed).
    Unreadable(String),
}

impl std::fmt::Display for Holding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let how = match &self.via {
            Via::Fd(fd) => format!("fd {fd}"),
            Via::Map(addr) => format!("a mapping at 0x{addr:x}"),
            Via::Ring(fd) => format!("a file registered in io_uring fd {fd}"),
            Via::Unreadable(why) => {
                return write!(f, "process {} (the agent cannot read {why})", self.pid);
            }
        };
        write!(f, "process {} ({how} of {})", self.pid, self.key)
    }
}

/// What lets the agent read every process's /proc entries, for the messages about one it could not read.
pub const UNREADABLE_FIX: &str = "the agent needs CAP_SYS_PTRACE and CAP_DAC_READ_SEARCH, and a security \
    profile that lets it read other processes' /proc (AppArmor unconfined, as tools/kubernetes/baton-agent.yaml \
    sets)";

/// What process `pid`, alive, whose `what` could not be read for `why`, counts as holding: every GPU, unless
/// it is in the root cgroup of every hierarchy, where no container runs (the node's init and kernel threads;
/// a tenant cannot move there). Under a sandbox's LSM (Landlock, AppArmor) the node's init is often one that
/// nothing under it may read.
fn unreadable(pid: u32, what: &str, why: &str) -> Vec<Holding> {
    if in_root_cgroup(pid) {
        return Vec::new();
    }
    vec![Holding {
        pid,
        kind: FdKind::Device,
        key: DeviceKey::Unknown,
        via: Via::Unreadable(format!("/proc/{pid}/{what}: {why}")),
    }]
}

/// Whether process `pid` is in the node's root cgroup: its v2 cgroup as the node names it is `/`, and so is
/// each cgroup v1 one (or, read from inside a cgroup namespace, one outside it: `/..`). Containers never run
/// there (runc gives each one cgroups of its own, under v1 and v2 alike).
fn in_root_cgroup(pid: u32) -> bool {
    use baton_tracer::cgroups::{of_pid, v2_path_of_pid};
    v2_path_of_pid(pid).is_some_and(|p| p == "/")
        && of_pid(pid).is_some_and(|all| {
            all.iter()
                .filter(|c| c.hierarchy != 0)
                .all(|c| c.pathname == "/" || c.pathname.starts_with("/.."))
        })
}

/// Tells NVIDIA files apart (the UVM major is dynamic: read once from /proc/devices).
#[derive(Clone, Debug, Default)]
pub struct Classifier {
    uvm_major: u32,
}

impl Classifier {
    /// A classifier for this node.
    pub fn new() -> Self {
        let uvm_major = std::fs::read_to_string("/proc/devices")
            .ok()
            .and_then(|text| major_named(&text, fdkind::UVM_DEVICES_NAME))
            .unwrap_or(0);
        Self { uvm_major }
    }

    /// The NVIDIA files process `pid` holds now (none when it is gone).
    #[cfg(test)]
    pub fn holdings_of(&self, pid: u32) -> Vec<Holding> {
        let mut cache = HashMap::new();
        self.holdings_cached(pid, &mut cache)
    }

    /// [`Classifier::holdings_of`], looking at each distinct mapped file (by the maps entry's device and
    /// inode) once across the calls that share `cache`.
    fn holdings_cached(
        &self,
        pid: u32,
        cache: &mut HashMap<(u64, u64), Option<(FdKind, DeviceKey)>>,
    ) -> Vec<Holding> {
        self.holdings_until(pid, cache, &|_| false)
    }

    /// [`Classifier::holdings_cached`] that stops at the first holding `enough` says settles the question
    /// (the fds first, then the mappings, whose read stops there too): a process with a million device fds
    /// or mappings costs a look at as many as it takes to find one that counts, not at all of them. Read
    /// through [`baton_tracer::proc_read`]: a process that is gone holds nothing, one whose entries fail
    /// otherwise is [`Via::Unreadable`].
    fn holdings_until(
        &self,
        pid: u32,
        cache: &mut HashMap<(u64, u64), Option<(FdKind, DeviceKey)>>,
        enough: &dyn Fn(&Holding) -> bool,
    ) -> Vec<Holding> {
        match self.read_holdings(pid, cache, enough) {
            Ok(out) => out,
            Err(ProcError::Gone) => Vec::new(),
            Err(ProcError::Unreadable { what, why, .. }) => unreadable(pid, &what, &why),
        }
    }

    fn read_holdings(
        &self,
        pid: u32,
        cache: &mut HashMap<(u64, u64), Option<(FdKind, DeviceKey)>>,
        enough: &dyn Fn(&Holding) -> bool,
    ) -> Result<Vec<Holding>, ProcError> {
        let dir = ProcDir::open(pid)?;
        let mut out = Vec::new();
        // The fd numbers (listing /proc/PID/fd needs no more than root), each link read on its own: reading
        // a link passes the kernel's ptrace access check, and a refusal is an unreadable process.
        for fd in dir.fd_numbers()? {
            let Some(target) = dir.fd_target(fd)? else {
                continue;
            };
            let target = target.as_encoded_bytes();
            if target == b"anon_inode:[io_uring]" {
                out.extend(ring_holdings(&dir, fd)?);
                continue;
            }
            if !target.starts_with(b"/") {
                continue;
            }
            let Some(meta) = dir.fd_metadata(fd)? else {
                continue;
            };
            if let Some((kind, key)) = DeviceKey::classify_meta(&meta, target, self.uvm_major) {
                let h = Holding {
                    pid,
                    kind,
                    key,
                    via: Via::Fd(fd),
                };
                let done = enough(&h);
                out.push(h);
                if done {
                    return Ok(out);
                }
            }
        }
        let mut failed = None;
        // Only shared mappings and those named as an NVIDIA device are parsed (see [`worth_a_look`]).
        let wanted = |line: &[u8]| raw_shared(line) || mentions(line, b"nvidia");
        dir.for_each_mapping(wanted, |m| {
            if !worth_a_look(m) {
                return ControlFlow::Continue(());
            }
            let classified = match cache.get(&(m.dev, m.inode)) {
                Some(c) => c.clone(),
                None => match dir.mapping_metadata(m.start, m.end) {
                    Ok(Some(meta)) => {
                        let c = DeviceKey::classify_meta(&meta, m.path, self.uvm_major);
                        cache.insert((m.dev, m.inode), c.clone());
                        c
                    }
                    // Unmapped meanwhile.
                    Ok(None) => None,
                    Err(e) => {
                        failed = Some(e);
                        return ControlFlow::Break(());
                    }
                },
            };
            let Some((kind, key)) = classified else {
                return ControlFlow::Continue(());
            };
            let h = Holding {
                pid,
                kind,
                key,
                via: Via::Map(m.start),
            };
            let done = enough(&h);
            out.push(h);
            if done {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        })?;
        match failed {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    /// What the processes `pids` hold.
    pub fn holdings_of_all(&self, pids: impl IntoIterator<Item = u32>) -> Vec<Holding> {
        let mut cache = HashMap::new();
        pids.into_iter()
            .flat_map(|pid| self.holdings_cached(pid, &mut cache))
            .collect()
    }
}

/// Whether a mapping may be NVIDIA device memory: a file's (not anonymous), shared (device memory is mapped
/// shared) or named as an NVIDIA device (a library's private mappings, most of a process's, cost nothing).
fn worth_a_look(m: &MapLine<'_>) -> bool {
    m.inode != 0
        && m.path.starts_with(b"/")
        && (m.shared() || fdkind::classify_name(m.base_name()).is_some())
}

/// The NVIDIA files registered in io_uring instance `fd` of the process (its fdinfo lists them under
/// `UserFiles:`, one `INDEX: PATH` line each, names raw). They are known by name only: the key carries no
/// file identity, and the gate matches it with any device of that name.
fn ring_holdings(dir: &ProcDir, fd: i32) -> Result<Vec<Holding>, ProcError> {
    let Some(text) = dir.fdinfo(fd)? else {
        return Ok(Vec::new());
    };
    Ok(registered_files(&text)
        .filter_map(|path| {
            let name = base_name(path);
            let (kind, _) = fdkind::classify_name(name)?;
            (kind != FdKind::Unknown).then(|| Holding {
                pid: dir.pid(),
                kind,
                key: DeviceKey::File {
                    dev: 0,
                    ino: 0,
                    name: String::from_utf8_lossy(name).into_owned(),
                },
                via: Via::Ring(fd),
            })
        })
        .collect())
}

/// The paths of the `UserFiles:` section of an io_uring fdinfo (bytes: a path need not be UTF-8).
fn registered_files(fdinfo: &[u8]) -> impl Iterator<Item = &[u8]> {
    fdinfo
        .split(|b| *b == b'\n')
        .skip_while(|l| !l.starts_with(b"UserFiles:"))
        .skip(1)
        .map_while(|l| {
            let at = l.windows(2).position(|w| w == b": ")?;
            let index = std::str::from_utf8(&l[..at]).ok()?.trim();
            index.parse::<u32>().ok().map(|_| trim_ascii(&l[at + 2..]))
        })
}

fn trim_ascii(b: &[u8]) -> &[u8] {
    b.trim_ascii()
}

/// The major named `name` in the text of /proc/devices.
fn major_named(devices: &str, name: &str) -> Option<u32> {
    devices
        .lines()
        .skip_while(|l| !l.starts_with("Character devices"))
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .find_map(|l| {
            let (num, n) = l.trim().split_once(' ')?;
            (n.trim() == name).then(|| num.parse().ok())?
        })
}

/// The pids of cgroup v2 `dir` (an absolute folder under the v2 mount) and of the cgroups below it.
pub fn pids_of_cgroup_tree(dir: &Path) -> Vec<u32> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        if let Ok(text) = std::fs::read_to_string(d.join("cgroup.procs")) {
            out.extend(text.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
        }
        // A container's cgroup rarely has cgroups below it: `cgroup.stat` says so in one small read, where
        // listing the folder (dozens of control files) took most of this function's time.
        let leaf = std::fs::read_to_string(d.join("cgroup.stat")).is_ok_and(|t| {
            t.lines()
                .any(|l| l.split_whitespace().eq(["nr_descendants", "0"]))
        });
        if leaf {
            continue;
        }
        for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                todo.push(entry.path());
            }
        }
    }
    out
}

/// Which processes do not count as holders: the node's own (in the mount namespace of the node's init, or
/// of the agent where that one cannot be read), the agent, those in the operator's exempt cgroups, and the
/// containers of the operator's exempt pods (see `pods.rs`).
#[derive(Clone, Debug, Default)]
pub struct Exempt {
    /// cgroup v2 paths whose processes (and those of the cgroups below) are the node's daemons.
    pub cgroups: Vec<String>,
    /// The pods that are the node's daemons (`--exempt-pod`).
    pub pods: crate::pods::ExemptPods,
}

impl Exempt {
    /// Whether process `pid` is one of the node's own. A process whose namespace cannot be read counts as a
    /// container's (the check fails closed).
    fn is_nodes_own(&self, pid: u32, host_mnt: Option<u64>) -> bool {
        if pid == std::process::id() {
            return true;
        }
        let mnt = std::fs::metadata(format!("/proc/{pid}/ns/mnt")).map(|m| m.ino());
        if host_mnt.is_some() && mnt.as_ref().ok() == host_mnt.as_ref() {
            return true;
        }
        !self.cgroups.is_empty()
            && baton_tracer::cgroups::v2_path_of_pid(pid)
                .is_some_and(|p| self.cgroups.iter().any(|e| is_within(&p, e)))
    }
}

/// Whether cgroup path `path` is `top` or below it.
pub fn is_within(path: &str, top: &str) -> bool {
    let top = top.trim_end_matches('/');
    path == top || path.strip_prefix(top).is_some_and(|r| r.starts_with('/'))
}

/// The node's mount namespace: pid 1's, or the agent's own where pid 1's cannot be read.
fn host_mount_namespace() -> Option<u64> {
    std::fs::metadata("/proc/1/ns/mnt")
        .or_else(|_| std::fs::metadata("/proc/self/ns/mnt"))
        .ok()
        .map(|m| m.ino())
}

/// What the gate asks of a look at the whole node ([`ScanRequest::run`], on the blocking pool): every process
/// in a container (not the node's own, see [`Exempt`]) that holds a GPU device file of `devices` that the
/// probes do not follow in a watched container (`followed`, the mirror's files of those containers when it
/// was asked).
#[derive(Clone, Debug)]
pub struct ScanRequest {
    /// Tells NVIDIA files apart.
    pub classifier: Classifier,
    /// The node's own processes.
    pub exempt: Exempt,
    /// The GPU devices the waiting Starts see (not empty).
    pub devices: BTreeSet<DeviceKey>,
    /// The NVIDIA fds and mappings the probes follow in watched containers, by pid.
    pub followed: HashMap<u32, ProcFds>,
    /// When it was asked (monotonic ns): the scan sees every holding older than that.
    pub asked_ns: u64,
}

/// What a node scan found ([`ScanRequest::run`]).
#[derive(Clone, Debug)]
pub struct NodeScan {
    /// When it was asked (monotonic ns).
    pub asked_ns: u64,
    /// The devices it looked for.
    pub devices: BTreeSet<DeviceKey>,
    /// The holdings found, each with its process's cgroup v2 path (when it could be read).
    pub holders: Vec<(Holding, Option<String>)>,
    /// How long it took.
    pub took: std::time::Duration,
}

impl NodeScan {
    /// The holders of device(s) `devices` outside cgroup `except` (with the cgroups below it).
    pub fn holders_of(&self, devices: &BTreeSet<DeviceKey>, except: &str) -> Vec<Holding> {
        self.holders
            .iter()
            .filter(|(h, _)| devices.iter().any(|d| d.same_device(&h.key)))
            .filter(|(_, cgroup)| cgroup.as_deref().is_none_or(|c| !is_within(c, except)))
            .map(|(h, _)| h.clone())
            .collect()
    }
}

impl ScanRequest {
    /// Looks at every process of the node (see [`ScanRequest`]). A process's files are looked at until they
    /// cover every device asked about (a tenant with a million device fds costs a look at one per device);
    /// its maps are read line by line. Blocks: run it on the blocking pool.
    pub fn run(self) -> NodeScan {
        let began = std::time::Instant::now();
        let followed = |h: &Holding| {
            self.followed
                .get(&h.pid)
                .is_some_and(|p| crate::registry::watched::accounted_in(p, h))
        };
        let counts = |h: &Holding| {
            h.kind == FdKind::Device
                && self.devices.iter().any(|d| d.same_device(&h.key))
                && !followed(h)
        };
        let host_mnt = host_mount_namespace();
        let mut cache = HashMap::new();
        let mut pods = HashMap::new();
        let mut holders = Vec::new();
        let pids = match baton_tracer::seed::all_pids() {
            Ok(pids) => pids,
            Err(e) => {
                // Not one process of the node could be looked at: all of them count as holding.
                let why = format!("the list of processes: {e}");
                let h = Holding {
                    pid: 0,
                    kind: FdKind::Device,
                    key: DeviceKey::Unknown,
                    via: Via::Unreadable(why),
                };
                return NodeScan {
                    asked_ns: self.asked_ns,
                    devices: self.devices,
                    holders: vec![(h, None)],
                    took: began.elapsed(),
                };
            }
        };
        for pid in pids {
            if self.exempt.is_nodes_own(pid, host_mnt) {
                continue;
            }
            let left = std::cell::RefCell::new(self.devices.clone());
            let covered_all = |h: &Holding| {
                if !counts(h) {
                    return false;
                }
                let mut left = left.borrow_mut();
                left.retain(|d| !d.same_device(&h.key));
                left.is_empty()
            };
            let held: Vec<Holding> = self
                .classifier
                .holdings_until(pid, &mut cache, &covered_all)
                .into_iter()
                .filter(counts)
                .collect();
            if held.is_empty() {
                continue;
            }
            let cgroup = baton_tracer::cgroups::v2_path_of_pid(pid);
            if cgroup
                .as_deref()
                .is_some_and(|c| self.exempt.pods.exempts(c, &mut pods))
            {
                continue;
            }
            holders.extend(held.into_iter().map(|h| (h, cgroup.clone())));
        }
        NodeScan {
            asked_ns: self.asked_ns,
            devices: self.devices,
            holders,
            took: began.elapsed(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_shared_or_nvidia_named_file_mappings_are_looked_at() {
        let look = |line: &[u8]| worth_a_look(&MapLine::parse(line).unwrap());
        assert!(look(
            b"7f00a000-7f00b000 rw-s 00000000 00:2d 42          /dev/nvidia0"
        ));
        assert!(look(b"1000-2000 r--p 00000000 00:05 7 /tmp/mock/nvidiactl"));
        assert!(!look(
            b"1000-2000 r-xp 00000000 fd:00 99 /usr/lib/libc.so.6"
        ));
        assert!(!look(b"1000-2000 ---p 00000000 00:00 0 "));
        assert!(look(
            b"1000-2000 rw-s 00000000 00:2d 43 /dev/shm/a name with spaces"
        ));
        assert!(look(b"1000-2000 rw-s 00000000 00:2d 43 /tmp/\xff\xfe"));
        assert!(!look(b"1000-2000 r--p 00000000 00:2d 43 /tmp/\xff\xfe"));
    }

    #[test]
    fn the_uvm_major_is_read_from_the_character_devices() {
        let text =
            "Character devices:\n  1 mem\n195 nvidia\n508 nvidia-uvm\n\nBlock devices:\n 8 sd\n";
        assert_eq!(major_named(text, "nvidia-uvm"), Some(508));
        assert_eq!(major_named(text, "sd"), None);
        assert_eq!(major_named(text, "nvidia-caps"), None);
    }

    #[test]
    fn io_uring_registered_files_are_read_from_its_fdinfo() {
        let text = b"pos:\t0\nflags:\t02000002\nSqMask:\t0x0\nUserFiles:\t3\n    0: /tmp/\xff\n    1: /dev/nvidiactl\n    2: /tmp/x\nUserBufs:\t0\n";
        let files: Vec<&[u8]> = registered_files(text).collect();
        assert_eq!(files, [&b"/tmp/\xff"[..], b"/dev/nvidiactl", b"/tmp/x"]);
        assert_eq!(
            registered_files(b"UserFiles:\t0\nUserBufs:\t0\n").count(),
            0
        );
    }

    #[test]
    fn cgroup_paths_are_within_their_parents_only_at_a_separator() {
        assert!(is_within("/kubepods/dcgm", "/kubepods/dcgm"));
        assert!(is_within("/kubepods/dcgm/c1", "/kubepods/dcgm/"));
        assert!(!is_within("/kubepods/dcgm-evil", "/kubepods/dcgm"));
    }

    #[test]
    fn a_file_named_as_a_device_held_by_this_process_is_seen_through_fd_and_mapping() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nvidia0");
        std::fs::write(&path, vec![0u8; 4096]).unwrap();
        let other = dir.path().join("notes");
        std::fs::write(&other, b"x").unwrap();
        let file = std::fs::File::open(&path).unwrap();
        let _plain = std::fs::File::open(&other).unwrap();
        let c = Classifier::new();
        let mine = c.holdings_of(std::process::id());
        let fds: Vec<&Holding> = mine
            .iter()
            .filter(|h| matches!(h.via, Via::Fd(_)) && h.key.to_string().contains("nvidia0"))
            .collect();
        assert_eq!(fds.len(), 1, "{mine:?}");
        assert_eq!(fds[0].kind, FdKind::Device);
        assert!(mine.iter().all(|h| !h.key.to_string().contains("notes")));
        drop(file);
        assert!(
            c.holdings_of(std::process::id()).iter().all(|h| !h
                .key
                .to_string()
                .contains(&path.display().to_string())
                || !matches!(h.via, Via::Fd(_))),
        );
    }
}
