//! What a container's `baton.io/role` changes in the shim: a co-runner gets `CUDA_LAUNCH_BLOCKING=1` in its
//! environment (unless `baton.io/launch-blocking: "false"`), so that at most one of its kernels is in flight
//! when the controller freezes it, and the pod a container belongs to is read from CRI's annotations.
use std::{collections::HashMap, path::Path};

use baton_agent_api::KubernetesRef;

use crate::errors::{Result, ShimError};

/// The variable, and the value that makes every CUDA launch synchronous.
pub const LAUNCH_BLOCKING: &str = "CUDA_LAUNCH_BLOCKING=1";

/// The container as Kubernetes names it (pod namespace, pod, container name), when CRI created it.
pub fn kubernetes_of(annotations: &HashMap<String, String>) -> Option<KubernetesRef> {
    KubernetesRef::from_annotations(annotations)
}

/// `pod-namespace/pod-name` from CRI's annotations, when they are there.
pub fn pod_of(annotations: &HashMap<String, String>) -> Option<String> {
    kubernetes_of(annotations).map(|k| k.pod_path())
}

/// Adds `CUDA_LAUNCH_BLOCKING=1` to the process environment of the bundle's config.json. A value the
/// container's own spec sets is kept (and logged). Returns whether the file changed.
pub fn inject_launch_blocking(bundle: &Path, id: &str) -> Result<bool> {
    let path = bundle.join("config.json");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| ShimError::io(format!("read {}", path.display()), e))?;
    let mut spec: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| ShimError::InvalidArgument(format!("invalid {}: {e}", path.display())))?;
    let Some(env) = spec
        .get_mut("process")
        .and_then(|p| p.as_object_mut())
        .map(|p| p.entry("env").or_insert_with(|| serde_json::json!([])))
        .and_then(serde_json::Value::as_array_mut)
    else {
        return Ok(false);
    };
    let name = LAUNCH_BLOCKING.split('=').next().unwrap_or_default();
    if let Some(set) = env
        .iter()
        .filter_map(serde_json::Value::as_str)
        .find(|v| v.split('=').next() == Some(name))
    {
        tracing::info!(id, "co-runner: its spec sets {set}; kept");
        return Ok(false);
    }
    env.push(serde_json::Value::from(LAUNCH_BLOCKING));
    let body = serde_json::to_vec(&spec)
        .map_err(|e| ShimError::InvalidArgument(format!("cannot write {}: {e}", path.display())))?;
    let tmp = bundle.join(".config.json.baton");
    std::fs::write(&tmp, body)
        .and_then(|()| std::fs::rename(&tmp, &path))
        .map_err(|e| ShimError::io(format!("write {}", path.display()), e))?;
    tracing::info!(id, "co-runner: {LAUNCH_BLOCKING} added to its environment");
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bundle(spec: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), spec).unwrap();
        dir
    }

    fn env_of(dir: &Path) -> Vec<String> {
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap();
        serde_json::from_value(v["process"]["env"].clone()).unwrap()
    }

    #[test]
    fn a_co_runner_gets_launch_blocking_and_keeps_everything_else() {
        let dir = bundle(
            r#"{"ociVersion":"1.0.2","process":{"args":["sh"],"env":["PATH=/bin"]},"x-extra":{"a":1}}"#,
        );
        assert!(inject_launch_blocking(dir.path(), "c").unwrap());
        assert_eq!(env_of(dir.path()), vec!["PATH=/bin", LAUNCH_BLOCKING]);
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).unwrap())
                .unwrap();
        assert_eq!(v["x-extra"]["a"], 1);
        // Twice is once.
        assert!(!inject_launch_blocking(dir.path(), "c").unwrap());
        assert_eq!(env_of(dir.path()).len(), 2);
    }

    #[test]
    fn a_value_the_spec_sets_is_kept() {
        let dir = bundle(r#"{"process":{"env":["CUDA_LAUNCH_BLOCKING=0"]}}"#);
        assert!(!inject_launch_blocking(dir.path(), "c").unwrap());
        assert_eq!(env_of(dir.path()), vec!["CUDA_LAUNCH_BLOCKING=0"]);
    }

    #[test]
    fn the_pod_comes_from_cri_annotations() {
        let a: HashMap<String, String> = [
            (
                "io.kubernetes.cri.sandbox-name".to_string(),
                "llm-0".to_string(),
            ),
            (
                "io.kubernetes.cri.sandbox-namespace".to_string(),
                "serving".to_string(),
            ),
        ]
        .into();
        assert_eq!(pod_of(&a).as_deref(), Some("serving/llm-0"));
        assert_eq!(pod_of(&HashMap::new()), None);
        let mut a = a;
        a.insert(
            "io.kubernetes.cri.container-name".to_string(),
            "server".to_string(),
        );
        let k = kubernetes_of(&a).unwrap();
        assert_eq!(
            (
                k.namespace.as_deref(),
                k.pod.as_str(),
                k.container.as_deref()
            ),
            (Some("serving"), "llm-0", Some("server"))
        );
        assert_eq!(kubernetes_of(&HashMap::new()), None);
    }
}
