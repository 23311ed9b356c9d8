//! Kernel-side probes: syscall tracepoints that follow which fds of a process are NVIDIA device files and
//! capture the driver calls made through them, and uprobes that count a container's CUDA launches, for the
//! user-space tracer in `baton-tracer`.
//!
//! Design (see docs/design.md): one probe set per node. Each program's fast path is one hash lookup
//! (`NV_FDS` by tgid+fd, `NV_PROCS` by tgid, or `WATCHED` by cgroup id), so the per-syscall cost does not grow
//! with the number of watched containers. Entry points are thin and call `try_*` functions; nothing can panic.
//! The programs only read syscall arguments (stable ABI) and user memory; they never walk kernel structs,
//! because aya-ebpf has no CO-RE relocations.
#![cfg_attr(target_arch = "bpf", no_std)]
#![cfg_attr(target_arch = "bpf", no_main)]
// An atomic add for a counter shared by every CPU (see confirm.rs); the probes are built with build-std and
// RUSTC_BOOTSTRAP=1 already.
#![cfg_attr(target_arch = "bpf", feature(core_intrinsics))]
#![cfg_attr(target_arch = "bpf", allow(internal_features))]
#![allow(
    missing_docs,
    reason = "entry points are named after the tracepoints they attach to"
)]

#[cfg(target_arch = "bpf")]
mod confirm;
#[cfg(target_arch = "bpf")]
mod fds;
#[cfg(target_arch = "bpf")]
mod ioctl;
#[cfg(target_arch = "bpf")]
mod launch;
#[cfg(target_arch = "bpf")]
mod lifecycle;
#[cfg(target_arch = "bpf")]
mod maps;
#[cfg(target_arch = "bpf")]
mod pending;
#[cfg(target_arch = "bpf")]
mod util;
#[cfg(target_arch = "bpf")]
mod vmas;

#[cfg(target_arch = "bpf")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    // Unreachable in a verified program: the verifier rejects programs that could get here.
    loop {}
}

/// The probes only exist for the BPF target; on the host this binary is empty so that workspace-wide
/// `cargo clippy --all-targets` can still check the crate.
#[cfg(not(target_arch = "bpf"))]
fn main() {}

#[cfg(target_arch = "bpf")]
#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
