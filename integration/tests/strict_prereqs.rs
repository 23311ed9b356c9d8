//! Strict mode has teeth: run as tools/dev test and CI run them, a test whose prerequisite is missing fails
//! instead of passing unseen; a developer's plain `cargo test` still skips it, saying why. The child test is
//! this test binary run again on one ignored test, with a PATH that has containerd and ctr but no runc.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use std::process::{Command, Output};

use baton_integration::{TestEnv, skip};
use baton_prereq::{LOG_ENV, STRICT_ENV};

const CHILD: &str = "a_containerd_test_run_by_the_strict_mode_test";

#[test]
#[ignore = "run in a child process by strict_mode_fails_a_test_whose_prerequisite_is_missing"]
fn a_containerd_test_run_by_the_strict_mode_test() {
    let Some(_env) = TestEnv::start("strict_child") else {
        return;
    };
}

/// Runs the child test with `path` as PATH.
fn run_child(strict: bool, path: &std::path::Path) -> (Output, String) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            CHILD,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("PATH", path)
        .env(STRICT_ENV, if strict { "1" } else { "0" })
        .env_remove("CI")
        .env_remove(LOG_ENV)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out, text)
}

#[test]
fn strict_mode_fails_a_test_whose_prerequisite_is_missing() {
    if let Some(reason) = skip::missing_containerd_prerequisite() {
        skip::missing(&reason);
        return;
    }
    let bin = tempfile::tempdir().unwrap();
    for tool in ["containerd", "ctr"] {
        std::os::unix::fs::symlink(skip::which(tool).unwrap(), bin.path().join(tool)).unwrap();
    }
    let (out, text) = run_child(true, bin.path());
    assert!(!out.status.success(), "strict run passed:\n{text}");
    assert!(
        text.contains(&format!(
            "prerequisite missing for {CHILD}: `runc` not found"
        )),
        "strict run failed for another reason:\n{text}"
    );

    let (out, text) = run_child(false, bin.path());
    assert!(out.status.success(), "loose run failed:\n{text}");
    assert!(
        text.contains(&format!("skipped: {CHILD}: `runc` not found")),
        "loose run did not say why it skipped:\n{text}"
    );
}
