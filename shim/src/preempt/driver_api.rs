//! The shim's side of the CUDA driver helper (`crate::cuda_helper`): one helper per shim and library, started
//! at the first checkpoint call and kept for the shim's life, so that the driver library is loaded and
//! initialised once, not once per call as with the `cuda-checkpoint` program. Calls run at once (each on a
//! thread of the helper), and each is bounded on its own by `cuda_checkpoint_timeout`: past it, that call fails
//! and the helper is retired (a call wedged in the driver may hold the library's locks): the next calls go to
//! a fresh helper, the retired one's other calls go on to their own answers or deadlines, and it is killed
//! once none is left, so one slow process never fails the calls of the others. A helper that dies fails the
//! calls in flight, with what it printed, and is started again at the next call. A call that got no answer
//! (timed out, or its helper died) may have done its work or not: the caller asks the process's state
//! (`super::rollback`). A library that cannot be used (not there, a driver before 570, `cuInit` failing) is
//! remembered, and the shim runs the program instead.

use std::{
    collections::HashMap,
    process::Stdio,
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::Duration,
};

use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader},
    process::{ChildStdin, Command},
    sync::oneshot,
};

use baton_agent_api::driver_helper::{Answer, Call, HELPER_ARG, Ready};

use crate::reaper;

/// The shim's own program, whatever its path became.
const SELF_EXE: &str = "/proc/self/exe";

/// How long a helper may take to load the library and initialise it.
const START_LIMIT: Duration = Duration::from_secs(60);
/// How much of what a dead helper printed on stderr the error keeps.
const STDERR_TAIL: usize = 2048;

/// Why a call through the driver API did not give an answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ApiError {
    /// The library cannot be used here: run the program.
    Unavailable(String),
    /// The driver refused.
    Driver {
        /// Its `CUresult`, when the helper gave one.
        code: Option<u32>,
        /// Its error name and description.
        message: String,
    },
    /// The call ran past its limit; the helper was retired.
    TimedOut(Duration),
    /// The helper died during the call.
    HelperDied(String),
}

/// A running helper.
struct Helper {
    pid: u32,
    /// Signals it without a pid that could be reused once the shim's reaper reaped it.
    pidfd: Option<std::os::fd::OwnedFd>,
    stdin: tokio::sync::Mutex<ChildStdin>,
    waiting: Mutex<HashMap<u64, oneshot::Sender<Answer>>>,
    gone: AtomicBool,
    /// Given no new calls (one of its calls ran past its limit); killed once it has none left.
    retired: AtomicBool,
    stderr: Arc<Mutex<String>>,
    _child: tokio::process::Child,
}

impl Helper {
    fn kill(&self) {
        self.gone.store(true, Ordering::SeqCst);
        if let Some(pidfd) = &self.pidfd {
            let _ = rustix::process::pidfd_send_signal(pidfd, rustix::process::Signal::KILL);
        }
    }

    /// Whether new calls may go to it.
    fn usable(&self) -> bool {
        !self.gone.load(Ordering::SeqCst) && !self.retired.load(Ordering::SeqCst)
    }

    /// Registers call `id`'s answer channel; gives it back when the helper was retired meanwhile (checked
    /// under the same lock as [`Self::kill_if_idle`], so a retired helper is never killed under a new call).
    fn enlist(&self, id: u64, tx: oneshot::Sender<Answer>) -> Result<(), oneshot::Sender<Answer>> {
        let mut waiting = self.waiting.lock().unwrap_or_else(PoisonError::into_inner);
        if self.retired.load(Ordering::SeqCst) {
            return Err(tx);
        }
        waiting.insert(id, tx);
        Ok(())
    }

    /// Call `id` ran past its limit: it is given up, and the helper gets no new calls.
    fn give_up(&self, id: u64) {
        self.retired.store(true, Ordering::SeqCst);
        self.waiting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&id);
        self.kill_if_idle();
    }

    /// Kills a retired helper that has no call left (its wedged threads die with it).
    fn kill_if_idle(&self) {
        let waiting = self.waiting.lock().unwrap_or_else(PoisonError::into_inner);
        if self.retired.load(Ordering::SeqCst) && waiting.is_empty() {
            self.kill();
        }
    }

    fn died(&self) -> String {
        let tail = self
            .stderr
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .trim()
            .to_owned();
        if tail.is_empty() {
            format!("the CUDA driver helper (pid {}) died", self.pid)
        } else {
            format!("the CUDA driver helper (pid {}) died: {tail}", self.pid)
        }
    }
}

enum State {
    NotStarted,
    Running(Arc<Helper>),
    Unavailable(String),
}

/// The driver API of one library, through its helper.
pub struct DriverApi {
    library: String,
    state: tokio::sync::Mutex<State>,
    next_id: AtomicU64,
}

impl std::fmt::Debug for DriverApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DriverApi")
            .field("library", &self.library)
            .finish_non_exhaustive()
    }
}

/// The helpers of this shim, one per library.
static HELPERS: std::sync::LazyLock<Mutex<HashMap<String, Arc<DriverApi>>>> =
    std::sync::LazyLock::new(Default::default);

impl DriverApi {
    /// The driver API of `library` (a path, or a name for the dynamic loader), shared by the shim's containers.
    pub fn of(library: &str) -> Arc<Self> {
        HELPERS
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(library.to_owned())
            .or_insert_with(|| {
                Arc::new(Self {
                    library: library.to_owned(),
                    state: tokio::sync::Mutex::new(State::NotStarted),
                    next_id: AtomicU64::new(1),
                })
            })
            .clone()
    }

    /// The library this API loads.
    pub fn library(&self) -> &str {
        &self.library
    }

    /// Whether the library can be used (starts the helper if none runs); why not, if not.
    pub async fn available(&self) -> Result<(), String> {
        match self.helper().await {
            Ok(_) => Ok(()),
            Err(ApiError::Unavailable(why)) => Err(why),
            // A helper that died at start is tried again at the next call.
            Err(e) => Err(format!("{e:?}")),
        }
    }

    /// The running helper, started if there is none (or the last one died).
    async fn helper(&self) -> Result<Arc<Helper>, ApiError> {
        let mut state = self.state.lock().await;
        match &*state {
            State::Running(h) if h.usable() => return Ok(h.clone()),
            State::Unavailable(why) => return Err(ApiError::Unavailable(why.clone())),
            _ => {}
        }
        match self.start().await {
            Ok(h) => {
                *state = State::Running(h.clone());
                Ok(h)
            }
            Err(ApiError::Unavailable(why)) => {
                tracing::info!(library = %self.library, "the CUDA driver API cannot be used ({why}): checkpoints run the cuda-checkpoint program");
                *state = State::Unavailable(why.clone());
                Err(ApiError::Unavailable(why))
            }
            Err(e) => {
                *state = State::NotStarted;
                Err(e)
            }
        }
    }

    async fn start(&self) -> Result<Arc<Helper>, ApiError> {
        // The shim's own program as the kernel has it: `baton install` may have replaced the file since the
        // shim started (its path then reads "... (deleted)"), and the helper must be this shim's.
        let mut child = Command::new(SELF_EXE)
            .arg(HELPER_ARG)
            .arg(&self.library)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| ApiError::Unavailable(format!("cannot start the helper: {e}")))?;
        let pid = child.id().unwrap_or_default();
        // Its exit is not a task's: the reaper reaps it and routes it nowhere.
        reaper::register_command(pid as i32);
        let pidfd = rustix::process::Pid::from_raw(pid as i32).and_then(|p| {
            rustix::process::pidfd_open(p, rustix::process::PidfdFlags::empty()).ok()
        });
        let (Some(stdin), Some(stdout), Some(mut stderr)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            return Err(ApiError::Unavailable("the helper has no pipes".to_owned()));
        };
        let tail = Arc::new(Mutex::new(String::new()));
        let stderr_read = tokio::spawn({
            let tail = tail.clone();
            async move {
                let mut buf = [0u8; 1024];
                while let Ok(n) = stderr.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    let mut t = tail.lock().unwrap_or_else(PoisonError::into_inner);
                    t.push_str(&String::from_utf8_lossy(&buf[..n]));
                    if t.len() > STDERR_TAIL {
                        let cut = t.len() - STDERR_TAIL;
                        let cut = (cut..t.len()).find(|&i| t.is_char_boundary(i)).unwrap_or(0);
                        t.drain(..cut);
                    }
                }
            }
        });
        let mut lines = BufReader::new(stdout).lines();
        let first = tokio::time::timeout(START_LIMIT, lines.next_line()).await;
        let ready: Ready = match first {
            Ok(Ok(Some(line))) => serde_json::from_str(&line).map_err(|e| {
                ApiError::Unavailable(format!("the helper's first line is not JSON ({e})"))
            })?,
            Ok(_) => {
                // What it printed before it died (its stderr ends with it).
                let _ = tokio::time::timeout(Duration::from_secs(1), stderr_read).await;
                let said = tail.lock().unwrap_or_else(PoisonError::into_inner).clone();
                return Err(ApiError::HelperDied(format!(
                    "the CUDA driver helper died while loading {}: {}",
                    self.library,
                    said.trim()
                )));
            }
            Err(_) => {
                if let Some(pidfd) = &pidfd {
                    let _ =
                        rustix::process::pidfd_send_signal(pidfd, rustix::process::Signal::KILL);
                }
                return Err(ApiError::Unavailable(format!(
                    "loading {} and cuInit took over {START_LIMIT:?}",
                    self.library
                )));
            }
        };
        if let Some(why) = ready.unavailable {
            return Err(ApiError::Unavailable(why));
        }
        tracing::info!(
            library = %self.library,
            loaded = ready.library.as_deref().unwrap_or("?"),
            "the CUDA driver helper loaded {}",
            ready.library.as_deref().unwrap_or(&self.library)
        );
        let helper = Arc::new(Helper {
            pid,
            pidfd,
            stdin: tokio::sync::Mutex::new(stdin),
            waiting: Mutex::new(HashMap::new()),
            gone: AtomicBool::new(false),
            retired: AtomicBool::new(false),
            stderr: tail,
            _child: child,
        });
        tokio::spawn(dispatch_answers(helper.clone(), lines));
        Ok(helper)
    }

    /// Runs `action` (`lock`, `checkpoint`, `restore`, `unlock`, `get-state`) on `pid`; the state for a
    /// `get-state`. Past `limit` the call fails and its helper is retired (see the module comment).
    pub async fn call(
        &self,
        action: &str,
        pid: u32,
        lock_timeout: Option<Duration>,
        limit: Option<Duration>,
    ) -> Result<Option<String>, ApiError> {
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        let (mut tx, rx) = oneshot::channel();
        let helper = loop {
            let helper = self.helper().await?;
            match helper.enlist(id, tx) {
                Ok(()) => break helper,
                // Retired between the two: the next helper() starts a fresh one.
                Err(back) => tx = back,
            }
        };
        let call = Call {
            id,
            action: action.to_owned(),
            pid,
            lock_timeout_ms: lock_timeout
                .map_or(0, |t| u32::try_from(t.as_millis()).unwrap_or(u32::MAX)),
        };
        let mut line = serde_json::to_vec(&call).unwrap_or_default();
        line.push(b'\n');
        let sent = {
            let mut stdin = helper.stdin.lock().await;
            stdin.write_all(&line).await.and(stdin.flush().await)
        };
        if sent.is_err() {
            helper.kill();
            return Err(ApiError::HelperDied(helper.died()));
        }
        let answer = match limit {
            Some(limit) => match tokio::time::timeout(limit, rx).await {
                Ok(a) => a,
                Err(_) => {
                    helper.give_up(id);
                    return Err(ApiError::TimedOut(limit));
                }
            },
            None => rx.await,
        };
        let answer = answer.map_err(|_| ApiError::HelperDied(helper.died()))?;
        match answer.error {
            Some(message) => Err(ApiError::Driver {
                code: answer.code,
                message,
            }),
            None => Ok(answer.state),
        }
    }
}

/// Hands each answer to its caller; when the helper's output ends (it died, or was killed), fails the calls
/// still waiting and lets the next call start another.
async fn dispatch_answers(
    helper: Arc<Helper>,
    mut lines: tokio::io::Lines<BufReader<tokio::process::ChildStdout>>,
) {
    while let Ok(Some(line)) = lines.next_line().await {
        match serde_json::from_str::<Answer>(&line) {
            Ok(answer) => {
                let waiter = helper
                    .waiting
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .remove(&answer.id);
                if let Some(tx) = waiter {
                    let _ = tx.send(answer);
                }
                helper.kill_if_idle();
            }
            Err(e) => tracing::warn!(
                pid = helper.pid,
                "the CUDA driver helper wrote a line that is not an answer ({e}): {line}"
            ),
        }
    }
    helper.gone.store(true, Ordering::SeqCst);
    // Dropping the senders fails the calls still waiting.
    let left = {
        let mut waiting = helper
            .waiting
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let left = waiting.len();
        waiting.clear();
        left
    };
    if helper.retired.load(Ordering::SeqCst) && left == 0 {
        tracing::info!(
            pid = helper.pid,
            "stopped a CUDA driver helper retired after a call ran past its limit"
        );
    } else {
        tracing::warn!(pid = helper.pid, "{}", helper.died());
    }
}
