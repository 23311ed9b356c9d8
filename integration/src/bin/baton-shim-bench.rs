//! `baton-shim-bench`: Baton's shim against Debian's Go `containerd-shim-runc-v2` in the same run, on private
//! containerd instances. Prints figures (no assertions): RSS and PSS of one idle shim, shim RSS and PSS per
//! container with 50 running containers (PSS, from /proc/PID/smaps_rollup, shares each page among the processes
//! mapping it: the memory a node really pays per shim), `ctr run --rm` latency over 50 runs, `ctr task exec`
//! latency over 100 execs.
//!
//! Run as root: `cargo run --release -p baton-integration --bin baton-shim-bench` (the Baton shim is built with
//! `--release`; `BATON_SHIM_BIN=/path` uses that binary instead).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use baton_integration::shim_binary::{self, BATON_RUNTIME};
use baton_integration::{TestEnv, procs, skip};

/// The Go shim's runtime type.
const RUNC_RUNTIME: &str = "io.containerd.runc.v2";
/// Containers for the RSS figure.
const RSS_CONTAINERS: usize = 50;
/// `ctr run --rm` samples.
const RUN_SAMPLES: usize = 50;
/// `ctr task exec` samples.
const EXEC_SAMPLES: usize = 100;

/// Shim memory: one idle shim, and the sum over the shims of [`RSS_CONTAINERS`] containers divided by that count.
struct Memory {
    idle: u64,
    per_container: u64,
}

/// The figures for one runtime.
struct Figures {
    rss: Memory,
    pss: Memory,
    run_p50: Duration,
    run_p95: Duration,
    exec_p50: Duration,
}

fn main() -> Result<()> {
    if let Some(reason) = skip::missing_containerd_prerequisite() {
        bail!("cannot benchmark: {reason}");
    }
    let baton_shim = match std::env::var_os("BATON_SHIM_BIN") {
        Some(path) => PathBuf::from(path),
        None => {
            shim_binary::baton_shim_release_binary().context("building the Baton shim (release)")?
        }
    };
    eprintln!("baton shim: {}", baton_shim.display());
    let baton = measure(BATON_RUNTIME, Some(&baton_shim))?;
    let runc = measure(RUNC_RUNTIME, None)?;
    print_table(&baton, &runc);
    Ok(())
}

fn measure(runtime: &str, shim: Option<&Path>) -> Result<Figures> {
    eprintln!("measuring {runtime} ...");
    let (rss, pss) = measure_memory(runtime, shim)?;
    let (run_p50, run_p95) = measure_run(runtime, shim)?;
    let exec_p50 = measure_exec(runtime, shim)?;
    Ok(Figures {
        rss,
        pss,
        run_p50,
        run_p95,
        exec_p50,
    })
}

fn environment(name: &str, runtime: &str, shim: Option<&Path>) -> Result<TestEnv> {
    TestEnv::with_shim(name, runtime, shim)
        .with_context(|| format!("setting up containerd for {runtime}"))
}

/// RSS and PSS of the one shim of one idle container, then of the shims of [`RSS_CONTAINERS`] containers.
fn measure_memory(runtime: &str, shim: Option<&Path>) -> Result<(Memory, Memory)> {
    let env = environment("bench-rss", runtime, shim)?;
    env.run_detached("c0", &[], &["/bin/sleep", "3600"])?;
    std::thread::sleep(Duration::from_millis(500));
    let (idle_rss, idle_pss) = (
        shim_sum(&env, procs::rss_bytes),
        shim_sum(&env, procs::pss_bytes),
    );
    for index in 1..RSS_CONTAINERS {
        env.run_detached(&format!("c{index}"), &[], &["/bin/sleep", "3600"])?;
    }
    std::thread::sleep(Duration::from_millis(500));
    let shims = env.shims().len();
    if shims != RSS_CONTAINERS {
        eprintln!("note: {shims} shims for {RSS_CONTAINERS} containers");
    }
    let count = RSS_CONTAINERS as u64;
    let rss = Memory {
        idle: idle_rss,
        per_container: shim_sum(&env, procs::rss_bytes) / count,
    };
    let pss = Memory {
        idle: idle_pss,
        per_container: shim_sum(&env, procs::pss_bytes) / count,
    };
    Ok((rss, pss))
}

/// `figure` summed over the live shims of `env`.
fn shim_sum(env: &TestEnv, figure: fn(i32) -> Option<u64>) -> u64 {
    env.shims().iter().filter_map(|shim| figure(shim.pid)).sum()
}

/// p50 and p95 of `ctr run --rm` (create + start + wait + delete) of `/bin/true`.
fn measure_run(runtime: &str, shim: Option<&Path>) -> Result<(Duration, Duration)> {
    let env = environment("bench-run", runtime, shim)?;
    let mut samples = Vec::with_capacity(RUN_SAMPLES);
    for index in 0..RUN_SAMPLES {
        let started = Instant::now();
        let out = env.run(
            &format!("r{index}"),
            &[],
            &["--rm", "--null-io"],
            &["/bin/true"],
        );
        samples.push(started.elapsed());
        if !out.success() {
            bail!("ctr run --rm failed with {runtime}: {}", out.stderr);
        }
    }
    Ok((percentile(&mut samples, 50), percentile(&mut samples, 95)))
}

/// p50 of `ctr task exec` of `/bin/true` in one running container.
fn measure_exec(runtime: &str, shim: Option<&Path>) -> Result<Duration> {
    let env = environment("bench-exec", runtime, shim)?;
    env.run_detached("host", &[], &["/bin/sleep", "3600"])?;
    let mut samples = Vec::with_capacity(EXEC_SAMPLES);
    for index in 0..EXEC_SAMPLES {
        let exec_id = format!("e{index}");
        let started = Instant::now();
        let out = env.ctr(&["task", "exec", "--exec-id", &exec_id, "host", "/bin/true"]);
        samples.push(started.elapsed());
        if !out.success() {
            bail!("ctr task exec failed with {runtime}: {}", out.stderr);
        }
    }
    Ok(percentile(&mut samples, 50))
}

fn percentile(samples: &mut [Duration], percent: usize) -> Duration {
    samples.sort_unstable();
    let index = (samples.len() * percent).div_ceil(100).saturating_sub(1);
    samples.get(index).copied().unwrap_or_default()
}

fn mib(bytes: u64) -> String {
    format!("{:.2} MiB", bytes as f64 / (1024.0 * 1024.0))
}

fn ms(duration: Duration) -> String {
    format!("{:.1} ms", duration.as_secs_f64() * 1000.0)
}

fn ratio(baton: f64, runc: f64) -> String {
    if runc > 0.0 {
        format!("{:.2}", baton / runc)
    } else {
        "n/a".to_string()
    }
}

fn print_table(baton: &Figures, runc: &Figures) {
    let memory = |figure: &str, baton: u64, runc: u64| {
        (
            figure.to_string(),
            mib(baton),
            mib(runc),
            ratio(baton as f64, runc as f64),
        )
    };
    let per_container = format!("({RSS_CONTAINERS} running, sum / {RSS_CONTAINERS})");
    let mut rows = vec![
        memory("RSS, one idle shim", baton.rss.idle, runc.rss.idle),
        memory("PSS, one idle shim", baton.pss.idle, runc.pss.idle),
        memory(
            &format!("shim RSS per container {per_container}; goal <= 3.5 MB"),
            baton.rss.per_container,
            runc.rss.per_container,
        ),
        memory(
            &format!("shim PSS per container {per_container}"),
            baton.pss.per_container,
            runc.pss.per_container,
        ),
    ];
    let latency = [
        (
            "`ctr run --rm` p50 (50 runs)",
            ms(baton.run_p50),
            ms(runc.run_p50),
            ratio(baton.run_p50.as_secs_f64(), runc.run_p50.as_secs_f64()),
        ),
        (
            "`ctr run --rm` p95 (50 runs)",
            ms(baton.run_p95),
            ms(runc.run_p95),
            ratio(baton.run_p95.as_secs_f64(), runc.run_p95.as_secs_f64()),
        ),
        (
            "`ctr task exec` p50 (100 execs)",
            ms(baton.exec_p50),
            ms(runc.exec_p50),
            ratio(baton.exec_p50.as_secs_f64(), runc.exec_p50.as_secs_f64()),
        ),
    ];
    rows.extend(
        latency
            .into_iter()
            .map(|(figure, baton, runc, ratio)| (figure.to_string(), baton, runc, ratio)),
    );
    println!("| figure | baton ({BATON_RUNTIME}) | runc ({RUNC_RUNTIME}) | baton / runc |");
    println!("|---|---|---|---|");
    for (figure, baton, runc, ratio) in rows {
        println!("| {figure} | {baton} | {runc} | {ratio} |");
    }
    println!();
    println!(
        "Reproduce (as root, from the workspace): `cargo run --release -p baton-integration --bin baton-shim-bench`"
    );
}
