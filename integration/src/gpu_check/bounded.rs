//! External programs run with a bound: `cuda-checkpoint`, `nvidia-smi`, `python3 -c ...`. Each may be
//! missing, fail or hang on a real machine; the answer says which, in words the report can carry, and a
//! program past its bound is killed. The moment it ended is stamped (CLOCK_MONOTONIC) by a thread blocked
//! in `wait`, not found by polling, so that "the checkpoint call returned" is exact.
use std::{
    io::Read,
    process::{Command, ExitStatus, Stdio},
    sync::mpsc,
    time::Duration,
};

use baton_agent_api::now_monotonic_ns;
use nix::{sys::signal::Signal, unistd::Pid};

/// A program that ran to its end.
#[derive(Debug)]
pub struct Finished {
    /// Its exit status.
    pub status: ExitStatus,
    /// What it printed on stdout.
    pub stdout: String,
    /// What it printed on stderr.
    pub stderr: String,
    /// When its end was seen (CLOCK_MONOTONIC ns).
    pub ended_ns: u64,
}

impl Finished {
    /// `Ok(self)` when it exited with 0, else an error with its status and the end of its stderr.
    pub fn succeeded(self, what: &str) -> Result<Self, String> {
        if self.status.success() {
            return Ok(self);
        }
        Err(format!(
            "{what} failed ({}): {}",
            self.status,
            last_lines(&self.stderr, 5)
        ))
    }
}

/// Runs `command` (its stdin empty, its output captured) to its end, killing it after `within`; `Err` says
/// it could not start (missing) or did not end in time.
pub fn run(command: &mut Command, within: Duration) -> Result<Finished, String> {
    let program = command.get_program().to_string_lossy().into_owned();
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run {program}: {e}"))?;
    let stdout = read_all(child.stdout.take());
    let stderr = read_all(child.stderr.take());
    let pid = child.id();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let status = child.wait();
        let _ = tx.send((status, now_monotonic_ns()));
    });
    match rx.recv_timeout(within) {
        Ok((Ok(status), ended_ns)) => Ok(Finished {
            status,
            stdout: stdout.recv().unwrap_or_default(),
            stderr: stderr.recv().unwrap_or_default(),
            ended_ns,
        }),
        Ok((Err(e), _)) => Err(format!("cannot wait for {program}: {e}")),
        Err(_) => {
            // The waiting thread has not reaped it, so the pid is still this child's.
            if let Ok(pid) = i32::try_from(pid) {
                let _ = nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGKILL);
            }
            Err(format!("{program} did not end within {within:?}: killed"))
        }
    }
}

/// The last `n` non-empty lines of `text`, joined by " / " (an error message's tail).
pub fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let tail = &lines[lines.len().saturating_sub(n)..];
    if tail.is_empty() {
        return "no output".to_owned();
    }
    tail.join(" / ")
}

fn read_all(source: Option<impl Read + Send + 'static>) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut text = String::new();
        if let Some(mut source) = source {
            let mut bytes = Vec::new();
            let _ = source.read_to_end(&mut bytes);
            text = String::from_utf8_lossy(&bytes).into_owned();
        }
        let _ = tx.send(text);
    });
    rx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_program_that_ends_fails_is_missing_or_hangs_is_told_apart() {
        let ok = run(
            Command::new("sh").args(["-c", "echo out; echo err >&2"]),
            Duration::from_secs(30),
        )
        .unwrap();
        assert!(ok.status.success());
        assert_eq!((ok.stdout.trim(), ok.stderr.trim()), ("out", "err"));
        assert!(ok.ended_ns > 0);

        let failed = run(
            Command::new("sh").args(["-c", "echo why >&2; exit 3"]),
            Duration::from_secs(30),
        )
        .unwrap()
        .succeeded("the test program")
        .unwrap_err();
        assert!(
            failed.contains("the test program failed") && failed.ends_with(": why"),
            "{failed}"
        );

        let missing = run(
            &mut Command::new("/nonexistent/cuda-checkpoint"),
            Duration::from_secs(30),
        )
        .unwrap_err();
        assert!(
            missing.starts_with("cannot run /nonexistent/cuda-checkpoint"),
            "{missing}"
        );

        let hung = run(Command::new("sleep").arg("600"), Duration::from_millis(200)).unwrap_err();
        assert!(
            hung.contains("did not end within") && hung.ends_with("killed"),
            "{hung}"
        );
    }

    #[test]
    fn an_error_keeps_the_last_lines_of_the_output() {
        assert_eq!(last_lines("a\n\nb\nc\n", 2), "b / c");
        assert_eq!(last_lines("", 2), "no output");
    }
}
