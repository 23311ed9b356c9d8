//! Who may register what, and who may ask: a registration's cgroup must be its container's own, a
//! re-registration must come from its registrant for the same cgroup, and a process inside a watched
//! container is not served.
use baton_agent_api::{ContainerRef, Registration};

use super::watched::Watched;
use crate::core::Core;

impl Core {
    /// Refuses peer `pid` when it sits in a watched container's cgroup (or below it): the agent commands
    /// freezes, preemptions and gates of every container on the node, and a tenant's process is not to.
    pub(crate) fn check_peer(&self, pid: u32) -> Result<(), String> {
        if pid == 0 || self.watched.is_empty() {
            return Ok(());
        }
        let Some(path) = baton_tracer::cgroups::v2_path_of_pid(pid) else {
            return Ok(());
        };
        let path = path.trim_end_matches('/');
        let inside = self.watched.values().find(|w| {
            let cg = w.registration.cgroup.trim_end_matches('/');
            !cg.is_empty()
                && (path == cg || path.strip_prefix(cg).is_some_and(|r| r.starts_with('/')))
        });
        match inside {
            Some(w) => Err(format!(
                "the baton agent does not serve processes inside a watched container: pid {pid} is in \
                 cgroup {path}, container {} (namespace {})",
                w.registration.container.id, w.registration.container.namespace
            )),
            None => Ok(()),
        }
    }
}

/// Refuses a re-registration of `key`, watched as `w`, for another cgroup (`cgroup_id`), or from another
/// process (`owner`) while the one that registered it lives: either would let a peer take over where the
/// container's freezes and preemptions go. An agent restarted since has no entry, so its shims register
/// afresh; a shim giving a restored container's new init at Start is the same owner, same cgroup; an OCI
/// hook registers and exits, so the next hook of the same container (same cgroup) takes its place.
pub(super) fn check_same_registrant(
    key: &ContainerRef,
    w: &Watched,
    cgroup_id: u64,
    owner: u32,
) -> Result<(), String> {
    if w.cgroup_id != cgroup_id {
        return Err(format!(
            "refusing to register container {} (namespace {}) again for another cgroup: it is watched in \
             cgroup {} (id {}), not id {cgroup_id}; delete the container first",
            key.id, key.namespace, w.registration.cgroup, w.cgroup_id
        ));
    }
    if w.owner != owner && w.owner_lives() {
        return Err(format!(
            "refusing to register container {} (namespace {}) again from pid {owner}: pid {} registered \
             it, and only that process may change where its freezes and preemptions go",
            key.id, key.namespace, w.owner
        ));
    }
    Ok(())
}

/// Refuses a cgroup that is not the container's own: the root, or the registering process's (on a host
/// where runc put the container in v1 cgroups only, its v2 path is its shim's), or one its init is not in.
pub(super) fn check_cgroup_is_its_own(reg: &Registration, owner: u32) -> Result<(), String> {
    let v2 = baton_tracer::cgroups::v2_path_of_pid;
    let init = if reg.init_pid == 0 {
        None
    } else {
        v2(reg.init_pid)
    };
    check_cgroup_paths(reg, v2(owner).as_deref(), init.as_deref())
}

/// [`check_cgroup_is_its_own`] on paths already read: the registering process's and the init's cgroup.
/// Every path is compared in its one spelling (`/.`, `//` and `/a/./b` are `/`, `/` and `/a/b`); a path
/// with `..` is refused.
fn check_cgroup_paths(
    reg: &Registration,
    owner_cgroup: Option<&str>,
    init_cgroup: Option<&str>,
) -> Result<(), String> {
    let id = &reg.container.id;
    let canonical = baton_tracer::cgroups::canonical_path;
    let path =
        canonical(&reg.cgroup).map_err(|e| format!("refusing to watch container {id}: {e}"))?;
    if baton_tracer::cgroups::is_root(&path) {
        return Err(format!(
            "refusing to watch container {id}: its cgroup v2 path is the root, which every process on \
             the node shares (is runc putting containers into cgroup v2 here?)"
        ));
    }
    // Paths the kernel wrote (/proc/PID/cgroup) have no `..`; one that does not parse matches nothing.
    let same = |other: &str| canonical(other).is_ok_and(|o| o == path);
    if owner_cgroup.is_some_and(same) {
        return Err(format!(
            "refusing to watch container {id}: its cgroup v2 path {path} is its shim's, so its calls \
             could not be told from the shim's (runc did not give it a cgroup v2 of its own)"
        ));
    }
    if let Some(actual) = init_cgroup
        && !same(actual)
    {
        return Err(format!(
            "refusing to watch container {id}: its init (pid {}) is in cgroup {actual}, not {path}",
            reg.init_pid
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(cgroup: &str, init_pid: u32) -> Registration {
        Registration {
            container: ContainerRef {
                id: "c".into(),
                namespace: "n".into(),
            },
            cgroup: cgroup.into(),
            init_pid,
            devices: vec![],
            settings: Default::default(),
            control_socket: None,
            preemption: None,
            role: None,
            kubernetes: None,
            gpu_memory: None,
        }
    }

    #[test]
    fn the_root_and_the_shims_own_cgroup_are_refused() {
        let e = check_cgroup_paths(&reg("/", 0), None, None).unwrap_err();
        assert!(e.contains("root"), "{e}");
        let e = check_cgroup_paths(&reg("/pods/shim/", 0), Some("/pods/shim"), None).unwrap_err();
        assert!(e.contains("shim's"), "{e}");
        let e = check_cgroup_paths(&reg("/elsewhere", 7), Some("/pods/shim"), Some("/pods/c1"))
            .unwrap_err();
        assert!(e.contains("not /elsewhere"), "{e}");
        check_cgroup_paths(&reg("/pods/c1", 7), Some("/pods/shim"), Some("/pods/c1")).unwrap();
    }

    #[test]
    fn cgroup_paths_are_compared_in_one_spelling() {
        for root in ["/.", "//", "/./", "/a/../"] {
            let e = check_cgroup_paths(&reg(root, 0), None, None).unwrap_err();
            assert!(e.contains("root") || e.contains("`..`"), "{root}: {e}");
        }
        let e = check_cgroup_paths(&reg("/a/../", 0), None, None).unwrap_err();
        assert!(e.contains("`..`"), "{e}");
        let e = check_cgroup_paths(&reg("/pods/./c1/../shim", 7), None, Some("/pods/shim"))
            .unwrap_err();
        assert!(e.contains("`..`"), "{e}");
        let e = check_cgroup_paths(&reg("/pods//shim", 0), Some("/pods/shim"), None).unwrap_err();
        assert!(e.contains("shim's"), "{e}");
        check_cgroup_paths(&reg("/pods/./c1", 7), Some("/pods/shim"), Some("/pods/c1")).unwrap();
        check_cgroup_paths(&reg("//pods/c1/", 7), Some("/pods/shim"), Some("/pods/c1")).unwrap();
    }
}
