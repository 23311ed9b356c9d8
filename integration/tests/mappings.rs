//! Device mappings as the kernel changes them, end to end (real containerd, runc, the Baton shim and agent,
//! the FUSE mock driver, the kernel), for the release signal and for the GPU-free gate. A mapping of an
//! NVIDIA file keeps the file, and the client whose memory lives on it, alive after its fd is closed. The
//! real driver's checkpoint ends each device mapping with an anonymous PROT_NONE `mmap(MAP_FIXED)` over it,
//! never an munmap (recording: /work/shared/gpu/580.159.04/maps-running.txt against maps-parked.txt), so:
//! an anonymous or memfd MAP_FIXED over a mapping releases it; half a mapping left, a mapping moved with
//! mremap and a kept nvidiactl mapping hold the GPU; a MADV_DONTFORK mapping is not a forked child's.
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
const PAGE: u64 = 4096;

fn expect_released(w: &mut AgentWatch, id: &str) {
    let e = w.next_transition(id, WITHIN).unwrap();
    assert_eq!(e["kind"], json!("released"), "{e}");
}

fn expect_acquire(w: &mut AgentWatch, id: &str) {
    let e = w.next_transition(id, WITHIN).unwrap();
    assert_eq!(e["kind"], json!("acquired"), "{e}");
}

/// The next transition of `id` is a release whose last removal came between `before` and `returned_at`
/// (by the holder's clock): nothing released it earlier.
fn expect_release_between(w: &mut AgentWatch, id: &str, before: u64, returned_at: u64) -> Value {
    let e = w.next_transition(id, WITHIN).unwrap();
    assert_eq!(e["kind"], json!("released"), "{e}");
    let last = e["t_last_close_ns"].as_u64().unwrap();
    assert!(
        last >= before && last <= returned_at,
        "released by the removal made between {before} and {returned_at}, not earlier: {e}"
    );
    e
}

/// Opens device file `name`, allocates GPU state through it, maps `pages` of it and closes the fd: the
/// mapping alone keeps the state. Returns the mapping's address.
fn mapped_state(h: &mut HolderContainer, name: &str, pages: u64) -> u64 {
    let fd = h.num(&format!("open {name}")).unwrap();
    let alloc = h.cmd(&format!("alloc {fd}")).unwrap();
    assert_eq!(alloc[1], "0", "{alloc:?}");
    let addr = h.num(&format!("map {fd} {pages}")).unwrap();
    h.num(&format!("close {fd}")).unwrap();
    addr
}

#[test]
fn an_anonymous_or_memfd_map_fixed_over_a_device_mapping_releases_it() {
    let Some(rig) = Rig::start("maps-fixed") else {
        return;
    };
    let mut h = rig.holder("fixed");
    let mut w = rig.watch("fixed");
    for over in ["over-anon", "over-memfd"] {
        let addr = mapped_state(&mut h, "nvidia0", 2);
        expect_acquire(&mut w, "fixed");
        let before = h.num("stamp").unwrap();
        let t = h.num(&format!("{over} 0x{addr:x} 2")).unwrap();
        let e = expect_release_between(&mut w, "fixed", before, t);
        assert!(
            ["syscall_return", "proc"].contains(&e["confirmed_by"].as_str().unwrap()),
            "{over}: confirmed after the kernel's release: {e}"
        );
        assert_eq!(rig.status("fixed")["mappings"], json!(0), "{over}");
    }
    h.finish().unwrap();
}

#[test]
fn half_a_mapping_left_a_moved_one_and_a_kept_nvidiactl_mapping_hold_the_gpu() {
    let Some(rig) = Rig::start("maps-held") else {
        return;
    };
    let mut h = rig.holder("held");
    let mut w = rig.watch("held");

    // Half a mapping replaced: the other half still holds the file.
    let addr = mapped_state(&mut h, "nvidia0", 2);
    expect_acquire(&mut w, "held");
    h.num(&format!("over-anon 0x{addr:x} 1")).unwrap();
    let before = h.num("stamp").unwrap();
    let t = h.num(&format!("unmap 0x{:x} 1", addr + PAGE)).unwrap();
    expect_release_between(&mut w, "held", before, t);

    // Moved with mremap: still mapped, elsewhere.
    let addr = mapped_state(&mut h, "nvidia0", 2);
    expect_acquire(&mut w, "held");
    let moved = h.cmd(&format!("mremap 0x{addr:x} 2 2 move")).unwrap();
    let to = u64::from_str_radix(moved[0].trim_start_matches("0x"), 16).unwrap();
    assert_ne!(to, addr);
    let before = h.num("stamp").unwrap();
    let t = h.num(&format!("unmap 0x{to:x} 2")).unwrap();
    expect_release_between(&mut w, "held", before, t);

    // Shrunk in place with mremap: the first page still holds the file.
    let addr = mapped_state(&mut h, "nvidia0", 2);
    expect_acquire(&mut w, "held");
    h.cmd(&format!("mremap 0x{addr:x} 2 1")).unwrap();
    let before = h.num("stamp").unwrap();
    let t = h.num(&format!("unmap 0x{addr:x} 1")).unwrap();
    expect_release_between(&mut w, "held", before, t);

    // A mapping of nvidiactl, whose file carries the client, kept after its fd was closed.
    let addr = mapped_state(&mut h, "nvidiactl", 1);
    expect_acquire(&mut w, "held");
    assert!(wait_until(WITHIN, || rig.status("held")["nvidia_fds"] == json!(0)));
    assert_eq!(rig.status("held")["gpu"], json!("held"));
    let before = h.num("stamp").unwrap();
    let t = h.num(&format!("unmap 0x{addr:x} 1")).unwrap();
    expect_release_between(&mut w, "held", before, t);
    h.finish().unwrap();
}

#[test]
fn a_forked_child_gets_the_mappings_but_not_the_dontfork_ones() {
    let Some(rig) = Rig::start("maps-fork") else {
        return;
    };
    let mut h = rig.holder("forker");
    let mut w = rig.watch("forker");

    // MADV_DONTFORK: the child has no mapping, so the parent's munmap releases.
    let addr = mapped_state(&mut h, "nvidia0", 1);
    expect_acquire(&mut w, "forker");
    h.cmd(&format!("dontfork 0x{addr:x} 1")).unwrap();
    let child = h.num("fork").unwrap();
    let before = h.num("stamp").unwrap();
    let t = h.num(&format!("unmap 0x{addr:x} 1")).unwrap();
    expect_release_between(&mut w, "forker", before, t);
    h.cmd(&format!("child-exit {child}")).unwrap();

    // Without it, the child's copy holds the file until the child exits.
    let addr = mapped_state(&mut h, "nvidia0", 1);
    expect_acquire(&mut w, "forker");
    let child = h.num("fork").unwrap();
    h.num(&format!("unmap 0x{addr:x} 1")).unwrap();
    let before = h.num("stamp").unwrap();
    h.cmd(&format!("child-exit {child}")).unwrap();
    let after = h.num("stamp").unwrap();
    expect_release_between(&mut w, "forker", before, after);
    h.finish().unwrap();
}

/// The probes do not follow `shmat(SHM_REMAP)`: the device mapping it replaces stays in the agent's mirror,
/// and the agent's periodic check of a held container against /proc releases it (`confirmed_by: proc`),
/// saying in its log that the mirror was wrong.
#[test]
fn a_mapping_that_goes_unseen_by_the_probes_is_released_by_the_check_against_proc() {
    let Some(rig) = Rig::start("maps-unseen") else {
        return;
    };
    let mut h = rig.holder("unseen");
    let mut w = rig.watch("unseen");
    let addr = mapped_state(&mut h, "nvidia0", 1);
    expect_acquire(&mut w, "unseen");
    let replaced = h.num(&format!("shm-over 0x{addr:x} 1")).unwrap();
    let e = w.next_transition("unseen", WITHIN).unwrap();
    assert_eq!(e["kind"], json!("released"), "{e}");
    assert_eq!(e["confirmed_by"], json!("proc"), "{e}");
    assert!(e["t_released_ns"].as_u64().unwrap() >= replaced, "{e}");
    let log = std::fs::read_to_string(
        rig.env
            .containerd()
            .agent_socket()
            .with_file_name("agent.log"),
    )
    .unwrap();
    assert!(
        log.contains("while the probes' mirror held it") && log.contains("probe bug"),
        "the agent says the mirror was wrong: {log}"
    );
    h.finish().unwrap();
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

/// Starts `id` behind the gate while `holder` holds the GPU, checks that the gate stays shut, runs
/// `let_go` and checks that the Start then goes on.
fn gate_waits_until(
    rig: &Rig,
    id: &str,
    holder: &mut HolderContainer,
    let_go: impl FnOnce(&mut HolderContainer),
) {
    std::thread::scope(|s| {
        let start = s.spawn(|| start_behind_gate(rig, id));
        let socket = rig.env.containerd().agent_socket();
        assert!(
            wait_until(WITHIN, || container_status(&socket, id)
                .ok()
                .flatten()
                .is_some()),
            "the gated container {id} is registered"
        );
        assert!(
            !wait_until(Duration::from_millis(800), || start.is_finished()),
            "the gate let {id} through while the GPU was held"
        );
        let_go(holder);
        let mut server = start.join().unwrap().unwrap();
        server.num("stamp").unwrap();
        server.finish().unwrap();
    });
}

#[test]
fn the_gate_waits_for_half_a_mapping_a_moved_one_and_a_kept_nvidiactl_mapping() {
    let Some(rig) = Rig::start("maps-gate") else {
        return;
    };
    let mut a = rig.holder("mapper");
    let mut w = rig.watch("mapper");

    let addr = mapped_state(&mut a, "nvidia0", 2);
    expect_acquire(&mut w, "mapper");
    a.num(&format!("over-anon 0x{addr:x} 1")).unwrap();
    gate_waits_until(&rig, "half", &mut a, |a| {
        a.num(&format!("unmap 0x{:x} 1", addr + PAGE)).unwrap();
    });
    expect_released(&mut w, "mapper");

    let addr = mapped_state(&mut a, "nvidia0", 2);
    expect_acquire(&mut w, "mapper");
    let moved = a.cmd(&format!("mremap 0x{addr:x} 2 2 move")).unwrap();
    let to = u64::from_str_radix(moved[0].trim_start_matches("0x"), 16).unwrap();
    gate_waits_until(&rig, "moved", &mut a, |a| {
        a.num(&format!("unmap 0x{to:x} 2")).unwrap();
    });
    expect_released(&mut w, "mapper");

    let addr = mapped_state(&mut a, "nvidiactl", 1);
    expect_acquire(&mut w, "mapper");
    gate_waits_until(&rig, "ctl", &mut a, |a| {
        a.num(&format!("unmap 0x{addr:x} 1")).unwrap();
    });
    expect_released(&mut w, "mapper");

    // The park's own way: an anonymous MAP_FIXED over the last device mapping opens the gate.
    let addr = mapped_state(&mut a, "nvidia0", 2);
    expect_acquire(&mut w, "mapper");
    gate_waits_until(&rig, "fixed", &mut a, |a| {
        a.num(&format!("over-anon 0x{addr:x} 2")).unwrap();
    });
    a.finish().unwrap();
}
