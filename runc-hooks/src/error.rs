//! What can go wrong in a hook, each variant naming the container, pid or path concerned and saying what to
//! do. [`HookError::is_bad_input`] tells the input's faults (exit 2) from the agent's (exit 1, or a warning).
use std::path::PathBuf;

use crate::agent::AgentError;

/// A hook's failure.
#[derive(Debug, thiserror::Error)]
pub enum HookError {
    /// stdin could not be read.
    #[error("reading the OCI state on stdin: {0}")]
    Stdin(#[source] std::io::Error),
    /// stdin is a terminal, or gave nothing, or did not end in time.
    #[error(
        "no OCI state on stdin ({why}): baton-hook is an OCI hook, the runtime writes the container's state \
         JSON on its stdin (by hand: echo '{{\"id\":\"ID\",\"pid\":PID,\"bundle\":\"DIR\"}}' | baton-hook STAGE)"
    )]
    NoState {
        /// What was seen instead.
        why: String,
    },
    /// stdin is not an OCI state.
    #[error("the OCI state on stdin is not valid JSON ({source}): {excerpt:?}")]
    Json {
        /// The parser's error.
        #[source]
        source: serde_json::Error,
        /// The start of what was read.
        excerpt: String,
    },
    /// The state has no container id.
    #[error(
        "the OCI state on stdin has no container id (\"id\"): is the hook run by runc, CRI-O or podman?"
    )]
    NoId,
    /// The state has no pid where the stage needs one.
    #[error(
        "the OCI state of container {id} has no pid: runc passes it to createRuntime and poststart hooks; \
         use baton-hook only in those stages and poststop"
    )]
    NoPid {
        /// Container id.
        id: String,
    },
    /// The container's process is gone.
    #[error("container {id}: its process {pid} is gone (no /proc/{pid}): nothing to watch")]
    ProcessGone {
        /// Container id.
        id: String,
        /// The state's pid.
        pid: u32,
    },
    /// The container's process has no cgroup v2 path, which attributes its calls.
    #[error(
        "container {id}: process {pid} has no cgroup v2 path in /proc/{pid}/cgroup (no `0::` line): the agent \
         tells containers apart by their cgroup v2; run runc with cgroup v2 (or hybrid) mounted"
    )]
    NoCgroup {
        /// Container id.
        id: String,
        /// The state's pid.
        pid: u32,
    },
    /// The container's process is in the root cgroup v2, which every process shares.
    #[error(
        "container {id}: process {pid} is in the root cgroup v2 (/proc/{pid}/cgroup says `0::/`), which every \
         process on the node shares: give the container a cgroupsPath of its own"
    )]
    RootCgroup {
        /// Container id.
        id: String,
        /// The state's pid.
        pid: u32,
    },
    /// The bundle's config.json could not be read.
    #[error("container {id}: reading its bundle's config {path}: {detail}")]
    Config {
        /// Container id.
        id: String,
        /// The config.json.
        path: PathBuf,
        /// The cause.
        detail: String,
    },
    /// The gate has no timeout.
    #[error(
        "container {id}: wait-gpu-free needs a timeout: --timeout DURATION or the container's \
         baton.io/wait-gpu-free annotation ({syntax})"
    )]
    NoTimeout {
        /// Container id.
        id: String,
        /// The syntax expected.
        syntax: &'static str,
    },
    /// A duration that does not parse.
    #[error("container {id}: {origin} {value:?}: expected {syntax}")]
    BadDuration {
        /// Container id.
        id: String,
        /// Where it came from.
        origin: &'static str,
        /// The text.
        value: String,
        /// The syntax expected.
        syntax: &'static str,
    },
    /// The agent failed (unreachable, refused, slow).
    #[error("container {id}: {source}")]
    Agent {
        /// Container id.
        id: String,
        /// What the agent did.
        #[source]
        source: AgentError,
    },
}

impl HookError {
    /// Whether the hook was given input it cannot work with (rather than the agent failing it).
    /// The others (the agent failing, a container the agent cannot tell apart by its cgroup) only mean
    /// that the container runs unwatched, as with plain runc.
    pub fn is_bad_input(&self) -> bool {
        !matches!(
            self,
            Self::Agent { .. } | Self::NoCgroup { .. } | Self::RootCgroup { .. }
        )
    }
}
