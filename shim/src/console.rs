//! TTY processes: a unix socket handed to runc as `--console-socket`; runc sends the pty master
//! over it (SCM_RIGHTS); ResizePty sets the window size on that master. The master is shared by
//! the copies and ResizePty as a [`Console`], which the end of the process's stdin closes for all
//! of them, as the Go shim's console does: once CloseIO has let go of stdin and containerd's writer
//! is gone, the terminal hangs up, so the process sees the end of its input.
//!
//! The shim also holds the terminal's slave side (opened through the master, `TIOCGPTPEER`) until the
//! process exited and the master has nothing left to read. Linux ends a master's reads (EIO) once no
//! process holds the slave: a read that found nothing ready just before the process's last write reached
//! the master, and then saw the slave closed, answered EIO with that write still queued (kilobytes lost
//! in about one TTY exec in 400 with busy CPUs; reproduced with a bare pty and `seq`, no shim, where a
//! read after the EIO returned exactly the missing bytes). With the shim's hold, the slave closes
//! only after a read of the shim's own found the master empty.

use std::{
    fs::File,
    io::IoSliceMut,
    os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd},
    path::PathBuf,
    pin::Pin,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll, Waker},
    time::Duration,
};

use containerd_shim::asynchronous::io::Pty;
use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};
use tokio::{
    io::{AsyncRead, AsyncWrite, Interest, ReadBuf},
    net::UnixListener,
};

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
    pub async fn receive_master(&self) -> Result<Console> {
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
        Console::new(File::from(fd))
    }
}

/// A process's pty master, shared by its output copy (reading), its stdin copy (writing, through
/// [`Console::input`]) and ResizePty. [`Console::close`] releases the master for all of them at
/// once: a parked read then ends (EOF) and a write fails, so the copies end and drop their handles.
#[derive(Clone)]
pub struct Console(Arc<ConsoleShared>);

struct ConsoleShared {
    /// The master; `None` once closed.
    master: Mutex<Option<Pty>>,
    /// The shim's own hold on the slave side (see the module's doc); `None` once let go, or when the
    /// kernel could not give it (then the terminal hangs up with the process's last holder).
    peer: Mutex<Option<OwnedFd>>,
    /// The process on the terminal exited ([`Console::process_exited`]).
    exited: AtomicBool,
    /// The tasks parked reading and writing, woken by close (the reactor forgets them when the
    /// master's registration goes away).
    reader: Mutex<Option<Waker>>,
    writer: Mutex<Option<Waker>>,
}

fn locked<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Console {
    /// Wraps a pty master (made non-blocking and registered with the reactor).
    pub fn new(master: File) -> Result<Self> {
        let peer = open_peer(&master);
        let pty = Pty::new(master).map_err(ShimError::from)?;
        Ok(Self(Arc::new(ConsoleShared {
            master: Mutex::new(Some(pty)),
            peer: Mutex::new(peer),
            exited: AtomicBool::new(false),
            reader: Mutex::new(None),
            writer: Mutex::new(None),
        })))
    }

    /// The master, unless closed. `waiter` is parked first, so a close that comes after this
    /// look-up wakes it.
    fn master(&self, waiter: &Mutex<Option<Waker>>, waker: &Waker) -> Option<Pty> {
        locked(waiter).replace(waker.clone());
        locked(&self.0.master).clone()
    }

    /// Closes the master for every holder (the terminal hangs up once the last in-flight use ends).
    pub fn close(&self) {
        drop(locked(&self.0.peer).take());
        drop(locked(&self.0.master).take());
        for waiter in [&self.0.reader, &self.0.writer] {
            if let Some(waker) = locked(waiter).take() {
                waker.wake();
            }
        }
    }

    /// The process on the terminal exited: once the master has nothing left to read, the shim lets go of
    /// the slave, so that the terminal hangs up (the end of the output) when the process's last other
    /// holder (a child it left behind) is gone too.
    pub fn process_exited(&self) {
        self.0.exited.store(true, Ordering::SeqCst);
        if let Some(waker) = locked(&self.0.reader).as_ref() {
            waker.wake_by_ref();
        }
    }

    /// After the exit, with nothing ready on the master: a read of the shim's own (the kernel moves what
    /// the terminal still buffers to the master before it answers EAGAIN); when it finds nothing, the
    /// shim lets go of the slave and reads once more, which answers EIO (the end) unless another
    /// process still holds the slave (then its output or its hang-up wakes the copy).
    fn read_after_exit(&self, pty: &Pty, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        if !self.0.exited.load(Ordering::SeqCst) {
            return Poll::Pending;
        }
        loop {
            let held = locked(&self.0.peer).is_some();
            match nix::unistd::read(pty.as_fd(), buf.initialize_unfilled()) {
                Ok(n) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Err(nix::errno::Errno::EIO) => return Poll::Ready(Ok(())),
                Err(nix::errno::Errno::EAGAIN) if held => drop(locked(&self.0.peer).take()),
                Err(nix::errno::Errno::EAGAIN) => return Poll::Pending,
                Err(e) => return Poll::Ready(Err(e.into())),
            }
        }
    }

    /// Whether [`Self::close`] ran.
    #[cfg(test)]
    pub fn is_closed(&self) -> bool {
        locked(&self.0.master).is_none()
    }

    /// The writer for the stdin copy: when the copy ends (end of stdin after CloseIO, a broken
    /// fifo, or the copies being shut down) and drops it, the console closes.
    pub fn input(&self) -> ConsoleInput {
        ConsoleInput(self.clone())
    }
}

impl AsyncRead for Console {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.master(&self.0.reader, cx.waker()) {
            Some(mut pty) => match Pin::new(&mut pty).poll_read(cx, buf) {
                // The slave side is closed (the process and every holder of its terminal are gone) and
                // nothing is left to read: the end of the output. Reported as an end, not an error, so that
                // a copy writes out what it read before (tokio's copy drops its buffer on a read error: the
                // last kilobytes of a terminal whose client read slowly were lost once in 200 execs).
                Poll::Ready(Err(e)) if e.raw_os_error() == Some(libc::EIO) => Poll::Ready(Ok(())),
                Poll::Pending => self.read_after_exit(&pty, buf),
                other => other,
            },
            None => Poll::Ready(Ok(())),
        }
    }
}

/// The stdin side of a [`Console`]; closes the console when dropped.
pub struct ConsoleInput(Console);

impl Drop for ConsoleInput {
    fn drop(&mut self) {
        self.0.close();
    }
}

impl AsyncWrite for ConsoleInput {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.0.master(&self.0.0.writer, cx.waker()) {
            Some(mut pty) => Pin::new(&mut pty).poll_write(cx, buf),
            None => Poll::Ready(Err(std::io::ErrorKind::BrokenPipe.into())),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// Opens the slave side of the pty `master` for the shim to hold (`TIOCGPTPEER`: through the master, so
/// whatever devpts instance the container made it in); `None`, with a warning, where the kernel refuses.
fn open_peer(master: &File) -> Option<OwnedFd> {
    let flags = libc::O_RDWR | libc::O_NOCTTY | libc::O_CLOEXEC;
    // SAFETY: TIOCGPTPEER takes the open flags by value and returns a new descriptor or -1; the
    // master is open for the call.
    let fd = unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCGPTPEER, flags) };
    if fd < 0 {
        tracing::warn!(
            error = %std::io::Error::last_os_error(),
            "cannot hold the terminal's slave side (TIOCGPTPEER): its last output may be lost if the process exits while it is unread"
        );
        return None;
    }
    // SAFETY: the ioctl just created this descriptor; nothing else owns it.
    Some(unsafe { OwnedFd::from_raw_fd(fd) })
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

/// Sets the terminal size of a console master (ResizePty); nothing to do once it is closed.
pub fn resize(console: &Console, width: u32, height: u32) -> Result<()> {
    use std::os::fd::AsFd;
    let Some(console) = locked(&console.0.master).clone() else {
        return Ok(());
    };
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

#[cfg(test)]
mod tests {
    use std::{
        io::{Read, Write},
        time::Duration,
    };

    use containerd_shim::asynchronous::io::IoTasks;
    use nix::sys::termios::{SetArg, cfmakeraw, tcgetattr, tcsetattr};
    use tokio::{io::AsyncReadExt, net::unix::pipe, time::timeout};

    use super::*;
    use crate::io::{OutputDrain, StdioSpec, start_console_copies};

    fn mkfifo(dir: &std::path::Path, name: &str) -> PathBuf {
        let path = dir.join(name);
        nix::unistd::mkfifo(&path, nix::sys::stat::Mode::S_IRWXU).unwrap();
        path
    }

    /// Reads once from the terminal's slave side, off the runtime (5 s at most).
    async fn read_slave(slave: &File) -> std::io::Result<Vec<u8>> {
        let mut slave = slave.try_clone().unwrap();
        let read = tokio::task::spawn_blocking(move || {
            let mut buf = [0u8; 64];
            slave.read(&mut buf).map(|n| buf[..n].to_vec())
        });
        timeout(Duration::from_secs(5), read)
            .await
            .expect("the slave read returns")
            .unwrap()
    }

    /// A raw pty (no `\n` to `\r\n`), its master as a [`Console`] whose exit `drain` reports, copied to a
    /// client that takes 16 bytes at a time (so the copy's buffer is full when the terminal hangs up).
    fn slow_copy(
        drain: &OutputDrain,
    ) -> (
        File,
        tokio::io::DuplexStream,
        tokio::task::JoinHandle<std::io::Result<u64>>,
    ) {
        let pty = nix::pty::openpty(None, None).unwrap();
        let mut termios = tcgetattr(&pty.slave).unwrap();
        cfmakeraw(&mut termios);
        tcsetattr(&pty.slave, SetArg::TCSANOW, &termios).unwrap();
        let console = Console::new(File::from(pty.master)).unwrap();
        drain.set_terminal(&console);
        let mut console = drain.track(console);
        let (mut client, from_client) = tokio::io::duplex(16);
        let copy = tokio::spawn(async move { tokio::io::copy(&mut console, &mut client).await });
        (File::from(pty.slave), from_client, copy)
    }

    /// Everything the process wrote reaches a client that reads slowly: the shim's hold on the terminal
    /// keeps the copy going when the process closes it, until the exit is reported; then the copy reads
    /// the terminal dry, lets go, and reads the hang-up (EIO) as the end, writing out what it had read.
    #[tokio::test]
    async fn output_written_before_the_exit_reaches_a_slow_client() {
        let drain = OutputDrain::default();
        let (mut slave, mut from_client, copy) = slow_copy(&drain);
        let written: Vec<u8> = (0..4000u32).map(|i| (i % 251) as u8).collect();
        slave.write_all(&written).unwrap();
        drop(slave);
        let mut got = vec![0u8; written.len()];
        timeout(Duration::from_secs(5), from_client.read_exact(&mut got))
            .await
            .expect("the output arrives")
            .unwrap();
        assert_eq!(got, written);
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            !copy.is_finished(),
            "the process closing the terminal is not the end while the shim holds it"
        );

        drain.process_exited();
        let mut rest = Vec::new();
        timeout(Duration::from_secs(5), from_client.read_to_end(&mut rest))
            .await
            .expect("the copy ends after the exit")
            .unwrap();
        assert!(rest.is_empty(), "{rest:?}");
        assert_eq!(copy.await.unwrap().unwrap(), written.len() as u64);
        assert!(drain.drained().await);
    }

    /// A child the process left on its terminal keeps the output going after the exit: its output still
    /// arrives, and the copy ends when it closes the terminal. An exit reported before the terminal was
    /// known is not missed.
    #[tokio::test]
    async fn output_of_a_child_left_on_the_terminal_arrives_after_the_exit() {
        let drain = OutputDrain::default();
        drain.process_exited();
        let (slave, mut from_client, copy) = slow_copy(&drain);
        let mut child = slave.try_clone().unwrap();
        (&slave).write_all(b"from the process ").unwrap();
        drop(slave);
        child.write_all(b"and from its child").unwrap();
        let mut got = vec![0u8; 35];
        timeout(Duration::from_secs(5), from_client.read_exact(&mut got))
            .await
            .expect("the output arrives")
            .unwrap();
        assert_eq!(got, b"from the process and from its child");
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!copy.is_finished(), "the child still holds the terminal");

        drop(child);
        let mut rest = Vec::new();
        timeout(Duration::from_secs(5), from_client.read_to_end(&mut rest))
            .await
            .expect("the copy ends with the child's hold")
            .unwrap();
        assert!(rest.is_empty(), "{rest:?}");
        assert_eq!(copy.await.unwrap().unwrap(), 35);
    }

    /// The console carries input and output; containerd's writer going away alone keeps it open;
    /// after CloseIO the end of stdin closes the master: the terminal hangs up (the process reads
    /// EOF) and the output copy ends, as with the Go shim.
    #[tokio::test]
    async fn end_of_stdin_after_close_io_hangs_up_the_terminal() {
        let dir = tempfile::tempdir().unwrap();
        let stdin = mkfifo(dir.path(), "stdin");
        let stdout = mkfifo(dir.path(), "stdout");
        let pty = nix::pty::openpty(None, None).unwrap();
        let mut termios = tcgetattr(&pty.slave).unwrap();
        cfmakeraw(&mut termios);
        tcsetattr(&pty.slave, SetArg::TCSANOW, &termios).unwrap();
        let slave = File::from(pty.slave);
        let console = Console::new(File::from(pty.master)).unwrap();
        let io = IoTasks::default();
        let mut out = pipe::OpenOptions::new().open_receiver(&stdout).unwrap();
        let spec = StdioSpec {
            stdin: stdin.display().to_string(),
            stdout: stdout.display().to_string(),
            stderr: String::new(),
            terminal: true,
        };
        start_console_copies(&console, &spec, &io, &OutputDrain::default()).unwrap();

        let mut containerd = std::fs::OpenOptions::new()
            .write(true)
            .open(&stdin)
            .unwrap();
        containerd.write_all(b"ping").unwrap();
        assert_eq!(read_slave(&slave).await.unwrap(), b"ping");
        (&slave).write_all(b"pong").unwrap();
        let mut buf = [0u8; 16];
        let n = timeout(Duration::from_secs(5), out.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&buf[..n], b"pong");

        drop(containerd);
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(!console.is_closed(), "open until CloseIO");

        io.close_input();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while !console.is_closed() && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(console.is_closed(), "the end of stdin closes the console");
        match read_slave(&slave).await {
            Ok(data) => assert!(data.is_empty(), "hung up, not {data:?}"),
            Err(e) => assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}"),
        }
        let mut rest = Vec::new();
        timeout(Duration::from_secs(5), out.read_to_end(&mut rest))
            .await
            .expect("the output copy ends")
            .unwrap();
        assert!(rest.is_empty());
        resize(&console, 80, 24).unwrap();
    }
}
