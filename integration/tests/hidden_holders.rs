//! Holders the probes cannot see, end to end (real containerd, runc, the Baton shim and agent, the FUSE mock
//! driver, the kernel): a file passed over a unix socket with SCM_RIGHTS, a file taken with pidfd_getfd, an fd
//! table shared with clone(CLONE_FILES), a file registered in io_uring, a mapping kept after its fd was
//! closed, and a container Baton does not watch; and one that is not hidden: a dup of an fd number reused
//! for another device while the agent was behind. Each keeps the container
//! "held" (no `released` event) or the GPU-free gate shut until the hidden holder lets go; then the release
//! comes, or the gate opens. The agent reads /proc before it publishes a release or opens a gate.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use std::time::Duration;

use baton_integration::{
    agent::{AgentWatch, container_status, wait_until},
    holder::{GpuRig as Rig, HolderContainer},
};
use serde_json::{Value, json};

const WITHIN: Duration = Duration::from_secs(30);

fn expect_transition(w: &mut AgentWatch, id: &str, kind: &str) -> Value {
    let e = w.next_transition(id, WITHIN).unwrap();
    assert_eq!(e["kind"], json!(kind), "{e}");
    e
}

/// The pids of the container's processes that the agent shows holding NVIDIA fds.
fn fd_holders(rig: &Rig, id: &str) -> Vec<u64> {
    rig.status(id)["processes"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["fds"].as_u64().unwrap_or(0) > 0)
        .map(|p| p["pid"].as_u64().unwrap())
        .collect()
}

/// Waits until the agent follows a holder of container `id` other than `not` (the hidden one it adopted
/// from /proc), then checks that the container is still held and no release was published.
fn expect_still_held_by_another(rig: &Rig, w: &mut AgentWatch, id: &str, not: u64) {
    assert!(
        wait_until(WITHIN, || fd_holders(rig, id).iter().any(|p| *p != not)),
        "the agent follows the hidden holder: {}",
        rig.status(id)
    );
    assert_eq!(rig.status(id)["gpu"], json!("held"), "{}", rig.status(id));
    assert_no_release(w, Duration::ZERO, "released while a holder remains");
}

/// No `released` event arrives on `w` within `within` (`why`: what still holds, for the failure message).
fn assert_no_release(w: &mut AgentWatch, within: Duration, why: &str) {
    let early: Vec<Value> = w
        .drain_for(within)
        .into_iter()
        .filter(|e| e["kind"] == json!("released"))
        .collect();
    assert!(early.is_empty(), "{why}: {early:?}");
}

/// The release that follows the hidden holder's last close, made between `before` and `returned_at`.
fn expect_release_after(w: &mut AgentWatch, id: &str, before: u64, returned_at: u64) {
    let e = expect_transition(w, id, "released");
    let last = e["t_last_close_ns"].as_u64().unwrap();
    assert!(
        last >= before && last <= returned_at,
        "the release is the hidden holder's close ({before}..{returned_at}): {e}"
    );
}

#[test]
fn a_file_passed_over_scm_rights_keeps_the_container_held_until_the_receiver_closes_it() {
    let Some(rig) = Rig::start("hidden-scm") else {
        return;
    };
    let mut h = rig.holder("scm");
    let mut w = rig.watch("scm");
    // The receiver is forked before the open: it never inherits the file, it is sent it.
    let child = h.num("fork-receiver").unwrap();
    let fd = h.num("open nvidiactl").unwrap();
    h.cmd(&format!("alloc {fd}")).unwrap();
    expect_transition(&mut w, "scm", "acquired");
    let opener = fd_holders(&rig, "scm");
    assert_eq!(opener.len(), 1, "{}", rig.status("scm"));
    h.cmd(&format!("send-fd {child} {fd}")).unwrap();
    h.num(&format!("close {fd}")).unwrap();
    expect_still_held_by_another(&rig, &mut w, "scm", opener[0]);
    // The receiver's calls are followed from then on: its close is the release.
    let before = h.num("stamp").unwrap();
    let t = h.num(&format!("child-close {child}")).unwrap();
    expect_release_after(&mut w, "scm", before, t);
}

#[test]
fn a_file_taken_with_pidfd_getfd_keeps_the_container_held_until_the_taker_closes_it() {
    let Some(rig) = Rig::start("hidden-pidfd") else {
        return;
    };
    let mut h = rig.holder("pidfd");
    let mut w = rig.watch("pidfd");
    let child = h.num("fork-receiver").unwrap();
    let cfd = h
        .num(&format!("child-open-state {child} nvidiactl"))
        .unwrap();
    expect_transition(&mut w, "pidfd", "acquired");
    let opener = fd_holders(&rig, "pidfd");
    assert_eq!(opener.len(), 1, "{}", rig.status("pidfd"));
    let mine = h.num(&format!("grab-fd {child} {cfd}")).unwrap();
    h.num(&format!("child-close {child}")).unwrap();
    expect_still_held_by_another(&rig, &mut w, "pidfd", opener[0]);
    let before = h.num("stamp").unwrap();
    let t = h.num(&format!("close {mine}")).unwrap();
    expect_release_after(&mut w, "pidfd", before, t);
}

#[test]
fn a_file_table_shared_with_clone_files_keeps_the_container_held_after_the_opener_exits() {
    let Some(rig) = Rig::start("hidden-clone-files") else {
        return;
    };
    let mut h = rig.holder("sharer");
    let mut w = rig.watch("sharer");
    // A child that shares the holder's fd table: what it opens, the holder has too, unseen by the probes.
    let child = h.num("clone-files").unwrap();
    let fd = h
        .num(&format!("child-open-state {child} nvidiactl"))
        .unwrap();
    expect_transition(&mut w, "sharer", "acquired");
    let opener = fd_holders(&rig, "sharer");
    assert_eq!(opener.len(), 1, "{}", rig.status("sharer"));
    // The opener exits; the table, and the file, live on in the holder.
    h.num(&format!("child-exit-now {child}")).unwrap();
    expect_still_held_by_another(&rig, &mut w, "sharer", opener[0]);
    let before = h.num("stamp").unwrap();
    let t = h.num(&format!("close {fd}")).unwrap();
    expect_release_after(&mut w, "sharer", before, t);
}

#[test]
fn a_file_registered_in_io_uring_keeps_the_container_held_until_the_ring_goes() {
    let Some(rig) = Rig::start("hidden-ring") else {
        return;
    };
    let mut h = rig.holder("ring");
    let mut w = rig.watch("ring");
    let fd = h.num("open nvidiactl").unwrap();
    h.cmd(&format!("alloc {fd}")).unwrap();
    expect_transition(&mut w, "ring", "acquired");
    let ring = h.num(&format!("ring-file {fd}")).unwrap();
    h.num(&format!("close {fd}")).unwrap();
    // The close is applied (no fd left in the mirror) and still no release: the ring holds the file.
    assert!(wait_until(WITHIN, || rig.status("ring")["nvidia_fds"] == json!(0)));
    assert_no_release(
        &mut w,
        Duration::from_millis(300),
        "released while io_uring holds the file",
    );
    assert_eq!(rig.status("ring")["gpu"], json!("held"));
    h.num(&format!("close {ring}")).unwrap();
    expect_transition(&mut w, "ring", "released");
}

/// Starts holder container `id` behind the gate.
fn start_behind_gate(rig: &Rig, id: &str) -> anyhow::Result<HolderContainer> {
    HolderContainer::start(
        &rig.env,
        id,
        rig.mock_dir.path(),
        &[("baton.io/wait-gpu-free", "1m")],
    )
}

/// Asserts that the gated Start has not returned, once the agent has the gate's request.
fn expect_gate_shut<T>(rig: &Rig, id: &str, start: &std::thread::ScopedJoinHandle<'_, T>) {
    let socket = rig.env.containerd().agent_socket();
    assert!(
        wait_until(WITHIN, || container_status(&socket, id)
            .ok()
            .flatten()
            .is_some()),
        "the gated container is registered"
    );
    assert!(
        !wait_until(Duration::from_millis(800), || start.is_finished()),
        "the gate opened while the GPU was held"
    );
}

#[test]
fn a_mapping_kept_after_its_fd_was_closed_keeps_the_gate_shut_until_the_munmap() {
    let Some(rig) = Rig::start("hidden-map") else {
        return;
    };
    let mut a = rig.holder("mapper");
    let fd = a.num("open nvidia0").unwrap();
    a.cmd(&format!("alloc {fd}")).unwrap();
    let addr = a.num(&format!("mmap {fd}")).unwrap();
    a.num(&format!("close {fd}")).unwrap();
    assert!(wait_until(WITHIN, || rig.status("mapper")["nvidia_fds"] == json!(0)));
    assert_eq!(rig.status("mapper")["gpu"], json!("held"));
    std::thread::scope(|s| {
        let start = s.spawn(|| start_behind_gate(&rig, "server"));
        expect_gate_shut(&rig, "server", &start);
        a.num(&format!("munmap 0x{addr:x}")).unwrap();
        let mut server = start.join().unwrap().unwrap();
        server.num("stamp").unwrap();
    });
}

#[test]
fn a_container_baton_does_not_watch_keeps_the_gate_shut_until_it_lets_go() {
    let Some(rig) = Rig::start("hidden-unwatched") else {
        return;
    };
    // The same mock GPU in a container of containerd's own runc shim: no registration, no probes.
    let mut u = HolderContainer::start_with_runtime(
        &rig.env,
        "plain",
        rig.mock_dir.path(),
        "io.containerd.runc.v2",
    )
    .unwrap();
    let fd = u.num("open nvidia0").unwrap();
    std::thread::scope(|s| {
        let start = s.spawn(|| start_behind_gate(&rig, "server"));
        expect_gate_shut(&rig, "server", &start);
        u.num(&format!("close {fd}")).unwrap();
        let mut server = start.join().unwrap().unwrap();
        server.num("stamp").unwrap();
    });
}

/// A tenant that would fill the probes' fd map (72,000 entries: more than the whole map held before quotas)
/// by forking a process that holds many NVIDIA fds used to break the agent's reading of the probes (every
/// gated Start on the node failed, and the probes were loaded again). Now it reaches its quota of the map
/// (`--probe-fd-quota`), the probes keep working, and its fds past the quota are judged from /proc: the gate
/// stays shut while it holds, and opens once it is gone. (The other containers keep their signal, gate and
/// preemption: `probe_flood.rs`.)
#[test]
fn a_tenant_past_its_fd_quota_keeps_the_gate_shut_while_it_holds_and_the_probes_keep_working() {
    let Some(rig) = Rig::start("gate-fails-closed") else {
        return;
    };
    let mut flooder = rig.holder("flooder");
    let mut w = rig.watch("flooder");
    let fd = flooder.num("open nvidia0").unwrap();
    flooder.cmd(&format!("alloc {fd}")).unwrap();
    expect_transition(&mut w, "flooder", "acquired");
    // About 900 fds of the device per process (the container's RLIMIT_NOFILE is 1024) ...
    for _ in 0..900 {
        flooder.num(&format!("dup {fd}")).unwrap();
    }
    let agent_log = rig
        .env
        .containerd()
        .agent_socket()
        .with_file_name("agent.log");
    std::thread::scope(|s| {
        let start = s.spawn(|| start_behind_gate(&rig, "server"));
        expect_gate_shut(&rig, "server", &start);
        // ... and 80 forks: 72,000 inherited entries.
        for _ in 0..80 {
            flooder.num("fork").unwrap();
        }
        assert!(
            wait_until(WITHIN, || rig.status("flooder")["probe_fds"]["over_quota"]
                == json!(true)),
            "the flooder reached its quota: {}",
            rig.status("flooder")
        );
        expect_gate_shut(&rig, "server", &start);
        // ... until the flooder is gone.
        flooder.finish().unwrap();
        let started = start
            .join()
            .unwrap()
            .and_then(|mut server| server.num("stamp"));
        assert!(
            started.is_ok(),
            "the server starts once the flooder is gone: {started:?}; the agent's log: {}",
            std::fs::read_to_string(&agent_log).unwrap_or_default()
        );
    });
    let log = std::fs::read_to_string(&agent_log).unwrap_or_default();
    assert!(
        !log.contains("reading the probes failed"),
        "the probes kept working:\n{log}"
    );
}

/// When the shim's log says the gate let `id` through (CLOCK_MONOTONIC ns, as the agent answered).
fn gate_opened_ns(rig: &Rig, id: &str) -> u64 {
    let log = std::fs::read_to_string(rig.env.containerd().log_path()).unwrap();
    let line = log
        .lines()
        .find(|l| l.contains("the GPU is free: starting") && l.contains(&format!("id={id} ")))
        .unwrap_or_else(|| panic!("the shim logs the gate's opening for {id}: {log}"));
    let after = line.split("t_free_ns=").nth(1).unwrap();
    after
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

/// The gate opens on the holder's confirmed release, not when its close begins: with closes that take
/// 300 ms in the driver (its teardown), the waiting Start goes on only once the close returned.
#[test]
fn the_gate_opens_on_the_confirmed_release_not_when_the_close_begins() {
    let Some(rig) = Rig::start_with("gate-confirmed", |o| {
        o.with_close_delay(Duration::from_millis(300))
    }) else {
        return;
    };
    let mut holder = rig.holder("slow-close");
    let mut w = rig.watch("slow-close");
    let fd = holder.num("open nvidia0").unwrap();
    holder.cmd(&format!("alloc {fd}")).unwrap();
    expect_transition(&mut w, "slow-close", "acquired");
    std::thread::scope(|s| {
        let start = s.spawn(|| start_behind_gate(&rig, "server"));
        expect_gate_shut(&rig, "server", &start);
        let before = holder.num("stamp").unwrap();
        let returned = holder.num(&format!("close {fd}")).unwrap();
        let released = expect_transition(&mut w, "slow-close", "released");
        let t_released = released["t_released_ns"].as_u64().unwrap();
        // Confirmed at the close's return or, from /proc, a moment after it.
        assert!(
            t_released >= before + 250_000_000,
            "the release waited for the close to return ({before}..{returned}): {released}"
        );
        let mut server = start.join().unwrap().unwrap();
        server.num("stamp").unwrap();
        let opened = gate_opened_ns(&rig, "server");
        assert!(
            opened >= t_released,
            "the gate opened {} ms before the release was confirmed",
            (t_released - opened) / 1_000_000
        );
    });
}

#[test]
fn a_dup_of_an_fd_number_reused_for_another_device_is_not_taken_for_a_hidden_holder() {
    // The process runs ahead of the agent: while the agent applies the open of nvidiactl under a number, the
    // process has closed it and opened nvidia0 under the same number and dups that. Each dup is nvidia0's
    // file, with no GPU state: when the client is freed the container is released at once (CI once saw such
    // a dup taken for nvidiactl's file, and the release waited for a "hidden" holder).
    let Some(rig) = Rig::start("reuse-dup") else {
        return;
    };
    let mut h = rig.holder("reuser");
    let mut w = rig.watch("reuser");
    let ctl = h.num("open nvidiactl").unwrap();
    let alloc = h.cmd(&format!("alloc {ctl}")).unwrap();
    assert_eq!(alloc[1], "0", "{alloc:?}");
    expect_transition(&mut w, "reuser", "acquired");
    let kept = h.num("reuse-dup nvidiactl nvidia0 60 8").unwrap();
    assert_eq!(kept, 480);
    let before = h.num("stamp").unwrap();
    let t = h.num(&format!("close {ctl}")).unwrap();
    let e = expect_transition(&mut w, "reuser", "released");
    let last = e["t_last_close_ns"].as_u64().unwrap();
    assert!(
        last >= before && last <= t,
        "released by the close of the client's file ({before}..{t}), the dups hold nothing: {e}"
    );
    h.finish().unwrap();
}

/// Waits for container `id`'s next periodic check against /proc after `after` (`proc_check.at_ns`,
/// CLOCK_MONOTONIC; the agent checks only a container that holds the GPU), then checks that it still holds the
/// GPU and that no `released` came. Returns when that check was made.
fn still_held_after_a_check(rig: &Rig, w: &mut AgentWatch, id: &str, after: u64) -> u64 {
    let checked = || rig.status(id)["proc_check"]["at_ns"].as_u64().unwrap_or(0);
    assert!(
        wait_until(WITHIN, || checked() > after
            || rig.status(id)["gpu"] != json!("held")),
        "the agent checks {id} against /proc: {}",
        rig.status(id)
    );
    assert_no_release(
        w,
        Duration::ZERO,
        "released while its device mapping holds the client",
    );
    let status = rig.status(id);
    assert_eq!(status["gpu"], json!("held"), "{status}");
    assert_eq!(status["mappings"], json!(1), "{status}");
    checked()
}

/// /proc prints file names raw, and a name need not be UTF-8 (issue 39, item 1). A holder that keeps GPU
/// state through a device mapping alone (its fd closed) and also maps a file named `/tmp/\xff\xfe` at a lower
/// address: the agent's periodic check against /proc must still see the device mapping (it read the maps
/// line by line as text and stopped at the odd line, so the mapping above it looked gone: the ledger freed
/// the client and `released` went out, `confirmed_by: proc`), the check before a release must too (it read
/// the maps as one string, which failed, and took that for "no mappings"), and so must the gate: a Start
/// that needs the whole GPU is refused while the holder lives.
#[test]
fn a_mapping_whose_name_is_not_utf8_below_a_mapping_only_holder_keeps_it_held_and_the_gate_shut() {
    let Some(rig) = Rig::start("hidden-non-utf8") else {
        return;
    };
    let mut a = rig.holder("odd");
    let mut w = rig.watch("odd");
    let fd = a.num("open nvidia0").unwrap();
    let alloc = a.cmd(&format!("alloc {fd}")).unwrap();
    assert_eq!(alloc[1], "0", "{alloc:?}");
    let addr = a.num(&format!("mmap {fd}")).unwrap();
    expect_transition(&mut w, "odd", "acquired");
    let odd = a.num(&format!("map-below 0x{addr:x} fffe")).unwrap();
    assert!(
        odd < addr,
        "0x{odd:x} is below the device mapping 0x{addr:x}"
    );
    let closed = a.num(&format!("close {fd}")).unwrap();
    assert!(wait_until(WITHIN, || rig.status("odd")["nvidia_fds"] == json!(0)));
    // Two periodic checks after the close: each reads the maps whole.
    let first = still_held_after_a_check(&rig, &mut w, "odd", closed);
    still_held_after_a_check(&rig, &mut w, "odd", first);

    // A Start that needs the whole GPU waits its 2 s at the gate and is refused, naming the holder.
    let started = HolderContainer::start(
        &rig.env,
        "server",
        rig.mock_dir.path(),
        &[("baton.io/wait-gpu-free", "2s")],
    );
    assert!(started.is_err(), "the server started beside the holder");
    let log = std::fs::read_to_string(rig.env.containerd().log_path()).unwrap();
    assert!(
        log.lines()
            .any(|l| l.contains("wait-gpu-free: not starting")
                && l.contains("id=server")
                && l.contains("odd")),
        "the gate refused the server, naming the holder: {log}"
    );
    assert_eq!(rig.status("odd")["gpu"], json!("held"));
    a.num(&format!("munmap 0x{addr:x}")).unwrap();
    expect_transition(&mut w, "odd", "released");
}
