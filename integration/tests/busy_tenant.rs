//! The agent keeps its word on a node with a tenant whose /proc is costly to read (issue 30, item 2): a
//! container that holds the GPU and has a million mappings (50 MB of /proc maps, most of a second to read
//! here) is checked against /proc every second. That read runs on the agent's blocking pool and the
//! co-runner controller on a thread of its own, so a co-runner frozen under a short lease stays frozen: its
//! renewals never wait behind the read. When the read ran on the agent's one thread, each check stalled the
//! renewals past the lease and the shim thawed the co-runner.
//!
//! Runs through containerd, runc, the Baton shim, the agent, the probes and the FUSE mock driver.
use std::time::Duration;

use baton_integration::{
    agent::{AgentConn, AgentProcess, container_status, wait_until},
    env::TestEnv,
    holder::HolderContainer,
    procs::{cgroup_frozen, freezer_file},
    skip,
    trace_env::missing_trace_prerequisite,
};
use baton_mock_nvidia::driver::{MockDriver, MountOptions};
use serde_json::{Value, json};

/// Long enough for a loaded CI machine.
const WITHIN: Duration = Duration::from_secs(60);
/// The tenant's mappings.
const MAPPINGS: u64 = 1_000_000;
/// The co-runner's freeze lease (ms): renewed every 100 ms, it lapses when a renewal is 200 ms late.
const LEASE_MS: u64 = 300;
/// How many of the tenant's checks the co-runner must stay frozen through.
const CHECKS: usize = 3;
/// A container that takes no CPU.
const SLEEP: &[&str] = &["/bin/sleep", "600"];

/// Raises `vm.max_map_count` to at least a value for the test's life, and puts it back after.
struct MaxMapCount(Option<String>);

impl MaxMapCount {
    const FILE: &str = "/proc/sys/vm/max_map_count";

    fn at_least(n: u64) -> Self {
        let old = std::fs::read_to_string(Self::FILE).expect("reading vm.max_map_count");
        if old.trim().parse::<u64>().is_ok_and(|v| v >= n) {
            return Self(None);
        }
        std::fs::write(Self::FILE, n.to_string())
            .unwrap_or_else(|e| panic!("raising vm.max_map_count to {n} (root is needed): {e}"));
        Self(Some(old))
    }
}

impl Drop for MaxMapCount {
    fn drop(&mut self) {
        if let Some(old) = &self.0 {
            let _ = std::fs::write(Self::FILE, old.trim());
        }
    }
}

/// The tenant's last check against /proc in the agent's status (`proc_check`), if any.
fn last_check(socket: &std::path::Path) -> Option<Value> {
    container_status(socket, "tenant")
        .ok()
        .flatten()
        .map(|s| s["proc_check"].clone())
        .filter(|c| !c.is_null())
}

#[test]
fn a_co_runners_lease_holds_while_a_tenant_with_a_million_mappings_is_checked() {
    if let Some(reason) = missing_trace_prerequisite() {
        skip::missing(&reason);
        return;
    }
    let Some(env) = TestEnv::start("busy-tenant") else {
        return;
    };
    if !env.is_baton() {
        skip::not_applicable("the agent and its co-runner controller are Baton's");
        return;
    }
    let _max_maps = MaxMapCount::at_least(MAPPINGS + 65_536);
    let socket = env.containerd().agent_socket();
    std::fs::create_dir_all(socket.parent().unwrap()).unwrap();
    let lease = LEASE_MS.to_string();
    let _agent = AgentProcess::start_with(
        &socket,
        &env.scratch().join("agent.log"),
        &["--freeze-lease-ms", &lease, "--max-frozen-ms", "600000"],
    )
    .unwrap();
    let mock_dir = tempfile::tempdir().unwrap();
    let _mock = MockDriver::mount(MountOptions::new(mock_dir.path())).unwrap();

    // The tenant holds the GPU (a client with video memory), so the agent checks it every second.
    let mut tenant = HolderContainer::start(&env, "tenant", mock_dir.path(), &[]).unwrap();
    let fd = tenant.num("open nvidiactl").unwrap();
    tenant.cmd(&format!("alloc {fd}")).unwrap();
    let lines = tenant.num(&format!("anon-maps {MAPPINGS}")).unwrap();
    assert!(lines >= MAPPINGS, "the tenant's maps has {lines} lines");
    assert!(
        wait_until(WITHIN, || container_status(&socket, "tenant")
            .ok()
            .flatten()
            .is_some_and(|s| s["gpu"] == json!("held"))),
        "the tenant holds the GPU: {:?}",
        container_status(&socket, "tenant")
    );

    // A co-runner, frozen by the agent under the short lease.
    env.run_detached("co", &[("baton.io/role", "co-runner")], SLEEP)
        .unwrap();
    let co = container_status_wait(&socket, "co")["init_pid"]
        .as_u64()
        .unwrap() as u32;
    let mut conn = AgentConn::connect(&socket).unwrap();
    let r = conn.call(json!({"op": "freeze", "id": "co"})).unwrap();
    assert_eq!(r["frozen"], json!(true), "{r}");
    assert!(cgroup_frozen(co), "{}", freezer_file(co).display());

    // Through the next checks of the tenant (each a read of its million mappings), the co-runner never
    // thaws: the renewals are not behind the reads.
    let mut seen: Vec<Value> = Vec::new();
    let done = wait_until(WITHIN, || {
        assert!(
            cgroup_frozen(co),
            "the co-runner thawed while the tenant was being checked: its lease of {LEASE_MS} ms lapsed \
             (checks seen so far: {seen:?})"
        );
        if let Some(check) = last_check(&socket)
            && seen.last() != Some(&check)
        {
            seen.push(check);
        }
        seen.len() > CHECKS
    });
    assert!(
        done,
        "the agent checked the tenant {} time(s) within {WITHIN:?}: {seen:?}",
        seen.len()
    );
    // The checks read the tenant's processes: the co-runner was frozen through reads of its mappings.
    let took: Vec<u64> = seen.iter().filter_map(|c| c["took_us"].as_u64()).collect();
    assert!(took.iter().all(|t| *t > 0), "{seen:?}");
    eprintln!("the tenant's checks took {took:?} µs each, under a lease of {LEASE_MS} ms");
    let r = conn.call(json!({"op": "thaw", "id": "co"})).unwrap();
    assert_eq!(r["frozen"], json!(false), "{r}");
    tenant.finish().unwrap();
}

/// Container `id`'s status once the agent watches it.
fn container_status_wait(socket: &std::path::Path, id: &str) -> Value {
    let mut status = None;
    assert!(
        wait_until(WITHIN, || {
            status = container_status(socket, id).ok().flatten();
            status.is_some()
        }),
        "the agent watches {id}"
    );
    status.expect("the status of a watched container")
}
