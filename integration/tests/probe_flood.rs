//! No tenant can blind the probes for the others (issue 30, item 1). The probes' fd map holds a fixed number
//! of entries for the whole node; a container that dups a device file 70,000 times (its RLIMIT_NOFILE raised)
//! used to fill it: every waiting Start on the node failed, the probes were reloaded, and the containers
//! registered again after the flooder (which sorts first) were dropped for good. Now each container has a
//! quota of the map (`--probe-fd-quota`); past it that container is followed through /proc alone, says so in
//! `baton status` and the metrics, and the others keep their release signal, gate and preemption. Real
//! components: containerd, the Baton shim and agent, the kernel's probes, the FUSE mock driver, the mock CUDA
//! trainer and server; NVML is the fake library, as a GPU node has NVML (the flooder's device files, held
//! with no context, then do not shut the gate: `node_daemons.rs`).
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use std::time::Duration;

use baton_integration::{
    agent::wait_until,
    cuda::{CudaRig, PREEMPTIBLE, SERVER, Trainer, WITHIN},
    fake_nvml::FakeNvml,
    holder::HolderContainer,
    metrics,
};
use serde_json::{Value, json};

/// How many dups the flooder keeps: more than the probes' whole fd map held before quotas (65,536).
const FLOOD: u64 = 70_000;

#[test]
fn a_tenant_that_floods_the_probes_fd_map_is_followed_through_proc_and_the_others_keep_signal_gate_and_preemption()
 {
    let Some(rig) = CudaRig::start("probe-flood") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let nvml = FakeNvml::install(
        dir.path(),
        rig.gpu.mock_dir.path(),
        Duration::from_millis(1),
    )
    .unwrap();
    let log = dir.path().join("agent.log");
    let _agent = nvml
        .start_agent(
            &rig.gpu.env.containerd().agent_socket(),
            &log,
            &["--metrics-addr", "127.0.0.1:0"],
        )
        .unwrap();
    let url = metrics::url_from_log(&log, WITHIN).unwrap();

    // The victim, registered first: a preemptible trainer.
    let mut trainer = rig.run("trainer", &Trainer::with_worker(), &PREEMPTIBLE);
    rig.wait_held("trainer");
    // The flooder, named to sort before it (the order containers are registered again in). ctr gives it an
    // RLIMIT_NOFILE of 1,024 (a pod under the CRI gets containerd's, often 1,048,576): it forks processes
    // that keep 1,000 dups each.
    let mut flood =
        HolderContainer::start(&rig.gpu.env, "aa-flood", rig.gpu.mock_dir.path(), &[]).unwrap();
    let fd = flood.num("open nvidia0").unwrap();
    assert_eq!(
        flood.num(&format!("keep-dups {fd} {FLOOD}")).unwrap(),
        FLOOD
    );

    // The flooder reached its quota and says so; what the probes follow of it stays within the quota.
    assert!(
        wait_until(
            WITHIN,
            || rig.gpu.status("aa-flood")["probe_fds"]["over_quota"] == json!(true)
        ),
        "the flooder is past its quota: {}",
        rig.gpu.status("aa-flood")["probe_fds"]
    );
    let probe_fds = rig.gpu.status("aa-flood")["probe_fds"].clone();
    let (followed, quota) = (
        probe_fds["followed"].as_u64().unwrap(),
        probe_fds["quota"].as_u64().unwrap(),
    );
    assert!(quota > 0 && followed <= quota, "{probe_fds}");
    assert_eq!(
        rig.gpu.status("trainer")["probe_fds"]["over_quota"],
        json!(false)
    );
    let scrape = metrics::scrape(&metrics::client(), &url).unwrap();
    assert_eq!(
        scrape
            .value(
                "baton_container_probe_fds_over_quota",
                &[("container_id", "aa-flood")]
            )
            .unwrap(),
        1.0
    );
    assert!(scrape.sum("baton_probe_fds_over_quota_total", &[]) > 0.0);
    let (out, err, ok) = rig.baton(&["status"]);
    assert!(ok, "baton status: {err}");
    assert!(
        out.lines()
            .any(|l| l.contains("aa-flood") && l.contains("followed through /proc")),
        "baton status names the flooder as followed through /proc:\n{out}"
    );

    // The trainer keeps its preemption, its release signal and the gate: a server behind the gate parks
    // it, and the server's Start returns on its release.
    let mut events = rig.gpu.watch("trainer");
    let _server = rig.create("server", &Trainer::with_worker(), &SERVER);
    let api = rig.gpu.env.api().unwrap();
    api.start("server", "").unwrap();
    let released = events.next_of("trainer", "released", WITHIN).unwrap();
    assert!(
        released["t_released_ns"].as_u64().unwrap() > 0,
        "{released}"
    );
    rig.wait_held("server");
    assert!(
        wait_until(WITHIN, || rig.preemption("trainer")["state"]
            == json!("parked")),
        "the trainer was parked for the server: {}",
        rig.gpu.status("trainer")
    );
    // The server goes: the trainer is resumed with its weights intact.
    api.kill("server", "", 9, true).unwrap();
    api.wait("server", "", WITHIN).unwrap();
    api.delete_task("server").unwrap();
    let line = trainer.wait_line("restored checksum");
    assert!(line.ends_with("intact"), "{line}");
    assert!(
        wait_until(WITHIN, || rig.preemption("trainer") == Value::Null),
        "the trainer runs again: {}",
        rig.gpu.status("trainer")
    );

    // The probes never failed (which dropped the containers registered after the flooder).
    let log = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        !log.contains("reading the probes failed"),
        "the agent reloaded its probes:\n{log}"
    );
    assert!(
        log.contains("container aa-flood has") && log.contains("followed through /proc only"),
        "the agent logged the flooder's quota:\n{log}"
    );
    flood.finish().unwrap();
}
