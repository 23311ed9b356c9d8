//! The Task service driven through a container's whole life against the fake runc (see
//! `fake_runc.rs`): create -> start -> pause -> resume -> checkpoint (--leave-running, then the
//! exit variant) -> delete, and a second container restored on Create from that checkpoint ->
//! start (restore) -> kill -> delete. Each step asserts the exact runc command lines, the task's
//! state and the events published; each step is first failed by the fake runc, which must leave
//! the state as it was, publish nothing, and come back as the ttrpc code containerd expects.

use std::{path::Path, sync::Arc, time::Duration};

use containerd_shim::{
    ExitSignal, TtrpcContext, TtrpcResult,
    api::{
        CreateTaskRequest, DeleteRequest, KillRequest, PauseRequest, ResumeRequest,
        ShutdownRequest, StartRequest, StateRequest, WaitRequest, WaitResponse,
    },
    protos::{api::CheckpointTaskRequest, shim_async::Task},
};
use containerd_shim_protos::{
    api::Status,
    protobuf::{Message, well_known_types::any::Any},
    shim::{event::Envelope, oci::CheckpointOptions},
    topics::{
        TASK_CHECKPOINTED_EVENT_TOPIC, TASK_CREATE_EVENT_TOPIC, TASK_DELETE_EVENT_TOPIC,
        TASK_EXIT_EVENT_TOPIC, TASK_PAUSED_EVENT_TOPIC, TASK_RESUMED_EVENT_TOPIC,
        TASK_START_EVENT_TOPIC,
    },
    ttrpc::{self, Code},
};
use tokio::sync::mpsc;

use super::TaskService;
use crate::{
    events::Events,
    fake_runc::{FakeRunc, exclusive},
    runtime::RuncGlobal,
};

pub(super) const NS: &str = "lifecycle";

pub(super) struct Harness {
    pub(super) svc: TaskService,
    pub(super) events: mpsc::Receiver<Envelope>,
    pub(super) exit: Arc<ExitSignal>,
    pub(super) fake: FakeRunc,
    pub(super) ctx: TtrpcContext,
}

/// The ttrpc code of a failed call (panics on success).
pub(super) fn code_of<T: std::fmt::Debug>(res: TtrpcResult<T>) -> (Code, String) {
    match res {
        Err(ttrpc::Error::RpcStatus(s)) => (s.code(), s.message().to_string()),
        other => panic!("expected an error status, got {other:?}"),
    }
}

impl Harness {
    pub(super) fn new() -> Self {
        let (events, rx) = Events::captured(NS);
        let exit = Arc::new(ExitSignal::default());
        Self {
            svc: TaskService::new(NS, events, exit.clone()),
            events: rx,
            exit,
            fake: FakeRunc::new(),
            ctx: TtrpcContext::default(),
        }
    }

    /// runc's global flags for a container in `bundle` (checked on every recorded line).
    pub(super) fn global(&self, bundle: &Path) -> Vec<String> {
        let mut o = containerd_shim_protos::shim::oci::Options::new();
        o.binary_name = self.fake.binary.display().to_string();
        o.root = self.fake.dir().join("root").display().to_string();
        RuncGlobal::new(&o, NS, bundle).args()
    }

    pub(super) fn calls(&self, bundle: &Path) -> Vec<String> {
        self.fake.take_calls(&self.global(bundle))
    }

    /// The topics published since the last call.
    pub(super) fn topics(&mut self) -> Vec<String> {
        let mut topics = Vec::new();
        while let Ok(env) = self.events.try_recv() {
            topics.push(env.topic);
        }
        topics
    }

    /// Waits (5 s at most) for `n` more events, returns their topics sorted (for events whose
    /// relative order is a race, as in the Go shim).
    pub(super) async fn next_topics(&mut self, n: usize) -> Vec<String> {
        let mut topics = Vec::new();
        for _ in 0..n {
            let env = tokio::time::timeout(Duration::from_secs(5), self.events.recv())
                .await
                .expect("event published")
                .expect("event queue open");
            topics.push(env.topic);
        }
        topics.sort();
        topics
    }

    pub(super) async fn status(&self, id: &str) -> Status {
        let req = StateRequest {
            id: id.into(),
            ..Default::default()
        };
        let state = self.svc.state(&self.ctx, req).await.expect("state");
        state.status.enum_value().expect("known status")
    }

    pub(super) async fn state_code(&self, id: &str) -> Code {
        let req = StateRequest {
            id: id.into(),
            ..Default::default()
        };
        code_of(self.svc.state(&self.ctx, req).await).0
    }

    pub(super) async fn create(
        &self,
        id: &str,
        bundle: &Path,
        checkpoint: &str,
    ) -> TtrpcResult<u32> {
        let req = CreateTaskRequest {
            id: id.into(),
            bundle: bundle.display().to_string(),
            checkpoint: checkpoint.into(),
            options: Some(self.fake.options()).into(),
            ..Default::default()
        };
        self.svc.create(&self.ctx, req).await.map(|r| r.pid)
    }

    pub(super) async fn start(&self, id: &str) -> TtrpcResult<u32> {
        let req = StartRequest {
            id: id.into(),
            ..Default::default()
        };
        self.svc.start(&self.ctx, req).await.map(|r| r.pid)
    }

    pub(super) async fn pause(&self, id: &str) -> TtrpcResult<()> {
        let req = PauseRequest {
            id: id.into(),
            ..Default::default()
        };
        self.svc.pause(&self.ctx, req).await.map(drop)
    }

    pub(super) async fn resume(&self, id: &str) -> TtrpcResult<()> {
        let req = ResumeRequest {
            id: id.into(),
            ..Default::default()
        };
        self.svc.resume(&self.ctx, req).await.map(drop)
    }

    pub(super) async fn checkpoint(&self, id: &str, path: &str, exit: bool) -> TtrpcResult<()> {
        let mut opts = CheckpointOptions::new();
        opts.exit = exit;
        let req = CheckpointTaskRequest {
            id: id.into(),
            path: path.into(),
            options: Some(Any {
                type_url: "containerd.runc.v1.CheckpointOptions".into(),
                value: opts.write_to_bytes().expect("encode"),
                ..Default::default()
            })
            .into(),
            ..Default::default()
        };
        self.svc.checkpoint(&self.ctx, req).await.map(drop)
    }

    pub(super) async fn kill(&self, id: &str, signal: u32) -> TtrpcResult<()> {
        let req = KillRequest {
            id: id.into(),
            signal,
            ..Default::default()
        };
        self.svc.kill(&self.ctx, req).await.map(drop)
    }

    pub(super) async fn delete(&self, id: &str) -> TtrpcResult<u32> {
        let req = DeleteRequest {
            id: id.into(),
            ..Default::default()
        };
        self.svc.delete(&self.ctx, req).await.map(|r| r.exit_status)
    }

    pub(super) async fn wait(&self, id: &str) -> WaitResponse {
        let req = WaitRequest {
            id: id.into(),
            ..Default::default()
        };
        tokio::time::timeout(Duration::from_secs(5), self.svc.wait(&self.ctx, req))
            .await
            .expect("the process exits")
            .expect("wait")
    }
}

#[tokio::test]
async fn a_container_lives_and_is_restored_through_runc() {
    let _guard = exclusive().await;
    let mut h = Harness::new();
    let b1 = h.fake.bundle("c1");
    let b = b1.display().to_string();

    // Create: a failed runc create is undone (runc delete --force) and leaves no task.
    h.fake.fail("create", "create exploded");
    let (code, msg) = code_of(h.create("c1", &b1, "").await);
    assert_eq!(code, Code::UNKNOWN);
    assert!(msg.contains("create exploded"), "{msg}");
    assert_eq!(
        h.calls(&b1),
        [
            format!("create --bundle {b} --pid-file {b}/init.pid c1"),
            "delete --force c1".to_string()
        ]
    );
    assert_eq!(h.state_code("c1").await, Code::NOT_FOUND);
    assert!(h.topics().is_empty());
    h.fake.heal("create");

    let pid = h.create("c1", &b1, "").await.expect("create");
    assert_eq!(Some(pid as i32), h.fake.pid_of("c1"));
    assert_eq!(
        h.calls(&b1),
        [format!("create --bundle {b} --pid-file {b}/init.pid c1")]
    );
    assert_eq!(h.status("c1").await, Status::CREATED);
    assert_eq!(h.topics(), [TASK_CREATE_EVENT_TOPIC]);
    assert_eq!(
        code_of(h.create("c1", &b1, "").await).0,
        Code::ALREADY_EXISTS
    );

    // Refused in Created, without running runc.
    assert_eq!(code_of(h.pause("c1").await).0, Code::FAILED_PRECONDITION);
    assert_eq!(code_of(h.resume("c1").await).0, Code::FAILED_PRECONDITION);
    assert_eq!(
        code_of(h.checkpoint("c1", "/img/0", false).await).0,
        Code::FAILED_PRECONDITION
    );
    assert!(h.calls(&b1).is_empty());

    // Start.
    h.fake.fail("start", "start exploded");
    let (code, msg) = code_of(h.start("c1").await);
    assert_eq!(code, Code::UNKNOWN);
    assert!(msg.contains("start exploded"), "{msg}");
    assert_eq!(h.calls(&b1), ["start c1"]);
    assert_eq!(h.status("c1").await, Status::CREATED);
    h.fake.heal("start");
    assert_eq!(h.start("c1").await.expect("start"), pid);
    assert_eq!(h.calls(&b1), ["start c1"]);
    assert_eq!(h.status("c1").await, Status::RUNNING);
    assert_eq!(code_of(h.start("c1").await).0, Code::FAILED_PRECONDITION);
    assert_eq!(code_of(h.delete("c1").await).0, Code::FAILED_PRECONDITION);
    assert!(h.calls(&b1).is_empty());
    assert_eq!(h.topics(), [TASK_START_EVENT_TOPIC]);

    // Pause and resume.
    h.fake.fail("pause", "pause exploded");
    assert_eq!(code_of(h.pause("c1").await).0, Code::UNKNOWN);
    assert_eq!(h.status("c1").await, Status::RUNNING);
    h.fake.heal("pause");
    h.pause("c1").await.expect("pause");
    assert_eq!(h.status("c1").await, Status::PAUSED);
    assert_eq!(code_of(h.pause("c1").await).0, Code::FAILED_PRECONDITION);
    assert_eq!(code_of(h.delete("c1").await).0, Code::FAILED_PRECONDITION);
    assert_eq!(h.calls(&b1), ["pause c1", "pause c1"]);
    h.fake.fail("resume", "resume exploded");
    assert_eq!(code_of(h.resume("c1").await).0, Code::UNKNOWN);
    assert_eq!(h.status("c1").await, Status::PAUSED);
    h.fake.heal("resume");
    h.resume("c1").await.expect("resume");
    assert_eq!(h.status("c1").await, Status::RUNNING);
    assert_eq!(code_of(h.resume("c1").await).0, Code::FAILED_PRECONDITION);
    assert_eq!(h.calls(&b1), ["resume c1", "resume c1"]);
    assert_eq!(
        h.topics(),
        [TASK_PAUSED_EVENT_TOPIC, TASK_RESUMED_EVENT_TOPIC]
    );

    // Checkpoint, leaving the container running.
    let leave_running = format!(
        "{}checkpoint --image-path /img/1 --leave-running c1",
        FakeRunc::criu_prefix()
    );
    h.fake.fail("checkpoint", "criu exploded");
    let (code, msg) = code_of(h.checkpoint("c1", "/img/1", false).await);
    assert_eq!(code, Code::UNKNOWN);
    assert!(msg.contains("criu exploded"), "{msg}");
    assert_eq!(h.status("c1").await, Status::RUNNING);
    assert_eq!(h.calls(&b1), std::slice::from_ref(&leave_running));
    assert!(h.topics().is_empty());
    h.fake.heal("checkpoint");
    h.checkpoint("c1", "/img/1", false)
        .await
        .expect("checkpoint");
    assert_eq!(h.calls(&b1), [leave_running]);
    assert_eq!(h.status("c1").await, Status::RUNNING);
    assert_eq!(h.topics(), [TASK_CHECKPOINTED_EVENT_TOPIC]);

    // Checkpoint with exit: runc stops the container; its exit reaches the task.
    h.checkpoint("c1", "/img/2", true)
        .await
        .expect("checkpoint and exit");
    assert_eq!(
        h.calls(&b1),
        [format!(
            "{}checkpoint --image-path /img/2 c1",
            FakeRunc::criu_prefix()
        )]
    );
    assert_eq!(h.wait("c1").await.exit_status, 128 + 9);
    assert_eq!(h.status("c1").await, Status::STOPPED);
    assert_eq!(
        h.next_topics(2).await,
        [TASK_CHECKPOINTED_EVENT_TOPIC, TASK_EXIT_EVENT_TOPIC]
    );
    assert_eq!(code_of(h.kill("c1", 15).await).0, Code::NOT_FOUND);
    assert_eq!(code_of(h.pause("c1").await).0, Code::FAILED_PRECONDITION);
    assert!(h.calls(&b1).is_empty());

    // Delete.
    h.fake.fail("delete", "delete exploded");
    assert_eq!(code_of(h.delete("c1").await).0, Code::UNKNOWN);
    assert_eq!(h.status("c1").await, Status::STOPPED);
    assert_eq!(h.calls(&b1), ["delete --force c1"]);
    assert!(h.topics().is_empty());
    h.fake.heal("delete");
    assert_eq!(h.delete("c1").await.expect("delete"), 128 + 9);
    assert_eq!(h.calls(&b1), ["delete --force c1"]);
    assert_eq!(h.state_code("c1").await, Code::NOT_FOUND);
    assert_eq!(h.topics(), [TASK_DELETE_EVENT_TOPIC]);

    // Restore on Create: nothing runs until Start, which restores.
    let b2 = h.fake.bundle("c2");
    let b = b2.display().to_string();
    assert_eq!(h.create("c2", &b2, "/img/2").await.expect("create"), 0);
    assert!(h.calls(&b2).is_empty());
    assert_eq!(h.status("c2").await, Status::CREATED);
    assert_eq!(h.topics(), [TASK_CREATE_EVENT_TOPIC]);
    assert_eq!(code_of(h.pause("c2").await).0, Code::FAILED_PRECONDITION);
    assert_eq!(
        code_of(h.checkpoint("c2", "/img/3", false).await).0,
        Code::FAILED_PRECONDITION
    );
    let restore = format!(
        "{}restore --image-path /img/2 --detach --pid-file {b}/init.pid --no-subreaper --bundle {b} c2",
        FakeRunc::criu_prefix()
    );
    h.fake.fail("restore", "restore exploded");
    let (code, msg) = code_of(h.start("c2").await);
    assert_eq!(code, Code::UNKNOWN);
    assert!(msg.contains("restore exploded"), "{msg}");
    assert_eq!(h.status("c2").await, Status::CREATED);
    assert_eq!(h.calls(&b2), [restore.as_str()]);
    assert!(h.topics().is_empty());
    h.fake.heal("restore");
    let pid = h.start("c2").await.expect("restore");
    assert_eq!(Some(pid as i32), h.fake.pid_of("c2"));
    assert_eq!(h.calls(&b2), [restore.as_str()]);
    assert_eq!(h.status("c2").await, Status::RUNNING);
    assert_eq!(h.topics(), [TASK_START_EVENT_TOPIC]);

    // Kill: runc's failure maps to Unknown, "not running" to NotFound; then the real kill.
    h.fake.fail("kill", "kill exploded");
    assert_eq!(code_of(h.kill("c2", 15).await).0, Code::UNKNOWN);
    h.fake.fail("kill", "container not running");
    assert_eq!(code_of(h.kill("c2", 15).await).0, Code::NOT_FOUND);
    assert_eq!(h.status("c2").await, Status::RUNNING);
    h.fake.heal("kill");
    h.kill("c2", 15).await.expect("kill");
    assert_eq!(h.calls(&b2), ["kill c2 15", "kill c2 15", "kill c2 15"]);
    assert_eq!(h.wait("c2").await.exit_status, 128 + 15);
    assert_eq!(h.status("c2").await, Status::STOPPED);
    assert_eq!(h.next_topics(1).await, [TASK_EXIT_EVENT_TOPIC]);

    assert_eq!(h.delete("c2").await.expect("delete"), 128 + 15);
    assert_eq!(h.calls(&b2), ["delete --force c2"]);
    assert_eq!(h.topics(), [TASK_DELETE_EVENT_TOPIC]);

    // No containers left: Shutdown lets the shim exit.
    h.svc
        .shutdown(&h.ctx, ShutdownRequest::default())
        .await
        .expect("shutdown");
    tokio::time::timeout(Duration::from_secs(5), h.exit.wait())
        .await
        .expect("shutdown signalled");
}
