//! `baton demo`: the main job on an embedded default. Without an NVIDIA driver it mounts the mock NVIDIA
//! driver (FUSE), runs the mock CUDA workload in a cgroup of its own and traces it live, then prints the
//! summary. With a real driver (/dev/nvidiactl present) it traces the real devices instead.
use std::{
    path::{Path, PathBuf},
    process::Stdio,
    time::Duration,
};

use anyhow::{Context, bail};
use baton_mock_nvidia::driver::{MockDriver, MountOptions};
use baton_tracer::cgroups;
use clap::Args;

use crate::trace::{self, TraceArgs};

/// Options of `baton demo`.
#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Use the mock driver even when a real NVIDIA driver is present.
    #[arg(long)]
    mock: bool,
    /// Training steps the mock workload runs.
    #[arg(long, default_value_t = 3)]
    steps: u32,
    /// Video memory the mock workload allocates, MiB.
    #[arg(long, default_value_t = 2048)]
    vram_mib: u64,
    /// Seconds to trace the real driver (real-driver mode).
    #[arg(long, default_value_t = 10.0)]
    seconds: f64,
    /// Print JSON events instead of text lines.
    #[arg(long)]
    json: bool,
}

/// Runs the demo.
pub async fn run(args: DemoArgs) -> anyhow::Result<()> {
    if !args.mock
        && Path::new("/dev/nvidiactl").exists()
        && Path::new("/proc/driver/nvidia/version").exists()
    {
        return real_driver(&args).await;
    }
    mock_driver(&args).await
}

/// Traces the real driver for a while; runs nvidia-smi as a workload when it is installed.
async fn real_driver(args: &DemoArgs) -> anyhow::Result<()> {
    eprintln!(
        "baton demo: NVIDIA driver found: tracing every process's calls into /dev/nvidia* for {} s",
        args.seconds
    );
    let workload = async {
        tokio::time::sleep(Duration::from_millis(500)).await;
        match tokio::process::Command::new("nvidia-smi")
            .stdout(Stdio::null())
            .status()
            .await
        {
            Ok(_) => eprintln!("baton demo: ran nvidia-smi as the workload"),
            Err(_) => eprintln!("baton demo: nvidia-smi not found: run any CUDA program now"),
        }
        tokio::time::sleep(Duration::from_secs_f64(args.seconds)).await;
    };
    let targs = TraceArgs {
        all: true,
        summary: true,
        json: args.json,
        ..Default::default()
    };
    trace::run_until(targs, workload, |_| {}).await
}

/// A sibling binary of this one (cargo puts every workspace binary in the same folder).
fn sibling(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("cannot find the baton binary's path")?;
    let path = exe.with_file_name(name);
    if !path.is_file() {
        bail!(
            "{name} not found at {}: build it with `cargo build --release -p baton-mock-nvidia`",
            path.display()
        );
    }
    Ok(path)
}

async fn mock_driver(args: &DemoArgs) -> anyhow::Result<()> {
    let dir = tempfile::Builder::new()
        .prefix("baton-demo-dev")
        .tempdir()?;
    // Served by threads of this process; dropping it unmounts.
    let _mock = MockDriver::mount(MountOptions::new(dir.path())).with_context(|| {
        format!(
            "cannot mount the mock NVIDIA driver at {} (is FUSE available? apt-get install fuse3)",
            dir.path().display()
        )
    })?;
    eprintln!(
        "baton demo: no NVIDIA driver here: mock driver mounted at {}",
        dir.path().display()
    );
    let root = cgroups::find_v2_root()?;
    let cg_rel = format!("/baton-demo/trainer-{}", std::process::id());
    let cg = cgroups::create(&root, &cg_rel)?;
    let prefix = format!("{}/", dir.path().display());
    let workload_args: Vec<String> = vec![
        "--dev-dir".into(),
        dir.path().display().to_string(),
        "--steps".into(),
        args.steps.to_string(),
        "--step-ms".into(),
        "200".into(),
        "--vram-mib".into(),
        args.vram_mib.to_string(),
    ];
    let targs = TraceArgs {
        cgroups: vec![PathBuf::from(&cg_rel)],
        prefixes: vec![prefix],
        summary: true,
        json: args.json,
        ..Default::default()
    };
    let workload = sibling("baton-mock-cuda")?;
    let cg_for_child = cg.clone();
    let run_workload = async move {
        // Give the probes a moment to attach before the workload starts.
        tokio::time::sleep(Duration::from_millis(300)).await;
        let mut cmd = tokio::process::Command::from(cgroups::command_in(
            &cg_for_child,
            &workload,
            &workload_args,
        ));
        match cmd.stdout(Stdio::null()).status().await {
            Ok(s) if s.success() => eprintln!("baton demo: workload finished"),
            Ok(s) => eprintln!("baton demo: workload failed: {s}"),
            Err(e) => eprintln!("baton demo: cannot run the workload: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let result = trace::run_until(targs, run_workload, |_| {}).await;
    let _ = cgroups::remove(&cg);
    let _ = cgroups::remove(&root.join("baton-demo"));
    result
}
