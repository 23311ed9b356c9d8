//! `baton-gpu-check`: the device kit (run it through `tools/gpu-check`). On a machine with an NVIDIA GPU,
//! PyTorch in `python3` and no containerd, from release binaries carried there: traces a PyTorch program
//! through the agent and `baton trace --json` (kept as a golden trace), counts what the decoder could not name,
//! compares the ledger and the release signal with a 1 ms NVML poller, and parks and resumes a process holding
//! GPU memory through `cuda-checkpoint` and through the driver API. `--mock` runs the same on the FUSE mock
//! driver. Prints a table; writes the golden trace, logs and `report.json` under `--out`.
use std::path::PathBuf;

use anyhow::{Context, Result};
use baton_integration::gpu_check::{self, Options};
use clap::Parser;

/// Check Baton against this machine's NVIDIA driver (or, with --mock, the mock driver).
///
/// Needs: root; a cgroup v2 hierarchy; the release binaries in --bin-dir (baton, containerd-shim-baton-v1,
/// this program; with --mock also baton-mock-cuda, baton-mock-cuda-checkpoint, libbaton_fake_libcuda.so);
/// without --mock an NVIDIA driver, python3 with PyTorch and CUDA, and for the checkpoint part a driver of
/// 570 or later (the driver API) and/or `cuda-checkpoint` on PATH. Takes a few minutes; nothing is installed.
#[derive(Debug, Parser)]
#[command(name = "gpu-check", version)]
struct Args {
    /// Run against the FUSE mock driver and mock workloads (no GPU needed).
    #[arg(long)]
    mock: bool,
    /// Output folder: golden/<driver version>/*.jsonl, report.json, logs.
    #[arg(long, default_value = "gpu-check-out")]
    out: PathBuf,
    /// GiB of weights the checkpointed process holds (default 8; 1 with --mock).
    #[arg(long)]
    gib: Option<u64>,
    /// Python interpreter with PyTorch.
    #[arg(long, default_value = "python3")]
    python: String,
    /// CUDA driver library for the driver-API path (default libcuda.so.1 through the dynamic loader).
    #[arg(long)]
    libcuda: Option<PathBuf>,
    /// The cuda-checkpoint program (default: the one on PATH).
    #[arg(long)]
    cuda_checkpoint: Option<PathBuf>,
    /// Folder of the release binaries (default: this program's).
    #[arg(long)]
    bin_dir: Option<PathBuf>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let bin_dir = match args.bin_dir {
        Some(d) => d,
        None => std::env::current_exe()?
            .parent()
            .context("this program has no folder")?
            .to_owned(),
    };
    let options = Options {
        mock: args.mock,
        out: args.out,
        gib: args.gib.unwrap_or(if args.mock { 1 } else { 8 }),
        python: args.python,
        libcuda: args.libcuda,
        cuda_checkpoint: args.cuda_checkpoint,
        bin_dir,
    };
    gpu_check::run(&options)?;
    Ok(())
}
