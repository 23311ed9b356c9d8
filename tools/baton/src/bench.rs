//! `baton bench`: what the probes cost and carry, measured side by side in one run and printed as a table.
//!
//! (a) added cost per ioctl on a traced fd, per ioctl in an untraced case (a non-NVIDIA fd), and per
//!     openat+close, with no probes, with probes and 1 watched cgroup, and with 100 watched cgroups;
//! (b) kernel-to-user event latency (syscall exit to the consumer), p50/p99;
//! (c) sustained events/s of a flood of traced ioctls, and how many were dropped.
//! The loads run in a child process (`baton bench-worker`) inside a watched cgroup while this process
//! consumes events, as `baton trace` would. Figures only: nothing is asserted.
use std::{path::Path, process::Stdio, time::Duration};

use anyhow::Context;
use baton_nvidia::{escape, ioc, params};
use baton_tracer::{Tracer, TracerConfig, cgroups};
use clap::Args;

use crate::trace::now_monotonic_ns;

/// Options of `baton bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Syscalls per run of (a).
    #[arg(long, default_value_t = 200_000)]
    iterations: u64,
    /// Runs of each cell of (a), alternating between the configurations; the median is reported.
    #[arg(long, default_value_t = 5)]
    repeats: usize,
}

/// Options of the hidden `baton bench-worker`.
#[derive(Args, Debug)]
pub struct WorkerArgs {
    /// ioctl-traced | ioctl-untraced | openclose | getppid | paced | paced-openclose | flood.
    op: String,
    /// Iterations (or milliseconds for flood).
    n: u64,
    /// Directory holding the fake `nvidiactl` the traced ioctls go to.
    dir: String,
}

/// An RM_CONTROL command as CUDA issues it; on a plain file it returns ENOTTY, after the probes ran.
fn rm_control_cmd() -> u32 {
    ioc::iowr(
        ioc::NV_IOCTL_MAGIC,
        escape::RM_CONTROL,
        params::nvos54::SIZE,
    )
}

/// Runs the benchmarks and prints the table.
pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    let dir = tempfile::Builder::new()
        .prefix("baton-bench-dev")
        .tempdir()?;
    std::fs::write(dir.path().join("nvidiactl"), b"")?;
    let root = cgroups::find_v2_root()?;
    let rel = format!("/baton-bench-{}", std::process::id());
    let cg = cgroups::create(&root, &rel)?;
    let result = run_in(&args, dir.path(), &root, &rel).await;
    let _ = cgroups::remove(&cg);
    result
}

async fn run_in(args: &BenchArgs, dir: &Path, root: &Path, rel: &str) -> anyhow::Result<()> {
    let cg_path = root.join(rel.trim_start_matches('/'));
    let cg_id = std::fs::metadata(&cg_path).map(|m| std::os::unix::fs::MetadataExt::ino(&m))?;
    let ops = ["ioctl-traced", "ioctl-untraced", "openclose", "getppid"];
    // runs[op][config]: ns per call of each repeat. The three configurations alternate within each repeat so
    // that drift on a noisy machine hits them alike.
    let mut runs = vec![[Vec::new(), Vec::new(), Vec::new()]; ops.len()];
    for _ in 0..args.repeats {
        for (i, op) in ops.iter().enumerate() {
            runs[i][0].push(measure(args, op, dir, &cg_path, None).await?);
            for (slot, watched) in [(1, 1u64), (2, 100)] {
                let mut tracer = start_tracer(dir, root)?;
                tracer.watch_cgroup(cg_id)?;
                for fake in 1..watched {
                    tracer.watch_cgroup(u64::MAX - fake)?;
                }
                runs[i][slot].push(measure(args, op, dir, &cg_path, Some(&mut tracer)).await?);
            }
        }
    }
    let ioctl_lat = latency(dir, root, &cg_path, cg_id, "paced").await?;
    let close_lat = latency(dir, root, &cg_path, cg_id, "paced-openclose").await?;
    let (rate, received, dropped) = flood(dir, root, &cg_path, cg_id).await?;

    println!(
        "baton bench: {} calls (bursts of 1000, 2 ms apart) x {} alternating repeats per cell, median ns per call",
        args.iterations, args.repeats
    );
    println!();
    println!(
        "| call | no probes | probes, 1 watched cgroup | probes, 100 watched cgroups | added (1) | added (100) |"
    );
    println!("|---|---|---|---|---|---|");
    for (op, r) in ops.iter().zip(&mut runs) {
        let m: Vec<f64> = r.iter_mut().map(|v| median(v)).collect();
        println!(
            "| {op} | {:.0} ns | {:.0} ns | {:.0} ns | {:+.0} ns | {:+.0} ns |",
            m[0],
            m[1],
            m[2],
            m[1] - m[0],
            m[2] - m[0]
        );
    }
    println!();
    println!("| kernel-to-user latency | events | p50 | p99 |");
    println!("|---|---|---|---|");
    for (what, (p50, p99, n)) in [
        (
            "ioctl records (wake an idle consumer; drained every 1 ms while they flow)",
            ioctl_lat,
        ),
        ("close records (wake at once)", close_lat),
    ] {
        println!("| {what} | {n} | {p50:.1} us | {p99:.1} us |");
    }
    println!();
    println!(
        "| flood of traced ioctls, 2 threads, 2 s | {rate:.0} events/s received | {received} received | {dropped} dropped |"
    );
    Ok(())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn start_tracer(dir: &Path, root: &Path) -> anyhow::Result<Tracer> {
    Ok(Tracer::start(TracerConfig {
        watch_all: false,
        prefixes: vec![format!("{}/", dir.display())],
        cgroup_root: Some(root.to_path_buf()),
        driver_version: None,
        ..Default::default()
    })?)
}

/// Runs `baton bench-worker op n dir` in cgroup `cg` and returns what it printed.
fn worker(op: &str, n: u64, dir: &Path, cg: &Path) -> anyhow::Result<tokio::process::Command> {
    let exe = std::env::current_exe().context("cannot find the baton binary")?;
    let args = vec![
        "bench-worker".to_owned(),
        op.to_owned(),
        n.to_string(),
        dir.display().to_string(),
    ];
    let mut cmd = tokio::process::Command::from(cgroups::command_in(cg, &exe, &args));
    cmd.stdout(Stdio::piped());
    Ok(cmd)
}

/// ns per call of one run of `op`, consuming events with `tracer` meanwhile when there is one.
async fn measure(
    args: &BenchArgs,
    op: &str,
    dir: &Path,
    cg: &Path,
    tracer: Option<&mut Tracer>,
) -> anyhow::Result<f64> {
    let child = worker(op, args.iterations, dir, cg)?.spawn()?;
    let out = consume_while(child, tracer, |_| {}).await?;
    out.trim()
        .parse::<f64>()
        .with_context(|| format!("bench-worker said {out:?}"))
}

/// Waits for `child`, feeding every event the tracer reads to `on_event`; returns the child's stdout.
async fn consume_while(
    child: tokio::process::Child,
    tracer: Option<&mut Tracer>,
    mut on_event: impl FnMut(&baton_tracer::event::Event),
) -> anyhow::Result<String> {
    let output = child.wait_with_output();
    tokio::pin!(output);
    let out = match tracer {
        None => output.await?,
        Some(t) => loop {
            tokio::select! {
                o = &mut output => {
                    for e in t.drain_now()? { on_event(&e); }
                    break o?;
                }
                batch = t.next_events() => for e in batch? { on_event(&e); },
            }
        },
    };
    anyhow::ensure!(out.status.success(), "bench-worker failed: {}", out.status);
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// (b): paced traced calls (`paced`: ioctls; `paced-openclose`: open+close of the device file); latency
/// from the syscall's exit (the record's stamp) to the event's arrival here. Returns p50, p99 (us), count.
async fn latency(
    dir: &Path,
    root: &Path,
    cg: &Path,
    cg_id: u64,
    op: &str,
) -> anyhow::Result<(f64, f64, usize)> {
    let mut tracer = start_tracer(dir, root)?;
    tracer.watch_cgroup(cg_id)?;
    let mut lat = Vec::new();
    let want_close = op == "paced-openclose";
    let child = worker(op, 2000, dir, cg)?.spawn()?;
    consume_while(child, Some(&mut tracer), |e| {
        let hit = match e.body {
            baton_tracer::event::Body::Ioctl(_) => !want_close,
            baton_tracer::event::Body::Close { .. } => want_close,
            _ => false,
        };
        if hit {
            lat.push(now_monotonic_ns().saturating_sub(e.ts_ns));
        }
    })
    .await?;
    lat.sort_unstable();
    Ok((
        percentile(&lat, 50.0) as f64 / 1000.0,
        percentile(&lat, 99.0) as f64 / 1000.0,
        lat.len(),
    ))
}

/// (c): a flood of traced ioctls; events received per second and drops.
async fn flood(dir: &Path, root: &Path, cg: &Path, cg_id: u64) -> anyhow::Result<(f64, u64, u64)> {
    let mut tracer = start_tracer(dir, root)?;
    tracer.watch_cgroup(cg_id)?;
    let mut received = 0u64;
    let start = std::time::Instant::now();
    let child = worker("flood", 2000, dir, cg)?.spawn()?;
    consume_while(child, Some(&mut tracer), |e| {
        if matches!(e.body, baton_tracer::event::Body::Ioctl(_)) {
            received += 1;
        }
    })
    .await?;
    let secs = start.elapsed().as_secs_f64();
    Ok((received as f64 / secs, received, tracer.dropped()))
}

/// The worker: runs one load and prints ns per call.
pub fn worker_main(a: WorkerArgs) -> anyhow::Result<()> {
    let ctl = std::ffi::CString::new(format!("{}/nvidiactl", a.dir))?;
    let null = c"/dev/null";
    // The params struct an RM_CONTROL carries, with a 64-byte params buffer behind it as CUDA passes.
    let inner = [0u8; 64];
    let mut nvos54 = [0u8; 32];
    nvos54[16..24].copy_from_slice(&(inner.as_ptr() as u64).to_ne_bytes());
    nvos54[24..28].copy_from_slice(&64u32.to_ne_bytes());
    let cmd = rm_control_cmd();
    let open = |p: &std::ffi::CStr| {
        // SAFETY: plain open(2) of a NUL-terminated path.
        let fd = unsafe { libc::open(p.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        anyhow::ensure!(
            fd >= 0,
            "cannot open {p:?}: {}",
            std::io::Error::last_os_error()
        );
        Ok(fd)
    };
    let ioctl = |fd: i32| {
        // SAFETY: ioctl on our own fd with a pointer to a live 32-byte buffer; the call fails with ENOTTY.
        unsafe { libc::ioctl(fd, cmd as _, nvos54.as_ptr()) };
    };
    // Calls are timed in bursts of 1000 with a 2 ms pause between bursts (not timed), so that the consumer
    // keeps up between bursts as it would at a real workload's call rate, instead of competing with the
    // caller for the machine's two cores throughout.
    let per_call = |n: u64, f: &dyn Fn()| {
        let mut busy = Duration::ZERO;
        let mut done = 0;
        while done < n {
            let burst = (n - done).min(1000);
            let t = std::time::Instant::now();
            for _ in 0..burst {
                f();
            }
            busy += t.elapsed();
            done += burst;
            std::thread::sleep(Duration::from_millis(2));
        }
        busy.as_nanos() as f64 / n as f64
    };
    let paced = |n: u64, f: &dyn Fn()| {
        for _ in 0..n {
            f();
            std::thread::sleep(Duration::from_micros(500));
        }
        0.0
    };
    let ns = match a.op.as_str() {
        "ioctl-traced" => {
            let fd = open(&ctl)?;
            per_call(a.n, &|| ioctl(fd))
        }
        "ioctl-untraced" => {
            let fd = open(null)?;
            per_call(a.n, &|| ioctl(fd))
        }
        // A syscall no probe is about: what every process on the node pays while the probes are attached.
        "getppid" => per_call(a.n, &|| {
            // SAFETY: getppid has no arguments and cannot fail.
            unsafe { libc::getppid() };
        }),
        "openclose" => per_call(a.n, &|| {
            // SAFETY: open and close of /dev/null.
            unsafe { libc::close(libc::open(null.as_ptr(), libc::O_RDONLY)) };
        }),
        "paced" => {
            let fd = open(&ctl)?;
            paced(a.n, &|| ioctl(fd))
        }
        "paced-openclose" => paced(a.n, &|| {
            // SAFETY: open and close of the fake device file.
            unsafe { libc::close(libc::open(ctl.as_ptr(), libc::O_RDWR)) };
        }),
        "flood" => {
            let fd = open(&ctl)?;
            let until = std::time::Instant::now() + Duration::from_millis(a.n);
            std::thread::scope(|s| {
                for _ in 0..2 {
                    s.spawn(|| {
                        while std::time::Instant::now() < until {
                            for _ in 0..1000 {
                                ioctl(fd);
                            }
                        }
                    });
                }
            });
            0.0
        }
        other => anyhow::bail!("unknown bench-worker op {other}"),
    };
    println!("{ns}");
    Ok(())
}

/// The `p`th percentile of sorted values (nearest rank); 0 for none.
pub fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

#[cfg(test)]
mod tests {
    use super::percentile;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&v, 50.0), 50);
        assert_eq!(percentile(&v, 99.0), 99);
        assert_eq!(percentile(&[7], 99.0), 7);
        assert_eq!(percentile(&[], 50.0), 0);
    }
}
