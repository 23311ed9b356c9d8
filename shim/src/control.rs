//! The shim's own socket, where the node agent sends `preempt`, `resume`, `start`, `freeze` and `thaw` for
//! this shim's containers (the agent resolves the container and its CUDA processes; the shim acts). Same
//! protocol as the agent's socket (docs/api.md): request lines (at most [`MAX_REQUEST_LINE`] bytes: a longer
//! one is answered with an error and ends its connection), each answered by step lines as the operation
//! goes (preemptions only) and one reply line. The holds (`freeze`) a connection made end with it.
//! Mode 0600, `<agent socket dir>/shims/<shim pid>.sock`, removed at exit.
//!
//! Only the agent commands a shim: a connection is served only when its peer (SO_PEERCRED, taken by the
//! kernel at connect) is the process at the other end of this shim's own live connection to the agent's
//! socket (the agent the shim registered its containers with, see [`crate::agent::AgentPid`]). Any other
//! process, root or not, gets one error line and the connection is closed; with no live link to an agent
//! (none started yet, or it went away) everyone is refused. Whoever listens on the agent socket the node's
//! TOML names is the agent: that path is node-only.
use std::{
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
};

use std::sync::atomic::{AtomicU64, Ordering};

use baton_agent_api::{
    BoundedLines, MAX_REQUEST_LINE, PROTOCOL_VERSION, Reply, ReplyLine, Request, RequestLine, Step,
    StepLine,
};
use tokio::{
    io::{AsyncWriteExt, BufReader},
    net::{
        UnixListener, UnixStream,
        unix::{OwnedReadHalf, OwnedWriteHalf},
    },
    sync::mpsc,
};

use crate::service::TaskService;

/// Where this shim's socket goes, beside the agent's socket `agent_socket`.
pub fn socket_path(agent_socket: &Path) -> PathBuf {
    agent_socket
        .parent()
        .unwrap_or(Path::new("/run/baton"))
        .join("shims")
        .join(format!("{}.sock", std::process::id()))
}

/// Binds the socket at `path` and serves it on this runtime.
pub fn serve(path: &Path, service: TaskService) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let _ = std::fs::remove_file(path);
    let listener = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    tracing::info!(socket = %path.display(), "control socket for the baton agent");
    tokio::spawn(async move {
        loop {
            match listener.accept().await {
                Ok((stream, _)) => {
                    let service = service.clone();
                    tokio::spawn(async move {
                        if let Err(e) = connection(stream, service).await {
                            tracing::debug!("control socket: connection ended: {e}");
                        }
                    });
                }
                Err(e) => {
                    tracing::warn!("control socket: accept failed: {e}");
                    return;
                }
            }
        }
    });
    Ok(())
}

/// How long a refused peer has to send its first request, whose answer is the refusal.
const REFUSAL_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Connections are numbered: the holds a connection made end with it.
static NEXT_CONNECTION: AtomicU64 = AtomicU64::new(1);

async fn connection(stream: UnixStream, service: TaskService) -> std::io::Result<()> {
    let cred = stream.peer_cred()?;
    let (read, mut write) = stream.into_split();
    let mut lines = BoundedLines::new(BufReader::new(read), MAX_REQUEST_LINE);
    let peer = cred.pid().and_then(|p| u32::try_from(p).ok());
    if let Err(error) = check_peer(cred.uid(), peer, service.agent_pid()) {
        tracing::warn!(peer_pid = ?peer, uid = cred.uid(), "control socket: refused: {error}");
        // Answered after its first request (or a short wait), so that a client that writes before it reads
        // sees the reason rather than a broken pipe.
        let _ = tokio::time::timeout(REFUSAL_WAIT, lines.next_line()).await;
        return send(&mut write, &ReplyLine::new(Reply::Error { error })).await;
    }
    let conn = NEXT_CONNECTION.fetch_add(1, Ordering::Relaxed);
    let result = serve_lines(&mut lines, &mut write, &service, conn).await;
    service.agent_connection_ended(conn).await;
    result
}

/// Whether a peer of uid `uid` and pid `peer` may command this shim, whose agent is `agent` now; the error
/// line to answer otherwise.
fn check_peer(uid: u32, peer: Option<u32>, agent: Option<u32>) -> Result<(), String> {
    let Some(agent) = agent else {
        return Err(
            "this shim is not connected to a baton agent now: its control socket serves the agent it \
             registers its containers with, and no one else"
                .to_owned(),
        );
    };
    if uid != 0 || peer != Some(agent) {
        let who = peer.map_or_else(|| "an unknown process".to_owned(), |p| format!("pid {p}"));
        return Err(format!(
            "this shim's control socket serves the baton agent alone (pid {agent}, the peer of the shim's \
             connection to the agent's socket); {who} is not it: ask the agent (`baton freeze`, `baton \
             preempt`, ...)"
        ));
    }
    Ok(())
}

/// Answers request lines until the agent closes its side: `freeze` and `thaw` at once, the others with
/// their step lines first.
async fn serve_lines(
    lines: &mut BoundedLines<BufReader<OwnedReadHalf>>,
    write: &mut OwnedWriteHalf,
    service: &TaskService,
    conn: u64,
) -> std::io::Result<()> {
    loop {
        let line = match lines.next_line().await {
            Ok(Some(line)) => line,
            Ok(None) => return Ok(()),
            Err(e) if baton_agent_api::lines::is_too_long(&e) => {
                tracing::warn!("control socket: closing a connection: {e}");
                let error = e.to_string();
                return send(write, &ReplyLine::new(Reply::Error { error })).await;
            }
            Err(e) => return Err(e),
        };
        let request = match serde_json::from_str::<RequestLine>(&line) {
            Ok(l) if l.v == PROTOCOL_VERSION => l.request,
            Ok(l) => {
                let error = format!("protocol version {} is not spoken here", l.v);
                send(write, &ReplyLine::new(Reply::Error { error })).await?;
                continue;
            }
            Err(e) => {
                let error = format!("not a request ({e}): {line}");
                send(write, &ReplyLine::new(Reply::Error { error })).await?;
                continue;
            }
        };
        let reply = match request {
            Request::Freeze(r) => service.freeze_for_agent(r, conn).await,
            Request::Thaw(t) => service.thaw_for_agent(t).await,
            request => {
                // Counted until its reply is sent: a Shutdown meanwhile waits for it.
                let _in_flight = service.control_op_begun();
                let reply = with_steps(request, write, service).await?;
                send(write, &ReplyLine::new(reply)).await?;
                continue;
            }
        };
        send(write, &ReplyLine::new(reply)).await?;
    }
}

/// Runs a preemption-kind request, writing its steps as they come; its reply.
async fn with_steps(
    request: Request,
    write: &mut OwnedWriteHalf,
    service: &TaskService,
) -> std::io::Result<Reply> {
    let (tx, mut rx) = mpsc::unbounded_channel::<Step>();
    let service = service.clone();
    let work = tokio::spawn(async move { service.control(request, tx).await });
    while let Some(step) = rx.recv().await {
        let line = StepLine {
            v: PROTOCOL_VERSION,
            step,
        };
        send(write, &line).await?;
    }
    Ok(work.await.unwrap_or_else(|e| Reply::Error {
        error: format!("the operation failed: {e}"),
    }))
}

async fn send(write: &mut OwnedWriteHalf, line: &impl serde::Serialize) -> std::io::Result<()> {
    let mut text = serde_json::to_string(line).map_err(std::io::Error::other)?;
    text.push('\n');
    write.write_all(text.as_bytes()).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_agent_is_served() {
        assert!(check_peer(0, Some(7), Some(7)).is_ok());
        let e = check_peer(0, Some(8), Some(7)).unwrap_err();
        assert!(e.contains("pid 8") && e.contains("pid 7"), "{e}");
        assert!(
            check_peer(0, Some(7), None)
                .unwrap_err()
                .contains("not connected")
        );
        assert!(check_peer(1000, Some(7), Some(7)).is_err());
        assert!(check_peer(0, None, Some(7)).is_err());
    }

    #[test]
    fn the_socket_goes_beside_the_agents() {
        let p = socket_path(Path::new("/run/baton/agent.sock"));
        assert_eq!(
            p,
            PathBuf::from(format!("/run/baton/shims/{}.sock", std::process::id()))
        );
    }
}
