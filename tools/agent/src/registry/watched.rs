//! One watched container in the agent: its registration, its GPU hold state and the transitions the
//! probes' records cause. Acquired: the GPU holds state of it (an RM object that is more than a handle:
//! memory, an address space, a channel, a context; a GPU registered with UVM; or a file /proc showed whose
//! contents are unknown) where it held none. Released: none of that is left (every client freed, explicitly
//! or with the final release of its file), the kernel has run the releases its processes started (see
//! `baton_tracer::release`), and /proc shows no NVIDIA file in its cgroup that the probes do not account for.
//! Open files that carry no state (a forked worker's inherited fds, the reservations a park leaves) do not
//! hold the GPU.
use std::collections::BTreeSet;

use baton_agent_api::{
    Acquired, ContainerStatus, EventBody, GpuHold, ProcessStatus, Registration, Released,
};
use baton_nvidia::{class, decode::Op};
use baton_tracer::{
    GpuState, Tracer,
    event::{Body, Event as Record},
    fdtable::{FdTable, ProcFds},
};

use crate::holders::{Classifier, Holding, Via, pids_of_cgroup_tree};
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
    /// /proc showed files the mirror did not account for, looked at before the records still in the ring were
    /// applied: looked at again once they are (see [`Watched::update_after_drain`]) before any is adopted.
    suspected: bool,
    /// Set while [`Watched::update_after_drain`] runs.
    drained: bool,
    /// Its last periodic check against /proc (see `core::reconcile`).
    pub proc_check: Option<baton_agent_api::ProcCheck>,
    /// What its shim said of its processes' CUDA state during its current preemption.
    pub shims_word: super::shims_word::ShimsWord,
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
            suspected: false,
            drained: false,
            proc_check: None,
            shims_word: Default::default(),
        };
        if tracer.gpu_state(cgroup_id).holds_state() {
            w.gpu = GpuHold::Held;
            w.partial = true;
            w.note_holders(tracer);
        }
        w
    }

    /// Applies a batch of records (or a resync or /proc confirmation); returns the transitions it caused:
    /// acquired, released, or both when a process created and dropped its state within the batch. A release
    /// is published only once the kernel has finished what its processes removed and /proc shows no NVIDIA
    /// file in its cgroup that the mirror does not account for (see [`Watched::unaccounted_holders`]).
    /// `confirmed_by_proc`: the mirror was just corrected from /proc (a release now is /proc's).
    pub fn update(
        &mut self,
        tracer: &mut Tracer,
        records: &[Record],
        classifier: &Classifier,
    ) -> Vec<EventBody> {
        self.update_as(tracer, records, classifier, false)
    }

    /// [`Watched::update`], saying whether the mirror was corrected from /proc just before.
    pub fn update_as(
        &mut self,
        tracer: &mut Tracer,
        records: &[Record],
        classifier: &Classifier,
        confirmed_by_proc: bool,
    ) -> Vec<EventBody> {
        let mine = || records.iter().filter(|r| r.cgroup_id == self.cgroup_id);
        let state = tracer.gpu_state(self.cgroup_id);
        let created = mine().find(|r| creates_state(r));
        let mut out = Vec::new();
        if self.gpu != GpuHold::Held && (state.holds_state() || created.is_some()) {
            let (pid, t) = created.map_or((0, now_monotonic_ns()), |r| (r.pid, r.ts_ns));
            self.holders.clear();
            self.gpu = GpuHold::Held;
            self.since_ns = t;
            self.held_objects = 0;
            self.held_vram = 0;
            out.push(EventBody::Acquired(Acquired {
                pid,
                t_acquired_ns: t,
            }));
        }
        for r in mine().filter(|r| !matches!(r.body, Body::Confirm { .. })) {
            self.holders.insert(r.pid);
        }
        if self.gpu != GpuHold::Held {
            return out;
        }
        if state.holds_state() {
            self.suspected = false;
            self.note_holders(tracer);
        } else if state.unconfirmed == 0 {
            let hidden = self.unaccounted_holders(tracer, classifier);
            if hidden.is_empty() {
                self.hidden.clear();
                self.suspected = false;
                let freed_at = mine().filter(|r| frees_state(r)).map(|r| r.ts_ns).max();
                let how = match (confirmed_by_proc, freed_at) {
                    (true, _) => Ended::Proc,
                    (false, Some(t)) => Ended::Freed(t),
                    (false, None) => Ended::Removed,
                };
                out.push(EventBody::Released(self.released(tracer, &state, how)));
            } else if self.drained || !self.hidden.is_empty() {
                self.follow_hidden(tracer, &hidden);
            } else {
                // /proc is ahead of the records not yet read from the ring (an open, a fork): adopting now
                // would move this mirror past them. Held until a look after the ring was drained.
                self.suspected = true;
            }
        }
        out
    }

    /// [`Watched::update`] right after the core applied every record still in the ring: what /proc shows and
    /// the mirror still does not account for is a hidden holder now, followed from then on.
    pub fn update_after_drain(
        &mut self,
        tracer: &mut Tracer,
        classifier: &Classifier,
    ) -> Vec<EventBody> {
        self.drained = true;
        let out = self.update_as(tracer, &[], classifier, false);
        self.drained = false;
        out
    }

    /// Whether its release waits for holders only /proc showed (the agent looks again until they let go).
    pub fn awaits_hidden_holders(&self) -> bool {
        !self.hidden.is_empty() || self.suspected
    }

    /// What the processes of its cgroup (and the cgroups below) hold, read from /proc (the kernel's word,
    /// whatever the records said), less what the mirror accounts for: an fd it has under that number, of that
    /// kind, or a mapping range it has at that address; and files that cannot carry GPU state (the MIG
    /// capability files CUDA keeps open, which the probes do not follow). What is left came to its holder in a
    /// way the probes do not see (SCM_RIGHTS, pidfd_getfd, a shared fd table, io_uring, a device node of
    /// another name).
    fn unaccounted_holders(&self, tracer: &mut Tracer, classifier: &Classifier) -> Vec<Holding> {
        let Some(dir) = tracer.cgroup_dir(self.cgroup_id) else {
            return Vec::new();
        };
        let table = tracer.fd_table();
        classifier
            .holdings_of_all(pids_of_cgroup_tree(&dir))
            .into_iter()
            .filter(|h| h.kind.carries_gpu_state() && !accounted(table, h))
            .collect()
    }

    /// Keeps the container held by `hidden`, and has the probes follow each holder from now on (its calls,
    /// closes and exit then come as records).
    fn follow_hidden(&mut self, tracer: &mut Tracer, hidden: &[Holding]) {
        let pids: BTreeSet<u32> = hidden.iter().map(|h| h.pid).collect();
        for h in hidden.iter().filter(|h| !self.hidden.contains(&h.pid)) {
            if matches!(h.via, Via::Unreadable(_)) {
                tracing::warn!(
                    id = self.registration.container.id,
                    "agent: {h}: it counts as holding, and the release waits for it: {}",
                    crate::holders::UNREADABLE_FIX
                );
                continue;
            }
            let mut known: Vec<(i32, baton_nvidia::fdkind::FdKind)> = tracer
                .fd_table()
                .get(h.pid)
                .map(|p| p.fds.iter().map(|(fd, nv)| (*fd, nv.kind)).collect())
                .unwrap_or_default();
            known.sort_unstable();
            tracing::warn!(
                id = self.registration.container.id,
                "agent: {h} holds an NVIDIA file the probes never saw it take (passed over a unix socket, \
                 taken with pidfd_getfd, a shared fd table, io_uring or a device node of another name): the \
                 release waits for it (the probes knew its NVIDIA fds {known:?}; /proc shows {:?})",
                h.kind
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

    /// The container's GPU state is gone and the kernel has released it: the `released` event, timed by
    /// `how` it ended.
    fn released(&mut self, tracer: &Tracer, state: &GpuState, how: Ended) -> Released {
        let now = now_monotonic_ns();
        let (last_removal, confirmation) = tracer.release_times(self.cgroup_id);
        let (t_last, t_released, confirmed_by) = match (how, last_removal, confirmation) {
            (Ended::Proc, last, _) => (last.unwrap_or(now), now, "proc"),
            // The last state went in an RM_FREE after the last removal: the driver freed it inside the
            // call, whose return the record is.
            (Ended::Freed(t), last, _) if last.is_none_or(|l| l <= t) => (t, t, "ioctl"),
            (_, Some(last), Some(c)) if c.t_ns >= last => (last, c.t_ns, c.kind.label()),
            // Released without a removal awaiting confirmation (a resync found the files gone).
            (_, last, _) => (last.unwrap_or(now), now, "resync"),
        };
        let confirmed_by = confirmed_by.to_owned();
        self.gpu = GpuHold::Released;
        self.since_ns = t_released;
        Released {
            pids: self.holders.iter().copied().collect(),
            t_last_close_ns: t_last,
            t_released_ns: t_released,
            confirmed_by,
            objects_freed: self.held_objects.saturating_sub(state.live_objects),
            bytes_freed: self.held_vram.saturating_sub(state.vram_bytes),
        }
    }

    fn note_holders(&mut self, tracer: &Tracer) {
        for (pid, p) in tracer.fd_table().iter() {
            if p.cgroup_id == self.cgroup_id {
                self.holders.insert(pid);
            }
        }
        // What a release frees: the most the ledger held while the container held the GPU.
        let state = tracer.gpu_state(self.cgroup_id);
        self.held_objects = self.held_objects.max(state.live_objects);
        self.held_vram = self.held_vram.max(state.vram_bytes);
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
            doubtful: ledger
                .map(|l| baton_agent_api::Doubtful {
                    objects: l.doubtful_objects(),
                    allocations: l.doubts.allocations,
                    frees_disputed: l.doubts.frees_disputed,
                })
                .filter(|d| *d != baton_agent_api::Doubtful::default()),
            preemption: self.preemption.clone(),
            role: self.registration.role.clone(),
            probe_fds: Some(baton_agent_api::ProbeFds {
                followed: tracer.cgroup_fd_entries(self.cgroup_id),
                quota: u64::from(tracer.fd_quota()),
                over_quota: tracer.over_fd_quota(self.cgroup_id),
            }),
            proc_check: self.proc_check.clone(),
        }
    }

    /// Whether it holds the GPU now (its last transition was `acquired`).
    pub fn is_held(&self) -> bool {
        self.gpu == GpuHold::Held
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

/// How a container's GPU state ended, for its `released` event.
#[derive(Clone, Copy, Debug)]
enum Ended {
    /// A removal (close, munmap, exit, ...) that the kernel confirmed.
    Removed,
    /// An RM_FREE that returned at this time.
    Freed(u64),
    /// /proc showed the mirror wrong (it was corrected).
    Proc,
}

/// Whether record `r` freed RM objects (an RM_FREE or a video-heap free the driver answered NV_OK for).
fn frees_state(r: &Record) -> bool {
    let Body::Ioctl(io) = &r.body else {
        return false;
    };
    io.ret == 0
        && io
            .decoded
            .status
            .is_none_or(|s| s == baton_nvidia::status::NV_OK)
        && matches!(
            io.decoded.op,
            Op::Free { .. } | Op::VidHeapFree { .. } | Op::UvmUnregisterGpu
        )
}

/// Whether record `r` created GPU state: an allocation the driver answered NV_OK for of a class that is more
/// than a handle, or a GPU registered with UVM.
fn creates_state(r: &Record) -> bool {
    let Body::Ioctl(io) = &r.body else {
        return false;
    };
    if io.ret != 0
        || io
            .decoded
            .status
            .is_some_and(|s| s != baton_nvidia::status::NV_OK)
    {
        return false;
    }
    match io.decoded.op {
        Op::Alloc { class, .. } | Op::AllocMemory { class, .. } => !class::is_handle_only(class),
        Op::VidHeapAlloc { .. } | Op::UvmRegisterGpu => true,
        _ => false,
    }
}

/// Whether the mirror accounts for what /proc shows in `h`: the same fd number of the same kind in the
/// same process, or a mapping range of that process at that address.
pub fn accounted(table: &FdTable, h: &Holding) -> bool {
    table.get(h.pid).is_some_and(|p| accounted_in(p, h))
}

/// [`accounted`] by the mirror of `h`'s process, `p`.
pub fn accounted_in(p: &ProcFds, h: &Holding) -> bool {
    match h.via {
        Via::Fd(fd) => p.fds.get(&fd).is_some_and(|nv| nv.kind == h.kind),
        Via::Map(addr) => p
            .maps
            .range(..=addr)
            .next_back()
            .is_some_and(|(start, m)| start.saturating_add(m.len) > addr),
        Via::Ring(_) | Via::Unreadable(_) => false,
    }
}
