//! What the OCI hook tests drive without containerd: a node agent, the mock NVIDIA driver, a busybox rootfs
//! with the mock's holder, and runc run directly on bundles whose config.json carries `baton-hook` as OCI
//! hooks (or podman, given a hooks.d folder). Everything the runtimes left (containers, runc state, cgroups,
//! mounts) is removed on drop, also after a failed assertion.
use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use baton_mock_nvidia::driver::{MockDriver, MountOptions, MountedDriver};
use oci_spec::runtime::{HookBuilder, HooksBuilder, MountBuilder};
use serde_json::{Value, json};

use crate::{
    agent::{AgentConn, AgentProcess, AgentWatch, container_status, install_mock_binary},
    cleanup::{clean_namespace, runc_root},
    holder::HolderContainer,
    rootfs::{make_busybox_rootfs, spec},
    skip,
    trace_env::{missing_trace_prerequisite, workspace_binary},
};

/// The device files of the mock driver bind-mounted into each container's /dev.
pub const MOCK_DEVICES: [&str; 4] = ["nvidiactl", "nvidia0", "nvidia-uvm", "nvidia-uvm-tools"];

/// One `baton-hook` invocation in a bundle: its stage (`createRuntime`, `poststart`, `poststop`) and its
/// arguments after the global flags (`create-runtime`, `wait-gpu-free --timeout 20s`).
#[derive(Clone, Debug)]
pub struct HookUse {
    /// The OCI stage.
    pub stage: &'static str,
    /// The hook's subcommand and its flags.
    pub args: Vec<String>,
}

impl HookUse {
    /// `baton-hook ARGS` at `stage`.
    pub fn new(stage: &'static str, args: &[&str]) -> Self {
        Self {
            stage,
            args: args.iter().map(|a| (*a).to_owned()).collect(),
        }
    }

    /// The three hooks that register, confirm and unregister.
    pub fn lifecycle() -> Vec<Self> {
        vec![
            Self::new("createRuntime", &["create-runtime"]),
            Self::new("poststart", &["poststart"]),
            Self::new("poststop", &["poststop"]),
        ]
    }
}

/// An agent, the mock driver, a rootfs, and runc state of a namespace of the test's own.
pub struct HookRig {
    /// Where everything lives: the agent's socket and log, the rootfs, bundles, the hooks' log.
    pub dir: tempfile::TempDir,
    /// The namespace the hooks register containers under (and the runc root's and cgroups' name).
    pub namespace: String,
    /// The agent.
    pub agent: AgentProcess,
    /// The `baton-hook` binary.
    pub hook: PathBuf,
    /// The mock's device files.
    pub mock_dir: tempfile::TempDir,
    _mock: MountedDriver,
}

impl HookRig {
    /// Starts the rig, or `None` after reporting a skip (a missing prerequisite fails in strict runs).
    pub fn start(name: &str) -> Option<Self> {
        if let Some(reason) =
            missing_trace_prerequisite().or_else(crate::skip::missing_containerd_prerequisite)
        {
            skip::missing(&reason);
            return None;
        }
        Some(Self::try_start(name).unwrap_or_else(|e| panic!("starting the hook rig: {e:#}")))
    }

    fn try_start(name: &str) -> anyhow::Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("baton-it-hooks-")
            .tempdir()?;
        let namespace = format!("hooks-{name}-{}", std::process::id());
        let rootfs = dir.path().join("rootfs");
        make_busybox_rootfs(&rootfs)?;
        install_mock_binary(&rootfs, "baton-mock-holder")?;
        let mock_dir = tempfile::tempdir()?;
        let mock = MockDriver::mount(MountOptions::new(mock_dir.path()))?;
        let agent = AgentProcess::start(
            &dir.path().join("agent.sock"),
            &dir.path().join("agent.log"),
        )?;
        Ok(Self {
            hook: workspace_binary("baton-runc-hooks", "baton-hook")?,
            dir,
            namespace,
            agent,
            mock_dir,
            _mock: mock,
        })
    }

    /// The shared busybox rootfs (with `/bin/baton-mock-holder`).
    pub fn rootfs(&self) -> PathBuf {
        self.dir.path().join("rootfs")
    }

    /// The file every hook of this rig appends its line to (`--log`).
    pub fn hook_log(&self) -> PathBuf {
        self.dir.path().join("hooks.log")
    }

    /// The hooks' lines so far.
    pub fn hook_lines(&self) -> Vec<String> {
        std::fs::read_to_string(self.hook_log())
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// The flags every hook of this rig gets before its subcommand.
    pub fn hook_flags(&self) -> Vec<String> {
        vec![
            "--socket".into(),
            self.agent.socket().display().to_string(),
            "--namespace".into(),
            self.namespace.clone(),
            "--log".into(),
            self.hook_log().display().to_string(),
            // The first registration loads the probes: slow on a loaded machine with a debug agent.
            "--agent-timeout".into(),
            "60s".into(),
        ]
    }

    /// Writes the bundle of container `id` running `args`, seeing the mock devices at /dev, with `hooks`
    /// (given [`HookRig::hook_flags`]).
    pub fn bundle(
        &self,
        id: &str,
        args: &[&str],
        hooks: &[HookUse],
        annotations: &HashMap<String, String>,
    ) -> anyhow::Result<PathBuf> {
        self.bundle_with_flags(id, args, hooks, annotations, &self.hook_flags())
    }

    /// [`HookRig::bundle`] with `flags` before each hook's subcommand instead of the rig's.
    pub fn bundle_with_flags(
        &self,
        id: &str,
        args: &[&str],
        hooks: &[HookUse],
        annotations: &HashMap<String, String>,
        flags: &[String],
    ) -> anyhow::Result<PathBuf> {
        let bundle = self.dir.path().join("bundles").join(id);
        std::fs::create_dir_all(&bundle)?;
        let mut spec = spec(&self.namespace, id, args, Some(&self.rootfs()), annotations)?;
        let mut mounts = spec.mounts().clone().unwrap_or_default();
        for name in MOCK_DEVICES {
            mounts.push(
                MountBuilder::default()
                    .destination(format!("/dev/{name}"))
                    .typ("bind")
                    .source(self.mock_dir.path().join(name))
                    .options(vec!["rbind".to_owned(), "rw".to_owned()])
                    .build()?,
            );
        }
        spec.set_mounts(Some(mounts));
        let hook = |h: &HookUse| {
            let mut args = vec!["baton-hook".to_owned()];
            args.extend(flags.iter().cloned());
            args.extend(h.args.iter().cloned());
            HookBuilder::default()
                .path(&self.hook)
                .args(args)
                .timeout(120)
                .build()
        };
        let of = |stage: &str| -> Result<Vec<_>, _> {
            hooks
                .iter()
                .filter(|h| h.stage == stage)
                .map(hook)
                .collect()
        };
        spec.set_hooks(Some(
            HooksBuilder::default()
                .create_runtime(of("createRuntime")?)
                .poststart(of("poststart")?)
                .poststop(of("poststop")?)
                .build()?,
        ));
        spec.save(bundle.join("config.json"))?;
        Ok(bundle)
    }

    /// `runc --root <this namespace's runc root>`.
    pub fn runc(&self) -> Command {
        let mut c = Command::new("runc");
        c.arg("--root").arg(runc_root(&self.namespace));
        c
    }

    /// Runs the holder as container `id` with `hooks` in the foreground (`runc run`: its stdio passed
    /// through; runc deletes the container, poststop hooks included, when it exits), and waits until it
    /// answers.
    pub fn run_holder(&self, id: &str, hooks: &[HookUse]) -> anyhow::Result<HolderContainer> {
        let bundle = self.bundle(id, &["/bin/baton-mock-holder"], hooks, &HashMap::new())?;
        self.run_holder_in(id, &bundle)
    }

    /// [`HookRig::run_holder`] on a bundle written already (runc's stderr goes to `runc.stderr` in it).
    pub fn run_holder_in(&self, id: &str, bundle: &Path) -> anyhow::Result<HolderContainer> {
        let child = self
            .runc()
            .args(["run", "--bundle"])
            .arg(bundle)
            .arg(id)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(bundle.join("runc.stderr"))?)
            .spawn()?;
        HolderContainer::attach(id, child)
    }

    /// `runc state` of container `id`'s `status`, or `None` when runc does not know it.
    pub fn runc_status(&self, id: &str) -> Option<String> {
        let out = self.runc().args(["state", id]).output().ok()?;
        let state: Value = serde_json::from_slice(&out.stdout).ok()?;
        state["status"].as_str().map(str::to_owned)
    }

    /// The agent's events of this rig's namespace.
    pub fn watch(&self) -> AgentWatch {
        AgentConn::connect(self.agent.socket())
            .map_err(anyhow::Error::from)
            .and_then(|c| c.watch(json!({ "namespace": self.namespace })))
            .unwrap_or_else(|e| panic!("watching namespace {}: {e:#}", self.namespace))
    }

    /// The agent's status of container `id`, `None` when it does not watch it.
    pub fn status(&self, id: &str) -> Option<Value> {
        container_status(self.agent.socket(), id)
            .unwrap_or_else(|e| panic!("agent status of {id}: {e:#}"))
    }

    /// The agent's log so far (for failure messages).
    pub fn agent_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("agent.log")).unwrap_or_default()
    }
}

impl Drop for HookRig {
    fn drop(&mut self) {
        clean_namespace(&self.namespace, &[], self.dir.path());
    }
}

/// Runs `baton-hook ARGS` with `stdin` as its input; returns its exit status and stderr.
pub fn run_hook(hook: &Path, args: &[&str], stdin: &[u8]) -> anyhow::Result<(Option<i32>, String)> {
    use std::io::Write;
    let mut child = Command::new(hook)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()?;
    if let Some(mut input) = child.stdin.take() {
        input.write_all(stdin)?;
    }
    let out = child.wait_with_output()?;
    Ok((
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}
