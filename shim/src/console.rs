//! TTY processes: a unix socket handed to runc as `--console-socket`; runc sends the pty master
//! over it (SCM_RIGHTS); ResizePty sets the window size on that master.

use std::{
    fs::File,
    io::IoSliceMut,
    os::fd::{AsRawFd, FromRawFd, OwnedFd},
    path::PathBuf,
    time::Duration,
};

use containerd_shim::asynchronous::io::Pty;
use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};
use tokio::{io::Interest, net::UnixListener};

use crate::errors::{Result, ShimError};

/// How long runc may take to send the console after create/exec returned.
const RECEIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// A listening console socket in a private temporary directory (removed on drop).
pub struct ConsoleSocket {
    dir: tempfile::TempDir,
    listener: UnixListener,
}

impl ConsoleSocket {
    /// Creates the socket (short path under the temp dir: sun_path is 108 bytes).
    pub fn new() -> Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("baton-pty")
            .tempdir()
            .map_err(|e| ShimError::io("create console socket dir", e))?;
        let path = dir.path().join("pty.sock");
        let listener = UnixListener::bind(&path)
            .map_err(|e| ShimError::io(format!("bind console socket {}", path.display()), e))?;
        Ok(Self { dir, listener })
    }

    /// The path for `--console-socket`.
    pub fn path(&self) -> PathBuf {
        self.dir.path().join("pty.sock")
    }

    /// Accepts runc's connection and takes the pty master it sends.
    pub async fn receive_master(&self) -> Result<Pty> {
        let path = self.path();
        let (stream, _) = tokio::time::timeout(RECEIVE_TIMEOUT, self.listener.accept())
            .await
            .map_err(|_| ShimError::Other(format!("runc sent no console on {}", path.display())))?
            .map_err(|e| ShimError::io(format!("accept on {}", path.display()), e))?;
        let fd = tokio::time::timeout(
            RECEIVE_TIMEOUT,
            stream.async_io(Interest::READABLE, || recv_fd(stream.as_raw_fd())),
        )
        .await
        .map_err(|_| ShimError::Other(format!("no console fd on {}", path.display())))?
        .map_err(|e| ShimError::io(format!("receive console on {}", path.display()), e))?;
        Pty::new(File::from(fd)).map_err(ShimError::from)
    }
}

fn recv_fd(sock: i32) -> std::io::Result<OwnedFd> {
    let mut name = [0u8; 4096];
    let mut iov = [IoSliceMut::new(&mut name)];
    let mut cmsg = nix::cmsg_space!([std::os::fd::RawFd; 1]);
    let msg = recvmsg::<()>(sock, &mut iov, Some(&mut cmsg), MsgFlags::MSG_CMSG_CLOEXEC)
        .map_err(std::io::Error::from)?;
    for c in msg.cmsgs().map_err(std::io::Error::from)? {
        if let ControlMessageOwned::ScmRights(fds) = c
            && let Some(&fd) = fds.first()
        {
            // SAFETY: SCM_RIGHTS just installed this descriptor in our table; nothing else owns it.
            return Ok(unsafe { OwnedFd::from_raw_fd(fd) });
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        "console message carried no file descriptor",
    ))
}

nix::ioctl_write_ptr_bad!(set_window_size, libc::TIOCSWINSZ, libc::winsize);

/// Sets the terminal size of a console master (ResizePty).
pub fn resize(console: &Pty, width: u32, height: u32) -> Result<()> {
    use std::os::fd::AsFd;
    let ws = libc::winsize {
        ws_row: u16::try_from(height).unwrap_or(u16::MAX),
        ws_col: u16::try_from(width).unwrap_or(u16::MAX),
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads a `winsize` from the pointer, which lives for the call; the fd is
    // a pty master kept open by `console`.
    unsafe { set_window_size(console.as_fd().as_raw_fd(), &ws) }
        .map_err(|e| ShimError::io("resize console", e.into()))?;
    Ok(())
}
