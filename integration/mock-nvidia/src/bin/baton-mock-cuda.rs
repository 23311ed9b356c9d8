//! `baton-mock-cuda`: a mock CUDA process. Sets up GPU resources through the NVIDIA device files, runs
//! training steps (until stopped with `--steps 0`), optionally holds, and tears down, printing one line
//! per phase. SIGUSR1 releases everything (prints `released`), SIGUSR2 sets it up again (prints
//! `reacquired`); SIGTERM/SIGINT (or stdin closing under `--hold`) ends it. Like real CUDA it runs a
//! restore thread on `/tmp/baton-mock-cuda/<pid>.sock` that `baton-mock-cuda-checkpoint` drives (lock,
//! checkpoint, restore, unlock). Exits 0 only if every RM status was `NV_OK`. With `--libcuda PATH
//! --launches N,M,K` it `dlopen`s a (fake) libcuda before the setup and, after it, calls cuLaunchKernel N,
//! cuLaunchKernelEx M and cuGraphLaunch K times (printing `phase launches-done`), for the launch-telemetry
//! tests; `--launch-when-exists FILE` first waits until the test creates FILE (once the tracer reported its
//! uprobes attached). `--progress-every N` prints `progress STEPS T_NS` every N steps, for the gap-fill
//! benchmark's step counts. `--fork-worker` forks a worker once set up, as a DataLoader does (printing
//! `phase worker-forked PID` before `phase setup-done`): it keeps the inherited NVIDIA fds and mappings,
//! makes no CUDA call, answers cuda-checkpoint with `CUDA_ERROR_NOT_INITIALIZED`, and dies with its parent.

use std::io::Read;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use anyhow::Context;
use baton_mock_nvidia::driver::DEFAULT_DRIVER_VERSION;
use baton_mock_nvidia::workload::control::{self, Action};
use baton_mock_nvidia::workload::gate::{Event, Gate, Next};
use baton_mock_nvidia::workload::launch::{CudaLibrary, Launches};
use baton_mock_nvidia::workload::restore::{ControlSocket, RestoreOptions};
use baton_mock_nvidia::workload::worker::Worker;
use baton_mock_nvidia::workload::{Workload, WorkloadOptions, say, weights};
use clap::Parser;
use nix::sys::signal::{SigSet, Signal};

/// Mock CUDA workload driving the NVIDIA device files with real syscalls.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Folder with nvidiactl, nvidia0, nvidia-uvm.
    #[arg(long, default_value = "/dev")]
    dev_dir: PathBuf,
    /// Training steps; 0 keeps stepping until stopped.
    #[arg(long, default_value_t = 3)]
    steps: u64,
    /// Milliseconds per step (the step counts as in flight for a lock all that time).
    #[arg(long, default_value_t = 10)]
    step_ms: u64,
    /// Every this many steps, print `progress STEPS T_NS` (CLOCK_MONOTONIC ns); 0 never. A benchmark counts
    /// the steps done in a window from these lines.
    #[arg(long, default_value_t = 0)]
    progress_every: u64,
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
    /// Rate at which a checkpoint or restore copies the video memory, in MiB/s.
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u64).range(1..))]
    copy_mib_per_s: u64,
    /// Milliseconds a lock takes before it can succeed (a smaller lock timeout then times out).
    #[arg(long, default_value_t = 0)]
    lock_delay_ms: u64,
    /// Make this action (lock, checkpoint, restore, unlock) fail without changing anything.
    #[arg(long, value_parser = parse_action)]
    fail_at: Option<Action>,
    /// The `--fail-at` failure happens the first time only (a retry succeeds).
    #[arg(long, requires = "fail_at")]
    fail_once: bool,
    /// The first request of this action tells the library that makes it to crash its process (the fake
    /// libcuda aborts); it changes nothing.
    #[arg(long, value_parser = parse_action)]
    crash_caller_at: Option<Action>,
    /// On a restore request, exit at once with this code (a job that finished while checkpointed).
    #[arg(long)]
    exit_at_restore: Option<i32>,
    /// A request of this action is not answered while `/tmp/baton-mock-cuda/<pid>.hang` exists (a call
    /// wedged in the driver; a test creates the file for the one process it wants wedged).
    #[arg(long, value_parser = parse_action)]
    hang_at: Option<Action>,
    /// Load this libcuda (dlopen) before the setup, as a CUDA program does before cuInit.
    #[arg(long)]
    libcuda: Option<PathBuf>,
    /// After the setup, call cuLaunchKernel, cuLaunchKernelEx and cuGraphLaunch of `--libcuda` this many
    /// times each (KERNEL,KERNEL_EX,GRAPH).
    #[arg(long, value_parser = Launches::parse, requires = "libcuda")]
    launches: Option<Launches>,
    /// Before launching, wait (up to 60 s) until this file exists. A test creates it once the tracer says its
    /// uprobes are attached: the process cannot tell by itself, as the kernel puts the breakpoints into its
    /// code when a uprobe is opened, before the program is attached to it.
    #[arg(long, requires = "launches")]
    launch_when_exists: Option<PathBuf>,
    /// Once set up, fork a worker that keeps the inherited NVIDIA fds and mappings (all but the
    /// MADV_DONTFORK one), makes no CUDA call, and lives as long as this process.
    #[arg(long)]
    fork_worker: bool,
    /// On SIGTERM or SIGINT, make one last step of CUDA calls (a trainer's final checkpoint, a server's
    /// drain) before exiting, printing `phase saved-at-stop`: a locked process waits for its unlock first, as
    /// a real one's CUDA calls do, so a parked one that is never resumed never gets there.
    #[arg(long)]
    save_at_stop: bool,
}

fn parse_action(name: &str) -> Result<Action, String> {
    Action::parse(name).ok_or_else(|| {
        format!("{name:?} is not an action (expected lock, checkpoint, restore or unlock)")
    })
}

type Shared = Arc<Mutex<Workload>>;

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let cuda = args.libcuda.as_deref().map(CudaLibrary::open).transpose()?;
    let gate = Arc::new(Gate::new());
    // Before any other thread starts, so that every thread inherits the blocked signals.
    start_event_threads(args.hold, &gate)?;
    let workload: Shared = Arc::new(Mutex::new(Workload::new(WorkloadOptions {
        dev_dir: args.dev_dir.clone(),
        steps: args.steps,
        step_ms: args.step_ms,
        vram_mib: args.vram_mib,
        driver_version: args.driver_version.clone(),
    })?));
    let _socket = start_restore_thread(&gate, &workload, &args);
    let mut worker = None;
    let result = run(&workload, &gate, &args, cuda.as_ref(), &mut worker);
    let mut workload = lock(&workload);
    let teardown = workload.teardown();
    if let Some(worker) = worker {
        worker.stop();
    }
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

/// Serves the control socket; without one (a read-only /tmp, say) the workload runs on, unable to be
/// checkpointed, and says why on stderr.
fn start_restore_thread(gate: &Arc<Gate>, workload: &Shared, args: &Args) -> Option<ControlSocket> {
    let path = control::socket_path(std::process::id());
    let served = ControlSocket::bind().and_then(|mut socket| {
        socket.serve(gate.clone(), workload.clone(), restore_options(args))?;
        Ok(socket)
    });
    match served {
        Ok(socket) => Some(socket),
        Err(error) => {
            eprintln!(
                "baton-mock-cuda: no restore thread, cuda-checkpoint cannot reach this process: cannot serve {}: {error}",
                path.display()
            );
            None
        }
    }
}

fn restore_options(args: &Args) -> RestoreOptions {
    RestoreOptions {
        vram_mib: args.vram_mib,
        copy_mib_per_s: args.copy_mib_per_s,
        lock_delay: Duration::from_millis(args.lock_delay_ms),
        fail_at: args.fail_at,
        fail_once: args.fail_once,
        crash_caller_at: args.crash_caller_at,
        exit_at_restore: args.exit_at_restore,
        hang_at: args.hang_at,
        weights_seed: weights::DEFAULT_SEED,
    }
}

fn lock(workload: &Shared) -> MutexGuard<'_, Workload> {
    workload.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The main thread: set up (and fork the worker), step, hold; every CUDA call goes through the gate.
fn run(
    workload: &Shared,
    gate: &Gate,
    args: &Args,
    cuda: Option<&CudaLibrary>,
    worker: &mut Option<Worker>,
) -> anyhow::Result<()> {
    let setup = lock(workload).setup();
    gate.done();
    setup?;
    if args.fork_worker {
        let forked = Worker::fork().context("cannot fork the worker")?;
        say(&format!("phase worker-forked {}", forked.pid()));
        *worker = Some(forked);
    }
    say("phase setup-done");
    if let (Some(cuda), Some(n)) = (cuda, args.launches) {
        launch(cuda, n, args.launch_when_exists.as_deref())?;
    }
    let mut main = MainThread {
        workload,
        gate,
        released: false,
    };
    let mut done = 0;
    while args.steps == 0 || done < args.steps {
        match gate.next(!main.released) {
            Next::Step => {
                let step = lock(workload).step();
                // The step is in flight (busy) for its whole duration.
                std::thread::sleep(Duration::from_millis(args.step_ms));
                gate.done();
                step?;
                done += 1;
                if args.progress_every > 0 && done % args.progress_every == 0 {
                    say_progress(done);
                }
            }
            Next::Event(event) => {
                if !main.apply(event)? {
                    return save_at_stop(workload, gate, args);
                }
            }
        }
    }
    say("phase steps-done");
    if args.hold {
        say("phase holding");
        while let Next::Event(event) = gate.next(false) {
            if !main.apply(event)? {
                return save_at_stop(workload, gate, args);
            }
        }
    }
    Ok(())
}

/// With `--save-at-stop`, the stop's last step of CUDA calls, once the process may make them.
fn save_at_stop(workload: &Shared, gate: &Gate, args: &Args) -> anyhow::Result<()> {
    if !args.save_at_stop {
        return Ok(());
    }
    say("phase stopping");
    gate.wait_running();
    let step = lock(workload).step();
    gate.done();
    step?;
    say("phase saved-at-stop");
    Ok(())
}

/// Prints `progress STEPS T_NS`: the steps done so far, and when (CLOCK_MONOTONIC ns).
fn say_progress(done: u64) {
    let now = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).map_or(0, |t| {
        t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64
    });
    say(&format!("progress {done} {now}"));
}

/// The launches of `--launches`, once `go` exists if asked.
fn launch(cuda: &CudaLibrary, n: Launches, go: Option<&std::path::Path>) -> anyhow::Result<()> {
    if let Some(go) = go {
        say("phase waiting-to-launch");
        wait_for_file(go, Duration::from_secs(60))?;
    }
    cuda.launch(n)?;
    say(&format!(
        "phase launches-done kernel={} kernel_ex={} graph={}",
        n.kernel, n.kernel_ex, n.graph
    ));
    Ok(())
}

/// Waits until `path` exists (polled every millisecond), up to `timeout`.
fn wait_for_file(path: &std::path::Path, timeout: Duration) -> anyhow::Result<()> {
    let start = std::time::Instant::now();
    while !path.exists() {
        if start.elapsed() > timeout {
            anyhow::bail!("{} did not appear within {timeout:?}", path.display());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    Ok(())
}

struct MainThread<'a> {
    workload: &'a Shared,
    gate: &'a Gate,
    /// Released by SIGUSR1: no steps until SIGUSR2.
    released: bool,
}

impl MainThread<'_> {
    /// Applies one event (the gate marked the thread busy); `false` when told to stop.
    fn apply(&mut self, event: Event) -> anyhow::Result<bool> {
        let result = self.apply_busy(event);
        self.gate.done();
        result
    }

    fn apply_busy(&mut self, event: Event) -> anyhow::Result<bool> {
        let mut workload = lock(self.workload);
        match event {
            Event::Stop => return Ok(false),
            Event::Reacquire => {
                if !workload.is_set_up() {
                    workload.reacquire()?;
                    say("reacquired");
                }
                self.released = false;
            }
            Event::Release => {
                if workload.is_set_up() {
                    workload.release()?;
                    say("released");
                }
                self.released = true;
            }
        }
        Ok(true)
    }
}

/// Blocks the control signals in this (main) thread before any other starts, then waits for them in a
/// dedicated thread; with `hold`, another thread reports stdin closing.
fn start_event_threads(hold: bool, gate: &Arc<Gate>) -> anyhow::Result<()> {
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
    let signal_gate = gate.clone();
    std::thread::spawn(move || {
        while let Ok(signal) = signals.wait() {
            signal_gate.post(match signal {
                Signal::SIGUSR1 => Event::Release,
                Signal::SIGUSR2 => Event::Reacquire,
                _ => Event::Stop,
            });
        }
    });
    if hold {
        let stdin_gate = gate.clone();
        std::thread::spawn(move || {
            let mut sink = [0u8; 256];
            let mut stdin = std::io::stdin();
            while matches!(stdin.read(&mut sink), Ok(n) if n > 0) {}
            stdin_gate.post(Event::Stop);
        });
    }
    Ok(())
}
