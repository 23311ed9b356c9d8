//! A Kubernetes node without a kubelet, driven at the CRI level (what a RuntimeClass drives): a private
//! containerd with its CRI plugin on and Baton runtime handlers, images built from local folders and imported
//! with `ctr -n k8s.io images import` (no registry), and a CRI client ([`client::CriClient`]). Pods get
//! host networking (no CNI) and a cgroup parent of their own, and their runc state lives under a private runc
//! root (the handlers' `Root`), so that dropping the node removes everything they left, also after a panic.

pub mod client;
pub mod image;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use k8s_cri::v1::{
    LinuxPodSandboxConfig, LinuxSandboxSecurityContext, NamespaceMode, NamespaceOption,
    PodSandboxConfig, PodSandboxMetadata,
};

use crate::containerd::{self, CRI_NAMESPACE, CgroupMode, Containerd};
use crate::procs::{self, Found};
use crate::shim_binary::{self, BATON_RUNTIME, BATON_SHIM_NAME};
use crate::{cleanup, rootfs, skip};
use client::CriClient;
use image::ImageSpec;

/// The pause image every pod's sandbox runs (`sandbox_image`): busybox sleeping.
pub const PAUSE_IMAGE: &str = "baton.invalid/pause:it";
/// How long containerd's CRI service and an imported image may take to be ready.
const READY_WITHIN: Duration = Duration::from_secs(60);

/// Errors setting up a CRI node.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file or folder could not be made.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The path.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The shim could not be built or found.
    #[error(transparent)]
    Shim(#[from] shim_binary::Error),
    /// A rootfs could not be made.
    #[error(transparent)]
    Rootfs(#[from] rootfs::Error),
    /// An image archive could not be written.
    #[error(transparent)]
    Image(#[from] image::Error),
    /// containerd failed (or `ctr images import`).
    #[error(transparent)]
    Containerd(#[from] containerd::Error),
    /// The CRI service failed.
    #[error(transparent)]
    Cri(#[from] client::Error),
    /// The CRI service never answered (its plugin failed to load, say).
    #[error("{error}; containerd's log about the CRI plugin:\n{log}")]
    CriPlugin {
        /// What the client saw.
        error: client::Error,
        /// containerd's log lines naming the CRI plugins.
        log: String,
    },
}

/// A runtime handler of the node: `runtime_type = "io.containerd.baton.v1"` and the `options` TOML.
#[derive(Debug, Clone)]
pub struct Handler {
    /// The handler's name (a RuntimeClass's `handler`).
    pub name: String,
    /// The lines of its options table (Baton's keys and runc's): `key = value` lines only, no tables (on
    /// containerd 2.x they are written into the options table itself).
    pub options: String,
}

/// The handler's options file, which the options table names through `ConfigPath` (containerd 1.x).
fn options_file(dir: &Path, handler: &str) -> PathBuf {
    dir.join("handlers").join(format!("{handler}.toml"))
}

/// The runc root of the node's pods, which the tests' handlers set as `Root` (`<dir>/runc`).
pub fn runc_root_in(dir: &Path) -> PathBuf {
    dir.join("runc")
}

/// The CRI plugin's section of the config for a containerd of major version `major` (format 2 for 1.x, format
/// 3 for 2.x, see [`containerd::major_version`]): the pause image, no AppArmor, OOM score adjustments no lower
/// than containerd's own (lowering it is refused on these machines), CNI folders of its own (empty: pods use
/// the host's network), a stream server on a free port, and one runtime per handler with Baton's annotations
/// passed through; the first handler is the default runtime.
///
/// How Baton's options reach the shim differs, and each way is tested on its version: containerd 1.6 hands a
/// non-runc runtime only `TypeUrl` and `ConfigPath` of the options table, so there the table names a file
/// holding them; containerd 2.x sends the whole table as `config_body` (TOML), so there the table holds them.
fn cri_section(dir: &Path, handlers: &[Handler], major: u32) -> String {
    if major >= 2 {
        cri_section_v3(dir, handlers)
    } else {
        cri_section_v2(dir, handlers)
    }
}

/// [`cri_section`] for containerd 1.x (config format 2, one `io.containerd.grpc.v1.cri` plugin; the
/// handlers' table replaces containerd's default one, which holds runc).
fn cri_section_v2(dir: &Path, handlers: &[Handler]) -> String {
    let cri = r#"plugins."io.containerd.grpc.v1.cri""#;
    let d = dir.display();
    let default = handlers.first().map_or("runc", |h| h.name.as_str());
    let mut text = format!(
        r#"[{cri}]
  sandbox_image = "{PAUSE_IMAGE}"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  disable_apparmor = true
  restrict_oom_score_adj = true
  [{cri}.cni]
    bin_dir = "{d}/cni/bin"
    conf_dir = "{d}/cni/net.d"
  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "{default}"
"#
    );
    for handler in handlers {
        let name = &handler.name;
        let file = options_file(dir, name);
        text.push_str(&format!(
            r#"  [{cri}.containerd.runtimes.{name}]
    runtime_type = "{BATON_RUNTIME}"
    pod_annotations = ["baton.io/*"]
    container_annotations = ["baton.io/*"]
    [{cri}.containerd.runtimes.{name}.options]
      ConfigPath = "{}"
"#,
            file.display()
        ));
    }
    text
}

/// [`cri_section`] for containerd 2.x (config format 3: CRI is split into the images plugin, the runtime
/// plugin and the gRPC one, which keeps the stream server; the handlers join containerd's runc runtime).
/// The handlers' options are the options table itself, which CRI sends as `config_body`.
fn cri_section_v3(dir: &Path, handlers: &[Handler]) -> String {
    let images = "plugins.'io.containerd.cri.v1.images'";
    let runtime = "plugins.'io.containerd.cri.v1.runtime'";
    let d = dir.display();
    let default = handlers.first().map_or("runc", |h| h.name.as_str());
    let mut text = format!(
        r#"[{images}]
  snapshotter = "overlayfs"
  [{images}.pinned_images]
    sandbox = "{PAUSE_IMAGE}"
[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
[{runtime}]
  disable_apparmor = true
  restrict_oom_score_adj = true
  [{runtime}.cni]
    bin_dirs = ["{d}/cni/bin"]
    conf_dir = "{d}/cni/net.d"
  [{runtime}.containerd]
    default_runtime_name = "{default}"
"#
    );
    for handler in handlers {
        let name = &handler.name;
        text.push_str(&format!(
            r#"  [{runtime}.containerd.runtimes.{name}]
    runtime_type = "{BATON_RUNTIME}"
    pod_annotations = ["baton.io/*"]
    container_annotations = ["baton.io/*"]
    [{runtime}.containerd.runtimes.{name}.options]
"#
        ));
        for line in handler.options.lines() {
            text.push_str(&format!("      {line}\n"));
        }
    }
    text
}

/// The node's private folder (`/tmp/baton-it-cri-*`).
fn new_dir() -> Result<tempfile::TempDir, Error> {
    tempfile::Builder::new()
        .prefix("baton-it-cri-")
        .tempdir()
        .map_err(|source| Error::Io {
            what: "creating",
            path: PathBuf::from("/tmp"),
            source,
        })
}

static SERIAL: Mutex<()> = Mutex::new(());
static NODES: AtomicU32 = AtomicU32::new(0);

/// A containerd with its CRI plugin on, the Baton shim under test on its PATH, and the pause image imported.
pub struct CriNode {
    containerd: Containerd,
    client: CriClient,
    cgroup_parent: String,
    runc_root: PathBuf,
    dir: tempfile::TempDir,
    _serial: MutexGuard<'static, ()>,
}

/// The runc entry of a node's config as `containerd config default` writes it (the default runtime; the
/// node's own pods and the DaemonSet's run under it), for containerd of major version `major`, with runc
/// `binary` when given (its `BinaryName`, which `baton install` copies into Baton's runtime).
fn runc_entry(major: u32, binary: Option<&Path>) -> String {
    let table = if major >= 2 {
        "plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc"
    } else {
        r#"plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc"#
    };
    let binary = binary.map_or_else(String::new, |b| {
        format!("    BinaryName = \"{}\"\n", b.display())
    });
    format!(
        "  [{table}]\n    runtime_type = \"io.containerd.runc.v2\"\n  [{table}.options]\n{binary}    SystemdCgroup = false\n"
    )
}

/// runc for a node in [`CgroupMode::V2`] on this machine, whose v2 hierarchy has no cpu or memory
/// controller (they stay bound to v1, machine.md): CRI sets CPU shares on every sandbox (2) and the
/// kubelet's limits on containers, which runc could not write there (no cpu.weight), so this drops the
/// bundle's `linux.resources.cpu` and `.memory` before `runc create` and runs runc. A node with those
/// controllers in its v2 hierarchy needs nothing of the kind.
const RUNC_WITHOUT_V1_CONTROLLERS: &str = r#"#!/bin/sh
bundle=
prev=
for arg in "$@"; do
  case "$prev" in --bundle|-b) bundle=$arg ;; esac
  prev=$arg
done
if [ -n "$bundle" ] && [ -f "$bundle/config.json" ]; then
  python3 - "$bundle/config.json" <<'PY' || exit 1
import json, sys
path = sys.argv[1]
with open(path) as f:
    spec = json.load(f)
resources = spec.get("linux", {}).get("resources", {})
resources.pop("cpu", None)
resources.pop("memory", None)
with open(path, "w") as f:
    json.dump(spec, f)
PY
fi
exec runc "$@"
"#;

/// Writes [`RUNC_WITHOUT_V1_CONTROLLERS`] into `dir`; its path.
fn write_runc_wrapper(dir: &Path) -> Result<PathBuf, Error> {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join("runc-v2-node");
    std::fs::write(&path, RUNC_WITHOUT_V1_CONTROLLERS)
        .and_then(|()| std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)))
        .map_err(|source| Error::Io {
            what: "writing",
            path: path.clone(),
            source,
        })?;
    Ok(path)
}

impl CriNode {
    /// Starts a node for `test` with the runtime handlers `handlers` returns (given the node's private
    /// folder, for the paths their options name). A missing prerequisite skips loudly, or fails in strict mode
    /// ([`skip::missing`]); a failing set-up panics.
    pub fn start(test: &str, handlers: impl FnOnce(&Path) -> Vec<Handler>) -> Option<Self> {
        if let Some(reason) = skip::missing_containerd_prerequisite() {
            skip::missing(&reason);
            return None;
        }
        match Self::try_start(handlers) {
            Ok(node) => Some(node),
            Err(error) => panic!("setting up {test}: {error}"),
        }
    }

    /// Starts a Kubernetes node for `test` ([`Containerd::start_as_node`]): its host root is `<dir>/host`
    /// ([`CriNode::host_root`]), its config `<host root>/etc/containerd/config.toml` with the CRI plugin and
    /// runc only (as a node's before `baton install`), runc's state under `<host root>/run/containerd/runc`,
    /// shims found in `<host root>/usr/local/bin`, in the cgroup layout `cgroups`.
    pub fn start_as_node(test: &str, cgroups: CgroupMode) -> Option<Self> {
        if let Some(reason) = skip::missing_containerd_prerequisite() {
            skip::missing(&reason);
            return None;
        }
        let serial = SERIAL
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let started = new_dir().and_then(|dir| {
            let host = dir.path().join("host");
            let major = containerd::major_version()?;
            let runc = match cgroups {
                CgroupMode::V2 => Some(write_runc_wrapper(dir.path())?),
                CgroupMode::Host => None,
            };
            let cri = format!(
                "{}{}",
                cri_section(dir.path(), &[], major),
                runc_entry(major, runc.as_deref())
            );
            let containerd = Containerd::start_as_node(dir.path(), &host, cgroups, &cri)?;
            let runc_root = host.join("run/containerd/runc");
            Self::finish_start(serial, dir, containerd, runc_root)
        });
        match started {
            Ok(node) => Some(node),
            Err(error) => panic!("setting up {test}: {error}"),
        }
    }

    /// The node's host root ([`CriNode::start_as_node`]): what the node's processes see at `/X` for the
    /// folders [`containerd::NODE_FOLDERS`] is `<host root>/X`.
    pub fn host_root(&self) -> PathBuf {
        self.dir().join("host")
    }

    fn try_start(handlers: impl FnOnce(&Path) -> Vec<Handler>) -> Result<Self, Error> {
        let serial = SERIAL
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let io = |what: &'static str, path: &Path| {
            let path = path.to_path_buf();
            move |source| Error::Io { what, path, source }
        };
        let dir = new_dir()?;
        let shim_dir = dir.path().join("bin");
        for sub in [shim_dir.clone(), dir.path().join("handlers")] {
            std::fs::create_dir_all(&sub).map_err(io("creating", &sub))?;
        }
        let link = shim_dir.join(BATON_SHIM_NAME);
        std::os::unix::fs::symlink(shim_binary::baton_shim_binary()?, &link)
            .map_err(io("linking the shim at", &link))?;
        let handlers = handlers(dir.path());
        for handler in &handlers {
            let file = options_file(dir.path(), &handler.name);
            std::fs::write(&file, &handler.options).map_err(io("writing", &file))?;
        }
        let cri = cri_section(dir.path(), &handlers, containerd::major_version()?);
        let containerd = Containerd::start_with_cri(dir.path(), &shim_dir, &cri)?;
        let runc_root = runc_root_in(dir.path());
        Self::finish_start(serial, dir, containerd, runc_root)
    }

    /// Waits for CRI, then imports the pause image.
    fn finish_start(
        serial: MutexGuard<'static, ()>,
        dir: tempfile::TempDir,
        containerd: Containerd,
        runc_root: PathBuf,
    ) -> Result<Self, Error> {
        let client = CriClient::connect(&containerd.socket())?;
        if let Err(error) = client.wait_ready(READY_WITHIN) {
            return Err(Error::CriPlugin {
                error,
                log: containerd
                    .log_tail(400)
                    .lines()
                    .filter(|line| {
                        // 1.x's one CRI plugin; 2.x's images, runtime and gRPC plugins.
                        line.contains("io.containerd.grpc.v1.cri")
                            || line.contains("io.containerd.cri.v1.")
                    })
                    .collect::<Vec<_>>()
                    .join("\n"),
            });
        }
        let cgroup_parent = format!(
            "/baton-it-cri-{}-{}",
            std::process::id(),
            NODES.fetch_add(1, Ordering::Relaxed)
        );
        let node = Self {
            containerd,
            client,
            cgroup_parent,
            runc_root,
            dir,
            _serial: serial,
        };
        let pause = node.dir().join("images").join("pause");
        rootfs::make_busybox_rootfs(&pause)?;
        node.import_image(&ImageSpec {
            name: PAUSE_IMAGE,
            rootfs: &pause,
            entrypoint: &["/bin/sleep", "2147483647"],
        })?;
        Ok(node)
    }

    /// Writes `image` as an archive, imports it with `ctr -n k8s.io images import` and waits until CRI
    /// knows it.
    pub fn import_image(&self, image: &ImageSpec<'_>) -> Result<(), Error> {
        let archive = self
            .dir()
            .join("images")
            .join(format!("{}.tar", image.name.replace(['/', ':'], "_")));
        image::write_docker_archive(image, &archive)?;
        let archive = archive.display().to_string();
        self.containerd.ctr_ok(&["images", "import", &archive])?;
        self.client.wait_image(image.name, READY_WITHIN)?;
        Ok(())
    }

    /// Restarts containerd (stop, start on the same root, state and config) and waits until CRI answers;
    /// shims and containers keep running.
    pub fn restart_containerd(&mut self) -> Result<(), Error> {
        self.containerd.restart()?;
        self.client.wait_ready(READY_WITHIN)?;
        Ok(())
    }

    /// Imports image `name`: busybox and the mock CUDA workload with its libraries, sleeping (the GPU pods'
    /// image); returns the workload's path in it.
    pub fn import_gpu_image(&self, name: &str) -> anyhow::Result<String> {
        let rootfs_dir = self.dir().join("images").join("gpu");
        rootfs::make_busybox_rootfs(&rootfs_dir)?;
        let workload = crate::agent::install_workload(&rootfs_dir)?;
        self.import_image(&ImageSpec {
            name,
            rootfs: &rootfs_dir,
            entrypoint: &["/bin/sleep", "2147483647"],
        })?;
        Ok(workload)
    }

    /// The CRI client.
    pub fn client(&self) -> &CriClient {
        &self.client
    }

    /// The containerd instance (namespace `k8s.io`).
    pub fn containerd(&self) -> &Containerd {
        &self.containerd
    }

    /// The node's private folder.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The runc root the handlers' `Root` names (for a node, runc's default root in the node:
    /// `<host root>/run/containerd/runc`; containers are in its `k8s.io` folder).
    pub fn runc_root(&self) -> PathBuf {
        self.runc_root.clone()
    }

    /// The cgroup parent of the node's pods (`/baton-it-cri-<pid>-<n>`).
    pub fn cgroup_parent(&self) -> &str {
        &self.cgroup_parent
    }

    /// The live shims of this containerd.
    pub fn shims(&self) -> Vec<Found> {
        procs::shims_of(&self.containerd.socket())
    }

    /// A pod's config: `name` in namespace `default`, `annotations`, host network (no CNI needed; so no
    /// hostname of its own, as the kubelet sends it), the
    /// node's cgroup parent, logs in the node's folder.
    pub fn sandbox_config(&self, name: &str, annotations: &[(&str, &str)]) -> PodSandboxConfig {
        let network = NamespaceOption {
            network: NamespaceMode::Node.into(),
            ..Default::default()
        };
        PodSandboxConfig {
            metadata: Some(PodSandboxMetadata {
                name: name.to_string(),
                uid: format!("uid-{name}"),
                namespace: "default".to_string(),
                attempt: 0,
            }),
            log_directory: self.dir().join("logs").join(name).display().to_string(),
            annotations: pairs(annotations),
            linux: Some(LinuxPodSandboxConfig {
                cgroup_parent: self.cgroup_parent.clone(),
                security_context: Some(LinuxSandboxSecurityContext {
                    namespace_options: Some(network),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// Containers runc knows in the node's runc root, and in runc's default root for `k8s.io`.
    pub fn runc_containers(&self) -> Vec<String> {
        let mut ids = Vec::new();
        let roots = [
            self.runc_root(),
            self.runc_root().join(CRI_NAMESPACE),
            cleanup::runc_root(CRI_NAMESPACE),
        ];
        for root in roots {
            let listed = std::process::Command::new("runc")
                .arg("--root")
                .arg(&root)
                .args(["list", "-q"])
                .output();
            if let Ok(out) = listed {
                ids.extend(
                    String::from_utf8_lossy(&out.stdout)
                        .lines()
                        .filter(|line| !line.is_empty())
                        .map(str::to_owned),
                );
            }
        }
        ids
    }

    /// The pods' cgroup folders still there (below the cgroup parent, in every hierarchy).
    pub fn cgroups_left(&self) -> Vec<PathBuf> {
        let parent = self.cgroup_parent.trim_start_matches('/');
        cleanup::cgroup_roots()
            .into_iter()
            .filter_map(|root| std::fs::read_dir(root.join(parent)).ok())
            .flat_map(|dir| dir.filter_map(Result::ok).map(|entry| entry.path()))
            .filter(|path| path.is_dir())
            .collect()
    }

    /// Mount points left in the node's folder (rootfs snapshots, sandbox /dev/shm).
    pub fn mounts_left(&self) -> Vec<PathBuf> {
        cleanup::mounts_under(self.dir())
    }
}

fn pairs(items: &[(&str, &str)]) -> HashMap<String, String> {
    items
        .iter()
        .map(|(key, value)| (key.to_string(), value.to_string()))
        .collect()
}

impl Drop for CriNode {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "containerd log ({}) ends with:\n{}",
                self.containerd.log_path().display(),
                self.containerd.log_tail(60)
            );
        }
        let ids: Vec<String> = self
            .containerd
            .ctr(&["containers", "ls", "-q"])
            .stdout
            .lines()
            .map(str::to_owned)
            .collect();
        let shims: Vec<i32> = self.shims().iter().map(|shim| shim.pid).collect();
        let parent = self.cgroup_parent.trim_start_matches('/').to_string();
        cleanup::clean_namespace(&parent, &shims, self.dir.path());
        cleanup::runc_delete_all(&self.runc_root().join(CRI_NAMESPACE));
        cleanup::runc_delete_all(&self.runc_root());
        cleanup::runc_delete(&cleanup::runc_root(CRI_NAMESPACE), &ids);
        self.containerd.stop();
        cleanup::clean_namespace(&parent, &[], self.dir.path());
    }
}
