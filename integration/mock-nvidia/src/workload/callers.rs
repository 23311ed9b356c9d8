//! Threads of a holder that call the driver together, for the tests of the probes' in-flight slots
//! (`baton-mock-holder`'s `ioctl-threads`, `callers`, `go`, `join` and `close-async`): threads that make
//! RM_CONTROL calls back to back, and groups of parked threads that each make one call (an ioctl, or a
//! mapping they keep) when told, all at once. A test steers their tids (through the node's `ns_last_pid`) so
//! that they share the probes' slots with each other or with another container's threads.
use std::{
    collections::HashMap,
    os::fd::RawFd,
    sync::{
        Arc, Condvar, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context, anyhow, bail};
use baton_nvidia::{escape, ioc, params::nvos00};

/// One RM_CONTROL call on `fd` with zeroed params (the driver refuses it; the call is what matters).
fn rm_control(fd: RawFd) {
    let cmd = ioc::iowr(ioc::NV_IOCTL_MAGIC, escape::RM_CONTROL, nvos00::SIZE);
    let mut params = vec![0u8; nvos00::SIZE as usize];
    // SAFETY: `params` is a live buffer of the size the command encodes; the fd is the script's and stays
    // open while its threads use it.
    let _ = unsafe { libc::ioctl(fd, cmd as libc::c_ulong, params.as_mut_ptr()) };
}

/// What a group of parked callers does when told.
#[derive(Clone, Debug)]
enum Job {
    /// One RM_CONTROL call on this fd.
    Ioctl(RawFd),
    /// Maps a page of this fd, shared, and keeps the mapping.
    Map(RawFd),
}

/// A group of parked callers: their (namespace-local) tids, and the job they wait for.
struct Group {
    tids: Vec<i32>,
    go: Arc<(Mutex<Option<Job>>, Condvar)>,
    threads: Vec<JoinHandle<u64>>,
}

/// The calling threads of a holder.
#[derive(Default)]
pub struct Callers {
    /// Threads of `ioctl-threads`, which call while this is set.
    calling: Arc<AtomicBool>,
    busy: Vec<JoinHandle<u64>>,
    groups: HashMap<String, Group>,
}

impl Callers {
    /// `n` more threads that make RM_CONTROL calls on `fd` back to back until [`Callers::stop_busy`].
    pub fn start_busy(&mut self, fd: RawFd, n: usize) {
        self.calling.store(true, Ordering::SeqCst);
        for _ in 0..n {
            let calling = self.calling.clone();
            self.busy.push(std::thread::spawn(move || {
                let mut calls = 0;
                while calling.load(Ordering::Relaxed) {
                    rm_control(fd);
                    calls += 1;
                }
                calls
            }));
        }
    }

    /// Ends the busy threads; how many calls they made.
    pub fn stop_busy(&mut self) -> anyhow::Result<u64> {
        self.calling.store(false, Ordering::SeqCst);
        let mut calls = 0;
        for t in self.busy.drain(..) {
            calls += t.join().map_err(|_| anyhow!("a calling thread panicked"))?;
        }
        Ok(calls)
    }

    /// `n` more threads in group `tag`, parked until [`Callers::go`]; returns once they all exist (their
    /// tids are taken), one after the other in the order they were made.
    pub fn park(&mut self, tag: &str, n: usize) -> anyhow::Result<()> {
        let group = self.groups.entry(tag.to_owned()).or_insert_with(|| Group {
            tids: Vec::new(),
            go: Arc::new((Mutex::new(None), Condvar::new())),
            threads: Vec::new(),
        });
        for _ in 0..n {
            let go = group.go.clone();
            let (tid_tx, tid_rx) = std::sync::mpsc::channel();
            group.threads.push(std::thread::spawn(move || {
                let _ = tid_tx.send(nix::unistd::gettid().as_raw());
                let job = {
                    let (job, woken) = &*go;
                    let mut job = job.lock().unwrap_or_else(|e| e.into_inner());
                    while job.is_none() {
                        job = woken.wait(job).unwrap_or_else(|e| e.into_inner());
                    }
                    job.clone()
                };
                match job {
                    Some(Job::Ioctl(fd)) => {
                        rm_control(fd);
                        0
                    }
                    // Kept: the test counts what the probes and /proc make of it.
                    Some(Job::Map(fd)) => u64::from(map_page(fd)),
                    None => 0,
                }
            }));
            group
                .tids
                .push(tid_rx.recv().context("a parked caller did not start")?);
        }
        Ok(())
    }

    /// Tells group `tag` to make its calls (`ioctl FD` or `map FD`), and returns once each of its threads is
    /// inside that call or past it (as its /proc `syscall` shows), or after 10 s. Returns how many were seen
    /// inside.
    pub fn go(&mut self, tag: &str, what: &str, arg: &str) -> anyhow::Result<usize> {
        let group = self
            .groups
            .get(tag)
            .ok_or_else(|| anyhow!("no callers {tag:?}"))?;
        let (job, nr) = match what {
            "ioctl" => (Job::Ioctl(arg.parse()?), libc::SYS_ioctl),
            "map" => (Job::Map(arg.parse()?), libc::SYS_mmap),
            other => bail!("unknown call {other:?} (ioctl FD, map FD)"),
        };
        {
            let (slot, woken) = &*group.go;
            *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(job);
            woken.notify_all();
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let states: Vec<Option<i64>> = group.tids.iter().map(|t| in_syscall(*t)).collect();
            let inside = states.iter().filter(|s| **s == Some(nr)).count();
            // Still waiting to be woken (futex) or on the way: not there yet.
            let waiting = states
                .iter()
                .filter(|s| s.is_none_or(|n| n != nr && n != i64::MIN))
                .count();
            if waiting == 0 || Instant::now() >= deadline {
                return Ok(inside);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Waits for group `tag`'s threads to end; how many of their mappings succeeded.
    pub fn join(&mut self, tag: &str) -> anyhow::Result<u64> {
        let group = self
            .groups
            .remove(tag)
            .ok_or_else(|| anyhow!("no callers {tag:?}"))?;
        let mut mapped = 0;
        for t in group.threads {
            mapped += t.join().map_err(|_| anyhow!("a caller panicked"))?;
        }
        Ok(mapped)
    }
}

/// Maps one page of `fd`, shared, and leaves it mapped; whether it could.
fn map_page(fd: RawFd) -> bool {
    // SAFETY: a fresh shared mapping at an address the kernel picks, never unmapped here; nothing aliases it.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    addr != libc::MAP_FAILED
}

/// The syscall thread `tid` (of this process, as its /proc numbers it) is inside: `Some(nr)`, `Some(-1)`
/// outside any, `None` when it cannot be told (running); a thread that is gone counts as past its call
/// (`Some(i64::MIN)`, which is no syscall's number).
fn in_syscall(tid: i32) -> Option<i64> {
    match std::fs::read_to_string(format!("/proc/self/task/{tid}/syscall")) {
        Ok(s) => s.split_whitespace().next()?.parse().ok(),
        Err(_) => Some(i64::MIN),
    }
}

/// Closes `fd` in a thread of its own and returns once that thread is inside the close (a close that a
/// slow driver holds up holds every other call to that driver up behind it).
pub fn close_async(fd: RawFd) -> anyhow::Result<()> {
    let (tid_tx, tid_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tid_tx.send(nix::unistd::gettid().as_raw());
        let _ = nix::unistd::close(fd);
    });
    let tid = tid_rx.recv().context("the closing thread did not start")?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        match in_syscall(tid) {
            Some(nr) if nr == libc::SYS_close || nr == i64::MIN => return Ok(()),
            _ => std::thread::sleep(Duration::from_micros(100)),
        }
    }
    bail!("the closing thread never entered close")
}
