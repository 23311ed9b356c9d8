//! Frontend escape numbers (`_IOC_NR` of ioctls on `/dev/nvidiactl` and `/dev/nvidiaN`), their names and
//! fixed params sizes.
//!
//! Source: `src/nvidia/arch/nvalloc/unix/include/nv_escape.h` (RM escapes, 0x27..0x5f) and
//! `kernel-open/common/inc/nv-ioctl-numbers.h` / `nv-ioctl-numa.h` (OS escapes, `NV_IOCTL_BASE` = 200 + n).
//! [`name`] gives 595.45.04's names; [`name_for`] the names of a given driver (0x5F changed meaning).

use crate::layout::DriverVersion;

/// NVOS02 + fd wrapper: allocate system/video memory (`/dev/nvidiaN`).
pub const RM_ALLOC_MEMORY: u32 = 0x27;
/// NVOS05: legacy object alloc.
pub const RM_ALLOC_OBJECT: u32 = 0x28;
/// NVOS00: free an object (or a whole client when hObjectOld == hRoot).
pub const RM_FREE: u32 = 0x29;
/// NVOS54: RM control call.
pub const RM_CONTROL: u32 = 0x2a;
/// NVOS21 / NVOS64: allocate an object of a class.
pub const RM_ALLOC: u32 = 0x2b;
/// NVOS55: duplicate an object into another client.
pub const RM_DUP_OBJECT: u32 = 0x34;
/// NVOS57: share an object.
pub const RM_SHARE: u32 = 0x35;
/// I2C access (`/dev/nvidiaN`).
pub const RM_I2C_ACCESS: u32 = 0x39;
/// NVOS30: idle channels.
pub const RM_IDLE_CHANNELS: u32 = 0x41;
/// NVOS32: video heap control (alloc/free video memory).
pub const RM_VID_HEAP_CONTROL: u32 = 0x4a;
/// NVOS38: registry access.
pub const RM_ACCESS_REGISTRY: u32 = 0x4d;
/// NVOS33 + fd wrapper: map memory into the CPU address space.
pub const RM_MAP_MEMORY: u32 = 0x4e;
/// NVOS34: unmap memory from the CPU address space.
pub const RM_UNMAP_MEMORY: u32 = 0x4f;
/// NVOS41: fetch event data.
pub const RM_GET_EVENT_DATA: u32 = 0x52;
/// NVOS39: allocate a context DMA.
pub const RM_ALLOC_CONTEXT_DMA2: u32 = 0x54;
/// Add a vblank callback (display only).
pub const RM_ADD_VBLANK_CALLBACK: u32 = 0x56;
/// NVOS46: map memory into a GPU virtual address space.
pub const RM_MAP_MEMORY_DMA: u32 = 0x57;
/// NVOS47: unmap memory from a GPU virtual address space.
pub const RM_UNMAP_MEMORY_DMA: u32 = 0x58;
/// NVOS49: bind a context DMA.
pub const RM_BIND_CONTEXT_DMA: u32 = 0x59;
/// Export an RM object to a file descriptor.
pub const RM_EXPORT_OBJECT_TO_FD: u32 = 0x5c;
/// Import an RM object from a file descriptor.
pub const RM_IMPORT_OBJECT_FROM_FD: u32 = 0x5d;
/// NVOS56: update device mapping info.
pub const RM_UPDATE_DEVICE_MAPPING_INFO: u32 = 0x5e;
/// Lockless diagnostic (545.23.06+; the same number was [`RM_NVLOG_CTRL`] before, see [`name_for`]).
pub const RM_LOCKLESS_DIAGNOSTIC: u32 = 0x5f;
/// NvLog control: what 0x5F was in 525.125.06 .. 525.x and 535.43.08 .. 535.x (not in [`ALL`]: the
/// number is [`RM_LOCKLESS_DIAGNOSTIC`]'s).
pub const RM_NVLOG_CTRL: u32 = 0x5f;
/// The first release where 0x5F is `NV_ESC_RM_LOCKLESS_DIAGNOSTIC`.
pub const FIRST_LOCKLESS_DIAGNOSTIC: DriverVersion = DriverVersion::new(545, 23, 6);

/// First OS escape number (`NV_IOCTL_BASE`).
pub const IOCTL_BASE: u32 = 200;
/// Card info: array of 72-byte entries, one per GPU.
pub const CARD_INFO: u32 = IOCTL_BASE;
/// Register a ctl fd on a device fd (`{int ctl_fd}`); pins the ctl file.
pub const REGISTER_FD: u32 = IOCTL_BASE + 1;
/// Allocate an OS event.
pub const ALLOC_OS_EVENT: u32 = IOCTL_BASE + 6;
/// Free an OS event.
pub const FREE_OS_EVENT: u32 = IOCTL_BASE + 7;
/// Query a GPU's status code.
pub const STATUS_CODE: u32 = IOCTL_BASE + 9;
/// Check the user-space/kernel version string.
pub const CHECK_VERSION_STR: u32 = IOCTL_BASE + 10;
/// Wrapper for large params: `{cmd, size, ptr}`; the real params are at `ptr`.
pub const IOCTL_XFER_CMD: u32 = IOCTL_BASE + 11;
/// Attach GPUs (array of u32 GPU ids) to the ctl fd.
pub const ATTACH_GPUS_TO_FD: u32 = IOCTL_BASE + 12;
/// Query device interrupt.
pub const QUERY_DEVICE_INTR: u32 = IOCTL_BASE + 13;
/// System parameters.
pub const SYS_PARAMS: u32 = IOCTL_BASE + 14;
/// NUMA info (`/dev/nvidiaN`).
pub const NUMA_INFO: u32 = IOCTL_BASE + 15;
/// Set NUMA status (`/dev/nvidiaN`).
pub const SET_NUMA_STATUS: u32 = IOCTL_BASE + 16;
/// Export memory to a dma-buf fd.
pub const EXPORT_TO_DMABUF_FD: u32 = IOCTL_BASE + 17;
/// Wait for the device open to complete (550+).
pub const WAIT_OPEN_COMPLETE: u32 = IOCTL_BASE + 18;

/// Every escape number above, for iteration in user space and tests.
pub const ALL: [u32; 37] = [
    RM_ALLOC_MEMORY,
    RM_ALLOC_OBJECT,
    RM_FREE,
    RM_CONTROL,
    RM_ALLOC,
    RM_DUP_OBJECT,
    RM_SHARE,
    RM_I2C_ACCESS,
    RM_IDLE_CHANNELS,
    RM_VID_HEAP_CONTROL,
    RM_ACCESS_REGISTRY,
    RM_MAP_MEMORY,
    RM_UNMAP_MEMORY,
    RM_GET_EVENT_DATA,
    RM_ALLOC_CONTEXT_DMA2,
    RM_ADD_VBLANK_CALLBACK,
    RM_MAP_MEMORY_DMA,
    RM_UNMAP_MEMORY_DMA,
    RM_BIND_CONTEXT_DMA,
    RM_EXPORT_OBJECT_TO_FD,
    RM_IMPORT_OBJECT_FROM_FD,
    RM_UPDATE_DEVICE_MAPPING_INFO,
    RM_LOCKLESS_DIAGNOSTIC,
    CARD_INFO,
    REGISTER_FD,
    ALLOC_OS_EVENT,
    FREE_OS_EVENT,
    STATUS_CODE,
    CHECK_VERSION_STR,
    IOCTL_XFER_CMD,
    ATTACH_GPUS_TO_FD,
    QUERY_DEVICE_INTR,
    SYS_PARAMS,
    NUMA_INFO,
    SET_NUMA_STATUS,
    EXPORT_TO_DMABUF_FD,
    WAIT_OPEN_COMPLETE,
];

/// Whether the probes read an escape's params at the syscall's entry too (the ledger's allocations and frees:
/// see `baton_probe_common::EnterReading`); RM_CONTROL, the hot path, is not among them.
#[inline(always)]
pub const fn read_at_enter(nr: u32) -> bool {
    matches!(
        nr,
        RM_ALLOC | RM_ALLOC_OBJECT | RM_FREE | RM_ALLOC_MEMORY | RM_VID_HEAP_CONTROL
    )
}

/// The `NV_ESC_*` name of an escape number.
pub fn name(nr: u32) -> Option<&'static str> {
    Some(match nr {
        RM_ALLOC_MEMORY => "NV_ESC_RM_ALLOC_MEMORY",
        RM_ALLOC_OBJECT => "NV_ESC_RM_ALLOC_OBJECT",
        RM_FREE => "NV_ESC_RM_FREE",
        RM_CONTROL => "NV_ESC_RM_CONTROL",
        RM_ALLOC => "NV_ESC_RM_ALLOC",
        RM_DUP_OBJECT => "NV_ESC_RM_DUP_OBJECT",
        RM_SHARE => "NV_ESC_RM_SHARE",
        RM_I2C_ACCESS => "NV_ESC_RM_I2C_ACCESS",
        RM_IDLE_CHANNELS => "NV_ESC_RM_IDLE_CHANNELS",
        RM_VID_HEAP_CONTROL => "NV_ESC_RM_VID_HEAP_CONTROL",
        RM_ACCESS_REGISTRY => "NV_ESC_RM_ACCESS_REGISTRY",
        RM_MAP_MEMORY => "NV_ESC_RM_MAP_MEMORY",
        RM_UNMAP_MEMORY => "NV_ESC_RM_UNMAP_MEMORY",
        RM_GET_EVENT_DATA => "NV_ESC_RM_GET_EVENT_DATA",
        RM_ALLOC_CONTEXT_DMA2 => "NV_ESC_RM_ALLOC_CONTEXT_DMA2",
        RM_ADD_VBLANK_CALLBACK => "NV_ESC_RM_ADD_VBLANK_CALLBACK",
        RM_MAP_MEMORY_DMA => "NV_ESC_RM_MAP_MEMORY_DMA",
        RM_UNMAP_MEMORY_DMA => "NV_ESC_RM_UNMAP_MEMORY_DMA",
        RM_BIND_CONTEXT_DMA => "NV_ESC_RM_BIND_CONTEXT_DMA",
        RM_EXPORT_OBJECT_TO_FD => "NV_ESC_RM_EXPORT_OBJECT_TO_FD",
        RM_IMPORT_OBJECT_FROM_FD => "NV_ESC_RM_IMPORT_OBJECT_FROM_FD",
        RM_UPDATE_DEVICE_MAPPING_INFO => "NV_ESC_RM_UPDATE_DEVICE_MAPPING_INFO",
        RM_LOCKLESS_DIAGNOSTIC => "NV_ESC_RM_LOCKLESS_DIAGNOSTIC",
        CARD_INFO => "NV_ESC_CARD_INFO",
        REGISTER_FD => "NV_ESC_REGISTER_FD",
        ALLOC_OS_EVENT => "NV_ESC_ALLOC_OS_EVENT",
        FREE_OS_EVENT => "NV_ESC_FREE_OS_EVENT",
        STATUS_CODE => "NV_ESC_STATUS_CODE",
        CHECK_VERSION_STR => "NV_ESC_CHECK_VERSION_STR",
        IOCTL_XFER_CMD => "NV_ESC_IOCTL_XFER_CMD",
        ATTACH_GPUS_TO_FD => "NV_ESC_ATTACH_GPUS_TO_FD",
        QUERY_DEVICE_INTR => "NV_ESC_QUERY_DEVICE_INTR",
        SYS_PARAMS => "NV_ESC_SYS_PARAMS",
        NUMA_INFO => "NV_ESC_NUMA_INFO",
        SET_NUMA_STATUS => "NV_ESC_SET_NUMA_STATUS",
        EXPORT_TO_DMABUF_FD => "NV_ESC_EXPORT_TO_DMABUF_FD",
        WAIT_OPEN_COMPLETE => "NV_ESC_WAIT_OPEN_COMPLETE",
        _ => return None,
    })
}

/// The `NV_ESC_*` name of escape `nr` in driver `v`'s `nv_escape.h`: [`name`], except 0x5F, which is
/// `NV_ESC_RM_LOCKLESS_DIAGNOSTIC` from 545.23.06, `NV_ESC_RM_NVLOG_CTRL` in 525.125.06 .. 525.x and
/// 535.43.08 .. 535.x, and undefined in other releases.
pub fn name_for(nr: u32, v: DriverVersion) -> Option<&'static str> {
    if nr != RM_LOCKLESS_DIAGNOSTIC {
        return name(nr);
    }
    if v.at_least(FIRST_LOCKLESS_DIAGNOSTIC) {
        Some("NV_ESC_RM_LOCKLESS_DIAGNOSTIC")
    } else if (v.major == 525 && v.at_least(DriverVersion::new(525, 125, 6)))
        || (v.major == 535 && v.at_least(DriverVersion::new(535, 43, 8)))
    {
        Some("NV_ESC_RM_NVLOG_CTRL")
    } else {
        None
    }
}

/// The escape number for an `NV_ESC_*` name (inverse of [`name`]).
pub fn from_name(name: &str) -> Option<u32> {
    ALL.iter().copied().find(|&nr| self::name(nr) == Some(name))
}

/// Params size (x86_64) for escapes whose struct size is the same in every supported driver band.
///
/// `None` for escapes whose size depends on the driver band ([`RM_ALLOC`]: NVOS21 or NVOS64;
/// [`RM_MAP_MEMORY_DMA`] / [`RM_UNMAP_MEMORY_DMA`], [`NUMA_INFO`] (552 up to 530, 560 from 535) and
/// [`EXPORT_TO_DMABUF_FD`] (2600 up to 565.77, 2608 from 570.86.15): see
/// [`crate::layout::Layout::escape_params_size`]), for variable-length
/// ones ([`CARD_INFO`], [`ATTACH_GPUS_TO_FD`]) and for ones whose size is not recorded here.
#[inline(always)]
pub const fn params_size(nr: u32) -> Option<u32> {
    match nr {
        RM_ALLOC_MEMORY => Some(crate::params::nvos02::WITH_FD_SIZE),
        RM_ALLOC_OBJECT => Some(crate::params::nvos05::SIZE),
        RM_FREE => Some(crate::params::nvos00::SIZE),
        RM_CONTROL => Some(crate::params::nvos54::SIZE),
        RM_DUP_OBJECT => Some(crate::params::nvos55::SIZE),
        RM_SHARE => Some(24),
        RM_I2C_ACCESS => Some(32),
        RM_IDLE_CHANNELS => Some(56),
        RM_VID_HEAP_CONTROL => Some(crate::params::nvos32::SIZE),
        RM_ACCESS_REGISTRY => Some(72),
        RM_MAP_MEMORY => Some(crate::params::nvos33::WITH_FD_SIZE),
        RM_UNMAP_MEMORY => Some(crate::params::nvos34::SIZE),
        RM_GET_EVENT_DATA => Some(16),
        RM_ALLOC_CONTEXT_DMA2 => Some(56),
        RM_BIND_CONTEXT_DMA => Some(16),
        RM_UPDATE_DEVICE_MAPPING_INFO => Some(40),
        REGISTER_FD => Some(crate::params::register_fd::SIZE),
        ALLOC_OS_EVENT | FREE_OS_EVENT => Some(16),
        STATUS_CODE => Some(12),
        CHECK_VERSION_STR => Some(crate::params::check_version_str::SIZE),
        IOCTL_XFER_CMD => Some(crate::params::xfer::SIZE),
        QUERY_DEVICE_INTR => Some(8),
        SYS_PARAMS => Some(8),
        SET_NUMA_STATUS => Some(4),
        WAIT_OPEN_COMPLETE => Some(8),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_escape_has_a_name_that_round_trips() {
        for nr in ALL {
            let n = name(nr).unwrap_or_else(|| panic!("escape {nr:#x} has no name"));
            assert!(n.starts_with("NV_ESC_"), "{n}");
            assert_eq!(from_name(n), Some(nr), "{n}");
        }
    }

    #[test]
    fn all_is_complete() {
        let mut distinct: Vec<u32> = ALL.to_vec();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), ALL.len(), "ALL has duplicates");
        let named = (0..=255).filter(|&nr| name(nr).is_some()).count();
        assert_eq!(distinct.len(), named, "a named escape is missing from ALL");
    }

    /// `src/nvidia/arch/nvalloc/unix/include/nv_escape.h`: 0x5F is NV_ESC_RM_NVLOG_CTRL at 525.147.05 and
    /// 535.288.01, absent at 530.41.03 and 535.43.02, NV_ESC_RM_LOCKLESS_DIAGNOSTIC from 545.23.06.
    #[test]
    fn escape_0x5f_by_driver_version() {
        let at = DriverVersion::new;
        assert_eq!(
            name_for(0x5f, at(525, 147, 5)),
            Some("NV_ESC_RM_NVLOG_CTRL")
        );
        assert_eq!(
            name_for(0x5f, at(535, 288, 1)),
            Some("NV_ESC_RM_NVLOG_CTRL")
        );
        assert_eq!(name_for(0x5f, at(525, 60, 11)), None);
        assert_eq!(name_for(0x5f, at(530, 41, 3)), None);
        assert_eq!(name_for(0x5f, at(535, 43, 2)), None);
        for v in [at(545, 23, 6), at(550, 40, 7), at(595, 45, 4)] {
            assert_eq!(name_for(0x5f, v), Some("NV_ESC_RM_LOCKLESS_DIAGNOSTIC"));
        }
        assert_eq!(name_for(RM_FREE, at(515, 43, 4)), Some("NV_ESC_RM_FREE"));
    }

    #[test]
    fn known_numbers() {
        assert_eq!(RM_ALLOC_MEMORY, 0x27);
        assert_eq!(CARD_INFO, 200);
        assert_eq!(REGISTER_FD, 201);
        assert_eq!(IOCTL_XFER_CMD, 211);
        assert_eq!(WAIT_OPEN_COMPLETE, 218);
        assert_eq!(params_size(RM_ALLOC), None);
        assert_eq!(params_size(RM_FREE), Some(16));
        // Band-dependent: only through Layout::escape_params_size.
        assert_eq!(params_size(NUMA_INFO), None);
        assert_eq!(params_size(EXPORT_TO_DMABUF_FD), None);
    }
}
