//! Pause/resume with their events, stats, resource updates, OOM, and grouping of containers in one shim.

use std::time::Duration;

use baton_integration::TestEnv;
use baton_integration::cleanup::{cgroup_v2_only, container_cgroup};
use oci_spec::runtime::{LinuxCpuBuilder, LinuxMemoryBuilder, LinuxResourcesBuilder};

const WAIT: Duration = Duration::from_secs(20);
const SANDBOX_ID: &str = "io.kubernetes.cri.sandbox-id";

fn read_trimmed(path: &std::path::Path) -> String {
    std::fs::read_to_string(path)
        .map(|text| text.trim().to_string())
        .unwrap_or_else(|error| format!("<{error}>"))
}

#[test]
fn shim_pause_and_resume_change_state_and_publish_events() {
    let Some(env) = TestEnv::start("shim_pause_resume") else {
        return;
    };
    let api = env.api().expect("api");
    let events = api.subscribe().expect("subscribe");
    env.run_detached("frozen", &[], &["/bin/sleep", "300"])
        .expect("run");
    env.ctr_ok(&["task", "pause", "frozen"]).expect("pause");
    assert_eq!(api.state("frozen", "").expect("state").0, "PAUSED");
    assert_eq!(env.task_status("frozen").as_deref(), Some("PAUSED"));
    let freezer = if cgroup_v2_only() {
        read_trimmed(&container_cgroup("unified", env.namespace(), "frozen").join("cgroup.freeze"))
    } else {
        read_trimmed(&container_cgroup("freezer", env.namespace(), "frozen").join("freezer.state"))
    };
    assert!(
        freezer == "FROZEN" || freezer == "1",
        "freezer state while paused: {freezer}"
    );
    assert!(
        events.wait_for("/tasks/paused", "frozen", WAIT).is_some(),
        "no TaskPaused: {:?}",
        events.all()
    );
    env.ctr_ok(&["task", "resume", "frozen"]).expect("resume");
    assert_eq!(api.state("frozen", "").expect("state").0, "RUNNING");
    assert!(
        events.wait_for("/tasks/resumed", "frozen", WAIT).is_some(),
        "no TaskResumed: {:?}",
        events.all()
    );
    let topics = events.topics_for("frozen");
    let paused = topics.iter().position(|topic| topic == "/tasks/paused");
    let resumed = topics.iter().position(|topic| topic == "/tasks/resumed");
    assert!(paused < resumed, "events out of order: {topics:?}");
    for topic in ["/tasks/create", "/tasks/start"] {
        assert!(
            topics.iter().any(|seen| seen == topic),
            "missing {topic}: {topics:?}"
        );
    }
}

#[test]
fn shim_stats_report_the_cgroup_figures() {
    let Some(env) = TestEnv::start("shim_stats") else {
        return;
    };
    env.run_detached(
        "busy",
        &[],
        &[
            "/bin/sh",
            "-c",
            "sleep 300 & sleep 300 & i=0; while [ $i -lt 20000 ]; do i=$((i+1)); done; wait",
        ],
    )
    .expect("run");
    std::thread::sleep(Duration::from_millis(1500));
    let text = env
        .ctr_ok(&["task", "metrics", "--format", "json", "busy"])
        .expect("metrics");
    let metrics: serde_json::Value = serde_json::from_str(&text).expect("metrics json");
    let pids = metrics["pids"]["current"]
        .as_u64()
        .unwrap_or_else(|| panic!("pids.current missing from {text}"));
    assert!(pids >= 3, "pids.current = {pids}: {text}");
    if cgroup_v2_only() {
        // io.containerd.cgroups.v2.Metrics
        let usage = metrics["memory"]["usage"]
            .as_u64()
            .unwrap_or_else(|| panic!("memory.usage (v2) missing from {text}"));
        assert!(usage > 0, "{text}");
        assert!(
            metrics["cpu"]["usage_usec"].as_u64().unwrap_or(0) > 0,
            "cpu usage: {text}"
        );
        let current = read_trimmed(
            &container_cgroup("unified", env.namespace(), "busy").join("pids.current"),
        );
        assert_eq!(current.parse::<u64>().ok(), Some(pids));
    } else {
        // Hybrid host: runc manages the v1 controllers, so the shim reports io.containerd.cgroups.v1.Metrics.
        let usage = metrics["memory"]["usage"]["usage"]
            .as_u64()
            .unwrap_or_else(|| panic!("memory.usage.usage (v1) missing from {text}"));
        assert!(usage > 0, "{text}");
        let cpu = metrics["cpu"]["usage"]["total"]
            .as_u64()
            .unwrap_or_else(|| panic!("cpu.usage.total (v1) missing from {text}"));
        assert!(cpu > 0, "{text}");
        let current =
            read_trimmed(&container_cgroup("pids", env.namespace(), "busy").join("pids.current"));
        assert_eq!(
            current.parse::<u64>().ok(),
            Some(pids),
            "pids.current file vs metrics"
        );
        let limit = read_trimmed(
            &container_cgroup("memory", env.namespace(), "busy").join("memory.limit_in_bytes"),
        );
        let reported = metrics["memory"]["usage"]["limit"]
            .as_u64()
            .unwrap_or_else(|| panic!("memory.usage.limit missing from {text}"));
        assert_eq!(
            limit.parse::<u64>().ok(),
            Some(reported),
            "memory limit file vs metrics"
        );
        // runc also places the container in the v2 tree of a hybrid host.
        let unified = container_cgroup("unified", env.namespace(), "busy");
        if unified
            .parent()
            .is_some_and(|parent| parent.parent().is_some_and(std::path::Path::exists))
        {
            assert!(
                unified.join("cgroup.procs").exists(),
                "{} missing",
                unified.display()
            );
        }
    }
}

#[test]
fn shim_update_changes_memory_and_cpu_limits_in_the_cgroup() {
    let Some(env) = TestEnv::start("shim_update") else {
        return;
    };
    env.run_detached("limited", &[], &["/bin/sleep", "300"])
        .expect("run");
    let api = env.api().expect("api");
    let memory = LinuxMemoryBuilder::default()
        .limit(64 * 1024 * 1024_i64)
        .build()
        .expect("memory");
    let cpu = LinuxCpuBuilder::default()
        .quota(50_000_i64)
        .period(100_000_u64)
        .build()
        .expect("cpu");
    let resources = LinuxResourcesBuilder::default()
        .memory(memory)
        .cpu(cpu)
        .build()
        .expect("resources");
    api.update("limited", &resources).expect("update");
    let ns = env.namespace();
    if cgroup_v2_only() {
        let dir = container_cgroup("unified", ns, "limited");
        assert_eq!(read_trimmed(&dir.join("memory.max")), "67108864");
        assert_eq!(read_trimmed(&dir.join("cpu.max")), "50000 100000");
    } else {
        assert_eq!(
            read_trimmed(&container_cgroup("memory", ns, "limited").join("memory.limit_in_bytes")),
            "67108864"
        );
        assert_eq!(
            read_trimmed(&container_cgroup("cpu", ns, "limited").join("cpu.cfs_quota_us")),
            "50000"
        );
        assert_eq!(
            read_trimmed(&container_cgroup("cpu", ns, "limited").join("cpu.cfs_period_us")),
            "100000"
        );
    }
    assert_eq!(api.state("limited", "").expect("state").0, "RUNNING");
}

#[test]
fn shim_oom_kill_publishes_task_oom_before_task_exit() {
    let Some(env) = TestEnv::start("shim_oom") else {
        return;
    };
    let api = env.api().expect("api");
    let events = api.subscribe().expect("subscribe");
    // `tail` keeps the whole newline-free /dev/zero in memory until the 32 MiB limit kills it.
    let args = env.run_args(
        "hog",
        &[],
        &["-d", "--null-io", "--memory-limit", "33554432"],
        &["/bin/sh", "-c", "tail /dev/zero"],
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    env.ctr_ok(&args).expect("run");
    let status = api.wait("hog", "", Duration::from_secs(60)).expect("wait");
    assert_ne!(status, 0, "the hog exited cleanly");
    let exit = events
        .wait_for("/tasks/exit", "hog", WAIT)
        .expect("TaskExit");
    assert!(exit.exit_status.is_some());
    let oom = events.wait_for("/tasks/oom", "hog", WAIT);
    let topics = events.topics_for("hog");
    assert!(oom.is_some(), "no TaskOOM for an OOM kill: {topics:?}");
    let oom_at = topics.iter().position(|topic| topic == "/tasks/oom");
    let exit_at = topics.iter().position(|topic| topic == "/tasks/exit");
    assert!(
        oom_at < exit_at,
        "TaskOOM must come before TaskExit: {topics:?}"
    );
}

#[test]
fn shim_groups_containers_of_one_sandbox_in_one_shim() {
    let Some(env) = TestEnv::start("shim_grouping") else {
        return;
    };
    env.run_detached("pod-a", &[(SANDBOX_ID, "pod-a")], &["/bin/sleep", "300"])
        .expect("run a");
    env.run_detached("pod-b", &[(SANDBOX_ID, "pod-a")], &["/bin/sleep", "300"])
        .expect("run b");
    let shims = env.shims();
    assert_eq!(
        shims.len(),
        1,
        "two containers of one sandbox must share a shim: {shims:?}"
    );
    env.run_detached("alone", &[], &["/bin/sleep", "300"])
        .expect("run alone");
    assert_eq!(
        env.shims().len(),
        2,
        "a container of no sandbox gets its own shim"
    );
    let api = env.api().expect("api");
    for id in ["pod-a", "pod-b", "alone"] {
        assert_eq!(api.state(id, "").expect("state").0, "RUNNING", "{id}");
    }
    // Stopping one container of the group leaves the shim serving the other.
    api.kill("pod-b", "", 9, false).expect("kill b");
    api.wait("pod-b", "", WAIT).expect("wait b");
    api.delete_task("pod-b").expect("delete b");
    assert_eq!(api.state("pod-a", "").expect("state a").0, "RUNNING");
    assert_eq!(env.shims().len(), 2);
}
