//! A worker forked after CUDA init, as a PyTorch DataLoader forks its workers: it inherits every NVIDIA fd
//! and every device mapping but the `MADV_DONTFORK` one, makes no CUDA call, and has no CUDA state of its
//! own, so the driver answers get-state and lock for it with `CUDA_ERROR_NOT_INITIALIZED`. On the H200 the
//! child held 31 fds and 30 of 31 mappings, and its parent's park freed the GPU all the same
//! (/work/shared/gpu/580.159.04/README.md, "Forked children").
//!
//! The worker lives as long as its parent: the kernel kills it when the parent's forking thread ends
//! (`PR_SET_PDEATHSIG`), and the parent kills and reaps it on its way out ([`Worker::stop`]), so it never
//! outlives it as an orphan. The parent serves the worker's control socket, answering every request with
//! [`super::control::NOT_INITIALIZED`] (the mock's stand-in for the driver's answer).

use std::thread::JoinHandle;

use nix::sys::prctl;
use nix::sys::signal::{SigSet, Signal, kill};
use nix::sys::wait::waitpid;
use nix::unistd::{ForkResult, Pid, fork, getpid, getppid, pause};

use super::restore::ControlSocket;
use super::say;

/// The parent's handle on its forked worker.
#[derive(Debug)]
pub struct Worker {
    pid: Pid,
    reaper: Option<JoinHandle<()>>,
}

impl Worker {
    /// Forks the worker. Call it from the main thread: the kernel's death signal follows the thread that
    /// forked. The parent prints `worker exited` when the worker is gone.
    pub fn fork() -> std::io::Result<Self> {
        let parent = getpid();
        // SAFETY: the child calls only async-signal-safe functions (prctl, getppid, sigprocmask, pause,
        // _exit) and never returns, so no lock another thread of the parent held at the fork is touched.
        match unsafe { fork() }? {
            ForkResult::Child => live_as_worker(parent),
            ForkResult::Parent { child } => {
                let served = ControlSocket::bind_for(child.as_raw().unsigned_abs())
                    .and_then(|mut socket| socket.serve_without_cuda().map(|()| socket));
                let socket = match served {
                    Ok(socket) => socket,
                    Err(error) => {
                        let _ = kill(child, Signal::SIGKILL);
                        let _ = waitpid(child, None);
                        return Err(std::io::Error::new(
                            error.kind(),
                            format!("cannot serve the worker's control socket: {error}"),
                        ));
                    }
                };
                let reaper = std::thread::Builder::new()
                    .name("worker-reaper".to_owned())
                    .spawn(move || {
                        let _ = waitpid(child, None);
                        // Gone: its control socket goes too.
                        drop(socket);
                        say("worker exited");
                    })?;
                Ok(Self {
                    pid: child,
                    reaper: Some(reaper),
                })
            }
        }
    }

    /// The worker's pid (in this pid namespace).
    pub fn pid(&self) -> u32 {
        self.pid.as_raw().unsigned_abs()
    }

    /// Kills the worker and waits until it is reaped.
    pub fn stop(mut self) {
        let _ = kill(self.pid, Signal::SIGKILL);
        if let Some(reaper) = self.reaper.take() {
            let _ = reaper.join();
        }
    }
}

/// The worker's whole life: die with the parent, keep everything inherited, wait for a signal that ends it
/// (SIGTERM and SIGINT end it as they would a DataLoader worker; the parent's control signals stay blocked).
fn live_as_worker(parent: Pid) -> ! {
    let _ = prctl::set_pdeathsig(Signal::SIGKILL);
    if getppid() != parent {
        // The parent died before the death signal was set.
        // SAFETY: _exit ends the process at once, running nothing of the parent's (no atexit handler, no
        // destructor), which is all a forked child of a multithreaded process may do.
        unsafe { libc::_exit(0) };
    }
    let mut ends = SigSet::empty();
    ends.add(Signal::SIGTERM);
    ends.add(Signal::SIGINT);
    let _ = ends.thread_unblock();
    loop {
        pause();
    }
}
