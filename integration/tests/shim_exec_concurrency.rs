//! Exec starts of one container never wait on each other's runc: with a runc (a wrapper of the real one,
//! named by the task's `BinaryName`) whose first `exec` is wedged, a second exec of the same container
//! starts, and after its init is killed the init's exit, a further exec's Start and Wait all answer at once,
//! under real containerd, runc and the Baton shim (as the Go shim does).

use std::{
    path::{Path, PathBuf},
    sync::mpsc,
    time::Duration,
};

use baton_integration::{
    TestEnv,
    api::{self, Api, StdioPaths},
    rootfs, skip,
};

/// Long enough for a loaded CI machine; far shorter than a wedged runc.
const WITHIN: Duration = Duration::from_secs(20);

/// A runc that runs the real one, except that an `exec` finding `wedge` in `dir` takes it and waits until
/// `release` appears there (saying so with `stuck`): a slow or wedged runc exec.
fn runc_with_a_wedged_exec(dir: &Path) -> PathBuf {
    let real = skip::which("runc").expect("runc on PATH");
    let script = format!(
        r#"#!/bin/sh
D='{dir}'
case " $* " in
  *" exec "*)
    if mv "$D/wedge" "$D/wedged" 2>/dev/null; then
      : > "$D/stuck"
      while [ ! -e "$D/release" ]; do sleep 0.05; done
    fi ;;
esac
exec '{real}' "$@"
"#,
        dir = dir.display(),
        real = real.display()
    );
    let path = dir.join("runc-wedged-exec");
    baton_integration::write_script(&path, &script).expect("write the runc wrapper");
    path
}

/// Lets the wedged runc exec go when dropped (a failing test included), so nothing stays stuck.
struct Release(PathBuf);

impl Drop for Release {
    fn drop(&mut self) {
        let _ = std::fs::write(self.0.join("release"), b"");
    }
}

/// Adds exec `exec_id` running `args` to task `id`.
fn add_exec(api: &Api, id: &str, exec_id: &str, args: &[&str]) {
    let process = rootfs::process(id, args, false).expect("process");
    api.exec(id, exec_id, &process, &StdioPaths::default())
        .unwrap_or_else(|e| panic!("exec {exec_id}: {e}"));
}

/// Starts exec `exec_id` of `id` on a thread of its own; its Start's result comes on the receiver.
fn start_in_background(
    env: &TestEnv,
    id: &str,
    exec_id: &str,
) -> mpsc::Receiver<Result<u32, api::Error>> {
    let api = env.api().expect("api");
    let (tx, rx) = mpsc::channel();
    let (id, exec_id) = (id.to_owned(), exec_id.to_owned());
    std::thread::spawn(move || {
        let _ = tx.send(api.start(&id, &exec_id));
    });
    rx
}

/// Waits for `file` (the wrapper's `stuck`), or fails.
fn wait_for_file(file: &Path) {
    assert!(
        baton_integration::agent::wait_until(WITHIN, || file.exists()),
        "{} never appeared: the first runc exec did not run",
        file.display()
    );
}

/// A created and started container `id` running `sleep` with the wedging runc; the API client.
fn sleeper(env: &TestEnv, id: &str, runc: &Path) -> Api {
    let api = env.api().expect("api");
    let options = api::runtime_options_toml(&format!("BinaryName = \"{}\"\n", runc.display()));
    env.create_task_via_api(&api, id, &["/bin/sleep", "300"], &[], Some(options))
        .unwrap_or_else(|e| panic!("create {id}: {e}"));
    api.start(id, "")
        .unwrap_or_else(|e| panic!("start {id}: {e}"));
    api
}

#[test]
fn a_second_exec_starts_while_the_first_ones_runc_is_wedged() {
    let Some(env) = TestEnv::start("shim_exec_wedged") else {
        return;
    };
    let dir = env.scratch();
    let _release = Release(dir.clone());
    let runc = runc_with_a_wedged_exec(&dir);
    let api = sleeper(&env, "box", &runc);

    add_exec(&api, "box", "first", &["/bin/sleep", "300"]);
    add_exec(&api, "box", "second", &["/bin/sleep", "300"]);
    std::fs::write(dir.join("wedge"), b"").expect("wedge");
    let first = start_in_background(&env, "box", "first");
    wait_for_file(&dir.join("stuck"));
    let second = start_in_background(&env, "box", "second");
    let pid = second
        .recv_timeout(WITHIN)
        .expect("the second exec's Start answered while the first one's runc is wedged")
        .expect("the second exec started");
    assert!(pid > 0);
    assert_eq!(api.state("box", "second").expect("state").0, "RUNNING");
    assert!(
        first.try_recv().is_err(),
        "the first exec's Start waits for its runc"
    );

    // Its runc let go, the first exec starts too.
    drop(_release);
    first
        .recv_timeout(WITHIN)
        .expect("the first exec's Start answered once its runc returned")
        .expect("the first exec started");
    api.kill("box", "", 9, true).expect("kill");
}

#[test]
fn with_an_exec_wedged_in_runc_the_inits_exit_and_a_second_exec_answer_at_once() {
    let Some(env) = TestEnv::start("shim_exec_wedged_kill") else {
        return;
    };
    let dir = env.scratch();
    let release = Release(dir.clone());
    let runc = runc_with_a_wedged_exec(&dir);
    let api = sleeper(&env, "box", &runc);
    let events = api.subscribe().expect("subscribe");

    add_exec(&api, "box", "first", &["/bin/sleep", "300"]);
    add_exec(&api, "box", "second", &["/bin/true"]);
    std::fs::write(dir.join("wedge"), b"").expect("wedge");
    let first = start_in_background(&env, "box", "first");
    wait_for_file(&dir.join("stuck"));
    api.kill("box", "", 9, false).expect("kill the init");
    assert_eq!(
        api.wait("box", "", WITHIN)
            .expect("the init's Wait answers while an exec's runc is wedged"),
        128 + 9
    );
    assert!(
        events.wait_for("/tasks/exit", "box", WITHIN).is_some(),
        "the init's TaskExit: {:?}",
        events.all()
    );
    // A second exec's Start answers at once, refused (the container is stopped) rather than queued.
    let second = start_in_background(&env, "box", "second");
    let answer = second
        .recv_timeout(WITHIN)
        .expect("the second exec's Start answered while the first one's runc is wedged");
    assert!(
        answer.is_err(),
        "no exec starts in a stopped container: {answer:?}"
    );

    drop(release);
    let first = first
        .recv_timeout(WITHIN)
        .expect("the first exec's Start answered once its runc returned");
    assert!(
        first.is_err(),
        "the wedged exec found its container gone: {first:?}"
    );
    api.delete_task("box").expect("delete the task");
}
