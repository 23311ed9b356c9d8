//! The agent's socket: root-only connections (SO_PEERCRED), one JSON request per line, one reply per
//! request; `watch` turns the connection into an event stream, `trace` into a stream of trace lines.
//! A process inside a watched container is refused (the core knows their cgroups), and a line longer than
//! [`MAX_REQUEST_LINE`] gets an error reply and ends its connection, the others served as before.
use std::sync::atomic::{AtomicU64, Ordering};

use baton_agent_api::{
    BoundedLines, EventLine, Filter, MAX_REQUEST_LINE, PROTOCOL_VERSION, Reply, ReplyLine, Request,
    RequestLine, TraceLine,
};
use tokio::{
    io::{AsyncWriteExt, BufReader},
    net::{
        UnixListener, UnixStream,
        unix::{OwnedReadHalf, OwnedWriteHalf},
    },
    sync::{broadcast, mpsc, oneshot},
};

use super::{
    control,
    core::{Command, What},
    preempt,
    registry::Published,
    trace_session::LINE_BUFFER,
};

/// Accepts connections until the listener fails.
pub async fn serve(
    listener: UnixListener,
    commands: mpsc::Sender<Command>,
    events: broadcast::Sender<Published>,
    controller: control::Handle,
) -> std::io::Result<()> {
    loop {
        let (stream, _) = listener.accept().await?;
        let (commands, events) = (commands.clone(), events.clone());
        let controller = controller.clone();
        tokio::spawn(async move {
            let peer = stream
                .peer_cred()
                .ok()
                .and_then(|c| c.pid())
                .and_then(|p| u32::try_from(p).ok())
                .unwrap_or(0);
            if let Err(e) = connection(stream, commands.clone(), events, controller).await {
                tracing::debug!("agent: connection ended: {e}");
            }
            ask(&commands, What::PeerGone(peer), peer).await;
        });
    }
}

async fn connection(
    stream: UnixStream,
    commands: mpsc::Sender<Command>,
    events: broadcast::Sender<Published>,
    controller: control::Handle,
) -> std::io::Result<()> {
    let cred = stream.peer_cred()?;
    let peer_pid = cred.pid().and_then(|p| u32::try_from(p).ok()).unwrap_or(0);
    let (read, mut write) = stream.into_split();
    let mut lines = BoundedLines::new(BufReader::new(read), MAX_REQUEST_LINE);
    if cred.uid() != 0 {
        let error = format!(
            "the baton agent serves root only (this process runs as uid {}): run the client as root",
            cred.uid()
        );
        tracing::warn!(
            peer_pid,
            uid = cred.uid(),
            "agent: refused a non-root client"
        );
        return refuse(&mut lines, &mut write, error).await;
    }
    if let Err(error) = check_peer(&commands, peer_pid).await {
        tracing::warn!(peer_pid, "agent: refused a client: {error}");
        return refuse(&mut lines, &mut write, error).await;
    }
    loop {
        let line = match lines.next_line().await {
            Ok(Some(line)) => line,
            Ok(None) => break,
            Err(e) if baton_agent_api::lines::is_too_long(&e) => {
                tracing::warn!(peer_pid, "agent: closing a connection: {e}");
                let error = e.to_string();
                return send_reply(&mut write, Reply::Error { error }).await;
            }
            Err(e) => return Err(e),
        };
        let request = match parse(&line) {
            Ok(r) => r,
            Err(error) => {
                send_reply(&mut write, Reply::Error { error }).await?;
                continue;
            }
        };
        match request {
            Request::Watch(filter) => {
                let rx = events.subscribe();
                send_reply(&mut write, Reply::Watching).await?;
                return stream_events(rx, filter, peer_pid, write, lines).await;
            }
            Request::Trace(request) => {
                let session = NEXT_SESSION.fetch_add(1, Ordering::Relaxed);
                let (tx, rx) = mpsc::channel(LINE_BUFFER);
                let what = What::Trace {
                    session,
                    request,
                    lines: tx,
                };
                let reply = ask(&commands, what, peer_pid).await;
                let tracing = matches!(reply, Reply::Tracing { .. });
                send_reply(&mut write, reply).await?;
                if tracing {
                    return stream_trace(session, rx, &commands, peer_pid, write, lines).await;
                }
            }
            Request::Preempt(r) => {
                let ctx = preempt::Ctx {
                    commands: &commands,
                    events: &events,
                    peer: peer_pid,
                };
                preempt::preempt(&ctx, r, &mut write).await?;
            }
            Request::Handoff(h) => {
                let ctx = preempt::Ctx {
                    commands: &commands,
                    events: &events,
                    peer: peer_pid,
                };
                preempt::handoff(&ctx, h, &mut write).await?;
            }
            request @ (Request::Resume(_) | Request::Start(_)) => {
                let ctx = preempt::Ctx {
                    commands: &commands,
                    events: &events,
                    peer: peer_pid,
                };
                preempt::forward(&ctx, request, &mut write).await?;
            }
            request @ (Request::Freeze(_)
            | Request::Thaw(_)
            | Request::Duty(_)
            | Request::Governor(_)
            | Request::RequestStart(_)
            | Request::FirstToken(_)
            | Request::Token(_)
            | Request::RequestEnd(_)) => {
                if let Request::RequestStart(e) | Request::RequestEnd(e) = &request {
                    let seen = What::RequestSeen {
                        server: e.server.clone(),
                        start: matches!(request, Request::RequestStart(_)),
                    };
                    let _ = ask(&commands, seen, peer_pid).await;
                }
                let reply = controller.ask(request).await;
                send_reply(&mut write, reply).await?;
            }
            Request::WaitGpuFree(g) => {
                let reply = ask(&commands, What::Gate(g), peer_pid).await;
                send_reply(&mut write, reply).await?;
            }
            request => {
                let reply = ask(&commands, What::Request(request), peer_pid).await;
                send_reply(&mut write, reply).await?;
            }
        }
    }
    Ok(())
}

/// How long a refused client has to send its first request, whose answer is the refusal.
const REFUSAL_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Answers a refused client with `error` and ends the connection: after its first request line (or
/// [`REFUSAL_WAIT`]), so that a client that writes before it reads sees the reason, not a broken pipe.
async fn refuse(
    lines: &mut BoundedLines<BufReader<OwnedReadHalf>>,
    write: &mut OwnedWriteHalf,
    error: String,
) -> std::io::Result<()> {
    let _ = tokio::time::timeout(REFUSAL_WAIT, lines.next_line()).await;
    send_reply(write, Reply::Error { error }).await
}

/// Whether the core serves peer `peer_pid` (not a process inside a watched container).
async fn check_peer(commands: &mpsc::Sender<Command>, peer_pid: u32) -> Result<(), String> {
    let (tx, rx) = oneshot::channel();
    match ask(commands, What::CheckPeer(tx), peer_pid).await {
        Reply::Error { error } => Err(error),
        _ => rx.await.unwrap_or(Ok(())),
    }
}

/// Trace sessions are numbered across connections.
static NEXT_SESSION: AtomicU64 = AtomicU64::new(1);

/// Hands `what` to the core and waits for its reply.
async fn ask(commands: &mpsc::Sender<Command>, what: What, peer_pid: u32) -> Reply {
    let (tx, rx) = oneshot::channel();
    let cmd = Command {
        what,
        peer_pid,
        reply: tx,
    };
    match commands.send(cmd).await {
        Ok(()) => rx.await.unwrap_or_else(|_| stopping()),
        Err(_) => stopping(),
    }
}

/// Writes the session's lines until the client shuts down its side; then ends the session (the core sends
/// the summary, if asked, and drops its sender) and writes what is left.
async fn stream_trace(
    session: u64,
    mut rx: mpsc::Receiver<String>,
    commands: &mpsc::Sender<Command>,
    peer_pid: u32,
    mut write: OwnedWriteHalf,
    mut lines: BoundedLines<BufReader<OwnedReadHalf>>,
) -> std::io::Result<()> {
    let mut ended = false;
    loop {
        tokio::select! {
            line = rx.recv() => match line {
                Some(line) => {
                    let sent = send_line(&mut write, &TraceLine { v: PROTOCOL_VERSION, line }).await;
                    if let Err(e) = sent {
                        if !ended {
                            ask(commands, What::EndTrace(session), peer_pid).await;
                        }
                        return Err(e);
                    }
                }
                None => return write.shutdown().await,
            },
            line = lines.next_line(), if !ended => {
                // The client shut down its side (or sent more, which ends a trace too).
                let _ = line;
                ended = true;
                ask(commands, What::EndTrace(session), peer_pid).await;
            },
        }
    }
}

fn stopping() -> Reply {
    Reply::Error {
        error: "the agent is stopping".to_owned(),
    }
}

/// A request line whose durations and counts are within the agent's bounds
/// ([`baton_agent_api::limits`]), or the error to answer it with.
fn parse(line: &str) -> Result<Request, String> {
    let value: serde_json::Value =
        serde_json::from_str(line).map_err(|e| format!("not a JSON line ({e}): {line}"))?;
    match value.get("v").and_then(serde_json::Value::as_u64) {
        Some(v) if v == u64::from(PROTOCOL_VERSION) => {}
        Some(v) => {
            return Err(format!(
                "protocol version {v} is not spoken here: this agent speaks \"v\": {PROTOCOL_VERSION}"
            ));
        }
        None => return Err(format!("missing \"v\": {PROTOCOL_VERSION} in {line}")),
    }
    let request = serde_json::from_value::<RequestLine>(value)
        .map(|l| l.request)
        .map_err(|e| format!("not a request ({e}): {line}"))?;
    request.check()?;
    Ok(request)
}

pub async fn send_reply(write: &mut OwnedWriteHalf, reply: Reply) -> std::io::Result<()> {
    send_line(write, &ReplyLine::new(reply)).await
}

pub async fn send_line(
    write: &mut OwnedWriteHalf,
    line: &impl serde::Serialize,
) -> std::io::Result<()> {
    let mut text = serde_json::to_string(line).map_err(std::io::Error::other)?;
    text.push('\n');
    write.write_all(text.as_bytes()).await
}

/// Writes the matching events until the client closes its end (or sends anything more).
async fn stream_events(
    mut rx: broadcast::Receiver<Published>,
    filter: Filter,
    peer_pid: u32,
    mut write: OwnedWriteHalf,
    mut lines: BoundedLines<BufReader<OwnedReadHalf>>,
) -> std::io::Result<()> {
    loop {
        tokio::select! {
            p = rx.recv() => match p {
                Ok(p) if filter.matches(&p.event.container, p.owner, peer_pid) => {
                    send_line(&mut write, &EventLine { v: PROTOCOL_VERSION, event: p.event }).await?;
                }
                Ok(_) => {}
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    tracing::warn!(peer_pid, "agent: a watcher fell behind and missed {n} events");
                }
                Err(broadcast::error::RecvError::Closed) => return Ok(()),
            },
            line = lines.next_line() => if line?.is_none() {
                return Ok(());
            },
        }
    }
}
