//! The timeline as Chrome trace-event JSON (`{"traceEvents": [...]}`), which the Perfetto UI and
//! chrome://tracing open: a process per container, a thread track per traced thread with its ioctls as
//! complete (`X`) slices and other calls as instants, a track each for the GPU held, frozen and preemption
//! spans, and a counter of the CUDA launches per interval. Times are microseconds from the first event.
use serde_json::{Value, json};

use super::model::{ContainerTracks, SpanTrack, Timeline};

/// Thread ids of the state tracks, kept clear of real thread ids (Linux caps pids at 2^22).
const STATE_TID_BASE: u64 = 1 << 30;

fn state_tid(track: SpanTrack) -> u64 {
    STATE_TID_BASE
        + match track {
            SpanTrack::Gpu => 0,
            SpanTrack::Frozen => 1,
            SpanTrack::Preemption => 2,
        }
}

/// Microseconds from `t0`.
fn us(ns: u64, t0: u64) -> f64 {
    ns.saturating_sub(t0) as f64 / 1000.0
}

/// Renders `t` as trace-event JSON.
pub fn render(t: &Timeline) -> anyhow::Result<Vec<u8>> {
    let t0 = t.start_ns.unwrap_or(0);
    let end = t.end_ns.unwrap_or(t0);
    let mut events = Vec::new();
    for (i, (name, c)) in t.containers.iter().enumerate() {
        container_events(&mut events, i as u64 + 1, name, c, t0, end);
    }
    let doc = json!({
        "traceEvents": events,
        "displayTimeUnit": "ns",
        "otherData": {"generator": "baton trace", "clock": "CLOCK_MONOTONIC", "t0_ns": t0},
    });
    Ok(serde_json::to_vec(&doc)?)
}

fn meta(pid: u64, tid: Option<u64>, what: &str, args: Value) -> Value {
    let mut e = json!({"ph": "M", "pid": pid, "name": what, "args": args});
    if let Some(tid) = tid {
        e["tid"] = json!(tid);
    }
    e
}

fn container_events(
    out: &mut Vec<Value>,
    pid: u64,
    name: &str,
    c: &ContainerTracks,
    t0: u64,
    end: u64,
) {
    out.push(meta(pid, None, "process_name", json!({"name": name})));
    out.push(meta(
        pid,
        None,
        "process_sort_index",
        json!({"sort_index": pid}),
    ));
    for track in [SpanTrack::Gpu, SpanTrack::Frozen, SpanTrack::Preemption] {
        let tid = state_tid(track);
        out.push(meta(
            pid,
            Some(tid),
            "thread_name",
            json!({"name": track.title()}),
        ));
        // The state tracks above the threads: sort indices -3, -2, -1.
        let sort_index = (tid - STATE_TID_BASE) as i64 - 3;
        out.push(meta(
            pid,
            Some(tid),
            "thread_sort_index",
            json!({"sort_index": sort_index}),
        ));
    }
    for (p, tid) in c.threads() {
        out.push(meta(
            pid,
            Some(u64::from(tid)),
            "thread_name",
            json!({"name": format!("{p}/{tid}")}),
        ));
    }
    for s in &c.spans {
        let stop = s.end_ns.unwrap_or(end);
        out.push(json!({
            "ph": "X", "pid": pid, "tid": state_tid(s.track), "name": s.name, "cat": "state",
            "ts": us(s.start_ns, t0), "dur": (stop.saturating_sub(s.start_ns) as f64 / 1000.0).max(0.001),
            "args": {"still_at_end": s.end_ns.is_none()},
        }));
    }
    for s in &c.slices {
        out.push(json!({
            "ph": "X", "pid": pid, "tid": s.tid, "name": s.name, "cat": "ioctl",
            "ts": us(s.ts_ns, t0), "dur": (s.dur_ns as f64 / 1000.0).max(0.001),
            "args": {"result": s.result, "fd": s.fd_kind, "pid": s.pid},
        }));
    }
    for i in &c.instants {
        out.push(json!({
            "ph": "i", "s": "t", "pid": pid, "tid": i.tid, "name": i.name, "cat": "call",
            "ts": us(i.ts_ns, t0),
        }));
    }
    for l in &c.launches {
        out.push(json!({
            "ph": "C", "pid": pid, "name": "CUDA launches", "ts": us(l.ts_ns, t0),
            "args": {"cuLaunchKernel": l.kernel, "cuLaunchKernelEx": l.kernel_ex, "cuGraphLaunch": l.graph},
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_container_is_a_process_with_its_ioctls_as_complete_slices() {
        let mut t = Timeline::default();
        for (ts, event, extra) in [
            (1_000, "open", json!({"fd": 4, "fd_kind": "ctl"})),
            (
                7_000,
                "ioctl",
                json!({"fd": 4, "escape": "NV_ESC_RM_ALLOC", "latency_ns": 5_000}),
            ),
            (9_000, "close", json!({"fd": 4})),
        ] {
            let mut v =
                json!({"ts_ns": ts, "container": "ns/a", "pid": 3, "tid": 4, "event": event});
            if let (Some(o), Some(e)) = (v.as_object_mut(), extra.as_object()) {
                o.extend(e.clone());
            }
            t.add(&v);
        }
        let doc: Value = serde_json::from_slice(&render(&t).unwrap()).unwrap();
        let events = doc["traceEvents"].as_array().unwrap();
        let slice = events.iter().find(|e| e["cat"] == "ioctl").unwrap();
        assert_eq!(slice["ph"], "X");
        assert_eq!(slice["ts"], 1.0);
        assert_eq!(slice["dur"], 5.0);
        let held = events.iter().find(|e| e["cat"] == "state").unwrap();
        assert_eq!(
            (
                held["name"].as_str(),
                held["ts"].as_f64(),
                held["dur"].as_f64()
            ),
            (Some("held"), Some(0.0), Some(8.0))
        );
        assert!(
            events
                .iter()
                .any(|e| e["ph"] == "M" && e["args"]["name"] == "ns/a")
        );
    }
}
