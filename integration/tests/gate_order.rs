//! One Start at a time per GPU (issue 30, item 6): when a GPU frees, the gate lets one of the Starts waiting
//! for it through; the others wait until that one holds GPU state (then its hold keeps them out) and lets
//! go, or its claim lapses (30 s). Before, one release let every waiter through at once, and they shared the
//! GPU each was to have alone. Real components: containerd, runc, the Baton shim and agent, the FUSE mock
//! driver, holder containers.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use std::time::Duration;

use baton_integration::{
    agent::{container_status, wait_until},
    holder::{GpuRig, HolderContainer},
};

const WITHIN: Duration = Duration::from_secs(30);

fn start_behind_gate(rig: &GpuRig, id: &str) -> anyhow::Result<HolderContainer> {
    HolderContainer::start(
        &rig.env,
        id,
        rig.mock_dir.path(),
        &[("baton.io/wait-gpu-free", "1m")],
    )
}

/// Opens nvidiactl and allocates GPU state through it; the fd.
fn allocate(h: &mut HolderContainer) -> u64 {
    let fd = h.num("open nvidiactl").unwrap();
    let alloc = h.cmd(&format!("alloc {fd}")).unwrap();
    assert_eq!(alloc[1], "0", "{alloc:?}");
    fd
}

#[test]
fn a_freed_gpu_lets_one_waiting_start_through_and_the_next_once_that_one_lets_go() {
    let Some(rig) = GpuRig::start("gate-order") else {
        return;
    };
    let mut holder = rig.holder("holder");
    let fd = allocate(&mut holder);
    let socket = rig.env.containerd().agent_socket();
    assert!(wait_until(WITHIN, || rig.status("holder")["gpu"] == "held"));
    std::thread::scope(|s| {
        let registered = |id: &str| {
            wait_until(WITHIN, || {
                container_status(&socket, id).ok().flatten().is_some()
            })
        };
        let a = s.spawn(|| start_behind_gate(&rig, "a"));
        assert!(registered("a"), "a is registered: {}", rig.node_status());
        let b = s.spawn(|| start_behind_gate(&rig, "b"));
        assert!(registered("b"), "b is registered: {}", rig.node_status());
        assert!(
            !wait_until(Duration::from_millis(500), || a.is_finished()
                || b.is_finished()),
            "a gate opened while the GPU was held"
        );
        holder.num(&format!("close {fd}")).unwrap();
        assert!(
            wait_until(WITHIN, || a.is_finished() || b.is_finished()),
            "the release let one through"
        );
        let (first, second) = if a.is_finished() { (a, b) } else { (b, a) };
        assert!(
            !wait_until(Duration::from_millis(800), || second.is_finished()),
            "the second waiter stays behind the first, which has not allocated yet"
        );
        let mut first = first.join().unwrap().unwrap();
        let fd = allocate(&mut first);
        assert!(
            !wait_until(Duration::from_millis(500), || second.is_finished()),
            "the first holds the GPU now"
        );
        first.num(&format!("close {fd}")).unwrap();
        let mut second = second.join().unwrap().unwrap();
        second.num("stamp").unwrap();
    });
}
