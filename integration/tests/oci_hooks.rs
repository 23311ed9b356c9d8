//! `baton-hook` as OCI hooks, end to end without containerd or the shim: runc run directly on bundles whose
//! config.json names the hooks (a real agent, the FUSE mock driver's device files bind-mounted in, the mock's
//! holder doing GPU work), podman given the example hooks.d folder, and the hook binary fed bad input.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use std::{
    collections::HashMap,
    process::{Command, Stdio},
    time::Duration,
};

use baton_integration::{
    agent::wait_until,
    oci_hooks::{HookRig, HookUse, run_hook},
};
use serde_json::json;

const WITHIN: Duration = Duration::from_secs(30);

/// The line a hook of `stage` wrote about container `id`, if any.
fn hook_line(rig: &HookRig, stage: &str, id: &str) -> Option<String> {
    rig.hook_lines()
        .into_iter()
        .find(|l| l.starts_with(&format!("baton-hook {stage}: ")) && l.contains(id))
}

#[test]
fn runc_hooks_register_at_create_the_agent_traces_the_work_and_they_unregister_at_stop() {
    let Some(rig) = HookRig::start("lifecycle") else {
        return;
    };
    let mut watch = rig.watch();
    let mut h = rig.run_holder("worker", &HookUse::lifecycle()).unwrap();

    // Registered by the createRuntime hook, before the program ran; poststart found it watched.
    let registered = watch.next_of("worker", "registered", WITHIN).unwrap();
    let ran_at = h.num("stamp").unwrap();
    assert!(
        registered["t_ns"].as_u64().unwrap() < ran_at,
        "registered before the program ran: {registered}"
    );
    let created = hook_line(&rig, "createRuntime", "worker").unwrap_or_default();
    assert!(
        created.contains("the agent watches container worker"),
        "createRuntime registered it: {:?}",
        rig.hook_lines()
    );
    let started = hook_line(&rig, "poststart", "worker").unwrap_or_default();
    assert!(
        started.contains("the agent watches container worker") && !started.contains("after start"),
        "poststart confirmed it: {:?}",
        rig.hook_lines()
    );
    let status = rig.status("worker").unwrap();
    assert_eq!(
        status["cgroup"],
        json!(format!("/{}/worker", rig.namespace)),
        "{status}"
    );
    assert!(
        status["devices"]
            .as_array()
            .unwrap()
            .contains(&json!("/dev/nvidia0")),
        "the devices it sees: {status}"
    );

    // The agent traces its mock GPU work: the file, the RM client it allocates, the release.
    let fd = h.num("open nvidiactl").unwrap();
    let alloc = h.cmd(&format!("alloc {fd}")).unwrap();
    assert_eq!(
        alloc[1], "0",
        "the root client, a device and memory were allocated: {alloc:?}"
    );
    let acquired = watch.next_transition("worker", WITHIN).unwrap();
    assert_eq!(acquired["kind"], json!("acquired"), "{acquired}");
    assert!(
        wait_until(WITHIN, || rig
            .status("worker")
            .is_some_and(|s| s["live_objects"] == json!(3))),
        "the agent saw the allocation: {:?}",
        rig.status("worker")
    );
    h.num(&format!("close {fd}")).unwrap();
    let released = watch.next_transition("worker", WITHIN).unwrap();
    assert_eq!(released["kind"], json!("released"), "{released}");
    assert_eq!(released["objects_freed"], json!(3), "{released}");

    // It stops: runc deletes it and the poststop hook unregisters it.
    h.finish().unwrap();
    watch.next_of("worker", "unregistered", WITHIN).unwrap();
    assert!(rig.status("worker").is_none(), "no longer watched");
    let stopped = hook_line(&rig, "poststop", "worker").unwrap_or_default();
    assert!(
        stopped.contains("no longer watches container worker"),
        "{:?}",
        rig.hook_lines()
    );
}

/// `runc run -d` of container `id` behind the gate (`wait-gpu-free ARGS`), spawned; runc's stderr (which
/// the detached container inherits, so not a pipe) goes to `runc.stderr` in the bundle.
fn run_gated(rig: &HookRig, id: &str, gate: &[&str]) -> (std::process::Child, std::path::PathBuf) {
    let mut hooks = HookUse::lifecycle();
    let mut args = vec!["wait-gpu-free"];
    args.extend_from_slice(gate);
    hooks.insert(1, HookUse::new("createRuntime", &args));
    let bundle = rig
        .bundle(
            id,
            &["/bin/busybox", "sleep", "600"],
            &hooks,
            &HashMap::new(),
        )
        .unwrap();
    let stderr = bundle.join("runc.stderr");
    let child = rig
        .runc()
        .args(["run", "-d", "--bundle"])
        .arg(&bundle)
        .arg(id)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr).unwrap())
        .spawn()
        .unwrap();
    (child, stderr)
}

#[test]
fn the_wait_gpu_free_hook_holds_the_start_until_the_release_and_fails_past_its_timeout_naming_the_holder()
 {
    let Some(rig) = HookRig::start("gate") else {
        return;
    };
    let mut watch = rig.watch();
    let mut holder = rig.run_holder("holder", &HookUse::lifecycle()).unwrap();
    let fd = holder.num("open nvidia0").unwrap();
    holder.cmd(&format!("alloc {fd}")).unwrap();
    assert_eq!(
        watch.next_transition("holder", WITHIN).unwrap()["kind"],
        json!("acquired")
    );

    // The gate holds `runc run` in createRuntime: the program does not run while the holder holds nvidia0.
    let (mut gated, gated_err) = run_gated(&rig, "server", &["--timeout", "1m"]);
    watch.next_of("server", "registered", WITHIN).unwrap();
    assert!(
        !wait_until(Duration::from_millis(500), || gated
            .try_wait()
            .unwrap()
            .is_some()),
        "runc run returned while the holder held the GPU"
    );
    assert_ne!(rig.runc_status("server").as_deref(), Some("running"));
    holder.num(&format!("close {fd}")).unwrap();
    let released = watch.next_transition("holder", WITHIN).unwrap();
    assert_eq!(released["kind"], json!("released"), "{released}");
    let status = gated.wait().unwrap();
    let returned_ns = baton_agent_api::now_monotonic_ns();
    assert!(
        status.success(),
        "the gate opened on the release: {}",
        std::fs::read_to_string(&gated_err).unwrap_or_default()
    );
    assert!(returned_ns > released["t_released_ns"].as_u64().unwrap());
    assert_eq!(rig.runc_status("server").as_deref(), Some("running"));
    let line = hook_line(&rig, "wait-gpu-free", "server").unwrap_or_default();
    assert!(
        line.contains("the GPU is free for container server"),
        "{line}"
    );

    // Past its timeout the gate fails the start, naming the container that holds the GPU; runc removes the
    // container (its poststop hook unregisters it).
    let fd = holder.num("open nvidia0").unwrap();
    holder.cmd(&format!("alloc {fd}")).unwrap();
    assert_eq!(
        watch.next_transition("holder", WITHIN).unwrap()["kind"],
        json!("acquired")
    );
    let (mut late, late_err) = run_gated(&rig, "late", &["--timeout", "300ms"]);
    let status = late.wait().unwrap();
    let err = std::fs::read_to_string(&late_err).unwrap_or_default();
    assert!(!status.success(), "the gate failed the start: {err}");
    assert!(
        err.contains("still held by container holder"),
        "the error names the holder: {err}"
    );
    watch.next_of("late", "unregistered", WITHIN).unwrap();
    assert_eq!(rig.runc_status("late"), None, "runc removed it");

    // Deleting the running one unregisters it.
    let delete = rig
        .runc()
        .args(["delete", "--force", "server"])
        .output()
        .unwrap();
    assert!(
        delete.status.success(),
        "{}",
        String::from_utf8_lossy(&delete.stderr)
    );
    watch.next_of("server", "unregistered", WITHIN).unwrap();
    holder.finish().unwrap();
}

/// The example hooks.d folder with its placeholders replaced: this build's `baton-hook`, the rig's agent
/// socket, plus the rig's log.
fn hooks_dir_for(rig: &HookRig) -> std::path::PathBuf {
    let examples = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../runc-hooks/hooks.d");
    let out = rig.dir.path().join("hooks.d");
    std::fs::create_dir_all(&out).unwrap();
    let mut copied = 0;
    for entry in std::fs::read_dir(&examples).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let text = text
            .replace("/usr/local/bin/baton-hook", &rig.hook.display().to_string())
            .replace("\"timeout\": 30", "\"timeout\": 120")
            .replace(
                "\"/run/baton/agent.sock\"",
                &format!(
                    "\"{}\", \"--log\", \"{}\", \"--agent-timeout\", \"60s\"",
                    rig.agent.socket().display(),
                    rig.hook_log().display()
                ),
            );
        std::fs::write(out.join(path.file_name().unwrap()), text).unwrap();
        copied += 1;
    }
    assert_eq!(copied, 4, "the example hooks.d files");
    out
}

/// Limits podman can set here: its defaults (1048576 open files) are above what root may raise a hard limit
/// to without CAP_SYS_RESOURCE (the CI machines' root lacks it), and its conmon runs with at most 32768
/// processes; the holder needs a few files and no child.
const PODMAN_ULIMITS: [&str; 4] = [
    "--ulimit",
    "nofile=1024:1024",
    "--ulimit",
    "nproc=1024:1024",
];

#[test]
fn podman_with_the_example_hooks_d_registers_and_unregisters_its_container() {
    let Some(rig) = HookRig::start("podman") else {
        return;
    };
    let Some(podman) = baton_integration::skip::which("podman") else {
        baton_integration::skip::missing("podman not found: install Debian package podman");
        return;
    };
    let hooks = hooks_dir_for(&rig);
    let private = rig.dir.path().join("podman");
    std::fs::create_dir_all(&private).unwrap();
    let conf = private.join("containers.conf");
    std::fs::write(
        &conf,
        "[engine]\nevents_logger = \"none\"\ncgroup_manager = \"cgroupfs\"\n",
    )
    .unwrap();
    let storage = private.join("storage.conf");
    std::fs::write(
        &storage,
        format!(
            "[storage]\ndriver = \"vfs\"\nrunroot = \"{0}/runroot\"\ngraphroot = \"{0}/root\"\n",
            private.display()
        ),
    )
    .unwrap();
    let mut command = Command::new(podman);
    command
        .env("CONTAINERS_CONF", &conf)
        .env("CONTAINERS_STORAGE_CONF", &storage)
        .env(
            "CONTAINERS_REGISTRIES_CONF",
            private.join("registries.conf"),
        )
        .arg("--root")
        .arg(private.join("root"))
        .arg("--runroot")
        .arg(private.join("runroot"))
        .arg("--tmpdir")
        .arg(private.join("tmp"))
        .args([
            "--runtime",
            "/usr/sbin/runc",
            "--cgroup-manager",
            "cgroupfs",
        ])
        .args(["--events-backend", "none", "--storage-driver", "vfs"])
        .arg("--hooks-dir")
        .arg(&hooks)
        .args(["run", "--rm", "-i", "--network", "none"])
        .args(PODMAN_ULIMITS)
        .args(["--cgroup-parent", &format!("/{}", rig.namespace)])
        .args([
            "--annotation",
            &format!("baton.io/namespace={}", rig.namespace),
        ]);
    for name in baton_integration::oci_hooks::MOCK_DEVICES {
        command.arg("--volume").arg(format!(
            "{}:/dev/{name}",
            rig.mock_dir.path().join(name).display()
        ));
    }
    // `--rootfs` makes the first argument the root folder (where an image would be named).
    let child = command
        .arg("--rootfs")
        .arg(rig.rootfs())
        .arg("/bin/baton-mock-holder")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(private.join("podman.stderr")).unwrap())
        .spawn()
        .unwrap();
    let mut watch = rig.watch();
    let h = baton_integration::holder::HolderContainer::attach("podman", child);
    let podman_err = || std::fs::read_to_string(private.join("podman.stderr")).unwrap_or_default();
    let mut h = h.unwrap_or_else(|e| panic!("podman run: {e:#}\n{}", podman_err()));

    // podman's container id is its own: the registration in the rig's namespace names it.
    let registered = watch
        .next_matching(WITHIN, |e| e["kind"] == json!("registered"))
        .unwrap_or_else(|e| panic!("{e:#}: hooks {:?}\n{}", rig.hook_lines(), podman_err()));
    let id = registered["id"].as_str().unwrap().to_owned();
    assert!(
        hook_line(&rig, "createRuntime", &id).is_some_and(|l| l.contains("the agent watches")),
        "{:?}",
        rig.hook_lines()
    );
    let fd = h.num("open nvidiactl").unwrap();
    h.cmd(&format!("alloc {fd}")).unwrap();
    assert_eq!(
        watch.next_transition(&id, WITHIN).unwrap()["kind"],
        json!("acquired")
    );
    h.num(&format!("close {fd}")).unwrap();
    assert_eq!(
        watch.next_transition(&id, WITHIN).unwrap()["kind"],
        json!("released")
    );
    h.finish().unwrap();
    watch
        .next_of(&id, "unregistered", WITHIN)
        .unwrap_or_else(|e| panic!("{e:#}: hooks {:?}\n{}", rig.hook_lines(), podman_err()));
    assert!(rig.status(&id).is_none());
}

#[test]
fn malformed_state_json_is_refused_with_a_clear_error_and_registers_nothing() {
    let Some(rig) = HookRig::start("badjson") else {
        return;
    };
    let flags = rig.hook_flags();
    let mut args: Vec<&str> = flags.iter().map(String::as_str).collect();
    args.push("create-runtime");
    for (input, says) in [
        (&b"{\"id\": \"broken\", "[..], "not valid JSON"),
        (&b""[..], "stdin was empty"),
        (&br#"{"pid": 1}"#[..], "no container id"),
        (&br#"{"id": "nopid", "bundle": "/"}"#[..], "has no pid"),
    ] {
        let (code, err) = run_hook(&rig.hook, &args, input).unwrap();
        assert_eq!(code, Some(2), "{err}");
        assert!(err.contains(says), "{says:?}: {err}");
    }
    let node = baton_integration::agent::AgentConn::connect(rig.agent.socket())
        .unwrap()
        .call(json!({"op": "status"}))
        .unwrap();
    assert_eq!(node["containers"], json!([]), "nothing registered: {node}");
}

#[test]
fn a_gone_process_or_one_without_a_cgroup_of_its_own_is_named() {
    let Some(rig) = HookRig::start("badpid") else {
        return;
    };
    let bundle = rig
        .bundle("c", &["/bin/true"], &[], &HashMap::new())
        .unwrap();
    let flags = rig.hook_flags();
    let hook = |stage: &[&str], pid: u32| {
        let mut args: Vec<&str> = flags.iter().map(String::as_str).collect();
        args.extend_from_slice(stage);
        let state = json!({"ociVersion": "1.0.2", "id": "c", "status": "creating", "pid": pid,
                           "bundle": bundle});
        run_hook(&rig.hook, &args, state.to_string().as_bytes()).unwrap()
    };
    // A process that is gone: reaped before the hook runs.
    let mut child = Command::new("/bin/true").spawn().unwrap();
    let gone = child.id();
    child.wait().unwrap();
    let (code, err) = hook(&["create-runtime"], gone);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains(&format!("its process {gone} is gone")),
        "{err}"
    );
    // ... is a warning at poststart (the program may have exited already): the container is not failed.
    let (code, err) = hook(&["poststart"], gone);
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("is gone"), "{err}");

    // kthreadd (pid 2) lives in the root cgroup: no cgroup of its own to watch it by. A warning (the
    // container runs unwatched), or a failure with --require-agent.
    let (code, err) = hook(&["create-runtime"], 2);
    assert_eq!(code, Some(0), "{err}");
    assert!(
        err.contains("root cgroup v2") && err.contains("runs unwatched"),
        "{err}"
    );
    let (code, err) = hook(&["--require-agent", "create-runtime"], 2);
    assert_eq!(code, Some(1), "{err}");
    let node = baton_integration::agent::AgentConn::connect(rig.agent.socket())
        .unwrap()
        .call(json!({"op": "status"}))
        .unwrap();
    assert_eq!(node["containers"], json!([]), "nothing registered: {node}");
}

#[test]
fn with_no_agent_the_container_runs_unwatched_unless_the_agent_is_required() {
    let Some(rig) = HookRig::start("noagent") else {
        return;
    };
    let mut flags = vec![
        "--socket".to_owned(),
        rig.dir.path().join("nobody.sock").display().to_string(),
        "--log".to_owned(),
        rig.hook_log().display().to_string(),
    ];
    let holder = ["/bin/baton-mock-holder"];
    let none = HashMap::new();
    let bundle = rig
        .bundle_with_flags("lonely", &holder, &HookUse::lifecycle(), &none, &flags)
        .unwrap();
    let mut h = rig.run_holder_in("lonely", &bundle).unwrap();
    h.num("open nvidiactl").unwrap();
    let line = hook_line(&rig, "createRuntime", "lonely").unwrap_or_default();
    assert!(
        line.contains("warning")
            && line.contains("cannot reach the baton agent")
            && line.contains("runs unwatched"),
        "{:?}",
        rig.hook_lines()
    );
    h.finish().unwrap();

    // --require-agent: runc fails the container, saying why.
    flags.insert(0, "--require-agent".to_owned());
    let bundle = rig
        .bundle_with_flags("needy", &holder, &HookUse::lifecycle(), &none, &flags)
        .unwrap();
    let out = rig
        .runc()
        .args(["run", "--bundle"])
        .arg(&bundle)
        .arg("needy")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("cannot reach the baton agent") && err.contains("--require-agent"),
        "{err}"
    );
    assert_eq!(rig.runc_status("needy"), None, "runc removed it");
}
