//! `baton-mock-cuda`: a mock CUDA process. Sets up GPU resources through the NVIDIA device files, runs
//! training steps, optionally holds, and tears down, printing one line per phase. SIGUSR1 releases
//! everything (prints `released`), SIGUSR2 sets it up again (prints `reacquired`), the way
//! cuda-checkpoint toggles a process; SIGTERM/SIGINT (or stdin closing under `--hold`) ends it.
//! Exits 0 only if every RM status was `NV_OK`.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};

use anyhow::Context;
use baton_mock_nvidia::driver::DEFAULT_DRIVER_VERSION;
use baton_mock_nvidia::workload::{Workload, WorkloadOptions};
use clap::Parser;
use nix::sys::signal::{SigSet, Signal};

/// Mock CUDA workload driving the NVIDIA device files with real syscalls.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Folder with nvidiactl, nvidia0, nvidia-uvm.
    #[arg(long, default_value = "/dev")]
    dev_dir: PathBuf,
    /// Training steps.
    #[arg(long, default_value_t = 3)]
    steps: u64,
    /// Milliseconds per step.
    #[arg(long, default_value_t = 10)]
    step_ms: u64,
    /// Video memory to allocate, in MiB.
    #[arg(long, default_value_t = 1024)]
    vram_mib: u64,
    /// Driver version whose struct layouts to use.
    #[arg(long, default_value = DEFAULT_DRIVER_VERSION)]
    driver_version: String,
    /// After the steps, wait (holding everything) until stdin closes or SIGTERM/SIGINT.
    #[arg(long)]
    hold: bool,
    /// Write the JSON summary of what it did to this file.
    #[arg(long)]
    summary_json: Option<PathBuf>,
}

/// What the signal and stdin threads report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Event {
    Release,
    Reacquire,
    Stop,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let events = start_event_threads(args.hold)?;
    let mut workload = Workload::new(WorkloadOptions {
        dev_dir: args.dev_dir.clone(),
        steps: args.steps,
        step_ms: args.step_ms,
        vram_mib: args.vram_mib,
        driver_version: args.driver_version.clone(),
    })?;
    let result = run(&mut workload, &events, args.hold);
    let teardown = workload.teardown();
    let summary = workload.summary();
    let json = serde_json::to_string(summary)?;
    if let Some(path) = &args.summary_json {
        std::fs::write(path, format!("{json}\n"))
            .with_context(|| format!("cannot write the summary to {}", path.display()))?;
    }
    say(&format!("summary {json}"));
    result?;
    teardown?;
    say("phase teardown-done");
    if !summary.all_ok() {
        anyhow::bail!(
            "some RM calls did not return NV_OK: {:?}",
            summary.failed_statuses
        );
    }
    Ok(())
}

fn run(workload: &mut Workload, events: &Receiver<Event>, hold: bool) -> anyhow::Result<()> {
    workload.setup()?;
    say("phase setup-done");
    let mut stopped = false;
    let mut failure = None;
    workload.run_steps(|workload| match handle_pending(workload, events) {
        Ok(keep_going) => {
            stopped = !keep_going;
            keep_going
        }
        Err(error) => {
            failure = Some(error);
            false
        }
    })?;
    if let Some(error) = failure {
        return Err(error);
    }
    say("phase steps-done");
    if hold && !stopped {
        say("phase holding");
        while let Ok(event) = events.recv() {
            if !apply(workload, event, events)? {
                break;
            }
        }
    }
    Ok(())
}

/// Handles the events that arrived since the last step; `false` when told to stop.
fn handle_pending(workload: &mut Workload, events: &Receiver<Event>) -> anyhow::Result<bool> {
    loop {
        match events.try_recv() {
            Ok(event) => {
                if !apply(workload, event, events)? {
                    return Ok(false);
                }
            }
            Err(TryRecvError::Empty) => return Ok(true),
            Err(TryRecvError::Disconnected) => return Ok(false),
        }
    }
}

/// Applies one event; a release waits (like a checkpointed process) until re-acquire or stop.
fn apply(workload: &mut Workload, event: Event, events: &Receiver<Event>) -> anyhow::Result<bool> {
    match event {
        Event::Stop => Ok(false),
        Event::Reacquire => {
            if !workload.is_set_up() {
                workload.reacquire()?;
                say("reacquired");
            }
            Ok(true)
        }
        Event::Release => {
            if workload.is_set_up() {
                workload.release()?;
                say("released");
            }
            loop {
                match events.recv() {
                    Ok(Event::Reacquire) => {
                        workload.reacquire()?;
                        say("reacquired");
                        return Ok(true);
                    }
                    Ok(Event::Release) => {}
                    Ok(Event::Stop) | Err(_) => return Ok(false),
                }
            }
        }
    }
}

/// Blocks the control signals in this (main) thread before any other starts, then waits for them in a
/// dedicated thread; with `hold`, another thread reports stdin closing.
fn start_event_threads(hold: bool) -> anyhow::Result<Receiver<Event>> {
    let mut signals = SigSet::empty();
    for signal in [
        Signal::SIGUSR1,
        Signal::SIGUSR2,
        Signal::SIGTERM,
        Signal::SIGINT,
    ] {
        signals.add(signal);
    }
    signals
        .thread_block()
        .context("cannot block control signals")?;
    let (sender, receiver) = mpsc::channel();
    let signal_sender: Sender<Event> = sender.clone();
    std::thread::spawn(move || {
        while let Ok(signal) = signals.wait() {
            let event = match signal {
                Signal::SIGUSR1 => Event::Release,
                Signal::SIGUSR2 => Event::Reacquire,
                _ => Event::Stop,
            };
            if signal_sender.send(event).is_err() {
                break;
            }
        }
    });
    if hold {
        std::thread::spawn(move || {
            let mut sink = [0u8; 256];
            let mut stdin = std::io::stdin();
            while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
            let _ = sender.send(Event::Stop);
        });
    }
    Ok(receiver)
}

fn say(line: &str) {
    let mut stdout = std::io::stdout().lock();
    // A closed stdout must not kill the workload mid-teardown.
    let _ = writeln!(stdout, "{line}");
    let _ = stdout.flush();
}
