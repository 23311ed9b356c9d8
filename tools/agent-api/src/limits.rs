//! What the agent accepts from its socket: every duration, rate and count a request carries is checked
//! here, once, before the request reaches the agent's tasks. A deadline built from an unchecked duration
//! overflows (`Instant + Duration` panics), and a panic in the agent's core task once left an agent that
//! answered "the agent is stopping" to every shim of the node. The shim checks the annotations a tenant
//! writes against the same bounds, so that a pod is refused at its Create with the reason.
use std::time::Duration;

use crate::{DURATION_SYNTAX, MAX_WAIT_GPU_FREE, RateGateSettings, Request, control::freeze_lease};

/// The longest `baton.io/park-when-idle`: a server idle a week is parked by hand.
pub const MAX_PARK_WHEN_IDLE: Duration = Duration::from_secs(7 * 24 * 3600);
/// The longest gap-fill rate window (`gap_fill_window`).
pub const MAX_RATE_WINDOW: Duration = Duration::from_secs(7 * 24 * 3600);
/// The longest controller window (`duty`, `governor`), ms: the seeds use 200.
pub const MAX_CONTROL_WINDOW_MS: u64 = 60_000;
/// The longest `freeze --hold` (a day), ms.
pub const MAX_FREEZE_HOLD_MS: u64 = 24 * 3600 * 1000;
/// The longest interval between `baton trace`'s launch lines (an hour), ms.
pub const MAX_LAUNCH_INTERVAL_MS: u64 = 3600 * 1000;
/// The most pids one `preempt` may name.
pub const MAX_PREEMPT_PIDS: usize = 4096;
/// The most device paths one registration may carry.
pub const MAX_DEVICES: usize = 1024;

/// Whether a wait at the GPU-free gate of `ms` is one the agent serves: from 1 ms to a day.
fn wait_gpu_free_in_bounds(ms: u64) -> bool {
    ms > 0 && u128::from(ms) <= MAX_WAIT_GPU_FREE.as_millis()
}

impl Request {
    /// Whether every duration, rate and count in the request is within what the agent serves; the error
    /// says which field, its bound and what to send instead.
    pub fn check(&self) -> Result<(), String> {
        match self {
            Request::WaitGpuFree(g) if !wait_gpu_free_in_bounds(g.timeout_ms) => {
                return Err(format!(
                    "wait_gpu_free: timeout_ms {} is not from 1 to {} (a day): ask a shorter wait and ask \
                     again",
                    g.timeout_ms,
                    MAX_WAIT_GPU_FREE.as_millis()
                ));
            }
            Request::Register(r) => {
                if r.devices.len() > MAX_DEVICES {
                    return Err(format!(
                        "register: {} devices, more than {MAX_DEVICES}",
                        r.devices.len()
                    ));
                }
                if let Some(ms) = r.role.as_ref().and_then(|r| r.park_when_idle_ms) {
                    check_park_when_idle(Duration::from_millis(ms))?;
                }
                if let Some(ms) = r.role.as_ref().and_then(|r| r.wait_gpu_free_ms)
                    && !wait_gpu_free_in_bounds(ms)
                {
                    return Err(format!(
                        "register: wait_gpu_free_ms {ms} is not from 1 to {} (a day)",
                        MAX_WAIT_GPU_FREE.as_millis()
                    ));
                }
                if let Some(g) = r.settings.rate_gate.as_deref() {
                    check_rate_gate(g)?;
                }
                let memory = [
                    ("gpu_memory", r.gpu_memory),
                    ("gpu_memory_headroom", r.settings.gpu_memory_headroom),
                    ("gpu_memory_minimum", r.settings.gpu_memory_minimum),
                    (
                        "parked_host_memory_budget",
                        r.settings.parked_host_memory_budget,
                    ),
                ];
                for (name, bytes) in memory {
                    if let Some(b) = bytes.filter(|b| *b > crate::room::MAX_GPU_MEMORY) {
                        return Err(format!(
                            "register: {name} {b} bytes is more than {} (1 PiB)",
                            crate::room::MAX_GPU_MEMORY
                        ));
                    }
                }
            }
            Request::Preempt(p) if p.pids.len() > MAX_PREEMPT_PIDS => {
                return Err(format!(
                    "preempt: {} pids, more than {MAX_PREEMPT_PIDS}: leave pids out to take the \
                     container's CUDA processes",
                    p.pids.len()
                ));
            }
            Request::Freeze(f) => {
                if let Some(ms) = f.hold_ms.filter(|ms| *ms > MAX_FREEZE_HOLD_MS) {
                    return Err(format!(
                        "freeze: hold_ms {ms} is above {MAX_FREEZE_HOLD_MS} (a day): leave it out to hold \
                         until a thaw"
                    ));
                }
                if f.lease_ms.is_some() {
                    freeze_lease(f.lease_ms).map_err(|e| format!("freeze: {e}"))?;
                }
            }
            Request::Duty(d) => {
                check_window("duty", d.window_ms)?;
                if d.run_ms > d.window_ms {
                    return Err(format!(
                        "duty: run_ms {} is longer than window_ms {}: a co-runner runs at most the whole \
                         window",
                        d.run_ms, d.window_ms
                    ));
                }
            }
            Request::Governor(g) if !g.off => {
                check_window("governor", g.window_ms)?;
                if !(g.target_stretch.is_finite() && g.target_stretch > 0.0) {
                    return Err(format!(
                        "governor: target_stretch must be a number > 0 (0.2: gaps at most 20% longer), not \
                         {}",
                        g.target_stretch
                    ));
                }
            }
            Request::Trace(t) => {
                if let Some(ms) = t
                    .launch_interval_ms
                    .filter(|ms| *ms == 0 || *ms > MAX_LAUNCH_INTERVAL_MS)
                {
                    return Err(format!(
                        "trace: launch_interval_ms {ms} is not from 1 to {MAX_LAUNCH_INTERVAL_MS} (an hour)"
                    ));
                }
            }
            _ => {}
        }
        Ok(())
    }
}

/// A controller window: from 1 ms to [`MAX_CONTROL_WINDOW_MS`].
fn check_window(what: &str, window_ms: u64) -> Result<(), String> {
    if window_ms == 0 || window_ms > MAX_CONTROL_WINDOW_MS {
        return Err(format!(
            "{what}: window_ms must be > 0 and at most {MAX_CONTROL_WINDOW_MS} (the seeds use 200), not \
             {window_ms}"
        ));
    }
    Ok(())
}

/// `baton.io/park-when-idle`: more than zero, at most [`MAX_PARK_WHEN_IDLE`].
pub fn check_park_when_idle(d: Duration) -> Result<(), String> {
    if d.is_zero() || d > MAX_PARK_WHEN_IDLE {
        return Err(format!(
            "park-when-idle {d:?} is not {DURATION_SYNTAX} of at most {} days",
            MAX_PARK_WHEN_IDLE.as_secs() / 86_400
        ));
    }
    Ok(())
}

/// The rate gate's settings: a share from 0 to 1 and a window of at most [`MAX_RATE_WINDOW`].
pub fn check_rate_gate(g: &RateGateSettings) -> Result<(), String> {
    if !(0.0..=1.0).contains(&g.min_share) {
        return Err(format!(
            "gap_fill_min_share {} is not a number from 0 to 1",
            g.min_share
        ));
    }
    let most = MAX_RATE_WINDOW.as_secs_f64();
    if !(g.window_s.is_finite() && g.window_s > 0.0 && g.window_s <= most) {
        return Err(format!(
            "gap_fill_window {} s is not more than 0 and at most {most} s (a week)",
            g.window_s
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ContainerRef, DutyRequest, GateRequest, GovernorRequest, TraceRequest};

    fn gate(timeout_ms: u64) -> Request {
        Request::WaitGpuFree(GateRequest {
            container: ContainerRef {
                id: "c".to_owned(),
                namespace: "n".to_owned(),
            },
            timeout_ms,
        })
    }

    #[test]
    fn durations_past_their_bounds_are_refused_with_the_bound() {
        assert!(gate(20_000).check().is_ok());
        let e = gate(u64::MAX).check().unwrap_err();
        assert!(e.contains("timeout_ms") && e.contains("86400000"), "{e}");
        assert!(gate(0).check().is_err());
        let duty = |run_ms, window_ms| {
            Request::Duty(DutyRequest {
                co_runner: Default::default(),
                run_ms,
                window_ms,
            })
        };
        assert!(duty(50, 200).check().is_ok());
        assert!(duty(u64::MAX, u64::MAX).check().is_err());
        assert!(duty(300, 200).check().is_err());
        let governor = |target_stretch, window_ms| {
            Request::Governor(GovernorRequest {
                target_stretch,
                window_ms,
                off: false,
            })
        };
        assert!(governor(0.2, 200).check().is_ok());
        assert!(governor(f64::NAN, 200).check().is_err());
        assert!(governor(0.2, u64::MAX).check().is_err());
        let trace = |ms| {
            Request::Trace(TraceRequest {
                launch_interval_ms: Some(ms),
                ..Default::default()
            })
        };
        assert!(trace(1000).check().is_ok());
        assert!(trace(u64::MAX).check().is_err());
        assert!(check_park_when_idle(Duration::from_secs(30)).is_ok());
        assert!(check_park_when_idle(Duration::from_secs(u64::MAX / 2)).is_err());
        let rate = |min_share, window_s| RateGateSettings {
            min_share,
            window_s,
        };
        assert!(check_rate_gate(&rate(0.25, 3600.0)).is_ok());
        assert!(check_rate_gate(&rate(0.25, f64::INFINITY)).is_err());
        assert!(check_rate_gate(&rate(f64::NAN, 3600.0)).is_err());
    }
}
