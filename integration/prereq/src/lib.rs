//! What a Baton test does when it cannot run: one rule for every test in the workspace.
//!
//! - [`missing`]: a prerequisite that `tools/setup.sh` installs (root, FUSE, containerd, runc, cgroups,
//!   python3, `script`, ...) is absent. A developer's plain `cargo test` skips loudly (`skipped: <test>:
//!   <reason>` on stderr); in strict mode the test fails with the reason.
//! - [`cannot_run_here`]: no machine of this kind can run the test (a real GPU, CRIU on this kernel). In strict
//!   mode it is an allowed skip only if `integration/allowed-skips.toml` lists the test by its test target
//!   *and* its name (a test of the same name in another target is not allowed); otherwise it fails like
//!   [`missing`].
//! - [`not_applicable`]: the test is about a Baton feature and the runtime under test is another one
//!   (`BATON_TEST_RUNTIME` names containerd's Go shim). A developer's run reports it and goes on.
//!
//! Switching the runtime under test must be asked for: in strict mode a runtime other than Baton's
//! ([`check_runtime_switch`], which the harness calls when it reads `BATON_TEST_RUNTIME`) and every
//! [`not_applicable`] fail unless `BATON_COMPARE_RUNTIME=1` says the switch is meant (a comparison run
//! against the Go shim). So a stray `BATON_TEST_RUNTIME` in CI fails the run instead of skipping every
//! Baton test and staying green.
//!
//! Strict mode is on when `BATON_STRICT_PREREQS=1` (tools/dev test sets it) or `CI=true`. Every skip is also
//! appended as one line to the file named by `BATON_SKIP_LOG`, when set, for the summary at the end of a run.
//! Callers return from the test after these functions (they return only when the test is to be skipped).

use std::{io::Write, path::Path};

/// Environment variable that turns strict mode on (`1`).
pub const STRICT_ENV: &str = "BATON_STRICT_PREREQS";
/// Environment variable naming the file that skips are appended to.
pub const LOG_ENV: &str = "BATON_SKIP_LOG";
/// Environment variable naming the runtime type the containerd tests run against (default: Baton's).
pub const RUNTIME_ENV: &str = "BATON_TEST_RUNTIME";
/// Environment variable (`1`) that asks for another runtime under test in strict mode (a comparison run).
pub const COMPARE_ENV: &str = "BATON_COMPARE_RUNTIME";
/// The list of tests allowed to skip in strict mode, relative to the workspace root.
pub const ALLOWED_FILE: &str = "integration/allowed-skips.toml";

const ALLOWED_TOML: &str = include_str!("../../allowed-skips.toml");

/// One test allowed to skip in strict mode.
#[derive(Debug, serde::Deserialize)]
pub struct Allowed {
    /// The test's name as libtest prints it.
    pub test: String,
    /// Its test target: the file under `tests/` (`integration/tests/shim_resilience.rs`), or the crate
    /// name for unit tests. Part of the key: only this target's test of that name may skip.
    pub target: String,
    /// Why no machine of this kind can run it.
    pub reason: String,
}

#[derive(serde::Deserialize)]
struct AllowedFile {
    /// Empty (the goal) when every test runs on this machine kind.
    #[serde(default)]
    allowed: Vec<Allowed>,
}

/// The entries of `integration/allowed-skips.toml`.
pub fn allowed_skips() -> Result<Vec<Allowed>, toml::de::Error> {
    toml::from_str::<AllowedFile>(ALLOWED_TOML).map(|f| f.allowed)
}

/// Whether a missing prerequisite fails the test (see the module documentation).
pub fn strict() -> bool {
    std::env::var(STRICT_ENV).is_ok_and(|v| v == "1")
        || std::env::var("CI").is_ok_and(|v| v == "true")
}

/// Whether another runtime under test was asked for (`BATON_COMPARE_RUNTIME=1`).
pub fn compare_asked() -> bool {
    std::env::var(COMPARE_ENV).is_ok_and(|v| v == "1")
}

/// A test: its target (cargo's name for the test binary: a `tests/` file's stem, or the crate name with
/// `_` for `-`) and its name as libtest prints it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TestId {
    /// The test target.
    pub target: String,
    /// The test's name.
    pub name: String,
}

/// The running test's name: libtest names each test's thread after it.
pub fn current_test() -> String {
    std::thread::current()
        .name()
        .unwrap_or("<unnamed thread>")
        .to_owned()
}

/// The running test: its name, and its target from the test binary's file name (`<target>-<hash>`).
pub fn current_test_id() -> TestId {
    let exe = std::env::current_exe().unwrap_or_default();
    let stem = exe.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    TestId {
        target: target_of_binary(stem).to_owned(),
        name: current_test(),
    }
}

/// The target a test binary was built for: cargo names it `<target>-<16 hex digits>`.
fn target_of_binary(file_name: &str) -> &str {
    match file_name.rsplit_once('-') {
        Some((target, hash)) if hash.len() == 16 && hash.bytes().all(|b| b.is_ascii_hexdigit()) => {
            target
        }
        _ => file_name,
    }
}

/// The cargo target name of an `allowed-skips.toml` `target`: a file's stem, or a crate name with `_`.
fn target_of_entry(target: &str) -> String {
    let path = Path::new(target);
    if path.extension().is_some_and(|e| e == "rs") {
        path.file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or(target)
            .to_owned()
    } else {
        target.replace('-', "_")
    }
}

/// The harness reads the runtime under test: in strict mode, a runtime other than `baton_runtime` fails
/// the test unless [`COMPARE_ENV`] asks for it (see the module documentation).
pub fn check_runtime_switch(runtime: &str, baton_runtime: &str) {
    if let Some(message) = runtime_switch_refused(runtime, baton_runtime, strict(), compare_asked())
    {
        panic!("{message}");
    }
}

fn runtime_switch_refused(
    runtime: &str,
    baton_runtime: &str,
    strict: bool,
    compare: bool,
) -> Option<String> {
    (runtime != baton_runtime && strict && !compare).then(|| {
        format!(
            "{RUNTIME_ENV}={runtime} switches the runtime under test away from Baton's ({baton_runtime}), \
             and strict mode (tools/dev test, CI) does not do that unasked: unset {RUNTIME_ENV}, or set \
             {COMPARE_ENV}=1 to compare against that runtime on purpose"
        )
    })
}

/// A prerequisite that tools/setup.sh provides is missing: fails the test in strict mode, else skips loudly.
pub fn missing(reason: &str) {
    apply(decide(
        Kind::Missing,
        &current_test_id(),
        reason,
        Mode::from_env(),
    ));
}

/// The test cannot run on this kind of machine (`detail` says what was found): an allowed skip when
/// `integration/allowed-skips.toml` lists it, else handled like [`missing`].
pub fn cannot_run_here(detail: &str) {
    apply(decide(
        Kind::CannotRunHere,
        &current_test_id(),
        detail,
        Mode::from_env(),
    ));
}

/// The test checks a Baton feature and another runtime is under test: reported; in strict mode it fails
/// unless [`COMPARE_ENV`] asked for that runtime.
pub fn not_applicable(reason: &str) {
    apply(decide(
        Kind::NotApplicable,
        &current_test_id(),
        reason,
        Mode::from_env(),
    ));
}

/// What the environment asked of this run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Mode {
    /// Strict mode.
    strict: bool,
    /// Another runtime under test was asked for.
    compare: bool,
}

impl Mode {
    fn from_env() -> Self {
        Self {
            strict: strict(),
            compare: compare_asked(),
        }
    }
}

/// Which function reported the skip.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Missing,
    CannotRunHere,
    NotApplicable,
}

/// What happens to the test.
#[derive(Debug, PartialEq, Eq)]
enum Decision {
    /// Fail with this message.
    Fail(String),
    /// Skip; this line goes to stderr and to the skip log.
    Skip(String),
}

fn decide(kind: Kind, test: &TestId, reason: &str, mode: Mode) -> Decision {
    let list = allowed_skips().unwrap_or_else(|e| panic!("{ALLOWED_FILE} does not parse: {e}"));
    decide_with(kind, test, reason, mode, &list)
}

/// [`decide`] against the allowed skips `allowed`.
fn decide_with(
    kind: Kind,
    test: &TestId,
    reason: &str,
    mode: Mode,
    allowed: &[Allowed],
) -> Decision {
    let reason = reason.replace('\n', " ");
    let name = &test.name;
    match kind {
        Kind::NotApplicable if mode.strict && !mode.compare => Decision::Fail(format!(
            "{name} is not applicable to the runtime under test ({reason}), and strict mode (tools/dev test, \
             CI) does not switch runtimes unasked: unset {RUNTIME_ENV}, or set {COMPARE_ENV}=1 to compare \
             against another runtime on purpose"
        )),
        Kind::NotApplicable => Decision::Skip(format!("not applicable: {name}: {reason}")),
        Kind::CannotRunHere => match allowed_reason(allowed, test) {
            Some(why) => Decision::Skip(format!("skipped (allowed): {name}: {why} ({reason})")),
            None if mode.strict => Decision::Fail(format!(
                "{name} (test target {}) cannot run on this machine: {reason}. Strict mode (tools/dev \
                 test, CI) fails a test that cannot run unless {ALLOWED_FILE} lists it (its target and \
                 name) with the reason no machine of this kind can run it",
                test.target
            )),
            None => Decision::Skip(format!("skipped: {name}: {reason}")),
        },
        Kind::Missing if mode.strict => Decision::Fail(format!(
            "prerequisite missing for {name}: {reason}. Strict mode (tools/dev test, CI; {STRICT_ENV}=1 or \
             CI=true) fails a test that cannot run: run tools/setup.sh as root, or fix what the reason names"
        )),
        Kind::Missing => Decision::Skip(format!("skipped: {name}: {reason}")),
    }
}

/// The reason the allowed skips `list` give for `test`, matched by target and name.
fn allowed_reason(list: &[Allowed], test: &TestId) -> Option<String> {
    list.iter()
        .find(|a| a.test == test.name && target_of_entry(&a.target) == test.target)
        .map(|a| a.reason.clone())
}

fn apply(decision: Decision) {
    match decision {
        Decision::Fail(message) => panic!("{message}"),
        Decision::Skip(line) => {
            eprintln!("{line}");
            if let Some(path) = std::env::var_os(LOG_ENV) {
                append_line(Path::new(&path), &line);
            }
        }
    }
}

/// Appends `line` to the skip log (one `write` with O_APPEND, so concurrent test processes do not interleave).
fn append_line(path: &Path, line: &str) {
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut f| f.write_all(format!("{line}\n").as_bytes()));
    if let Err(e) = written {
        panic!(
            "cannot append to the skip log {} ({LOG_ENV}): {e}",
            path.display()
        );
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]
    use super::*;

    /// A test the allowed skips of [`listed`] name.
    const LISTED: &str = "a_test_no_machine_of_this_kind_can_run";

    /// An allowed-skips list with one entry, [`LISTED`] of target `shim_resilience` (the real file may be
    /// empty: the rules are tested on this one).
    fn listed() -> Vec<Allowed> {
        vec![Allowed {
            test: LISTED.into(),
            target: "integration/tests/shim_resilience.rs".into(),
            reason: "CRIU cannot run here, says this list".into(),
        }]
    }

    #[test]
    fn every_allowed_skip_names_a_test_that_exists_and_says_why() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        for a in allowed_skips().unwrap() {
            assert!(
                a.reason.len() > 20,
                "{}: say why no machine of this kind can run it",
                a.test
            );
            let source = std::fs::read_to_string(root.join(&a.target))
                .unwrap_or_else(|e| panic!("{}: target {}: {e}", a.test, a.target));
            let name = a.test.rsplit("::").next().unwrap();
            assert!(
                source.contains(&format!("fn {name}(")),
                "{} is not in {}",
                a.test,
                a.target
            );
        }
    }

    fn id(target: &str, name: &str) -> TestId {
        TestId {
            target: target.into(),
            name: name.into(),
        }
    }

    const STRICT: Mode = Mode {
        strict: true,
        compare: false,
    };
    const LOOSE: Mode = Mode {
        strict: false,
        compare: false,
    };

    #[test]
    fn strict_mode_fails_a_missing_prerequisite_and_loose_mode_skips_it() {
        let t = id("x", "t");
        let Decision::Fail(message) = decide(Kind::Missing, &t, "`runc` not found", STRICT) else {
            panic!("strict mode skipped a missing prerequisite");
        };
        assert!(
            message.contains("`runc` not found") && message.contains("tools/setup.sh"),
            "{message}"
        );
        assert_eq!(
            decide(Kind::Missing, &t, "`runc` not found", LOOSE),
            Decision::Skip("skipped: t: `runc` not found".into())
        );
    }

    #[test]
    fn only_listed_tests_may_skip_for_the_machine_in_strict_mode() {
        let test = id("shim_resilience", LISTED);
        let Decision::Skip(line) = decide_with(
            Kind::CannotRunHere,
            &test,
            "criu check: no",
            STRICT,
            &listed(),
        ) else {
            panic!("a listed test failed");
        };
        assert!(
            line.starts_with(&format!("skipped (allowed): {LISTED}: CRIU")),
            "{line}"
        );
        assert!(line.ends_with("(criu check: no)"), "{line}");
        let Decision::Fail(message) = decide_with(
            Kind::CannotRunHere,
            &id("x", "unlisted"),
            "no GPU",
            STRICT,
            &listed(),
        ) else {
            panic!("an unlisted test skipped in strict mode");
        };
        assert!(message.contains(ALLOWED_FILE), "{message}");
    }

    #[test]
    fn an_allowed_skip_is_keyed_by_target_and_name() {
        // The listed name in another target is not the listed test.
        let elsewhere = id("strict_prereqs", LISTED);
        let Decision::Fail(message) = decide_with(
            Kind::CannotRunHere,
            &elsewhere,
            "criu check: no",
            STRICT,
            &listed(),
        ) else {
            panic!("a test of the listed name in another target skipped in strict mode");
        };
        assert!(message.contains("strict_prereqs"), "{message}");
        assert_eq!(
            target_of_entry("integration/tests/shim_resilience.rs"),
            "shim_resilience"
        );
        assert_eq!(
            target_of_entry("containerd-shim-baton-v1"),
            "containerd_shim_baton_v1"
        );
        assert_eq!(
            target_of_binary("shim_resilience-0123456789abcdef"),
            "shim_resilience"
        );
        assert_eq!(
            target_of_binary("baton_prereq-fedcba9876543210"),
            "baton_prereq"
        );
        assert_eq!(target_of_binary("odd-name"), "odd-name");
        assert_eq!(current_test_id().target, "baton_prereq");
    }

    #[test]
    fn another_runtime_is_reported_and_fails_strict_mode_unless_asked_for() {
        let t = id("x", "t");
        for mode in [
            LOOSE,
            Mode {
                strict: true,
                compare: true,
            },
        ] {
            assert_eq!(
                decide(Kind::NotApplicable, &t, "Baton's annotations", mode),
                Decision::Skip("not applicable: t: Baton's annotations".into())
            );
        }
        let Decision::Fail(message) =
            decide(Kind::NotApplicable, &t, "Baton's annotations", STRICT)
        else {
            panic!("strict mode skipped a test for a runtime switch nobody asked for");
        };
        assert!(message.contains(COMPARE_ENV), "{message}");
    }

    #[test]
    fn a_runtime_switch_is_refused_in_strict_mode_unless_asked_for() {
        let (baton, go) = ("io.containerd.baton.v1", "io.containerd.runc.v2");
        let refused = runtime_switch_refused(go, baton, true, false).unwrap();
        assert!(
            refused.contains(COMPARE_ENV) && refused.contains(go),
            "{refused}"
        );
        assert_eq!(runtime_switch_refused(go, baton, true, true), None);
        assert_eq!(runtime_switch_refused(go, baton, false, false), None);
        assert_eq!(runtime_switch_refused(baton, baton, true, false), None);
    }

    #[test]
    fn skips_are_appended_to_the_log() {
        let dir = std::env::temp_dir().join(format!("baton-prereq-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("skips.log");
        append_line(&log, "skipped (allowed): a: why");
        append_line(&log, "not applicable: b: why");
        let text = std::fs::read_to_string(&log).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(text, "skipped (allowed): a: why\nnot applicable: b: why\n");
    }
}
