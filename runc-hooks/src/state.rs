//! The OCI state a runtime writes on a hook's stdin (runtime-spec `state`: `ociVersion`, `id`, `status`,
//! `pid`, `bundle`, `annotations`), read with bounds on its size and on the time it takes, so that a hook
//! run by hand without input says so instead of hanging.
use std::{collections::HashMap, io::IsTerminal, path::PathBuf, time::Duration};

use oci_spec::runtime::State;
use tokio::io::AsyncReadExt;

use crate::error::HookError;

/// The most bytes of state read (runc's are a few hundred, with annotations a few KiB).
const MAX_STATE_BYTES: u64 = 1 << 20;
/// How long stdin may take to give its state and end.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

/// What a hook needs of the state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HookState {
    /// Container id.
    pub id: String,
    /// Host pid of the container's init (createRuntime, poststart; runc gives it at poststop too).
    pub pid: Option<u32>,
    /// The bundle (its config.json names the rootfs).
    pub bundle: PathBuf,
    /// The container's annotations.
    pub annotations: HashMap<String, String>,
}

impl HookState {
    /// Parses a state document; an error names what is missing or wrong.
    pub fn parse(text: &[u8]) -> Result<Self, HookError> {
        if text.iter().all(u8::is_ascii_whitespace) {
            return Err(HookError::NoState {
                why: "stdin was empty".to_owned(),
            });
        }
        let state: State = serde_json::from_slice(text).map_err(|source| HookError::Json {
            source,
            excerpt: String::from_utf8_lossy(&text[..text.len().min(200)]).into_owned(),
        })?;
        if state.id().trim().is_empty() {
            return Err(HookError::NoId);
        }
        Ok(Self {
            id: state.id().clone(),
            pid: state
                .pid()
                .and_then(|p| u32::try_from(p).ok())
                .filter(|p| *p > 0),
            bundle: state.bundle().clone(),
            annotations: state.annotations().clone().unwrap_or_default(),
        })
    }

    /// Reads the state from stdin (at most [`MAX_STATE_BYTES`], within [`READ_TIMEOUT`]).
    pub async fn from_stdin() -> Result<Self, HookError> {
        if std::io::stdin().is_terminal() {
            return Err(HookError::NoState {
                why: "stdin is a terminal".to_owned(),
            });
        }
        let mut text = Vec::new();
        let mut stdin = tokio::io::stdin().take(MAX_STATE_BYTES);
        let read = stdin.read_to_end(&mut text);
        match tokio::time::timeout(READ_TIMEOUT, read).await {
            Ok(Ok(_)) => Self::parse(&text),
            Ok(Err(e)) => Err(HookError::Stdin(e)),
            Err(_) => Err(HookError::NoState {
                why: format!("stdin did not end within {READ_TIMEOUT:?}"),
            }),
        }
    }

    /// The pid, or the error saying the state has none.
    pub fn require_pid(&self) -> Result<u32, HookError> {
        self.pid.ok_or_else(|| HookError::NoPid {
            id: self.id.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runcs_state_parses() {
        let text = br#"{"ociVersion":"1.0.2-dev","id":"c1","status":"creating","pid":4242,
            "bundle":"/run/b","annotations":{"baton.io/wait-gpu-free":"20s"}}"#;
        let s = HookState::parse(text).unwrap();
        assert_eq!(s.id, "c1");
        assert_eq!(s.pid, Some(4242));
        assert_eq!(s.bundle, PathBuf::from("/run/b"));
        assert_eq!(s.annotations["baton.io/wait-gpu-free"], "20s");
    }

    #[test]
    fn a_stopped_state_without_pid_parses_and_says_so_when_a_pid_is_needed() {
        let s = HookState::parse(
            br#"{"ociVersion":"1.0.2","id":"c1","status":"stopped","bundle":"/b"}"#,
        )
        .unwrap();
        assert_eq!(s.pid, None);
        let e = s.require_pid().unwrap_err().to_string();
        assert!(e.contains("container c1") && e.contains("no pid"), "{e}");
    }

    #[test]
    fn malformed_empty_or_anonymous_states_are_refused_clearly() {
        let e = HookState::parse(b"{\"id\": \"c1\", ").unwrap_err();
        assert!(matches!(e, HookError::Json { .. }), "{e}");
        assert!(e.to_string().contains("not valid JSON"), "{e}");
        let e = HookState::parse(b" \n").unwrap_err();
        assert!(e.to_string().contains("stdin was empty"), "{e}");
        let e = HookState::parse(br#"{"pid": 1}"#).unwrap_err();
        assert!(matches!(e, HookError::NoId), "{e}");
        let e = HookState::parse(br#"{"id": 7}"#).unwrap_err();
        assert!(matches!(e, HookError::Json { .. }), "{e}");
    }
}
