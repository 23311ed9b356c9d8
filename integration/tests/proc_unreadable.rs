//! Where the agent cannot read /proc, it fails closed (issue 30, item 4): a process whose files the kernel
//! refuses to show the agent counts as holding every GPU, so the gate stays shut and names it, and the agent
//! says at start what it lacks. The agent here runs without CAP_SYS_PTRACE (`setpriv --bounding-set
//! -sys_ptrace`), as a confined DaemonSet container would: the kernel's ptrace access check then refuses it
//! the links in /proc/PID/fd of a process with capabilities it lacks (a privileged container). Before, such a
//! process counted as holding nothing, and the gate opened. Real containerd, runc, the Baton shim, the kernel's
//! access checks and the FUSE mock driver.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use std::os::unix::fs::PermissionsExt;

use baton_integration::{
    agent::AgentProcess,
    cuda::{CudaRig, Trainer},
    holder::HolderContainer,
    trace_env::workspace_binary,
};

#[test]
fn an_agent_that_cannot_read_a_process_keeps_the_gate_shut_and_names_it() {
    let Some(rig) = CudaRig::start("proc-unreadable") else {
        return;
    };
    // `baton` run without CAP_SYS_PTRACE, started before any container so that the shims use it.
    let dir = rig.gpu.env.scratch();
    let wrapper = dir.join("baton-without-ptrace");
    let baton = workspace_binary("baton", "baton").unwrap();
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nexec setpriv --bounding-set -sys_ptrace --inh-caps -sys_ptrace {} \"$@\"\n",
            baton.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    let log = dir.join("agent.log");
    let socket = rig.gpu.env.containerd().agent_socket();
    std::fs::create_dir_all(socket.parent().unwrap()).unwrap();
    let _agent = AgentProcess::start_program(&wrapper, &socket, &log).unwrap();
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("cannot read /proc/1/maps") && text.contains("CAP_SYS_PTRACE"),
        "the agent says what it lacks at start:\n{text}"
    );

    // A privileged container Baton does not watch, holding nothing: its capabilities include CAP_SYS_PTRACE,
    // which the agent lacks, so the kernel refuses the agent the links in its /proc/PID/fd.
    let _privileged = HolderContainer::start_with_runtime_and_flags(
        &rig.gpu.env,
        "privileged",
        rig.gpu.mock_dir.path(),
        "io.containerd.runc.v2",
        &["--privileged".to_owned()],
    )
    .unwrap();
    let (_, privileged) = rig.gpu.env.api().unwrap().state("privileged", "").unwrap();
    let short = [("baton.io/wait-gpu-free", "2s")];
    let _server = rig.create("server", &Trainer::with_worker(), &short);
    let err = rig.start_error("server");
    assert!(
        err.contains("(the agent cannot read /proc/") && err.contains("CAP_SYS_PTRACE"),
        "the gate says it cannot read some processes, and what the agent needs: {err}"
    );
    let pids: Vec<String> = err
        .split_once("count as holding every GPU: pid(s) ")
        .map(|(_, rest)| rest.split(" (").next().unwrap_or_default())
        .unwrap_or_default()
        .split(", ")
        .map(str::to_owned)
        .collect();
    assert!(
        pids.contains(&privileged.to_string()),
        "the privileged container's process {privileged} is among them ({pids:?}): {err}"
    );
    assert_eq!(rig.task_status("server").as_deref(), Some("CREATED"));
}
