//! The container as the agent is told of it: its namespace (the hook's flag, else an annotation, else the
//! engine that runs it), its cgroup v2 path from `/proc/<pid>/cgroup`, and the NVIDIA device files it sees,
//! in the agent's [`Registration`] (the one the shim sends for its own containers, without a control
//! socket: park, preempt and freeze go through a shim).
use std::{
    collections::HashMap,
    path::{Path, PathBuf},
};

use baton_agent_api::{ContainerRef, Registration, WatchSettings};
use oci_spec::runtime::Spec;

use crate::{error::HookError, state::HookState};

/// The annotation that names the container's namespace for the agent (when no `--namespace` is given).
pub const NAMESPACE_ANNOTATION: &str = "baton.io/namespace";
/// The annotation podman (`libpod`) and CRI-O (`cri-o`) put on their containers: the namespace otherwise.
pub const MANAGER_ANNOTATION: &str = "io.container.manager";
/// The namespace of a container nothing names one for (plain runc).
pub const DEFAULT_NAMESPACE: &str = "runc";

/// Where `/proc/<pid>/root` of the container's init points when the hook runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RootView {
    /// Before `pivot_root` (createRuntime): the runtime's root, the rootfs mounted at its path in it.
    BeforePivot,
    /// After it (poststart): the container's root.
    AfterPivot,
}

/// The namespace the agent files the container under: `flag`, else [`NAMESPACE_ANNOTATION`], else
/// [`MANAGER_ANNOTATION`], else [`DEFAULT_NAMESPACE`].
pub fn namespace_of(flag: Option<&str>, annotations: &HashMap<String, String>) -> String {
    flag.map(str::to_owned)
        .or_else(|| annotations.get(NAMESPACE_ANNOTATION).cloned())
        .or_else(|| annotations.get(MANAGER_ANNOTATION).cloned())
        .map(|n| n.trim().to_owned())
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| DEFAULT_NAMESPACE.to_owned())
}

/// The container's cgroup v2 path (the `0::` line of `/proc/<pid>/cgroup`); an error when the process is
/// gone, has no such line, or sits in the root.
pub fn cgroup_of(id: &str, pid: u32) -> Result<String, HookError> {
    let gone = || HookError::ProcessGone {
        id: id.to_owned(),
        pid,
    };
    if !Path::new(&format!("/proc/{pid}")).exists() {
        return Err(gone());
    }
    let path = baton_cgroups::v2_path_of_pid(pid).ok_or_else(|| {
        if Path::new(&format!("/proc/{pid}")).exists() {
            HookError::NoCgroup {
                id: id.to_owned(),
                pid,
            }
        } else {
            gone()
        }
    })?;
    if baton_cgroups::canonical_path(&path).is_ok_and(|p| baton_cgroups::is_root(&p)) {
        return Err(HookError::RootCgroup {
            id: id.to_owned(),
            pid,
        });
    }
    Ok(path)
}

/// The container's rootfs as its bundle's config.json names it (relative paths are the bundle's).
pub fn rootfs_of(state: &HookState) -> Result<PathBuf, HookError> {
    let path = state.bundle.join("config.json");
    let error = |detail: String| HookError::Config {
        id: state.id.clone(),
        path: path.clone(),
        detail,
    };
    let spec = Spec::load(&path).map_err(|e| error(e.to_string()))?;
    let root = spec
        .root()
        .as_ref()
        .ok_or_else(|| error("it has no root".to_owned()))?
        .path();
    Ok(if root.is_absolute() {
        root.clone()
    } else {
        state.bundle.join(root)
    })
}

/// The NVIDIA device files container `state` sees in the device folder of `trace_prefix` (paths inside it).
pub fn devices_of(
    state: &HookState,
    pid: u32,
    trace_prefix: &str,
    view: RootView,
) -> Result<Vec<String>, HookError> {
    let dir = baton_agent_api::device_dir(trace_prefix);
    let root = match view {
        RootView::AfterPivot => PathBuf::from(format!("/proc/{pid}/root")),
        RootView::BeforePivot => {
            let rootfs = rootfs_of(state)?;
            Path::new(&format!("/proc/{pid}/root"))
                .join(rootfs.strip_prefix("/").unwrap_or(&rootfs))
        }
    };
    Ok(baton_agent_api::nvidia_devices_in(
        &root.join(dir.trim_start_matches('/')),
        dir,
    ))
}

/// The registration of container `state` as `container`, or `None` when it sees no NVIDIA device file
/// (the agent has nothing to watch: the shim's rule too).
pub fn registration_of(
    state: &HookState,
    container: ContainerRef,
    trace_prefix: &str,
    view: RootView,
) -> Result<Option<Registration>, HookError> {
    let pid = state.require_pid()?;
    let cgroup = cgroup_of(&state.id, pid)?;
    let devices = devices_of(state, pid, trace_prefix, view)?;
    if devices.is_empty() {
        return Ok(None);
    }
    Ok(Some(Registration {
        container,
        cgroup,
        init_pid: pid,
        devices,
        settings: WatchSettings {
            trace_prefix: trace_prefix.to_owned(),
            ..WatchSettings::default()
        },
        control_socket: None,
        preemption: None,
        role: None,
        // CRI-O's (or containerd's) annotations name the pod, for the agent's metrics.
        kubernetes: baton_agent_api::KubernetesRef::from_annotations(&state.annotations)
            .map(Box::new),
        // The hooks take no Baton annotation: a container they register needs the whole GPU.
        gpu_memory: None,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn annotations(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn the_namespace_is_the_flag_else_the_annotation_else_the_engine_else_runc() {
        let both = annotations(&[
            (NAMESPACE_ANNOTATION, "team-a"),
            (MANAGER_ANNOTATION, "libpod"),
        ]);
        assert_eq!(namespace_of(Some("mine"), &both), "mine");
        assert_eq!(namespace_of(None, &both), "team-a");
        assert_eq!(
            namespace_of(None, &annotations(&[(MANAGER_ANNOTATION, "cri-o")])),
            "cri-o"
        );
        assert_eq!(namespace_of(None, &HashMap::new()), "runc");
        assert_eq!(namespace_of(Some(" "), &HashMap::new()), "runc");
    }

    #[test]
    fn a_gone_process_and_the_root_cgroup_are_named() {
        // Pid 2 is kthreadd, a kernel thread in the root cgroup; u32::MAX is no process.
        let e = cgroup_of("c1", u32::MAX).unwrap_err();
        assert!(matches!(e, HookError::ProcessGone { .. }), "{e}");
        let e = cgroup_of("c1", 2).unwrap_err();
        assert!(
            matches!(e, HookError::RootCgroup { .. } | HookError::NoCgroup { .. }),
            "{e}"
        );
        assert!(e.to_string().contains("container c1: process 2"), "{e}");
    }

    #[test]
    fn the_rootfs_comes_from_the_bundles_config_relative_to_the_bundle() {
        let bundle = tempfile::tempdir().unwrap();
        let state = HookState {
            id: "c1".into(),
            pid: Some(std::process::id()),
            bundle: bundle.path().to_owned(),
            annotations: HashMap::new(),
        };
        let e = rootfs_of(&state).unwrap_err().to_string();
        assert!(e.contains("config.json") && e.contains("c1"), "{e}");
        std::fs::write(
            bundle.path().join("config.json"),
            r#"{"ociVersion":"1.0.2","root":{"path":"rootfs"}}"#,
        )
        .unwrap();
        assert_eq!(rootfs_of(&state).unwrap(), bundle.path().join("rootfs"));
    }
}
