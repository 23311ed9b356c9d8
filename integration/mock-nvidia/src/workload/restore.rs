//! The workload's "restore thread", like the one CUDA runs in every process: it serves the control socket
//! ([`super::control`]) and carries out `cuda-checkpoint`'s actions. running -> lock -> locked ->
//! checkpoint -> checkpointed -> restore -> locked -> unlock -> running. As on the real driver, the
//! checkpoint and the restore run in this thread of the parked process itself (the H200's checkpoint thread
//! was a thread of the parked process: /work/shared/gpu/580.159.04/park-program.jsonl.gz, pid 440 tid 462).
//! A checkpoint closes the OS-event fds, copies device memory into host memory of this process (time
//! proportional to the allocation, every page written: [`super::host_copy`]) and then parks the workload
//! ([`super::park`]); a restore resumes it, copies back, frees the host copy and verifies the weights. Each
//! transition prints a line on stdout.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::control::{self, Action, CudaState, NOT_INITIALIZED, Reply, Request};
use super::gate::{Gate, LockError};
use super::host_copy::HostCopy;
use super::weights::Weights;
use super::{Workload, say};

const MIB: usize = 1024 * 1024;

/// How the restore thread behaves.
#[derive(Debug, Clone)]
pub struct RestoreOptions {
    /// Video memory the workload allocates, in MiB (what a checkpoint copies).
    pub vram_mib: u64,
    /// Copy rate between "device" and host, in MiB/s (at least 1).
    pub copy_mib_per_s: u64,
    /// How long a lock takes before it can succeed.
    pub lock_delay: Duration,
    /// This action answers an injected failure and changes nothing.
    pub fail_at: Option<Action>,
    /// The injected failure happens once; the action then works.
    pub fail_once: bool,
    /// This action, the first time, answers a failure that tells the calling library to crash its process
    /// ([`super::control::CRASH_THE_CALLER`]), and changes nothing.
    pub crash_caller_at: Option<Action>,
    /// A restore request makes the process exit at once with this code.
    pub exit_at_restore: Option<i32>,
    /// An injected wedge: while [`hang_file`] exists, a request of this action is not answered (the restore
    /// thread waits, as a call wedged in the driver would), then it is carried out as usual.
    pub hang_at: Option<Action>,
    /// Seed of the weights.
    pub weights_seed: u32,
}

/// The bound control socket; the file is removed when this is dropped.
#[derive(Debug)]
pub struct ControlSocket {
    path: PathBuf,
    listener: Option<UnixListener>,
}

impl ControlSocket {
    /// Binds `/tmp/baton-mock-cuda/<own pid>.sock`, creating the folder. A socket left by a process that
    /// is gone is replaced; one that still answers (a process with the same pid in another pid namespace
    /// sharing this root filesystem) is left alone, and this fails with `AddrInUse`.
    pub fn bind() -> std::io::Result<Self> {
        Self::bind_for(std::process::id())
    }

    /// [`ControlSocket::bind`] for process `pid` of this pid namespace (a forked worker's socket, served
    /// by its parent).
    pub fn bind_for(pid: u32) -> std::io::Result<Self> {
        let path = control::socket_path(pid);
        std::fs::create_dir_all(control::SOCKET_DIR)?;
        let listener = match UnixListener::bind(&path) {
            Err(error) if error.kind() == std::io::ErrorKind::AddrInUse => {
                if UnixStream::connect(&path).is_ok() {
                    return Err(error);
                }
                std::fs::remove_file(&path)?;
                UnixListener::bind(&path)?
            }
            bound => bound?,
        };
        Ok(Self {
            path,
            listener: Some(listener),
        })
    }

    /// Where it is.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    /// Starts the restore thread on this socket.
    pub fn serve(
        &mut self,
        gate: Arc<Gate>,
        workload: Arc<Mutex<Workload>>,
        options: RestoreOptions,
    ) -> std::io::Result<()> {
        let listener = self
            .listener
            .take()
            .ok_or_else(|| std::io::Error::other("the control socket is already served"))?;
        let mut thread = RestoreThread {
            weights: Weights::new(options.weights_seed),
            gate,
            workload,
            options,
            socket: self.path.clone(),
            host: None,
        };
        std::thread::Builder::new()
            .name("restore".to_owned())
            .spawn(move || {
                for stream in listener.incoming().map_while(Result::ok) {
                    thread.answer(stream);
                }
            })?;
        Ok(())
    }

    /// Answers every request on this socket as the driver answers for a process with no CUDA state of its
    /// own: `CUDA_ERROR_NOT_INITIALIZED` ([`NOT_INITIALIZED`]), get-state included.
    pub fn serve_without_cuda(&mut self) -> std::io::Result<()> {
        let listener = self
            .listener
            .take()
            .ok_or_else(|| std::io::Error::other("the control socket is already served"))?;
        std::thread::Builder::new()
            .name("no-cuda".to_owned())
            .spawn(move || {
                for stream in listener.incoming().map_while(Result::ok) {
                    let mut line = String::new();
                    if BufReader::new(&stream).read_line(&mut line).is_err() {
                        continue;
                    }
                    let reply = Reply::Err(format!(
                        "{NOT_INITIALIZED} (initialization error): the process has no CUDA state of its \
                         own (forked after CUDA init)"
                    ));
                    let _ = (&stream).write_all(format!("{reply}\n").as_bytes());
                }
            })?;
        Ok(())
    }
}

impl Drop for ControlSocket {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

struct RestoreThread {
    gate: Arc<Gate>,
    workload: Arc<Mutex<Workload>>,
    weights: Weights,
    options: RestoreOptions,
    socket: PathBuf,
    /// The checkpoint's copy of device memory, from the checkpoint to the restore.
    host: Option<HostCopy>,
}

impl RestoreThread {
    /// Reads one request from `stream` and writes its reply (a client that went away is ignored).
    fn answer(&mut self, stream: UnixStream) {
        let mut line = String::new();
        if BufReader::new(&stream).read_line(&mut line).is_err() {
            return;
        }
        let reply = match Request::parse(line.trim_end()) {
            Ok(request) => match self.handle(request) {
                Ok(state) => Reply::Ok(state),
                Err(message) => Reply::Err(message),
            },
            Err(message) => Reply::Err(message),
        };
        let _ = (&stream).write_all(format!("{reply}\n").as_bytes());
    }

    fn handle(&mut self, request: Request) -> Result<CudaState, String> {
        let action = match request {
            Request::State => return Ok(self.gate.state()),
            Request::Lock { .. } => Action::Lock,
            Request::Other(action) => action,
        };
        if self.options.hang_at == Some(action) {
            hang_while_told(action);
        }
        let state = self.gate.state();
        let needs = needed_state(action);
        if state != needs {
            return Err(format!(
                "{action} needs a {needs} process; state is {state}"
            ));
        }
        if self.options.fail_at == Some(action) {
            if self.options.fail_once {
                self.options.fail_at = None;
            }
            return Err(format!("mock failure injected at {action}"));
        }
        if self.options.crash_caller_at == Some(action) {
            self.options.crash_caller_at = None;
            return Err(format!(
                "mock failure injected at {action}: {}",
                super::control::CRASH_THE_CALLER
            ));
        }
        match request {
            Request::Lock { timeout_ms } => self.lock(timeout_ms)?,
            Request::Other(Action::Checkpoint) => self.checkpoint()?,
            Request::Other(Action::Restore) => self.restore()?,
            _ => {
                self.gate.set_state(CudaState::Running);
                say("unlocked");
            }
        }
        Ok(self.gate.state())
    }

    fn lock(&mut self, timeout_ms: u64) -> Result<(), String> {
        let timeout = (timeout_ms > 0).then(|| Duration::from_millis(timeout_ms));
        match self.gate.lock(self.options.lock_delay, timeout) {
            Ok(()) => {
                say("locked");
                Ok(())
            }
            Err(LockError::TimedOut) => Err(format!("lock timed out after {timeout_ms} ms")),
            Err(LockError::NotRunning(state)) => {
                Err(format!("lock needs a running process; state is {state}"))
            }
        }
    }

    /// Closes the OS-event fds, copies device memory into host memory of this process, then parks (the
    /// GPU is released at the end of the copy). A host copy that cannot be allocated fails the checkpoint
    /// before anything changed.
    fn checkpoint(&mut self) -> Result<(), String> {
        let size = usize::try_from(self.options.vram_mib)
            .unwrap_or(usize::MAX)
            .saturating_mul(MIB);
        let mut host = HostCopy::allocate(size).map_err(|error| error.to_string())?;
        if let Err(error) = self.with_workload(Workload::park_os_events) {
            self.gate.set_state(CudaState::Failed);
            return Err(format!("closing the OS-event fds failed: {error}"));
        }
        self.copy("to host", |done| host.fill_to(done));
        self.weights.save_to_host();
        if let Err(error) = self.with_workload(Workload::park) {
            self.gate.set_state(CudaState::Failed);
            return Err(format!("releasing the GPU failed: {error}"));
        }
        self.host = Some(host);
        self.gate.set_state(CudaState::Checkpointed);
        say("checkpointed");
        Ok(())
    }

    /// Resumes the workload (files, objects, mappings back), copies device memory back from the host copy,
    /// frees it, and verifies the weights. A GPU without room for it leaves the process checkpointed, its
    /// host copy kept, so that a later restore can succeed (see [`Workload::resume`]).
    fn restore(&mut self) -> Result<(), String> {
        if let Some(code) = self.options.exit_at_restore {
            let _ = std::fs::remove_file(&self.socket);
            say(&format!("exiting with {code} at restore"));
            std::process::exit(code);
        }
        if let Err(error) = self.with_workload(Workload::resume) {
            if error.is_out_of_memory() {
                say(&format!(
                    "restore: out of GPU memory, still checkpointed: {error}"
                ));
                return Err(format!(
                    "re-acquiring the GPU failed: {error}; the process is still checkpointed"
                ));
            }
            self.gate.set_state(CudaState::Failed);
            return Err(format!("re-acquiring the GPU failed: {error}"));
        }
        let host = self.host.take();
        let mut intact = true;
        self.copy("back to the device", |done| {
            if done == usize::MAX {
                intact = host.as_ref().is_none_or(HostCopy::intact);
            }
        });
        drop(host);
        let checked = self.weights.restore_from_host();
        match checked {
            Ok(checksum) if intact => {
                self.gate.set_state(CudaState::Locked);
                say(&format!("restored checksum {checksum:#010x} intact"));
                Ok(())
            }
            Ok(_) => {
                self.gate.set_state(CudaState::Failed);
                let message = "the host copy of device memory changed while parked".to_owned();
                say(&message);
                Err(message)
            }
            Err(mismatch) => {
                self.gate.set_state(CudaState::Failed);
                say(&mismatch.to_string());
                Err(mismatch.to_string())
            }
        }
    }

    fn with_workload(
        &self,
        act: impl FnOnce(&mut Workload) -> Result<(), super::WorkloadError>,
    ) -> Result<(), super::WorkloadError> {
        act(&mut self.workload.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Copies the allocation `direction` at the configured rate, saying when half of it is done
    /// (`copying to host: 256 of 512 MiB`), so that a test can look at the process mid-copy. `work` is
    /// told how many bytes are done: half, then all (`usize::MAX`).
    fn copy(&self, direction: &str, mut work: impl FnMut(usize)) {
        let total = self.options.vram_mib;
        let half =
            Duration::from_secs_f64(total as f64 / self.options.copy_mib_per_s.max(1) as f64 / 2.0);
        let start = Instant::now();
        let half_bytes = usize::try_from(total / 2)
            .unwrap_or(usize::MAX)
            .saturating_mul(MIB);
        work(half_bytes);
        std::thread::sleep((start + half).saturating_duration_since(Instant::now()));
        say(&format!(
            "copying {direction}: {} of {total} MiB",
            total / 2
        ));
        work(usize::MAX);
        std::thread::sleep((start + 2 * half).saturating_duration_since(Instant::now()));
    }
}

/// The file that keeps a `hang_at` action waiting while it exists: beside the control socket,
/// `/tmp/baton-mock-cuda/<own pid>.hang` (a test creates it through `/proc/PID/root` for the one process it
/// wants wedged, and removes it to let that process answer).
pub fn hang_file(own_pid: u32) -> PathBuf {
    control::socket_path(own_pid).with_extension("hang")
}

/// Waits, unanswering, for as long as this process's [`hang_file`] exists.
fn hang_while_told(action: Action) {
    let file = hang_file(std::process::id());
    if !file.exists() {
        return;
    }
    say(&format!("hanging at {action}"));
    while file.exists() {
        std::thread::sleep(Duration::from_millis(10));
    }
    say(&format!("answering {action} at last"));
}

/// The state `action` starts from.
fn needed_state(action: Action) -> CudaState {
    match action {
        Action::Lock => CudaState::Running,
        Action::Checkpoint | Action::Unlock => CudaState::Locked,
        Action::Restore => CudaState::Checkpointed,
    }
}
