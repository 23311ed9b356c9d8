//! NVIDIA's `cuda-checkpoint` tool: its `--action`s and the process states `--get-state` prints
//! (`CUprocessState`). The shim runs the tool; the mock stand-in implements it. [`driver_api`]: the same
//! operations as the CUDA driver API exports them from `libcuda.so.1` since the 570 drivers (CUDA 12.8).
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

/// The CUDA driver API's checkpoint calls (`cuCheckpointProcess*`, group CUDA_CHECKPOINT of NVIDIA's CUDA
/// driver API reference, CUDA 12.8 and later): their names, the `CUresult` codes they return, the
/// `CUprocessState` values and the argument structs (each 64 bytes, reserved fields zero).
pub mod driver_api {
    use super::{Action, CudaState};

    /// `CUresult`.
    pub type CuResult = u32;
    /// `CUDA_SUCCESS`.
    pub const CUDA_SUCCESS: CuResult = 0;
    /// `CUDA_ERROR_INVALID_VALUE`: a bad argument (no such CUDA process, a null pointer).
    pub const CUDA_ERROR_INVALID_VALUE: CuResult = 1;
    /// `CUDA_ERROR_NOT_INITIALIZED`: `cuInit` has not been called in this process.
    pub const CUDA_ERROR_NOT_INITIALIZED: CuResult = 3;
    /// `CUDA_ERROR_ILLEGAL_STATE`: the process is not in the state the call needs.
    pub const CUDA_ERROR_ILLEGAL_STATE: CuResult = 401;
    /// `CUDA_ERROR_NOT_SUPPORTED`.
    pub const CUDA_ERROR_NOT_SUPPORTED: CuResult = 801;
    /// `CUDA_ERROR_TIMEOUT`: a lock's `timeoutMs` passed.
    pub const CUDA_ERROR_TIMEOUT: CuResult = 909;
    /// `CUDA_ERROR_UNKNOWN`.
    pub const CUDA_ERROR_UNKNOWN: CuResult = 999;

    /// `CUprocessState`: `CU_PROCESS_STATE_RUNNING` .. `_FAILED`.
    pub const fn state_value(state: CudaState) -> u32 {
        match state {
            CudaState::Running => 0,
            CudaState::Locked => 1,
            CudaState::Checkpointed => 2,
            CudaState::Failed => 3,
        }
    }

    /// The state a `CUprocessState` value names (13.4's CHECKPOINTING and RESTORING are not modelled).
    pub const fn state_from_value(value: u32) -> Option<CudaState> {
        match value {
            0 => Some(CudaState::Running),
            1 => Some(CudaState::Locked),
            2 => Some(CudaState::Checkpointed),
            3 => Some(CudaState::Failed),
            _ => None,
        }
    }

    /// The exported symbol (NUL-terminated) that performs `action`.
    pub const fn symbol(action: Action) -> &'static [u8] {
        match action {
            Action::Lock => b"cuCheckpointProcessLock\0",
            Action::Checkpoint => b"cuCheckpointProcessCheckpoint\0",
            Action::Restore => b"cuCheckpointProcessRestore\0",
            Action::Unlock => b"cuCheckpointProcessUnlock\0",
        }
    }

    /// `cuInit`.
    pub const CU_INIT: &[u8] = b"cuInit\0";
    /// `cuCheckpointProcessGetState`.
    pub const GET_STATE: &[u8] = b"cuCheckpointProcessGetState\0";
    /// `cuGetErrorName`.
    pub const GET_ERROR_NAME: &[u8] = b"cuGetErrorName\0";
    /// `cuGetErrorString`.
    pub const GET_ERROR_STRING: &[u8] = b"cuGetErrorString\0";
    /// `CUcheckpointLockArgs`.
    #[repr(C)]
    #[derive(Debug, Clone, Copy, Default)]
    pub struct LockArgs {
        /// Milliseconds the lock waits for in-flight work; 0 = no limit.
        pub timeout_ms: u32,
        /// Zero.
        pub reserved0: u32,
        /// Zero.
        pub reserved1: [u64; 7],
    }

    /// `CUcheckpointCheckpointArgs`, `CUcheckpointUnlockArgs` (reserved only).
    #[repr(C)]
    #[derive(Debug, Clone, Copy, Default)]
    pub struct ReservedArgs {
        /// Zero.
        pub reserved: [u64; 8],
    }

    /// `CUcheckpointRestoreArgs`: the GPU remapping (none here: a restore goes back to the same GPUs).
    #[repr(C)]
    #[derive(Debug, Clone, Copy)]
    pub struct RestoreArgs {
        /// `CUcheckpointGpuPair *gpuPairs`.
        pub gpu_pairs: *const core::ffi::c_void,
        /// `gpuPairsCount`.
        pub gpu_pairs_count: u32,
        /// Zero (`char reserved[52 - sizeof(void *)]`).
        pub reserved: [u8; 44],
        /// Zero.
        pub reserved1: u64,
    }

    impl Default for RestoreArgs {
        fn default() -> Self {
            Self {
                gpu_pairs: core::ptr::null(),
                gpu_pairs_count: 0,
                reserved: [0; 44],
                reserved1: 0,
            }
        }
    }

    /// What `cuGetErrorName` and `cuGetErrorString` say of a code the checkpoint calls return.
    pub const fn error_text(
        code: CuResult,
    ) -> (&'static core::ffi::CStr, &'static core::ffi::CStr) {
        match code {
            CUDA_SUCCESS => (c"CUDA_SUCCESS", c"no error"),
            CUDA_ERROR_INVALID_VALUE => (c"CUDA_ERROR_INVALID_VALUE", c"invalid argument"),
            CUDA_ERROR_NOT_INITIALIZED => (c"CUDA_ERROR_NOT_INITIALIZED", c"initialization error"),
            CUDA_ERROR_ILLEGAL_STATE => (
                c"CUDA_ERROR_ILLEGAL_STATE",
                c"the operation cannot be performed in the present state",
            ),
            CUDA_ERROR_NOT_SUPPORTED => (c"CUDA_ERROR_NOT_SUPPORTED", c"operation not supported"),
            CUDA_ERROR_TIMEOUT => (c"CUDA_ERROR_TIMEOUT", c"wait operation timed out"),
            _ => (c"CUDA_ERROR_UNKNOWN", c"unknown error"),
        }
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

    /// The argument structs are the 64 bytes NVIDIA's cuda.h declares (CUDA 12.8), on 64-bit targets.
    #[test]
    #[cfg(target_pointer_width = "64")]
    fn driver_api_argument_structs_are_64_bytes() {
        use core::mem::{offset_of, size_of};
        use driver_api::{LockArgs, ReservedArgs, RestoreArgs};
        assert_eq!(size_of::<LockArgs>(), 64);
        assert_eq!(offset_of!(LockArgs, reserved1), 8);
        assert_eq!(size_of::<ReservedArgs>(), 64);
        assert_eq!(size_of::<RestoreArgs>(), 64);
        assert_eq!(offset_of!(RestoreArgs, gpu_pairs_count), 8);
        assert_eq!(offset_of!(RestoreArgs, reserved1), 56);
        for s in [
            CudaState::Running,
            CudaState::Locked,
            CudaState::Checkpointed,
            CudaState::Failed,
        ] {
            assert_eq!(
                driver_api::state_from_value(driver_api::state_value(s)),
                Some(s)
            );
        }
    }
}
