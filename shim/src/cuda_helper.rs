//! The CUDA driver helper: the shim's own binary, run as `containerd-shim-baton-v1 cuda-driver-helper LIBRARY`
//! by the shim (`crate::preempt::driver_api`), which loads the node's `libcuda.so.1` once, calls `cuInit` once,
//! and then makes the checkpoint calls (`cuCheckpointProcess*`) the shim asks for, each on a thread of its own,
//! for as long as the shim lives. A separate process, so that a crash inside the vendor library takes down
//! only the helper (the shim reports it and starts another), and one that runs in the shim's cgroup, never in
//! a container's, so the agent never counts it as a holder of a container's GPU.
//!
//! The protocol is `baton_agent_api::driver_helper`'s (its one definition, shared with `tools/gpu-check`).
//! The end of its stdin ends the helper; it dies with the shim (`PR_SET_PDEATHSIG`).

use std::{
    ffi::{CStr, OsStr, c_char, c_int, c_uint, c_void},
    io::{BufRead, Write},
    path::PathBuf,
    sync::{Arc, Mutex, PoisonError},
};

use crate::driver_library;

use baton_agent_api::driver_helper::{Answer, Call, HELPER_ARG, Ready};
use baton_nvidia::cuda_checkpoint::{
    Action,
    driver_api::{self as cu, CuResult, LockArgs, ReservedArgs, RestoreArgs},
};

type InitFn = unsafe extern "C" fn(c_uint) -> CuResult;
type ActionFn = unsafe extern "C" fn(c_int, *const c_void) -> CuResult;
type GetStateFn = unsafe extern "C" fn(c_int, *mut c_uint) -> CuResult;
type ErrorTextFn = unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult;

/// The loaded library's checkpoint entry points.
struct DriverLibrary {
    /// Kept loaded for the symbols below.
    _library: libloading::Library,
    actions: [(Action, ActionFn); 4],
    get_state: GetStateFn,
    error_name: Option<ErrorTextFn>,
    error_string: Option<ErrorTextFn>,
}

impl DriverLibrary {
    /// Loads `path` (a bare name through the dynamic loader's search, then the known folders: see
    /// [`crate::driver_library`]), checks its version against the kernel module's, finds the calls and runs
    /// `cuInit(0)`. Also returns the file it loaded.
    fn load(path: &OsStr) -> Result<(Self, PathBuf), String> {
        let shown = path.to_string_lossy();
        let mut failures = Vec::new();
        let mut loaded = None;
        for candidate in driver_library::candidates(path, &driver_library::DRIVER_DIRS) {
            // SAFETY: loading runs the library's initialisers; the library is the node's CUDA driver library,
            // named by the node's administrator (never by a container), or the file of that name in a folder
            // where the driver's installs put it, which is what it is there for.
            match unsafe { libloading::Library::new(&candidate) } {
                Ok(l) => {
                    loaded = Some((l, candidate));
                    break;
                }
                Err(e) => failures.push(format!("{}: {e}", candidate.display())),
            }
        }
        let Some((library, candidate)) = loaded else {
            return Err(format!(
                "cannot load {shown} (looked in the loader's path and {}): {}",
                driver_library::DRIVER_DIRS.join(", "),
                failures.join("; ")
            ));
        };
        let symbol = |name: &[u8]| {
            String::from_utf8_lossy(name.strip_suffix(b"\0").unwrap_or(name)).into_owned()
        };
        let get = |name: &[u8]| {
            // SAFETY: the checkpoint calls have the C signature `ActionFn` names (NVIDIA's cuda.h, CUDA 12.8);
            // the library stays loaded in `_library` for as long as the pointers are used.
            unsafe { library.get::<ActionFn>(name) }
                .map(|s| *s)
                .map_err(|_| format!("{shown} has no {} (a driver before 570)", symbol(name)))
        };
        let actions = [
            (Action::Lock, get(cu::symbol(Action::Lock))?),
            (Action::Checkpoint, get(cu::symbol(Action::Checkpoint))?),
            (Action::Restore, get(cu::symbol(Action::Restore))?),
            (Action::Unlock, get(cu::symbol(Action::Unlock))?),
        ];
        // SAFETY: cuInit, cuCheckpointProcessGetState, cuGetErrorName and cuGetErrorString have the C signatures
        // the types name (cuda.h); the library stays loaded in `_library` for as long as the pointers are used.
        let (init, get_state, error_name, error_string) = unsafe {
            (
                *library
                    .get::<InitFn>(cu::CU_INIT)
                    .map_err(|_| format!("{shown} has no cuInit: not a CUDA driver library"))?,
                *library
                    .get::<GetStateFn>(cu::GET_STATE)
                    .map_err(|_| format!("{shown} has no {}", symbol(cu::GET_STATE)))?,
                library
                    .get::<ErrorTextFn>(cu::GET_ERROR_NAME)
                    .ok()
                    .map(|s| *s),
                library
                    .get::<ErrorTextFn>(cu::GET_ERROR_STRING)
                    .ok()
                    .map(|s| *s),
            )
        };
        let file = loaded_file(init as *const c_void).unwrap_or(candidate);
        let kernel = std::fs::read_to_string(driver_library::KERNEL_VERSION_FILE)
            .ok()
            .and_then(|t| driver_library::kernel_version(&t));
        let user = driver_library::library_version(&file);
        if let Some(why) = driver_library::mismatch(&file, user.as_deref(), kernel.as_deref()) {
            return Err(why);
        }
        let this = Self {
            _library: library,
            actions,
            get_state,
            error_name,
            error_string,
        };
        // SAFETY: cuInit takes its flags by value.
        let code = unsafe { init(0) };
        if code != cu::CUDA_SUCCESS {
            return Err(format!(
                "cuInit of {} failed: {}",
                file.display(),
                this.describe(code)
            ));
        }
        Ok((this, file))
    }

    /// `NAME: description` of `code`, as the library says it.
    fn describe(&self, code: CuResult) -> String {
        let text = |f: Option<ErrorTextFn>| {
            let f = f?;
            let mut out: *const c_char = std::ptr::null();
            // SAFETY: the call writes a pointer to a static NUL-terminated string into `out`, which lives for
            // the call; it is read only when the call succeeded and set it.
            unsafe {
                (f(code, &mut out) == cu::CUDA_SUCCESS && !out.is_null())
                    .then(|| CStr::from_ptr(out).to_string_lossy().into_owned())
            }
        };
        match (text(self.error_name), text(self.error_string)) {
            (Some(name), Some(what)) => format!("{name}: {what}"),
            (Some(name), None) => name,
            _ => format!("CUresult {code}"),
        }
    }

    /// Runs `call`; the state for a `get-state`, or why not (the driver's code, when it gave one).
    fn call(&self, call: &Call) -> Result<Option<String>, Refusal> {
        let pid = c_int::try_from(call.pid)
            .map_err(|_| Refusal::other(format!("pid {} is out of range", call.pid)))?;
        if call.action == "get-state" {
            let mut value: c_uint = c_uint::MAX;
            // SAFETY: `value` lives for the call, which writes one CUprocessState into it.
            let code = unsafe { (self.get_state)(pid, &mut value) };
            if code != cu::CUDA_SUCCESS {
                return Err(self.refusal(code));
            }
            return cu::state_from_value(value)
                .map(|s| Some(s.name().to_owned()))
                .ok_or_else(|| Refusal::other(format!("unknown CUprocessState {value}")));
        }
        let unknown = || Refusal::other(format!("unknown action {:?}", call.action));
        let action = Action::parse(&call.action).ok_or_else(unknown)?;
        let Some(&(_, f)) = self.actions.iter().find(|(a, _)| *a == action) else {
            return Err(unknown());
        };
        let lock = LockArgs {
            timeout_ms: call.lock_timeout_ms,
            ..Default::default()
        };
        let restore = RestoreArgs::default();
        let reserved = ReservedArgs::default();
        let args: *const c_void = match action {
            Action::Lock => (&raw const lock).cast(),
            Action::Restore => (&raw const restore).cast(),
            Action::Checkpoint | Action::Unlock => (&raw const reserved).cast(),
        };
        // SAFETY: `f` is the call for `action`, whose argument struct `args` points to and which lives for the
        // call (read only: the timeout, or zeroed reserved fields and no GPU remapping).
        let code = unsafe { f(pid, args) };
        if code == cu::CUDA_SUCCESS {
            Ok(None)
        } else {
            Err(self.refusal(code))
        }
    }

    /// The driver's refusal with `code`.
    fn refusal(&self, code: CuResult) -> Refusal {
        Refusal {
            code: Some(code),
            message: self.describe(code),
        }
    }
}

/// Why a call gave no result: the driver's code, when it was the driver that refused, and what to say.
struct Refusal {
    code: Option<CuResult>,
    message: String,
}

impl Refusal {
    /// A refusal of the helper's own, before any driver call.
    fn other(message: String) -> Self {
        Self {
            code: None,
            message,
        }
    }
}

/// Writes one JSON line to the shim.
fn send(out: &Mutex<std::io::Stdout>, value: &impl serde::Serialize) {
    let Ok(mut line) = serde_json::to_vec(value) else {
        return;
    };
    line.push(b'\n');
    let mut out = out.lock().unwrap_or_else(PoisonError::into_inner);
    let _ = out.write_all(&line).and_then(|()| out.flush());
}

/// The file the loaded object holding `symbol` came from (the dynamic loader's word, whichever search found
/// it).
fn loaded_file(symbol: *const c_void) -> Option<PathBuf> {
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
    // SAFETY: dladdr only reads the loader's tables and writes `info`, which lives for the call; the name it
    // points to is the loader's, read at once while the library is loaded.
    unsafe {
        if libc::dladdr(symbol, info.as_mut_ptr()) == 0 {
            return None;
        }
        let info = info.assume_init();
        if info.dli_fname.is_null() {
            return None;
        }
        let name = CStr::from_ptr(info.dli_fname)
            .to_string_lossy()
            .into_owned();
        Some(PathBuf::from(name))
    }
}

/// The helper's main: returns its exit code.
pub fn serve(args: &[std::ffi::OsString]) -> i32 {
    // It never outlives the shim that started it (the shim is its parent).
    let _ = nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL);
    let out = Arc::new(Mutex::new(std::io::stdout()));
    let Some(library) = args.first() else {
        eprintln!("usage: containerd-shim-baton-v1 {HELPER_ARG} LIBRARY (the shim runs it)");
        return 2;
    };
    let library = match DriverLibrary::load(library) {
        Ok((l, file)) => {
            send(
                &out,
                &Ready {
                    unavailable: None,
                    library: Some(file.display().to_string()),
                },
            );
            Arc::new(l)
        }
        Err(why) => {
            send(
                &out,
                &Ready {
                    unavailable: Some(why),
                    library: None,
                },
            );
            return 3;
        }
    };
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let call: Call = match serde_json::from_str(&line) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("{HELPER_ARG}: a call that is not JSON ({e}): {line}");
                continue;
            }
        };
        let (library, out) = (library.clone(), out.clone());
        // Each call on its own thread: a lock waits for the process's in-flight work, and the others' calls
        // go on meanwhile (the driver API is thread-safe).
        std::thread::spawn(move || {
            let (state, error, code) = match library.call(&call) {
                Ok(state) => (state, None, None),
                Err(e) => (None, Some(e.message), e.code),
            };
            send(
                &out,
                &Answer {
                    id: call.id,
                    state,
                    error,
                    code,
                },
            );
        });
    }
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_library_without_the_checkpoint_calls_is_unavailable_and_says_why() {
        let e = DriverLibrary::load(OsStr::new("/nonexistent/libcuda.so.1"))
            .err()
            .unwrap();
        assert!(e.contains("cannot load /nonexistent/libcuda.so.1"), "{e}");
        // The C library is a library, but no CUDA driver.
        let e = DriverLibrary::load(OsStr::new("libc.so.6")).err().unwrap();
        assert!(e.contains("no cuCheckpointProcessLock"), "{e}");
    }

    #[test]
    fn the_protocol_round_trips() {
        let call: Call =
            serde_json::from_str(r#"{"id":7,"action":"lock","pid":42,"lock_timeout_ms":500}"#)
                .unwrap();
        assert_eq!((call.id, call.pid, call.lock_timeout_ms), (7, 42, 500));
        let call: Call = serde_json::from_str(r#"{"id":8,"action":"unlock","pid":42}"#).unwrap();
        assert_eq!(call.lock_timeout_ms, 0);
    }
}
