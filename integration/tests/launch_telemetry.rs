//! Launch telemetry end to end on this kernel: the tracer's uprobes on a fake libcuda (built from
//! integration/fake-libcuda, real exported `cuLaunchKernel`, `cuLaunchKernelEx`, `cuGraphLaunch`) count
//! exactly the launches that mock CUDA workloads make in watched cgroups, none of an unwatched one's, also
//! when the library exists only inside the workload's own mount namespace; and `baton trace` shows them.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use std::{os::unix::fs::MetadataExt, path::Path, process::Command, time::Duration};

use baton_integration::{
    agent::{AgentProcess, wait_until},
    skip,
    trace_env::{
        BatonTrace, TraceEnv, collect_until, fake_libcuda_in, missing_trace_prerequisite,
        workspace_binary,
    },
};
use baton_tracer::{LaunchCounts, Tracer};

const WAIT: Duration = Duration::from_secs(30);

macro_rules! require_trace_env {
    () => {
        if let Some(reason) = missing_trace_prerequisite() {
            skip::missing(&reason);
            return;
        }
    };
}

fn counts(kernel: u64, kernel_ex: u64, graph: u64) -> LaunchCounts {
    LaunchCounts {
        kernel,
        kernel_ex,
        graph,
    }
}

/// `baton-mock-cuda` flags: load `lib`, wait until `go` exists (the test creates it once the tracer says its
/// uprobes are attached), then make `n` launches.
fn launch_flags(lib: &Path, n: LaunchCounts, go: &Path) -> Vec<String> {
    vec![
        "--libcuda".into(),
        lib.display().to_string(),
        "--launches".into(),
        format!("{},{},{}", n.kernel, n.kernel_ex, n.graph),
        "--launch-when-exists".into(),
        go.display().to_string(),
    ]
}

/// Lets the workloads waiting on `go` launch.
fn let_launch(go: &Path) {
    std::fs::write(go, b"go\n").unwrap();
}

/// The line the workload prints once it made the launches `n`.
fn launches_done(n: LaunchCounts) -> String {
    format!(
        "phase launches-done kernel={} kernel_ex={} graph={}",
        n.kernel, n.kernel_ex, n.graph
    )
}

/// Reads events until the tracer has probed a libcuda file.
async fn until_probed(tracer: &mut Tracer) {
    collect_until(tracer, WAIT, |t, _| t.launch_libraries().count() > 0)
        .await
        .unwrap();
}

#[tokio::test(flavor = "current_thread")]
async fn launches_of_a_watched_container_are_counted_exactly_and_an_unwatched_ones_are_not() {
    require_trace_env!();
    let mut env = TraceEnv::start("launch", "595.45.04").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let lib = fake_libcuda_in(dir.path()).unwrap();
    let watched = env.make_cgroup("trainer").unwrap();
    let unwatched = env.make_cgroup("other").unwrap();
    let mut tracer = env.tracer().unwrap();
    tracer.watch_cgroup(watched).unwrap();

    let go = dir.path().join("go");
    let n = counts(1000, 200, 30);
    let w = env
        .spawn_workload_with("trainer", 64, 1, &launch_flags(&lib, n, &go), &[])
        .unwrap();
    // The workload opens the mock device after loading the library: the tracer probes it then.
    until_probed(&mut tracer).await;
    let_launch(&go);
    env.workload(w).wait_line(&launches_done(n), WAIT).unwrap();
    // The same file, so the uprobes fire in this process too; its cgroup is not watched.
    let m = counts(50, 40, 3);
    let u = env
        .spawn_workload_with("other", 64, 1, &launch_flags(&lib, m, &go), &[])
        .unwrap();
    env.workload(u).wait_line(&launches_done(m), WAIT).unwrap();

    assert_eq!(tracer.launches(watched), n);
    assert_eq!(tracer.launches(unwatched), LaunchCounts::default());
    assert_eq!(
        tracer.all_launches(),
        vec![(watched, n)],
        "only the watched container has counters"
    );
    let probed: Vec<_> = tracer.launch_libraries().collect();
    assert_eq!(probed.len(), 1, "one file, probed once: {probed:?}");
    assert_eq!(probed[0].ino, std::fs::metadata(&lib).unwrap().ino());
    assert_eq!(probed[0].probed.len(), 3, "{probed:?}");
    env.workload(w).finish().unwrap();
    env.workload(u).finish().unwrap();
}

#[tokio::test(flavor = "current_thread")]
async fn a_libcuda_only_in_the_containers_mount_namespace_is_probed_through_its_proc_root() {
    require_trace_env!();
    let mut env = TraceEnv::start("launch-ns", "595.45.04").unwrap();
    let host = tempfile::tempdir().unwrap();
    let lib = fake_libcuda_in(host.path()).unwrap();
    // Empty on the host; in the workload's mount namespace a tmpfs there holds its own copy of the library.
    let ns_dir = tempfile::tempdir().unwrap();
    let ns_lib = ns_dir.path().join("libcuda.so.1");
    let script = format!(
        "mount -t tmpfs baton-launch-ns '{dir}' && cp '{lib}' '{dir}/libcuda.so.1' && exec \"$@\"",
        dir = ns_dir.path().display(),
        lib = lib.display()
    );
    let wrapper: Vec<String> = [
        "unshare",
        "-m",
        "--propagation",
        "private",
        "/bin/sh",
        "-c",
        &script,
        "sh",
    ]
    .map(str::to_owned)
    .to_vec();
    let cg = env.make_cgroup("trainer").unwrap();
    let mut tracer = env.tracer().unwrap();
    tracer.watch_cgroup(cg).unwrap();

    let go = host.path().join("go");
    let n = counts(300, 20, 10);
    let w = env
        .spawn_workload_with("trainer", 64, 1, &launch_flags(&ns_lib, n, &go), &wrapper)
        .unwrap();
    until_probed(&mut tracer).await;
    let_launch(&go);
    env.workload(w).wait_line(&launches_done(n), WAIT).unwrap();

    assert!(
        !ns_lib.exists(),
        "the library must not be reachable from the host's mount namespace"
    );
    assert_eq!(tracer.launches(cg), n);
    let probed: Vec<_> = tracer.launch_libraries().cloned().collect();
    assert_eq!(probed.len(), 1, "{probed:?}");
    let pid = env.workload(w).pid();
    assert_eq!(
        probed[0].path,
        Path::new(&format!("/proc/{pid}/root")).join(ns_lib.strip_prefix("/").unwrap()),
        "resolved through the process's root"
    );
    assert_ne!(
        probed[0].ino,
        std::fs::metadata(&lib).unwrap().ino(),
        "the namespace's copy, not the host's file, is probed"
    );
    env.workload(w).finish().unwrap();
}

#[test]
fn baton_trace_prints_launches_per_interval_and_in_the_summary() {
    require_trace_env!();
    trace_shows_launches("launch-cli", &["--standalone"], None);
}

#[test]
fn baton_trace_through_the_agent_prints_launches_too() {
    require_trace_env!();
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("agent.sock");
    let _agent = AgentProcess::start(&socket, &dir.path().join("agent.log")).unwrap();
    trace_shows_launches("launch-agent", &[], Some(&socket));
    let log = std::fs::read_to_string(dir.path().join("agent.log")).unwrap();
    assert!(
        log.contains("agent: trace started"),
        "the agent served the trace:\n{log}"
    );
}

/// `baton trace` with `how` (`--standalone`), or through the agent at `agent`, of a workload that launches
/// 700/60/9 times: its launch lines add up to that, and the summary has the totals.
fn trace_shows_launches(name: &str, how: &[&str], agent: Option<&Path>) {
    let mut env = TraceEnv::start(name, "595.45.04").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let lib = fake_libcuda_in(dir.path()).unwrap();
    env.make_cgroup("job").unwrap();
    let out = tempfile::NamedTempFile::new().unwrap();
    let mut command = Command::new(workspace_binary("baton", "baton").unwrap());
    command
        .arg("trace")
        .args(how)
        .args(["--summary", "--launch-interval", "0.2"])
        .arg("--cgroup")
        .arg(env.cgroup_rel("job"))
        .arg("--prefix")
        .arg(env.prefix())
        .arg("-o")
        .arg(out.path());
    if let Some(socket) = agent {
        command.env(baton_agent_api::SOCKET_ENV, socket);
    }
    let trace = BatonTrace::start(command, WAIT).unwrap();
    let go = dir.path().join("go");
    let n = counts(700, 60, 9);
    let w = env
        .spawn_workload_with("job", 64, 1, &launch_flags(&lib, n, &go), &[])
        .unwrap();
    // The trace says when launches through the library are counted; only then may the workload launch.
    let probes_line = format!(
        "pid {pid}: +++ launch uprobes on cuLaunchKernel cuLaunchKernelEx cuGraphLaunch of /proc/{pid}/root{} +++",
        lib.display(),
        pid = env.workload(w).pid()
    );
    assert!(
        wait_until(WAIT, || std::fs::read_to_string(out.path())
            .is_ok_and(|t| t.contains(&probes_line))),
        "the trace never showed the launch uprobes: {probes_line}\n{}",
        std::fs::read_to_string(out.path()).unwrap_or_default()
    );
    let_launch(&go);
    env.workload(w).wait_line(&launches_done(n), WAIT).unwrap();
    env.workload(w).finish().unwrap();
    // Ending the trace prints the launches since the last line, then the summary.
    let (status, stderr) = trace.stop().unwrap();
    assert!(status.success(), "baton trace failed: {status}\n{stderr}");

    let text = std::fs::read_to_string(out.path()).unwrap();
    let mut shown = LaunchCounts::default();
    for line in text.lines().filter(|l| l.contains(" launches/")) {
        assert!(line.contains("/job launches/"), "{line}");
        for (key, count) in [
            ("cuLaunchKernel=", &mut shown.kernel),
            ("cuLaunchKernelEx=", &mut shown.kernel_ex),
            ("cuGraphLaunch=", &mut shown.graph),
        ] {
            let value = line
                .split_whitespace()
                .find_map(|w| w.strip_prefix(key))
                .unwrap_or_else(|| panic!("no {key} in {line}"));
            *count += value.parse::<u64>().unwrap();
        }
    }
    let launch_lines: Vec<&str> = text.lines().filter(|l| l.contains("launch")).collect();
    assert_eq!(
        shown,
        n,
        "the launch lines add up to the launches:\n{}",
        launch_lines.join("\n")
    );
    assert!(
        text.contains("launches: cuLaunchKernel 700, cuLaunchKernelEx 60, cuGraphLaunch 9"),
        "the summary has the totals:\n{text}"
    );
}
