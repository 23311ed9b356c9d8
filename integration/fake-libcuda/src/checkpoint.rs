//! The checkpoint calls of the CUDA driver API (`cuCheckpointProcess*`, CUDA 12.8+) as a real `libcuda.so.1`
//! exports them, driving `baton-mock-cuda`'s restore thread over its control socket as the `cuda-checkpoint`
//! stand-in does. Like the real library, every call fails with `CUDA_ERROR_NOT_INITIALIZED` until this process
//! has called `cuInit`, and for a target with no CUDA state of its own (a worker forked after CUDA init: the
//! H200 answered so, /work/shared/gpu/580.159.04/README.md, "Forked children"); a checkpoint whose target
//! dies on it (the kernel's OOM kill when the host copy does not fit its memory cgroup) or finds no host
//! memory for the copy returns `CUDA_ERROR_OPERATING_SYSTEM`, as the H200's did (README there, "Memory
//! cgroups"). `cuGetErrorString` and `cuGetErrorName` say what a code means.
use std::{
    ffi::{c_char, c_int, c_uint},
    sync::atomic::{AtomicBool, Ordering},
};

use baton_mock_nvidia::workload::control::{self, Action, ControlError, Reply, Request};
use baton_nvidia::cuda_checkpoint::driver_api::{
    self as api, CUDA_ERROR_ILLEGAL_STATE, CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_INITIALIZED,
    CUDA_ERROR_TIMEOUT, CUDA_ERROR_UNKNOWN, CUDA_SUCCESS, CuResult, LockArgs, ReservedArgs,
    RestoreArgs,
};

static INITIALIZED: AtomicBool = AtomicBool::new(false);

/// `CUDA_ERROR_OPERATING_SYSTEM`: an OS call failed (what the H200's checkpoint returned when the kernel
/// OOM-killed its target for the host copy).
pub const CUDA_ERROR_OPERATING_SYSTEM: CuResult = 304;

/// `CUresult cuInit(unsigned int Flags)`: flags must be 0.
#[unsafe(no_mangle)]
pub extern "C" fn cuInit(flags: c_uint) -> CuResult {
    if flags != 0 {
        return CUDA_ERROR_INVALID_VALUE;
    }
    INITIALIZED.store(true, Ordering::SeqCst);
    CUDA_SUCCESS
}

/// The mock's answer to `request` on `pid`: the process's `CUprocessState` after it, or the code of its failure.
fn drive(pid: c_int, request: Request) -> Result<c_uint, CuResult> {
    if !INITIALIZED.load(Ordering::SeqCst) {
        return Err(CUDA_ERROR_NOT_INITIALIZED);
    }
    let pid = u32::try_from(pid).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
    match control::send(pid, request) {
        Ok(Reply::Ok(state)) => Ok(api::state_value(state)),
        Ok(Reply::Err(message)) => Err(code_of(&message)),
        // The target died during its checkpoint.
        Err(ControlError::Exited { .. }) if request == Request::Other(Action::Checkpoint) => {
            Err(CUDA_ERROR_OPERATING_SYSTEM)
        }
        // Not a (mock) CUDA process, or one that went away.
        Err(_) => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

/// The code the real library returns for what the mock's restore thread said; a failure injected as a crash
/// of the caller aborts this process, as a fault inside the vendor's library would.
fn code_of(message: &str) -> CuResult {
    if message.contains(control::CRASH_THE_CALLER) {
        eprintln!("fake libcuda: {message}: aborting");
        std::process::abort();
    }
    if message.starts_with(control::NOT_INITIALIZED) {
        CUDA_ERROR_NOT_INITIALIZED
    } else if message.starts_with(control::OPERATING_SYSTEM) {
        CUDA_ERROR_OPERATING_SYSTEM
    } else if message.contains("timed out") {
        CUDA_ERROR_TIMEOUT
    } else if message.contains("; state is ") {
        CUDA_ERROR_ILLEGAL_STATE
    } else {
        CUDA_ERROR_UNKNOWN
    }
}

fn result(outcome: Result<c_uint, CuResult>) -> CuResult {
    outcome.map_or_else(|code| code, |_| CUDA_SUCCESS)
}

/// `CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args)` (`args` may be NULL: no timeout).
///
/// # Safety
/// `args` is NULL or points to a `CUcheckpointLockArgs` that lives for the call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCheckpointProcessLock(pid: c_int, args: *const LockArgs) -> CuResult {
    // SAFETY: a non-null `args` points to a CUcheckpointLockArgs the caller owns for the call.
    let timeout_ms = unsafe { args.as_ref() }.map_or(0, |a| a.timeout_ms);
    result(drive(
        pid,
        Request::action(Action::Lock, u64::from(timeout_ms)),
    ))
}

/// `CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args)`.
#[unsafe(no_mangle)]
pub extern "C" fn cuCheckpointProcessCheckpoint(
    pid: c_int,
    _args: *const ReservedArgs,
) -> CuResult {
    result(drive(pid, Request::Other(Action::Checkpoint)))
}

/// `CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args)`.
#[unsafe(no_mangle)]
pub extern "C" fn cuCheckpointProcessRestore(pid: c_int, _args: *const RestoreArgs) -> CuResult {
    result(drive(pid, Request::Other(Action::Restore)))
}

/// `CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args)`.
#[unsafe(no_mangle)]
pub extern "C" fn cuCheckpointProcessUnlock(pid: c_int, _args: *const ReservedArgs) -> CuResult {
    result(drive(pid, Request::Other(Action::Unlock)))
}

/// `CUresult cuCheckpointProcessGetState(int pid, CUprocessState *state)`.
///
/// # Safety
/// `state` is NULL or points to a writable `CUprocessState`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCheckpointProcessGetState(pid: c_int, state: *mut c_uint) -> CuResult {
    if state.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    match drive(pid, Request::State) {
        Ok(value) => {
            // SAFETY: `state` is non-null and points to a CUprocessState the caller owns for the call.
            unsafe { state.write(value) };
            CUDA_SUCCESS
        }
        Err(code) => code,
    }
}

/// `CUresult cuGetErrorName(CUresult error, const char **pStr)`.
///
/// # Safety
/// `p_str` is NULL or points to a writable `const char *`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorName(error: CuResult, p_str: *mut *const c_char) -> CuResult {
    // SAFETY: as this function's contract says.
    unsafe { write_static(p_str, error_text(error).0) }
}

/// `CUresult cuGetErrorString(CUresult error, const char **pStr)`.
///
/// # Safety
/// `p_str` is NULL or points to a writable `const char *`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorString(error: CuResult, p_str: *mut *const c_char) -> CuResult {
    // SAFETY: as this function's contract says.
    unsafe { write_static(p_str, error_text(error).1) }
}

/// The name and the string of `code`: `baton-nvidia`'s, and this library's own code 304.
fn error_text(code: CuResult) -> (&'static std::ffi::CStr, &'static std::ffi::CStr) {
    match code {
        CUDA_ERROR_OPERATING_SYSTEM => (
            c"CUDA_ERROR_OPERATING_SYSTEM",
            c"OS call failed or operation not supported on this OS",
        ),
        other => api::error_text(other),
    }
}

/// # Safety
/// `p_str` is NULL or points to a writable `const char *`.
unsafe fn write_static(p_str: *mut *const c_char, text: &'static std::ffi::CStr) -> CuResult {
    if p_str.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: `p_str` is non-null and points to a `const char *` the caller owns; `text` is a static C string
    // that outlives every caller.
    unsafe { p_str.write(text.as_ptr()) };
    CUDA_SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `cuCheckpointProcessGetState` of `pid`, into a local.
    fn get_state(pid: c_int) -> CuResult {
        let mut state = u32::MAX;
        // SAFETY: `state` lives for the call.
        unsafe { cuCheckpointProcessGetState(pid, &mut state) }
    }

    /// The name `cuGetErrorName` gives `code`.
    fn error_name(code: CuResult) -> String {
        let mut name: *const c_char = std::ptr::null();
        // SAFETY: `name` lives for the call.
        assert_eq!(unsafe { cuGetErrorName(code, &mut name) }, CUDA_SUCCESS);
        // SAFETY: cuGetErrorName wrote a static NUL-terminated string.
        unsafe { std::ffi::CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned()
    }

    /// Before `cuInit` every checkpoint call fails as the real library's do, naming the code; after it, a pid
    /// that is no CUDA process is an invalid value, not a crash, and a process with no CUDA state of its own
    /// (a worker forked after CUDA init, whose control socket its parent serves) is not initialized. One test:
    /// `cuInit` is the library's, process-wide.
    #[test]
    fn calls_before_cu_init_fail_and_a_pid_that_is_no_cuda_process_is_invalid() {
        let me = std::process::id() as c_int;
        assert_eq!(get_state(me), CUDA_ERROR_NOT_INITIALIZED);
        // SAFETY: a NULL args pointer is allowed.
        let locked = unsafe { cuCheckpointProcessLock(me, std::ptr::null()) };
        assert_eq!(locked, CUDA_ERROR_NOT_INITIALIZED);
        assert_eq!(
            error_name(CUDA_ERROR_NOT_INITIALIZED),
            "CUDA_ERROR_NOT_INITIALIZED"
        );
        assert_eq!(cuInit(1), CUDA_ERROR_INVALID_VALUE);
        assert_eq!(cuInit(0), CUDA_SUCCESS);
        assert_eq!(get_state(me), CUDA_ERROR_INVALID_VALUE);
        // SAFETY: a NULL state pointer is checked, never written.
        let null = unsafe { cuCheckpointProcessGetState(me, std::ptr::null_mut()) };
        assert_eq!(null, CUDA_ERROR_INVALID_VALUE);
        assert_eq!(code_of("lock timed out after 5 ms"), CUDA_ERROR_TIMEOUT);
        assert_eq!(
            code_of("checkpoint needs a locked process; state is running"),
            CUDA_ERROR_ILLEGAL_STATE
        );
        assert_eq!(
            code_of(&format!(
                "{} (initialization error): ...",
                control::NOT_INITIALIZED
            )),
            CUDA_ERROR_NOT_INITIALIZED
        );
        assert_eq!(
            code_of(&format!(
                "{}: cannot allocate ...",
                control::OPERATING_SYSTEM
            )),
            CUDA_ERROR_OPERATING_SYSTEM
        );
        assert_eq!(
            error_name(CUDA_ERROR_OPERATING_SYSTEM),
            "CUDA_ERROR_OPERATING_SYSTEM"
        );

        // A worker: a live process whose control socket answers as the mock answers for forked workers.
        let mut worker = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .expect("run sleep");
        let mut socket = baton_mock_nvidia::workload::restore::ControlSocket::bind_for(worker.id())
            .expect("bind the worker's control socket");
        socket.serve_without_cuda().expect("serve it");
        let pid = worker.id() as c_int;
        assert_eq!(get_state(pid), CUDA_ERROR_NOT_INITIALIZED);
        // SAFETY: a NULL args pointer is allowed.
        let locked = unsafe { cuCheckpointProcessLock(pid, std::ptr::null()) };
        assert_eq!(locked, CUDA_ERROR_NOT_INITIALIZED);
        assert_eq!(
            cuCheckpointProcessCheckpoint(pid, std::ptr::null()),
            CUDA_ERROR_NOT_INITIALIZED
        );
        let _ = worker.kill();
        let _ = worker.wait();
    }
}
