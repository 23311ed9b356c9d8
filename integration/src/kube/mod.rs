//! The kubelet's part, played at the CRI level on a [`CriNode`] started as a node
//! ([`CriNode::start_as_node`]): the project's Kubernetes manifests are read ([`manifest`]) and each pod is
//! run as a kubelet runs it (hostPath folders checked or made, RunPodSandbox with the RuntimeClass's handler,
//! the init containers one by one to completion, then the containers; a crashed container made again with
//! the next attempt number), so that the YAML is what the tests run. Also the node image's build
//! (tools/image/build) and import, as an operator loads an image onto a node with no registry.

pub mod manifest;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use k8s_cri::v1::{ContainerState, PodSandboxConfig};

use crate::containerd::NODE_FOLDERS;
use crate::cri::CriNode;
use manifest::{Pod, Substitutes};

/// The project's manifests (tools/kubernetes/).
pub fn manifests_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tools/kubernetes")
}

/// Errors of the kubelet's part.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A manifest could not be turned into CRI.
    #[error(transparent)]
    Manifest(#[from] manifest::Error),
    /// A CRI call failed.
    #[error(transparent)]
    Cri(#[from] crate::cri::client::Error),
    /// A hostPath volume of type `Directory` is missing, which the kubelet refuses too.
    #[error("pod {pod}: hostPath {path} (type Directory) does not exist on the node")]
    NoHostPath {
        /// The pod.
        pod: String,
        /// The path on the node.
        path: String,
    },
    /// An init container did not exit 0.
    #[error("pod {pod}: init container {name} exited {code}; its log:\n{log}")]
    InitFailed {
        /// The pod.
        pod: String,
        /// The init container.
        name: String,
        /// Its exit code.
        code: i32,
        /// Its log.
        log: String,
    },
    /// Waiting for a container's state timed out.
    #[error("container {id}: {what} not within {within:?}")]
    Timeout {
        /// The container.
        id: String,
        /// What was waited for.
        what: String,
        /// How long.
        within: Duration,
    },
    /// The pod's log folder could not be made.
    #[error("cannot create {path}: {source}")]
    LogDir {
        /// The folder.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The image could not be built or imported.
    #[error("the node image: {0}")]
    Image(String),
}

/// A pod the kubelet runs: its sandbox and its containers' ids (the latest attempt of each).
#[derive(Debug, Clone)]
pub struct RunningPod {
    /// The pod.
    pub pod: Pod,
    /// The sandbox's id.
    pub sandbox: String,
    /// The sandbox's config.
    pub config: PodSandboxConfig,
    /// Container name -> (id, attempt).
    pub containers: HashMap<String, (String, u32)>,
    /// Where its logs go.
    pub log_dir: PathBuf,
}

impl RunningPod {
    /// The id of container `name` (its latest attempt).
    pub fn id(&self, name: &str) -> &str {
        self.containers.get(name).map_or("", |(id, _)| id.as_str())
    }

    /// The log of container `name`'s latest attempt (CRI's log format: time, stream, tag, text).
    pub fn log(&self, name: &str) -> String {
        let attempt = self.containers.get(name).map_or(0, |(_, a)| *a);
        std::fs::read_to_string(self.log_dir.join(name).join(format!("{attempt}.log")))
            .unwrap_or_default()
    }
}

/// The kubelet of a node, with the test's substitutes for the manifests' placeholders. Its calls take the
/// node, which the test restarts containerd of in between.
pub struct Kubelet {
    subs: Substitutes,
}

/// How long a container may take to reach a state.
const WITHIN: Duration = Duration::from_secs(60);

impl Kubelet {
    /// A kubelet with substitutes `subs`.
    pub fn new(subs: Substitutes) -> Self {
        Self { subs }
    }

    /// Where path `path` of the node is, seen from this test: under the host root for the node's own
    /// folders ([`NODE_FOLDERS`]), else the machine's.
    pub fn node_path(node: &CriNode, path: &str) -> PathBuf {
        let rel = path.trim_start_matches('/');
        if NODE_FOLDERS
            .iter()
            .any(|f| rel == *f || rel.starts_with(&format!("{f}/")))
        {
            node.host_root().join(rel)
        } else {
            PathBuf::from(path)
        }
    }

    /// Runs `pod` with RuntimeClasses `classes`: its hostPath folders, its sandbox, each init container to
    /// completion (exit 0, or an error with its log), then its containers, started.
    pub fn run(
        &self,
        node: &CriNode,
        pod: &Pod,
        classes: &[serde_json::Value],
    ) -> Result<RunningPod, Error> {
        for (path, kind) in pod.host_paths() {
            let on_node = Self::node_path(node, &path);
            match kind.as_str() {
                "DirectoryOrCreate" => {
                    let _ = std::fs::create_dir_all(&on_node);
                }
                "Directory" if !on_node.is_dir() => {
                    return Err(Error::NoHostPath {
                        pod: pod.name().to_owned(),
                        path,
                    });
                }
                _ => {}
            }
        }
        let handler = pod.runtime_handler(classes)?;
        let log_dir = node
            .dir()
            .join("pods")
            .join(format!("{}_{}", pod.namespace(), pod.name()));
        std::fs::create_dir_all(&log_dir).map_err(|source| Error::LogDir {
            path: log_dir.clone(),
            source,
        })?;
        let config = pod.sandbox_config(0, &log_dir, node.cgroup_parent());
        let sandbox = node.client().run_pod_sandbox(&config, &handler)?;
        let mut running = RunningPod {
            pod: pod.clone(),
            sandbox,
            config,
            containers: HashMap::new(),
            log_dir,
        };
        for name in pod.container_names("initContainers") {
            let id = self.start(node, &mut running, &name, 0)?;
            let code = self.wait_exited(node, &id)?;
            if code != 0 {
                return Err(Error::InitFailed {
                    pod: pod.name().to_owned(),
                    log: running.log(&name),
                    name,
                    code,
                });
            }
        }
        for name in pod.container_names("containers") {
            self.start(node, &mut running, &name, 0)?;
        }
        Ok(running)
    }

    /// Creates and starts attempt `attempt` of container `name` of `running`; returns its id.
    fn start(
        &self,
        node: &CriNode,
        running: &mut RunningPod,
        name: &str,
        attempt: u32,
    ) -> Result<String, Error> {
        let config = running.pod.container_config(name, attempt, &self.subs)?;
        let cri = node.client();
        let id = cri.create_container(&running.sandbox, &config, &running.config)?;
        running
            .containers
            .insert(name.to_owned(), (id.clone(), attempt));
        cri.start_container(&id)?;
        Ok(id)
    }

    /// What the kubelet does when container `name` of `running` has exited (a crash: `restartPolicy:
    /// Always`): the next attempt is created and started in the same sandbox, and the exited one removed.
    pub fn restart_crashed(
        &self,
        node: &CriNode,
        running: &mut RunningPod,
        name: &str,
    ) -> Result<String, Error> {
        let (old, attempt) = running.containers.get(name).cloned().unwrap_or_default();
        self.wait_exited(node, &old)?;
        let id = self.start(node, running, name, attempt + 1)?;
        node.client().remove_container(&old)?;
        Ok(id)
    }

    /// Stops and removes pod `running` (what deleting it does).
    pub fn delete(&self, node: &CriNode, running: &RunningPod) -> Result<(), Error> {
        let cri = node.client();
        cri.stop_pod_sandbox(&running.sandbox)?;
        cri.remove_pod_sandbox(&running.sandbox)?;
        Ok(())
    }

    /// Waits until container `id` has exited; its exit code.
    pub fn wait_exited(&self, node: &CriNode, id: &str) -> Result<i32, Error> {
        let deadline = Instant::now() + WITHIN;
        loop {
            let status = node.client().container_status(id)?.status;
            if let Some(s) =
                status.filter(|s| s.state == i32::from(ContainerState::ContainerExited))
            {
                return Ok(s.exit_code);
            }
            if Instant::now() >= deadline {
                return Err(Error::Timeout {
                    id: id.to_owned(),
                    what: "exited".into(),
                    within: WITHIN,
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Builds the node image once per test process with tools/image/build from the binaries the tests use
/// (the debug builds beside the shim under test: the release build would only take longer here); returns
/// (its name, its docker-archive).
pub fn node_image() -> Result<(String, PathBuf), Error> {
    static BUILT: OnceLock<Result<(String, PathBuf), String>> = OnceLock::new();
    BUILT
        .get_or_init(build_node_image)
        .clone()
        .map_err(Error::Image)
}

fn build_node_image() -> Result<(String, PathBuf), String> {
    let shim = crate::shim_binary::baton_shim_binary().map_err(|e| e.to_string())?;
    let bin_dir = shim.parent().unwrap_or(Path::new("."));
    let archive = crate::shim_binary::target_dir().join("baton-node-image.tar");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tools/image/build");
    let out = Command::new(&script)
        .arg("--bin-dir")
        .arg(bin_dir)
        .arg("--archive")
        .arg(&archive)
        .output()
        .map_err(|e| format!("cannot run {}: {e}", script.display()))?;
    if !out.status.success() {
        return Err(format!(
            "{} failed: {}",
            script.display(),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let name = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    Ok((name, archive))
}

/// Imports the node image into `node`'s `k8s.io` namespace (`ctr images import`), as an operator loads
/// it onto a node with no registry; returns its name.
pub fn import_node_image(node: &CriNode) -> Result<String, Error> {
    let (name, archive) = node_image()?;
    node.containerd()
        .ctr_ok(&["images", "import", &archive.display().to_string()])
        .map_err(|e| Error::Image(e.to_string()))?;
    node.client().wait_image(&name, WITHIN)?;
    Ok(name)
}
