//! The shim's one error type and the ONE place where errors become ttrpc status codes.
//!
//! Every handler returns [`ShimError`]; `service.rs` converts with `?` through the `From` impl
//! below, so the mapping from failure kind to ttrpc code (and so to containerd's errdefs) lives
//! here and nowhere else.

use containerd_shim_protos::ttrpc::{self, Code};

/// Result alias used across the shim.
pub type Result<T> = std::result::Result<T, ShimError>;

/// Everything that can go wrong while serving a task call.
#[derive(Debug, thiserror::Error)]
pub enum ShimError {
    /// No container with this id is served by this shim.
    #[error("container {id} not found")]
    ContainerNotFound {
        /// Container id asked for.
        id: String,
    },
    /// The container exists but has no process with this exec id.
    #[error("process {exec_id} not found in container {id}")]
    ProcessNotFound {
        /// Container id.
        id: String,
        /// Exec id asked for.
        exec_id: String,
    },
    /// An id that must be unique is taken.
    #[error("{what} {id} already exists")]
    AlreadyExists {
        /// What kind of object ("container", "exec").
        what: &'static str,
        /// The id that is taken.
        id: String,
    },
    /// The request is malformed (bad options, bad annotation, missing field).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The process is in a state where the call makes no sense (pause a stopped task, ...).
    #[error("{id}: cannot {action} a process that is {state}")]
    FailedPrecondition {
        /// Container (or container/exec) id.
        id: String,
        /// The refused action.
        action: &'static str,
        /// The state it was in.
        state: String,
    },
    /// The process already exited (kill of a finished process maps to NotFound, as in Go).
    #[error("{id}: process already finished")]
    ProcessFinished {
        /// Container (or container/exec) id.
        id: String,
    },
    /// runc (or another runtime binary) failed.
    #[error("runc {action} {id}: {message}")]
    Runtime {
        /// The runc subcommand.
        action: &'static str,
        /// Container id.
        id: String,
        /// runc's output or the spawn error.
        message: String,
    },
    /// The cgroup freezer failed to pause or resume the container.
    #[error("{action} {id}: {source}")]
    Freezer {
        /// "pause" or "resume".
        action: &'static str,
        /// Container id.
        id: String,
        /// What the freezer said (it names the cgroup).
        #[source]
        source: baton_cgroups::freezer::FreezerError,
    },
    /// A file or socket operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done, with the path.
        context: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The call is not supported in this configuration (e.g. a cgroup mode without metrics).
    #[error("unimplemented: {0}")]
    Unimplemented(String),
    /// Anything else, with a message saying what failed.
    #[error("{0}")]
    Other(String),
}

impl ShimError {
    /// Builds an [`ShimError::Io`] with a context naming the path or operation.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io {
            context: context.into(),
            source,
        }
    }

    /// Wraps a runc crate error for `action` on container `id`.
    pub fn runtime(action: &'static str, id: &str, err: runc::error::Error) -> Self {
        let message = match err {
            runc::error::Error::CommandFailed {
                stdout,
                stderr,
                status,
            } => {
                let out = format!("{}{}", stdout.trim(), stderr.trim());
                format!("{status}: {out}")
            }
            other => other.to_string(),
        };
        Self::Runtime {
            action,
            id: id.to_string(),
            message,
        }
    }

    /// The ttrpc code containerd turns back into its errdefs error.
    pub fn code(&self) -> Code {
        match self {
            Self::ContainerNotFound { .. }
            | Self::ProcessNotFound { .. }
            | Self::ProcessFinished { .. } => Code::NOT_FOUND,
            Self::AlreadyExists { .. } => Code::ALREADY_EXISTS,
            Self::InvalidArgument(_) => Code::INVALID_ARGUMENT,
            Self::FailedPrecondition { .. } => Code::FAILED_PRECONDITION,
            Self::Unimplemented(_) => Code::UNIMPLEMENTED,
            Self::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
                Code::NOT_FOUND
            }
            Self::Runtime { .. } | Self::Freezer { .. } | Self::Io { .. } | Self::Other(_) => {
                Code::UNKNOWN
            }
        }
    }
}

impl From<ShimError> for ttrpc::Error {
    fn from(err: ShimError) -> Self {
        ttrpc::Error::RpcStatus(ttrpc::get_status(err.code(), err.to_string()))
    }
}

impl From<containerd_shim::Error> for ShimError {
    fn from(err: containerd_shim::Error) -> Self {
        match err {
            containerd_shim::Error::InvalidArgument(msg) => Self::InvalidArgument(msg),
            containerd_shim::Error::NotFoundError(msg) => Self::Other(format!("not found: {msg}")),
            other => Self::Other(other.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status_of(err: ShimError) -> (Code, String) {
        match ttrpc::Error::from(err) {
            ttrpc::Error::RpcStatus(s) => (s.code(), s.message().to_string()),
            other => panic!("not a status: {other:?}"),
        }
    }

    #[test]
    fn each_kind_maps_to_the_code_containerd_expects() {
        let cases = [
            (
                ShimError::ContainerNotFound { id: "c".into() },
                Code::NOT_FOUND,
            ),
            (
                ShimError::ProcessNotFound {
                    id: "c".into(),
                    exec_id: "e".into(),
                },
                Code::NOT_FOUND,
            ),
            (
                ShimError::ProcessFinished { id: "c".into() },
                Code::NOT_FOUND,
            ),
            (
                ShimError::AlreadyExists {
                    what: "exec",
                    id: "e".into(),
                },
                Code::ALREADY_EXISTS,
            ),
            (
                ShimError::InvalidArgument("x".into()),
                Code::INVALID_ARGUMENT,
            ),
            (
                ShimError::FailedPrecondition {
                    id: "c".into(),
                    action: "pause",
                    state: "stopped".into(),
                },
                Code::FAILED_PRECONDITION,
            ),
            (ShimError::Unimplemented("x".into()), Code::UNIMPLEMENTED),
            (ShimError::Other("x".into()), Code::UNKNOWN),
            (
                ShimError::io(
                    "open /x",
                    std::io::Error::from(std::io::ErrorKind::NotFound),
                ),
                Code::NOT_FOUND,
            ),
        ];
        for (err, code) in cases {
            assert_eq!(status_of(err).0, code);
        }
    }

    #[test]
    fn message_names_the_object() {
        let (_, msg) = status_of(ShimError::ProcessNotFound {
            id: "web".into(),
            exec_id: "sh1".into(),
        });
        assert!(msg.contains("web") && msg.contains("sh1"), "{msg}");
    }
}
