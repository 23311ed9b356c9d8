//! `baton freeze`, `baton thaw`, `baton duty` and `baton governor`: thin clients of the agent's co-runner
//! controller. `freeze` and `thaw` print the latency the container's shim confirmed.
use baton_agent_api::{
    CoRunnerSel, DutyRequest, FreezeRequest, FreezerReply, GovernorRequest, Reply, Request, Target,
};

use crate::node::AgentSocket;

/// What `baton freeze` does (its help line).
pub const FREEZE_ABOUT: &str = "Freeze a container through its shim's cgroup freezer (not a latency-critical \
     one); prints the confirmed latency";
/// What `baton thaw` does (its help line).
pub const THAW_ABOUT: &str = "Thaw a container frozen by `baton freeze` (one the controller or the user holds \
     stays frozen)";

/// `baton freeze` and `baton thaw` (`args`: the whole command line), run without the rest of the CLI: the
/// parser of that one command (the same arguments, help and errors as in the whole CLI), a current-thread
/// runtime, and the log only when `BATON_LOG` asks for one. These commands are a step of
/// whatever calls them, so their cost is the process's: building the parsers of every command (page faults
/// over the binary's code) and the log took longer than the agent and the shim take to freeze. `None`
/// for any other command.
pub fn run_alone(args: &[std::ffi::OsString]) -> Option<std::process::ExitCode> {
    use clap::FromArgMatches as _;
    let freeze = match args.get(1)?.to_str()? {
        "freeze" => true,
        "thaw" => false,
        _ => return None,
    };
    let parsed = alone_command(freeze)
        .try_get_matches_from(&args[1..])
        .and_then(|m| FreezeArgs::from_arg_matches(&m));
    let parsed = match parsed {
        Ok(a) => a,
        // Help, or a usage error: printed and exited as clap does for the whole CLI.
        Err(e) => e.exit(),
    };
    if std::env::var_os("BATON_LOG").is_some() {
        crate::init_log("warn");
    }
    let result = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| anyhow::anyhow!("cannot start the async runtime: {e}"))
        .and_then(|rt| rt.block_on(self::freeze(parsed, freeze)));
    Some(match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("baton: {e:#}");
            std::process::ExitCode::FAILURE
        }
    })
}

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

/// The parser of `baton freeze` (`freeze`) or `baton thaw` alone: what the whole CLI has for it.
fn alone_command(freeze: bool) -> clap::Command {
    use clap::Args as _;
    let (name, about) = if freeze {
        ("freeze", FREEZE_ABOUT)
    } else {
        ("thaw", THAW_ABOUT)
    };
    // The about after the arguments: theirs is the struct's doc comment.
    FreezeArgs::augment_args(clap::Command::new(name))
        .bin_name(format!("baton {name}"))
        .about(about)
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

#[cfg(test)]
mod tests {
    use clap::CommandFactory as _;

    /// What a parser shows of itself: its about and each argument's id, flags, help and whether required.
    fn shape(c: &clap::Command) -> Vec<String> {
        let mut v = vec![format!("{:?}", c.get_about().map(ToString::to_string))];
        v.extend(c.get_arguments().map(|a| {
            format!(
                "{} {:?} {:?} {:?} {}",
                a.get_id(),
                a.get_long(),
                a.get_short(),
                a.get_help().map(ToString::to_string),
                a.is_required_set()
            )
        }));
        v
    }

    #[test]
    fn freeze_and_thaw_alone_parse_what_the_whole_cli_does() {
        let mut whole = crate::Cli::command();
        whole.build();
        for (name, freeze) in [("freeze", true), ("thaw", false)] {
            let mut alone = super::alone_command(freeze);
            alone.build();
            let sub = whole.find_subcommand(name).unwrap();
            assert_eq!(shape(&alone), shape(sub), "{name}");
        }
    }

    #[test]
    fn only_freeze_and_thaw_run_alone() {
        let args = |a: &[&str]| a.iter().map(std::ffi::OsString::from).collect::<Vec<_>>();
        assert!(super::run_alone(&args(&["baton", "status"])).is_none());
        assert!(super::run_alone(&args(&["baton"])).is_none());
        assert!(super::run_alone(&args(&["baton", "--version"])).is_none());
    }
}
