//! A fake `libcuda.so`: the three launch entry points of the CUDA driver API (`cuLaunchKernel`,
//! `cuLaunchKernelEx`, `cuGraphLaunch`) as real exported symbols with the C ABI and CUDA's signatures. Each
//! counts its calls and returns `CUDA_SUCCESS`; `batonFakeCudaCalls` reads a count back, so that a workload
//! can show that its calls really went into the library the uprobes watch. And the driver API's checkpoint
//! calls, driving the mock CUDA workload ([`checkpoint`]).
//!
//! Built as a cdylib (`target/<profile>/libbaton_fake_libcuda.so`); tests copy it to a file named
//! `libcuda.so.1`, the name the tracer recognizes.
#![allow(non_snake_case, reason = "CUDA's names")]
pub mod checkpoint;

use std::{
    ffi::c_void,
    sync::atomic::{AtomicU64, Ordering},
};

/// `CUresult` (0 is `CUDA_SUCCESS`).
pub type CuResult = u32;

static CALLS: [AtomicU64; 3] = [AtomicU64::new(0), AtomicU64::new(0), AtomicU64::new(0)];

#[inline(never)]
fn called(which: usize) -> CuResult {
    CALLS[which].fetch_add(1, Ordering::Relaxed);
    0
}

/// `CUresult cuLaunchKernel(CUfunction f, unsigned gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY,
/// blockDimZ, unsigned sharedMemBytes, CUstream hStream, void **kernelParams, void **extra)`.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments, reason = "CUDA's signature")]
pub extern "C" fn cuLaunchKernel(
    _f: *mut c_void,
    _grid_x: u32,
    _grid_y: u32,
    _grid_z: u32,
    _block_x: u32,
    _block_y: u32,
    _block_z: u32,
    _shared_mem_bytes: u32,
    _stream: *mut c_void,
    _kernel_params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CuResult {
    called(0)
}

/// `CUresult cuLaunchKernelEx(const CUlaunchConfig *config, CUfunction f, void **kernelParams, void **extra)`.
#[unsafe(no_mangle)]
pub extern "C" fn cuLaunchKernelEx(
    _config: *const c_void,
    _f: *mut c_void,
    _kernel_params: *mut *mut c_void,
    _extra: *mut *mut c_void,
) -> CuResult {
    called(1)
}

/// `CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream)`.
#[unsafe(no_mangle)]
pub extern "C" fn cuGraphLaunch(_graph_exec: *mut c_void, _stream: *mut c_void) -> CuResult {
    called(2)
}

/// Calls made so far of entry point `which` (0 cuLaunchKernel, 1 cuLaunchKernelEx, 2 cuGraphLaunch; 0 for
/// any other).
#[unsafe(no_mangle)]
pub extern "C" fn batonFakeCudaCalls(which: u32) -> u64 {
    CALLS
        .get(which as usize)
        .map_or(0, |c| c.load(Ordering::Relaxed))
}
