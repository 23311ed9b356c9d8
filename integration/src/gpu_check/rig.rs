//! What the kit runs on: the node's driver (`/dev`, PyTorch programs, the node's `libcuda.so.1` and
//! `cuda-checkpoint`) or, with `--mock`, the FUSE mock driver mounted in a folder of its own with the mock
//! CUDA workload, the fake libcuda and the stand-in `cuda-checkpoint`; and the sizes and bounds of the run
//! (`--quick` or not).
use std::{path::PathBuf, process::Command};

use anyhow::{Context, Result, bail};
use baton_mock_nvidia::driver::{DEFAULT_DRIVER_VERSION, MockDriver, MountOptions, MountedDriver};
use tempfile::TempDir;

use super::{Options, bounded, bounds::Bounds};
use crate::skip::which;

/// The program the trace follows: CUDA init, 1 GiB allocated, a matmul, freed, exit.
const TRACED_PY: &str = include_str!("traced_program.py");
/// The program that holds GPU memory while it is parked and resumed; prints checksums of its weights.
const HOLDER_PY: &str = include_str!("holder_program.py");
/// The seeds' loop's server: starts once the agent's gate opens, takes some GPU memory, says `serving`.
const SERVER_PY: &str = include_str!("server_program.py");

/// The mock workload's option to fork a worker after its set-up that keeps the inherited NVIDIA fds and
/// mappings (issue 28, item 4, being added by another change). The kit passes it once
/// `baton-mock-cuda --help` lists it; until then the mock holder is parked without a worker and the report
/// says so. Should the option get another name, change it here.
pub const MOCK_FORK_FLAG: &str = "--fork-worker";

/// The server's GPU memory, MiB.
const SERVER_MIB: u64 = 256;

/// A program and its arguments.
#[derive(Clone, Debug)]
pub struct Program {
    /// The executable.
    pub path: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
}

/// The machine the kit runs on, and the programs it uses there.
pub struct Rig {
    /// The FUSE mock instead of a GPU.
    pub mock: bool,
    /// The folder of the NVIDIA device files.
    pub dev_dir: PathBuf,
    /// The driver version (the host's, or the mock's).
    pub driver_version: String,
    /// The `baton` binary (agent and trace).
    pub baton: PathBuf,
    /// The shim binary, which is also the CUDA driver helper.
    pub shim: PathBuf,
    /// The CUDA driver library the helper loads.
    pub libcuda: PathBuf,
    /// The `cuda-checkpoint` program, if there is one.
    pub cuda_checkpoint: Option<PathBuf>,
    /// The output folder.
    pub out: PathBuf,
    /// GiB the checkpointed process holds.
    pub gib: u64,
    /// Park/resume cycles per way.
    pub cycles: u32,
    /// `--quick`.
    pub quick: bool,
    /// How long each wait may take.
    pub bounds: Bounds,
    /// `Ok`: the holder forks a worker after CUDA init; `Err`: why it does not.
    pub worker: Result<(), String>,
    /// `Ok`: the traced program, the holder and the server can run here; `Err`: why not (no PyTorch with
    /// CUDA), and the parts that need them are unavailable.
    pub cuda_programs: Result<(), String>,
    /// The Python interpreter with PyTorch.
    pub python: String,
    mock_cuda: Option<PathBuf>,
    /// Declared before `work`, so that it is unmounted before `work` (which holds its mount point) is removed:
    /// fields drop in this order, and a mounted folder cannot be removed (each run left its folder in /tmp).
    _mock: Option<MountedDriver>,
    /// A scratch folder (the agent's socket, the scripts, logs).
    pub work: TempDir,
}

impl Rig {
    /// Finds the binaries and, for `--mock`, mounts the mock driver.
    pub fn new(options: &Options) -> Result<Self> {
        if !nix::unistd::geteuid().is_root() {
            bail!("run tools/gpu-check as root: the agent loads eBPF programs and makes cgroups");
        }
        let bin = |name: &str| -> Result<PathBuf> {
            let p = options.bin_dir.join(name);
            if !p.is_file() {
                bail!(
                    "{} missing: build with `cargo build --release --workspace --bins` and carry target/release \
                     (or pass --bin-dir)",
                    p.display()
                );
            }
            Ok(p)
        };
        let work = tempfile::Builder::new()
            .prefix("baton-gpu-check")
            .tempdir()?;
        let (baton, shim) = (bin("baton")?, bin("containerd-shim-baton-v1")?);
        let bounds = Bounds::new(options.quick, options.time_limit);
        let cycles = options
            .cycles
            .unwrap_or(if options.quick { 1 } else { 3 })
            .max(1);
        let no_worker = || Err("--no-worker: parked without a forked worker".to_owned());
        if options.mock {
            let dev_dir = work.path().join("dev");
            std::fs::create_dir(&dev_dir)?;
            let mount = MockDriver::mount(MountOptions::new(&dev_dir))
                .context("mounting the mock driver (FUSE)")?;
            let libcuda = work.path().join("libcuda.so.1");
            std::fs::copy(bin("libbaton_fake_libcuda.so")?, &libcuda)?;
            let mock_cuda = bin("baton-mock-cuda")?;
            let worker = if options.no_worker {
                no_worker()
            } else {
                mock_forks(&mock_cuda, &bounds)
            };
            return Ok(Self {
                mock: true,
                dev_dir,
                driver_version: DEFAULT_DRIVER_VERSION.to_owned(),
                baton,
                shim,
                libcuda: options.libcuda.clone().unwrap_or(libcuda),
                cuda_checkpoint: Some(match &options.cuda_checkpoint {
                    Some(p) => p.clone(),
                    None => bin("baton-mock-cuda-checkpoint")?,
                }),
                out: options.out.clone(),
                gib: options.gib.unwrap_or(1),
                cycles,
                quick: options.quick,
                bounds,
                worker,
                cuda_programs: Ok(()),
                python: options.python.clone(),
                mock_cuda: Some(mock_cuda),
                work,
                _mock: Some(mount),
            });
        }
        let Some(version) = baton_nvidia::layout::host_driver_version() else {
            bail!(
                "no NVIDIA driver here (/proc/driver/nvidia/version is missing): run on a GPU machine, or \
                 pass --mock"
            );
        };
        std::fs::write(work.path().join("traced_program.py"), TRACED_PY)?;
        std::fs::write(work.path().join("holder_program.py"), HOLDER_PY)?;
        std::fs::write(work.path().join("server_program.py"), SERVER_PY)?;
        Ok(Self {
            mock: false,
            dev_dir: "/dev".into(),
            driver_version: version.to_string(),
            baton,
            shim,
            libcuda: options
                .libcuda
                .clone()
                .unwrap_or_else(|| "libcuda.so.1".into()),
            cuda_checkpoint: options
                .cuda_checkpoint
                .clone()
                .or_else(|| which("cuda-checkpoint")),
            out: options.out.clone(),
            gib: options.gib.unwrap_or(if options.quick { 1 } else { 8 }),
            cycles,
            quick: options.quick,
            bounds,
            worker: if options.no_worker {
                no_worker()
            } else {
                Ok(())
            },
            cuda_programs: Ok(()),
            python: options.python.clone(),
            mock_cuda: None,
            work,
            _mock: None,
        })
    }

    /// The traced program: PyTorch's CUDA init, 1 GiB allocated, a matmul, freed, exit; on the mock, the
    /// mock workload's set-up (1 GiB), three steps and teardown.
    pub fn traced_program(&self) -> Program {
        match &self.mock_cuda {
            Some(mock) => Program {
                path: mock.clone(),
                args: self.mock_args(&["--steps", "3", "--vram-mib", "1024"]),
            },
            None => Program {
                path: self.python.clone().into(),
                args: vec![self.script("traced_program.py")],
            },
        }
    }

    /// The checkpointed program: holds `gib` GiB (and forks a worker, see [`Rig::worker`]) until its stdin
    /// closes; the PyTorch one prints `checksum N` of its weights for each line it reads.
    pub fn holder_program(&self) -> Program {
        let fork = self.worker.is_ok();
        match &self.mock_cuda {
            Some(mock) => {
                let mib = (self.gib * 1024).to_string();
                let mut extra = vec!["--steps", "1", "--vram-mib", &mib, "--hold"];
                if fork {
                    extra.push(MOCK_FORK_FLAG);
                }
                Program {
                    path: mock.clone(),
                    args: self.mock_args(&extra),
                }
            }
            None => {
                let mut args = vec![self.script("holder_program.py"), self.gib.to_string()];
                if fork {
                    args.push("--fork-worker".to_owned());
                }
                Program {
                    path: self.python.clone().into(),
                    args,
                }
            }
        }
    }

    /// The seeds' loop's server: takes [`SERVER_MIB`] MiB and says so (`serving`; the mock's `phase
    /// holding`), then holds it until its stdin closes.
    pub fn server_program(&self) -> Program {
        let mib = SERVER_MIB.to_string();
        match &self.mock_cuda {
            Some(mock) => Program {
                path: mock.clone(),
                args: self.mock_args(&["--steps", "1", "--vram-mib", &mib, "--hold"]),
            },
            None => Program {
                path: self.python.clone().into(),
                args: vec![self.script("server_program.py"), mib],
            },
        }
    }

    /// The line a server prints once its GPU memory is taken.
    pub fn serving_line(&self) -> &'static str {
        if self.mock {
            "phase holding"
        } else {
            "serving"
        }
    }

    /// The NVIDIA device files a container with this machine's GPUs sees (`nvidia0`, `nvidiactl`,
    /// `nvidia-uvm`, ...): what the kit registers its processes with, and what the gate compares.
    pub fn device_files(&self) -> Vec<PathBuf> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(&self.dev_dir)
            .map(|dir| {
                dir.filter_map(Result::ok)
                    .filter(|e| e.file_name().to_string_lossy().starts_with("nvidia"))
                    .filter(|e| e.file_type().is_ok_and(|t| !t.is_dir()))
                    .map(|e| e.path())
                    .collect()
            })
            .unwrap_or_default();
        if files.is_empty() {
            files.push(self.dev_dir.join("nvidiactl"));
        }
        files.sort();
        files
    }

    /// The prefix of the device files the probes follow.
    pub fn trace_prefix(&self) -> String {
        format!("{}/nvidia", self.dev_dir.display())
    }

    fn mock_args(&self, extra: &[&str]) -> Vec<String> {
        let mut args = vec!["--dev-dir".to_owned(), self.dev_dir.display().to_string()];
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        args
    }

    fn script(&self, name: &str) -> String {
        self.work.path().join(name).display().to_string()
    }
}

/// Whether the mock workload can fork a worker ([`MOCK_FORK_FLAG`] in its `--help`); `Err` says why not.
fn mock_forks(mock_cuda: &std::path::Path, bounds: &Bounds) -> Result<(), String> {
    let help = bounded::run(Command::new(mock_cuda).arg("--help"), bounds.command)
        .and_then(|f| f.succeeded("baton-mock-cuda --help"))?;
    if help.stdout.contains(MOCK_FORK_FLAG) {
        return Ok(());
    }
    Err(format!(
        "the mock workload has no {MOCK_FORK_FLAG} option yet: parked without a forked worker"
    ))
}
