//! Kubernetes manifests turned into the CRI requests a kubelet makes for them: a pod spec (a Pod's, or a
//! DaemonSet's template) becomes a `PodSandboxConfig` (its namespaces, hostPID, labels, annotations, the
//! RuntimeClass's handler) and each container a `ContainerConfig` (command and args, env, the
//! securityContext's user, capabilities, no-new-privileges and read-only root, hostPath volumes as mounts,
//! the memory limit and CPU request). A field this translation does not know fails the test by name, so that
//! a manifest change the test cannot follow is seen, not dropped.
//!
//! What a kubelet does that this does not: no CNI here, so every pod shares the node's network (as
//! `hostNetwork: true` pods do); a device plugin's devices are given by the test ([`Substitutes::devices`]);
//! images and the workload's command are the test's ([`Substitutes`]), since the manifests' are placeholders
//! for the user's own.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use k8s_cri::v1::{
    Capability, ContainerConfig, ContainerMetadata, ImageSpec, Int64Value, KeyValue,
    LinuxContainerConfig, LinuxContainerResources, LinuxContainerSecurityContext,
    LinuxPodSandboxConfig, LinuxSandboxSecurityContext, Mount, NamespaceMode, NamespaceOption,
    PodSandboxConfig, PodSandboxMetadata, SecurityProfile, security_profile::ProfileType,
};
use serde_json::Value;

/// Errors reading a manifest.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The file is not YAML.
    #[error("{path} is not YAML: {source}")]
    Yaml {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: serde_yaml_ng::Error,
    },
    /// No object of that kind and name.
    #[error("{path} has no {kind} named {name}")]
    Missing {
        /// The file.
        path: PathBuf,
        /// The object's kind.
        kind: String,
        /// Its name.
        name: String,
    },
    /// A field this translation does not turn into CRI.
    #[error(
        "{what}: not translated into CRI by this test (teach integration/src/kube/manifest.rs)"
    )]
    Unsupported {
        /// The field.
        what: String,
    },
}

/// The objects of a multi-document YAML file.
pub fn documents(path: &Path) -> Result<Vec<Value>, Error> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Read {
        path: path.into(),
        source,
    })?;
    let mut out = Vec::new();
    for doc in serde_yaml_ng::Deserializer::from_str(&text) {
        let value: Value = serde::Deserialize::deserialize(doc).map_err(|source| Error::Yaml {
            path: path.into(),
            source,
        })?;
        if !value.is_null() {
            out.push(value);
        }
    }
    Ok(out)
}

/// The object of `kind` named `name` in the file at `path`.
pub fn object(path: &Path, kind: &str, name: &str) -> Result<Value, Error> {
    documents(path)?
        .into_iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .ok_or_else(|| Error::Missing {
            path: path.into(),
            kind: kind.into(),
            name: name.into(),
        })
}

/// A pod as the kubelet sees it: its metadata (name, namespace, uid, labels, annotations) and spec.
#[derive(Debug, Clone)]
pub struct Pod {
    /// `metadata`.
    pub metadata: Value,
    /// `spec`.
    pub spec: Value,
}

impl Pod {
    /// A Pod object.
    pub fn from_pod(object: &Value) -> Self {
        Self {
            metadata: object["metadata"].clone(),
            spec: object["spec"].clone(),
        }
    }

    /// The pod a DaemonSet controller makes for a node: the template, named `<daemonset>-<node>`, in the
    /// DaemonSet's namespace.
    pub fn from_daemonset(object: &Value, node: &str) -> Self {
        let template = &object["spec"]["template"];
        let mut metadata = template["metadata"].clone();
        let name = format!("{}-{node}", str_of(&object["metadata"]["name"]));
        metadata["name"] = Value::String(name);
        metadata["namespace"] = object["metadata"]["namespace"].clone();
        Self {
            metadata,
            spec: template["spec"].clone(),
        }
    }

    /// `metadata.name`.
    pub fn name(&self) -> &str {
        str_of(&self.metadata["name"])
    }

    /// `metadata.namespace` (`default` when absent).
    pub fn namespace(&self) -> &str {
        self.metadata["namespace"].as_str().unwrap_or("default")
    }

    /// The container (or init container) named `name`.
    pub fn container(&self, name: &str) -> Option<&Value> {
        ["initContainers", "containers"]
            .iter()
            .filter_map(|list| self.spec[list].as_array())
            .flatten()
            .find(|c| c["name"] == name)
    }

    /// The names of the init containers, then of the containers, in order.
    pub fn container_names(&self, list: &str) -> Vec<String> {
        self.spec[list]
            .as_array()
            .map(|cs| cs.iter().map(|c| str_of(&c["name"]).to_owned()).collect())
            .unwrap_or_default()
    }

    /// The namespaces the kubelet asks for: the node's pid namespace for `hostPID`, else one per container;
    /// the node's IPC namespace for `hostIPC`, else the pod's; always the node's network (no CNI here).
    pub fn namespace_options(&self) -> NamespaceOption {
        let host = |field: &str| self.spec[field].as_bool().unwrap_or(false);
        NamespaceOption {
            network: NamespaceMode::Node.into(),
            pid: if host("hostPID") {
                NamespaceMode::Node
            } else {
                NamespaceMode::Container
            }
            .into(),
            ipc: if host("hostIPC") {
                NamespaceMode::Node
            } else {
                NamespaceMode::Pod
            }
            .into(),
            ..Default::default()
        }
    }

    /// RunPodSandbox's config: attempt `attempt`, logs under `log_dir`, in cgroup `cgroup_parent`.
    pub fn sandbox_config(
        &self,
        attempt: u32,
        log_dir: &Path,
        cgroup_parent: &str,
    ) -> PodSandboxConfig {
        PodSandboxConfig {
            metadata: Some(PodSandboxMetadata {
                name: self.name().to_owned(),
                uid: format!("uid-{}-{}", self.namespace(), self.name()),
                namespace: self.namespace().to_owned(),
                attempt,
            }),
            log_directory: log_dir.display().to_string(),
            labels: string_map(&self.metadata["labels"]),
            annotations: string_map(&self.metadata["annotations"]),
            linux: Some(LinuxPodSandboxConfig {
                cgroup_parent: cgroup_parent.to_owned(),
                security_context: Some(LinuxSandboxSecurityContext {
                    namespace_options: Some(self.namespace_options()),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// The runtime handler: the RuntimeClass's `handler` for `runtimeClassName` (from `classes`, the
    /// RuntimeClass objects), or the default runtime's (`""`) when the pod names none.
    pub fn runtime_handler(&self, classes: &[Value]) -> Result<String, Error> {
        let Some(class) = self.spec["runtimeClassName"].as_str() else {
            return Ok(String::new());
        };
        classes
            .iter()
            .find(|c| c["kind"] == "RuntimeClass" && c["metadata"]["name"] == class)
            .map(|c| str_of(&c["handler"]).to_owned())
            .ok_or_else(|| Error::Unsupported {
                what: format!("pod {}: RuntimeClass {class} not given", self.name()),
            })
    }

    /// CreateContainer's config for container `name` (attempt `attempt`), with the test's `subs`.
    pub fn container_config(
        &self,
        name: &str,
        attempt: u32,
        subs: &Substitutes,
    ) -> Result<ContainerConfig, Error> {
        let c = self.container(name).ok_or_else(|| Error::Unsupported {
            what: format!("pod {}: no container {name}", self.name()),
        })?;
        let unsupported = |what: &str| Error::Unsupported {
            what: format!("pod {} container {name}: {what}", self.name()),
        };
        const KNOWN: [&str; 10] = [
            "name",
            "image",
            "imagePullPolicy",
            "command",
            "args",
            "env",
            "securityContext",
            "volumeMounts",
            "resources",
            "ports",
        ];
        if let Some(key) = unknown_key(c, &KNOWN) {
            return Err(unsupported(key));
        }
        let image = str_of(&c["image"]);
        let image = subs
            .images
            .get(image)
            .cloned()
            .unwrap_or_else(|| image.to_owned());
        let (command, args) = match subs.commands.get(name) {
            Some(command) => (command.clone(), Vec::new()),
            None => (strings(&c["command"]), strings(&c["args"])),
        };
        let mut mounts = self.mounts(c).map_err(|w| unsupported(&w))?;
        if has_gpu_limit(c) {
            mounts.extend(subs.devices.iter().map(|(host, inside)| Mount {
                container_path: inside.clone(),
                host_path: host.display().to_string(),
                ..Default::default()
            }));
        }
        let envs = c["env"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|e| match e["value"].as_str() {
                Some(v) => Ok(KeyValue {
                    key: str_of(&e["name"]).to_owned(),
                    value: v.to_owned(),
                }),
                None => Err(unsupported("env without a literal value")),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(ContainerConfig {
            metadata: Some(ContainerMetadata {
                name: name.to_owned(),
                attempt,
            }),
            image: Some(ImageSpec {
                image,
                ..Default::default()
            }),
            command,
            args,
            envs,
            mounts,
            labels: HashMap::from([("io.kubernetes.container.name".into(), name.to_owned())]),
            log_path: format!("{name}/{attempt}.log"),
            linux: Some(LinuxContainerConfig {
                resources: Some(resources(c)),
                security_context: Some(
                    self.security_context(&c["securityContext"])
                        .map_err(|w| unsupported(&w))?,
                ),
            }),
            ..Default::default()
        })
    }

    /// The container's securityContext as CRI's: user, capabilities (names as written: containerd adds
    /// `CAP_`, and `ALL` means all), no-new-privileges for `allowPrivilegeEscalation: false`, the read-only
    /// root, the AppArmor profile (`RuntimeDefault` or `Unconfined`), and the pod's namespaces.
    fn security_context(&self, sc: &Value) -> Result<LinuxContainerSecurityContext, String> {
        const KNOWN: [&str; 6] = [
            "runAsUser",
            "allowPrivilegeEscalation",
            "readOnlyRootFilesystem",
            "capabilities",
            "privileged",
            "appArmorProfile",
        ];
        if let Some(key) = unknown_key(sc, &KNOWN) {
            return Err(format!("securityContext.{key}"));
        }
        let apparmor = match sc["appArmorProfile"]["type"].as_str() {
            None => None,
            Some("Unconfined") => Some(ProfileType::Unconfined),
            Some("RuntimeDefault") => Some(ProfileType::RuntimeDefault),
            Some(other) => return Err(format!("securityContext.appArmorProfile.type {other}")),
        };
        Ok(LinuxContainerSecurityContext {
            apparmor: apparmor.map(|t| SecurityProfile {
                profile_type: t as i32,
                localhost_ref: String::new(),
            }),
            capabilities: Some(Capability {
                add_capabilities: strings(&sc["capabilities"]["add"]),
                drop_capabilities: strings(&sc["capabilities"]["drop"]),
                ..Default::default()
            }),
            privileged: sc["privileged"].as_bool().unwrap_or(false),
            namespace_options: Some(self.namespace_options()),
            run_as_user: sc["runAsUser"].as_i64().map(|value| Int64Value { value }),
            readonly_rootfs: sc["readOnlyRootFilesystem"].as_bool().unwrap_or(false),
            no_new_privs: sc["allowPrivilegeEscalation"] == false,
            ..Default::default()
        })
    }

    /// The container's volumeMounts, each a hostPath volume of the pod, as bind mounts.
    fn mounts(&self, c: &Value) -> Result<Vec<Mount>, String> {
        let mut out = Vec::new();
        for m in c["volumeMounts"].as_array().into_iter().flatten() {
            let name = str_of(&m["name"]);
            let volume = self.spec["volumes"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|v| v["name"] == name)
                .ok_or_else(|| format!("volumeMount {name} names no volume"))?;
            let host = volume["hostPath"]["path"]
                .as_str()
                .ok_or_else(|| format!("volume {name}: only hostPath volumes are translated"))?;
            out.push(Mount {
                container_path: str_of(&m["mountPath"]).to_owned(),
                host_path: host.to_owned(),
                readonly: m["readOnly"].as_bool().unwrap_or(false),
                ..Default::default()
            });
        }
        Ok(out)
    }

    /// The hostPath volumes' paths and types (`Directory`, `DirectoryOrCreate`, ...).
    pub fn host_paths(&self) -> Vec<(String, String)> {
        self.spec["volumes"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|v| {
                Some((
                    v["hostPath"]["path"].as_str()?.to_owned(),
                    v["hostPath"]["type"].as_str().unwrap_or("").to_owned(),
                ))
            })
            .collect()
    }
}

/// What the test puts in place of the manifests' placeholders.
#[derive(Debug, Default, Clone)]
pub struct Substitutes {
    /// Image in the manifest -> image imported into the node.
    pub images: HashMap<String, String>,
    /// Container name -> its whole command line (replacing the manifest's command and args).
    pub commands: HashMap<String, Vec<String>>,
    /// What a device plugin gives a container that asks for `nvidia.com/gpu`: (file on the node, path in the
    /// container). The mock driver's device files are FUSE files, not device nodes, so they are bind mounts.
    pub devices: Vec<(PathBuf, String)>,
}

/// Whether the container asks for a GPU (`resources.limits["nvidia.com/gpu"]`).
fn has_gpu_limit(c: &Value) -> bool {
    !c["resources"]["limits"]["nvidia.com/gpu"].is_null()
}

/// The kubelet's resources for a container: the memory limit in bytes, and CPU shares from the request
/// (1024 per CPU, at least 2).
fn resources(c: &Value) -> LinuxContainerResources {
    let r = &c["resources"];
    let memory = r["limits"]["memory"].as_str().and_then(quantity_bytes);
    let cpu_milli = r["requests"]["cpu"].as_str().and_then(cpu_millis);
    LinuxContainerResources {
        memory_limit_in_bytes: memory.unwrap_or(0),
        cpu_shares: cpu_milli.map_or(2, |m| (m * 1024 / 1000).max(2)),
        ..Default::default()
    }
}

/// A memory quantity (`512Mi`, `1Gi`, `64Ki`, or bytes) in bytes.
fn quantity_bytes(q: &str) -> Option<i64> {
    let (number, unit) = q.split_at(q.find(|c: char| !c.is_ascii_digit()).unwrap_or(q.len()));
    let n: i64 = number.parse().ok()?;
    let scale = match unit {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        _ => return None,
    };
    Some(n * scale)
}

/// A CPU quantity (`50m`, `2`) in millicores.
fn cpu_millis(q: &str) -> Option<i64> {
    match q.strip_suffix('m') {
        Some(m) => m.parse().ok(),
        None => q.parse::<i64>().ok().map(|n| n * 1000),
    }
}

/// A key of object `v` that is not among `known` (the first found).
fn unknown_key<'v>(v: &'v Value, known: &[&str]) -> Option<&'v str> {
    v.as_object()?
        .keys()
        .map(String::as_str)
        .find(|k| !known.contains(k))
}

fn str_of(v: &Value) -> &str {
    v.as_str().unwrap_or("")
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s.as_str().map(str::to_owned))
        .collect()
}

fn string_map(v: &Value) -> HashMap<String, String> {
    v.as_object()
        .into_iter()
        .flatten()
        .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_owned())))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_container_field_that_is_not_translated_fails_by_name() {
        let pod = Pod::from_pod(&serde_json::json!({
            "metadata": {"name": "p"},
            "spec": {"containers": [{"name": "c", "image": "i", "livenessProbe": {}}]}
        }));
        let err = pod
            .container_config("c", 0, &Substitutes::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("livenessProbe"), "{err}");
    }

    #[test]
    fn quantities_read_as_a_kubelet_reads_them() {
        assert_eq!(quantity_bytes("512Mi"), Some(512 << 20));
        assert_eq!(quantity_bytes("64Mi"), Some(64 << 20));
        assert_eq!(quantity_bytes("1Gi"), Some(1 << 30));
        assert_eq!(quantity_bytes("100"), Some(100));
        assert_eq!(quantity_bytes("1G"), None);
        assert_eq!(cpu_millis("50m"), Some(50));
        assert_eq!(cpu_millis("2"), Some(2000));
    }
}
