//! `baton-hook`'s logic: OCI hooks that give containers run by plain runc (or by CRI-O or podman, through
//! their hooks.d) what the Baton shim gives its own: the node agent watches them (tracing, the ledger, the
//! release signal) from before their program runs until they stop, and an optional GPU-free gate holds
//! their start while another container holds the GPU.
//!
//! [`state`] reads the OCI state the runtime writes on a hook's stdin; [`container`] turns it into the
//! agent's [`Registration`](baton_agent_api::Registration); [`agent`] makes the bounded calls; [`stages`]
//! is what each hook does and how it ends ([`outcome`]: the exit statuses).
pub mod agent;
pub mod container;
pub mod error;
pub mod outcome;
pub mod stages;
pub mod state;
