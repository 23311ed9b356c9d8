//! Typed events parsed from the probes' ring-buffer records, with ioctls decoded through `baton-nvidia`.
use baton_nvidia::{
    decode::{self, Call, Decoded},
    fdkind::FdKind,
    layout::Layout,
};
use baton_probe_common::{
    ConfirmReason, DATA_CAP, EnterReading, FdRecord, Header, IoctlRecord, MapRecord, NAME_CAP,
    NESTED_CAP, RecordKind, Sys,
};

use crate::release::ConfirmKind;

/// One thing a traced process did to the NVIDIA driver.
#[derive(Clone, Debug)]
pub struct Event {
    /// CLOCK_MONOTONIC time, ns.
    pub ts_ns: u64,
    /// cgroup v2 id of the caller.
    pub cgroup_id: u64,
    /// Process id.
    pub pid: u32,
    /// Thread id.
    pub tid: u32,
    /// What happened.
    pub body: Body,
}

/// The kind-specific part of an event.
#[derive(Clone, Debug)]
pub enum Body {
    /// An ioctl into the driver.
    Ioctl(Box<Ioctl>),
    /// A device file was opened.
    Open {
        /// The new fd.
        fd: i32,
        /// Which device.
        kind: FdKind,
        /// Device minor.
        minor: u8,
        /// Device file name (`nvidiactl`).
        name: String,
    },
    /// An NVIDIA fd was closed.
    Close {
        /// The fd.
        fd: i32,
    },
    /// An NVIDIA fd was duplicated.
    Dup {
        /// The new fd.
        fd: i32,
        /// The fd it duplicates.
        old_fd: i32,
        /// Which device.
        kind: FdKind,
        /// Device minor.
        minor: u8,
    },
    /// A device file was mapped.
    Mmap {
        /// The fd mapped.
        fd: i32,
        /// Mapping address.
        addr: u64,
        /// Mapping length.
        len: u64,
    },
    /// A holder unmapped a range.
    Munmap {
        /// Start.
        addr: u64,
        /// Length.
        len: u64,
    },
    /// A holder's mmap(MAP_FIXED) replaced whatever was mapped in a range, as an munmap of it would (an
    /// NVIDIA mapping made by the same call follows as `Mmap`).
    MapFixed {
        /// Start.
        addr: u64,
        /// Length.
        len: u64,
    },
    /// A holder's mremap moved, shrank or grew a range (`old_len` 0: a shared mapping duplicated).
    Mremap {
        /// The range's start before.
        old_addr: u64,
        /// Its length before.
        old_len: u64,
        /// Its start now.
        new_addr: u64,
        /// Its length now.
        new_len: u64,
        /// mremap flags.
        flags: u32,
    },
    /// A holder's madvise changed whether a fork copies the mappings of a range.
    Madvise {
        /// Start.
        addr: u64,
        /// Length.
        len: u64,
        /// `MADV_DONTFORK` (true) or `MADV_DOFORK` (false).
        dont_fork: bool,
    },
    /// A holder closed the fds `first..=last` with close_range (only the NVIDIA ones among them matter).
    CloseRange {
        /// First fd of the range.
        first: u32,
        /// Last fd of the range (inclusive).
        last: u32,
        /// close_range flags (`CLOSE_RANGE_UNSHARE`).
        flags: u32,
    },
    /// A holder called exec.
    Exec,
    /// A holder exited (its last thread did).
    Exit,
    /// A thread of a holder exited, others remain.
    ThreadExit,
    /// The thread is past the kernel's deferred release of what it removed (see `crate::release`).
    Confirm {
        /// How that is known.
        kind: crate::release::ConfirmKind,
        /// When the thread was marked (its removal's syscall exit, exec or exit), CLOCK_MONOTONIC ns.
        marked_ns: u64,
    },
    /// The probes could not keep the record of a call this thread began (its in-flight slot was another
    /// thread's and the overflow was full): what the call does is unknown. Its container's ledger is partial
    /// from now on, and the process is read again from /proc once the call has returned.
    Lost {
        /// Which call.
        call: baton_probe_common::Sys,
        /// Its fd (-1: none, or not known at its enter).
        fd: i32,
    },
    /// Records were lost (the ring buffer was full): the mirror was rebuilt from /proc (`cgroup_id` 0).
    Resync {
        /// Records lost since the last resync.
        lost: u64,
    },
    /// A holder forked.
    Fork {
        /// The child's pid.
        child: u32,
    },
}

/// A decoded ioctl.
#[derive(Clone, Debug)]
pub struct Ioctl {
    /// The fd.
    pub fd: i32,
    /// Which device file it went to.
    pub fd_kind: FdKind,
    /// Device minor.
    pub minor: u8,
    /// The raw command.
    pub cmd: u32,
    /// The syscall's return value.
    pub ret: i64,
    /// Time in the driver, ns.
    pub latency_ns: u64,
    /// Decoded parameters, status and operation.
    pub decoded: Decoded,
    /// The allocation or free the params named at the syscall's entry, before the driver read them (`None`
    /// for other calls, or when they could not be read): see `ledger::readings`.
    pub enter: Option<decode::Op>,
    /// The bytes the probe captured, as the decoder read them (`baton trace --json --raw` prints them, so
    /// that a trace can be replayed through the decoder).
    pub raw: RawParams,
}

/// The parameter bytes captured for one ioctl: those at its argument and those behind the pointer that
/// matters (see [`baton_nvidia::decode::Call`]). Kept inline: the event is boxed already.
#[derive(Clone, Debug)]
pub struct RawParams {
    data: [u8; DATA_CAP],
    data_len: usize,
    nested: [u8; NESTED_CAP],
    nested_len: usize,
}

impl RawParams {
    /// The first [`DATA_CAP`] bytes of `data` and [`NESTED_CAP`] of `nested`.
    pub fn new(data: &[u8], nested: &[u8]) -> Self {
        let mut raw = Self {
            data: [0; DATA_CAP],
            data_len: data.len().min(DATA_CAP),
            nested: [0; NESTED_CAP],
            nested_len: nested.len().min(NESTED_CAP),
        };
        raw.data[..raw.data_len].copy_from_slice(&data[..raw.data_len]);
        raw.nested[..raw.nested_len].copy_from_slice(&nested[..raw.nested_len]);
        raw
    }

    /// The bytes at the ioctl's argument.
    pub fn data(&self) -> &[u8] {
        &self.data[..self.data_len]
    }

    /// The bytes behind its inner pointer (empty when none were captured).
    pub fn nested(&self) -> &[u8] {
        &self.nested[..self.nested_len]
    }
}

/// Errors parsing a record.
#[derive(Debug, thiserror::Error)]
pub enum ParseError {
    /// The record is shorter than its kind needs.
    #[error("ring-buffer record of {len} bytes is too short for kind {kind}")]
    Short {
        /// Bytes received.
        len: usize,
        /// The kind field.
        kind: u32,
    },
    /// Unknown kind.
    #[error("ring-buffer record of unknown kind {0}")]
    UnknownKind(u32),
}

/// Copies a `#[repr(C)]` plain-old-data record out of the ring buffer's bytes.
fn read_pod<T: Copy>(bytes: &[u8]) -> Option<T> {
    if bytes.len() < size_of::<T>() {
        return None;
    }
    // SAFETY: the length is checked above, the read is unaligned-safe, and T is one of the probe-common records:
    // plain integers and byte arrays for which every bit pattern is valid.
    Some(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<T>()) })
}

/// Parses one ring-buffer record.
pub fn parse(bytes: &[u8], layout: &Layout) -> Result<Event, ParseError> {
    let hdr: Header = read_pod(bytes).ok_or(ParseError::Short {
        len: bytes.len(),
        kind: 0,
    })?;
    let kind = RecordKind::from_u32(hdr.kind).ok_or(ParseError::UnknownKind(hdr.kind))?;
    let short = ParseError::Short {
        len: bytes.len(),
        kind: hdr.kind,
    };
    let body = match kind {
        RecordKind::Ioctl => {
            let rec: IoctlRecord = read_pod(bytes).ok_or(short)?;
            Body::Ioctl(Box::new(ioctl(&rec, layout)))
        }
        RecordKind::Mremap => {
            let rec: MapRecord = read_pod(bytes).ok_or(short)?;
            Body::Mremap {
                old_addr: rec.old_addr,
                old_len: rec.old_len,
                new_addr: rec.new_addr,
                new_len: rec.new_len,
                flags: rec.flags,
            }
        }
        _ => {
            let rec: FdRecord = read_pod(bytes).ok_or(short)?;
            fd_body(kind, &rec).ok_or(ParseError::UnknownKind(hdr.kind))?
        }
    };
    Ok(Event {
        ts_ns: hdr.ts_ns,
        cgroup_id: hdr.cgroup_id(),
        pid: hdr.pid,
        tid: hdr.tid,
        body,
    })
}

fn ioctl(rec: &IoctlRecord, layout: &Layout) -> Ioctl {
    let fd_kind = FdKind::from_u8(rec.fd_kind);
    let data = &rec.data[..usize::from(rec.data_len).min(DATA_CAP)];
    let nested = &rec.nested[..usize::from(rec.nested_len).min(NESTED_CAP)];
    let decoded = decode::decode(
        &Call {
            fd_kind,
            cmd: rec.cmd,
            data,
            nested,
        },
        layout,
    );
    Ioctl {
        fd: rec.fd,
        fd_kind,
        minor: rec.minor,
        cmd: rec.cmd,
        ret: rec.ret,
        latency_ns: rec.latency_ns,
        decoded,
        enter: enter_op(&rec.enter),
        raw: RawParams::new(data, nested),
    }
}

/// The operation the probes' reading at the syscall's entry names.
pub fn enter_op(e: &EnterReading) -> Option<decode::Op> {
    decode::op_at_enter(&decode::EnterFields {
        nr: e.nr,
        len: e.len,
        client: e.client,
        parent: e.parent,
        object: e.object,
        class: e.class,
        size: (e.size_read != 0).then_some(e.size),
    })
}

/// The body of an fd lifecycle record (`None` for kinds that are not carried by an `FdRecord`).
fn fd_body(kind: RecordKind, rec: &FdRecord) -> Option<Body> {
    let fd_kind = FdKind::from_u8(rec.fd_kind);
    Some(match kind {
        RecordKind::Open => Body::Open {
            fd: rec.fd,
            kind: fd_kind,
            minor: rec.minor,
            name: name(&rec.name),
        },
        RecordKind::Close => Body::Close { fd: rec.fd },
        RecordKind::Dup => Body::Dup {
            fd: rec.fd,
            old_fd: rec.aux,
            kind: fd_kind,
            minor: rec.minor,
        },
        RecordKind::Mmap => Body::Mmap {
            fd: rec.fd,
            addr: rec.addr,
            len: rec.len,
        },
        RecordKind::Munmap => Body::Munmap {
            addr: rec.addr,
            len: rec.len,
        },
        RecordKind::CloseRange => Body::CloseRange {
            first: rec.addr.min(u64::from(u32::MAX)) as u32,
            last: rec.len.min(u64::from(u32::MAX)) as u32,
            flags: rec.aux as u32,
        },
        RecordKind::Exec => Body::Exec,
        RecordKind::Exit if rec.aux != 0 => Body::Exit,
        RecordKind::Exit => Body::ThreadExit,
        RecordKind::Confirm => Body::Confirm {
            kind: if rec.aux == ConfirmReason::Exited as i32 {
                ConfirmKind::Exited
            } else {
                ConfirmKind::Returned
            },
            marked_ns: rec.addr,
        },
        RecordKind::Fork => Body::Fork {
            child: rec.aux as u32,
        },
        RecordKind::MapFixed => Body::MapFixed {
            addr: rec.addr,
            len: rec.len,
        },
        RecordKind::Madvise => Body::Madvise {
            addr: rec.addr,
            len: rec.len,
            dont_fork: rec.aux == MADV_DONTFORK,
        },
        RecordKind::Lost => Body::Lost {
            call: u8::try_from(rec.aux).ok().and_then(Sys::from_u8)?,
            fd: rec.fd,
        },
        RecordKind::Ioctl | RecordKind::Mremap => return None,
    })
}

/// The madvise advice that keeps a mapping out of a forked child.
const MADV_DONTFORK: i32 = 10;

fn name(raw: &[u8; NAME_CAP]) -> String {
    let end = raw.iter().position(|b| *b == 0).unwrap_or(NAME_CAP);
    String::from_utf8_lossy(&raw[..end]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn as_bytes<T: Copy>(v: &T) -> Vec<u8> {
        // SAFETY: test records are plain #[repr(C)] data; reading their bytes is what the ring buffer does.
        unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), size_of::<T>()) }.to_vec()
    }

    fn open_record() -> FdRecord {
        let mut name = [0u8; NAME_CAP];
        name[..9].copy_from_slice(b"nvidiactl");
        FdRecord {
            hdr: Header {
                kind: RecordKind::Open as u32,
                pid: 10,
                tid: 11,
                cgroup_id_lo: 5,
                cgroup_id_hi: 1,
                _pad: 0,
                ts_ns: 99,
            },
            fd: 3,
            aux: -1,
            fd_kind: FdKind::Ctl as u8,
            minor: 255,
            _pad: [0; 6],
            addr: 0,
            len: 0,
            name,
        }
    }

    #[test]
    fn records_parse_into_events_and_bad_ones_are_errors() {
        let bytes = as_bytes(&open_record());
        let e = parse(&bytes, &Layout::DEFAULT).unwrap();
        assert_eq!(
            (e.pid, e.tid, e.ts_ns, e.cgroup_id),
            (10, 11, 99, (1 << 32) | 5)
        );
        assert!(
            matches!(e.body, Body::Open { fd: 3, kind: FdKind::Ctl, ref name, .. } if name == "nvidiactl")
        );

        assert!(matches!(
            parse(&bytes[..bytes.len() - 1], &Layout::DEFAULT),
            Err(ParseError::Short { .. })
        ));
        assert!(matches!(
            parse(&bytes[..4], &Layout::DEFAULT),
            Err(ParseError::Short { .. })
        ));
        let mut bad = open_record();
        bad.hdr.kind = 77;
        assert!(matches!(
            parse(&as_bytes(&bad), &Layout::DEFAULT),
            Err(ParseError::UnknownKind(77))
        ));
        // An fd-sized record that claims to be an ioctl is too short for one.
        let mut short_ioctl = open_record();
        short_ioctl.hdr.kind = RecordKind::Ioctl as u32;
        assert!(matches!(
            parse(&as_bytes(&short_ioctl), &Layout::DEFAULT),
            Err(ParseError::Short { .. })
        ));
    }

    #[test]
    fn a_lost_record_names_its_call_and_an_unknown_call_is_an_error() {
        let mut lost = open_record();
        lost.hdr.kind = RecordKind::Lost as u32;
        lost.aux = Sys::Mmap as i32;
        lost.fd = 7;
        let e = parse(&as_bytes(&lost), &Layout::DEFAULT).unwrap();
        assert!(matches!(
            e.body,
            Body::Lost {
                call: Sys::Mmap,
                fd: 7
            }
        ));
        lost.aux = 99;
        assert!(matches!(
            parse(&as_bytes(&lost), &Layout::DEFAULT),
            Err(ParseError::UnknownKind(15))
        ));
    }
}
