//! The `baton trace` command as a user runs it: the ready line, JSON lines with the documented keys, the
//! summary, and one-line errors.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use std::{process::Command, time::Duration};

use baton_integration::{
    skip,
    trace_env::{BatonTrace, TraceEnv, missing_trace_prerequisite, workspace_binary},
};

const WAIT: Duration = Duration::from_secs(20);

fn baton() -> std::path::PathBuf {
    workspace_binary("baton", "baton").unwrap()
}

#[test]
fn json_lines_carry_the_documented_keys_and_the_summary_the_ledger() {
    if let Some(reason) = missing_trace_prerequisite() {
        skip::missing(&reason);
        return;
    }
    let mut env = TraceEnv::start("cli", "595.45.04").unwrap();
    env.make_cgroup("job").unwrap();
    let out = tempfile::NamedTempFile::new().unwrap();
    let mut command = Command::new(baton());
    command
        .args([
            "trace",
            "--container",
            "job",
            "--json",
            "--summary",
            "--prefix",
        ])
        .arg(env.prefix())
        .arg("-o")
        .arg(out.path());
    // The workload starts once baton trace says its probes are attached, and tracing ends (SIGTERM, as
    // Ctrl-C) once the workload has exited: every call it made is in the ring buffer by then.
    let trace = BatonTrace::start(command, WAIT).unwrap();
    let w = env.spawn_workload("job", 300, 2).unwrap();
    env.workload(w).wait_line("phase holding", WAIT).unwrap();
    let summary = env.workload(w).finish().unwrap();
    let (status, stderr) = trace.stop().unwrap();
    assert!(status.success(), "baton trace failed: {status}\n{stderr}");

    let text = std::fs::read_to_string(out.path()).unwrap();
    let (json, rest): (Vec<&str>, Vec<&str>) = text.lines().partition(|l| l.starts_with('{'));
    let events: Vec<serde_json::Value> = json
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let ioctls: Vec<&serde_json::Value> = events.iter().filter(|e| e["event"] == "ioctl").collect();
    let calls: u64 =
        summary.escapes.values().sum::<u64>() + summary.uvm_commands.values().sum::<u64>();
    assert_eq!(
        ioctls.len() as u64,
        calls,
        "one JSON object per driver call"
    );
    for e in &ioctls {
        for key in [
            "ts_ns",
            "cgroup_id",
            "container",
            "pid",
            "tid",
            "fd_kind",
            "escape",
            "cmd",
            "latency_ns",
            "fields",
        ] {
            assert!(e.get(key).is_some(), "key {key} missing in {e}");
        }
        assert!(e["container"].as_str().unwrap().ends_with("/job"), "{e}");
    }
    let alloc = ioctls
        .iter()
        .find(|e| e["fields"]["hClass"]["name"] == "NV01_MEMORY_LOCAL_USER")
        .expect("the video memory allocation is decoded");
    assert_eq!(alloc["status_name"], "NV_OK");
    assert_eq!(alloc["fields"]["size"], 300u64 << 20);

    let report = rest.join("\n");
    assert!(
        report.contains("== container"),
        "summary printed:\n{report}"
    );
    let alloc_row: Vec<&str> = report
        .lines()
        .find(|l| l.starts_with("NV_ESC_RM_ALLOC "))
        .unwrap_or_else(|| panic!("no RM_ALLOC row:\n{report}"))
        .split_whitespace()
        .collect();
    let allocs: u64 = summary.allocs_by_class.values().sum();
    assert_eq!(
        alloc_row[1].parse::<u64>().unwrap(),
        allocs,
        "calls column: {alloc_row:?}"
    );
    let (p50, p99): (f64, f64) = (alloc_row[3].parse().unwrap(), alloc_row[4].parse().unwrap());
    assert!(
        p50 > 0.0 && p99 >= p50,
        "latency percentiles of real FUSE round trips: {alloc_row:?}"
    );
    assert!(
        report.contains("live objects: 0"),
        "everything freed at the end:\n{report}"
    );
}

#[test]
fn errors_say_what_to_do() {
    let out = Command::new(baton()).args(["trace"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("nothing to trace: give --container"), "{err}");

    let out = Command::new(baton())
        .args(["trace", "--all", "--driver-version", "banana"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("--driver-version \"banana\" is not"));

    if !nix::unistd::geteuid().is_root() {
        skip::missing("needs root to check the not-root message by dropping privileges");
        return;
    }
    let setpriv = Command::new("setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(baton())
        .args(["trace", "--all", "--duration", "1"])
        .output();
    match setpriv {
        Ok(out) => {
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success());
            assert!(err.contains("needs root"), "{err}");
        }
        Err(e) => skip::missing(&format!(
            "setpriv not available ({e}): install Debian package util-linux"
        )),
    }
}

/// `baton demo` runs the mock driver as its own process, found next to the baton binary or on PATH (the
/// production binary does not link the mock), and says how to build it when it is in neither place.
#[test]
fn demo_finds_the_mock_driver_on_path_and_traces_the_workload() {
    if let Some(reason) = missing_trace_prerequisite() {
        skip::missing(&reason);
        return;
    }
    let helpers = workspace_binary("baton-mock-nvidia", "baton-mock-nvidia").unwrap();
    workspace_binary("baton-mock-nvidia", "baton-mock-cuda").unwrap();
    let alone = tempfile::tempdir_in(baton_integration::shim_binary::target_dir()).unwrap();
    let lone_baton = alone.path().join("baton");
    std::fs::hard_link(baton(), &lone_baton)
        .or_else(|_| std::fs::copy(baton(), &lone_baton).map(drop))
        .unwrap();
    let demo = |path: &str| {
        Command::new(&lone_baton)
            .args(["demo", "--mock", "--steps", "1", "--vram-mib", "64"])
            .env("PATH", path)
            .output()
            .unwrap()
    };

    let out = demo("/usr/bin:/bin");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("not found next to")
            && err.contains("cargo build --release -p baton-mock-nvidia"),
        "{err}"
    );

    let out = demo(&format!(
        "{}:/usr/bin:/bin",
        helpers.parent().unwrap().display()
    ));
    let (text, err) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "{err}\n{text}");
    assert!(text.contains("NV_ESC_RM_ALLOC("), "{text}");
    assert!(text.contains("== container baton-demo/trainer-"), "{text}");
    assert!(text.contains("live objects: 0"), "{text}");
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !mounts.contains("baton-demo-dev"),
        "the mock is unmounted: {mounts}"
    );
}
