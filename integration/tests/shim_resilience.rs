//! The shim survives a containerd restart, is cleaned up after `kill -9`, and checkpoints and restores
//! through runc and real CRIU.

use std::path::Path;
use std::time::{Duration, Instant};

use baton_integration::TestEnv;
use baton_integration::agent::wait_until;
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

/// Makes container `id` through the API, on the busybox rootfs with `out` bind-mounted at /out, running
/// a counter that writes its value to /out/count ten times a second; its task is created from `checkpoint`
/// when one is given (restored by Start), else created fresh, and started.
fn start_counter(
    env: &TestEnv,
    id: &str,
    out: &Path,
    checkpoint: Option<containerd_client::types::Descriptor>,
) {
    let api = env.api().expect("api");
    let mut spec = rootfs::spec(
        env.namespace(),
        id,
        &[
            "/bin/sh",
            "-c",
            // Written aside and renamed: a kill between the truncation and the write of `>` left an empty
            // count (CI), which the test read as no count at all.
            "i=0; while :; do i=$((i+1)); echo $i > /out/count.new; mv /out/count.new /out/count; sleep 0.1; done",
        ],
        None,
        &Default::default(),
    )
    .expect("spec");
    let mut mounts = spec.mounts().clone().unwrap_or_default();
    mounts.push(
        oci_spec::runtime::MountBuilder::default()
            .destination("/out")
            .typ("bind")
            .source(out)
            .options(vec!["rbind".to_string(), "rw".to_string()])
            .build()
            .expect("mount"),
    );
    spec.set_mounts(Some(mounts));
    let json = serde_json::to_vec(&spec).expect("spec json");
    api.create_container(id, env.runtime(), json, None, Default::default())
        .expect("create container");
    api.create_task_from(
        id,
        &StdioPaths::default(),
        vec![baton_integration::api::bind_rootfs(env.rootfs())],
        None,
        checkpoint,
    )
    .expect("create the task");
    api.start(id, "")
        .expect("start (a restore, from a checkpoint)");
}

/// The counter's last value, once it parses (a write may be under way).
fn count(out: &Path) -> Option<u64> {
    std::fs::read_to_string(out.join("count"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// containerd's Task Checkpoint and a task restored from its image, through runc and real CRIU (Debian
/// unstable's 4.2, which tools/setup.sh caches where the shim looks by default): the restored process goes on
/// counting from where the dumped one stopped, with the memory CRIU saved, instead of starting again.
#[test]
fn shim_checkpoint_and_restore_through_real_criu() {
    let criu = Path::new(baton_agent_api::option_keys::DEFAULT_CRIU_PATH);
    match std::process::Command::new(criu).arg("check").output() {
        Err(error) => {
            skip::missing(&format!(
                "CRIU not found at {} ({error}): run tools/setup.sh",
                criu.display()
            ));
            return;
        }
        Ok(output) if !output.status.success() => {
            skip::missing(&format!(
                "{} check fails: {}",
                criu.display(),
                String::from_utf8_lossy(&output.stderr).trim()
            ));
            return;
        }
        Ok(_) => {}
    }
    let Some(env) = TestEnv::start("shim_checkpoint") else {
        return;
    };
    let out = env.scratch().join("out");
    std::fs::create_dir_all(&out).expect("out folder");
    start_counter(&env, "saved", &out, None);
    assert!(
        wait_until(WAIT, || count(&out).is_some_and(|n| n >= 3)),
        "the counter runs"
    );
    let before = count(&out).expect("a count");
    let checkpointed = env.ctr(&["task", "checkpoint", "saved"]);
    assert!(
        checkpointed.success(),
        "checkpoint: {}",
        checkpointed.stderr
    );
    assert_eq!(
        env.task_status("saved").as_deref(),
        Some("RUNNING"),
        "checkpoint without --exit stops nothing"
    );
    env.ctr_ok(&["task", "kill", "--signal", "SIGKILL", "saved"])
        .expect("kill");
    assert!(
        wait_until(WAIT, || env.task_status("saved").as_deref()
            == Some("STOPPED")),
        "the dumped counter stops"
    );
    let stopped_at = count(&out).expect("a count");

    start_counter(
        &env,
        "restored",
        &out,
        Some(env.checkpoint_blob(&checkpointed.stdout)),
    );
    assert!(
        wait_until(WAIT, || count(&out).is_some_and(|n| n != stopped_at)),
        "the restored counter runs"
    );
    // Dumped at `before` or later; a fresh start would write 1 first.
    let first = count(&out).expect("a count");
    assert!(
        first > before,
        "the restored process counts on from its checkpoint (taken at {before} or later; it wrote {first}), \
         not from 1"
    );
    assert_eq!(env.task_status("restored").as_deref(), Some("RUNNING"));
}
