//! The gate's waiting Starts in the core: each waits until no other container holds one of its devices
//! (the watched holders the probes see, the releases not confirmed yet, then the holders only /proc
//! shows), asking gap-fill to preempt for it meanwhile; one still held at its deadline fails, naming who
//! holds its GPU.
use baton_agent_api::{ContainerRef, GateRequest, Reply};
use baton_tracer::now_monotonic_ns;
use tokio::sync::oneshot;

use super::{DeviceKey, Waiter, devices_held, devices_seen};
use crate::{
    core::Core,
    gapfill,
    holders::{Holding, NodeScan, ScanRequest, Via},
    registry::watched::Watched,
};

impl Core {
    /// Puts a Start behind the gate until its devices are free (answered at once when they are), or fails
    /// it when its container is not watched.
    pub(crate) fn add_waiter(&mut self, request: GateRequest, reply: oneshot::Sender<Reply>) {
        let Some(w) = self.watched.get(&request.container) else {
            let _ = reply.send(Reply::Error {
                error: format!(
                    "container {} is not watched by the agent: nothing tells whether its GPU is free",
                    request.container.id
                ),
            });
            return;
        };
        let devices = devices_seen(w.registration.init_pid, &w.registration.devices);
        // The socket's check refused a longer one; kept in bounds here too, as the deadline's sum panics.
        let timeout = std::time::Duration::from_millis(request.timeout_ms)
            .min(baton_agent_api::MAX_WAIT_GPU_FREE);
        let cgroup = w.registration.cgroup.clone();
        let need = self.declared_need(&request.container);
        self.waiters.push(Waiter {
            container: request.container,
            cgroup,
            hidden_logged: false,
            clear_since_ns: None,
            devices,
            need,
            asked_ns: now_monotonic_ns(),
            deadline: tokio::time::Instant::now() + timeout,
            reply,
            unparkable: Default::default(),
            floor: None,
            floor_logged: false,
        });
        self.check_gates();
    }

    /// The other watched containers that hold the GPU (GPU state, or a release not confirmed yet: see
    /// [`Watched`]) on a device in `devices` (any GPU device when empty). Which device a container's state is
    /// on is told by its open device files; one that holds state with none open (its state kept alive by a
    /// mapping, or by a ctl file alone) counts as holding every device.
    pub(crate) fn holders(
        &self,
        me: &ContainerRef,
        devices: &std::collections::BTreeSet<DeviceKey>,
    ) -> Vec<&Watched> {
        let Some(tracer) = self.tracer.as_ref() else {
            return Vec::new();
        };
        self.watched
            .iter()
            .filter(|(c, w)| *c != me && w.is_held())
            .filter(|(_, w)| {
                let held = devices_held(tracer, w.cgroup_id);
                held.is_empty()
                    || devices.is_empty()
                    || held
                        .iter()
                        .any(|d| devices.iter().any(|w| w.same_device(d)))
            })
            .map(|(_, w)| w)
            .collect()
    }

    /// What the probes follow in watched containers, for a node scan: the mirror's files of their processes,
    /// except in a container past its quota of the probes' fd map (what it did through the fds the probes do
    /// not follow is not in its ledger, so it is followed through /proc and NVML like an unwatched process).
    /// Whether a followed file's container holds the GPU is the registry's to say, not the file's being open.
    fn followed_files(&self) -> std::collections::HashMap<u32, baton_tracer::fdtable::ProcFds> {
        let Some(tracer) = self.tracer.as_ref() else {
            return Default::default();
        };
        tracer
            .fd_table()
            .iter()
            .filter(|(_, p)| {
                self.by_cgroup.contains_key(&p.cgroup_id) && !tracer.over_fd_quota(p.cgroup_id)
            })
            .map(|(pid, p)| (pid, p.clone()))
            .collect()
    }

    /// Who keeps waiter `w` from starting among the watched containers: those that hold the GPU on one of
    /// its devices (their release not published yet), or one let through the gate before it that holds no
    /// GPU state yet. Empty when none does.
    fn watched_holders(&self, w: &Waiter) -> Vec<String> {
        let server = self.watched.get(&w.container);
        let watched: Vec<String> = self
            .holders(&w.container, &w.devices)
            .iter()
            .map(|h| {
                let c = &h.registration.container;
                let why = if self.gapfill.is_being_preempted(c) {
                    " (the agent is preempting it)"
                } else {
                    ""
                };
                let kept = server
                    .and_then(|s| gapfill::why_kept(s, h))
                    .map_or_else(String::new, |y| format!(" ({y})"));
                let what = self
                    .tracer
                    .as_ref()
                    .map_or_else(String::new, |t| describe_state(&t.gpu_state(h.cgroup_id)));
                format!(
                    "container {} (namespace {}){why}{kept}{what}",
                    c.id, c.namespace
                )
            })
            .collect();
        if !watched.is_empty() {
            return watched;
        }
        // One gate at a time per GPU: a container let through that holds no GPU state yet keeps the others
        // out until it does (then its hold counts), or its claim lapses.
        if let Some(c) = self.gapfill.claimed_by(&w.container, &w.devices) {
            return vec![format!(
                "container {} (namespace {}) (let through the gate before it: it has not allocated on the \
                 GPU yet)",
                c.id, c.namespace
            )];
        }
        Vec::new()
    }

    /// The processes that keep waiter `w` from starting once no watched container does: every process the
    /// latest node scan showed holding one of its device files that the probes do not follow in a watched
    /// container (in any container: a file passed over a socket, a container Baton does not watch) and that
    /// uses the GPU by NVML's word where the node has NVML ([`super::gpu_users`]); and whether NVML is to be
    /// asked about them. `None` while there is no scan `w` may trust: one asked after its watched holders
    /// were gone, looking at its devices (`fresh` false: any scan of its devices, for messages).
    fn hidden_holders(&self, w: &Waiter, fresh: bool) -> Option<(Vec<Holding>, bool)> {
        // A container whose GPU devices could not be resolved (its root not set up yet, under a hook) waits
        // for the watched holders only: "any GPU on the node" would make it wait for every other GPU.
        if w.devices.is_empty() {
            return Some((Vec::new(), false));
        }
        let scan = self.node_scan.as_ref().filter(|s| {
            s.devices.is_superset(&w.devices)
                && (!fresh || w.clear_since_ns.is_some_and(|t| s.asked_ns >= t))
        })?;
        let hidden = scan.holders_of(&w.devices, &w.cgroup);
        Some(self.gpu_users.using(hidden, now_monotonic_ns()))
    }

    /// Asks for a look at the node for the devices of `devices` (the waiters with no scan to trust), unless
    /// one is out: its answer checks the gates again, which asks again if need be.
    pub(crate) fn scan_node_for(&mut self, devices: std::collections::BTreeSet<DeviceKey>) {
        if devices.is_empty() || self.offload.is_scanning() {
            return;
        }
        let request = ScanRequest {
            classifier: self.classifier.clone(),
            exempt: self.exempt.clone(),
            devices,
            followed: self.followed_files(),
            asked_ns: now_monotonic_ns(),
        };
        self.offload.scan(request);
    }

    /// A node scan came back: the gates are checked with it.
    pub(crate) fn on_node_scanned(&mut self, scan: NodeScan) {
        if scan.took > std::time::Duration::from_millis(100) {
            tracing::debug!(
                took_ms = scan.took.as_millis() as u64,
                "agent: the gate's look at the node's /proc was slow"
            );
        }
        self.node_scan = Some(scan);
        self.check_gates();
    }

    /// Looks at the node again for the waiters that wait for holders only /proc shows (the recheck).
    pub(crate) fn rescan_for_gates(&mut self) {
        let devices: std::collections::BTreeSet<DeviceKey> = self
            .waiters
            .iter()
            .filter(|w| w.clear_since_ns.is_some())
            .flat_map(|w| w.devices.iter().cloned())
            .collect();
        self.scan_node_for(devices);
    }

    /// Answers every waiter whose devices nobody else holds now.
    pub(crate) fn check_gates(&mut self) {
        if self.waiters.is_empty() {
            return;
        }
        // A claim ends once its container holds GPU state (its hold counts from then on) or is not watched.
        let watched = &self.watched;
        self.gapfill
            .settle_claims(|c| watched.get(c).is_none_or(Watched::is_held));
        let waiters = std::mem::take(&mut self.waiters);
        let now = now_monotonic_ns();
        let mut hidden_wait = false;
        let mut ask_nvml = false;
        let mut ask_floor = false;
        let mut scan_for = std::collections::BTreeSet::new();
        for mut w in waiters {
            // One whose need fits beside the holders is kept out by none of them (see `room.rs`).
            let fit = self.fit_of(&w);
            let watched = if fit.fits() {
                Vec::new()
            } else {
                self.watched_holders(&w)
            };
            let hidden = if watched.is_empty() {
                w.clear_since_ns.get_or_insert(now);
                self.hidden_holders(&w, true)
            } else {
                w.clear_since_ns = None;
                Some((Vec::new(), false))
            };
            let hidden = match hidden {
                Some((hidden, ask)) => {
                    ask_nvml |= ask;
                    hidden
                }
                None => {
                    // Not known yet: the gate stays shut until a scan asked from now on comes back.
                    scan_for.extend(w.devices.iter().cloned());
                    if !fit.fits() {
                        self.gap_fill_preempt_for(&mut w);
                    }
                    self.waiters.push(w);
                    continue;
                }
            };
            // A co-runner preempted for it lets it through on its release signal (confirmed), not before.
            let unreleased = self.gapfill.awaits_release(&w.devices);
            if watched.is_empty() && hidden.is_empty() && !unreleased {
                // The ledgers let it through; NVML, where the node has it, must too (`floor.rs`).
                w.floor = self.floor_holds(&w, fit.fits());
                match &w.floor {
                    None => {
                        self.open_gate(w, fit);
                        continue;
                    }
                    Some(super::floor::Hold::Unread) => ask_floor = true,
                    Some(hold) => {
                        hidden_wait = true;
                        if !w.floor_logged {
                            w.floor_logged = true;
                            tracing::warn!(
                                id = w.container.id,
                                "agent: the gate stays shut: {}",
                                hold.describe(self.floor.tolerance)
                            );
                        }
                    }
                }
            } else {
                w.floor = None;
            }
            if !hidden.is_empty() {
                hidden_wait = true;
                log_hidden_once(&mut w, &hidden);
            }
            if !fit.fits() {
                self.gap_fill_preempt_for(&mut w);
            }
            self.waiters.push(w);
        }
        self.scan_node_for(scan_for);
        if hidden_wait {
            self.schedule_recheck();
        }
        if ask_floor {
            self.ask_floor();
        }
        if ask_nvml {
            let now = now_monotonic_ns();
            if self.gpu_users.ask(now) && !crate::nvml::ask_gpu_users(now) {
                // No NVML task (a core without one): files decided this round, and will.
                self.gpu_users.answered(now, None);
            }
        }
    }

    /// The Starts of container `c`, no longer watched, waiting at the gate get an error: a gate that opened
    /// for it later would claim a GPU for a container that is gone.
    pub(crate) fn drop_waiters_of(&mut self, c: &ContainerRef) {
        let (gone, kept): (Vec<Waiter>, Vec<Waiter>) = std::mem::take(&mut self.waiters)
            .into_iter()
            .partition(|w| w.container == *c);
        self.waiters = kept;
        for w in gone {
            let _ = w.reply.send(Reply::Error {
                error: format!(
                    "container {} is no longer watched (unregistered): its wait for a free GPU ends",
                    c.id
                ),
            });
        }
    }

    /// Lets waiter `w` start: its GPU is free, and claimed for it until it holds GPU state there (against the
    /// other waiters and gap-fill).
    fn open_gate(&mut self, w: Waiter, fit: super::room::Fit) {
        let now = now_monotonic_ns();
        // Who it starts beside is read only for a Start that went through on room (a whole-GPU one has none).
        let beside: Vec<String> = if fit.fits() {
            self.holders(&w.container, &w.devices)
                .iter()
                .map(|h| h.registration.container.id.clone())
                .collect()
        } else {
            Vec::new()
        };
        if !beside.is_empty() {
            let detail = format!(
                "started beside {} (fits: {})",
                beside.join(", "),
                fit.describe()
            );
            tracing::info!(id = w.container.id, "agent: the gate opens: {detail}");
            self.note(&crate::core::Note {
                container: w.container.clone(),
                t_ns: now,
                kind: crate::core::NoteKind::Room {
                    what: "beside",
                    detail,
                },
            });
        } else {
            tracing::info!(
                id = w.container.id,
                "agent: the GPU is free: the gate opens"
            );
        }
        self.gapfill.claim(&w.container, &w.devices);
        let _ = w.reply.send(Reply::GpuFree {
            waited_ns: now.saturating_sub(w.asked_ns),
            t_free_ns: now,
        });
    }

    /// Fails the waiters past their deadline, naming who still holds the GPU.
    pub(crate) fn expire_gates(&mut self) {
        let now = tokio::time::Instant::now();
        let waiters = std::mem::take(&mut self.waiters);
        for w in waiters {
            if w.deadline > now {
                self.waiters.push(w);
                continue;
            }
            let error = self.still_held(&w);
            let _ = w.reply.send(Reply::Error { error });
        }
    }

    /// Why waiter `w`'s GPU is not free at its deadline.
    fn still_held(&self, w: &Waiter) -> String {
        let waited = std::time::Duration::from_nanos(now_monotonic_ns().saturating_sub(w.asked_ns));
        // Set only when the ledgers let it through at its last check: NVML is what kept it.
        if let Some(hold) = &w.floor {
            return format!(
                "the GPU was not free within {waited:?} ({}): {}",
                self.fit_of(w).describe(),
                hold.describe(self.floor.tolerance)
            );
        }
        let watched = self.watched_holders(w);
        let hidden = self
            .hidden_holders(w, false)
            .map(|(h, _)| h)
            .unwrap_or_default();
        if !watched.is_empty() {
            let fit = self.fit_of(w);
            let room = match fit {
                super::room::Fit::Short { .. } | super::room::Fit::Never { .. } => {
                    format!(" ({})", fit.describe())
                }
                _ => String::new(),
            };
            let mut unparkable: String = w
                .unparkable
                .iter()
                .map(|(c, why)| format!("; {} was not parked: {why}", c.id))
                .collect();
            if w.need.is_some() {
                for whole in self.whole_gpu_holders(w) {
                    unparkable.push_str("; ");
                    unparkable.push_str(&whole);
                }
            }
            format!(
                "the GPU is still held by {} after {waited:?}{room}{unparkable}",
                watched.join(", ")
            )
        } else if !hidden.is_empty() {
            format!(
                "the GPU is still held after {waited:?}: {}",
                describe_hidden(&hidden)
            )
        } else if self.offload.is_scanning() {
            format!(
                "the GPU was not free within {waited:?}: the agent's look at the node's processes (/proc) had \
                 not come back"
            )
        } else {
            format!("the GPU was not free within {waited:?}")
        }
    }
}

/// What a holder holds, for the gate's messages: ` (holding N objects that are more than handles, ...)`.
fn describe_state(s: &baton_tracer::GpuState) -> String {
    let mut parts = Vec::new();
    if s.state_objects > 0 {
        parts.push(format!(
            "{} object(s) that are more than handles ({} MiB of video memory)",
            s.state_objects,
            s.vram_bytes >> 20
        ));
    }
    if s.uvm_gpus > 0 {
        parts.push(format!("{} GPU(s) registered with UVM", s.uvm_gpus));
    }
    if s.opaque_files > 0 {
        parts.push(format!(
            "{} NVIDIA file(s) whose contents the probes never saw",
            s.opaque_files
        ));
    }
    if s.unconfirmed > 0 {
        parts.push(format!(
            "{} release(s) the kernel has not finished",
            s.unconfirmed
        ));
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!(" (holding {})", parts.join(", "))
    }
}

/// Logs, once per waiter, the holders only /proc shows that keep `w` waiting.
fn log_hidden_once(w: &mut Waiter, hidden: &[Holding]) {
    if !w.hidden_logged {
        w.hidden_logged = true;
        tracing::warn!(
            id = w.container.id,
            "agent: the gate stays shut: {}",
            describe_hidden(hidden)
        );
    }
}

/// The processes of `hidden` and what they hold, for a log line or an error: each with its cgroup, since
/// the probes may not know its container.
fn describe_hidden(hidden: &[Holding]) -> String {
    let (unreadable, files): (Vec<Holding>, Vec<Holding>) = hidden
        .iter()
        .cloned()
        .partition(|h| matches!(h.via, Via::Unreadable(_)));
    let mut parts = Vec::new();
    if !files.is_empty() {
        parts.push(describe_files(&files));
    }
    if !unreadable.is_empty() {
        parts.push(describe_unreadable(&unreadable));
    }
    parts.join("; ")
}

/// The processes of `unreadable` (each once), which count as holding every GPU: all their pids (up to 64),
/// the first few with why and their cgroup, and what the agent needs.
fn describe_unreadable(unreadable: &[Holding]) -> String {
    let mut pids: Vec<u32> = unreadable.iter().map(|h| h.pid).collect();
    pids.sort_unstable();
    pids.dedup();
    let listed: Vec<String> = pids.iter().take(64).map(u32::to_string).collect();
    let more = match pids.len().saturating_sub(listed.len()) {
        0 => String::new(),
        n => format!(" and {n} more"),
    };
    let each: Vec<String> = unreadable.iter().take(3).map(with_cgroup).collect();
    format!(
        "{} process(es) whose files the agent cannot read count as holding every GPU: pid(s) {}{more} ({}): {}",
        pids.len(),
        listed.join(", "),
        each.join("; "),
        crate::holders::UNREADABLE_FIX
    )
}

/// Holding `h` and its holder's cgroup: the probes may not know its container.
fn with_cgroup(h: &Holding) -> String {
    let cgroup = baton_tracer::cgroups::v2_path_of_pid(h.pid)
        .unwrap_or_else(|| "an unknown cgroup".to_owned());
    format!("{h} in cgroup {cgroup}")
}

/// [`describe_hidden`] of holders whose files /proc showed.
fn describe_files(hidden: &[Holding]) -> String {
    let mut pids: Vec<u32> = hidden.iter().map(|h| h.pid).collect();
    pids.sort_unstable();
    pids.dedup();
    let each: Vec<String> = hidden.iter().take(8).map(with_cgroup).collect();
    let more = match hidden.len().saturating_sub(each.len()) {
        0 => String::new(),
        n => format!("; and {n} more"),
    };
    format!(
        "{} process(es) hold its device files as /proc shows: {}{more}",
        pids.len(),
        each.join("; ")
    )
}
