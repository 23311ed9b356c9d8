//! `baton-handoff-demo` (`tools/dev demo`): what Baton is for, on the mock GPU, under a private containerd
//! with the Baton shim and agent. A trainer container holds GPU memory and trains; a server container is
//! created behind the GPU-free gate (`baton.io/wait-gpu-free`) and its Start waits. `baton preempt trainer`
//! parks the trainer; the server starts on the release signal, before the trainer is even frozen; the
//! timeline is printed; when the server has finished, `baton resume trainer` gives the trainer its GPU state
//! back, and the trainer checks its weights. A live `baton trace` of both containers runs throughout.
//!
//! Run as root: `tools/dev demo` (or `cargo run -p baton-integration --bin baton-handoff-demo`).
use std::{
    io::{BufRead, BufReader},
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{Context, Result, bail};
use baton_integration::{
    agent::wait_until,
    cuda::{CudaRig, Trainer},
    trace_env::workspace_binary,
};
use serde_json::json;

const WITHIN: Duration = Duration::from_secs(60);

fn main() -> Result<()> {
    let Some(rig) = CudaRig::start("demo") else {
        bail!("cannot run the demo: a prerequisite is missing (see above)");
    };
    let socket = rig.gpu.env.containerd().agent_socket();
    let baton = workspace_binary("baton", "baton")?;
    say(
        "a trainer container takes the mock GPU (2 GiB of device memory, a training step every 300 ms)",
    );
    let trainer_opts = Trainer {
        vram_mib: 2048,
        copy_mib_per_s: 4096,
        step_ms: 300,
        ..Trainer::default()
    };
    let mut trainer = rig.run("trainer", &trainer_opts, &[]);
    wait_until(WITHIN, || rig.gpu.status("trainer")["gpu"] == json!("held"));

    say("baton trace of both containers, live (lines start with 'trace |')");
    let mut trace = Command::new(&baton)
        .args([
            "trace",
            "--container",
            "trainer",
            "--container",
            "server",
            "--summary",
        ])
        .env(baton_agent_api::SOCKET_ENV, &socket)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .context("starting baton trace")?;
    let out = trace.stdout.take().context("no trace output")?;
    let printer = std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            println!("    trace | {line}");
        }
    });

    say(
        "a server container is created behind baton.io/wait-gpu-free=1m; its Start waits for the GPU",
    );
    let server_opts = Trainer {
        vram_mib: 512,
        steps: 10,
        step_ms: 100,
        ..Trainer::default()
    };
    let _server = rig.create("server", &server_opts, &[("baton.io/wait-gpu-free", "1m")]);
    let containerd = rig.gpu.env.containerd().socket();
    let namespace = rig.gpu.env.namespace().to_owned();
    let start = std::thread::spawn(move || {
        let api = baton_integration::api::Api::connect(&containerd, &namespace)?;
        api.start("server", "")?;
        Ok::<_, anyhow::Error>(baton_agent_api::now_monotonic_ns())
    });
    std::thread::sleep(Duration::from_millis(700));

    say("baton preempt trainer: lock, checkpoint (device memory to host), GPU released, frozen");
    let status = Command::new(&baton)
        .args(["preempt", "trainer", "--socket"])
        .arg(&socket)
        .status()?;
    if !status.success() {
        bail!("baton preempt failed");
    }
    let started = start
        .join()
        .map_err(|_| anyhow::anyhow!("the start thread panicked"))??;
    let released = rig.gpu.status("trainer")["since_ns"].as_u64().unwrap_or(0);
    say(&format!(
        "the gate opened: the server's Start returned {:.1} ms after the trainer's release (runc start \
         included), while the trainer was still being frozen",
        started.saturating_sub(released) as f64 / 1e6
    ));
    let api = rig.gpu.env.api()?;
    let code = api.wait("server", "", WITHIN)?;
    say(&format!(
        "the server finished its work (exit status {code})"
    ));

    say("baton resume trainer: thaw, restore (host memory to device), unlock");
    let status = Command::new(&baton)
        .args(["resume", "trainer", "--socket"])
        .arg(&socket)
        .status()?;
    if !status.success() {
        bail!("baton resume failed");
    }
    let line = trainer.wait_line("restored checksum");
    say(&format!("the trainer says: {line}"));
    trainer.wait_line("unlocked");
    std::thread::sleep(Duration::from_millis(700));
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(trace.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    );
    let _ = trace.wait();
    let _ = printer.join();
    say("done");
    Ok(())
}

fn say(text: &str) {
    println!("\n== {text}");
}
