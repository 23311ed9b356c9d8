//! The exact release signal, end to end: a container running the mock's scripted NVIDIA file holder under
//! the Baton shim, the agent the shim starts, the FUSE mock driver, real containerd, runc and kernel. Each
//! way a file can go (close, close_range, dup2 over it, munmap of the last mapping, exec with close-on-exec,
//! the exit of the process, the last of several processes and threads) gives one `released` event, only
//! once nothing holds an NVIDIA file any more, confirmed after the kernel's deferred release (at the
//! thread's next syscall, its death, or from /proc), with both times in the event.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use std::time::Duration;

use baton_integration::{
    agent::{AgentConn, AgentWatch},
    holder::{GpuRig as Rig, HolderContainer},
};
use serde_json::{Value, json};

const WITHIN: Duration = Duration::from_secs(30);

/// The next transition (acquired or released) of `id`.
fn next_transition(w: &mut AgentWatch, id: &str) -> Value {
    w.next_transition(id, WITHIN).unwrap()
}

/// Asserts that the next transition is a release confirmed by one of `by`, after the removal at
/// `removed_after` (a time the holder took before the last removal) and `returned_at` (when that removal's
/// call had returned, by the holder's clock); returns the event.
fn expect_release(
    w: &mut AgentWatch,
    id: &str,
    before: u64,
    returned_at: u64,
    by: &[&str],
) -> Value {
    let e = next_transition(w, id);
    assert_eq!(e["kind"], json!("released"), "{e}");
    let last = e["t_last_close_ns"].as_u64().unwrap();
    let released = e["t_released_ns"].as_u64().unwrap();
    assert!(
        last >= before && last <= returned_at,
        "the last removal ({last}) is the one made between {before} and {returned_at}: {e}"
    );
    assert!(released >= last, "confirmed after the removal: {e}");
    let confirmed_by = e["confirmed_by"].as_str().unwrap();
    assert!(
        by.contains(&confirmed_by),
        "confirmed by {confirmed_by}, expected one of {by:?}: {e}"
    );
    e
}

fn expect_acquire(w: &mut AgentWatch, id: &str) {
    let e = next_transition(w, id);
    assert_eq!(e["kind"], json!("acquired"), "{e}");
}

#[test]
fn each_way_a_file_goes_releases_once_nothing_holds_one() {
    let Some(rig) = Rig::start("release-ways") else {
        return;
    };
    let mut h = rig.holder("ways");
    let mut w = rig.watch("ways");

    // close
    let fd = h.num("open nvidiactl").unwrap();
    // An open alone holds no GPU state: no transition until a client with memory is allocated.
    let client_only = h.cmd(&format!("alloc-client {fd}")).unwrap();
    assert_eq!(client_only[1], "0", "{client_only:?}");
    let alloc = h.cmd(&format!("alloc {fd}")).unwrap();
    assert_eq!(
        alloc[1], "0",
        "the client, its device and memory were allocated: {alloc:?}"
    );
    expect_acquire(&mut w, "ways");
    let before = h.num("stamp").unwrap();
    let t = h.num(&format!("close {fd}")).unwrap();
    let e = expect_release(&mut w, "ways", before, t, &["syscall_return", "proc"]);
    assert_eq!(
        e["objects_freed"],
        json!(4),
        "both clients, the device and the memory went with the file: {e}"
    );
    assert_eq!(e["bytes_freed"], json!(1 << 20), "{e}");

    // openat2 is followed too
    let fd = h.num("openat2 nvidiactl").unwrap();
    h.cmd(&format!("alloc {fd}")).unwrap();
    expect_acquire(&mut w, "ways");
    let before = h.num("stamp").unwrap();
    let t = h.num(&format!("close {fd}")).unwrap();
    expect_release(&mut w, "ways", before, t, &["syscall_return", "proc"]);

    // re-acquire, then close_range over two fds
    let ctl = h.num("open nvidiactl").unwrap();
    h.cmd(&format!("alloc {ctl}")).unwrap();
    expect_acquire(&mut w, "ways");
    h.num("open nvidia0").unwrap();
    let before = h.num("stamp").unwrap();
    let t = h.num("close-range 3 4294967295").unwrap();
    expect_release(&mut w, "ways", before, t, &["syscall_return", "proc"]);

    // dup2 of another file over the only NVIDIA fd
    let fd = h.num("open nvidiactl").unwrap();
    h.cmd(&format!("alloc {fd}")).unwrap();
    expect_acquire(&mut w, "ways");
    let before = h.num("stamp").unwrap();
    let t = h.num(&format!("dup2 1 {fd}")).unwrap();
    expect_release(&mut w, "ways", before, t, &["syscall_return", "proc"]);

    // the mapping outlives its fd: the close releases nothing, the munmap does
    let fd = h.num("open nvidia0").unwrap();
    h.cmd(&format!("alloc {fd}")).unwrap();
    expect_acquire(&mut w, "ways");
    let addr = h.num(&format!("mmap {fd}")).unwrap();
    let closed = h.num(&format!("close {fd}")).unwrap();
    let before = h.num("stamp").unwrap();
    let t = h.num(&format!("munmap 0x{addr:x}")).unwrap();
    let e = expect_release(&mut w, "ways", before, t, &["syscall_return", "proc"]);
    assert!(e["t_last_close_ns"].as_u64().unwrap() > closed, "{e}");

    // exec: the close-on-exec fd goes, the inherited one stays until closed
    let ctl = h.num("open nvidiactl").unwrap();
    h.cmd(&format!("alloc {ctl}")).unwrap();
    expect_acquire(&mut w, "ways");
    let before = h.num("stamp").unwrap();
    h.send("exec").unwrap();
    let t = h.reply("exec").unwrap()[0].parse().unwrap();
    expect_release(&mut w, "ways", before, t, &["syscall_return", "proc"]);

    // a thread closes the last fd and never makes another syscall: /proc confirms it
    let fd = h.num("open nvidiactl").unwrap();
    h.cmd(&format!("alloc {fd}")).unwrap();
    expect_acquire(&mut w, "ways");
    let before = h.num("stamp").unwrap();
    let t = h.num(&format!("thread-close {fd}")).unwrap();
    expect_release(&mut w, "ways", before, t, &["proc"]);
    h.cmd("stop-spin").unwrap();

    let status = rig.status("ways");
    assert_eq!(status["gpu"], json!("released"), "{status}");
    assert_eq!(status["nvidia_fds"], json!(0), "{status}");
    assert_eq!(status["unconfirmed"], json!(0), "{status}");
    h.finish().unwrap();
}

#[test]
fn the_last_of_several_processes_and_threads_releases() {
    let Some(rig) = Rig::start("release-last") else {
        return;
    };
    let mut h = rig.holder("last");
    let mut w = rig.watch("last");

    // A forked child keeps the inherited fd: the parent's close releases nothing, the child's exit does.
    let fd = h.num("open-inherit nvidiactl").unwrap();
    h.cmd(&format!("alloc {fd}")).unwrap();
    expect_acquire(&mut w, "last");
    let child = h.num("fork").unwrap();
    h.num(&format!("close {fd}")).unwrap();
    let status = rig.status("last");
    assert_eq!(status["gpu"], json!("held"), "{status}");
    let before = h.num("stamp").unwrap();
    h.cmd(&format!("child-exit {child}")).unwrap();
    let after = h.num("stamp").unwrap();
    let e = expect_release(&mut w, "last", before, after, &["thread_dead", "proc"]);
    assert_eq!(
        e["pids"].as_array().unwrap().len(),
        2,
        "the parent and its child {child} (pid in the container) held the file: {e}"
    );

    // A process with several threads exits holding its fds: released once every thread is dead.
    let ctl = h.num("open nvidiactl").unwrap();
    h.cmd(&format!("alloc {ctl}")).unwrap();
    expect_acquire(&mut w, "last");
    h.cmd("threads 4").unwrap();
    let before = h.num("stamp").unwrap();
    h.send("exit 0").unwrap();
    let e = next_transition(&mut w, "last");
    assert_eq!(e["kind"], json!("released"), "{e}");
    assert!(e["t_last_close_ns"].as_u64().unwrap() >= before, "{e}");
    assert!(
        ["thread_dead", "proc"].contains(&e["confirmed_by"].as_str().unwrap()),
        "an exit is confirmed by the death of its threads: {e}"
    );
    h.finish().unwrap();
}

#[test]
fn a_forged_release_in_the_params_releases_nothing() {
    let Some(rig) = Rig::start("release-forged") else {
        return;
    };
    let mut h = rig.holder("forger");
    let mut w = rig.watch("forger");
    let fd = h.num("open nvidiactl").unwrap();
    h.cmd(&format!("alloc {fd}")).unwrap();
    expect_acquire(&mut w, "forger");
    h.cmd(&format!("forge {fd}")).unwrap();
    let status = rig.status("forger");
    assert_eq!(status["gpu"], json!("held"), "{status}");
    assert_eq!(
        status["live_objects"],
        json!(3),
        "the fake free freed nothing: {status}"
    );
    // The next transition is the real close's release, not one at the forgery.
    let before = h.num("stamp").unwrap();
    let t = h.num(&format!("close {fd}")).unwrap();
    expect_release(&mut w, "forger", before, t, &["syscall_return", "proc"]);
    h.finish().unwrap();
}

#[test]
fn two_containers_release_independently_and_one_that_never_opens_has_no_transition() {
    let Some(rig) = Rig::start("release-two") else {
        return;
    };
    let mut a = rig.holder("a");
    let mut b = rig.holder("b");
    let mut idle = rig.holder("idle");
    let mut wa = rig.watch("a");
    let mut wb = rig.watch("b");
    let mut wi = rig.watch("idle");
    let fa = a.num("open nvidiactl").unwrap();
    a.cmd(&format!("alloc {fa}")).unwrap();
    expect_acquire(&mut wa, "a");
    let fb = b.num("open nvidiactl").unwrap();
    b.cmd(&format!("alloc {fb}")).unwrap();
    expect_acquire(&mut wb, "b");
    let before = a.num("stamp").unwrap();
    let t = a.num(&format!("close {fa}")).unwrap();
    expect_release(&mut wa, "a", before, t, &["syscall_return", "proc"]);
    assert_eq!(rig.status("b")["gpu"], json!("held"));
    let before = b.num("stamp").unwrap();
    let t = b.num(&format!("close {fb}")).unwrap();
    expect_release(&mut wb, "b", before, t, &["syscall_return", "proc"]);

    idle.cmd("stamp").unwrap();
    assert_eq!(rig.status("idle")["gpu"], json!("never"));
    a.finish().unwrap();
    b.finish().unwrap();
    idle.finish().unwrap();
    // The idle container's stream ends with its unregistration and holds no transition.
    let e = wi
        .next_matching(WITHIN, |e| {
            e["id"] == json!("idle") && e["kind"] != json!("registered")
        })
        .unwrap();
    assert_eq!(e["kind"], json!("unregistered"), "{e}");
}

#[test]
fn threads_that_come_and_go_and_a_reused_fd_after_exec_leave_no_phantom_holder() {
    let Some(rig) = Rig::start("release-phantoms") else {
        return;
    };
    let mut h = rig.holder("phantoms");
    let mut w = rig.watch("phantoms");
    // Short-lived threads of a holder are not new processes: they inherit no fd of their own.
    let fd = h.num("open nvidiactl").unwrap();
    h.cmd(&format!("alloc {fd}")).unwrap();
    expect_acquire(&mut w, "phantoms");
    h.cmd("flash-threads 50").unwrap();
    let before = h.num("stamp").unwrap();
    let t = h.num(&format!("close {fd}")).unwrap();
    expect_release(&mut w, "phantoms", before, t, &["syscall_return", "proc"]);

    // The re-executed program maps /dev/zero through the fd number its close-on-exec NVIDIA fd had: that
    // is no NVIDIA mapping, and the exec releases.
    let fd = h.num("open nvidiactl").unwrap();
    h.cmd(&format!("alloc {fd}")).unwrap();
    expect_acquire(&mut w, "phantoms");
    let before = h.num("stamp").unwrap();
    // The agent is stopped meanwhile, so that the mmap comes before the exec is handled, while the probes
    // still take fd {fd} for the NVIDIA fd it was.
    let agent = nix::unistd::Pid::from_raw(rig.env.containerd().agent_pid().unwrap());
    nix::sys::signal::kill(agent, nix::sys::signal::Signal::SIGSTOP).unwrap();
    h.send("exec-map /dev/zero").unwrap();
    let reply = h.reply("exec-map");
    nix::sys::signal::kill(agent, nix::sys::signal::Signal::SIGCONT).unwrap();
    let reply = reply.unwrap();
    let t: u64 = reply[0].parse().unwrap();
    expect_release(&mut w, "phantoms", before, t, &["syscall_return", "proc"]);
    let status = rig.status("phantoms");
    assert_eq!(
        status["mappings"],
        json!(0),
        "fd {fd} reused for /dev/zero: {status}"
    );
    assert_eq!(status["gpu"], json!("released"), "{status}");
    h.finish().unwrap();
}

#[test]
fn records_lost_while_the_agent_stalls_are_made_up_for_from_proc() {
    let Some(rig) = Rig::start("release-resync") else {
        return;
    };
    let mut h = rig.holder("flooder");
    let mut w = rig.watch("flooder");
    let fd = h.num("open nvidiactl").unwrap();
    h.cmd(&format!("alloc {fd}")).unwrap();
    expect_acquire(&mut w, "flooder");
    let agent = nix::unistd::Pid::from_raw(rig.env.containerd().agent_pid().unwrap());
    nix::sys::signal::kill(agent, nix::sys::signal::Signal::SIGSTOP).unwrap();
    // More ioctl records than the 16 MiB ring holds, then small records to fill what an ioctl record could
    // not, then the close, whose record is lost too.
    let flood = h
        .cmd(&format!("flood {fd} 60000"))
        .and_then(|_| h.cmd(&format!("flood-dup {fd} 100")));
    let closed = h.num(&format!("close {fd}"));
    nix::sys::signal::kill(agent, nix::sys::signal::Signal::SIGCONT).unwrap();
    flood.unwrap();
    closed.unwrap();
    let e = next_transition(&mut w, "flooder");
    let node = AgentConn::connect(&rig.env.containerd().agent_socket())
        .unwrap()
        .call(json!({"op": "status"}))
        .unwrap();
    assert_eq!(e["kind"], json!("released"), "{e}");
    // The last removal seen may be a dup's close whose confirmation was lost too: /proc confirms it.
    assert!(
        ["resync", "proc"].contains(&e["confirmed_by"].as_str().unwrap()),
        "the lost close is made up for by the resync: {e}\n{node}"
    );
    assert_eq!(node["containers"][0]["partial"], json!(true), "{node}");
    assert!(node["ringbuf_drops"].as_u64().unwrap() > 0, "{node}");
    assert!(node["resyncs"].as_u64().unwrap() >= 1, "{node}");
    h.finish().unwrap();
}

#[test]
fn a_second_containers_device_folder_is_followed_too() {
    let Some(rig) = Rig::start("release-prefix") else {
        return;
    };
    let mut first = rig.holder("first");
    let mut w1 = rig.watch("first");
    let ctl = first.num("open nvidiactl").unwrap();
    first.cmd(&format!("alloc {ctl}")).unwrap();
    expect_acquire(&mut w1, "first");
    // The device folder is the node's to say (its options TOML), not an annotation's.
    let node = rig
        .env
        .node_options_flags("gpu-prefix.toml", "trace_prefix = \"/gpu/nvidia\"\n")
        .unwrap();
    let mut second =
        HolderContainer::start_with(&rig.env, "second", rig.mock_dir.path(), &[], "/gpu", &node)
            .unwrap();
    let mut w2 = rig.watch("second");
    let fd = second.num("open nvidiactl").unwrap();
    second.cmd(&format!("alloc {fd}")).unwrap();
    expect_acquire(&mut w2, "second");
    let before = second.num("stamp").unwrap();
    let t = second.num(&format!("close {fd}")).unwrap();
    expect_release(&mut w2, "second", before, t, &["syscall_return", "proc"]);
    first.finish().unwrap();
    second.finish().unwrap();
}
