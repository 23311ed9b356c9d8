//! The JSON schema of trace events (`baton trace --json`): one object per event. This is the one definition
//! of that schema; `baton trace`, tests and later the shim's event export all serialise through it.
use baton_nvidia::{
    decode::{self, Field},
    fdkind, status,
};
use serde::Serialize;

use crate::event::{Body, Event};

/// One event as `baton trace --json` prints it.
#[derive(Debug, Serialize)]
pub struct TraceEvent<'a> {
    /// CLOCK_MONOTONIC time, ns.
    pub ts_ns: u64,
    /// cgroup v2 id.
    pub cgroup_id: u64,
    /// Container name derived from the cgroup path.
    pub container: &'a str,
    /// Process id.
    pub pid: u32,
    /// Thread id.
    pub tid: u32,
    /// `ioctl`, `open`, `close`, `dup`, `mmap`, `munmap`, `map_fixed`, `mremap`, `madvise`, `exec`, `exit`,
    /// `fork`; `lost` (a call whose record the probes could not keep: `name` says which syscall).
    pub event: &'static str,
    /// The fd, when the event has one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fd: Option<i32>,
    /// Device file: `ctl`, `nvidia0`, `uvm`, ...
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fd_kind: Option<String>,
    /// Escape or UVM command name (ioctl).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub escape: Option<&'a str>,
    /// Raw ioctl command.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cmd: Option<u32>,
    /// RM status from the params struct (ioctl).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<u32>,
    /// Its name (`NV_OK`, `NV_ERR_INVALID_CLASS`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status_name: Option<String>,
    /// Syscall return value (ioctl).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ret: Option<i64>,
    /// Time in the driver (ioctl), ns.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub latency_ns: Option<u64>,
    /// Decoded parameter fields (ioctl), as an object in the struct's order (`{"hRoot": 3235905537, ...}`).
    #[serde(
        skip_serializing_if = "Option::is_none",
        serialize_with = "fields_object"
    )]
    pub fields: Option<&'a [Field]>,
    /// Device file name (open).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<&'a str>,
    /// Duplicated fd (dup).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub old_fd: Option<i32>,
    /// Mapping address (mmap, munmap).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub addr: Option<u64>,
    /// Mapping length (mmap, munmap).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub len: Option<u64>,
    /// Child pid (fork).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub child: Option<u32>,
    /// Where a remapped range is now (mremap; `addr`/`len` are where it was).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub new_addr: Option<u64>,
    /// Its length now (mremap).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub new_len: Option<u64>,
    /// mremap flags, or the madvise advice (`dontfork`, `dofork`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub flags: Option<String>,
    /// The captured parameter bytes, hex (ioctl; only with `--raw`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub params: Option<String>,
    /// The captured bytes behind the inner pointer, hex (ioctl; only with `--raw`, when there are any).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nested: Option<String>,
}

fn fields_object<S: serde::Serializer>(fields: &Option<&[Field]>, s: S) -> Result<S::Ok, S::Error> {
    match fields {
        Some(f) => decode::fields_as_map(f, s),
        None => s.serialize_none(),
    }
}

/// The name of an RM status as driver `v` numbers it (0x8b and 0x8c were renumbered), or its hex value.
pub fn status_name(s: u32, v: baton_nvidia::layout::DriverVersion) -> String {
    status::name_for(s, v).map_or_else(|| format!("0x{s:x}"), str::to_owned)
}

impl<'a> TraceEvent<'a> {
    /// The JSON view of `e`, attributed to `container`.
    pub fn new(e: &'a Event, container: &'a str) -> Self {
        let mut t = TraceEvent {
            ts_ns: e.ts_ns,
            cgroup_id: e.cgroup_id,
            container,
            pid: e.pid,
            tid: e.tid,
            event: "",
            fd: None,
            fd_kind: None,
            escape: None,
            cmd: None,
            status: None,
            status_name: None,
            ret: None,
            latency_ns: None,
            fields: None,
            name: None,
            old_fd: None,
            addr: None,
            len: None,
            child: None,
            new_addr: None,
            new_len: None,
            flags: None,
            params: None,
            nested: None,
        };
        match &e.body {
            Body::Ioctl(io) => {
                t.event = "ioctl";
                t.fd = Some(io.fd);
                t.fd_kind = Some(fdkind::label(io.fd_kind, io.minor));
                t.escape = Some(&io.decoded.escape);
                t.cmd = Some(io.cmd);
                t.status = io.decoded.status;
                t.status_name = io
                    .decoded
                    .status
                    .map(|s| status_name(s, io.decoded.version));
                t.ret = Some(io.ret);
                t.latency_ns = Some(io.latency_ns);
                t.fields = Some(&io.decoded.fields);
            }
            Body::Open {
                fd,
                kind,
                minor,
                name,
            } => {
                t.event = "open";
                t.fd = Some(*fd);
                t.fd_kind = Some(fdkind::label(*kind, *minor));
                t.name = Some(name);
            }
            Body::Close { fd } => {
                t.event = "close";
                t.fd = Some(*fd);
            }
            Body::Dup {
                fd,
                old_fd,
                kind,
                minor,
            } => {
                t.event = "dup";
                t.fd = Some(*fd);
                t.old_fd = Some(*old_fd);
                t.fd_kind = Some(fdkind::label(*kind, *minor));
            }
            Body::Mmap { fd, addr, len } => {
                t.event = "mmap";
                t.fd = Some(*fd);
                t.addr = Some(*addr);
                t.len = Some(*len);
            }
            Body::Munmap { addr, len } => {
                t.event = "munmap";
                t.addr = Some(*addr);
                t.len = Some(*len);
            }
            Body::MapFixed { addr, len } => {
                t.event = "map_fixed";
                t.addr = Some(*addr);
                t.len = Some(*len);
            }
            Body::Mremap {
                old_addr,
                old_len,
                new_addr,
                new_len,
                flags,
            } => {
                t.event = "mremap";
                t.addr = Some(*old_addr);
                t.len = Some(*old_len);
                t.new_addr = Some(*new_addr);
                t.new_len = Some(*new_len);
                t.flags = Some(format!("0x{flags:x}"));
            }
            Body::Madvise {
                addr,
                len,
                dont_fork,
            } => {
                t.event = "madvise";
                t.addr = Some(*addr);
                t.len = Some(*len);
                t.flags = Some(if *dont_fork { "dontfork" } else { "dofork" }.to_owned());
            }
            Body::CloseRange { first, last, .. } => {
                t.event = "close_range";
                t.fd = Some(*first as i32);
                t.addr = Some(u64::from(*first));
                t.len = Some(u64::from(*last));
            }
            Body::Exec => t.event = "exec",
            Body::Resync { lost } => {
                t.event = "resync";
                t.len = Some(*lost);
            }
            Body::Lost { call, fd } => {
                t.event = "lost";
                t.name = Some(call.name());
                t.fd = (*fd >= 0).then_some(*fd);
            }
            Body::Exit => t.event = "exit",
            Body::ThreadExit => t.event = "thread-exit",
            Body::Confirm { kind, marked_ns } => {
                t.event = "confirm";
                t.name = Some(kind.label());
                t.latency_ns = Some(e.ts_ns.saturating_sub(*marked_ns));
            }
            Body::Fork { child } => {
                t.event = "fork";
                t.child = Some(*child);
            }
        }
        t
    }

    /// Adds the captured bytes of an ioctl (`params`, and `nested` when there are any), so that the trace
    /// can be decoded again (a golden trace replayed by a later decoder).
    pub fn with_raw(mut self, e: &Event) -> Self {
        if let Body::Ioctl(io) = &e.body {
            self.params = Some(hex::encode(io.raw.data()));
            self.nested = (!io.raw.nested().is_empty()).then(|| hex::encode(io.raw.nested()));
        }
        self
    }
}

/// A container's CUDA launches over one interval, as `baton trace --json` prints them (`"event":
/// "launches"`): the deltas of [`crate::Tracer::launches`] since the previous object for that container.
#[derive(Debug, Serialize)]
pub struct LaunchWindow<'a> {
    /// CLOCK_MONOTONIC time at the end of the interval, ns.
    pub ts_ns: u64,
    /// cgroup v2 id.
    pub cgroup_id: u64,
    /// Container name derived from the cgroup path.
    pub container: &'a str,
    /// Always `launches`.
    pub event: &'static str,
    /// Length of the interval, ns.
    pub interval_ns: u64,
    /// Calls of `cuLaunchKernel` (`kernel`), `cuLaunchKernelEx` (`kernel_ex`), `cuGraphLaunch` (`graph`) in it.
    #[serde(flatten)]
    pub launches: crate::LaunchCounts,
}

/// The launch uprobes were attached to a libcuda file, as `baton trace --json` prints it (`"event":
/// "launch_probes"`): from then on the launches of every traced process that maps the file are counted.
#[derive(Debug, Serialize)]
pub struct LaunchProbes<'a> {
    /// CLOCK_MONOTONIC time at which the trace saw it, ns.
    pub ts_ns: u64,
    /// Always `launch_probes`.
    pub event: &'static str,
    /// The process it was found through.
    pub pid: u32,
    /// The file, through that process's `/proc/PID/root`.
    pub path: &'a std::path::Path,
    /// The entry points probed (`cuLaunchKernel`, `cuLaunchKernelEx`, `cuGraphLaunch`).
    pub entry_points: Vec<&'static str>,
}

/// A freeze, thaw or preemption step of a container, as `baton trace --json` prints it through the agent
/// (`"event": "frozen" | "thawed" | "preemption"`).
#[derive(Debug, Serialize)]
pub struct StateChange<'a> {
    /// CLOCK_MONOTONIC time, ns (the kernel's confirmation, for a freeze or a thaw).
    pub ts_ns: u64,
    /// cgroup v2 id.
    pub cgroup_id: u64,
    /// Container name derived from the cgroup path.
    pub container: &'a str,
    /// `frozen`, `thawed` or `preemption`.
    pub event: &'static str,
    /// The preemption step (`locked`, `gpu released`, `done`, ...).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub phase: Option<&'a str>,
    /// What the step says.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<&'a str>,
    /// From the write to the kernel's confirmation (freeze, thaw), ns.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub latency_ns: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::status_name;
    use baton_nvidia::layout::DriverVersion;

    /// 0x8b named as the traced driver numbers it (NVIDIA's src/common/sdk/nvidia/inc/nvstatuscodes.h at
    /// 590.48.01 and 595.45.04), and an unnamed status in hex.
    #[test]
    fn a_status_is_named_as_the_traced_driver_numbers_it() {
        assert_eq!(
            status_name(0x8b, DriverVersion::new(590, 48, 1)),
            "NV_ERR_DMA_XFER_FAILED"
        );
        assert_eq!(
            status_name(0x8b, DriverVersion::new(595, 45, 4)),
            "NV_ERR_OPERATION_ABORTED"
        );
        assert_eq!(
            status_name(0xfff0, DriverVersion::new(595, 45, 4)),
            "0xfff0"
        );
    }
}
