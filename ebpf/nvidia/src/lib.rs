//! NVIDIA kernel-driver protocol tables (escapes, classes, UVM commands, status codes, struct layouts by
//! driver version) and the decoder built on them: the one place every NVIDIA number lives.
//!
//! Everything except [`decode`] (and the `std`-only helpers in [`layout`]) is `no_std`, allocation-free and
//! panic-free so the kernel-side eBPF probes can use the same constants and small `const fn`s as user space.
//! Numbers come from NVIDIA/open-gpu-kernel-modules (515 .. 595.45.04), see
//! `shared/reference/nvidia-driver.md`; the 610.43.02 band (UVM range groups removed) from gVisor's
//! nvproxy. Names that changed meaning between releases have `name_for(value, version)` variants
//! ([`escape::name_for`], [`status::name_for`], [`ctrl::name_for`], [`uvm::name_for`]).
#![cfg_attr(not(feature = "std"), no_std)]

pub mod class;
pub mod ctrl;
pub mod cuda_checkpoint;
pub mod escape;
pub mod fdkind;
pub mod ioc;
pub mod layout;
pub mod params;
pub mod status;
pub mod uvm;

#[cfg(feature = "std")]
pub mod decode;
