//! Task events to containerd, published through the crate's `RemotePublisher` on the topics
//! containerd's task service listens to.

use std::time::{Duration, SystemTime};

use containerd_shim::{
    Context,
    protos::{
        shim::{event::Envelope, events::ForwardRequest},
        shim_async::{Client, EventsClient},
    },
};
use tokio::sync::mpsc;

use crate::io::StdioSpec;
use containerd_shim_protos::{
    events::task::{
        TaskCheckpointed, TaskCreate, TaskDelete, TaskExecAdded, TaskExecStarted, TaskExit, TaskIO,
        TaskOOM, TaskPaused, TaskResumed, TaskStart,
    },
    protobuf::{MessageDyn, MessageField, well_known_types::timestamp::Timestamp},
    topics,
};

/// Converts a system time to the protobuf timestamp containerd uses.
pub fn timestamp(t: SystemTime) -> Timestamp {
    let d = t.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
    Timestamp {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
        ..Default::default()
    }
}

/// How many times one event is tried before it is dropped (about a minute of backoff).
const MAX_ATTEMPTS: u32 = 40;

/// Publishes events for one namespace, in order: a single task forwards them to containerd and
/// retries the event at the head of the queue (reconnecting on any error, e.g. while containerd
/// restarts) before it sends the next, so TaskOOM can never be overtaken by TaskExit.
#[derive(Clone)]
pub struct Events {
    queue: mpsc::Sender<Envelope>,
    namespace: String,
}

fn ttrpc_address(address: &str) -> String {
    if address.contains("://") {
        address.to_string()
    } else {
        format!("unix://{address}")
    }
}

async fn forward_loop(address: String, mut queue: mpsc::Receiver<Envelope>) {
    let mut client: Option<EventsClient> = None;
    while let Some(envelope) = queue.recv().await {
        let mut req = ForwardRequest::new();
        req.set_envelope(envelope);
        for attempt in 0..MAX_ATTEMPTS {
            if client.is_none() {
                client = Client::connect(&address).await.ok().map(EventsClient::new);
            }
            if let Some(c) = &client {
                match c.forward(Context::default(), &req).await {
                    Ok(_) => break,
                    Err(e) => {
                        tracing::debug!(error = %e, attempt, "forward event failed; reconnecting");
                        client = None;
                    }
                }
            }
            if attempt + 1 == MAX_ATTEMPTS {
                tracing::warn!(topic = %req.envelope.topic, "event dropped: containerd unreachable at {address}");
            } else {
                let backoff = Duration::from_millis(100 << attempt.min(4));
                tokio::time::sleep(backoff).await;
            }
        }
    }
}

impl Events {
    /// A publisher to containerd's ttrpc `address` for `namespace`.
    pub fn new(address: &str, namespace: &str) -> Self {
        let (queue, rx) = mpsc::channel(1024);
        tokio::spawn(forward_loop(ttrpc_address(address), rx));
        Self {
            queue,
            namespace: namespace.to_string(),
        }
    }

    async fn send(&self, topic: &str, event: Box<dyn MessageDyn>) {
        let any = match containerd_shim::util::convert_to_any(event) {
            Ok(any) => any,
            Err(e) => {
                tracing::warn!(topic, error = %e, "encode event failed");
                return;
            }
        };
        let mut envelope = Envelope::new();
        envelope.set_topic(topic.to_string());
        envelope.set_namespace(self.namespace.clone());
        envelope.set_timestamp(timestamp(SystemTime::now()));
        envelope.set_event(any);
        if self.queue.send(envelope).await.is_err() {
            tracing::warn!(topic, "event queue closed");
        }
    }

    /// TaskCreate, with the init's stdio as containerd sent it.
    pub async fn create(&self, id: &str, bundle: &str, pid: u32, stdio: &StdioSpec) {
        let ev = TaskCreate {
            container_id: id.into(),
            bundle: bundle.into(),
            pid,
            io: MessageField::some(TaskIO {
                stdin: stdio.stdin.clone(),
                stdout: stdio.stdout.clone(),
                stderr: stdio.stderr.clone(),
                terminal: stdio.terminal,
                ..Default::default()
            }),
            ..Default::default()
        };
        self.send(topics::TASK_CREATE_EVENT_TOPIC, Box::new(ev))
            .await;
    }

    /// TaskStart.
    pub async fn start(&self, id: &str, pid: u32) {
        let ev = TaskStart {
            container_id: id.into(),
            pid,
            ..Default::default()
        };
        self.send(topics::TASK_START_EVENT_TOPIC, Box::new(ev))
            .await;
    }

    /// TaskExecAdded.
    pub async fn exec_added(&self, id: &str, exec_id: &str) {
        let ev = TaskExecAdded {
            container_id: id.into(),
            exec_id: exec_id.into(),
            ..Default::default()
        };
        self.send(topics::TASK_EXEC_ADDED_EVENT_TOPIC, Box::new(ev))
            .await;
    }

    /// TaskExecStarted.
    pub async fn exec_started(&self, id: &str, exec_id: &str, pid: u32) {
        let ev = TaskExecStarted {
            container_id: id.into(),
            exec_id: exec_id.into(),
            pid,
            ..Default::default()
        };
        self.send(topics::TASK_EXEC_STARTED_EVENT_TOPIC, Box::new(ev))
            .await;
    }

    /// TaskPaused.
    pub async fn paused(&self, id: &str) {
        let ev = TaskPaused {
            container_id: id.into(),
            ..Default::default()
        };
        self.send(topics::TASK_PAUSED_EVENT_TOPIC, Box::new(ev))
            .await;
    }

    /// TaskResumed.
    pub async fn resumed(&self, id: &str) {
        let ev = TaskResumed {
            container_id: id.into(),
            ..Default::default()
        };
        self.send(topics::TASK_RESUMED_EVENT_TOPIC, Box::new(ev))
            .await;
    }

    /// TaskCheckpointed.
    pub async fn checkpointed(&self, id: &str, checkpoint: &str) {
        let ev = TaskCheckpointed {
            container_id: id.into(),
            checkpoint: checkpoint.into(),
            ..Default::default()
        };
        self.send(topics::TASK_CHECKPOINTED_EVENT_TOPIC, Box::new(ev))
            .await;
    }

    /// TaskOOM.
    pub async fn oom(&self, id: &str) {
        let ev = TaskOOM {
            container_id: id.into(),
            ..Default::default()
        };
        self.send(topics::TASK_OOM_EVENT_TOPIC, Box::new(ev)).await;
    }

    /// TaskExit (`id` is the exec id, or the container id for init, as in Go).
    pub async fn exit(&self, container_id: &str, id: &str, pid: u32, status: u32, at: SystemTime) {
        let ev = TaskExit {
            container_id: container_id.into(),
            id: id.into(),
            pid,
            exit_status: status,
            exited_at: MessageField::some(timestamp(at)),
            ..Default::default()
        };
        self.send(topics::TASK_EXIT_EVENT_TOPIC, Box::new(ev)).await;
    }

    /// TaskDelete.
    pub async fn delete(&self, id: &str, pid: u32, status: u32, at: SystemTime) {
        let ev = TaskDelete {
            container_id: id.into(),
            pid,
            exit_status: status,
            exited_at: MessageField::some(timestamp(at)),
            ..Default::default()
        };
        self.send(topics::TASK_DELETE_EVENT_TOPIC, Box::new(ev))
            .await;
    }
}
