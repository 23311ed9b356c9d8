//! How a hook ends, and its exit status. A runtime fails the container when a createRuntime or poststart
//! hook exits non-zero (runc also fails `runc delete` on a poststop hook's), so:
//! - 0 ([`EXIT_OK`]): done, or not done for a reason that must not stop the container (no agent, the agent
//!   refused, no cgroup v2 of its own, no NVIDIA device): the container runs unwatched, as with plain runc,
//!   and stderr says why;
//! - 1 ([`EXIT_AGENT`]): the same failures with `--require-agent`, and the GPU-free gate failing (the
//!   GPU still held past the timeout, or no agent to ask): the start is meant to stop there;
//! - 2 ([`EXIT_BAD_INPUT`]): input the hook cannot work with (no or malformed state, no id, the
//!   container's process gone at createRuntime, an unreadable bundle, a bad duration).
use crate::error::HookError;

/// Done, or a warning only.
pub const EXIT_OK: u8 = 0;
/// The agent failed a hook that requires it, or the gate failed.
pub const EXIT_AGENT: u8 = 1;
/// The hook's input is wrong.
pub const EXIT_BAD_INPUT: u8 = 2;

/// How a hook ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// It did its work; what it did.
    Done(String),
    /// It could not, and the container goes on unwatched; why.
    Warning(String),
    /// It failed the container with this exit status; why.
    Failed {
        /// Exit status.
        status: u8,
        /// Why.
        message: String,
    },
}

impl Outcome {
    /// A hook's error: bad input fails with [`EXIT_BAD_INPUT`]; the rest is a warning, or fails with
    /// [`EXIT_AGENT`] when `required`.
    pub fn of_error(e: &HookError, required: bool) -> Self {
        if e.is_bad_input() {
            Self::Failed {
                status: EXIT_BAD_INPUT,
                message: e.to_string(),
            }
        } else if required {
            Self::Failed {
                status: EXIT_AGENT,
                message: format!("{e} (--require-agent)"),
            }
        } else {
            Self::Warning(format!("{e}; the container runs unwatched"))
        }
    }

    /// The process's exit status.
    pub fn exit_status(&self) -> u8 {
        match self {
            Self::Done(_) | Self::Warning(_) => EXIT_OK,
            Self::Failed { status, .. } => *status,
        }
    }

    /// The line for stderr.
    pub fn line(&self, stage: &str) -> String {
        match self {
            Self::Done(m) => format!("baton-hook {stage}: {m}"),
            Self::Warning(m) => format!("baton-hook {stage}: warning: {m}"),
            Self::Failed { message, .. } => format!("baton-hook {stage}: error: {message}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_input_fails_and_agent_trouble_warns_unless_required() {
        let bad = HookError::NoId;
        assert_eq!(Outcome::of_error(&bad, false).exit_status(), EXIT_BAD_INPUT);
        let gone = HookError::Agent {
            id: "c1".into(),
            source: crate::agent::AgentError::Refused("no".into()),
        };
        let warned = Outcome::of_error(&gone, false);
        assert_eq!(warned.exit_status(), EXIT_OK);
        assert!(
            warned
                .line("createRuntime")
                .contains("warning: container c1"),
            "{warned:?}"
        );
        assert_eq!(Outcome::of_error(&gone, true).exit_status(), EXIT_AGENT);
    }
}
