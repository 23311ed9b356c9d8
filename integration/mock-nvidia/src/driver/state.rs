//! The mock driver's observable state, as served in the mount's `state.json`: per open file its RM
//! clients and objects (class, parent, bytes), registered fd, attached GPUs, mappings and UVM command
//! counts, plus driver-wide totals. Tests in any process read it back with [`DriverState::read`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// Name of the state file inside the mount.
pub const STATE_FILE: &str = "state.json";

/// Failure to read `state.json`.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// The file could not be read (is the mock mounted there?).
    #[error("cannot read mock driver state {path}: {source} (is baton-mock-nvidia mounted there?)")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file is not the JSON this crate writes.
    #[error("mock driver state {path} is not valid: {source}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The JSON error.
        source: serde_json::Error,
    },
}

/// Everything the mock driver holds right now.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DriverState {
    /// The driver version the mock reports, e.g. `595.45.04`.
    pub driver_version: String,
    /// Number of GPUs (`nvidia0`..).
    pub gpus: u32,
    /// Video memory of all GPUs together, in bytes.
    pub vram_bytes: u64,
    /// Video memory held by live video-memory objects whose size the mock could read, all GPUs together.
    pub vram_used_bytes: u64,
    /// Video memory of each GPU (its capacity), in bytes. 0 in a state written before the mock said it.
    #[serde(default)]
    pub vram_bytes_per_gpu: u64,
    /// Video memory held on each GPU (index: the GPU's device instance, `nvidiaN`'s N), in bytes; each at
    /// most `vram_bytes_per_gpu`. Empty in a state written before the mock said it.
    #[serde(default)]
    pub vram_used_bytes_per_gpu: Vec<u64>,
    /// Open device files (one per FUSE file handle), in opening order.
    pub files: Vec<FileState>,
    /// Counters since the mount.
    pub totals: Totals,
}

/// One open device file (a FUSE file handle: one `open()`, shared by dup'd and inherited fds).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileState {
    /// The FUSE file handle.
    pub fh: u64,
    /// The file's name in the mount (`nvidiactl`, `nvidia0`, `nvidia-uvm`, ...).
    pub node: String,
    /// Process (thread) id that opened it, in the mock's pid namespace.
    pub pid: u32,
    /// RM clients allocated through this file.
    pub clients: Vec<ClientState>,
    /// The ctl fd number passed to `REGISTER_FD` on this file (a number in the caller's fd table).
    pub registered_ctl_fd: Option<i32>,
    /// GPU ids passed to `ATTACH_GPUS_TO_FD` on this file.
    pub attached_gpus: Vec<u32>,
    /// Live `RM_MAP_MEMORY` mappings made through this file.
    pub mappings: Vec<MappingState>,
    /// UVM commands received on this file, by command number (hex) with their count.
    pub uvm_commands: BTreeMap<String, u64>,
    /// Ioctls received on this file.
    pub ioctls: u64,
}

/// An RM client and the objects under it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClientState {
    /// The client handle (`hRoot`).
    pub handle: u32,
    /// Objects of the client (not the client itself), in allocation order.
    pub objects: Vec<ObjectState>,
}

/// An RM object.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ObjectState {
    /// The object handle.
    pub handle: u32,
    /// Its class (`hClass`).
    pub class: u32,
    /// The class name from `baton-nvidia`, when known.
    pub class_name: Option<String>,
    /// The parent handle (the client handle for devices).
    pub parent: u32,
    /// Bytes of memory it holds (0 for non-memory objects, and for memory whose size was unreadable).
    pub bytes: u64,
    /// For memory objects: whether `bytes` is the size the caller asked for.
    pub size_known: bool,
}

/// A live `RM_MAP_MEMORY` mapping.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MappingState {
    /// `hClient`.
    pub client: u32,
    /// `hDevice`.
    pub device: u32,
    /// `hMemory`.
    pub memory: u32,
    /// Mapped length in bytes.
    pub length: u64,
}

/// Counters since the mount.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Totals {
    /// Device-file opens.
    pub opens: u64,
    /// Device-file final releases.
    pub releases: u64,
    /// Successful object allocations (clients included).
    pub allocs: u64,
    /// Objects freed, by `RM_FREE` or at release (clients included).
    pub frees: u64,
    /// `RM_CONTROL` calls.
    pub controls: u64,
    /// UVM commands.
    pub uvm_commands: u64,
    /// RM calls answered with a status other than `NV_OK`.
    pub failed_statuses: u64,
}

impl DriverState {
    /// Reads `state.json` from the mount at `mount`.
    pub fn read(mount: &Path) -> Result<Self, StateError> {
        let path = mount.join(STATE_FILE);
        let text = std::fs::read(&path).map_err(|source| StateError::Read {
            path: path.clone(),
            source,
        })?;
        serde_json::from_slice(&text).map_err(|source| StateError::Parse { path, source })
    }

    /// Reads `state.json` until `done` holds for it, or `timeout` passes; returns the last state read
    /// either way (check it). FUSE sends a file's RELEASE asynchronously after the last `close()`, so
    /// a release shows up here shortly after the closing process moved on.
    pub fn wait_for(
        mount: &Path,
        timeout: Duration,
        mut done: impl FnMut(&DriverState) -> bool,
    ) -> Result<Self, StateError> {
        let deadline = Instant::now() + timeout;
        loop {
            let state = Self::read(mount)?;
            if done(&state) || Instant::now() >= deadline {
                return Ok(state);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Whether no device file is open and no memory is held (everything was released).
    pub fn is_idle(&self) -> bool {
        self.files.is_empty() && self.vram_used_bytes == 0
    }

    /// Every open file of this node name (`nvidiactl`, `nvidia0`, ...).
    pub fn files_named<'a>(&'a self, node: &'a str) -> impl Iterator<Item = &'a FileState> + 'a {
        self.files.iter().filter(move |file| file.node == node)
    }

    /// Every live client, over all files.
    pub fn clients(&self) -> impl Iterator<Item = &ClientState> {
        self.files.iter().flat_map(|file| file.clients.iter())
    }

    /// Every live object (clients excluded), over all files.
    pub fn objects(&self) -> impl Iterator<Item = &ObjectState> {
        self.clients().flat_map(|client| client.objects.iter())
    }

    /// Number of live objects of `class`.
    pub fn count_class(&self, class: u32) -> usize {
        self.objects()
            .filter(|object| object.class == class)
            .count()
    }

    /// The live object with this handle under `client`, if any.
    pub fn object(&self, client: u32, handle: u32) -> Option<&ObjectState> {
        self.clients()
            .filter(|c| c.handle == client)
            .flat_map(|c| c.objects.iter())
            .find(|object| object.handle == handle)
    }
}
