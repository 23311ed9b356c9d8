//! `baton trace --perfetto FILE --html FILE` of a mock CUDA workload, standalone and through the agent: the
//! Chrome trace-event JSON has the container as a process with every ioctl the workload made as a slice and
//! its GPU-held span, `baton timeline` makes the same from the `--json` output, and the HTML page, rendered
//! in headless Chromium, draws the tracks.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use std::{path::Path, process::Command, time::Duration};

use baton_integration::{
    agent::AgentProcess,
    browser, skip,
    trace_env::{BatonTrace, TraceEnv, missing_trace_prerequisite, workspace_binary},
};
use serde_json::Value;

const WAIT: Duration = Duration::from_secs(30);

macro_rules! require {
    ($reason:expr) => {
        if let Some(reason) = $reason {
            skip::missing(&reason);
            return;
        }
    };
}

/// Traces one mock workload in cgroup `job` with `flags`, through `agent` if given; returns the number of
/// ioctls the workload made.
fn trace_workload(
    env: &mut TraceEnv,
    flags: &[&Path],
    agent: Option<&Path>,
    json_out: &Path,
) -> u64 {
    env.make_cgroup("job").unwrap();
    let mut command = Command::new(workspace_binary("baton", "baton").unwrap());
    command
        .arg("trace")
        .arg("--json")
        .arg("--cgroup")
        .arg(env.cgroup_rel("job"))
        .arg("--prefix")
        .arg(env.prefix())
        .arg("-o")
        .arg(json_out);
    for (flag, path) in ["--perfetto", "--html"].iter().zip(flags) {
        command.arg(flag).arg(path);
    }
    match agent {
        Some(socket) => command.env(baton_agent_api::SOCKET_ENV, socket),
        None => command.arg("--standalone"),
    };
    let trace = BatonTrace::start(command, WAIT).unwrap();
    let w = env.spawn_workload("job", 64, 2).unwrap();
    let summary = env.workload(w).finish().unwrap();
    let (status, stderr) = trace.stop().unwrap();
    assert!(status.success(), "baton trace failed: {status}\n{stderr}");
    summary.escapes.values().sum::<u64>() + summary.uvm_commands.values().sum::<u64>()
}

fn read_json(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

/// Checks a trace-event document: the container is a named process whose thread track holds `ioctls` complete
/// slices, and a GPU-held span that ended (the workload closed everything).
fn check_perfetto(doc: &Value, container_suffix: &str, ioctls: u64) {
    let events = doc["traceEvents"].as_array().expect("a traceEvents array");
    for e in events {
        let ph = e["ph"].as_str().expect("every event has a phase");
        assert!(["M", "X", "i", "C"].contains(&ph), "unexpected phase: {e}");
        assert!(e["pid"].is_u64(), "every event has a pid: {e}");
        if ph != "M" {
            assert!(e["ts"].as_f64().is_some_and(|t| t >= 0.0), "{e}");
            assert!(e["name"].is_string(), "{e}");
        }
        if ph == "X" {
            assert!(e["dur"].as_f64().is_some_and(|d| d > 0.0), "{e}");
        }
    }
    let process = events
        .iter()
        .find(|e| {
            e["name"] == "process_name"
                && e["args"]["name"]
                    .as_str()
                    .is_some_and(|n| n.ends_with(container_suffix))
        })
        .unwrap_or_else(|| panic!("no process named *{container_suffix}"));
    let pid = &process["pid"];
    let slices = events
        .iter()
        .filter(|e| &e["pid"] == pid && e["ph"] == "X" && e["cat"] == "ioctl")
        .count() as u64;
    assert_eq!(slices, ioctls, "one slice per ioctl the workload made");
    let held: Vec<&Value> = events
        .iter()
        .filter(|e| &e["pid"] == pid && e["cat"] == "state" && e["name"] == "held")
        .collect();
    assert_eq!(held.len(), 1, "one GPU-held span: {held:?}");
    assert_eq!(held[0]["args"]["still_at_end"], false, "{:?}", held[0]);
}

#[test]
fn a_standalone_trace_writes_a_perfetto_timeline_and_an_html_page_chromium_draws() {
    require!(missing_trace_prerequisite());
    require!(browser::missing_browser());
    let mut env = TraceEnv::start("timeline", "595.45.04").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (perfetto, html, jsonl) = (
        dir.path().join("trace.json"),
        dir.path().join("trace.html"),
        dir.path().join("events.jsonl"),
    );
    let ioctls = trace_workload(&mut env, &[&perfetto, &html], None, &jsonl);
    assert!(ioctls > 10, "the workload made {ioctls} ioctls");
    let doc = read_json(&perfetto);
    check_perfetto(&doc, "/job", ioctls);

    // `baton timeline` makes the same slices from the --json output.
    let again = dir.path().join("again.json");
    let status = Command::new(workspace_binary("baton", "baton").unwrap())
        .arg("timeline")
        .arg(&jsonl)
        .arg("--perfetto")
        .arg(&again)
        .status()
        .unwrap();
    assert!(status.success());
    check_perfetto(&read_json(&again), "/job", ioctls);

    // The page draws a track per state and thread, with a shape per ioctl at least.
    let dom = browser::dump_dom(&html).unwrap();
    let attr = |name: &str| -> u64 {
        let key = format!("{name}=\"");
        let at = dom
            .find(&key)
            .unwrap_or_else(|| panic!("no {name} in the DOM:\n{}", &dom[..dom.len().min(2000)]));
        let rest = &dom[at + key.len()..];
        rest[..rest.find('"').unwrap()].parse().unwrap()
    };
    assert!(
        attr("data-tracks") >= 4,
        "GPU held, frozen, preemption and a thread"
    );
    assert!(attr("data-shapes") >= ioctls, "a shape per ioctl at least");
    for track in ["GPU held", "frozen", "preemption"] {
        assert!(
            dom.contains(&format!("data-track=\"{track}\"")),
            "no {track} track"
        );
    }
    assert!(dom.contains("class=\"shape ioctl\""), "no ioctl drawn");
    let png = browser::screenshot(&html, &dir.path().join("shot.png"), 1200, 420).unwrap();
    let bytes = std::fs::read(&png).unwrap();
    assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "a PNG");
    if let Ok(keep) = std::env::var("BATON_TIMELINE_SCREENSHOT") {
        std::fs::copy(&png, keep).unwrap();
    }
}

#[test]
fn a_trace_through_the_agent_writes_the_timeline_too() {
    require!(missing_trace_prerequisite());
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("agent.sock");
    let _agent = AgentProcess::start(&socket, &dir.path().join("agent.log")).unwrap();
    let mut env = TraceEnv::start("timeline-agent", "595.45.04").unwrap();
    let perfetto = dir.path().join("trace.json");
    let jsonl = dir.path().join("events.jsonl");
    let ioctls = trace_workload(&mut env, &[&perfetto], Some(&socket), &jsonl);
    check_perfetto(&read_json(&perfetto), "/job", ioctls);
}

#[test]
fn baton_timeline_refuses_a_file_that_is_not_a_json_trace() {
    let dir = tempfile::tempdir().unwrap();
    let input = dir.path().join("not-json.txt");
    std::fs::write(&input, "{ this is not json\n").unwrap();
    let out_file = dir.path().join("out.json");
    let out = Command::new(workspace_binary("baton", "baton").unwrap())
        .arg("timeline")
        .arg(&input)
        .arg("--perfetto")
        .arg(&out_file)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("not-json.txt:1: not a JSON object"),
        "{stderr}"
    );
    assert!(!out_file.exists(), "nothing written");
}
