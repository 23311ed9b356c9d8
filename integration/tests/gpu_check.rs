//! `tools/gpu-check --mock`: the device kit run as a user runs it, from the built binaries, against the FUSE
//! mock driver: the agent and `baton trace --json` follow the mock workload, the golden trace is written and
//! every call in it is named, the ledger's peak and the release signal are reported, and a process holding
//! 1 GiB is parked and resumed through the stand-in `cuda-checkpoint` and through the driver helper loading
//! the fake libcuda. NVML's figures are "unavailable" here (no driver), as the agent's are.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use std::{path::PathBuf, process::Command};

use baton_integration::{
    gpu_check::replay,
    shim_binary::target_dir,
    skip,
    trace_env::{fake_libcuda_in, missing_trace_prerequisite, workspace_binary},
};
use serde_json::Value;

fn kit() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tools/gpu-check")
}

/// The binaries the kit runs, built if missing (the fake libcuda's copy is only there to build it).
fn build_the_kit() -> PathBuf {
    for (package, name) in [
        ("baton", "baton"),
        ("containerd-shim-baton-v1", "containerd-shim-baton-v1"),
        ("baton-integration", "baton-gpu-check"),
        ("baton-mock-nvidia", "baton-mock-cuda"),
        ("baton-mock-nvidia", "baton-mock-cuda-checkpoint"),
    ] {
        workspace_binary(package, name).unwrap();
    }
    fake_libcuda_in(tempfile::tempdir().unwrap().path()).unwrap();
    target_dir().join("debug")
}

/// `tools/gpu-check --bin-dir BIN_DIR ARGS...`, run to its end.
fn run_kit(bin_dir: &std::path::Path, args: &[&std::ffi::OsStr]) -> std::process::Output {
    Command::new(kit())
        .arg("--bin-dir")
        .arg(bin_dir)
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn the_kit_on_the_mock_names_every_call_and_parks_through_the_program_and_the_driver_api() {
    if let Some(reason) = missing_trace_prerequisite() {
        skip::missing(&reason);
        return;
    }
    let bin_dir = build_the_kit();
    let out = tempfile::tempdir().unwrap();
    let run = run_kit(
        &bin_dir,
        &["--mock".as_ref(), "--out".as_ref(), out.path().as_os_str()],
    );
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        run.status.success(),
        "gpu-check failed:\n{stdout}\n{stderr}"
    );
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("report.json")).unwrap())
            .unwrap();

    // The trace: the mock workload's set-up, steps and teardown, every escape, class, control command and
    // status named, written where the report says.
    let counts = &report["trace"]["counts"];
    for call in [
        "NV_ESC_RM_ALLOC",
        "NV_ESC_RM_CONTROL",
        "NV_ESC_RM_FREE",
        "UVM_INITIALIZE",
    ] {
        assert!(
            counts["calls"][call].as_u64().unwrap_or(0) > 0,
            "no {call}: {counts}"
        );
    }
    for unknown in [
        "unknown_escapes",
        "unknown_classes",
        "unknown_controls",
        "unknown_statuses",
    ] {
        assert_eq!(
            counts[unknown],
            serde_json::json!({}),
            "{unknown}: {counts}"
        );
    }
    let golden = PathBuf::from(report["trace"]["golden"].as_str().unwrap());
    assert!(
        golden.starts_with(out.path().join("golden/595.45.04")),
        "{}",
        golden.display()
    );
    let lines: Vec<Value> = std::fs::read_to_string(&golden)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len() as u64, counts["events"].as_u64().unwrap());
    // Only the traced program's cgroup (`/baton-gpu-check-PID-trace`) is in it.
    assert!(
        lines
            .iter()
            .all(|e| e["container"].as_str().unwrap().ends_with("-trace")),
        "{:?}",
        lines.first()
    );

    // The golden trace carries the captured bytes: decoded again today, every ioctl prints the same object,
    // and the ledger fed them reaches the peak the agent's did; the expectation beside it says so.
    let replay = replay::replay_file(&golden, "595.45.04").unwrap();
    assert_eq!(replay.ioctls, counts["ioctls"].as_u64().unwrap());
    assert!(
        replay.differences.is_empty(),
        "{:?}",
        replay.differences.first()
    );
    assert_eq!(replay.peak_vram_bytes, 1u64 << 30);
    let expect: Value = serde_json::from_str(
        &std::fs::read_to_string(golden.with_extension("expect.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(expect["ledger_peak_bytes"], 1u64 << 30);
    assert_eq!(expect["unknowns"], 0);

    // The ledger saw the 1 GiB the workload allocated; the release was confirmed after the last close; NVML
    // is unavailable on the mock, in the agent's event as in the kit's poller.
    assert_eq!(report["trace"]["ledger_peak_bytes"], 1u64 << 30);
    assert_eq!(report["trace"]["released"]["nvml"], "unavailable");
    assert!(report["trace"]["close_to_released_ns"].as_u64().unwrap() > 0);
    assert!(report["trace"]["nvml_peak_bytes"].is_null());

    // Both ways parked and resumed the 1 GiB holder intact; the agent saw its GPU released after each park.
    let ways = report["checkpoint"]["ways"].as_array().unwrap();
    let names: Vec<&str> = ways.iter().map(|w| w["way"].as_str().unwrap()).collect();
    assert_eq!(names, ["program", "driver API"]);
    for w in ways {
        assert!(w["unavailable"].is_null(), "{w}");
        assert_eq!(w["intact"], true, "{w}");
        // The mock copies 1 GiB at 4 GiB/s each way: a park or resume cannot take less than 0.25 s.
        assert!(w["park_s"].as_f64().unwrap() >= 0.25, "{w}");
        assert!(w["resume_s"].as_f64().unwrap() >= 0.25, "{w}");
        assert!(w["request_to_released_s"].as_f64().unwrap() > 0.0, "{w}");
    }
    assert!(stdout.contains("| unknown escapes | 0 |"), "{stdout}");
    assert!(
        stdout.contains("| weights intact after resume, via driver API | yes |"),
        "{stdout}"
    );
}

#[test]
fn the_kit_says_what_it_needs_and_refuses_a_machine_without_a_driver() {
    let bin_dir = build_the_kit();
    let help = run_kit(&bin_dir, &["--help".as_ref()]);
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(help.status.success(), "{text}");
    for needed in [
        "--mock",
        "Needs: root",
        "python3 with PyTorch",
        "cuda-checkpoint",
    ] {
        assert!(
            text.contains(needed),
            "--help does not mention {needed:?}:\n{text}"
        );
    }
    if std::path::Path::new("/proc/driver/nvidia/version").exists() {
        return;
    }
    let out = tempfile::tempdir().unwrap();
    let run = run_kit(&bin_dir, &["--out".as_ref(), out.path().as_os_str()]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success());
    let expected = if nix::unistd::geteuid().is_root() {
        "no NVIDIA driver here (/proc/driver/nvidia/version is missing): run on a GPU machine, or pass --mock"
    } else {
        "run tools/gpu-check as root"
    };
    assert!(stderr.contains(expected), "{stderr}");
}
