//! `baton-mock-nvidia`: mounts the mock NVIDIA driver on a directory, prints `ready <mountpoint>` once it
//! serves, and unmounts cleanly on SIGINT or SIGTERM.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use baton_mock_nvidia::driver::{
    DEFAULT_DRIVER_VERSION, DEFAULT_VRAM_MIB, MockDriver, MountOptions,
};
use clap::Parser;
use nix::sys::signal::{SigSet, Signal};

/// Mock NVIDIA kernel driver served through FUSE (for tests without a GPU).
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// Empty directory to mount the device files on.
    #[arg(long)]
    mount: PathBuf,
    /// Driver version to report and whose ioctl struct layouts to accept.
    #[arg(long, default_value = DEFAULT_DRIVER_VERSION)]
    driver_version: String,
    /// Number of GPUs (nvidia0..).
    #[arg(long, default_value_t = 1)]
    gpus: u32,
    /// Video memory per GPU, in MiB (default: an H200's); allocations past it are refused.
    #[arg(long, default_value_t = DEFAULT_VRAM_MIB)]
    vram_mib: u64,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // Block the stop signals before the FUSE thread starts, so only sigwait below sees them.
    let mut stop_signals = SigSet::empty();
    stop_signals.add(Signal::SIGINT);
    stop_signals.add(Signal::SIGTERM);
    stop_signals
        .thread_block()
        .context("cannot block SIGINT/SIGTERM")?;
    let options = MountOptions::new(&args.mount)
        .with_driver_version(args.driver_version)
        .with_gpus(args.gpus)
        .with_vram_mib(args.vram_mib);
    let driver = MockDriver::mount(options)?;
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "ready {}", driver.mountpoint().display())?;
    stdout.flush()?;
    drop(stdout);
    let signal = stop_signals.wait().context("waiting for SIGINT/SIGTERM")?;
    eprintln!(
        "baton-mock-nvidia: {signal}, unmounting {}",
        driver.mountpoint().display()
    );
    if let Err(error) = driver.unmount() {
        // Files still open (a workload holding them): the mount was detached and its connection
        // aborted instead, which is as final as an unmount for this process.
        eprintln!("baton-mock-nvidia: {error}; detached the mount instead");
    }
    Ok(())
}
