//! The rate gate's memory across agent restarts. The agent is the one owner of a GPU's gap-fill
//! preemptions and their costs; a DaemonSet rollout replaces its process, not that fact. So the rate gate
//! writes them through, at each change, to `rate-gate.json` next to the agent's socket (`/run/baton` on the
//! node, a hostPath of the DaemonSet), and the next agent reads them back at its start: a GPU that had
//! stopped filling stays closed after the rollout until its preemptions leave the window, as it would have.
//!
//! Times are CLOCK_MONOTONIC, which a reboot restarts: the file names the boot it was written in
//! (`/proc/sys/kernel/random/boot_id`) and a file of another boot is dropped (so is `/run` itself, a tmpfs).
//! Only the agent (root) writes there; a file it cannot read or parse is reported and the gate starts empty,
//! as on a new node (it fills until it measures again).
use std::path::{Path, PathBuf};

use baton_agent_api::RateGateSettings;
use serde::{Deserialize, Serialize};

use crate::gate::DeviceKey;

/// Where the kernel names the current boot.
const BOOT_ID: &str = "/proc/sys/kernel/random/boot_id";

/// The file's contents.
#[derive(Debug, Serialize, Deserialize)]
struct Saved {
    /// The boot its times belong to.
    boot_id: String,
    /// The node's settings in force when it was written (until a shim registers with the node's TOML).
    settings: RateGateSettings,
    gpus: Vec<SavedGpu>,
}

/// What an earlier agent left: the settings it had and its window.
#[derive(Debug, Default, PartialEq)]
pub struct Window {
    /// The settings in force (none without a file).
    pub settings: Option<RateGateSettings>,
    /// The GPUs' preemptions and costs.
    pub gpus: Vec<SavedGpu>,
}

/// One GPU's preemptions and costs, as the rate gate keeps them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SavedGpu {
    /// Which GPU.
    pub key: DeviceKey,
    /// When each gap-fill preemption in the window was asked (CLOCK_MONOTONIC ns), oldest first.
    pub preemptions: Vec<u64>,
    /// (request ns, C ns) of the resumes whose preemption is in the window.
    pub costs: Vec<(u64, u64)>,
    /// The last C measured.
    pub last_c_ns: Option<u64>,
}

/// The file the rate gate writes through to.
pub struct Store {
    path: PathBuf,
    boot_id: String,
    /// Whether the last write failed (one warning per streak).
    failing: bool,
}

impl Store {
    /// The store at `path`, for this boot.
    pub fn at(path: &Path) -> Self {
        Self {
            path: path.to_owned(),
            boot_id: boot_id(),
            failing: false,
        }
    }

    /// What an earlier agent of this boot saved, without times after `now_ns` (nothing when there is no file,
    /// or it is of another boot, or it cannot be read: each said in the log).
    pub fn load(&self, now_ns: u64) -> Window {
        let text = match std::fs::read(&self.path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Window::default(),
            Err(e) => {
                tracing::warn!(
                    "agent: gap-fill: cannot read the rate gate's window from {} ({e}): it starts empty",
                    self.path.display()
                );
                return Window::default();
            }
        };
        let saved: Saved = match serde_json::from_slice(&text) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(
                    "agent: gap-fill: {} is not a rate gate window ({e}): it starts empty, and the file is \
                     written anew at the next preemption",
                    self.path.display()
                );
                return Window::default();
            }
        };
        if saved.boot_id != self.boot_id {
            tracing::info!(
                "agent: gap-fill: {} is of another boot: the rate gate starts empty",
                self.path.display()
            );
            return Window::default();
        }
        if baton_agent_api::limits::check_rate_gate(&saved.settings).is_err() {
            tracing::warn!(
                "agent: gap-fill: {} holds settings out of bounds: the rate gate starts empty",
                self.path.display()
            );
            return Window::default();
        }
        let gpus: Vec<SavedGpu> = saved
            .gpus
            .into_iter()
            .map(|mut g| {
                g.preemptions.retain(|t| *t <= now_ns);
                g.costs.retain(|(t, c)| t.saturating_add(*c) <= now_ns);
                g
            })
            .collect();
        let preemptions: usize = gpus.iter().map(|g| g.preemptions.len()).sum();
        tracing::info!(
            gpus = gpus.len(),
            preemptions,
            "agent: gap-fill: the rate gate's window taken up from {}",
            self.path.display()
        );
        Window {
            settings: Some(saved.settings),
            gpus,
        }
    }

    /// Writes `gpus` (to a temporary file renamed over the old one: a reader never sees half a file).
    pub fn save(&mut self, settings: RateGateSettings, gpus: Vec<SavedGpu>) {
        let saved = Saved {
            boot_id: self.boot_id.clone(),
            settings,
            gpus,
        };
        let result = serde_json::to_vec(&saved)
            .map_err(std::io::Error::other)
            .and_then(|bytes| {
                let tmp = self.path.with_extension("json.tmp");
                std::fs::write(&tmp, bytes)?;
                std::fs::rename(&tmp, &self.path)
            });
        match result {
            Ok(()) => self.failing = false,
            Err(e) if !self.failing => {
                self.failing = true;
                tracing::warn!(
                    "agent: gap-fill: cannot write the rate gate's window to {} ({e}): an agent restarted \
                     now would start it empty; make the socket's folder writable by the agent",
                    self.path.display()
                );
            }
            Err(_) => {}
        }
    }
}

/// This boot's id (empty where the kernel does not say: then every file of an earlier agent is taken, its
/// times filtered to those not after now).
fn boot_id() -> String {
    std::fs::read_to_string(BOOT_ID)
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(preemptions: Vec<u64>) -> SavedGpu {
        SavedGpu {
            key: DeviceKey::File {
                dev: 42,
                ino: 7,
                name: "nvidia0".into(),
            },
            preemptions,
            costs: vec![(10, 5)],
            last_c_ns: Some(5),
        }
    }

    #[test]
    fn what_is_saved_is_taken_up_by_the_next_store_of_this_boot_without_times_from_the_future() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("rate-gate.json");
        let mut store = Store::at(&path);
        assert_eq!(store.load(100), Window::default(), "no file yet");
        let settings = RateGateSettings {
            min_share: 0.9,
            window_s: 15.0,
        };
        store.save(settings, vec![gpu(vec![10, 50, 200])]);
        let again = Store::at(&path).load(100);
        assert_eq!(again.gpus, vec![gpu(vec![10, 50])]);
        assert_eq!(again.settings, Some(settings));
    }

    #[test]
    fn a_file_of_another_boot_or_not_a_window_is_dropped() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("rate-gate.json");
        let other = Saved {
            boot_id: "another boot".into(),
            settings: RateGateSettings::default(),
            gpus: vec![gpu(vec![10])],
        };
        std::fs::write(&path, serde_json::to_vec(&other).expect("json")).expect("write");
        assert_eq!(Store::at(&path).load(100), Window::default());
        std::fs::write(&path, b"{ not json").expect("write");
        assert_eq!(Store::at(&path).load(100), Window::default());
    }

    #[test]
    fn a_write_that_fails_is_reported_and_the_gate_goes_on() {
        let mut store = Store::at(Path::new("/proc/baton-no-such-folder/rate-gate.json"));
        store.save(RateGateSettings::default(), vec![gpu(vec![1])]);
        assert!(store.failing);
        store.save(RateGateSettings::default(), vec![gpu(vec![1])]);
        assert!(store.failing);
    }
}
