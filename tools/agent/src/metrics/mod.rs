//! The agent's Prometheus endpoint (`--metrics-addr`, `http://127.0.0.1:9477/metrics` by default): what the
//! core knows of each watched container (ledger, fds, ioctl counts) and what happened (releases, freezes,
//! preemptions), in the OpenMetrics text format of the `prometheus-client` crate.
//!
//! The core is never slowed by a scrape beyond one snapshot: scrapes ask it over its channel at most once per
//! [`snapshot::MIN_INTERVAL`] (concurrent scrapes share the answer) and give up after
//! [`snapshot::CORE_TIMEOUT`]; encoding happens on the connection's task. Histograms and counters of events
//! are atomics the core, the controller and the connections update in place ([`events`]).
mod encode;
pub mod events;
mod http;
pub mod snapshot;

use std::net::SocketAddr;

use tokio::sync::mpsc;

use super::core::Command;

/// The default address of the endpoint.
pub const DEFAULT_ADDR: &str = "127.0.0.1:9477";

/// Where the endpoint listens, from `--metrics-addr` (`off` turns it off).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MetricsAddr {
    /// No endpoint.
    Off,
    /// Listen here (port 0: any free port, logged).
    At(SocketAddr),
}

impl std::str::FromStr for MetricsAddr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if matches!(s, "off" | "none" | "") {
            return Ok(Self::Off);
        }
        s.parse().map(Self::At).map_err(|e| {
            format!("--metrics-addr {s:?} is not IP:PORT ({e}), e.g. 127.0.0.1:9477, or off")
        })
    }
}

/// Starts the endpoint on the current runtime. A port that cannot be bound (in use, no permission) is
/// logged as an error and the agent runs on without metrics: the release signal matters more than its
/// figures, and an agent a shim starts must not fail because something else holds the port. Returns the
/// address bound.
pub fn spawn(addr: &MetricsAddr, core: mpsc::Sender<Command>) -> Option<SocketAddr> {
    let MetricsAddr::At(addr) = addr else {
        tracing::info!("agent: metrics endpoint off (--metrics-addr off)");
        return None;
    };
    let listener = match std::net::TcpListener::bind(addr)
        .and_then(|l| l.set_nonblocking(true).map(|()| l))
        .and_then(tokio::net::TcpListener::from_std)
    {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(
                "agent: cannot serve metrics on {addr}: {e}; running without metrics (free the port, or \
                 pass --metrics-addr IP:PORT for another one, or --metrics-addr off)"
            );
            return None;
        }
    };
    let bound = listener.local_addr().unwrap_or(*addr);
    tracing::info!("agent: metrics on http://{bound}/metrics");
    let source = snapshot::Source::new(core);
    tokio::spawn(http::serve(listener, source));
    Some(bound)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flag_takes_an_address_or_off() {
        assert_eq!("off".parse::<MetricsAddr>(), Ok(MetricsAddr::Off));
        assert_eq!(
            DEFAULT_ADDR.parse::<MetricsAddr>(),
            Ok(MetricsAddr::At(([127, 0, 0, 1], 9477).into()))
        );
        let e = "localhost".parse::<MetricsAddr>().unwrap_err();
        assert!(e.contains("IP:PORT"), "{e}");
    }
}
