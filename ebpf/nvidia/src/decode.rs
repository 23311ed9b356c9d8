//! Decoder of captured NVIDIA ioctl params: turns what a tracer read at the ioctl's `arg` (and behind the
//! one pointer that matters) into named fields, the RM status and a typed operation ([`Op`]) for the
//! per-container ledger.
//!
//! Input may be truncated, empty or garbage: decoding never panics and never indexes out of bounds;
//! params shorter than their struct decode as [`Op::Truncated`] with no status, except the UVM structs larger
//! than any capture, whose captured head is decoded without a status (see `decode/uvm_calls.rs`).

use std::borrow::Cow;
use std::fmt;

use serde::Serialize;
use serde::ser::{SerializeMap, SerializeStruct, Serializer};

use crate::fdkind::FdKind;
use crate::layout::{AllocLayout, DEFAULT_VERSION, DriverVersion, Layout, nvos46, nvos47};
use crate::params::{
    card_info, check_version_str, memory_alloc, nvos00, nvos02, nvos05, nvos32, nvos33, nvos34,
    nvos54, nvos55, nvos56, nvos57, os_event, register_fd, rm_alloc, status_code, xfer,
};
use crate::{class, ctrl, escape, ioc, params, status, uvm};

/// One captured ioctl, as a tracer hands it over at syscall exit.
#[derive(Clone, Copy, Debug)]
pub struct Call<'a> {
    /// Which device file the fd refers to (decides frontend escape vs UVM command).
    pub fd_kind: FdKind,
    /// The ioctl command (`_IOWR('F', nr, size)` for the frontend, the bare number for UVM).
    pub cmd: u32,
    /// Bytes read at `arg` at syscall exit: up to `_IOC_SIZE` for escapes, up to
    /// [`uvm::capture_size`] for UVM; possibly truncated or empty.
    pub data: &'a [u8],
    /// Bytes read behind the pointer that matters: RM_ALLOC of a memory class: the
    /// NV_MEMORY_ALLOCATION_PARAMS at pAllocParms; RM_CONTROL: up to 256 bytes at params;
    /// IOCTL_XFER_CMD: up to 256 bytes of the inner params at ptr. Empty when not captured.
    pub nested: &'a [u8],
}

/// A decoded field value; `Display` renders it strace-style, JSON gives numbers (with names for classes,
/// control commands and status codes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Value {
    /// An RM object handle (rendered 0x%08x).
    Handle(u32),
    /// An RM class (rendered NAME(0x..)).
    Class(u32),
    /// An RM control command (rendered NAME(0x..), named as that driver version names it: see
    /// [`ctrl::name_for`]).
    Ctrl(u32, DriverVersion),
    /// A decimal 32-bit number.
    U32(u32),
    /// A decimal 64-bit number.
    U64(u64),
    /// A hexadecimal number (addresses, flags).
    Hex(u64),
    /// A byte count.
    Bytes(u64),
    /// Text (version strings, UUIDs, lists).
    Str(String),
    /// An NV_STATUS (rendered by its name in that driver version: some values were renumbered, see
    /// [`status::name_for`]).
    Status(u32, DriverVersion),
}

/// One named field of a decoded call.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Field {
    /// Field name as in the driver's struct (hRoot, hClass, ...).
    pub name: &'static str,
    /// Its value.
    pub value: Value,
}

/// The typed operation the ledger consumes. Apply it only when [`Decoded::status`] is `Some(NV_OK)`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    /// RM_ALLOC / RM_ALLOC_OBJECT: object `object` of `class` under `parent` in `client` (for root classes
    /// `object` is the new client). `size` from NV_MEMORY_ALLOCATION_PARAMS.size for memory classes when
    /// it was captured.
    Alloc {
        /// hRoot.
        client: u32,
        /// hObjectParent.
        parent: u32,
        /// hObjectNew.
        object: u32,
        /// hClass.
        class: u32,
        /// Bytes of memory, for memory classes with captured params.
        size: Option<u64>,
    },
    /// RM_FREE: `object` (the whole client when `object == client`).
    Free {
        /// hRoot.
        client: u32,
        /// hObjectParent.
        parent: u32,
        /// hObjectOld.
        object: u32,
    },
    /// RM_CONTROL `cmd` on `object`.
    Control {
        /// hClient.
        client: u32,
        /// hObject.
        object: u32,
        /// The control command.
        cmd: u32,
    },
    /// RM_ALLOC_MEMORY (NVOS02): `size` = limit + 1.
    AllocMemory {
        /// hRoot.
        client: u32,
        /// hObjectParent.
        parent: u32,
        /// hObjectNew.
        object: u32,
        /// hClass.
        class: u32,
        /// Bytes (limit + 1).
        size: u64,
    },
    /// RM_VID_HEAP_CONTROL function ALLOC_SIZE (2).
    VidHeapAlloc {
        /// hRoot.
        client: u32,
        /// hObjectParent.
        parent: u32,
        /// data.AllocSize.hMemory.
        object: u32,
        /// data.AllocSize.size.
        size: u64,
    },
    /// RM_VID_HEAP_CONTROL function FREE (3).
    VidHeapFree {
        /// hRoot.
        client: u32,
        /// hObjectParent.
        parent: u32,
        /// data.Free.hMemory.
        object: u32,
    },
    /// RM_MAP_MEMORY (CPU mapping).
    MapMemory {
        /// hClient.
        client: u32,
        /// hDevice.
        device: u32,
        /// hMemory.
        memory: u32,
        /// length.
        length: u64,
        /// The fd of the file the memory is then mmap()ed through (`nv_ioctl_nvos33_parameters_with_fd`),
        /// when captured.
        fd: Option<i32>,
    },
    /// RM_UNMAP_MEMORY (CPU mapping).
    UnmapMemory {
        /// hClient.
        client: u32,
        /// hDevice.
        device: u32,
        /// hMemory.
        memory: u32,
    },
    /// RM_DUP_OBJECT: `src_object` of `src_client` duplicated as `object` under `parent` in `client`.
    DupObject {
        /// hClient.
        client: u32,
        /// hParent.
        parent: u32,
        /// hObject.
        object: u32,
        /// hClientSrc.
        src_client: u32,
        /// hObjectSrc.
        src_object: u32,
    },
    /// REGISTER_FD: this device fd pins the ctl file `ctl_fd`.
    RegisterFd {
        /// The registered `/dev/nvidiactl` fd.
        ctl_fd: i32,
    },
    /// UVM_INITIALIZE.
    UvmInitialize,
    /// UVM_DEINITIALIZE.
    UvmDeinitialize,
    /// UVM_REGISTER_GPU.
    UvmRegisterGpu,
    /// UVM_UNREGISTER_GPU.
    UvmUnregisterGpu,
    /// UVM_REGISTER_GPU_VASPACE.
    UvmRegisterVaSpace,
    /// UVM_MM_INITIALIZE.
    UvmMmInitialize,
    /// Any other known UVM command.
    Uvm {
        /// The command.
        cmd: u32,
    },
    /// CARD_INFO.
    CardInfo,
    /// CHECK_VERSION_STR.
    CheckVersion,
    /// A known escape without a ledger meaning.
    Other,
    /// The captured params are shorter than the struct.
    Truncated,
    /// The driver refused the call before RM saw it (595.44.02+: a params size that is not the
    /// escape's, see [`Layout::accepts_escape`]): the ioctl failed with EINVAL, nothing happened.
    Refused,
    /// Not a known escape or command.
    Unknown,
}

/// A decoded call.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Decoded {
    /// "NV_ESC_RM_ALLOC", "UVM_INITIALIZE", or "UNKNOWN(0x...)".
    pub escape: Cow<'static, str>,
    /// The escape number (`_IOC_NR`) for frontend calls, the command for UVM.
    pub nr: u32,
    /// The RM status from the params struct (`status` / `rmStatus`), when the struct has one and it was
    /// captured in full.
    pub status: Option<u32>,
    /// The typed operation.
    pub op: Op,
    /// Named fields, in struct order.
    #[serde(serialize_with = "fields_as_map")]
    pub fields: Vec<Field>,
    /// Whether the call came wrapped in NV_ESC_IOCTL_XFER_CMD (the rest describes the inner call).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub xfer: bool,
    /// The driver version the call was decoded for (names of statuses and escapes depend on it).
    #[serde(skip)]
    pub version: DriverVersion,
}

/// Decodes one captured call with the struct layouts (and names) of `layout`'s driver.
pub fn decode(call: &Call, layout: &Layout) -> Decoded {
    let mut decoded = decode_any(call, layout);
    decoded.set_version(layout.version);
    decoded
}

fn decode_any(call: &Call, layout: &Layout) -> Decoded {
    match call.fd_kind {
        FdKind::Uvm | FdKind::UvmTools => uvm_calls::decode_uvm(call, layout),
        // The Linux frontend never checks `_IOC_TYPE` (see [`crate::ioc`]): any type runs as the escape
        // its number names. On an fd of unknown kind, 'F' is what tells an escape from a UVM command.
        FdKind::Ctl | FdKind::Device => decode_frontend(call, layout, true),
        FdKind::Unknown if ioc::is_nvidia(call.cmd) => decode_frontend(call, layout, true),
        FdKind::Unknown if uvm::name(call.cmd).is_some() => uvm_calls::decode_uvm(call, layout),
        FdKind::Unknown | FdKind::Modeset | FdKind::Caps => unknown(call.cmd, call.cmd),
    }
}

fn unknown(cmd: u32, nr: u32) -> Decoded {
    Decoded {
        escape: Cow::Owned(format!("UNKNOWN({cmd:#x})")),
        nr,
        status: None,
        op: Op::Unknown,
        fields: Vec::new(),
        xfer: false,
        version: DEFAULT_VERSION,
    }
}

/// Little reader over captured bytes: every read is bounds-checked and yields `None` past the end.
struct Bytes<'a>(&'a [u8]);

impl Bytes<'_> {
    fn u8(&self, off: u32) -> Option<u8> {
        self.0.get(off as usize).copied()
    }

    fn u16(&self, off: u32) -> Option<u16> {
        let b = self.0.get(off as usize..(off as usize).checked_add(2)?)?;
        Some(u16::from_ne_bytes(b.try_into().ok()?))
    }

    fn u32(&self, off: u32) -> Option<u32> {
        let b = self.0.get(off as usize..(off as usize).checked_add(4)?)?;
        Some(u32::from_ne_bytes(b.try_into().ok()?))
    }

    fn u64(&self, off: u32) -> Option<u64> {
        let b = self.0.get(off as usize..(off as usize).checked_add(8)?)?;
        Some(u64::from_ne_bytes(b.try_into().ok()?))
    }

    fn slice(&self, off: u32, len: u32) -> Option<&[u8]> {
        self.0
            .get(off as usize..(off as usize).checked_add(len as usize)?)
    }

    fn has(&self, size: u32) -> bool {
        self.0.len() >= size as usize
    }
}

/// Collects fields; reads that fall outside the data are skipped.
struct Fields<'a> {
    data: Bytes<'a>,
    out: Vec<Field>,
}

impl<'a> Fields<'a> {
    fn new(data: &'a [u8]) -> Self {
        Fields {
            data: Bytes(data),
            out: Vec::new(),
        }
    }

    fn push(&mut self, name: &'static str, value: Option<Value>) {
        if let Some(value) = value {
            self.out.push(Field { name, value });
        }
    }

    fn handle(&mut self, name: &'static str, off: u32) -> u32 {
        let v = self.data.u32(off);
        self.push(name, v.map(Value::Handle));
        v.unwrap_or(0)
    }

    fn class(&mut self, name: &'static str, off: u32) -> u32 {
        let v = self.data.u32(off);
        self.push(name, v.map(Value::Class));
        v.unwrap_or(0)
    }

    fn u32(&mut self, name: &'static str, off: u32) -> u32 {
        let v = self.data.u32(off);
        self.push(name, v.map(Value::U32));
        v.unwrap_or(0)
    }

    fn hex32(&mut self, name: &'static str, off: u32) -> u32 {
        let v = self.data.u32(off);
        self.push(name, v.map(|v| Value::Hex(v.into())));
        v.unwrap_or(0)
    }

    fn u64(&mut self, name: &'static str, off: u32) -> u64 {
        let v = self.data.u64(off);
        self.push(name, v.map(Value::U64));
        v.unwrap_or(0)
    }

    fn hex64(&mut self, name: &'static str, off: u32) -> u64 {
        let v = self.data.u64(off);
        self.push(name, v.map(Value::Hex));
        v.unwrap_or(0)
    }

    fn bytes64(&mut self, name: &'static str, off: u32) -> u64 {
        let v = self.data.u64(off);
        self.push(name, v.map(Value::Bytes));
        v.unwrap_or(0)
    }

    fn fd(&mut self, name: &'static str, off: u32) -> i32 {
        let v = self.data.u32(off).map(|v| v as i32);
        self.push(name, v.map(|fd| Value::Str(fd.to_string())));
        v.unwrap_or(-1)
    }

    fn status(&mut self, name: &'static str, off: u32) -> Option<u32> {
        let v = self.data.u32(off);
        self.push(name, v.map(|s| Value::Status(s, DEFAULT_VERSION)));
        v
    }

    fn uuid(&mut self, name: &'static str, off: u32) {
        let v = self.data.slice(off, 16).map(format_uuid);
        self.push(name, v.map(Value::Str));
    }
}

/// Formats a 16-byte GPU UUID as nvidia-smi does: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx.
fn format_uuid(b: &[u8]) -> String {
    let hex = |r: std::ops::Range<usize>| {
        b.get(r)
            .unwrap_or(&[])
            .iter()
            .map(|x| format!("{x:02x}"))
            .collect::<String>()
    };
    format!(
        "GPU-{}-{}-{}-{}-{}",
        hex(0..4),
        hex(4..6),
        hex(6..8),
        hex(8..10),
        hex(10..16)
    )
}

/// The result of one struct decoder before the escape name is attached.
struct Parts {
    status: Option<u32>,
    op: Op,
    fields: Vec<Field>,
}

impl Parts {
    fn truncated() -> Self {
        Parts {
            status: None,
            op: Op::Truncated,
            fields: Vec::new(),
        }
    }

    fn refused() -> Self {
        Parts {
            status: None,
            op: Op::Refused,
            fields: Vec::new(),
        }
    }
}

fn decode_frontend(call: &Call, layout: &Layout, allow_xfer: bool) -> Decoded {
    let nr = ioc::nr(call.cmd);
    let Some(name) = escape::name_for(nr, layout.version) else {
        return unknown(call.cmd, nr);
    };
    if layout.accepts_escape(nr, ioc::size(call.cmd)) == Some(false) && allow_xfer {
        // 595.44.02+ validates the outer command only (an xfer's inner one reaches RM unchecked).
        return finish(name, nr, Parts::refused());
    }
    if nr == escape::IOCTL_XFER_CMD {
        return if allow_xfer {
            decode_xfer(call, layout)
        } else {
            finish(name, nr, Parts::truncated())
        };
    }
    let parts = decode_escape(nr, ioc::size(call.cmd), call.data, call.nested, layout);
    finish(name, nr, parts)
}

fn finish(name: &'static str, nr: u32, parts: Parts) -> Decoded {
    Decoded {
        escape: Cow::Borrowed(name),
        nr,
        status: parts.status,
        op: parts.op,
        fields: parts.fields,
        xfer: false,
        version: DEFAULT_VERSION,
    }
}

/// NV_ESC_IOCTL_XFER_CMD: decodes the inner escape from `nested` (the params at ptr).
fn decode_xfer(call: &Call, layout: &Layout) -> Decoded {
    let data = Bytes(call.data);
    let (Some(inner_nr), Some(inner_size)) =
        (data.u32(xfer::CMD_OFFSET), data.u32(xfer::SIZE_OFFSET))
    else {
        return finish(
            "NV_ESC_IOCTL_XFER_CMD",
            escape::IOCTL_XFER_CMD,
            Parts::truncated(),
        );
    };
    if !data.has(xfer::SIZE) || inner_nr > 0xff || inner_size > xfer::MAX_PARAMS {
        let mut f = Fields::new(call.data);
        f.u32("cmd", xfer::CMD_OFFSET);
        f.u32("size", xfer::SIZE_OFFSET);
        f.hex64("ptr", xfer::PTR_OFFSET);
        let op = if data.has(xfer::SIZE) {
            Op::Unknown
        } else {
            Op::Truncated
        };
        return finish(
            "NV_ESC_IOCTL_XFER_CMD",
            escape::IOCTL_XFER_CMD,
            Parts {
                status: None,
                op,
                fields: f.out,
            },
        );
    }
    let inner = Call {
        fd_kind: call.fd_kind,
        cmd: ioc::iowr(ioc::NV_IOCTL_MAGIC, inner_nr, inner_size),
        data: call.nested,
        nested: &[],
    };
    let mut decoded = decode_frontend(&inner, layout, false);
    decoded.xfer = true;
    decoded
}

fn decode_escape(nr: u32, ioc_size: u32, data: &[u8], nested: &[u8], layout: &Layout) -> Parts {
    match nr {
        escape::RM_ALLOC => decode_rm_alloc(ioc_size, data, nested, layout),
        escape::RM_ALLOC_OBJECT => decode_nvos05(data),
        escape::RM_FREE => decode_nvos00(data),
        escape::RM_CONTROL => decode_nvos54(data, nested),
        escape::RM_ALLOC_MEMORY => decode_nvos02(data),
        escape::RM_VID_HEAP_CONTROL => decode_nvos32(data),
        escape::RM_MAP_MEMORY => decode_nvos33(data),
        escape::RM_UNMAP_MEMORY => decode_nvos34(data),
        escape::RM_DUP_OBJECT => decode_nvos55(data),
        escape::RM_SHARE => decode_nvos57(data),
        escape::RM_UPDATE_DEVICE_MAPPING_INFO => decode_nvos56(data),
        escape::RM_MAP_MEMORY_DMA => decode_nvos46(data, layout),
        escape::RM_UNMAP_MEMORY_DMA => decode_nvos47(data, layout),
        escape::REGISTER_FD => decode_register_fd(data),
        escape::CARD_INFO => decode_card_info(data),
        escape::CHECK_VERSION_STR => decode_check_version(data),
        escape::ALLOC_OS_EVENT | escape::FREE_OS_EVENT => decode_os_event(data),
        escape::STATUS_CODE => decode_status_code(data),
        escape::ATTACH_GPUS_TO_FD => decode_attach_gpus(data),
        escape::EXPORT_TO_DMABUF_FD => decode_export_dmabuf(data, layout),
        _ => decode_other(nr, data, layout),
    }
}

/// Known escapes without a dedicated decoder: Truncated when shorter than their fixed size, else Other.
fn decode_other(nr: u32, data: &[u8], layout: &Layout) -> Parts {
    match layout.escape_params_size(nr) {
        Some(size) if !Bytes(data).has(size) => Parts::truncated(),
        _ => Parts {
            status: None,
            op: Op::Other,
            fields: Vec::new(),
        },
    }
}

fn decode_rm_alloc(ioc_size: u32, data: &[u8], nested: &[u8], layout: &Layout) -> Parts {
    let Some(al) = layout.rm_alloc_layout(ioc_size) else {
        return Parts {
            status: None,
            op: Op::Unknown,
            fields: Vec::new(),
        };
    };
    if !Bytes(data).has(al.size) {
        return Parts::truncated();
    }
    let mut f = Fields::new(data);
    let client = f.handle("hRoot", rm_alloc::H_ROOT_OFFSET);
    let parent = f.handle("hParent", rm_alloc::H_OBJECT_PARENT_OFFSET);
    let object = f.handle("hNew", rm_alloc::H_OBJECT_NEW_OFFSET);
    let class = f.class("hClass", rm_alloc::H_CLASS_OFFSET);
    f.hex64("pAllocParms", rm_alloc::P_ALLOC_PARMS_OFFSET);
    push_alloc_tail(&mut f, &al);
    let status = f.status("status", al.status);
    let size = if class::is_memory(class) {
        memory_params(&mut f, nested)
    } else {
        None
    };
    Parts {
        status,
        op: Op::Alloc {
            client,
            parent,
            object,
            class,
            size,
        },
        fields: f.out,
    }
}

fn push_alloc_tail(f: &mut Fields, al: &AllocLayout) {
    if let Some(off) = al.rights_requested {
        f.hex64("pRightsRequested", off);
    }
    if let Some(off) = al.params_size {
        f.u32("paramsSize", off);
    }
    if let Some(off) = al.flags {
        f.hex32("flags", off);
    }
}

/// Fields of a captured NV_MEMORY_ALLOCATION_PARAMS; returns its size when captured.
fn memory_params(f: &mut Fields, nested: &[u8]) -> Option<u64> {
    let m = Bytes(nested);
    let size = m.u64(memory_alloc::SIZE_OFFSET)?;
    if let Some(v) = m.u32(memory_alloc::OWNER_OFFSET) {
        f.push("owner", Some(Value::Hex(v.into())));
    }
    if let Some(v) = m.u32(memory_alloc::TYPE_OFFSET) {
        f.push("type", Some(Value::U32(v)));
    }
    if let Some(v) = m.u32(memory_alloc::FLAGS_OFFSET) {
        f.push("memFlags", Some(Value::Hex(v.into())));
    }
    if let Some(v) = m.u32(memory_alloc::ATTR_OFFSET) {
        f.push("attr", Some(Value::Hex(v.into())));
    }
    if let Some(v) = m.u32(memory_alloc::ATTR2_OFFSET) {
        f.push("attr2", Some(Value::Hex(v.into())));
    }
    f.push("size", Some(Value::Bytes(size)));
    if let Some(v) = m.u64(memory_alloc::ALIGNMENT_OFFSET) {
        f.push("alignment", Some(Value::Hex(v)));
    }
    if let Some(v) = m.u64(memory_alloc::OFFSET_OFFSET) {
        f.push("offset", Some(Value::Hex(v)));
    }
    if let Some(v) = m.u32(memory_alloc::H_VA_SPACE_OFFSET) {
        f.push("hVASpace", Some(Value::Handle(v)));
    }
    Some(size)
}

fn decode_nvos05(data: &[u8]) -> Parts {
    if !Bytes(data).has(nvos05::SIZE) {
        return Parts::truncated();
    }
    let mut f = Fields::new(data);
    let client = f.handle("hRoot", nvos05::H_ROOT_OFFSET);
    let parent = f.handle("hParent", nvos05::H_OBJECT_PARENT_OFFSET);
    let object = f.handle("hNew", nvos05::H_OBJECT_NEW_OFFSET);
    let class = f.class("hClass", nvos05::H_CLASS_OFFSET);
    let status = f.status("status", nvos05::STATUS_OFFSET);
    Parts {
        status,
        op: Op::Alloc {
            client,
            parent,
            object,
            class,
            size: None,
        },
        fields: f.out,
    }
}

fn decode_nvos00(data: &[u8]) -> Parts {
    if !Bytes(data).has(nvos00::SIZE) {
        return Parts::truncated();
    }
    let mut f = Fields::new(data);
    let client = f.handle("hRoot", nvos00::H_ROOT_OFFSET);
    let parent = f.handle("hParent", nvos00::H_OBJECT_PARENT_OFFSET);
    let object = f.handle("hObjectOld", nvos00::H_OBJECT_OLD_OFFSET);
    let status = f.status("status", nvos00::STATUS_OFFSET);
    Parts {
        status,
        op: Op::Free {
            client,
            parent,
            object,
        },
        fields: f.out,
    }
}

fn decode_nvos54(data: &[u8], nested: &[u8]) -> Parts {
    if !Bytes(data).has(nvos54::SIZE) {
        return Parts::truncated();
    }
    let mut f = Fields::new(data);
    let client = f.handle("hClient", nvos54::H_CLIENT_OFFSET);
    let object = f.handle("hObject", nvos54::H_OBJECT_OFFSET);
    let cmd = f.data.u32(nvos54::CMD_OFFSET).unwrap_or(0);
    f.push("cmd", Some(Value::Ctrl(cmd, DEFAULT_VERSION)));
    f.hex32("flags", nvos54::FLAGS_OFFSET);
    f.hex64("params", nvos54::PARAMS_OFFSET);
    f.u32("paramsSize", nvos54::PARAMS_SIZE_OFFSET);
    let status = f.status("status", nvos54::STATUS_OFFSET);
    if !nested.is_empty() {
        f.push("paramsCaptured", Some(Value::Bytes(nested.len() as u64)));
    }
    Parts {
        status,
        op: Op::Control {
            client,
            object,
            cmd,
        },
        fields: f.out,
    }
}

fn decode_nvos02(data: &[u8]) -> Parts {
    if !Bytes(data).has(nvos02::WITH_FD_SIZE) {
        return Parts::truncated();
    }
    let mut f = Fields::new(data);
    let client = f.handle("hRoot", nvos02::H_ROOT_OFFSET);
    let parent = f.handle("hParent", nvos02::H_OBJECT_PARENT_OFFSET);
    let object = f.handle("hNew", nvos02::H_OBJECT_NEW_OFFSET);
    let class = f.class("hClass", nvos02::H_CLASS_OFFSET);
    f.hex32("flags", nvos02::FLAGS_OFFSET);
    f.hex64("pMemory", nvos02::P_MEMORY_OFFSET);
    let limit = f.hex64("limit", nvos02::LIMIT_OFFSET);
    let status = f.status("status", nvos02::STATUS_OFFSET);
    f.fd("fd", nvos02::FD_OFFSET);
    let size = limit.saturating_add(1);
    Parts {
        status,
        op: Op::AllocMemory {
            client,
            parent,
            object,
            class,
            size,
        },
        fields: f.out,
    }
}

fn decode_nvos32(data: &[u8]) -> Parts {
    if !Bytes(data).has(nvos32::SIZE) {
        return Parts::truncated();
    }
    let mut f = Fields::new(data);
    let client = f.handle("hRoot", nvos32::H_ROOT_OFFSET);
    let parent = f.handle("hParent", nvos32::H_OBJECT_PARENT_OFFSET);
    let function = f.u32("function", nvos32::FUNCTION_OFFSET);
    f.handle("hVASpace", nvos32::H_VA_SPACE_OFFSET);
    let status = f.status("status", nvos32::STATUS_OFFSET);
    let op = match function {
        nvos32::FUNCTION_ALLOC_SIZE => {
            let object = f.handle("hMemory", nvos32::H_MEMORY_OFFSET);
            f.u32("type", nvos32::ALLOC_TYPE_OFFSET);
            f.hex32("allocFlags", nvos32::ALLOC_FLAGS_OFFSET);
            let size = f.bytes64("size", nvos32::ALLOC_SIZE_OFFSET);
            Op::VidHeapAlloc {
                client,
                parent,
                object,
                size,
            }
        }
        nvos32::FUNCTION_FREE => {
            let object = f.handle("hMemory", nvos32::H_MEMORY_OFFSET);
            Op::VidHeapFree {
                client,
                parent,
                object,
            }
        }
        _ => Op::Other,
    };
    Parts {
        status,
        op,
        fields: f.out,
    }
}

fn decode_nvos33(data: &[u8]) -> Parts {
    if !Bytes(data).has(nvos33::WITH_FD_SIZE) {
        return Parts::truncated();
    }
    let mut f = Fields::new(data);
    let client = f.handle("hClient", nvos33::H_CLIENT_OFFSET);
    let device = f.handle("hDevice", nvos33::H_DEVICE_OFFSET);
    let memory = f.handle("hMemory", nvos33::H_MEMORY_OFFSET);
    f.hex64("offset", nvos33::OFFSET_OFFSET);
    let length = f.bytes64("length", nvos33::LENGTH_OFFSET);
    f.hex64("pLinearAddress", nvos33::P_LINEAR_ADDRESS_OFFSET);
    let status = f.status("status", nvos33::STATUS_OFFSET);
    f.hex32("flags", nvos33::FLAGS_OFFSET);
    let fd = f.fd("fd", nvos33::FD_OFFSET);
    Parts {
        status,
        op: Op::MapMemory {
            client,
            device,
            memory,
            length,
            fd: (fd >= 0).then_some(fd),
        },
        fields: f.out,
    }
}

fn decode_nvos34(data: &[u8]) -> Parts {
    if !Bytes(data).has(nvos34::SIZE) {
        return Parts::truncated();
    }
    let mut f = Fields::new(data);
    let client = f.handle("hClient", nvos34::H_CLIENT_OFFSET);
    let device = f.handle("hDevice", nvos34::H_DEVICE_OFFSET);
    let memory = f.handle("hMemory", nvos34::H_MEMORY_OFFSET);
    f.hex64("pLinearAddress", nvos34::P_LINEAR_ADDRESS_OFFSET);
    let status = f.status("status", nvos34::STATUS_OFFSET);
    f.hex32("flags", nvos34::FLAGS_OFFSET);
    Parts {
        status,
        op: Op::UnmapMemory {
            client,
            device,
            memory,
        },
        fields: f.out,
    }
}

fn decode_nvos55(data: &[u8]) -> Parts {
    if !Bytes(data).has(nvos55::SIZE) {
        return Parts::truncated();
    }
    let mut f = Fields::new(data);
    let client = f.handle("hClient", nvos55::H_CLIENT_OFFSET);
    let parent = f.handle("hParent", nvos55::H_PARENT_OFFSET);
    let object = f.handle("hObject", nvos55::H_OBJECT_OFFSET);
    let src_client = f.handle("hClientSrc", nvos55::H_CLIENT_SRC_OFFSET);
    let src_object = f.handle("hObjectSrc", nvos55::H_OBJECT_SRC_OFFSET);
    f.hex32("flags", nvos55::FLAGS_OFFSET);
    let status = f.status("status", nvos55::STATUS_OFFSET);
    Parts {
        status,
        op: Op::DupObject {
            client,
            parent,
            object,
            src_client,
            src_object,
        },
        fields: f.out,
    }
}

/// NVOS56 (RM_UPDATE_DEVICE_MAPPING_INFO): CUDA moves a CPU mapping it got from RM_MAP_MEMORY to the
/// address it mmap()ed the device file at (recording: /work/shared/gpu/580.159.04/pytorch-1gib.jsonl, after
/// each RM_MAP_MEMORY of video memory through nvidia0).
fn decode_nvos56(data: &[u8]) -> Parts {
    if !Bytes(data).has(nvos56::SIZE) {
        return Parts::truncated();
    }
    let mut f = Fields::new(data);
    f.handle("hClient", nvos56::H_CLIENT_OFFSET);
    f.handle("hDevice", nvos56::H_DEVICE_OFFSET);
    f.handle("hMemory", nvos56::H_MEMORY_OFFSET);
    f.hex64("pOldCpuAddress", nvos56::P_OLD_CPU_ADDRESS_OFFSET);
    f.hex64("pNewCpuAddress", nvos56::P_NEW_CPU_ADDRESS_OFFSET);
    let status = f.status("status", nvos56::STATUS_OFFSET);
    Parts {
        status,
        op: Op::Other,
        fields: f.out,
    }
}

fn decode_nvos57(data: &[u8]) -> Parts {
    if !Bytes(data).has(nvos57::SIZE) {
        return Parts::truncated();
    }
    let mut f = Fields::new(data);
    f.handle("hClient", nvos57::H_CLIENT_OFFSET);
    f.handle("hObject", nvos57::H_OBJECT_OFFSET);
    let status = f.status("status", nvos57::STATUS_OFFSET);
    Parts {
        status,
        op: Op::Other,
        fields: f.out,
    }
}

fn decode_nvos46(data: &[u8], layout: &Layout) -> Parts {
    if !Bytes(data).has(layout.nvos46_size) {
        return Parts::truncated();
    }
    let mut f = Fields::new(data);
    f.handle("hClient", nvos46::H_CLIENT_OFFSET);
    f.handle("hDevice", nvos46::H_DEVICE_OFFSET);
    f.handle("hDma", nvos46::H_DMA_OFFSET);
    f.handle("hMemory", nvos46::H_MEMORY_OFFSET);
    f.hex64("offset", nvos46::OFFSET_OFFSET);
    f.bytes64("length", nvos46::LENGTH_OFFSET);
    f.hex32("flags", nvos46::FLAGS_OFFSET);
    if let Some(off) = layout.nvos46_flags2 {
        f.hex32("flags2", off);
    }
    if let Some(off) = layout.nvos46_kind_override {
        f.hex32("kindOverride", off);
    }
    f.hex64("dmaOffset", layout.nvos46_dma_offset);
    let status = f.status("status", layout.nvos46_status);
    Parts {
        status,
        op: Op::Other,
        fields: f.out,
    }
}

fn decode_nvos47(data: &[u8], layout: &Layout) -> Parts {
    if !Bytes(data).has(layout.nvos47_size) {
        return Parts::truncated();
    }
    let mut f = Fields::new(data);
    f.handle("hClient", nvos47::H_CLIENT_OFFSET);
    f.handle("hDevice", nvos47::H_DEVICE_OFFSET);
    f.handle("hDma", nvos47::H_DMA_OFFSET);
    f.handle("hMemory", nvos47::H_MEMORY_OFFSET);
    f.hex32("flags", nvos47::FLAGS_OFFSET);
    f.hex64("dmaOffset", nvos47::DMA_OFFSET_OFFSET);
    if let Some(off) = layout.nvos47_length {
        f.bytes64("size", off);
    }
    let status = f.status("status", layout.nvos47_status);
    Parts {
        status,
        op: Op::Other,
        fields: f.out,
    }
}

/// nv_ioctl_export_to_dma_buf_fd_t: 2600 bytes (status@2592) up to 565.77, 2608 (status@2600) from
/// 570.86.15; see [`Layout::export_dmabuf_size`].
fn decode_export_dmabuf(data: &[u8], layout: &Layout) -> Parts {
    use params::export_to_dmabuf_fd as p;
    if !Bytes(data).has(layout.export_dmabuf_size) {
        return Parts::truncated();
    }
    let mut f = Fields::new(data);
    f.fd("fd", p::FD_OFFSET);
    f.handle("hClient", p::H_CLIENT_OFFSET);
    f.u32("totalObjects", p::TOTAL_OBJECTS_OFFSET);
    f.u32("numObjects", p::NUM_OBJECTS_OFFSET);
    f.u32("index", p::INDEX_OFFSET);
    f.bytes64("totalSize", p::TOTAL_SIZE_OFFSET);
    if let Some(off) = layout.export_dmabuf_mapping_type {
        let v = f.data.u8(off);
        f.push("mappingType", v.map(|v| Value::U32(v.into())));
    }
    if let Some(off) = layout.export_dmabuf_allow_mmap {
        let v = f.data.u8(off);
        f.push("bAllowMmap", v.map(|v| Value::U32(v.into())));
    }
    let status = f.status("status", layout.export_dmabuf_status);
    Parts {
        status,
        op: Op::Other,
        fields: f.out,
    }
}

fn decode_register_fd(data: &[u8]) -> Parts {
    if !Bytes(data).has(register_fd::SIZE) {
        return Parts::truncated();
    }
    let mut f = Fields::new(data);
    let ctl_fd = f.fd("ctl_fd", register_fd::CTL_FD_OFFSET);
    Parts {
        status: None,
        op: Op::RegisterFd { ctl_fd },
        fields: f.out,
    }
}

/// Most card-info entries rendered as fields.
const CARD_INFO_MAX_ENTRIES: u32 = 32;

fn decode_card_info(data: &[u8]) -> Parts {
    if !Bytes(data).has(card_info::ENTRY_SIZE) {
        return Parts::truncated();
    }
    let b = Bytes(data);
    let entries = (data.len() / card_info::ENTRY_SIZE as usize) as u32;
    let mut f = Fields::new(data);
    f.push("entries", Some(Value::U32(entries)));
    let mut gpus = Vec::new();
    for i in 0..entries.min(CARD_INFO_MAX_ENTRIES) {
        let base = i * card_info::ENTRY_SIZE;
        if b.u8(base + card_info::VALID_OFFSET).unwrap_or(0) == 0 {
            continue;
        }
        let gpu = format!(
            "id={:#x} minor={} pci={:04x}:{:02x}:{:02x}.{} {:04x}:{:04x} fb={}",
            b.u32(base + card_info::GPU_ID_OFFSET).unwrap_or(0),
            b.u32(base + card_info::MINOR_NUMBER_OFFSET).unwrap_or(0),
            b.u32(base + card_info::PCI_DOMAIN_OFFSET).unwrap_or(0),
            b.u8(base + card_info::PCI_BUS_OFFSET).unwrap_or(0),
            b.u8(base + card_info::PCI_SLOT_OFFSET).unwrap_or(0),
            b.u8(base + card_info::PCI_FUNCTION_OFFSET).unwrap_or(0),
            b.u16(base + card_info::PCI_VENDOR_ID_OFFSET).unwrap_or(0),
            b.u16(base + card_info::PCI_DEVICE_ID_OFFSET).unwrap_or(0),
            b.u64(base + card_info::FB_SIZE_OFFSET).unwrap_or(0),
        );
        gpus.push(gpu);
    }
    f.push("gpus", Some(Value::Str(gpus.join("; "))));
    Parts {
        status: None,
        op: Op::CardInfo,
        fields: f.out,
    }
}

fn decode_check_version(data: &[u8]) -> Parts {
    if !Bytes(data).has(check_version_str::SIZE) {
        return Parts::truncated();
    }
    let mut f = Fields::new(data);
    f.hex32("cmd", check_version_str::CMD_OFFSET);
    f.u32("reply", check_version_str::REPLY_OFFSET);
    let raw = f
        .data
        .slice(
            check_version_str::VERSION_STRING_OFFSET,
            check_version_str::VERSION_STRING_LEN,
        )
        .unwrap_or(&[]);
    let text = raw.split(|&b| b == 0).next().unwrap_or(&[]);
    f.push(
        "versionString",
        Some(Value::Str(String::from_utf8_lossy(text).into_owned())),
    );
    Parts {
        status: None,
        op: Op::CheckVersion,
        fields: f.out,
    }
}

fn decode_os_event(data: &[u8]) -> Parts {
    if !Bytes(data).has(os_event::SIZE) {
        return Parts::truncated();
    }
    let mut f = Fields::new(data);
    f.handle("hClient", os_event::H_CLIENT_OFFSET);
    f.handle("hDevice", os_event::H_DEVICE_OFFSET);
    f.fd("fd", os_event::FD_OFFSET);
    let status = f.status("Status", os_event::STATUS_OFFSET);
    Parts {
        status,
        op: Op::Other,
        fields: f.out,
    }
}

fn decode_status_code(data: &[u8]) -> Parts {
    if !Bytes(data).has(status_code::SIZE) {
        return Parts::truncated();
    }
    let mut f = Fields::new(data);
    // The GPU's status code is the query's answer, not the call's result.
    f.status("gpuStatus", status_code::STATUS_OFFSET);
    Parts {
        status: None,
        op: Op::Other,
        fields: f.out,
    }
}

/// Most GPU ids rendered for ATTACH_GPUS_TO_FD.
const ATTACH_GPUS_MAX: usize = 64;

fn decode_attach_gpus(data: &[u8]) -> Parts {
    let ids: Vec<String> = data
        .chunks_exact(4)
        .take(ATTACH_GPUS_MAX)
        .map(|c| format!("{:#x}", u32::from_ne_bytes([c[0], c[1], c[2], c[3]])))
        .collect();
    if ids.is_empty() {
        return Parts::truncated();
    }
    let fields = vec![Field {
        name: "gpuIds",
        value: Value::Str(ids.join(",")),
    }];
    Parts {
        status: None,
        op: Op::Other,
        fields,
    }
}

impl Decoded {
    /// Names statuses and control commands (the call's and its fields') as driver `version` does.
    fn set_version(&mut self, version: DriverVersion) {
        self.version = version;
        for field in &mut self.fields {
            if let Value::Status(_, v) | Value::Ctrl(_, v) = &mut field.value {
                *v = version;
            }
        }
    }

    /// The fields alone, strace-style: `hRoot=0xc1d00001 hClass=NV01_DEVICE_0(0x80) ...`.
    pub fn args(&self) -> String {
        self.fields
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(" ")
    }
}

impl fmt::Display for Decoded {
    /// `NV_ESC_RM_ALLOC(hRoot=0xc1d00001 ...) = NV_OK`; `= ?` when no status was captured, and the op for
    /// truncated or unknown calls.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.xfer {
            write!(f, "[xfer] ")?;
        }
        write!(f, "{}({})", self.escape, self.args())?;
        match (self.status, &self.op) {
            (Some(s), _) => write!(f, " = {}", StatusName(s, self.version)),
            (None, Op::Truncated) => write!(f, " = ? <truncated>"),
            (None, Op::Unknown) => write!(f, " = ? <unknown>"),
            (None, Op::Refused) => write!(f, " = -EINVAL <refused>"),
            (None, _) => write!(f, " = ?"),
        }
    }
}

impl fmt::Display for Field {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}={}", self.name, self.value)
    }
}

struct StatusName(u32, DriverVersion);

impl fmt::Display for StatusName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match status::name_for(self.0, self.1) {
            Some(n) => f.write_str(n),
            None => write!(f, "{:#x}", self.0),
        }
    }
}

fn named(f: &mut fmt::Formatter<'_>, name: Option<&str>, v: u32) -> fmt::Result {
    match name {
        Some(n) => write!(f, "{n}({v:#x})"),
        None => write!(f, "{v:#x}"),
    }
}

impl fmt::Display for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Value::Handle(h) => write!(f, "{h:#010x}"),
            Value::Class(c) => named(f, class::name(*c), *c),
            Value::Ctrl(c, v) => named(f, ctrl::name_for(*c, *v), *c),
            Value::U32(v) => write!(f, "{v}"),
            Value::U64(v) | Value::Bytes(v) => write!(f, "{v}"),
            Value::Hex(v) => write!(f, "{v:#x}"),
            Value::Str(s) => write!(f, "{s:?}"),
            Value::Status(s, v) => write!(f, "{}", StatusName(*s, *v)),
        }
    }
}

impl Value {
    /// The value's name where it has one (class, control command, status).
    pub fn name(&self) -> Option<&'static str> {
        match self {
            Value::Class(c) => class::name(*c),
            Value::Ctrl(c, v) => ctrl::name_for(*c, *v),
            Value::Status(s, v) => status::name_for(*s, *v),
            _ => None,
        }
    }
}

impl Serialize for Value {
    /// Numbers as JSON numbers; classes, control commands and statuses as `{"value": n, "name": "..."}`
    /// (name null when unknown); handles as numbers; strings as strings.
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Value::Handle(v) | Value::U32(v) => s.serialize_u32(*v),
            Value::U64(v) | Value::Hex(v) | Value::Bytes(v) => s.serialize_u64(*v),
            Value::Str(v) => s.serialize_str(v),
            Value::Class(v) | Value::Ctrl(v, _) | Value::Status(v, _) => {
                let mut st = s.serialize_struct("Named", 2)?;
                st.serialize_field("value", v)?;
                st.serialize_field("name", &self.name())?;
                st.end()
            }
        }
    }
}

/// Serializes fields as an ordered JSON object (`{"hRoot": 3235905537, ...}`); field names are unique
/// within a call.
pub fn fields_as_map<S: Serializer>(fields: &[Field], s: S) -> Result<S::Ok, S::Error> {
    let mut map = s.serialize_map(Some(fields.len()))?;
    for field in fields {
        map.serialize_entry(field.name, &field.value)?;
    }
    map.end()
}

mod uvm_calls;

mod enter;
pub use enter::{EnterFields, op_at_enter};

#[cfg(test)]
mod recorded;
#[cfg(test)]
mod tests;
