//! Decoding of UVM commands (`/dev/nvidia-uvm`): the fields of each command at its band's offsets, and what
//! a capture holds of the params that are larger than it.
//!
//! UVM_MAP_EXTERNAL_ALLOCATION (9264 bytes from 550.40.53) and UVM_ALLOC_SEMAPHORE_POOL (9248) are bigger
//! than what a tracer reads at the ioctl's arg (the probes read 256 bytes: `DATA_CAP` in `baton-common`).
//! Such a capture holds the struct's head (base, length, offset and the first per-GPU entries) but not its
//! tail (gpuAttributesCount, the fd and handles, rmStatus): it decodes to the head's fields and no status.
//! A decoder that waited for the whole struct would show every such call as truncated, with no field (so
//! did all 37 of the PyTorch program on the H200: /work/shared/gpu/580.159.04/pytorch-1gib.jsonl).

use super::{Bytes, Call, Decoded, Fields, Parts, finish, unknown};
use crate::decode::Op;
use crate::layout::Layout;
use crate::params::uvm::{
    alloc_semaphore_pool as pool, gpu_mapping_attributes as attrs, map_external_allocation as map,
};
use crate::{params, uvm};

pub(super) fn decode_uvm(call: &Call, layout: &Layout) -> Decoded {
    let cmd = call.cmd;
    let Some(name) = uvm::name_for(cmd, layout.version) else {
        return unknown(cmd, cmd);
    };
    let data = Bytes(call.data);
    let parts = match layout.uvm_params(cmd) {
        None => Parts {
            status: None,
            op: uvm_op(cmd),
            fields: Vec::new(),
        },
        Some(p) if data.has(p.size) => {
            let mut f = Fields::new(call.data);
            uvm_fields(&mut f, cmd, layout);
            let status = p.status_offset.and_then(|off| f.status("rmStatus", off));
            Parts {
                status,
                op: uvm_op(cmd),
                fields: f.out,
            }
        }
        Some(_) if head_size(cmd).is_some_and(|head| data.has(head)) => {
            // Only the head was captured: its fields (reads past the capture are skipped), no status.
            let mut f = Fields::new(call.data);
            uvm_fields(&mut f, cmd, layout);
            Parts {
                status: None,
                op: uvm_op(cmd),
                fields: f.out,
            }
        }
        Some(_) => Parts::truncated(),
    };
    finish(name, cmd, parts)
}

/// Bytes a capture of `cmd`'s params must hold to decode without the whole struct: the fields before the
/// per-GPU array. `None`: the command decodes only whole.
const fn head_size(cmd: u32) -> Option<u32> {
    match cmd {
        uvm::MAP_EXTERNAL_ALLOCATION => Some(map::PER_GPU_ATTRIBUTES_OFFSET),
        uvm::ALLOC_SEMAPHORE_POOL => Some(pool::PER_GPU_ATTRIBUTES_OFFSET),
        _ => None,
    }
}

fn uvm_op(cmd: u32) -> Op {
    match cmd {
        uvm::INITIALIZE => Op::UvmInitialize,
        uvm::DEINITIALIZE => Op::UvmDeinitialize,
        uvm::REGISTER_GPU => Op::UvmRegisterGpu,
        uvm::UNREGISTER_GPU => Op::UvmUnregisterGpu,
        uvm::REGISTER_GPU_VASPACE => Op::UvmRegisterVaSpace,
        uvm::MM_INITIALIZE => Op::UvmMmInitialize,
        _ => Op::Uvm { cmd },
    }
}

fn uvm_fields(f: &mut Fields, cmd: u32, layout: &Layout) {
    use params::uvm as p;
    match cmd {
        uvm::INITIALIZE => {
            f.hex64("flags", p::initialize::FLAGS_OFFSET);
        }
        uvm::MM_INITIALIZE => {
            f.fd("uvmFd", p::mm_initialize::UVM_FD_OFFSET);
        }
        uvm::REGISTER_GPU => {
            f.uuid("gpu_uuid", p::register_gpu::GPU_UUID_OFFSET);
            f.fd("rmCtrlFd", p::register_gpu::RM_CTRL_FD_OFFSET);
            f.handle("hClient", p::register_gpu::H_CLIENT_OFFSET);
            f.handle("hSmcPartRef", p::register_gpu::H_SMC_PART_REF_OFFSET);
        }
        uvm::UNREGISTER_GPU => f.uuid("gpu_uuid", p::unregister_gpu::GPU_UUID_OFFSET),
        uvm::REGISTER_GPU_VASPACE => {
            f.uuid("gpuUuid", p::register_gpu_vaspace::GPU_UUID_OFFSET);
            f.fd("rmCtrlFd", p::register_gpu_vaspace::RM_CTRL_FD_OFFSET);
            f.handle("hClient", p::register_gpu_vaspace::H_CLIENT_OFFSET);
            f.handle("hVaSpace", p::register_gpu_vaspace::H_VA_SPACE_OFFSET);
        }
        uvm::UNREGISTER_GPU_VASPACE => {
            f.uuid("gpuUuid", p::unregister_gpu_vaspace::GPU_UUID_OFFSET)
        }
        uvm::CREATE_RANGE_GROUP | uvm::DESTROY_RANGE_GROUP => {
            f.u64("rangeGroupId", p::range_group::RANGE_GROUP_ID_OFFSET);
        }
        uvm::SET_RANGE_GROUP => {
            f.u64("rangeGroupId", p::set_range_group::RANGE_GROUP_ID_OFFSET);
            f.hex64("requestedBase", p::set_range_group::REQUESTED_BASE_OFFSET);
            f.bytes64("length", p::set_range_group::LENGTH_OFFSET);
        }
        uvm::MIGRATE_RANGE_GROUP => {
            f.u64(
                "rangeGroupId",
                p::migrate_range_group::RANGE_GROUP_ID_OFFSET,
            );
            f.uuid(
                "destinationUuid",
                p::migrate_range_group::DESTINATION_UUID_OFFSET,
            );
        }
        uvm::FREE => {
            f.hex64("base", crate::layout::uvm_free::BASE_OFFSET);
            if let Some(off) = layout.uvm_free_length {
                f.bytes64("length", off);
            }
        }
        uvm::MAP_EXTERNAL_ALLOCATION => map_external_allocation_fields(f, layout),
        uvm::ALLOC_SEMAPHORE_POOL => alloc_semaphore_pool_fields(f, layout),
        _ => {}
    }
}

/// Whether driver `layout.version` has `cmd`'s per-GPU array at UVM_MAX_GPUS_V2 entries (550.40.53+), decided
/// like its size by [`uvm::band_major_for`].
fn has_max_gpus_v2(cmd: u32, layout: &Layout) -> bool {
    uvm::band_major_for(cmd, layout.version) >= 550
}

/// UVM_MAP_EXTERNAL_ALLOCATION's fields at the offsets of the struct the driver's band uses (1200 bytes
/// before 550.40.53, 9264 from it); those past the capture are left out.
fn map_external_allocation_fields(f: &mut Fields, layout: &Layout) {
    let (gpus, count, fd, client, memory) = if has_max_gpus_v2(uvm::MAP_EXTERNAL_ALLOCATION, layout)
    {
        (
            attrs::MAX_GPUS,
            map::GPU_ATTRIBUTES_COUNT_OFFSET,
            map::RM_CTRL_FD_OFFSET,
            map::H_CLIENT_OFFSET,
            map::H_MEMORY_OFFSET,
        )
    } else {
        (
            attrs::MAX_GPUS_BEFORE_V2,
            map::GPU_ATTRIBUTES_COUNT_OFFSET_BEFORE_V2,
            map::RM_CTRL_FD_OFFSET_BEFORE_V2,
            map::H_CLIENT_OFFSET_BEFORE_V2,
            map::H_MEMORY_OFFSET_BEFORE_V2,
        )
    };
    f.hex64("base", map::BASE_OFFSET);
    f.bytes64("length", map::LENGTH_OFFSET);
    f.hex64("offset", map::OFFSET_OFFSET);
    per_gpu_attributes(f, map::PER_GPU_ATTRIBUTES_OFFSET, gpus, count);
    f.fd("rmCtrlFd", fd);
    f.handle("hClient", client);
    f.handle("hMemory", memory);
}

/// UVM_ALLOC_SEMAPHORE_POOL's fields (1184 bytes before 550.40.53, 9248 from it).
fn alloc_semaphore_pool_fields(f: &mut Fields, layout: &Layout) {
    let (gpus, count) = if has_max_gpus_v2(uvm::ALLOC_SEMAPHORE_POOL, layout) {
        (attrs::MAX_GPUS, pool::GPU_ATTRIBUTES_COUNT_OFFSET)
    } else {
        (
            attrs::MAX_GPUS_BEFORE_V2,
            pool::GPU_ATTRIBUTES_COUNT_OFFSET_BEFORE_V2,
        )
    };
    f.hex64("base", pool::BASE_OFFSET);
    f.bytes64("length", pool::LENGTH_OFFSET);
    per_gpu_attributes(f, pool::PER_GPU_ATTRIBUTES_OFFSET, gpus, count);
}

/// perGpuAttributes at `array` (`gpus` entries) as one field, and gpuAttributesCount at `count` when
/// captured. With the count, its first `count` entries; without it (a capture of the head only), the
/// captured entries that name a GPU (libcuda zeroes the rest of the array).
fn per_gpu_attributes(f: &mut Fields, array: u32, gpus: u32, count: u32) {
    let captured = f.data.u64(count);
    let entries = match captured {
        Some(n) => u32::try_from(n).map_or(gpus, |n| n.min(gpus)),
        None => gpus,
    };
    let mut shown = Vec::new();
    for i in 0..entries {
        let at = array + i * attrs::SIZE;
        let Some(entry) = f.data.slice(at, attrs::SIZE) else {
            break;
        };
        if captured.is_none() && entry[..16].iter().all(|&b| b == 0) {
            continue;
        }
        shown.push(describe_attributes(&Bytes(entry)));
    }
    f.push(
        "perGpuAttributes",
        Some(super::Value::Str(shown.join("; "))),
    );
    f.u64("gpuAttributesCount", count);
}

/// One `UvmGpuMappingAttributes`: `GPU-<uuid> mapping=ReadWriteAtomic caching=Default ...`, each enum by its
/// name in `nv_uvm_user_types.h` (the number when it has none).
fn describe_attributes(e: &Bytes) -> String {
    let named = |off, names: &[(u32, &str)]| {
        let v = e.u32(off).unwrap_or(0);
        names
            .iter()
            .find(|(n, _)| *n == v)
            .map_or_else(|| v.to_string(), |(_, name)| (*name).to_owned())
    };
    format!(
        "{} mapping={} caching={} format={} elementBits={} compression={}",
        super::format_uuid(e.slice(attrs::GPU_UUID_OFFSET, 16).unwrap_or(&[])),
        named(attrs::MAPPING_TYPE_OFFSET, MAPPING_TYPES),
        named(attrs::CACHING_TYPE_OFFSET, CACHING_TYPES),
        named(attrs::FORMAT_TYPE_OFFSET, FORMAT_TYPES),
        named(attrs::ELEMENT_BITS_OFFSET, ELEMENT_BITS),
        named(attrs::COMPRESSION_TYPE_OFFSET, COMPRESSION_TYPES),
    )
}

/// `UvmGpuMappingType`.
const MAPPING_TYPES: &[(u32, &str)] = &[
    (0, "Default"),
    (1, "ReadWriteAtomic"),
    (2, "ReadWrite"),
    (3, "ReadOnly"),
];
/// `UvmGpuCachingType`.
const CACHING_TYPES: &[(u32, &str)] = &[(0, "Default"), (1, "ForceUncached"), (2, "ForceCached")];
/// `UvmGpuFormatType`.
const FORMAT_TYPES: &[(u32, &str)] = &[(0, "Default"), (1, "BlockLinear")];
/// `UvmGpuFormatElementBits` (no 24-bit element: 3 is unused).
const ELEMENT_BITS: &[(u32, &str)] = &[
    (0, "Default"),
    (1, "8"),
    (2, "16"),
    (4, "32"),
    (5, "64"),
    (6, "128"),
];
/// `UvmGpuCompressionType`.
const COMPRESSION_TYPES: &[(u32, &str)] = &[(0, "Default"), (1, "EnabledNoPlc")];
