//! Task events to containerd, published through the crate's `RemotePublisher` on the topics
//! containerd's task service listens to.

use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, SystemTime},
};

use containerd_shim::{
    Context,
    protos::{
        shim::{event::Envelope, events::ForwardRequest},
        shim_async::{Client, EventsClient},
    },
};
use tokio::sync::{mpsc, watch};

use crate::io::StdioSpec;
use containerd_shim_protos::{
    events::task::{
        TaskCheckpointed, TaskCreate, TaskDelete, TaskExecAdded, TaskExecStarted, TaskExit, TaskIO,
        TaskOOM, TaskPaused, TaskResumed, TaskStart,
    },
    protobuf::{
        Message, MessageField,
        well_known_types::{
            any::Any,
            struct_::{ListValue, NullValue, Struct, Value},
            timestamp::Timestamp,
        },
    },
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

/// Go's zero `time.Time` (0001-01-01T00:00:00Z) as a protobuf timestamp: what the Go runc-v2 shim reports as the
/// `exited_at` of a process that has not exited. An absent timestamp would read as 1970 in containerd 2.x.
pub fn zero_time() -> Timestamp {
    Timestamp {
        seconds: -62_135_596_800,
        nanos: 0,
        ..Default::default()
    }
}

/// The protobuf package of containerd's task events (their type URLs are `<package>.<name>`).
const EVENTS_PACKAGE: &str = "containerd.events";

/// An event as the `Any` containerd expects. The type URL is built from the message's name rather
/// than read from its descriptor, which would build (and keep on the heap for the shim's life)
/// the reflection tables of the events' proto files.
fn event_any<E: Message>(event: &E) -> containerd_shim::protos::protobuf::Result<Any> {
    Ok(Any {
        type_url: format!("{EVENTS_PACKAGE}.{}", E::NAME),
        value: event.write_to_bytes()?,
        ..Default::default()
    })
}

/// The type URL of `google.protobuf.Struct` as containerd's typeurl resolves it: ctr 1.6 finds the
/// message by its full name only (with the `type.googleapis.com/` prefix it answers "not found").
const STRUCT_TYPE_URL: &str = "google.protobuf.Struct";

/// A JSON object as a protobuf `Struct` in an `Any`.
fn struct_any(payload: &serde_json::Value) -> containerd_shim::protos::protobuf::Result<Any> {
    let serde_json::Value::Object(map) = payload else {
        return Ok(Any::default());
    };
    let mut st = Struct::new();
    for (k, v) in map {
        st.fields.insert(k.clone(), proto_value(v));
    }
    Ok(Any {
        type_url: STRUCT_TYPE_URL.to_owned(),
        value: st.write_to_bytes()?,
        ..Default::default()
    })
}

fn proto_value(v: &serde_json::Value) -> Value {
    use serde_json::Value as J;
    let mut out = Value::new();
    match v {
        J::Null => out.set_null_value(NullValue::NULL_VALUE),
        J::Bool(b) => out.set_bool_value(*b),
        J::Number(n) => out.set_number_value(n.as_f64().unwrap_or(0.0)),
        J::String(s) => out.set_string_value(s.clone()),
        J::Array(items) => {
            let mut list = ListValue::new();
            list.values = items.iter().map(proto_value).collect();
            out.set_list_value(list);
        }
        J::Object(map) => {
            let mut st = Struct::new();
            for (k, v) in map {
                st.fields.insert(k.clone(), proto_value(v));
            }
            out.set_struct_value(st);
        }
    }
    out
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
    /// Events queued so far.
    queued: Arc<AtomicU64>,
    /// Events the forwarder is done with (delivered or dropped); `None` when nothing forwards.
    done: Option<watch::Receiver<u64>>,
}

fn ttrpc_address(address: &str) -> String {
    if address.contains("://") {
        address.to_string()
    } else {
        format!("unix://{address}")
    }
}

async fn forward_loop(
    address: String,
    mut queue: mpsc::Receiver<Envelope>,
    done: watch::Sender<u64>,
) {
    let mut client: Option<EventsClient> = None;
    while let Some(envelope) = queue.recv().await {
        forward_one(&address, &mut client, envelope).await;
        done.send_modify(|n| *n += 1);
    }
}

/// Forwards one event, reconnecting and retrying with growing delays; drops it after
/// [`MAX_ATTEMPTS`].
async fn forward_one(address: &str, client: &mut Option<EventsClient>, envelope: Envelope) {
    let mut req = ForwardRequest::new();
    req.set_envelope(envelope);
    for attempt in 0..MAX_ATTEMPTS {
        if client.is_none() {
            *client = Client::connect(address).await.ok().map(EventsClient::new);
        }
        if let Some(c) = client.as_ref() {
            match c.forward(Context::default(), &req).await {
                Ok(_) => return,
                Err(e) => {
                    tracing::debug!(error = %e, attempt, "forward event failed; reconnecting");
                    *client = None;
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

impl Events {
    /// A publisher to containerd's ttrpc `address` for `namespace`.
    pub fn new(address: &str, namespace: &str) -> Self {
        let (mut events, rx) = Self::queued(namespace);
        let (done_tx, done_rx) = watch::channel(0);
        events.done = Some(done_rx);
        tokio::spawn(forward_loop(ttrpc_address(address), rx, done_tx));
        events
    }

    /// A publisher whose events stay in the returned queue (what tests read instead of containerd).
    fn queued(namespace: &str) -> (Self, mpsc::Receiver<Envelope>) {
        let (queue, rx) = mpsc::channel(1024);
        let events = Self {
            queue,
            namespace: namespace.to_string(),
            queued: Arc::new(AtomicU64::new(0)),
            done: None,
        };
        (events, rx)
    }

    /// Waits until every event queued so far has been forwarded to containerd (or given up
    /// on), for at most `within`. False when time ran out first.
    pub async fn flush(&self, within: Duration) -> bool {
        let Some(mut done) = self.done.clone() else {
            return true;
        };
        let target = self.queued.load(Ordering::SeqCst);
        tokio::time::timeout(within, done.wait_for(|n| *n >= target))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// A publisher for tests: the events it publishes are read from the returned receiver.
    #[cfg(test)]
    pub fn captured(namespace: &str) -> (Self, mpsc::Receiver<Envelope>) {
        Self::queued(namespace)
    }

    async fn send<E: Message>(&self, topic: &str, event: E) {
        match event_any(&event) {
            Ok(any) => self.send_any(topic, any).await,
            Err(e) => tracing::warn!(topic, error = %e, "encode event failed"),
        }
    }

    /// A Baton event (`/baton/...`): `payload`, a JSON object, as a `google.protobuf.Struct`, which
    /// `ctr events` (1.6 and 2.x) decodes and prints as JSON.
    pub async fn gpu(&self, topic: &str, payload: &serde_json::Value) {
        match struct_any(payload) {
            Ok(any) => self.send_any(topic, any).await,
            Err(e) => tracing::warn!(topic, error = %e, "encode event failed"),
        }
    }

    async fn send_any(&self, topic: &str, any: Any) {
        let mut envelope = Envelope::new();
        envelope.set_topic(topic.to_string());
        envelope.set_namespace(self.namespace.clone());
        envelope.set_timestamp(timestamp(SystemTime::now()));
        envelope.set_event(any);
        if self.queue.send(envelope).await.is_err() {
            tracing::warn!(topic, "event queue closed");
            return;
        }
        self.queued.fetch_add(1, Ordering::SeqCst);
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
        self.send(topics::TASK_CREATE_EVENT_TOPIC, ev).await;
    }

    /// TaskStart.
    pub async fn start(&self, id: &str, pid: u32) {
        let ev = TaskStart {
            container_id: id.into(),
            pid,
            ..Default::default()
        };
        self.send(topics::TASK_START_EVENT_TOPIC, ev).await;
    }

    /// TaskExecAdded.
    pub async fn exec_added(&self, id: &str, exec_id: &str) {
        let ev = TaskExecAdded {
            container_id: id.into(),
            exec_id: exec_id.into(),
            ..Default::default()
        };
        self.send(topics::TASK_EXEC_ADDED_EVENT_TOPIC, ev).await;
    }

    /// TaskExecStarted.
    pub async fn exec_started(&self, id: &str, exec_id: &str, pid: u32) {
        let ev = TaskExecStarted {
            container_id: id.into(),
            exec_id: exec_id.into(),
            pid,
            ..Default::default()
        };
        self.send(topics::TASK_EXEC_STARTED_EVENT_TOPIC, ev).await;
    }

    /// TaskPaused.
    pub async fn paused(&self, id: &str) {
        let ev = TaskPaused {
            container_id: id.into(),
            ..Default::default()
        };
        self.send(topics::TASK_PAUSED_EVENT_TOPIC, ev).await;
    }

    /// TaskResumed.
    pub async fn resumed(&self, id: &str) {
        let ev = TaskResumed {
            container_id: id.into(),
            ..Default::default()
        };
        self.send(topics::TASK_RESUMED_EVENT_TOPIC, ev).await;
    }

    /// TaskCheckpointed.
    pub async fn checkpointed(&self, id: &str, checkpoint: &str) {
        let ev = TaskCheckpointed {
            container_id: id.into(),
            checkpoint: checkpoint.into(),
            ..Default::default()
        };
        self.send(topics::TASK_CHECKPOINTED_EVENT_TOPIC, ev).await;
    }

    /// TaskOOM.
    pub async fn oom(&self, id: &str) {
        let ev = TaskOOM {
            container_id: id.into(),
            ..Default::default()
        };
        self.send(topics::TASK_OOM_EVENT_TOPIC, ev).await;
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
        self.send(topics::TASK_EXIT_EVENT_TOPIC, ev).await;
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
        self.send(topics::TASK_DELETE_EVENT_TOPIC, ev).await;
    }
}

#[cfg(test)]
mod tests {
    use containerd_shim_protos::protobuf::MessageFull;

    use super::*;

    fn type_url_matches_descriptor<E: MessageFull + Default>() {
        let any = event_any(&E::default()).unwrap();
        assert_eq!(any.type_url, E::descriptor().full_name());
    }

    #[test]
    fn type_urls_are_the_descriptors_full_names() {
        type_url_matches_descriptor::<TaskCreate>();
        type_url_matches_descriptor::<TaskStart>();
        type_url_matches_descriptor::<TaskExecAdded>();
        type_url_matches_descriptor::<TaskExecStarted>();
        type_url_matches_descriptor::<TaskPaused>();
        type_url_matches_descriptor::<TaskResumed>();
        type_url_matches_descriptor::<TaskCheckpointed>();
        type_url_matches_descriptor::<TaskOOM>();
        type_url_matches_descriptor::<TaskExit>();
        type_url_matches_descriptor::<TaskDelete>();
    }
}
