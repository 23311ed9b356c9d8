//! `baton demo`: the main job on an embedded default. Without an NVIDIA driver it starts the mock NVIDIA
//! driver (`baton-mock-nvidia`, a FUSE file system served by its own process: the test mock is not linked into
//! this binary), runs the mock CUDA workload in a cgroup of its own and traces it live, then prints the
//! summary. With a real driver (/dev/nvidiactl present) it traces the real devices instead.
use std::{
    io::BufRead,
    path::{Path, PathBuf},
    process::Stdio,
    time::Duration,
};

use anyhow::{Context, bail};
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
    // run_until polls this only once the probes are attached.
    let workload = async {
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

/// How long the mock driver may take to mount.
const MOUNT_TIMEOUT: Duration = Duration::from_secs(30);

/// A helper binary of the demo: next to this one (cargo puts every workspace binary in the same folder), else
/// on PATH.
fn helper_binary(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("cannot find the baton binary's path")?;
    let sibling = exe.with_file_name(name);
    if sibling.is_file() {
        return Ok(sibling);
    }
    let on_path = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join(name))
            .find(|candidate| candidate.is_file())
    });
    on_path.with_context(|| {
        format!(
            "{name} not found next to {} nor on PATH: build it with `cargo build --release -p baton-mock-nvidia` \
             (tools/dev demo does)",
            exe.display()
        )
    })
}

/// The mock driver served by its own `baton-mock-nvidia` process; SIGTERM (on drop) makes it unmount.
struct MockDriverProcess {
    child: std::process::Child,
}

impl MockDriverProcess {
    /// Starts the driver on `dir` and waits for its `ready <dir>` line.
    fn start(binary: &Path, dir: &Path) -> anyhow::Result<Self> {
        let mut child = std::process::Command::new(binary)
            .arg("--mount")
            .arg(dir)
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot run {}", binary.display()))?;
        let stdout = child
            .stdout
            .take()
            .context("no stdout pipe to the mock driver")?;
        let driver = Self { child };
        let (line_tx, line_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = std::io::BufReader::new(stdout).read_line(&mut line);
            let _ = line_tx.send(line);
        });
        let line = line_rx.recv_timeout(MOUNT_TIMEOUT).unwrap_or_default();
        if line.trim_end() != format!("ready {}", dir.display()) {
            bail!(
                "the mock NVIDIA driver ({}) did not mount {} (is FUSE available? apt-get install fuse3); it said {:?}",
                binary.display(),
                dir.display(),
                line.trim_end()
            );
        }
        Ok(driver)
    }
}

impl Drop for MockDriverProcess {
    fn drop(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        if nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).is_err() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

async fn mock_driver(args: &DemoArgs) -> anyhow::Result<()> {
    let dir = tempfile::Builder::new()
        .prefix("baton-demo-dev")
        .tempdir()?;
    let workload = helper_binary("baton-mock-cuda")?;
    // Dropped (unmounted) after the workload, before the folder.
    let _mock = MockDriverProcess::start(&helper_binary("baton-mock-nvidia")?, dir.path())?;
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
    let cg_for_child = cg.clone();
    let run_workload = async move {
        // run_until polls this only once the probes are attached (after its ready line).
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
        // Nothing to wait for: the workload has exited, so all its records are in the ring buffer, which
        // run_until drains before the summary.
    };
    let result = trace::run_until(targs, run_workload, |_| {}).await;
    let _ = cgroups::remove(&cg);
    let _ = cgroups::remove(&root.join("baton-demo"));
    result
}
