//! `baton freeze`, `baton thaw`, `baton duty` and `baton governor`: thin clients of the agent's co-runner
//! controller. `freeze` and `thaw` print the latency the container's shim confirmed.
use baton_agent_api::{
    CoRunnerSel, DutyRequest, FreezeRequest, FreezerReply, GovernorRequest, Reply, Request, Target,
};

use crate::node::AgentSocket;

/// Arguments of `baton freeze` and `baton thaw`.
#[derive(clap::Args, Debug)]
pub struct FreezeArgs {
    #[command(flatten)]
    agent: AgentSocket,
    /// The container id, as containerd shows it (a co-runner, or a container without a role).
    id: String,
    /// Its namespace, when the id is in several.
    #[arg(short = 'n', long)]
    namespace: Option<String>,
    /// freeze: thaw by itself after this many ms (default: until `baton thaw`).
    #[arg(long)]
    hold_ms: Option<u64>,
    /// Print the agent's JSON reply.
    #[arg(long)]
    json: bool,
}

/// Arguments of `baton duty`.
#[derive(clap::Args, Debug)]
pub struct DutyArgs {
    #[command(flatten)]
    agent: AgentSocket,
    /// Running time per window, ms (equal to the window: always running, which clears the cycle).
    run_ms: u64,
    /// Window, ms.
    window_ms: u64,
    /// Only this co-runner (default: every co-runner on the node).
    #[arg(long)]
    id: Option<String>,
    /// Its namespace, when the id is in several.
    #[arg(short = 'n', long)]
    namespace: Option<String>,
}

/// Arguments of `baton governor`.
#[derive(clap::Args, Debug)]
pub struct GovernorArgs {
    #[command(flatten)]
    agent: AgentSocket,
    /// Allowed mean stretch of the server's inter-token gaps (0.2: 20% longer); `off` turns it off.
    target: String,
    /// Window the run share applies to, ms.
    #[arg(long, default_value_t = 200)]
    window_ms: u64,
}

/// `baton freeze` (`freeze = true`) or `baton thaw`.
pub async fn freeze(args: FreezeArgs, freeze: bool) -> anyhow::Result<()> {
    let mut client = args.agent.connect().await?;
    let target = Target {
        id: args.id,
        namespace: args.namespace,
    };
    let request = if freeze {
        Request::Freeze(FreezeRequest {
            target,
            hold_ms: args.hold_ms,
            lease_ms: None,
            renew: false,
        })
    } else {
        Request::Thaw(target)
    };
    let Reply::Freezer(r) = client.call(request).await? else {
        anyhow::bail!("the agent answered with something else");
    };
    if args.json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        println!("{}", render(&r, freeze));
    }
    Ok(())
}

fn render(r: &FreezerReply, freeze: bool) -> String {
    let state = if r.frozen { "frozen" } else { "running" };
    let what = if freeze { "freeze" } else { "thaw" };
    let latency = if r.latency_ns > 0 {
        format!(", {what} confirmed in {:.1} us", r.latency_ns as f64 / 1e3)
    } else {
        String::new()
    };
    let note = r
        .note
        .as_ref()
        .map_or_else(String::new, |n| format!(" ({n})"));
    format!(
        "{}/{}: {state}{latency}{note}",
        r.container.namespace, r.container.id
    )
}

/// `baton duty`.
pub async fn duty(args: DutyArgs) -> anyhow::Result<()> {
    let mut client = args.agent.connect().await?;
    let request = Request::Duty(DutyRequest {
        co_runner: CoRunnerSel {
            id: args.id,
            namespace: args.namespace,
        },
        run_ms: args.run_ms,
        window_ms: args.window_ms,
    });
    accepted(client.call(request).await?)
}

/// `baton governor`.
pub async fn governor(args: GovernorArgs) -> anyhow::Result<()> {
    let mut client = args.agent.connect().await?;
    let off = args.target == "off";
    let target_stretch = if off {
        0.0
    } else {
        args.target
            .parse()
            .map_err(|_| anyhow::anyhow!("the target is a number such as 0.2, or `off`"))?
    };
    let request = Request::Governor(GovernorRequest {
        target_stretch,
        window_ms: args.window_ms,
        off,
    });
    accepted(client.call(request).await?)
}

fn accepted(reply: Reply) -> anyhow::Result<()> {
    let Reply::Accepted(a) = reply else {
        anyhow::bail!("the agent answered with something else");
    };
    println!(
        "accepted: {} co-runner(s) to be frozen now, {} request(s) shielded",
        a.frozen, a.shielded
    );
    Ok(())
}
