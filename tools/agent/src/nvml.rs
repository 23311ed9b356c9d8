//! NVML, the cross-check of the ledger and of the release signal: each `released` event is followed by an
//! `nvml_check` event with NVML's view (the compute processes it still lists among the released pids, each
//! device's used memory), and `baton status` shows each device's used memory beside the ledger's. Without
//! NVML (no driver, as on CI) the view is `"unavailable"`.
//!
//! The check never delays `released`: the core publishes the release first and hands the check to
//! [`Checker`], a task that asks NVML on a blocking thread, one query at a time per node, each within a
//! time bound (`--nvml-timeout-ms`; a query past it is reported `timed_out`, and the next waits for it
//! within its own bound, so that NVML is never asked twice at once), and keeps at most [`QUEUE_CAPACITY`] releases waiting (under
//! a flood the oldest is dropped, reported `dropped`). On the H200 the query took 7 ms per release, all of it
//! on the agent's only thread before the release went out (/work/shared/gpu/580.159.04/README.md, Figures:
//! `released` at a subscriber 160.5 ms after the last close, the confirmation at 153.5 ms).
use std::{
    collections::{BTreeMap, BTreeSet, VecDeque},
    ffi::OsString,
    future::Future,
    sync::{Arc, Mutex, OnceLock, PoisonError},
    time::Duration,
};

use baton_agent_api::{
    ContainerRef, NvmlCheck, NvmlDevice, NvmlMissing, NvmlProcess, NvmlSeen, NvmlView,
};
use baton_tracer::now_monotonic_ns;
use nvml_wrapper::{Nvml, enums::device::UsedGpuMemory};
use tokio::{
    sync::{Notify, mpsc, oneshot},
    task::JoinHandle,
    time::Instant,
};

use crate::core::{Command, What};

/// The NVML library the agent loads when `--nvml-library` does not name one: NVIDIA's, through the dynamic
/// loader, as nvml-wrapper names it.
pub const DEFAULT_LIBRARY: &str = "libnvidia-ml.so.1";

/// How long one cross-check may take NVML by default, ms (the H200 answered in 7 ms; `nvmlInit` of a GPU
/// without persistence mode can take seconds, and the first check waits for it).
pub const DEFAULT_QUERY_BOUND_MS: u64 = 2_000;

/// How many releases may wait for their cross-check; beyond, the oldest is dropped.
pub const QUEUE_CAPACITY: usize = 64;

/// The library `nvml()` loads, set once by [`configure`].
static LIBRARY: OnceLock<OsString> = OnceLock::new();

/// The NVML library to load (`--nvml-library`); the first call wins. Call before [`initialise_in_background`].
pub fn configure(library: Option<std::path::PathBuf>) {
    let library = library.map_or_else(|| OsString::from(DEFAULT_LIBRARY), Into::into);
    let _ = LIBRARY.set(library);
}

/// NVML, initialised once (`None` when the library or the driver is missing).
fn nvml() -> Option<&'static Nvml> {
    static NVML: OnceLock<Option<Nvml>> = OnceLock::new();
    NVML.get_or_init(|| {
        let library = LIBRARY.get_or_init(|| OsString::from(DEFAULT_LIBRARY));
        match Nvml::builder().lib_path(library).init() {
            Ok(n) => {
                tracing::info!(
                    "agent: NVML loaded from {}: each release is cross-checked (nvml_check events)",
                    library.to_string_lossy()
                );
                Some(n)
            }
            Err(e) => {
                tracing::info!(
                    "agent: NVML unavailable from {} ({e}); nvml_check events carry nvml: \"unavailable\" \
                     (--nvml-library names another library)",
                    library.to_string_lossy()
                );
                None
            }
        }
    })
    .as_ref()
}

/// Loads and initialises NVML now, on a thread of its own, so that neither the first cross-check nor the
/// first `status` waits for loading the library and `nvmlInit` (milliseconds without a driver, far longer
/// with one).
pub fn initialise_in_background() {
    std::thread::spawn(|| {
        if let Some(capacities) = read_capacities() {
            tracing::info!(
                ?capacities,
                "agent: NVML: each GPU's memory (by minor): the gate lets a Start through beside holders when \
                 its baton.io/gpu-memory fits"
            );
            let _ = CAPACITIES.set(capacities);
        }
    });
}

/// Each GPU's memory by minor, read once after NVML's initialisation.
static CAPACITIES: OnceLock<BTreeMap<u32, u64>> = OnceLock::new();

/// Each GPU's memory (NVML's total) by its minor number (N of `/dev/nvidiaN`): `None` without NVML, or
/// while it is still being initialised. Never blocks: the core calls it.
pub fn capacity_by_minor() -> Option<&'static BTreeMap<u32, u64>> {
    CAPACITIES.get()
}

/// NVML's total memory of each device by minor (blocking: NVML's calls; `None` without NVML).
fn read_capacities() -> Option<BTreeMap<u32, u64>> {
    Some(
        devices()?
            .iter()
            .filter_map(|(_, d)| Some((d.minor_number().ok()?, d.memory_info().ok()?.total)))
            .collect(),
    )
}

/// NVML's devices with their indices; `None` without NVML.
fn devices() -> Option<Vec<(u32, nvml_wrapper::Device<'static>)>> {
    let nvml = nvml()?;
    let count = nvml.device_count().ok()?;
    Some(
        (0..count)
            .filter_map(|index| nvml.device_by_index(index).ok().map(|d| (index, d)))
            .collect(),
    )
}

/// Each device's used memory by its minor number (N of `/dev/nvidiaN`); `None` without NVML.
pub fn used_by_minor() -> Option<BTreeMap<u32, u64>> {
    let memory = memory_by_minor()?;
    Some(memory.into_iter().map(|(m, mem)| (m, mem.used)).collect())
}

/// Each device's total and used memory by its minor number; `None` without NVML (a device whose memory
/// cannot be read is left out). Blocking: NVML's calls.
pub fn memory_by_minor() -> Option<BTreeMap<u32, crate::gate::floor::Memory>> {
    Some(
        devices()?
            .iter()
            .filter_map(|(_, d)| {
                let m = d.memory_info().ok()?;
                let memory = crate::gate::floor::Memory {
                    total: m.total,
                    used: m.used,
                };
                Some((d.minor_number().ok()?, memory))
            })
            .collect(),
    )
}

/// Asks NVML for [`memory_by_minor`] on a blocking thread; the answer goes to the core (`What::NvmlMemory`,
/// with `asked_ns`). False when no checker runs (a core in a unit test).
pub fn ask_memory(asked_ns: u64) -> bool {
    ask_core(move || What::NvmlMemory {
        asked_ns,
        memory: memory_by_minor(),
    })
}

/// Runs `answer` (NVML's calls) on a blocking thread and sends what it says to the core. False when no
/// checker runs (a core in a unit test).
fn ask_core(answer: impl FnOnce() -> What + Send + 'static) -> bool {
    let Some(core) = CORE.get().cloned() else {
        return false;
    };
    tokio::task::spawn_blocking(move || {
        let (reply, _) = oneshot::channel();
        let _ = core.blocking_send(Command {
            what: answer(),
            peer_pid: 0,
            reply,
        });
    });
    true
}

/// What NVML says now of `pids` and the devices (blocking: NVML's calls).
pub fn view(pids: &BTreeSet<u32>) -> NvmlView {
    let Some(all) = devices() else {
        return NvmlView::Missing(NvmlMissing::Unavailable);
    };
    let mut seen = NvmlSeen::default();
    for (index, device) in &all {
        if let Ok(memory) = device.memory_info() {
            seen.devices.push(NvmlDevice {
                device: *index,
                minor: device.minor_number().ok(),
                used_bytes: memory.used,
            });
        }
        for p in device.running_compute_processes().unwrap_or_default() {
            if pids.contains(&p.pid) {
                let used_bytes = match p.used_gpu_memory {
                    UsedGpuMemory::Used(b) => Some(b),
                    UsedGpuMemory::Unavailable => None,
                };
                seen.processes.push(NvmlProcess {
                    device: *index,
                    pid: p.pid,
                    used_bytes,
                });
            }
        }
    }
    NvmlView::Seen(seen)
}

/// The pids NVML lists as running on a GPU: its compute processes, and its graphics ones where the library
/// has that call; each has a context or device memory there. `None` without NVML, or when a device's
/// compute processes cannot be read (then open files decide, see [`crate::gate::gpu_users`]). Blocking.
pub fn gpu_users() -> Option<BTreeSet<u32>> {
    let mut users = BTreeSet::new();
    for (_, device) in devices()? {
        let compute = device.running_compute_processes().ok()?;
        users.extend(compute.into_iter().map(|p| p.pid));
        if let Ok(graphics) = device.running_graphics_processes() {
            users.extend(graphics.into_iter().map(|p| p.pid));
        }
    }
    Some(users)
}

/// The core, for answers it asked for ([`ask_gpu_users`]); set by [`start`].
static CORE: OnceLock<mpsc::Sender<Command>> = OnceLock::new();

/// Asks NVML for [`gpu_users`] on a blocking thread; the answer goes to the core (`What::GpuUsers`, with
/// `asked_ns`). False when no checker runs (a core in a unit test).
pub fn ask_gpu_users(asked_ns: u64) -> bool {
    ask_core(move || What::GpuUsers {
        asked_ns,
        users: gpu_users(),
    })
}

/// A published release whose cross-check is to come.
#[derive(Clone, Debug)]
pub struct Pending {
    /// Its container.
    pub container: ContainerRef,
    /// Who registered the container (the check goes to the same watchers).
    pub owner: u32,
    /// The `released` event's `seq`.
    pub released_seq: u64,
    /// Its `t_released_ns`.
    pub t_released_ns: u64,
    /// Its `pids`.
    pub pids: Vec<u32>,
}

/// A cross-check to publish: the release it checks and NVML's answer.
#[derive(Clone, Debug)]
pub struct Checked {
    /// The release.
    pub pending: Pending,
    /// CLOCK_MONOTONIC ns when the agent began asking NVML (0: not asked); a query still running from an
    /// earlier check is waited for first.
    pub t_asked_ns: u64,
    /// How long it took, ns.
    pub took_ns: u64,
    /// What it said.
    pub view: NvmlView,
}

impl Checked {
    /// The check of `pending` that was never asked (dropped under a flood).
    fn dropped(pending: Pending) -> Self {
        Self {
            pending,
            t_asked_ns: 0,
            took_ns: 0,
            view: NvmlView::Missing(NvmlMissing::Dropped),
        }
    }

    /// The `nvml_check` event's body; its container and owner.
    pub fn into_event(self) -> (ContainerRef, u32, NvmlCheck) {
        let p = self.pending;
        let check = NvmlCheck {
            released_seq: p.released_seq,
            t_released_ns: p.t_released_ns,
            pids: p.pids,
            t_asked_ns: self.t_asked_ns,
            took_ns: self.took_ns,
            nvml: self.view,
        };
        (p.container, p.owner, check)
    }
}

/// The releases waiting for their cross-check, oldest first, at most `capacity`.
struct Queue {
    waiting: Mutex<VecDeque<Pending>>,
    ready: Notify,
    capacity: usize,
}

impl Queue {
    /// Adds `p`; returns the oldest waiting one when the queue was full (it is dropped).
    fn push(&self, p: Pending) -> Option<Pending> {
        let mut waiting = self.waiting.lock().unwrap_or_else(PoisonError::into_inner);
        let dropped = (waiting.len() >= self.capacity)
            .then(|| waiting.pop_front())
            .flatten();
        waiting.push_back(p);
        drop(waiting);
        self.ready.notify_one();
        dropped
    }

    /// The oldest waiting release, when there is one.
    async fn pop(&self) -> Pending {
        loop {
            let next = self
                .waiting
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .pop_front();
            if let Some(p) = next {
                return p;
            }
            // A push between the look and the wait leaves a permit: the wait ends at once.
            self.ready.notified().await;
        }
    }
}

/// The one query NVML is answering (or the last; `None` when it has answered).
type Busy = Option<JoinHandle<NvmlView>>;

/// The node's cross-checker: a queue of published releases and the task that asks NVML for each.
#[derive(Clone)]
pub struct Checker {
    queue: Arc<Queue>,
}

/// The agent's checker, once [`start`] ran.
static CHECKER: OnceLock<Checker> = OnceLock::new();

/// Starts the agent's checker on the current runtime, each query bounded by `bound`: each cross-check goes
/// to the core (`core`), which publishes it. NVML is loaded from the library [`configure`] named.
pub fn start(core: mpsc::Sender<Command>, bound: Duration) {
    let _ = CORE.set(core.clone());
    let deliver = move |checked| {
        let core = core.clone();
        async move {
            let (reply, _) = oneshot::channel();
            let what = What::NvmlChecked(Box::new(checked));
            core.send(Command {
                what,
                peer_pid: 0,
                reply,
            })
            .await
            .is_ok()
        }
    };
    let _ = CHECKER.set(Checker::spawn(QUEUE_CAPACITY, bound, view, deliver));
}

/// Queues the cross-check of a release the core just published; returns the check to publish at once in
/// its stead when one was dropped (the queue was full). Without a checker (none started) nothing is checked.
pub fn check_later(p: Pending) -> Option<Checked> {
    CHECKER.get()?.push(p)
}

impl Checker {
    /// A checker keeping at most `capacity` releases waiting, asking `query` for each (on a blocking
    /// thread, one at a time) within `bound`, handing each answer to `deliver` until it returns false.
    pub fn spawn<Q, F, Fut>(capacity: usize, bound: Duration, query: Q, mut deliver: F) -> Self
    where
        Q: Fn(&BTreeSet<u32>) -> NvmlView + Send + Sync + Clone + 'static,
        F: FnMut(Checked) -> Fut + Send + 'static,
        Fut: Future<Output = bool> + Send,
    {
        let queue = Arc::new(Queue {
            waiting: Mutex::new(VecDeque::new()),
            ready: Notify::new(),
            capacity: capacity.max(1),
        });
        let waiting = Arc::clone(&queue);
        tokio::spawn(async move {
            let mut busy: Busy = None;
            loop {
                let pending = waiting.pop().await;
                let checked = ask(&mut busy, pending, bound, query.clone()).await;
                if !deliver(checked).await {
                    return;
                }
            }
        });
        Self { queue }
    }

    /// Queues `p`; returns the check dropped to make room, if any.
    pub fn push(&self, p: Pending) -> Option<Checked> {
        self.queue.push(p).map(Checked::dropped)
    }
}

/// Asks `query` for `pending`'s pids within `bound` from now: first waits for a query still running (one
/// that outlived its own bound), then runs this one on a blocking thread.
async fn ask<Q>(busy: &mut Busy, pending: Pending, bound: Duration, query: Q) -> Checked
where
    Q: Fn(&BTreeSet<u32>) -> NvmlView + Send + Sync + 'static,
{
    let deadline = Instant::now() + bound;
    let t_asked_ns = now_monotonic_ns();
    let timed_out = |pending| Checked {
        pending,
        t_asked_ns,
        took_ns: u64::try_from(bound.as_nanos()).unwrap_or(u64::MAX),
        view: NvmlView::Missing(NvmlMissing::TimedOut),
    };
    if let Some(running) = busy.as_mut() {
        if tokio::time::timeout_at(deadline, running).await.is_err() {
            return timed_out(pending);
        }
        *busy = None;
    }
    let pids: BTreeSet<u32> = pending.pids.iter().copied().collect();
    let running = busy.insert(tokio::task::spawn_blocking(move || query(&pids)));
    match tokio::time::timeout_at(deadline, running).await {
        Err(_) => timed_out(pending),
        Ok(result) => {
            *busy = None;
            let view = result.unwrap_or_else(|e| {
                tracing::warn!("agent: an NVML query failed ({e})");
                NvmlView::Missing(NvmlMissing::Unavailable)
            });
            Checked {
                pending,
                t_asked_ns,
                took_ns: now_monotonic_ns().saturating_sub(t_asked_ns),
                view,
            }
        }
    }
}

#[cfg(test)]
mod tests;
