//! Task Pause / Resume through the shim's cgroup freezer, in cgroup v1 (this hybrid host: runc uses the v1
//! freezer) and in cgroup v2 (containerd, the shim and runc in a private mount namespace with cgroup2 over
//! /sys/fs/cgroup): a paused task's processes stop running and its cgroup reads frozen (as `runc state` sees it),
//! Resume makes them run again, exec into a paused task fails at once with a clear error, SIGKILL ends a paused
//! task with status 137, delete --force of a paused task works, and nothing stays frozen after.
use std::{
    path::PathBuf,
    time::{Duration, Instant},
};

use baton_integration::{TestEnv, containerd::CgroupMode};

const SPIN: &[&str] = &["/bin/busybox", "sh", "-c", "while :; do :; done"];

fn pid_of(env: &TestEnv, id: &str) -> u32 {
    let listing = env.ctr_ok(&["task", "ls"]).expect("ctr task ls");
    listing
        .lines()
        .find_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            (f.first() == Some(&id)).then(|| f.get(1)?.parse().ok())?
        })
        .unwrap_or_else(|| panic!("{id} not in ctr task ls:\n{listing}"))
}

/// CPU time of every process in the container's cgroup (ns, from schedstat).
fn cpu_ns(pids: &[u32]) -> u64 {
    pids.iter()
        .map(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/schedstat"))
                .ok()
                .and_then(|s| s.split_whitespace().next()?.parse::<u64>().ok())
                .unwrap_or(0)
        })
        .sum()
}

fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The container's freezer as the kernel shows it from outside: (the file, what it says when frozen).
fn frozen_marker(mode: CgroupMode, env: &TestEnv, id: &str) -> (PathBuf, &'static str) {
    match mode {
        CgroupMode::Host => (
            PathBuf::from("/sys/fs/cgroup/freezer")
                .join(env.namespace())
                .join(id)
                .join("freezer.state"),
            "FROZEN",
        ),
        CgroupMode::V2 => (
            PathBuf::from("/sys/fs/cgroup/unified")
                .join(env.namespace())
                .join(id)
                .join("cgroup.events"),
            "frozen 1",
        ),
    }
}

fn is_frozen(marker: &(PathBuf, &str)) -> bool {
    std::fs::read_to_string(&marker.0).is_ok_and(|t| t.lines().any(|l| l.trim() == marker.1))
}

/// The spinner's CPU time does not move over 100 ms (it would gain about 100 ms running).
fn assert_stopped(pid: u32) {
    let before = cpu_ns(&[pid]);
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(100) {
        let ran = cpu_ns(&[pid]) - before;
        assert!(ran < 2_000_000, "a paused task ran for {ran} ns");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn assert_runs(pid: u32) {
    let before = cpu_ns(&[pid]);
    wait_until("the resumed task runs", || {
        cpu_ns(&[pid]) > before + 5_000_000
    });
}

fn pause_resume_kill_exec_delete(mode: CgroupMode, test: &str) {
    let Some(env) = TestEnv::start_in(test, mode) else {
        return;
    };
    env.run_detached("spin", &[], SPIN)
        .expect("run the spinner");
    let pid = pid_of(&env, "spin");
    let marker = frozen_marker(mode, &env, "spin");
    let own = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("cgroup of the task");
    let v1_line = own
        .lines()
        .find(|l| l.contains(":freezer:"))
        .unwrap_or_default()
        .to_string();
    match mode {
        CgroupMode::Host => assert!(
            v1_line.ends_with(&format!("/{}/spin", env.namespace())),
            "{own}"
        ),
        CgroupMode::V2 => assert!(
            v1_line.ends_with(":/"),
            "runc in v2 mode leaves the v1 freezer alone: {own}"
        ),
    }
    assert_runs(pid);

    for _ in 0..3 {
        env.ctr_ok(&["task", "pause", "spin"]).expect("pause");
        assert_eq!(env.task_status("spin").as_deref(), Some("PAUSED"));
        assert!(is_frozen(&marker), "{} reads frozen", marker.0.display());
        assert_stopped(pid);
        env.ctr_ok(&["task", "resume", "spin"]).expect("resume");
        assert_eq!(env.task_status("spin").as_deref(), Some("RUNNING"));
        assert!(!is_frozen(&marker));
        assert_runs(pid);
    }

    // Exec into a paused task: refused at once (a process joining a frozen cgroup would hang).
    env.ctr_ok(&["task", "pause", "spin"]).expect("pause");
    let started = Instant::now();
    let exec = env.ctr(&[
        "task",
        "exec",
        "--exec-id",
        "e1",
        "spin",
        "/bin/busybox",
        "true",
    ]);
    assert!(!exec.success(), "exec into a paused task must fail");
    assert!(
        exec.stderr.contains("paused"),
        "the error says why: {}",
        exec.stderr
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "exec answered in {:?}",
        started.elapsed()
    );
    assert!(is_frozen(&marker), "the refused exec left the task paused");

    // SIGKILL of a paused task ends it (the v1 freezer holds it until thawed: the shim thaws).
    env.ctr_ok(&["task", "kill", "-s", "SIGKILL", "spin"])
        .expect("kill");
    wait_until("the killed task is stopped", || {
        env.task_status("spin").as_deref() == Some("STOPPED")
    });
    let delete = env.ctr(&["task", "delete", "spin"]);
    assert!(
        delete.success() && delete.stderr.contains("exit code 137"),
        "ctr task delete reports the task's status (137: SIGKILL): {delete:?}"
    );
    env.ctr_ok(&["container", "delete", "spin"])
        .expect("delete the container");
    let left = env.leftovers("spin");
    assert!(left.is_empty(), "a killed paused task left {left:?}");

    // delete --force of a paused task (kill, then delete) works and leaves nothing frozen behind.
    env.run_detached("spin2", &[], SPIN)
        .expect("run the second spinner");
    let marker2 = frozen_marker(mode, &env, "spin2");
    env.ctr_ok(&["task", "pause", "spin2"]).expect("pause");
    assert!(is_frozen(&marker2));
    env.ctr_ok(&["task", "delete", "--force", "spin2"])
        .expect("delete --force a paused task");
    env.ctr_ok(&["container", "delete", "spin2"])
        .expect("delete the container");
    assert!(
        !is_frozen(&marker2),
        "the deleted task's cgroup stayed frozen"
    );
    let left = env.leftovers("spin2");
    assert!(left.is_empty(), "a deleted paused task left {left:?}");

    if env.is_baton() {
        let log = std::fs::read_to_string(env.containerd().log_path()).unwrap_or_default();
        let version = if mode == CgroupMode::Host { "v1" } else { "v2" };
        assert!(
            log.lines()
                .any(|l| l.contains("confirmed by the cgroup freezer")
                    && l.contains(&format!("version={version}"))),
            "the shim paused through its {version} freezer (containerd's log has no such line)"
        );
    }
}

#[test]
fn pause_resume_kill_exec_delete_in_cgroup_v1() {
    pause_resume_kill_exec_delete(CgroupMode::Host, "freezer_v1");
}

#[test]
fn pause_resume_kill_exec_delete_in_cgroup_v2() {
    pause_resume_kill_exec_delete(CgroupMode::V2, "freezer_v2");
}
