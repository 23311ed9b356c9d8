//! `binary://` logging through real containerd: `ctr run --log-uri binary:///logger?...` starts the logger with
//! the container's stdout on fd 3, stderr on fd 4 and a ready pipe on fd 5 (the Go shim's contract), and
//! nothing else of the shim's.

use std::collections::HashSet;
use std::os::unix::fs::PermissionsExt;
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

fn write_logger(dir: &Path) -> PathBuf {
    let path = dir.join("logger.sh");
    std::fs::write(&path, LOGGER).expect("write logger");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod logger");
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
    let logger = write_logger(&scratch);
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
