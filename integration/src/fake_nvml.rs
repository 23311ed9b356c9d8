//! The fake NVML library (`integration/fake-nvml`) for a test's agent: built, copied to
//! `libnvidia-ml.so.1` in the test's folder (given to `baton agent --nvml-library`), and the environment
//! that points it at the test's mock driver, slows each call and holds its answers while a file is there.
use std::{
    ffi::OsString,
    path::{Path, PathBuf},
    time::Duration,
};

use crate::{
    shim_binary::{build_package, target_dir},
    trace_env::workspace_binary,
};

/// The fake library in a test's folder, and how it answers.
pub struct FakeNvml {
    /// `<dir>/libnvidia-ml.so.1`.
    pub library: PathBuf,
    /// The mock driver's mount folder it answers from.
    pub mock: PathBuf,
    /// How long each call takes.
    pub delay: Duration,
    /// While this file is there, every device query waits.
    pub hold: PathBuf,
}

impl FakeNvml {
    /// Builds the fake (this binary's profile; cargo does nothing when it is up to date) and copies it into
    /// `dir`, answering from the mock mounted at `mock` after `delay` per call.
    pub fn install(dir: &Path, mock: &Path, delay: Duration) -> anyhow::Result<Self> {
        let release = !cfg!(debug_assertions);
        let profile = build_package("baton-fake-nvml", release)?;
        let built = target_dir().join(profile).join("libbaton_fake_nvml.so");
        anyhow::ensure!(
            built.is_file(),
            "fake NVML not found at {}",
            built.display()
        );
        let library = dir.join("libnvidia-ml.so.1");
        std::fs::copy(&built, &library)?;
        Ok(Self {
            library,
            mock: mock.to_owned(),
            delay,
            hold: dir.join("nvml-hold"),
        })
    }

    /// The environment the agent loading it needs (the names integration/fake-nvml reads).
    pub fn env(&self) -> Vec<(&'static str, OsString)> {
        vec![
            ("BATON_FAKE_NVML_MOCK", self.mock.clone().into_os_string()),
            (
                "BATON_FAKE_NVML_DELAY_US",
                self.delay.as_micros().to_string().into(),
            ),
            ("BATON_FAKE_NVML_HOLD", self.hold.clone().into_os_string()),
        ]
    }

    /// The node's agent on `socket`, with this library (`--nvml-library`, its environment) and `flags`,
    /// logging to `log`: started before any container, so that the shims find it rather than start one
    /// without NVML.
    pub fn start_agent(
        &self,
        socket: &Path,
        log: &Path,
        flags: &[&str],
    ) -> anyhow::Result<crate::agent::AgentProcess> {
        let baton = workspace_binary("baton", "baton")?;
        self.start_agent_program(&baton, socket, log, flags)
    }

    /// [`FakeNvml::start_agent`] with the `baton` binary at `baton` (a release build, for benchmarks).
    pub fn start_agent_program(
        &self,
        baton: &Path,
        socket: &Path,
        log: &Path,
        flags: &[&str],
    ) -> anyhow::Result<crate::agent::AgentProcess> {
        let library = self
            .library
            .to_str()
            .ok_or_else(|| anyhow::anyhow!("{} is not UTF-8", self.library.display()))?;
        let mut all = vec!["--nvml-library", library];
        all.extend_from_slice(flags);
        crate::agent::AgentProcess::start_program_with_env(baton, socket, log, &all, &self.env())
    }

    /// A CUDA rig whose mock GPU has `vram_mib` MiB and whose agent has this library (answering at once)
    /// and `flags`, started before any container; the folder holds the library, and the agent logs next to
    /// its socket (`agent.log`, shown when the test fails). `None` where the rig's prerequisites are missing outside CI (see
    /// [`crate::cuda::CudaRig::start_with`]).
    pub fn rig(
        name: &str,
        vram_mib: u64,
        flags: &[&str],
    ) -> Option<(
        crate::cuda::CudaRig,
        crate::agent::AgentProcess,
        tempfile::TempDir,
    )> {
        let rig = crate::cuda::CudaRig::start_with(name, |o| o.with_vram_mib(vram_mib))?;
        let dir = tempfile::tempdir().expect("a temporary folder");
        let nvml = Self::install(
            dir.path(),
            rig.gpu.mock_dir.path(),
            Duration::from_millis(1),
        )
        .expect("the fake NVML library builds");
        // The log next to the socket, which the rig's TestEnv shows when the test fails.
        let socket = rig.gpu.env.containerd().agent_socket();
        let agent = nvml
            .start_agent(&socket, &socket.with_file_name("agent.log"), flags)
            .expect("the agent starts");
        Some((rig, agent, dir))
    }

    /// NVML answers no device query until [`FakeNvml::answer`].
    pub fn hold(&self) -> std::io::Result<()> {
        std::fs::write(&self.hold, b"")
    }

    /// NVML answers again.
    pub fn answer(&self) -> std::io::Result<()> {
        std::fs::remove_file(&self.hold)
    }
}
