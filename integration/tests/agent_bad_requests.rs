//! Bad requests get errors, not a dead agent (real containerd, runc, the Baton shim and the agent it starts,
//! the FUSE mock driver): durations past their bounds are refused with the field and its bound, random
//! request lines get answers, and through all of it the same agent keeps watching a container and
//! publishing its events, and its controller keeps taking requests. Before the bounds, a `governor` with a
//! `window_ms` of `u64::MAX` overflowed in the controller's task and left an agent answering "the agent's
//! controller is stopping" to every co-runner request of the node from then on.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use std::{
    io::{BufRead, BufReader, Write},
    os::unix::net::UnixStream,
    path::Path,
    time::Duration,
};

use baton_integration::{agent::AgentWatch, holder::GpuRig as Rig};
use rand::{Rng, SeedableRng, rngs::StdRng, seq::IndexedRandom};
use serde_json::{Value, json};

const WITHIN: Duration = Duration::from_secs(30);

/// Sends `line` on a fresh connection and returns the reply line, parsed.
fn ask_raw(socket: &Path, line: &str) -> Value {
    let mut s = UnixStream::connect(socket)
        .unwrap_or_else(|e| panic!("the agent no longer accepts connections ({e}) after {line}"));
    s.set_read_timeout(Some(WITHIN)).unwrap();
    writeln!(s, "{line}").unwrap();
    let mut reply = String::new();
    BufReader::new(s)
        .read_line(&mut reply)
        .unwrap_or_else(|e| panic!("no reply to {line}: {e}"));
    serde_json::from_str(&reply).unwrap_or_else(|e| panic!("reply {reply:?} to {line}: {e}"))
}

/// The agent still serves: it answers a ping, its controller takes a request (clearing a duty cycle), and
/// it still watches `id`.
fn assert_serving(socket: &Path, id: &str, after: &str) {
    let pong = ask_raw(socket, r#"{"v":1,"op":"ping"}"#);
    assert_eq!(pong["ok"], json!(true), "ping after {after}: {pong}");
    let control = ask_raw(
        socket,
        r#"{"v":1,"op":"duty","run_ms":200,"window_ms":200}"#,
    );
    assert_eq!(
        control["ok"],
        json!(true),
        "the controller after {after}: {control}"
    );
    let status = ask_raw(
        socket,
        &json!({"v": 1, "op": "status", "container": id}).to_string(),
    );
    assert_eq!(status["ok"], json!(true), "status after {after}: {status}");
    assert!(
        status.to_string().contains(id),
        "{id} still watched after {after}: {status}"
    );
}

fn expect(w: &mut AgentWatch, id: &str, kind: &str) {
    let e = w.next_transition(id, WITHIN).unwrap();
    assert_eq!(e["kind"], json!(kind), "{e}");
}

#[test]
fn durations_past_their_bounds_are_refused_and_the_agent_keeps_its_containers() {
    let Some(rig) = Rig::start("bad-requests") else {
        return;
    };
    let mut h = rig.holder("keeper");
    let mut w = rig.watch("keeper");
    let socket = rig.env.containerd().agent_socket();
    let agent = rig.env.containerd().agent_pid().unwrap();
    let ns = rig.env.namespace().to_owned();
    let max = u64::MAX;
    let bad = [
        (
            json!({"op": "wait_gpu_free", "id": "keeper", "namespace": ns, "timeout_ms": max}),
            "timeout_ms",
        ),
        (
            json!({"op": "duty", "run_ms": max, "window_ms": max}),
            "window_ms",
        ),
        (
            json!({"op": "governor", "target_stretch": 0.2, "window_ms": max}),
            "window_ms",
        ),
        (
            json!({"op": "trace", "all": true, "launch_interval_ms": max}),
            "launch_interval_ms",
        ),
        (
            json!({"op": "freeze", "id": "keeper", "hold_ms": max}),
            "hold_ms",
        ),
    ];
    for (mut request, field) in bad {
        request["v"] = json!(1);
        let line = request.to_string();
        let reply = ask_raw(&socket, &line);
        assert_eq!(reply["ok"], json!(false), "{line}: {reply}");
        let error = reply["error"].as_str().unwrap_or_default();
        assert!(
            error.contains(field),
            "{line}: the error names {field}: {reply}"
        );
        assert_serving(&socket, "keeper", &line);
    }
    assert_eq!(
        rig.env.containerd().agent_pid(),
        Some(agent),
        "the same agent"
    );
    // It still follows the container's calls and publishes their events.
    let fd = h.num("open nvidiactl").unwrap();
    h.cmd(&format!("alloc {fd}")).unwrap();
    expect(&mut w, "keeper", "acquired");
    h.num(&format!("close {fd}")).unwrap();
    expect(&mut w, "keeper", "released");
    h.finish().unwrap();
}

/// A request line of a random op with fields drawn from values that have broken parsers before: the
/// extremes of each integer type, negative and huge floats, wrong types, empty and long strings.
fn random_request(rng: &mut StdRng, ns: &str) -> String {
    // Not `watch` or `trace`: their replies are followed by a stream, and a long trace ties the probes up.
    const OPS: &[&str] = &[
        "ping",
        "status",
        "wait_gpu_free",
        "duty",
        "governor",
        "freeze",
        "thaw",
        "request_start",
        "first_token",
        "token",
        "request_end",
        "preempt",
        "resume",
        "start",
        "handoff",
        "unregister",
        "preemption",
        "register",
        "no_such_op",
    ];
    const FIELDS: &[&str] = &[
        "id",
        "namespace",
        "timeout_ms",
        "run_ms",
        "window_ms",
        "target_stretch",
        "off",
        "hold_ms",
        "lease_ms",
        "renew",
        "t_ns",
        "server",
        "mode",
        "pids",
        "image_path",
        "from",
        "to",
        "order",
        "cgroup",
        "init_pid",
        "devices",
        "settings",
        "container",
        "state",
        "role",
    ];
    let long = "x".repeat(4096);
    let values = [
        json!(u64::MAX),
        json!(i64::MIN),
        json!(0),
        json!(1),
        json!(-1),
        json!(1e308),
        json!(-1e308),
        json!(0.5),
        json!(""),
        json!(long),
        json!("keeper"),
        json!(ns),
        json!("../../etc"),
        json!(null),
        json!(true),
        json!([]),
        json!([u64::MAX, 0]),
        json!({}),
        json!({"id": "nope", "namespace": ns}),
        json!({"role": "co-runner", "priority": i32::MIN, "park_when_idle_ms": u64::MAX}),
    ];
    let mut request = json!({"v": 1, "op": OPS.choose(rng).unwrap()});
    for _ in 0..rng.random_range(0..6) {
        let field = FIELDS.choose(rng).unwrap();
        // The one container here is never a target: a valid preempt of it would park it.
        let value = values.choose(rng).unwrap().clone();
        if value == json!("keeper") && ["id", "container", "server"].contains(field) {
            continue;
        }
        request[*field] = value;
    }
    request.to_string()
}

#[test]
fn random_request_lines_get_answers_and_the_agent_keeps_serving() {
    let Some(rig) = Rig::start("random-requests") else {
        return;
    };
    let mut h = rig.holder("keeper");
    let mut w = rig.watch("keeper");
    let socket = rig.env.containerd().agent_socket();
    let agent = rig.env.containerd().agent_pid().unwrap();
    let seed: u64 = rand::rng().random();
    let mut rng = StdRng::seed_from_u64(seed);
    for i in 0..400 {
        let line = random_request(&mut rng, rig.env.namespace());
        let reply = ask_raw(&socket, &line);
        assert!(
            reply.get("ok").is_some(),
            "seed {seed}, line {i}: {line}: {reply}"
        );
        if i % 20 == 0 {
            assert_serving(&socket, "keeper", &format!("seed {seed}, line {i}: {line}"));
        }
    }
    assert_eq!(
        rig.env.containerd().agent_pid(),
        Some(agent),
        "seed {seed}: the same agent"
    );
    assert_serving(&socket, "keeper", &format!("seed {seed}: all lines"));
    let fd = h.num("open nvidiactl").unwrap();
    h.cmd(&format!("alloc {fd}")).unwrap();
    expect(&mut w, "keeper", "acquired");
    h.num(&format!("close {fd}")).unwrap();
    expect(&mut w, "keeper", "released");
    h.finish().unwrap();
}
