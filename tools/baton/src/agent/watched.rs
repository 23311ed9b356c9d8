//! One watched container in the agent: its registration, its GPU hold state and the transitions the
//! probes' records cause (acquired: the first NVIDIA file opened while it held none; released: none of its
//! processes holds an NVIDIA file or mapping any more).
use std::collections::BTreeSet;

use baton_agent_api::{
    Acquired, ContainerStatus, EventBody, GpuHold, ProcessStatus, Registration, Released,
};
use baton_tracer::{
    Tracer,
    event::{Body, Event as Record},
};

use crate::trace::now_monotonic_ns;

/// A watched container.
pub struct Watched {
    /// What its shim registered.
    pub registration: Registration,
    /// The pid of the process that registered it.
    pub owner: u32,
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
}

impl Watched {
    /// A container just watched; `tracer` has seeded what its processes already hold.
    pub fn new(
        registration: Registration,
        owner: u32,
        cgroup_id: u64,
        tracer: &Tracer,
        now_ns: u64,
    ) -> Self {
        let mut w = Self {
            registration,
            owner,
            cgroup_id,
            gpu: GpuHold::Never,
            since_ns: now_ns,
            partial: false,
            holders: BTreeSet::new(),
            held_objects: 0,
            held_vram: 0,
        };
        if holds_files(tracer, cgroup_id) {
            w.gpu = GpuHold::Held;
            w.partial = true;
            w.note_holders(tracer);
        }
        w
    }

    /// Applies a batch of records; returns the transition it caused, if any.
    pub fn update(&mut self, tracer: &Tracer, records: &[Record]) -> Option<EventBody> {
        let mine = || records.iter().filter(|r| r.cgroup_id == self.cgroup_id);
        // Records of other containers change nothing here.
        mine().next()?;
        let holds = holds_files(tracer, self.cgroup_id);
        let was_held = self.gpu == GpuHold::Held;
        let transition = match (was_held, holds) {
            (false, true) => {
                let open = mine().find(|r| matches!(r.body, Body::Open { .. }));
                let (pid, t) = open.map_or((0, now_monotonic_ns()), |r| (r.pid, r.ts_ns));
                self.holders.clear();
                self.gpu = GpuHold::Held;
                self.since_ns = t;
                Some(EventBody::Acquired(Acquired {
                    pid,
                    t_acquired_ns: t,
                }))
            }
            (true, false) => {
                let last = mine().rev().find(|r| {
                    matches!(
                        r.body,
                        Body::Close { .. } | Body::Munmap { .. } | Body::Exec | Body::Exit
                    )
                });
                let t_last = last.map_or(now_monotonic_ns(), |r| r.ts_ns);
                for r in mine() {
                    self.holders.insert(r.pid);
                }
                self.gpu = GpuHold::Released;
                self.since_ns = t_last;
                let state = tracer.gpu_state(self.cgroup_id);
                Some(EventBody::Released(Released {
                    pids: self.holders.iter().copied().collect(),
                    t_last_close_ns: t_last,
                    t_released_ns: t_last,
                    confirmed_by: "syscall_exit".to_owned(),
                    objects_freed: self.held_objects.saturating_sub(state.live_objects),
                    bytes_freed: self.held_vram.saturating_sub(state.vram_bytes),
                    nvml: super::nvml::view(&self.holders),
                }))
            }
            _ => None,
        };
        if holds {
            self.note_holders(tracer);
        }
        transition
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
            live_objects: state.live_objects,
            vram_bytes: state.vram_bytes,
            peak_vram_bytes: ledger.map_or(0, |l| l.peak_vram_bytes()),
            gpu: self.gpu,
            since_ns: self.since_ns,
            partial: self.partial || ledger.is_some_and(|l| l.partial),
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

/// Whether any process of the container holds an NVIDIA fd or mapping (kernel facts only: what a process
/// writes into its call parameters cannot make it look released).
fn holds_files(tracer: &Tracer, cgroup_id: u64) -> bool {
    let s = tracer.gpu_state(cgroup_id);
    s.open_fds > 0 || s.mappings > 0
}
