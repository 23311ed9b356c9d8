//! `baton trace` end to end on this kernel: the real probes, the mock NVIDIA driver served through FUSE, and
//! mock CUDA workloads in cgroups of their own. Each test compares what the tracer saw (events, ledger, fd
//! mirror) with what the workload reports it did.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use std::{collections::BTreeMap, time::Duration};

use baton_integration::{
    skip,
    trace_env::{TraceEnv, collect_until, missing_trace_prerequisite},
};
use baton_nvidia::{class, status};
use baton_tracer::event::{Body, Event};

const WAIT: Duration = Duration::from_secs(20);
const MIB: u64 = 1 << 20;
/// Children the dup/fork/exec script forks, each racing user space's copy of its inherited fd.
const FORKS: usize = 10;

macro_rules! require_trace_env {
    () => {
        if let Some(reason) = missing_trace_prerequisite() {
            skip::missing(&reason);
            return;
        }
    };
}

/// Successful RM_ALLOCs by class among `events` of `pid`, roots counted as NV01_ROOT_CLIENT.
fn allocs_by_class(events: &[Event], pid: u32) -> BTreeMap<u32, u64> {
    let mut m = BTreeMap::new();
    for e in events.iter().filter(|e| e.pid == pid) {
        if let Body::Ioctl(io) = &e.body {
            if let baton_nvidia::decode::Op::Alloc { class: c, .. } = io.decoded.op {
                if io.ret == 0 && io.decoded.status == Some(status::NV_OK) {
                    let c = if class::is_root(c) {
                        class::NV01_ROOT_CLIENT
                    } else {
                        c
                    };
                    *m.entry(c).or_default() += 1;
                }
            }
        }
    }
    m
}

/// Calls per escape/UVM name among `events` of `pid`.
fn calls_by_name(events: &[Event], pid: u32) -> BTreeMap<String, u64> {
    let mut m = BTreeMap::new();
    for e in events.iter().filter(|e| e.pid == pid) {
        if let Body::Ioctl(io) = &e.body {
            *m.entry(io.decoded.escape.to_string()).or_default() += 1;
        }
    }
    m
}

fn opens(events: &[Event], pid: u32) -> BTreeMap<String, u64> {
    let mut m = BTreeMap::new();
    for e in events.iter().filter(|e| e.pid == pid) {
        if let Body::Open { name, .. } = &e.body {
            *m.entry(name.clone()).or_default() += 1;
        }
    }
    m
}

#[tokio::test(flavor = "current_thread")]
async fn decoded_events_and_ledger_follow_the_workload_through_each_phase() {
    require_trace_env!();
    let mut env = TraceEnv::start("phases", "595.45.04").unwrap();
    let cg = env.make_cgroup("trainer").unwrap();
    let mut tracer = env.tracer().unwrap();
    tracer.watch_cgroup(cg).unwrap();
    let w = env.spawn_workload("trainer", 768, 4).unwrap();
    env.workload(w).wait_line("phase holding", WAIT).unwrap();
    let pid = env.workload(w).pid();

    // Holding: everything set up is live in the ledger, with the memory size read from user memory.
    let mut events = collect_until(&mut tracer, WAIT, |t, _| {
        t.gpu_state(cg).vram_bytes == 768 * MIB
    })
    .await
    .unwrap();
    let held = tracer.gpu_state(cg);
    assert!(held.holds_anything());
    assert_eq!(
        held.open_fds, 6,
        "nvidiactl, nvidia0, two nvidia-uvm fds, and the OS-event nvidia0 fd and its dup"
    );
    assert_eq!(
        held.mappings, 2,
        "video memory through nvidia0 and system memory through nvidiactl"
    );
    let live = tracer.ledger().container(cg).unwrap().live_by_class();
    for c in [
        class::NV01_ROOT_CLIENT,
        class::NV01_DEVICE_0,
        class::NV20_SUBDEVICE_0,
        class::FERMI_VASPACE_A,
        class::NV01_MEMORY_LOCAL_USER,
        class::KEPLER_CHANNEL_GROUP_A,
        class::HOPPER_CHANNEL_GPFIFO_A,
        class::HOPPER_COMPUTE_A,
    ] {
        assert!(
            live.contains_key(&c),
            "class {} missing from the ledger: {live:?}",
            class::name(c).unwrap_or("?")
        );
    }
    let uvm = tracer.ledger().container(cg).unwrap().uvm;
    assert!(
        uvm.initialized >= 1 && uvm.gpus_registered >= 1 && uvm.va_spaces_registered >= 1,
        "{uvm:?}"
    );

    // Teardown: the ledger empties and every fd and mapping is gone.
    let summary = env.workload(w).finish().unwrap();
    events.extend(
        collect_until(&mut tracer, WAIT, |t, _| !t.gpu_state(cg).holds_anything())
            .await
            .unwrap(),
    );
    assert_eq!(tracer.gpu_state(cg), Default::default());

    // The decoded stream equals what the workload did.
    let seen: u64 = live.values().map(|n| *n as u64).sum();
    let allocated: u64 = summary.allocs_by_class.values().sum();
    assert_eq!(
        seen, allocated,
        "live objects while holding = objects the workload allocated"
    );
    assert_eq!(allocs_by_class(&events, pid), summary.allocs_by_class);
    let mut expected_calls = summary.escapes.clone();
    expected_calls.extend(summary.uvm_commands.clone());
    assert_eq!(calls_by_name(&events, pid), expected_calls);
    assert_eq!(opens(&events, pid), summary.fds_opened);
    assert!(
        events.iter().all(|e| e.cgroup_id == cg),
        "every event attributed to the workload's cgroup"
    );
    let order: Vec<&str> = events
        .iter()
        .filter_map(|e| match &e.body {
            Body::Ioctl(io) => Some(io.decoded.escape.as_ref()),
            _ => None,
        })
        .collect();
    let pos = |name: &str| {
        order
            .iter()
            .position(|n| *n == name)
            .unwrap_or_else(|| panic!("{name} not traced"))
    };
    assert!(
        pos("NV_ESC_RM_ALLOC") < pos("NV_ESC_REGISTER_FD")
            || pos("NV_ESC_CARD_INFO") < pos("NV_ESC_REGISTER_FD")
    );
    assert!(pos("UVM_INITIALIZE") < pos("UVM_REGISTER_GPU"));
}

#[tokio::test(flavor = "current_thread")]
async fn two_workloads_in_two_cgroups_are_attributed_to_their_own_container() {
    require_trace_env!();
    let mut env = TraceEnv::start("attrib", "595.45.04").unwrap();
    let a = env.make_cgroup("a").unwrap();
    let b = env.make_cgroup("b").unwrap();
    let mut tracer = env.tracer().unwrap();
    tracer.watch_cgroup(a).unwrap();
    tracer.watch_cgroup(b).unwrap();
    let wa = env.spawn_workload("a", 256, 2).unwrap();
    let wb = env.spawn_workload("b", 1024, 2).unwrap();
    env.workload(wa).wait_line("phase holding", WAIT).unwrap();
    env.workload(wb).wait_line("phase holding", WAIT).unwrap();
    let (pa, pb) = (env.workload(wa).pid(), env.workload(wb).pid());
    let events = collect_until(&mut tracer, WAIT, |t, _| {
        t.gpu_state(a).vram_bytes == 256 * MIB && t.gpu_state(b).vram_bytes == 1024 * MIB
    })
    .await
    .unwrap();
    for e in &events {
        let want = if e.pid == pa {
            a
        } else if e.pid == pb {
            b
        } else {
            panic!("event from a stranger pid {}", e.pid)
        };
        assert_eq!(
            e.cgroup_id, want,
            "event of pid {} in the wrong container",
            e.pid
        );
    }
    assert_eq!(tracer.gpu_state(a).open_fds, 6);
    assert_eq!(tracer.gpu_state(b).open_fds, 6);
    env.workload(wa).finish().unwrap();
    collect_until(&mut tracer, WAIT, |t, _| !t.gpu_state(a).holds_anything())
        .await
        .unwrap();
    assert!(
        tracer.gpu_state(b).holds_anything(),
        "b is untouched by a's teardown"
    );
    env.workload(wb).finish().unwrap();
    collect_until(&mut tracer, WAIT, |t, _| !t.gpu_state(b).holds_anything())
        .await
        .unwrap();
}

#[tokio::test(flavor = "current_thread")]
async fn a_process_that_opened_devices_before_tracing_is_tracked_from_proc() {
    require_trace_env!();
    let mut env = TraceEnv::start("seed", "595.45.04").unwrap();
    let cg = env.make_cgroup("early").unwrap();
    let w = env.spawn_workload("early", 128, 1).unwrap();
    env.workload(w).wait_line("phase holding", WAIT).unwrap();
    let pid = env.workload(w).pid();

    let mut tracer = env.tracer().unwrap();
    tracer.watch_cgroup(cg).unwrap();
    let seeded = tracer.gpu_state(cg);
    assert_eq!(
        (seeded.open_fds, seeded.mappings),
        (6, 2),
        "fds and mapping found in /proc"
    );
    assert!(
        tracer.ledger().container(cg).unwrap().partial,
        "objects allocated before tracing are unknown"
    );

    env.workload(w).finish().unwrap();
    let events = collect_until(&mut tracer, WAIT, |t, _| !t.gpu_state(cg).holds_anything())
        .await
        .unwrap();
    let closes = events
        .iter()
        .filter(|e| e.pid == pid && matches!(e.body, Body::Close { .. }))
        .count();
    assert_eq!(closes, 6, "the seeded fds' closes are traced");
    assert!(
        calls_by_name(&events, pid)
            .get("NV_ESC_RM_FREE")
            .is_some_and(|n| *n > 0),
        "teardown frees traced"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn an_unwatched_cgroup_is_not_traced() {
    require_trace_env!();
    let mut env = TraceEnv::start("unwatched", "595.45.04").unwrap();
    let watched = env.make_cgroup("watched").unwrap();
    env.make_cgroup("other").unwrap();
    let mut tracer = env.tracer().unwrap();
    tracer.watch_cgroup(watched).unwrap();
    let other = env.spawn_workload("other", 64, 1).unwrap();
    let mine = env.spawn_workload("watched", 64, 1).unwrap();
    env.workload(other)
        .wait_line("phase holding", WAIT)
        .unwrap();
    env.workload(mine).wait_line("phase holding", WAIT).unwrap();
    let other_pid = env.workload(other).pid();
    env.workload(other).finish().unwrap();
    env.workload(mine).finish().unwrap();
    let events = collect_until(&mut tracer, WAIT, |_, ev| {
        ev.iter().any(|e| matches!(e.body, Body::Exit))
    })
    .await
    .unwrap();
    assert!(!events.is_empty());
    assert!(
        events
            .iter()
            .all(|e| e.pid != other_pid && e.cgroup_id == watched)
    );
}

#[tokio::test(flavor = "current_thread")]
async fn release_and_reacquire_show_in_the_ledger() {
    require_trace_env!();
    let mut env = TraceEnv::start("toggle", "595.45.04").unwrap();
    let cg = env.make_cgroup("job").unwrap();
    let mut tracer = env.tracer().unwrap();
    tracer.watch_cgroup(cg).unwrap();
    let w = env.spawn_workload("job", 512, 1).unwrap();
    env.workload(w).wait_line("phase holding", WAIT).unwrap();
    collect_until(&mut tracer, WAIT, |t, _| {
        t.gpu_state(cg).vram_bytes == 512 * MIB
    })
    .await
    .unwrap();

    env.workload(w)
        .signal(nix::sys::signal::Signal::SIGUSR1)
        .unwrap();
    env.workload(w).wait_line("released", WAIT).unwrap();
    collect_until(&mut tracer, WAIT, |t, _| !t.gpu_state(cg).holds_anything())
        .await
        .unwrap();
    assert_eq!(
        tracer.gpu_state(cg),
        Default::default(),
        "nothing of the job is left in the driver"
    );

    env.workload(w)
        .signal(nix::sys::signal::Signal::SIGUSR2)
        .unwrap();
    env.workload(w).wait_line("reacquired", WAIT).unwrap();
    collect_until(&mut tracer, WAIT, |t, _| {
        t.gpu_state(cg).vram_bytes == 512 * MIB
    })
    .await
    .unwrap();
    env.workload(w).finish().unwrap();
}

#[tokio::test(flavor = "current_thread")]
async fn older_driver_layouts_decode_with_their_band() {
    require_trace_env!();
    for version in ["515.65.01", "530.30.02"] {
        let mut env = TraceEnv::start(&format!("band{}", &version[..3]), version).unwrap();
        let cg = env.make_cgroup("old").unwrap();
        let mut tracer = env.tracer().unwrap();
        tracer.watch_cgroup(cg).unwrap();
        let w = env.spawn_workload("old", 64, 1).unwrap();
        env.workload(w).wait_line("phase holding", WAIT).unwrap();
        let pid = env.workload(w).pid();
        let summary = env.workload(w).finish().unwrap();
        let events = collect_until(&mut tracer, WAIT, |_, ev| {
            ev.iter().any(|e| matches!(e.body, Body::Exit))
        })
        .await
        .unwrap();
        assert_eq!(
            allocs_by_class(&events, pid),
            summary.allocs_by_class,
            "driver {version}: statuses read at the band's offsets"
        );
    }
}

/// A process that dups its nvidiactl fd, closes the original, forks children that call the driver through the
/// inherited fd at once, then execs (the dup is CLOEXEC): every step shows in the events and the fd mirror.
/// Each child's call races user space's copy of the inherited fd (docs/design.md, Probes): none is missed.
#[tokio::test(flavor = "current_thread")]
async fn fds_are_followed_through_dup_fork_and_exec() {
    require_trace_env!();
    let Some(python) = skip::which("python3") else {
        skip::missing(
            "python3 not found: install Debian package python3 (the dup/fork/exec script)",
        );
        return;
    };
    let env = TraceEnv::start("fdlife", "595.45.04").unwrap();
    let cg = env.make_cgroup("p").unwrap();
    let mut tracer = env.tracer().unwrap();
    tracer.watch_cgroup(cg).unwrap();
    let cmd = baton_nvidia::ioc::iowr(
        baton_nvidia::ioc::NV_IOCTL_MAGIC,
        baton_nvidia::escape::RM_FREE,
        baton_nvidia::params::nvos00::SIZE,
    );
    let script = format!(
        r#"
import fcntl, os, sys
fd = os.open("{dev}/nvidiactl", os.O_RDWR)
fd2 = os.dup(fd)          # CLOEXEC, as Python makes every new fd
os.close(fd)
children = []
for _ in range({FORKS}):
    pid = os.fork()
    if pid == 0:
        try:              # at once: before user space can have copied the inherited fd
            fcntl.ioctl(fd2, {cmd}, bytearray(16))
        except OSError:
            pass
        os._exit(0)
    os.waitpid(pid, 0)
    children.append(pid)
print(fd2, *children, flush=True)
os.execv("/bin/sleep", ["sleep", "0.3"])
"#,
        dev = env.dev_dir().display()
    );
    let cg_path = baton_tracer::cgroups::find_v2_root()
        .unwrap()
        .join(env.cgroup_rel("p").trim_start_matches('/'));
    // The tracer must read events while the script runs: it copies the inherited fd into the kernel map when
    // it sees the fork.
    let script_run = tokio::process::Command::from(baton_tracer::cgroups::command_in(
        &cg_path,
        &python,
        &["-c".into(), script],
    ))
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::piped())
    .output();
    let traced = collect_until(&mut tracer, WAIT, |_, ev| {
        ev.iter().any(|e| matches!(e.body, Body::Exec))
    });
    let (out, events) = tokio::join!(script_run, traced);
    let (out, events) = (out.unwrap(), events.unwrap());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed = String::from_utf8_lossy(&out.stdout);
    let mut it = printed
        .split_whitespace()
        .map(|s| s.parse::<i32>().unwrap());
    let dup_fd = it.next().unwrap();
    let children: Vec<u32> = it.map(|pid| pid as u32).collect();
    assert_eq!(children.len(), FORKS);
    let parent = events
        .iter()
        .find(|e| matches!(e.body, Body::Open { .. }))
        .expect("open traced")
        .pid;
    let kinds: Vec<String> = events
        .iter()
        .map(|e| match &e.body {
            Body::Open { fd, .. } => format!("{} open {fd}", e.pid),
            Body::Dup { fd, old_fd, .. } => format!("{} dup {old_fd}->{fd}", e.pid),
            Body::Close { fd } => format!("{} close {fd}", e.pid),
            Body::Fork { child } => format!("{} fork {child}", e.pid),
            Body::Ioctl(io) => format!("{} ioctl {} {}", e.pid, io.fd, io.decoded.escape),
            Body::Exec => format!("{} exec", e.pid),
            Body::Exit => format!("{} exit", e.pid),
            other => format!("{} {other:?}", e.pid),
        })
        .collect();
    let has = |s: String| assert!(kinds.contains(&s), "{s:?} not in {kinds:#?}");
    has(format!("{parent} dup {}->{dup_fd}", old_fd(&events)));
    for child in children {
        has(format!("{parent} fork {child}"));
        has(format!("{child} ioctl {dup_fd} NV_ESC_RM_FREE"));
    }
    has(format!("{parent} exec"));
    assert!(
        tracer.fd_table().get(parent).is_none(),
        "the CLOEXEC fd is gone after exec: {:?}",
        tracer.fd_table().get(parent)
    );
}

/// A child that closes its inherited nvidiactl fd at once, before user space can have copied it, and reuses the
/// number for /dev/null: the close is traced, and the copy of the parent's table made afterwards does not bring
/// the fd back (none of the child's many ioctls on /dev/null is taken for a driver call).
#[tokio::test(flavor = "current_thread")]
async fn an_inherited_fd_the_child_closes_at_once_stays_closed() {
    require_trace_env!();
    let Some(python) = skip::which("python3") else {
        skip::missing("python3 not found: install Debian package python3 (the fork script)");
        return;
    };
    let env = TraceEnv::start("fdclose", "595.45.04").unwrap();
    let cg = env.make_cgroup("p").unwrap();
    let mut tracer = env.tracer().unwrap();
    tracer.watch_cgroup(cg).unwrap();
    let cmd = baton_nvidia::ioc::iowr(
        baton_nvidia::ioc::NV_IOCTL_MAGIC,
        baton_nvidia::escape::RM_FREE,
        baton_nvidia::params::nvos00::SIZE,
    );
    let script = format!(
        r#"
import fcntl, os
fd = os.open("{dev}/nvidiactl", os.O_RDWR)
pid = os.fork()
if pid == 0:
    os.close(fd)
    null = os.open("/dev/null", os.O_RDWR)
    assert null == fd, (null, fd)
    for _ in range(20000):
        try:
            fcntl.ioctl(null, {cmd}, bytearray(16))
        except OSError:
            pass
    os._exit(0)
_, status = os.waitpid(pid, 0)
assert status == 0, status
print(fd, pid, flush=True)
"#,
        dev = env.dev_dir().display()
    );
    let cg_path = baton_tracer::cgroups::find_v2_root()
        .unwrap()
        .join(env.cgroup_rel("p").trim_start_matches('/'));
    let script_run = tokio::process::Command::from(baton_tracer::cgroups::command_in(
        &cg_path,
        &python,
        &["-c".into(), script],
    ))
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::piped())
    .output();
    let parent_exited = |ev: &[Event]| {
        let parent = ev
            .iter()
            .find(|e| matches!(e.body, Body::Open { .. }))
            .map(|e| e.pid);
        ev.iter()
            .any(|e| matches!(e.body, Body::Exit) && Some(e.pid) == parent)
    };
    let traced = collect_until(&mut tracer, WAIT, |_, ev| parent_exited(ev));
    let (out, events) = tokio::join!(script_run, traced);
    let (out, events) = (out.unwrap(), events.unwrap());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed = String::from_utf8_lossy(&out.stdout);
    let mut it = printed
        .split_whitespace()
        .map(|s| s.parse::<u32>().unwrap());
    let (fd, child) = (it.next().unwrap() as i32, it.next().unwrap());
    assert!(
        events
            .iter()
            .any(|e| e.pid == child && matches!(e.body, Body::Close { fd: f } if f == fd)),
        "the child's close of its inherited fd is traced"
    );
    let child_ioctls = events
        .iter()
        .filter(|e| e.pid == child && matches!(e.body, Body::Ioctl(_)))
        .count();
    assert_eq!(
        child_ioctls, 0,
        "ioctls on /dev/null taken for driver calls"
    );
    assert!(tracer.fd_table().get(child).is_none());
}

/// The fd the first open returned.
fn old_fd(events: &[Event]) -> i32 {
    events
        .iter()
        .find_map(|e| {
            if let Body::Open { fd, .. } = e.body {
                Some(fd)
            } else {
                None
            }
        })
        .unwrap()
}
