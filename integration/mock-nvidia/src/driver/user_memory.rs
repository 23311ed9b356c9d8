//! Reading and writing the calling process's memory, the way the real driver's `copy_from_user` /
//! `copy_to_user` follow pointers inside ioctl params. FUSE restricted ioctls only carry the top-level
//! struct, so the mock follows nested pointers (`pAllocParms`, `IOCTL_XFER_CMD`'s `ptr`) itself with
//! `process_vm_readv` / `process_vm_writev` on the pid FUSE reports for the request. This needs the
//! mock to run as root (or to be allowed to ptrace the caller); when it is not, callers get `EFAULT`
//! (as from the real driver for an unreadable pointer) or, for memory sizes, "size unknown".

use std::io::{IoSlice, IoSliceMut};

use nix::sys::uio::{RemoteIoVec, process_vm_readv, process_vm_writev};
use nix::unistd::Pid;

/// Reads `len` bytes at `address` of process `pid`.
pub fn read(pid: u32, address: u64, len: usize) -> std::io::Result<Vec<u8>> {
    let mut data = vec![0u8; len];
    let remote = remote_iov(address, len)?;
    let read = process_vm_readv(pid_of(pid)?, &mut [IoSliceMut::new(&mut data)], &[remote])?;
    if read != len {
        return Err(std::io::Error::from_raw_os_error(libc::EFAULT));
    }
    Ok(data)
}

/// Writes `data` at `address` of process `pid`.
pub fn write(pid: u32, address: u64, data: &[u8]) -> std::io::Result<()> {
    let remote = remote_iov(address, data.len())?;
    let written = process_vm_writev(pid_of(pid)?, &[IoSlice::new(data)], &[remote])?;
    if written != data.len() {
        return Err(std::io::Error::from_raw_os_error(libc::EFAULT));
    }
    Ok(())
}

fn pid_of(pid: u32) -> std::io::Result<Pid> {
    i32::try_from(pid)
        .map(Pid::from_raw)
        .map_err(|_| std::io::Error::from_raw_os_error(libc::ESRCH))
}

fn remote_iov(address: u64, len: usize) -> std::io::Result<RemoteIoVec> {
    let base =
        usize::try_from(address).map_err(|_| std::io::Error::from_raw_os_error(libc::EFAULT))?;
    if base == 0 {
        return Err(std::io::Error::from_raw_os_error(libc::EFAULT));
    }
    Ok(RemoteIoVec { base, len })
}
