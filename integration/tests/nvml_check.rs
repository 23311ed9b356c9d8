//! The first event is never late: `released` goes out on the confirmation, and NVML's cross-check follows
//! in an `nvml_check` event of its own. Real components: containerd, the Baton shim, the agent with its
//! probes, the FUSE mock driver, a holder container; NVML is the fake library (integration/fake-nvml),
//! answering from the mock's state, 5 ms per call. The test holds NVML's answers while a release happens:
//! `released` reaches the watcher (and containerd) while NVML has not answered, then the check follows with
//! NVML's view of the released pids.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use std::time::Duration;

use baton_integration::{
    agent::{AgentWatch, CtrEvents},
    fake_nvml::FakeNvml,
    holder::{GpuRig, HolderContainer},
};
use serde_json::{Value, json};

const WITHIN: Duration = Duration::from_secs(30);

/// How long each call of the fake NVML takes.
const NVML_CALL: Duration = Duration::from_millis(5);

/// CLOCK_MONOTONIC now, ns (the clock of the agent's times).
fn now_ns() -> u64 {
    let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).unwrap();
    u64::try_from(t.tv_sec()).unwrap() * 1_000_000_000 + u64::try_from(t.tv_nsec()).unwrap()
}

/// The next event of kind `kind` for `id`, and when it arrived here.
fn next_of(w: &mut AgentWatch, id: &str, kind: &str) -> (Value, u64) {
    let e = w.next_of(id, kind, WITHIN).unwrap();
    (e, now_ns())
}

/// The holder opens nvidiactl and allocates a client (the GPU is acquired), then closes it: the event
/// `released` and when it arrived here.
fn acquire_and_release(h: &mut HolderContainer, w: &mut AgentWatch, id: &str) -> (Value, u64) {
    let fd = h.num("open nvidiactl").unwrap();
    let alloc = h.cmd(&format!("alloc {fd}")).unwrap();
    assert_eq!(alloc[1], "0", "the root client was allocated: {alloc:?}");
    next_of(w, id, "acquired");
    h.num(&format!("close {fd}")).unwrap();
    next_of(w, id, "released")
}

/// Checks that `check` is the cross-check of `released`, asked after that event went out, and that NVML
/// took at least `calls` calls of [`NVML_CALL`].
fn expect_check_of(check: &Value, released: &Value, calls: u64) {
    assert_eq!(check["released_seq"], released["seq"], "{check}");
    assert_eq!(check["t_released_ns"], released["t_released_ns"], "{check}");
    assert_eq!(check["pids"], released["pids"], "{check}");
    let asked = check["t_asked_ns"].as_u64().unwrap();
    assert!(
        asked >= released["t_ns"].as_u64().unwrap(),
        "NVML was asked after the release went out: {check} {released}"
    );
    let slowest = u64::try_from(NVML_CALL.as_nanos()).unwrap() * calls;
    assert!(
        check["took_ns"].as_u64().unwrap() >= slowest,
        "the fake NVML's {calls} calls of {NVML_CALL:?} each: {check}"
    );
}

/// Prints when `released` and its check arrived, from the release's confirmation.
fn print_figures(what: &str, released: &Value, arrived: u64, check: &Value, check_arrived: u64) {
    let confirmed = released["t_released_ns"].as_u64().unwrap();
    let ms = |ns: u64| ns.saturating_sub(confirmed) as f64 / 1e6;
    println!(
        "nvml_check ({what}): released published {:.3} ms and at the watcher {:.3} ms after the \
         confirmation; nvml_check at the watcher {:.3} ms after it (NVML asked at {:.3} ms, took {:.3} ms)",
        ms(released["t_ns"].as_u64().unwrap()),
        ms(arrived),
        ms(check_arrived),
        ms(check["t_asked_ns"].as_u64().unwrap()),
        check["took_ns"].as_u64().unwrap() as f64 / 1e6,
    );
}

/// Prints the agent's log when the test fails.
struct LogOnPanic(std::path::PathBuf);

impl Drop for LogOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let log = std::fs::read_to_string(&self.0).unwrap_or_default();
            eprintln!("agent log ({}):\n{log}", self.0.display());
        }
    }
}

#[test]
fn released_goes_out_without_waiting_for_nvml_and_the_nvml_check_follows() {
    let Some(rig) = GpuRig::start("nvml-check") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let nvml = FakeNvml::install(dir.path(), rig.mock_dir.path(), NVML_CALL).unwrap();
    // The node's agent, started before any container (the shims find it on the socket), with the fake
    // NVML; its time bound is far above what the test waits, so that a held query never times out.
    let log = dir.path().join("agent.log");
    let _agent = nvml
        .start_agent(
            &rig.env.containerd().agent_socket(),
            &log,
            &["--nvml-timeout-ms", "60000"],
        )
        .unwrap();
    let _log = LogOnPanic(log);
    let ctr = CtrEvents::start(rig.env.containerd()).unwrap();
    let id = "firstevent";
    let mut h = rig.holder(id);
    let mut w = rig.watch(id);

    // NVML answers nothing until told: the release reaches the watcher and containerd all the same, without
    // NVML's view, and no check has come.
    nvml.hold().unwrap();
    let (released, arrived) = acquire_and_release(&mut h, &mut w, id);
    assert!(released.get("nvml").is_none(), "{released}");
    let early: Vec<Value> = w
        .drain_for(Duration::ZERO)
        .into_iter()
        .filter(|e| e["kind"] == "nvml_check")
        .collect();
    assert!(early.is_empty(), "NVML answered while held: {early:?}");
    let acquired_line = ctr.wait_for("/baton/gpu/acquired", id, WITHIN).unwrap();
    let released_line = ctr.wait_for("/baton/gpu/released", id, WITHIN).unwrap();
    assert!(!released_line.contains("\"nvml\""), "{released_line}");

    // NVML answers: the check follows, with its view of the released pids (none listed: the mock freed the
    // holder's client) and of the device (nothing used, as on the H200 after a release:
    // /work/shared/gpu/580.159.04/report.json, trace.released.nvml).
    nvml.answer().unwrap();
    let (check, check_arrived) = next_of(&mut w, id, "nvml_check");
    expect_check_of(&check, &released, 5);
    assert_eq!(
        check["nvml"],
        json!({"processes": [], "devices": [{"device": 0, "minor": 0, "used_bytes": 0}]}),
        "{check}"
    );
    print_figures("NVML held", &released, arrived, &check, check_arrived);
    let line = ctr.wait_for("/baton/gpu/nvml_check", id, WITHIN).unwrap();
    let seq = format!("{}", released["seq"]);
    assert!(
        line.contains(&format!(
            r#""released_seq":{{"Kind":{{"string_value":"{seq}"}}}}"#
        )),
        "{line}"
    );
    assert!(
        line.contains(r#""processes":{"Kind":{"list_value":{}}}"#),
        "{line}"
    );
    println!("ctr events:\n{acquired_line}\n{released_line}\n{line}");

    // A slow NVML (5 ms a call) that answers at once: the release comes first, then its check.
    let (released, arrived) = acquire_and_release(&mut h, &mut w, id);
    let (check, check_arrived) = next_of(&mut w, id, "nvml_check");
    expect_check_of(&check, &released, 5);
    assert!(check["nvml"]["devices"].is_array(), "{check}");
    print_figures(
        "NVML at 5 ms a call",
        &released,
        arrived,
        &check,
        check_arrived,
    );
    h.finish().unwrap();
}
