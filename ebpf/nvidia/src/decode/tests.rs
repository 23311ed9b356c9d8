//! Decoder tests: structs are built from the layout constants (never hard-coded bytes) for every band.

use super::*;
use crate::layout::{DriverVersion, uvm_free};
use crate::params::uvm as puvm;
use proptest::prelude::*;

const CLIENT: u32 = 0xc1d0_0001;
const DEVICE: u32 = 0xcaf0_0002;
const MEMORY: u32 = 0xcaf0_0010;

fn put32(buf: &mut [u8], off: u32, v: u32) {
    buf[off as usize..off as usize + 4].copy_from_slice(&v.to_ne_bytes());
}

fn put64(buf: &mut [u8], off: u32, v: u64) {
    buf[off as usize..off as usize + 8].copy_from_slice(&v.to_ne_bytes());
}

fn layout(major: u32) -> Layout {
    Layout::for_version(DriverVersion::new(major, 0, 0))
}

fn esc(nr: u32, size: u32) -> u32 {
    ioc::iowr(ioc::NV_IOCTL_MAGIC, nr, size)
}

fn frontend<'a>(cmd: u32, data: &'a [u8], nested: &'a [u8]) -> Call<'a> {
    Call {
        fd_kind: FdKind::Ctl,
        cmd,
        data,
        nested,
    }
}

fn field<'a>(d: &'a Decoded, name: &str) -> Option<&'a Value> {
    d.fields.iter().find(|f| f.name == name).map(|f| &f.value)
}

/// An NV_ESC_RM_ALLOC params struct for `al`, with `status` at its band's offset.
fn rm_alloc_struct(al: &AllocLayout, class: u32, status: u32) -> Vec<u8> {
    let mut b = vec![0u8; al.size as usize];
    put32(&mut b, rm_alloc::H_ROOT_OFFSET, CLIENT);
    put32(&mut b, rm_alloc::H_OBJECT_PARENT_OFFSET, CLIENT);
    put32(&mut b, rm_alloc::H_OBJECT_NEW_OFFSET, DEVICE);
    put32(&mut b, rm_alloc::H_CLASS_OFFSET, class);
    put64(&mut b, rm_alloc::P_ALLOC_PARMS_OFFSET, 0x7fff_0000_1000);
    if let Some(off) = al.params_size {
        put32(&mut b, off, 128);
    }
    if let Some(off) = al.flags {
        put32(&mut b, off, 0x5);
    }
    put32(&mut b, al.status, status);
    b
}

#[test]
fn rm_alloc_every_band_and_struct() {
    for major in [515, 520, 525, 530, 535, 550, 580, 595] {
        let l = layout(major);
        for size in [l.nvos21_size, l.nvos64_size] {
            let al = l.rm_alloc_layout(size).expect("layout for its own sizes");
            let data = rm_alloc_struct(&al, class::NV01_DEVICE_0, status::NV_ERR_INVALID_CLASS);
            let d = decode(&frontend(esc(escape::RM_ALLOC, size), &data, &[]), &l);
            assert_eq!(d.escape, "NV_ESC_RM_ALLOC");
            assert_eq!(
                d.status,
                Some(status::NV_ERR_INVALID_CLASS),
                "{major} {size}"
            );
            assert_eq!(
                d.op,
                Op::Alloc {
                    client: CLIENT,
                    parent: CLIENT,
                    object: DEVICE,
                    class: class::NV01_DEVICE_0,
                    size: None
                }
            );
            assert_eq!(
                field(&d, "paramsSize").is_some(),
                al.params_size.is_some(),
                "{major} {size}"
            );
            assert_eq!(
                field(&d, "flags"),
                al.flags.map(|_| &Value::Hex(5)),
                "{major} {size}"
            );
            // One byte short: truncated, no status.
            let d = decode(
                &frontend(esc(escape::RM_ALLOC, size), &data[..data.len() - 1], &[]),
                &l,
            );
            assert_eq!((d.op, d.status), (Op::Truncated, None));
        }
    }
}

#[test]
fn rm_alloc_of_video_memory_reports_size() {
    let l = Layout::DEFAULT;
    let al = l.rm_alloc_layout(l.nvos21_size).expect("nvos21");
    let data = rm_alloc_struct(&al, class::NV01_MEMORY_LOCAL_USER, status::NV_OK);
    let mut nested = vec![0u8; memory_alloc::SIZE as usize];
    put64(&mut nested, memory_alloc::SIZE_OFFSET, 2 << 20);
    put32(&mut nested, memory_alloc::H_VA_SPACE_OFFSET, 0xcaf0_0003);
    let d = decode(
        &frontend(esc(escape::RM_ALLOC, l.nvos21_size), &data, &nested),
        &l,
    );
    assert_eq!(d.status, Some(status::NV_OK));
    let Op::Alloc { size, class, .. } = d.op else {
        panic!("{:?}", d.op)
    };
    assert_eq!(
        (size, class),
        (Some(2 << 20), class::NV01_MEMORY_LOCAL_USER)
    );
    assert_eq!(field(&d, "hVASpace"), Some(&Value::Handle(0xcaf0_0003)));
    // Without the nested params the size is unknown; a non-memory class never reads them.
    let d = decode(
        &frontend(esc(escape::RM_ALLOC, l.nvos21_size), &data, &[]),
        &l,
    );
    assert!(matches!(d.op, Op::Alloc { size: None, .. }));
    let data = rm_alloc_struct(&al, class::FERMI_VASPACE_A, status::NV_OK);
    let d = decode(
        &frontend(esc(escape::RM_ALLOC, l.nvos21_size), &data, &nested),
        &l,
    );
    assert!(matches!(d.op, Op::Alloc { size: None, .. }));
}

/// RM_ALLOC with a size of neither NVOS21 nor NVOS64: RM cannot read it before 595.44.02, and from
/// 595.44.02 `RmValidateIoctl` (src/nvidia/arch/nvalloc/unix/src/escape.c) refuses it with EINVAL.
#[test]
fn rm_alloc_with_a_size_of_neither_struct_is_unknown() {
    let data = vec![0u8; 64];
    let call = frontend(esc(escape::RM_ALLOC, 44), &data, &[]);
    let d = decode(&call, &layout(590));
    assert_eq!(
        (d.op, d.status, d.escape.as_ref()),
        (Op::Unknown, None, "NV_ESC_RM_ALLOC")
    );
    let d = decode(&call, &Layout::DEFAULT);
    assert_eq!(
        (d.op, d.status, d.escape.as_ref()),
        (Op::Refused, None, "NV_ESC_RM_ALLOC")
    );
}

fn nvos00(object: u32, st: u32) -> Vec<u8> {
    let mut b = vec![0u8; nvos00::SIZE as usize];
    put32(&mut b, nvos00::H_ROOT_OFFSET, CLIENT);
    put32(&mut b, nvos00::H_OBJECT_PARENT_OFFSET, CLIENT);
    put32(&mut b, nvos00::H_OBJECT_OLD_OFFSET, object);
    put32(&mut b, nvos00::STATUS_OFFSET, st);
    b
}

#[test]
fn rm_free_and_display() {
    let data = nvos00(DEVICE, status::NV_ERR_INVALID_OBJECT_HANDLE);
    let d = decode(
        &frontend(esc(escape::RM_FREE, nvos00::SIZE), &data, &[]),
        &Layout::DEFAULT,
    );
    assert_eq!(
        d.op,
        Op::Free {
            client: CLIENT,
            parent: CLIENT,
            object: DEVICE
        }
    );
    assert_eq!(d.status, Some(0x33));
    assert_eq!(
        d.to_string(),
        "NV_ESC_RM_FREE(hRoot=0xc1d00001 hParent=0xc1d00001 hObjectOld=0xcaf00002 \
         status=NV_ERR_INVALID_OBJECT_HANDLE) = NV_ERR_INVALID_OBJECT_HANDLE"
    );
}

#[test]
fn xfer_wrapping_rm_free_decodes_as_the_inner_call() {
    let inner = nvos00(CLIENT, status::NV_OK);
    let mut x = vec![0u8; xfer::SIZE as usize];
    put32(&mut x, xfer::CMD_OFFSET, escape::RM_FREE);
    put32(&mut x, xfer::SIZE_OFFSET, nvos00::SIZE);
    put64(&mut x, xfer::PTR_OFFSET, 0x7fff_1234_0000);
    let d = decode(
        &frontend(esc(escape::IOCTL_XFER_CMD, xfer::SIZE), &x, &inner),
        &Layout::DEFAULT,
    );
    assert_eq!(d.escape, "NV_ESC_RM_FREE");
    assert_eq!(d.nr, escape::RM_FREE);
    assert!(d.xfer);
    assert_eq!(
        d.op,
        Op::Free {
            client: CLIENT,
            parent: CLIENT,
            object: CLIENT
        }
    );
    assert_eq!(d.status, Some(status::NV_OK));
    assert!(d.to_string().starts_with("[xfer] NV_ESC_RM_FREE("));
    // Inner params not captured: the inner call is truncated.
    let d = decode(
        &frontend(esc(escape::IOCTL_XFER_CMD, xfer::SIZE), &x, &[]),
        &Layout::DEFAULT,
    );
    assert_eq!(
        (d.escape.as_ref(), d.op, d.status),
        ("NV_ESC_RM_FREE", Op::Truncated, None)
    );
    // XFER inside XFER is not followed.
    put32(&mut x, xfer::CMD_OFFSET, escape::IOCTL_XFER_CMD);
    let d = decode(
        &frontend(esc(escape::IOCTL_XFER_CMD, xfer::SIZE), &x, &x),
        &Layout::DEFAULT,
    );
    assert_eq!(d.op, Op::Truncated);
}

#[test]
fn rm_control_names_its_command() {
    let mut b = vec![0u8; nvos54::SIZE as usize];
    put32(&mut b, nvos54::H_CLIENT_OFFSET, CLIENT);
    put32(&mut b, nvos54::H_OBJECT_OFFSET, 0xcaf0_0004);
    put32(
        &mut b,
        nvos54::CMD_OFFSET,
        ctrl::NV2080_CTRL_CMD_GPU_GET_INFO_V2,
    );
    put32(&mut b, nvos54::PARAMS_SIZE_OFFSET, 0x104);
    put32(&mut b, nvos54::STATUS_OFFSET, status::NV_ERR_NOT_SUPPORTED);
    let d = decode(
        &frontend(esc(escape::RM_CONTROL, nvos54::SIZE), &b, &[0; 16]),
        &Layout::DEFAULT,
    );
    assert_eq!(
        d.op,
        Op::Control {
            client: CLIENT,
            object: 0xcaf0_0004,
            cmd: 0x2080_0102
        }
    );
    assert_eq!(d.status, Some(status::NV_ERR_NOT_SUPPORTED));
    assert!(
        d.args()
            .contains("cmd=NV2080_CTRL_CMD_GPU_GET_INFO_V2(0x20800102)"),
        "{}",
        d.args()
    );
    let json = serde_json::to_value(&d).expect("json");
    assert_eq!(json["escape"], "NV_ESC_RM_CONTROL");
    assert_eq!(json["op"]["op"], "control");
    assert_eq!(
        json["fields"]["cmd"]["name"],
        "NV2080_CTRL_CMD_GPU_GET_INFO_V2"
    );
    assert_eq!(
        json["fields"]["status"]["value"],
        status::NV_ERR_NOT_SUPPORTED
    );
    assert_eq!(json["fields"]["paramsCaptured"], 16);
}

#[test]
fn nvos46_and_nvos47_every_band() {
    for major in [515, 545, 550, 575, 580, 595] {
        let l = layout(major);
        let mut map = vec![0u8; l.nvos46_size as usize];
        put32(&mut map, nvos46::H_MEMORY_OFFSET, MEMORY);
        put64(&mut map, nvos46::LENGTH_OFFSET, 4096);
        put64(&mut map, l.nvos46_dma_offset, 0x2_0000_0000);
        put32(&mut map, l.nvos46_status, status::NV_ERR_NO_MEMORY);
        let d = decode(
            &frontend(esc(escape::RM_MAP_MEMORY_DMA, l.nvos46_size), &map, &[]),
            &l,
        );
        assert_eq!(d.status, Some(status::NV_ERR_NO_MEMORY), "{major}");
        assert_eq!(
            field(&d, "dmaOffset"),
            Some(&Value::Hex(0x2_0000_0000)),
            "{major}"
        );
        assert_eq!(field(&d, "hMemory"), Some(&Value::Handle(MEMORY)));
        assert_eq!(field(&d, "flags2").is_some(), major >= 580);

        let mut unmap = vec![0u8; l.nvos47_size as usize];
        put32(&mut unmap, nvos47::H_MEMORY_OFFSET, MEMORY);
        put64(&mut unmap, nvos47::DMA_OFFSET_OFFSET, 0x2_0000_0000);
        if let Some(off) = l.nvos47_length {
            put64(&mut unmap, off, 4096);
        }
        put32(&mut unmap, l.nvos47_status, status::NV_OK);
        let d = decode(
            &frontend(esc(escape::RM_UNMAP_MEMORY_DMA, l.nvos47_size), &unmap, &[]),
            &l,
        );
        assert_eq!(d.status, Some(status::NV_OK), "{major}");
        assert_eq!(
            field(&d, "size"),
            l.nvos47_length.map(|_| &Value::Bytes(4096)),
            "{major}"
        );
        let d = decode(
            &frontend(
                esc(escape::RM_UNMAP_MEMORY_DMA, l.nvos47_size),
                &unmap[..8],
                &[],
            ),
            &l,
        );
        assert_eq!((d.op, d.status), (Op::Truncated, None));
    }
}

#[test]
fn uvm_free_before_and_after_590() {
    for major in [515, 580, 590, 595] {
        let l = layout(major);
        let mut b = vec![0u8; l.uvm_free_size as usize];
        put64(&mut b, uvm_free::BASE_OFFSET, 0x7f00_0000_0000);
        if let Some(off) = l.uvm_free_length {
            put64(&mut b, off, 1 << 21);
        }
        put32(&mut b, l.uvm_free_status, status::NV_ERR_INVALID_ADDRESS);
        let call = Call {
            fd_kind: FdKind::Uvm,
            cmd: uvm::FREE,
            data: &b,
            nested: &[],
        };
        let d = decode(&call, &l);
        assert_eq!(d.escape, "UVM_FREE");
        assert_eq!(d.op, Op::Uvm { cmd: uvm::FREE });
        assert_eq!(d.status, Some(status::NV_ERR_INVALID_ADDRESS), "{major}");
        assert_eq!(field(&d, "length").is_some(), major < 590);
    }
    // A 580 driver's 24-byte UVM_FREE captured as 16 bytes is truncated.
    let b = vec![0u8; 16];
    let d = decode(
        &Call {
            fd_kind: FdKind::Uvm,
            cmd: uvm::FREE,
            data: &b,
            nested: &[],
        },
        &layout(580),
    );
    assert_eq!((d.op, d.status), (Op::Truncated, None));
}

#[test]
fn uvm_lifecycle_commands() {
    let l = Layout::DEFAULT;
    let mut init = vec![0u8; puvm::initialize::SIZE as usize];
    put32(&mut init, puvm::initialize::RM_STATUS_OFFSET, status::NV_OK);
    let d = decode(
        &Call {
            fd_kind: FdKind::Uvm,
            cmd: uvm::INITIALIZE,
            data: &init,
            nested: &[],
        },
        &l,
    );
    assert_eq!(
        (d.escape.as_ref(), &d.op, d.status),
        ("UVM_INITIALIZE", &Op::UvmInitialize, Some(0))
    );

    let mut reg = vec![0u8; puvm::register_gpu::SIZE as usize];
    reg[..16].copy_from_slice(&[0xab; 16]);
    put32(&mut reg, puvm::register_gpu::RM_CTRL_FD_OFFSET, 5);
    put32(&mut reg, puvm::register_gpu::H_CLIENT_OFFSET, CLIENT);
    put32(
        &mut reg,
        puvm::register_gpu::RM_STATUS_OFFSET,
        status::NV_ERR_GPU_UUID_NOT_FOUND,
    );
    let d = decode(
        &Call {
            fd_kind: FdKind::Uvm,
            cmd: uvm::REGISTER_GPU,
            data: &reg,
            nested: &[],
        },
        &l,
    );
    assert_eq!(
        (d.op.clone(), d.status),
        (Op::UvmRegisterGpu, Some(status::NV_ERR_GPU_UUID_NOT_FOUND))
    );
    assert_eq!(
        field(&d, "gpu_uuid"),
        Some(&Value::Str(
            "GPU-abababab-abab-abab-abab-abababababab".to_owned()
        ))
    );
    assert_eq!(field(&d, "hClient"), Some(&Value::Handle(CLIENT)));

    let mut mm = vec![0u8; puvm::mm_initialize::SIZE as usize];
    put32(&mut mm, puvm::mm_initialize::UVM_FD_OFFSET, 7);
    let d = decode(
        &Call {
            fd_kind: FdKind::Uvm,
            cmd: uvm::MM_INITIALIZE,
            data: &mm,
            nested: &[],
        },
        &l,
    );
    assert_eq!((d.op, d.status), (Op::UvmMmInitialize, Some(0)));
    // Not present before 535: known name, no layout, no status.
    let d = decode(
        &Call {
            fd_kind: FdKind::Uvm,
            cmd: uvm::MM_INITIALIZE,
            data: &mm,
            nested: &[],
        },
        &layout(530),
    );
    assert_eq!((d.op, d.status), (Op::UvmMmInitialize, None));

    let d = decode(
        &Call {
            fd_kind: FdKind::Uvm,
            cmd: uvm::DEINITIALIZE,
            data: &[],
            nested: &[],
        },
        &l,
    );
    assert_eq!((d.op, d.status), (Op::UvmDeinitialize, None));
}

#[test]
fn memory_escapes() {
    let l = Layout::DEFAULT;
    let mut a = vec![0u8; nvos02::WITH_FD_SIZE as usize];
    put32(&mut a, nvos02::H_ROOT_OFFSET, CLIENT);
    put32(&mut a, nvos02::H_OBJECT_PARENT_OFFSET, DEVICE);
    put32(&mut a, nvos02::H_OBJECT_NEW_OFFSET, MEMORY);
    put32(
        &mut a,
        nvos02::H_CLASS_OFFSET,
        class::NV01_MEMORY_SYSTEM_OS_DESCRIPTOR,
    );
    put64(&mut a, nvos02::LIMIT_OFFSET, (1 << 20) - 1);
    put32(&mut a, nvos02::FD_OFFSET, 9);
    let d = decode(
        &frontend(esc(escape::RM_ALLOC_MEMORY, nvos02::WITH_FD_SIZE), &a, &[]),
        &l,
    );
    let want = Op::AllocMemory {
        client: CLIENT,
        parent: DEVICE,
        object: MEMORY,
        class: class::NV01_MEMORY_SYSTEM_OS_DESCRIPTOR,
        size: 1 << 20,
    };
    assert_eq!((d.op, d.status), (want, Some(0)));

    let mut v = vec![0u8; nvos32::SIZE as usize];
    put32(&mut v, nvos32::H_ROOT_OFFSET, CLIENT);
    put32(&mut v, nvos32::H_OBJECT_PARENT_OFFSET, DEVICE);
    put32(&mut v, nvos32::FUNCTION_OFFSET, nvos32::FUNCTION_ALLOC_SIZE);
    put32(&mut v, nvos32::H_MEMORY_OFFSET, MEMORY);
    put64(&mut v, nvos32::ALLOC_SIZE_OFFSET, 1 << 30);
    let d = decode(
        &frontend(esc(escape::RM_VID_HEAP_CONTROL, nvos32::SIZE), &v, &[]),
        &l,
    );
    assert_eq!(
        d.op,
        Op::VidHeapAlloc {
            client: CLIENT,
            parent: DEVICE,
            object: MEMORY,
            size: 1 << 30
        }
    );
    put32(&mut v, nvos32::FUNCTION_OFFSET, nvos32::FUNCTION_FREE);
    let d = decode(
        &frontend(esc(escape::RM_VID_HEAP_CONTROL, nvos32::SIZE), &v, &[]),
        &l,
    );
    assert_eq!(
        d.op,
        Op::VidHeapFree {
            client: CLIENT,
            parent: DEVICE,
            object: MEMORY
        }
    );

    let mut m = vec![0u8; nvos33::WITH_FD_SIZE as usize];
    put32(&mut m, nvos33::H_CLIENT_OFFSET, CLIENT);
    put32(&mut m, nvos33::H_DEVICE_OFFSET, DEVICE);
    put32(&mut m, nvos33::H_MEMORY_OFFSET, MEMORY);
    put64(&mut m, nvos33::LENGTH_OFFSET, 4096);
    put32(
        &mut m,
        nvos33::STATUS_OFFSET,
        status::NV_ERR_INVALID_ARGUMENT,
    );
    let d = decode(
        &frontend(esc(escape::RM_MAP_MEMORY, nvos33::WITH_FD_SIZE), &m, &[]),
        &l,
    );
    assert_eq!(
        d.op,
        Op::MapMemory {
            client: CLIENT,
            device: DEVICE,
            memory: MEMORY,
            length: 4096,
            fd: Some(0),
        }
    );
    assert_eq!(d.status, Some(status::NV_ERR_INVALID_ARGUMENT));

    let mut u = vec![0u8; nvos34::SIZE as usize];
    put32(&mut u, nvos34::H_CLIENT_OFFSET, CLIENT);
    put32(&mut u, nvos34::H_DEVICE_OFFSET, DEVICE);
    put32(&mut u, nvos34::H_MEMORY_OFFSET, MEMORY);
    let d = decode(
        &frontend(esc(escape::RM_UNMAP_MEMORY, nvos34::SIZE), &u, &[]),
        &l,
    );
    assert_eq!(
        d.op,
        Op::UnmapMemory {
            client: CLIENT,
            device: DEVICE,
            memory: MEMORY
        }
    );

    let mut dup = vec![0u8; nvos55::SIZE as usize];
    put32(&mut dup, nvos55::H_CLIENT_OFFSET, CLIENT);
    put32(&mut dup, nvos55::H_PARENT_OFFSET, DEVICE);
    put32(&mut dup, nvos55::H_OBJECT_OFFSET, 0xbeef);
    put32(&mut dup, nvos55::H_CLIENT_SRC_OFFSET, 0xc1d0_0099);
    put32(&mut dup, nvos55::H_OBJECT_SRC_OFFSET, MEMORY);
    let d = decode(
        &frontend(esc(escape::RM_DUP_OBJECT, nvos55::SIZE), &dup, &[]),
        &l,
    );
    let want = Op::DupObject {
        client: CLIENT,
        parent: DEVICE,
        object: 0xbeef,
        src_client: 0xc1d0_0099,
        src_object: MEMORY,
    };
    assert_eq!(d.op, want);
}

#[test]
fn os_escapes() {
    let l = Layout::DEFAULT;
    let mut r = vec![0u8; register_fd::SIZE as usize];
    put32(&mut r, register_fd::CTL_FD_OFFSET, 3);
    let call = Call {
        fd_kind: FdKind::Device,
        cmd: esc(escape::REGISTER_FD, 4),
        data: &r,
        nested: &[],
    };
    assert_eq!(decode(&call, &l).op, Op::RegisterFd { ctl_fd: 3 });

    let mut v = vec![0u8; check_version_str::SIZE as usize];
    put32(
        &mut v,
        check_version_str::REPLY_OFFSET,
        check_version_str::REPLY_RECOGNIZED,
    );
    let text = b"595.45.04";
    let at = check_version_str::VERSION_STRING_OFFSET as usize;
    v[at..at + text.len()].copy_from_slice(text);
    let d = decode(
        &frontend(
            esc(escape::CHECK_VERSION_STR, check_version_str::SIZE),
            &v,
            &[],
        ),
        &l,
    );
    assert_eq!(d.op, Op::CheckVersion);
    assert_eq!(
        field(&d, "versionString"),
        Some(&Value::Str("595.45.04".to_owned()))
    );

    let mut c = vec![0u8; 2 * card_info::ENTRY_SIZE as usize];
    c[card_info::VALID_OFFSET as usize] = 1;
    put32(&mut c, card_info::GPU_ID_OFFSET, 0x100);
    c[(card_info::PCI_VENDOR_ID_OFFSET) as usize..(card_info::PCI_VENDOR_ID_OFFSET + 2) as usize]
        .copy_from_slice(&0x10deu16.to_ne_bytes());
    let d = decode(
        &frontend(esc(escape::CARD_INFO, c.len() as u32), &c, &[]),
        &l,
    );
    assert_eq!(d.op, Op::CardInfo);
    assert_eq!(field(&d, "entries"), Some(&Value::U32(2)));
    let Some(Value::Str(gpus)) = field(&d, "gpus") else {
        panic!("{d:?}")
    };
    assert!(
        gpus.starts_with("id=0x100 minor=0 pci=0000:00:00.0 10de:0000"),
        "{gpus}"
    );
}

#[test]
fn unknown_and_short_input_never_panic() {
    let l = Layout::DEFAULT;
    let d = decode(&frontend(esc(0x99, 8), &[1, 2, 3], &[]), &l);
    assert_eq!((d.op, d.status), (Op::Unknown, None));
    assert!(d.escape.starts_with("UNKNOWN(0xc0084699"), "{}", d.escape);
    for nr in escape::ALL {
        for len in [0usize, 1, 3, 15] {
            let data = vec![0xffu8; len];
            let d = decode(&frontend(esc(nr, 64), &data, &data), &l);
            assert!(d.status.is_none(), "{nr:#x} len {len}: {d:?}");
        }
    }
    for cmd in uvm::ALL {
        let d = decode(
            &Call {
                fd_kind: FdKind::Uvm,
                cmd,
                data: &[],
                nested: &[],
            },
            &l,
        );
        assert!(d.status.is_none());
    }
    let d = decode(
        &Call {
            fd_kind: FdKind::Uvm,
            cmd: 0x1234,
            data: &[0; 64],
            nested: &[],
        },
        &l,
    );
    assert_eq!((d.op, d.escape.as_ref()), (Op::Unknown, "UNKNOWN(0x1234)"));
    let d = decode(
        &Call {
            fd_kind: FdKind::Modeset,
            cmd: esc(escape::RM_FREE, 16),
            data: &[0; 16],
            nested: &[],
        },
        &l,
    );
    assert_eq!(d.op, Op::Unknown);
}

/// The size a complete struct must have for `call` to report a status (None: never reports one).
fn status_needs(call: &Call, l: &Layout) -> Option<usize> {
    if call.fd_kind.is_uvm() || (call.fd_kind == FdKind::Unknown && !ioc::is_nvidia(call.cmd)) {
        return l.uvm_params(call.cmd).map(|p| p.size as usize);
    }
    match ioc::nr(call.cmd) {
        escape::RM_ALLOC => l
            .rm_alloc_layout(ioc::size(call.cmd))
            .map(|a| a.size as usize),
        escape::IOCTL_XFER_CMD => Some(0),
        nr => l.escape_params_size(nr).map(|s| s as usize),
    }
}

fn any_kind() -> impl Strategy<Value = FdKind> {
    (0u8..8).prop_map(FdKind::from_u8)
}

fn any_cmd() -> impl Strategy<Value = u32> {
    prop_oneof![
        any::<u32>(),
        (proptest::sample::select(escape::ALL.to_vec()), 0u32..300)
            .prop_map(|(nr, size)| esc(nr, size)),
        proptest::sample::select(uvm::ALL.to_vec()),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn decode_never_panics_and_status_needs_a_whole_struct(
        kind in any_kind(),
        cmd in any_cmd(),
        data in proptest::collection::vec(any::<u8>(), 0..400),
        nested in proptest::collection::vec(any::<u8>(), 0..300),
        major in 500u32..620,
    ) {
        let l = Layout::for_version(DriverVersion::new(major, 0, 0));
        let call = Call { fd_kind: kind, cmd, data: &data, nested: &nested };
        let d = decode(&call, &l);
        let _ = d.to_string();
        let _ = serde_json::to_string(&d).map_err(|e| TestCaseError::fail(e.to_string()))?;
        if d.status.is_some() {
            if d.xfer {
                prop_assert!(data.len() >= xfer::SIZE as usize);
            } else {
                let needs = status_needs(&call, &l);
                prop_assert!(needs.is_some_and(|n| data.len() >= n), "{d:?} needs {needs:?}");
            }
        }
    }
}

/// `nvidia_ioctl` (`kernel-open/nvidia/nv.c`, 515.43.04 .. 595.45.04) never checks `_IOC_TYPE`: on
/// nvidiactl/nvidiaN a command with another type runs as the escape its number names, so it decodes as
/// that escape (only the FreeBSD/Solaris frontends answer ENOTTY).
#[test]
fn frontend_call_with_a_foreign_magic_runs_as_its_escape() {
    let data = nvos00(DEVICE, status::NV_OK);
    for kind in [FdKind::Ctl, FdKind::Device] {
        let cmd = ioc::iowr(b'G', escape::RM_FREE, nvos00::SIZE);
        let d = decode(
            &Call {
                fd_kind: kind,
                cmd,
                data: &data,
                nested: &[],
            },
            &Layout::DEFAULT,
        );
        assert_eq!(d.escape, "NV_ESC_RM_FREE", "{kind:?}: {d}");
        assert_eq!(d.status, Some(status::NV_OK), "{kind:?}: {d}");
        assert!(matches!(d.op, Op::Free { object: DEVICE, .. }), "{d:?}");
    }
}

/// From 595.44.02 `nv_validate_ioctls` (`kernel-open/nvidia/nv.c`) fails a known escape with a wrong
/// `_IOC_SIZE` with -EINVAL before RM sees it (its status field is never written); 590.48.01 has no such
/// check and RM reads the params.
#[test]
fn wrong_size_is_refused_from_595_44_02() {
    let mut data = nvos00(DEVICE, status::NV_OK);
    data.extend_from_slice(&[0; 4]);
    let cmd = esc(escape::RM_FREE, 20);
    let new = Layout::for_version(DriverVersion::new(595, 44, 2));
    let d = decode(&frontend(cmd, &data, &[]), &new);
    assert_eq!((&d.op, d.status), (&Op::Refused, None), "{d}");
    assert_eq!(d.escape, "NV_ESC_RM_FREE");
    assert!(d.to_string().ends_with("<refused>"), "{d}");
    let old = Layout::for_version(DriverVersion::new(590, 48, 1));
    let d = decode(&frontend(cmd, &data, &[]), &old);
    assert_eq!(d.status, Some(status::NV_OK), "{d}");
    // The right size still decodes at 595.44.02.
    let d = decode(&frontend(esc(escape::RM_FREE, 16), &data[..16], &[]), &new);
    assert_eq!(d.status, Some(status::NV_OK), "{d}");
}

/// NV_ESC_EXPORT_TO_DMABUF_FD: `nv_ioctl_export_to_dma_buf_fd_t` in `kernel-open/common/inc/nv-ioctl.h` is
/// 2600 bytes with status@2592 at 515.43.04 .. 565.77 and 2608 bytes with status@2600 from 570.86.15
/// (`mappingType` added); gVisor `pkg/abi/nvgpu/frontend.go` (IoctlExportToDMABufFD / _V570) agrees.
#[test]
fn export_to_dmabuf_fd_by_band() {
    for (version, size, status_at) in [
        (DriverVersion::new(515, 43, 4), 2600u32, 2592u32),
        (DriverVersion::new(565, 77, 0), 2600, 2592),
        (DriverVersion::new(570, 86, 15), 2608, 2600),
        (DriverVersion::new(575, 64, 5), 2608, 2600),
        (DriverVersion::new(580, 65, 6), 2608, 2600),
        (DriverVersion::new(595, 45, 4), 2608, 2600),
    ] {
        let l = Layout::for_version(version);
        assert_eq!(
            l.escape_params_size(escape::EXPORT_TO_DMABUF_FD),
            Some(size),
            "{version}"
        );
        let mut b = vec![0u8; size as usize];
        put32(&mut b, 4, CLIENT);
        put32(&mut b, status_at, status::NV_ERR_INVALID_ARGUMENT);
        let cmd = esc(escape::EXPORT_TO_DMABUF_FD, size);
        let d = decode(&frontend(cmd, &b, &[]), &l);
        assert_eq!(
            d.status,
            Some(status::NV_ERR_INVALID_ARGUMENT),
            "{version}: {d}"
        );
        assert_eq!(field(&d, "hClient"), Some(&Value::Handle(CLIENT)));
        assert_eq!(
            field(&d, "mappingType").is_some(),
            size == 2608,
            "{version}"
        );
        // bAllowMmap (byte 33) exists from 580.65.06 (nv-ioctl.h; gVisor IoctlExportToDMABufFD_V580).
        assert_eq!(
            field(&d, "bAllowMmap").is_some(),
            version.major >= 580,
            "{version}"
        );
        // One byte short of the band's struct: no status.
        let d = decode(&frontend(cmd, &b[..size as usize - 1], &[]), &l);
        assert_eq!((d.op, d.status), (Op::Truncated, None), "{version}");
    }
}

/// NV_ESC_NUMA_INFO: `nv_ioctl_numa_info_t` in `kernel-open/common/inc/nv-ioctl-numa.h` is 552 bytes at
/// 515.43.04 .. 530.41.03 and 560 bytes from 535.43.02.
#[test]
fn numa_info_size_by_band() {
    for (version, size) in [
        (DriverVersion::new(515, 43, 4), 552u32),
        (DriverVersion::new(530, 41, 3), 552),
        (DriverVersion::new(535, 43, 2), 560),
        (DriverVersion::new(595, 45, 4), 560),
    ] {
        let l = Layout::for_version(version);
        assert_eq!(
            l.escape_params_size(escape::NUMA_INFO),
            Some(size),
            "{version}"
        );
        let b = vec![0u8; size as usize];
        let cmd = esc(escape::NUMA_INFO, size);
        assert_eq!(
            decode(&frontend(cmd, &b, &[]), &l).op,
            Op::Other,
            "{version}"
        );
        let short = &b[..size as usize - 1];
        assert_eq!(
            decode(&frontend(cmd, short, &[]), &l).op,
            Op::Truncated,
            "{version}"
        );
    }
}

/// UVM_SET_PREFERRED_LOCATION: `UVM_SET_PREFERRED_LOCATION_PARAMS` in `kernel-open/nvidia-uvm/uvm_ioctl.h`
/// has rmStatus@36 (preferredCpuNumaNode added) already at 550.40.07, the first 550 tag, while
/// UVM_MAP_EXTERNAL_ALLOCATION there still has its 545 size (1200 bytes) until 550.40.53; gVisor
/// `pkg/sentry/devices/nvproxy/version.go` switches to UVM_SET_PREFERRED_LOCATION_PARAMS_V550 at 550.40.07.
#[test]
fn uvm_set_preferred_location_status_at_550_40_07() {
    for (version, status_at) in [
        (DriverVersion::new(545, 29, 6), 32u32),
        (DriverVersion::new(550, 40, 7), 36),
        (DriverVersion::new(550, 40, 53), 36),
        (DriverVersion::new(595, 45, 4), 36),
    ] {
        let l = Layout::for_version(version);
        let mut b = vec![0u8; 40];
        put32(&mut b, status_at, status::NV_ERR_INVALID_DEVICE);
        let call = Call {
            fd_kind: FdKind::Uvm,
            cmd: uvm::SET_PREFERRED_LOCATION,
            data: &b,
            nested: &[],
        };
        let d = decode(&call, &l);
        assert_eq!(
            d.status,
            Some(status::NV_ERR_INVALID_DEVICE),
            "{version}: {d}"
        );
    }
    let first_550 = Layout::for_version(DriverVersion::new(550, 40, 7));
    assert_eq!(
        first_550
            .uvm_params(uvm::MAP_EXTERNAL_ALLOCATION)
            .map(|p| p.size),
        Some(1200)
    );
}

fn uvm_call(cmd: u32, data: &[u8]) -> Call<'_> {
    Call {
        fd_kind: FdKind::Uvm,
        cmd,
        data,
        nested: &[],
    }
}

/// UVM_MAP_EXTERNAL_ALLOCATION: `UVM_MAP_EXTERNAL_ALLOCATION_PARAMS` in `kernel-open/nvidia-uvm/uvm_ioctl.h`
/// carries perGpuAttributes[UVM_MAX_GPUS] (1200 bytes: rmCtrlFd@1184, hClient@1188, hMemory@1192,
/// rmStatus@1196) up to 550.40.07 and perGpuAttributes[UVM_MAX_GPUS_V2] (9264 bytes: rmCtrlFd@9248 ..
/// rmStatus@9260) from 550.40.53; gVisor `pkg/abi/nvgpu/uvm.go` (UVM_MAP_EXTERNAL_ALLOCATION_PARAMS /
/// _V550). The decoder must follow the struct's band, not the major.
#[test]
fn uvm_map_external_allocation_fields_follow_the_band() {
    use puvm::map_external_allocation as m;
    for (version, size, fd_at, client_at, memory_at, status_at) in [
        (
            DriverVersion::new(545, 29, 6),
            1200u32,
            1184,
            1188,
            1192,
            1196,
        ),
        (DriverVersion::new(550, 40, 7), 1200, 1184, 1188, 1192, 1196),
        (
            DriverVersion::new(550, 40, 53),
            9264,
            9248,
            9252,
            9256,
            9260,
        ),
        (DriverVersion::new(595, 45, 4), 9264, 9248, 9252, 9256, 9260),
    ] {
        let l = Layout::for_version(version);
        let mut b = vec![0u8; size as usize];
        put64(&mut b, m::BASE_OFFSET, 0x7f00_0000_0000);
        put64(&mut b, m::LENGTH_OFFSET, 1 << 21);
        put32(&mut b, fd_at, 7);
        put32(&mut b, client_at, CLIENT);
        put32(&mut b, memory_at, MEMORY);
        put32(&mut b, status_at, status::NV_ERR_INVALID_ADDRESS);
        let d = decode(&uvm_call(uvm::MAP_EXTERNAL_ALLOCATION, &b), &l);
        assert_eq!(d.status, Some(status::NV_ERR_INVALID_ADDRESS), "{version}");
        assert_eq!(
            field(&d, "rmCtrlFd"),
            Some(&Value::Str("7".into())),
            "{version}"
        );
        assert_eq!(
            field(&d, "hClient"),
            Some(&Value::Handle(CLIENT)),
            "{version}"
        );
        assert_eq!(
            field(&d, "hMemory"),
            Some(&Value::Handle(MEMORY)),
            "{version}"
        );
    }
}

/// rangeGroupId is a NvU64 in `UVM_CREATE_RANGE_GROUP_PARAMS`, `UVM_DESTROY_RANGE_GROUP_PARAMS`,
/// `UVM_SET_RANGE_GROUP_PARAMS` and `UVM_MIGRATE_RANGE_GROUP_PARAMS` (`kernel-open/nvidia-uvm/uvm_ioctl.h`,
/// 515.43.04 .. 595.45.04; gVisor `pkg/abi/nvgpu/uvm.go`): all 64 bits are decoded.
#[test]
fn uvm_range_group_id_is_64_bits() {
    let l = Layout::for_version(DriverVersion::new(595, 45, 4));
    let id = 0x1234_5678_9abc_def0u64;
    for (cmd, size, id_at, status_at) in [
        (uvm::CREATE_RANGE_GROUP, 16u32, 0u32, 8u32),
        (uvm::DESTROY_RANGE_GROUP, 16, 0, 8),
        (uvm::SET_RANGE_GROUP, 32, 0, 24),
        (uvm::MIGRATE_RANGE_GROUP, 32, 0, 24),
    ] {
        let mut b = vec![0u8; size as usize];
        put64(&mut b, id_at, id);
        let d = decode(&uvm_call(cmd, &b), &l);
        assert_eq!(field(&d, "rangeGroupId"), Some(&Value::U64(id)), "{d}");
        assert_eq!(d.status, Some(status::NV_OK), "{d}");
        assert_eq!(
            l.uvm_params(cmd).and_then(|p| p.status_offset),
            Some(status_at)
        );
    }
}

/// Status 0x8B is NV_ERR_DMA_XFER_FAILED at 580.105.08 .. 590.48.01 and NV_ERR_OPERATION_ABORTED from
/// 595.44.02 (`src/common/sdk/nvidia/inc/nvstatuscodes.h` at those tags): the decoder names a call's status
/// and its status field as the traced driver does.
#[test]
fn status_names_follow_the_driver_version() {
    let data = nvos00(DEVICE, 0x8b);
    let cmd = esc(escape::RM_FREE, nvos00::SIZE);
    for (version, want) in [
        (DriverVersion::new(580, 105, 8), "NV_ERR_DMA_XFER_FAILED"),
        (DriverVersion::new(590, 48, 1), "NV_ERR_DMA_XFER_FAILED"),
        (DriverVersion::new(595, 44, 2), "NV_ERR_OPERATION_ABORTED"),
    ] {
        let d = decode(&frontend(cmd, &data, &[]), &Layout::for_version(version));
        assert!(
            d.to_string().ends_with(&format!(" = {want}")),
            "{version}: {d}"
        );
        let status = field(&d, "status").expect("status field");
        assert_eq!(status.name(), Some(want), "{version}");
        let json = serde_json::to_value(&d).expect("json");
        assert_eq!(json["fields"]["status"]["name"], want, "{version}");
    }
}

/// Escape 0x5F is NV_ESC_RM_NVLOG_CTRL at 535.288.01 and NV_ESC_RM_LOCKLESS_DIAGNOSTIC from 545.23.06
/// (`src/nvidia/arch/nvalloc/unix/include/nv_escape.h` at those tags); absent at 530.41.03.
#[test]
fn escape_0x5f_is_named_as_the_driver_names_it() {
    let data = [0u8; 64];
    let cmd = esc(0x5f, 64);
    for (version, want) in [
        (DriverVersion::new(535, 288, 1), "NV_ESC_RM_NVLOG_CTRL"),
        (
            DriverVersion::new(545, 23, 6),
            "NV_ESC_RM_LOCKLESS_DIAGNOSTIC",
        ),
        (
            DriverVersion::new(595, 45, 4),
            "NV_ESC_RM_LOCKLESS_DIAGNOSTIC",
        ),
    ] {
        let d = decode(&frontend(cmd, &data, &[]), &Layout::for_version(version));
        assert_eq!(d.escape, want, "{version}");
    }
    let d = decode(
        &frontend(cmd, &data, &[]),
        &Layout::for_version(DriverVersion::new(530, 41, 3)),
    );
    assert_eq!(d.op, Op::Unknown);
}

/// The UVM range-group ioctls (23, 24, 31, 53) were removed in 610.43.02 (gVisor
/// `pkg/sentry/devices/nvproxy/version.go`, v610_43_02): a 610 driver does not know them, so neither does
/// the decoder; 595.45.04 still has them (`kernel-open/nvidia-uvm/uvm_ioctl.h`).
#[test]
fn uvm_range_groups_are_unknown_from_610() {
    let data = [0u8; 32];
    for cmd in [
        uvm::CREATE_RANGE_GROUP,
        uvm::DESTROY_RANGE_GROUP,
        uvm::SET_RANGE_GROUP,
        uvm::MIGRATE_RANGE_GROUP,
    ] {
        let l595 = Layout::for_version(DriverVersion::new(595, 45, 4));
        let d = decode(&uvm_call(cmd, &data), &l595);
        assert_eq!(d.status, Some(status::NV_OK), "{cmd}: {d}");
        let l610 = Layout::for_version(DriverVersion::new(610, 43, 2));
        let d = decode(&uvm_call(cmd, &data), &l610);
        assert_eq!((&d.op, d.status), (&Op::Unknown, None), "{cmd}: {d}");
    }
}

/// RM_CONTROL of 0x20801358: NV2080_CTRL_CMD_FB_QUERY_DRAM_ENCRYPTION_INFOROM_SUPPORT at 570.x and
/// NV2080_CTRL_CMD_FB_QUERY_DRAM_ENCRYPTION_STATUS from 575.51.02 (`ctrl/ctrl2080/ctrl2080fb.h` at
/// 570.195.03 and 575.51.02; gVisor `pkg/abi/nvgpu/ctrl.go`).
#[test]
fn control_command_names_follow_the_driver_version() {
    let mut b = vec![0u8; nvos54::SIZE as usize];
    put32(&mut b, nvos54::CMD_OFFSET, 0x2080_1358);
    let cmd = esc(escape::RM_CONTROL, nvos54::SIZE);
    for (version, want) in [
        (
            DriverVersion::new(570, 195, 3),
            "NV2080_CTRL_CMD_FB_QUERY_DRAM_ENCRYPTION_INFOROM_SUPPORT",
        ),
        (
            DriverVersion::new(575, 51, 2),
            "NV2080_CTRL_CMD_FB_QUERY_DRAM_ENCRYPTION_STATUS",
        ),
    ] {
        let d = decode(&frontend(cmd, &b, &[]), &Layout::for_version(version));
        assert_eq!(
            field(&d, "cmd").and_then(Value::name),
            Some(want),
            "{version}"
        );
        assert!(d.args().contains(&format!("cmd={want}(0x20801358)")), "{d}");
    }
}

/// RM_ALLOC of classes CUDA/NVML allocate that the decoder used to leave unnamed (gVisor
/// `pkg/abi/nvgpu/classes.go`; `src/common/sdk/nvidia/inc/class/cl503b.h`, `clcb33.h` at 595.45.04).
#[test]
fn rm_alloc_names_the_classes_cuda_and_nvml_allocate() {
    let l = Layout::DEFAULT;
    let al = l.rm_alloc_layout(l.nvos64_size).expect("nvos64");
    for (c, want) in [
        (class::NV50_P2P, "NV50_P2P"),
        (class::NV_CONFIDENTIAL_COMPUTE, "NV_CONFIDENTIAL_COMPUTE"),
        (class::RM_USER_SHARED_DATA, "RM_USER_SHARED_DATA"),
    ] {
        let data = rm_alloc_struct(&al, c, status::NV_OK);
        let d = decode(&frontend(esc(escape::RM_ALLOC, al.size), &data, &[]), &l);
        assert_eq!(field(&d, "hClass").and_then(Value::name), Some(want));
    }
}

/// NV_ESC_RM_LOCKLESS_DIAGNOSTIC: sizeof(NV_LOCKLESS_DIAGNOSTIC_PARAMS) in
/// `src/nvidia/arch/nvalloc/unix/include/nv-ioctl-lockless-diag.h` is 4024 at 545.23.06 .. 565.77 and
/// 550.40.07 .. 550.135, 15412 at 550.142+ and from 570.86.15; 595.44.02+ refuses any other size
/// (`RmValidateIoctl`, src/nvidia/arch/nvalloc/unix/src/escape.c).
#[test]
fn lockless_diagnostic_size_by_band() {
    for (version, size) in [
        (DriverVersion::new(545, 23, 6), 4024u32),
        (DriverVersion::new(550, 135, 0), 4024),
        (DriverVersion::new(550, 142, 0), 15412),
        (DriverVersion::new(565, 77, 0), 4024),
        (DriverVersion::new(570, 86, 15), 15412),
        (DriverVersion::new(595, 45, 4), 15412),
    ] {
        let l = Layout::for_version(version);
        assert_eq!(
            l.escape_params_size(escape::RM_LOCKLESS_DIAGNOSTIC),
            Some(size),
            "{version}"
        );
        let data = vec![0u8; size as usize];
        let cmd = esc(escape::RM_LOCKLESS_DIAGNOSTIC, size);
        assert_eq!(
            decode(&frontend(cmd, &data, &[]), &l).op,
            Op::Other,
            "{version}"
        );
    }
    let l595 = Layout::DEFAULT;
    let old_size = esc(escape::RM_LOCKLESS_DIAGNOSTIC, 4024);
    let d = decode(&frontend(old_size, &[0; 4024], &[]), &l595);
    assert_eq!(d.op, Op::Refused, "{d}");
    let l535 = Layout::for_version(DriverVersion::new(535, 288, 1));
    assert_eq!(
        l535.escape_params_size(escape::RM_LOCKLESS_DIAGNOSTIC),
        None
    );
}
