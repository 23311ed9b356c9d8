//! `baton preempt`, `baton resume` and `baton handoff`: thin clients of the agent's socket that print the
//! timeline as it comes (times relative to the request), or JSON lines with `--json`.
use baton_agent_api::{
    HandoffOrder, HandoffRequest, Outcome, PreemptMode, PreemptRequest, Reply, Request, Step,
    Target,
};

use crate::node::AgentSocket;

/// How a container gives up the GPU, on the command line.
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum ModeArg {
    /// cuda-checkpoint into host memory, then freeze (resume: thaw, restore, unlock).
    Park,
    /// As park up to the release, then runc checkpoint (CRIU).
    Snapshot,
}

impl From<ModeArg> for PreemptMode {
    fn from(m: ModeArg) -> Self {
        match m {
            ModeArg::Park => PreemptMode::Park,
            ModeArg::Snapshot => PreemptMode::Snapshot,
        }
    }
}

/// When `handoff` starts the second container, on the command line.
#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum OrderArg {
    /// On the first container's release signal.
    Overlapped,
    /// Once the first container's preemption has completed.
    Sequential,
}

/// Arguments of `baton preempt`.
#[derive(clap::Args, Debug)]
pub struct PreemptArgs {
    #[command(flatten)]
    agent: AgentSocket,
    /// The container id, as containerd shows it.
    id: String,
    /// Its namespace, when the id is in several.
    #[arg(short = 'n', long)]
    namespace: Option<String>,
    /// Park (default) or snapshot.
    #[arg(long, value_enum, default_value = "park")]
    mode: ModeArg,
    /// Snapshot: where the image goes, an absolute path (default: <snapshot_dir>/<namespace>/<id>, with
    /// the node's snapshot_dir, /var/lib/baton/snapshots unless its TOML says otherwise).
    #[arg(long, value_parser = absolute_image_path)]
    image_path: Option<String>,
    /// One JSON object per step, then the outcome.
    #[arg(long)]
    json: bool,
}

/// Arguments of `baton resume`.
#[derive(clap::Args, Debug)]
pub struct ResumeArgs {
    #[command(flatten)]
    agent: AgentSocket,
    /// The container id.
    id: String,
    /// Its namespace, when the id is in several.
    #[arg(short = 'n', long)]
    namespace: Option<String>,
    /// One JSON object per step, then the outcome.
    #[arg(long)]
    json: bool,
}

/// Arguments of `baton handoff`.
#[derive(clap::Args, Debug)]
pub struct HandoffArgs {
    #[command(flatten)]
    agent: AgentSocket,
    /// The container that gives the GPU up.
    #[arg(long)]
    from: String,
    /// The container that gets it (a created task, or a parked one).
    #[arg(long)]
    to: String,
    /// The namespace of both, when an id is in several.
    #[arg(short = 'n', long)]
    namespace: Option<String>,
    /// How `--from` gives the GPU up.
    #[arg(long, value_enum, default_value = "park")]
    mode: ModeArg,
    /// When `--to` starts.
    #[arg(long, value_enum, default_value = "overlapped")]
    order: OrderArg,
    /// One JSON object per step, then the outcome.
    #[arg(long)]
    json: bool,
}

fn target(id: &str, namespace: &Option<String>) -> Target {
    Target {
        id: id.to_owned(),
        namespace: namespace.clone(),
    }
}

/// `baton preempt`.
pub async fn preempt(a: PreemptArgs) -> anyhow::Result<()> {
    let request = Request::Preempt(PreemptRequest {
        target: target(&a.id, &a.namespace),
        mode: a.mode.into(),
        pids: Vec::new(),
        image_path: a.image_path,
        parked_for: None,
        idle_park: false,
        vram_bytes: None,
        host_budget_left_bytes: None,
        again: false,
    });
    run(&a.agent, request, a.json).await
}

/// `baton resume`.
pub async fn resume(a: ResumeArgs) -> anyhow::Result<()> {
    run(
        &a.agent,
        Request::Resume(target(&a.id, &a.namespace)),
        a.json,
    )
    .await
}

/// `baton handoff`.
pub async fn handoff(a: HandoffArgs) -> anyhow::Result<()> {
    let request = Request::Handoff(HandoffRequest {
        from: target(&a.from, &a.namespace),
        to: target(&a.to, &a.namespace),
        mode: a.mode.into(),
        order: match a.order {
            OrderArg::Overlapped => HandoffOrder::Overlapped,
            OrderArg::Sequential => HandoffOrder::Sequential,
        },
    });
    run(&a.agent, request, a.json).await
}

async fn run(agent: &AgentSocket, request: Request, json: bool) -> anyhow::Result<()> {
    let mut client = agent.connect().await?;
    let mut first: Option<u64> = None;
    let reply = client
        .call_with_steps(request, |step| {
            let t0 = *first.get_or_insert(step.t_ns);
            if json {
                if let Ok(line) = serde_json::to_string(step) {
                    println!("{line}");
                }
            } else {
                println!("{}", render_step(step, t0));
            }
        })
        .await?;
    let Reply::Done(outcome) = reply else {
        anyhow::bail!("the agent answered with something else: {reply:?}");
    };
    if json {
        println!("{}", serde_json::to_string(&outcome)?);
    } else {
        println!("{}", render_outcome(&outcome, first.unwrap_or(0)));
    }
    Ok(())
}

/// One timeline line: `+   12.345 ms  trainer  checkpointed  pid 42`. Steps that come out of order
/// (the agent's release signal may be stamped before a shim step already printed) show their own time.
pub fn render_step(s: &Step, t0: u64) -> String {
    let ms = s.t_ns.saturating_sub(t0) as f64 / 1e6;
    let mut line = format!("+{ms:>10.3} ms  {:<16} {}", s.container.id, s.phase.label());
    if let Some(pid) = s.pid {
        line.push_str(&format!("  pid {pid}"));
    }
    if !s.detail.is_empty() {
        line.push_str(&format!("  ({})", s.detail));
    }
    line
}

fn render_outcome(o: &Outcome, t0: u64) -> String {
    let total = o.steps.last().map_or(0, |s| s.t_ns.saturating_sub(t0));
    let state = o.preemption.as_ref().map_or("running".to_owned(), |p| {
        format!("{:?}", p.state).to_lowercase()
    });
    format!(
        "{}: {state} after {:.3} ms",
        o.container.id,
        total as f64 / 1e6
    )
}

/// `--image-path`: absolute only (the shim writes the image; a relative path would be its, not the caller's).
fn absolute_image_path(path: &str) -> Result<String, String> {
    baton_agent_api::check_image_path(path).map(|()| path.to_owned())
}

#[cfg(test)]
mod tests {
    use baton_agent_api::{ContainerRef, Phase};

    use super::*;

    #[derive(clap::Parser, Debug)]
    struct Preempt {
        #[command(flatten)]
        args: PreemptArgs,
    }

    #[test]
    fn a_relative_image_path_is_refused_with_what_to_give() {
        use clap::Parser;
        let parse = |path: &str| {
            Preempt::try_parse_from(["preempt", "c1", "--mode", "snapshot", "--image-path", path])
        };
        let e = parse("snapshots/c1").unwrap_err().to_string();
        assert!(e.contains("give an absolute path"), "{e}");
        let ok = parse("/var/tmp/c1").unwrap();
        assert_eq!(ok.args.image_path.as_deref(), Some("/var/tmp/c1"));
    }

    #[test]
    fn a_step_is_shown_relative_to_the_request() {
        let s = Step {
            t_ns: 2_500_000,
            container: ContainerRef {
                id: "trainer".into(),
                namespace: "default".into(),
            },
            phase: Phase::Checkpointed,
            pid: Some(42),
            detail: String::new(),
            no_cuda_state: Vec::new(),
        };
        let line = render_step(&s, 1_000_000);
        assert!(line.contains("1.500 ms"), "{line}");
        assert!(
            line.contains("trainer") && line.contains("checkpointed  pid 42"),
            "{line}"
        );
    }
}
