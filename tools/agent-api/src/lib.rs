//! The node agent's local API (docs/api.md): newline-delimited JSON over a root-only unix socket.
//!
//! [`protocol`] is the one definition of its messages; [`client`] is the async client the shim, the `baton`
//! CLI and the OCI hooks use, including [`client::connect_or_start`], which starts a detached agent when
//! nothing answers on a plain node.
pub mod client;
pub mod control;
pub mod devices;
pub mod driver_helper;
pub mod duration;
pub mod gapfill;
pub mod host_copy;
pub mod limits;
pub mod lines;
pub mod option_keys;
pub mod preempt;
pub mod protocol;
pub mod room;
pub mod status;

pub use client::{Client, ClientError, Endpoint, connect_or_start};
pub use control::*;
pub use devices::nvidia_devices_in;
pub use duration::{DURATION_SYNTAX, MAX_WAIT_GPU_FREE, parse_duration};
pub use gapfill::{
    FinishedCoRunner, GapFillStatus, GpuGapFill, ParkedCoRunner, Preempting, RateGateSettings,
};
pub use host_copy::{
    HostMemory, ParkMemory, ParkedHostMemory, RaisedLimit, host_copy_need, room_for_host_copy,
};
pub use lines::{BoundedLines, MAX_REPLY_LINE, MAX_REQUEST_LINE};
pub use preempt::*;
pub use protocol::*;
pub use status::*;

/// Where the agent listens unless configured otherwise (TOML `agent_socket`, `BATON_AGENT_SOCKET`).
pub const DEFAULT_SOCKET: &str = "/run/baton/agent.sock";

/// The environment variable that names the agent's socket for every Baton program started with it.
pub const SOCKET_ENV: &str = "BATON_AGENT_SOCKET";

/// The agent's socket: `BATON_AGENT_SOCKET` when set, else [`DEFAULT_SOCKET`].
pub fn default_socket() -> std::path::PathBuf {
    std::env::var_os(SOCKET_ENV)
        .filter(|v| !v.is_empty())
        .map_or_else(|| DEFAULT_SOCKET.into(), Into::into)
}

/// CLOCK_MONOTONIC now, in ns: the clock of every time in the protocol (the probes' clock).
pub fn now_monotonic_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).map_or(0, |t| {
        u64::try_from(t.tv_sec()).unwrap_or(0) * 1_000_000_000
            + u64::try_from(t.tv_nsec()).unwrap_or(0)
    })
}

/// The device directory of a `trace_prefix`, what the probes follow opens in (`/dev/nvidia` -> `/dev/`).
pub fn device_dir(trace_prefix: &str) -> &str {
    trace_prefix
        .rfind('/')
        .map_or("/dev/", |i| &trace_prefix[..=i])
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_device_dir_is_the_prefix_up_to_its_last_slash() {
        assert_eq!(super::device_dir("/dev/nvidia"), "/dev/");
        assert_eq!(super::device_dir("/run/mock/dev/"), "/run/mock/dev/");
        assert_eq!(super::device_dir("nvidia"), "/dev/");
    }
}
