//! A mock NVIDIA kernel driver served through FUSE, and a mock CUDA workload that drives it through real
//! syscalls, for tests on machines without a GPU.
//!
//! - [`driver`]: mount the mock ([`driver::MockDriver::mount`] in-process,
//!   [`driver::MockDriverProcess::start`] as a child) and read its state ([`driver::DriverState`]).
//! - [`workload`]: the CUDA-like call sequence ([`workload::Workload`]) that the `baton-mock-cuda` binary
//!   runs, and its summary ([`workload::Summary`]).
//!
//! Every NVIDIA number comes from `baton-nvidia`.

pub mod driver;
pub mod wire;
pub mod workload;
