//! Where Baton's eBPF GPU tracer plugs into the shim.
//!
//! The task service calls [`GpuTracing::container_created`] once runc has created a container (its init
//! process exists and its mounts are in place, but the user's program has not started), again
//! [`GpuTracing::container_started`] after Start (a restored container only has a pid then), and
//! [`GpuTracing::container_deleted`] when the container is deleted. Create waits (a few seconds at most) until
//! the probes watch the container, so that its program's first call into the driver is seen. A container that can see NVIDIA device
//! files (in its own root, under the directory of its `trace_prefix`) and has `ebpf` on is watched: the shim
//! loads the probes once, in the background, and keeps the container's ledger of GPU objects and memory from
//! the calls its processes make. It logs when a watched container's CUDA state has left the driver (the
//! signal the planned overlapped preemption builds on) and a summary at delete.
//!
//! Nothing here can fail a container: if the probes cannot load, containers run as with plain runc and the
//! reason is logged once. Only shims of containers that see NVIDIA devices load probes, so a node pays for
//! one probe set per GPU pod, not per pod; a single node-wide probe set shared by the shims is planned (a node agent).
use std::{
    collections::HashMap,
    path::Path,
    sync::{
        Mutex,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use baton_tracer::{Tracer, TracerConfig};
use tokio::sync::{mpsc, oneshot};

use crate::options::BatonSettings;

/// What the tracer needs to know about a started container.
#[derive(Debug, Clone, Copy)]
pub struct StartedContainer<'a> {
    /// Container id.
    pub id: &'a str,
    /// Pid of the init process (host pid namespace).
    pub init_pid: u32,
    /// cgroup v2 path of the container (the `0::` line of /proc/<pid>/cgroup), if any.
    pub cgroup_v2_path: Option<&'a str>,
    /// Baton settings after the TOML / pod / container layering.
    pub settings: &'a BatonSettings,
}

/// Requests to the tracer task.
#[derive(Debug)]
enum Request {
    Watch {
        id: String,
        cgroup: String,
        done: Option<oneshot::Sender<()>>,
    },
    Forget {
        id: String,
    },
}

/// How long Create waits for the probes to load and watch the container before it goes on without them.
const WATCH_TIMEOUT: Duration = Duration::from_secs(5);

/// The GPU tracing hook of one shim (one per shim, shared by its containers).
#[derive(Debug, Default)]
pub struct GpuTracing {
    reason_logged: AtomicBool,
    tracer: Mutex<Option<mpsc::UnboundedSender<Request>>>,
}

impl GpuTracing {
    /// A hook that loads nothing until a GPU container starts.
    pub fn new() -> Self {
        Self::default()
    }

    fn log_once(&self, reason: &str) {
        if !self.reason_logged.swap(true, Ordering::SeqCst) {
            tracing::warn!("gpu tracing: off ({reason}); containers run as with plain runc");
        }
    }

    /// runc created the container: watch it before its program runs. Never fails the container.
    pub async fn container_created(&self, c: &StartedContainer<'_>) {
        let (done, ack) = oneshot::channel();
        if self.request_watch(c, Some(done))
            && tokio::time::timeout(WATCH_TIMEOUT, ack).await.is_err()
        {
            tracing::warn!(
                id = c.id,
                "gpu tracing: the probes took over {WATCH_TIMEOUT:?}; the container starts without waiting"
            );
        }
    }

    /// The container's init process is running (the pid a restored container gets at Start). Watching a
    /// container twice is harmless. Never fails the container.
    pub fn container_started(&self, c: &StartedContainer<'_>) {
        self.request_watch(c, None);
    }

    /// Asks the tracer task (started on first use) to watch `c`; false when `c` is not to be watched.
    fn request_watch(&self, c: &StartedContainer<'_>, done: Option<oneshot::Sender<()>>) -> bool {
        if c.init_pid == 0 {
            return false;
        }
        if !c.settings.ebpf {
            tracing::debug!(
                id = c.id,
                "gpu tracing: off for this container (ebpf = false)"
            );
            return false;
        }
        let dir = device_dir(&c.settings.trace_prefix);
        if !sees_nvidia_devices(c.init_pid, dir) {
            tracing::debug!(
                id = c.id,
                "gpu tracing: no NVIDIA device files in the container"
            );
            return false;
        }
        let Some(cgroup) = c.cgroup_v2_path else {
            self.log_once("the container has no cgroup v2 path, which attributes its calls");
            return false;
        };
        let request = Request::Watch {
            id: c.id.to_owned(),
            cgroup: cgroup.to_owned(),
            done,
        };
        let mut guard = self.tracer.lock().unwrap_or_else(|p| p.into_inner());
        let tx = guard.get_or_insert_with(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            tokio::spawn(run(rx, dir.to_owned()));
            tx
        });
        if tx.send(request).is_err() {
            self.log_once("the probes could not be loaded (see the earlier message)");
            return false;
        }
        true
    }

    /// A container was deleted: stop watching it and log its ledger.
    pub fn container_deleted(&self, id: &str) {
        let guard = self.tracer.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(tx) = guard.as_ref() {
            let _ = tx.send(Request::Forget { id: id.to_owned() });
        }
    }
}

/// The directory part of a `trace_prefix` (`/dev/nvidia` -> `/dev/`).
fn device_dir(prefix: &str) -> &str {
    prefix.rfind('/').map_or("/dev/", |i| &prefix[..=i])
}

/// Whether the container of `pid` has an NVIDIA device file in `dir` of its own root.
fn sees_nvidia_devices(pid: u32, dir: &str) -> bool {
    let root = format!("/proc/{pid}/root{dir}");
    std::fs::read_dir(Path::new(&root)).is_ok_and(|entries| {
        entries.flatten().any(|e| {
            baton_nvidia::fdkind::classify_name(e.file_name().as_encoded_bytes())
                .is_some_and(|(kind, _)| kind != baton_nvidia::fdkind::FdKind::Unknown)
        })
    })
}

/// One watched container.
struct Watched {
    cgroup_id: u64,
    held_gpu: bool,
}

/// The tracer task: loads the probes, follows requests, and reads events until the shim exits.
async fn run(mut requests: mpsc::UnboundedReceiver<Request>, dir: String) {
    let cfg = TracerConfig {
        prefixes: vec![dir],
        ..Default::default()
    };
    let mut tracer = match tokio::task::spawn_blocking(move || Tracer::start(cfg)).await {
        Ok(Ok(t)) => t,
        Ok(Err(e)) => {
            tracing::warn!("gpu tracing: off ({e}); containers run as with plain runc");
            return;
        }
        Err(e) => {
            tracing::warn!(
                "gpu tracing: off (loading the probes panicked: {e}); containers run as with plain runc"
            );
            return;
        }
    };
    tracing::info!("gpu tracing: probes loaded");
    let mut watched: HashMap<String, Watched> = HashMap::new();
    loop {
        tokio::select! {
            req = requests.recv() => match req {
                Some(Request::Watch { id, cgroup, done }) => {
                    if !watched.contains_key(&id) {
                        watch(&mut tracer, &mut watched, id, &cgroup);
                    }
                    if let Some(done) = done {
                        let _ = done.send(());
                    }
                }
                Some(Request::Forget { id }) => forget(&mut tracer, &mut watched, &id),
                None => return,
            },
            batch = tracer.next_events() => match batch {
                Ok(_) => note_releases(&tracer, &mut watched),
                Err(e) => {
                    tracing::warn!("gpu tracing: stopped reading events: {e}");
                    return;
                }
            },
        }
    }
}

fn watch(tracer: &mut Tracer, watched: &mut HashMap<String, Watched>, id: String, cgroup: &str) {
    let cgroup_id = match tracer.cgroups_mut().id_of_path(Path::new(cgroup)) {
        Ok(cg) => cg,
        Err(e) => {
            tracing::warn!(id, "gpu tracing: cannot watch the container: {e}");
            return;
        }
    };
    if let Err(e) = tracer.watch_cgroup(cgroup_id) {
        tracing::warn!(id, "gpu tracing: cannot watch the container: {e}");
        return;
    }
    tracing::info!(id, cgroup, "gpu tracing: watching container");
    let held_gpu = tracer.gpu_state(cgroup_id).holds_gpu();
    watched.insert(
        id,
        Watched {
            cgroup_id,
            held_gpu,
        },
    );
}

fn forget(tracer: &mut Tracer, watched: &mut HashMap<String, Watched>, id: &str) {
    let _ = tracer.drain_now();
    let Some(w) = watched.remove(id) else { return };
    tracer.unwatch_cgroup(w.cgroup_id);
    let state = tracer.gpu_state(w.cgroup_id);
    let (objects, vram, peak) = tracer
        .ledger()
        .container(w.cgroup_id)
        .map_or((0, 0, 0), |l| {
            (l.live_objects(), l.vram_bytes(), l.peak_vram_bytes())
        });
    tracing::info!(
        id,
        live_objects = objects,
        vram_bytes = vram,
        peak_vram_bytes = peak,
        open_fds = state.open_fds,
        mappings = state.mappings,
        "gpu tracing: container deleted"
    );
}

/// Logs each watched container whose CUDA state has just left the driver, or come back.
fn note_releases(tracer: &Tracer, watched: &mut HashMap<String, Watched>) {
    for (id, w) in watched.iter_mut() {
        let state = tracer.gpu_state(w.cgroup_id);
        let holds = state.holds_gpu();
        if holds != w.held_gpu {
            w.held_gpu = holds;
            if holds {
                tracing::info!(id, "gpu tracing: container acquired GPU state");
            } else {
                tracing::info!(
                    id,
                    "gpu tracing: container released the GPU (no driver objects, fds or mappings left)"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_device_dir_is_the_prefix_up_to_its_last_slash() {
        assert_eq!(device_dir("/dev/nvidia"), "/dev/");
        assert_eq!(device_dir("/run/mock/dev/"), "/run/mock/dev/");
        assert_eq!(device_dir("nvidia"), "/dev/");
    }

    #[test]
    fn a_process_without_nvidia_devices_is_not_watched() {
        // A device directory of our own, so that the answer does not depend on the machine's /dev.
        let dir = tempfile::tempdir().unwrap();
        let empty = format!("{}/", dir.path().display());
        assert!(!sees_nvidia_devices(std::process::id(), &empty));
        std::fs::write(dir.path().join("nvidiactl"), b"").unwrap();
        let d = format!("{}/", dir.path().display());
        assert!(sees_nvidia_devices(std::process::id(), &d));
    }
}
