//! The checkpoint part of the kit: a process holding exactly `--gib` GiB of GPU memory, with a worker it
//! forked after CUDA init (as a DataLoader does), is parked (lock, checkpoint) and resumed (restore,
//! unlock), once through the `cuda-checkpoint` program and once through the CUDA driver helper
//! ([`super::ways`]), `--cycles` times each. Each park also runs the seeds' loop through the agent without
//! containerd ([`super::gate`]): a server waiting on the agent's GPU-free gate starts on the park's release.
//! For each way: what the holder holds (ledger, NVML, PyTorch), the seconds each way, the time from the
//! checkpoint call's return to `released` (signed: it may come before; the goal is within 100 ms), from the
//! park request to `released`, to the gate opening, to the server's start and to NVML's device memory
//! dropping, and whether the weights came back intact. A way that cannot run here is unavailable; one that
//! goes wrong is failed with what was seen, and the run goes on.
use serde::Serialize;
use serde_json::json;

use super::{
    nvml_poll,
    report::{Part, Status},
    rig::Rig,
    trace_run::start_poller,
    watched::{EventLog, NAMESPACE},
    ways::{Helper, Way},
};
use crate::agent::{AgentConn, AgentProcess};

/// What the holder holds: its figures once its weights are there.
#[derive(Clone, Debug, Default, Serialize)]
pub struct HolderFigures {
    /// Its pid.
    pub pid: u32,
    /// The ledger's device memory of its container, bytes.
    pub ledger_bytes: Option<u64>,
    /// The ledger's peak for its container, bytes.
    pub ledger_peak_bytes: Option<u64>,
    /// NVML's figure for its pid, bytes (`None` without NVML).
    pub nvml_bytes: Option<u64>,
    /// PyTorch's reserved memory (its allocator's cache), bytes; none on the mock.
    pub torch_reserved_bytes: Option<u64>,
    /// The workers it forked, with the NVIDIA fds each holds.
    pub workers: Vec<Worker>,
}

/// A forked worker of the holder.
#[derive(Clone, Debug, Serialize)]
pub struct Worker {
    /// Its pid.
    pub pid: u32,
    /// The NVIDIA fds it holds (inherited).
    pub nvidia_fds: usize,
}

/// One park and resume, with the seeds' loop's server.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Cycle {
    /// 1, 2, ...
    pub n: u32,
    /// The lock call, seconds.
    pub lock_s: Option<f64>,
    /// The checkpoint call, seconds.
    pub checkpoint_s: Option<f64>,
    /// Lock + checkpoint, seconds.
    pub park_s: Option<f64>,
    /// From the checkpoint call's return to the agent's `t_released_ns`, ms; negative when it came before.
    pub checkpoint_return_to_released_ms: Option<f64>,
    /// From the park request to `t_released_ns`, seconds.
    pub request_to_released_s: Option<f64>,
    /// What confirmed the release (`confirmed_by`).
    pub confirmed_by: Option<String>,
    /// From the park request to the gate's answer reaching the kit, seconds (negative: before).
    pub request_to_gate_open_s: Option<f64>,
    /// From the park request to the server's start, seconds.
    pub request_to_server_start_s: Option<f64>,
    /// From the park request to the server having taken its GPU memory, seconds.
    pub request_to_server_serving_s: Option<f64>,
    /// From the park request to NVML's device memory having dropped by 90% of what was held, seconds.
    pub request_to_nvml_free_s: Option<f64>,
    /// Restore + unlock, seconds.
    pub resume_s: Option<f64>,
    /// The weights' checksum after the resume equals the one before.
    pub intact: Option<bool>,
}

/// One way of making the checkpoint calls, measured.
#[derive(Clone, Debug, Default, Serialize)]
pub struct WayResult {
    /// `program` or `driver API`.
    pub way: String,
    /// What the holder held.
    pub holder: Option<HolderFigures>,
    /// Each park and resume.
    pub cycles: Vec<Cycle>,
    /// The median park over the cycles, seconds.
    pub park_s: Option<f64>,
    /// The median resume, seconds.
    pub resume_s: Option<f64>,
    /// The median from the park request to `released`, seconds.
    pub request_to_released_s: Option<f64>,
    /// The latest `released` after the checkpoint call's return over the cycles, ms (signed).
    pub checkpoint_return_to_released_ms: Option<f64>,
    /// The median from the park request to the server's start, seconds.
    pub request_to_server_start_s: Option<f64>,
    /// Every cycle's weights came back intact.
    pub intact: Option<bool>,
}

impl WayResult {
    fn named(way: &str) -> Self {
        Self {
            way: way.to_owned(),
            ..Self::default()
        }
    }

    fn summarize(&mut self) {
        let of = |f: fn(&Cycle) -> Option<f64>| -> Vec<f64> {
            self.cycles.iter().filter_map(f).collect()
        };
        self.park_s = median(of(|c| c.park_s));
        self.resume_s = median(of(|c| c.resume_s));
        self.request_to_released_s = median(of(|c| c.request_to_released_s));
        self.request_to_server_start_s = median(of(|c| c.request_to_server_start_s));
        self.checkpoint_return_to_released_ms = of(|c| c.checkpoint_return_to_released_ms)
            .into_iter()
            .reduce(f64::max);
        let intact: Vec<bool> = self.cycles.iter().filter_map(|c| c.intact).collect();
        self.intact = (!intact.is_empty()).then(|| intact.iter().all(|i| *i));
    }
}

/// The checkpoint part's findings.
#[derive(Clone, Debug, Serialize)]
pub struct CheckpointResult {
    /// GiB the holder held.
    pub gib: u64,
    /// Park/resume cycles per way.
    pub cycles: u32,
    /// `None`: the holder forked a worker after CUDA init; else why it did not.
    pub no_worker: Option<String>,
    /// Why NVML figures are missing, when they are.
    pub nvml_unavailable: Option<String>,
    /// The program, then the driver API.
    pub ways: Vec<Part<WayResult>>,
}

impl CheckpointResult {
    /// Before anything ran: both ways not run.
    pub fn not_run(rig: &Rig, why: &str) -> Self {
        Self {
            gib: rig.gib,
            cycles: rig.cycles,
            no_worker: rig.worker.clone().err(),
            nvml_unavailable: None,
            ways: WAYS
                .iter()
                .map(|w| way_part(w, Status::NotRun, why))
                .collect(),
        }
    }
}

/// The ways, in the order they run.
const WAYS: [&str; 2] = ["program", "driver API"];

fn way_part(way: &str, status: Status, why: &str) -> Part<WayResult> {
    Part {
        status,
        problems: vec![why.to_owned()],
        found: Some(WayResult::named(way)),
    }
}

/// Parks and resumes a holder through each way there is; `save` is called with the findings so far after
/// each way (the report is written again).
pub fn run(rig: &Rig, save: &mut dyn FnMut(&CheckpointResult)) -> CheckpointResult {
    let mut result = CheckpointResult::not_run(rig, "not reached");
    if let Err(why) = &rig.cuda_programs {
        result.ways = WAYS
            .iter()
            .map(|w| way_part(w, Status::Unavailable, why))
            .collect();
        return result;
    }
    if rig.bounds.expired() {
        return CheckpointResult::not_run(rig, "--time-limit reached before it");
    }
    let socket = rig.work.path().join("agent-checkpoint.sock");
    let started =
        AgentProcess::start_program(&rig.baton, &socket, &rig.out.join("agent-checkpoint.log"))
            .and_then(|agent| {
                let conn = AgentConn::connect(&socket)?;
                let watch = AgentConn::connect(&socket)?.watch(json!({"namespace": NAMESPACE}))?;
                Ok((agent, conn, EventLog::start(watch)))
            });
    let (_agent, mut conn, mut events) = match started {
        Ok(s) => s,
        Err(e) => {
            let why = format!("cannot start `baton agent`: {e:#}");
            result.ways = WAYS
                .iter()
                .map(|w| way_part(w, Status::Failed, &why))
                .collect();
            return result;
        }
    };
    let poller = start_poller(rig);
    result.nvml_unavailable = poller.as_ref().err().cloned();
    let mut session = Session {
        rig,
        socket: &socket,
        conn: &mut conn,
        events: &mut events,
        poller: poller.as_ref().ok(),
    };
    for (i, name) in WAYS.iter().enumerate() {
        if rig.bounds.expired() {
            result.ways[i] = way_part(name, Status::NotRun, "--time-limit reached before it");
            continue;
        }
        let way = match *name {
            "program" => rig
                .cuda_checkpoint
                .clone()
                .map(Way::Program)
                .ok_or_else(|| {
                    "no cuda-checkpoint program on PATH (pass --cuda-checkpoint)".to_owned()
                }),
            _ => Helper::start(
                &rig.shim,
                &rig.libcuda,
                rig.bounds.within(rig.bounds.program_ready),
            )
            .map(Way::Api),
        };
        result.ways[i] = match way {
            Ok(mut way) => session.measure(name, &mut way),
            Err(why) => way_part(name, Status::Unavailable, &why),
        };
        save(&result);
    }
    result
}

/// What one measurement needs.
pub(super) struct Session<'a> {
    pub(super) rig: &'a Rig,
    pub(super) socket: &'a std::path::Path,
    pub(super) conn: &'a mut AgentConn,
    pub(super) events: &'a mut EventLog,
    pub(super) poller: Option<&'a nvml_poll::Poller>,
}

impl Session<'_> {
    /// Starts a holder, parks and resumes it through `way` `rig.cycles` times, each with a server waiting
    /// on the gate, and checks its weights: what it found, and what went wrong.
    fn measure(&mut self, name: &str, way: &mut Way) -> Part<WayResult> {
        let mut found = WayResult::named(name);
        let mut problems = Vec::new();
        if let Err(e) = self.hold_and_cycle(name, way, &mut found, &mut problems) {
            problems.push(format!("{e:#}"));
        }
        found.summarize();
        Part::ran(Some(found), problems)
    }
}

/// The median of `values` (`None` when empty).
pub fn median(mut values: Vec<f64>) -> Option<f64> {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    match n {
        0 => None,
        _ if n % 2 == 1 => Some(values[n / 2]),
        _ => Some((values[n / 2 - 1] + values[n / 2]) / 2.0),
    }
}

/// `a - b` in seconds, signed.
pub fn signed_s(a: u64, b: u64) -> f64 {
    (i128::from(a) - i128::from(b)) as f64 / 1e9
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_takes_medians_and_the_latest_release() {
        assert_eq!(median(vec![]), None);
        assert_eq!(median(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), Some(2.5));
        assert_eq!(signed_s(1_000_000_000, 3_000_000_000), -2.0);
        let mut w = WayResult::named("program");
        for (n, (park, ms, intact)) in [(1.0, -3.0, true), (3.0, 40.0, true), (2.0, 7.0, false)]
            .into_iter()
            .enumerate()
        {
            w.cycles.push(Cycle {
                n: n as u32 + 1,
                park_s: Some(park),
                checkpoint_return_to_released_ms: Some(ms),
                intact: Some(intact),
                ..Cycle::default()
            });
        }
        w.summarize();
        assert_eq!(w.park_s, Some(2.0));
        assert_eq!(w.checkpoint_return_to_released_ms, Some(40.0));
        assert_eq!(w.intact, Some(false));
        assert_eq!(w.resume_s, None);
    }
}
