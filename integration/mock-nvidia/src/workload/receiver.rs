//! A process that holds NVIDIA files the probes never saw it take, for the hidden-holder tests: a child
//! forked before any NVIDIA file is opened, driven over a unix socket pair (one message a command). It
//! receives fds passed with SCM_RIGHTS, opens files itself (for its parent to take with pidfd_getfd), and
//! closes what it holds.
//!
//! Commands (the child answers `ok ...` or `err ...`): `take` with rights (-> `ok N`, the fds kept), `open
//! NAME` (-> `ok FD`), `close` (closes every fd it holds -> `ok T`, CLOCK_MONOTONIC ns after the last close
//! returned), `exit`.
//!
//! Fork it before the process starts threads: the child allocates. [`Receiver::clone_files`] makes a child that
//! shares the fd table instead (what it opens, its parent holds too).
use std::{
    io::{IoSlice, IoSliceMut},
    os::fd::{AsRawFd, FromRawFd, IntoRawFd, OwnedFd, RawFd},
    path::Path,
};

use anyhow::{Context, anyhow, bail};
use nix::{
    fcntl::{OFlag, open},
    sys::{
        socket::{
            AddressFamily, ControlMessage, ControlMessageOwned, MsgFlags, SockFlag, SockType,
            recvmsg, sendmsg, socketpair,
        },
        stat::Mode,
    },
    unistd::{ForkResult, fork},
};

/// The parent's end of a receiver child.
pub struct Receiver {
    /// The child's pid.
    pub pid: i32,
    socket: OwnedFd,
}

impl Receiver {
    /// Forks the child; device names of `open` are looked up in `dev_dir`.
    pub fn fork(dev_dir: &Path) -> anyhow::Result<Self> {
        let (mine, theirs) = command_pair()?;
        let dev_dir = dev_dir.to_path_buf();
        // SAFETY: the caller forks before starting threads (module doc), so no lock is held in the child.
        match unsafe { fork() }? {
            ForkResult::Child => {
                drop(mine);
                serve(&theirs, &dev_dir);
                // SAFETY: leaves at once without running the parent's atexit handlers or destructors.
                unsafe { libc::_exit(0) }
            }
            ForkResult::Parent { child } => Ok(Self {
                pid: child.as_raw(),
                socket: mine,
            }),
        }
    }

    /// Like [`Receiver::fork`], but the child shares this process's fd table (`clone(CLONE_FILES)` without
    /// CLONE_THREAD: two processes, one table): what either opens or closes, both have or lose, and the
    /// table lives until both are gone.
    pub fn clone_files(dev_dir: &Path) -> anyhow::Result<Self> {
        let (mine, theirs) = command_pair()?;
        let flags = (libc::CLONE_FILES | libc::SIGCHLD) as libc::c_ulong;
        // SAFETY: clone without CLONE_VM and with no new stack returns twice like fork (the child runs on a
        // copy of this stack); the caller clones before starting threads (module doc).
        let pid = unsafe { libc::syscall(libc::SYS_clone, flags, 0usize, 0usize, 0usize, 0usize) };
        match pid {
            -1 => bail!("clone(CLONE_FILES): {}", std::io::Error::last_os_error()),
            0 => {
                // One table: closing either end here would close it for the parent too.
                serve(&theirs, dev_dir);
                // SAFETY: leaves at once without running the parent's atexit handlers or destructors.
                unsafe { libc::_exit(0) }
            }
            child => {
                // The child's end is the parent's too (one table): keep it open as long as this process.
                std::mem::forget(theirs);
                Ok(Self {
                    pid: child as i32,
                    socket: mine,
                })
            }
        }
    }

    /// Tells the child to exit, and reaps it.
    pub fn exit(self) -> anyhow::Result<()> {
        self.send(b"exit", &[])?;
        nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(self.pid), None)?;
        // With a shared table the socket is the child's too; leave it be (it goes with this process).
        std::mem::forget(self.socket);
        Ok(())
    }

    /// Passes `fd` to the child with SCM_RIGHTS; the number of fds it holds then.
    pub fn send_fd(&self, fd: RawFd) -> anyhow::Result<String> {
        let fds = [fd];
        self.send(b"take", &[ControlMessage::ScmRights(&fds)])
            .context("sendmsg with SCM_RIGHTS")?;
        self.answer()
    }

    /// Sends `command` to the child; its answer after `ok`.
    pub fn ask(&self, command: &str) -> anyhow::Result<String> {
        self.send(command.as_bytes(), &[])?;
        self.answer()
    }

    /// One command message, with `rights` (fds) attached.
    fn send(&self, command: &[u8], rights: &[ControlMessage<'_>]) -> nix::Result<usize> {
        sendmsg::<()>(
            self.socket.as_raw_fd(),
            &[IoSlice::new(command)],
            rights,
            MsgFlags::empty(),
            None,
        )
    }

    fn answer(&self) -> anyhow::Result<String> {
        let mut buf = [0u8; 256];
        let n = nix::unistd::read(&self.socket, &mut buf)?;
        let text = String::from_utf8_lossy(&buf[..n]).into_owned();
        match text.strip_prefix("ok") {
            Some(rest) => Ok(rest.trim().to_owned()),
            None => bail!("receiver {}: {text}", self.pid),
        }
    }
}

/// The socket pair a parent and its receiver child talk over (one message a command).
fn command_pair() -> nix::Result<(OwnedFd, OwnedFd)> {
    socketpair(
        AddressFamily::Unix,
        SockType::SeqPacket,
        None,
        SockFlag::SOCK_CLOEXEC,
    )
}

/// The child's loop: one command per message until `exit` or the parent's end closes.
fn serve(socket: &OwnedFd, dev_dir: &Path) {
    let mut held: Vec<OwnedFd> = Vec::new();
    loop {
        let mut buf = [0u8; 256];
        let mut cmsg = nix::cmsg_space!([RawFd; 8]);
        let (n, received) = {
            let mut iov = [IoSliceMut::new(&mut buf)];
            let Ok(msg) = recvmsg::<()>(
                socket.as_raw_fd(),
                &mut iov,
                Some(&mut cmsg),
                MsgFlags::MSG_CMSG_CLOEXEC,
            ) else {
                return;
            };
            let mut received = Vec::new();
            for c in msg.cmsgs().into_iter().flatten() {
                if let ControlMessageOwned::ScmRights(fds) = c {
                    received.extend(fds);
                }
            }
            (msg.bytes, received)
        };
        if n == 0 {
            return;
        }
        // SAFETY: the kernel just installed these fds in this process for it alone.
        held.extend(
            received
                .into_iter()
                .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
        );
        let command = String::from_utf8_lossy(&buf[..n]).into_owned();
        let reply = match run(&command, &mut held, dev_dir) {
            Ok(r) => format!("ok {r}"),
            Err(e) => format!("err {e:#}"),
        };
        if nix::unistd::write(socket, reply.as_bytes()).is_err() {
            return;
        }
    }
}

fn run(command: &str, held: &mut Vec<OwnedFd>, dev_dir: &Path) -> anyhow::Result<String> {
    let words: Vec<&str> = command.split_whitespace().collect();
    match words.as_slice() {
        ["take"] => Ok(held.len().to_string()),
        ["open", name] => {
            let path = dev_dir.join(name);
            let fd = open(&path, OFlag::O_RDWR | OFlag::O_CLOEXEC, Mode::empty())
                .with_context(|| format!("open {}", path.display()))?;
            let raw = fd.as_raw_fd();
            held.push(fd);
            Ok(raw.to_string())
        }
        ["open-state", name] => {
            let path = dev_dir.join(name);
            let fd = open(&path, OFlag::O_RDWR | OFlag::O_CLOEXEC, Mode::empty())
                .with_context(|| format!("open {}", path.display()))?;
            let raw = fd.as_raw_fd();
            let (_, status) = alloc_gpu_state(fd.as_raw_fd(), dev_dir, 1 << 20)?;
            held.push(fd);
            if status != 0 {
                bail!("allocating GPU state on {name}: RM status {status:#x}");
            }
            Ok(raw.to_string())
        }
        ["close"] => {
            held.clear();
            Ok(now_ns().to_string())
        }
        ["exit"] => {
            // SAFETY: leaves at once, as the child of a fork should.
            unsafe { libc::_exit(0) }
        }
        _ => Err(anyhow!("unknown command {command:?}")),
    }
}

/// Allocates GPU state through NVIDIA fd `fd` (of this process, left open): an RM root client with a device
/// and `bytes` of video memory under it. Returns the client's handle and the first status that is not NV_OK
/// (else 0).
pub fn alloc_gpu_state(fd: RawFd, dev_dir: &Path, bytes: u64) -> anyhow::Result<(u32, u32)> {
    use baton_nvidia::{class, layout::Layout};
    // SAFETY: `fd` is open and the caller's; `into_fd` below hands it back unclosed.
    let file = super::nvfile::NvFile::from_fd(unsafe { OwnedFd::from_raw_fd(fd) }, dev_dir);
    let layout = Layout::DEFAULT;
    let form = super::calls::AllocForm::Nvos21;
    let built = (|| {
        let client =
            super::calls::rm_alloc(&file, &layout, form, [0; 3], class::NV01_ROOT_CLIENT, None)?;
        if client.status != 0 {
            return Ok((client.handle, client.status));
        }
        let c = client.handle;
        let device = super::calls::rm_alloc(
            &file,
            &layout,
            form,
            [c, c, 0x4855_0001],
            class::NV01_DEVICE_0,
            None,
        )?;
        if device.status != 0 {
            return Ok((c, device.status));
        }
        let mut params = super::calls::memory_alloc_params(&layout, bytes);
        let memory = super::calls::rm_alloc(
            &file,
            &layout,
            form,
            [c, device.handle, 0x4855_0002],
            class::NV01_MEMORY_LOCAL_USER,
            Some(&mut params),
        )?;
        Ok::<_, super::WorkloadError>((c, memory.status))
    })();
    let _ = file.into_fd().into_raw_fd();
    Ok(built?)
}

/// Registers `fd` as a fixed file of a new io_uring instance (no submission queue is ever used); the
/// ring's fd. The ring keeps the file after `fd` is closed, in no fd table.
pub fn ring_with_file(fd: RawFd) -> anyhow::Result<RawFd> {
    /// `sizeof(struct io_uring_params)`.
    const PARAMS_BYTES: usize = 120;
    /// `IORING_REGISTER_FILES`.
    const REGISTER_FILES: u32 = 2;
    let mut params = [0u8; PARAMS_BYTES];
    // SAFETY: io_uring_setup reads and writes `params`, a live buffer of the struct's size.
    let ring = unsafe { libc::syscall(libc::SYS_io_uring_setup, 1u32, params.as_mut_ptr()) };
    if ring < 0 {
        bail!("io_uring_setup: {}", std::io::Error::last_os_error());
    }
    let fds = [fd];
    // SAFETY: IORING_REGISTER_FILES reads `fds`, an array of the count given.
    let r = unsafe {
        libc::syscall(
            libc::SYS_io_uring_register,
            ring as RawFd,
            REGISTER_FILES,
            fds.as_ptr(),
            1u32,
        )
    };
    if r < 0 {
        bail!(
            "io_uring_register(FILES): {}",
            std::io::Error::last_os_error()
        );
    }
    Ok(ring as RawFd)
}

/// CLOCK_MONOTONIC now, ns (the clock of the probes' records).
pub fn now_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC)
        .map(|t| t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64)
        .unwrap_or(0)
}

/// Takes fd `fd` of process `pid` into this process with pidfd_getfd (as a debugger would; it needs
/// ptrace access to `pid`, which a parent has to its child); the new fd.
pub fn grab_fd(pid: i32, fd: RawFd) -> anyhow::Result<RawFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0u32) };
    if pidfd < 0 {
        bail!("pidfd_open({pid}): {}", std::io::Error::last_os_error());
    }
    // SAFETY: pidfd_open returned a new fd that this function owns.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as RawFd) };
    // SAFETY: pidfd_getfd takes a pidfd, an fd number of that process and flags; returns a new fd or -1.
    let got = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0u32) };
    if got < 0 {
        bail!(
            "pidfd_getfd({pid}, {fd}): {}",
            std::io::Error::last_os_error()
        );
    }
    Ok(got as RawFd)
}
