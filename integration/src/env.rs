//! [`TestEnv`]: one test's private containerd, busybox rootfs and namespace, cleaned up on drop (also after a
//! panic). Tests in one process run one at a time (a process-wide lock): the machines have 2 CPUs and the
//! tests measure timing-sensitive things such as OOM kills. `tools/dev test` runs each test in a process of
//! its own with cargo-nextest, two at a time (tools/nextest.toml): everything a `TestEnv` makes carries the
//! test process's pid in its name, so two of them never share anything.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use crate::containerd::{self, CgroupMode, Containerd, CtrOutput};
use crate::procs::{self, Found};
use crate::shim_binary::{self, BATON_RUNTIME, BATON_SHIM_NAME};
use crate::{api, cleanup, rootfs, skip};

/// Errors setting up a test environment (prerequisites present but something failed).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The temporary folder could not be made.
    #[error("creating a temporary folder: {0}")]
    TempDir(std::io::Error),
    /// The shim could not be built or found.
    #[error(transparent)]
    Shim(#[from] shim_binary::Error),
    /// The shim symlink could not be made.
    #[error("linking the shim into {path}: {source}")]
    Link {
        /// The link path.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The rootfs could not be made.
    #[error(transparent)]
    Rootfs(#[from] rootfs::Error),
    /// containerd failed.
    #[error(transparent)]
    Containerd(#[from] containerd::Error),
    /// The API failed.
    #[error(transparent)]
    Api(#[from] api::Error),
}

static SERIAL: Mutex<()> = Mutex::new(());

/// A private containerd with the runtime under test, a busybox rootfs, and a namespace of its own.
pub struct TestEnv {
    containerd: Containerd,
    rootfs: PathBuf,
    runtime: String,
    dir: tempfile::TempDir,
    _serial: MutexGuard<'static, ()>,
}

impl TestEnv {
    /// Sets up for test `test` with the runtime under test ([`shim_binary::runtime_under_test`]). When a
    /// prerequisite is missing it returns `None` after printing `skipped: <test>: <reason>`, or, in strict mode
    /// (tools/dev test, CI), panics with the reason ([`skip::missing`]); panics when set-up itself fails.
    pub fn start(test: &str) -> Option<Self> {
        if let Some(reason) = skip::missing_containerd_prerequisite() {
            skip::missing(&reason);
            return None;
        }
        match Self::with_runtime(test, &shim_binary::runtime_under_test()) {
            Ok(env) => Some(env),
            Err(error) => panic!("setting up {test}: {error}"),
        }
    }

    /// [`TestEnv::start`] with containerd, the shims and runc in the cgroup layout `cgroups`
    /// ([`CgroupMode::V2`]: cgroup v2 only, on this hybrid host).
    pub fn start_in(test: &str, cgroups: CgroupMode) -> Option<Self> {
        if let Some(reason) = skip::missing_containerd_prerequisite() {
            skip::missing(&reason);
            return None;
        }
        let runtime = shim_binary::runtime_under_test();
        let shim = if runtime == BATON_RUNTIME {
            match shim_binary::baton_shim_binary() {
                Ok(shim) => Some(shim),
                Err(error) => panic!("setting up {test}: {error}"),
            }
        } else {
            None
        };
        match Self::with_shim_in(test, &runtime, shim.as_deref(), cgroups) {
            Ok(env) => Some(env),
            Err(error) => panic!("setting up {test}: {error}"),
        }
    }

    /// Sets up for `test` with runtime type `runtime` (Baton's shim is built and put first on containerd's PATH).
    pub fn with_runtime(test: &str, runtime: &str) -> Result<Self, Error> {
        let shim = if runtime == BATON_RUNTIME {
            Some(shim_binary::baton_shim_binary()?)
        } else {
            None
        };
        Self::with_shim(test, runtime, shim.as_deref())
    }

    /// Sets up for `test` with runtime type `runtime`; `baton_shim` (when given) is linked first on containerd's
    /// PATH as `containerd-shim-baton-v1`.
    pub fn with_shim(test: &str, runtime: &str, baton_shim: Option<&Path>) -> Result<Self, Error> {
        Self::with_shim_in(test, runtime, baton_shim, CgroupMode::Host)
    }

    /// [`TestEnv::with_shim`] in the cgroup layout `cgroups`.
    pub fn with_shim_in(
        test: &str,
        runtime: &str,
        baton_shim: Option<&Path>,
        cgroups: CgroupMode,
    ) -> Result<Self, Error> {
        let serial = SERIAL
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let dir = tempfile::Builder::new()
            .prefix("baton-it-")
            .tempdir()
            .map_err(Error::TempDir)?;
        let shim_dir = dir.path().join("bin");
        std::fs::create_dir_all(&shim_dir).map_err(|source| Error::Link {
            path: shim_dir.clone(),
            source,
        })?;
        if let Some(binary) = baton_shim {
            let link = shim_dir.join(BATON_SHIM_NAME);
            std::os::unix::fs::symlink(binary, &link)
                .map_err(|source| Error::Link { path: link, source })?;
        }
        let rootfs = dir.path().join("rootfs");
        rootfs::make_busybox_rootfs(&rootfs)?;
        let namespace = namespace_for(test);
        let containerd = Containerd::start_in(dir.path(), &namespace, &shim_dir, cgroups)?;
        Ok(Self {
            containerd,
            rootfs,
            runtime: runtime.to_string(),
            dir,
            _serial: serial,
        })
    }

    /// The folder first on containerd's (and so the shim's) PATH.
    pub fn shim_dir(&self) -> PathBuf {
        self.dir.path().join("bin")
    }

    /// The containerd instance.
    pub fn containerd(&self) -> &Containerd {
        &self.containerd
    }

    /// The containerd instance, mutably (to restart it).
    pub fn containerd_mut(&mut self) -> &mut Containerd {
        &mut self.containerd
    }

    /// The busybox rootfs folder.
    pub fn rootfs(&self) -> &Path {
        &self.rootfs
    }

    /// The runtime type under test.
    pub fn runtime(&self) -> &str {
        &self.runtime
    }

    /// Whether the runtime under test is Baton's.
    pub fn is_baton(&self) -> bool {
        self.runtime == BATON_RUNTIME
    }

    /// The test's containerd namespace.
    pub fn namespace(&self) -> &str {
        self.containerd.namespace()
    }

    /// A scratch folder for the test's own files (FIFOs, logs).
    pub fn scratch(&self) -> PathBuf {
        let dir = self.dir.path().join("scratch");
        let _ = std::fs::create_dir_all(&dir);
        dir
    }

    /// `ctr` against this containerd and namespace.
    pub fn ctr(&self, args: &[&str]) -> CtrOutput {
        self.containerd.ctr(args)
    }

    /// Runs containerd's garbage collector now: a lease made and deleted with `--sync` (which collects before
    /// it returns), so that a test shows what survives a collection instead of racing the scheduled ones.
    pub fn collect_garbage(&self) -> Result<(), containerd::Error> {
        let lease = self.ctr_ok(&["leases", "create"])?;
        let id = lease
            .split_whitespace()
            .next()
            .unwrap_or_default()
            .to_owned();
        self.ctr_ok(&["leases", "delete", "--sync", &id]).map(drop)
    }

    /// `ctr` that must succeed; returns stdout.
    pub fn ctr_ok(&self, args: &[&str]) -> Result<String, containerd::Error> {
        self.containerd.ctr_ok(args)
    }

    /// `ctr run` arguments for container `id` on the busybox rootfs with the runtime under test, each
    /// annotation as `--annotation k=v`, then `flags`, the id and `command`.
    pub fn run_args(
        &self,
        id: &str,
        annotations: &[(&str, &str)],
        flags: &[&str],
        command: &[&str],
    ) -> Vec<String> {
        let mut args: Vec<String> = vec!["run".into(), "--runtime".into(), self.runtime.clone()];
        args.extend(self.cgroup_run_flags().iter().map(|flag| flag.to_string()));
        for (key, value) in annotations {
            args.push("--annotation".into());
            args.push(format!("{key}={value}"));
        }
        args.extend(flags.iter().map(|flag| flag.to_string()));
        args.push("--rootfs".into());
        args.push(self.rootfs.display().to_string());
        args.push(id.to_string());
        args.extend(command.iter().map(|arg| arg.to_string()));
        args
    }

    /// Flags `ctr run` needs in this cgroup layout: in [`CgroupMode::V2`] no cpu shares (ctr's default of 1024
    /// becomes `cpu.weight`, and the cpu controller stays bound to v1 on this host).
    pub fn cgroup_run_flags(&self) -> &'static [&'static str] {
        match self.containerd.cgroup_mode() {
            CgroupMode::Host => &[],
            CgroupMode::V2 => &["--cpu-shares", "0"],
        }
    }

    /// Runs `ctr run` (see [`TestEnv::run_args`]) and returns what it printed.
    pub fn run(
        &self,
        id: &str,
        annotations: &[(&str, &str)],
        flags: &[&str],
        command: &[&str],
    ) -> CtrOutput {
        let args = self.run_args(id, annotations, flags, command);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.ctr(&args)
    }

    /// `ctr run` flags that give the shim the node options TOML `toml` (Baton's node-only keys such as `ebpf`
    /// and `trace_prefix`, as the runtime's options table in containerd's config would), written as file
    /// `name` in the scratch folder: `ctr` passes its path as `runtimeoptions.v1.Options.ConfigPath`.
    pub fn node_options_flags(&self, name: &str, toml: &str) -> std::io::Result<Vec<String>> {
        let path = self.scratch().join(name);
        std::fs::write(&path, toml)?;
        Ok(vec![
            "--runtime-config-path".to_owned(),
            path.display().to_string(),
        ])
    }

    /// Starts container `id` detached with no stdio (`ctr run -d --null-io`); an error when ctr fails.
    pub fn run_detached(
        &self,
        id: &str,
        annotations: &[(&str, &str)],
        command: &[&str],
    ) -> Result<(), containerd::Error> {
        let args = self.run_args(id, annotations, &["-d", "--null-io"], command);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        self.containerd.ctr_ok(&args).map(|_| ())
    }

    /// A blocking API client for this containerd and namespace.
    pub fn api(&self) -> Result<api::Api, api::Error> {
        api::Api::connect(&self.containerd.socket(), self.namespace())
    }

    /// Creates container `id` through the API with the runtime under test, `annotations` and runtime `options`,
    /// and its task (no stdio) on a bind mount of the busybox rootfs that the shim mounts in the bundle, running
    /// `args`. Returns the task's pid; the task is created, not started.
    pub fn create_task_via_api(
        &self,
        api: &api::Api,
        id: &str,
        args: &[&str],
        annotations: &[(&str, &str)],
        options: Option<prost_types::Any>,
    ) -> Result<u32, Error> {
        let annotations = annotations
            .iter()
            .map(|(key, value)| (key.to_string(), value.to_string()))
            .collect();
        let spec = rootfs::spec(self.namespace(), id, args, None, &annotations)?;
        let json = serde_json::to_vec(&spec).map_err(|error| rootfs::Error::Spec {
            id: id.to_string(),
            detail: error.to_string(),
        })?;
        api.create_container(id, &self.runtime, json, options, Default::default())?;
        let rootfs = vec![api::bind_rootfs(&self.rootfs)];
        Ok(api.create_task(id, &api::StdioPaths::default(), rootfs)?)
    }

    /// The live shim processes of this containerd.
    pub fn shims(&self) -> Vec<Found> {
        procs::shims_of(&self.containerd.socket())
    }

    /// The status `ctr task ls` shows for `id` (`RUNNING`, `PAUSED`, `STOPPED`, ...), if listed.
    pub fn task_status(&self, id: &str) -> Option<String> {
        let listing = self.ctr(&["task", "ls"]).stdout;
        listing.lines().skip(1).find_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            (fields.first() == Some(&id))
                .then(|| fields.last().map(|status| status.to_string()))
                .flatten()
        })
    }

    /// The CRIU blob of checkpoint image `image` (the name `ctr task checkpoint` printed) in the content
    /// store, as a task's `checkpoint` descriptor for restoring from it.
    pub fn checkpoint_blob(&self, image: &str) -> containerd_client::types::Descriptor {
        let images = self.ctr(&["images", "ls"]).stdout;
        let index = images
            .lines()
            .find(|l| l.split_whitespace().next() == Some(image.trim()))
            .and_then(|l| l.split_whitespace().nth(2))
            .unwrap_or_else(|| panic!("no checkpoint image {image:?}: {images}"))
            .to_owned();
        let index: serde_json::Value =
            serde_json::from_str(&self.ctr(&["content", "get", &index]).stdout)
                .unwrap_or_else(|e| panic!("checkpoint index {index}: {e}"));
        let criu = index["manifests"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|m| {
                m["mediaType"]
                    .as_str()
                    .is_some_and(|t| t.ends_with("checkpoint.criu.tar"))
            })
            .unwrap_or_else(|| panic!("no CRIU blob in {index}"));
        containerd_client::types::Descriptor {
            media_type: criu["mediaType"].as_str().unwrap_or_default().to_owned(),
            digest: criu["digest"].as_str().unwrap_or_default().to_owned(),
            size: criu["size"].as_i64().unwrap_or_default(),
            ..Default::default()
        }
    }

    /// What container `id` left behind (processes, mounts, cgroups, runc state).
    pub fn leftovers(&self, id: &str) -> cleanup::Leftovers {
        cleanup::Leftovers::of(self.namespace(), id, &self.containerd.state_dir())
    }
}

impl Drop for TestEnv {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "containerd log ({}) ends with:\n{}",
                self.containerd.log_path().display(),
                self.containerd.log_tail(40)
            );
            // The agent decides what gap-fill, the gate and the controller do: its side of the story.
            if let Some(tail) = self.containerd.agent_log_tail(60) {
                eprintln!("agent log ends with:\n{tail}");
            }
        }
        let shims: Vec<i32> = self.shims().iter().map(|shim| shim.pid).collect();
        cleanup::clean_namespace(self.namespace(), &shims, self.dir.path());
        self.containerd.stop();
        cleanup::clean_namespace(self.namespace(), &[], self.dir.path());
    }
}

/// A containerd namespace for `test`, unique to this process: its words joined by `-`, then the pid.
fn namespace_for(test: &str) -> String {
    let words: Vec<String> = test
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|word| !word.is_empty())
        .map(str::to_ascii_lowercase)
        .collect();
    format!("{}-{}", words.join("-"), std::process::id())
}
