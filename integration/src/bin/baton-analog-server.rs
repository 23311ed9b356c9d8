//! `baton-analog-server`: the CPU analog's latency-critical server. It listens on a unix socket and answers
//! each request (one line, its id) with a "prefill" of `--prefill-ms` of CPU work, then `--tokens` "tokens"
//! of `--token-ms` of CPU work each, writing `token I` back as each is done, then closes the connection.
//! Requests are served one at a time, in the order they connect (a FIFO queue in the listen backlog).
//!
//! The work is measured in this thread's CPU time, so a co-runner on the same CPU stretches it in wall time
//! as a co-runner's kernels stretch a GPU server's decode steps. `--cpu N` pins it to CPU N.
use std::{
    io::{BufRead, BufReader, Write},
    os::unix::net::{UnixListener, UnixStream},
    path::PathBuf,
};

use anyhow::{Context, Result};
use baton_integration::analog::work::{burn_cpu_ms, pin_to_cpu};
use clap::Parser;

/// The server's flags.
#[derive(Parser)]
struct Args {
    /// The unix socket to listen on (replaced if it exists).
    #[arg(long)]
    socket: PathBuf,
    /// CPU time of a request's prefill, ms.
    #[arg(long, default_value_t = 30.0)]
    prefill_ms: f64,
    /// Tokens per request.
    #[arg(long, default_value_t = 10)]
    tokens: u32,
    /// CPU time of one token, ms.
    #[arg(long, default_value_t = 5.0)]
    token_ms: f64,
    /// Pin the server to this CPU.
    #[arg(long)]
    cpu: Option<usize>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    if let Some(cpu) = args.cpu {
        pin_to_cpu(cpu)?;
    }
    let _ = std::fs::remove_file(&args.socket);
    let listener = UnixListener::bind(&args.socket)
        .with_context(|| format!("listening on {}", args.socket.display()))?;
    println!("listening on {}", args.socket.display());
    for stream in listener.incoming() {
        let served = stream
            .context("accepting a request")
            .and_then(|s| serve(&args, s));
        if let Err(e) = served {
            eprintln!("baton-analog-server: {e:#}");
        }
    }
    Ok(())
}

/// Serves one request: reads its id line, prefills, streams the tokens.
fn serve(args: &Args, stream: UnixStream) -> Result<()> {
    let mut id = String::new();
    if BufReader::new(&stream)
        .read_line(&mut id)
        .context("reading a request")?
        == 0
    {
        return Ok(()); // closed without a request: a readiness probe
    }
    burn_cpu_ms(args.prefill_ms)?;
    let mut out = &stream;
    for i in 0..args.tokens {
        burn_cpu_ms(args.token_ms)?;
        writeln!(out, "token {i}").with_context(|| format!("streaming request {}", id.trim()))?;
    }
    Ok(())
}
