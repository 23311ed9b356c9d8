//! The registry: the containers the agent watches, as their shims (or OCI hooks) registered them:
//! registering (and again, from the same registrant), unregistering, dropping orphans whose shim and init
//! are gone, resolving a container a user names, and each container's preemption state as its shim pushes
//! it.
mod checks;
pub mod peaks;
mod publish;
pub mod shims_word;
pub mod watched;

use baton_agent_api::{
    ContainerRef, ContainerStatus, EventBody, PreemptState, PreemptionUpdate, Registration, Reply,
    Target,
};
use baton_tracer::{Tracer, cgroups::process_gone, now_monotonic_ns};

pub use publish::Published;

use crate::{
    core::{Core, Resolved},
    metrics::snapshot::IoctlCounts,
};
use checks::{check_cgroup_is_its_own, check_same_registrant};
use watched::Watched;

impl Core {
    /// Answers a `register`: a failed one lets go of what it loaded for nothing.
    pub(crate) fn register_reply(&mut self, reg: Registration, owner: u32) -> Reply {
        match self.register(reg, owner) {
            Ok(container) => Reply::Registered { container },
            Err(error) => {
                self.free_unused_prefixes();
                self.drop_tracer_if_unused();
                Reply::Error { error }
            }
        }
    }

    /// Watches `reg`'s container for `owner` (the registering process), or updates it when the same
    /// registrant registers it again.
    pub(crate) fn register(
        &mut self,
        reg: Registration,
        owner: u32,
    ) -> Result<ContainerStatus, String> {
        check_cgroup_is_its_own(&reg, owner)?;
        if let Some(settings) = reg.settings.rate_gate.as_deref().copied() {
            self.gapfill.rate.set(settings);
        }
        if let Some(headroom) = reg.settings.gpu_memory_headroom {
            self.gpu_headroom = headroom;
        }
        if let Some(minimum) = reg.settings.gpu_memory_minimum {
            self.gpu_min_need = minimum;
        }
        if let Some(budget) = reg.settings.parked_host_memory_budget {
            self.parked_budget = Some(budget);
        }
        if let Some(w) = self.watched.get_mut(&reg.container) {
            let tracer = self.tracer.as_mut().ok_or("the probes are not loaded")?;
            return register_again(w, tracer, reg, owner);
        }
        self.watch_new(reg, owner)
    }

    /// Starts watching a container not watched yet, loading the probes if need be, and publishes
    /// `registered`.
    fn watch_new(&mut self, reg: Registration, owner: u32) -> Result<ContainerStatus, String> {
        self.load_tracer(&reg.settings.trace_prefix)?;
        let tracer = self.tracer.as_mut().ok_or("the probes are not loaded")?;
        let cgroup_id = cgroup_id_of(tracer, &reg)?;
        if let Some(other) = self.by_cgroup.get(&cgroup_id) {
            return Err(format!(
                "cgroup {} is already watched for container {} in namespace {}: each watched container \
                 needs a cgroup of its own",
                reg.cgroup, other.id, other.namespace
            ));
        }
        tracer
            .watch_cgroup(cgroup_id)
            .map_err(|e| format!("cannot watch container {}: {e}", reg.container.id))?;
        let key = reg.container.clone();
        let w = Watched::new(reg, owner, cgroup_id, tracer, now_monotonic_ns());
        let status = w.status(tracer);
        tracing::info!(
            id = key.id,
            namespace = key.namespace,
            cgroup = status.cgroup,
            cgroup_id,
            partial = status.partial,
            "agent: watching container"
        );
        let body = EventBody::Registered {
            cgroup: status.cgroup.clone(),
            init_pid: status.init_pid,
            partial: status.partial,
        };
        self.by_cgroup.insert(cgroup_id, key.clone());
        self.ioctls.insert(cgroup_id, IoctlCounts::default());
        self.gapfill.adopt(&w);
        self.idle.adopt(&w);
        self.watched.insert(key.clone(), w);
        self.publish(&key, owner, body);
        // A container parked before this agent started: its shim's word on what its processes hold.
        self.preemption_state_changed(&key);
        Ok(status)
    }

    /// Stops watching container `c` (after the records still in the ring), publishes `unregistered` and
    /// lets go of what it alone used; whether it was watched.
    pub(crate) fn unregister(&mut self, c: &ContainerRef) -> bool {
        if let Some(t) = self.tracer.as_mut()
            && let Ok(batch) = t.drain_now()
        {
            self.apply(&batch);
        }
        let Some(w) = self.watched.remove(c) else {
            return false;
        };
        self.by_cgroup.remove(&w.cgroup_id);
        self.ioctls.remove(&w.cgroup_id);
        let body = self.unwatch(&w);
        if let EventBody::Unregistered {
            peak_vram_bytes, ..
        } = &body
        {
            self.peaks.ended(peaks::name_of(&w), *peak_vram_bytes);
        }
        log_unwatched(c, &body);
        self.publish(c, w.owner, body);
        self.gapfill.gone(c);
        self.idle_gone(c);
        self.drop_waiters_of(c);
        self.free_unused_prefixes();
        self.drop_tracer_if_unused();
        self.check_gates();
        true
    }

    /// The probes stop following `w`'s cgroup; returns its `unregistered` event (what it still held).
    fn unwatch(&mut self, w: &Watched) -> EventBody {
        match self.tracer.as_mut() {
            Some(t) => {
                t.unwatch_cgroup(w.cgroup_id);
                w.unregistered(t)
            }
            None => EventBody::Unregistered {
                live_objects: 0,
                vram_bytes: 0,
                peak_vram_bytes: 0,
            },
        }
    }

    /// Process `pid`'s connection ended: when it is gone, its orphans go (see [`Core::prune_orphans`]).
    pub(crate) fn peer_gone(&mut self, pid: u32) -> Reply {
        let found = pid != 0 && process_gone(pid) && self.prune_orphans() > 0;
        Reply::Unregistered { found }
    }

    /// Stops watching the containers whose registering shim is gone and whose init is gone too (a shim
    /// killed with -9 never unregisters them). Those still running stay watched. Looked at when a connection
    /// ends and before `register` and `status`, never on a timer. Returns how many went.
    pub(crate) fn prune_orphans(&mut self) -> usize {
        let orphans: Vec<ContainerRef> = self
            .watched
            .iter()
            .filter(|(_, w)| w.owner_and_init_gone())
            .map(|(c, _)| c.clone())
            .collect();
        for c in &orphans {
            tracing::info!(
                id = c.id,
                namespace = c.namespace,
                "agent: its shim and its init are gone: no longer watched"
            );
            self.unregister(c);
        }
        orphans.len()
    }

    /// The watched container `target` names, its shim's socket and its CUDA processes.
    pub(crate) fn resolve(&self, target: &Target) -> Result<Resolved, String> {
        let (c, w) = self.find(target)?;
        Ok(Resolved {
            container: c.clone(),
            control_socket: w.registration.control_socket.clone(),
            pids: self.cuda_pids(w.cgroup_id),
            preemption: w.preemption.clone(),
            vram_bytes: self
                .tracer
                .as_ref()
                .and_then(|t| t.ledger().container(w.cgroup_id))
                .map_or(0, |l| l.vram_bytes()),
            host_budget_left: self.parked_host_memory().budget_left(),
        })
    }

    /// The one watched container with `target`'s id (in its namespace, when it names one).
    fn find(&self, target: &Target) -> Result<(&ContainerRef, &Watched), String> {
        let matching: Vec<(&ContainerRef, &Watched)> = self
            .watched
            .iter()
            .filter(|(c, _)| {
                c.id == target.id && target.namespace.as_ref().is_none_or(|n| *n == c.namespace)
            })
            .collect();
        match matching.as_slice() {
            [] => Err(format!(
                "no watched container {}{}: `baton status` lists the containers the agent watches \
                 (a container is watched when it sees NVIDIA devices and runs under the baton runtime)",
                target.id,
                target
                    .namespace
                    .as_ref()
                    .map_or_else(String::new, |n| format!(" in namespace {n}"))
            )),
            [one] => Ok(*one),
            many => {
                let namespaces: Vec<&str> =
                    many.iter().map(|(c, _)| c.namespace.as_str()).collect();
                Err(format!(
                    "container id {} is in several namespaces ({}): add -n NAMESPACE",
                    target.id,
                    namespaces.join(", ")
                ))
            }
        }
    }

    /// The processes of cgroup `cgroup_id` a preemption names to the shim, sorted (none without probes): those
    /// that allocated the clients holding GPU state (the ledger's), those holding files whose contents the
    /// records never showed (followed only from /proc), and those that share a file with a process of the
    /// first kind (a worker forked after CUDA init). The shim asks the driver which of them own CUDA state and
    /// leaves the others alone, frozen with the cgroup, never checkpointed (the driver answers
    /// CUDA_ERROR_NOT_INITIALIZED for a forked worker: /work/shared/gpu/580.159.04/README.md, point 5); and
    /// it says which those are, the word an agent started after the park began needs to release it
    /// (`shims_word`): a worker left unnamed would keep its files, which that agent sees as opaque, held.
    fn cuda_pids(&self, cgroup_id: u64) -> Vec<u32> {
        let Some(t) = self.tracer.as_ref() else {
            return Vec::new();
        };
        let table = t.fd_table();
        let mine: Vec<(u32, &baton_tracer::fdtable::ProcFds)> = table
            .iter()
            .filter(|(_, p)| p.cgroup_id == cgroup_id)
            .collect();
        let files_of = |p: &baton_tracer::fdtable::ProcFds| -> Vec<baton_tracer::files::FileId> {
            let fds = p.fds.values().map(|nv| nv.file);
            fds.chain(p.maps.values().map(|m| m.file)).collect()
        };
        let owners = t
            .ledger()
            .container(cgroup_id)
            .map(|l| l.state_owners())
            .unwrap_or_default();
        let owners_files: std::collections::HashSet<baton_tracer::files::FileId> = mine
            .iter()
            .filter(|(pid, _)| owners.contains(pid))
            .flat_map(|(_, p)| files_of(p))
            .collect();
        mine.iter()
            .filter(|(pid, p)| {
                owners.contains(pid)
                    || files_of(p).iter().any(|f| {
                        owners_files.contains(f) || table.files().get(*f).is_some_and(|f| f.opaque)
                    })
            })
            .map(|(pid, _)| *pid)
            .collect::<std::collections::BTreeSet<u32>>()
            .into_iter()
            .collect()
    }

    /// The shim that registered a container pushes its preemption state (it owns it): kept as it says.
    pub(crate) fn preemption_pushed(&mut self, update: PreemptionUpdate, peer: u32) -> Reply {
        let Some(w) = self.watched.get_mut(&update.container) else {
            return Reply::Unregistered { found: false };
        };
        if w.owner != peer {
            return Reply::Error {
                error: format!(
                    "only the shim that registered container {} (pid {}) sets its preemption state",
                    update.container.id, w.owner
                ),
            };
        }
        let phase = |p: &Option<PreemptState>| p.as_ref().map(|s| s.state);
        self.gapfill.state_pushed(
            &update.container,
            phase(&w.preemption),
            phase(&update.state),
        );
        w.preemption = update.state;
        self.gapfill.adopt(w);
        self.preemption_state_changed(&update.container);
        Reply::Unregistered { found: true }
    }

    /// Records a preemption's new state of container `c` (the agent's own preemptions); whether it is
    /// watched.
    pub(crate) fn set_preemption(&mut self, c: &ContainerRef, state: Option<PreemptState>) -> bool {
        match self.watched.get_mut(c) {
            Some(w) => {
                w.preemption = state;
                self.preemption_state_changed(c);
                true
            }
            None => false,
        }
    }
}

/// The same registrant registers `w` again (a shim after a reconnect, or giving a restored container's new
/// pid): only the process that registered it, for the same cgroup (its init checked to be in it before).
fn register_again(
    w: &mut Watched,
    tracer: &mut Tracer,
    reg: Registration,
    owner: u32,
) -> Result<ContainerStatus, String> {
    let cgroup_id = cgroup_id_of(tracer, &reg)?;
    check_same_registrant(&reg.container, w, cgroup_id, owner)?;
    w.set_owner_and_init(owner, reg.init_pid);
    w.registration.control_socket = reg.control_socket;
    w.registration.role = reg.role;
    w.registration.kubernetes = reg.kubernetes;
    Ok(w.status(tracer))
}

/// The id of `reg`'s cgroup.
fn cgroup_id_of(tracer: &mut Tracer, reg: &Registration) -> Result<u64, String> {
    tracer
        .cgroups_mut()
        .id_of_path(std::path::Path::new(&reg.cgroup))
        .map_err(|e| format!("cannot watch container {}: {e}", reg.container.id))
}

/// Logs that container `c` is no longer watched, with what it still held (`body`, its `unregistered`).
fn log_unwatched(c: &ContainerRef, body: &EventBody) {
    if let EventBody::Unregistered {
        live_objects,
        vram_bytes,
        peak_vram_bytes,
    } = body
    {
        tracing::info!(
            id = c.id,
            namespace = c.namespace,
            live_objects,
            vram_bytes,
            peak_vram_bytes,
            "agent: no longer watching container"
        );
    }
}
