//! NVIDIA's `cuda-checkpoint`, run by the shim for each CUDA process of a container: `--action
//! lock|checkpoint|restore|unlock --pid P [--timeout MS]` and `--get-state --pid P`. The program comes only
//! from the node's options TOML (`cuda_checkpoint_path`) or the shim's PATH, never from an annotation.
use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use crate::runtime::{self, ProgramError};

pub use baton_nvidia::cuda_checkpoint::Action;

/// What went wrong running cuda-checkpoint.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CudaError {
    /// The program is not there.
    #[error(
        "cuda-checkpoint not found at {path}: install NVIDIA's cuda-checkpoint on the node, or set \
         cuda_checkpoint_path in the runtime's options TOML"
    )]
    NotFound {
        /// Where it was looked for.
        path: PathBuf,
    },
    /// It ran and failed.
    #[error("cuda-checkpoint --action {action} --pid {pid} failed ({status}): {output}")]
    Failed {
        /// The action.
        action: &'static str,
        /// The process.
        pid: u32,
        /// Its exit status.
        status: String,
        /// What it printed.
        output: String,
    },
    /// It ran past `cuda_checkpoint_timeout` and was stopped.
    #[error(
        "cuda-checkpoint --action {action} --pid {pid} did not finish within {after:?} \
         (cuda_checkpoint_timeout): stopped it{output}"
    )]
    TimedOut {
        /// The action.
        action: &'static str,
        /// The process.
        pid: u32,
        /// The limit it ran past.
        after: Duration,
        /// What it had printed (": ..." or empty).
        output: String,
    },
    /// It could not be run.
    #[error("cannot run {path}: {message}")]
    Spawn {
        /// The program.
        path: PathBuf,
        /// Why.
        message: String,
    },
}

impl CudaError {
    /// The process the error concerns, if one.
    pub fn pid(&self) -> Option<u32> {
        match self {
            CudaError::Failed { pid, .. } | CudaError::TimedOut { pid, .. } => Some(*pid),
            _ => None,
        }
    }
}

/// The cuda-checkpoint program of a container.
#[derive(Clone, Debug)]
pub struct CudaCheckpoint {
    path: PathBuf,
    /// How long one run may take before it is stopped.
    limit: Option<Duration>,
}

impl CudaCheckpoint {
    /// The program at `configured` (a bare name is looked up on the shim's PATH).
    pub fn find(configured: &Path) -> Result<Self, CudaError> {
        let found = if configured.components().count() > 1 {
            Some(configured.to_path_buf()).filter(|p| p.is_file())
        } else {
            std::env::var_os("PATH").and_then(|path| {
                std::env::split_paths(&path)
                    .map(|d| d.join(configured))
                    .find(|p| p.is_file())
            })
        };
        found
            .map(|path| Self { path, limit: None })
            .ok_or(CudaError::NotFound {
                path: configured.to_path_buf(),
            })
    }

    /// The same program, each run stopped (and failed) after `limit`: a wedged process, or one frozen
    /// meanwhile, never holds a preemption for good.
    pub fn within(self, limit: Duration) -> Self {
        Self {
            limit: Some(limit),
            ..self
        }
    }

    /// Runs `--action ACTION --pid PID` (`--timeout MS` for a lock with a timeout).
    pub async fn run(
        &self,
        action: Action,
        pid: u32,
        timeout: Option<Duration>,
    ) -> Result<(), CudaError> {
        let mut args = vec![
            "--action".to_owned(),
            action.name().to_owned(),
            "--pid".to_owned(),
            pid.to_string(),
        ];
        if let (Action::Lock, Some(t)) = (action, timeout) {
            args.push("--timeout".to_owned());
            args.push(t.as_millis().to_string());
        }
        let (status, stdout, stderr) = self.exec(action.name(), pid, &args).await?;
        if status.success() {
            return Ok(());
        }
        Err(CudaError::Failed {
            action: action.name(),
            pid,
            status: status.to_string(),
            output: format!("{}{}", stdout.trim(), stderr.trim()),
        })
    }

    /// `--get-state --pid PID`: `running`, `locked`, `checkpointed` or `failed`.
    pub async fn state(&self, pid: u32) -> Result<String, CudaError> {
        let args = [
            "--get-state".to_owned(),
            "--pid".to_owned(),
            pid.to_string(),
        ];
        let (status, stdout, stderr) = self.exec("get-state", pid, &args).await?;
        if status.success() {
            return Ok(stdout.trim().to_owned());
        }
        Err(CudaError::Failed {
            action: "get-state",
            pid,
            status: status.to_string(),
            output: format!("{}{}", stdout.trim(), stderr.trim()),
        })
    }

    async fn exec(
        &self,
        action: &'static str,
        pid: u32,
        args: &[String],
    ) -> Result<(std::process::ExitStatus, String, String), CudaError> {
        runtime::run_program(&self.path, args, self.limit)
            .await
            .map_err(|e| match e {
                ProgramError::Spawn(message) => CudaError::Spawn {
                    path: self.path.clone(),
                    message,
                },
                ProgramError::TimedOut { output } => CudaError::TimedOut {
                    action,
                    pid,
                    after: self.limit.unwrap_or_default(),
                    output: if output.is_empty() {
                        String::new()
                    } else {
                        format!(": {output}")
                    },
                },
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_program_says_where_it_was_looked_for() {
        let err = CudaCheckpoint::find(Path::new("/nonexistent/cuda-checkpoint")).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("/nonexistent/cuda-checkpoint"), "{text}");
        assert!(text.contains("cuda_checkpoint_path"), "{text}");
        assert!(CudaCheckpoint::find(Path::new("no-such-program-baton")).is_err());
        assert!(CudaCheckpoint::find(Path::new("sh")).is_ok());
    }
}
