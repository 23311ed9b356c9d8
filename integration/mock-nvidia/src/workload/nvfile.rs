//! An open NVIDIA device file and the raw ioctl syscall on it: frontend escapes are sent as
//! `_IOWR('F', nr, sizeof params)` exactly like NVIDIA's user-space libraries, UVM commands as bare
//! numbers with a pointer to their params.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};

use baton_nvidia::{escape, ioc};
use nix::fcntl::{OFlag, open};
use nix::sys::stat::Mode;

use super::WorkloadError;

/// An open device file (`nvidiactl`, `nvidia0`, `nvidia-uvm`, ...).
#[derive(Debug)]
pub struct NvFile {
    fd: OwnedFd,
    path: PathBuf,
}

impl NvFile {
    /// Opens `path` read-write, close-on-exec, as CUDA does.
    pub fn open(path: &Path) -> Result<Self, WorkloadError> {
        let fd = open(path, OFlag::O_RDWR | OFlag::O_CLOEXEC, Mode::empty()).map_err(|errno| {
            WorkloadError::Open {
                path: path.to_owned(),
                source: errno.into(),
            }
        })?;
        Ok(Self {
            fd,
            path: path.to_owned(),
        })
    }

    /// Takes ownership of `fd`, an open device file at `path` (the scripted holder's fds).
    pub fn from_fd(fd: OwnedFd, path: &Path) -> Self {
        Self {
            fd,
            path: path.to_owned(),
        }
    }

    /// A second fd for the same open file, close-on-exec (`fcntl(F_DUPFD_CLOEXEC)`), as libcuda dups the
    /// OS-event fds it hands out.
    pub fn duplicate(&self) -> Result<Self, WorkloadError> {
        let fd = self.fd.try_clone().map_err(|source| WorkloadError::Fd {
            what: format!("dup of {}", self.path.display()),
            source,
        })?;
        Ok(Self {
            fd,
            path: self.path.clone(),
        })
    }

    /// Gives the fd back without closing it.
    pub fn into_fd(self) -> OwnedFd {
        self.fd
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The fd number (what `REGISTER_FD` and UVM's `rmCtrlFd` carry).
    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Sends frontend escape `nr` with `params` as `_IOWR('F', nr, params.len())`; the driver's reply
    /// (status fields, handles) is written back into `params`.
    pub fn escape(&self, nr: u32, params: &mut [u8]) -> Result<(), WorkloadError> {
        let size = u32::try_from(params.len())
            .ok()
            .filter(|size| *size <= ioc::SIZE_MAX)
            .ok_or_else(|| WorkloadError::ParamsTooLarge {
                escape: escape_name(nr),
                size: params.len(),
            })?;
        let cmd = ioc::iowr(ioc::NV_IOCTL_MAGIC, nr, size);
        self.ioctl(cmd, params.as_mut_ptr())
            .map_err(|source| WorkloadError::Ioctl {
                path: self.path.clone(),
                call: escape_name(nr),
                source,
            })
    }

    /// Sends UVM command `cmd` (a bare number, not `_IOC`-encoded) with a pointer to `params`.
    pub fn uvm(&self, cmd: u32, name: &str, params: &mut [u8]) -> Result<(), WorkloadError> {
        self.ioctl(cmd, params.as_mut_ptr())
            .map_err(|source| WorkloadError::Ioctl {
                path: self.path.clone(),
                call: name.to_owned(),
                source,
            })
    }

    fn ioctl(&self, cmd: u32, arg: *mut u8) -> std::io::Result<()> {
        // SAFETY: `self.fd` is an open descriptor we own; `arg` points to a live, writable buffer at
        // least as long as the size encoded in `cmd` (frontend escapes encode `params.len()`; UVM
        // commands carry no size and their params buffers are sized from baton-nvidia's tables), and
        // the kernel writes no more than that.
        let result = unsafe { libc::ioctl(self.fd.as_raw_fd(), cmd as libc::Ioctl, arg) };
        if result < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(())
        }
    }
}

impl AsFd for NvFile {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

fn escape_name(nr: u32) -> String {
    escape::name(nr)
        .map(str::to_owned)
        .unwrap_or_else(|| format!("escape {nr:#x}"))
}
