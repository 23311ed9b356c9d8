//! The CPU work of the analog's workloads: pinning to a CPU, burning a given amount of this thread's CPU
//! time (the server), and a fixed unit of work (the co-runner).
use anyhow::{Context, Result};
use nix::{
    sched::{CpuSet, sched_setaffinity},
    time::{ClockId, clock_gettime},
    unistd::Pid,
};

/// Pins the calling process to CPU `cpu`.
pub fn pin_to_cpu(cpu: usize) -> Result<()> {
    let mut set = CpuSet::new();
    set.set(cpu).with_context(|| format!("CPU {cpu}"))?;
    sched_setaffinity(Pid::from_raw(0), &set).with_context(|| format!("pinning to CPU {cpu}"))
}

/// CLOCK_MONOTONIC now, ns.
pub fn now_ns() -> u64 {
    baton_agent_api::now_monotonic_ns()
}

fn thread_cpu_ns() -> Result<u64> {
    let t =
        clock_gettime(ClockId::CLOCK_THREAD_CPUTIME_ID).context("reading the thread's CPU time")?;
    Ok(u64::try_from(t.tv_sec()).unwrap_or(0) * 1_000_000_000
        + u64::try_from(t.tv_nsec()).unwrap_or(0))
}

/// Spins until this thread has used `ms` more milliseconds of CPU time (however long that takes in wall time).
pub fn burn_cpu_ms(ms: f64) -> Result<()> {
    let start = thread_cpu_ns()?;
    let want = (ms * 1e6) as u64;
    let mut seed = start;
    while thread_cpu_ns()?.saturating_sub(start) < want {
        for _ in 0..64 {
            seed = mix(seed);
        }
        std::hint::black_box(seed);
    }
    Ok(())
}

/// One unit of the co-runner's work (about 0.1 ms of CPU on a current core); returns the next seed.
pub fn work_unit(mut seed: u64) -> u64 {
    for _ in 0..20_000 {
        seed = mix(seed);
    }
    std::hint::black_box(seed)
}

/// splitmix64's step: cheap work the compiler cannot drop.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
