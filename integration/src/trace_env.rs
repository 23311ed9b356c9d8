//! Environment for the tracing tests: the mock NVIDIA driver mounted through FUSE in a temporary folder, test
//! cgroups of their own under the cgroup v2 root, mock CUDA workloads started inside them, and a
//! [`baton_tracer::Tracer`] that watches them. Everything is torn down on drop, also after a failed assertion.
use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use baton_mock_nvidia::{
    driver::{MockDriver, MountOptions, MountedDriver, fuse_unavailable_reason},
    workload::{
        Summary, WorkloadOptions,
        process::{self, WorkloadProcess},
    },
};
use baton_tracer::{Tracer, TracerConfig, cgroups, event::Event};

use crate::shim_binary::{build_package, target_dir};

/// The reason the tracing tests cannot run here, or `None`.
pub fn missing_trace_prerequisite() -> Option<String> {
    if !nix::unistd::geteuid().is_root() {
        return Some("needs root (loads eBPF programs, mounts FUSE, creates cgroups)".into());
    }
    if let Some(r) = fuse_unavailable_reason() {
        return Some(r);
    }
    if cgroups::find_v2_root().is_err() {
        return Some("no cgroup v2 hierarchy mounted: per-container attribution needs one".into());
    }
    None
}

/// Binaries `names` from the folder of the running program (a benchmark in `target/release` finds the
/// release builds of `baton`, the mock holder, ... beside it), or what to build when one is missing.
pub fn sibling_binaries<const N: usize>(names: [&str; N]) -> anyhow::Result<[PathBuf; N]> {
    let exe = std::env::current_exe()?;
    let dir = exe
        .parent()
        .ok_or_else(|| anyhow::anyhow!("{} has no folder", exe.display()))?;
    let paths = names.map(|n| dir.join(n));
    for bin in &paths {
        anyhow::ensure!(
            bin.is_file(),
            "{} missing: cargo build --release --workspace --bins",
            bin.display()
        );
    }
    Ok(paths)
}

/// A workspace binary from `<target>/debug`, built with `cargo build -p package` if it is not there.
pub fn workspace_binary(package: &str, name: &str) -> anyhow::Result<PathBuf> {
    let path = target_dir().join("debug").join(name);
    if !path.is_file() {
        build_package(package, false)?;
    }
    anyhow::ensure!(path.is_file(), "{name} not found at {}", path.display());
    Ok(path)
}

/// The fake libcuda (`integration/fake-libcuda`, of this binary's profile), built if needed, copied to
/// `dir/libcuda.so.1` (a file of its own, so that a test's uprobes are on an inode no other test probes).
pub fn fake_libcuda_in(dir: &Path) -> anyhow::Result<PathBuf> {
    let release = !cfg!(debug_assertions);
    let profile = if release { "release" } else { "debug" };
    let built = target_dir().join(profile).join("libbaton_fake_libcuda.so");
    if !built.is_file() {
        build_package("baton-fake-libcuda", release)?;
    }
    anyhow::ensure!(
        built.is_file(),
        "fake libcuda not found at {}",
        built.display()
    );
    let copy = dir.join("libcuda.so.1");
    std::fs::copy(&built, &copy)?;
    Ok(copy)
}

/// The mock driver, a cgroup folder for the test, and the workloads started in it.
pub struct TraceEnv {
    driver: Option<MountedDriver>,
    _mount_dir: tempfile::TempDir,
    cgroup_root: PathBuf,
    test_cgroup: String,
    workloads: Vec<Workload>,
    driver_version: String,
}

impl TraceEnv {
    /// Mounts the mock (driver version `driver_version`) and makes the test's cgroup folder `/baton-test-<name>`.
    pub fn start(name: &str, driver_version: &str) -> anyhow::Result<Self> {
        let mount_dir = tempfile::Builder::new().prefix("baton-mockdev").tempdir()?;
        let driver = MockDriver::mount(
            MountOptions::new(mount_dir.path()).with_driver_version(driver_version.to_owned()),
        )?;
        let cgroup_root = cgroups::find_v2_root()?;
        let test_cgroup = format!("/baton-test-{name}-{}", std::process::id());
        cgroups::create(&cgroup_root, &test_cgroup)?;
        Ok(Self {
            driver: Some(driver),
            _mount_dir: mount_dir,
            cgroup_root,
            test_cgroup,
            workloads: Vec::new(),
            driver_version: driver_version.to_owned(),
        })
    }

    /// Where the mock's device files are.
    pub fn dev_dir(&self) -> &Path {
        self._mount_dir.path()
    }

    /// The prefix the tracer matches (`<dev_dir>/`).
    pub fn prefix(&self) -> String {
        format!("{}/", self.dev_dir().display())
    }

    /// The cgroup path (relative to the v2 root) of container `name` in this test.
    pub fn cgroup_rel(&self, name: &str) -> String {
        format!("{}/{name}", self.test_cgroup)
    }

    /// Creates container cgroup `name` and returns its id.
    pub fn make_cgroup(&self, name: &str) -> anyhow::Result<u64> {
        let path = cgroups::create(&self.cgroup_root, &self.cgroup_rel(name))?;
        Ok(std::fs::metadata(path).map(|m| std::os::unix::fs::MetadataExt::ino(&m))?)
    }

    /// A tracer watching nothing yet, matching the mock's device files, decoding with the mock's layouts.
    pub fn tracer(&self) -> anyhow::Result<Tracer> {
        Ok(Tracer::start(TracerConfig {
            watch_all: false,
            prefixes: vec![self.prefix()],
            cgroup_root: Some(self.cgroup_root.clone()),
            driver_version: baton_nvidia::layout::DriverVersion::parse(&self.driver_version),
            ..Default::default()
        })?)
    }

    /// Starts `baton-mock-cuda --hold` in container cgroup `name` (created if needed) with `vram_mib`.
    pub fn spawn_workload(
        &mut self,
        name: &str,
        vram_mib: u64,
        steps: u64,
    ) -> anyhow::Result<usize> {
        self.spawn_workload_with(name, vram_mib, steps, &[], &[])
    }

    /// As [`TraceEnv::spawn_workload`], with `extra` flags for `baton-mock-cuda`, run through `wrapper`
    /// when it is not empty (a command that ends by exec'ing the workload command line appended to it, e.g.
    /// `unshare -m ... sh -c '...; exec "$@"' sh`).
    pub fn spawn_workload_with(
        &mut self,
        name: &str,
        vram_mib: u64,
        steps: u64,
        extra: &[String],
        wrapper: &[String],
    ) -> anyhow::Result<usize> {
        self.make_cgroup(name)?;
        let bin = workspace_binary("baton-mock-nvidia", "baton-mock-cuda")?;
        let options = WorkloadOptions {
            steps,
            step_ms: 1,
            vram_mib,
            driver_version: self.driver_version.clone(),
            ..WorkloadOptions::new(self.dev_dir())
        };
        let mut args: Vec<String> = process::args(&options, true)
            .iter()
            .map(|a| a.to_string_lossy().into_owned())
            .chain(extra.iter().cloned())
            .collect();
        let cg = self
            .cgroup_root
            .join(self.cgroup_rel(name).trim_start_matches('/'));
        let program = match wrapper.split_first() {
            Some((first, rest)) => {
                args.insert(0, bin.display().to_string());
                args.splice(0..0, rest.iter().cloned());
                PathBuf::from(first)
            }
            None => bin.clone(),
        };
        let mut cmd = cgroups::command_in(&cg, &program, &args);
        let proc = WorkloadProcess::start_command(&mut cmd, &bin)?;
        self.workloads.push(Workload { proc: Some(proc) });
        Ok(self.workloads.len() - 1)
    }

    /// Workload `i`.
    pub fn workload(&mut self, i: usize) -> &mut Workload {
        &mut self.workloads[i]
    }
}

impl Drop for TraceEnv {
    fn drop(&mut self) {
        // Workloads still running are killed when dropped (WorkloadProcess), before the unmount.
        self.workloads.clear();
        if let Some(d) = self.driver.take() {
            let _ = d.unmount();
        }
        let top = self
            .cgroup_root
            .join(self.test_cgroup.trim_start_matches('/'));
        if let Ok(entries) = std::fs::read_dir(&top) {
            for e in entries.flatten().filter(|e| e.path().is_dir()) {
                let _ = cgroups::remove(&e.path());
            }
        }
        let _ = cgroups::remove(&top);
    }
}

/// A running `baton-mock-cuda` in a test cgroup.
pub struct Workload {
    proc: Option<WorkloadProcess>,
}

impl Workload {
    fn proc(&mut self) -> anyhow::Result<&mut WorkloadProcess> {
        self.proc
            .as_mut()
            .ok_or_else(|| anyhow::anyhow!("the workload already finished"))
    }

    /// Its pid (0 once finished).
    pub fn pid(&self) -> u32 {
        self.proc.as_ref().map_or(0, WorkloadProcess::pid)
    }

    /// Waits until it prints `line` (`phase holding`, `released`, `reacquired`).
    pub fn wait_line(&mut self, line: &str, timeout: Duration) -> anyhow::Result<()> {
        Ok(self.proc()?.wait_for_line(line, timeout)?)
    }

    /// Sends a signal (SIGUSR1 releases, SIGUSR2 re-acquires).
    pub fn signal(&mut self, sig: nix::sys::signal::Signal) -> anyhow::Result<()> {
        Ok(self.proc()?.signal(sig)?)
    }

    /// Ends `--hold` (closes stdin), waits for the exit, and returns its summary.
    pub fn finish(&mut self) -> anyhow::Result<Summary> {
        let proc = self
            .proc
            .take()
            .ok_or_else(|| anyhow::anyhow!("the workload already finished"))?;
        let done = proc.finish(Duration::from_secs(20))?;
        anyhow::ensure!(
            done.status.success(),
            "workload failed: {}: {:?}",
            done.status,
            done.lines
        );
        done.summary
            .ok_or_else(|| anyhow::anyhow!("the workload printed no summary: {:?}", done.lines))
    }
}

/// Reads events until `done(tracer)` holds or `timeout` passes; returns every event read.
pub async fn collect_until(
    tracer: &mut Tracer,
    timeout: Duration,
    mut done: impl FnMut(&Tracer, &[Event]) -> bool,
) -> anyhow::Result<Vec<Event>> {
    let mut all = Vec::new();
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if done(tracer, &all) {
            return Ok(all);
        }
        match tokio::time::timeout_at(deadline, tracer.next_events()).await {
            Ok(batch) => all.extend(batch?),
            Err(_) => {
                all.extend(tracer.drain_now()?);
                anyhow::ensure!(
                    done(tracer, &all),
                    "condition not reached in {timeout:?} ({} events read)",
                    all.len()
                );
                return Ok(all);
            }
        }
    }
}

/// The line `baton trace` prints on stderr once its probes are attached (tools/baton/src/trace/mod.rs, README).
pub const BATON_TRACE_READY: &str = "baton trace: probes attached, tracing";

/// A running `baton trace` that has printed its ready line; killed on drop unless [`BatonTrace::stop`] ran.
pub struct BatonTrace {
    child: Option<std::process::Child>,
    stderr: Option<std::thread::JoinHandle<String>>,
}

impl BatonTrace {
    /// Spawns `command` (a `baton trace` command line) and waits up to `timeout` for its ready line.
    pub fn start(mut command: std::process::Command, timeout: Duration) -> anyhow::Result<Self> {
        use std::io::BufRead;
        let mut child = command.stderr(std::process::Stdio::piped()).spawn()?;
        let pipe = child
            .stderr
            .take()
            .ok_or_else(|| anyhow::anyhow!("no stderr pipe"))?;
        let (ready, is_ready) = std::sync::mpsc::channel();
        let reader = std::thread::spawn(move || {
            let mut all = String::new();
            for line in std::io::BufReader::new(pipe).lines().map_while(Result::ok) {
                if line == BATON_TRACE_READY {
                    let _ = ready.send(());
                }
                all.push_str(&line);
                all.push('\n');
            }
            all
        });
        let mut trace = Self {
            child: Some(child),
            stderr: Some(reader),
        };
        if is_ready.recv_timeout(timeout).is_err() {
            let stderr = trace.kill_and_collect();
            anyhow::bail!(
                "baton trace printed no ready line within {timeout:?}; its stderr:\n{stderr}"
            );
        }
        Ok(trace)
    }

    /// Ends tracing as Ctrl-C would (SIGTERM: the final events and the summary are written) and returns its
    /// exit status and stderr.
    pub fn stop(mut self) -> anyhow::Result<(std::process::ExitStatus, String)> {
        let mut child = self
            .child
            .take()
            .ok_or_else(|| anyhow::anyhow!("already stopped"))?;
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        )?;
        let status = child.wait()?;
        let stderr = self.stderr.take().map(|r| r.join().unwrap_or_default());
        Ok((status, stderr.unwrap_or_default()))
    }

    fn kill_and_collect(&mut self) -> String {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        self.stderr
            .take()
            .map(|r| r.join().unwrap_or_default())
            .unwrap_or_default()
    }
}

impl Drop for BatonTrace {
    fn drop(&mut self) {
        self.kill_and_collect();
    }
}
