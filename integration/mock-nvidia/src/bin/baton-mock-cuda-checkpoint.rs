//! `baton-mock-cuda-checkpoint`: a stand-in for NVIDIA's `cuda-checkpoint` with its command line, driving
//! `baton-mock-cuda`'s restore thread over its control socket (reached through `/proc/PID/root`, so PID is
//! a host pid even when the workload runs in a container). Quiet and exit 0 on success; one line on
//! stderr and a non-zero exit on failure: like NVIDIA's program, the CUDA error code where the driver
//! answered one the stand-in models (3, `CUDA_ERROR_NOT_INITIALIZED`, for a process with no CUDA state of
//! its own, such as a worker forked after CUDA init), 1 otherwise.

use baton_mock_nvidia::workload::control::{
    self, Action, CudaState, NOT_INITIALIZED, Reply, Request,
};
use baton_nvidia::cuda_checkpoint::driver_api::CUDA_ERROR_NOT_INITIALIZED;
use clap::{ArgGroup, Parser, ValueEnum};

/// Checkpoint and restore the CUDA state of a (mock) CUDA process.
#[derive(Debug, Parser)]
#[command(name = "cuda-checkpoint", version)]
#[command(group(ArgGroup::new("operation").required(true).args(["action", "get_state", "toggle"])))]
struct Args {
    /// The action to perform.
    #[arg(long, value_enum)]
    action: Option<CliAction>,
    /// Print the process's state: running, locked, checkpointed or failed.
    #[arg(long)]
    get_state: bool,
    /// Checkpoint a running process (lock, checkpoint) or restore a checkpointed one (restore, unlock).
    #[arg(long)]
    toggle: bool,
    /// Host pid of the CUDA process.
    #[arg(long, short = 'p')]
    pid: u32,
    /// Milliseconds a lock waits for in-flight work before it fails (default: no limit).
    #[arg(long)]
    timeout: Option<u64>,
}

/// `--action` values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum CliAction {
    Lock,
    Checkpoint,
    Restore,
    Unlock,
}

impl From<CliAction> for Action {
    fn from(action: CliAction) -> Self {
        match action {
            CliAction::Lock => Self::Lock,
            CliAction::Checkpoint => Self::Checkpoint,
            CliAction::Restore => Self::Restore,
            CliAction::Unlock => Self::Unlock,
        }
    }
}

fn main() {
    let args = Args::parse();
    if let Err(message) = run(&args) {
        eprintln!("cuda-checkpoint: {message}");
        // NVIDIA's program exits with the CUDA error code of a failed call (criu's CUDA plugin reads it).
        let code = if message.contains(NOT_INITIALIZED) {
            CUDA_ERROR_NOT_INITIALIZED as i32
        } else {
            1
        };
        std::process::exit(code);
    }
}

fn run(args: &Args) -> Result<(), String> {
    let action = args.action.map(Action::from);
    if args.timeout.is_some() && action != Some(Action::Lock) {
        return Err("--timeout applies to --action lock only".to_owned());
    }
    let pid = args.pid;
    if let Some(action) = action {
        return perform(pid, action, args.timeout.unwrap_or(0)).map(drop);
    }
    let state = send(pid, "get-state", Request::State)?;
    if args.get_state {
        println!("{state}");
        return Ok(());
    }
    let steps = match state {
        CudaState::Running => [Action::Lock, Action::Checkpoint],
        CudaState::Checkpointed => [Action::Restore, Action::Unlock],
        other => {
            return Err(format!(
                "toggle of pid {pid} failed: it needs a running or checkpointed process; state is {other}"
            ));
        }
    };
    for action in steps {
        perform(pid, action, 0)?;
    }
    Ok(())
}

fn perform(pid: u32, action: Action, timeout_ms: u64) -> Result<CudaState, String> {
    send(pid, action.name(), Request::action(action, timeout_ms))
}

/// Sends `request`; an `err` reply or a failure to reach the process becomes the one-line message.
fn send(pid: u32, what: &str, request: Request) -> Result<CudaState, String> {
    match control::send(pid, request) {
        Ok(Reply::Ok(state)) => Ok(state),
        Ok(Reply::Err(message)) => Err(format!("{what} of pid {pid} failed: {message}")),
        Err(error) => Err(format!("{what} of pid {pid} failed: {error}")),
    }
}
