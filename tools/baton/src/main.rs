//! `baton`: the node agent (`baton agent`, a call into the `baton-agent` crate) and its clients (`baton status`, `baton events`, `baton freeze`,
//! `baton preempt`, ...), strace for the
//! NVIDIA driver per container (`baton trace`), a self-contained demo on the mock driver (`baton demo`), and
//! the probe benchmarks (`baton bench`), and `baton install` / `baton uninstall` (containerd's config,
//! the agent's unit).
mod bench;
mod control_cli;
mod demo;
mod install;
mod node;
mod preempt_cli;
mod timeline;
mod trace;

use clap::{Parser, Subcommand};

/// Baton: GPU-aware container runtime tools.
#[derive(Parser)]
#[command(name = "baton", version, about)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// The node agent: owns the probes and every watched container's GPU ledger and release signal.
    Agent(baton_agent::AgentArgs),
    /// The containers the agent watches: pids, NVIDIA fds, mappings, objects, memory, held/released.
    Status(node::StatusArgs),
    /// Stream the agent's events (registered, acquired, released, unregistered).
    Events(node::EventsArgs),
    /// Take the GPU from a container: checkpoint its CUDA processes to host memory and freeze it (park),
    /// or dump it with CRIU (snapshot). Prints the timeline.
    Preempt(preempt_cli::PreemptArgs),
    /// Give a parked container its GPU state back (thaw, restore, unlock).
    Resume(preempt_cli::ResumeArgs),
    /// Preempt one container and start (a created task) or resume (a parked one) another.
    Handoff(preempt_cli::HandoffArgs),
    #[command(about = control_cli::FREEZE_ABOUT)]
    Freeze(control_cli::FreezeArgs),
    #[command(about = control_cli::THAW_ABOUT)]
    Thaw(control_cli::FreezeArgs),
    /// Run the co-runners only RUN_MS of every WINDOW_MS.
    Duty(control_cli::DutyArgs),
    /// Hold the co-runners' stretch of the server's inter-token gaps at or under a target.
    Governor(control_cli::GovernorArgs),
    /// Trace calls into the NVIDIA kernel driver, per container, like strace.
    Trace(trace::TraceArgs),
    /// Make the timelines of a saved `baton trace --json` file (Perfetto JSON, a self-contained HTML page).
    Timeline(TimelineArgs),
    /// Start the mock NVIDIA driver, run a mock CUDA workload, and trace it live (real devices if present).
    Demo(demo::DemoArgs),
    /// Measure the probes' cost and throughput; prints figures, asserts nothing.
    Bench(bench::BenchArgs),
    /// Add the Baton runtime to containerd's config, install the agent's systemd unit, print the
    /// RuntimeClass.
    Install(install::InstallArgs),
    /// Remove what `baton install` added.
    Uninstall(install::UninstallArgs),
    /// The load `baton bench` runs in a child process.
    #[command(hide = true)]
    BenchWorker(bench::WorkerArgs),
}

/// Options of `baton timeline`.
#[derive(clap::Args, Debug)]
struct TimelineArgs {
    /// A `baton trace --json` output (one object per line).
    input: std::path::PathBuf,
    #[command(flatten)]
    outputs: timeline::Outputs,
}

/// Logs to stderr (the agent's log file for the agent) at `BATON_LOG`'s filter, else `default_level`.
fn init_log(default_level: &str) {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("BATON_LOG")
                .unwrap_or_else(|_| default_level.into()),
        )
        .with_writer(baton_agent::log_writer)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

fn main() -> std::process::ExitCode {
    // `baton freeze` and `baton thaw` are parsed and run on their own (control_cli::run_alone): building
    // every command's parser, then the log, cost them more than the agent and the shim take to answer.
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if let Some(code) = control_cli::run_alone(&args) {
        return code;
    }
    let cli = Cli::parse_from(args);
    // The agent is a daemon: its log says what it does. The other commands only warn.
    init_log(if matches!(cli.cmd, Cmd::Agent(_)) {
        "info"
    } else {
        "warn"
    });
    if let Cmd::BenchWorker(a) = cli.cmd {
        return match bench::worker_main(a) {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("baton bench-worker: {e:#}");
                std::process::ExitCode::FAILURE
            }
        };
    }
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("baton: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(async {
        match cli.cmd {
            Cmd::Agent(a) => baton_agent::run(a).await.map_err(anyhow::Error::from),
            Cmd::Status(a) => node::status(a).await,
            Cmd::Events(a) => node::events(a).await,
            Cmd::Preempt(a) => preempt_cli::preempt(a).await,
            Cmd::Resume(a) => preempt_cli::resume(a).await,
            Cmd::Handoff(a) => preempt_cli::handoff(a).await,
            Cmd::Freeze(a) => control_cli::freeze(a, true).await,
            Cmd::Thaw(a) => control_cli::freeze(a, false).await,
            Cmd::Duty(a) => control_cli::duty(a).await,
            Cmd::Governor(a) => control_cli::governor(a).await,
            Cmd::Trace(a) => trace::run(a).await,
            Cmd::Timeline(a) => timeline::convert(&a.input, &a.outputs),
            Cmd::Demo(a) => demo::run(a).await,
            Cmd::Bench(a) => bench::run(a).await,
            Cmd::Install(a) => install::install(a),
            Cmd::Uninstall(a) => install::uninstall(a),
            Cmd::BenchWorker(_) => Ok(()),
        }
    });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("baton: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
