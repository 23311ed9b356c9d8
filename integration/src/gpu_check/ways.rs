//! The two ways the kit makes the checkpoint calls (lock, checkpoint, restore, unlock): the `cuda-checkpoint`
//! program, one run per action as the shim falls back to, and the CUDA driver helper
//! (`containerd-shim-baton-v1 cuda-driver-helper LIBRARY`), the process the shim uses where the library has
//! the calls. Each call is bounded (a program past it is killed, a helper that does not answer is killed and
//! refuses every later call) and returns when it ended (CLOCK_MONOTONIC ns), stamped as its answer came.
use std::{
    io::{BufRead, BufReader, Write},
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Command, Stdio},
    sync::mpsc,
    time::Duration,
};

use baton_agent_api::{
    driver_helper::{Answer, Call, HELPER_ARG, Ready},
    now_monotonic_ns,
};
use baton_nvidia::cuda_checkpoint::Action;

use super::bounded;

/// The checkpoint calls through the program or the helper.
pub enum Way {
    /// `cuda-checkpoint --action A --pid P`, one run per call.
    Program(PathBuf),
    /// The CUDA driver helper.
    Api(Helper),
}

impl Way {
    /// Makes `action` on `pid` (a lock waits `lock_timeout` for in-flight work), bounded by `within`: when it
    /// returned (CLOCK_MONOTONIC ns), or what went wrong.
    pub fn call(
        &mut self,
        action: Action,
        pid: u32,
        lock_timeout: Duration,
        within: Duration,
    ) -> Result<u64, String> {
        let name = action.name();
        let lock_ms = u64::try_from(lock_timeout.as_millis()).unwrap_or(u64::MAX);
        match self {
            Way::Program(program) => {
                let mut command = Command::new(&*program);
                command.args(["--action", name, "--pid", &pid.to_string()]);
                if action == Action::Lock {
                    command.args(["--timeout", &lock_ms.to_string()]);
                }
                let what = format!("`{} --action {name} --pid {pid}`", program.display());
                bounded::run(&mut command, within)
                    .and_then(|f| f.succeeded(&what))
                    .map(|f| f.ended_ns)
            }
            Way::Api(helper) => helper.call(
                name,
                pid,
                u32::try_from(lock_ms).unwrap_or(u32::MAX),
                within,
            ),
        }
    }
}

/// The CUDA driver helper, spoken to as the shim speaks to it.
pub struct Helper {
    child: Child,
    stdin: ChildStdin,
    answers: mpsc::Receiver<(u64, String)>,
    next_id: u64,
    broken: Option<String>,
}

impl Helper {
    /// Starts the helper loading `library`; `Err` says why the library cannot be used (or the helper did not
    /// say it was ready within `within`).
    pub fn start(shim: &Path, library: &Path, within: Duration) -> Result<Self, String> {
        let mut child = Command::new(shim)
            .arg(HELPER_ARG)
            .arg(library)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("cannot start the CUDA driver helper: {e}"))?;
        let (Some(stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            return Err("the helper has no pipes".to_owned());
        };
        let (tx, answers) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send((now_monotonic_ns(), line)).is_err() {
                    break;
                }
            }
        });
        let mut helper = Self {
            child,
            stdin,
            answers,
            next_id: 0,
            broken: None,
        };
        let ready: Ready = helper
            .answer("its ready line", within)
            .map(|(_, ready)| ready)
            .map_err(|e| format!("the helper did not say it was ready: {e}"))?;
        match ready.unavailable {
            None => Ok(helper),
            Some(why) => Err(why),
        }
    }

    fn call(
        &mut self,
        action: &str,
        pid: u32,
        lock_ms: u32,
        within: Duration,
    ) -> Result<u64, String> {
        if let Some(why) = &self.broken {
            return Err(format!("{action} of pid {pid} not tried: {why}"));
        }
        self.next_id += 1;
        let call = Call {
            id: self.next_id,
            action: action.to_owned(),
            pid,
            lock_timeout_ms: lock_ms,
        };
        let line = serde_json::to_string(&call).map_err(|e| e.to_string())?;
        writeln!(self.stdin, "{line}")
            .and_then(|()| self.stdin.flush())
            .map_err(|e| format!("the CUDA driver helper cannot be written to: {e}"))?;
        let (ended_ns, answer): (u64, Answer) = self
            .answer(&format!("{action} of pid {pid}"), within)
            .map_err(|e| format!("{action} of pid {pid} through the driver API: {e}"))?;
        match answer.error {
            None => Ok(ended_ns),
            Some(e) => Err(format!("{action} of pid {pid} through the driver API: {e}")),
        }
    }

    /// The next line, parsed, and when it came; on a timeout the helper is killed and marked broken.
    fn answer<T: serde::de::DeserializeOwned>(
        &mut self,
        what: &str,
        within: Duration,
    ) -> Result<(u64, T), String> {
        match self.answers.recv_timeout(within) {
            Ok((t, line)) => serde_json::from_str(&line)
                .map(|v| (t, v))
                .map_err(|e| format!("unreadable answer {line:?}: {e}")),
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let why = "the CUDA driver helper ended".to_owned();
                self.broken = Some(why.clone());
                Err(why)
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let _ = self.child.kill();
                let why = format!(
                    "the CUDA driver helper did not answer {what} within {within:?}: killed"
                );
                self.broken = Some(why.clone());
                Err(why)
            }
        }
    }
}

impl Drop for Helper {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
