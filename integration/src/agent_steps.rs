//! What the agent did by itself, as a test sees it: the agent's own steps on a container (`baton trace --json
//! --container ID`: the preemptions, resumes, gap-fill and room decisions it made), and requests told to it as a
//! request proxy tells them.
use serde_json::Value;

use crate::{
    agent::wait_until,
    cuda::{CudaRig, WITHIN},
    trace_env::{BatonTrace, workspace_binary},
};

/// Sends `line` (one request of the agent's protocol) to the agent, as a request proxy does: its reply.
pub fn tell_agent(rig: &CudaRig, line: &str) -> String {
    use std::io::{BufRead, Write};
    let socket = rig.gpu.env.containerd().agent_socket();
    let mut s = std::os::unix::net::UnixStream::connect(&socket)
        .unwrap_or_else(|e| panic!("telling the agent {line}: {e}"));
    s.write_all(format!("{line}\n").as_bytes())
        .unwrap_or_else(|e| panic!("telling the agent {line}: {e}"));
    let mut reply = String::new();
    std::io::BufReader::new(s)
        .read_line(&mut reply)
        .unwrap_or_else(|e| panic!("telling the agent {line}: {e}"));
    reply
}

/// The agent's own steps on container `id`, as `baton trace --json --container ID` shows them: (phase, detail).
pub struct AgentSteps {
    jsonl: std::path::PathBuf,
    trace: Option<BatonTrace>,
    _dir: tempfile::TempDir,
}

impl AgentSteps {
    /// Starts `baton trace --json --container ID` of `id`.
    pub fn start(rig: &CudaRig, id: &str) -> Self {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("a temporary folder: {e}"));
        let jsonl = dir.path().join("trace.jsonl");
        let mut command = std::process::Command::new(
            workspace_binary("baton", "baton").unwrap_or_else(|e| panic!("the baton CLI: {e}")),
        );
        command
            .args(["trace", "--json", "--container", id, "-o"])
            .arg(&jsonl)
            .env(
                baton_agent_api::SOCKET_ENV,
                rig.gpu.env.containerd().agent_socket(),
            );
        let trace = Some(
            BatonTrace::start(command, WITHIN)
                .unwrap_or_else(|e| panic!("baton trace of {id}: {e}")),
        );
        Self {
            jsonl,
            trace,
            _dir: dir,
        }
    }

    /// The steps seen so far: (phase, detail).
    pub fn seen(&self) -> Vec<(String, String)> {
        std::fs::read_to_string(&self.jsonl)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|o| {
                ["preemption", "gap_fill", "room"]
                    .contains(&o["event"].as_str().unwrap_or_default())
            })
            .map(|o| {
                let text = |k: &str| o[k].as_str().unwrap_or_default().to_owned();
                (text("phase"), text("detail"))
            })
            .collect()
    }

    /// Waits until step `phase` with `detail` shows.
    pub fn wait_for(&self, phase: &str, detail: &str) {
        self.wait_for_matching(phase, |d| d == detail);
    }

    /// Waits until a step `phase` whose detail matches shows.
    pub fn wait_for_matching(&self, phase: &str, detail: impl Fn(&str) -> bool) {
        assert!(
            wait_until(WITHIN, || self
                .seen()
                .iter()
                .any(|(p, d)| p == phase && detail(d))),
            "{phase} in the trace: {:?}",
            self.seen()
        );
    }
}

impl Drop for AgentSteps {
    fn drop(&mut self) {
        if let Some(t) = self.trace.take() {
            let _ = t.stop();
        }
    }
}
