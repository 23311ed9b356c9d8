//! What a Baton test does when it cannot run: one rule for every test in the workspace.
//!
//! - [`missing`]: a prerequisite that `tools/setup.sh` installs (root, FUSE, containerd, runc, cgroups,
//!   python3, `script`, ...) is absent. A developer's plain `cargo test` skips loudly (`skipped: <test>:
//!   <reason>` on stderr); in strict mode the test fails with the reason.
//! - [`cannot_run_here`]: no machine of this kind can run the test (a real GPU, CRIU on this kernel). In strict
//!   mode it is an allowed skip only if `integration/allowed-skips.toml` lists the test (with the reason);
//!   otherwise it fails like [`missing`].
//! - [`not_applicable`]: the test is about a Baton feature and the runtime under test is another one
//!   (`BATON_TEST_RUNTIME` names containerd's Go shim). Not a prerequisite: it never fails.
//!
//! Strict mode is on when `BATON_STRICT_PREREQS=1` (tools/dev test sets it) or `CI=true`. Every skip is also
//! appended as one line to the file named by `BATON_SKIP_LOG`, when set, for the summary at the end of a run.
//! Callers return from the test after these functions (they return only when the test is to be skipped).

use std::{io::Write, path::Path};

/// Environment variable that turns strict mode on (`1`).
pub const STRICT_ENV: &str = "BATON_STRICT_PREREQS";
/// Environment variable naming the file that skips are appended to.
pub const LOG_ENV: &str = "BATON_SKIP_LOG";
/// The list of tests allowed to skip in strict mode, relative to the workspace root.
pub const ALLOWED_FILE: &str = "integration/allowed-skips.toml";

const ALLOWED_TOML: &str = include_str!("../../allowed-skips.toml");

/// One test allowed to skip in strict mode.
#[derive(Debug, serde::Deserialize)]
pub struct Allowed {
    /// The test's name as libtest prints it.
    pub test: String,
    /// Its test target (file), for readers.
    pub target: String,
    /// Why no machine of this kind can run it.
    pub reason: String,
}

#[derive(serde::Deserialize)]
struct AllowedFile {
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

/// The running test's name: libtest names each test's thread after it.
pub fn current_test() -> String {
    std::thread::current()
        .name()
        .unwrap_or("<unnamed thread>")
        .to_owned()
}

/// A prerequisite that tools/setup.sh provides is missing: fails the test in strict mode, else skips loudly.
pub fn missing(reason: &str) {
    apply(decide(Kind::Missing, &current_test(), reason, strict()));
}

/// The test cannot run on this kind of machine (`detail` says what was found): an allowed skip when
/// `integration/allowed-skips.toml` lists it, else handled like [`missing`].
pub fn cannot_run_here(detail: &str) {
    apply(decide(
        Kind::CannotRunHere,
        &current_test(),
        detail,
        strict(),
    ));
}

/// The test checks a Baton feature and another runtime is under test: never fails, always reported.
pub fn not_applicable(reason: &str) {
    apply(decide(
        Kind::NotApplicable,
        &current_test(),
        reason,
        strict(),
    ));
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

fn decide(kind: Kind, test: &str, reason: &str, strict: bool) -> Decision {
    let reason = reason.replace('\n', " ");
    match kind {
        Kind::NotApplicable => Decision::Skip(format!("not applicable: {test}: {reason}")),
        Kind::CannotRunHere => match allowed_reason(test) {
            Some(why) => Decision::Skip(format!("skipped (allowed): {test}: {why} ({reason})")),
            None if strict => Decision::Fail(format!(
                "{test} cannot run on this machine: {reason}. Strict mode (tools/dev test, CI) fails a test \
                 that cannot run unless {ALLOWED_FILE} lists it with the reason no machine of this kind can \
                 run it"
            )),
            None => Decision::Skip(format!("skipped: {test}: {reason}")),
        },
        Kind::Missing if strict => Decision::Fail(format!(
            "prerequisite missing for {test}: {reason}. Strict mode (tools/dev test, CI; {STRICT_ENV}=1 or \
             CI=true) fails a test that cannot run: run tools/setup.sh as root, or fix what the reason names"
        )),
        Kind::Missing => Decision::Skip(format!("skipped: {test}: {reason}")),
    }
}

fn allowed_reason(test: &str) -> Option<String> {
    let list = allowed_skips().unwrap_or_else(|e| panic!("{ALLOWED_FILE} does not parse: {e}"));
    list.into_iter().find(|a| a.test == test).map(|a| a.reason)
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

    const LISTED: &str = "shim_checkpoint_where_criu_works";

    #[test]
    fn every_allowed_skip_names_a_test_that_exists_and_says_why() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let list = allowed_skips().unwrap();
        assert!(!list.is_empty());
        for a in list {
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

    #[test]
    fn strict_mode_fails_a_missing_prerequisite_and_loose_mode_skips_it() {
        let Decision::Fail(message) = decide(Kind::Missing, "t", "`runc` not found", true) else {
            panic!("strict mode skipped a missing prerequisite");
        };
        assert!(
            message.contains("`runc` not found") && message.contains("tools/setup.sh"),
            "{message}"
        );
        assert_eq!(
            decide(Kind::Missing, "t", "`runc` not found", false),
            Decision::Skip("skipped: t: `runc` not found".into())
        );
    }

    #[test]
    fn only_listed_tests_may_skip_for_the_machine_in_strict_mode() {
        let Decision::Skip(line) = decide(Kind::CannotRunHere, LISTED, "criu check: no", true)
        else {
            panic!("a listed test failed");
        };
        assert!(
            line.starts_with(&format!("skipped (allowed): {LISTED}: CRIU")),
            "{line}"
        );
        assert!(line.ends_with("(criu check: no)"), "{line}");
        let Decision::Fail(message) = decide(Kind::CannotRunHere, "unlisted", "no GPU", true)
        else {
            panic!("an unlisted test skipped in strict mode");
        };
        assert!(message.contains(ALLOWED_FILE), "{message}");
    }

    #[test]
    fn another_runtime_is_reported_and_never_fails() {
        for strict in [true, false] {
            assert_eq!(
                decide(Kind::NotApplicable, "t", "Baton's annotations", strict),
                Decision::Skip("not applicable: t: Baton's annotations".into())
            );
        }
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
