//! Running `baton-mock-cuda` as a child process from tests: build its arguments, start it, wait for its
//! phase lines, signal it (SIGUSR1 release, SIGUSR2 re-acquire), close its stdin to end a `--hold`, and
//! collect its exit status and JSON summary.

use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use super::{Summary, WorkloadOptions};

/// Failure to drive the workload process.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadProcessError {
    /// It could not be started.
    #[error(
        "cannot start workload {binary}: {source} (build it with `cargo build -p baton-mock-nvidia`)"
    )]
    Spawn {
        /// The binary.
        binary: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The expected line did not come.
    #[error(
        "workload pid {pid} did not print {expected:?} within {timeout:?}; it printed {seen:?}"
    )]
    LineTimeout {
        /// Its pid.
        pid: u32,
        /// The line waited for.
        expected: String,
        /// How long we waited.
        timeout: Duration,
        /// Everything it printed so far.
        seen: Vec<String>,
    },
    /// Signalling or waiting failed.
    #[error("workload pid {pid}: {source}")]
    Control {
        /// Its pid.
        pid: u32,
        /// The error.
        source: std::io::Error,
    },
}

/// How a workload process ended.
#[derive(Debug)]
pub struct Finished {
    /// Its exit status.
    pub status: ExitStatus,
    /// Every stdout line it printed.
    pub lines: Vec<String>,
    /// Its summary (from the `summary {json}` line).
    pub summary: Option<Summary>,
}

/// The command-line arguments `baton-mock-cuda` takes for `options` (plus `--hold` when `hold`).
pub fn args(options: &WorkloadOptions, hold: bool) -> Vec<OsString> {
    let mut args: Vec<OsString> = vec![
        "--dev-dir".into(),
        options.dev_dir.clone().into(),
        "--steps".into(),
        options.steps.to_string().into(),
        "--step-ms".into(),
        options.step_ms.to_string().into(),
        "--vram-mib".into(),
        options.vram_mib.to_string().into(),
        "--driver-version".into(),
        options.driver_version.clone().into(),
    ];
    if hold {
        args.push("--hold".into());
    }
    args
}

/// A running `baton-mock-cuda`.
#[derive(Debug)]
pub struct WorkloadProcess {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    seen: Vec<String>,
}

impl WorkloadProcess {
    /// Starts `binary` with `options` (and `--hold` when `hold`), stdout captured, stdin a pipe.
    pub fn start(
        binary: &Path,
        options: &WorkloadOptions,
        hold: bool,
    ) -> Result<Self, WorkloadProcessError> {
        Self::start_command(Command::new(binary).args(args(options, hold)), binary)
    }

    /// Starts a prepared `command` (e.g. the workload wrapped in a container runner).
    pub fn start_command(
        command: &mut Command,
        binary: &Path,
    ) -> Result<Self, WorkloadProcessError> {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|source| WorkloadProcessError::Spawn {
                binary: binary.to_owned(),
                source,
            })?;
        let (sender, lines) = mpsc::channel();
        if let Some(stdout) = child.stdout.take() {
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                    if sender.send(line).is_err() {
                        break;
                    }
                }
            });
        }
        Ok(Self {
            stdin: child.stdin.take(),
            child,
            lines,
            seen: Vec::new(),
        })
    }

    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Waits until it prints exactly `expected` (lines printed before are kept in [`Finished::lines`]).
    pub fn wait_for_line(
        &mut self,
        expected: &str,
        timeout: Duration,
    ) -> Result<(), WorkloadProcessError> {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    let found = line == expected;
                    self.seen.push(line);
                    if found {
                        return Ok(());
                    }
                }
                Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => {
                    return Err(WorkloadProcessError::LineTimeout {
                        pid: self.pid(),
                        expected: expected.to_owned(),
                        timeout,
                        seen: self.seen.clone(),
                    });
                }
            }
        }
    }

    /// Sends `signal` (SIGUSR1 release, SIGUSR2 re-acquire, SIGTERM stop).
    pub fn signal(&self, signal: Signal) -> Result<(), WorkloadProcessError> {
        let pid = self.pid();
        let raw = i32::try_from(pid).map_err(|e| WorkloadProcessError::Control {
            pid,
            source: std::io::Error::other(e),
        })?;
        kill(Pid::from_raw(raw), signal).map_err(|errno| WorkloadProcessError::Control {
            pid,
            source: errno.into(),
        })
    }

    /// Closes its stdin, which ends a `--hold`.
    pub fn close_stdin(&mut self) {
        self.stdin = None;
    }

    /// Closes stdin and waits for it to exit (killing it after `timeout`).
    pub fn finish(mut self, timeout: Duration) -> Result<Finished, WorkloadProcessError> {
        self.close_stdin();
        let pid = self.pid();
        let control = |source| WorkloadProcessError::Control { pid, source };
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(status) = self.child.try_wait().map_err(control)? {
                break status;
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                break self.child.wait().map_err(control)?;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut lines = std::mem::take(&mut self.seen);
        // The reader thread ends when the pipe closes; it may still be draining it after the exit.
        while let Ok(line) = self.lines.recv_timeout(Duration::from_millis(500)) {
            lines.push(line);
        }
        let summary = lines
            .iter()
            .filter_map(|line| line.strip_prefix("summary "))
            .filter_map(|json| serde_json::from_str(json).ok())
            .next_back();
        Ok(Finished {
            status,
            lines,
            summary,
        })
    }
}

impl Drop for WorkloadProcess {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}
