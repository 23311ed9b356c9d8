//! Benchmarks.
use clap::Args;
/// Options of `baton bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {}
/// Runs the benchmarks.
pub async fn run(_a: BenchArgs) -> anyhow::Result<()> {
    Ok(())
}
