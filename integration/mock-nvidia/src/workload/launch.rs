//! Kernel launches through a (fake) libcuda, for the launch-telemetry tests: the library is opened with
//! `dlopen` at start, as a CUDA program loads libcuda before `cuInit` opens the device files, and the three
//! entry points the tracer's uprobes count are called a given number of times each.
use std::{
    ffi::c_void,
    path::{Path, PathBuf},
};

/// How many calls of each entry point to make.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Launches {
    /// `cuLaunchKernel` calls.
    pub kernel: u64,
    /// `cuLaunchKernelEx` calls.
    pub kernel_ex: u64,
    /// `cuGraphLaunch` calls.
    pub graph: u64,
}

impl Launches {
    /// Parses `KERNEL,KERNEL_EX,GRAPH` (e.g. `1000,200,30`).
    pub fn parse(s: &str) -> Result<Self, String> {
        let n: Vec<u64> = s
            .split(',')
            .map(|p| p.trim().parse::<u64>())
            .collect::<Result<_, _>>()
            .map_err(|e| format!("{s:?} is not KERNEL,KERNEL_EX,GRAPH counts: {e}"))?;
        match n[..] {
            [kernel, kernel_ex, graph] => Ok(Self {
                kernel,
                kernel_ex,
                graph,
            }),
            _ => Err(format!(
                "{s:?} is not three counts KERNEL,KERNEL_EX,GRAPH (e.g. 1000,200,30)"
            )),
        }
    }
}

/// Why the library cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// dlopen or dlsym failed.
    #[error("cannot use {path} as libcuda: {source}")]
    Load {
        /// The library.
        path: PathBuf,
        /// The error.
        source: libloading::Error,
    },
    /// An entry point returned an error.
    #[error("{symbol} returned CUresult {code}")]
    Failed {
        /// The entry point.
        symbol: &'static str,
        /// What it returned.
        code: u32,
    },
}

type LaunchKernel = unsafe extern "C" fn(
    *mut c_void,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    *mut c_void,
    *mut *mut c_void,
    *mut *mut c_void,
) -> u32;
type LaunchKernelEx =
    unsafe extern "C" fn(*const c_void, *mut c_void, *mut *mut c_void, *mut *mut c_void) -> u32;
type GraphLaunch = unsafe extern "C" fn(*mut c_void, *mut c_void) -> u32;

/// The symbols, in the order of [`Launches`].
const SYMBOLS: [&str; 3] = ["cuLaunchKernel", "cuLaunchKernelEx", "cuGraphLaunch"];

/// An opened libcuda and its launch entry points.
pub struct CudaLibrary {
    launch_kernel: LaunchKernel,
    launch_kernel_ex: LaunchKernelEx,
    graph_launch: GraphLaunch,
    /// Keeps the library mapped while the function pointers above are used.
    _lib: libloading::Library,
}

impl CudaLibrary {
    /// `dlopen`s `path` and looks up the three entry points.
    pub fn open(path: &Path) -> Result<Self, LaunchError> {
        let err = |source| LaunchError::Load {
            path: path.to_owned(),
            source,
        };
        // SAFETY: loading runs the library's initializers; the tests' fake libcuda has none, and a real one
        // is meant to be loaded by CUDA programs.
        let lib = unsafe { libloading::Library::new(path) }.map_err(err)?;
        // SAFETY: the types are CUDA's signatures for these symbols; the pointers are used only while `lib`
        // is kept alive (it is stored with them).
        let (launch_kernel, launch_kernel_ex, graph_launch) = unsafe {
            (
                *lib.get::<LaunchKernel>(SYMBOLS[0].as_bytes())
                    .map_err(err)?,
                *lib.get::<LaunchKernelEx>(SYMBOLS[1].as_bytes())
                    .map_err(err)?,
                *lib.get::<GraphLaunch>(SYMBOLS[2].as_bytes()).map_err(err)?,
            )
        };
        Ok(Self {
            launch_kernel,
            launch_kernel_ex,
            graph_launch,
            _lib: lib,
        })
    }

    /// One `cuLaunchKernel` call (a 1x1x1 grid of a null function, as the fake ignores its arguments).
    pub fn launch_kernel(&self) -> Result<(), LaunchError> {
        let null = std::ptr::null_mut();
        // SAFETY: CUDA's signature; the fake library reads none of the arguments (a real libcuda would
        // reject the null function with an error code).
        let code = unsafe {
            (self.launch_kernel)(null, 1, 1, 1, 1, 1, 1, 0, null, null.cast(), null.cast())
        };
        check(SYMBOLS[0], code)
    }

    /// Makes the calls `n` asks for, in order: kernels, Ex kernels, graphs.
    pub fn launch(&self, n: Launches) -> Result<(), LaunchError> {
        let null = std::ptr::null_mut();
        for _ in 0..n.kernel {
            self.launch_kernel()?;
        }
        for _ in 0..n.kernel_ex {
            // SAFETY: as in `launch_kernel`.
            check(SYMBOLS[1], unsafe {
                (self.launch_kernel_ex)(std::ptr::null(), null, null.cast(), null.cast())
            })?;
        }
        for _ in 0..n.graph {
            // SAFETY: as in `launch_kernel`.
            check(SYMBOLS[2], unsafe { (self.graph_launch)(null, null) })?;
        }
        Ok(())
    }
}

fn check(symbol: &'static str, code: u32) -> Result<(), LaunchError> {
    if code == 0 {
        Ok(())
    } else {
        Err(LaunchError::Failed { symbol, code })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launch_counts_parse_as_three_numbers() {
        assert_eq!(
            Launches::parse("1000, 200,30").unwrap(),
            Launches {
                kernel: 1000,
                kernel_ex: 200,
                graph: 30
            }
        );
        assert!(Launches::parse("1,2").is_err());
        assert!(Launches::parse("1,x,3").is_err());
    }
}
