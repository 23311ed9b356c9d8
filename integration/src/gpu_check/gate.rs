//! The seeds' loop without containerd: a server registered with the agent waits on the agent's GPU-free
//! gate (`wait_gpu_free` on the agent's socket, as a shim's Start does: docs/api.md) while the holder is
//! parked, and is started the moment the gate opens. The request is a plain line on a connection of its
//! own, answered by a thread that stamps the answer's arrival; the kit stops waiting at a deadline of its
//! own (shutting the connection), so a gate that never opens costs a bounded wait.
use std::{
    io::{BufRead, BufReader, Write},
    net::Shutdown,
    os::unix::net::UnixStream,
    path::Path,
    sync::mpsc,
    time::{Duration, Instant},
};

use baton_agent_api::now_monotonic_ns;
use serde_json::{Value, json};

use super::watched::NAMESPACE;

/// The gate's answer.
#[derive(Clone, Copy, Debug)]
pub struct Opened {
    /// When the answer reached the kit (CLOCK_MONOTONIC ns).
    pub arrived_ns: u64,
    /// When the agent found the GPU free (its `t_free_ns`).
    pub t_free_ns: u64,
}

/// A `wait_gpu_free` in flight.
pub struct Gate {
    stream: UnixStream,
    answer: mpsc::Receiver<Result<Opened, String>>,
}

impl Gate {
    /// Asks the agent at `socket` to answer once container `id`'s GPU is free, giving up after `timeout`.
    pub fn ask(socket: &Path, id: &str, timeout: Duration) -> std::io::Result<Self> {
        let mut stream = UnixStream::connect(socket)?;
        let request = json!({
            "v": 1, "op": "wait_gpu_free", "id": id, "namespace": NAMESPACE,
            "timeout_ms": u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
        });
        writeln!(stream, "{request}")?;
        let reader = BufReader::new(stream.try_clone()?);
        let (tx, answer) = mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(read_answer(reader));
        });
        Ok(Self { stream, answer })
    }

    /// The gate's answer, waited for until `deadline`: `Err(Some)` carries the agent's error (naming who
    /// holds the GPU), `Err(None)` means it was still shut at `deadline`.
    pub fn opened_by(&self, deadline: Instant) -> Result<Opened, Option<String>> {
        let left = deadline.saturating_duration_since(Instant::now());
        match self.answer.recv_timeout(left) {
            Ok(answer) => answer.map_err(Some),
            Err(_) => Err(None),
        }
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        // Ends the reading thread and tells the agent nobody waits any more.
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

fn read_answer(mut reader: BufReader<UnixStream>) -> Result<Opened, String> {
    let mut line = String::new();
    match reader.read_line(&mut line) {
        Ok(0) | Err(_) => return Err("the agent closed the gate's connection".to_owned()),
        Ok(_) => {}
    }
    let arrived_ns = now_monotonic_ns();
    let reply: Value =
        serde_json::from_str(&line).map_err(|e| format!("unreadable gate answer {line:?}: {e}"))?;
    if reply["ok"] != true {
        return Err(reply["error"].as_str().unwrap_or(line.trim()).to_owned());
    }
    Ok(Opened {
        arrived_ns,
        t_free_ns: reply["t_free_ns"].as_u64().unwrap_or(0),
    })
}
