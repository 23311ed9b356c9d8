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

use crate::containerd::{self, CRI_NAMESPACE, Containerd};
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

static SERIAL: Mutex<()> = Mutex::new(());
static NODES: AtomicU32 = AtomicU32::new(0);

/// A containerd with its CRI plugin on, the Baton shim under test on its PATH, and the pause image imported.
pub struct CriNode {
    containerd: Containerd,
    client: CriClient,
    cgroup_parent: String,
    dir: tempfile::TempDir,
    _serial: MutexGuard<'static, ()>,
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

    fn try_start(handlers: impl FnOnce(&Path) -> Vec<Handler>) -> Result<Self, Error> {
        let serial = SERIAL
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let io = |what: &'static str, path: &Path| {
            let path = path.to_path_buf();
            move |source| Error::Io { what, path, source }
        };
        let dir = tempfile::Builder::new()
            .prefix("baton-it-cri-")
            .tempdir()
            .map_err(io("creating", Path::new("/tmp")))?;
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

    /// The runc root the handlers' `Root` names.
    pub fn runc_root(&self) -> PathBuf {
        runc_root_in(self.dir())
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
        for root in [self.runc_root(), cleanup::runc_root(CRI_NAMESPACE)] {
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
        cleanup::runc_delete_all(&self.runc_root());
        cleanup::runc_delete(&cleanup::runc_root(CRI_NAMESPACE), &ids);
        self.containerd.stop();
        cleanup::clean_namespace(&parent, &[], self.dir.path());
    }
}
