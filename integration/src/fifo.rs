//! FIFOs for task stdio through the API: the test creates them, hands their paths to containerd, and reads what
//! the shim writes into them on a thread.

use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use nix::sys::stat::Mode;

/// Errors creating or reading a FIFO.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// mkfifo failed.
    #[error("mkfifo {path}: {source}")]
    Create {
        /// The FIFO path.
        path: PathBuf,
        /// The cause.
        source: nix::Error,
    },
    /// Reading the FIFO failed.
    #[error("reading FIFO {path}: {detail}")]
    Read {
        /// The FIFO path.
        path: PathBuf,
        /// The cause.
        detail: String,
    },
    /// The writer did not close its end in time.
    #[error(
        "FIFO {path} still open after {timeout:?}: the shim never opened it or never closed it"
    )]
    Timeout {
        /// The FIFO path.
        path: PathBuf,
        /// How long we waited.
        timeout: Duration,
    },
}

/// Creates a FIFO at `path` (mode 0600).
pub fn make_fifo(path: &Path) -> Result<(), Error> {
    nix::unistd::mkfifo(path, Mode::from_bits_truncate(0o600)).map_err(|source| Error::Create {
        path: path.to_path_buf(),
        source,
    })
}

/// Reads a FIFO to its end on a thread (the open blocks until the shim opens the write end).
pub struct FifoReader {
    path: PathBuf,
    done: mpsc::Receiver<Result<Vec<u8>, String>>,
}

impl FifoReader {
    /// Creates the FIFO at `path` and starts reading it.
    pub fn create(path: &Path) -> Result<Self, Error> {
        make_fifo(path)?;
        let (sender, done) = mpsc::channel();
        let thread_path = path.to_path_buf();
        std::thread::spawn(move || {
            let result = std::fs::File::open(&thread_path).and_then(|mut file| {
                let mut data = Vec::new();
                file.read_to_end(&mut data).map(|_| data)
            });
            let _ = sender.send(result.map_err(|error| error.to_string()));
        });
        Ok(Self {
            path: path.to_path_buf(),
            done,
        })
    }

    /// The FIFO's path (give it to containerd as stdout/stderr).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Waits up to `timeout` for the writer to close, and returns everything written.
    pub fn finish(self, timeout: Duration) -> Result<String, Error> {
        match self.done.recv_timeout(timeout) {
            Ok(Ok(data)) => Ok(String::from_utf8_lossy(&data).into_owned()),
            Ok(Err(detail)) => Err(Error::Read {
                path: self.path,
                detail,
            }),
            Err(_) => {
                // Unblock the reader thread if the shim never opened the FIFO.
                let _ = std::fs::OpenOptions::new()
                    .write(true)
                    .custom_flags(nix::libc::O_NONBLOCK)
                    .open(&self.path);
                Err(Error::Timeout {
                    path: self.path,
                    timeout,
                })
            }
        }
    }
}
