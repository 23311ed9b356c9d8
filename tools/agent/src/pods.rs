//! Exemption by Kubernetes identity: the node's GPU daemons that run as pods (dcgm-exporter, the device plugin,
//! the GPU operator's validators) keep the GPU's device files open, and where the node has no NVML to say they
//! hold no GPU memory, each of them kept every gate shut. `baton agent --exempt-pod NAMESPACE/NAME` names them
//! as an operator knows them: by the pod's namespace and name (`NAME*` for the pods of a DaemonSet, `*` for a
//! whole namespace).
//!
//! A process's pod is read from what containerd wrote, never from what the container says: its cgroup's last
//! component names a containerd container (`<id>` with cgroupfs, `cri-containerd-<id>.scope` with systemd);
//! that container's bundle under containerd's state directory (`<state>/io.containerd.runtime.v2.task/<ns>/<id>`,
//! read through `/proc/1/root` where the agent does not see it itself, so that the DaemonSet's agent needs no
//! mount) has the pod's names in its OCI
//! spec's annotations (CRI's `io.kubernetes.cri.sandbox-namespace` and `sandbox-name`) and its init's pid in
//! `init.pid`. The process counts as that pod's only when its cgroup is exactly the cgroup of that init: a
//! tenant that made a cgroup below its own named after an exempt pod's container is not that pod.
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use baton_agent_api::KubernetesRef;

/// containerd's state directory when the agent is not told another (`--containerd-state`).
pub const DEFAULT_CONTAINERD_STATE: &str = "/run/containerd";

/// One `--exempt-pod`: a namespace and a pod name, the name ending in `*` for every pod it begins.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodPattern {
    namespace: String,
    name: String,
}

impl std::str::FromStr for PodPattern {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (namespace, name) = s
            .split_once('/')
            .filter(|(ns, name)| !ns.is_empty() && !name.is_empty() && !name.contains('/'))
            .ok_or_else(|| {
                format!(
                    "{s:?} is not NAMESPACE/NAME (NAME may end in `*`: gpu-operator/nvidia-dcgm-exporter-*, \
                     or be `*` for the whole namespace)"
                )
            })?;
        if name.trim_end_matches('*').contains('*') || namespace.contains('*') {
            return Err(format!(
                "{s:?}: `*` may only end the pod's name (gpu-operator/nvidia-dcgm-exporter-*)"
            ));
        }
        Ok(Self {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        })
    }
}

impl PodPattern {
    /// Whether pod `k` is one this pattern names.
    pub fn matches(&self, k: &KubernetesRef) -> bool {
        if k.namespace.as_deref() != Some(self.namespace.as_str()) {
            return false;
        }
        match self.name.strip_suffix('*') {
            Some(prefix) => k.pod.starts_with(prefix),
            None => k.pod == self.name,
        }
    }
}

/// The pods whose processes never count as GPU holders, and where containerd keeps its bundles.
#[derive(Clone, Debug, Default)]
pub struct ExemptPods {
    /// The patterns (`--exempt-pod`).
    pub patterns: Vec<PodPattern>,
    /// containerd's state directory as the node sees it (`--containerd-state`).
    pub containerd_state: PathBuf,
}

impl ExemptPods {
    /// Whether the process in cgroup `cgroup` (v2 path) is a container of an exempt pod; `cache` keeps the
    /// answer per cgroup for one look at the node. Blocks (reads the bundle): run it on the blocking pool.
    pub fn exempts(&self, cgroup: &str, cache: &mut HashMap<String, bool>) -> bool {
        if self.patterns.is_empty() {
            return false;
        }
        if let Some(&known) = cache.get(cgroup) {
            return known;
        }
        let exempt = self
            .pod_of(cgroup)
            .is_some_and(|k| self.patterns.iter().any(|p| p.matches(&k)));
        cache.insert(cgroup.to_owned(), exempt);
        exempt
    }

    /// The pod of the containerd container whose init's cgroup is `cgroup`, if any.
    fn pod_of(&self, cgroup: &str) -> Option<KubernetesRef> {
        let id = container_id_of(cgroup)?;
        let bundle = self.bundle_of(id)?;
        let init: u32 = std::fs::read_to_string(bundle.join("init.pid"))
            .ok()?
            .trim()
            .parse()
            .ok()?;
        if baton_tracer::cgroups::v2_path_of_pid(init).as_deref() != Some(cgroup) {
            return None;
        }
        let spec: serde_json::Value =
            serde_json::from_slice(&std::fs::read(bundle.join("config.json")).ok()?).ok()?;
        let annotations: HashMap<String, String> =
            serde_json::from_value(spec.get("annotations")?.clone()).ok()?;
        KubernetesRef::from_annotations(&annotations)
    }

    /// Container `id`'s bundle, in whichever containerd namespace it is: under the state directory as the
    /// agent sees it (an agent on the node), else through the node's init (the DaemonSet's agent, which sees
    /// the node's processes but not its /run).
    fn bundle_of(&self, id: &str) -> Option<PathBuf> {
        let relative = self
            .containerd_state
            .strip_prefix("/")
            .unwrap_or(&self.containerd_state);
        let tasks = [
            self.containerd_state.clone(),
            Path::new("/proc/1/root").join(relative),
        ]
        .into_iter()
        .map(|state| state.join("io.containerd.runtime.v2.task"))
        .find(|tasks| tasks.is_dir())?;
        std::fs::read_dir(&tasks)
            .ok()?
            .flatten()
            .map(|ns| ns.path().join(id))
            .find(|b| b.join("config.json").is_file())
    }
}

/// The containerd container id a cgroup's last component names (`<id>`, `cri-containerd-<id>.scope`), when it
/// is one containerd accepts (letters, digits, `.`, `_`, `-`, beginning with a letter or digit, at most 76).
fn container_id_of(cgroup: &str) -> Option<&str> {
    let last = cgroup.rsplit('/').next()?;
    let id = last
        .strip_prefix("cri-containerd-")
        .and_then(|s| s.strip_suffix(".scope"))
        .unwrap_or(last);
    let valid = id.len() <= 76
        && id.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    valid.then_some(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(namespace: &str, name: &str) -> KubernetesRef {
        KubernetesRef {
            namespace: Some(namespace.into()),
            pod: name.into(),
            container: None,
        }
    }

    #[test]
    fn a_pattern_names_a_pod_the_pods_of_a_daemonset_or_a_namespace() {
        let exact: PodPattern = "kube-system/dcgm".parse().unwrap();
        assert!(exact.matches(&pod("kube-system", "dcgm")));
        assert!(!exact.matches(&pod("kube-system", "dcgm-x")));
        assert!(!exact.matches(&pod("default", "dcgm")));
        let ds: PodPattern = "gpu-operator/nvidia-dcgm-exporter-*".parse().unwrap();
        assert!(ds.matches(&pod("gpu-operator", "nvidia-dcgm-exporter-7x2kq")));
        assert!(!ds.matches(&pod("gpu-operator", "nvidia-device-plugin-abc")));
        let all: PodPattern = "gpu-operator/*".parse().unwrap();
        assert!(all.matches(&pod("gpu-operator", "anything")));
        assert!(!all.matches(&KubernetesRef {
            namespace: None,
            pod: "anything".into(),
            container: None,
        }));
        for bad in ["dcgm", "/dcgm", "ns/", "ns/a/b", "ns/*x", "n*/x", "ns/a*b*"] {
            let e = bad.parse::<PodPattern>().unwrap_err();
            assert!(
                e.contains("NAMESPACE/NAME") || e.contains("`*`"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn a_container_id_is_the_cgroups_last_component_in_either_driver() {
        let id = "5e2ae491f579c7236ddb656ca3d4d412e6043fe6d6a2782057dbd40765bcdc6c";
        assert_eq!(container_id_of(&format!("/kubepods/pod1/{id}")), Some(id));
        assert_eq!(
            container_id_of(&format!(
                "/kubepods.slice/kubepods-pod1.slice/cri-containerd-{id}.scope"
            )),
            Some(id)
        );
        assert_eq!(container_id_of("/default/dcgm"), Some("dcgm"));
        assert_eq!(container_id_of("/x/.."), None);
        assert_eq!(container_id_of("/x/"), None);
        assert_eq!(container_id_of(&format!("/x/{id}{id}")), None);
    }

    #[test]
    fn no_pattern_exempts_nothing_and_reads_nothing() {
        let none = ExemptPods::default();
        let mut cache = HashMap::new();
        assert!(!none.exempts("/anything", &mut cache));
        assert!(cache.is_empty());
    }
}
