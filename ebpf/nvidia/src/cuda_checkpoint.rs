//! NVIDIA's `cuda-checkpoint` tool: its `--action`s and the process states `--get-state` prints
//! (`CUprocessState`). The shim runs the tool; the mock stand-in implements it.
use core::fmt;

/// What `cuda-checkpoint --action` does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Block CUDA calls and wait for submitted work (`--timeout MS` bounds the wait).
    Lock,
    /// Copy device memory to the host and release the GPU (the process holds no NVIDIA file after).
    Checkpoint,
    /// Re-acquire the GPU and copy device memory back.
    Restore,
    /// Let CUDA calls run again.
    Unlock,
}

impl Action {
    /// The action's name on the command line.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Lock => "lock",
            Self::Checkpoint => "checkpoint",
            Self::Restore => "restore",
            Self::Unlock => "unlock",
        }
    }

    /// The action named `name`.
    pub fn parse(name: &str) -> Option<Self> {
        [Self::Lock, Self::Checkpoint, Self::Restore, Self::Unlock]
            .into_iter()
            .find(|action| action.name() == name)
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A CUDA process's checkpoint state, as `cuda-checkpoint --get-state` names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CudaState {
    /// CUDA calls run.
    Running,
    /// CUDA calls are blocked; device memory is still on the GPU.
    Locked,
    /// Device memory is in host memory and every GPU resource is released.
    Checkpointed,
    /// A checkpoint or restore went wrong.
    Failed,
}

impl CudaState {
    /// The name `cuda-checkpoint --get-state` prints.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Locked => "locked",
            Self::Checkpointed => "checkpointed",
            Self::Failed => "failed",
        }
    }

    /// The state named `name`.
    pub fn parse(name: &str) -> Option<Self> {
        [
            Self::Running,
            Self::Locked,
            Self::Checkpointed,
            Self::Failed,
        ]
        .into_iter()
        .find(|state| state.name() == name)
    }
}

impl fmt::Display for CudaState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for a in [
            Action::Lock,
            Action::Checkpoint,
            Action::Restore,
            Action::Unlock,
        ] {
            assert_eq!(Action::parse(a.name()), Some(a));
        }
        for s in [
            CudaState::Running,
            CudaState::Locked,
            CudaState::Checkpointed,
            CudaState::Failed,
        ] {
            assert_eq!(CudaState::parse(s.name()), Some(s));
        }
        assert_eq!(Action::parse("toggle"), None);
    }
}
