//! `baton-analog-corunner`: the CPU analog's co-runner (the "trainer"). It does fixed units of CPU work
//! without end and rewrites `--report` (`UNITS T_NS`: units done, CLOCK_MONOTONIC ns) every `--every-ms`,
//! so that whoever reads the file can tell its throughput. `--cpu N` pins it to CPU N.
use std::path::PathBuf;

use anyhow::{Context, Result};
use baton_integration::analog::work::{now_ns, pin_to_cpu, work_unit};
use clap::Parser;

/// The co-runner's flags.
#[derive(Parser)]
struct Args {
    /// The file it rewrites with its count.
    #[arg(long)]
    report: PathBuf,
    /// How often it rewrites it, ms.
    #[arg(long, default_value_t = 20)]
    every_ms: u64,
    /// Pin it to this CPU.
    #[arg(long)]
    cpu: Option<usize>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if let Some(cpu) = args.cpu {
        pin_to_cpu(cpu)?;
    }
    let tmp = args.report.with_extension("tmp");
    let every_ns = args.every_ms * 1_000_000;
    let (mut units, mut seed, mut last) = (0u64, 1u64, 0u64);
    loop {
        seed = work_unit(seed);
        units += 1;
        let now = now_ns();
        if now.saturating_sub(last) >= every_ns {
            // Written then renamed over the report: a reader never sees half a line.
            std::fs::write(&tmp, format!("{units} {now}\n"))
                .and_then(|()| std::fs::rename(&tmp, &args.report))
                .with_context(|| format!("writing {}", args.report.display()))?;
            last = now;
        }
    }
}
