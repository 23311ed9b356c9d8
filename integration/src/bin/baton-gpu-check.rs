//! `baton-gpu-check`: the device kit (run it through `tools/gpu-check`). On a machine with an NVIDIA GPU,
//! PyTorch in `python3` and no containerd, from release binaries carried there: traces a PyTorch program
//! through the agent and `baton trace --json` (kept as a golden trace), counts what the decoder could not name,
//! compares the ledger and the release signal with a 1 ms NVML poller, and parks and resumes a process holding
//! GPU memory, with a forked worker, through `cuda-checkpoint` and through the driver API, each park with a
//! server waiting on the agent's GPU-free gate. `--mock` runs the same on the FUSE mock driver. Prints a
//! table; writes the golden trace, logs and `report.json` (after each part) under `--out`. Exits 0 when
//! everything passed, 1 when something failed, 3 when nothing failed but something could not run here, 2
//! when nothing could run.
use std::{path::PathBuf, time::Duration};

use anyhow::{Context, Result};
use baton_integration::gpu_check::{self, Options};
use clap::Parser;

/// Check Baton against this machine's NVIDIA driver (or, with --mock, the mock driver).
///
/// Needs: root; a cgroup v2 hierarchy; the release binaries in --bin-dir (baton, containerd-shim-baton-v1,
/// this program; with --mock also baton-mock-cuda, baton-mock-cuda-checkpoint, libbaton_fake_libcuda.so);
/// without --mock an NVIDIA driver, python3 with PyTorch and CUDA, and for the checkpoint part a driver of
/// 570 or later (the driver API) and/or `cuda-checkpoint` on PATH. What is missing (PyTorch,
/// cuda-checkpoint, nvidia-smi, NVML) is reported as unavailable and the rest runs. Every wait is bounded;
/// report.json is written after each part. A full run takes a few minutes; --quick under 2 on one GPU.
/// Nothing is installed. Exit status: 0 passed, 1 failed, 3 partial (something unavailable), 2 not run.
#[derive(Debug, Parser)]
#[command(name = "gpu-check", version)]
struct Args {
    /// Run against the FUSE mock driver and mock workloads (no GPU needed).
    #[arg(long)]
    mock: bool,
    /// A short run (under 2 minutes on one GPU): the holder holds 1 GiB instead of 8, each way parks and
    /// resumes once instead of 3 times, and the bounds are shorter (a PyTorch program's start 120 s, a
    /// checkpoint call 60 s, `released` 5 s after the checkpoint returned). The trace part, the forked
    /// worker and the seeds' loop are kept.
    #[arg(long)]
    quick: bool,
    /// Output folder: golden/<driver version>/*.jsonl, report.json, table.md, logs.
    #[arg(long, default_value = "gpu-check-out")]
    out: PathBuf,
    /// GiB of weights the checkpointed process holds (default 8; 1 with --quick or --mock).
    #[arg(long)]
    gib: Option<u64>,
    /// Park/resume cycles per way (default 3; 1 with --quick).
    #[arg(long)]
    cycles: Option<u32>,
    /// Park a holder without a forked worker (to tell a problem of the worker from another).
    #[arg(long)]
    no_worker: bool,
    /// Seconds the whole run may take: every wait ends by then and what is left is reported as not run
    /// (set it below the machine's remaining time).
    #[arg(long)]
    time_limit: Option<u64>,
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
        quick: args.quick,
        out: args.out,
        gib: args.gib,
        cycles: args.cycles,
        no_worker: args.no_worker,
        time_limit: args.time_limit.map(Duration::from_secs),
        python: args.python,
        libcuda: args.libcuda,
        cuda_checkpoint: args.cuda_checkpoint,
        bin_dir,
    };
    match gpu_check::run(&options) {
        Ok(report) => std::process::exit(report.overall.exit_code()),
        Err(e) => {
            eprintln!("gpu-check: {e:#}");
            std::process::exit(2);
        }
    }
}
