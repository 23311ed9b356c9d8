//! NVIDIA's `cuda-checkpoint`, run by the shim for each CUDA process of a container: `--action
//! lock|checkpoint|restore|unlock --pid P [--timeout MS]` and `--get-state --pid P`. The program comes only
//! from the node's options TOML (`cuda_checkpoint_path`) or the shim's PATH, never from an annotation.
//! Where the node's CUDA driver library has the same calls (`cuCheckpointProcess*`, drivers 570 and later),
//! they are made through the shim's driver helper instead ([`super::driver_api`]), with the program as the
//! fallback when the library cannot be used.
//!
//! It acts on the container's own processes only: each pid is checked to be in the container's cgroups (the
//! init's, read from /proc) right before cuda-checkpoint is run on it; a pid outside is refused, and
//! nothing is run on it.
use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use super::driver_api::{ApiError, DriverApi};
use crate::runtime::{self, ProgramError};

pub use baton_nvidia::cuda_checkpoint::Action;

/// What went wrong running cuda-checkpoint.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CudaError {
    /// The program is not there.
    #[error(
        "cuda-checkpoint not found at {path}: install NVIDIA's cuda-checkpoint on the node, or set \
         cuda_checkpoint_path in the runtime's options TOML"
    )]
    NotFound {
        /// Where it was looked for.
        path: PathBuf,
    },
    /// It ran and failed.
    #[error("cuda-checkpoint --action {action} --pid {pid} failed ({status}): {output}")]
    Failed {
        /// The action.
        action: &'static str,
        /// The process.
        pid: u32,
        /// Its exit status.
        status: String,
        /// What it printed.
        output: String,
    },
    /// It ran past `cuda_checkpoint_timeout` and was stopped.
    #[error(
        "cuda-checkpoint --action {action} --pid {pid} did not finish within {after:?} \
         (cuda_checkpoint_timeout): stopped it{output}"
    )]
    TimedOut {
        /// The action.
        action: &'static str,
        /// The process.
        pid: u32,
        /// The limit it ran past.
        after: Duration,
        /// What it had printed (": ..." or empty).
        output: String,
    },
    /// The pid is not a process of the container.
    #[error(
        "pid {pid} is not a process of container {container} ({why}): cuda-checkpoint is not run on it"
    )]
    NotInContainer {
        /// The process.
        pid: u32,
        /// The container's id.
        container: String,
        /// What /proc said.
        why: String,
    },
    /// A call through the CUDA driver API failed: the driver refused it.
    #[error("{call} of pid {pid} through the CUDA driver API ({library}) failed: {message}")]
    Api {
        /// The driver call.
        call: &'static str,
        /// The process.
        pid: u32,
        /// The library.
        library: String,
        /// The driver's `CUresult`, when the helper gave one.
        code: Option<u32>,
        /// The driver's error name and description, or why the library cannot be used.
        message: String,
    },
    /// A call through the CUDA driver API got no answer: it ran past `cuda_checkpoint_timeout`, or the helper
    /// died under it. Whether it did its work is known only by asking the process's state.
    #[error("{call} of pid {pid} through the CUDA driver API ({library}) failed: {message}")]
    Unanswered {
        /// The driver call.
        call: &'static str,
        /// The process.
        pid: u32,
        /// The library.
        library: String,
        /// What happened to the helper.
        message: String,
    },
    /// It could not be run.
    #[error("cannot run {path}: {message}")]
    Spawn {
        /// The program.
        path: PathBuf,
        /// Why.
        message: String,
    },
}

impl CudaError {
    /// The process the error concerns, if one.
    pub fn pid(&self) -> Option<u32> {
        match self {
            CudaError::Failed { pid, .. }
            | CudaError::Api { pid, .. }
            | CudaError::Unanswered { pid, .. }
            | CudaError::TimedOut { pid, .. }
            | CudaError::NotInContainer { pid, .. } => Some(*pid),
            _ => None,
        }
    }

    /// Whether the call may have done its work or not (it was stopped, or its helper died under it): the
    /// process's state tells.
    pub fn outcome_unknown(&self) -> bool {
        matches!(
            self,
            CudaError::TimedOut { .. } | CudaError::Unanswered { .. }
        )
    }

    /// For a get-state: whether the driver says the process has no CUDA state (see [`no_cuda_state`]); the
    /// driver's word for it.
    pub fn no_cuda_state(&self) -> Option<&'static str> {
        match self {
            CudaError::Api {
                code: Some(code), ..
            } => no_cuda_state(*code),
            CudaError::Failed { output, .. } => program_says_no_cuda_state(output),
            _ => None,
        }
    }
}

/// Whether a get-state refused with `code` means that the process has no CUDA state to lock or checkpoint;
/// the code's name if so.
///
/// - `CUDA_ERROR_NOT_INITIALIZED`: what the driver answers for a child forked after CUDA init (a DataLoader
///   worker), which inherited the parent's NVIDIA files but has no CUDA state of its own
///   (recorded on an H200 with driver 580.159.04: shared/gpu/580.159.04/README.md, point 5; get-state and
///   lock both answer it).
/// - `CUDA_ERROR_INVALID_VALUE`: the driver knows no CUDA process behind the pid. The arguments are valid
///   (the pid is in range and was just checked to be a live process of the container, the state pointer is
///   the helper's), so that is the one thing left for it to mean: a process that never initialised CUDA (an
///   NVML-only tool, a process that only opened a device file). Such a process cannot be locked or
///   checkpointed either (the lock answers the same), so passing it on would fail every park of its
///   container for a process that holds no CUDA state. No recording has this case yet: the fake libcuda
///   answers it for any pid without a restore thread.
pub fn no_cuda_state(code: u32) -> Option<&'static str> {
    use baton_nvidia::cuda_checkpoint::driver_api::{
        CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_INITIALIZED,
    };
    match code {
        CUDA_ERROR_NOT_INITIALIZED => Some("CUDA_ERROR_NOT_INITIALIZED"),
        CUDA_ERROR_INVALID_VALUE => Some("CUDA_ERROR_INVALID_VALUE"),
        _ => None,
    }
}

/// [`no_cuda_state`] from what the `cuda-checkpoint` program printed: the code's name, or the driver's
/// description of it in quotes as the program prints it (`Could not ... process ID N: "invalid argument"`).
/// Its own failure to initialise CUDA (`Error initializing CUDA: ...`) is no answer about the process.
fn program_says_no_cuda_state(output: &str) -> Option<&'static str> {
    if output.contains("Error initializing CUDA") {
        return None;
    }
    if output.contains("CUDA_ERROR_NOT_INITIALIZED") || output.contains("\"initialization error\"")
    {
        Some("CUDA_ERROR_NOT_INITIALIZED")
    } else if output.contains("CUDA_ERROR_INVALID_VALUE") || output.contains("\"invalid argument\"")
    {
        Some("CUDA_ERROR_INVALID_VALUE")
    } else {
        None
    }
}

/// The cuda-checkpoint program of a container (or the driver API), and the container whose processes it may act
/// on.
#[derive(Clone, Debug)]
pub struct CudaCheckpoint {
    /// The program, or where it was looked for when it is not there (`found`).
    path: PathBuf,
    found: bool,
    /// The driver API, where the node's library can be used.
    api: Option<Arc<DriverApi>>,
    /// How long one run may take before it is stopped.
    limit: Option<Duration>,
    scope: Option<Scope>,
}

/// A container's processes: those in the cgroups of its init.
#[derive(Clone, Debug)]
struct Scope {
    container: String,
    init: u32,
}

impl Scope {
    /// Whether `pid` is in every cgroup of the container's init (that cgroup or one below it, in each
    /// hierarchy where the init is not at the root), read from /proc now.
    fn check(&self, pid: u32) -> Result<(), CudaError> {
        let refuse = |why: String| CudaError::NotInContainer {
            pid,
            container: self.container.clone(),
            why,
        };
        let init = baton_cgroups::of_pid(self.init).ok_or_else(|| {
            refuse(format!(
                "the cgroups of its init, pid {}, cannot be read",
                self.init
            ))
        })?;
        let mine =
            baton_cgroups::of_pid(pid).ok_or_else(|| refuse("no such process".to_owned()))?;
        let own: Vec<_> = init.iter().filter(|c| c.pathname != "/").collect();
        if own.is_empty() {
            return Err(refuse(
                "its init is in the root cgroups, which tell no container apart".to_owned(),
            ));
        }
        for c in own {
            let theirs = mine.iter().find(|m| m.hierarchy == c.hierarchy);
            let inside = theirs.is_some_and(|m| is_at_or_below(&m.pathname, &c.pathname));
            if !inside {
                let at = theirs.map_or("none", |m| m.pathname.as_str());
                return Err(refuse(format!(
                    "it is in cgroup {at}, not under the container's {}",
                    c.pathname
                )));
            }
        }
        Ok(())
    }
}

/// The driver call a NUL-terminated symbol names.
fn api_call_name(symbol: &'static [u8]) -> &'static str {
    std::str::from_utf8(symbol.strip_suffix(b"\0").unwrap_or(symbol))
        .unwrap_or("cuCheckpointProcess")
}

/// Whether cgroup path `path` is `top` or below it.
fn is_at_or_below(path: &str, top: &str) -> bool {
    let (path, top) = (path.trim_end_matches('/'), top.trim_end_matches('/'));
    path == top || path.strip_prefix(top).is_some_and(|r| r.starts_with('/'))
}

impl CudaCheckpoint {
    /// The program at `configured` (a bare name is looked up on the shim's PATH).
    pub fn find(configured: &Path) -> Result<Self, CudaError> {
        let found = if configured.components().count() > 1 {
            Some(configured.to_path_buf()).filter(|p| p.is_file())
        } else {
            std::env::var_os("PATH").and_then(|path| {
                std::env::split_paths(&path)
                    .map(|d| d.join(configured))
                    .find(|p| p.is_file())
            })
        };
        found
            .map(|path| Self {
                path,
                found: true,
                api: None,
                limit: None,
                scope: None,
            })
            .ok_or(CudaError::NotFound {
                path: configured.to_path_buf(),
            })
    }

    /// The driver API of `api` where its library can be used (the program at `configured`, if there, stays the
    /// fallback), else the program as [`Self::find`] finds it.
    pub async fn choose(configured: &Path, api: Option<Arc<DriverApi>>) -> Result<Self, CudaError> {
        let program = Self::find(configured);
        let Some(api) = api else { return program };
        if api.available().await.is_err() {
            return program;
        }
        Ok(match program {
            Ok(p) => Self {
                api: Some(api),
                ..p
            },
            Err(_) => Self {
                path: configured.to_path_buf(),
                found: false,
                api: Some(api),
                limit: None,
                scope: None,
            },
        })
    }

    /// Whether calls go through the driver API (the library to say so in logs).
    pub fn driver_api(&self) -> Option<&str> {
        self.api.as_deref().map(DriverApi::library)
    }

    /// `action` through the driver API, if there is one that can be used: `None` means run the program.
    async fn through_api(
        &self,
        action: &str,
        call: &'static str,
        pid: u32,
        lock_timeout: Option<Duration>,
    ) -> Option<Result<Option<String>, CudaError>> {
        let api = self.api.as_ref()?;
        let library = api.library().to_owned();
        let unanswered = |message: String| CudaError::Unanswered {
            call,
            pid,
            library: library.clone(),
            message,
        };
        let refused = |code: Option<u32>, message: String| CudaError::Api {
            call,
            pid,
            library: library.clone(),
            code,
            message,
        };
        match api.call(action, pid, lock_timeout, self.limit).await {
            Ok(state) => Some(Ok(state)),
            Err(ApiError::Unavailable(_)) if self.found => None,
            Err(ApiError::Unavailable(why)) => Some(Err(refused(None, why))),
            Err(ApiError::Driver { code, message }) => Some(Err(refused(code, message))),
            Err(ApiError::HelperDied(e)) => Some(Err(unanswered(e))),
            Err(ApiError::TimedOut(after)) => Some(Err(unanswered(format!(
                "no answer within {after:?} (cuda_checkpoint_timeout): the call was given up and its \
                 helper retired"
            )))),
        }
    }

    /// The same program, each run stopped (and failed) after `limit`: a wedged process, or one frozen
    /// meanwhile, never holds a preemption for good.
    pub fn within(self, limit: Duration) -> Self {
        Self {
            limit: Some(limit),
            ..self
        }
    }

    /// The same program, acting only on processes of container `container` (id), whose init is `init`.
    pub fn confined_to(self, container: &str, init: u32) -> Self {
        Self {
            scope: Some(Scope {
                container: container.to_owned(),
                init,
            }),
            ..self
        }
    }

    /// Refuses `pid` when it is not a process of the container this program is confined to.
    fn check(&self, pid: u32) -> Result<(), CudaError> {
        self.scope.as_ref().map_or(Ok(()), |s| s.check(pid))
    }

    /// Runs `--action ACTION --pid PID` (`--timeout MS` for a lock with a timeout).
    pub async fn run(
        &self,
        action: Action,
        pid: u32,
        timeout: Option<Duration>,
    ) -> Result<(), CudaError> {
        self.check(pid)?;
        let lock_timeout = timeout.filter(|_| action == Action::Lock);
        let call = api_call_name(baton_nvidia::cuda_checkpoint::driver_api::symbol(action));
        if let Some(done) = self
            .through_api(action.name(), call, pid, lock_timeout)
            .await
        {
            return done.map(|_| ());
        }
        let mut args = vec![
            "--action".to_owned(),
            action.name().to_owned(),
            "--pid".to_owned(),
            pid.to_string(),
        ];
        if let (Action::Lock, Some(t)) = (action, timeout) {
            args.push("--timeout".to_owned());
            args.push(t.as_millis().to_string());
        }
        let (status, stdout, stderr) = self.exec(action.name(), pid, &args).await?;
        if status.success() {
            return Ok(());
        }
        Err(CudaError::Failed {
            action: action.name(),
            pid,
            status: status.to_string(),
            output: format!("{}{}", stdout.trim(), stderr.trim()),
        })
    }

    /// `--get-state --pid PID`: `running`, `locked`, `checkpointed` or `failed`.
    pub async fn state(&self, pid: u32) -> Result<String, CudaError> {
        self.check(pid)?;
        let call = api_call_name(baton_nvidia::cuda_checkpoint::driver_api::GET_STATE);
        if let Some(done) = self.through_api("get-state", call, pid, None).await {
            return done.map(Option::unwrap_or_default);
        }
        let args = [
            "--get-state".to_owned(),
            "--pid".to_owned(),
            pid.to_string(),
        ];
        let (status, stdout, stderr) = self.exec("get-state", pid, &args).await?;
        if status.success() {
            return Ok(stdout.trim().to_owned());
        }
        Err(CudaError::Failed {
            action: "get-state",
            pid,
            status: status.to_string(),
            output: format!("{}{}", stdout.trim(), stderr.trim()),
        })
    }

    async fn exec(
        &self,
        action: &'static str,
        pid: u32,
        args: &[String],
    ) -> Result<(std::process::ExitStatus, String, String), CudaError> {
        if !self.found {
            return Err(CudaError::NotFound {
                path: self.path.clone(),
            });
        }
        runtime::run_program(&self.path, args, self.limit)
            .await
            .map_err(|e| match e {
                ProgramError::Spawn(message) => CudaError::Spawn {
                    path: self.path.clone(),
                    message,
                },
                ProgramError::TimedOut { output } => CudaError::TimedOut {
                    action,
                    pid,
                    after: self.limit.unwrap_or_default(),
                    output: if output.is_empty() {
                        String::new()
                    } else {
                        format!(": {output}")
                    },
                },
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_program_says_where_it_was_looked_for() {
        let err = CudaCheckpoint::find(Path::new("/nonexistent/cuda-checkpoint")).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("/nonexistent/cuda-checkpoint"), "{text}");
        assert!(text.contains("cuda_checkpoint_path"), "{text}");
        assert!(CudaCheckpoint::find(Path::new("no-such-program-baton")).is_err());
        assert!(CudaCheckpoint::find(Path::new("sh")).is_ok());
    }

    /// The driver's "no CUDA state" answers, by code through the helper and by what the program prints; any
    /// other failure, and the program's failure to initialise CUDA itself, is no such answer.
    #[test]
    fn only_not_initialized_and_invalid_value_mean_no_cuda_state() {
        use baton_nvidia::cuda_checkpoint::driver_api as cu;
        let api = |code| CudaError::Api {
            call: "cuCheckpointProcessGetState",
            pid: 7,
            library: "libcuda.so.1".into(),
            code,
            message: String::new(),
        };
        assert_eq!(
            api(Some(cu::CUDA_ERROR_NOT_INITIALIZED)).no_cuda_state(),
            Some("CUDA_ERROR_NOT_INITIALIZED")
        );
        assert_eq!(
            api(Some(cu::CUDA_ERROR_INVALID_VALUE)).no_cuda_state(),
            Some("CUDA_ERROR_INVALID_VALUE")
        );
        for code in [
            Some(cu::CUDA_ERROR_ILLEGAL_STATE),
            Some(cu::CUDA_ERROR_NOT_SUPPORTED),
            Some(cu::CUDA_ERROR_UNKNOWN),
            None,
        ] {
            assert_eq!(api(code).no_cuda_state(), None, "{code:?}");
        }
        let program = |output: &str| CudaError::Failed {
            action: "get-state",
            pid: 7,
            status: "exit status: 1".into(),
            output: output.into(),
        };
        assert_eq!(
            program("Could not get state of process ID 7: \"initialization error\"")
                .no_cuda_state(),
            Some("CUDA_ERROR_NOT_INITIALIZED")
        );
        assert_eq!(
            program("get-state of pid 7 failed: CUDA_ERROR_INVALID_VALUE").no_cuda_state(),
            Some("CUDA_ERROR_INVALID_VALUE")
        );
        let own_init = "Error initializing CUDA: \"initialization error\"";
        assert_eq!(program(own_init).no_cuda_state(), None);
        assert_eq!(
            program("talking to pid 7: connection refused").no_cuda_state(),
            None
        );
        let unanswered = CudaError::Unanswered {
            call: "cuCheckpointProcessGetState",
            pid: 7,
            library: "libcuda.so.1".into(),
            message: "the CUDA driver helper (pid 9) died".into(),
        };
        assert!(unanswered.outcome_unknown() && unanswered.no_cuda_state().is_none());
        assert!(!api(Some(cu::CUDA_ERROR_TIMEOUT)).outcome_unknown());
    }

    #[test]
    fn cgroup_paths_below_the_containers_are_in_it_and_lookalikes_are_not() {
        assert!(is_at_or_below("/pods/c1", "/pods/c1"));
        assert!(is_at_or_below("/pods/c1/sub", "/pods/c1/"));
        assert!(!is_at_or_below("/pods/c10", "/pods/c1"));
        assert!(!is_at_or_below("/pods", "/pods/c1"));
    }

    #[test]
    fn a_process_outside_the_container_is_refused_before_anything_runs() {
        // This test's process is the "init": a process in its cgroups is in, pid 1 (at the root on a
        // machine where the test runs in a cgroup of its own) or a process gone is not.
        let me = std::process::id();
        let cuda = CudaCheckpoint::find(Path::new("sh"))
            .unwrap()
            .confined_to("c1", me);
        let own = baton_cgroups::of_pid(me).unwrap();
        if own.iter().all(|c| c.pathname == "/") {
            let e = cuda.check(me).unwrap_err().to_string();
            assert!(e.contains("root cgroups"), "{e}");
            return;
        }
        cuda.check(me).unwrap();
        let e = cuda.check(u32::MAX).unwrap_err().to_string();
        assert!(
            e.contains(&format!("pid {}", u32::MAX)) && e.contains("container c1"),
            "{e}"
        );
    }
}
