//! `baton status` and `baton events`: thin clients of the agent's socket.
use std::path::PathBuf;

use anyhow::Context;
use baton_agent_api::{
    Client, ContainerStatus, Event, EventBody, Filter, GpuHold, NodeStatus, Reply, Request,
};

/// Where the agent is.
#[derive(clap::Args, Debug)]
pub struct AgentSocket {
    /// The agent's socket (default: $BATON_AGENT_SOCKET, else /run/baton/agent.sock).
    #[arg(long)]
    socket: Option<PathBuf>,
}

impl AgentSocket {
    /// Connects to the agent's socket.
    pub async fn connect(&self) -> anyhow::Result<Client> {
        let path = self
            .socket
            .clone()
            .unwrap_or_else(baton_agent_api::default_socket);
        Ok(Client::connect(&path).await?)
    }
}

/// Arguments of `baton status`.
#[derive(clap::Args, Debug)]
pub struct StatusArgs {
    #[command(flatten)]
    agent: AgentSocket,
    /// Only this container id.
    container: Option<String>,
    /// Only this containerd namespace.
    #[arg(short = 'n', long)]
    namespace: Option<String>,
    /// Print the agent's JSON reply.
    #[arg(long)]
    json: bool,
}

/// Arguments of `baton events`.
#[derive(clap::Args, Debug)]
pub struct EventsArgs {
    #[command(flatten)]
    agent: AgentSocket,
    /// Only this container id.
    #[arg(long)]
    container: Option<String>,
    /// Only this containerd namespace.
    #[arg(short = 'n', long)]
    namespace: Option<String>,
    /// One JSON object per line (the agent's event lines).
    #[arg(long)]
    json: bool,
}

/// `baton status`.
pub async fn status(args: StatusArgs) -> anyhow::Result<()> {
    let mut client = args.agent.connect().await?;
    let filter = Filter {
        container: args.container,
        namespace: args.namespace,
        mine: false,
    };
    let Reply::Status(status) = client.call(Request::Status(filter)).await? else {
        anyhow::bail!("the agent answered status with something else");
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&status)?);
    } else {
        print!(
            "{}",
            render_status(&status, crate::trace::now_monotonic_ns())
        );
    }
    Ok(())
}

/// `baton events`: prints the agent's events until interrupted.
pub async fn events(args: EventsArgs) -> anyhow::Result<()> {
    let mut client = args.agent.connect().await?;
    client
        .watch(Filter {
            container: args.container,
            namespace: args.namespace,
            mine: false,
        })
        .await?;
    loop {
        let event = client.next_event().await.context("reading events")?;
        if args.json {
            println!("{}", serde_json::to_string(&event)?);
        } else {
            println!("{}", render_event(&event));
        }
    }
}

fn gpu_word(g: GpuHold) -> &'static str {
    match g {
        GpuHold::Never => "never",
        GpuHold::Held => "held",
        GpuHold::Released => "released",
    }
}

/// The table `baton status` prints.
pub fn render_status(s: &NodeStatus, now_ns: u64) -> String {
    let mut out = format!(
        "agent pid {}, probes {} ({} programs), {} ring-buffer drops ({} resyncs from /proc), {} calls \
         sharing an in-flight slot kept in the overflow, {} calls lost (made up for from /proc)\n",
        s.agent_pid,
        if s.probes_attached {
            "attached"
        } else {
            "detached"
        },
        s.programs_attached,
        s.ringbuf_drops,
        s.resyncs,
        s.pending_overflowed,
        s.pending_lost
    );
    if let Some(m) = &s.probe_fd_map {
        out.push_str(&format!(
            "probe fd map: {} of {} entries free, {} of its reserve of {} (kept for each container's first \
             fds)\n",
            m.entries.saturating_sub(m.used),
            m.entries,
            m.reserve_free,
            m.reserve
        ));
    }
    out.push_str(&format!(
        "{:<16} {:<10} {:<9} {:>8} {:>4} {:>5} {:>7} {:>12}  {}\n",
        "CONTAINER", "NAMESPACE", "GPU", "SINCE", "FDS", "MAPS", "OBJECTS", "VRAM", "PIDS"
    ));
    for c in &s.containers {
        out.push_str(&render_container(c, now_ns));
    }
    out.push_str(&render_gpus(&s.gpus));
    out.push_str(&render_controller(&s.controller));
    out.push_str(&render_gap_fill(&s.gap_fill));
    out.push_str(&render_parked_host_memory(s));
    out.push_str(&render_peaks(&s.peaks));
    out
}

/// The host memory parked containers hold (the host copies of their device memory), each one's, and the
/// node's budget for the limits their parks raised.
fn render_parked_host_memory(s: &NodeStatus) -> String {
    use baton_agent_api::room::show_bytes;
    let p = &s.parked_host_memory;
    let mut out = format!(
        "parked host memory: {} held; memory limits raised by {} of a budget of {} \
         (parked_host_memory_budget)\n",
        show_bytes(p.held_bytes),
        show_bytes(p.raised_bytes),
        show_bytes(p.budget_bytes)
    );
    for c in &s.containers {
        let Some(state) = &c.preemption else {
            continue;
        };
        let Some(held) = state.host_copy_bytes else {
            continue;
        };
        out.push_str(&format!(
            "  {} (namespace {}): {}{}\n",
            c.container.id,
            c.container.namespace,
            show_bytes(held),
            state.raised_limit.map_or_else(String::new, |r| format!(
                ", its memory limit raised from {} to {} while parked",
                show_bytes(r.was_bytes),
                show_bytes(r.raised_to_bytes)
            ))
        ));
    }
    out
}

/// The ledger's peak per container name in `baton status` (nothing when none was watched).
fn render_peaks(peaks: &[baton_agent_api::room::PeakMemory]) -> String {
    if peaks.is_empty() {
        return String::new();
    }
    let mut out = format!(
        "peak GPU memory per container name (what to set baton.io/gpu-memory from)\n{:<16} {:<24} {:>11} {:>10}\n",
        "NAMESPACE", "NAME", "PEAK", "CONTAINERS"
    );
    for p in peaks {
        out.push_str(&format!(
            "{:<16} {:<24} {:>11} {:>10}\n",
            p.namespace,
            p.name,
            baton_agent_api::room::show_bytes(p.peak_bytes),
            p.containers
        ));
    }
    out
}

/// Gap-fill's part of `baton status`: the co-runners the agent parked by itself, in the order it resumes
/// them, with their ages; those it is preempting; those that finished instead (nothing when all are empty).
fn render_gap_fill(g: &baton_agent_api::GapFillStatus) -> String {
    let mut out = render_room(g);
    out.push_str(&render_rate_gate(g));
    if g.parked.is_empty() && g.preempting.is_empty() && g.finished.is_empty() {
        return out;
    }
    out.push_str(&format!(
        "gap-fill: resume order (priority + {} per second parked)\n{:<4} {:<16} {:<10} {:<9} {:>8} {:>9} {:>9}  {}\n",
        baton_agent_api::gapfill::AGING_PER_SECOND,
        "NEXT",
        "PARKED",
        "NAMESPACE",
        "MODE",
        "PRIORITY",
        "PARKED",
        "EFFECTIVE",
        "FOR"
    ));
    for (i, p) in g.parked.iter().enumerate() {
        out.push_str(&format!(
            "{:<4} {:<16} {:<10} {:<9} {:>8} {:>8.1}s {:>9.2}  {}{}\n",
            i + 1,
            p.container.id,
            p.container.namespace,
            p.mode.label(),
            p.priority,
            p.parked_ns as f64 / 1e9,
            p.effective_priority,
            p.parked_for.id,
            if p.resuming { " (resuming)" } else { "" }
        ));
        if let Some(e) = &p.resume_error {
            out.push_str(&format!(
                "     {} resume(s) failed in a row, the last: {e}\n",
                p.failed_resumes
            ));
        }
    }
    for p in &g.preempting {
        out.push_str(&format!(
            "preempting {} (namespace {}) for {}\n",
            p.container.id, p.container.namespace, p.parked_for.id
        ));
    }
    for f in &g.finished {
        out.push_str(&format!(
            "finished {} (namespace {}): {}\n",
            f.container.id, f.container.namespace, f.detail
        ));
    }
    out
}

/// The gate's room per GPU in `baton status`: capacity, headroom, room, what each holder has and what each
/// waiting Start needs (`whole`: the whole GPU; nothing without a GPU row).
fn render_room(g: &baton_agent_api::GapFillStatus) -> String {
    use baton_agent_api::room::show_bytes;
    if g.gpus.is_empty() {
        return String::new();
    }
    let amount = |b: Option<u64>| b.map_or_else(|| "whole".to_owned(), show_bytes);
    let mut out = format!(
        "GPU memory (a Start with baton.io/gpu-memory goes through when its need fits in ROOM)\n{:<12} {:>11} {:>9} {:>11}  {:<32} {}\n",
        "GPU", "CAPACITY", "HEADROOM", "ROOM", "HOLDERS", "WAITERS (NEED)"
    );
    for gpu in &g.gpus {
        let r = &gpu.room;
        let held: Vec<String> = r
            .held
            .iter()
            .map(|h| format!("{} {}", h.container.id, amount(h.bytes)))
            .collect();
        let needs: Vec<String> = r
            .needs
            .iter()
            .map(|n| format!("{} {}", n.container.id, amount(n.bytes)))
            .collect();
        let list = |l: Vec<String>| {
            if l.is_empty() {
                "-".to_owned()
            } else {
                l.join(", ")
            }
        };
        out.push_str(&format!(
            "{:<12} {:>11} {:>9} {:>11}  {:<32} {}\n",
            gpu.device,
            r.capacity_bytes
                .map_or_else(|| "unknown".to_owned(), show_bytes),
            show_bytes(r.headroom_bytes),
            r.room_bytes.map_or_else(|| "-".to_owned(), show_bytes),
            list(held),
            list(needs)
        ));
        if let Some(n) = &r.nvml {
            out.push_str(&format!(
                "{:<12} NVML: {} used, {} free, idle {} (+{} tolerance){}\n",
                "",
                show_bytes(n.used_bytes),
                show_bytes(n.free_bytes),
                n.idle_baseline_bytes
                    .map_or_else(|| "not measured yet".to_owned(), show_bytes),
                show_bytes(n.tolerance_bytes),
                n.unaccounted_bytes.map_or_else(String::new, |u| format!(
                    "; {} used that no ledger accounts for",
                    show_bytes(u)
                ))
            ));
        }
    }
    out
}

/// The rate gate's part of `baton status`: per GPU, its holders, waiters, parked co-runners, C, the
/// preemptions per hour, the projected share and whether the agent fills it (nothing without a GPU).
fn render_rate_gate(g: &baton_agent_api::GapFillStatus) -> String {
    if g.gpus.is_empty() {
        return String::new();
    }
    let ids = |cs: &[baton_agent_api::ContainerRef]| match cs.len() {
        0 => "-".to_owned(),
        _ => cs
            .iter()
            .map(|c| c.id.as_str())
            .collect::<Vec<_>>()
            .join(","),
    };
    let mut out = format!(
        "gap-fill: rate gate (fills while 1 - rate * C / 3600 >= {}, rate over {}s)\n{:<12} {:<8} {:>8} {:>8} {:>6}  {:<16} {:<16} {}\n",
        g.rate_gate.min_share,
        g.rate_gate.window_s,
        "GPU",
        "FILLING",
        "C",
        "RATE/H",
        "SHARE",
        "HOLDERS",
        "WAITERS",
        "PARKED"
    );
    for gpu in &g.gpus {
        out.push_str(&format!(
            "{:<12} {:<8} {:>8} {:>8.1} {:>6}  {:<16} {:<16} {}\n",
            gpu.device,
            if gpu.filling { "on" } else { "off" },
            gpu.c_s
                .map_or_else(|| "-".to_owned(), |c| format!("{c:.2}s")),
            gpu.preemptions_per_hour,
            gpu.projected_share
                .map_or_else(|| "-".to_owned(), |s| format!("{s:.3}")),
            ids(&gpu.holders),
            ids(&gpu.waiters),
            ids(&gpu.parked)
        ));
    }
    out
}

/// The controller's part of `baton status` (nothing when it has no co-runner).
fn render_controller(c: &baton_agent_api::ControllerStatus) -> String {
    if c.co_runners.is_empty() {
        return String::new();
    }
    let mut out = format!(
        "controller: {} live requests ({} shielded), {} silence thaws",
        c.live_requests, c.shielded, c.silence_thaws
    );
    if let Some(g) = &c.governor {
        out.push_str(&format!(
            ", governor target {} window {} ms: stretch {}, run share {:.2} ({} running / {} frozen gaps)",
            g.target_stretch,
            g.window_ms,
            g.stretch.map_or_else(|| "not measured yet".to_owned(), |s| format!("{s:.2}")),
            g.run_share,
            g.gaps_running,
            g.gaps_frozen
        ));
    }
    if let Some((run, window)) = c.duty {
        out.push_str(&format!(", duty {run}/{window} ms"));
    }
    out.push('\n');
    out.push_str(&format!(
        "{:<16} {:<10} {:<9} {:>7} {:>9} {:>9} {:>8} {:>10}  {}\n",
        "CO-RUNNER",
        "NAMESPACE",
        "STATE",
        "FREEZES",
        "RUN-SHARE",
        "LONGEST",
        "STARVED",
        "LAUNCHES",
        "YIELDS-TO"
    ));
    for r in &c.co_runners {
        let state = match (&r.frozen_for, r.frozen) {
            (Some(why), _) => why.clone(),
            (None, true) => "frozen".to_owned(),
            (None, false) => "running".to_owned(),
        };
        out.push_str(&format!(
            "{:<16} {:<10} {:<9} {:>7} {:>9.3} {:>7.0}ms {:>8} {:>10}  {}{}\n",
            r.container.id,
            r.container.namespace,
            state,
            r.freezes,
            r.run_share,
            r.longest_frozen_ns as f64 / 1e6,
            r.starvation_thaws,
            r.launches.map_or_else(|| "-".to_owned(), |l| l.to_string()),
            if r.yields_to.is_empty() {
                "*".to_owned()
            } else {
                r.yields_to.join(",")
            },
            r.error
                .as_ref()
                .map_or_else(String::new, |e| format!(" (error: {e})"))
        ));
    }
    out
}

fn render_container(c: &ContainerStatus, now_ns: u64) -> String {
    let since = now_ns.saturating_sub(c.since_ns) as f64 / 1e9;
    let pids: Vec<String> = c.processes.iter().map(|p| p.pid.to_string()).collect();
    format!(
        "{:<16} {:<10} {:<9} {:>7.1}s {:>4} {:>5} {:>7} {:>12}  {}{}{}{}{}\n",
        c.container.id,
        c.container.namespace,
        c.preemption.as_ref().map_or_else(
            || gpu_word(c.gpu).to_owned(),
            |p| format!("{:?}", p.state).to_lowercase()
        ),
        since,
        c.nvidia_fds,
        c.mappings,
        c.live_objects,
        c.vram_bytes,
        if pids.is_empty() {
            "-".to_owned()
        } else {
            pids.join(",")
        },
        if c.partial { " (partial)" } else { "" },
        if c.unconfirmed > 0 {
            format!(" ({} removals not yet confirmed)", c.unconfirmed)
        } else {
            String::new()
        },
        match &c.probe_fds {
            Some(p) if p.over_quota => format!(
                " (past its quota of {} fds in the probes' map: followed through /proc)",
                p.quota
            ),
            _ => String::new(),
        },
        match &c.doubtful {
            Some(d) => format!(
                " (doubtful: {} object(s) counted though read as refused or rewritten, {} free(s) not believed)",
                d.objects, d.frees_disputed
            ),
            None => String::new(),
        }
    )
}

/// The GPUs the watched containers see: the ledger's video memory of those containers beside NVML's used
/// memory of the device (nothing when no container sees a GPU).
fn render_gpus(gpus: &[baton_agent_api::GpuMemory]) -> String {
    if gpus.is_empty() {
        return String::new();
    }
    let mut out = format!(
        "{:<10} {:>10} {:>14} {:>14}\n",
        "GPU", "CONTAINERS", "LEDGER VRAM", "NVML USED"
    );
    for g in gpus {
        out.push_str(&format!(
            "{:<10} {:>10} {:>14} {:>14}\n",
            g.device,
            g.containers,
            g.ledger_vram_bytes,
            g.nvml_used_bytes
                .map_or_else(|| "unavailable".to_owned(), |b| b.to_string())
        ));
    }
    out
}

/// One line of `baton events`.
pub fn render_event(e: &Event) -> String {
    let head = format!(
        "{}.{:09} {}/{}",
        e.t_ns / 1_000_000_000,
        e.t_ns % 1_000_000_000,
        e.container.namespace,
        e.container.id
    );
    match &e.body {
        EventBody::Registered {
            cgroup, partial, ..
        } => format!(
            "{head} registered cgroup={cgroup}{}",
            if *partial { " partial" } else { "" }
        ),
        EventBody::Unregistered {
            live_objects,
            vram_bytes,
            ..
        } => format!("{head} unregistered live_objects={live_objects} vram_bytes={vram_bytes}"),
        EventBody::WatchLost { error } => format!("{head} watch_lost error={error:?}"),
        EventBody::Acquired(a) => format!("{head} acquired pid={}", a.pid),
        EventBody::Released(r) => format!(
            "{head} released pids={:?} confirm_gap_us={:.1} confirmed_by={} objects_freed={} bytes_freed={}",
            r.pids,
            r.t_released_ns.saturating_sub(r.t_last_close_ns) as f64 / 1e3,
            r.confirmed_by,
            r.objects_freed,
            r.bytes_freed
        ),
        EventBody::NvmlCheck(c) => format!(
            "{head} nvml_check released_seq={} asked_after_us={:.1} took_us={:.1} nvml={}",
            c.released_seq,
            c.t_asked_ns.saturating_sub(c.t_released_ns) as f64 / 1e3,
            c.took_ns as f64 / 1e3,
            serde_json::to_string(&c.nvml).unwrap_or_default()
        ),
        EventBody::Other => format!("{head} (an event kind this baton does not know)"),
    }
}

#[cfg(test)]
mod tests {
    use baton_agent_api::{ContainerRef, NvmlCheck, NvmlMissing, NvmlView};

    use super::*;

    #[test]
    fn an_nvml_check_line_names_the_release_it_checks_and_what_nvml_said() {
        let e = Event {
            seq: 8,
            t_ns: 2_500_000_000,
            container: ContainerRef {
                id: "trainer".into(),
                namespace: "default".into(),
            },
            body: EventBody::NvmlCheck(NvmlCheck {
                released_seq: 7,
                t_released_ns: 1_000_000,
                pids: vec![42],
                t_asked_ns: 1_250_000,
                took_ns: 7_000_000,
                nvml: NvmlView::Missing(NvmlMissing::TimedOut),
            }),
        };
        assert_eq!(
            render_event(&e),
            "2.500000000 default/trainer nvml_check released_seq=7 asked_after_us=250.0 took_us=7000.0 \
             nvml=\"timed_out\""
        );
    }

    #[test]
    fn status_shows_the_calls_kept_and_lost_in_flight_and_what_is_left_of_the_fd_map() {
        let s: NodeStatus = serde_json::from_value(serde_json::json!({
            "agent_pid": 1,
            "probes_attached": true,
            "programs_attached": 33,
            "ringbuf_drops": 0,
            "containers": [],
            "pending_overflowed": 12,
            "pending_lost": 3,
            "probe_fd_map": {"entries": 131072, "used": 100352, "reserve": 32768, "reserve_free": 30720},
        }))
        .unwrap();
        let out = render_status(&s, 0);
        assert!(
            out.contains("12 calls sharing an in-flight slot kept in the overflow, 3 calls lost"),
            "{out}"
        );
        assert!(
            out.contains(
                "probe fd map: 30720 of 131072 entries free, 30720 of its reserve of 32768"
            ),
            "{out}"
        );
        // An older agent's count of overwritten records reads as lost ones.
        let old: NodeStatus = serde_json::from_value(serde_json::json!({
            "agent_pid": 1, "probes_attached": true, "programs_attached": 33, "ringbuf_drops": 0,
            "containers": [], "pending_evicted": 5,
        }))
        .unwrap();
        assert_eq!((old.pending_lost, old.probe_fd_map), (5, None));
    }
}
