//! A process's stdio: what containerd asked for (fifo paths, `file://` or `binary://` log URIs,
//! or a terminal), the pipes runc gets, and the copies the shim runs between them.

use std::{
    fmt,
    path::{Path, PathBuf},
    pin::Pin,
    process::Stdio,
    sync::{Arc, Mutex},
    task::{Context, Poll},
    time::Duration,
};

use async_trait::async_trait;
use containerd_shim::asynchronous::io::IoTasks;
use percent_encoding::percent_decode_str;
use runc::{Command, PipedIo, io::IoOption};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};

use crate::{
    console::Console,
    errors::{Result, ShimError},
};

/// Stdio of a process as containerd sent it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StdioSpec {
    /// stdin fifo (empty: none).
    pub stdin: String,
    /// stdout: fifo path or URI (empty: none).
    pub stdout: String,
    /// stderr: fifo path or URI (empty: none).
    pub stderr: String,
    /// A TTY was asked for.
    pub terminal: bool,
}

/// Where a process's output goes, parsed from containerd's stdout string.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutputTarget {
    /// Nowhere.
    Null,
    /// A fifo containerd reads.
    Fifo(String),
    /// `file:///path`: stdout and stderr appended to one file.
    File(PathBuf),
    /// `binary:///path?k=v`: a logging binary gets the output pipes as fds 3 and 4.
    Binary {
        /// The binary.
        path: PathBuf,
        /// Arguments from the query, `k v` pairs as the Go shim passes them.
        args: Vec<String>,
    },
}

/// Percent-decodes a URI path.
fn decode_path(s: &str) -> String {
    percent_decode_str(s).decode_utf8_lossy().into_owned()
}

/// Decodes a query key or value as Go's `url.ParseQuery` does (`+` is a space).
fn decode_query(s: &str) -> String {
    decode_path(&s.replace('+', " "))
}

/// Parses containerd's stdout string (path or URI).
pub fn parse_output(stdout: &str) -> Result<OutputTarget> {
    if stdout.is_empty() {
        return Ok(OutputTarget::Null);
    }
    let Some((scheme, rest)) = stdout.split_once("://") else {
        return Ok(OutputTarget::Fifo(stdout.to_string()));
    };
    let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
    let path = decode_path(path);
    if path.is_empty() || !path.starts_with('/') {
        return Err(ShimError::InvalidArgument(format!(
            "stdio URI {stdout:?}: expected an absolute path after {scheme}://"
        )));
    }
    match scheme {
        "fifo" => Ok(OutputTarget::Fifo(path)),
        "file" => Ok(OutputTarget::File(PathBuf::from(path))),
        "binary" => {
            let mut args = Vec::new();
            for pair in query.split('&').filter(|p| !p.is_empty()) {
                let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
                args.push(decode_query(k));
                if !v.is_empty() {
                    args.push(decode_query(v));
                }
            }
            Ok(OutputTarget::Binary {
                path: PathBuf::from(path),
                args,
            })
        }
        other => Err(ShimError::InvalidArgument(format!(
            "stdio URI {stdout:?}: unsupported scheme {other:?} (fifo, file or binary)"
        ))),
    }
}

/// The pipes a non-TTY process gets from runc, with `/dev/null` for the streams not asked for.
pub struct ProcessPipes {
    pipes: PipedIo,
}

impl fmt::Debug for ProcessPipes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ProcessPipes")
    }
}

impl ProcessPipes {
    /// Pipes for `spec`, owned by `uid:gid` (the IoUid/IoGid options).
    pub fn new(spec: &StdioSpec, uid: u32, gid: u32) -> Result<Self> {
        let opts = IoOption {
            open_stdin: !spec.stdin.is_empty(),
            open_stdout: !spec.stdout.is_empty(),
            open_stderr: !spec.stderr.is_empty(),
        };
        let pipes =
            PipedIo::new(uid, gid, &opts).map_err(|e| ShimError::io("create stdio pipes", e))?;
        Ok(Self { pipes })
    }
}

#[async_trait]
impl runc::Io for ProcessPipes {
    fn stdin(&self) -> Option<Box<dyn tokio::io::AsyncWrite + Send + Sync + Unpin>> {
        self.pipes.stdin()
    }
    fn stdout(&self) -> Option<Box<dyn tokio::io::AsyncRead + Send + Sync + Unpin>> {
        self.pipes.stdout()
    }
    fn stderr(&self) -> Option<Box<dyn tokio::io::AsyncRead + Send + Sync + Unpin>> {
        self.pipes.stderr()
    }
    async fn set(&self, cmd: &mut Command) -> std::io::Result<()> {
        if self.pipes.stdout.is_none() {
            cmd.stdout(Stdio::null());
        }
        if self.pipes.stderr.is_none() {
            cmd.stderr(Stdio::null());
        }
        self.pipes.set(cmd).await
    }
    async fn close_after_start(&self) {
        self.pipes.close_after_start().await
    }
}

/// The writer into a process's stdin pipe, which CloseIO can drop (closing the pipe, so the
/// process reads EOF) even while containerd keeps its end of the stdin fifo open, as the Go
/// shim's CloseIO does.
#[derive(Clone, Default)]
pub struct StdinCloser(Arc<Mutex<Option<Box<dyn AsyncWrite + Send + Sync + Unpin>>>>);

/// How long CloseIO lets already-written input reach the process before closing its stdin.
const STDIN_DRAIN: Duration = Duration::from_millis(100);

impl StdinCloser {
    fn slot(&self) -> std::sync::MutexGuard<'_, Option<Box<dyn AsyncWrite + Send + Sync + Unpin>>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Closes the process's stdin shortly (after the input already in flight is copied).
    pub fn close_soon(&self) {
        let this = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(STDIN_DRAIN).await;
            this.slot().take();
        });
    }
}

impl AsyncWrite for StdinCloser {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.slot().as_mut() {
            Some(w) => Pin::new(w).poll_write(cx, buf),
            None => Poll::Ready(Err(std::io::ErrorKind::BrokenPipe.into())),
        }
    }
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.slot().as_mut() {
            Some(w) => Pin::new(w).poll_flush(cx),
            None => Poll::Ready(Ok(())),
        }
    }
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.slot().as_mut() {
            Some(w) => Pin::new(w).poll_shutdown(cx),
            None => Poll::Ready(Ok(())),
        }
    }
}

/// How long a process's exit waits for its output copies once no more output flows: long enough for a loaded
/// shim to be scheduled again, short enough that output nobody reads (a client gone) or a pipe a daemonised child
/// keeps open holds the exit back only briefly: on a 2-core CI machine with every CPU kept busy and three clients
/// at once (the output series), a copy can go unscheduled for a few seconds. (Terminal output lost at the exit in
/// that series was not a stall: the copy dropped what it had read when the terminal hung up, and the kernel
/// hung it up with output still queued; see `crate::console`.)
pub const OUTPUT_STALL: Duration = Duration::from_secs(5);

/// The output streams of one process that the shim copies (console, stdout and stderr pipes, to fifos or
/// `file://` logs): how many are still open and how many bytes they gave. A process's exit is published only
/// once they reached their end ([`OutputDrain::drained`]), so that Wait never returns before the output did.
/// It also tells the process's terminal of the exit ([`OutputDrain::process_exited`]), which is when the shim
/// lets go of its hold on the terminal (see `crate::console`).
#[derive(Clone, Default)]
pub struct OutputDrain(Arc<DrainShared>);

#[derive(Default)]
struct DrainShared {
    flow: tokio::sync::watch::Sender<Flow>,
    exited: std::sync::atomic::AtomicBool,
    terminal: Mutex<Option<Console>>,
}

/// What [`OutputDrain`] counts.
#[derive(Debug, Clone, Copy, Default)]
struct Flow {
    open: usize,
    bytes: u64,
}

impl OutputDrain {
    /// `reader`, counted as open until the copy reading it drops it.
    pub fn track<R: AsyncRead + Unpin>(&self, reader: R) -> Tracked<R> {
        self.0.flow.send_modify(|f| f.open += 1);
        Tracked {
            inner: reader,
            drain: Some(self.clone()),
        }
    }

    fn ended(&self) {
        self.0
            .flow
            .send_modify(|f| f.open = f.open.saturating_sub(1));
    }

    /// The process's terminal, to be told of its exit (at once if the exit came first).
    pub fn set_terminal(&self, console: &Console) {
        *self.terminal() = Some(console.clone());
        if self.0.exited.load(std::sync::atomic::Ordering::SeqCst) {
            console.process_exited();
        }
    }

    /// The process exited: its terminal, if any, may hang up once it has nothing left to give.
    pub fn process_exited(&self) {
        self.0
            .exited
            .store(true, std::sync::atomic::Ordering::SeqCst);
        if let Some(console) = self.terminal().as_ref() {
            console.process_exited();
        }
    }

    fn terminal(&self) -> std::sync::MutexGuard<'_, Option<Console>> {
        self.0
            .terminal
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Waits until every tracked stream reached its end (true), or until no byte flowed for [`OUTPUT_STALL`]
    /// (false: output nobody reads, or a pipe another process holds open).
    pub async fn drained(&self) -> bool {
        let mut flow = self.0.flow.subscribe();
        loop {
            if flow.borrow_and_update().open == 0 {
                return true;
            }
            match tokio::time::timeout(OUTPUT_STALL, flow.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return true,
                Err(_) => return false,
            }
        }
    }

    /// Bytes read so far (for logs).
    pub fn bytes(&self) -> u64 {
        self.0.flow.borrow().bytes
    }
}

/// A reader counted by an [`OutputDrain`]: the bytes it gives, and its end when dropped.
pub struct Tracked<R> {
    inner: R,
    drain: Option<OutputDrain>,
}

/// The copy owning a tracked reader drops it only once it wrote out the last bytes it read (and flushed), so
/// the stream counts as ended then, not when its end was read.
impl<R> Drop for Tracked<R> {
    fn drop(&mut self) {
        if let Some(drain) = self.drain.take() {
            drain.ended();
        }
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for Tracked<R> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let res = Pin::new(&mut self.inner).poll_read(cx, buf);
        let n = buf.filled().len() - before;
        if n > 0
            && let Some(drain) = &self.drain
        {
            drain.0.flow.send_modify(|f| f.bytes += n as u64);
        }
        res
    }
}

/// Starts the copies for a non-TTY process after runc created it. Returns the `file://`
/// copies, which Delete lets finish (the fifo copies belong to `io`).
pub async fn start_pipe_copies(
    pipes: &ProcessPipes,
    spec: &StdioSpec,
    io: &IoTasks,
    stdin: &StdinCloser,
    output: &OutputDrain,
    id: &str,
    namespace: &str,
) -> Result<Vec<tokio::task::JoinHandle<()>>> {
    let mut file_copies = Vec::new();
    use runc::Io as _;
    if !spec.stdin.is_empty()
        && let Some(w) = pipes.stdin()
    {
        *stdin.slot() = Some(w);
        io.copy_from_fifo(&spec.stdin, stdin.clone())?;
    }
    let stdout = parse_output(&spec.stdout)?;
    match stdout {
        OutputTarget::Null | OutputTarget::Fifo(_) => {
            let streams = [
                (stdout, pipes.stdout()),
                (parse_output(&spec.stderr)?, pipes.stderr()),
            ];
            for (target, reader) in streams {
                if let (OutputTarget::Fifo(path), Some(r)) = (target, reader) {
                    io.copy_to_fifo(output.track(r), &path)?;
                }
            }
        }
        OutputTarget::File(path) => {
            let file = open_log_file(&path).await?;
            for reader in [pipes.stdout(), pipes.stderr()].into_iter().flatten() {
                let mut file = file
                    .try_clone()
                    .await
                    .map_err(|e| ShimError::io(format!("dup {}", path.display()), e))?;
                let mut reader = output.track(reader);
                file_copies.push(tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut reader, &mut file).await;
                    let _ = file.flush().await;
                }));
            }
        }
        OutputTarget::Binary { path, args } => {
            let out = pipes.pipes.stdout.as_ref().map(|p| &p.rd);
            let err = pipes.pipes.stderr.as_ref().map(|p| &p.rd);
            crate::binary_logger::start(&path, &args, out, err, id, namespace, output).await?;
        }
    }
    Ok(file_copies)
}

async fn open_log_file(path: &Path) -> Result<tokio::fs::File> {
    if let Some(dir) = path.parent() {
        tokio::fs::create_dir_all(dir)
            .await
            .map_err(|e| ShimError::io(format!("create {}", dir.display()), e))?;
    }
    tokio::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(path)
        .await
        .map_err(|e| ShimError::io(format!("open log file {}", path.display()), e))
}

/// Starts the copies for a TTY process: console master to stdout, stdin to console. The end of
/// the stdin copy closes the console (see [`Console::input`]), as in the Go shim.
pub fn start_console_copies(
    console: &Console,
    spec: &StdioSpec,
    io: &IoTasks,
    output: &OutputDrain,
) -> Result<()> {
    if !spec.stdin.is_empty() {
        io.copy_from_fifo(&spec.stdin, console.input())?;
    }
    output.set_terminal(console);
    match parse_output(&spec.stdout)? {
        OutputTarget::Fifo(path) => io.copy_to_fifo(output.track(console.clone()), &path)?,
        OutputTarget::Null => {}
        other => {
            return Err(ShimError::InvalidArgument(format!(
                "a terminal process needs a fifo for stdout, not {other:?}"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An exit waits until every tracked copy ended (its reader dropped, after the last bytes were written
    /// out), and gives up once nothing flowed for OUTPUT_STALL.
    #[tokio::test]
    async fn output_drain_waits_for_the_copies_or_a_stall() {
        let drain = OutputDrain::default();
        assert!(drain.drained().await, "nothing tracked: drained at once");

        let (mut process, pipe) = tokio::io::duplex(64);
        let mut reader = drain.track(pipe);
        let copy = tokio::spawn(async move {
            tokio::io::copy(&mut reader, &mut tokio::io::sink())
                .await
                .unwrap()
        });
        let exit = tokio::spawn({
            let drain = drain.clone();
            async move { drain.drained().await }
        });
        process.write_all(b"the tail").await.unwrap();
        tokio::task::yield_now().await;
        assert!(!exit.is_finished(), "drained while the copy runs");
        drop(process);
        assert!(exit.await.unwrap(), "the copy ended");
        assert_eq!(copy.await.unwrap(), 8);
        assert_eq!(drain.bytes(), 8);

        let (_unread, pipe) = tokio::io::duplex(64);
        let stalled = drain.track(pipe);
        let t0 = tokio::time::Instant::now();
        assert!(!drain.drained().await, "a stalled stream is given up");
        assert!(t0.elapsed() >= OUTPUT_STALL);
        drop(stalled);
        assert!(drain.drained().await);
    }

    #[test]
    fn output_uris() {
        assert_eq!(parse_output("").unwrap(), OutputTarget::Null);
        assert_eq!(
            parse_output("/run/fifo/out").unwrap(),
            OutputTarget::Fifo("/run/fifo/out".into())
        );
        assert_eq!(
            parse_output("file:///var/log/c%201.log").unwrap(),
            OutputTarget::File("/var/log/c 1.log".into())
        );
        assert_eq!(
            parse_output("binary:///usr/bin/logger?tag=web&verbose").unwrap(),
            OutputTarget::Binary {
                path: "/usr/bin/logger".into(),
                args: vec!["tag".into(), "web".into(), "verbose".into()]
            }
        );
        assert_eq!(
            parse_output("binary:///opt/log+ger%21?tag=a+b%26c&to=%2Fvar%2Flog").unwrap(),
            OutputTarget::Binary {
                path: "/opt/log+ger!".into(),
                args: vec!["tag".into(), "a b&c".into(), "to".into(), "/var/log".into()]
            }
        );
        assert!(parse_output("http://x/y").is_err());
        assert!(parse_output("file://relative").is_err());
    }
}
