//! One watched container in the agent: its registration, its GPU hold state and the transitions the
//! probes' records cause (acquired: the first NVIDIA file opened while it held none; released: none of its
//! processes holds an NVIDIA file or mapping any more, and the kernel has run the release of each, see
//! `baton_tracer::release`).
use std::collections::BTreeSet;

use baton_agent_api::{
    Acquired, ContainerStatus, EventBody, GpuHold, ProcessStatus, Registration, Released,
};
use baton_tracer::{
    GpuState, Tracer,
    event::{Body, Event as Record},
};

use crate::holders::{Classifier, Holding, pids_of_cgroup_tree};
use baton_tracer::now_monotonic_ns;

/// A watched container.
pub struct Watched {
    /// What its shim registered.
    pub registration: Registration,
    /// The pid of the process that registered it.
    pub owner: u32,
    /// When the owner started ([`baton_tracer::cgroups::start_ticks`]): once it is gone, its pid alone may
    /// name a later process.
    owner_started: Option<u64>,
    /// When the init started, likewise.
    init_started: Option<u64>,
    /// Its cgroup v2 id.
    pub cgroup_id: u64,
    gpu: GpuHold,
    since_ns: u64,
    partial: bool,
    /// Processes that held NVIDIA files since the last acquire.
    holders: BTreeSet<u32>,
    /// Its ledger while it last held the GPU: what a release frees.
    held_objects: usize,
    held_vram: u64,
    /// Parked, or being preempted or resumed (from the shim's registration and the agent's preemptions).
    pub preemption: Option<baton_agent_api::PreemptState>,
    /// Processes of its cgroup that /proc shows holding NVIDIA files the records never showed them take:
    /// its release waits for them.
    hidden: BTreeSet<u32>,
}

impl Watched {
    /// Whether the process that registered it and its init are both gone (by pid and start time).
    pub fn owner_and_init_gone(&self) -> bool {
        use baton_tracer::cgroups::instance_gone;
        instance_gone(self.owner, self.owner_started)
            && instance_gone(self.registration.init_pid, self.init_started)
    }

    /// Whether the process that registered it is still there (by pid and start time).
    pub fn owner_lives(&self) -> bool {
        !baton_tracer::cgroups::instance_gone(self.owner, self.owner_started)
    }

    /// Takes `owner` and `init_pid` as its registrant and init from now on.
    pub fn set_owner_and_init(&mut self, owner: u32, init_pid: u32) {
        use baton_tracer::cgroups::start_ticks;
        if owner != self.owner {
            self.owner_started = start_ticks(owner);
        }
        if init_pid != self.registration.init_pid {
            self.init_started = start_ticks(init_pid);
        }
        self.owner = owner;
        self.registration.init_pid = init_pid;
    }

    /// A container just watched; `tracer` has seeded what its processes already hold.
    pub fn new(
        registration: Registration,
        owner: u32,
        cgroup_id: u64,
        tracer: &Tracer,
        now_ns: u64,
    ) -> Self {
        let preemption = registration.preemption.clone();
        let init_started = baton_tracer::cgroups::start_ticks(registration.init_pid);
        let mut w = Self {
            preemption,
            registration,
            owner,
            owner_started: baton_tracer::cgroups::start_ticks(owner),
            init_started,
            cgroup_id,
            gpu: GpuHold::Never,
            since_ns: now_ns,
            partial: false,
            holders: BTreeSet::new(),
            held_objects: 0,
            held_vram: 0,
            hidden: BTreeSet::new(),
        };
        if tracer.gpu_state(cgroup_id).pins_files() {
            w.gpu = GpuHold::Held;
            w.partial = true;
            w.note_holders(tracer);
        }
        w
    }

    /// Applies a batch of records (or a resync or /proc confirmation); returns the transitions it caused:
    /// acquired, released, or both when a process opened and dropped its files within the batch. A release
    /// is published only once /proc agrees that no process of its cgroup holds an NVIDIA file or mapping
    /// (see [`Watched::hidden_holders`]).
    pub fn update(
        &mut self,
        tracer: &mut Tracer,
        records: &[Record],
        classifier: &Classifier,
    ) -> Vec<EventBody> {
        let mine = || records.iter().filter(|r| r.cgroup_id == self.cgroup_id);
        let state = tracer.gpu_state(self.cgroup_id);
        let has_files = state.has_files();
        let opened = mine().find(|r| matches!(r.body, Body::Open { .. }));
        let mut out = Vec::new();
        if self.gpu != GpuHold::Held && (has_files || opened.is_some()) {
            let (pid, t) = opened.map_or((0, now_monotonic_ns()), |r| (r.pid, r.ts_ns));
            self.holders.clear();
            self.gpu = GpuHold::Held;
            self.since_ns = t;
            out.push(EventBody::Acquired(Acquired {
                pid,
                t_acquired_ns: t,
            }));
        }
        for r in mine().filter(|r| !matches!(r.body, Body::Confirm { .. })) {
            self.holders.insert(r.pid);
        }
        if has_files {
            self.note_holders(tracer);
        } else if self.gpu == GpuHold::Held && !state.pins_files() {
            let hidden = self.hidden_holders(tracer, classifier);
            if hidden.is_empty() {
                self.hidden.clear();
                out.push(EventBody::Released(self.released(tracer, &state)));
            } else {
                self.follow_hidden(tracer, &hidden);
            }
        }
        out
    }

    /// Whether its release waits for holders only /proc showed (the agent looks again until they let go).
    pub fn awaits_hidden_holders(&self) -> bool {
        !self.hidden.is_empty()
    }

    /// What the processes of its cgroup (and the cgroups below) hold, read from /proc: the kernel's word,
    /// whatever the records said.
    fn hidden_holders(&self, tracer: &mut Tracer, classifier: &Classifier) -> Vec<Holding> {
        let Some(dir) = tracer.cgroup_dir(self.cgroup_id) else {
            return Vec::new();
        };
        classifier.holdings_of_all(pids_of_cgroup_tree(&dir))
    }

    /// Keeps the container held by `hidden`, and has the probes follow each holder from now on (its calls,
    /// closes and exit then come as records).
    fn follow_hidden(&mut self, tracer: &mut Tracer, hidden: &[Holding]) {
        let pids: BTreeSet<u32> = hidden.iter().map(|h| h.pid).collect();
        for h in hidden.iter().filter(|h| !self.hidden.contains(&h.pid)) {
            tracing::warn!(
                id = self.registration.container.id,
                "agent: {h} holds an NVIDIA file the probes never saw it take (passed over a unix socket, \
                 taken with pidfd_getfd, a shared fd table, io_uring or a device node of another name): the \
                 release waits for it"
            );
        }
        for &pid in pids.difference(&self.hidden) {
            if let Err(e) = tracer.adopt(pid) {
                tracing::warn!(pid, "agent: cannot follow hidden holder {pid}: {e}");
            }
            self.holders.insert(pid);
        }
        self.hidden = pids;
    }

    /// The container's files are gone and the kernel has released them: the `released` event.
    fn released(&mut self, tracer: &Tracer, state: &GpuState) -> Released {
        let now = now_monotonic_ns();
        let (last_removal, confirmation) = tracer.release_times(self.cgroup_id);
        let t_last = last_removal.unwrap_or(now);
        let (t_released, confirmed_by) = match confirmation {
            Some(c) if c.t_ns >= t_last => (c.t_ns, c.kind.label().to_owned()),
            // Released without a removal awaiting confirmation (a resync found the files gone).
            _ => (now, "resync".to_owned()),
        };
        self.gpu = GpuHold::Released;
        self.since_ns = t_released;
        Released {
            pids: self.holders.iter().copied().collect(),
            t_last_close_ns: t_last,
            t_released_ns: t_released,
            confirmed_by,
            objects_freed: self.held_objects.saturating_sub(state.live_objects),
            bytes_freed: self.held_vram.saturating_sub(state.vram_bytes),
            nvml: crate::nvml::view(&self.holders),
        }
    }

    fn note_holders(&mut self, tracer: &Tracer) {
        for (pid, p) in tracer.fd_table().iter() {
            if p.cgroup_id == self.cgroup_id {
                self.holders.insert(pid);
            }
        }
        // What a release would free: the ledger now (objects freed while files stay open are not the
        // release's).
        let state = tracer.gpu_state(self.cgroup_id);
        self.held_objects = state.live_objects;
        self.held_vram = state.vram_bytes;
    }

    /// What `status` shows of it.
    pub fn status(&self, tracer: &Tracer) -> ContainerStatus {
        let mut processes = Vec::new();
        for (pid, p) in tracer.fd_table().iter() {
            if p.cgroup_id == self.cgroup_id {
                processes.push(ProcessStatus {
                    pid,
                    fds: p.fds.len(),
                    mappings: p.maps.len(),
                });
            }
        }
        processes.sort_by_key(|p| p.pid);
        let state = tracer.gpu_state(self.cgroup_id);
        let ledger = tracer.ledger().container(self.cgroup_id);
        ContainerStatus {
            container: self.registration.container.clone(),
            cgroup: self.registration.cgroup.clone(),
            cgroup_id: self.cgroup_id,
            init_pid: self.registration.init_pid,
            devices: self.registration.devices.clone(),
            processes,
            nvidia_fds: state.open_fds,
            mappings: state.mappings,
            unconfirmed: state.unconfirmed,
            live_objects: state.live_objects,
            vram_bytes: state.vram_bytes,
            peak_vram_bytes: ledger.map_or(0, |l| l.peak_vram_bytes()),
            gpu: self.gpu,
            since_ns: self.since_ns,
            partial: self.partial || ledger.is_some_and(|l| l.partial),
            preemption: self.preemption.clone(),
            role: self.registration.role.clone(),
        }
    }

    /// The event that ends its watch.
    pub fn unregistered(&self, tracer: &Tracer) -> EventBody {
        let state = tracer.gpu_state(self.cgroup_id);
        EventBody::Unregistered {
            live_objects: state.live_objects,
            vram_bytes: state.vram_bytes,
            peak_vram_bytes: tracer
                .ledger()
                .container(self.cgroup_id)
                .map_or(0, |l| l.peak_vram_bytes()),
        }
    }
}
