//! The timeline's data: per container, the slices (ioctls), instants (opens, closes, maps, exits), spans
//! (GPU held, frozen, preemption phases) and launch counters, built from `baton trace --json` objects.
use std::collections::{BTreeMap, HashSet};

use serde::Serialize;
use serde_json::Value;

/// A call into the driver that took time: an ioctl.
#[derive(Clone, Debug, Serialize)]
pub struct Slice {
    /// When the call entered the driver, CLOCK_MONOTONIC ns.
    pub ts_ns: u64,
    /// Duration, ns.
    pub dur_ns: u64,
    /// Process and thread.
    pub pid: u32,
    /// Thread.
    pub tid: u32,
    /// Escape or UVM command (`NV_ESC_RM_ALLOC`).
    pub name: String,
    /// RM status name or return value.
    pub result: String,
    /// Device file (`ctl`, `nvidia0`, `uvm`).
    pub fd_kind: String,
}

/// Something without a duration: an open, close, dup, mmap, munmap, exec, exit.
#[derive(Clone, Debug, Serialize)]
pub struct Instant {
    /// When, CLOCK_MONOTONIC ns.
    pub ts_ns: u64,
    /// Thread.
    pub tid: u32,
    /// Process.
    pub pid: u32,
    /// `open nvidiactl = 4`, `close 4`, `exit`.
    pub name: String,
}

/// Which state track a span belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SpanTrack {
    /// From a first NVIDIA file opened to the last one gone.
    Gpu,
    /// Frozen by the cgroup freezer.
    Frozen,
    /// Phases of a preemption.
    Preemption,
}

impl SpanTrack {
    /// The track's name in the viewers.
    pub fn title(self) -> &'static str {
        match self {
            Self::Gpu => "GPU held",
            Self::Frozen => "frozen",
            Self::Preemption => "preemption",
        }
    }
}

/// A state over time (an end of `None`: still so when the trace ended).
#[derive(Clone, Debug, Serialize)]
pub struct Span {
    /// Its track.
    pub track: SpanTrack,
    /// `held`, `frozen`, a phase name.
    pub name: String,
    /// Start, ns.
    pub start_ns: u64,
    /// End, ns.
    pub end_ns: Option<u64>,
}

/// The launches of one interval.
#[derive(Clone, Debug, Serialize)]
pub struct LaunchSample {
    /// End of the interval, ns.
    pub ts_ns: u64,
    /// Length of the interval, ns.
    pub interval_ns: u64,
    /// cuLaunchKernel calls.
    pub kernel: u64,
    /// cuLaunchKernelEx calls.
    pub kernel_ex: u64,
    /// cuGraphLaunch calls.
    pub graph: u64,
}

/// One container's tracks.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ContainerTracks {
    /// Its ioctls.
    pub slices: Vec<Slice>,
    /// Its other calls.
    pub instants: Vec<Instant>,
    /// Its states.
    pub spans: Vec<Span>,
    /// Its launches per interval.
    pub launches: Vec<LaunchSample>,
    /// NVIDIA fds open now, as (pid, fd): the GPU is held while there is one.
    #[serde(skip)]
    open_fds: HashSet<(u32, i64)>,
}

impl ContainerTracks {
    /// The threads that made calls, sorted.
    pub fn threads(&self) -> Vec<(u32, u32)> {
        let mut t: Vec<(u32, u32)> = self
            .slices
            .iter()
            .map(|s| (s.pid, s.tid))
            .chain(self.instants.iter().map(|i| (i.pid, i.tid)))
            .collect::<HashSet<_>>()
            .into_iter()
            .collect();
        t.sort_unstable();
        t
    }

    fn open_span(&mut self, track: SpanTrack, name: &str, at: u64) {
        if self
            .spans
            .iter()
            .any(|s| s.track == track && s.end_ns.is_none())
        {
            return;
        }
        self.spans.push(Span {
            track,
            name: name.to_owned(),
            start_ns: at,
            end_ns: None,
        });
    }

    fn close_span(&mut self, track: SpanTrack, at: u64) {
        if let Some(s) = self
            .spans
            .iter_mut()
            .rev()
            .find(|s| s.track == track && s.end_ns.is_none())
        {
            s.end_ns = Some(at.max(s.start_ns));
        }
    }

    fn fd_added(&mut self, pid: u32, fd: i64, at: u64) {
        self.open_fds.insert((pid, fd));
        self.open_span(SpanTrack::Gpu, "held", at);
    }

    fn fds_gone(&mut self, at: u64, gone: impl Fn(&(u32, i64)) -> bool) {
        let before = self.open_fds.len();
        self.open_fds.retain(|k| !gone(k));
        if before > 0 && self.open_fds.is_empty() {
            self.close_span(SpanTrack::Gpu, at);
        }
    }
}

/// Every container's tracks, by container name, and the time range seen.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Timeline {
    /// By container name.
    pub containers: BTreeMap<String, ContainerTracks>,
    /// First time seen, ns.
    pub start_ns: Option<u64>,
    /// Last time seen, ns.
    pub end_ns: Option<u64>,
}

fn u64_of(v: &Value, key: &str) -> Option<u64> {
    v.get(key).and_then(Value::as_u64)
}

fn str_of<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str)
}

impl Timeline {
    /// Whether nothing was added.
    pub fn is_empty(&self) -> bool {
        self.containers.is_empty()
    }

    /// Adds one `baton trace --json` object (an event, a launch window, a state change); objects of other
    /// kinds, or without a time and a container, are ignored.
    pub fn add(&mut self, v: &Value) {
        let (Some(ts), Some(event)) = (u64_of(v, "ts_ns"), str_of(v, "event")) else {
            return;
        };
        let Some(container) = str_of(v, "container") else {
            return;
        };
        // An ioctl's time is that of its return: it began `latency_ns` before.
        let latency = u64_of(v, "latency_ns").unwrap_or(0);
        let begin = ts.saturating_sub(latency);
        self.start_ns = Some(self.start_ns.map_or(begin, |s| s.min(begin)));
        self.end_ns = Some(self.end_ns.map_or(ts, |e| e.max(ts)));
        let pid = u64_of(v, "pid").unwrap_or(0) as u32;
        let tid = u64_of(v, "tid").unwrap_or(u64::from(pid)) as u32;
        let fd = v.get("fd").and_then(Value::as_i64);
        let c = self.containers.entry(container.to_owned()).or_default();
        match event {
            "ioctl" => c.slices.push(Slice {
                ts_ns: begin,
                dur_ns: latency,
                pid,
                tid,
                name: str_of(v, "escape")
                    .map(str::to_owned)
                    .unwrap_or_else(|| format!("ioctl 0x{:x}", u64_of(v, "cmd").unwrap_or(0))),
                result: str_of(v, "status_name")
                    .map(str::to_owned)
                    .or_else(|| v.get("ret").map(|r| r.to_string()))
                    .unwrap_or_default(),
                fd_kind: str_of(v, "fd_kind").unwrap_or("").to_owned(),
            }),
            "launches" => c.launches.push(LaunchSample {
                ts_ns: ts,
                interval_ns: u64_of(v, "interval_ns").unwrap_or(0),
                kernel: u64_of(v, "kernel").unwrap_or(0),
                kernel_ex: u64_of(v, "kernel_ex").unwrap_or(0),
                graph: u64_of(v, "graph").unwrap_or(0),
            }),
            "frozen" => c.open_span(SpanTrack::Frozen, "frozen", ts),
            "thawed" => c.close_span(SpanTrack::Frozen, ts),
            "preemption" => {
                let phase = str_of(v, "phase").unwrap_or("phase");
                c.close_span(SpanTrack::Preemption, ts);
                match phase {
                    // A park ends frozen: the frozen span goes on until the resume's thaw.
                    "frozen" => c.open_span(SpanTrack::Frozen, "frozen (preemption)", ts),
                    "thawed" => c.close_span(SpanTrack::Frozen, ts),
                    _ => {}
                }
                if phase != "done" {
                    c.open_span(SpanTrack::Preemption, phase, ts);
                }
            }
            other => {
                let name = match (other, fd) {
                    ("open", Some(fd)) => {
                        c.fd_added(pid, fd, ts);
                        format!("open {} = {fd}", str_of(v, "fd_kind").unwrap_or("?"))
                    }
                    ("dup", Some(fd)) => {
                        c.fd_added(pid, fd, ts);
                        format!("dup = {fd}")
                    }
                    ("close", Some(fd)) => {
                        c.fds_gone(ts, |k| *k == (pid, fd));
                        format!("close {fd}")
                    }
                    ("exit" | "exec", _) => {
                        c.fds_gone(ts, |k| k.0 == pid);
                        other.to_owned()
                    }
                    _ => other.to_owned(),
                };
                c.instants.push(Instant {
                    ts_ns: ts,
                    tid,
                    pid,
                    name,
                });
            }
        }
    }
}

/// `baton trace` adds its objects to the timeline as it prints them.
impl baton_agent::trace_output::TimelineSink for Timeline {
    fn add(&mut self, object: &Value) {
        Timeline::add(self, object);
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn ev(ts: u64, event: &str, extra: Value) -> Value {
        let mut v = json!({"ts_ns": ts, "container": "default/trainer", "pid": 7, "tid": 8, "event": event});
        if let (Some(o), Some(e)) = (v.as_object_mut(), extra.as_object()) {
            o.extend(e.clone());
        }
        v
    }

    #[test]
    fn the_gpu_is_held_from_the_first_open_to_the_last_fd_gone() {
        let mut t = Timeline::default();
        t.add(&ev(100, "open", json!({"fd": 4, "fd_kind": "ctl"})));
        t.add(&ev(150, "open", json!({"fd": 5, "fd_kind": "nvidia0"})));
        t.add(&ev(
            200,
            "ioctl",
            json!({"fd": 4, "escape": "NV_ESC_RM_ALLOC", "latency_ns": 30, "status_name": "NV_OK"}),
        ));
        t.add(&ev(300, "close", json!({"fd": 4})));
        let c = &t.containers["default/trainer"];
        assert_eq!(c.spans.len(), 1);
        assert_eq!(c.spans[0].end_ns, None, "fd 5 is still open");
        t.add(&ev(400, "exit", json!({})));
        let c = &t.containers["default/trainer"];
        assert_eq!((c.spans[0].start_ns, c.spans[0].end_ns), (100, Some(400)));
        assert_eq!(c.slices.len(), 1);
        assert_eq!(
            (c.slices[0].ts_ns, c.slices[0].dur_ns),
            (170, 30),
            "it returned at 200"
        );
        assert_eq!(c.slices[0].name, "NV_ESC_RM_ALLOC");
        assert_eq!(c.instants.len(), 4);
        assert_eq!((t.start_ns, t.end_ns), (Some(100), Some(400)));
    }

    #[test]
    fn freezes_and_preemption_phases_are_spans_and_other_objects_are_ignored() {
        let mut t = Timeline::default();
        t.add(&ev(10, "frozen", json!({})));
        t.add(&ev(20, "thawed", json!({})));
        t.add(&ev(30, "preemption", json!({"phase": "locked"})));
        t.add(&ev(40, "preemption", json!({"phase": "checkpointed"})));
        t.add(&ev(50, "preemption", json!({"phase": "done"})));
        t.add(&json!({"event": "launch_probes", "ts_ns": 5, "path": "/x"}));
        t.add(&json!({"not": "an event"}));
        let c = &t.containers["default/trainer"];
        let spans: Vec<_> = c
            .spans
            .iter()
            .map(|s| (s.track, s.name.as_str(), s.start_ns, s.end_ns))
            .collect();
        assert_eq!(
            spans,
            vec![
                (SpanTrack::Frozen, "frozen", 10, Some(20)),
                (SpanTrack::Preemption, "locked", 30, Some(40)),
                (SpanTrack::Preemption, "checkpointed", 40, Some(50)),
            ]
        );
        assert_eq!(t.containers.len(), 1);
    }
}
