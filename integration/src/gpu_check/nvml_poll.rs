//! A 1 ms NVML poller, what a tool without Baton can watch: each sample holds the GPU memory NVML reports
//! for one process (its running compute processes on every device) and the devices' used memory. It says
//! when the process first appeared and when it was first gone, and the peak it saw. Without NVML (the mock,
//! a machine with no driver) it does not start and every figure is "unavailable".
use std::{
    sync::{
        Arc, Mutex, PoisonError,
        atomic::{AtomicBool, AtomicU32, Ordering},
    },
    thread::JoinHandle,
    time::Duration,
};

use baton_agent_api::now_monotonic_ns;
use nvml_wrapper::{Nvml, enums::device::UsedGpuMemory};

/// One sample.
#[derive(Clone, Copy, Debug)]
pub struct Sample {
    /// CLOCK_MONOTONIC, ns.
    pub t_ns: u64,
    /// The followed process's GPU memory, `None` when NVML does not list it.
    pub process_bytes: Option<u64>,
    /// Used memory summed over the devices.
    pub device_bytes: u64,
}

/// A running poller.
pub struct Poller {
    pid: Arc<AtomicU32>,
    stop: Arc<AtomicBool>,
    samples: Arc<Mutex<Vec<Sample>>>,
    thread: JoinHandle<()>,
}

impl Poller {
    /// Starts polling every millisecond, following no process until [`Poller::follow`]; `Err` says why NVML
    /// is unavailable (a library that does not initialise within `within` included: its thread is left to
    /// end on its own).
    pub fn start(within: Duration) -> Result<Self, String> {
        let pid = Arc::new(AtomicU32::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let samples = Arc::new(Mutex::new(Vec::new()));
        let (p, s, out) = (pid.clone(), stop.clone(), samples.clone());
        let (ready, initialised) = std::sync::mpsc::channel();
        let thread = std::thread::spawn(move || match Nvml::init() {
            Ok(nvml) => {
                let _ = ready.send(Ok(()));
                poll(&nvml, &p, &s, &out);
            }
            Err(e) => {
                let _ = ready.send(Err(format!("NVML unavailable: {e}")));
            }
        });
        match initialised.recv_timeout(within) {
            Ok(Ok(())) => {}
            Ok(Err(why)) => return Err(why),
            Err(_) => {
                stop.store(true, Ordering::Relaxed);
                return Err(format!("NVML did not initialise within {within:?}"));
            }
        }
        Ok(Self {
            pid,
            stop,
            samples,
            thread,
        })
    }

    /// Follows process `pid` from now on.
    pub fn follow(&self, pid: u32) {
        self.pid.store(pid, Ordering::Relaxed);
    }

    /// The samples so far.
    pub fn snapshot(&self) -> Vec<Sample> {
        self.samples
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Stops and returns the samples (a poll stuck in NVML is not waited for past a second).
    pub fn stop(self) -> Vec<Sample> {
        self.stop.store(true, Ordering::Relaxed);
        crate::agent::wait_until(Duration::from_secs(1), || self.thread.is_finished());
        std::mem::take(&mut *self.samples.lock().unwrap_or_else(PoisonError::into_inner))
    }
}

fn poll(nvml: &Nvml, pid: &AtomicU32, stop: &AtomicBool, out: &Mutex<Vec<Sample>>) {
    let count = nvml.device_count().unwrap_or(0);
    let devices: Vec<_> = (0..count)
        .filter_map(|i| nvml.device_by_index(i).ok())
        .collect();
    while !stop.load(Ordering::Relaxed) {
        let followed = pid.load(Ordering::Relaxed);
        let mut process_bytes = None;
        let mut device_bytes = 0;
        for device in &devices {
            device_bytes += device.memory_info().map_or(0, |m| m.used);
            for p in device.running_compute_processes().unwrap_or_default() {
                if p.pid == followed {
                    let used = match p.used_gpu_memory {
                        UsedGpuMemory::Used(n) => n,
                        UsedGpuMemory::Unavailable => 0,
                    };
                    process_bytes = Some(process_bytes.unwrap_or(0) + used);
                }
            }
        }
        out.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Sample {
                t_ns: now_monotonic_ns(),
                process_bytes,
                device_bytes,
            });
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The largest memory NVML reported for the process.
pub fn peak_process_bytes(samples: &[Sample]) -> Option<u64> {
    samples.iter().filter_map(|s| s.process_bytes).max()
}

/// When NVML first stopped listing the process, after having listed it.
pub fn first_gone_ns(samples: &[Sample]) -> Option<u64> {
    let seen = samples.iter().position(|s| s.process_bytes.is_some())?;
    samples[seen..]
        .iter()
        .find(|s| s.process_bytes.is_none())
        .map(|s| s.t_ns)
}

/// The first sample at or after `from_ns` whose device memory is at most `below` bytes.
pub fn first_device_below_ns(samples: &[Sample], from_ns: u64, below: u64) -> Option<u64> {
    samples
        .iter()
        .find(|s| s.t_ns >= from_ns && s.device_bytes <= below)
        .map(|s| s.t_ns)
}

/// The devices' used memory in the last sample before `t_ns`.
pub fn device_bytes_before(samples: &[Sample], t_ns: u64) -> Option<u64> {
    samples
        .iter()
        .take_while(|s| s.t_ns < t_ns)
        .last()
        .map(|s| s.device_bytes)
}
