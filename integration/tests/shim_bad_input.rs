//! Bad input gets a clear error and the shim keeps serving the other tasks it holds (all bad containers share
//! the healthy container's shim through the sandbox-id annotation, where the spec can be read).

use std::time::Duration;

use baton_integration::api::{self, Api, StdioPaths};
use baton_integration::procs::Found;
use baton_integration::{TestEnv, rootfs, skip};

const WAIT: Duration = Duration::from_secs(20);
const SANDBOX: (&str, &str) = ("io.kubernetes.cri.sandbox-id", "pod");

/// A healthy task in the pod's shim; returns the shim.
fn healthy(env: &TestEnv) -> Found {
    env.run_detached("healthy", &[SANDBOX], &["/bin/sleep", "300"])
        .expect("run healthy");
    let shims = env.shims();
    assert_eq!(shims.len(), 1, "{shims:?}");
    shims[0].clone()
}

/// The healthy task still answers, through the same shim process.
fn assert_still_serving(env: &TestEnv, api: &Api, shim: &Found, after: &str) {
    assert!(
        baton_integration::procs::alive(shim.pid),
        "the shim died after {after}"
    );
    assert_eq!(
        api.state("healthy", "").expect("state").0,
        "RUNNING",
        "after {after}"
    );
    let exec_id = format!(
        "probe-{}",
        after.replace(|c: char| !c.is_ascii_alphanumeric(), "-")
    );
    let out = env.ctr(&[
        "task",
        "exec",
        "--exec-id",
        &exec_id,
        "healthy",
        "/bin/echo",
        "alive",
    ]);
    assert_eq!(
        out.stdout.trim(),
        "alive",
        "exec after {after}: {}",
        out.stderr
    );
}

fn assert_clear(error: &str, what: &str, needles: &[&str]) {
    let lower = error.to_lowercase();
    assert!(!error.trim().is_empty(), "{what}: empty error");
    assert!(
        needles
            .iter()
            .any(|needle| lower.contains(&needle.to_lowercase())),
        "{what}: error does not say what is wrong (expected one of {needles:?}): {error}"
    );
}

#[test]
fn shim_missing_rootfs_is_a_clear_error() {
    let Some(env) = TestEnv::start("shim_bad_rootfs") else {
        return;
    };
    let shim = healthy(&env);
    let api = env.api().expect("api");
    let args = [
        "run",
        "-d",
        "--null-io",
        "--runtime",
        env.runtime(),
        "--annotation",
        "io.kubernetes.cri.sandbox-id=pod",
        "--rootfs",
        "/nonexistent-baton-rootfs",
        "norootfs",
        "/bin/true",
    ];
    let out = env.ctr(&args);
    assert_ne!(out.code, Some(0), "a missing rootfs was accepted");
    assert_clear(
        &out.stderr,
        "missing rootfs",
        &["nonexistent-baton-rootfs", "no such file"],
    );
    assert_still_serving(&env, &api, &shim, "missing rootfs");
}

#[test]
fn shim_invalid_config_json_is_a_clear_error() {
    let Some(env) = TestEnv::start("shim_bad_config") else {
        return;
    };
    let shim = healthy(&env);
    let api = env.api().expect("api");
    api.create_container(
        "garbled",
        env.runtime(),
        b"{ this is not json".to_vec(),
        None,
        Default::default(),
    )
    .expect("containerd stores the spec as given");
    let error = api
        .create_task(
            "garbled",
            &StdioPaths::default(),
            vec![api::bind_rootfs(env.rootfs())],
        )
        .expect_err("a task with an invalid config.json was created");
    // containerd 1.6 itself parses config.json before it starts the shim ("failed to start shim: invalid
    // character ..."), for any runtime; a shim that gets that far must name the file or the spec.
    let needles: &[&str] = &["config.json", "spec", "invalid character"];
    assert_clear(&error.message(), "invalid config.json", needles);
    assert_still_serving(&env, &api, &shim, "invalid config.json");
}

#[test]
fn shim_unknown_exec_id_is_not_found() {
    let Some(env) = TestEnv::start("shim_unknown_exec") else {
        return;
    };
    let shim = healthy(&env);
    let api = env.api().expect("api");
    let kill = api
        .kill("healthy", "no-such-exec", 9, false)
        .expect_err("kill of an unknown exec");
    assert_clear(
        &kill.message(),
        "kill unknown exec",
        &["not found", "no-such-exec"],
    );
    let state = api
        .state("healthy", "no-such-exec")
        .expect_err("state of an unknown exec");
    assert_clear(
        &state.message(),
        "state unknown exec",
        &["not found", "no-such-exec"],
    );
    let resize = api
        .resize("healthy", "no-such-exec", 80, 24)
        .expect_err("resize of an unknown exec");
    assert_clear(
        &resize.message(),
        "resize unknown exec",
        &["not found", "no-such-exec"],
    );
    let wait = api
        .wait("healthy", "no-such-exec", WAIT)
        .expect_err("wait on an unknown exec");
    assert_clear(
        &wait.message(),
        "wait unknown exec",
        &["not found", "no-such-exec"],
    );
    assert_still_serving(&env, &api, &shim, "unknown exec id");
}

#[test]
fn shim_exec_and_pause_on_a_stopped_task_are_refused() {
    let Some(env) = TestEnv::start("shim_stopped_task") else {
        return;
    };
    let shim = healthy(&env);
    let api = env.api().expect("api");
    env.run_detached("done", &[SANDBOX], &["/bin/true"])
        .expect("run");
    assert_eq!(api.wait("done", "", WAIT).expect("wait"), 0);
    let process = rootfs::process("done", &["/bin/true"], false).expect("process");
    let exec = api
        .exec("done", "late", &process, &StdioPaths::default())
        .and_then(|()| api.start("done", "late"))
        .expect_err("exec in a stopped task");
    assert_clear(
        &exec.message(),
        "exec on stopped",
        &["stopped", "not running", "exited", "cannot"],
    );
    let pause = env.ctr(&["task", "pause", "done"]);
    assert_ne!(pause.code, Some(0), "pause of a stopped task succeeded");
    assert_clear(
        &pause.stderr,
        "pause of stopped",
        &["stopped", "not running", "exited", "cannot"],
    );
    assert_still_serving(&env, &api, &shim, "exec/pause on a stopped task");
}

#[test]
fn shim_malformed_options_toml_is_a_clear_error() {
    let Some(env) = TestEnv::start("shim_bad_options") else {
        return;
    };
    if !env.is_baton() {
        skip::not_applicable(
            "runtime options TOML (config_body) is Baton's; not checked against another runtime",
        );
        return;
    }
    let shim = healthy(&env);
    let api = env.api().expect("api");
    let options = api::runtime_options_toml("ebpf = [ this is not toml");
    let error = env
        .create_task_via_api(
            &api,
            "badtoml",
            &["/bin/sleep", "300"],
            &[SANDBOX],
            Some(options),
        )
        .expect_err("malformed TOML accepted");
    assert_clear(
        &error.to_string(),
        "malformed TOML",
        &["toml", "config_body", "options"],
    );
    assert_still_serving(&env, &api, &shim, "malformed options TOML");
    let valid = api::runtime_options_toml("ebpf = false\nfreezer = \"signal\"\n");
    env.create_task_via_api(
        &api,
        "goodtoml",
        &["/bin/sleep", "300"],
        &[SANDBOX],
        Some(valid),
    )
    .expect("valid options TOML refused");
}

#[test]
fn shim_invalid_baton_annotations_are_clear_errors() {
    let Some(env) = TestEnv::start("shim_bad_annotations") else {
        return;
    };
    if !env.is_baton() {
        skip::not_applicable(
            "baton.io/ annotations are Baton's; not checked against another runtime",
        );
        return;
    }
    let shim = healthy(&env);
    let api = env.api().expect("api");
    let cases: [(&str, (&str, &str), &str); 7] = [
        ("badfreezer", ("baton.io/freezer", "sometimes"), "freezer"),
        (
            "badcuda",
            ("baton.io/cuda_checkpoint_path", " "),
            "cuda_checkpoint_path",
        ),
        // What the probes see is the node's to decide: refused whatever the value.
        ("ebpfoff", ("baton.io/ebpf", "false"), "baton.io/ebpf"),
        (
            "otherprefix",
            ("baton.io/trace_prefix", "/gpu/nvidia"),
            "baton.io/trace_prefix",
        ),
        // A wait beyond the bound fails Create (it overflowed the shim's deadline at Start).
        (
            "hugewait",
            ("baton.io/wait-gpu-free", "18446744073709551615s"),
            "wait-gpu-free",
        ),
        (
            "longwait",
            ("baton.io/wait-gpu-free", "25h"),
            "wait-gpu-free",
        ),
        (
            "zerowait",
            ("baton.io/wait-gpu-free", "0s"),
            "wait-gpu-free",
        ),
    ];
    for (id, annotation, key) in cases {
        let error = env
            .create_task_via_api(
                &api,
                id,
                &["/bin/sleep", "300"],
                &[SANDBOX, annotation],
                None,
            )
            .expect_err(&format!("{annotation:?} accepted"));
        assert_clear(&error.to_string(), id, &[key]);
        assert_still_serving(&env, &api, &shim, id);
    }
    // A co-runner the agent may park for a server does not opt out of the park's freeze: a thawed parked
    // co-runner could start a fresh CUDA process beside that server (issue 39). Nor does a tenant lower the
    // node's least need of the gate's room. Both are the node's TOML's.
    let co_runner = [
        SANDBOX,
        ("baton.io/role", "co-runner"),
        ("baton.io/preemptible", "park"),
    ];
    for (id, annotation) in [
        ("nofreeze", ("baton.io/park-freeze", "false")),
        ("tinyneed", ("baton.io/gpu_memory_minimum", "1")),
    ] {
        let annotations = [co_runner.as_slice(), &[annotation]].concat();
        let error = env
            .create_task_via_api(&api, id, &["/bin/sleep", "300"], &annotations, None)
            .expect_err(&format!("{annotation:?} accepted"));
        let error = error.to_string();
        assert!(
            [annotation.0, "not allowed in annotations", "options TOML"]
                .iter()
                .all(|needle| error.contains(needle)),
            "{id}: {error}"
        );
        assert_still_serving(&env, &api, &shim, id);
    }
}

#[test]
fn shim_refuses_program_paths_from_annotations() {
    let Some(env) = TestEnv::start("shim_program_annotation") else {
        return;
    };
    if !env.is_baton() {
        skip::not_applicable(
            "baton.io/ annotations are Baton's; not checked against another runtime",
        );
        return;
    }
    let shim = healthy(&env);
    let api = env.api().expect("api");
    // A real, valid program path: the annotation is refused for what it is, not for its value.
    let annotation = ("baton.io/cuda_checkpoint_path", "/bin/true");
    let error = env
        .create_task_via_api(
            &api,
            "pathfrompod",
            &["/bin/sleep", "300"],
            &[SANDBOX, annotation],
            None,
        )
        .expect_err("an annotation chose the program the root shim runs");
    let error = error.to_string();
    assert!(
        error.contains("baton.io/cuda_checkpoint_path") && error.contains("options TOML"),
        "the error must name the key and say where to set it: {error}"
    );
    assert_still_serving(&env, &api, &shim, "program path annotation");
    let toml = api::runtime_options_toml("cuda_checkpoint_path = \"/bin/true\"\n");
    env.create_task_via_api(
        &api,
        "pathfromnode",
        &["/bin/sleep", "300"],
        &[SANDBOX],
        Some(toml),
    )
    .expect("the node's TOML may set cuda_checkpoint_path");
}
