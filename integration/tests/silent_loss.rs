//! No silent loss (issue 39, item 6), end to end (real containerd, runc, the Baton shim and agent, the FUSE
//! mock driver, the kernel's probes):
//! - a thread's call is never pushed out of the probes' in-flight slots by another's: on a node whose
//!   `pid_max` is above 65,536 (systemd's 4,194,304), threads whose tids share a slot collide, and a
//!   flooding container's threads made to share the victim's slot used to overwrite the victim's records (its
//!   allocations went missing from its ledger for good, only counted);
//! - an munmap is applied when it succeeded, at its exit: a failing one (unaligned, or past the address
//!   space) used to be applied at its entry and release a container that still maps the device;
//! - the probes' fd map keeps a reserve for every container's first fds: sixteen containers at their quota
//!   used to fill it and leave the next container's fds to the /proc fallback.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use std::{path::Path, time::Duration};

use baton_integration::{
    agent::{AgentProcess, AgentWatch, wait_until},
    holder::{GpuRig as Rig, HolderContainer},
    metrics,
};
use serde_json::{Value, json};

const WITHIN: Duration = Duration::from_secs(30);
const PAGE: u64 = 4096;
const MIB: u64 = 1 << 20;

fn expect_transition(w: &mut AgentWatch, id: &str, kind: &str) -> Value {
    let e = w.next_transition(id, WITHIN).unwrap();
    assert_eq!(e["kind"], json!(kind), "{e}");
    e
}

/// Holder container `id`, watched, with a client and 1 MiB of video memory on its nvidiactl fd (returned):
/// it has acquired the GPU.
fn holding_state(rig: &Rig, id: &str) -> (HolderContainer, AgentWatch, u64) {
    let mut h = rig.holder(id);
    let mut w = rig.watch(id);
    let ctl = h.num("open nvidiactl").unwrap();
    let alloc = h.cmd(&format!("alloc {ctl}")).unwrap();
    assert_eq!(alloc[1], "0", "{alloc:?}");
    expect_transition(&mut w, id, "acquired");
    (h, w, ctl)
}

/// The next transition of `id` is a release timed by the removal made between `before` and `returned_at`
/// (by the holder's clock), confirmed past the kernel's release: nothing released it earlier, and the
/// removal was seen by the probes (a container followed through /proc is released by a later look, not at
/// its close's record).
fn expect_release_between(w: &mut AgentWatch, id: &str, before: u64, returned_at: u64) -> Value {
    let e = expect_transition(w, id, "released");
    let last = e["t_last_close_ns"].as_u64().unwrap();
    assert!(
        last >= before && last <= returned_at,
        "released by the removal made between {before} and {returned_at}, not earlier: {e}"
    );
    assert!(
        ["syscall_return", "proc"].contains(&e["confirmed_by"].as_str().unwrap()),
        "confirmed past the kernel's release of the removal: {e}"
    );
    e
}

/// The host pid of the one process of container `id` that holds NVIDIA files.
fn holder_pid(rig: &Rig, id: &str) -> u32 {
    assert!(
        wait_until(WITHIN, || rig.status(id)["processes"]
            .as_array()
            .is_some_and(|p| p.len() == 1)),
        "{id} has one holder: {}",
        rig.status(id)
    );
    rig.status(id)["processes"][0]["pid"].as_u64().unwrap() as u32
}

#[test]
fn a_failing_munmap_leaves_a_mapping_only_holder_held() {
    let Some(rig) = Rig::start("loss-munmap") else {
        return;
    };
    let mut h = rig.holder("unmapper");
    let mut w = rig.watch("unmapper");
    // GPU state on nvidia0's file, kept by a mapping alone.
    let fd = h.num("open nvidia0").unwrap();
    let alloc = h.cmd(&format!("alloc {fd}")).unwrap();
    assert_eq!(alloc[1], "0", "{alloc:?}");
    let addr = h.num(&format!("map {fd} 1")).unwrap();
    h.num(&format!("close {fd}")).unwrap();
    expect_transition(&mut w, "unmapper", "acquired");

    // Two munmaps the kernel refuses (EINVAL), each covering the mapping as its arguments read: from an
    // unaligned address below it, and with a length past the address space. The mapping stays.
    for (at, len) in [(addr - 1, 2 * PAGE), (addr, 1 << 47)] {
        let reply = h.cmd(&format!("munmap-raw 0x{at:x} {len}")).unwrap();
        assert_eq!(
            reply[0],
            (nix::errno::Errno::EINVAL as i32).to_string(),
            "munmap(0x{at:x}, {len})"
        );
    }
    assert!(
        std::fs::read_to_string(format!("/proc/{}/maps", holder_pid(&rig, "unmapper")))
            .unwrap()
            .lines()
            .any(|l| l.starts_with(&format!("{addr:x}-"))),
        "the kernel still maps 0x{addr:x}"
    );
    let status = rig.status("unmapper");
    assert_eq!(
        (&status["gpu"], &status["mappings"]),
        (&json!("held"), &json!(1)),
        "{status}"
    );

    // The real munmap releases it (and nothing before it did).
    let before = h.num("stamp").unwrap();
    let reply = h.cmd(&format!("munmap-raw 0x{addr:x} {PAGE}")).unwrap();
    assert_eq!(reply[0], "0", "{reply:?}");
    let t: u64 = reply[1].parse().unwrap();
    expect_release_between(&mut w, "unmapper", before, t);
    assert_eq!(rig.status("unmapper")["mappings"], json!(0));
    h.finish().unwrap();
}

/// The node's `pid_max`, raised for a test and put back when dropped. The tests that raise it take turns
/// (a lock file): one that read another's raised value would put that back for good.
struct RaisedPidMax {
    was: String,
    _turn: nix::fcntl::Flock<std::fs::File>,
}

const PID_MAX: &str = "/proc/sys/kernel/pid_max";

impl RaisedPidMax {
    /// Raises `pid_max` to systemd's 4,194,304 (the kernel's limit on 64-bit) if it is lower.
    fn to_systemds() -> Self {
        let lock =
            std::fs::File::create(std::env::temp_dir().join("baton-test-pid-max.lock")).unwrap();
        let turn = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive)
            .map_err(|(_, e)| e)
            .unwrap();
        let was = std::fs::read_to_string(PID_MAX).unwrap().trim().to_owned();
        if was.parse::<u64>().unwrap() < 4_194_304 {
            std::fs::write(PID_MAX, "4194304").unwrap();
        }
        Self { was, _turn: turn }
    }
}

impl Drop for RaisedPidMax {
    fn drop(&mut self) {
        let _ = std::fs::write(PID_MAX, &self.was);
    }
}

/// The next pid the node hands out is `pid` (unless another process takes it first).
fn next_pid_is(pid: u32) {
    std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string()).unwrap();
}

/// Gives `flooder` (host pid `pid`, RM_CONTROL calls on its fd `fd`) a calling thread whose tid is `tid`:
/// the next pid the node hands out is set to it (`ns_last_pid`), then the thread is made. Another process of
/// the node may take that pid first (tests run side by side): then it is tried again. Returns whether it got
/// one.
fn calling_thread_at(flooder: &mut HolderContainer, pid: u32, fd: u64, tid: u32) -> bool {
    for _ in 0..20 {
        if Path::new(&format!("/proc/{tid}")).exists() {
            return Path::new(&format!("/proc/{pid}/task/{tid}")).exists();
        }
        next_pid_is(tid);
        flooder.cmd(&format!("ioctl-threads {fd} 1")).unwrap();
        if Path::new(&format!("/proc/{pid}/task/{tid}")).exists() {
            return true;
        }
    }
    false
}

#[test]
fn a_flood_of_threads_sharing_the_victims_in_flight_slot_loses_none_of_its_calls() {
    let Some(rig) = Rig::start("loss-collide") else {
        return;
    };
    let _pid_max = RaisedPidMax::to_systemds();
    let (mut victim, mut w, ctl) = holding_state(&rig, "victim");
    // The victim's calls come from its main thread, whose tid is its pid.
    let victim_tid = holder_pid(&rig, "victim");

    // The flooder's threads call the driver back to back with tids that share the victim's slot
    // (tid % 65536): one of them is inside a call nearly all the time.
    let mut flooder = rig.holder("flooder");
    let fd = flooder.num("open nvidiactl").unwrap();
    let flooder_pid = holder_pid(&rig, "flooder");
    let colliding = (1..=2)
        .filter(|k| calling_thread_at(&mut flooder, flooder_pid, fd, victim_tid + k * 65_536))
        .count();
    assert!(
        colliding > 0,
        "the flooder got no thread sharing the victim's slot"
    );

    // 32 more allocations of 1 MiB each while the flood goes on: every one is in the ledger.
    const ALLOCS: u64 = 32;
    for _ in 0..ALLOCS {
        let alloc = victim.cmd(&format!("alloc {ctl}")).unwrap();
        assert_eq!(alloc[1], "0", "{alloc:?}");
    }
    let calls: u64 = flooder.num("stop-ioctl-threads").unwrap();
    let expected = (ALLOCS + 1) * MIB;
    assert!(
        wait_until(WITHIN, || rig.status("victim")["vram_bytes"]
            == json!(expected)),
        "the victim's ledger has all of its {} MiB (the flooder made {calls} calls beside it): {}",
        ALLOCS + 1,
        rig.status("victim")
    );
    let status = rig.status("victim");
    assert_eq!(status["partial"], json!(false), "{status}");
    // The slot was shared: the victim's calls (or the flooder's) waited in the overflow, and none was lost.
    let node = rig.node_status();
    assert!(
        node["pending_overflowed"].as_u64().unwrap() > 0,
        "calls shared a slot: {node}"
    );
    assert_eq!(node["pending_lost"], json!(0), "{node}");

    // Its release is exact too: the close of its file, confirmed.
    let before = victim.num("stamp").unwrap();
    let t = victim.num(&format!("close {ctl}")).unwrap();
    let released = expect_release_between(&mut w, "victim", before, t);
    assert_eq!(released["bytes_freed"], json!(expected), "{released}");
    victim.finish().unwrap();
    flooder.finish().unwrap();
}

/// Threads per batch of the crowd that shares in-flight slots.
const SLOTS: u32 = 256;

#[test]
fn calls_that_find_no_room_in_flight_are_made_up_for_from_proc_not_only_counted() {
    // Every close of a device file holds the driver up for 3 s (the mock serves one request at a time): calls
    // made meanwhile stay in flight.
    let Some(rig) = Rig::start_with("loss-lost", |o| o.with_close_delay(Duration::from_secs(3)))
    else {
        return;
    };
    let _pid_max = RaisedPidMax::to_systemds();
    let (mut h, _w, ctl) = holding_state(&rig, "crowd");
    let slow = h.num("open nvidia0").unwrap();
    holder_pid(&rig, "crowd");

    // Batches of threads whose tids share slots (tid % 65536): more of them in flight at once than the
    // container's share of the overflow holds, then threads that map a device file on top of them.
    let batches = baton_tracer::PENDING_OVERFLOW_PER_CGROUP / SLOTS + 2;
    let first = 40_000;
    for k in 0..batches {
        next_pid_is(first + k * 65_536);
        h.cmd(&format!("callers calls {SLOTS}")).unwrap();
    }
    next_pid_is(first + batches * 65_536);
    h.cmd(&format!("callers maps {SLOTS}")).unwrap();

    // The driver is held up by a close; every thread calls it meanwhile (and stays inside its call), then
    // the last batch maps nvidiactl's file (which the driver is not asked about) on top of them.
    h.cmd(&format!("close-async {slow}")).unwrap();
    let calling = h.num(&format!("go calls ioctl {ctl}")).unwrap();
    h.num(&format!("go maps map {ctl}")).unwrap();
    let mapped = h.num("join maps").unwrap();
    h.num("join calls").unwrap();
    assert_eq!(mapped, u64::from(SLOTS), "{calling} calls were in flight");

    // Calls were lost, and none silently: the ledger says it is partial, and the mappings whose records
    // were lost are followed all the same, from /proc once their threads were past them.
    let node = rig.node_status();
    assert!(
        node["pending_lost"].as_u64().unwrap() > 0,
        "calls found no room ({calling} calls in flight): {node}"
    );
    assert!(
        wait_until(WITHIN, || {
            let s = rig.status("crowd");
            s["mappings"] == json!(mapped) && s["unconfirmed"] == json!(0)
        }),
        "the crowd's {mapped} mappings are followed: {}",
        rig.status("crowd")
    );
    assert_eq!(rig.status("crowd")["partial"], json!(true));
    assert!(rig.node_status()["resyncs"].as_u64().unwrap() > 0);
    h.finish().unwrap();
}

/// How many containers of one tenant flood the fd map.
const FLOODERS: usize = 16;

#[test]
fn sixteen_containers_at_their_fd_quota_leave_another_container_followed_exactly() {
    let Some(rig) = Rig::start("loss-fd-map") else {
        return;
    };
    let log = rig
        .env
        .containerd()
        .agent_socket()
        .with_file_name("agent.log");
    let _agent = AgentProcess::start_with(
        &rig.env.containerd().agent_socket(),
        &log,
        &["--metrics-addr", "127.0.0.1:0"],
    )
    .unwrap();
    let url = metrics::url_from_log(&log, WITHIN).unwrap();
    let (mut victim, mut w, ctl) = holding_state(&rig, "victim");

    // Sixteen containers of one tenant, each with 9,010 NVIDIA fds (900 dups of nvidia0 in a process and
    // nine forks of it), past their quota of 8,192: together more than the whole map (131,072).
    let (env, devices) = (&rig.env, rig.mock_dir.path());
    let mut flooders: Vec<HolderContainer> = std::thread::scope(|s| {
        let started: Vec<_> = (0..FLOODERS)
            .map(|i| {
                s.spawn(move || HolderContainer::start(env, &format!("flood-{i:02}"), devices, &[]))
            })
            .collect();
        started
            .into_iter()
            .map(|t| t.join().unwrap().unwrap())
            .collect()
    });
    for f in &mut flooders {
        let fd = f.num("open nvidia0").unwrap();
        assert_eq!(f.num(&format!("keep-dups {fd} 900")).unwrap(), 900);
        for _ in 0..9 {
            f.num("fork").unwrap();
        }
    }
    for f in &flooders {
        assert!(
            wait_until(WITHIN, || rig.status(f.id())["probe_fds"]["over_quota"]
                == json!(true)),
            "{} is past its share of the map: {}",
            f.id(),
            rig.status(f.id())["probe_fds"]
        );
    }

    // The victim opens more, and each fd is followed: in the mirror, its calls in the ledger.
    let gpu = victim.num("open nvidia0").unwrap();
    let alloc = victim.cmd(&format!("alloc {gpu}")).unwrap();
    assert_eq!(alloc[1], "0", "{alloc:?}");
    let copy = victim.num(&format!("dup {gpu}")).unwrap();
    assert!(
        wait_until(WITHIN, || {
            let s = rig.status("victim");
            s["nvidia_fds"] == json!(3) && s["vram_bytes"] == json!(2 * MIB)
        }),
        "the victim's three fds and 2 MiB are followed: {}",
        rig.status("victim")
    );
    let status = rig.status("victim");
    assert_eq!(
        (
            &status["probe_fds"]["followed"],
            &status["probe_fds"]["over_quota"],
            &status["partial"]
        ),
        (&json!(3), &json!(false), &json!(false)),
        "{status}"
    );
    // What is left of the map, and of its reserve, is shown.
    let node = rig.node_status();
    let map = &node["probe_fd_map"];
    let reserve_free = map["reserve_free"].as_u64().unwrap();
    assert!(
        reserve_free > 0 && reserve_free <= map["reserve"].as_u64().unwrap(),
        "{map}"
    );
    let scrape = metrics::scrape(&metrics::client(), &url).unwrap();
    assert!(
        scrape
            .value("baton_probe_fd_map_reserve_free_entries", &[])
            .unwrap()
            > 0.0
    );
    assert!(
        scrape
            .value("baton_probe_fd_map_free_entries", &[])
            .unwrap()
            >= scrape
                .value("baton_probe_fd_map_reserve_free_entries", &[])
                .unwrap()
    );

    // Its release comes at the close of its last file, as the probes saw it.
    for fd in [copy, gpu] {
        victim.num(&format!("close {fd}")).unwrap();
    }
    let before = victim.num("stamp").unwrap();
    let t = victim.num(&format!("close {ctl}")).unwrap();
    expect_release_between(&mut w, "victim", before, t);
    victim.finish().unwrap();
    for f in flooders {
        f.finish().unwrap();
    }
}
