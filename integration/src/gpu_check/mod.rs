//! The device kit behind `tools/gpu-check` (the `baton-gpu-check` binary): one run on a machine with an
//! NVIDIA GPU (or, with `--mock`, on the FUSE mock driver) that traces a PyTorch program through the agent
//! and `baton trace --json`, keeps the trace as a golden file, counts what the decoder could not name,
//! compares the ledger's peak and the release signal with NVML, and parks and resumes a process holding
//! GPU memory through the `cuda-checkpoint` program and through the driver API. Its findings are a table on
//! stdout and `report.json` in the output folder.
pub mod checkpoint;
pub mod count;
pub mod nvml_poll;
pub mod replay;
pub mod report;
pub mod rig;
pub mod trace_run;
pub mod watched;

use std::path::PathBuf;

/// What a run is asked to do.
#[derive(Clone, Debug)]
pub struct Options {
    /// Run against the FUSE mock driver and the mock workloads instead of a GPU.
    pub mock: bool,
    /// Where the golden trace, the logs and `report.json` go.
    pub out: PathBuf,
    /// GiB the checkpointed process holds.
    pub gib: u64,
    /// The Python interpreter with PyTorch (real runs).
    pub python: String,
    /// The CUDA driver library for the driver-API path (a bare name goes through the dynamic loader).
    pub libcuda: Option<PathBuf>,
    /// The `cuda-checkpoint` program (default: the one on PATH).
    pub cuda_checkpoint: Option<PathBuf>,
    /// Where the release binaries are (`baton`, `containerd-shim-baton-v1`, the mock's programs).
    pub bin_dir: PathBuf,
}

/// Runs the kit: the trace part, then the checkpoint part; prints the table and writes `report.json`.
pub fn run(options: &Options) -> anyhow::Result<report::Report> {
    std::fs::create_dir_all(&options.out)?;
    let rig = rig::Rig::new(options)?;
    let trace = trace_run::run(&rig)?;
    let checkpoint = checkpoint::run(&rig)?;
    let report = report::Report {
        mock: options.mock,
        driver_version: rig.driver_version.clone(),
        trace,
        checkpoint,
    };
    report.write(&options.out)?;
    print!("{}", report.table());
    Ok(report)
}
