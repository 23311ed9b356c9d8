//! What the kit runs on: the node's driver (`/dev`, PyTorch programs, the node's `libcuda.so.1` and
//! `cuda-checkpoint`) or, with `--mock`, the FUSE mock driver mounted in a folder of its own with the mock
//! CUDA workload, the fake libcuda and the stand-in `cuda-checkpoint`.
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use baton_mock_nvidia::driver::{DEFAULT_DRIVER_VERSION, MockDriver, MountOptions, MountedDriver};
use tempfile::TempDir;

use super::Options;
use crate::skip::which;

/// The program the trace follows: CUDA init, 1 GiB allocated, a matmul, freed, exit.
const TRACED_PY: &str = include_str!("traced_program.py");
/// The program that holds GPU memory while it is parked and resumed; prints checksums of its weights.
const HOLDER_PY: &str = include_str!("holder_program.py");

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
    /// A scratch folder (the agent's socket, the scripts, logs).
    pub work: TempDir,
    python: String,
    mock_cuda: Option<PathBuf>,
    _mock: Option<MountedDriver>,
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
        if options.mock {
            let dev_dir = work.path().join("dev");
            std::fs::create_dir(&dev_dir)?;
            let mount = MockDriver::mount(MountOptions::new(&dev_dir))
                .context("mounting the mock driver (FUSE)")?;
            let libcuda = work.path().join("libcuda.so.1");
            std::fs::copy(bin("libbaton_fake_libcuda.so")?, &libcuda)?;
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
                gib: options.gib,
                python: options.python.clone(),
                mock_cuda: Some(bin("baton-mock-cuda")?),
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
            gib: options.gib,
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

    /// The checkpointed program: holds `gib` GiB until its stdin closes; the PyTorch one prints
    /// `checksum N` of its weights for each line it reads.
    pub fn holder_program(&self) -> Program {
        match &self.mock_cuda {
            Some(mock) => {
                let mib = (self.gib * 1024).to_string();
                Program {
                    path: mock.clone(),
                    args: self.mock_args(&["--steps", "1", "--vram-mib", &mib, "--hold"]),
                }
            }
            None => Program {
                path: self.python.clone().into(),
                args: vec![self.script("holder_program.py"), self.gib.to_string()],
            },
        }
    }

    /// The device file the agent counts a holder by.
    pub fn control_device(&self) -> PathBuf {
        self.dev_dir.join("nvidiactl")
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
