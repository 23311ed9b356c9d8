//! `baton trace` through the node agent's probe set: the agent resolves the selection, traces and renders;
//! this side prints what it sends. Ending the trace (Ctrl-C, SIGTERM, `--duration`) shuts down the sending
//! side of the connection, after which the agent sends the summary, if asked, and closes.
use std::{io::Write, path::Path, time::Duration};

use anyhow::Context;
use baton_agent_api::{Client, Request, TraceRequest};

use super::{READY_LINE, TraceArgs};
use crate::timeline::Timeline;

/// How long a ping of the agent may take before `baton trace` loads its own probes instead.
const PING_TIMEOUT: Duration = Duration::from_secs(2);

/// A connection to the agent at `socket`, if one answers.
pub async fn agent_answering(socket: &Path) -> Option<Client> {
    let mut client = Client::connect(socket).await.ok()?;
    match tokio::time::timeout(PING_TIMEOUT, client.call(Request::Ping)).await {
        Ok(Ok(_)) => Some(client),
        _ => None,
    }
}

/// Traces through the agent until `stop`, `--duration` or the agent's end.
pub async fn run(
    args: TraceArgs,
    mut client: Client,
    stop: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let request = TraceRequest {
        containers: args.containers.clone(),
        cgroups: args
            .cgroups
            .iter()
            .map(|p| p.display().to_string())
            .collect(),
        pids: args.pids.clone(),
        all: args.all,
        prefixes: args.prefixes.clone(),
        // A timeline is built here from the JSON objects, whatever the lines shown.
        json: args.json || args.timeline.any(),
        raw: args.raw,
        quiet: args.quiet && !args.timeline.any(),
        summary: args.summary,
        launch_interval_ms: args.launch_interval.map(|s| (s * 1000.0).max(1.0) as u64),
    };
    let programs = client.trace(request).await.with_context(|| {
        format!(
            "tracing through the baton agent at {}",
            client.path().display()
        )
    })?;
    eprintln!(
        "baton trace: using the probe set of the baton agent at {} ({programs} programs)",
        client.path().display()
    );
    eprintln!("{READY_LINE}");
    let mut out: Box<dyn Write> = match &args.output {
        Some(p) => Box::new(
            std::fs::File::create(p).with_context(|| format!("cannot create {}", p.display()))?,
        ),
        None => Box::new(std::io::stdout().lock()),
    };
    let deadline = async {
        match args.duration {
            Some(s) => tokio::time::sleep(Duration::from_secs_f64(s)).await,
            None => std::future::pending().await,
        }
    };
    let mut timeline = args.timeline.any().then(Timeline::default);
    if timeline.is_some() && !args.json {
        eprintln!(
            "baton trace: through the agent, a timeline run shows no text lines (the agent sends JSON for the timeline): add --json to see the objects, or --standalone for text lines"
        );
    }
    let show = !args.quiet && (args.json || timeline.is_none());
    let mut take = |l: &str, out: &mut dyn Write| -> anyhow::Result<()> {
        if let Some(t) = &mut timeline
            && l.starts_with('{')
            && let Ok(v) = serde_json::from_str::<serde_json::Value>(l)
        {
            t.add(&v);
            if !show {
                return Ok(());
            }
        }
        writeln!(out, "{l}")?;
        Ok(())
    };
    tokio::pin!(stop, deadline);
    let mut agent_ended = false;
    loop {
        tokio::select! {
            _ = &mut stop => break,
            _ = &mut deadline => break,
            line = client.next_trace_line() => match line? {
                Some(l) => {
                    take(&l, &mut out)?;
                    out.flush()?;
                }
                None => {
                    agent_ended = true;
                    break;
                }
            },
        }
    }
    if !agent_ended {
        client.end_trace().await?;
        while let Some(l) = client.next_trace_line().await? {
            take(&l, &mut out)?;
        }
    }
    out.flush()?;
    if let Some(t) = &timeline {
        args.timeline.write(t)?;
    }
    Ok(())
}
