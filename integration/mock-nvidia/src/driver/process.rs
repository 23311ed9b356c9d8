//! Running the mock driver as a child process (the `baton-mock-nvidia` binary): start it, wait for its
//! `ready <mountpoint>` line, stop it with SIGTERM (it unmounts) when dropped.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use super::MountOptions;
use super::state::{DriverState, StateError};

/// How long [`MockDriverProcess::start`] waits for the `ready` line.
pub const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// Failure to run the mock driver binary.
#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    /// The binary could not be started.
    #[error(
        "cannot start mock driver {binary}: {source} (build it with `cargo build -p baton-mock-nvidia`)"
    )]
    Spawn {
        /// The binary.
        binary: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// It exited or went silent before printing `ready`.
    #[error("mock driver {binary} did not become ready on {mountpoint}: {detail}")]
    NotReady {
        /// The binary.
        binary: PathBuf,
        /// The mount point.
        mountpoint: PathBuf,
        /// What happened instead.
        detail: String,
    },
    /// Stopping it failed.
    #[error("cannot stop mock driver pid {pid}: {source}")]
    Stop {
        /// Its pid.
        pid: u32,
        /// The error.
        source: std::io::Error,
    },
}

/// A running `baton-mock-nvidia` child; dropping it stops it.
#[derive(Debug)]
pub struct MockDriverProcess {
    child: Option<Child>,
    mountpoint: PathBuf,
}

impl MockDriverProcess {
    /// Starts `binary` with `options` and waits until it serves the mount.
    pub fn start(binary: &Path, options: &MountOptions) -> Result<Self, ProcessError> {
        let mut child = Command::new(binary)
            .arg("--mount")
            .arg(&options.mountpoint)
            .arg("--driver-version")
            .arg(&options.driver_version)
            .arg("--gpus")
            .arg(options.gpus.to_string())
            .arg("--vram-mib")
            .arg(options.vram_mib.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|source| ProcessError::Spawn {
                binary: binary.to_owned(),
                source,
            })?;
        let not_ready = |detail: String| ProcessError::NotReady {
            binary: binary.to_owned(),
            mountpoint: options.mountpoint.clone(),
            detail,
        };
        let Some(stdout) = child.stdout.take() else {
            return Err(not_ready("no stdout pipe".to_owned()));
        };
        let (lines_tx, lines_rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if lines_tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut process = Self {
            child: Some(child),
            mountpoint: options.mountpoint.clone(),
        };
        match lines_rx.recv_timeout(READY_TIMEOUT) {
            Ok(line) if line.starts_with("ready ") => Ok(process),
            Ok(line) => Err(not_ready(format!("first line was {line:?}"))),
            Err(_) => {
                let status = process
                    .child
                    .as_mut()
                    .and_then(|c| c.try_wait().ok().flatten());
                Err(not_ready(match status {
                    Some(status) => format!("it exited with {status} (see its stderr)"),
                    None => format!("no ready line within {READY_TIMEOUT:?}"),
                }))
            }
        }
    }

    /// The mount point.
    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    /// Process id of the driver.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// What the mock holds now, read from its `state.json`.
    pub fn state(&self) -> Result<DriverState, StateError> {
        DriverState::read(&self.mountpoint)
    }

    /// Sends SIGTERM (the driver unmounts and exits) and waits for it.
    pub fn stop(mut self) -> Result<(), ProcessError> {
        self.stop_now()
    }

    fn stop_now(&mut self) -> Result<(), ProcessError> {
        let Some(mut child) = self.child.take() else {
            return Ok(());
        };
        let pid = child.id();
        let stop_error = |source: std::io::Error| ProcessError::Stop { pid, source };
        let raw_pid = i32::try_from(pid).map_err(|e| stop_error(std::io::Error::other(e)))?;
        if let Err(errno) = kill(Pid::from_raw(raw_pid), Signal::SIGTERM) {
            return Err(stop_error(errno.into()));
        }
        child.wait().map(|_| ()).map_err(stop_error)
    }
}

impl Drop for MockDriverProcess {
    fn drop(&mut self) {
        if let Err(error) = self.stop_now() {
            eprintln!("baton-mock-nvidia: {error}");
        }
    }
}
