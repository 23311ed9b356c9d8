//! OOM kills of a container: cgroup v1 through an eventfd registered on `memory.oom_control`
//! (`cgroup.event_control`), cgroup v2 through an inotify watch on `memory.events`. Both read the
//! kernel's `oom_kill` counter, and [`OomWatch::check`] publishes only a counter increase, so the
//! exit path can call it just before TaskExit: the OOM event always precedes the exit.

use std::{
    os::fd::{AsFd, AsRawFd},
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use nix::sys::{
    eventfd::{EfdFlags, EventFd},
    inotify::{AddWatchFlags, InitFlags, Inotify},
};
use tokio::io::unix::AsyncFd;

use crate::errors::{Result, ShimError};

/// Which memory cgroup file holds the container's oom_kill counter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MemoryCgroup {
    /// v1: `<dir>/memory.oom_control`.
    V1(PathBuf),
    /// v2: `<dir>/memory.events`.
    V2(PathBuf),
}

impl MemoryCgroup {
    /// The memory cgroup of `pid`: the v1 memory controller, or v2 when the container's
    /// cgroup in the v2 hierarchy (wherever it is mounted) has `memory.events`.
    pub fn of_pid(pid: u32) -> Option<Self> {
        let v2_root = baton_cgroups::find_v2_root().ok();
        for cg in baton_cgroups::of_pid(pid)? {
            let rel = cg.pathname.trim_start_matches('/');
            if cg.controllers.iter().any(|c| c == "memory") {
                let dir = Path::new("/sys/fs/cgroup/memory").join(rel);
                if dir.join("memory.oom_control").exists() {
                    return Some(Self::V1(dir));
                }
            }
            if let (0, Some(v2_root)) = (cg.hierarchy, v2_root.as_deref()) {
                let dir = v2_root.join(rel);
                if dir.join("memory.events").exists() {
                    return Some(Self::V2(dir));
                }
            }
        }
        None
    }

    fn counter_file(&self) -> PathBuf {
        match self {
            Self::V1(d) => d.join("memory.oom_control"),
            Self::V2(d) => d.join("memory.events"),
        }
    }

    /// Current oom_kill count (0 when the file is gone).
    pub fn oom_kills(&self) -> u64 {
        std::fs::read_to_string(self.counter_file())
            .map(|t| parse_oom_kill(&t))
            .unwrap_or(0)
    }
}

/// Reads `oom_kill N` from `memory.oom_control` (v1) or `memory.events` (v2).
pub fn parse_oom_kill(text: &str) -> u64 {
    text.lines()
        .filter_map(|l| l.split_once(' '))
        .find(|(k, _)| *k == "oom_kill")
        .and_then(|(_, v)| v.trim().parse().ok())
        .unwrap_or(0)
}

/// The OOM state of one container: its memory cgroup and the count already published.
#[derive(Debug)]
pub struct OomWatch {
    cgroup: MemoryCgroup,
    published: AtomicU64,
}

impl OomWatch {
    /// Watches `cgroup`; kills before now are not reported.
    pub fn new(cgroup: MemoryCgroup) -> Arc<Self> {
        let now = cgroup.oom_kills();
        Arc::new(Self {
            cgroup,
            published: AtomicU64::new(now),
        })
    }

    /// True (once per kill batch) when the counter grew since the last report.
    pub fn check(&self) -> bool {
        let now = self.cgroup.oom_kills();
        now > self.published.fetch_max(now, Ordering::SeqCst)
    }

    /// Waits for the next kernel notification (eventfd or inotify). Returns when something may
    /// have changed; the caller then calls [`Self::check`]. Errors when watching is impossible.
    pub async fn notifications(self: &Arc<Self>) -> Result<Notifier> {
        match &self.cgroup {
            MemoryCgroup::V1(dir) => Notifier::v1(dir),
            MemoryCgroup::V2(dir) => Notifier::v2(dir),
        }
    }
}

/// A kernel notification source for one memory cgroup.
pub enum Notifier {
    /// v1 eventfd (kept with the oom_control file it is registered on).
    V1 {
        /// The eventfd the kernel signals.
        fd: AsyncFd<EventFd>,
        /// memory.oom_control, kept open while registered.
        _control: std::fs::File,
    },
    /// v2 inotify on memory.events.
    V2(AsyncFd<InotifyFd>),
}

/// An inotify instance with the `AsRawFd` that `AsyncFd` wants.
pub struct InotifyFd(Inotify);

impl AsRawFd for InotifyFd {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

impl Notifier {
    fn v1(dir: &Path) -> Result<Self> {
        let control = dir.join("memory.oom_control");
        let file = std::fs::File::open(&control)
            .map_err(|e| ShimError::io(format!("open {}", control.display()), e))?;
        let efd = EventFd::from_flags(EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)
            .map_err(|e| ShimError::io("eventfd", e.into()))?;
        let line = format!("{} {}", efd.as_fd().as_raw_fd(), file.as_raw_fd());
        let ec = dir.join("cgroup.event_control");
        std::fs::write(&ec, line)
            .map_err(|e| ShimError::io(format!("write {}", ec.display()), e))?;
        // SAFETY: the EventFd owns its descriptor and is moved into the AsyncFd, which keeps it
        // open and unchanged for as long as it is registered.
        let fd = unsafe { AsyncFd::register(efd) }
            .map_err(|e| ShimError::io("register eventfd", std::io::Error::from(e)))?;
        Ok(Self::V1 { fd, _control: file })
    }

    fn v2(dir: &Path) -> Result<Self> {
        let events = dir.join("memory.events");
        let ino = Inotify::init(InitFlags::IN_CLOEXEC | InitFlags::IN_NONBLOCK)
            .map_err(|e| ShimError::io("inotify_init", e.into()))?;
        ino.add_watch(&events, AddWatchFlags::IN_MODIFY)
            .map_err(|e| ShimError::io(format!("watch {}", events.display()), e.into()))?;
        // SAFETY: the Inotify owns its descriptor and is moved into the AsyncFd, which keeps it
        // open and unchanged for as long as it is registered.
        let fd = unsafe { AsyncFd::register(InotifyFd(ino)) }
            .map_err(|e| ShimError::io("register inotify", std::io::Error::from(e)))?;
        Ok(Self::V2(fd))
    }

    /// Waits for one notification. `Ok(false)` means the source is gone (cgroup removed).
    pub async fn next(&mut self) -> bool {
        match self {
            Self::V1 { fd, .. } => loop {
                let Ok(mut guard) = fd.readable().await else {
                    return false;
                };
                match guard.try_io(|f| f.get_ref().read().map_err(std::io::Error::from)) {
                    Ok(Ok(_)) => return true,
                    Ok(Err(_)) => return false,
                    Err(_would_block) => continue,
                }
            },
            Self::V2(fd) => loop {
                let Ok(mut guard) = fd.readable().await else {
                    return false;
                };
                match guard.try_io(|f| f.get_ref().0.read_events().map_err(std::io::Error::from)) {
                    Ok(Ok(events)) => {
                        return !events.iter().any(|e| {
                            e.mask
                                .contains(nix::sys::inotify::AddWatchFlags::IN_IGNORED)
                        });
                    }
                    Ok(Err(_)) => return false,
                    Err(_would_block) => continue,
                }
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counter_parsing() {
        assert_eq!(
            parse_oom_kill("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n"),
            3
        );
        assert_eq!(
            parse_oom_kill("low 0\nhigh 0\nmax 2\noom 2\noom_kill 1\n"),
            1
        );
        assert_eq!(parse_oom_kill(""), 0);
    }

    #[tokio::test]
    async fn v2_watch_reports_each_increase_once() {
        let dir = tempfile::tempdir().unwrap();
        let events = dir.path().join("memory.events");
        std::fs::write(&events, "oom 0\noom_kill 0\n").unwrap();
        let watch = OomWatch::new(MemoryCgroup::V2(dir.path().to_path_buf()));
        assert!(!watch.check());
        let mut n = watch.notifications().await.unwrap();
        std::fs::write(&events, "oom 1\noom_kill 1\n").unwrap();
        assert!(
            tokio::time::timeout(std::time::Duration::from_secs(5), n.next())
                .await
                .unwrap()
        );
        assert!(watch.check());
        assert!(!watch.check(), "published once");
    }
}
