//! Why the agent could not start, or stopped serving.
use std::path::Path;

/// An error of `baton agent`.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// Not run as root.
    #[error("baton agent needs root: it loads eBPF programs and reads other processes' /proc")]
    NotRoot,
    /// Options out of their ranges: which, and their ranges.
    #[error("{0}")]
    Options(String),
    /// Another agent holds the instance lock of the socket.
    #[error("another baton agent{who} serves {socket} (it holds {lock})")]
    AnotherAgent {
        /// ` (pid N)`, when its lock file says.
        who: String,
        /// The socket.
        socket: String,
        /// Its lock file.
        lock: String,
    },
    /// The instance lock could not be taken.
    #[error("cannot lock {path}: {errno}")]
    Lock {
        /// The lock file.
        path: String,
        /// Why.
        errno: nix::errno::Errno,
    },
    /// A system call failed: what the agent was doing, and (as the source) why.
    #[error("{what}")]
    Io {
        /// What the agent was doing.
        what: String,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
}

/// Turns an I/O error into an [`AgentError::Io`] saying what was being done.
pub(crate) fn doing(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> AgentError {
    let what = what.into();
    move |source| AgentError::Io { what, source }
}

/// [`doing`] with a path: `{verb} {path}` (`cannot create /run/baton`).
pub(crate) fn at(verb: &str, path: &Path) -> impl FnOnce(std::io::Error) -> AgentError {
    doing(format!("{verb} {}", path.display()))
}
