//! The shim survives a containerd restart, is cleaned up after `kill -9`, and checkpoints where CRIU works.

use std::time::{Duration, Instant};

use baton_integration::TestEnv;
use baton_integration::api::StdioPaths;
use baton_integration::{procs, rootfs, skip};

const WAIT: Duration = Duration::from_secs(20);

#[test]
fn shim_tasks_survive_a_containerd_restart() {
    let Some(mut env) = TestEnv::start("shim_containerd_restart") else {
        return;
    };
    env.run_detached("runner", &[], &["/bin/sleep", "300"])
        .expect("run runner");
    env.run_detached("sleeper", &[], &["/bin/sleep", "300"])
        .expect("run sleeper");
    let (exec_pid, shims_before) = {
        let api = env.api().expect("api");
        let process = rootfs::process("runner", &["/bin/sleep", "300"], false).expect("process");
        api.exec("runner", "side", &process, &StdioPaths::default())
            .expect("exec");
        let pid = api.start("runner", "side").expect("start exec");
        env.ctr_ok(&["task", "pause", "sleeper"]).expect("pause");
        (pid, env.shims())
    };
    env.containerd_mut().restart().expect("restart containerd");
    let api = env.api().expect("api after restart");
    assert_eq!(
        env.shims(),
        shims_before,
        "shims changed across the restart"
    );
    assert_eq!(api.state("runner", "").expect("runner").0, "RUNNING");
    assert_eq!(api.state("sleeper", "").expect("sleeper").0, "PAUSED");
    let (exec_status, pid) = api.state("runner", "side").expect("exec state");
    assert_eq!((exec_status.as_str(), pid), ("RUNNING", exec_pid));
    let ps = env.ctr_ok(&["task", "ps", "runner"]).expect("ps");
    assert!(
        ps.contains(&exec_pid.to_string()),
        "exec pid {exec_pid} missing from ps: {ps}"
    );
    let events = api.subscribe().expect("subscribe");
    env.ctr_ok(&["task", "resume", "sleeper"])
        .expect("resume after restart");
    assert_eq!(api.state("sleeper", "").expect("sleeper").0, "RUNNING");
    api.kill("runner", "side", 9, false).expect("kill exec");
    assert_eq!(
        api.wait("runner", "side", WAIT).expect("wait exec"),
        128 + 9
    );
    api.kill("runner", "", 9, false).expect("kill runner");
    assert_eq!(api.wait("runner", "", WAIT).expect("wait runner"), 128 + 9);
    let exit = events.wait_for("/tasks/exit", "runner", WAIT);
    assert!(
        exit.is_some(),
        "no TaskExit after the restart: {:?}",
        events.all()
    );
    assert!(
        events.wait_for("/tasks/resumed", "sleeper", WAIT).is_some(),
        "{:?}",
        events.all()
    );
}

#[test]
fn shim_killed_with_sigkill_is_cleaned_up_by_containerd() {
    let Some(env) = TestEnv::start("shim_kill9") else {
        return;
    };
    let api = env.api().expect("api");
    let events = api.subscribe().expect("subscribe");
    let pid = env
        .create_task_via_api(&api, "orphan", &["/bin/sleep", "300"], &[], None)
        .expect("create");
    api.start("orphan", "").expect("start");
    let bundle = env
        .containerd()
        .state_dir()
        .join("io.containerd.runtime.v2.task")
        .join(env.namespace())
        .join("orphan");
    assert!(
        !baton_integration::cleanup::mounts_under(&bundle.join("rootfs")).is_empty(),
        "the shim did not mount the rootfs in {}",
        bundle.display()
    );
    let shims = env.shims();
    assert_eq!(shims.len(), 1, "{shims:?}");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(shims[0].pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill -9");
    let deadline = Instant::now() + WAIT;
    let mut left = env.leftovers("orphan");
    while Instant::now() < deadline && (!left.is_empty() || procs::alive(pid as i32)) {
        std::thread::sleep(Duration::from_millis(100));
        left = env.leftovers("orphan");
    }
    assert!(
        !procs::alive(pid as i32),
        "container init {pid} survived its shim"
    );
    assert!(left.is_empty(), "left after the shim died: {left:?}");
    assert!(
        env.shims().is_empty(),
        "a shim is still running: {:?}",
        env.shims()
    );
    assert!(
        events.wait_for("/tasks/exit", "orphan", WAIT).is_some(),
        "no TaskExit: {:?}",
        events.all()
    );
    let status = env.task_status("orphan");
    assert!(
        status.is_none() || status.as_deref() == Some("STOPPED"),
        "task still listed as {status:?}"
    );
}

/// The one allowed skip of this machine kind: in strict mode (tools/dev test, CI) the checkpoint test passes
/// by skipping only because integration/allowed-skips.toml lists it, and the skip is logged for the run's
/// summary. Runs the checkpoint test in a child process of this test binary.
#[test]
fn the_checkpoint_test_skips_only_as_allowed_and_is_logged() {
    let log = tempfile::NamedTempFile::new().expect("temp file");
    let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
        .args(["--exact", "shim_checkpoint_where_criu_works", "--nocapture"])
        .env(baton_prereq::STRICT_ENV, "1")
        .env(baton_prereq::LOG_ENV, log.path())
        .output()
        .expect("run the checkpoint test");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "strict checkpoint test failed:\n{text}"
    );
    let criu_works = std::process::Command::new("criu")
        .arg("check")
        .output()
        .is_ok_and(|o| o.status.success());
    let logged = std::fs::read_to_string(log.path()).expect("skip log");
    if criu_works {
        assert_eq!(logged, "", "the checkpoint test ran for real");
    } else {
        assert!(
            logged.starts_with(
                "skipped (allowed): shim_checkpoint_where_criu_works: CRIU cannot checkpoint on this kernel"
            ),
            "skip log: {logged:?}\n{text}"
        );
    }
}

#[test]
fn shim_checkpoint_where_criu_works() {
    let check = std::process::Command::new("criu").arg("check").output();
    match check {
        Err(error) => {
            skip::missing(&format!(
                "criu not found ({error}): install Debian package criu"
            ));
            return;
        }
        Ok(output) if !output.status.success() => {
            let why = String::from_utf8_lossy(&output.stderr)
                .lines()
                .last()
                .unwrap_or("")
                .to_string();
            skip::cannot_run_here(&format!("criu check: {why}"));
            return;
        }
        Ok(_) => {}
    }
    let Some(env) = TestEnv::start("shim_checkpoint") else {
        return;
    };
    env.run_detached(
        "saved",
        &[],
        &[
            "/bin/sh",
            "-c",
            "i=0; while :; do i=$((i+1)); sleep 1; done",
        ],
    )
    .expect("run");
    let out = env.ctr(&["task", "checkpoint", "saved"]);
    assert_eq!(out.code, Some(0), "checkpoint: {}", out.stderr);
    assert_eq!(
        env.task_status("saved").as_deref(),
        Some("RUNNING"),
        "checkpoint without --exit stops nothing"
    );
}
