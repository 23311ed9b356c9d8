//! Strict mode has teeth: run as tools/dev test and CI run them, a test whose prerequisite is missing fails
//! instead of passing unseen; a developer's plain `cargo test` still skips it, saying why. Each child test is
//! this test binary run again on one ignored test: with a PATH that has containerd and ctr but no runc; with
//! another runtime under test (`BATON_TEST_RUNTIME`), asked for (`BATON_COMPARE_RUNTIME=1`) or not; and a
//! test that finds it cannot run on this machine kind but is not an allowed skip.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use std::process::{Command, Output};

use baton_integration::{
    TestEnv,
    shim_binary::{self, BATON_RUNTIME},
    skip,
};
use baton_prereq::{COMPARE_ENV, LOG_ENV, RUNTIME_ENV, STRICT_ENV};

const CHILD: &str = "a_containerd_test_run_by_the_strict_mode_test";
const NOT_APPLICABLE_CHILD: &str = "a_test_that_finds_itself_not_applicable";
const BATON_ONLY_CHILD: &str = "a_baton_only_test_run_by_the_runtime_switch_test";
/// A test that says no machine of this kind can run it, which integration/allowed-skips.toml does not list.
const CANNOT_RUN_CHILD: &str = "a_test_that_says_this_machine_cannot_run_it";
const GO_SHIM: &str = "io.containerd.runc.v2";

#[test]
#[ignore = "run in a child process by strict_mode_fails_a_test_whose_prerequisite_is_missing"]
fn a_containerd_test_run_by_the_strict_mode_test() {
    let Some(_env) = TestEnv::start("strict_child") else {
        return;
    };
}

#[test]
#[ignore = "run in a child process by strict_mode_fails_a_runtime_switch_nobody_asked_for"]
fn a_baton_only_test_run_by_the_runtime_switch_test() {
    if shim_binary::runtime_under_test() != BATON_RUNTIME {
        skip::not_applicable("a Baton feature");
        return;
    }
    panic!("the child ran under Baton's runtime: {RUNTIME_ENV} did not reach it");
}

#[test]
#[ignore = "run in a child process by strict_mode_fails_not_applicable_unless_a_comparison_was_asked_for"]
fn a_test_that_finds_itself_not_applicable() {
    skip::not_applicable("another runtime, says the test");
}

#[test]
#[ignore = "run in a child process by a_skip_not_listed_as_allowed_fails_strict_mode"]
fn a_test_that_says_this_machine_cannot_run_it() {
    skip::cannot_run_here("this machine kind cannot run this (says the test)");
}

/// Runs the child test with `path` as PATH.
fn run_child(strict: bool, path: &std::path::Path) -> (Output, String) {
    run_named_child(CHILD, strict, &[("PATH", path.to_str().unwrap())])
}

/// Runs child test `name` in strict mode or not, with `env` added (and no runtime switch but `env`'s).
fn run_named_child(name: &str, strict: bool, env: &[(&str, &str)]) -> (Output, String) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            name,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(STRICT_ENV, if strict { "1" } else { "0" })
        .env_remove("CI")
        .env_remove(LOG_ENV)
        .env_remove(RUNTIME_ENV)
        .env_remove(COMPARE_ENV)
        .envs(env.iter().copied())
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

#[test]
fn strict_mode_fails_a_runtime_switch_nobody_asked_for() {
    let switched = [(RUNTIME_ENV, GO_SHIM)];
    let (out, text) = run_named_child(BATON_ONLY_CHILD, true, &switched);
    assert!(
        !out.status.success(),
        "strict run with an unasked switch passed:\n{text}"
    );
    assert!(
        text.contains(&format!("{RUNTIME_ENV}={GO_SHIM}")) && text.contains(COMPARE_ENV),
        "strict run failed for another reason:\n{text}"
    );

    let asked = [(RUNTIME_ENV, GO_SHIM), (COMPARE_ENV, "1")];
    let (out, text) = run_named_child(BATON_ONLY_CHILD, true, &asked);
    assert!(
        out.status.success(),
        "strict comparison run failed:\n{text}"
    );
    assert!(
        text.contains(&format!(
            "not applicable: {BATON_ONLY_CHILD}: a Baton feature"
        )),
        "the comparison run did not report the test as not applicable:\n{text}"
    );

    let (out, text) = run_named_child(BATON_ONLY_CHILD, false, &switched);
    assert!(out.status.success(), "loose run failed:\n{text}");
    assert!(
        text.contains(&format!("not applicable: {BATON_ONLY_CHILD}")),
        "loose run did not say why it skipped:\n{text}"
    );
}

#[test]
fn strict_mode_fails_not_applicable_unless_a_comparison_was_asked_for() {
    let (out, text) = run_named_child(NOT_APPLICABLE_CHILD, true, &[]);
    assert!(!out.status.success(), "strict run passed:\n{text}");
    assert!(
        text.contains(COMPARE_ENV),
        "strict run failed for another reason:\n{text}"
    );
    let (out, text) = run_named_child(NOT_APPLICABLE_CHILD, true, &[(COMPARE_ENV, "1")]);
    assert!(
        out.status.success(),
        "strict comparison run failed:\n{text}"
    );
    assert!(
        text.contains(&format!("not applicable: {NOT_APPLICABLE_CHILD}")),
        "{text}"
    );
}

#[test]
fn a_skip_not_listed_as_allowed_fails_strict_mode() {
    let (out, text) = run_named_child(CANNOT_RUN_CHILD, true, &[]);
    assert!(
        !out.status.success(),
        "a test that cannot run here skipped in strict mode, unlisted:\n{text}"
    );
    assert!(
        text.contains(baton_prereq::ALLOWED_FILE) && text.contains("strict_prereqs"),
        "strict run failed for another reason:\n{text}"
    );
    let (out, text) = run_named_child(CANNOT_RUN_CHILD, false, &[]);
    assert!(out.status.success(), "loose run failed:\n{text}");
}
