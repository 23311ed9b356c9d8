//! Container-level tests against the fake runc.

use std::io::Write as _;

use super::*;
use crate::fake_runc::{FakeRunc, exclusive};

fn runc_options(fake: &FakeRunc) -> RuncOptions {
    let mut o = RuncOptions::new();
    o.binary_name = fake.binary.display().to_string();
    o.root = fake.dir().join("root").display().to_string();
    o
}

/// A container created from a checkpoint (non-TTY, with stdin): Start restores it, and the
/// restored process reads what containerd writes into the request's stdin fifo, until
/// CloseIO ends its input.
#[tokio::test]
async fn restore_hands_the_request_stdin_to_the_restored_process() {
    let _guard = exclusive().await;
    let fake = FakeRunc::new();
    let stdin = fake.fifo("r1-stdin");
    let req = CreateTaskRequest {
        id: "r1".into(),
        bundle: fake.bundle("r1").display().to_string(),
        stdin: stdin.display().to_string(),
        checkpoint: "/ckpt/r1".into(),
        ..Default::default()
    };
    let c = Container::create(&req, "test", runc_options(&fake), BatonSettings::default())
        .await
        .unwrap();
    let global = c.global.args();
    assert!(
        fake.take_calls(&global).is_empty(),
        "restore waits for Start"
    );
    assert_eq!(c.procs.lock().await.init.state, State::CreatedCheckpoint);

    let exits = ExitSubscription::new();
    let (pid, early) = c.start_init(&exits).await.unwrap();
    assert!(early.is_none(), "the restored process is alive");
    assert_eq!(Some(pid as i32), fake.pid_of("r1"));
    let calls = fake.take_calls(&global);
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert!(
        calls[0].starts_with(&format!(
            "{}restore --image-path /ckpt/r1 --detach",
            FakeRunc::criu_prefix()
        )),
        "{calls:?}"
    );
    assert!(
        fake.stdin_of("r1", "restore").starts_with("pipe:"),
        "runc restore got stdin {:?}, not the stdin pipe",
        fake.stdin_of("r1", "restore")
    );

    let mut containerd = std::fs::OpenOptions::new()
        .write(true)
        .open(&stdin)
        .unwrap();
    containerd.write_all(b"hello\n").unwrap();
    assert_eq!(fake.wait_for_input("r1", "hello\n").await, "hello\n");
    assert!(!fake.input_ended("r1"), "no EOF before CloseIO");

    drop(containerd);
    {
        let procs = c.procs.lock().await;
        procs.init.io.close_input();
        procs.init.stdin.close_soon();
    }
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
    while !fake.input_ended("r1") && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    assert!(
        fake.input_ended("r1"),
        "CloseIO ends the restored process's stdin"
    );
}

/// The exec request's `terminal` decides whether runc allocates a TTY, whatever the process
/// spec says (runc refuses a console socket for a spec without a terminal).
#[tokio::test]
async fn the_exec_request_decides_the_terminal() {
    let _guard = exclusive().await;
    let fake = FakeRunc::new();
    let req = CreateTaskRequest {
        id: "t1".into(),
        bundle: fake.bundle("t1").display().to_string(),
        ..Default::default()
    };
    let c = Container::create(&req, "test", runc_options(&fake), BatonSettings::default())
        .await
        .unwrap();
    for (exec_id, asked, in_spec) in [("tty", true, false), ("pipes", false, true)] {
        let spec = serde_json::json!({"args": ["sh"], "cwd": "/", "terminal": in_spec,
            "user": {"uid": 0, "gid": 0}});
        let any = Any {
            value: serde_json::to_vec(&spec).unwrap(),
            ..Default::default()
        };
        let stdio = StdioSpec {
            terminal: asked,
            ..Default::default()
        };
        c.add_exec(exec_id, stdio, &any).await.unwrap();
        let procs = c.procs.lock().await;
        let spec = procs.execs[exec_id].exec_spec.as_ref().unwrap();
        assert_eq!(spec.terminal(), Some(asked), "{exec_id}");
    }
    c.delete("").await.unwrap();
}
