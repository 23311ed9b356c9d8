//! Replays a golden trace (`baton trace --json --raw`, as `tools/gpu-check` writes it) through today's
//! decoder and ledger: each ioctl's captured bytes are decoded again with the layouts of the trace's driver
//! version and must print the very object the trace holds, and the ledger fed the re-decoded calls must
//! reach the peak the agent's ledger reached when the trace was taken. A decoder change that names a call,
//! a class, a control command or a status differently, or reads another offset, shows here.
//!
//! A deliberate decoder change makes a golden trace differ; [`Replay::rewritten`] is the trace as today's
//! decoder writes it (every recorded byte kept, the decoded parts written again), to be committed in its place.
use std::{
    collections::{BTreeMap, HashMap},
    io::Write,
    path::Path,
};

use anyhow::{Context, Result, bail};
use baton_nvidia::{
    decode::{self, Call, Op},
    fdkind::{self, FdKind},
    layout::{DriverVersion, Layout},
};
use baton_tracer::{
    event::{Body, Event, Ioctl, RawParams},
    ledger::ContainerLedger,
    schema::TraceEvent,
};
use serde_json::Value;

use super::count::{self, Counts};

/// What a replay found.
#[derive(Debug, Default)]
pub struct Replay {
    /// ioctls decoded again.
    pub ioctls: u64,
    /// The lines whose object differs from the re-decoded one (line number, recorded, now).
    pub differences: Vec<(usize, Value, Value)>,
    /// The ledger's peak GPU memory over the replayed calls: the highest of the trace's containers.
    pub peak_vram_bytes: u64,
    /// What the decoder cannot name in the re-decoded trace, counted as `tools/gpu-check` counts a trace.
    pub counts: Counts,
    /// Every event of the trace in its order, ioctls as decoded now.
    pub events: Vec<Replayed>,
    /// The trace as today's decoder writes it, one object per line.
    pub rewritten: String,
}

/// One event of a replayed trace.
#[derive(Clone, Debug)]
pub struct Replayed {
    /// Line number in the trace.
    pub line: usize,
    /// The event object: as recorded, or for an ioctl as decoded now.
    pub object: Value,
    /// For an ioctl the driver answered (syscall return 0): the decoded operation and its RM status.
    pub call: Option<(Op, Option<u32>)>,
}

impl Replayed {
    /// The process id (0 when the event has none).
    pub fn pid(&self) -> u64 {
        self.object["pid"].as_u64().unwrap_or_default()
    }

    /// The thread id (0 when the event has none).
    pub fn tid(&self) -> u64 {
        self.object["tid"].as_u64().unwrap_or_default()
    }

    /// The event's kind: `ioctl`, `open`, `close`, `exit`, ...
    pub fn kind(&self) -> &str {
        self.object["event"].as_str().unwrap_or_default()
    }
}

/// The replay's one use of baton-tracer's per-container ledger, whose internals are changing: every ledger
/// call of the replay and of the golden tests goes through here.
#[derive(Clone, Debug, Default)]
pub struct LedgerView(ContainerLedger);

impl LedgerView {
    /// Applies a decoded call of process `pid` that the kernel returned 0 for (on no known file: a replay has
    /// no file mirror). A recorded trace carries the params read at each call's exit only: the call is taken
    /// as read the same at its entry (`baton_tracer::ledger::Readings::agreeing`).
    pub fn apply(&mut self, pid: u32, op: &Op, rm_status: Option<u32>) {
        let readings = baton_tracer::ledger::Readings::agreeing(op, rm_status);
        self.0.apply(pid, None, &readings);
    }

    /// Live RM objects.
    pub fn live_objects(&self) -> usize {
        self.0.live_objects()
    }

    /// Live RM objects by class.
    pub fn live_by_class(&self) -> BTreeMap<u32, usize> {
        self.0.live_by_class()
    }

    /// Bytes of live video memory.
    pub fn vram_bytes(&self) -> u64 {
        self.0.vram_bytes()
    }

    /// The most video memory held at once.
    pub fn peak_vram_bytes(&self) -> u64 {
        self.0.peak_vram_bytes()
    }

    /// Whether object `handle` of `client` is live (`handle == client`: the client itself).
    pub fn is_live(&self, client: u32, handle: u32) -> bool {
        self.0.object(client, handle).is_some()
    }
}

/// Replays the trace in `path` (gzipped when its name ends in `.gz`), decoding with driver `version`'s
/// layouts.
pub fn replay_file(path: &Path, version: &str) -> Result<Replay> {
    replay(&count::read_trace(path)?, version)
}

/// Replays the trace `text` (one JSON object per line), decoding with driver `version`'s layouts.
pub fn replay(text: &str, version: &str) -> Result<Replay> {
    let Some(version) = DriverVersion::parse(version) else {
        bail!("{version:?} is not a driver version (like 580.95.05)");
    };
    let layout = Layout::for_version(version);
    let mut ledgers: HashMap<u64, LedgerView> = HashMap::new();
    let mut out = Replay::default();
    let lines: Vec<&str> = text.lines().collect();
    for object in count::objects(text) {
        let (n, recorded) = object?;
        let (line, object, call) = if recorded["event"] == "ioctl" {
            let event = redecode(&recorded, &layout).with_context(|| format!("line {n}"))?;
            let Body::Ioctl(io) = &event.body else {
                bail!("line {n}: an ioctl decoded as another event");
            };
            out.ioctls += 1;
            let call = (io.ret == 0).then(|| (io.decoded.op.clone(), io.decoded.status));
            if let Some((op, status)) = &call {
                let l = ledgers.entry(event.cgroup_id).or_default();
                l.apply(event.pid, op, *status);
                out.peak_vram_bytes = out.peak_vram_bytes.max(l.peak_vram_bytes());
            }
            let container = recorded["container"].as_str().unwrap_or_default();
            let line = serde_json::to_string(&TraceEvent::new(&event, container).with_raw(&event))?;
            let now: Value = serde_json::from_str(&line)?;
            if now != recorded {
                out.differences.push((n, recorded, now.clone()));
            }
            (line, now, call)
        } else {
            (lines[n - 1].to_owned(), recorded, None)
        };
        out.counts.add(&object);
        out.rewritten.push_str(&line);
        out.rewritten.push('\n');
        out.events.push(Replayed {
            line: n,
            object,
            call,
        });
    }
    Ok(out)
}

/// Writes trace `text` to `path`, gzipped when its name ends in `.gz`.
pub fn write_trace(path: &Path, text: &str) -> Result<()> {
    let bytes = if path.extension().is_some_and(|e| e == "gz") {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        gz.write_all(text.as_bytes())?;
        gz.finish()?
    } else {
        text.as_bytes().to_vec()
    };
    std::fs::write(path, bytes).with_context(|| format!("writing {}", path.display()))
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
            enter: decoded_enter(&decoded),
            decoded,
            raw: RawParams::new(&data, &nested),
        })),
    })
}

/// The entry reading a replayed call is given: its exit's operation for the calls the probes read at entry
/// (a recorded trace has the exit's reading only), none for the others.
fn decoded_enter(decoded: &decode::Decoded) -> Option<Op> {
    matches!(
        decoded.op,
        Op::Alloc { .. }
            | Op::AllocMemory { .. }
            | Op::VidHeapAlloc { .. }
            | Op::Free { .. }
            | Op::VidHeapFree { .. }
    )
    .then(|| decoded.op.clone())
}
