//! `baton-signal-bench`: how fast the release signal reaches its consumers. A container (Baton shim, the
//! agent it starts, the FUSE mock driver) runs the scripted holder, which opens nvidiactl and closes it again,
//! N times (default 200). For each release it measures, from the moment the last close returned to user space
//! (the holder's CLOCK_MONOTONIC stamp), when the release reached:
//! (a) a `watch` subscriber on the agent socket, (b) a `ctr events` subscriber (through the shim and
//! containerd), and, side by side in the same run, two *agent-status pollers*: clients that send the agent
//! `{"op":"status","container":"bench"}` every 100 ms and every 10 ms and take a release as seen when the
//! reply's `containers[0].gpu` is `"released"` with a `since_ns` they have not seen before. They poll
//! Baton's own verdict, so they measure what polling instead of subscribing costs (the period, on top of the
//! same signal), not what a tool without Baton would see. Beside them, (c) a */proc fd poller*, what a tool
//! without Baton can poll (there is no GPU here for NVML or nvidia-smi): every 10 ms it lists the holder's
//! `/proc/PID/fd` and takes the release as seen at the first listing, finished after the last close's
//! syscall, with no link to an `nvidia*` device file. It sees the fd leave the process's table, which comes
//! before the driver's release (and never sees an fd passed to another process or a mapping kept), so it is
//! an optimistic bound for a poller, not the same event. It also reports the confirmation gap: from the last
//! close's syscall to the kernel being past its release. Figures only (no assertions); ratios are against the
//! same run.
//!
//! Then the same release cycles with the gate's NVML floor off and on (issue 39), FLOOR_CYCLES each way, each
//! way on a containerd and mock of its own whose agent the bench starts with the fake NVML
//! (integration/fake-nvml, answering from the mock's state after `BATON_BENCH_NVML_DELAY_US` per call, 0 by
//! default): the floor asks NVML after each release, off the agent's thread; `released` must not wait for it.
//!
//! Run as root: `cargo run --release -p baton-integration --bin baton-signal-bench [-- CYCLES
//! FLOOR_CYCLES]` (defaults 200, 100; CYCLES 0 runs the floor part only; `tools/dev bench` runs it).
use std::{
    io::{BufRead, BufReader, Write},
    os::unix::net::UnixStream,
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    time::Duration,
};

use anyhow::{Context, Result, bail};
use baton_integration::{
    TestEnv,
    fake_nvml::FakeNvml,
    holder::HolderContainer,
    shim_binary::{self, BATON_RUNTIME},
    trace_env::missing_trace_prerequisite,
};
use baton_mock_nvidia::driver::{MockDriver, MountOptions};
use serde_json::{Value, json};

const WITHIN: Duration = Duration::from_secs(30);

/// A line and when it arrived (CLOCK_MONOTONIC ns).
type Stamped = (u64, String);

fn main() -> Result<()> {
    let number = |i: usize, default: usize| -> Result<usize> {
        std::env::args().nth(i).map_or(Ok(default), |n| {
            n.parse().context("CYCLES and FLOOR_CYCLES are numbers")
        })
    };
    let (cycles, floor_cycles) = (number(1, 200)?, number(2, 100)?);
    if let Some(reason) = missing_trace_prerequisite() {
        bail!("cannot benchmark: {reason}");
    }
    let shim: std::path::PathBuf = match std::env::var_os("BATON_SHIM_BIN") {
        Some(p) => p.into(),
        None => shim_binary::baton_shim_release_binary().context("building the Baton shim")?,
    };
    if cycles > 0 {
        signal(&shim, cycles)?;
    }
    if floor_cycles > 0 {
        println!();
        floor_costs(&shim, floor_cycles)?;
    }
    Ok(())
}

/// The release signal at each receiver over `cycles` cycles, with the agent the shim starts.
fn signal(shim: &Path, cycles: usize) -> Result<()> {
    let env = TestEnv::with_shim("signal-bench", BATON_RUNTIME, Some(shim))?;
    let mock_dir = tempfile::tempdir()?;
    let _mock = MockDriver::mount(MountOptions::new(mock_dir.path()))?;
    let mut h = HolderContainer::start(&env, "bench", mock_dir.path(), &[])?;
    let socket = env.containerd().agent_socket();
    let watch = watch_lines(&socket, "bench")?;
    let ctr = ctr_event_lines(&env)?;
    let stop = Arc::new(AtomicBool::new(false));
    let slow = poller(&socket, "bench", Duration::from_millis(100), stop.clone());
    let fast = poller(&socket, "bench", Duration::from_millis(10), stop.clone());
    let holder_pid = init_pid(&socket, "bench")?;
    let fd_polls = proc_fd_poller(holder_pid, Duration::from_millis(10), stop.clone());

    // `ctr events` subscribes some time after it starts: warm-up cycles until it has seen one.
    loop {
        let fd = h.num("open nvidiactl")?;
        h.cmd(&format!("alloc {fd}"))?;
        next_kind(&watch, "acquired")?;
        h.num(&format!("close {fd}"))?;
        next_kind(&watch, "released")?;
        if next_line_within(&ctr.1, "/baton/gpu/released", Duration::from_secs(2)).is_ok() {
            break;
        }
    }
    let mut lat = Latencies::default();
    let mut jitter = Jitter(0x9e37_79b9_7f4a_7c15);
    eprintln!("baton-signal-bench: {cycles} release cycles ...");
    for i in 0..cycles {
        // An open alone holds no GPU state: a client with memory does (and goes with the file).
        let fd = h.num("open nvidiactl")?;
        h.cmd(&format!("alloc {fd}"))?;
        next_kind(&watch, "acquired")?;
        // A random pause, so that releases do not fall in step with the pollers' period.
        std::thread::sleep(jitter.below(Duration::from_millis(100)));
        let returned = h.num(&format!("close {fd}"))?;
        let (t_watch, e) = next_kind(&watch, "released")?;
        let t_released = e["t_released_ns"].as_u64().unwrap_or(0);
        let t_last = e["t_last_close_ns"].as_u64().unwrap_or(0);
        // ctr prints the Struct's numbers as floats: the events come in order, one release per cycle.
        let (t_ctr, _) = next_line_with(&ctr.1, "/baton/gpu/released")?;
        let t_slow = detection(&slow, t_released)?;
        let t_fast = detection(&fast, t_released)?;
        let t_proc = fd_detection(&fd_polls, t_last)?;
        lat.watch.push(t_watch.saturating_sub(returned));
        lat.ctr.push(t_ctr.saturating_sub(returned));
        lat.slow.push(t_slow.saturating_sub(returned));
        lat.fast.push(t_fast.saturating_sub(returned));
        lat.proc_fds.push(t_proc.saturating_sub(returned));
        lat.gap.push(t_released.saturating_sub(t_last));
        // Where the watch subscriber's time goes: the close's return to the kernel seen past its release, to
        // the agent publishing the event, to the subscriber reading it.
        let t_published = e["t_ns"].as_u64().unwrap_or(0);
        lat.confirm.push(t_released.saturating_sub(returned));
        lat.publish.push(t_published.saturating_sub(t_released));
        lat.deliver.push(t_watch.saturating_sub(t_published));
        if (i + 1) % 50 == 0 {
            eprintln!("  {} cycles", i + 1);
        }
    }
    stop.store(true, Ordering::SeqCst);
    lat.print(cycles);
    h.finish()?;
    Ok(())
}

/// The release signal at a `watch` subscriber over `cycles` cycles with the agent's NVML floor off, then on.
fn floor_costs(shim: &Path, cycles: usize) -> Result<()> {
    let delay_us: u64 = std::env::var("BATON_BENCH_NVML_DELAY_US")
        .ok()
        .map_or(Ok(0), |v| v.parse())
        .context("BATON_BENCH_NVML_DELAY_US is a number")?;
    let baton = std::env::current_exe()?.with_file_name("baton");
    let baton = if baton.is_file() {
        baton
    } else {
        baton_integration::trace_env::workspace_binary("baton", "baton")?
    };
    let ways: [(&str, &[&str]); 2] = [
        ("floor off (--nvml-floor false)", &["--nvml-floor", "false"]),
        ("floor on", &[]),
    ];
    let mut rows = Vec::new();
    for (n, (way, flags)) in ways.into_iter().enumerate() {
        let env = TestEnv::with_shim(&format!("signal-floor-{n}"), BATON_RUNTIME, Some(shim))?;
        let mock_dir = tempfile::tempdir()?;
        let _mock = MockDriver::mount(MountOptions::new(mock_dir.path()))?;
        let dir = tempfile::tempdir()?;
        let nvml = FakeNvml::install(dir.path(), mock_dir.path(), Duration::from_micros(delay_us))?;
        let socket = env.containerd().agent_socket();
        let _agent =
            nvml.start_agent_program(&baton, &socket, &dir.path().join("agent.log"), flags)?;
        let mut h = HolderContainer::start(&env, "bench", mock_dir.path(), &[])?;
        let watch = watch_lines(&socket, "bench")?;
        let mut jitter = Jitter(0x9e37_79b9_7f4a_7c15);
        let mut lat = Vec::with_capacity(cycles);
        for _ in 0..cycles {
            let fd = h.num("open nvidiactl")?;
            h.cmd(&format!("alloc {fd}"))?;
            next_kind(&watch, "acquired")?;
            std::thread::sleep(jitter.below(Duration::from_millis(20)));
            let returned = h.num(&format!("close {fd}"))?;
            let (t_watch, _) = next_kind(&watch, "released")?;
            lat.push(t_watch.saturating_sub(returned));
        }
        h.finish()?;
        lat.sort_unstable();
        rows.push((way, lat));
    }
    println!(
        "release signal with the gate's NVML floor off and on, {cycles} cycles each way (the fake NVML answering \
         {delay_us} us per call): from the last close's return to a `watch` subscriber"
    );
    println!("| NVML floor | p50 | p99 | max |");
    println!("|---|---|---|---|");
    for (way, v) in &rows {
        println!(
            "| {way} | {} | {} | {} |",
            us(pct(v, 50.0)),
            us(pct(v, 99.0)),
            us(v.last().copied().unwrap_or(0))
        );
    }
    Ok(())
}

/// A small xorshift generator for the pauses (reproducible, no dependency).
struct Jitter(u64);

impl Jitter {
    fn below(&mut self, max: Duration) -> Duration {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        Duration::from_nanos(self.0 % max.as_nanos().max(1) as u64)
    }
}

#[derive(Default)]
struct Latencies {
    watch: Vec<u64>,
    ctr: Vec<u64>,
    slow: Vec<u64>,
    fast: Vec<u64>,
    proc_fds: Vec<u64>,
    gap: Vec<u64>,
    confirm: Vec<u64>,
    publish: Vec<u64>,
    deliver: Vec<u64>,
}

impl Latencies {
    fn print(&mut self, cycles: usize) {
        let rows: [(&str, &mut Vec<u64>); 5] = [
            ("(a) agent `watch` subscriber", &mut self.watch),
            ("(b) `ctr events` subscriber", &mut self.ctr),
            ("agent `status` poller, every 10 ms", &mut self.fast),
            ("agent `status` poller, every 100 ms", &mut self.slow),
            (
                "(c) /proc fd poller, every 10 ms (fd gone from the table, not the release)",
                &mut self.proc_fds,
            ),
        ];
        println!("release signal, {cycles} cycles: from the last close's return to receipt");
        println!("| receiver | p50 | p99 | max |");
        println!("|---|---|---|---|");
        let mut p50s = Vec::new();
        for (name, v) in rows {
            v.sort_unstable();
            let (p50, p99, max) = (pct(v, 50.0), pct(v, 99.0), v.last().copied().unwrap_or(0));
            p50s.push(p50);
            println!("| {name} | {} | {} | {} |", us(p50), us(p99), us(max));
        }
        println!("where (a)'s time goes:");
        println!("| part | p50 | p99 | max |");
        println!("|---|---|---|---|");
        for (name, v) in [
            (
                "the close's return -> the kernel seen past its release (t_released_ns)",
                &mut self.confirm,
            ),
            (
                "-> the agent publishing `released` (its t_ns)",
                &mut self.publish,
            ),
            ("-> the subscriber reading it", &mut self.deliver),
        ] {
            v.sort_unstable();
            println!(
                "| {name} | {} | {} | {} |",
                us(pct(v, 50.0)),
                us(pct(v, 99.0)),
                us(v.last().copied().unwrap_or(0))
            );
        }
        self.gap.sort_unstable();
        println!(
            "confirmation gap (last close's syscall to the kernel past its release): p50 {}, p99 {}",
            us(pct(&self.gap, 50.0)),
            us(pct(&self.gap, 99.0))
        );
        let ratio = |a: u64, b: u64| a as f64 / b.max(1) as f64;
        println!(
            "p50 ratios: 100 ms status poller / watch = {:.0}x, 10 ms status poller / watch = {:.0}x, 100 ms \
             status poller / ctr events = {:.0}x",
            ratio(p50s[3], p50s[0]),
            ratio(p50s[2], p50s[0]),
            ratio(p50s[3], p50s[1])
        );
    }
}

/// Nearest-rank percentile of sorted values.
fn pct(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn us(ns: u64) -> String {
    if ns >= 10_000_000 {
        format!("{:.1} ms", ns as f64 / 1e6)
    } else {
        format!("{:.0} us", ns as f64 / 1e3)
    }
}

fn now_ns() -> u64 {
    baton_tracer::now_monotonic_ns()
}

/// Lines of `source`, each stamped when it was read, from a thread of their own.
fn stamped_lines(source: impl std::io::Read + Send + 'static) -> mpsc::Receiver<Stamped> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(source).lines().map_while(Result::ok) {
            if tx.send((now_ns(), line)).is_err() {
                return;
            }
        }
    });
    rx
}

/// A `watch` of container `id` on the agent socket: its event lines, stamped.
fn watch_lines(socket: &Path, id: &str) -> Result<mpsc::Receiver<Stamped>> {
    let mut stream = UnixStream::connect(socket)?;
    writeln!(
        stream,
        "{}",
        json!({"v": 1, "op": "watch", "container": id})
    )?;
    Ok(stamped_lines(stream))
}

/// A child killed when dropped.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `ctr events` and its lines, stamped.
fn ctr_event_lines(env: &TestEnv) -> Result<(KillOnDrop, mpsc::Receiver<Stamped>)> {
    let (child, out) = baton_integration::agent::spawn_ctr_events(env.containerd())?;
    Ok((KillOnDrop(child), stamped_lines(out)))
}

/// The next watch event of kind `kind` (the reply line and other kinds skipped).
fn next_kind(rx: &mpsc::Receiver<Stamped>, kind: &str) -> Result<(u64, Value)> {
    loop {
        let (t, line) = rx.recv_timeout(WITHIN).context("no agent event")?;
        let v: Value = serde_json::from_str(&line)?;
        if v["event"]["kind"] == json!(kind) {
            return Ok((t, v["event"].clone()));
        }
    }
}

/// The next line that contains `needle`.
fn next_line_with(rx: &mpsc::Receiver<Stamped>, needle: &str) -> Result<Stamped> {
    next_line_within(rx, needle, WITHIN)
}

/// The next line that contains `needle`, within `within`.
fn next_line_within(
    rx: &mpsc::Receiver<Stamped>,
    needle: &str,
    within: Duration,
) -> Result<Stamped> {
    let deadline = std::time::Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let (t, line) = rx
            .recv_timeout(left)
            .with_context(|| format!("no ctr event with {needle}"))?;
        if line.contains(needle) {
            return Ok((t, line));
        }
    }
}

/// An agent-status poller: sends `status` for container `id` every `every` and compares the reply's
/// `containers[0].gpu` with `"released"` and its `since_ns` with the last one seen; for each release it
/// sees, (when the release happened, when the poll saw it).
fn poller(
    socket: &Path,
    id: &str,
    every: Duration,
    stop: Arc<AtomicBool>,
) -> mpsc::Receiver<(u64, u64)> {
    let (tx, rx) = mpsc::channel();
    let (socket, id) = (socket.to_owned(), id.to_owned());
    std::thread::spawn(move || {
        let Ok(mut conn) = baton_integration::agent::AgentConn::connect(&socket) else {
            return;
        };
        let mut last_seen = 0;
        while !stop.load(Ordering::SeqCst) {
            std::thread::sleep(every);
            let Ok(reply) = conn.call(json!({"op": "status", "container": id})) else {
                return;
            };
            let c = &reply["containers"][0];
            let since = c["since_ns"].as_u64().unwrap_or(0);
            if c["gpu"] == json!("released") && since != last_seen {
                last_seen = since;
                if tx.send((since, now_ns())).is_err() {
                    return;
                }
            }
        }
    });
    rx
}

/// When a poller saw the release that happened at `t_released`.
fn detection(rx: &mpsc::Receiver<(u64, u64)>, t_released: u64) -> Result<u64> {
    loop {
        let (since, seen) = rx.recv_timeout(WITHIN).context("a poller saw no release")?;
        if since == t_released {
            return Ok(seen);
        }
    }
}

/// The init pid of container `id`, as the agent registered it.
fn init_pid(socket: &Path, id: &str) -> Result<u32> {
    let mut conn = baton_integration::agent::AgentConn::connect(socket)?;
    let reply = conn.call(json!({"op": "status", "container": id}))?;
    reply["containers"][0]["init_pid"]
        .as_u64()
        .and_then(|p| u32::try_from(p).ok())
        .with_context(|| format!("no init pid for {id} in {reply}"))
}

/// A /proc fd poller: every `every`, lists `/proc/PID/fd` of `pid` and sends (when the listing finished,
/// whether a link named an `nvidia*` device file).
fn proc_fd_poller(pid: u32, every: Duration, stop: Arc<AtomicBool>) -> mpsc::Receiver<(u64, bool)> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let dir = format!("/proc/{pid}/fd");
        while !stop.load(Ordering::SeqCst) {
            std::thread::sleep(every);
            let Ok(entries) = std::fs::read_dir(&dir) else {
                return;
            };
            let held = entries.flatten().any(|e| {
                std::fs::read_link(e.path()).is_ok_and(|target| {
                    target
                        .file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with("nvidia"))
                })
            });
            if tx.send((now_ns(), held)).is_err() {
                return;
            }
        }
    });
    rx
}

/// When the /proc fd poller first saw no NVIDIA fd in a listing finished after `t_last_close` (the last
/// close's syscall).
fn fd_detection(rx: &mpsc::Receiver<(u64, bool)>, t_last_close: u64) -> Result<u64> {
    loop {
        let (done, held) = rx
            .recv_timeout(WITHIN)
            .context("the /proc fd poller saw no release")?;
        if done >= t_last_close && !held {
            return Ok(done);
        }
    }
}
