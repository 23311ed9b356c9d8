//! containerd's gRPC API (through `containerd-client`) behind a blocking interface, for what `ctr` 1.6 cannot
//! do: tasks created with runtime options (`runtimeoptions.v1.Options` with a TOML `config_body`, as CRI sends
//! them), rootfs mounts, update, resize, TTY exec with FIFOs, and an event subscription.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use containerd_client::services::v1::container::Runtime;
use containerd_client::services::v1::containers_client::ContainersClient;
use containerd_client::services::v1::content_client::ContentClient;
use containerd_client::services::v1::events_client::EventsClient;
use containerd_client::services::v1::leases_client::LeasesClient;
use containerd_client::services::v1::tasks_client::TasksClient;
use containerd_client::services::v1::{
    CheckpointTaskRequest, CloseIoRequest, Container, CreateContainerRequest, CreateTaskRequest,
    DeleteContainerRequest, DeleteTaskRequest, ExecProcessRequest, GetRequest, KillRequest,
    PublishRequest, ResizePtyRequest, StartRequest, SubscribeRequest, UpdateTaskRequest,
    WaitRequest, WriteAction, WriteContentRequest,
};
use containerd_client::types::Mount;
use prost::Message;
use prost_types::Any;
use tonic::Request;
use tonic::metadata::MetadataValue;
use tonic::transport::Channel;

/// Type URL containerd uses for an OCI spec (JSON).
pub const SPEC_TYPE: &str = "types.containerd.io/opencontainers/runtime-spec/1/Spec";
/// Type URL containerd uses for an OCI process (JSON).
pub const PROCESS_TYPE: &str = "types.containerd.io/opencontainers/runtime-spec/1/Process";
/// Type URL containerd uses for OCI Linux resources (JSON).
pub const RESOURCES_TYPE: &str = "types.containerd.io/opencontainers/runtime-spec/1/LinuxResources";
/// Type URL of CRI's runtime options message for non-runc runtimes.
pub const RUNTIME_OPTIONS_TYPE: &str = "runtimeoptions.v1.Options";

/// Errors from the API.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The tokio runtime could not be built.
    #[error("building a tokio runtime: {0}")]
    Runtime(std::io::Error),
    /// The socket could not be reached.
    #[error("connecting to containerd at {socket}: {detail}")]
    Connect {
        /// The socket.
        socket: String,
        /// The cause.
        detail: String,
    },
    /// A call returned an error status.
    #[error("{call} {id}: {status}")]
    Rpc {
        /// The call.
        call: &'static str,
        /// The container (and exec) id.
        id: String,
        /// containerd's answer.
        status: tonic::Status,
    },
    /// Something could not be serialised.
    #[error("encoding {what} for {id}: {detail}")]
    Encode {
        /// What.
        what: &'static str,
        /// The container id.
        id: String,
        /// The cause.
        detail: String,
    },
    /// Wait did not return in time.
    #[error("wait for {id} did not return within {timeout:?}")]
    WaitTimeout {
        /// The container (and exec) id.
        id: String,
        /// The limit.
        timeout: Duration,
    },
}

impl Error {
    /// The gRPC status message, or the whole error text.
    pub fn message(&self) -> String {
        match self {
            Self::Rpc { status, .. } => status.message().to_string(),
            other => other.to_string(),
        }
    }
}

/// `runtimeoptions.v1.Options` (containerd pkg/runtimeoptions/v1/api.proto), what CRI sends a non-runc runtime.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RuntimeOptions {
    /// Type URL of the options inside.
    #[prost(string, tag = "1")]
    pub type_url: String,
    /// Path of a config file.
    #[prost(string, tag = "2")]
    pub config_path: String,
    /// The runtime's `options` table as TOML text.
    #[prost(string, tag = "3")]
    pub config_body: String,
}

/// CRI-style runtime options carrying `toml` as config_body.
pub fn runtime_options_toml(toml: &str) -> Any {
    let options = RuntimeOptions {
        config_body: toml.to_string(),
        ..Default::default()
    };
    Any {
        type_url: RUNTIME_OPTIONS_TYPE.to_string(),
        value: options.encode_to_vec(),
    }
}

/// A bind mount of `source` as the task's rootfs (the shim mounts it at `<bundle>/rootfs`).
pub fn bind_rootfs(source: &Path) -> Mount {
    Mount {
        r#type: "bind".to_string(),
        source: source.display().to_string(),
        target: String::new(),
        options: vec!["rbind".to_string(), "rw".to_string()],
    }
}

/// Paths for a task's stdio (empty string = none).
#[derive(Debug, Clone, Default)]
pub struct StdioPaths {
    /// Stdin FIFO.
    pub stdin: String,
    /// Stdout FIFO or URI.
    pub stdout: String,
    /// Stderr FIFO or URI.
    pub stderr: String,
    /// Whether the process gets a terminal.
    pub terminal: bool,
}

/// A blocking client for one containerd namespace.
///
/// Everything it makes in the content store (a Task Checkpoint's blobs, [`Api::write_content`]) is held by a
/// lease of its own until it is dropped: containerd's garbage collector removes content that nothing refers to,
/// and it runs at unpredictable times (100 ms after start-up, after deletions), so a blob a test wrote and
/// then restored from vanished once in CI ("content digest ...: not found").
pub struct Api {
    runtime: tokio::runtime::Runtime,
    channel: Channel,
    namespace: String,
    lease: String,
}

/// A gRPC channel to containerd's socket and the one-worker runtime that blocking clients drive it on.
pub fn blocking_channel(socket: &Path) -> Result<(tokio::runtime::Runtime, Channel), Error> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(Error::Runtime)?;
    let channel = runtime
        .block_on(containerd_client::connect(socket))
        .map_err(|error| Error::Connect {
            socket: socket.display().to_string(),
            detail: error.to_string(),
        })?;
    Ok((runtime, channel))
}

impl Api {
    /// Connects to containerd's socket for `namespace`.
    pub fn connect(socket: &Path, namespace: &str) -> Result<Self, Error> {
        static LEASES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let (runtime, channel) = blocking_channel(socket)?;
        let n = LEASES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut api = Self {
            runtime,
            channel,
            namespace: namespace.to_string(),
            lease: String::new(),
        };
        let lease = format!("baton-test-{}-{n}", std::process::id());
        let request = api.request(containerd_client::services::v1::CreateRequest {
            id: lease.clone(),
            labels: HashMap::new(),
        });
        let mut leases = LeasesClient::new(api.channel.clone());
        api.runtime
            .block_on(leases.create(request))
            .map_err(|status| Error::Rpc {
                call: "create lease",
                id: lease.clone(),
                status,
            })?;
        api.lease = lease;
        Ok(api)
    }

    /// `message` in this client's namespace and lease.
    fn request<T>(&self, message: T) -> Request<T> {
        let mut request = Request::new(message);
        if let Ok(value) = MetadataValue::try_from(self.namespace.as_str()) {
            request.metadata_mut().insert("containerd-namespace", value);
        }
        if !self.lease.is_empty()
            && let Ok(value) = MetadataValue::try_from(self.lease.as_str())
        {
            request.metadata_mut().insert("containerd-lease", value);
        }
        request
    }

    /// Writes `data` into the content store under this client's lease, as `reference`; its descriptor with
    /// `media_type`.
    pub fn write_content(
        &self,
        reference: &str,
        media_type: &str,
        data: Vec<u8>,
    ) -> Result<containerd_client::types::Descriptor, Error> {
        let digest = format!("sha256:{}", crate::cri::image::hex_sha256(&data));
        let size = data.len() as i64;
        // One message: containerd writes its data, then commits at the expected size and digest.
        let write = WriteContentRequest {
            action: WriteAction::Commit as i32,
            r#ref: reference.to_string(),
            total: size,
            expected: digest.clone(),
            offset: 0,
            data,
            labels: HashMap::new(),
        };
        let request = self.request(tokio_stream::iter(vec![write]));
        let mut content = ContentClient::new(self.channel.clone());
        self.runtime
            .block_on(async {
                let mut replies = content.write(request).await?.into_inner();
                while replies.message().await?.is_some() {}
                Ok::<_, tonic::Status>(())
            })
            .map_err(|status| Error::Rpc {
                call: "write content",
                id: reference.to_string(),
                status,
            })?;
        Ok(containerd_client::types::Descriptor {
            media_type: media_type.to_string(),
            digest,
            size,
            ..Default::default()
        })
    }

    fn tasks(&self) -> TasksClient<Channel> {
        TasksClient::new(self.channel.clone())
    }

    /// Creates container `id` with `runtime`, the raw spec bytes (normally JSON) and optional runtime options.
    pub fn create_container(
        &self,
        id: &str,
        runtime: &str,
        spec: Vec<u8>,
        options: Option<Any>,
        labels: HashMap<String, String>,
    ) -> Result<(), Error> {
        let container = Container {
            id: id.to_string(),
            runtime: Some(Runtime {
                name: runtime.to_string(),
                options,
            }),
            spec: Some(Any {
                type_url: SPEC_TYPE.to_string(),
                value: spec,
            }),
            labels,
            ..Default::default()
        };
        let request = self.request(CreateContainerRequest {
            container: Some(container),
        });
        let mut client = ContainersClient::new(self.channel.clone());
        self.runtime
            .block_on(client.create(request))
            .map(|_| ())
            .map_err(|status| Error::Rpc {
                call: "create container",
                id: id.to_string(),
                status,
            })
    }

    /// Creates the task of container `id`; returns its pid.
    pub fn create_task(
        &self,
        id: &str,
        stdio: &StdioPaths,
        rootfs: Vec<Mount>,
    ) -> Result<u32, Error> {
        self.create_task_with_options(id, stdio, rootfs, None)
    }

    /// Creates the task of container `id` with task `options` (what containerd hands the shim's `start` and
    /// Create); returns its pid.
    pub fn create_task_with_options(
        &self,
        id: &str,
        stdio: &StdioPaths,
        rootfs: Vec<Mount>,
        options: Option<Any>,
    ) -> Result<u32, Error> {
        self.create_task_from(id, stdio, rootfs, options, None)
    }

    /// Creates the task of container `id` from `checkpoint` (a CRIU checkpoint blob in the content store;
    /// the shim restores it at Start) when given; returns its pid.
    pub fn create_task_from(
        &self,
        id: &str,
        stdio: &StdioPaths,
        rootfs: Vec<Mount>,
        options: Option<Any>,
        checkpoint: Option<containerd_client::types::Descriptor>,
    ) -> Result<u32, Error> {
        let request = self.request(CreateTaskRequest {
            checkpoint,
            container_id: id.to_string(),
            rootfs,
            stdin: stdio.stdin.clone(),
            stdout: stdio.stdout.clone(),
            stderr: stdio.stderr.clone(),
            terminal: stdio.terminal,
            options,
            ..Default::default()
        });
        let mut tasks = self.tasks();
        self.runtime
            .block_on(tasks.create(request))
            .map(|response| response.into_inner().pid)
            .map_err(|status| Error::Rpc {
                call: "create task",
                id: id.to_string(),
                status,
            })
    }

    /// Starts the task (or exec `exec_id`); returns its pid.
    pub fn start(&self, id: &str, exec_id: &str) -> Result<u32, Error> {
        let request = self.request(StartRequest {
            container_id: id.to_string(),
            exec_id: exec_id.to_string(),
        });
        let mut tasks = self.tasks();
        self.runtime
            .block_on(tasks.start(request))
            .map(|response| response.into_inner().pid)
            .map_err(|status| Error::Rpc {
                call: "start",
                id: join(id, exec_id),
                status,
            })
    }

    /// Adds exec `exec_id` running `process` to task `id` (start it with [`Api::start`]).
    pub fn exec(
        &self,
        id: &str,
        exec_id: &str,
        process: &oci_spec::runtime::Process,
        stdio: &StdioPaths,
    ) -> Result<(), Error> {
        let value = serde_json::to_vec(process).map_err(|error| Error::Encode {
            what: "process spec",
            id: id.to_string(),
            detail: error.to_string(),
        })?;
        let request = self.request(ExecProcessRequest {
            container_id: id.to_string(),
            exec_id: exec_id.to_string(),
            stdin: stdio.stdin.clone(),
            stdout: stdio.stdout.clone(),
            stderr: stdio.stderr.clone(),
            terminal: stdio.terminal,
            spec: Some(Any {
                type_url: PROCESS_TYPE.to_string(),
                value,
            }),
        });
        let mut tasks = self.tasks();
        self.runtime
            .block_on(tasks.exec(request))
            .map(|_| ())
            .map_err(|status| Error::Rpc {
                call: "exec",
                id: join(id, exec_id),
                status,
            })
    }

    /// Closes the stdin of the task (or exec), as `ctr` does when its own stdin ends.
    pub fn close_stdin(&self, id: &str, exec_id: &str) -> Result<(), Error> {
        let request = self.request(CloseIoRequest {
            container_id: id.to_string(),
            exec_id: exec_id.to_string(),
            stdin: true,
        });
        let mut tasks = self.tasks();
        self.runtime
            .block_on(tasks.close_io(request))
            .map(|_| ())
            .map_err(|status| Error::Rpc {
                call: "close io",
                id: join(id, exec_id),
                status,
            })
    }

    /// Resizes the terminal of the task (or exec).
    pub fn resize(&self, id: &str, exec_id: &str, width: u32, height: u32) -> Result<(), Error> {
        let request = self.request(ResizePtyRequest {
            container_id: id.to_string(),
            exec_id: exec_id.to_string(),
            width,
            height,
        });
        let mut tasks = self.tasks();
        self.runtime
            .block_on(tasks.resize_pty(request))
            .map(|_| ())
            .map_err(|status| Error::Rpc {
                call: "resize",
                id: join(id, exec_id),
                status,
            })
    }

    /// Updates the task's resources.
    pub fn update(
        &self,
        id: &str,
        resources: &oci_spec::runtime::LinuxResources,
    ) -> Result<(), Error> {
        let value = serde_json::to_vec(resources).map_err(|error| Error::Encode {
            what: "resources",
            id: id.to_string(),
            detail: error.to_string(),
        })?;
        let request = self.request(UpdateTaskRequest {
            container_id: id.to_string(),
            resources: Some(Any {
                type_url: RESOURCES_TYPE.to_string(),
                value,
            }),
            ..Default::default()
        });
        let mut tasks = self.tasks();
        self.runtime
            .block_on(tasks.update(request))
            .map(|_| ())
            .map_err(|status| Error::Rpc {
                call: "update",
                id: id.to_string(),
                status,
            })
    }

    /// containerd's Task Checkpoint of `id` (runc's `CheckpointOptions`, with `exit` to stop the task after
    /// the dump, which `ctr task checkpoint --exit` sends to runc's own shims only): the CRIU blob it wrote
    /// into the content store, as a task's `checkpoint` for restoring from it.
    pub fn checkpoint(
        &self,
        id: &str,
        exit: bool,
    ) -> Result<containerd_client::types::Descriptor, Error> {
        use crate::task_options::{CHECKPOINT_OPTIONS_TYPE, CheckpointOptions};
        let request = self.request(CheckpointTaskRequest {
            container_id: id.to_string(),
            options: Some(Any {
                type_url: CHECKPOINT_OPTIONS_TYPE.to_string(),
                value: CheckpointOptions { exit }.encode_to_vec(),
            }),
            ..Default::default()
        });
        let mut tasks = self.tasks();
        let reply = self
            .runtime
            .block_on(tasks.checkpoint(request))
            .map_err(|status| Error::Rpc {
                call: "checkpoint",
                id: id.to_string(),
                status,
            })?;
        let descriptors = reply.into_inner().descriptors;
        descriptors
            .iter()
            .find(|d| d.media_type.ends_with("checkpoint.criu.tar"))
            .cloned()
            .ok_or_else(|| Error::Encode {
                what: "checkpoint reply",
                id: id.to_string(),
                detail: format!("no CRIU blob among {descriptors:?}"),
            })
    }

    /// Waits for the task (or exec) to exit; returns its exit status.
    pub fn wait(&self, id: &str, exec_id: &str, timeout: Duration) -> Result<u32, Error> {
        let request = self.request(WaitRequest {
            container_id: id.to_string(),
            exec_id: exec_id.to_string(),
        });
        let mut tasks = self.tasks();
        let call = async move { tokio::time::timeout(timeout, tasks.wait(request)).await };
        match self.runtime.block_on(call) {
            Ok(Ok(response)) => Ok(response.into_inner().exit_status),
            Ok(Err(status)) => Err(Error::Rpc {
                call: "wait",
                id: join(id, exec_id),
                status,
            }),
            Err(_) => Err(Error::WaitTimeout {
                id: join(id, exec_id),
                timeout,
            }),
        }
    }

    /// Sends `signal` to the task (or exec, or with `all` every process of the container).
    pub fn kill(&self, id: &str, exec_id: &str, signal: u32, all: bool) -> Result<(), Error> {
        let request = self.request(KillRequest {
            container_id: id.to_string(),
            exec_id: exec_id.to_string(),
            signal,
            all,
        });
        let mut tasks = self.tasks();
        self.runtime
            .block_on(tasks.kill(request))
            .map(|_| ())
            .map_err(|status| Error::Rpc {
                call: "kill",
                id: join(id, exec_id),
                status,
            })
    }

    /// The record containerd keeps of the task (or exec): status, pid, exit status and time (`exited_at`).
    pub fn process(
        &self,
        id: &str,
        exec_id: &str,
    ) -> Result<containerd_client::types::v1::Process, Error> {
        let request = self.request(GetRequest {
            container_id: id.to_string(),
            exec_id: exec_id.to_string(),
        });
        let mut tasks = self.tasks();
        let response = self
            .runtime
            .block_on(tasks.get(request))
            .map_err(|status| Error::Rpc {
                call: "get",
                id: join(id, exec_id),
                status,
            })?;
        Ok(response.into_inner().process.unwrap_or_default())
    }

    /// The status of the task (or exec) as containerd names it (`RUNNING`, `PAUSED`, `STOPPED`, ...) and its pid.
    pub fn state(&self, id: &str, exec_id: &str) -> Result<(String, u32), Error> {
        let process = self.process(id, exec_id)?;
        let status = containerd_client::types::v1::Status::try_from(process.status).map_or_else(
            |_| format!("status {}", process.status),
            |status| status.as_str_name().to_string(),
        );
        Ok((status, process.pid))
    }

    /// Deletes the (stopped) task; returns its exit status.
    pub fn delete_task(&self, id: &str) -> Result<u32, Error> {
        let request = self.request(DeleteTaskRequest {
            container_id: id.to_string(),
        });
        let mut tasks = self.tasks();
        self.runtime
            .block_on(tasks.delete(request))
            .map(|response| response.into_inner().exit_status)
            .map_err(|status| Error::Rpc {
                call: "delete task",
                id: id.to_string(),
                status,
            })
    }

    /// Deletes container `id` (its task must be gone).
    pub fn delete_container(&self, id: &str) -> Result<(), Error> {
        let request = self.request(DeleteContainerRequest { id: id.to_string() });
        let mut client = ContainersClient::new(self.channel.clone());
        self.runtime
            .block_on(client.delete(request))
            .map(|_| ())
            .map_err(|status| Error::Rpc {
                call: "delete container",
                id: id.to_string(),
                status,
            })
    }

    /// Subscribes to this namespace's `/tasks/` events; they collect in the returned log until it is dropped.
    /// Returns once the subscription is live (containerd answers a streaming call only with its first event, so
    /// this publishes a marker event until it comes back).
    pub fn subscribe(&self) -> Result<EventLog, Error> {
        let filters = vec![format!("namespace==\"{}\"", self.namespace)];
        let mut client = EventsClient::new(self.channel.clone());
        let events = Arc::new(Mutex::new(Vec::new()));
        let live = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (sink, seen) = (Arc::clone(&events), Arc::clone(&live));
        let task = self.runtime.spawn(async move {
            let Ok(response) = client.subscribe(SubscribeRequest { filters }).await else {
                return;
            };
            let mut stream = response.into_inner();
            while let Ok(Some(envelope)) = stream.message().await {
                seen.store(true, std::sync::atomic::Ordering::SeqCst);
                if !envelope.topic.starts_with("/tasks/") {
                    continue;
                }
                let event = TaskEvent::decode(&envelope.topic, envelope.event.as_ref());
                if let Ok(mut events) = sink.lock() {
                    events.push(event);
                }
            }
        });
        let log = EventLog { events, task };
        let deadline = Instant::now() + SUBSCRIBE_TIMEOUT;
        while !live.load(std::sync::atomic::Ordering::SeqCst) {
            if Instant::now() >= deadline {
                return Err(Error::Rpc {
                    call: "subscribe",
                    id: self.namespace.clone(),
                    status: tonic::Status::deadline_exceeded("no marker event came back"),
                });
            }
            let marker = PublishRequest {
                topic: SUBSCRIBE_MARKER_TOPIC.to_string(),
                event: Some(Any {
                    type_url: RUNTIME_OPTIONS_TYPE.to_string(),
                    value: Vec::new(),
                }),
            };
            let request = self.request(marker);
            let mut publisher = EventsClient::new(self.channel.clone());
            let _ = self.runtime.block_on(publisher.publish(request));
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(log)
    }
}

/// Topic of the marker event [`Api::subscribe`] publishes to know its subscription is live.
const SUBSCRIBE_MARKER_TOPIC: &str = "/baton-test/subscribed";
/// How long [`Api::subscribe`] waits for its marker.
const SUBSCRIBE_TIMEOUT: Duration = Duration::from_secs(10);

fn join(id: &str, exec_id: &str) -> String {
    if exec_id.is_empty() {
        id.to_string()
    } else {
        format!("{id}/{exec_id}")
    }
}

/// One `/tasks/...` event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskEvent {
    /// Topic, e.g. `/tasks/exit`.
    pub topic: String,
    /// Container id.
    pub container_id: String,
    /// Exec id for exit / exec events (the container id for the init process's exit).
    pub id: String,
    /// Exit status, for `/tasks/exit`.
    pub exit_status: Option<u32>,
}

/// The field every task event starts with (containerd api/events/task.proto: container_id = 1).
#[derive(Clone, PartialEq, prost::Message)]
struct TaskEventHead {
    #[prost(string, tag = "1")]
    container_id: String,
}

/// Container and exec id of TaskExit, TaskExecAdded and TaskExecStarted (fields 1 and 2).
#[derive(Clone, PartialEq, prost::Message)]
struct TaskExecHead {
    #[prost(string, tag = "1")]
    container_id: String,
    #[prost(string, tag = "2")]
    id: String,
}

impl TaskEvent {
    fn decode(topic: &str, payload: Option<&Any>) -> Self {
        let bytes = payload.map(|any| any.value.as_slice()).unwrap_or_default();
        let exit_status = (topic == "/tasks/exit")
            .then(|| {
                containerd_client::events::TaskExit::decode(bytes)
                    .ok()
                    .map(|exit| exit.exit_status)
            })
            .flatten();
        let container_id = TaskEventHead::decode(bytes)
            .unwrap_or_default()
            .container_id;
        let has_exec_id = matches!(
            topic,
            "/tasks/exit" | "/tasks/exec-added" | "/tasks/exec-started"
        );
        let id = if has_exec_id {
            TaskExecHead::decode(bytes).unwrap_or_default().id
        } else {
            String::new()
        };
        Self {
            topic: topic.to_string(),
            container_id,
            id,
            exit_status,
        }
    }
}

/// Events collected by [`Api::subscribe`].
pub struct EventLog {
    events: Arc<Mutex<Vec<TaskEvent>>>,
    task: tokio::task::JoinHandle<()>,
}

impl EventLog {
    /// Everything received so far.
    pub fn all(&self) -> Vec<TaskEvent> {
        self.events
            .lock()
            .map(|events| events.clone())
            .unwrap_or_default()
    }

    /// The topics received so far for container `id`, in order.
    pub fn topics_for(&self, id: &str) -> Vec<String> {
        self.all()
            .into_iter()
            .filter(|event| event.container_id == id)
            .map(|event| event.topic)
            .collect()
    }

    /// Waits up to `timeout` for an event with `topic` for container `id`.
    pub fn wait_for(&self, topic: &str, id: &str, timeout: Duration) -> Option<TaskEvent> {
        let deadline = Instant::now() + timeout;
        loop {
            let found = self
                .all()
                .into_iter()
                .find(|event| event.topic == topic && event.container_id == id);
            if found.is_some() || Instant::now() >= deadline {
                return found;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Lets go of the client's lease: what it held is garbage once nothing else refers to it.
impl Drop for Api {
    fn drop(&mut self) {
        if self.lease.is_empty() {
            return;
        }
        let request = self.request(containerd_client::services::v1::DeleteRequest {
            id: self.lease.clone(),
            sync: false,
        });
        let mut leases = LeasesClient::new(self.channel.clone());
        let _ = self.runtime.block_on(leases.delete(request));
    }
}

impl Drop for EventLog {
    fn drop(&mut self) {
        self.task.abort();
    }
}
