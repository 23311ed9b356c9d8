//! Byte layouts (x86_64) of the params structs whose layout is the same in every supported driver band
//! (515 .. 595). Each submodule holds the struct's `SIZE` and one `*_OFFSET` per field the tracer, decoder
//! or mock driver reads or writes. Band-dependent structs (NVOS21, NVOS64, NVOS46, NVOS47, UVM_FREE) are in
//! [`crate::layout`].
//!
//! Offsets were checked with `offsetof` against `nvos.h`, `nv-ioctl.h`, `nv-unix-nvos-params-wrappers.h` and
//! `uvm_ioctl.h` at the last tag of every major release from 515 to 595.

/// NVOS00: `NV_ESC_RM_FREE`.
pub mod nvos00 {
    /// Struct size.
    pub const SIZE: u32 = 16;
    /// hRoot (client).
    pub const H_ROOT_OFFSET: u32 = 0;
    /// hObjectParent.
    pub const H_OBJECT_PARENT_OFFSET: u32 = 4;
    /// hObjectOld: the object freed (== hRoot frees the whole client).
    pub const H_OBJECT_OLD_OFFSET: u32 = 8;
    /// status (NV_STATUS).
    pub const STATUS_OFFSET: u32 = 12;
}

/// NVOS02: `NV_ESC_RM_ALLOC_MEMORY`, sent wrapped with an fd (`nv_ioctl_nvos02_parameters_with_fd`).
pub mod nvos02 {
    /// Size of NVOS02 itself.
    pub const SIZE: u32 = 48;
    /// Size of the wrapper `{NVOS02 params; int fd}` that the ioctl carries.
    pub const WITH_FD_SIZE: u32 = 56;
    /// hRoot (client).
    pub const H_ROOT_OFFSET: u32 = 0;
    /// hObjectParent.
    pub const H_OBJECT_PARENT_OFFSET: u32 = 4;
    /// hObjectNew.
    pub const H_OBJECT_NEW_OFFSET: u32 = 8;
    /// hClass.
    pub const H_CLASS_OFFSET: u32 = 12;
    /// flags.
    pub const FLAGS_OFFSET: u32 = 16;
    /// pMemory (u64 pointer).
    pub const P_MEMORY_OFFSET: u32 = 24;
    /// limit (u64): size - 1.
    pub const LIMIT_OFFSET: u32 = 32;
    /// status (NV_STATUS).
    pub const STATUS_OFFSET: u32 = 40;
    /// fd of the wrapper.
    pub const FD_OFFSET: u32 = 48;
}

/// NVOS05: `NV_ESC_RM_ALLOC_OBJECT`.
pub mod nvos05 {
    /// Struct size.
    pub const SIZE: u32 = 20;
    /// hRoot (client).
    pub const H_ROOT_OFFSET: u32 = 0;
    /// hObjectParent.
    pub const H_OBJECT_PARENT_OFFSET: u32 = 4;
    /// hObjectNew.
    pub const H_OBJECT_NEW_OFFSET: u32 = 8;
    /// hClass.
    pub const H_CLASS_OFFSET: u32 = 12;
    /// status (NV_STATUS).
    pub const STATUS_OFFSET: u32 = 16;
}

/// Fields NVOS21 and NVOS64 (`NV_ESC_RM_ALLOC`) share in every band; the rest is in [`crate::layout`].
pub mod rm_alloc {
    /// hRoot (client; for root classes the new client handle is hObjectNew).
    pub const H_ROOT_OFFSET: u32 = 0;
    /// hObjectParent.
    pub const H_OBJECT_PARENT_OFFSET: u32 = 4;
    /// hObjectNew.
    pub const H_OBJECT_NEW_OFFSET: u32 = 8;
    /// hClass.
    pub const H_CLASS_OFFSET: u32 = 12;
    /// pAllocParms (u64 pointer to the class's alloc params).
    pub const P_ALLOC_PARMS_OFFSET: u32 = 16;
}

/// NVOS32: `NV_ESC_RM_VID_HEAP_CONTROL`.
pub mod nvos32 {
    /// Struct size.
    pub const SIZE: u32 = 184;
    /// hRoot (client).
    pub const H_ROOT_OFFSET: u32 = 0;
    /// hObjectParent (device).
    pub const H_OBJECT_PARENT_OFFSET: u32 = 4;
    /// function (see `FUNCTION_*`).
    pub const FUNCTION_OFFSET: u32 = 8;
    /// hVASpace.
    pub const H_VA_SPACE_OFFSET: u32 = 12;
    /// ivcHeapNumber.
    pub const IVC_HEAP_NUMBER_OFFSET: u32 = 16;
    /// status (NV_STATUS).
    pub const STATUS_OFFSET: u32 = 20;
    /// total (u64).
    pub const TOTAL_OFFSET: u32 = 24;
    /// free (u64).
    pub const FREE_OFFSET: u32 = 32;
    /// Start of the per-function union.
    pub const DATA_OFFSET: u32 = 40;
    /// data.AllocSize.owner / data.Free.owner.
    pub const OWNER_OFFSET: u32 = 40;
    /// data.AllocSize.hMemory / data.Free.hMemory.
    pub const H_MEMORY_OFFSET: u32 = 44;
    /// data.AllocSize.type.
    pub const ALLOC_TYPE_OFFSET: u32 = 48;
    /// data.AllocSize.flags.
    pub const ALLOC_FLAGS_OFFSET: u32 = 52;
    /// data.AllocSize.size (u64).
    pub const ALLOC_SIZE_OFFSET: u32 = 88;
    /// `NVOS32_FUNCTION_ALLOC_SIZE`.
    pub const FUNCTION_ALLOC_SIZE: u32 = 2;
    /// `NVOS32_FUNCTION_FREE`.
    pub const FUNCTION_FREE: u32 = 3;
}

/// NVOS33: `NV_ESC_RM_MAP_MEMORY`, sent wrapped with an fd (`nv_ioctl_nvos33_parameters_with_fd`).
pub mod nvos33 {
    /// Size of NVOS33 itself.
    pub const SIZE: u32 = 48;
    /// Size of the wrapper `{NVOS33 params; int fd}` that the ioctl carries.
    pub const WITH_FD_SIZE: u32 = 56;
    /// hClient.
    pub const H_CLIENT_OFFSET: u32 = 0;
    /// hDevice.
    pub const H_DEVICE_OFFSET: u32 = 4;
    /// hMemory.
    pub const H_MEMORY_OFFSET: u32 = 8;
    /// offset (u64).
    pub const OFFSET_OFFSET: u32 = 16;
    /// length (u64).
    pub const LENGTH_OFFSET: u32 = 24;
    /// pLinearAddress (u64).
    pub const P_LINEAR_ADDRESS_OFFSET: u32 = 32;
    /// status (NV_STATUS).
    pub const STATUS_OFFSET: u32 = 40;
    /// flags.
    pub const FLAGS_OFFSET: u32 = 44;
    /// fd of the wrapper.
    pub const FD_OFFSET: u32 = 48;
}

/// NVOS34: `NV_ESC_RM_UNMAP_MEMORY`.
pub mod nvos34 {
    /// Struct size.
    pub const SIZE: u32 = 32;
    /// hClient.
    pub const H_CLIENT_OFFSET: u32 = 0;
    /// hDevice.
    pub const H_DEVICE_OFFSET: u32 = 4;
    /// hMemory.
    pub const H_MEMORY_OFFSET: u32 = 8;
    /// pLinearAddress (u64).
    pub const P_LINEAR_ADDRESS_OFFSET: u32 = 16;
    /// status (NV_STATUS).
    pub const STATUS_OFFSET: u32 = 24;
    /// flags.
    pub const FLAGS_OFFSET: u32 = 28;
}

/// NVOS54: `NV_ESC_RM_CONTROL`.
pub mod nvos54 {
    /// Struct size.
    pub const SIZE: u32 = 32;
    /// hClient.
    pub const H_CLIENT_OFFSET: u32 = 0;
    /// hObject.
    pub const H_OBJECT_OFFSET: u32 = 4;
    /// cmd (see [`crate::ctrl`]).
    pub const CMD_OFFSET: u32 = 8;
    /// flags.
    pub const FLAGS_OFFSET: u32 = 12;
    /// params (u64 pointer).
    pub const PARAMS_OFFSET: u32 = 16;
    /// paramsSize.
    pub const PARAMS_SIZE_OFFSET: u32 = 24;
    /// status (NV_STATUS).
    pub const STATUS_OFFSET: u32 = 28;
    /// Bytes of the control params a tracer captures (`Call::nested`).
    pub const CAPTURE_PARAMS_MAX: u32 = 256;
}

/// NVOS55: `NV_ESC_RM_DUP_OBJECT`.
pub mod nvos55 {
    /// Struct size.
    pub const SIZE: u32 = 28;
    /// hClient (destination).
    pub const H_CLIENT_OFFSET: u32 = 0;
    /// hParent (destination).
    pub const H_PARENT_OFFSET: u32 = 4;
    /// hObject (new handle in the destination).
    pub const H_OBJECT_OFFSET: u32 = 8;
    /// hClientSrc.
    pub const H_CLIENT_SRC_OFFSET: u32 = 12;
    /// hObjectSrc.
    pub const H_OBJECT_SRC_OFFSET: u32 = 16;
    /// flags.
    pub const FLAGS_OFFSET: u32 = 20;
    /// status (NV_STATUS).
    pub const STATUS_OFFSET: u32 = 24;
}

/// NVOS57: `NV_ESC_RM_SHARE`.
pub mod nvos57 {
    /// Struct size.
    pub const SIZE: u32 = 24;
    /// hClient.
    pub const H_CLIENT_OFFSET: u32 = 0;
    /// hObject.
    pub const H_OBJECT_OFFSET: u32 = 4;
    /// status (NV_STATUS).
    pub const STATUS_OFFSET: u32 = 20;
}

/// NVOS56: `NV_ESC_RM_UPDATE_DEVICE_MAPPING_INFO` (`src/common/sdk/nvidia/inc/nvos.h`, the same from 515.43.04
/// to 595.45.04): tells RM that the CPU mapping of hMemory made through RM_MAP_MEMORY now lives at another
/// address.
pub mod nvos56 {
    /// Struct size.
    pub const SIZE: u32 = 40;
    /// hClient.
    pub const H_CLIENT_OFFSET: u32 = 0;
    /// hDevice.
    pub const H_DEVICE_OFFSET: u32 = 4;
    /// hMemory.
    pub const H_MEMORY_OFFSET: u32 = 8;
    /// pOldCpuAddress (u64, 8-aligned after a 4-byte hole).
    pub const P_OLD_CPU_ADDRESS_OFFSET: u32 = 16;
    /// pNewCpuAddress (u64).
    pub const P_NEW_CPU_ADDRESS_OFFSET: u32 = 24;
    /// status (NV_STATUS).
    pub const STATUS_OFFSET: u32 = 32;
}

/// `nv_ioctl_xfer_t`: `NV_ESC_IOCTL_XFER_CMD`.
pub mod xfer {
    /// Struct size.
    pub const SIZE: u32 = 16;
    /// cmd: the inner escape number.
    pub const CMD_OFFSET: u32 = 0;
    /// size: the inner params size.
    pub const SIZE_OFFSET: u32 = 4;
    /// ptr (u64): the inner params.
    pub const PTR_OFFSET: u32 = 8;
    /// Largest inner params size the driver accepts.
    pub const MAX_PARAMS: u32 = 16384;
    /// Bytes of the inner params a tracer captures (`Call::nested`).
    pub const CAPTURE_PARAMS_MAX: u32 = 256;
}

/// `NV_MEMORY_ALLOCATION_PARAMS`: the `pAllocParms` of memory classes ([`crate::class::is_memory`]).
pub mod memory_alloc {
    /// Struct size from 545 on (numaNode added at 120).
    pub const SIZE: u32 = 128;
    /// Struct size up to 535.
    pub const SIZE_BEFORE_545: u32 = 120;
    /// owner.
    pub const OWNER_OFFSET: u32 = 0;
    /// type (NVOS32_TYPE_*).
    pub const TYPE_OFFSET: u32 = 4;
    /// flags (NVOS32_ALLOC_FLAGS_*).
    pub const FLAGS_OFFSET: u32 = 8;
    /// attr (NVOS32_ATTR_*).
    pub const ATTR_OFFSET: u32 = 24;
    /// attr2 (NVOS32_ATTR2_*).
    pub const ATTR2_OFFSET: u32 = 28;
    /// size (u64): bytes requested (updated by RM to what it allocated).
    pub const SIZE_OFFSET: u32 = 64;
    /// alignment (u64).
    pub const ALIGNMENT_OFFSET: u32 = 72;
    /// offset (u64).
    pub const OFFSET_OFFSET: u32 = 80;
    /// limit (u64).
    pub const LIMIT_OFFSET: u32 = 88;
    /// address (u64 pointer).
    pub const ADDRESS_OFFSET: u32 = 96;
    /// hVASpace.
    pub const H_VA_SPACE_OFFSET: u32 = 108;
    /// numaNode (545+).
    pub const NUMA_NODE_OFFSET: u32 = 120;
}

/// `nv_ioctl_register_fd_t`: `NV_ESC_REGISTER_FD`.
pub mod register_fd {
    /// Struct size.
    pub const SIZE: u32 = 4;
    /// ctl_fd (int): the `/dev/nvidiactl` fd registered on this device fd.
    pub const CTL_FD_OFFSET: u32 = 0;
}

/// `nv_ioctl_card_info_t`: one entry of `NV_ESC_CARD_INFO` (the ioctl carries an array of them).
pub mod card_info {
    /// Entry size.
    pub const ENTRY_SIZE: u32 = 72;
    /// valid (NvBool, u8).
    pub const VALID_OFFSET: u32 = 0;
    /// pci_info.domain (u32).
    pub const PCI_DOMAIN_OFFSET: u32 = 4;
    /// pci_info.bus (u8).
    pub const PCI_BUS_OFFSET: u32 = 8;
    /// pci_info.slot (u8).
    pub const PCI_SLOT_OFFSET: u32 = 9;
    /// pci_info.function (u8).
    pub const PCI_FUNCTION_OFFSET: u32 = 10;
    /// pci_info.vendor_id (u16).
    pub const PCI_VENDOR_ID_OFFSET: u32 = 12;
    /// pci_info.device_id (u16).
    pub const PCI_DEVICE_ID_OFFSET: u32 = 14;
    /// gpu_id (u32).
    pub const GPU_ID_OFFSET: u32 = 16;
    /// interrupt_line (u16).
    pub const INTERRUPT_LINE_OFFSET: u32 = 20;
    /// reg_address (u64).
    pub const REG_ADDRESS_OFFSET: u32 = 24;
    /// reg_size (u64).
    pub const REG_SIZE_OFFSET: u32 = 32;
    /// fb_address (u64).
    pub const FB_ADDRESS_OFFSET: u32 = 40;
    /// fb_size (u64).
    pub const FB_SIZE_OFFSET: u32 = 48;
    /// minor_number (u32): N of /dev/nvidiaN.
    pub const MINOR_NUMBER_OFFSET: u32 = 56;
    /// dev_name (10 bytes).
    pub const DEV_NAME_OFFSET: u32 = 60;
    /// dev_name length.
    pub const DEV_NAME_LEN: u32 = 10;
    /// Entries in the array CUDA passes (`NV_MAX_DEVICES`).
    pub const MAX_ENTRIES: u32 = 32;
    /// NVIDIA's PCI vendor id.
    pub const PCI_VENDOR_NVIDIA: u16 = 0x10de;
}

/// `nv_ioctl_rm_api_version_t`: `NV_ESC_CHECK_VERSION_STR`.
pub mod check_version_str {
    /// Struct size.
    pub const SIZE: u32 = 72;
    /// cmd (0 strict, '1' relaxed, '2' query).
    pub const CMD_OFFSET: u32 = 0;
    /// reply (0 unrecognized, 1 recognized).
    pub const REPLY_OFFSET: u32 = 4;
    /// versionString (NUL-terminated).
    pub const VERSION_STRING_OFFSET: u32 = 8;
    /// versionString length.
    pub const VERSION_STRING_LEN: u32 = 64;
    /// `NV_RM_API_VERSION_REPLY_RECOGNIZED`.
    pub const REPLY_RECOGNIZED: u32 = 1;
    /// `NV_RM_API_VERSION_REPLY_UNRECOGNIZED`.
    pub const REPLY_UNRECOGNIZED: u32 = 0;
    /// `NV_RM_API_VERSION_CMD_STRICT`.
    pub const CMD_STRICT: u32 = 0;
    /// `NV_RM_API_VERSION_CMD_RELAXED` ('1').
    pub const CMD_RELAXED: u32 = 0x31;
    /// `NV_RM_API_VERSION_CMD_QUERY` ('2').
    pub const CMD_QUERY: u32 = 0x32;
}

/// `nv_ioctl_alloc_os_event_t` / `nv_ioctl_free_os_event_t`.
pub mod os_event {
    /// Struct size.
    pub const SIZE: u32 = 16;
    /// hClient.
    pub const H_CLIENT_OFFSET: u32 = 0;
    /// hDevice.
    pub const H_DEVICE_OFFSET: u32 = 4;
    /// fd.
    pub const FD_OFFSET: u32 = 8;
    /// Status (NV_STATUS).
    pub const STATUS_OFFSET: u32 = 12;
}

/// `nv_ioctl_status_code_t`: `NV_ESC_STATUS_CODE`.
pub mod status_code {
    /// Struct size.
    pub const SIZE: u32 = 12;
    /// status (NV_STATUS).
    pub const STATUS_OFFSET: u32 = 8;
}

/// `nv_ioctl_export_to_dma_buf_fd_t`: `NV_ESC_EXPORT_TO_DMABUF_FD` (`kernel-open/common/inc/nv-ioctl.h`).
/// Band-dependent: [`crate::layout::Layout::export_dmabuf_size`] picks the size for a driver.
pub mod export_to_dmabuf_fd {
    use crate::layout::DriverVersion;

    /// The first release with `mappingType` (570.86.15): 2608 bytes from it on, 2600 before.
    pub const FIRST_570: DriverVersion = DriverVersion::new(570, 86, 15);
    /// Struct size from 570.86.15 on.
    pub const SIZE: u32 = 2608;
    /// Struct size up to 565.77.
    pub const SIZE_BEFORE_570: u32 = 2600;
    /// status (NV_STATUS) from 570.86.15 on.
    pub const STATUS_OFFSET: u32 = 2600;
    /// status (NV_STATUS) up to 565.77.
    pub const STATUS_OFFSET_BEFORE_570: u32 = 2592;
    /// fd: the device fd the memory belongs to.
    pub const FD_OFFSET: u32 = 0;
    /// hClient.
    pub const H_CLIENT_OFFSET: u32 = 4;
    /// totalObjects.
    pub const TOTAL_OBJECTS_OFFSET: u32 = 8;
    /// numObjects: handles in this call.
    pub const NUM_OBJECTS_OFFSET: u32 = 12;
    /// index of the first handle of this call.
    pub const INDEX_OFFSET: u32 = 16;
    /// totalSize (u64).
    pub const TOTAL_SIZE_OFFSET: u32 = 24;
    /// mappingType (u8, 570.86.15+).
    pub const MAPPING_TYPE_OFFSET: u32 = 32;
    /// bAllowMmap (NvBool, 580.65.06+).
    pub const ALLOW_MMAP_OFFSET: u32 = 33;
}

/// `nv_ioctl_numa_info_t`: `NV_ESC_NUMA_INFO` (`kernel-open/common/inc/nv-ioctl-numa.h`).
pub mod numa_info {
    /// Struct size from 535 (535.43.02) on.
    pub const SIZE: u32 = 560;
    /// Struct size up to 530.
    pub const SIZE_BEFORE_535: u32 = 552;
}

/// Band-stable UVM params (see [`crate::uvm`] for the rest and [`crate::layout`] for UVM_FREE).
pub mod uvm {
    /// `UVM_INITIALIZE_PARAMS`: flags (u64) @0, rmStatus @8; size 16.
    pub mod initialize {
        /// Struct size.
        pub const SIZE: u32 = 16;
        /// flags (u64).
        pub const FLAGS_OFFSET: u32 = 0;
        /// rmStatus.
        pub const RM_STATUS_OFFSET: u32 = 8;
    }
    /// `UVM_MM_INITIALIZE_PARAMS`: uvmFd @0, rmStatus @4; size 8 (535+).
    pub mod mm_initialize {
        /// Struct size.
        pub const SIZE: u32 = 8;
        /// uvmFd: the first uvm fd.
        pub const UVM_FD_OFFSET: u32 = 0;
        /// rmStatus.
        pub const RM_STATUS_OFFSET: u32 = 4;
    }
    /// `UVM_REGISTER_GPU_PARAMS`.
    pub mod register_gpu {
        /// Struct size.
        pub const SIZE: u32 = 40;
        /// gpu_uuid (16 bytes).
        pub const GPU_UUID_OFFSET: u32 = 0;
        /// numaEnabled (NvBool).
        pub const NUMA_ENABLED_OFFSET: u32 = 16;
        /// numaNodeId.
        pub const NUMA_NODE_ID_OFFSET: u32 = 20;
        /// rmCtrlFd.
        pub const RM_CTRL_FD_OFFSET: u32 = 24;
        /// hClient.
        pub const H_CLIENT_OFFSET: u32 = 28;
        /// hSmcPartRef.
        pub const H_SMC_PART_REF_OFFSET: u32 = 32;
        /// rmStatus.
        pub const RM_STATUS_OFFSET: u32 = 36;
    }
    /// `UVM_UNREGISTER_GPU_PARAMS`.
    pub mod unregister_gpu {
        /// Struct size.
        pub const SIZE: u32 = 20;
        /// gpu_uuid (16 bytes).
        pub const GPU_UUID_OFFSET: u32 = 0;
        /// rmStatus.
        pub const RM_STATUS_OFFSET: u32 = 16;
    }
    /// `UVM_REGISTER_GPU_VASPACE_PARAMS`.
    pub mod register_gpu_vaspace {
        /// Struct size.
        pub const SIZE: u32 = 32;
        /// gpuUuid (16 bytes).
        pub const GPU_UUID_OFFSET: u32 = 0;
        /// rmCtrlFd.
        pub const RM_CTRL_FD_OFFSET: u32 = 16;
        /// hClient.
        pub const H_CLIENT_OFFSET: u32 = 20;
        /// hVaSpace.
        pub const H_VA_SPACE_OFFSET: u32 = 24;
        /// rmStatus.
        pub const RM_STATUS_OFFSET: u32 = 28;
    }
    /// `UVM_UNREGISTER_GPU_VASPACE_PARAMS`.
    pub mod unregister_gpu_vaspace {
        /// Struct size.
        pub const SIZE: u32 = 20;
        /// gpuUuid (16 bytes).
        pub const GPU_UUID_OFFSET: u32 = 0;
        /// rmStatus.
        pub const RM_STATUS_OFFSET: u32 = 16;
    }
    /// `UVM_CREATE_RANGE_GROUP_PARAMS` / `UVM_DESTROY_RANGE_GROUP_PARAMS` (removed in 610.43.02).
    pub mod range_group {
        /// Struct size.
        pub const SIZE: u32 = 16;
        /// rangeGroupId (u64).
        pub const RANGE_GROUP_ID_OFFSET: u32 = 0;
        /// rmStatus.
        pub const RM_STATUS_OFFSET: u32 = 8;
    }
    /// `UVM_SET_RANGE_GROUP_PARAMS` (removed in 610.43.02).
    pub mod set_range_group {
        /// Struct size.
        pub const SIZE: u32 = 32;
        /// rangeGroupId (u64).
        pub const RANGE_GROUP_ID_OFFSET: u32 = 0;
        /// requestedBase (u64).
        pub const REQUESTED_BASE_OFFSET: u32 = 8;
        /// length (u64).
        pub const LENGTH_OFFSET: u32 = 16;
        /// rmStatus.
        pub const RM_STATUS_OFFSET: u32 = 24;
    }
    /// `UVM_MIGRATE_RANGE_GROUP_PARAMS` (removed in 610.43.02).
    pub mod migrate_range_group {
        /// Struct size.
        pub const SIZE: u32 = 32;
        /// rangeGroupId (u64).
        pub const RANGE_GROUP_ID_OFFSET: u32 = 0;
        /// destinationUuid (16 bytes).
        pub const DESTINATION_UUID_OFFSET: u32 = 8;
        /// rmStatus.
        pub const RM_STATUS_OFFSET: u32 = 24;
    }
    /// `UvmGpuMappingAttributes` (`kernel-open/nvidia-uvm/uvm_types.h`, 515 .. 595): one GPU's entry of the
    /// perGpuAttributes array of UVM_MAP_EXTERNAL_ALLOCATION and UVM_ALLOC_SEMAPHORE_POOL; the values are the
    /// enums of `kernel-open/common/inc/nv_uvm_user_types.h`.
    pub mod gpu_mapping_attributes {
        /// Entry size.
        pub const SIZE: u32 = 36;
        /// gpuUuid (16 bytes).
        pub const GPU_UUID_OFFSET: u32 = 0;
        /// gpuMappingType (UvmGpuMappingType).
        pub const MAPPING_TYPE_OFFSET: u32 = 16;
        /// gpuCachingType (UvmGpuCachingType).
        pub const CACHING_TYPE_OFFSET: u32 = 20;
        /// gpuFormatType (UvmGpuFormatType).
        pub const FORMAT_TYPE_OFFSET: u32 = 24;
        /// gpuElementBits (UvmGpuFormatElementBits).
        pub const ELEMENT_BITS_OFFSET: u32 = 28;
        /// gpuCompressionType (UvmGpuCompressionType).
        pub const COMPRESSION_TYPE_OFFSET: u32 = 32;
        /// Entries in the array: UVM_MAX_GPUS (NV_MAX_DEVICES * UVM_PARENT_ID_MAX_SUB_PROCESSORS) from
        /// 550.40.53 (see [`crate::uvm::band_major_for`]).
        pub const MAX_GPUS: u32 = 256;
        /// Entries before 550.40.53 (UVM_MAX_GPUS = NV_MAX_DEVICES).
        pub const MAX_GPUS_BEFORE_V2: u32 = 32;
    }
    /// `UVM_MAP_EXTERNAL_ALLOCATION_PARAMS`: 9264 bytes with UVM_MAX_GPUS_V2 (256) per-GPU attributes from
    /// 550.40.53, 1200 bytes with UVM_MAX_GPUS (32) before; see [`crate::uvm::band_major_for`]. A tracer
    /// that captures fewer bytes (the probes take 256) holds base, length, offset and the first entries of
    /// perGpuAttributes; the fd, handles and rmStatus are in the struct's last 16 bytes.
    pub mod map_external_allocation {
        /// Struct size (UVM_MAX_GPUS_V2, 550.40.53+).
        pub const SIZE: u32 = 9264;
        /// Struct size before 550.40.53.
        pub const SIZE_BEFORE_V2: u32 = 1200;
        /// base (u64).
        pub const BASE_OFFSET: u32 = 0;
        /// length (u64).
        pub const LENGTH_OFFSET: u32 = 8;
        /// offset (u64) into the allocation.
        pub const OFFSET_OFFSET: u32 = 16;
        /// perGpuAttributes[] (see [`super::gpu_mapping_attributes`]).
        pub const PER_GPU_ATTRIBUTES_OFFSET: u32 = 24;
        /// gpuAttributesCount (u64, 550.40.53+).
        pub const GPU_ATTRIBUTES_COUNT_OFFSET: u32 = 9240;
        /// rmCtrlFd (550.40.53+).
        pub const RM_CTRL_FD_OFFSET: u32 = 9248;
        /// hClient (550.40.53+).
        pub const H_CLIENT_OFFSET: u32 = 9252;
        /// hMemory (550.40.53+).
        pub const H_MEMORY_OFFSET: u32 = 9256;
        /// rmStatus (550.40.53+).
        pub const RM_STATUS_OFFSET: u32 = 9260;
        /// gpuAttributesCount before 550.40.53.
        pub const GPU_ATTRIBUTES_COUNT_OFFSET_BEFORE_V2: u32 = 1176;
        /// rmCtrlFd before 550.40.53.
        pub const RM_CTRL_FD_OFFSET_BEFORE_V2: u32 = 1184;
        /// hClient before 550.40.53.
        pub const H_CLIENT_OFFSET_BEFORE_V2: u32 = 1188;
        /// hMemory before 550.40.53.
        pub const H_MEMORY_OFFSET_BEFORE_V2: u32 = 1192;
        /// rmStatus before 550.40.53.
        pub const RM_STATUS_OFFSET_BEFORE_V2: u32 = 1196;
    }
    /// `UVM_ALLOC_SEMAPHORE_POOL_PARAMS`: 9248 bytes from 550.40.53, 1184 before (perGpuAttributes grew as
    /// UVM_MAP_EXTERNAL_ALLOCATION's did).
    pub mod alloc_semaphore_pool {
        /// Struct size (550.40.53+).
        pub const SIZE: u32 = 9248;
        /// Struct size before 550.40.53.
        pub const SIZE_BEFORE_V2: u32 = 1184;
        /// base (u64).
        pub const BASE_OFFSET: u32 = 0;
        /// length (u64).
        pub const LENGTH_OFFSET: u32 = 8;
        /// perGpuAttributes[] (see [`super::gpu_mapping_attributes`]).
        pub const PER_GPU_ATTRIBUTES_OFFSET: u32 = 16;
        /// gpuAttributesCount (u64, 550.40.53+).
        pub const GPU_ATTRIBUTES_COUNT_OFFSET: u32 = 9232;
        /// rmStatus (550.40.53+).
        pub const RM_STATUS_OFFSET: u32 = 9240;
        /// gpuAttributesCount before 550.40.53.
        pub const GPU_ATTRIBUTES_COUNT_OFFSET_BEFORE_V2: u32 = 1168;
        /// rmStatus before 550.40.53.
        pub const RM_STATUS_OFFSET_BEFORE_V2: u32 = 1176;
    }
}

#[cfg(test)]
mod tests {
    use super::nvos56;
    use super::uvm::{
        alloc_semaphore_pool as pool, gpu_mapping_attributes as attrs,
        map_external_allocation as map,
    };
    use crate::uvm::{self, UvmParams, params_layout};

    fn with_status(size: u32, status: u32) -> Option<UvmParams> {
        Some(UvmParams {
            size,
            status_offset: Some(status),
        })
    }

    /// In both bands the per-GPU array ends where gpuAttributesCount (u64) starts, the fields after it follow
    /// in order, and size and rmStatus agree with `uvm::params_layout`.
    #[test]
    fn per_gpu_attribute_arrays_fit_their_structs() {
        let v2 = (
            595,
            attrs::MAX_GPUS,
            [
                map::GPU_ATTRIBUTES_COUNT_OFFSET,
                map::RM_CTRL_FD_OFFSET,
                map::H_CLIENT_OFFSET,
                map::H_MEMORY_OFFSET,
                map::RM_STATUS_OFFSET,
                map::SIZE,
            ],
            [
                pool::GPU_ATTRIBUTES_COUNT_OFFSET,
                pool::RM_STATUS_OFFSET,
                pool::SIZE,
            ],
        );
        let v1 = (
            545,
            attrs::MAX_GPUS_BEFORE_V2,
            [
                map::GPU_ATTRIBUTES_COUNT_OFFSET_BEFORE_V2,
                map::RM_CTRL_FD_OFFSET_BEFORE_V2,
                map::H_CLIENT_OFFSET_BEFORE_V2,
                map::H_MEMORY_OFFSET_BEFORE_V2,
                map::RM_STATUS_OFFSET_BEFORE_V2,
                map::SIZE_BEFORE_V2,
            ],
            [
                pool::GPU_ATTRIBUTES_COUNT_OFFSET_BEFORE_V2,
                pool::RM_STATUS_OFFSET_BEFORE_V2,
                pool::SIZE_BEFORE_V2,
            ],
        );
        for (major, gpus, [count, fd, client, memory, status, size], [p_count, p_status, p_size]) in
            [v2, v1]
        {
            assert_eq!(map::PER_GPU_ATTRIBUTES_OFFSET, map::OFFSET_OFFSET + 8);
            assert_eq!(map::PER_GPU_ATTRIBUTES_OFFSET + gpus * attrs::SIZE, count);
            assert_eq!(
                [count + 8, fd + 4, client + 4, memory + 4, status + 4],
                [fd, client, memory, status, size]
            );
            assert_eq!(
                params_layout(uvm::MAP_EXTERNAL_ALLOCATION, major),
                with_status(size, status)
            );
            assert_eq!(pool::PER_GPU_ATTRIBUTES_OFFSET, pool::LENGTH_OFFSET + 8);
            assert_eq!(
                pool::PER_GPU_ATTRIBUTES_OFFSET + gpus * attrs::SIZE,
                p_count
            );
            assert_eq!(p_count + 8, p_status);
            assert_eq!(
                params_layout(uvm::ALLOC_SEMAPHORE_POOL, major),
                with_status(p_size, p_status)
            );
        }
        assert_eq!(attrs::COMPRESSION_TYPE_OFFSET + 4, attrs::SIZE);
    }

    #[test]
    fn nvos56_is_the_size_the_escape_takes() {
        assert_eq!(
            crate::escape::params_size(crate::escape::RM_UPDATE_DEVICE_MAPPING_INFO),
            Some(nvos56::SIZE)
        );
        assert_eq!(nvos56::STATUS_OFFSET + 8, nvos56::SIZE);
    }
}
