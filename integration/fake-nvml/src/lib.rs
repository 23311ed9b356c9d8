//! A fake `libnvidia-ml.so.1`: the NVML entry points that nvml-wrapper resolves for what the agent asks
//! (`nvmlInit_v2`, `nvmlShutdown`, `nvmlErrorString`, `nvmlDeviceGetCount_v2`,
//! `nvmlDeviceGetHandleByIndex_v2`, `nvmlDeviceGetMinorNumber`, `nvmlDeviceGetMemoryInfo_v2` and `_v1`,
//! `nvmlDeviceGetComputeRunningProcesses_v3`), exported with NVML's names and C ABI, answering from the
//! mock driver's state ([`answers`]). nvml-wrapper resolves every other symbol lazily: a call of one the fake
//! lacks fails in the wrapper, not at load.
//!
//! Set by the loading process's environment, read once at `nvmlInit_v2`:
//! - `BATON_FAKE_NVML_MOCK`: the mock driver's mount folder (its `state.json`); without it, or when it
//!   cannot be read, `nvmlInit_v2` answers `NVML_ERROR_DRIVER_NOT_LOADED`, as NVML does on a node without
//!   the driver.
//! - `BATON_FAKE_NVML_DELAY_US`: how long every call takes (a slow NVML; 0 by default).
//! - `BATON_FAKE_NVML_HOLD`: a path; while a file is there, every device query waits (the test decides
//!   when NVML answers).
//!
//! Built as a cdylib (`target/<profile>/libbaton_fake_nvml.so`); tests copy it to a file named
//! `libnvidia-ml.so.1` and pass it to `baton agent --nvml-library`.
#![allow(non_snake_case, reason = "NVML's names")]
pub mod answers;

use std::{
    ffi::{CStr, c_char, c_uint},
    path::PathBuf,
    sync::{
        OnceLock,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use baton_mock_nvidia::driver::DriverState;
use nvml_wrapper_sys::bindings::{
    nvmlDevice_st, nvmlDevice_t, nvmlMemory_t, nvmlMemory_v2_t, nvmlProcessInfo_t, nvmlReturn_t,
};

use answers::Gpu;

/// `NVML_SUCCESS` and the errors the fake answers (nvml.h's numbers, through nvml-wrapper-sys).
mod code {
    pub use nvml_wrapper_sys::bindings::{
        nvmlReturn_enum_NVML_ERROR_ARGUMENT_VERSION_MISMATCH as ARGUMENT_VERSION_MISMATCH,
        nvmlReturn_enum_NVML_ERROR_DRIVER_NOT_LOADED as DRIVER_NOT_LOADED,
        nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_SIZE as INSUFFICIENT_SIZE,
        nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT as INVALID_ARGUMENT,
        nvmlReturn_enum_NVML_ERROR_UNINITIALIZED as UNINITIALIZED,
        nvmlReturn_enum_NVML_ERROR_UNKNOWN as UNKNOWN, nvmlReturn_enum_NVML_SUCCESS as SUCCESS,
    };
}

/// The environment variable naming the mock driver's mount folder.
pub const MOCK_ENV: &str = "BATON_FAKE_NVML_MOCK";
/// The environment variable giving every call's delay, in microseconds.
pub const DELAY_ENV: &str = "BATON_FAKE_NVML_DELAY_US";
/// The environment variable naming the hold file.
pub const HOLD_ENV: &str = "BATON_FAKE_NVML_HOLD";

/// How the fake behaves, from the environment.
#[derive(Clone, Debug, Default)]
struct Config {
    mock: Option<PathBuf>,
    delay: Duration,
    hold: Option<PathBuf>,
}

impl Config {
    fn from_env() -> Self {
        let path = |name| std::env::var_os(name).map(PathBuf::from);
        Self {
            mock: path(MOCK_ENV),
            delay: std::env::var(DELAY_ENV)
                .ok()
                .and_then(|v| v.parse().ok())
                .map_or(Duration::ZERO, Duration::from_micros),
            hold: path(HOLD_ENV),
        }
    }
}

static CONFIG: OnceLock<Config> = OnceLock::new();
static INITIALIZED: AtomicBool = AtomicBool::new(false);

fn config() -> &'static Config {
    CONFIG.get_or_init(Config::from_env)
}

/// The time every call takes.
fn slow() {
    let delay = config().delay;
    if !delay.is_zero() {
        std::thread::sleep(delay);
    }
}

/// The mock's GPUs now, after the delay and while the hold file is there; the code to return otherwise.
fn query() -> Result<Vec<Gpu>, nvmlReturn_t> {
    slow();
    if !INITIALIZED.load(Ordering::SeqCst) {
        return Err(code::UNINITIALIZED);
    }
    let config = config();
    if let Some(hold) = &config.hold {
        while hold.exists() {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    let mock = config.mock.as_ref().ok_or(code::UNKNOWN)?;
    let state = DriverState::read(mock).map_err(|_| code::UNKNOWN)?;
    Ok(answers::gpus(&state, answers::tgid_from_proc))
}

/// GPU `device` of the mock now.
fn gpu(device: nvmlDevice_t) -> Result<Gpu, nvmlReturn_t> {
    let index = device.addr().checked_sub(1).ok_or(code::INVALID_ARGUMENT)?;
    query()?
        .into_iter()
        .nth(index)
        .ok_or(code::INVALID_ARGUMENT)
}

/// `nvmlReturn_t nvmlInit_v2(void)`: fails as on a node without the driver unless the mock's state reads.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit_v2() -> nvmlReturn_t {
    slow();
    match config().mock.as_ref().map(|m| DriverState::read(m)) {
        Some(Ok(_)) => {
            INITIALIZED.store(true, Ordering::SeqCst);
            code::SUCCESS
        }
        _ => code::DRIVER_NOT_LOADED,
    }
}

/// `nvmlReturn_t nvmlInitWithFlags(unsigned int flags)`: as `nvmlInit_v2`.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlInitWithFlags(_flags: c_uint) -> nvmlReturn_t {
    nvmlInit_v2()
}

/// `nvmlReturn_t nvmlShutdown(void)`.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlShutdown() -> nvmlReturn_t {
    slow();
    INITIALIZED.store(false, Ordering::SeqCst);
    code::SUCCESS
}

/// `const char *nvmlErrorString(nvmlReturn_t result)`: a static string.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlErrorString(result: nvmlReturn_t) -> *const c_char {
    let text: &'static CStr = match result {
        code::SUCCESS => c"Success",
        code::UNINITIALIZED => c"Uninitialized",
        code::INVALID_ARGUMENT => c"Invalid Argument",
        code::INSUFFICIENT_SIZE => c"Insufficient Size",
        code::DRIVER_NOT_LOADED => c"Driver Not Loaded",
        code::ARGUMENT_VERSION_MISMATCH => c"Argument version mismatch",
        _ => c"Unknown Error",
    };
    text.as_ptr()
}

/// Writes `value` to `out` when it is not NULL; `INVALID_ARGUMENT` when it is.
///
/// # Safety
/// `out` is NULL or points to a writable `T` the caller owns for the call.
unsafe fn answer<T>(out: *mut T, value: Result<T, nvmlReturn_t>) -> nvmlReturn_t {
    if out.is_null() {
        return code::INVALID_ARGUMENT;
    }
    match value {
        Ok(v) => {
            // SAFETY: `out` is not NULL and, by this function's contract, points to a writable `T`.
            unsafe { out.write(v) };
            code::SUCCESS
        }
        Err(code) => code,
    }
}

/// `nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount)`.
///
/// # Safety
/// `count` is NULL or points to a writable `unsigned int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut c_uint) -> nvmlReturn_t {
    let n = query().map(|g| c_uint::try_from(g.len()).unwrap_or(c_uint::MAX));
    // SAFETY: as this function's contract says.
    unsafe { answer(count, n) }
}

/// `nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)`: the handle of
/// GPU I is the address I + 1 (never dereferenced).
///
/// # Safety
/// `device` is NULL or points to a writable `nvmlDevice_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: c_uint,
    device: *mut nvmlDevice_t,
) -> nvmlReturn_t {
    let handle = query().and_then(|g| {
        let i = index as usize;
        (i < g.len())
            .then(|| std::ptr::without_provenance_mut::<nvmlDevice_st>(i + 1))
            .ok_or(code::INVALID_ARGUMENT)
    });
    // SAFETY: as this function's contract says.
    unsafe { answer(device, handle) }
}

/// `nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber)`: GPU N is
/// `/dev/nvidiaN`, as the mock names its device files.
///
/// # Safety
/// `minor` is NULL or points to a writable `unsigned int`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMinorNumber(
    device: nvmlDevice_t,
    minor: *mut c_uint,
) -> nvmlReturn_t {
    let index = gpu(device).map(|_| c_uint::try_from(device.addr() - 1).unwrap_or(c_uint::MAX));
    // SAFETY: as this function's contract says.
    unsafe { answer(minor, index) }
}

/// `nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory)`: the caller
/// sets `memory->version` to `nvmlMemory_v2` (its size | 2 << 24), as nvml.h asks; no memory is reserved.
///
/// # Safety
/// `memory` is NULL or points to a readable and writable `nvmlMemory_v2_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_v2_t,
) -> nvmlReturn_t {
    const VERSION_2: c_uint = (size_of::<nvmlMemory_v2_t>() | (2 << 24)) as c_uint;
    // SAFETY: a non-NULL `memory` points to an nvmlMemory_v2_t the caller owns for the call.
    let Some(version) = (unsafe { memory.as_ref() }).map(|m| m.version) else {
        return code::INVALID_ARGUMENT;
    };
    if version != VERSION_2 {
        return code::ARGUMENT_VERSION_MISMATCH;
    }
    let info = gpu(device).map(|g| nvmlMemory_v2_t {
        version,
        total: g.total_bytes,
        reserved: 0,
        free: g.total_bytes.saturating_sub(g.used_bytes),
        used: g.used_bytes,
    });
    // SAFETY: as this function's contract says.
    unsafe { answer(memory, info) }
}

/// `nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)`.
///
/// # Safety
/// `memory` is NULL or points to a writable `nvmlMemory_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    device: nvmlDevice_t,
    memory: *mut nvmlMemory_t,
) -> nvmlReturn_t {
    let info = gpu(device).map(|g| nvmlMemory_t {
        total: g.total_bytes,
        free: g.total_bytes.saturating_sub(g.used_bytes),
        used: g.used_bytes,
    });
    // SAFETY: as this function's contract says.
    unsafe { answer(memory, info) }
}

/// `nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
/// nvmlProcessInfo_t *infos)`: as nvml.h says, a `*infoCount` below the number of processes gets that
/// number back with `NVML_ERROR_INSUFFICIENT_SIZE` (how callers ask for the count, with `infos` NULL).
///
/// # Safety
/// `count` is NULL or points to a writable `unsigned int`; `infos` is NULL or points to `*count` writable
/// `nvmlProcessInfo_t`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    device: nvmlDevice_t,
    count: *mut c_uint,
    infos: *mut nvmlProcessInfo_t,
) -> nvmlReturn_t {
    // SAFETY: a non-NULL `count` points to an unsigned int the caller owns for the call.
    let Some(room) = (unsafe { count.as_mut() }) else {
        return code::INVALID_ARGUMENT;
    };
    let processes = match gpu(device) {
        Ok(g) => g.processes,
        Err(code) => return code,
    };
    let n = c_uint::try_from(processes.len()).unwrap_or(c_uint::MAX);
    if *room < n {
        *room = n;
        return code::INSUFFICIENT_SIZE;
    }
    if n > 0 && infos.is_null() {
        return code::INVALID_ARGUMENT;
    }
    for (i, p) in processes.iter().enumerate() {
        let info = nvmlProcessInfo_t {
            pid: p.pid,
            usedGpuMemory: p.used_bytes,
            // NVML's "no value" for both: no MIG.
            gpuInstanceId: u32::MAX,
            computeInstanceId: u32::MAX,
        };
        // SAFETY: `infos` is not NULL and holds `*count` >= n entries the caller owns for the call.
        unsafe { infos.add(i).write(info) };
    }
    *room = n;
    code::SUCCESS
}

#[cfg(test)]
mod tests;
