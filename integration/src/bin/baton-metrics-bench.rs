//! `baton-metrics-bench`: what a scrape of the agent's metrics costs. A foreground `baton agent` (the release
//! build beside this binary) with `--metrics-addr 127.0.0.1:0` watches 1, 10 and 100 "containers" (cgroups
//! of their own, each with a scripted holder keeping the FUSE mock's nvidiactl open, registered over the
//! socket). For each count it prints the latency of a scrape that builds a new exposition (scrapes 110 ms
//! apart, past the endpoint's 100 ms reuse), the exposition's size, and the agent socket's `status`
//! latency alone and while a thread scrapes in a loop (the ratio is the scrape's cost to the socket). Figures
//! only; nothing is asserted.
//!
//! Run as root: `cargo build --release --workspace --bins && target/release/baton-metrics-bench`.
use std::{
    path::Path,
    process::Stdio,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Result, bail};
use baton_integration::{
    agent::{AgentConn, AgentProcess},
    holder::HolderContainer,
    metrics::{client, get, url_from_log},
    trace_env::{missing_trace_prerequisite, sibling_binaries},
};
use baton_mock_nvidia::driver::{MockDriver, MountOptions};
use baton_tracer::cgroups;
use serde_json::json;

/// Scrapes measured per count.
const SCRAPES: usize = 40;
/// Status requests per measurement.
const STATUSES: usize = 400;

fn main() -> Result<()> {
    if let Some(reason) = missing_trace_prerequisite() {
        bail!("cannot benchmark: {reason}");
    }
    let [baton, holder] = sibling_binaries(["baton", "baton-mock-holder"])?;
    let work = tempfile::tempdir()?;
    let mock_dir = work.path().join("dev");
    std::fs::create_dir(&mock_dir)?;
    let _mock = MockDriver::mount(MountOptions::new(&mock_dir))?;
    let socket = work.path().join("agent.sock");
    let log = work.path().join("agent.log");
    let agent = AgentProcess::start_program_with(
        &baton,
        &socket,
        &log,
        &["--metrics-addr", "127.0.0.1:0"],
    )?;
    let url = url_from_log(&log, Duration::from_secs(20))?;
    let mut conn = AgentConn::connect(agent.socket())?;
    let root = cgroups::find_v2_root()?;
    let bench_cg = format!("baton-metrics-bench-{}", std::process::id());
    let http = client();

    println!(
        "| watched containers | scrape p50 | scrape p99 | exposition | status p50 | status p50 while scraping | ratio |"
    );
    println!("|---|---|---|---|---|---|---|");
    let mut holders: Vec<HolderContainer> = Vec::new();
    for count in [1usize, 10, 100] {
        while holders.len() < count {
            let i = holders.len();
            let cg = cgroups::create(&root, &format!("{bench_cg}/c{i}"))?;
            let h = start_holder(&holder, &mock_dir, &cg, &format!("c{i}"))?;
            conn.call(json!({
                "op": "register", "id": format!("c{i}"), "namespace": "bench",
                "cgroup": format!("/{bench_cg}/c{i}"), "init_pid": h.child_pid(),
                "devices": [mock_dir.join("nvidiactl")],
                "settings": {"trace_prefix": format!("{}/nvidia", mock_dir.display())},
                "kubernetes": {"namespace": "bench", "pod": format!("pod-{i}"), "container": "main"},
            }))?;
            holders.push(h);
        }
        let mut scrapes = Vec::new();
        let mut size = 0;
        for _ in 0..SCRAPES {
            std::thread::sleep(Duration::from_millis(110));
            let t = Instant::now();
            let (status, _, body) = get(&http, &url)?;
            scrapes.push(t.elapsed());
            anyhow::ensure!(status == 200, "scrape: {status}: {body}");
            size = body.len();
        }
        let alone = status_latencies(&mut conn)?;
        let stop = Arc::new(AtomicBool::new(false));
        let looper = {
            let (stop, http, url) = (stop.clone(), http.clone(), url.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let _ = get(&http, &url);
                }
            })
        };
        let during = status_latencies(&mut conn)?;
        stop.store(true, Ordering::Relaxed);
        let _ = looper.join();
        let (a, d) = (percentile(&alone, 50), percentile(&during, 50));
        println!(
            "| {count} | {:.2?} | {:.2?} | {:.1} KiB | {a:.2?} | {d:.2?} | {:.2}x |",
            percentile(&scrapes, 50),
            percentile(&scrapes, 99),
            size as f64 / 1024.0,
            d.as_secs_f64() / a.as_secs_f64(),
        );
    }
    drop(holders);
    for i in 0..100 {
        let _ = cgroups::remove(&root.join(format!("{bench_cg}/c{i}")));
    }
    let _ = cgroups::remove(&root.join(&bench_cg));
    Ok(())
}

fn status_latencies(conn: &mut AgentConn) -> Result<Vec<Duration>> {
    (0..STATUSES)
        .map(|_| {
            let t = Instant::now();
            conn.call(json!({"op": "status"}))?;
            Ok(t.elapsed())
        })
        .collect()
}

fn percentile(samples: &[Duration], p: usize) -> Duration {
    let mut s = samples.to_vec();
    s.sort_unstable();
    s.get((s.len().saturating_sub(1)) * p / 100)
        .copied()
        .unwrap_or_default()
}

/// A scripted holder with nvidiactl open, in cgroup `cgroup`.
fn start_holder(program: &Path, dev: &Path, cgroup: &Path, id: &str) -> Result<HolderContainer> {
    let child = cgroups::command_in(
        cgroup,
        program,
        &["--dev-dir".to_owned(), dev.display().to_string()],
    )
    .stdin(Stdio::piped())
    .stdout(Stdio::piped())
    .spawn()?;
    let mut h = HolderContainer::attach(id, child)?;
    h.cmd("open nvidiactl")?;
    Ok(h)
}
