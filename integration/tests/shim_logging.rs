//! `binary://` logging through real containerd: `ctr run --log-uri binary:///logger?...` starts the logger with
//! the container's stdout on fd 3, stderr on fd 4 and a ready pipe on fd 5 (the Go shim's contract), and
//! nothing else of the shim's.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use baton_integration::TestEnv;

const WAIT: Duration = Duration::from_secs(20);

/// A logger as users write them: records its environment and open fds, says it is ready (closes fd 5),
/// then copies fd 3 and fd 4 into files next to `$2` (the `out` query value).
const LOGGER: &str = r#"#!/bin/sh
out="$2"
printf 'CONTAINER_ID=%s\nCONTAINER_NAMESPACE=%s\n' "$CONTAINER_ID" "$CONTAINER_NAMESPACE" > "$out.env"
ls -l /proc/$$/fd > "$out.fds"
exec 5>&-
cat <&3 > "$out.stdout" &
cat <&4 > "$out.stderr" &
wait
"#;

fn write_logger(dir: &Path, name: &str, text: &str) -> PathBuf {
    let path = dir.join(name);
    baton_integration::write_script(&path, text).expect("write logger");
    path
}

/// Waits until `path` holds `wanted`; returns what it holds at the end.
fn wait_for_text(path: &Path, wanted: &str) -> String {
    let deadline = Instant::now() + WAIT;
    loop {
        let text = std::fs::read_to_string(path).unwrap_or_default();
        if text.contains(wanted) || Instant::now() > deadline {
            return text;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// What this test process's own fds lead to: whatever started the tests may have left some open, and they
/// reach containerd and every shim alike (the shim cannot know them).
fn inherited_targets() -> HashSet<String> {
    std::fs::read_dir("/proc/self/fd")
        .map(|fds| {
            fds.filter_map(Result::ok)
                .filter_map(|fd| std::fs::read_link(fd.path()).ok())
                .map(|target| target.display().to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// The logger's fds above its own (0-5) that lead to a pipe, socket or other kernel object the test run did
/// not bring: the shim's leaks.
fn leaked_fds(listing: &str) -> Vec<String> {
    let inherited = inherited_targets();
    listing
        .lines()
        .filter_map(|line| {
            let (left, target) = line.split_once(" -> ")?;
            let fd: u32 = left.split_whitespace().last()?.parse().ok()?;
            let kernel_object = !target.starts_with('/');
            (fd > 5 && kernel_object && !inherited.contains(target)).then(|| line.to_string())
        })
        .collect()
}

#[test]
fn shim_binary_log_uri_feeds_a_real_logger() {
    let Some(env) = TestEnv::start("shim_binary_logger") else {
        return;
    };
    let scratch = env.scratch();
    let logger = write_logger(&scratch, "logger.sh", LOGGER);
    let out = scratch.join("container");
    let uri = format!("binary://{}?out={}", logger.display(), out.display());
    let result = env.run(
        "logged",
        &[],
        &["--rm", "--log-uri", &uri],
        &["/bin/sh", "-c", "echo to-stdout; echo to-stderr >&2"],
    );
    assert!(
        result.success(),
        "ctr run with a binary:// logger failed: {}",
        result.stderr
    );
    let stdout = wait_for_text(&out.with_extension("stdout"), "to-stdout");
    assert_eq!(stdout.trim(), "to-stdout", "the logger's fd 3");
    let stderr = wait_for_text(&out.with_extension("stderr"), "to-stderr");
    assert_eq!(stderr.trim(), "to-stderr", "the logger's fd 4");
    let environment = std::fs::read_to_string(out.with_extension("env")).expect("logger env");
    assert!(
        environment.contains("CONTAINER_ID=logged\n"),
        "{environment}"
    );
    assert!(
        environment.contains(&format!("CONTAINER_NAMESPACE={}\n", env.namespace())),
        "{environment}"
    );
    let fds = std::fs::read_to_string(out.with_extension("fds")).expect("logger fds");
    assert_eq!(
        leaked_fds(&fds),
        Vec::<String>::new(),
        "shim fds reached the logger:\n{fds}"
    );
}

/// A logger that writes out what it read only once both pipes ended, and a moment later (as a logger that
/// batches, compresses or ships does): the file appears whole, or not at all.
const BATCHING_LOGGER: &str = r#"#!/bin/sh
out="$2"
exec 5>&-
cat <&3 > "$out.part" &
cat <&4 > /dev/null &
wait
sleep 1
mv "$out.part" "$out.stdout"
"#;

/// Nothing is lost through a `binary://` logger either: the container's exit (and so `ctr run --rm`'s return)
/// comes once the logger read its pipes to their end and exited, so everything the container printed is
/// written out by then. (runc-v2 publishes the exit at once; the logger finishes later.)
#[test]
fn shim_binary_log_uri_exit_comes_after_the_logger_wrote_everything() {
    let Some(env) = TestEnv::start("shim_binary_logger_drain") else {
        return;
    };
    let scratch = env.scratch();
    let logger = write_logger(&scratch, "batching-logger.sh", BATCHING_LOGGER);
    let out = scratch.join("container");
    let uri = format!("binary://{}?out={}", logger.display(), out.display());
    let result = env.run(
        "batched",
        &[],
        &["--rm", "--log-uri", &uri],
        &["/bin/seq", "1", "100000"],
    );
    assert!(result.success(), "ctr run failed: {}", result.stderr);
    if !env.is_baton() {
        baton_integration::skip::not_applicable(
            "the exit waiting for a binary:// logger: runc-v2 publishes it at once",
        );
        return;
    }
    // At once, no waiting: the exit came after the logger.
    let written = std::fs::read(out.with_extension("stdout"))
        .expect("the logger wrote its file before the container's exit was published");
    let expected: usize = (1..=100_000u32).map(|n| n.to_string().len() + 1).sum();
    assert_eq!(written.len(), expected, "every byte the container printed");
}
