//! `baton-launch-bench`: what launch telemetry costs a launch. Calls the fake libcuda's `cuLaunchKernel`
//! (integration/fake-libcuda, through `dlopen` as CUDA programs do) in batches and reports ns per call in
//! three arms, alternated in rounds within one run: no uprobe; the tracer's uprobe on the library but this
//! process's cgroup not watched (the uprobe trap and the cgroup filter); and watched (the launch is counted).
//! It checks that the watched arm counted every call. Figures only, ratios against the same run.
//!
//! Run as root: `cargo run --release -p baton-integration --bin baton-launch-bench [-- CALLS [ROUNDS]]`
//! (defaults 200000 calls per batch, 5 rounds).
use std::{path::PathBuf, time::Instant};

use anyhow::{Context, Result, bail, ensure};
use baton_integration::trace_env::{fake_libcuda_in, missing_trace_prerequisite};
use baton_mock_nvidia::workload::launch::CudaLibrary;
use baton_tracer::{Tracer, TracerConfig, cgroups};

/// The bench's own cgroup, so that watching it traces nothing else.
struct OwnCgroup {
    root: PathBuf,
    path: PathBuf,
    id: u64,
}

impl OwnCgroup {
    fn enter() -> Result<Self> {
        let root = cgroups::find_v2_root()?;
        let rel = format!("/baton-launch-bench-{}", std::process::id());
        let path = cgroups::create(&root, &rel)?;
        std::fs::write(path.join("cgroup.procs"), std::process::id().to_string())
            .with_context(|| format!("cannot move into {}", path.display()))?;
        let id = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&path)?);
        Ok(Self { root, path, id })
    }
}

impl Drop for OwnCgroup {
    fn drop(&mut self) {
        let _ = std::fs::write(
            self.root.join("cgroup.procs"),
            std::process::id().to_string(),
        );
        let _ = cgroups::remove(&self.path);
    }
}

/// ns per call of `calls` cuLaunchKernel calls.
fn batch(cuda: &CudaLibrary, calls: u64) -> Result<f64> {
    let start = Instant::now();
    for _ in 0..calls {
        cuda.launch_kernel()?;
    }
    Ok(start.elapsed().as_nanos() as f64 / calls as f64)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let calls: u64 = match args.next() {
        Some(n) => n.parse().context("CALLS must be a number")?,
        None => 200_000,
    };
    let rounds: usize = match args.next() {
        Some(n) => n.parse().context("ROUNDS must be a number")?,
        None => 5,
    };
    ensure!(calls > 0 && rounds > 0, "CALLS and ROUNDS must be positive");
    if let Some(reason) = missing_trace_prerequisite() {
        bail!("cannot benchmark: {reason}");
    }
    let dir = tempfile::tempdir()?;
    let lib = fake_libcuda_in(dir.path())?;
    let cuda = CudaLibrary::open(&lib)?;
    let cg = OwnCgroup::enter()?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let _entered = rt.enter();
    let (mut none, mut unwatched, mut watched) = (Vec::new(), Vec::new(), Vec::new());
    batch(&cuda, calls)?; // warm-up
    for _ in 0..rounds {
        none.push(batch(&cuda, calls)?);
        let mut tracer = Tracer::start(TracerConfig::default())?;
        ensure!(
            tracer.probe_launches_of(std::process::id()) == 1,
            "the tracer did not attach to {}",
            lib.display()
        );
        unwatched.push(batch(&cuda, calls)?);
        tracer.watch_cgroup(cg.id)?;
        watched.push(batch(&cuda, calls)?);
        let counted = tracer.launches(cg.id).kernel;
        ensure!(
            counted == calls,
            "the watched arm counted {counted} of {calls} launches"
        );
        // Dropping the tracer detaches the uprobes.
    }
    let (none, unwatched, watched) = (
        median(&mut none),
        median(&mut unwatched),
        median(&mut watched),
    );
    println!(
        "launch telemetry: cuLaunchKernel of the fake libcuda, {calls} calls x {rounds} rounds, median ns/call"
    );
    println!("  no uprobe                   {none:>9.1} ns");
    println!(
        "  uprobe, cgroup not watched  {unwatched:>9.1} ns  (+{:.1} ns, {:.1}x)",
        unwatched - none,
        unwatched / none
    );
    println!(
        "  uprobe, watched (counted)   {watched:>9.1} ns  (+{:.1} ns, {:.1}x); every call counted",
        watched - none,
        watched / none
    );
    Ok(())
}
