//! A cgroup control file kept open: read and written at offset 0, so that one freeze or thaw costs no open.
//! kernfs regenerates a file's content on every read from offset 0, so a `pread` is always fresh.
use std::{
    fs::{File, OpenOptions},
    os::unix::fs::FileExt,
    path::{Path, PathBuf},
};

use super::FreezerError;

/// An open control file and its path (for errors).
#[derive(Debug)]
pub(super) struct ControlFile {
    file: File,
    path: PathBuf,
}

impl ControlFile {
    /// Opens `dir/name` for reading, and for writing when `write`.
    pub(super) fn open(dir: &Path, name: &str, write: bool) -> Result<Self, FreezerError> {
        let path = dir.join(name);
        let file = OpenOptions::new()
            .read(true)
            .write(write)
            .open(&path)
            .map_err(|source| FreezerError::Io {
                action: "open",
                path: path.clone(),
                source,
            })?;
        Ok(Self { file, path })
    }

    /// The file, for polling.
    pub(super) fn file(&self) -> &File {
        &self.file
    }

    /// Writes `text` at offset 0 (one write, as the kernel wants for control files).
    pub(super) fn write(&self, text: &str) -> Result<(), FreezerError> {
        self.file
            .write_at(text.as_bytes(), 0)
            .map(drop)
            .map_err(|source| FreezerError::Io {
                action: "write",
                path: self.path.clone(),
                source,
            })
    }

    /// Reads the whole (small) file from offset 0 into `buf`; returns the text.
    pub(super) fn read<'b>(&self, buf: &'b mut [u8; 256]) -> Result<&'b str, FreezerError> {
        let n = self
            .file
            .read_at(buf, 0)
            .map_err(|source| FreezerError::Io {
                action: "read",
                path: self.path.clone(),
                source,
            })?;
        std::str::from_utf8(&buf[..n]).map_err(|_| FreezerError::Unexpected {
            path: self.path.clone(),
            text: String::from_utf8_lossy(&buf[..n]).into_owned(),
        })
    }

    /// An error saying that this file held `text`.
    pub(super) fn unexpected(&self, text: &str) -> FreezerError {
        FreezerError::Unexpected {
            path: self.path.clone(),
            text: text.to_owned(),
        }
    }
}
