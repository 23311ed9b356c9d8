//! An example request proxy: what a serving front end does to let the Baton agent shield and govern the
//! co-runners of its server (the messages: tools/agent-api/src/control.rs; the socket: docs/api.md).
//!
//! It listens on `--listen`; each client connection is one request: a line (the request's id), forwarded to
//! the server at `--server`, whose reply lines (one per token) are streamed back. Around each request it
//! writes to the agent, over one connection kept open:
//!
//! ```text
//! {"v":1,"op":"request_start","id":"r7","t_ns":...}   when it sends the request to the server
//! {"v":1,"op":"first_token","id":"r7","t_ns":...}     at the first token (the shield drops)
//! {"v":1,"op":"token","id":"r7","t_ns":...}           at every token (the governor measures the gaps)
//! {"v":1,"op":"request_end","id":"r7","t_ns":...}     when the server is done with it
//! ```
//!
//! Every line gets one reply line, in order. The request path never waits for them: the events go through a
//! channel to one writer thread, and a reader thread takes the replies and reports refusals on stderr.
//!
//! With `--sigstop PID,...` it does the 000 seed's shield itself instead: SIGSTOP to those processes from
//! any request's start until its first token, SIGCONT after. With neither, it only forwards.
//!
//! With `--hold-for CONTAINER` (gap-fill: a server with `baton.io/park-when-idle`), the request events name that
//! container, and each request is held after its `request_start` (which makes the agent hand the GPU back to a
//! parked server) until the container holds its GPU and is not parked; only then is it forwarded. At most
//! `--max-waiting` requests wait at once: one more is answered `503 ...` at once, and one that waited
//! `--hold-timeout` seconds is answered `503 ...` too, each line saying why.
//!
//! `cargo run -p baton --example request_proxy -- --listen /tmp/p.sock --server /run/srv.sock --agent /run/baton/agent.sock`
use std::{
    io::{BufRead, BufReader, Write},
    os::unix::net::{UnixListener, UnixStream},
    path::{Path, PathBuf},
    sync::{Arc, Mutex, mpsc},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use baton_agent_api::{
    Filter, GpuHold, PROTOCOL_VERSION, Reply, ReplyLine, Request, RequestEvent, RequestLine,
    now_monotonic_ns,
};
use clap::Parser;
use nix::{
    sys::signal::{Signal, kill},
    unistd::Pid,
};

/// The proxy's flags.
#[derive(Parser)]
struct Args {
    /// Where clients connect (replaced if it exists).
    #[arg(long)]
    listen: PathBuf,
    /// The server's socket.
    #[arg(long)]
    server: PathBuf,
    /// Feed the agent at this socket.
    #[arg(long, conflicts_with = "sigstop")]
    agent: Option<PathBuf>,
    /// Shield by SIGSTOP/SIGCONT of these pids instead (comma-separated).
    #[arg(long, value_delimiter = ',')]
    sigstop: Vec<i32>,
    /// Hold each request until this container (`ID` or `NAMESPACE/ID`) holds its GPU and is not parked.
    #[arg(long, requires = "agent")]
    hold_for: Option<String>,
    /// With --hold-for: how many requests may wait at once (one more is answered 503 at once).
    #[arg(long, default_value_t = 64)]
    max_waiting: usize,
    /// With --hold-for: seconds a request may wait before it is answered 503.
    #[arg(long, default_value_t = 60)]
    hold_timeout: u64,
}

/// `--hold-for`: requests wait until their server holds its GPU.
struct Hold {
    /// The agent's socket, for `status`.
    agent: PathBuf,
    /// Which container.
    filter: Filter,
    max_waiting: usize,
    timeout: Duration,
    /// Requests waiting now.
    waiting: Mutex<usize>,
    /// The last answer and when it came: every waiter shares one status call per [`HOLD_POLL`].
    last: Mutex<Option<(Instant, bool)>>,
}

/// How often the waiting requests ask the agent whether their server holds its GPU.
const HOLD_POLL: Duration = Duration::from_millis(20);

/// How the proxy protects the requests it forwards.
enum Shield {
    /// Not at all.
    None,
    /// Events to the agent, through the writer thread, naming `server` (`None`: the node's only one).
    Agent {
        tx: mpsc::Sender<Request>,
        server: Option<String>,
    },
    /// SIGSTOP/SIGCONT of the co-runner's processes; the count of requests before their first token.
    Sigstop { pids: Vec<Pid>, open: Mutex<usize> },
}

fn main() -> Result<()> {
    let args = Args::parse();
    let hold = match (&args.hold_for, &args.agent) {
        (Some(server), Some(agent)) => Some(Hold::new(agent, server, &args)),
        _ => None,
    };
    let shield = Arc::new(match (&args.agent, args.sigstop.is_empty()) {
        (Some(agent), _) => Shield::Agent {
            tx: connect_agent(agent)?,
            server: args.hold_for.clone(),
        },
        (None, false) => Shield::Sigstop {
            pids: args.sigstop.iter().map(|p| Pid::from_raw(*p)).collect(),
            open: Mutex::new(0),
        },
        (None, true) => Shield::None,
    });
    let _ = std::fs::remove_file(&args.listen);
    let listener = UnixListener::bind(&args.listen)
        .with_context(|| format!("listening on {}", args.listen.display()))?;
    println!("listening on {}", args.listen.display());
    std::io::stdout().flush()?;
    let hold = Arc::new(hold);
    for (n, client) in listener.incoming().enumerate() {
        let client = client.context("accepting a client")?;
        let (shield, hold, server) = (Arc::clone(&shield), Arc::clone(&hold), args.server.clone());
        std::thread::spawn(move || {
            if let Err(e) = forward(n, client, &server, &shield, hold.as_ref().as_ref()) {
                eprintln!("request_proxy: request {n}: {e:#}");
            }
        });
    }
    Ok(())
}

/// Opens the agent connection: a writer thread sends what the channel brings, a reader thread checks the
/// replies (one per line, in order).
fn connect_agent(socket: &Path) -> Result<mpsc::Sender<Request>> {
    let stream = UnixStream::connect(socket)
        .with_context(|| format!("connecting to the agent at {}", socket.display()))?;
    let replies = BufReader::new(stream.try_clone()?);
    std::thread::spawn(move || read_replies(replies));
    let (tx, rx) = mpsc::channel::<Request>();
    std::thread::spawn(move || {
        let mut out = &stream;
        for request in rx {
            let line = RequestLine {
                v: PROTOCOL_VERSION,
                request,
            };
            let sent = serde_json::to_string(&line)
                .map_err(std::io::Error::other)
                .and_then(|text| writeln!(out, "{text}"));
            if let Err(e) = sent {
                eprintln!("request_proxy: writing to the agent: {e}");
                return;
            }
        }
    });
    Ok(tx)
}

/// Reads the agent's replies; prints the first refusals and then one line per 100.
fn read_replies(replies: BufReader<UnixStream>) {
    let mut refused = 0u64;
    for line in replies.lines() {
        let Ok(line) = line else { break };
        match serde_json::from_str::<ReplyLine>(&line) {
            Ok(reply) if reply.ok => {}
            _ => {
                refused += 1;
                if refused <= 3 || refused.is_multiple_of(100) {
                    eprintln!(
                        "request_proxy: the agent refused an event ({refused} so far): {line}"
                    );
                }
            }
        }
    }
    eprintln!("request_proxy: the agent closed the connection");
}

/// One request: its id line to the server (once the server holds its GPU, with `--hold-for`), the server's lines
/// back to the client, the events around it.
fn forward(
    n: usize,
    mut client: UnixStream,
    server: &Path,
    shield: &Shield,
    hold: Option<&Hold>,
) -> Result<()> {
    let mut id = String::new();
    BufReader::new(&client).read_line(&mut id)?;
    let id = match id.trim() {
        "" => format!("req-{n}"),
        given => given.to_owned(),
    };
    shield.request_start(&id);
    let mut tokens = 0;
    let result = match hold.map(Hold::until_resident).transpose() {
        Ok(_) => stream_tokens(&id, &client, server, shield, &mut tokens),
        Err(refusal) => writeln!(client, "503 {refusal}").map_err(Into::into),
    };
    shield.request_end(&id, tokens > 0);
    result
}

impl Hold {
    fn new(agent: &Path, server: &str, args: &Args) -> Self {
        let (namespace, id) = match server.split_once('/') {
            Some((ns, id)) => (Some(ns.to_owned()), id),
            None => (None, server),
        };
        Self {
            agent: agent.to_owned(),
            filter: Filter {
                container: Some(id.to_owned()),
                namespace,
                mine: false,
            },
            max_waiting: args.max_waiting,
            timeout: Duration::from_secs(args.hold_timeout),
            waiting: Mutex::new(0),
            last: Mutex::new(None),
        }
    }

    /// Waits until the server holds its GPU; why not, as the 503 line says it.
    fn until_resident(&self) -> std::result::Result<(), String> {
        if self.resident() {
            return Ok(());
        }
        let _waiting = self.admit()?;
        let deadline = Instant::now() + self.timeout;
        while Instant::now() < deadline {
            std::thread::sleep(HOLD_POLL);
            if self.resident() {
                return Ok(());
            }
        }
        Err(format!(
            "{} did not hold its GPU within {:?}: try again later",
            self.name(),
            self.timeout
        ))
    }

    /// Counts one more waiting request, or refuses it past `--max-waiting`.
    fn admit(&self) -> std::result::Result<Waiting<'_>, String> {
        let mut waiting = lock(&self.waiting);
        if *waiting >= self.max_waiting {
            return Err(format!(
                "{} requests are already waiting for {} to hold its GPU (--max-waiting {}): try again later",
                *waiting,
                self.name(),
                self.max_waiting
            ));
        }
        *waiting += 1;
        Ok(Waiting(self))
    }

    /// Whether the server holds its GPU and is not parked, asked at most once per [`HOLD_POLL`].
    fn resident(&self) -> bool {
        let mut last = lock(&self.last);
        if let Some((at, answer)) = *last
            && at.elapsed() < HOLD_POLL
        {
            return answer;
        }
        let answer = self.ask_agent().unwrap_or_else(|e| {
            eprintln!(
                "request_proxy: asking the agent about {}: {e:#}",
                self.name()
            );
            false
        });
        *last = Some((Instant::now(), answer));
        answer
    }

    fn ask_agent(&self) -> Result<bool> {
        let mut stream = UnixStream::connect(&self.agent)
            .with_context(|| format!("connecting to the agent at {}", self.agent.display()))?;
        let line = RequestLine {
            v: PROTOCOL_VERSION,
            request: Request::Status(self.filter.clone()),
        };
        writeln!(stream, "{}", serde_json::to_string(&line)?)?;
        let mut reply = String::new();
        BufReader::new(&stream).read_line(&mut reply)?;
        match serde_json::from_str::<ReplyLine>(&reply)?.reply {
            Reply::Status(node) => Ok(node
                .containers
                .first()
                .is_some_and(|c| c.gpu == GpuHold::Held && c.preemption.is_none())),
            other => bail!("unexpected reply {other:?}"),
        }
    }

    fn name(&self) -> &str {
        self.filter.container.as_deref().unwrap_or_default()
    }
}

/// One waiting request, counted until dropped.
struct Waiting<'h>(&'h Hold);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let mut waiting = lock(&self.0.waiting);
        *waiting = waiting.saturating_sub(1);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Sends the request and streams its tokens, counting them in `tokens`.
fn stream_tokens(
    id: &str,
    mut client: &UnixStream,
    server: &Path,
    shield: &Shield,
    tokens: &mut u64,
) -> Result<()> {
    let mut upstream = UnixStream::connect(server)
        .with_context(|| format!("connecting to the server at {}", server.display()))?;
    writeln!(upstream, "{id}")?;
    for line in BufReader::new(upstream).lines() {
        let line = line?;
        shield.token(id, *tokens == 0);
        *tokens += 1;
        writeln!(client, "{line}")?;
    }
    if *tokens == 0 {
        bail!("the server sent no token");
    }
    Ok(())
}

impl Shield {
    fn request_start(&self, id: &str) {
        match self {
            Shield::None => {}
            Shield::Agent { tx, server } => send(tx, Request::RequestStart(event(id, server))),
            Shield::Sigstop { pids, open } => {
                let mut open = lock(open);
                *open += 1;
                if *open == 1 {
                    signal_all(pids, Signal::SIGSTOP);
                }
            }
        }
    }

    fn token(&self, id: &str, first: bool) {
        match self {
            Shield::None => {}
            Shield::Agent { tx, server } => {
                if first {
                    send(tx, Request::FirstToken(event(id, server)));
                }
                send(tx, Request::Token(event(id, server)));
            }
            Shield::Sigstop { .. } if first => self.drop_shield(),
            Shield::Sigstop { .. } => {}
        }
    }

    /// The request is over; `had_first_token`: its shield already went down.
    fn request_end(&self, id: &str, had_first_token: bool) {
        match self {
            Shield::None => {}
            Shield::Agent { tx, server } => send(tx, Request::RequestEnd(event(id, server))),
            Shield::Sigstop { .. } if !had_first_token => self.drop_shield(),
            Shield::Sigstop { .. } => {}
        }
    }

    /// One request less before its first token; SIGCONT when none is left.
    fn drop_shield(&self) {
        if let Shield::Sigstop { pids, open } = self {
            let mut open = lock(open);
            *open = open.saturating_sub(1);
            if *open == 0 {
                signal_all(pids, Signal::SIGCONT);
            }
        }
    }
}

/// A request event of `id` for `server`, stamped now (the agent's clock: CLOCK_MONOTONIC).
fn event(id: &str, server: &Option<String>) -> RequestEvent {
    RequestEvent {
        id: id.to_owned(),
        server: server.clone(),
        t_ns: Some(now_monotonic_ns()),
    }
}

fn send(tx: &mpsc::Sender<Request>, request: Request) {
    // The writer thread is gone only when the agent connection broke; it said so on stderr.
    let _ = tx.send(request);
}

fn signal_all(pids: &[Pid], signal: Signal) {
    for pid in pids {
        if let Err(e) = kill(*pid, signal) {
            eprintln!("request_proxy: {signal} to {pid}: {e}");
        }
    }
}
