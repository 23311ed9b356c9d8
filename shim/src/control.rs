//! The shim's own socket, where the node agent sends `preempt`, `resume`, `start`, `freeze` and `thaw` for
//! this shim's containers (the agent resolves the container and its CUDA processes; the shim acts). Same
//! protocol as the agent's socket (docs/api.md): request lines, each answered by step lines as the operation
//! goes (preemptions only) and one reply line. The holds (`freeze`) a connection made end with it.
//! Root only (SO_PEERCRED), mode 0600, `<agent socket dir>/shims/<shim pid>.sock`, removed at exit.
use std::{
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
};

use std::sync::atomic::{AtomicU64, Ordering};

use baton_agent_api::{PROTOCOL_VERSION, Reply, ReplyLine, Request, RequestLine, Step, StepLine};
use tokio::{
    io::{AsyncBufReadExt, AsyncWriteExt, BufReader},
    net::{UnixListener, UnixStream, unix::OwnedWriteHalf},
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

/// Connections are numbered: the holds a connection made end with it.
static NEXT_CONNECTION: AtomicU64 = AtomicU64::new(1);

async fn connection(stream: UnixStream, service: TaskService) -> std::io::Result<()> {
    let cred = stream.peer_cred()?;
    let (read, mut write) = stream.into_split();
    if cred.uid() != 0 {
        let error = format!("this shim's socket serves root only (uid {})", cred.uid());
        return send(&mut write, &ReplyLine::new(Reply::Error { error })).await;
    }
    let conn = NEXT_CONNECTION.fetch_add(1, Ordering::Relaxed);
    let mut lines = BufReader::new(read).lines();
    let result = serve_lines(&mut lines, &mut write, &service, conn).await;
    service.agent_connection_ended(conn).await;
    result
}

/// Answers request lines until the agent closes its side: `freeze` and `thaw` at once, the others with
/// their step lines first.
async fn serve_lines(
    lines: &mut tokio::io::Lines<BufReader<tokio::net::unix::OwnedReadHalf>>,
    write: &mut OwnedWriteHalf,
    service: &TaskService,
    conn: u64,
) -> std::io::Result<()> {
    while let Some(line) = lines.next_line().await? {
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
            request => with_steps(request, write, service).await?,
        };
        send(write, &ReplyLine::new(reply)).await?;
    }
    Ok(())
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
    fn the_socket_goes_beside_the_agents() {
        let p = socket_path(Path::new("/run/baton/agent.sock"));
        assert_eq!(
            p,
            PathBuf::from(format!("/run/baton/shims/{}.sock", std::process::id()))
        );
    }
}
