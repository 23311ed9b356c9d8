//! Preemption test rig: containers running the mock CUDA workload (`baton-mock-cuda`, with its restore
//! thread) under the Baton shim, the cuda-checkpoint stand-in (`baton-mock-cuda-checkpoint`) linked as
//! `cuda-checkpoint` first on the shim's PATH (how a node without `cuda_checkpoint_path` finds it), and the
//! `baton` CLI against the test's agent.
use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use oci_spec::runtime::MountBuilder;
use serde_json::Value;

use crate::{
    agent::{device_mounts_at, install_mock_binary, read_lines},
    api,
    holder::GpuRig,
    rootfs,
    trace_env::workspace_binary,
};

/// How long a test waits for a line, a step or a state (a loaded CI machine included).
pub const WITHIN: Duration = Duration::from_secs(60);

/// A latency-critical server whose Start waits up to a minute at the GPU-free gate.
pub const SERVER: [(&str, &str); 2] = [
    ("baton.io/role", "latency-critical"),
    ("baton.io/wait-gpu-free", "1m"),
];
/// A co-runner the agent may park by itself for a server.
pub const PREEMPTIBLE: [(&str, &str); 2] = [
    ("baton.io/role", "co-runner"),
    ("baton.io/preemptible", "park"),
];

/// A [`GpuRig`] whose shim finds the cuda-checkpoint stand-in on its PATH.
pub struct CudaRig {
    /// containerd, the shim, the agent, the mock driver.
    pub gpu: GpuRig,
    workload: String,
}

/// How the mock trainer runs.
#[derive(Clone, Debug)]
pub struct Trainer {
    /// Video memory it allocates (MiB).
    pub vram_mib: u64,
    /// How fast its checkpoint and restore copy (MiB/s).
    pub copy_mib_per_s: u64,
    /// More flags (`--fail-at checkpoint`, `--exit-at-restore 7`, ...).
    pub extra: Vec<String>,
    /// How many workload processes run in the container (the first is the init's child when 2).
    pub processes: usize,
    /// Training steps (0: until stopped).
    pub steps: u64,
    /// Milliseconds per step.
    pub step_ms: u64,
    /// Each workload process forks a worker once set up (`--fork-worker`), as a DataLoader does: it keeps
    /// the inherited NVIDIA fds and mappings, has no CUDA state (cuda-checkpoint and the driver API answer
    /// `CUDA_ERROR_NOT_INITIALIZED` for it), and dies with its parent.
    pub fork_worker: bool,
    /// The container's memory limit (bytes), when it has one: a park's host copy is charged to it.
    pub memory_limit_bytes: Option<u64>,
    /// One more workload process starts once [`LATE_GO`] exists in the container's /tmp
    /// ([`CudaRig::start_late_process`]): a CUDA process that appears while a preemption runs.
    pub late_process: bool,
    /// The mock GPU the container sees, at its /dev/nvidia0 (where the workload opens it): 0 for the mock's
    /// nvidia0, 1 for its nvidia1 ([`CudaRig::start_with`] a mock of two GPUs). The gate and the ledger tell
    /// GPUs apart by the file, whatever its name in the container.
    pub gpu: u32,
}

/// The file in the container's /tmp whose creation starts a [`Trainer::late_process`].
pub const LATE_GO: &str = "baton-late-go";

impl Default for Trainer {
    fn default() -> Self {
        Self {
            vram_mib: 256,
            copy_mib_per_s: 2048,
            extra: Vec::new(),
            processes: 1,
            steps: 0,
            step_ms: 5,
            fork_worker: false,
            memory_limit_bytes: None,
            late_process: false,
            gpu: 0,
        }
    }
}

impl Trainer {
    /// The default trainer with a forked worker, as a PyTorch trainer with DataLoader workers runs (what the
    /// H200 recording shows a park must get past: /work/shared/gpu/580.159.04/README.md, point 5).
    pub fn with_worker() -> Self {
        Self {
            fork_worker: true,
            ..Self::default()
        }
    }
}

impl CudaRig {
    /// Starts the rig, or `None` after reporting a skip.
    pub fn start(name: &str) -> Option<Self> {
        Self::start_with(name, |o| o)
    }

    /// [`CudaRig::start`] with the mock driver's options changed by `options` (a smaller GPU, more GPUs).
    pub fn start_with(
        name: &str,
        options: impl FnOnce(
            baton_mock_nvidia::driver::MountOptions,
        ) -> baton_mock_nvidia::driver::MountOptions,
    ) -> Option<Self> {
        let gpu = GpuRig::start_with(name, options)?;
        let standin = workspace_binary("baton-mock-nvidia", "baton-mock-cuda-checkpoint")
            .unwrap_or_else(|e| panic!("the cuda-checkpoint stand-in: {e}"));
        let link = gpu.env.shim_dir().join("cuda-checkpoint");
        std::os::unix::fs::symlink(&standin, &link)
            .unwrap_or_else(|e| panic!("linking {}: {e}", link.display()));
        let workload = install_mock_binary(gpu.env.rootfs(), "baton-mock-cuda")
            .unwrap_or_else(|e| panic!("installing the workload: {e}"));
        Some(Self { gpu, workload })
    }

    /// The workload's command line for `t`.
    pub fn command(&self, t: &Trainer) -> Vec<String> {
        let one = format!(
            "{} --dev-dir /dev --steps {} --step-ms {} --vram-mib {} --copy-mib-per-s {}{} {}",
            self.workload,
            t.steps,
            t.step_ms,
            t.vram_mib,
            t.copy_mib_per_s,
            if t.fork_worker { " --fork-worker" } else { "" },
            t.extra.join(" ")
        );
        let mut script = if t.late_process {
            format!("(while [ ! -e /tmp/{LATE_GO} ]; do sleep 0.05; done; exec {one}) & ")
        } else {
            String::new()
        };
        for _ in 1..t.processes.max(1) {
            script.push_str(&format!("{one} & "));
        }
        script.push_str(&format!("exec {one}"));
        vec!["/bin/sh".into(), "-c".into(), script]
    }

    /// Runs `t` in container `id` with `ctr run` (its stdout comes back through ctr), with the mock devices
    /// and a private /tmp (where the workload's control socket goes).
    pub fn run(&self, id: &str, t: &Trainer, annotations: &[(&str, &str)]) -> Running {
        self.run_with(id, t, annotations, &[])
    }

    /// [`CudaRig::run`] with more `ctr run` flags (`--memory-limit BYTES`, ...).
    pub fn run_with(
        &self,
        id: &str,
        t: &Trainer,
        annotations: &[(&str, &str)],
        more: &[&str],
    ) -> Running {
        let mut flags = device_mounts_at(self.gpu.mock_dir.path(), "/dev");
        if t.gpu != 0 {
            let gpu = flags
                .iter_mut()
                .find(|f| f.contains("/nvidia0,"))
                .unwrap_or_else(|| panic!("no mount of nvidia0"));
            *gpu = gpu.replacen("/nvidia0,", &format!("/nvidia{},", t.gpu), 1);
        }
        flags.push("--mount".into());
        flags.push("type=tmpfs,src=tmpfs,dst=/tmp,options=rw".into());
        if let Some(bytes) = t.memory_limit_bytes {
            flags.extend(["--memory-limit".to_owned(), bytes.to_string()]);
        }
        flags.extend(more.iter().map(|f| f.to_string()));
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let command = self.command(t);
        let command: Vec<&str> = command.iter().map(String::as_str).collect();
        let args = self.gpu.env.run_args(id, annotations, &flags, &command);
        let mut child = self
            .gpu
            .env
            .containerd()
            .ctr_command()
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("ctr run {id}: {e}"));
        let out = child.stdout.take().unwrap_or_else(|| panic!("no stdout"));
        let mut r = Running {
            id: id.to_owned(),
            child: Some(child),
            lines: Some(read_lines(out)),
            file: None,
        };
        // Each workload process says so once its CUDA state is allocated (a park names the processes that
        // own some: one not set up yet would be left out).
        for _ in 0..t.processes.max(1) {
            r.wait_line("phase setup-done");
        }
        r
    }

    /// A preemptible trainer (`trainer`) runs, an idle server (`server`, with `server_annotations`, among them
    /// `baton.io/park-when-idle`) starts, is parked by the agent once idle, and the trainer gets the GPU back
    /// with its weights intact; each runs `t`. The trainer and the server.
    pub fn idle_server_parked_for_a_trainer(
        &self,
        t: &Trainer,
        server_annotations: &[(&str, &str)],
    ) -> (Running, Running) {
        let mut trainer = self.run("trainer", t, &PREEMPTIBLE);
        self.wait_held("trainer");
        let server = self.create("server", t, server_annotations);
        self.gpu
            .env
            .api()
            .and_then(|api| api.start("server", ""))
            .unwrap_or_else(|e| panic!("starting server: {e}"));
        self.wait_held("server");
        assert!(
            crate::agent::wait_until(WITHIN, || self.preemption("server")["state"] == "parked"),
            "the idle server was parked: {}",
            self.gpu.status("server")
        );
        let line = trainer.wait_line("restored checksum");
        assert!(line.ends_with("intact"), "{line}");
        (trainer, server)
    }

    /// Starts created container `id` through containerd's API, expecting it to fail: the error's text.
    pub fn start_error(&self, id: &str) -> String {
        match self.gpu.env.api().and_then(|api| api.start(id, "")) {
            Ok(pid) => panic!("{id} started (pid {pid}); it was to fail"),
            Err(e) => e.to_string(),
        }
    }

    /// Waits until the agent says container `id` holds the GPU; panics past [`WITHIN`].
    pub fn wait_held(&self, id: &str) {
        assert!(
            crate::agent::wait_until(WITHIN, || self.gpu.status(id)["gpu"] == "held"),
            "{id} holds the GPU: {}",
            self.gpu.status(id)
        );
    }

    /// The agent's preemption state of container `id` (`null` when it runs).
    pub fn preemption(&self, id: &str) -> Value {
        self.gpu.status(id)["preemption"].clone()
    }

    /// Starts the [`Trainer::late_process`] of running container `id` (its init's /tmp gets [`LATE_GO`]).
    pub fn start_late_process(&self, id: &str) {
        let init = self.gpu.status(id)["init_pid"]
            .as_u64()
            .unwrap_or_else(|| panic!("no init_pid of {id}"));
        let go = PathBuf::from(format!("/proc/{init}/root/tmp/{LATE_GO}"));
        std::fs::write(&go, b"").unwrap_or_else(|e| panic!("creating {}: {e}", go.display()));
    }

    /// Creates (not starts) container `id` running `t` through containerd's API, its stdout in a file.
    pub fn create(&self, id: &str, t: &Trainer, annotations: &[(&str, &str)]) -> Running {
        self.create_with(id, t, annotations, None)
    }

    /// [`CudaRig::create`] with runtime `options` (a TOML through [`api::runtime_options_toml`]).
    pub fn create_with(
        &self,
        id: &str,
        t: &Trainer,
        annotations: &[(&str, &str)],
        options: Option<prost_types::Any>,
    ) -> Running {
        self.create_from(id, t, annotations, options, None)
    }

    /// Container `id` created from a Task Checkpoint of `source` taken with `exit` (paused first, as
    /// containerd's Go client does; `source` stops), through containerd's content store, and started. The
    /// client's lease holds the checkpoint's blobs until the task is created: a garbage collection runs in
    /// between to show it.
    pub fn restore_from_checkpoint_of(
        &self,
        source: &str,
        id: &str,
        options: Option<prost_types::Any>,
    ) -> Running {
        let env = &self.gpu.env;
        env.ctr_ok(&["task", "pause", source])
            .unwrap_or_else(|e| panic!("pause {source}: {e}"));
        let api = env.api().unwrap_or_else(|e| panic!("api: {e}"));
        let checkpoint = api
            .checkpoint(source, true)
            .unwrap_or_else(|e| panic!("checkpoint {source}: {e}"));
        assert!(
            self.wait_status(source, "STOPPED"),
            "{source} did not stop at its checkpoint: {:?}",
            self.task_status(source)
        );
        env.collect_garbage()
            .unwrap_or_else(|e| panic!("garbage collection: {e}"));
        let restored = self.create_from(id, &Trainer::default(), &[], options, Some(checkpoint));
        drop(api);
        env.api()
            .and_then(|api| api.start(id, ""))
            .unwrap_or_else(|e| panic!("start {id}: {e}"));
        restored
    }

    /// [`CudaRig::create_with`] of a task restored (at Start) from CRIU checkpoint blob `checkpoint`.
    pub fn create_from(
        &self,
        id: &str,
        t: &Trainer,
        annotations: &[(&str, &str)],
        options: Option<prost_types::Any>,
        checkpoint: Option<containerd_client::types::Descriptor>,
    ) -> Running {
        let env = &self.gpu.env;
        let api = env.api().unwrap_or_else(|e| panic!("api: {e}"));
        let annotations = annotations
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let command = self.command(t);
        let command: Vec<&str> = command.iter().map(String::as_str).collect();
        let mut spec = rootfs::spec(env.namespace(), id, &command, None, &annotations)
            .unwrap_or_else(|e| panic!("spec: {e}"));
        if let Some(bytes) = t.memory_limit_bytes {
            let memory = oci_spec::runtime::LinuxMemoryBuilder::default()
                .limit(i64::try_from(bytes).unwrap_or(i64::MAX))
                .build()
                .unwrap_or_else(|e| panic!("memory limit: {e}"));
            let mut linux = spec.linux().clone().unwrap_or_default();
            let mut resources = linux.resources().clone().unwrap_or_default();
            resources.set_memory(Some(memory));
            linux.set_resources(Some(resources));
            spec.set_linux(Some(linux));
        }
        let mut mounts = spec.mounts().clone().unwrap_or_default();
        let gpu = format!("nvidia{}", t.gpu);
        for (name, at) in [
            ("nvidiactl", "nvidiactl"),
            (gpu.as_str(), "nvidia0"),
            ("nvidia-uvm", "nvidia-uvm"),
            ("nvidia-uvm-tools", "nvidia-uvm-tools"),
        ] {
            mounts.push(mount(
                "bind",
                &self.gpu.mock_dir.path().join(name),
                &format!("/dev/{at}"),
                &["rbind", "rw"],
            ));
        }
        mounts.push(mount("tmpfs", Path::new("tmpfs"), "/tmp", &["rw"]));
        spec.set_mounts(Some(mounts));
        let json = serde_json::to_vec(&spec).unwrap_or_else(|e| panic!("spec: {e}"));
        api.create_container(id, env.runtime(), json, options, Default::default())
            .unwrap_or_else(|e| panic!("create container {id}: {e}"));
        let file = env.scratch().join(format!("{id}.out"));
        let stdio = api::StdioPaths {
            stdout: format!("file://{}", file.display()),
            ..Default::default()
        };
        api.create_task_from(
            id,
            &stdio,
            vec![api::bind_rootfs(env.rootfs())],
            None,
            checkpoint,
        )
        .unwrap_or_else(|e| panic!("create task {id}: {e}"));
        Running {
            id: id.to_owned(),
            child: None,
            lines: None,
            file: Some(file),
        }
    }

    /// Runs `baton ARGS --socket <agent>`; its stdout, stderr and whether it succeeded.
    pub fn baton(&self, args: &[&str]) -> (String, String, bool) {
        let socket = self.gpu.env.containerd().agent_socket();
        let out =
            Command::new(workspace_binary("baton", "baton").unwrap_or_else(|e| panic!("{e}")))
                .args(args)
                .arg("--socket")
                .arg(&socket)
                .output()
                .unwrap_or_else(|e| panic!("baton {args:?}: {e}"));
        (
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
            out.status.success(),
        )
    }

    /// Runs `baton ARGS --json`, which must succeed; its steps and its outcome.
    pub fn baton_json(&self, args: &[&str]) -> (Vec<Value>, Value) {
        let mut all: Vec<&str> = args.to_vec();
        all.push("--json");
        let (out, err, ok) = self.baton(&all);
        assert!(ok, "baton {args:?} failed: {err}\n{out}");
        let mut values: Vec<Value> = out
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
            .collect();
        let outcome = values.pop().unwrap_or_else(|| panic!("no outcome: {out}"));
        (values, outcome)
    }

    /// The task's status as containerd shows it (`RUNNING`, `PAUSED`, ...).
    pub fn task_status(&self, id: &str) -> Option<String> {
        self.gpu.env.task_status(id)
    }

    /// Polls the task's status until it is `want`; whether it got there.
    pub fn wait_status(&self, id: &str, want: &str) -> bool {
        crate::agent::wait_until(WITHIN, || self.task_status(id).as_deref() == Some(want))
    }

    /// Waits until the agent shows container `id`'s GPU as `gpu` (`held`, ...), up to `within`.
    pub fn wait_gpu(&self, id: &str, gpu: &str, within: Duration) -> anyhow::Result<()> {
        if crate::agent::wait_until(within, || self.gpu.status(id)["gpu"] == gpu) {
            return Ok(());
        }
        anyhow::bail!(
            "{id} is not {gpu} within {within:?}: {}",
            self.gpu.status(id)
        )
    }

    /// The 000 seed's orchestrator's wait: polls the agent's view of container `id`'s GPU memory (and its
    /// NVIDIA files) every `every` until it holds none.
    pub fn poll_until_gpu_free(&self, id: &str, every: Duration) {
        loop {
            let s = self.gpu.status(id);
            if s["vram_bytes"] == 0 && s["nvidia_fds"] == 0 {
                return;
            }
            std::thread::sleep(every);
        }
    }

    /// Kills task `id` (SIGKILL), waits for it and deletes it and its container.
    pub fn remove(&self, id: &str) -> anyhow::Result<()> {
        let api = self.gpu.env.api()?;
        api.kill(id, "", nix::sys::signal::Signal::SIGKILL as u32, false)?;
        api.wait(id, "", WITHIN)?;
        api.delete_task(id)?;
        api.delete_container(id)?;
        Ok(())
    }

    /// The cuda-checkpoint stand-in's `--get-state` of `pid`.
    pub fn cuda_state(pid: u32) -> String {
        let standin = workspace_binary("baton-mock-nvidia", "baton-mock-cuda-checkpoint")
            .unwrap_or_else(|e| panic!("{e}"));
        let out = Command::new(standin)
            .args(["--get-state", "--pid", &pid.to_string()])
            .output()
            .unwrap_or_else(|e| panic!("{e}"));
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }
}

/// The two ways a shim parks, as node TOMLs: the `cuda-checkpoint` program (the driver API turned off), and the
/// driver API through `library` (the fake libcuda) with no program at all.
pub fn checkpoint_ways(library: &std::path::Path) -> [(&'static str, String); 2] {
    [
        ("program", "cuda_driver_path = \"\"\n".to_owned()),
        (
            "driver API",
            format!(
                "cuda_driver_path = \"{}\"\ncuda_checkpoint_path = \"/nonexistent/cuda-checkpoint\"\n",
                library.display()
            ),
        ),
    ]
}

/// The container id of a way of [`checkpoint_ways`] (`driver API` -> `driver-API`).
pub fn way_id(way: &str) -> String {
    way.replace(' ', "-")
}

/// Creates and starts trainer `t` once per way of `ways` (its id: [`way_id`]), and waits until each holds the
/// GPU.
pub fn start_per_way(
    rig: &CudaRig,
    ways: &[(&'static str, String)],
    t: &Trainer,
    within: Duration,
) -> anyhow::Result<Vec<Running>> {
    let mut running = Vec::new();
    for (name, toml) in ways {
        let id = way_id(name);
        let options = crate::api::runtime_options_toml(toml);
        running.push(rig.create_with(&id, t, &[], Some(options)));
        rig.gpu.env.api()?.start(&id, "")?;
        rig.wait_gpu(&id, "held", within)?;
    }
    Ok(running)
}

/// When step `phase` of container `id` happened in a `baton ... --json` run's `steps` (CLOCK_MONOTONIC ns; 0
/// when it is not there).
pub fn step_t_ns(steps: &[Value], phase: &str, id: &str) -> u64 {
    steps
        .iter()
        .find(|s| s["phase"] == phase && s["id"] == id)
        .and_then(|s| s["t_ns"].as_u64())
        .unwrap_or(0)
}

fn mount(
    typ: &str,
    source: &Path,
    destination: &str,
    options: &[&str],
) -> oci_spec::runtime::Mount {
    MountBuilder::default()
        .typ(typ)
        .source(source)
        .destination(PathBuf::from(destination))
        .options(options.iter().map(|o| o.to_string()).collect::<Vec<_>>())
        .build()
        .unwrap_or_else(|e| panic!("mount: {e}"))
}

/// A workload container: its output lines (through `ctr run`, or from its stdout file).
pub struct Running {
    id: String,
    child: Option<Child>,
    lines: Option<mpsc::Receiver<String>>,
    file: Option<PathBuf>,
}

impl Running {
    /// Its id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The file its stdout goes to (a container made by [`CudaRig::create`]).
    pub fn output_file(&self) -> Option<&Path> {
        self.file.as_deref()
    }

    /// Waits for a line starting with `prefix`; returns it.
    pub fn wait_line(&mut self, prefix: &str) -> String {
        self.try_wait_line(prefix, WITHIN).unwrap_or_else(|| {
            panic!(
                "{}: no line starting with {prefix:?} within {WITHIN:?}",
                self.id
            )
        })
    }

    /// [`Running::wait_line`] that gives up after `within`.
    pub fn try_wait_line(&mut self, prefix: &str, within: Duration) -> Option<String> {
        let deadline = Instant::now() + within;
        if let Some(file) = &self.file {
            while Instant::now() < deadline {
                let text = std::fs::read_to_string(file).unwrap_or_default();
                if let Some(l) = text.lines().find(|l| l.starts_with(prefix)) {
                    return Some(l.to_owned());
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            return None;
        }
        let lines = self.lines.as_ref()?;
        loop {
            let left = deadline.checked_duration_since(Instant::now())?;
            match lines.recv_timeout(left) {
                Ok(l) if l.starts_with(prefix) => return Some(l),
                Ok(_) => {}
                Err(_) => return None,
            }
        }
    }

    /// Waits for `ctr run` to return; its exit code.
    pub fn exit_code(&mut self) -> Option<i32> {
        let child = self.child.as_mut()?;
        let deadline = Instant::now() + WITHIN;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = child.try_wait() {
                return status.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            if matches!(c.try_wait(), Ok(None)) {
                let _ = c.kill();
            }
            let _ = c.wait();
        }
    }
}
