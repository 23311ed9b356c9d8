//! The async client of the agent's socket, and starting the agent when nothing answers there.
use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use tokio::{
    io::{AsyncWriteExt, BufReader},
    net::UnixStream,
};

use crate::lines::{BoundedLines, MAX_REPLY_LINE};
use crate::preempt::{Step, StepLine};
use crate::protocol::{
    Event, EventLine, Filter, PROTOCOL_VERSION, Reply, ReplyLine, Request, RequestLine, TraceLine,
    TraceRequest,
};

/// Errors of the client.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Nothing listens on the socket (or it cannot be reached).
    #[error("cannot reach the baton agent at {path}: {source} (is `baton agent` running?)")]
    Connect {
        /// The socket.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The connection failed mid-way.
    #[error("talking to the baton agent at {path}: {source}")]
    Io {
        /// The socket.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The agent closed the connection.
    #[error("the baton agent at {path} closed the connection")]
    Closed {
        /// The socket.
        path: PathBuf,
    },
    /// A line that is not what the protocol says.
    #[error("the baton agent at {path} sent an unexpected line ({detail}): {line}")]
    Protocol {
        /// The socket.
        path: PathBuf,
        /// What was wrong.
        detail: String,
        /// The line.
        line: String,
    },
    /// The agent refused the request.
    #[error("the baton agent refused: {0}")]
    Refused(String),
    /// The agent could not be started.
    #[error("cannot start the baton agent ({program}): {source}")]
    Start {
        /// The program run.
        program: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// Nothing answered in time.
    #[error("the baton agent at {path} did not answer within {within:?}")]
    Timeout {
        /// The socket.
        path: PathBuf,
        /// The bound.
        within: Duration,
    },
}

/// One connection to the agent.
#[derive(Debug)]
pub struct Client {
    path: PathBuf,
    stream: BoundedLines<BufReader<UnixStream>>,
}

impl Client {
    /// Connects to the agent's socket.
    pub async fn connect(path: &Path) -> Result<Self, ClientError> {
        let stream = UnixStream::connect(path)
            .await
            .map_err(|source| ClientError::Connect {
                path: path.to_owned(),
                source,
            })?;
        Ok(Self {
            path: path.to_owned(),
            stream: BoundedLines::new(BufReader::new(stream), MAX_REPLY_LINE),
        })
    }

    /// The socket this client is connected to.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The pid of the process at the other end (SO_PEERCRED, as of the connect): the agent's, for a
    /// connection to the agent's socket. `None` when the kernel does not say.
    pub fn peer_pid(&self) -> Option<u32> {
        let cred = self.stream.get_ref().get_ref().peer_cred().ok()?;
        cred.pid().and_then(|p| u32::try_from(p).ok())
    }

    /// Sends one request and reads its reply; an error reply becomes [`ClientError::Refused`].
    pub async fn call(&mut self, request: Request) -> Result<Reply, ClientError> {
        self.send(request).await?;
        let line = self.read_line().await?;
        self.reply_of(line)
    }

    async fn send(&mut self, request: Request) -> Result<(), ClientError> {
        let mut text = serde_json::to_string(&RequestLine {
            v: PROTOCOL_VERSION,
            request,
        })
        .map_err(|e| self.protocol(e.to_string(), String::new()))?;
        text.push('\n');
        self.stream
            .get_mut()
            .get_mut()
            .write_all(text.as_bytes())
            .await
            .map_err(|source| self.io(source))
    }

    fn reply_of(&self, line: String) -> Result<Reply, ClientError> {
        let reply: ReplyLine =
            serde_json::from_str(&line).map_err(|e| self.protocol(e.to_string(), line.clone()))?;
        match reply.reply {
            Reply::Error { error } => Err(ClientError::Refused(error)),
            other => Ok(other),
        }
    }

    /// Sends a request whose reply comes after step lines (`preempt`, `resume`, `start`, `handoff`);
    /// `on_step` sees each step as it arrives.
    pub async fn call_with_steps(
        &mut self,
        request: Request,
        mut on_step: impl FnMut(&Step),
    ) -> Result<Reply, ClientError> {
        self.send(request).await?;
        loop {
            let line = self.read_line().await?;
            if let Ok(step) = serde_json::from_str::<StepLine>(&line) {
                on_step(&step.step);
                continue;
            }
            return self.reply_of(line);
        }
    }

    /// Asks for the events matching `filter`; read them with [`Client::next_event`].
    pub async fn watch(&mut self, filter: Filter) -> Result<(), ClientError> {
        match self.call(Request::Watch(filter)).await? {
            Reply::Watching => Ok(()),
            other => Err(self.protocol("expected the watching reply".into(), format!("{other:?}"))),
        }
    }

    /// Asks for trace output; read it with [`Client::next_trace_line`], end it with [`Client::end_trace`].
    pub async fn trace(&mut self, request: TraceRequest) -> Result<usize, ClientError> {
        match self.call(Request::Trace(request)).await? {
            Reply::Tracing { programs_attached } => Ok(programs_attached),
            other => Err(self.protocol("expected the tracing reply".into(), format!("{other:?}"))),
        }
    }

    /// The next trace line; `None` once the agent has sent everything (after [`Client::end_trace`]).
    pub async fn next_trace_line(&mut self) -> Result<Option<String>, ClientError> {
        let line = match self.read_line().await {
            Ok(l) => l,
            Err(ClientError::Closed { .. }) => return Ok(None),
            Err(e) => return Err(e),
        };
        let t: TraceLine =
            serde_json::from_str(&line).map_err(|e| self.protocol(e.to_string(), line.clone()))?;
        Ok(Some(t.line))
    }

    /// Ends a trace: the agent sends what is left (the summary, if asked) and closes.
    pub async fn end_trace(&mut self) -> Result<(), ClientError> {
        self.stream
            .get_mut()
            .get_mut()
            .shutdown()
            .await
            .map_err(|source| self.io(source))
    }

    /// The next event of a watch.
    pub async fn next_event(&mut self) -> Result<Event, ClientError> {
        let line = self.read_line().await?;
        let event: EventLine =
            serde_json::from_str(&line).map_err(|e| self.protocol(e.to_string(), line.clone()))?;
        Ok(event.event)
    }

    async fn read_line(&mut self) -> Result<String, ClientError> {
        let line = self
            .stream
            .next_line()
            .await
            .map_err(|source| ClientError::Io {
                path: self.path.clone(),
                source,
            })?;
        line.ok_or_else(|| ClientError::Closed {
            path: self.path.clone(),
        })
    }

    fn io(&self, source: std::io::Error) -> ClientError {
        ClientError::Io {
            path: self.path.clone(),
            source,
        }
    }

    fn protocol(&self, detail: String, line: String) -> ClientError {
        ClientError::Protocol {
            path: self.path.clone(),
            detail,
            line,
        }
    }
}

/// Where the agent listens and, when the client may start it, the `baton` program to start it with.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    /// The agent's socket.
    pub socket: PathBuf,
    /// The `baton` binary that starts an agent when none answers; `None`: never start one.
    pub autostart: Option<PathBuf>,
}

/// Connects to the agent, starting it (detached, see `baton agent --daemon`) when nothing answers and
/// `endpoint.autostart` allows it; gives up after `within`.
pub async fn connect_or_start(
    endpoint: &Endpoint,
    within: Duration,
) -> Result<Client, ClientError> {
    let socket = &endpoint.socket;
    let first = tokio::time::timeout(within, Client::connect(socket)).await;
    match (first, &endpoint.autostart) {
        (Ok(Ok(c)), _) => Ok(c),
        (Ok(Err(e)), None) => Err(e),
        (Err(_), _) => Err(ClientError::Timeout {
            path: socket.clone(),
            within,
        }),
        (Ok(Err(_)), Some(program)) => {
            start_agent(program, socket)?;
            wait_until_listening(socket, within).await
        }
    }
}

/// Starts `program agent --daemon --socket SOCKET`. The agent detaches itself (new session, the root
/// cgroups, its own log file) and exits at once when another agent holds the node's lock, so that many
/// shims racing to start one end up with one.
pub fn start_agent(program: &Path, socket: &Path) -> Result<(), ClientError> {
    tracing::info!(
        "starting the baton agent: {} agent --daemon --socket {}",
        program.display(),
        socket.display()
    );
    std::process::Command::new(program)
        .arg("agent")
        .arg("--daemon")
        .arg("--socket")
        .arg(socket)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map(drop)
        .map_err(|source| ClientError::Start {
            program: program.to_owned(),
            source,
        })
}

/// Connects as soon as the agent listens on `socket` (checked every 10 ms), or fails after `within`.
async fn wait_until_listening(socket: &Path, within: Duration) -> Result<Client, ClientError> {
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if let Ok(c) = Client::connect(socket).await {
            return Ok(c);
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(ClientError::Timeout {
                path: socket.to_owned(),
                within,
            });
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
