//! The node agent as a node component: one probe set however many GPU pods (and none once they are gone),
//! no periodic wakeups while nothing happens, and a kill -9 mid-run that loses nothing that matters (the
//! shims start it again, register their containers again, and it rebuilds their fds from /proc).
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use std::time::Duration;

use baton_integration::{
    agent::{AgentWatch, device_mounts_at, wait_until},
    holder::{GpuRig, HolderContainer},
    procs::context_switches,
};
use serde_json::{Value, json};

const WITHIN: Duration = Duration::from_secs(30);

fn expect(w: &mut AgentWatch, id: &str, kind: &str) -> Value {
    let e = w.next_transition(id, WITHIN).unwrap();
    assert_eq!(e["kind"], json!(kind), "{e}");
    e
}

/// eBPF programs whose fds process `pid` holds (from /proc/PID/fdinfo: the kernel's view, not the agent's).
fn bpf_programs_held(pid: i32) -> usize {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fdinfo")) else {
        return 0;
    };
    dir.flatten()
        .filter(|e| std::fs::read_to_string(e.path()).is_ok_and(|info| info.contains("prog_type:")))
        .count()
}

#[test]
fn twenty_gpu_pods_share_one_probe_set_which_goes_with_the_last() {
    let Some(rig) = GpuRig::start("agent-twenty") else {
        return;
    };
    let mut pods: Vec<HolderContainer> = Vec::new();
    let mut first = rig.holder("pod-0");
    let mut w = rig.watch("pod-0");
    let fd = first.num("open nvidiactl").unwrap();
    first.cmd(&format!("alloc {fd}")).unwrap();
    expect(&mut w, "pod-0", "acquired");
    let agent = rig.env.containerd().agent_pid().unwrap();
    let with_one = rig.node_status()["programs_attached"].as_u64().unwrap();
    let held_with_one = bpf_programs_held(agent);
    assert!(
        with_one > 0 && held_with_one as u64 == with_one,
        "{with_one} {held_with_one}"
    );
    pods.push(first);
    for i in 1..20 {
        let id = format!("pod-{i}");
        let mut h = rig.holder(&id);
        let mut w = rig.watch(&id);
        let fd = h.num("open nvidiactl").unwrap();
        h.cmd(&format!("alloc {fd}")).unwrap();
        expect(&mut w, &id, "acquired");
        pods.push(h);
    }
    let node = rig.node_status();
    assert_eq!(node["containers"].as_array().unwrap().len(), 20, "{node}");
    assert!(
        node["containers"]
            .as_array()
            .unwrap()
            .iter()
            .all(|c| c["gpu"] == json!("held")),
        "{node}"
    );
    assert_eq!(
        node["programs_attached"].as_u64().unwrap(),
        with_one,
        "{node}"
    );
    assert_eq!(
        bpf_programs_held(agent),
        held_with_one,
        "the agent's programs"
    );
    for shim in rig.env.shims() {
        assert_eq!(
            bpf_programs_held(shim.pid),
            0,
            "shim {} loads no probes",
            shim.pid
        );
    }
    for h in pods {
        h.finish().unwrap();
    }
    let detached = wait_until(WITHIN, || {
        rig.node_status()["probes_attached"] == json!(false)
    });
    assert!(
        detached,
        "the probes go with the last GPU pod: {}",
        rig.node_status()
    );
    assert_eq!(bpf_programs_held(agent), 0);
}

#[test]
fn an_idle_agent_and_its_shims_do_not_wake_up_periodically() {
    let Some(rig) = GpuRig::start("agent-idle") else {
        return;
    };
    let mut h = rig.holder("sleeper");
    let mut w = rig.watch("sleeper");
    let fd = h.num("open nvidiactl").unwrap();
    h.cmd(&format!("alloc {fd}")).unwrap();
    expect(&mut w, "sleeper", "acquired");
    let agent = rig.env.containerd().agent_pid().unwrap();
    let shims: Vec<i32> = rig.env.shims().iter().map(|s| s.pid).collect();
    assert!(!shims.is_empty());
    // Counted over a window, not waited for: a 1 kHz poll would show about 1000 switches per second here.
    let before: Vec<u64> = std::iter::once(agent)
        .chain(shims.iter().copied())
        .map(context_switches)
        .collect();
    std::thread::sleep(Duration::from_secs(1));
    let after: Vec<u64> = std::iter::once(agent)
        .chain(shims.iter().copied())
        .map(context_switches)
        .collect();
    let woke: Vec<u64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    assert!(
        woke.iter().all(|n| *n < 50),
        "context switches in 1 s while idle (agent, then shims): {woke:?}"
    );
    h.finish().unwrap();
}

#[test]
fn the_agent_killed_mid_run_is_started_again_and_rebuilds_from_proc() {
    let Some(rig) = GpuRig::start("agent-kill") else {
        return;
    };
    let mut h = rig.holder("survivor");
    let mut w = rig.watch("survivor");
    let fd = h.num("open nvidiactl").unwrap();
    h.cmd(&format!("alloc {fd}")).unwrap();
    expect(&mut w, "survivor", "acquired");
    let old = rig.env.containerd().agent_pid().unwrap();
    rig.env.containerd().kill_agent();
    // Created while no agent runs: the new one cannot have seen it.
    h.cmd(&format!("alloc {fd}")).unwrap();
    let back = wait_until(WITHIN, || {
        rig.env.containerd().agent_pid().is_some_and(|p| p != old)
            && baton_integration::agent::container_status(
                &rig.env.containerd().agent_socket(),
                "survivor",
            )
            .ok()
            .flatten()
            .is_some()
    });
    assert!(
        back,
        "the shim started the agent again and registered the container again"
    );
    let status = rig.status("survivor");
    assert_eq!(status["gpu"], json!("held"), "{status}");
    assert_eq!(
        status["nvidia_fds"],
        json!(1),
        "rebuilt from /proc: {status}"
    );
    assert_eq!(status["partial"], json!(true), "{status}");
    let log = std::fs::read_to_string(rig.env.containerd().log_path()).unwrap();
    assert_eq!(
        log.matches("gpu: no baton agent").count(),
        1,
        "the shim says once that the agent is gone"
    );
    assert!(
        log.contains("gpu: connected to the baton agent at"),
        "and that it is back"
    );

    let mut w = rig.watch("survivor");
    let before = h.num("stamp").unwrap();
    h.num(&format!("close {fd}")).unwrap();
    let e = expect(&mut w, "survivor", "released");
    assert!(e["t_last_close_ns"].as_u64().unwrap() >= before, "{e}");
    h.finish().unwrap();
}

#[test]
fn baton_trace_uses_the_agents_probe_set_when_an_agent_runs() {
    let Some(rig) = GpuRig::start("agent-trace") else {
        return;
    };
    let mut h = rig.holder("traced");
    let mut w = rig.watch("traced");
    let agent = rig.env.containerd().agent_pid().unwrap();
    let programs = rig.node_status()["programs_attached"].as_u64().unwrap();
    let out = tempfile::NamedTempFile::new().unwrap();
    let mut cmd = std::process::Command::new(
        baton_integration::trace_env::workspace_binary("baton", "baton").unwrap(),
    );
    cmd.args(["trace", "-c", "traced", "--summary", "-o"])
        .arg(out.path())
        .env("BATON_AGENT_SOCKET", rig.env.containerd().agent_socket());
    let trace =
        baton_integration::trace_env::BatonTrace::start(cmd, Duration::from_secs(30)).unwrap();
    let fd = h.num("open nvidiactl").unwrap();
    h.cmd(&format!("alloc {fd}")).unwrap();
    expect(&mut w, "traced", "acquired");
    h.num(&format!("close {fd}")).unwrap();
    expect(&mut w, "traced", "released");
    // One probe set on the node: the agent's, unchanged; the trace loaded none.
    assert_eq!(
        rig.node_status()["programs_attached"].as_u64().unwrap(),
        programs
    );
    assert_eq!(bpf_programs_held(agent) as u64, programs);
    let (status, stderr) = trace.stop().unwrap();
    assert!(status.success(), "{stderr}");
    assert!(
        stderr.contains("using the probe set of the baton agent"),
        "{stderr}"
    );
    let text = std::fs::read_to_string(out.path()).unwrap();
    assert!(text.contains("open(nvidiactl) = "), "{text}");
    assert!(text.contains("NV_ESC_RM_ALLOC(nvidiactl"), "{text}");
    assert!(text.contains("hClass=NV01_ROOT_CLIENT"), "{text}");
    assert!(text.contains(&format!("close({fd})")), "{text}");
    let summary = format!("== container {}/traced", rig.env.namespace());
    assert!(text.contains(&summary), "the summary follows: {text}");
    h.finish().unwrap();
}

#[test]
fn a_container_whose_shim_was_killed_is_dropped_once_its_init_is_gone() {
    let Some(mut rig) = GpuRig::start("agent-orphan") else {
        return;
    };
    // A GPU container whose init does not live on its stdio: a holder reads commands from stdin and exits
    // at its end, which came when the shim (and ctr, with containerd) holding the fifo went.
    let mut flags = device_mounts_at(rig.mock_dir.path(), "/dev");
    flags.extend(["-d".to_owned(), "--null-io".to_owned()]);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let args = rig
        .env
        .run_args("orphan", &[], &flags, &["/bin/sleep", "600"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    rig.env.ctr_ok(&args).unwrap();
    let status = rig.status("orphan");
    let init = status["init_pid"].as_i64().unwrap() as i32;
    let kill = |pid: i32| {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap()
    };
    // containerd goes first: its clean-up of a dead shim deletes the container, killing its init, and on a
    // loaded machine that came before the check below (the init was gone, and rightly no longer watched).
    let shims = rig.env.shims();
    rig.env.containerd_mut().stop();
    for shim in shims {
        kill(shim.pid);
    }
    // The container outlives its shim: still watched.
    assert_eq!(
        rig.status("orphan")["init_pid"].as_i64().unwrap() as i32,
        init
    );
    kill(init);
    let dropped = wait_until(WITHIN, || {
        baton_integration::agent::container_status(&rig.env.containerd().agent_socket(), "orphan")
            .is_ok_and(|s| s.is_none())
    });
    assert!(dropped, "{}", rig.node_status());
}
