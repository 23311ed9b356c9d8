//! `baton-busy-tenant-bench`: what a tenant whose /proc is costly to read does to the agent's other work
//! (issue 30, item 2). Under a private containerd with the Baton shim, an agent started by the bench and the
//! FUSE mock driver: a *tenant* container holds the GPU (so the agent checks its processes against /proc
//! every second), a *trainer* container takes and releases the GPU in a loop, and a *co-runner* stays
//! frozen by the agent under a short freeze lease. Two phases in the same run: the tenant as it starts, then
//! the same tenant with `--mappings` anonymous mappings (default 1,000,000: 50 MB of /proc maps). For each it
//! prints:
//! - the release signal: from the trainer's last close's return to a `watch` subscriber's receipt (p50, p99,
//!   max);
//! - the agent's answer to `status` (a client asking every 50 ms): p50, p99, max;
//! - the co-runner's lease: how often the kernel showed it thawed (each a lapse: the shim thawed it because
//!   no renewal came within the lease; the bench freezes it again) and for how long in all;
//! - what the agent's last check of the tenant took (`proc_check` in its status).
//!
//! Figures only (no assertions). `--baton PATH` runs another build's agent, to compare builds in one
//! command line. Needs root and a `vm.max_map_count` above `--mappings` (raised for the run, put back after).
//!
//! Run: `cargo build --release --workspace --bins && BATON_SHIM_BIN=$PWD/target/release/containerd-shim-baton-v1
//! target/release/baton-busy-tenant-bench` (`tools/dev bench` runs it).
use std::{
    path::{Path, PathBuf},
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use baton_integration::{
    TestEnv,
    agent::{AgentConn, AgentProcess, container_status, wait_until},
    holder::HolderContainer,
    procs::cgroup_frozen,
    shim_binary::{self, BATON_RUNTIME},
    trace_env::{missing_trace_prerequisite, workspace_binary},
};
use baton_mock_nvidia::driver::{MockDriver, MountOptions};
use clap::Parser;
use serde_json::{Value, json};

const WITHIN: Duration = Duration::from_secs(60);
const MAX_MAP_COUNT: &str = "/proc/sys/vm/max_map_count";

/// What a busy tenant costs the agent's release signal, answers and leases.
#[derive(Parser)]
struct Args {
    /// Release cycles per phase.
    #[arg(long, default_value_t = 200)]
    cycles: usize,
    /// The tenant's anonymous mappings in the second phase.
    #[arg(long, default_value_t = 1_000_000)]
    mappings: u64,
    /// The co-runner's freeze lease (ms).
    #[arg(long, default_value_t = 300)]
    lease_ms: u64,
    /// The `baton` program whose agent runs (default: this workspace's debug build).
    #[arg(long)]
    baton: Option<PathBuf>,
}

/// One phase's figures.
#[derive(Default)]
struct Phase {
    release_ns: Vec<u64>,
    status_ns: Vec<u64>,
    lapses: u64,
    thawed_ns: u64,
    check: Option<Value>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if let Some(reason) = missing_trace_prerequisite() {
        bail!("cannot benchmark: {reason}");
    }
    let shim = match std::env::var_os("BATON_SHIM_BIN") {
        Some(p) => p.into(),
        None => shim_binary::baton_shim_release_binary().context("building the Baton shim")?,
    };
    let baton = match &args.baton {
        Some(p) => p.clone(),
        None => workspace_binary("baton", "baton")?,
    };
    let old_max = std::fs::read_to_string(MAX_MAP_COUNT)?;
    let want = args.mappings + 65_536;
    if old_max.trim().parse::<u64>().is_ok_and(|v| v < want) {
        std::fs::write(MAX_MAP_COUNT, want.to_string())
            .with_context(|| format!("raising {MAX_MAP_COUNT} to {want}"))?;
    }
    let result = run(&args, &shim, &baton);
    let _ = std::fs::write(MAX_MAP_COUNT, old_max.trim());
    result
}

fn run(args: &Args, shim: &Path, baton: &Path) -> Result<()> {
    let env = TestEnv::with_shim("busy-tenant-bench", BATON_RUNTIME, Some(shim))?;
    let socket = env.containerd().agent_socket();
    std::fs::create_dir_all(socket.parent().context("agent socket")?)?;
    let lease = args.lease_ms.to_string();
    let _agent = AgentProcess::start_program_with(
        baton,
        &socket,
        &env.scratch().join("agent.log"),
        &["--freeze-lease-ms", &lease, "--max-frozen-ms", "3600000"],
    )?;
    let mock_dir = tempfile::tempdir()?;
    let _mock = MockDriver::mount(MountOptions::new(mock_dir.path()))?;
    let mut tenant = HolderContainer::start(&env, "tenant", mock_dir.path(), &[])?;
    let fd = tenant.num("open nvidiactl")?;
    tenant.cmd(&format!("alloc {fd}"))?;
    let mut trainer = HolderContainer::start(&env, "trainer", mock_dir.path(), &[])?;
    env.run_detached(
        "co",
        &[("baton.io/role", "co-runner")],
        &["/bin/sleep", "36000"],
    )?;
    let co = watched_init_pid(&socket, "co")?;
    let mut watch = AgentConn::connect(&socket)?.watch(json!({"container": "trainer"}))?;

    eprintln!("baton-busy-tenant-bench: phase 1, the tenant as it started");
    let plain = phase(args, &socket, co, &mut trainer, &mut watch)?;
    eprintln!(
        "baton-busy-tenant-bench: phase 2, the tenant with {} mappings",
        args.mappings
    );
    let lines = tenant.num(&format!("anon-maps {}", args.mappings))?;
    // Past its next check: the phase measures the checks that read the mappings.
    std::thread::sleep(Duration::from_secs(3));
    let busy = phase(args, &socket, co, &mut trainer, &mut watch)?;
    print(args, lines, &plain, &busy);
    trainer.finish()?;
    tenant.finish()?;
    Ok(())
}

/// One phase: `args.cycles` releases of the trainer with the co-runner frozen and a status client asking.
fn phase(
    args: &Args,
    socket: &Path,
    co: u32,
    trainer: &mut HolderContainer,
    watch: &mut baton_integration::agent::AgentWatch,
) -> Result<Phase> {
    let mut conn = AgentConn::connect(socket)?;
    conn.call(json!({"op": "freeze", "id": "co"}))?;
    let stop = Arc::new(AtomicBool::new(false));
    let (lapses, thawed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let lease_watch = {
        let (stop, lapses, thawed, socket) = (
            stop.clone(),
            lapses.clone(),
            thawed.clone(),
            socket.to_owned(),
        );
        std::thread::spawn(move || -> Result<()> {
            let mut conn = AgentConn::connect(&socket)?;
            while !stop.load(Ordering::SeqCst) {
                if !cgroup_frozen(co) {
                    let t = Instant::now();
                    lapses.fetch_add(1, Ordering::SeqCst);
                    conn.call(json!({"op": "freeze", "id": "co"}))?;
                    thawed.fetch_add(t.elapsed().as_nanos() as u64, Ordering::SeqCst);
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Ok(())
        })
    };
    let status_client = {
        let (stop, socket) = (stop.clone(), socket.to_owned());
        std::thread::spawn(move || -> Result<Vec<u64>> {
            let mut conn = AgentConn::connect(&socket)?;
            let mut out = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                let t = Instant::now();
                conn.call(json!({"op": "status"}))?;
                out.push(t.elapsed().as_nanos() as u64);
                std::thread::sleep(Duration::from_millis(50));
            }
            Ok(out)
        })
    };
    let mut p = Phase::default();
    for i in 0..args.cycles {
        let fd = trainer.num("open nvidiactl")?;
        trainer.cmd(&format!("alloc {fd}"))?;
        watch.next_of("trainer", "acquired", WITHIN)?;
        // Releases spread over the tenant's check period, not in step with it.
        std::thread::sleep(Duration::from_millis(7 * (i as u64 % 13)));
        let returned = trainer.num(&format!("close {fd}"))?;
        watch.next_of("trainer", "released", WITHIN)?;
        p.release_ns
            .push(baton_tracer::now_monotonic_ns().saturating_sub(returned));
    }
    stop.store(true, Ordering::SeqCst);
    lease_watch
        .join()
        .map_err(|_| anyhow::anyhow!("lease watch"))??;
    p.status_ns = status_client
        .join()
        .map_err(|_| anyhow::anyhow!("status client"))??;
    p.lapses = lapses.load(Ordering::SeqCst);
    p.thawed_ns = thawed.load(Ordering::SeqCst);
    p.check = container_status(socket, "tenant")?
        .map(|s| s["proc_check"].clone())
        .filter(|c| !c.is_null());
    conn.call(json!({"op": "thaw", "id": "co"}))?;
    Ok(p)
}

/// The init pid of container `id` once the agent watches it.
fn watched_init_pid(socket: &Path, id: &str) -> Result<u32> {
    let mut pid = 0;
    wait_until(WITHIN, || {
        pid = container_status(socket, id)
            .ok()
            .flatten()
            .and_then(|s| s["init_pid"].as_u64())
            .unwrap_or(0) as u32;
        pid != 0
    });
    anyhow::ensure!(pid != 0, "the agent does not watch {id}");
    Ok(pid)
}

fn print(args: &Args, lines: u64, plain: &Phase, busy: &Phase) {
    println!(
        "busy tenant, {} release cycles per phase, co-runner lease {} ms; the tenant's /proc maps: {lines} lines \
         in phase 2",
        args.cycles, args.lease_ms
    );
    println!(
        "| figure | tenant as started | tenant with {} mappings | ratio |",
        args.mappings
    );
    println!("|---|---|---|---|");
    let rows = |name: &str, a: &[u64], b: &[u64]| {
        let (mut a, mut b) = (a.to_vec(), b.to_vec());
        a.sort_unstable();
        b.sort_unstable();
        for (what, q) in [("p50", 50.0), ("p99", 99.0), ("max", 100.0)] {
            let (x, y) = (pct(&a, q), pct(&b, q));
            println!(
                "| {name} {what} | {} | {} | {:.2} |",
                us(x),
                us(y),
                y as f64 / x.max(1) as f64
            );
        }
    };
    rows(
        "release: last close -> `watch` subscriber",
        &plain.release_ns,
        &busy.release_ns,
    );
    rows("`status` answered", &plain.status_ns, &busy.status_ns);
    println!(
        "| co-runner lease lapses (thawed by its shim) | {} | {} | |",
        plain.lapses, busy.lapses
    );
    println!(
        "| co-runner time thawed by lapses | {} | {} | |",
        us(plain.thawed_ns),
        us(busy.thawed_ns)
    );
    let check = |p: &Phase| {
        p.check
            .as_ref()
            .map_or("n/a (an agent without `proc_check`)".to_owned(), |c| {
                format!(
                    "{} ({} process(es))",
                    us(c["took_us"].as_u64().unwrap_or(0) * 1000),
                    c["processes"]
                )
            })
    };
    println!(
        "| the agent's last check of the tenant against /proc | {} | {} | |",
        check(plain),
        check(busy)
    );
}

fn pct(sorted: &[u64], q: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let i = ((q / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn us(ns: u64) -> String {
    if ns >= 10_000_000 {
        format!("{:.1} ms", ns as f64 / 1e6)
    } else {
        format!("{:.0} µs", ns as f64 / 1e3)
    }
}
