//! The co-runner controller backs off a shim it cannot reach, and the detached agent's log stays bounded. A
//! real `baton agent --daemon` (eBPF probes, its log file capped at 64 KiB) watches a co-runner (a process in
//! a cgroup of its own) under `duty`, whose control socket is this test's: first a shim that drops every
//! connection at once, then no socket at all, then a shim that answers. Attempts are counted by the kernel
//! (the connections the fake shim accepts) and by the agent's own log lines; never by the agent's word.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use std::{
    io::{BufRead, BufReader, Write},
    os::unix::net::{UnixListener, UnixStream},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use baton_integration::{
    agent::{AgentConn, wait_until},
    skip,
    trace_env::{TraceEnv, missing_trace_prerequisite, workspace_binary},
};
use baton_mock_nvidia::driver::DEFAULT_DRIVER_VERSION;
use baton_tracer::cgroups;
use serde_json::{Value, json};

/// Long enough for a loaded CI machine.
const WITHIN: Duration = Duration::from_secs(30);
/// The log cap the agent runs with (the least it accepts).
const LOG_CAP: u64 = 65_536;
/// How long attempts are counted in each phase.
const WINDOW: Duration = Duration::from_secs(3);
/// At most one attempt a second once backed off, each of at most two connections (one reconnect): with
/// slack for the doubling waits still under a second when a window starts.
const MAX_CONNECTS_PER_WINDOW: u64 = 14;
/// The same, in the agent's attempt lines (one per failed attempt).
const MAX_ATTEMPTS_PER_WINDOW: usize = 7;

/// A child killed when dropped.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A fake shim control socket: counts the connections it accepts; drops each at once, or answers every
/// freeze and thaw as a shim would.
fn fake_shim(path: &Path, answer: bool) -> Arc<AtomicU64> {
    let listener = UnixListener::bind(path).unwrap();
    let accepts = Arc::new(AtomicU64::new(0));
    let counted = accepts.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { return };
            counted.fetch_add(1, Ordering::SeqCst);
            if answer {
                std::thread::spawn(move || serve(conn));
            }
        }
    });
    accepts
}

/// Answers each request line of `conn` with the freezer reply a shim gives.
fn serve(conn: UnixStream) {
    let mut out = conn.try_clone().unwrap();
    for line in BufReader::new(conn).lines().map_while(Result::ok) {
        let Ok(req) = serde_json::from_str::<Value>(&line) else {
            return;
        };
        let reply = json!({
            "v": 1, "ok": true, "reply": "freezer",
            "id": req["id"], "namespace": req["namespace"],
            "frozen": req["op"] == json!("freeze"),
            "latency_ns": 1000, "t_confirmed_ns": baton_tracer::now_monotonic_ns(),
        });
        if writeln!(out, "{reply}").is_err() {
            return;
        }
    }
}

/// `baton agent --daemon` on `socket`, its log at `log` capped at [`LOG_CAP`], the controller's attempt
/// lines on; once it answers `ping`.
fn start_agent(socket: &Path, log: &Path) -> KillOnDrop {
    let child = Command::new(workspace_binary("baton", "baton").unwrap())
        .args(["agent", "--daemon", "--socket"])
        .arg(socket)
        .arg("--log-file")
        .arg(log)
        .args(["--log-max-bytes", &LOG_CAP.to_string()])
        .env("BATON_LOG", "info,baton_agent::control=debug")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let agent = KillOnDrop(child);
    assert!(
        wait_until(WITHIN, || AgentConn::connect(socket)
            .is_ok_and(|mut c| c.call(json!({"op": "ping"})).is_ok())),
        "the agent did not answer on {}: {}",
        socket.display(),
        std::fs::read_to_string(log).unwrap_or_default()
    );
    agent
}

fn log_text(log: &Path) -> String {
    std::fs::read_to_string(log).unwrap_or_default()
}

/// The controller's warnings, and its lines for later failed attempts, in the log.
fn warnings(log: &Path) -> usize {
    log_text(log)
        .lines()
        .filter(|l| l.contains(" WARN ") && l.contains("controller:"))
        .count()
}

fn attempt_lines(log: &Path) -> usize {
    log_text(log)
        .lines()
        .filter(|l| l.contains("controller: again:"))
        .count()
}

fn co_runner_error(socket: &Path, id: &str) -> Value {
    let status = AgentConn::connect(socket)
        .unwrap()
        .call(json!({"op": "status"}))
        .unwrap();
    status["controller"]["co_runners"]
        .as_array()
        .and_then(|a| a.iter().find(|c| c["id"] == json!(id)))
        .map_or(Value::Null, |c| c["error"].clone())
}

#[test]
fn an_unreachable_shim_under_duty_is_retried_with_backoff_and_the_log_stays_capped() {
    if let Some(reason) = missing_trace_prerequisite() {
        skip::missing(&reason);
        return;
    }
    let env = TraceEnv::start("ctl-backoff", DEFAULT_DRIVER_VERSION).unwrap();
    env.make_cgroup("co").unwrap();
    let cg = cgroups::find_v2_root()
        .unwrap()
        .join(env.cgroup_rel("co").trim_start_matches('/'));
    let init = cgroups::command_in(&cg, Path::new("sleep"), &["1000".to_owned()])
        .spawn()
        .unwrap();
    let init = KillOnDrop(init);
    let init_pid = init.0.id();
    assert!(wait_until(WITHIN, || {
        std::fs::read_to_string(format!("/proc/{init_pid}/cmdline"))
            .is_ok_and(|c| c.starts_with("sleep"))
    }));
    let dir = tempfile::tempdir().unwrap();
    let (socket, log) = (dir.path().join("agent.sock"), dir.path().join("agent.log"));
    let shim: PathBuf = dir.path().join("shim.sock");
    let accepts = fake_shim(&shim, false);
    let _agent = start_agent(&socket, &log);

    let dev = env.dev_dir().to_owned();
    let mut conn = AgentConn::connect(&socket).unwrap();
    conn.call(json!({
        "op": "register", "id": "co-1", "namespace": "backoff-test",
        "cgroup": env.cgroup_rel("co"), "init_pid": init_pid,
        "devices": [dev.join("nvidiactl"), dev.join("nvidia0")],
        "settings": {"trace_prefix": format!("{}/nvidia", dev.display())},
        "control_socket": shim, "role": {"role": "co-runner"},
    }))
    .unwrap();
    conn.call(json!({"op": "duty", "run_ms": 50, "window_ms": 200}))
        .unwrap();
    assert!(
        wait_until(WITHIN, || !co_runner_error(&socket, "co-1").is_null()),
        "the controller never reported the shim's failure: {}",
        log_text(&log)
    );

    // A shim that drops every connection: the kernel counts the agent's connections.
    let before = accepts.load(Ordering::SeqCst);
    std::thread::sleep(WINDOW);
    let connects = accepts.load(Ordering::SeqCst) - before;
    assert!(
        connects <= MAX_CONNECTS_PER_WINDOW,
        "{connects} connections to a shim that drops them in {WINDOW:?}: no backoff"
    );

    // The socket is gone: the agent's attempt lines count the connects that fail.
    std::fs::remove_file(&shim).unwrap();
    let before = attempt_lines(&log);
    std::thread::sleep(WINDOW);
    let attempts = attempt_lines(&log) - before;
    assert!(
        attempts <= MAX_ATTEMPTS_PER_WINDOW,
        "{attempts} attempts on a vanished socket in {WINDOW:?}: no backoff"
    );
    assert!(
        attempts >= 1,
        "no attempt at all in {WINDOW:?}: the controller gave up instead of backing off"
    );
    assert_eq!(
        warnings(&log),
        1,
        "one warning per streak of failures:\n{}",
        log_text(&log)
    );

    // A shim answers again: one recovery line, and the error is gone.
    let _answers = fake_shim(&shim, true);
    assert!(
        wait_until(WITHIN, || log_text(&log)
            .contains("controller: the shim answers again")),
        "no recovery line:\n{}",
        log_text(&log)
    );
    assert!(
        wait_until(WITHIN, || co_runner_error(&socket, "co-1").is_null()),
        "the error stayed after the shim answered"
    );

    let size = std::fs::metadata(&log).unwrap().len();
    assert!(
        size <= LOG_CAP,
        "agent.log is {size} bytes, over its cap {LOG_CAP}"
    );
    assert!(!dir.path().join("agent.log.2").exists());
}
