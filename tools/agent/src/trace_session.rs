//! `baton trace` sessions served from the agent's probe set: each resolves its selection like a standalone
//! trace (watching, trace-only, the cgroups it names that no registration watches), renders the events of
//! those cgroups with the same code, and sends its lines to its connection.
use std::{collections::HashSet, io::Write};

use baton_agent_api::TraceRequest;
use baton_tracer::{Tracer, cgroups, event::Event as Record, now_monotonic_ns};
use tokio::sync::mpsc;

use super::core::{Note, NoteKind};
use crate::trace_output::{LaunchMeter, Output, Selection, StateKind, Summary};

/// Lines a slow trace client may fall behind by before lines are dropped (and counted).
pub const LINE_BUFFER: usize = 16384;

/// A `Write` that sends each complete line to a connection; a full channel drops the line.
pub struct LineSender {
    tx: mpsc::Sender<String>,
    partial: Vec<u8>,
    lost: u64,
}

impl Write for LineSender {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.partial.extend_from_slice(buf);
        while let Some(end) = self.partial.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = self.partial.drain(..=end).collect();
            let text = String::from_utf8_lossy(&line[..end]).into_owned();
            if self.tx.try_send(text).is_err() {
                self.lost += 1;
            }
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The device directory a trace follows when it names none.
pub const DEFAULT_DEVICE_DIR: &str = "/dev/";

/// One client's trace.
pub struct TraceSession {
    selection: Selection,
    output: Output<LineSender>,
    /// `--all`: every process.
    pub all: bool,
    summary: bool,
    meter: LaunchMeter,
    /// Between launch lines.
    pub launch_every: std::time::Duration,
    /// The device directories it follows (`/dev/` when it named none): their probe slots stay while it runs.
    pub prefixes: Vec<String>,
    last_launch_ns: u64,
}

impl TraceSession {
    /// Resolves `req` on `tracer` (watching what it names) and starts sending to `tx`.
    pub fn start(
        req: &TraceRequest,
        tracer: &mut Tracer,
        tx: mpsc::Sender<String>,
    ) -> Result<Self, String> {
        for p in &req.prefixes {
            tracer
                .add_prefix(p)
                .map_err(|e| format!("cannot follow device directory {p}: {e}"))?;
        }
        let mut selection = Selection {
            names: req.containers.clone(),
            watched: HashSet::new(),
        };
        for path in &req.cgroups {
            let id = tracer
                .cgroups_mut()
                .id_of_path(std::path::Path::new(path))
                .map_err(|e| e.to_string())?;
            selection.watched.insert(id);
        }
        for pid in &req.pids {
            let root = tracer.cgroup_root().to_path_buf();
            let id = cgroups::cgroup_id_of_pid(&root, *pid as i32)
                .ok_or_else(|| format!("no process {pid} (or it has no cgroup v2)"))?;
            selection.watched.insert(id);
        }
        for id in selection.watched.clone() {
            tracer.watch_cgroup(id).map_err(|e| e.to_string())?;
        }
        selection.refresh(tracer).map_err(|e| format!("{e:#}"))?;
        if req.all {
            tracer.set_watch_all(true).map_err(|e| e.to_string())?;
        }
        // The agent's counters ran before this session: what they read now is not its launches.
        let mut meter = LaunchMeter::default();
        let only = (!req.all).then_some(&selection.watched);
        meter.tick(tracer, only);
        let t0 = now_monotonic_ns();
        Ok(Self {
            meter,
            launch_every: std::time::Duration::from_millis(
                req.launch_interval_ms.unwrap_or(1000).max(1),
            ),
            last_launch_ns: t0,
            prefixes: if req.prefixes.is_empty() {
                vec![DEFAULT_DEVICE_DIR.to_owned()]
            } else {
                req.prefixes.clone()
            },
            selection,
            output: Output {
                out: LineSender {
                    tx,
                    partial: Vec::new(),
                    lost: 0,
                },
                summary: Summary::default(),
                pids: req.pids.iter().copied().collect(),
                json: req.json,
                raw: req.raw,
                quiet: req.quiet,
                t0,
                probes_shown: HashSet::new(),
                // The client builds the timeline from the JSON objects it asks for.
                timeline: None,
            },
            all: req.all,
            summary: req.summary,
        })
    }

    /// Whether it traces cgroup `id`.
    pub fn traces_cgroup(&self, id: u64) -> bool {
        self.all || self.selection.watched.contains(&id)
    }

    /// Whether it names containers, which are looked for again from time to time.
    pub fn has_names(&self) -> bool {
        !self.selection.names.is_empty()
    }

    /// Watches the containers started since that match its names.
    pub fn refresh(&mut self, tracer: &mut Tracer) {
        if let Err(e) = self.selection.refresh(tracer) {
            tracing::warn!("agent: trace: {e:#}");
        }
    }

    /// Sends the lines of the events it selects.
    pub fn take(&mut self, records: &[Record], tracer: &mut Tracer) {
        let only = (!self.all).then_some(&self.selection.watched);
        if let Err(e) = self.output.take(records, tracer, &mut |_| {}, only) {
            tracing::warn!("agent: trace: {e:#}");
        }
    }

    /// Sends the line of a freeze, thaw or preemption step of container `cgroup_id`.
    pub fn note(&mut self, cgroup_id: u64, note: &Note, tracer: &mut Tracer) {
        let change = match &note.kind {
            NoteKind::Frozen { latency_ns } => StateKind::Frozen {
                latency_ns: *latency_ns,
            },
            NoteKind::Thawed { latency_ns } => StateKind::Thawed {
                latency_ns: *latency_ns,
            },
            NoteKind::Preemption { phase, detail, .. } => StateKind::Preemption {
                phase: phase.label(),
                detail,
            },
            NoteKind::GapFill { filling, detail } => StateKind::GapFill {
                filling: *filling,
                detail,
            },
            NoteKind::Room { what, detail } => StateKind::Room { what, detail },
        };
        if let Err(e) = self.output.state(cgroup_id, note.t_ns, change, tracer) {
            tracing::warn!("agent: trace: {e:#}");
        }
    }

    /// Sends a line per traced container with the CUDA launches since the last one.
    pub fn launches(&mut self, tracer: &mut Tracer) {
        let now = now_monotonic_ns();
        let only = (!self.all).then_some(&self.selection.watched);
        let deltas = self.meter.tick(tracer, only);
        let interval = now.saturating_sub(self.last_launch_ns);
        self.last_launch_ns = now;
        if let Err(e) = self.output.launches(&deltas, tracer, now, interval) {
            tracing::warn!("agent: trace: {e:#}");
        }
    }

    /// Ends it: sends the launches since the last line and the summary if asked; returns the cgroups it
    /// watched.
    pub fn finish(mut self, tracer: &mut Tracer) -> HashSet<u64> {
        self.launches(tracer);
        if self.summary {
            let report = self.output.summary.render(tracer);
            let _ = writeln!(self.output.out, "{report}");
        }
        if self.output.out.lost > 0 {
            tracing::warn!(
                lost = self.output.out.lost,
                "agent: a trace client fell behind: lines were dropped"
            );
        }
        self.selection.watched
    }
}
