//! The device kit behind `tools/gpu-check` (the `baton-gpu-check` binary): one run on a machine with an
//! NVIDIA GPU (or, with `--mock`, on the FUSE mock driver) that traces a PyTorch program through the agent
//! and `baton trace --json`, keeps the trace as a golden file, counts what the decoder could not name,
//! compares the ledger's peak and the release signal with NVML, and parks and resumes a process holding
//! GPU memory (with a forked worker) through the `cuda-checkpoint` program and through the driver API, each
//! park with the seeds' loop: a server waiting on the agent's gate starts on the release. Its findings are a
//! table on stdout and `report.json` in the output folder, written after each part for whatever ran; every
//! wait is bounded ([`bounds`]), and what this machine lacks is recorded as unavailable.
pub mod bounded;
pub mod bounds;
pub mod checkpoint;
pub mod count;
mod cycle;
pub mod gate;
pub mod machine;
pub mod nvml_poll;
pub mod replay;
pub mod report;
pub mod rig;
mod table;
pub mod trace_run;
pub mod watched;
pub mod ways;

use std::{path::PathBuf, time::Duration};

use checkpoint::CheckpointResult;
use report::{Overall, Part, Report};

/// What a run is asked to do.
#[derive(Clone, Debug)]
pub struct Options {
    /// Run against the FUSE mock driver and the mock workloads instead of a GPU.
    pub mock: bool,
    /// Smaller sizes and one park/resume per way.
    pub quick: bool,
    /// Where the golden trace, the logs and `report.json` go.
    pub out: PathBuf,
    /// GiB the checkpointed process holds (default: 8, 1 with `--quick` or `--mock`).
    pub gib: Option<u64>,
    /// Park/resume cycles per way (default: 3, 1 with `--quick`).
    pub cycles: Option<u32>,
    /// Park a holder without a forked worker.
    pub no_worker: bool,
    /// End every wait by then, and skip what is left.
    pub time_limit: Option<Duration>,
    /// The Python interpreter with PyTorch (real runs).
    pub python: String,
    /// The CUDA driver library for the driver-API path (a bare name goes through the dynamic loader).
    pub libcuda: Option<PathBuf>,
    /// The `cuda-checkpoint` program (default: the one on PATH).
    pub cuda_checkpoint: Option<PathBuf>,
    /// Where the release binaries are (`baton`, `containerd-shim-baton-v1`, the mock's programs).
    pub bin_dir: PathBuf,
}

/// Runs the kit: the machine's survey, the trace part, then the checkpoint part, writing `report.json`
/// (and `table.md`) after each; prints the table. `Err` only when nothing could run (not root, no driver,
/// a binary missing); a part that fails is in the report.
pub fn run(options: &Options) -> anyhow::Result<Report> {
    std::fs::create_dir_all(&options.out)?;
    let mut rig = rig::Rig::new(options)?;
    let machine = (!rig.mock).then(|| machine::survey(&rig.python, &rig.bounds));
    if let Some(why) = machine.as_ref().and_then(|m| m.torch_unavailable.as_ref()) {
        rig.cuda_programs = Err(format!("no PyTorch with CUDA to run: {why}"));
    }
    let mut report = Report {
        mock: rig.mock,
        quick: rig.quick,
        driver_version: rig.driver_version.clone(),
        machine,
        trace: Part::not_run("not reached"),
        checkpoint: CheckpointResult::not_run(&rig, "not reached"),
        overall: Overall::Partial,
        failed: Vec::new(),
        not_measured: Vec::new(),
    };
    report.write(&options.out)?;
    report.trace = if rig.bounds.expired() {
        Part::not_run("--time-limit reached before it")
    } else {
        trace_run::run(&rig)
    };
    report.write(&options.out)?;
    let so_far = report.clone();
    report.checkpoint = checkpoint::run(&rig, &mut |checkpoint| {
        let mut r = so_far.clone();
        r.checkpoint = checkpoint.clone();
        if let Err(e) = r.write(&options.out) {
            eprintln!("gpu-check: cannot write the report: {e:#}");
        }
    });
    report.write(&options.out)?;
    print!("{}", report.table());
    Ok(report)
}
