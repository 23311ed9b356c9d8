//! The protocol of the CUDA driver helper (`containerd-shim-baton-v1 cuda-driver-helper LIBRARY`), the
//! process that loads the node's `libcuda.so.1` once and makes the `cuCheckpointProcess*` calls: JSON lines.
//! The helper first writes [`Ready`]; then for each [`Call`] on its stdin, one [`Answer`] with the same `id`,
//! in the order the calls finish. The shim drives it for park, resume, snapshot and Task Checkpoint; the
//! device kit (`tools/gpu-check`) drives it to measure them. This module is the protocol's one definition.
use serde::{Deserialize, Serialize};

/// The first argument that makes the shim binary the helper.
pub const HELPER_ARG: &str = "cuda-driver-helper";

/// The helper's first line: ready, or why the library cannot be used (the shim then runs the program).
#[derive(Debug, Serialize, Deserialize)]
pub struct Ready {
    /// `None`: the library is loaded and `cuInit` succeeded.
    pub unavailable: Option<String>,
    /// The file the helper loaded (the loader's search or a known folder found it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub library: Option<String>,
}

/// One call the shim asks for.
#[derive(Debug, Serialize, Deserialize)]
pub struct Call {
    /// Matches the answer.
    pub id: u64,
    /// `lock`, `checkpoint`, `restore`, `unlock`, or `get-state`.
    pub action: String,
    /// The process.
    pub pid: u32,
    /// A lock's `timeoutMs` (0: none).
    #[serde(default)]
    pub lock_timeout_ms: u32,
}

/// The answer to a [`Call`].
#[derive(Debug, Serialize, Deserialize)]
pub struct Answer {
    /// The call's id.
    pub id: u64,
    /// For `get-state`: `running`, `locked`, `checkpointed` or `failed`.
    pub state: Option<String>,
    /// Why it failed: the driver's error name and description.
    pub error: Option<String>,
    /// The driver's `CUresult` when it failed with one (absent from a helper that predates it): the shim
    /// tells "no CUDA state" (`CUDA_ERROR_NOT_INITIALIZED`, `CUDA_ERROR_INVALID_VALUE`) by it, not by text.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<u32>,
}
