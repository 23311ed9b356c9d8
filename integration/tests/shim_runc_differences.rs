//! The last differences from containerd's Go runc-v2 shim, each checked against both shims
//! (`BATON_TEST_RUNTIME=io.containerd.runc.v2` runs them against Debian's Go shim): SIGTERM shuts the shim
//! down and leaves its containers to containerd's clean-up, a paused container whose init exits is thawed, a
//! process that has not exited reports the zero time (0001-01-01) as its `exited_at`, and Update of a task
//! created from a checkpoint but not yet restored is refused with the reason.

use std::path::PathBuf;
use std::time::Duration;

use baton_integration::api::{Api, StdioPaths};
use baton_integration::containerd::CgroupMode;
use baton_integration::procs::alive;
use baton_integration::shim_ttrpc::ShimClient;
use baton_integration::{TestEnv, rootfs};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

const WAIT: Duration = Duration::from_secs(20);
/// Seconds from 1970 to 0001-01-01T00:00:00Z: Go's zero `time.Time` as a protobuf timestamp.
const GO_ZERO_TIME_SECONDS: i64 = -62_135_596_800;

/// Polls `done` until it holds or `WAIT` passes; returns whether it held.
fn eventually(done: impl FnMut() -> bool) -> bool {
    baton_integration::agent::wait_until(WAIT, done)
}

/// The bundle containerd made for task `id`.
fn bundle(env: &TestEnv, id: &str) -> PathBuf {
    env.containerd()
        .state_dir()
        .join("io.containerd.runtime.v2.task")
        .join(env.namespace())
        .join(id)
}

/// The one shim of this containerd.
fn only_shim(env: &TestEnv) -> i32 {
    let shims = env.shims();
    assert_eq!(shims.len(), 1, "one shim expected: {shims:?}");
    shims[0].pid
}

fn sigterm(pid: i32) {
    kill(Pid::from_raw(pid), Signal::SIGTERM).expect("SIGTERM the shim");
}

#[test]
fn shim_sigterm_exits_and_containerd_cleans_up_its_container() {
    let Some(env) = TestEnv::start("shim_sigterm_exits") else {
        return;
    };
    let api = env.api().expect("api");
    let events = api.subscribe().expect("subscribe");
    env.run_detached("term", &[], &["/bin/sleep", "300"])
        .expect("run");
    let (_, init) = api.state("term", "").expect("state");
    let shim = only_shim(&env);

    sigterm(shim);
    assert!(
        eventually(|| !alive(shim)),
        "the shim is still running after SIGTERM (runc-v2's exits at once)"
    );
    // containerd sees the shim gone and runs its `delete` action: the container is killed and cleaned up.
    let exit = events
        .wait_for("/tasks/exit", "term", WAIT)
        .expect("a TaskExit for the container of the stopped shim");
    assert_eq!(exit.exit_status, Some(128 + 9), "{exit:?}");
    assert!(
        events.wait_for("/tasks/delete", "term", WAIT).is_some(),
        "no TaskDelete"
    );
    assert!(
        eventually(|| !alive(init as i32)),
        "the container outlived its shim's clean-up"
    );
    assert!(
        eventually(|| env.leftovers("term").is_empty()),
        "{:?}",
        env.leftovers("term")
    );
    assert_eq!(env.task_status("term"), None);
    // The container gets a new task at once.
    env.ctr_ok(&["task", "start", "-d", "--null-io", "term"])
        .expect("a new task for the container");
    assert_eq!(env.task_status("term").as_deref(), Some("RUNNING"));
}

#[test]
fn shim_sigterm_while_containerd_is_down_leaves_the_container_to_its_next_start() {
    let Some(mut env) = TestEnv::start("shim_sigterm_no_containerd") else {
        return;
    };
    let api = env.api().expect("api");
    env.run_detached("term", &[], &["/bin/sleep", "300"])
        .expect("run");
    let (_, init) = api.state("term", "").expect("state");
    drop(api);
    let shim = only_shim(&env);
    env.containerd_mut().stop();

    sigterm(shim);
    assert!(
        eventually(|| !alive(shim)),
        "the shim is still running after SIGTERM (runc-v2's exits at once)"
    );
    assert!(
        alive(init as i32),
        "the container runs on without its shim, as with runc-v2"
    );
    env.containerd_mut().restart().expect("restart containerd");
    assert!(
        eventually(|| !alive(init as i32)),
        "containerd's start did not clean up the container of the dead shim"
    );
    assert!(
        eventually(|| env.leftovers("term").is_empty()),
        "{:?}",
        env.leftovers("term")
    );
    assert!(eventually(|| env.task_status("term").is_none()));
}

#[test]
fn shim_paused_container_whose_init_exits_is_thawed() {
    // cgroup v2: its freezer lets SIGKILL end a frozen task (the v1 freezer holds it until thawed).
    let Some(env) = TestEnv::start_in("shim_paused_init_exit", CgroupMode::V2) else {
        return;
    };
    let api = env.api().expect("api");
    env.run_detached("frozen", &[], &["/bin/sleep", "300"])
        .expect("run");
    let (_, init) = api.state("frozen", "").expect("state");
    env.ctr_ok(&["task", "pause", "frozen"]).expect("pause");
    let freeze = PathBuf::from("/sys/fs/cgroup/unified")
        .join(env.namespace())
        .join("frozen")
        .join("cgroup.freeze");
    let frozen = || std::fs::read_to_string(&freeze).map(|t| t.trim() == "1");
    assert!(
        frozen().expect("read cgroup.freeze"),
        "{} after Pause",
        freeze.display()
    );

    // The init dies while paused, killed from outside the shim.
    kill(Pid::from_raw(init as i32), Signal::SIGKILL).expect("kill the init");
    assert_eq!(api.wait("frozen", "", WAIT).expect("wait"), 128 + 9);
    assert!(
        !frozen().expect("read cgroup.freeze"),
        "the cgroup of the exited container is still frozen (runc-v2 thaws it before publishing the exit)"
    );
    assert_eq!(api.state("frozen", "").expect("state").0, "STOPPED");
    api.delete_task("frozen").expect("delete");
    assert!(
        eventually(|| env.leftovers("frozen").is_empty()),
        "{:?}",
        env.leftovers("frozen")
    );
}

#[test]
fn shim_reports_the_zero_time_as_exited_at_until_a_process_exits() {
    let Some(env) = TestEnv::start("shim_exited_at_zero") else {
        return;
    };
    let api = env.api().expect("api");
    env.run_detached("run", &[], &["/bin/sleep", "300"])
        .expect("run");
    let process = rootfs::process("run", &["/bin/sleep", "300"], false).expect("process");
    api.exec("run", "idle", &process, &StdioPaths::default())
        .expect("exec");
    let shim = ShimClient::for_bundle(&bundle(&env, "run"), env.namespace()).expect("shim");
    for (exec_id, what) in [("", "a running init"), ("idle", "an exec not started")] {
        let state = shim.state("run", exec_id).expect("shim State");
        let at = state.exited_at.as_ref().map(|t| (t.seconds, t.nanos));
        assert_eq!(
            at,
            Some((GO_ZERO_TIME_SECONDS, 0)),
            "exited_at of {what}: runc-v2 sends the zero time (0001-01-01); an absent one reads 1970 in containerd 2.x"
        );
    }
    // Through containerd too.
    let listed = api.process("run", "").expect("get");
    assert_eq!(
        listed.exited_at.map(|t| t.seconds),
        Some(GO_ZERO_TIME_SECONDS)
    );
    // Once exited, the real time.
    api.kill("run", "", 9, false).expect("kill");
    api.wait("run", "", WAIT).expect("wait");
    let state = shim.state("run", "").expect("shim State");
    let seconds = state.exited_at.as_ref().map_or(0, |t| t.seconds);
    assert!(
        seconds > 1_700_000_000,
        "exited_at after the exit: {seconds}"
    );
}

/// An (empty) CRIU checkpoint blob in containerd's content store, as `ctr task checkpoint` leaves one, held by
/// `api`'s lease (containerd's garbage collector removed an unreferenced one before the restore once in CI).
fn checkpoint_blob(api: &Api) -> containerd_client::types::Descriptor {
    let mut archive = tar::Builder::new(Vec::new());
    archive.finish().expect("tar");
    let blob = archive.into_inner().expect("tar bytes");
    api.write_content(
        "checkpoint-blob",
        "application/vnd.containerd.container.criu.checkpoint.criu.tar",
        blob,
    )
    .expect("write the checkpoint blob")
}

#[test]
fn shim_update_of_a_task_created_from_a_checkpoint_is_refused_with_the_reason() {
    let Some(env) = TestEnv::start("shim_update_restored") else {
        return;
    };
    let api = env.api().expect("api");
    let spec = rootfs::spec(
        env.namespace(),
        "restored",
        &["/bin/sleep", "300"],
        None,
        &Default::default(),
    )
    .expect("spec");
    let json = serde_json::to_vec(&spec).expect("spec json");
    api.create_container("restored", env.runtime(), json, None, Default::default())
        .expect("create container");
    let checkpoint = checkpoint_blob(&api);
    env.collect_garbage().expect("a garbage collection");
    api.create_task_from(
        "restored",
        &StdioPaths::default(),
        vec![baton_integration::api::bind_rootfs(env.rootfs())],
        None,
        Some(checkpoint),
    )
    .expect("create the task from the checkpoint");
    assert_eq!(api.state("restored", "").expect("state").0, "CREATED");
    let resources: oci_spec::runtime::LinuxResources = serde_json::from_value(serde_json::json!({
        "memory": {"limit": 256 * 1024 * 1024}
    }))
    .expect("resources");
    // runc-v2 hands it to runc, which knows no container before the restore ("container does not exist").
    let refused = api
        .update("restored", &resources)
        .expect_err("Update of a task not restored yet");
    if env.is_baton() {
        let message = refused.message();
        assert!(
            message.contains("checkpoint") && message.contains("Start"),
            "the refusal says why and what to do: {message}"
        );
    }
    assert_eq!(api.state("restored", "").expect("state").0, "CREATED");
    api.delete_task("restored").expect("delete");
    assert!(
        eventually(|| env.leftovers("restored").is_empty()),
        "{:?}",
        env.leftovers("restored")
    );
}
