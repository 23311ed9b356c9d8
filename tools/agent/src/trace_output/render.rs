//! strace-like one-line rendering of trace events.
use baton_nvidia::fdkind;
use baton_tracer::{
    LaunchCounts, LaunchFn,
    event::{Body, Event},
    launch::LaunchLibrary,
    schema::{StateChange, status_name},
};

/// A container's launches over an interval: `   3.000120 default/trainer launches/1.00s cuLaunchKernel=1000
/// cuLaunchKernelEx=200 cuGraphLaunch=30`.
pub fn launch_line(
    ts_ns: u64,
    container: &str,
    interval_ns: u64,
    n: &LaunchCounts,
    t0_ns: u64,
) -> String {
    let t = ts_ns.saturating_sub(t0_ns);
    let counts: Vec<String> = LaunchFn::ALL
        .iter()
        .map(|f| format!("{}={}", f.symbol(), n.get(*f)))
        .collect();
    format!(
        "{:>4}.{:06} {container} launches/{:.2}s {}",
        t / 1_000_000_000,
        (t / 1000) % 1_000_000,
        interval_ns as f64 / 1e9,
        counts.join(" ")
    )
}

/// Launch counting began for a libcuda file: `   0.038999 pid 4242: +++ launch uprobes on cuLaunchKernel
/// cuLaunchKernelEx cuGraphLaunch of /proc/4242/root/usr/lib/libcuda.so.1 +++`.
pub fn launch_probes_line(ts_ns: u64, lib: &LaunchLibrary, t0_ns: u64) -> String {
    let t = ts_ns.saturating_sub(t0_ns);
    let fns: Vec<&str> = lib.probed.iter().map(|f| f.symbol()).collect();
    format!(
        "{:>4}.{:06} pid {}: +++ launch uprobes on {} of {} +++",
        t / 1_000_000_000,
        (t / 1000) % 1_000_000,
        lib.pid,
        fns.join(" "),
        lib.path.display()
    )
}

/// A state change the agent made: `   1.204100 default/trainer +++ frozen (confirmed in 52 us) +++`, or
/// `+++ preemption: GPU released (pid 42) +++`.
pub fn state_line(c: &StateChange<'_>, t0_ns: u64) -> String {
    let t = c.ts_ns.saturating_sub(t0_ns);
    let what = match (c.phase, c.latency_ns) {
        (Some(phase), _) => match c.detail {
            Some(d) => format!("{}: {phase} ({d})", c.event),
            None => format!("{}: {phase}", c.event),
        },
        (None, Some(ns)) if ns > 0 => format!("{} (confirmed in {} us)", c.event, ns / 1000),
        _ => c.event.to_owned(),
    };
    format!(
        "{:>4}.{:06} {} +++ {what} +++",
        t / 1_000_000_000,
        (t / 1000) % 1_000_000,
        c.container
    )
}

/// `HH:MM:SS.micro`-style relative time, container, pid/tid, call, decoded fields, result, latency.
pub fn line(e: &Event, container: &str, t0_ns: u64) -> String {
    let t = e.ts_ns.saturating_sub(t0_ns);
    let head = format!(
        "{:>4}.{:06} {container} {}/{}",
        t / 1_000_000_000,
        (t / 1000) % 1_000_000,
        e.pid,
        e.tid
    );
    match &e.body {
        Body::Ioctl(io) => {
            let fields: Vec<String> = io.decoded.fields.iter().map(ToString::to_string).collect();
            let result = match (io.ret, io.decoded.status) {
                (0, Some(s)) => status_name(s, io.decoded.version),
                (0, None) => "0".to_owned(),
                (r, _) => format!("{r} ({})", nix::errno::Errno::from_raw(-r as i32)),
            };
            format!(
                "{head} {}({}, {}) -> {result} <{}.{:06}>",
                io.decoded.escape,
                fdkind::label(io.fd_kind, io.minor),
                fields.join(" "),
                io.latency_ns / 1_000_000_000,
                (io.latency_ns / 1000) % 1_000_000,
            )
        }
        Body::Open { fd, name, .. } => format!("{head} open({name}) = {fd}"),
        Body::Close { fd } => format!("{head} close({fd})"),
        Body::Dup { fd, old_fd, .. } => format!("{head} dup({old_fd}) = {fd}"),
        Body::Mmap { fd, addr, len } => format!("{head} mmap(fd={fd}, len={len}) = 0x{addr:x}"),
        Body::Munmap { addr, len } => format!("{head} munmap(0x{addr:x}, {len})"),
        Body::MapFixed { addr, len } => {
            format!("{head} mmap(0x{addr:x}, {len}, MAP_FIXED) over a device mapping")
        }
        Body::Mremap {
            old_addr,
            old_len,
            new_addr,
            new_len,
            flags,
        } => format!(
            "{head} mremap(0x{old_addr:x}, {old_len}, {new_len}, 0x{flags:x}) = 0x{new_addr:x}"
        ),
        Body::Madvise {
            addr,
            len,
            dont_fork,
        } => {
            let advice = if *dont_fork {
                "MADV_DONTFORK"
            } else {
                "MADV_DOFORK"
            };
            format!("{head} madvise(0x{addr:x}, {len}, {advice})")
        }
        Body::CloseRange { first, last, flags } => {
            format!("{head} close_range({first}, {last}, 0x{flags:x})")
        }
        Body::Exec => format!("{head} exec"),
        Body::Lost { call, fd } => format!(
            "{head} {}({fd}): record lost (no room in flight): its file counts as holding, or the process is \
             re-read from /proc once the call returns",
            call.name()
        ),
        Body::Resync { lost } => {
            format!(
                "{head} {lost} records lost (ring buffer full): fds and mappings re-read from /proc"
            )
        }
        Body::Exit => format!("{head} exit"),
        Body::ThreadExit => format!("{head} thread exit"),
        Body::Confirm { kind, marked_ns } => format!(
            "{head} confirm({}) {} ns after the removal",
            kind.label(),
            e.ts_ns.saturating_sub(*marked_ns)
        ),
        Body::Fork { child } => format!("{head} fork() = {child}"),
    }
}
