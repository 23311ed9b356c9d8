//! The hooks' calls to the node agent, each bounded in time: a hook never starts an agent (one runs as a
//! DaemonSet or a systemd unit) and never waits long on one that does not answer. The bound is generous
//! ([`CALL_TIMEOUT`] by default) because the first registration on an idle node loads the probes.
use std::{path::PathBuf, time::Duration};

use baton_agent_api::{
    Client, ClientError, ContainerRef, ContainerStatus, Filter, GateRequest, Registration, Reply,
    Request,
};

/// How long connecting and one quick request (register, status, unregister) may take, unless told.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// What the agent did instead of answering.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// No agent, or the connection failed.
    #[error(transparent)]
    Client(#[from] ClientError),
    /// It refused the request (its reason says why).
    #[error("the baton agent refused: {0}")]
    Refused(String),
    /// It did not answer in time.
    #[error("the baton agent at {socket} did not answer within {within:?}")]
    Timeout {
        /// Its socket.
        socket: PathBuf,
        /// The bound.
        within: Duration,
    },
    /// It answered something else.
    #[error("unexpected reply from the baton agent at {socket}: {reply}")]
    Unexpected {
        /// Its socket.
        socket: PathBuf,
        /// The reply.
        reply: String,
    },
}

/// The agent at one socket.
#[derive(Clone, Debug)]
pub struct Agent {
    /// Its socket.
    pub socket: PathBuf,
    /// How long connecting and one quick request may take ([`CALL_TIMEOUT`] by default).
    pub within: Duration,
}

impl Agent {
    /// Sends `request` on a new connection and returns the reply, all within `within`.
    async fn call(&self, request: Request, within: Duration) -> Result<Reply, AgentError> {
        let call = async {
            let mut client = Client::connect(&self.socket).await?;
            client.call(request).await
        };
        match tokio::time::timeout(within, call).await {
            Ok(Ok(reply)) => Ok(reply),
            Ok(Err(ClientError::Refused(e))) => Err(AgentError::Refused(e)),
            Ok(Err(e)) => Err(AgentError::Client(e)),
            Err(_) => Err(AgentError::Timeout {
                socket: self.socket.clone(),
                within,
            }),
        }
    }

    fn unexpected(&self, reply: &Reply) -> AgentError {
        AgentError::Unexpected {
            socket: self.socket.clone(),
            reply: format!("{reply:?}"),
        }
    }

    /// Has the agent watch a container; returns its entry.
    pub async fn register(
        &self,
        registration: Registration,
    ) -> Result<ContainerStatus, AgentError> {
        match self
            .call(Request::Register(Box::new(registration)), CALL_TIMEOUT)
            .await?
        {
            Reply::Registered { container } => Ok(container),
            other => Err(self.unexpected(&other)),
        }
    }

    /// Whether the agent watches container `c`.
    pub async fn watches(&self, c: &ContainerRef) -> Result<bool, AgentError> {
        let filter = Filter {
            container: Some(c.id.clone()),
            namespace: Some(c.namespace.clone()),
            mine: false,
        };
        match self.call(Request::Status(filter), self.within).await? {
            Reply::Status(s) => Ok(!s.containers.is_empty()),
            other => Err(self.unexpected(&other)),
        }
    }

    /// Stops watching container `c`; returns whether it was watched.
    pub async fn unregister(&self, c: ContainerRef) -> Result<bool, AgentError> {
        match self.call(Request::Unregister(c), self.within).await? {
            Reply::Unregistered { found } => Ok(found),
            other => Err(self.unexpected(&other)),
        }
    }

    /// Waits, at most `within`, until no other container holds a GPU device `c` sees (the shim's Start
    /// gate); returns how long it waited, in ns. The agent answers at the deadline itself, naming the
    /// holder; the margin of [`Agent::within`] only covers an agent that hangs.
    pub async fn wait_gpu_free(
        &self,
        c: ContainerRef,
        within: Duration,
    ) -> Result<u64, AgentError> {
        let request = Request::WaitGpuFree(GateRequest {
            container: c,
            timeout_ms: u64::try_from(within.as_millis()).unwrap_or(u64::MAX),
        });
        match self.call(request, within + self.within).await? {
            Reply::GpuFree { waited_ns, .. } => Ok(waited_ns),
            other => Err(self.unexpected(&other)),
        }
    }
}
