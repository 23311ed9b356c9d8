//! `baton trace`: attaches the probes, follows the selected containers, prints one line (or one JSON
//! object) per driver call and, every `--launch-interval`, per container the CUDA launches counted by the
//! libcuda uprobes (standalone probe set only), and on exit a per-container summary.
mod via_agent;

use std::{collections::HashSet, io::Write, path::PathBuf, time::Duration};

use anyhow::{Context, bail};
use baton_nvidia::layout::DriverVersion;
use baton_tracer::{Tracer, TracerConfig, cgroups, event::Event};
use clap::Args;

use baton_agent::trace_output::{LaunchMeter, Output, Selection, Summary};

use crate::timeline::{self, Timeline};

/// Options of `baton trace`.
#[derive(Args, Clone, Debug, Default)]
pub struct TraceArgs {
    /// Trace containers with this name (containerd `namespace/id`, or a container id or its 12-character
    /// prefix); repeatable. Containers started later are picked up.
    #[arg(long = "container", short = 'c')]
    pub containers: Vec<String>,
    /// Trace this cgroup (v2 path relative to the cgroup root, e.g. /default/trainer); repeatable.
    #[arg(long = "cgroup")]
    pub cgroups: Vec<PathBuf>,
    /// Trace the container (cgroup) of this process and show only its calls; repeatable.
    #[arg(long = "pid", short = 'p')]
    pub pids: Vec<u32>,
    /// Trace every process on the node.
    #[arg(long)]
    pub all: bool,
    /// One JSON object per event instead of text lines.
    #[arg(long)]
    pub json: bool,
    /// With --json: each ioctl's captured parameter bytes too (`params`, `nested`, hex), so that the trace
    /// can be decoded again later (tools/gpu-check's golden traces).
    #[arg(long, requires = "json")]
    pub raw: bool,
    /// Print a per-container summary when tracing ends.
    #[arg(long)]
    pub summary: bool,
    /// No live lines (with --summary: only the summary, like strace -c).
    #[arg(long, short = 'q')]
    pub quiet: bool,
    /// Stop after this many seconds.
    #[arg(long)]
    pub duration: Option<f64>,
    /// Directory prefixes of the NVIDIA device files (default /dev/); repeatable, at most 4.
    #[arg(long = "prefix")]
    pub prefixes: Vec<String>,
    /// Decode with the struct layouts of this driver version instead of the host's (e.g. 535.104.05).
    #[arg(long)]
    pub driver_version: Option<String>,
    /// cgroup v2 mount point (found from /proc/self/mountinfo by default).
    #[arg(long)]
    pub cgroup_root: Option<PathBuf>,
    /// Write events here instead of stdout.
    #[arg(long, short = 'o')]
    pub output: Option<PathBuf>,
    /// Seconds between launch lines (per container, the CUDA launches counted since the previous line; only
    /// while it launches); 1 by default.
    #[arg(long, value_parser = parse_interval)]
    pub launch_interval: Option<f64>,
    /// Timelines to write when tracing ends.
    #[command(flatten)]
    pub timeline: timeline::Outputs,
    /// Load a probe set of its own even when a `baton agent` runs (by default the agent's set traces, so
    /// that the node pays for one; `--driver-version` and `--cgroup-root` imply this).
    #[arg(long)]
    pub standalone: bool,
}

fn parse_interval(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.001 => Ok(v),
        _ => Err(format!(
            "{s:?} is not a number of seconds of at least 0.001"
        )),
    }
}

/// Printed on stderr once the probes are attached and the selected cgroups watched (README, `baton trace`):
/// calls made from then on are traced. A stable text, as bpftrace's "Attaching N probes...".
pub const READY_LINE: &str = "baton trace: probes attached, tracing";

/// Runs `baton trace` until Ctrl-C, SIGTERM or `--duration`.
pub async fn run(args: TraceArgs) -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    // Installed before the ready line is printed, so that a signal sent after it ends tracing cleanly.
    let mut interrupt = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let mut terminate =
        signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let stop = async move {
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = terminate.recv() => {}
        }
    };
    if args.containers.is_empty() && args.cgroups.is_empty() && args.pids.is_empty() && !args.all {
        bail!("nothing to trace: give --container NAME, --cgroup PATH, --pid PID or --all");
    }
    if !args.standalone && args.driver_version.is_none() && args.cgroup_root.is_none() {
        let socket = baton_agent_api::default_socket();
        if let Some(client) = via_agent::agent_answering(&socket).await {
            return via_agent::run(args, client, stop).await;
        }
    }
    run_until(args, stop, |_| {}).await
}

/// Runs the tracer until `stop` completes; `on_event` sees every event (the demo uses it).
pub async fn run_until(
    args: TraceArgs,
    stop: impl std::future::Future<Output = ()>,
    mut on_event: impl FnMut(&Event),
) -> anyhow::Result<()> {
    if args.containers.is_empty() && args.cgroups.is_empty() && args.pids.is_empty() && !args.all {
        bail!("nothing to trace: give --container NAME, --cgroup PATH, --pid PID or --all");
    }
    let driver_version = match &args.driver_version {
        Some(v) => Some(
            DriverVersion::parse(v)
                .with_context(|| format!("--driver-version {v:?} is not X.Y[.Z]"))?,
        ),
        None => None,
    };
    let prefixes = if args.prefixes.is_empty() {
        vec!["/dev/".to_owned()]
    } else {
        args.prefixes.clone()
    };
    let mut tracer = Tracer::start(TracerConfig {
        watch_all: args.all,
        prefixes,
        cgroup_root: args.cgroup_root.clone(),
        driver_version,
        ..Default::default()
    })?;
    let mut sel = Selection {
        names: args.containers.clone(),
        watched: HashSet::new(),
    };
    for path in &args.cgroups {
        let id = tracer.cgroups_mut().id_of_path(path)?;
        sel.watched.insert(id);
        tracer.watch_cgroup(id)?;
    }
    for pid in &args.pids {
        let root = tracer.cgroup_root().to_path_buf();
        let id = cgroups::cgroup_id_of_pid(&root, *pid as i32)
            .with_context(|| format!("no process {pid} (or it has no cgroup v2)"))?;
        if sel.watched.insert(id) {
            tracer.watch_cgroup(id)?;
        }
    }
    sel.refresh(&mut tracer)?;
    // Every probe is attached and the selection watched: what callers starting a workload wait for.
    eprintln!("{READY_LINE}");

    let out: Box<dyn Write> = match &args.output {
        Some(p) => Box::new(
            std::fs::File::create(p).with_context(|| format!("cannot create {}", p.display()))?,
        ),
        None => Box::new(std::io::stdout().lock()),
    };
    let mut output = Output {
        out,
        summary: Summary::default(),
        pids: args.pids.iter().copied().collect(),
        json: args.json,
        raw: args.raw,
        quiet: args.quiet,
        t0: now_monotonic_ns(),
        probes_shown: HashSet::new(),
        timeline: args.timeline.any().then(Timeline::default),
    };
    let deadline = async {
        match args.duration {
            Some(s) => tokio::time::sleep(Duration::from_secs_f64(s)).await,
            None => std::future::pending().await,
        }
    };
    tokio::pin!(stop, deadline);
    let mut rescan = tokio::time::interval(Duration::from_millis(500));
    let mut reported_drops = 0;
    let launch_every = Duration::from_secs_f64(args.launch_interval.unwrap_or(1.0).max(0.001));
    let mut launch_tick =
        tokio::time::interval_at(tokio::time::Instant::now() + launch_every, launch_every);
    let mut meter = LaunchMeter::default();
    let mut last_launch_ns = output.t0;
    loop {
        tokio::select! {
            _ = &mut stop => break,
            _ = &mut deadline => break,
            _ = rescan.tick() => {
                sel.refresh(&mut tracer)?;
                reported_drops = report_drops(&tracer, reported_drops);
            }
            _ = launch_tick.tick() => {
                last_launch_ns = launch_lines(&mut meter, &mut output, &mut tracer, &sel, args.all, last_launch_ns)?;
            }
            batch = tracer.next_events() => output.take(&batch?, &mut tracer, &mut on_event, None)?,
        }
    }
    output.take(&tracer.drain_now()?, &mut tracer, &mut on_event, None)?;
    launch_lines(
        &mut meter,
        &mut output,
        &mut tracer,
        &sel,
        args.all,
        last_launch_ns,
    )?;
    report_drops(&tracer, reported_drops);
    if args.summary {
        let report = output.summary.render(&mut tracer);
        writeln!(output.out, "{report}")?;
    }
    output.out.flush()?;
    if let Some(t) = &output.timeline {
        args.timeline.write(t)?;
    }
    Ok(())
}

/// Prints the launches since `since_ns` of the traced containers; returns now.
fn launch_lines<W: Write>(
    meter: &mut LaunchMeter,
    output: &mut Output<W, Timeline>,
    tracer: &mut Tracer,
    sel: &Selection,
    all: bool,
    since_ns: u64,
) -> anyhow::Result<u64> {
    let now = now_monotonic_ns();
    let deltas = meter.tick(tracer, (!all).then_some(&sel.watched));
    output.launches(&deltas, tracer, now, now.saturating_sub(since_ns))?;
    Ok(now)
}

/// Prints the number of events lost since the last report to stderr; returns the new total.
fn report_drops(tracer: &Tracer, before: u64) -> u64 {
    let now = tracer.dropped();
    if now > before {
        eprintln!(
            "baton trace: {} events lost: the ring buffer was full (the consumer is too slow: use --json -o FILE, or fewer containers)",
            now - before
        );
    }
    now
}

pub use baton_tracer::now_monotonic_ns;
