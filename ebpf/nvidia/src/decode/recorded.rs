//! Decoder tests on bytes taken from the H200 recordings (driver 580.159.04, /work/shared/gpu/580.159.04/):
//! the calls that decoded with no field there, checked against what the same recording shows around them.

use super::*;
use crate::params::uvm::map_external_allocation as map;

const H200: DriverVersion = DriverVersion::new(580, 159, 4);

/// The GPU UUID UVM_REGISTER_GPU registered in pytorch-1gib.jsonl (its gpu_uuid field).
const PYTORCH_GPU: &str = "GPU-9cf33b08-3414-afd0-a702-4f5aaca53ba2";

/// `hex` followed by zeros up to `len` bytes: the rest of the capture is zero in the recording.
fn captured(hex: &str, len: usize) -> Vec<u8> {
    let mut b = hex::decode(hex).unwrap();
    b.resize(len, 0);
    b
}

fn field<'a>(d: &'a Decoded, name: &str) -> Option<&'a Value> {
    d.fields.iter().find(|f| f.name == name).map(|f| &f.value)
}

fn uvm(cmd: u32, data: &[u8]) -> Call<'_> {
    Call {
        fd_kind: FdKind::Uvm,
        cmd,
        data,
        nested: &[],
    }
}

fn ctl(nr: u32, size: u32, data: &[u8]) -> Call<'_> {
    Call {
        fd_kind: FdKind::Ctl,
        cmd: ioc::iowr(ioc::NV_IOCTL_MAGIC, nr, size),
        data,
        nested: &[],
    }
}

/// pytorch-1gib.jsonl, ts 34097827540: the 256 bytes the probes captured of a 9264-byte
/// UVM_MAP_EXTERNAL_ALLOCATION_PARAMS (6 MiB at 0x200000000 on the registered GPU, read-write-atomic).
const MAP_EXTERNAL_HEAD: &str = "000000000200000000006000000000000000000000000000\
                                 9cf33b083414afd0a7024f5aaca53ba201000000";

#[test]
fn a_captured_head_of_map_external_allocation_decodes_to_its_fields() {
    let data = captured(MAP_EXTERNAL_HEAD, 256);
    let d = decode(
        &uvm(uvm::MAP_EXTERNAL_ALLOCATION, &data),
        &Layout::for_version(H200),
    );
    assert_eq!(
        d.op,
        Op::Uvm {
            cmd: uvm::MAP_EXTERNAL_ALLOCATION
        }
    );
    assert_eq!(field(&d, "base"), Some(&Value::Hex(0x2_0000_0000)));
    assert_eq!(field(&d, "length"), Some(&Value::Bytes(6 << 20)));
    assert_eq!(field(&d, "offset"), Some(&Value::Hex(0)));
    assert_eq!(
        field(&d, "perGpuAttributes"),
        Some(&Value::Str(format!(
            "{PYTORCH_GPU} mapping=ReadWriteAtomic caching=Default format=Default elementBits=Default \
             compression=Default"
        )))
    );
    // The fd, the handles and rmStatus are in the struct's last 16 bytes, past the capture.
    for absent in [
        "gpuAttributesCount",
        "rmCtrlFd",
        "hClient",
        "hMemory",
        "rmStatus",
    ] {
        assert_eq!(field(&d, absent), None, "{absent}");
    }
    assert_eq!(d.status, None);
    assert!(d.to_string().ends_with(" = ?"), "{d}");
    // A capture shorter than base, length and offset is still truncated.
    let d = decode(
        &uvm(uvm::MAP_EXTERNAL_ALLOCATION, &data[..20]),
        &Layout::for_version(H200),
    );
    assert_eq!((d.op, d.fields.len()), (Op::Truncated, 0));
}

/// park-program.jsonl.gz, pid 440 thread 462 (the resume), ts 41061126640: a read-write, force-cached
/// mapping of 4 KiB at 0x1f000 on the park recording's GPU.
#[test]
fn per_gpu_attributes_are_named_as_nv_uvm_user_types_names_them() {
    let data = captured(
        "00f001000000000000100000000000000000000000000000\
         f9340222cc1f5eaa375d523fe25401fa0200000002000000",
        256,
    );
    let d = decode(
        &uvm(uvm::MAP_EXTERNAL_ALLOCATION, &data),
        &Layout::for_version(H200),
    );
    assert_eq!(field(&d, "base"), Some(&Value::Hex(0x1_f000)));
    assert_eq!(field(&d, "length"), Some(&Value::Bytes(4096)));
    assert_eq!(
        field(&d, "perGpuAttributes"),
        Some(&Value::Str(
            "GPU-f9340222-cc1f-5eaa-375d-523fe25401fa mapping=ReadWrite caching=ForceCached \
             format=Default elementBits=Default compression=Default"
                .into()
        ))
    );
}

/// A tracer that captured the whole struct: the recorded head, then gpuAttributesCount, rmCtrlFd, hClient,
/// hMemory and rmStatus at the 580 band's offsets. The count, not the UUIDs, decides the entries shown.
#[test]
fn a_whole_map_external_allocation_shows_its_tail_and_counted_entries() {
    let mut data = captured(MAP_EXTERNAL_HEAD, map::SIZE as usize);
    let put = |b: &mut Vec<u8>, off: u32, v: &[u8]| {
        b[off as usize..off as usize + v.len()].copy_from_slice(v)
    };
    put(
        &mut data,
        map::GPU_ATTRIBUTES_COUNT_OFFSET,
        &2u64.to_ne_bytes(),
    );
    put(&mut data, map::RM_CTRL_FD_OFFSET, &8i32.to_ne_bytes());
    put(
        &mut data,
        map::H_CLIENT_OFFSET,
        &0xc1d0_0020u32.to_ne_bytes(),
    );
    put(
        &mut data,
        map::H_MEMORY_OFFSET,
        &0x5c00_0017u32.to_ne_bytes(),
    );
    put(
        &mut data,
        map::RM_STATUS_OFFSET,
        &status::NV_OK.to_ne_bytes(),
    );
    let d = decode(
        &uvm(uvm::MAP_EXTERNAL_ALLOCATION, &data),
        &Layout::for_version(H200),
    );
    assert_eq!(d.status, Some(status::NV_OK));
    assert_eq!(field(&d, "gpuAttributesCount"), Some(&Value::U64(2)));
    assert_eq!(field(&d, "rmCtrlFd"), Some(&Value::Str("8".into())));
    assert_eq!(field(&d, "hClient"), Some(&Value::Handle(0xc1d0_0020)));
    assert_eq!(field(&d, "hMemory"), Some(&Value::Handle(0x5c00_0017)));
    let Some(Value::Str(entries)) = field(&d, "perGpuAttributes") else {
        panic!("{d}");
    };
    let entries: Vec<&str> = entries.split("; ").collect();
    assert_eq!(entries.len(), 2, "{entries:?}");
    assert!(entries[0].starts_with(PYTORCH_GPU), "{entries:?}");
    assert!(
        entries[1].starts_with("GPU-00000000-0000-0000-0000-000000000000 mapping=Default"),
        "{entries:?}"
    );
}

/// pytorch-1gib.jsonl, ts 34189203116: UVM_ALLOC_SEMAPHORE_POOL (9248 bytes at 580), 2 MiB at 0x204a00000,
/// read-write-atomic and force-uncached; captured like UVM_MAP_EXTERNAL_ALLOCATION, head only.
#[test]
fn a_captured_head_of_alloc_semaphore_pool_decodes_to_its_fields() {
    let data = captured(
        "0000a004020000000000200000000000\
         9cf33b083414afd0a7024f5aaca53ba20100000001000000",
        256,
    );
    let d = decode(
        &uvm(uvm::ALLOC_SEMAPHORE_POOL, &data),
        &Layout::for_version(H200),
    );
    assert_eq!(field(&d, "base"), Some(&Value::Hex(0x2_04a0_0000)));
    assert_eq!(field(&d, "length"), Some(&Value::Bytes(2 << 20)));
    assert_eq!(
        field(&d, "perGpuAttributes"),
        Some(&Value::Str(format!(
            "{PYTORCH_GPU} mapping=ReadWriteAtomic caching=ForceUncached format=Default \
             elementBits=Default compression=Default"
        )))
    );
    assert_eq!((d.status, field(&d, "rmStatus")), (None, None));
}

/// pytorch-1gib.jsonl lines 98-100: RM_MAP_MEMORY of hMemory 0x5c000006 answers pLinearAddress
/// 0x10000a0000 with fd 15, the program mmap()s fd 15 at 0x7fa6aa4c4000, then RM_UPDATE_DEVICE_MAPPING_INFO
/// moves the mapping from the one address to the other.
#[test]
fn update_device_mapping_info_moves_what_map_memory_returned_to_the_mmap_address() {
    let l = Layout::for_version(H200);
    let map_memory = hex::decode(
        "2000d0c10300005c0600005c000000000000000000000000000001000000000000000a000010000000000000\
         020089000f00000000000000",
    )
    .unwrap();
    let m = decode(&ctl(escape::RM_MAP_MEMORY, 56, &map_memory), &l);
    assert_eq!(
        m.op,
        Op::MapMemory {
            client: 0xc1d0_0020,
            device: 0x5c00_0003,
            memory: 0x5c00_0006,
            length: 65536,
            fd: Some(15),
        }
    );
    let Some(&Value::Hex(linear)) = field(&m, "pLinearAddress") else {
        panic!("{m}");
    };
    let mmap_address = 140_353_798_422_528u64; // the mmap event of fd 15 that follows
    let update = hex::decode(
        "2000d0c10300005c0600005c0000000000000a000010000000404caaa67f00000000000000000000",
    )
    .unwrap();
    let d = decode(&ctl(escape::RM_UPDATE_DEVICE_MAPPING_INFO, 40, &update), &l);
    assert_eq!((d.op.clone(), d.status), (Op::Other, Some(status::NV_OK)));
    assert_eq!(field(&d, "hClient"), Some(&Value::Handle(0xc1d0_0020)));
    assert_eq!(field(&d, "hDevice"), Some(&Value::Handle(0x5c00_0003)));
    assert_eq!(field(&d, "hMemory"), Some(&Value::Handle(0x5c00_0006)));
    assert_eq!(field(&d, "pOldCpuAddress"), Some(&Value::Hex(linear)));
    assert_eq!(field(&d, "pNewCpuAddress"), Some(&Value::Hex(mmap_address)));
    let d = decode(
        &ctl(escape::RM_UPDATE_DEVICE_MAPPING_INFO, 40, &update[..36]),
        &l,
    );
    assert_eq!((d.op, d.status), (Op::Truncated, None));
}
