//! `baton-hook`: OCI hooks for containers that run under plain runc, CRI-O or podman instead of the Baton
//! shim. Put it in a bundle's config.json (or a hooks.d file) as
//! `createRuntime: baton-hook create-runtime`, `poststart: baton-hook poststart`,
//! `poststop: baton-hook poststop`, and optionally `createRuntime: baton-hook wait-gpu-free --timeout 20s`.
//! It reads the OCI state on stdin, tells the node agent, writes one line on stderr (and in `--log`), and
//! exits 0 unless the container is meant to fail (see `baton_runc_hooks::outcome`).
use std::{io::Write, path::PathBuf, process::ExitCode};

use baton_runc_hooks::{
    agent::Agent,
    outcome::Outcome,
    stages::{self, Options},
    state::HookState,
};
use clap::{Parser, Subcommand};

/// OCI hooks that have the baton agent watch containers run without the Baton shim.
#[derive(Parser)]
#[command(name = "baton-hook", version)]
struct Cli {
    /// The agent's socket [default: $BATON_AGENT_SOCKET, else /run/baton/agent.sock]. runtimes give hooks
    /// only the environment the hook entry names, so give it here.
    #[arg(long, global = true)]
    socket: Option<PathBuf>,
    /// The namespace the agent files the container under [default: the baton.io/namespace annotation, else
    /// io.container.manager (libpod, cri-o), else "runc"].
    #[arg(long, global = true)]
    namespace: Option<String>,
    /// The device path prefix the probes follow (its folder is where the container's NVIDIA files are).
    #[arg(long, global = true, default_value = "/dev/nvidia")]
    trace_prefix: String,
    /// How long connecting to the agent and one request may take ("500ms", "10s"); the gate waits its own
    /// timeout on top.
    #[arg(long, global = true, default_value = "10s", value_parser = duration)]
    agent_timeout: std::time::Duration,
    /// Fail the container (exit 1) when the agent cannot watch it, instead of a warning.
    #[arg(long, global = true)]
    require_agent: bool,
    /// Also append the hook's line to this file (a runtime drops a successful hook's stderr).
    #[arg(long, global = true)]
    log: Option<PathBuf>,
    #[command(subcommand)]
    stage: Stage,
}

#[derive(Subcommand)]
enum Stage {
    /// createRuntime hook: register the container with the agent before its program runs.
    #[command(name = "create-runtime", alias = "createRuntime")]
    CreateRuntime,
    /// poststart hook: confirm the agent watches the container (register it if not).
    Poststart,
    /// poststop hook: unregister the container.
    Poststop,
    /// createRuntime hook: register, then wait until no other container holds a GPU this one sees.
    WaitGpuFree {
        /// At most this long ("500ms", "20s", "2m") [default: the baton.io/wait-gpu-free annotation].
        #[arg(long)]
        timeout: Option<String>,
    },
}

impl Stage {
    fn name(&self) -> &'static str {
        match self {
            Self::CreateRuntime => "createRuntime",
            Self::Poststart => "poststart",
            Self::Poststop => "poststop",
            Self::WaitGpuFree { .. } => "wait-gpu-free",
        }
    }
}

/// A flag's duration, in the one syntax of Baton's durations.
fn duration(value: &str) -> Result<std::time::Duration, String> {
    baton_agent_api::parse_duration(value)
        .ok_or_else(|| baton_agent_api::DURATION_SYNTAX.to_owned())
}

async fn run(cli: &Cli) -> Outcome {
    let state = match HookState::from_stdin().await {
        Ok(s) => s,
        Err(e) => return Outcome::of_error(&e, true),
    };
    let options = Options {
        agent: Agent {
            socket: cli
                .socket
                .clone()
                .unwrap_or_else(baton_agent_api::default_socket),
            within: cli.agent_timeout,
        },
        namespace: cli.namespace.clone(),
        trace_prefix: cli.trace_prefix.clone(),
        require_agent: cli.require_agent,
    };
    match &cli.stage {
        Stage::CreateRuntime => stages::create_runtime(&options, &state).await,
        Stage::Poststart => stages::poststart(&options, &state).await,
        Stage::Poststop => stages::poststop(&options, &state).await,
        Stage::WaitGpuFree { timeout } => {
            stages::wait_gpu_free(&options, &state, timeout.as_deref()).await
        }
    }
}

fn report(cli: &Cli, line: &str) -> anyhow::Result<()> {
    eprintln!("{line}");
    if let Some(path) = &cli.log {
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| anyhow::anyhow!("opening the log {}: {e}", path.display()))?;
        writeln!(f, "{line}")?;
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let outcome = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt.block_on(run(&cli)),
        Err(e) => Outcome::Failed {
            status: baton_runc_hooks::outcome::EXIT_AGENT,
            message: format!("cannot start the async runtime: {e}"),
        },
    };
    if let Err(e) = report(&cli, &outcome.line(cli.stage.name())) {
        eprintln!("baton-hook: warning: {e:#}");
    }
    ExitCode::from(outcome.exit_status())
}
