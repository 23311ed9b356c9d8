//! What a trace session is, wherever its probes are (`baton trace`'s own, or the agent's): the selection the
//! options resolve to, and the output (live lines or JSON objects, the launch lines and the summary). One
//! definition for both, so that a trace through the agent prints what a standalone one does.
pub mod launches;
mod render;
mod summary;

use std::{collections::HashSet, io::Write};

use baton_tracer::{
    LaunchCounts, Tracer, TracerError, cgroups,
    event::Event,
    now_monotonic_ns,
    schema::{LaunchProbes, LaunchWindow, StateChange, TraceEvent},
};

pub use launches::LaunchMeter;
pub use summary::Summary;

/// Why a trace's output failed: writing, encoding or the probes (shown as the cause itself).
#[derive(Debug, thiserror::Error)]
pub enum OutputError {
    /// Writing the lines failed.
    #[error(transparent)]
    Write(#[from] std::io::Error),
    /// Encoding an object failed.
    #[error(transparent)]
    Json(#[from] serde_json::Error),
    /// The probes refused to watch a cgroup.
    #[error(transparent)]
    Tracer(#[from] TracerError),
}

/// Where the objects of a trace also go, as `--json` prints them: the timeline `baton trace` builds
/// (`--perfetto`, `--html`).
pub trait TimelineSink {
    /// Takes one object.
    fn add(&mut self, object: &serde_json::Value);
}

/// No timeline: the agent's trace sessions (their client builds it from the JSON objects it asks for).
pub enum NoTimeline {}

impl TimelineSink for NoTimeline {
    fn add(&mut self, _: &serde_json::Value) {
        match *self {}
    }
}

/// What the selection options resolve to.
pub struct Selection {
    /// `--container` names.
    pub names: Vec<String>,
    /// The cgroups traced.
    pub watched: HashSet<u64>,
}

impl Selection {
    /// Watches every cgroup whose container name or path matches a `--container` name.
    pub fn refresh(&mut self, tracer: &mut Tracer) -> Result<(), TracerError> {
        if self.names.is_empty() {
            return Ok(());
        }
        tracer.cgroups_mut().rescan();
        let matches: Vec<u64> = tracer
            .cgroups_mut()
            .entries()
            .filter(|(_, path)| self.names.iter().any(|n| name_matches(n, path)))
            .map(|(id, _)| id)
            .collect();
        for id in matches {
            if self.watched.insert(id) {
                tracer.watch_cgroup(id)?;
            }
        }
        Ok(())
    }
}

/// Whether `--container name` selects the cgroup at `path`.
pub fn name_matches(name: &str, path: &str) -> bool {
    let cname = cgroups::container_name(path);
    cname == name
        || path
            .trim_end_matches(".scope")
            .ends_with(&format!("/{name}"))
        || path
            .trim_end_matches(".scope")
            .ends_with(&format!("-{name}"))
        || (name.len() >= 12 && cname.len() == 12 && name.starts_with(&cname))
}

/// Where events go: the live lines or JSON objects, and the summary.
pub struct Output<W: Write, T: TimelineSink = NoTimeline> {
    /// Where lines go.
    pub out: W,
    /// Counts for `--summary`.
    pub summary: Summary,
    /// `--pid` filter (empty: every process of the traced containers).
    pub pids: HashSet<u32>,
    /// JSON objects instead of text lines.
    pub json: bool,
    /// With `json`: each ioctl's captured bytes too (`--raw`).
    pub raw: bool,
    /// No live lines.
    pub quiet: bool,
    /// Time origin of the text lines.
    pub t0: u64,
    /// The libcuda files (device, inode) whose launch uprobes it has shown.
    pub probes_shown: HashSet<(u64, u64)>,
    /// The timeline being built (`--perfetto`, `--html`), from the same objects `--json` prints.
    pub timeline: Option<T>,
}

impl<W: Write, T: TimelineSink> Output<W, T> {
    /// Takes a batch of events: the ones `--pid` selects (and, when `only` is given, of those cgroups) are
    /// counted, handed to `on_event` and printed.
    pub fn take(
        &mut self,
        events: &[Event],
        tracer: &mut Tracer,
        on_event: &mut impl FnMut(&Event),
        only: Option<&HashSet<u64>>,
    ) -> Result<(), OutputError> {
        for e in events.iter().filter(|e| {
            (self.pids.is_empty() || self.pids.contains(&e.pid))
                && only.is_none_or(|set| set.contains(&e.cgroup_id))
        }) {
            on_event(e);
            self.summary.add(e);
            if self.quiet && self.timeline.is_none() {
                continue;
            }
            let name = tracer.container_name(e.cgroup_id);
            if let Some(t) = &mut self.timeline {
                t.add(&serde_json::to_value(TraceEvent::new(e, &name))?);
            }
            if !self.quiet {
                emit(&mut self.out, e, &name, (self.json, self.raw), self.t0)?;
            }
        }
        self.show_new_launch_probes(tracer)?;
        self.out.flush()?;
        Ok(())
    }

    /// Prints a line for each libcuda file the tracer attached launch uprobes to since the last call: launches
    /// through it are counted from then on (and a workload that waits for this line launches only once they
    /// are, since the breakpoints appear in its code before the programs are attached).
    fn show_new_launch_probes(&mut self, tracer: &Tracer) -> Result<(), OutputError> {
        let now = now_monotonic_ns();
        for lib in tracer.launch_libraries() {
            if !self.probes_shown.insert((lib.dev, lib.ino)) || self.quiet {
                continue;
            }
            if self.json {
                let probes = LaunchProbes {
                    ts_ns: now,
                    event: "launch_probes",
                    pid: lib.pid,
                    path: &lib.path,
                    entry_points: lib.probed.iter().map(|f| f.symbol()).collect(),
                };
                serde_json::to_writer(&mut self.out, &probes)?;
                writeln!(self.out)?;
            } else {
                writeln!(
                    self.out,
                    "{}",
                    render::launch_probes_line(now, lib, self.t0)
                )?;
            }
        }
        Ok(())
    }
}

/// A change of a container's state that the agent made (trace sessions through the agent show them).
#[derive(Clone, Copy, Debug)]
pub enum StateKind<'a> {
    /// Frozen by the controller, confirmed after `latency_ns`.
    Frozen {
        /// Write to confirmation, ns.
        latency_ns: u64,
    },
    /// Thawed by the controller.
    Thawed {
        /// Write to confirmation, ns.
        latency_ns: u64,
    },
    /// A preemption step.
    Preemption {
        /// The step's name.
        phase: &'a str,
        /// What it says.
        detail: &'a str,
    },
    /// The gate's room decided for the container (`beside`, `parked`, `resumed`).
    Room {
        /// What happened.
        what: &'a str,
        /// Who, and the figures.
        detail: &'a str,
    },
    /// The rate gate started (`filling`) or stopped filling a GPU the container is on.
    GapFill {
        /// Whether the agent fills it now.
        filling: bool,
        /// The GPU and the rule with its figures.
        detail: &'a str,
    },
}

impl<W: Write, T: TimelineSink> Output<W, T> {
    /// Takes a state change of container `cgroup_id` at `ts_ns`: printed (`+++ frozen (52 us) +++`) and
    /// added to the timeline.
    pub fn state(
        &mut self,
        cgroup_id: u64,
        ts_ns: u64,
        kind: StateKind<'_>,
        tracer: &mut Tracer,
    ) -> Result<(), OutputError> {
        let name = tracer.container_name(cgroup_id);
        let (event, phase, detail, latency_ns) = match kind {
            StateKind::Frozen { latency_ns } => ("frozen", None, None, Some(latency_ns)),
            StateKind::Thawed { latency_ns } => ("thawed", None, None, Some(latency_ns)),
            StateKind::Preemption { phase, detail } => (
                "preemption",
                Some(phase),
                Some(detail).filter(|d| !d.is_empty()),
                None,
            ),
            StateKind::Room { what, detail } => ("room", Some(what), Some(detail), None),
            StateKind::GapFill { filling, detail } => (
                "gap_fill",
                Some(if filling { "on" } else { "off" }),
                Some(detail),
                None,
            ),
        };
        let change = StateChange {
            ts_ns,
            cgroup_id,
            container: &name,
            event,
            phase,
            detail,
            latency_ns,
        };
        if let Some(t) = &mut self.timeline {
            t.add(&serde_json::to_value(&change)?);
        }
        if self.quiet {
            return Ok(());
        }
        if self.json {
            serde_json::to_writer(&mut self.out, &change)?;
            writeln!(self.out)?;
        } else {
            writeln!(self.out, "{}", render::state_line(&change, self.t0))?;
        }
        self.out.flush()?;
        Ok(())
    }

    /// Takes the launches of an interval that ended at `ts_ns`: counted, and printed (one line or JSON object
    /// per container).
    pub fn launches(
        &mut self,
        deltas: &[(u64, LaunchCounts)],
        tracer: &mut Tracer,
        ts_ns: u64,
        interval_ns: u64,
    ) -> Result<(), OutputError> {
        self.show_new_launch_probes(tracer)?;
        for (id, n) in deltas {
            self.summary.add_launches(*id, n);
            let name = tracer.container_name(*id);
            let window = LaunchWindow {
                ts_ns,
                cgroup_id: *id,
                container: &name,
                event: "launches",
                interval_ns,
                launches: *n,
            };
            if let Some(t) = &mut self.timeline {
                t.add(&serde_json::to_value(&window)?);
            }
            if self.quiet {
                continue;
            }
            if self.json {
                serde_json::to_writer(&mut self.out, &window)?;
                writeln!(self.out)?;
            } else {
                let line = render::launch_line(ts_ns, &name, interval_ns, n, self.t0);
                writeln!(self.out, "{line}")?;
            }
        }
        self.out.flush()?;
        Ok(())
    }
}

fn emit(
    out: &mut dyn Write,
    e: &Event,
    name: &str,
    (json, raw): (bool, bool),
    t0: u64,
) -> Result<(), OutputError> {
    if json {
        let object = TraceEvent::new(e, name);
        let object = if raw { object.with_raw(e) } else { object };
        serde_json::to_writer(&mut *out, &object)?;
        writeln!(out)?;
    } else {
        writeln!(out, "{}", render::line(e, name, t0))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn container_names_match_ids_and_paths() {
        let id = "0123456789abcdef".repeat(4);
        assert!(name_matches("default/trainer", "/default/trainer"));
        assert!(name_matches("trainer", "/default/trainer"));
        assert!(name_matches(
            &id,
            &format!("/kubepods/besteffort/pod1/{id}")
        ));
        assert!(name_matches(
            "0123456789ab",
            &format!("/kubepods.slice/x.slice/cri-containerd-{id}.scope")
        ));
        assert!(!name_matches("train", "/default/trainer"));
    }
}
