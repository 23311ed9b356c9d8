//! A Create or Start that fails leaves nothing behind (no runc state, cgroup, mount or process), so the same id
//! can be created again at once. A `runc` first on the shims' PATH fails a step while a marker file asks for it:
//! `create` after doing it for real (a runtime that dies after its work: a created container, its cgroup and
//! state), `start` before (the process never ran; a start that did run is a running task, which runc-v2 too
//! refuses to delete until it is killed). Runs against both shims (`BATON_TEST_RUNTIME=io.containerd.runc.v2`).

use std::path::Path;
use std::time::{Duration, Instant};

use baton_integration::TestEnv;
use baton_integration::api::{Api, StdioPaths, bind_rootfs};
use baton_integration::rootfs;

const WAIT: Duration = Duration::from_secs(20);

/// A `runc` that runs the real one, except that when `<dir>/fail-<command>` exists it exits 1 saying so: at once,
/// or after doing the step for real when the file says `after`.
fn install_failing_runc(bin: &Path, dir: &Path) {
    let real = ["/usr/sbin/runc", "/usr/bin/runc", "/usr/local/sbin/runc"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect("runc installed");
    let script = format!(
        r#"#!/bin/sh
cmd=""; skip=0
for a in "$@"; do
  if [ "$skip" = 1 ]; then skip=0; continue; fi
  case "$a" in
    --root|--log|--log-format|--criu|--rootless) skip=1 ;;
    -*) ;;
    *) cmd="$a"; break ;;
  esac
done
if [ -e "{dir}/fail-$cmd" ]; then
  if [ "$(cat "{dir}/fail-$cmd")" = after ]; then {real} "$@"; fi
  echo "injected failure of runc $cmd" >&2
  exit 1
fi
exec {real} "$@"
"#,
        dir = dir.display()
    );
    let path = bin.join("runc");
    std::fs::write(&path, script).expect("write the runc wrapper");
    let mut perms = std::fs::metadata(&path).expect("stat").permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
    std::fs::set_permissions(&path, perms).expect("chmod the runc wrapper");
}

/// Polls until nothing of `id` is left, or `WAIT` passes; returns what is left.
fn leftovers_after(env: &TestEnv, id: &str) -> baton_integration::cleanup::Leftovers {
    let deadline = Instant::now() + WAIT;
    loop {
        let left = env.leftovers(id);
        if left.is_empty() || Instant::now() > deadline {
            return left;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn create_container(env: &TestEnv, api: &Api, id: &str) {
    let spec = rootfs::spec(
        env.namespace(),
        id,
        &["/bin/sleep", "300"],
        None,
        &Default::default(),
    )
    .expect("spec");
    let json = serde_json::to_vec(&spec).expect("spec json");
    api.create_container(id, env.runtime(), json, None, Default::default())
        .expect("create container");
}

fn create_task(env: &TestEnv, api: &Api, id: &str) -> Result<u32, baton_integration::api::Error> {
    api.create_task(id, &StdioPaths::default(), vec![bind_rootfs(env.rootfs())])
}

/// The same id gets a running task at once.
fn runs_again(env: &TestEnv, api: &Api, id: &str) {
    create_task(env, api, id).expect("create the same id again");
    api.start(id, "").expect("start it");
    assert_eq!(api.state(id, "").expect("state").0, "RUNNING");
    api.kill(id, "", 9, false).expect("kill");
    api.wait(id, "", WAIT).expect("wait");
    api.delete_task(id).expect("delete");
}

#[test]
fn shim_failed_create_leaves_nothing_behind() {
    let Some(env) = TestEnv::start("shim_failed_create") else {
        return;
    };
    let markers = env.scratch();
    install_failing_runc(&env.shim_dir(), &markers);
    let api = env.api().expect("api");
    create_container(&env, &api, "flaky");
    std::fs::write(markers.join("fail-create"), "after").expect("marker");
    create_task(&env, &api, "flaky").expect_err("the create fails");
    let left = leftovers_after(&env, "flaky");
    assert!(left.is_empty(), "a failed Create left {left:?}");
    std::fs::remove_file(markers.join("fail-create")).expect("marker");
    runs_again(&env, &api, "flaky");
}

#[test]
fn shim_failed_start_leaves_nothing_behind_once_deleted() {
    let Some(env) = TestEnv::start("shim_failed_start") else {
        return;
    };
    let markers = env.scratch();
    install_failing_runc(&env.shim_dir(), &markers);
    let api = env.api().expect("api");
    create_container(&env, &api, "flaky");
    create_task(&env, &api, "flaky").expect("create");
    std::fs::write(markers.join("fail-start"), "before").expect("marker");
    api.start("flaky", "").expect_err("the start fails");
    std::fs::remove_file(markers.join("fail-start")).expect("marker");
    // What every client does after a failed start (ctr run, CRI): delete the task.
    api.delete_task("flaky")
        .expect("delete the task whose start failed");
    let left = leftovers_after(&env, "flaky");
    assert!(left.is_empty(), "a failed Start left {left:?} after Delete");
    runs_again(&env, &api, "flaky");
}
