//! The co-runner controller end to end: a latency-critical container and co-runners (`baton.io/role`)
//! under real containerd, runc, the Baton shim and a `baton agent` started with the bounds each test needs.
//! What is frozen is read from the kernel (the container's freezer cgroup, the task state in /proc), never
//! from the agent's own word: `baton freeze`/`thaw`, the prefill shield, the user's Pause winning, and each
//! fail-safe (silent input, an agent that hangs, an agent that dies, the anti-starvation bound).
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use std::{
    path::PathBuf,
    process::Command,
    time::{Duration, Instant},
};

use baton_integration::{
    agent::{AgentConn, AgentProcess, FakeAgent, wait_until},
    env::TestEnv,
    procs::{cgroup_frozen as frozen, freezer_file},
    skip,
    trace_env::{BatonTrace, missing_trace_prerequisite, workspace_binary},
};
use serde_json::{Value, json};

/// Long enough for a loaded CI machine.
const WITHIN: Duration = Duration::from_secs(20);
const SPIN: &[&str] = &["/bin/sh", "-c", "while :; do :; done"];
/// A container that takes no CPU (where the test needs no running work).
const SLEEP: &[&str] = &["/bin/sleep", "600"];

struct Rig {
    env: TestEnv,
    agent: Option<AgentProcess>,
}

impl Rig {
    /// containerd with the Baton shim and an agent run with `flags`; `None` after reporting a skip.
    fn start(name: &str, flags: &[&str]) -> Option<Self> {
        if let Some(reason) = missing_trace_prerequisite() {
            skip::missing(&reason);
            return None;
        }
        let env = TestEnv::start(name)?;
        if !env.is_baton() {
            skip::not_applicable("the co-runner controller is Baton's");
            return None;
        }
        let socket = env.containerd().agent_socket();
        std::fs::create_dir_all(socket.parent().unwrap()).unwrap();
        let log = env.scratch().join("agent.log");
        let agent = AgentProcess::start_with(&socket, &log, flags).unwrap();
        Some(Self {
            env,
            agent: Some(agent),
        })
    }

    /// An agent whose freeze lease is 600 ms and whose input silence bound is `silence_ms`.
    fn with_short_lease(name: &str, silence_ms: &str) -> Option<Self> {
        let flags = [
            "--input-silence-ms",
            silence_ms,
            "--freeze-lease-ms",
            "600",
            "--max-frozen-ms",
            "600000",
        ];
        Self::start(name, &flags)
    }

    /// Stops the agent (SIGSTOP) until the shim's lease of frozen co-runner `co` lapses and it thaws, then
    /// lets the agent go on.
    fn hang_agent_until_the_lease_lapses(&self, co: u32) {
        let agent = nix::unistd::Pid::from_raw(self.agent.as_ref().unwrap().pid() as i32);
        nix::sys::signal::kill(agent, nix::sys::signal::Signal::SIGSTOP).unwrap();
        wait_frozen(co, false, "the agent hangs: the lease lapses");
        nix::sys::signal::kill(agent, nix::sys::signal::Signal::SIGCONT).unwrap();
    }

    /// Runs a spinning container with `annotations`; its init pid once the agent watches it.
    fn spinner(&self, id: &str, annotations: &[(&str, &str)]) -> u32 {
        self.env.run_detached(id, annotations, SPIN).unwrap();
        self.watched_pid(id)
    }

    /// A sleeping container (no CPU taken from a loaded machine) with `annotations` and the node options
    /// TOML `toml` (its own, as a runtime handler's); its init pid once the agent watches it.
    fn sleeper_with_node_toml(&self, id: &str, annotations: &[(&str, &str)], toml: &str) -> u32 {
        let mut flags = vec!["-d".to_owned(), "--null-io".to_owned()];
        flags.extend(
            self.env
                .node_options_flags(&format!("{id}.toml"), toml)
                .unwrap(),
        );
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let args = self.env.run_args(id, annotations, &flags, SLEEP);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.env.ctr_ok(&args).unwrap();
        self.watched_pid(id)
    }

    /// The init pid of container `id` once the agent watches it.
    fn watched_pid(&self, id: &str) -> u32 {
        let mut pid = 0;
        assert!(
            wait_until(WITHIN, || {
                pid = self.status()["containers"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|c| c["id"] == json!(id))
                    .and_then(|c| c["init_pid"].as_u64())
                    .unwrap_or(0) as u32;
                pid != 0
            }),
            "the agent watches {id}: {}",
            self.status()
        );
        pid
    }

    fn conn(&self) -> AgentConn {
        AgentConn::connect(&self.env.containerd().agent_socket()).unwrap()
    }

    fn status(&self) -> Value {
        self.conn().call(json!({"op": "status"})).unwrap()
    }

    /// The controller's view of co-runner `id` in `status`.
    fn co_runner(&self, id: &str) -> Value {
        self.status()["controller"]["co_runners"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["id"] == json!(id))
            .cloned()
            .unwrap_or(Value::Null)
    }

    /// Runs `baton ARGS --socket <the agent's>`: stdout, stderr, success.
    fn baton(&self, args: &[&str]) -> (String, String, bool) {
        let out = Command::new(workspace_binary("baton", "baton").unwrap())
            .args(args)
            .arg("--socket")
            .arg(self.env.containerd().agent_socket())
            .output()
            .unwrap();
        (
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
            out.status.success(),
        )
    }
}

fn wait_frozen(pid: u32, want: bool, what: &str) {
    assert!(
        wait_until(WITHIN, || frozen(pid) == want),
        "{what}: the kernel reports pid {pid} {} ({})",
        if want { "not frozen" } else { "still frozen" },
        freezer_file(pid).display()
    );
}

fn event(conn: &mut AgentConn, op: &str, id: &str) -> Value {
    conn.call(json!({"op": op, "id": id}))
        .unwrap_or_else(|e| panic!("{op} {id}: {e:#}"))
}

#[test]
fn freeze_and_thaw_are_confirmed_and_a_latency_critical_container_is_never_frozen() {
    let Some(rig) = Rig::start("ctl-freeze", &[]) else {
        return;
    };
    let server = rig.spinner("srv", &[("baton.io/role", "latency-critical")]);
    let co = rig.spinner(
        "trainer",
        &[
            ("baton.io/role", "co-runner"),
            ("baton.io/yields-to", "srv"),
        ],
    );
    let (out, err, ok) = rig.baton(&["freeze", "trainer"]);
    assert!(ok, "baton freeze: {err}");
    assert!(
        out.contains("frozen, freeze confirmed in") && out.contains(" us"),
        "{out}"
    );
    assert!(
        frozen(co),
        "the kernel says frozen when baton freeze returns"
    );
    let (out, err, ok) = rig.baton(&["thaw", "trainer"]);
    assert!(ok, "baton thaw: {err}");
    assert!(out.contains("running, thaw confirmed in"), "{out}");
    assert!(!frozen(co));

    let (_, err, ok) = rig.baton(&["freeze", "srv"]);
    assert!(!ok && err.contains("latency-critical"), "{err}");
    assert!(!frozen(server));
    let (_, err, ok) = rig.baton(&["freeze", "nobody"]);
    assert!(!ok && err.contains("no container nobody"), "{err}");

    // The co-runner got CUDA_LAUNCH_BLOCKING=1, the server did not.
    let environ = |pid: u32| std::fs::read(format!("/proc/{pid}/environ")).unwrap();
    let has = |pid: u32| {
        environ(pid)
            .split(|b| *b == 0)
            .any(|v| v == b"CUDA_LAUNCH_BLOCKING=1")
    };
    assert!(has(co) && !has(server));
    let (out, _, _) = rig.baton(&["status"]);
    assert!(
        out.contains("CO-RUNNER") && out.contains("trainer"),
        "{out}"
    );
    assert_eq!(rig.co_runner("trainer")["freezes"], json!(1));
}

#[test]
fn a_trace_through_the_agent_shows_the_controllers_freezes_and_its_timeline_draws_them() {
    let Some(rig) = Rig::start("ctl-trace", &[]) else {
        return;
    };
    rig.spinner("trainer", &[("baton.io/role", "co-runner")]);
    let dir = tempfile::tempdir().unwrap();
    let (jsonl, perfetto) = (dir.path().join("t.jsonl"), dir.path().join("t.json"));
    let mut command = Command::new(workspace_binary("baton", "baton").unwrap());
    command
        .args(["trace", "--json", "--container", "trainer", "-o"])
        .arg(&jsonl)
        .arg("--perfetto")
        .arg(&perfetto)
        .env(
            baton_agent_api::SOCKET_ENV,
            rig.env.containerd().agent_socket(),
        );
    let trace = BatonTrace::start(command, WITHIN).unwrap();
    for op in ["freeze", "thaw"] {
        let (_, err, ok) = rig.baton(&[op, "trainer"]);
        assert!(ok, "baton {op}: {err}");
    }
    // The thaw's line reaches the trace after the CLI's answer: wait for it before ending the trace.
    assert!(
        wait_until(WITHIN, || std::fs::read_to_string(&jsonl)
            .is_ok_and(|t| t.contains(r#""event":"thawed""#))),
        "no thawed object: {}",
        std::fs::read_to_string(&jsonl).unwrap_or_default()
    );
    let (status, stderr) = trace.stop().unwrap();
    assert!(status.success(), "{stderr}");
    let objects: Vec<Value> = std::fs::read_to_string(&jsonl)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let states: Vec<&Value> = objects
        .iter()
        .filter(|o| o["event"] == "frozen" || o["event"] == "thawed")
        .collect();
    assert_eq!(states.len(), 2, "{states:?}");
    assert_eq!(states[0]["event"], "frozen");
    assert!(states[0]["latency_ns"].as_u64().unwrap() > 0, "{states:?}");
    assert!(states[0]["container"].as_str().unwrap().contains("trainer"));
    assert!(states[1]["ts_ns"].as_u64() > states[0]["ts_ns"].as_u64());
    let doc: Value = serde_json::from_slice(&std::fs::read(&perfetto).unwrap()).unwrap();
    let spans: Vec<&Value> = doc["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["cat"] == "state" && e["name"] == "frozen")
        .collect();
    assert_eq!(spans.len(), 1, "one frozen span: {spans:?}");
    let want_us = (states[1]["ts_ns"].as_u64().unwrap() - states[0]["ts_ns"].as_u64().unwrap())
        as f64
        / 1000.0;
    assert!(
        (spans[0]["dur"].as_f64().unwrap() - want_us).abs() < 0.01,
        "{spans:?} vs {want_us}"
    );
}

#[test]
fn the_prefill_shield_freezes_the_co_runners_of_a_server_until_its_first_token() {
    let Some(rig) = Rig::start("ctl-shield", &[]) else {
        return;
    };
    rig.spinner("srv", &[("baton.io/role", "latency-critical")]);
    rig.spinner("other", &[("baton.io/role", "latency-critical")]);
    let co = rig.spinner(
        "trainer",
        &[
            ("baton.io/role", "co-runner"),
            ("baton.io/yields-to", "srv"),
        ],
    );
    let mut conn = rig.conn();
    // A request of a server the trainer does not yield to leaves it running.
    let r = conn
        .call(json!({"op": "request_start", "id": "o1", "server": "other"}))
        .unwrap();
    assert_eq!(r["shielded"], json!(1));
    assert_eq!(r["frozen"], json!(0), "{r}");
    event(&mut conn, "first_token", "o1");
    event(&mut conn, "request_end", "o1");
    assert!(!frozen(co));

    let r = conn
        .call(json!({"op": "request_start", "id": "r1", "server": "srv"}))
        .unwrap();
    assert_eq!(r["frozen"], json!(1), "{r}");
    wait_frozen(co, true, "after request_start");
    assert_eq!(rig.co_runner("trainer")["frozen_for"], json!("shield"));
    event(&mut conn, "first_token", "r1");
    wait_frozen(co, false, "after first_token");
    event(&mut conn, "token", "r1");
    event(&mut conn, "request_end", "r1");
    assert!(!frozen(co));
}

#[test]
fn a_user_pause_wins_over_the_controller() {
    let Some(rig) = Rig::start("ctl-user-pause", &[]) else {
        return;
    };
    let co = rig.spinner("trainer", &[("baton.io/role", "co-runner")]);
    let mut conn = rig.conn();
    event(&mut conn, "request_start", "r1");
    wait_frozen(co, true, "shield");
    rig.env.ctr_ok(&["task", "pause", "trainer"]).unwrap();
    event(&mut conn, "first_token", "r1");
    event(&mut conn, "request_end", "r1");
    // The controller wants it running now; the user's Pause holds. Its thaw reply says why.
    let r = conn.call(json!({"op": "thaw", "id": "trainer"})).unwrap();
    assert_eq!(r["frozen"], json!(true), "{r}");
    assert!(frozen(co));
    assert_eq!(rig.env.task_status("trainer").as_deref(), Some("PAUSED"));
    let (out, _, ok) = rig.baton(&["freeze", "trainer"]);
    assert!(ok && out.contains("user-paused"), "{out}");
    rig.baton(&["thaw", "trainer"]);
    assert!(
        frozen(co),
        "a thaw of a user-paused container leaves it frozen"
    );
    rig.env.ctr_ok(&["task", "resume", "trainer"]).unwrap();
    wait_frozen(co, false, "after the user's resume");
    // The controller freezes it again on the next request.
    event(&mut conn, "request_start", "r2");
    wait_frozen(co, true, "shield after resume");
    event(&mut conn, "first_token", "r2");
    wait_frozen(co, false, "first token after resume");
}

#[test]
fn silence_a_hung_agent_and_a_dead_agent_each_thaw_the_co_runner() {
    let Some(mut rig) = Rig::with_short_lease("ctl-failsafe", "400") else {
        return;
    };
    let co = rig.spinner("trainer", &[("baton.io/role", "co-runner")]);
    let mut conn = rig.conn();

    // Silent input: the request never gets its first token, nothing else comes.
    event(&mut conn, "request_start", "lost");
    wait_frozen(co, true, "shield");
    let t = Instant::now();
    wait_frozen(co, false, "silent input");
    assert!(t.elapsed() < WITHIN);
    assert_eq!(rig.status()["controller"]["silence_thaws"], json!(1));
    let err = conn
        .call(json!({"op": "first_token", "id": "lost"}))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("unknown request id"),
        "silence dropped it: {err}"
    );

    // A hung agent (stopped): the shim's lease lapses and it thaws by itself.
    event(&mut conn, "request_start", "hang");
    wait_frozen(co, true, "shield before the hang");
    rig.hang_agent_until_the_lease_lapses(co);

    // A dead agent: its connection to the shim ends and the shim thaws at once.
    let mut conn = rig.conn();
    wait_until(WITHIN, || {
        conn.call(json!({"op": "request_start", "id": "dead"}))
            .is_ok()
    });
    wait_frozen(co, true, "shield before the kill");
    drop(rig.agent.take());
    wait_frozen(co, false, "the agent died");
}

#[test]
fn a_co_runner_its_lease_thawed_is_frozen_again_when_the_agent_is_back_and_still_wants_it() {
    let Some(rig) = Rig::with_short_lease("ctl-relapse", "600000") else {
        return;
    };
    rig.env
        .run_detached("trainer", &[("baton.io/role", "co-runner")], SLEEP)
        .unwrap();
    let co = rig.watched_pid("trainer");
    let mut conn = rig.conn();
    event(&mut conn, "request_start", "long");
    wait_frozen(co, true, "shield");
    rig.hang_agent_until_the_lease_lapses(co);
    // The request is still open and no new input comes: the agent's renewal finds the hold gone, and the
    // controller takes a new one (before, it believed its freeze in force and the co-runner ran on).
    wait_frozen(co, true, "the agent is back, the shield still up");
    let c = rig.co_runner("trainer");
    assert_eq!(c["frozen_for"], json!("shield"), "{c}");
    assert!(c["freezes"].as_u64().unwrap() >= 2, "{c}");
}

#[test]
fn anti_starvation_bounds_a_continuous_freeze() {
    let Some(rig) = Rig::start(
        "ctl-starve",
        &["--max-frozen-ms", "300", "--min-run-share", "0.25"],
    ) else {
        return;
    };
    let co = rig.spinner("trainer", &[("baton.io/role", "co-runner")]);
    let mut conn = rig.conn();
    // A request whose first token never comes, while other input keeps the controller from going silent.
    event(&mut conn, "request_start", "stuck");
    event(&mut conn, "request_start", "alive");
    wait_frozen(co, true, "shield");
    event(&mut conn, "first_token", "alive");
    let mut thawed_while_stuck = false;
    let deadline = Instant::now() + WITHIN;
    while Instant::now() < deadline && !thawed_while_stuck {
        event(&mut conn, "token", "alive");
        thawed_while_stuck = !frozen(co);
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        thawed_while_stuck,
        "the bound thawed it while the shield stayed up"
    );
    let c = rig.co_runner("trainer");
    assert!(c["starvation_thaws"].as_u64().unwrap() >= 1, "{c}");
    // The bound is 300 ms; the longest freeze the shim confirmed stays near it.
    let longest_ms = c["longest_frozen_ns"].as_u64().unwrap() / 1_000_000;
    assert!((250..5000).contains(&longest_ms), "{c}");
    assert_eq!(rig.status()["controller"]["shielded"], json!(1));
}

#[test]
fn bad_control_input_gets_a_clear_error_and_the_controller_keeps_running() {
    let Some(rig) = Rig::start("ctl-bad-input", &[]) else {
        return;
    };
    rig.spinner("srv", &[("baton.io/role", "latency-critical")]);
    let co = rig.spinner("trainer", &[("baton.io/role", "co-runner")]);
    let cases: &[(Value, &str)] = &[
        (
            json!({"op": "duty", "run_ms": 300, "window_ms": 200}),
            "longer than window_ms",
        ),
        (
            json!({"op": "duty", "run_ms": 0, "window_ms": 0}),
            "window_ms must be > 0",
        ),
        (
            json!({"op": "duty", "id": "srv", "run_ms": 1, "window_ms": 2}),
            "not a co-runner",
        ),
        (
            json!({"op": "governor", "target_stretch": 0.0}),
            "target_stretch must be a number > 0",
        ),
        (
            json!({"op": "governor", "target_stretch": -1.0}),
            "target_stretch must be a number > 0",
        ),
        (
            json!({"op": "governor", "target_stretch": 0.2, "window_ms": 0}),
            "window_ms must be > 0",
        ),
        (
            json!({"op": "first_token", "id": "ghost"}),
            "unknown request id",
        ),
        (
            json!({"op": "token", "id": "ghost", "t_ns": 1}),
            "not CLOCK_MONOTONIC",
        ),
        (
            json!({"op": "request_end", "id": "ghost"}),
            "unknown request id",
        ),
        (
            json!({"op": "request_start", "id": "r", "server": "nope"}),
            "no latency-critical container",
        ),
        (json!({"op": "request_start"}), "not a request"),
        (json!({"op": "freeze", "id": "srv"}), "latency-critical"),
        (json!({"op": "thaw", "id": "srv"}), "latency-critical"),
        (json!({"op": "launch_missiles"}), "not a request"),
    ];
    let mut conn = rig.conn();
    for (request, expected) in cases {
        let err = conn.call(request.clone()).unwrap_err().to_string();
        assert!(err.contains(expected), "{request}: {err}");
    }
    // A line that is not JSON, on the same connection.
    {
        use std::io::{BufRead, Write};
        let mut raw =
            std::os::unix::net::UnixStream::connect(rig.env.containerd().agent_socket()).unwrap();
        raw.write_all(b"{not json\n").unwrap();
        let mut line = String::new();
        std::io::BufReader::new(&raw).read_line(&mut line).unwrap();
        assert!(line.contains("not a JSON line"), "{line}");
    }
    // Nothing changed, and the controller still answers.
    let r = event(&mut conn, "request_start", "fine");
    assert_eq!(r["frozen"], json!(1), "{r}");
    wait_frozen(co, true, "a good request after the bad ones");
    event(&mut conn, "first_token", "fine");
    wait_frozen(co, false, "its first token");
    let g = conn
        .call(json!({"op": "governor", "target_stretch": 0.2}))
        .unwrap();
    assert_eq!(g["reply"], json!("accepted"));

    // A client that is not root is refused before anything is read.
    let out = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(workspace_binary("baton", "baton").unwrap())
        .args(["freeze", "trainer", "--socket"])
        .arg(rig.env.containerd().agent_socket())
        .output()
        .expect("setpriv (Debian package util-linux)");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a non-root client froze a container");
    assert!(
        err.contains("root") || err.contains("ermission denied"),
        "{err}"
    );
    assert!(!frozen(co));
}

/// The control sockets of the shims beside the agent's socket of `rig` (`<dir>/shims/<shim pid>.sock`).
fn shim_sockets(rig: &Rig) -> Vec<PathBuf> {
    let dir = rig
        .env
        .containerd()
        .agent_socket()
        .parent()
        .unwrap()
        .join("shims");
    std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "sock"))
        .collect()
}

/// Sends `request` (one line, the version added) on a new connection to `socket`; the first line back.
fn raw_call(socket: &std::path::Path, mut request: Value) -> Value {
    use std::io::{BufRead, Write};
    request["v"] = json!(1);
    let mut stream = std::os::unix::net::UnixStream::connect(socket).unwrap();
    stream
        .set_read_timeout(Some(WITHIN))
        .expect("a read timeout");
    writeln!(stream, "{request}").unwrap();
    let mut line = String::new();
    std::io::BufReader::new(&stream)
        .read_line(&mut line)
        .unwrap();
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"))
}

#[test]
fn a_root_process_that_is_not_the_agent_cannot_command_a_shim() {
    let Some(rig) = Rig::start("ctl-not-agent", &[]) else {
        return;
    };
    let co = rig.spinner("trainer", &[("baton.io/role", "co-runner")]);
    let sockets = shim_sockets(&rig);
    assert_eq!(
        sockets.len(),
        1,
        "one shim, one control socket: {sockets:?}"
    );
    // The test runs as root and is not the agent: a freeze (even a leased one) is refused, naming the pid.
    let reply = raw_call(
        &sockets[0],
        json!({"op": "freeze", "id": "trainer", "lease_ms": 600_000}),
    );
    assert_eq!(reply["ok"], json!(false), "{reply}");
    let error = reply["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("agent alone") && error.contains(&format!("pid {}", std::process::id())),
        "{reply}"
    );
    assert!(!frozen(co), "a process that is not the agent froze it");
    let reply = raw_call(
        &sockets[0],
        json!({"op": "preempt", "id": "trainer", "pids": [co]}),
    );
    assert_eq!(reply["ok"], json!(false), "{reply}");
    // What the agent sends still works.
    let (_, err, ok) = rig.baton(&["freeze", "trainer"]);
    assert!(ok, "baton freeze: {err}");
    assert!(frozen(co));
    let (_, err, ok) = rig.baton(&["thaw", "trainer"]);
    assert!(ok, "baton thaw: {err}");
    assert!(!frozen(co));
}

#[test]
fn a_watched_container_is_registered_again_only_by_its_shim_and_never_from_inside_a_container() {
    let Some(rig) = Rig::start("ctl-reregister", &[]) else {
        return;
    };
    let co = rig.spinner("trainer", &[("baton.io/role", "co-runner")]);
    let entry = rig.status()["containers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == json!("trainer"))
        .cloned()
        .unwrap();
    let (namespace, cgroup) = (entry["namespace"].clone(), entry["cgroup"].clone());
    let me = std::process::id();
    let mut conn = rig.conn();

    // Another cgroup (one the test makes, empty): refused, whoever asks.
    let root = baton_cgroups::find_v2_root().unwrap();
    let other = format!("/baton-test-reregister-{me}");
    let other_dir = baton_cgroups::create(&root, &other).unwrap();
    let err = conn
        .call(
            json!({"op": "register", "id": "trainer", "namespace": namespace,
            "cgroup": other, "init_pid": 0}),
        )
        .unwrap_err()
        .to_string();
    let _ = std::fs::remove_dir(&other_dir);
    assert!(err.contains("another cgroup"), "{err}");

    // The same cgroup and init from a process that is not its shim, making it latency-critical (never
    // frozen) and sending its preemptions elsewhere: refused, naming the pid.
    let err = conn
        .call(
            json!({"op": "register", "id": "trainer", "namespace": namespace,
            "cgroup": cgroup, "init_pid": co, "role": {"role": "latency-critical"},
            "control_socket": "/tmp/not-the-shim.sock"}),
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains(&format!("again from pid {me}")), "{err}");
    assert_eq!(
        rig.co_runner("trainer")["id"],
        json!("trainer"),
        "still a co-runner: {}",
        rig.status()
    );
    let (_, err, ok) = rig.baton(&["freeze", "trainer"]);
    assert!(ok, "its own shim still freezes it: {err}");
    assert!(frozen(co));
    let (_, err, ok) = rig.baton(&["thaw", "trainer"]);
    assert!(ok, "baton thaw: {err}");

    // A process inside the watched container's cgroup is not served at all.
    let dir = root.join(cgroup.as_str().unwrap().trim_start_matches('/'));
    let out = baton_cgroups::command_in(
        &dir,
        &workspace_binary("baton", "baton").unwrap(),
        &[
            "freeze".to_owned(),
            "trainer".to_owned(),
            "--socket".to_owned(),
            rig.env.containerd().agent_socket().display().to_string(),
        ],
    )
    .output()
    .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "a process inside the container froze it"
    );
    assert!(err.contains("inside a watched container"), "{err}");
    assert!(!frozen(co));
}

/// Sends `request` on `stream` and reads lines until the reply (skipping the step lines of a preemption).
fn call_on(stream: &mut std::os::unix::net::UnixStream, mut request: Value) -> Value {
    use std::io::{BufRead, Write};
    request["v"] = json!(1);
    writeln!(stream, "{request}").unwrap();
    let mut reader = std::io::BufReader::new(stream.try_clone().unwrap());
    loop {
        let mut line = String::new();
        assert!(
            reader.read_line(&mut line).unwrap() > 0,
            "no reply to {request}"
        );
        let v: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"));
        if v.get("reply").is_some() {
            return v;
        }
    }
}

#[test]
fn a_freeze_without_a_lease_ends_by_itself_and_a_preemption_acts_on_the_containers_processes_only()
{
    let Some(env) = TestEnv::start("ctl-lease") else {
        return;
    };
    if !env.is_baton() {
        skip::not_applicable("the shim's control socket is Baton's");
        return;
    }
    // This test is the agent (it listens on the agent's socket), so the shim takes its commands: those the
    // real agent never sends (no lease, a pid outside the container) are refused or bounded all the same.
    let agent = FakeAgent::start(&env.containerd().agent_socket()).unwrap();
    let log = env.scratch().join("cuda-checkpoint.log");
    let program = env.scratch().join("cuda-checkpoint");
    baton_integration::write_script(
        &program,
        &format!("#!/bin/sh\necho \"$@\" >> {}\n", log.display()),
    )
    .unwrap();
    let mut flags = vec!["-d".to_owned(), "--null-io".to_owned()];
    flags.extend(
        env.node_options_flags(
            "cuda.toml",
            &format!("cuda_checkpoint_path = \"{}\"\n", program.display()),
        )
        .unwrap(),
    );
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let args = env.run_args("trainer", &[("baton.io/role", "co-runner")], &flags, SLEEP);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    env.ctr_ok(&args).unwrap();
    let registration = agent
        .registration("trainer", WITHIN)
        .expect("the shim registers the co-runner");
    let co = registration["init_pid"].as_u64().unwrap() as u32;
    let control = registration["control_socket"].as_str().unwrap().to_owned();
    let mut stream = std::os::unix::net::UnixStream::connect(&control).unwrap();

    // No lease: the default one. The connection stays open, so only the lease can end the freeze.
    let r = call_on(&mut stream, json!({"op": "freeze", "id": "trainer"}));
    assert_eq!(r["frozen"], json!(true), "{r}");
    assert!(frozen(co));
    let t = Instant::now();
    wait_frozen(co, false, "a freeze without a lease, never renewed");
    assert!(
        t.elapsed() >= Duration::from_millis(baton_agent_api::DEFAULT_FREEZE_LEASE_MS / 2),
        "thawed after {:?}, before its default lease",
        t.elapsed()
    );
    // A lease above the maximum is refused, and nothing is frozen.
    let too_long = baton_agent_api::MAX_FREEZE_LEASE_MS + 1;
    let r = call_on(
        &mut stream,
        json!({"op": "freeze", "id": "trainer", "lease_ms": too_long}),
    );
    assert_eq!(r["ok"], json!(false), "{r}");
    assert!(
        r["error"]
            .as_str()
            .unwrap()
            .contains(&baton_agent_api::MAX_FREEZE_LEASE_MS.to_string()),
        "{r}"
    );
    assert!(!frozen(co));

    // A preemption naming a process outside the container (this test) fails naming it and the container;
    // cuda-checkpoint never runs on it.
    let me = std::process::id();
    let r = call_on(
        &mut stream,
        json!({"op": "preempt", "id": "trainer", "pids": [co, me]}),
    );
    assert_eq!(r["ok"], json!(false), "{r}");
    let error = r["error"].as_str().unwrap();
    assert!(
        error.contains(&format!("pid {me}")) && error.contains("container trainer"),
        "{r}"
    );
    let ran = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        !ran.contains(&format!("--pid {me}")),
        "cuda-checkpoint ran on a process outside the container:\n{ran}"
    );
    assert!(!frozen(co), "the failed preemption left it running");
    assert_eq!(env.task_status("trainer").as_deref(), Some("RUNNING"));

    // A line without end on another connection: the shim reads at most its bound, answers, closes that
    // connection, and keeps serving this one.
    let shim: u32 = std::path::Path::new(&control)
        .file_stem()
        .and_then(|s| s.to_str())
        .and_then(|s| s.parse().ok())
        .unwrap();
    let before = rss_kib(shim);
    let (sent, back) = endless_line(std::path::Path::new(&control));
    let grown = rss_kib(shim).saturating_sub(before);
    assert!(
        grown < 16 * 1024 && sent < 64,
        "the shim grew by {grown} KiB reading a line without end ({sent} MiB sent); it answered {back:?}"
    );
    let r = call_on(&mut stream, json!({"op": "freeze", "id": "trainer"}));
    assert_eq!(r["frozen"], json!(true), "{r}");
    let r = call_on(&mut stream, json!({"op": "thaw", "id": "trainer"}));
    assert_eq!(r["frozen"], json!(false), "{r}");
}

#[test]
fn device_folders_no_container_uses_any_more_free_their_probe_slots() {
    let Some(rig) = Rig::start("ctl-prefixes", &[]) else {
        return;
    };
    let role = [("baton.io/role", "co-runner")];
    let folder = |i: u32| format!("trace_prefix = \"/gpu{i}/nvidia\"\n");
    // The probes follow at most 4 device folders: four containers, each the node's TOML of its own.
    for i in 1..=4 {
        rig.sleeper_with_node_toml(&format!("c{i}"), &role, &folder(i));
    }
    rig.env.ctr_ok(&["task", "rm", "-f", "c1"]).unwrap();
    assert!(
        wait_until(WITHIN, || !rig.status()["containers"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["id"] == json!("c1"))),
        "c1 is no longer watched: {}",
        rig.status()
    );
    // Its folder's slot is free again: a fifth folder is followed.
    rig.sleeper_with_node_toml("c5", &role, &folder(5));
}

/// Writes 64 MiB without a newline to `socket`, as fast as the other end takes it (stopping when it closes);
/// how many MiB went, and what came back.
fn endless_line(socket: &std::path::Path) -> (usize, String) {
    use std::io::{Read, Write};
    let mut stream = std::os::unix::net::UnixStream::connect(socket).unwrap();
    let chunk = vec![b'x'; 1 << 20];
    let mut sent = 0;
    while sent < 64 && stream.write_all(&chunk).is_ok() {
        sent += 1;
    }
    stream.set_read_timeout(Some(WITHIN)).unwrap();
    let mut back = Vec::new();
    let _ = stream.read_to_end(&mut back);
    (sent, String::from_utf8_lossy(&back).into_owned())
}

/// The resident memory of process `pid`, in KiB.
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

#[test]
fn an_endless_line_does_not_grow_the_agent_and_other_clients_are_still_answered() {
    let Some(rig) = Rig::start("ctl-long-line", &[]) else {
        return;
    };
    let agent = rig.agent.as_ref().unwrap().pid();
    let before = rss_kib(agent);
    let socket = rig.env.containerd().agent_socket();
    let writer = std::thread::spawn(move || endless_line(&socket));
    // Another client is answered meanwhile, and after.
    assert_eq!(rig.status()["agent_pid"], json!(agent));
    let (sent, back) = writer.join().unwrap();
    let grown = rss_kib(agent).saturating_sub(before);
    assert!(
        grown < 16 * 1024,
        "the agent grew by {grown} KiB reading a line without end ({sent} MiB sent); it answered {back:?}"
    );
    assert!(sent < 64, "the agent read all 64 MiB of one line");
    let log = std::fs::read_to_string(rig.env.scratch().join("agent.log")).unwrap();
    assert!(log.contains("closing a connection"), "{log}");
    let (out, err, ok) = rig.baton(&["status"]);
    assert!(ok, "baton status after the endless line: {err}\n{out}");
}

/// A co-runner frozen nearly all the time by a duty cycle (run 20 ms of every 2 s), with a lease renewed
/// every 100 ms.
fn duty_cycled_rig(name: &str, command: &[&str]) -> Option<(Rig, u32)> {
    let rig = Rig::start(
        name,
        &[
            "--freeze-lease-ms",
            "300",
            "--max-frozen-ms",
            "600000",
            "--min-run-share",
            "0",
        ],
    )?;
    rig.env
        .run_detached("trainer", &[("baton.io/role", "co-runner")], command)
        .unwrap();
    let mut pid = 0;
    assert!(wait_until(WITHIN, || {
        pid = rig.status()["containers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["id"] == json!("trainer"))
            .and_then(|c| c["init_pid"].as_u64())
            .unwrap_or(0) as u32;
        pid != 0
    }));
    let r = rig
        .conn()
        .call(json!({"op": "duty", "id": "trainer", "run_ms": 20, "window_ms": 2000}))
        .unwrap();
    assert_eq!(r["reply"], json!("accepted"), "{r}");
    wait_frozen(pid, true, "the duty cycle");
    Some((rig, pid))
}

#[test]
fn exec_into_a_duty_cycled_co_runner_succeeds_every_time() {
    let Some((rig, _)) = duty_cycled_rig("ctl-duty-exec", SPIN) else {
        return;
    };
    // An exec ends the hold and no renewal takes it again while runc execs; before, a renewal froze the
    // container under runc now and then ("cannot exec in a paused container", or a hang).
    for i in 0..20 {
        let exec_id = format!("e{i}");
        let out = rig.env.ctr(&[
            "task",
            "exec",
            "--exec-id",
            &exec_id,
            "trainer",
            "/bin/echo",
            "exec-ok",
        ]);
        assert!(
            out.success() && out.stdout.contains("exec-ok"),
            "exec {i} into the duty-cycled co-runner: exit {:?}, stdout {:?}, stderr {:?}",
            out.code,
            out.stdout,
            out.stderr
        );
    }
}

#[test]
fn a_kill_of_a_duty_cycled_co_runner_ends_it_promptly() {
    // Its SIGTERM handler works for a while before it exits: a graceful shutdown.
    let graceful = &[
        "/bin/sh",
        "-c",
        "trap 'i=0; while [ $i -lt 100000 ]; do i=$((i+1)); done; exit 3' TERM; while :; do :; done",
    ];
    let Some((rig, _)) = duty_cycled_rig("ctl-duty-kill", graceful) else {
        return;
    };
    let api = rig.env.api().unwrap();
    let t = Instant::now();
    api.kill(
        "trainer",
        "",
        nix::sys::signal::Signal::SIGTERM as u32,
        false,
    )
    .unwrap();
    // Frozen 99% of the time, its shutdown would take a hundred times as long: a killed co-runner is not
    // frozen again while it stops.
    let status = api.wait("trainer", "", WITHIN).unwrap();
    assert_eq!(status, 3, "it exited through its handler");
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "it stopped {:?} after the kill",
        t.elapsed()
    );
}
