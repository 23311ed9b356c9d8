//! Behaviour the Go runc shim has and the service must match, against the fake runc: the order
//! of exit events (execs' TaskExit, then the init's, then TaskDelete), an init that dies inside
//! `runc create`, `runc kill --all` for containers without a pid namespace of their own, exec
//! processes that never started, an exec start that must not block the task, the id reservation
//! on Create, and Shutdown draining the event queue to containerd.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use async_trait::async_trait;
use containerd_shim::{
    ExitSignal, TtrpcContext, TtrpcResult,
    api::{DeleteRequest, ExecProcessRequest, KillRequest, ShutdownRequest, StartRequest},
    protos::shim_async::Task,
};
use containerd_shim_protos::{
    api::Status,
    events::task::{TaskDelete, TaskExit},
    protobuf::{Message, well_known_types::any::Any, well_known_types::empty::Empty},
    shim::events::ForwardRequest,
    shim_async::create_events,
    topics::{
        TASK_CREATE_EVENT_TOPIC, TASK_DELETE_EVENT_TOPIC, TASK_EXIT_EVENT_TOPIC,
        TASK_OOM_EVENT_TOPIC,
    },
    ttrpc::{
        Code,
        r#async::{Server, transport::Listener},
    },
};

use super::{
    TaskService,
    lifecycle_tests::{Harness, NS, code_of},
};
use crate::{events::Events, fake_runc::exclusive};

/// How long a call may take before the test calls it blocked.
const BLOCKED: Duration = Duration::from_secs(10);

fn exec_spec(terminal: bool) -> Any {
    let spec = serde_json::json!({
        "args": ["sleep", "1000"], "cwd": "/", "terminal": terminal,
        "user": {"uid": 0, "gid": 0},
    });
    Any {
        type_url: "types.containerd.io/opencontainers/runtime-spec/1/Process".into(),
        value: serde_json::to_vec(&spec).expect("spec"),
        ..Default::default()
    }
}

impl Harness {
    async fn exec(&self, id: &str, exec_id: &str) -> TtrpcResult<()> {
        let req = ExecProcessRequest {
            id: id.into(),
            exec_id: exec_id.into(),
            spec: Some(exec_spec(false)).into(),
            ..Default::default()
        };
        self.svc.exec(&self.ctx, req).await.map(drop)
    }

    async fn start_exec(&self, id: &str, exec_id: &str) -> TtrpcResult<u32> {
        start_exec(&self.svc, id, exec_id).await
    }

    async fn kill_exec(&self, id: &str, exec_id: &str, signal: u32) -> TtrpcResult<()> {
        let req = KillRequest {
            id: id.into(),
            exec_id: exec_id.into(),
            signal,
            ..Default::default()
        };
        self.svc.kill(&self.ctx, req).await.map(drop)
    }

    async fn delete_exec(&self, id: &str, exec_id: &str) -> TtrpcResult<()> {
        let req = DeleteRequest {
            id: id.into(),
            exec_id: exec_id.into(),
            ..Default::default()
        };
        self.svc.delete(&self.ctx, req).await.map(drop)
    }

    /// The next `n` events in the order they were queued, as "create c1", "exit e1" (TaskExit's
    /// id: the exec id, or the container id for the init), "delete c1", or the bare topic.
    async fn ordered(&mut self, n: usize) -> Vec<String> {
        let mut out = Vec::new();
        for _ in 0..n {
            let env = tokio::time::timeout(BLOCKED, self.events.recv())
                .await
                .expect("event published")
                .expect("event queue open");
            let value = &env.event.value;
            out.push(match env.topic.as_str() {
                TASK_EXIT_EVENT_TOPIC => {
                    format!(
                        "exit {}",
                        TaskExit::parse_from_bytes(value).expect("exit").id
                    )
                }
                TASK_DELETE_EVENT_TOPIC => format!(
                    "delete {}",
                    TaskDelete::parse_from_bytes(value)
                        .expect("delete")
                        .container_id
                ),
                TASK_CREATE_EVENT_TOPIC => "create".to_string(),
                other => other.to_string(),
            });
        }
        out
    }

    /// A created and started container `id` in `bundle`, its events and calls consumed.
    async fn running(&mut self, id: &str, bundle: &std::path::Path) {
        self.create(id, bundle, "").await.expect("create");
        self.start(id).await.expect("start");
        self.calls(bundle);
        self.topics();
    }
}

async fn start_exec(svc: &TaskService, id: &str, exec_id: &str) -> TtrpcResult<u32> {
    let req = StartRequest {
        id: id.into(),
        exec_id: exec_id.into(),
        ..Default::default()
    };
    svc.start(&TtrpcContext::default(), req)
        .await
        .map(|r| r.pid)
}

/// An init that dies before `runc create` returns still gets its TaskExit (after TaskCreate),
/// its Wait returns, and Start is refused.
#[tokio::test]
async fn an_init_that_dies_during_create_gets_its_task_exit() {
    let _guard = exclusive().await;
    let mut h = Harness::new();
    let b = h.fake.bundle("d1");
    h.fake.init_dies_during("create");
    h.create("d1", &b, "").await.expect("create");
    assert_eq!(h.ordered(2).await, ["create", "exit d1"]);
    assert_eq!(h.wait("d1").await.exit_status, 3);
    assert_eq!(h.status("d1").await, Status::STOPPED);
    assert_eq!(code_of(h.start("d1").await).0, Code::FAILED_PRECONDITION);
    assert_eq!(h.delete("d1").await.expect("delete"), 3);
    assert_eq!(h.ordered(1).await, ["delete d1"]);
}

/// The init's TaskExit waits for the running exec's, not for one that never started, and its
/// Wait returns only once TaskExit is queued: a Delete right after Wait comes after it.
#[tokio::test]
async fn exec_exits_then_init_exit_then_delete() {
    let _guard = exclusive().await;
    let mut h = Harness::new();
    let b = h.fake.bundle("o1");
    h.running("o1", &b).await;
    h.exec("o1", "e1").await.expect("exec e1");
    h.start_exec("o1", "e1").await.expect("start e1");
    h.exec("o1", "never").await.expect("exec never");
    h.topics();

    h.kill("o1", 9).await.expect("kill init");
    h.kill_exec("o1", "e1", 9).await.expect("kill e1");
    assert_eq!(h.wait("o1").await.exit_status, 128 + 9);
    assert_eq!(h.delete("o1").await.expect("delete"), 128 + 9);
    assert_eq!(
        h.ordered(3).await,
        ["exit e1", "exit o1", "delete o1"],
        "the Go shim's order"
    );
}

/// A container without a pid namespace of its own: when its init exits, the shim runs
/// `runc kill --all` before the init's TaskExit, so its other processes die first.
#[tokio::test]
async fn host_pid_namespace_init_exit_kills_every_process_first() {
    let _guard = exclusive().await;
    let mut h = Harness::new();
    let b = h.fake.bundle_in_host_pid_namespace("p1");
    h.running("p1", &b).await;
    h.exec("p1", "e1").await.expect("exec");
    h.start_exec("p1", "e1").await.expect("start exec");
    h.calls(&b);
    h.topics();

    h.kill("p1", 9).await.expect("kill init");
    assert_eq!(h.ordered(2).await, ["exit e1", "exit p1"]);
    assert_eq!(h.calls(&b), ["kill p1 9", "kill --all p1 9"]);

    // With a pid namespace of its own, the kernel does that: no kill --all.
    let b2 = h.fake.bundle("p2");
    h.running("p2", &b2).await;
    h.kill("p2", 9).await.expect("kill init");
    assert_eq!(h.ordered(1).await, ["exit p2"]);
    assert_eq!(h.calls(&b2), ["kill p2 9"]);
}

/// Killing an exec that was created but never started (or whose start failed, as with a missing
/// binary through CRI, which then kills and deletes it) is refused without signalling anything;
/// the exec can then be deleted and the container goes on.
#[tokio::test]
async fn kill_of_an_exec_that_never_started_signals_nothing() {
    let _guard = exclusive().await;
    let mut h = Harness::new();
    let b = h.fake.bundle("k1");
    h.running("k1", &b).await;
    h.exec("k1", "idle").await.expect("exec");
    // Signal 0: should the shim signal pid 0 (its own process group), nothing dies.
    let (code, msg) = code_of(h.kill_exec("k1", "idle", 0).await);
    assert_eq!(code, Code::FAILED_PRECONDITION, "{msg}");
    h.delete_exec("k1", "idle").await.expect("delete exec");

    h.exec("k1", "missing").await.expect("exec");
    h.fake.fail(
        "exec",
        "exec: \"nosuch\": executable file not found in $PATH",
    );
    assert_eq!(
        code_of(h.start_exec("k1", "missing").await).0,
        Code::UNKNOWN
    );
    let (code, msg) = code_of(h.kill_exec("k1", "missing", 0).await);
    assert_eq!(code, Code::FAILED_PRECONDITION, "{msg}");
    h.delete_exec("k1", "missing").await.expect("delete exec");
    h.fake.heal("exec");
    assert_eq!(h.status("k1").await, Status::RUNNING);
}

/// While `runc exec` is slow, State and Kill of the task still answer.
#[tokio::test]
async fn a_slow_exec_start_does_not_block_state_or_kill() {
    let _guard = exclusive().await;
    let mut h = Harness::new();
    let b = h.fake.bundle("s1");
    h.running("s1", &b).await;
    h.exec("s1", "slow").await.expect("exec");
    h.fake.block("exec");
    let svc = h.svc.clone();
    let start = tokio::spawn(async move { start_exec(&svc, "s1", "slow").await });
    h.fake.wait_blocked("exec").await;

    let state = tokio::time::timeout(BLOCKED, h.status("s1")).await;
    let kill = tokio::time::timeout(BLOCKED, h.kill("s1", 0)).await;
    h.fake.unblock("exec");
    assert_eq!(
        state.expect("State answered during runc exec"),
        Status::RUNNING
    );
    kill.expect("Kill answered during runc exec")
        .expect("kill 0");
    start.await.expect("join").expect("exec started");
}

/// Two Creates of one id at once: the second is refused while the first runs, and only one
/// `runc create` happens.
#[tokio::test]
async fn concurrent_creates_of_one_id_run_runc_once() {
    let _guard = exclusive().await;
    let h = Harness::new();
    let b = h.fake.bundle("r1");
    h.fake.block("create");
    let first = {
        let svc = h.svc.clone();
        let req = containerd_shim::api::CreateTaskRequest {
            id: "r1".into(),
            bundle: b.display().to_string(),
            options: Some(h.fake.options()).into(),
            ..Default::default()
        };
        tokio::spawn(async move { svc.create(&TtrpcContext::default(), req).await })
    };
    h.fake.wait_blocked("create").await;
    let second = tokio::time::timeout(BLOCKED, h.create("r1", &b, "")).await;
    h.fake.unblock("create");
    let (code, _) = code_of(second.expect("the second Create answered at once"));
    assert_eq!(code, Code::ALREADY_EXISTS);
    first.await.expect("join").expect("first create");
    let creates: Vec<_> = h
        .calls(&b)
        .into_iter()
        .filter(|c| c.starts_with("create "))
        .collect();
    assert_eq!(creates.len(), 1, "{creates:?}");
}

/// containerd's event service, slow to answer, recording what it got.
struct SlowContainerd {
    topics: Arc<Mutex<Vec<String>>>,
}

#[async_trait]
impl containerd_shim_protos::shim_async::Events for SlowContainerd {
    async fn forward(&self, _: &TtrpcContext, req: ForwardRequest) -> TtrpcResult<Empty> {
        tokio::time::sleep(Duration::from_millis(30)).await;
        self.topics
            .lock()
            .expect("topics")
            .push(req.envelope.topic.clone());
        Ok(Empty::new())
    }
}

/// Shutdown lets the queued events reach containerd before the shim exits.
#[tokio::test]
async fn shutdown_drains_queued_events() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("events.sock");
    let topics = Arc::new(Mutex::new(Vec::new()));
    let listener = std::os::unix::net::UnixListener::bind(&path).expect("bind");
    let mut server = Server::new()
        .add_listener(Listener::try_from(listener).expect("listener"))
        .register_service(create_events(Arc::new(SlowContainerd {
            topics: topics.clone(),
        })));
    server.start().await.expect("start events server");

    let events = Events::new(&path.display().to_string(), NS);
    let exit = Arc::new(ExitSignal::default());
    let svc = TaskService::new(NS, events.clone(), exit.clone());
    for _ in 0..10 {
        events.oom("gone").await;
    }
    svc.shutdown(&TtrpcContext::default(), ShutdownRequest::default())
        .await
        .expect("shutdown");
    tokio::time::timeout(BLOCKED, exit.wait())
        .await
        .expect("exit signalled");
    let seen = topics.lock().expect("topics").clone();
    assert_eq!(seen, vec![TASK_OOM_EVENT_TOPIC.to_string(); 10]);
    let _ = server.shutdown().await;
}

/// A container restored on Start gets its OOM watch then (its init has no pid before).
#[tokio::test]
async fn a_restored_container_is_watched_for_oom_kills() {
    let _guard = exclusive().await;
    let h = Harness::new();
    let b = h.fake.bundle("w1");
    h.create("w1", &b, "/img/w1")
        .await
        .expect("create from checkpoint");
    let c = h.svc.shared.containers.get("w1").expect("container");
    assert!(c.oom.get().is_none(), "no pid, no memory cgroup yet");
    h.start("w1").await.expect("restore");
    assert!(
        c.oom.get().is_some(),
        "the restored init's memory cgroup is not watched"
    );
}
