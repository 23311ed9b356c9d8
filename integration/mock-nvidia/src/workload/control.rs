//! The control protocol between `baton-mock-cuda`'s restore thread and the `baton-mock-cuda-checkpoint`
//! stand-in for NVIDIA's `cuda-checkpoint`: where the socket lives, the request and reply lines, and the
//! client side (finding a host pid's socket through `/proc/PID/root`, across pid and mount namespaces).
//!
//! One connection carries one request line (`lock <timeout_ms>` with 0 = wait, `checkpoint`, `restore`,
//! `unlock`, `state`) and one reply line (`ok <state>` or `err <message>`).

use std::fmt;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// Folder (inside the workload's root filesystem) holding the control sockets.
pub const SOCKET_DIR: &str = "/tmp/baton-mock-cuda";

/// The control socket of the process whose pid, as it sees itself, is `own_pid`.
pub fn socket_path(own_pid: u32) -> PathBuf {
    Path::new(SOCKET_DIR).join(format!("{own_pid}.sock"))
}

pub use baton_nvidia::cuda_checkpoint::{Action, CudaState};

/// One request line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request {
    /// `lock <timeout_ms>`; a timeout of 0 waits as long as it takes.
    Lock {
        /// Milliseconds to wait for in-flight work; 0 = no limit.
        timeout_ms: u64,
    },
    /// `checkpoint`, `restore` or `unlock`.
    Other(Action),
    /// `state`.
    State,
}

impl Request {
    /// The request for `action` (`timeout_ms` only matters for a lock).
    pub fn action(action: Action, timeout_ms: u64) -> Self {
        match action {
            Action::Lock => Self::Lock { timeout_ms },
            other => Self::Other(other),
        }
    }

    /// Parses a request line (without its newline).
    pub fn parse(line: &str) -> Result<Self, String> {
        let mut words = line.split_whitespace();
        let request = match (words.next(), words.next()) {
            (Some("state"), None) => Self::State,
            (Some("lock"), Some(timeout)) => Self::Lock {
                timeout_ms: timeout
                    .parse()
                    .map_err(|_| format!("lock timeout {timeout:?} is not a number of ms"))?,
            },
            (Some(name), None) if name != "lock" => {
                Self::Other(Action::parse(name).ok_or_else(|| unknown(line))?)
            }
            _ => return Err(unknown(line)),
        };
        if words.next().is_some() {
            return Err(unknown(line));
        }
        Ok(request)
    }
}

fn unknown(line: &str) -> String {
    format!(
        "unknown request {line:?} (expected lock <timeout_ms>, checkpoint, restore, unlock or state)"
    )
}

impl fmt::Display for Request {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Lock { timeout_ms } => write!(f, "lock {timeout_ms}"),
            Self::Other(action) => f.write_str(action.name()),
            Self::State => f.write_str("state"),
        }
    }
}

/// In an injected failure's message: the library making the call is to crash its process (the fake libcuda
/// aborts), as a fault inside the vendor's library would.
pub const CRASH_THE_CALLER: &str = "the caller crashes";

/// Starts the message of every answer about a process with no CUDA state of its own (a worker forked after
/// CUDA init): the driver answers get-state and lock for such a process with `CUDA_ERROR_NOT_INITIALIZED`
/// (/work/shared/gpu/580.159.04/README.md, "Forked children"). The fake libcuda returns that code for it,
/// and the cuda-checkpoint stand-in exits with it.
pub const NOT_INITIALIZED: &str = "CUDA_ERROR_NOT_INITIALIZED";

/// Starts the message of a checkpoint that could not get host memory for its copy: the code the H200's
/// checkpoint returned when the copy did not fit the memory cgroup (README.md there, "Memory cgroups").
pub const OPERATING_SYSTEM: &str = "CUDA_ERROR_OPERATING_SYSTEM";

/// One reply line: the state after the request, or why it failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// `ok <state>`.
    Ok(CudaState),
    /// `err <message>`.
    Err(String),
}

impl Reply {
    /// Parses a reply line (without its newline).
    pub fn parse(line: &str) -> Result<Self, String> {
        if let Some(state) = line.strip_prefix("ok ") {
            return CudaState::parse(state)
                .map(Self::Ok)
                .ok_or_else(|| format!("unknown state in reply {line:?}"));
        }
        line.strip_prefix("err ")
            .map(|message| Self::Err(message.to_owned()))
            .ok_or_else(|| format!("malformed reply {line:?}"))
    }
}

impl fmt::Display for Reply {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Ok(state) => write!(f, "ok {state}"),
            // A reply is one line: a multi-line message is folded.
            Self::Err(message) => write!(f, "err {}", message.replace('\n', " ")),
        }
    }
}

/// Why a request could not be answered.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// No such process.
    #[error("no process with pid {pid}")]
    NoProcess {
        /// The host pid.
        pid: u32,
    },
    /// The process exited (a zombie, or gone while we talked to it).
    #[error("process {pid} has exited")]
    Exited {
        /// The host pid.
        pid: u32,
    },
    /// It has no control socket: not a mock CUDA process (or not set up yet).
    #[error("pid {pid} is not a CUDA process: it has no mock CUDA control socket at {}", path.display())]
    NotCuda {
        /// The host pid.
        pid: u32,
        /// Where the socket was looked for.
        path: PathBuf,
    },
    /// `/proc/PID/status` could not be read or has no `NSpid:` line.
    #[error("cannot read the namespace pid of {pid} from /proc/{pid}/status: {reason}")]
    Status {
        /// The host pid.
        pid: u32,
        /// What went wrong.
        reason: String,
    },
    /// Talking over the socket failed.
    #[error("talking to pid {pid} over {}: {source}", path.display())]
    Io {
        /// The host pid.
        pid: u32,
        /// The socket.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The workload answered something that is not a reply.
    #[error("pid {pid} answered badly: {reason}")]
    BadReply {
        /// The host pid.
        pid: u32,
        /// What was wrong.
        reason: String,
    },
}

/// What `/proc/PID/status` says about a host pid.
struct ProcStatus {
    zombie: bool,
    ns_pid: u32,
}

fn proc_status(pid: u32) -> Result<ProcStatus, ControlError> {
    let text = match std::fs::read_to_string(format!("/proc/{pid}/status")) {
        Ok(text) => text,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            return Err(ControlError::NoProcess { pid });
        }
        Err(error) => {
            return Err(ControlError::Status {
                pid,
                reason: error.to_string(),
            });
        }
    };
    let field = |name: &str| {
        text.lines()
            .find_map(|line| line.strip_prefix(name))
            .map(str::trim)
    };
    let zombie = field("State:").is_some_and(|state| state.starts_with('Z'));
    // The last NSpid field is the pid in the process's own (innermost) pid namespace.
    let ns_pid = field("NSpid:")
        .and_then(|pids| pids.split_whitespace().next_back())
        .and_then(|last| last.parse().ok())
        .ok_or_else(|| ControlError::Status {
            pid,
            reason: "no NSpid line".to_owned(),
        })?;
    Ok(ProcStatus { zombie, ns_pid })
}

/// The control socket of host pid `pid`, reached through its root filesystem (`/proc/PID/root`).
pub fn host_socket_path(pid: u32) -> Result<PathBuf, ControlError> {
    let status = proc_status(pid)?;
    if status.zombie {
        return Err(ControlError::Exited { pid });
    }
    let inner = socket_path(status.ns_pid);
    let relative = inner.strip_prefix("/").unwrap_or(&inner);
    Ok(Path::new("/proc")
        .join(pid.to_string())
        .join("root")
        .join(relative))
}

/// Sends `request` to host pid `pid` and returns its reply.
pub fn send(pid: u32, request: Request) -> Result<Reply, ControlError> {
    let path = host_socket_path(pid)?;
    let io = |source| ControlError::Io {
        pid,
        path: path.clone(),
        source,
    };
    let mut stream = match UnixStream::connect(&path) {
        Ok(stream) => stream,
        Err(error) => return Err(not_reachable(pid, path, error)),
    };
    stream
        .write_all(format!("{request}\n").as_bytes())
        .map_err(io)?;
    let mut line = String::new();
    let read = BufReader::new(&stream).read_line(&mut line).map_err(io)?;
    if read == 0 {
        // The workload closed the connection without answering: it is exiting, or it is broken.
        return Err(if exits_soon(pid) {
            ControlError::Exited { pid }
        } else {
            ControlError::BadReply {
                pid,
                reason: format!("it closed the connection without answering {request:?}"),
            }
        });
    }
    Reply::parse(line.trim_end()).map_err(|reason| ControlError::BadReply { pid, reason })
}

/// Whether `pid` is gone or a zombie within [`EXIT_GRACE`]: a process closes its sockets on its way out,
/// a moment before it becomes a zombie.
fn exits_soon(pid: u32) -> bool {
    let deadline = Instant::now() + EXIT_GRACE;
    loop {
        match proc_status(pid) {
            Ok(status) if !status.zombie => {}
            _ => return true,
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// How long a process that closed its control socket gets to finish exiting.
const EXIT_GRACE: Duration = Duration::from_secs(5);

/// Why connecting to `path` failed, in the caller's terms.
fn not_reachable(pid: u32, path: PathBuf, error: std::io::Error) -> ControlError {
    match proc_status(pid) {
        Err(ControlError::NoProcess { .. }) => return ControlError::Exited { pid },
        Ok(status) if status.zombie => return ControlError::Exited { pid },
        _ => {}
    }
    match error.kind() {
        std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused => {
            ControlError::NotCuda { pid, path }
        }
        _ => ControlError::Io {
            pid,
            path,
            source: error,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip() {
        for request in [
            Request::Lock { timeout_ms: 0 },
            Request::Lock { timeout_ms: 250 },
            Request::Other(Action::Checkpoint),
            Request::Other(Action::Restore),
            Request::Other(Action::Unlock),
            Request::State,
        ] {
            assert_eq!(Request::parse(&request.to_string()), Ok(request));
        }
    }

    #[test]
    fn bad_requests_are_refused() {
        for line in ["", "lock", "lock x", "state now", "toggle", "unlock 3"] {
            assert!(Request::parse(line).is_err(), "{line:?}");
        }
    }

    #[test]
    fn replies_round_trip() {
        for reply in [
            Reply::Ok(CudaState::Checkpointed),
            Reply::Err("lock timed out after 5 ms".to_owned()),
        ] {
            assert_eq!(Reply::parse(&reply.to_string()), Ok(reply));
        }
        assert!(Reply::parse("ok sleeping").is_err());
    }

    #[test]
    fn own_pid_is_the_last_nspid_field() {
        let own = std::process::id();
        let path = host_socket_path(own).expect("our own status");
        assert_eq!(
            path,
            PathBuf::from(format!("/proc/{own}/root/tmp/baton-mock-cuda/{own}.sock"))
        );
    }
}
