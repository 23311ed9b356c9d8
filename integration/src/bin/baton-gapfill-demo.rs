//! `baton-gapfill-demo` (`tools/dev demo`): what Baton is for, on the mock GPU, under a private containerd with
//! the Baton shim and agent, and nobody but the agent acting. A trainer container marked
//! `baton.io/preemptible: park` holds GPU memory and trains. A latency-critical server is created behind the
//! GPU-free gate with `baton.io/park-when-idle`: its Start waits while the agent parks the trainer, and returns on
//! the trainer's release, before the trainer is even frozen. Requests keep the server resident; once it is idle
//! the agent parks it and resumes the trainer, which checks its weights; a request for the parked server hands
//! the GPU back; when the server goes, the trainer resumes for good. A live `baton trace` of both containers
//! shows the calls and the agent's steps (`+++` lines) throughout, and `baton status` the gap-fill state.
//!
//! Run as root: `tools/dev demo` (or `cargo run -p baton-integration --bin baton-gapfill-demo`).
use std::{
    io::{BufRead, BufReader},
    process::{Child, Command, Stdio},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail, ensure};
use baton_integration::{
    agent::{AgentConn, wait_until},
    cuda::{CudaRig, Trainer},
    trace_env::workspace_binary,
};
use serde_json::{Value, json};

const WITHIN: Duration = Duration::from_secs(60);
const IDLE: &str = "3s";

fn main() -> Result<()> {
    let Some(rig) = CudaRig::start("demo") else {
        bail!("cannot run the demo: a prerequisite is missing (see above)");
    };
    say(
        "a trainer container takes the mock GPU (2 GiB of device memory, a training step every 300 ms, a \
         DataLoader-like worker forked after CUDA init), with baton.io/preemptible=park: the agent may park it \
         for a server",
    );
    let trainer_opts = Trainer {
        vram_mib: 2048,
        copy_mib_per_s: 4096,
        step_ms: 300,
        ..Trainer::with_worker()
    };
    let mut trainer = rig.run(
        "trainer",
        &trainer_opts,
        &[
            ("baton.io/role", "co-runner"),
            ("baton.io/preemptible", "park"),
        ],
    );
    wait_for(&rig, "the trainer holds the GPU", || held(&rig, "trainer"))?;
    let trace = LiveTrace::start(&rig)?;

    say(&format!(
        "a server is created (baton.io/role=latency-critical, wait-gpu-free=1m, park-when-idle={IDLE}) and \
         started; nobody calls baton preempt"
    ));
    let server_opts = Trainer {
        vram_mib: 512,
        copy_mib_per_s: 4096,
        step_ms: 100,
        ..Trainer::default()
    };
    let _server = rig.create(
        "server",
        &server_opts,
        &[
            ("baton.io/role", "latency-critical"),
            ("baton.io/wait-gpu-free", "1m"),
            ("baton.io/park-when-idle", IDLE),
        ],
    );
    let mut events = rig.gpu.watch("trainer");
    let asked = Instant::now();
    let start = start_in_background(&rig, "server");
    let released = events.next_of("trainer", "released", WITHIN)?;
    let started_ns = start
        .join()
        .map_err(|_| anyhow::anyhow!("the start thread panicked"))??;
    let released_ns = released["t_released_ns"].as_u64().unwrap_or(0);
    say(&format!(
        "the agent parked the trainer; the server's Start returned {:.1} s after it was asked and {:.1} ms after \
         the trainer's release (runc start included), while the trainer was still being frozen",
        asked.elapsed().as_secs_f64(),
        started_ns.saturating_sub(released_ns) as f64 / 1e6
    ));
    wait_for(&rig, "the trainer is parked", || {
        preemption(&rig, "trainer")["state"] == json!("parked")
    })?;
    show_gap_fill(&rig);

    say(
        "two requests for the server (request_start / request_end to the agent, as a request proxy sends them)",
    );
    let mut agent = AgentConn::connect(&rig.gpu.env.containerd().agent_socket())?;
    for id in ["r1", "r2"] {
        request(&mut agent, "request_start", id)?;
        request(&mut agent, "request_end", id)?;
    }

    say(&format!(
        "no request for {IDLE}: the agent parks the idle server and resumes the trainer"
    ));
    wait_for(&rig, "the server is parked", || {
        preemption(&rig, "server")["state"] == json!("parked")
    })?;
    say(&format!(
        "the trainer says: {}",
        trainer.wait_line("restored checksum")
    ));
    wait_resident(&rig, "trainer")?;

    say(
        "a request for the parked server: the agent parks the trainer and resumes the server on its release",
    );
    let asked = Instant::now();
    request(&mut agent, "request_start", "r3")?;
    wait_resident(&rig, "server")?;
    say(&format!(
        "the server is back {:.1} s after the request, the trainer parked",
        asked.elapsed().as_secs_f64()
    ));
    request(&mut agent, "request_end", "r3")?;

    say("the server goes (killed and deleted): the agent resumes the trainer");
    let api = rig.gpu.env.api()?;
    api.kill("server", "", 9, true)?;
    api.wait("server", "", WITHIN)?;
    api.delete_task("server")?;
    say(&format!(
        "the trainer says: {}",
        trainer.wait_line("restored checksum")
    ));
    wait_resident(&rig, "trainer")?;
    show_gap_fill(&rig);
    trace.stop();
    say("done");
    Ok(())
}

/// `baton trace` of both containers, live, its lines printed as `trace | ...`.
struct LiveTrace {
    child: Child,
    printer: JoinHandle<()>,
}

impl LiveTrace {
    fn start(rig: &CudaRig) -> Result<Self> {
        say(
            "baton trace of both containers, live (lines start with 'trace |'; the agent's steps are +++ lines)",
        );
        let mut child = Command::new(workspace_binary("baton", "baton")?)
            .args(["trace", "--container", "trainer", "--container", "server"])
            .env(
                baton_agent_api::SOCKET_ENV,
                rig.gpu.env.containerd().agent_socket(),
            )
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .context("starting baton trace")?;
        let out = child.stdout.take().context("no trace output")?;
        let printer = std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                println!("    trace | {line}");
            }
        });
        Ok(Self { child, printer })
    }

    /// Stops the trace (SIGINT, as a user's Ctrl-C) and prints the rest of what it wrote.
    fn stop(mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGINT,
        );
        let _ = self.child.wait();
        let _ = self.printer.join();
    }
}

/// Starts task `id` through containerd's API in a thread; when its Start returned (monotonic ns).
fn start_in_background(rig: &CudaRig, id: &str) -> JoinHandle<Result<u64>> {
    let containerd = rig.gpu.env.containerd().socket();
    let namespace = rig.gpu.env.namespace().to_owned();
    let id = id.to_owned();
    std::thread::spawn(move || {
        let api = baton_integration::api::Api::connect(&containerd, &namespace)?;
        api.start(&id, "")?;
        Ok(baton_agent_api::now_monotonic_ns())
    })
}

/// Sends a request event for the server, as a request proxy does.
fn request(agent: &mut AgentConn, op: &str, id: &str) -> Result<()> {
    agent.call(json!({ "op": op, "id": id, "server": "server" }))?;
    println!("   {op} {id}");
    Ok(())
}

fn held(rig: &CudaRig, id: &str) -> bool {
    rig.gpu.status(id)["gpu"] == json!("held")
}

fn preemption(rig: &CudaRig, id: &str) -> Value {
    rig.gpu.status(id)["preemption"].clone()
}

/// Waits until `id` holds the GPU and is not parked.
fn wait_resident(rig: &CudaRig, id: &str) -> Result<()> {
    wait_for(rig, &format!("{id} holds the GPU, unparked"), || {
        preemption(rig, id).is_null() && held(rig, id)
    })
}

fn wait_for(rig: &CudaRig, what: &str, cond: impl FnMut() -> bool) -> Result<()> {
    ensure!(
        wait_until(WITHIN, cond),
        "{what}: not within {WITHIN:?}; baton status:\n{}",
        rig.baton(&["status"]).0
    );
    Ok(())
}

/// Prints the gap-fill part of `baton status`: the resume order and, per GPU, the rate gate.
fn show_gap_fill(rig: &CudaRig) {
    let (out, err, _) = rig.baton(&["status"]);
    let part: Vec<&str> = out
        .lines()
        .skip_while(|l| !l.starts_with("gap-fill:"))
        .collect();
    say("baton status (its gap-fill part)");
    if part.is_empty() {
        println!("   (none) {err}");
    }
    for line in part {
        println!("   {line}");
    }
}

fn say(text: &str) {
    println!("\n== {text}");
}
