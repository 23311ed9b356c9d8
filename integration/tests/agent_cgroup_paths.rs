//! A registration's cgroup path is compared in its one spelling: a real `baton agent` (eBPF probes) refuses
//! the root however it is spelled (`/.`, `//`) and a path with `..`, and watches a real container cgroup
//! spelled with `.` and doubled slashes as that cgroup. The registering process is this test; the init is a
//! process in a cgroup of its own.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use std::{path::Path, process::Child, time::Duration};

use baton_integration::{
    agent::{AgentConn, AgentProcess, wait_until},
    skip,
    trace_env::{TraceEnv, missing_trace_prerequisite},
};
use baton_mock_nvidia::driver::DEFAULT_DRIVER_VERSION;
use baton_tracer::cgroups;
use serde_json::{Value, json};

const WITHIN: Duration = Duration::from_secs(20);

/// A child killed when dropped.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The agent's reply to registering `id` with cgroup path `cgroup` and init `init_pid`.
fn register(conn: &mut AgentConn, env: &TraceEnv, id: &str, cgroup: &str, init_pid: u32) -> Value {
    let dev = env.dev_dir();
    let request = json!({
        "op": "register", "id": id, "namespace": "cgroup-paths",
        "cgroup": cgroup, "init_pid": init_pid,
        "devices": [dev.join("nvidiactl")],
        "settings": {"trace_prefix": format!("{}/nvidia", dev.display())},
    });
    match conn.call(request) {
        Ok(reply) => reply,
        Err(e) => json!({"ok": false, "error": e.to_string()}),
    }
}

#[test]
fn the_root_spelled_otherwise_and_dot_dot_are_refused_and_dots_name_the_same_cgroup() {
    if let Some(reason) = missing_trace_prerequisite() {
        skip::missing(&reason);
        return;
    }
    let env = TraceEnv::start("cg-paths", DEFAULT_DRIVER_VERSION).unwrap();
    env.make_cgroup("c1").unwrap();
    let rel = env.cgroup_rel("c1");
    let cg = cgroups::find_v2_root()
        .unwrap()
        .join(rel.trim_start_matches('/'));
    let init = KillOnDrop(
        cgroups::command_in(&cg, Path::new("sleep"), &["1000".to_owned()])
            .spawn()
            .unwrap(),
    );
    let pid = init.0.id();
    assert!(wait_until(WITHIN, || {
        std::fs::read_to_string(format!("/proc/{pid}/cmdline"))
            .is_ok_and(|c| c.starts_with("sleep"))
    }));
    let dir = tempfile::tempdir().unwrap();
    let agent = AgentProcess::start(
        &dir.path().join("agent.sock"),
        &dir.path().join("agent.log"),
    )
    .unwrap();
    let mut conn = AgentConn::connect(agent.socket()).unwrap();

    for (i, root) in ["/.", "//", "/./"].into_iter().enumerate() {
        let reply = register(&mut conn, &env, &format!("root-{i}"), root, 0);
        let error = reply["error"].as_str().unwrap_or_default();
        assert!(
            error.contains("is the root"),
            "{root:?} was not refused as the root: {reply}"
        );
    }
    let climbing = format!("{rel}/../");
    let reply = register(&mut conn, &env, "climb", &climbing, pid);
    let error = reply["error"].as_str().unwrap_or_default();
    assert!(
        error.contains("`..`"),
        "{climbing:?} was not refused: {reply}"
    );

    // The container's own cgroup, spelled with `.` and doubled slashes: the same cgroup as its init's.
    let parent = Path::new(&rel).parent().unwrap().display().to_string();
    let dotted = format!("/{}/./{}/", parent.trim_start_matches('/'), "/c1");
    let reply = register(&mut conn, &env, "c1", &dotted, pid);
    assert_eq!(reply["ok"], json!(true), "{dotted:?} was refused: {reply}");
    let status = conn.call(json!({"op": "status"})).unwrap();
    assert!(
        status["containers"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["id"] == json!("c1")),
        "{status}"
    );
    drop(init);
}
