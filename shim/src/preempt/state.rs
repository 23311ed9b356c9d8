//! A container's preemption state, persisted in its bundle (`baton-preempt.json`) so that a parked container
//! is still known as parked after containerd or the agent restarts, and so that the shim's `delete`
//! clean-up (containerd runs it when a shim died) knows it has a frozen container to let go.
use std::path::{Path, PathBuf};

use baton_agent_api::PreemptState;

use crate::errors::{Result, ShimError};

/// The file's name in the bundle.
pub const FILE_NAME: &str = "baton-preempt.json";

fn path_in(bundle: &Path) -> PathBuf {
    bundle.join(FILE_NAME)
}

/// The persisted state, if any (an unreadable file is logged and treated as none).
pub fn load(bundle: &Path) -> Option<PreemptState> {
    let path = path_in(bundle);
    let text = std::fs::read_to_string(&path).ok()?;
    match serde_json::from_str(&text) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(path = %path.display(), "ignoring an unreadable preemption state: {e}");
            None
        }
    }
}

/// Persists `state` (written to a temporary file, then renamed over the old one), or removes the file
/// for `None`.
pub fn save(bundle: &Path, state: Option<&PreemptState>) -> Result<()> {
    let path = path_in(bundle);
    let Some(state) = state else {
        return match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(ShimError::io(format!("remove {}", path.display()), e)),
        };
    };
    let text = serde_json::to_string(state)
        .map_err(|e| ShimError::Other(format!("preemption state: {e}")))?;
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, text).map_err(|e| ShimError::io(format!("write {}", tmp.display()), e))?;
    std::fs::rename(&tmp, &path).map_err(|e| ShimError::io(format!("rename {}", path.display()), e))
}

#[cfg(test)]
mod tests {
    use baton_agent_api::{PreemptMode, PreemptPhase};

    use super::*;

    #[test]
    fn a_state_survives_a_round_trip_and_goes_with_none() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(load(dir.path()), None);
        let state = PreemptState {
            state: PreemptPhase::Parked,
            mode: PreemptMode::Park,
            pids: vec![3, 4],
            since_ns: 9,
            image_path: None,
            parked_for: None,
            idle_park: false,
            host_copy_bytes: Some(1 << 30),
            raised_limit: Some(baton_agent_api::RaisedLimit {
                was_bytes: 1 << 29,
                raised_to_bytes: 3 << 29,
            }),
            unfrozen: true,
            no_cuda_state: vec![12],
        };
        save(dir.path(), Some(&state)).unwrap();
        assert_eq!(load(dir.path()), Some(state));
        save(dir.path(), None).unwrap();
        assert_eq!(load(dir.path()), None);
        save(dir.path(), None).unwrap();
        std::fs::write(dir.path().join(FILE_NAME), "not json").unwrap();
        assert_eq!(load(dir.path()), None);
    }
}
