//! The co-runner controller's CPU analog (issue 9 §3): a latency-critical "server" that streams "tokens" of
//! CPU work and a CPU-bound co-runner, in containers under containerd and the Baton shim, pinned to one CPU;
//! requests from a seeded Poisson generator through the example request proxy (`tools/baton/examples`),
//! which feeds the agent; and the arms the benchmark and the test compare.
pub mod arms;
pub mod generator;
pub mod rig;
pub mod work;
