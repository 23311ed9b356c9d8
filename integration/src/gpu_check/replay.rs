//! Replays a golden trace (`baton trace --json --raw`, as `tools/gpu-check` writes it) through today's
//! decoder and ledger: each ioctl's captured bytes are decoded again with the layouts of the trace's driver
//! version and must print the very object the trace holds, and the ledger fed the re-decoded calls must
//! reach the peak the agent's ledger reached when the trace was taken. A decoder change that names a call,
//! a class, a control command or a status differently, or reads another offset, shows here.
use std::path::Path;

use anyhow::{Context, Result, bail};
use baton_nvidia::{
    decode::{self, Call},
    fdkind::{self, FdKind},
    layout::{DriverVersion, Layout},
};
use baton_tracer::{
    event::{Body, Event, Ioctl, RawParams},
    ledger::Ledger,
    schema::TraceEvent,
};
use serde_json::Value;

use super::count;

/// What a replay found.
#[derive(Debug, Default)]
pub struct Replay {
    /// ioctls decoded again.
    pub ioctls: u64,
    /// The lines whose object differs from the re-decoded one (line number, recorded, now).
    pub differences: Vec<(usize, Value, Value)>,
    /// The ledger's peak GPU memory over the replayed calls, summed over the trace's processes.
    pub peak_vram_bytes: u64,
}

/// Replays the trace in `path`, decoding with driver `version`'s layouts.
pub fn replay_file(path: &Path, version: &str) -> Result<Replay> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    replay(&text, version)
}

/// Replays the trace `text` (one JSON object per line), decoding with driver `version`'s layouts.
pub fn replay(text: &str, version: &str) -> Result<Replay> {
    let Some(version) = DriverVersion::parse(version) else {
        bail!("{version:?} is not a driver version (like 580.95.05)");
    };
    let layout = Layout::for_version(version);
    let mut ledger = Ledger::default();
    let mut out = Replay::default();
    for object in count::objects(text) {
        let (n, recorded) = object?;
        if recorded["event"] != "ioctl" {
            continue;
        }
        let event = redecode(&recorded, &layout).with_context(|| format!("line {n}"))?;
        let Body::Ioctl(io) = &event.body else {
            continue;
        };
        out.ioctls += 1;
        if io.ret == 0 {
            let l = ledger.container_mut(event.cgroup_id);
            l.apply(event.pid, None, &io.decoded.op, io.decoded.status);
            out.peak_vram_bytes = out.peak_vram_bytes.max(l.peak_vram_bytes());
        }
        let container = recorded["container"].as_str().unwrap_or_default();
        let now = serde_json::to_value(TraceEvent::new(&event, container).with_raw(&event))?;
        if now != recorded {
            out.differences.push((n, recorded, now));
        }
    }
    Ok(out)
}

/// The event a recorded ioctl object came from, decoded again from its `params` and `nested`.
fn redecode(recorded: &Value, layout: &Layout) -> Result<Event> {
    let number = |key: &str| {
        recorded[key]
            .as_u64()
            .with_context(|| format!("no {key} in {recorded}"))
    };
    let hex_of = |key: &str| -> Result<Vec<u8>> {
        Ok(hex::decode(recorded[key].as_str().unwrap_or_default())?)
    };
    let Some(params) = recorded.get("params") else {
        bail!("an ioctl without `params`: the trace was not taken with --raw");
    };
    let data = hex::decode(params.as_str().unwrap_or_default())?;
    let nested = hex_of("nested")?;
    let label = recorded["fd_kind"].as_str().unwrap_or("unknown");
    let (fd_kind, minor) = fdkind::classify_name(label.as_bytes()).unwrap_or((FdKind::Unknown, 0));
    let cmd = u32::try_from(number("cmd")?)?;
    let decoded = decode::decode(
        &Call {
            fd_kind,
            cmd,
            data: &data,
            nested: &nested,
        },
        layout,
    );
    Ok(Event {
        ts_ns: number("ts_ns")?,
        cgroup_id: number("cgroup_id")?,
        pid: u32::try_from(number("pid")?)?,
        tid: u32::try_from(number("tid")?)?,
        body: Body::Ioctl(Box::new(Ioctl {
            fd: i32::try_from(recorded["fd"].as_i64().unwrap_or(-1))?,
            fd_kind,
            minor,
            cmd,
            ret: recorded["ret"].as_i64().unwrap_or(0),
            latency_ns: number("latency_ns")?,
            decoded,
            raw: RawParams::new(&data, &nested),
        })),
    })
}
