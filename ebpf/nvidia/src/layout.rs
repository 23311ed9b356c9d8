//! Params layouts that changed between driver releases, selected by the driver version.
//!
//! Checked with `offsetof` at the last tag of every major release 515 .. 595 of
//! NVIDIA/open-gpu-kernel-modules (x86_64); bands are by major version:
//!
//! | struct | band | size | fields |
//! |---|---|---|---|
//! | NVOS21 (RM_ALLOC) | <= 530 | 32 | status@24 |
//! | | >= 535 | 32 | paramsSize@24, status@28 |
//! | NVOS64 (RM_ALLOC) | <= 520 | 40 | pRightsRequested@24, status@32 |
//! | | 525-530 | 40 | pRightsRequested@24, flags@32, status@36 |
//! | | >= 535 | 48 | pRightsRequested@24, paramsSize@32, flags@36, status@40 |
//! | NVOS46 (RM_MAP_MEMORY_DMA) | <= 575 | 56 | offset@16, length@24, flags@32, dmaOffset@40, status@48 |
//! | | >= 580 | 64 | flags2@36, kindOverride@40, dmaOffset@48, status@56 |
//! | NVOS47 (RM_UNMAP_MEMORY_DMA) | <= 545 | 40 | flags@16, dmaOffset@24, status@32 |
//! | | >= 550 | 48 | size@32, status@40 |
//! | UVM_FREE | <= 580 | 24 | base@0, length@8, rmStatus@16 |
//! | | >= 590 | 16 | base@0, rmStatus@8 |
//! | NV_MEMORY_ALLOCATION_PARAMS | <= 535 | 120 | (size@64 in all bands) |
//! | | >= 545 | 128 | numaNode@120 |
//! | nv_ioctl_numa_info_t (NV_ESC_NUMA_INFO) | <= 530 | 552 | |
//! | | >= 535 | 560 | |
//! | nv_ioctl_export_to_dma_buf_fd_t (NV_ESC_EXPORT_TO_DMABUF_FD) | <= 565 | 2600 | status@2592 |
//! | | 570-575 | 2608 | mappingType@32, status@2600 |
//! | | >= 580 | 2608 | mappingType@32, bAllowMmap@33, status@2600 |
//! | NV_LOCKLESS_DIAGNOSTIC_PARAMS (NV_ESC_RM_LOCKLESS_DIAGNOSTIC) | 545 .. 565, 550 < 550.142 | 4024 | |
//! | | >= 570, 550.142+ | 15412 | |
//!
//! Within a major the layouts are stable (first and last tag of every major compared), except UVM: the
//! first 550 release (550.40.07) still had the 545 structs of the four commands that grew with
//! UVM_MAX_GPUS_V2 (other UVM structs, e.g. UVM_SET_PREFERRED_LOCATION's, already had their 550 layout),
//! see [`crate::uvm::band_major_for`].
//!
//! Fields common to all bands are in [`crate::params`]; other UVM commands through [`Layout::uvm_params`].
//!
//! Drivers above 595 (610.43.02+) use the 595 layouts here, minus the UVM range-group ioctls
//! ([`crate::uvm::RANGE_GROUPS_REMOVED`]). Not modelled: `NV_CHANNEL_ALLOC_PARAMS` (the `pAllocParms` of
//! the GPFIFO channel classes), which changed at 570.86.15 and again at 610.43.02 (gVisor
//! `pkg/abi/nvgpu/classes.go`, NV_CHANNEL_ALLOC_PARAMS_V570 / _V610); the decoder does not read channel
//! params, so no band is recorded for it yet.

use crate::uvm::UvmParams;

/// The first release whose frontend refuses (-EINVAL, before RM) an unknown escape number or a params size
/// that is not the escape's (`nv_validate_ioctls` in `kernel-open/nvidia/nv.c`).
pub const FIRST_VALIDATING_IOCTLS: DriverVersion = DriverVersion::new(595, 44, 2);

/// A driver version such as 595.45.04 (patch 0 when the version has two parts, e.g. 565.77).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[cfg_attr(feature = "std", derive(serde::Serialize, serde::Deserialize))]
pub struct DriverVersion {
    /// Major (branch), e.g. 595.
    pub major: u32,
    /// Minor, e.g. 45.
    pub minor: u32,
    /// Patch, e.g. 4.
    pub patch: u32,
}

/// The driver this crate's defaults describe.
pub const DEFAULT_VERSION: DriverVersion = DriverVersion::new(595, 45, 4);

impl DriverVersion {
    /// A version from its parts.
    pub const fn new(major: u32, minor: u32, patch: u32) -> Self {
        DriverVersion {
            major,
            minor,
            patch,
        }
    }

    /// Parses "595.45.04" or "565.77" (surrounding ASCII whitespace allowed). `None` for anything else:
    /// empty parts, non-digits, more than three parts, or a number above 99999.
    pub fn parse(s: &str) -> Option<DriverVersion> {
        Self::parse_bytes(s.trim_ascii().as_bytes())
    }

    /// [`DriverVersion::parse`] over bytes, without trimming.
    pub fn parse_bytes(s: &[u8]) -> Option<DriverVersion> {
        let mut parts = [0u32; 3];
        let mut count = 0usize;
        for part in s.split(|&b| b == b'.') {
            if count == parts.len() || part.is_empty() || part.len() > 5 {
                return None;
            }
            let mut value = 0u32;
            for &b in part {
                if !b.is_ascii_digit() {
                    return None;
                }
                value = value * 10 + u32::from(b - b'0');
            }
            parts[count] = value;
            count += 1;
        }
        if count < 2 {
            return None;
        }
        Some(DriverVersion::new(parts[0], parts[1], parts[2]))
    }

    /// Whether this version is `other` or later (`>=` usable in `const fn`s and BPF code).
    pub const fn at_least(self, other: DriverVersion) -> bool {
        if self.major != other.major {
            return self.major > other.major;
        }
        if self.minor != other.minor {
            return self.minor > other.minor;
        }
        self.patch >= other.patch
    }

    /// Finds the version in `/proc/driver/nvidia/version`'s text ("NVRM version: NVIDIA UNIX ... Kernel
    /// Module for x86_64  595.45.04  Release Build ..."): the first whitespace-separated token that parses.
    pub fn find_in_text(text: &str) -> Option<DriverVersion> {
        text.split_ascii_whitespace().find_map(DriverVersion::parse)
    }
}

#[cfg(feature = "std")]
impl std::fmt::Display for DriverVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{:02}.{:02}", self.major, self.minor, self.patch)
    }
}

/// Which struct an `NV_ESC_RM_ALLOC` carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "std", derive(serde::Serialize))]
pub enum AllocStruct {
    /// NVOS21_PARAMETERS (what libcuda uses for most allocs).
    Nvos21,
    /// NVOS64_PARAMETERS (with access rights).
    Nvos64,
}

/// Layout of one `NV_ESC_RM_ALLOC` params struct in one band. hRoot, hObjectParent, hObjectNew, hClass
/// and pAllocParms are at the same offsets in both (see [`crate::params::rm_alloc`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllocLayout {
    /// NVOS21 or NVOS64.
    pub kind: AllocStruct,
    /// Struct size (= the ioctl's `_IOC_SIZE`).
    pub size: u32,
    /// Offset of status.
    pub status: u32,
    /// Offset of paramsSize (535+).
    pub params_size: Option<u32>,
    /// Offset of flags (NVOS64, 525+).
    pub flags: Option<u32>,
    /// Offset of pRightsRequested (NVOS64 only).
    pub rights_requested: Option<u32>,
}

/// Offsets of every band-dependent field for one driver version (see the module doc for the bands).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// The version this layout was built for.
    pub version: DriverVersion,
    /// NVOS21 size: 32 in all bands.
    pub nvos21_size: u32,
    /// NVOS21 status: @24 up to 530, @28 from 535.
    pub nvos21_status: u32,
    /// NVOS21 paramsSize: @24 from 535, absent before.
    pub nvos21_params_size: Option<u32>,
    /// NVOS64 size: 40 up to 530, 48 from 535.
    pub nvos64_size: u32,
    /// NVOS64 status: @32 up to 520, @36 in 525-530, @40 from 535.
    pub nvos64_status: u32,
    /// NVOS64 flags: absent up to 520, @32 in 525-530, @36 from 535.
    pub nvos64_flags: Option<u32>,
    /// NVOS64 paramsSize: @32 from 535, absent before.
    pub nvos64_params_size: Option<u32>,
    /// NVOS64 pRightsRequested (u64 pointer): @24 in all bands.
    pub nvos64_rights_requested: Option<u32>,
    /// UVM_FREE params size: 24 up to 580, 16 from 590.
    pub uvm_free_size: u32,
    /// UVM_FREE rmStatus: @16 up to 580, @8 from 590.
    pub uvm_free_status: u32,
    /// UVM_FREE length (u64): @8 up to 580, absent from 590.
    pub uvm_free_length: Option<u32>,
    /// NVOS46 size: 56 up to 575, 64 from 580.
    pub nvos46_size: u32,
    /// NVOS46 dmaOffset (u64): @40 up to 575, @48 from 580.
    pub nvos46_dma_offset: u32,
    /// NVOS46 status: @48 up to 575, @56 from 580.
    pub nvos46_status: u32,
    /// NVOS46 flags2: @36 from 580, absent before.
    pub nvos46_flags2: Option<u32>,
    /// NVOS46 kindOverride: @40 from 580, absent before.
    pub nvos46_kind_override: Option<u32>,
    /// NVOS47 size: 40 up to 545, 48 from 550.
    pub nvos47_size: u32,
    /// NVOS47 status: @32 up to 545, @40 from 550.
    pub nvos47_status: u32,
    /// NVOS47 size field (u64, bytes unmapped): @32 from 550, absent before.
    pub nvos47_length: Option<u32>,
    /// NV_MEMORY_ALLOCATION_PARAMS size: 120 up to 535, 128 from 545.
    pub memory_alloc_size: u32,
    /// nv_ioctl_numa_info_t size (NV_ESC_NUMA_INFO): 552 up to 530, 560 from 535 (535.43.02).
    pub numa_info_size: u32,
    /// nv_ioctl_export_to_dma_buf_fd_t size (NV_ESC_EXPORT_TO_DMABUF_FD): 2600 up to 565.77, 2608 from
    /// 570.86.15 (mappingType added).
    pub export_dmabuf_size: u32,
    /// nv_ioctl_export_to_dma_buf_fd_t status: @2592 up to 565.77, @2600 from 570.86.15.
    pub export_dmabuf_status: u32,
    /// nv_ioctl_export_to_dma_buf_fd_t mappingType (u8): @32 from 570.86.15, absent before.
    pub export_dmabuf_mapping_type: Option<u32>,
    /// nv_ioctl_export_to_dma_buf_fd_t bAllowMmap (NvBool): @33 from 580 (580.65.06), absent before.
    pub export_dmabuf_allow_mmap: Option<u32>,
    /// NV_LOCKLESS_DIAGNOSTIC_PARAMS size (`nv-ioctl-lockless-diag.h`): absent before 545.23.06, 4024 up
    /// to 565.77 (and 550 before 550.142), 15412 from 570.86.15 and 550.142.
    pub lockless_diagnostic_size: Option<u32>,
}

/// NVOS46 fields that did not move: hClient@0, hDevice@4, hDma@8, hMemory@12, offset@16, length@24,
/// flags@32.
pub mod nvos46 {
    /// hClient.
    pub const H_CLIENT_OFFSET: u32 = 0;
    /// hDevice.
    pub const H_DEVICE_OFFSET: u32 = 4;
    /// hDma (the VA space / context DMA).
    pub const H_DMA_OFFSET: u32 = 8;
    /// hMemory.
    pub const H_MEMORY_OFFSET: u32 = 12;
    /// offset (u64).
    pub const OFFSET_OFFSET: u32 = 16;
    /// length (u64).
    pub const LENGTH_OFFSET: u32 = 24;
    /// flags.
    pub const FLAGS_OFFSET: u32 = 32;
}

/// NVOS47 fields that did not move: hClient@0, hDevice@4, hDma@8, hMemory@12, flags@16, dmaOffset@24.
pub mod nvos47 {
    /// hClient.
    pub const H_CLIENT_OFFSET: u32 = 0;
    /// hDevice.
    pub const H_DEVICE_OFFSET: u32 = 4;
    /// hDma.
    pub const H_DMA_OFFSET: u32 = 8;
    /// hMemory.
    pub const H_MEMORY_OFFSET: u32 = 12;
    /// flags.
    pub const FLAGS_OFFSET: u32 = 16;
    /// dmaOffset (u64).
    pub const DMA_OFFSET_OFFSET: u32 = 24;
}

/// UVM_FREE fields that did not move: base (u64) @0.
pub mod uvm_free {
    /// base (u64).
    pub const BASE_OFFSET: u32 = 0;
}

impl Layout {
    /// The layout for this crate's default driver (595.45.04).
    pub const DEFAULT: Layout = Layout::for_version(DEFAULT_VERSION);

    /// The layout for driver `v` (bands by major version; see the module doc).
    pub const fn for_version(v: DriverVersion) -> Layout {
        let m = v.major;
        let (nvos21_status, nvos21_params_size) =
            if m >= 535 { (28, Some(24)) } else { (24, None) };
        let (nvos64_size, nvos64_status, nvos64_flags, nvos64_params_size, nvos64_rights_requested) =
            if m >= 535 {
                (48, 40, Some(36), Some(32), Some(24))
            } else if m >= 525 {
                (40, 36, Some(32), None, Some(24))
            } else {
                (40, 32, None, None, Some(24))
            };
        let (uvm_free_size, uvm_free_status, uvm_free_length) = if m >= 590 {
            (16, 8, None)
        } else {
            (24, 16, Some(8))
        };
        let (nvos46_size, nvos46_dma_offset, nvos46_status, nvos46_flags2, nvos46_kind_override) =
            if m >= 580 {
                (64, 48, 56, Some(36), Some(40))
            } else {
                (56, 40, 48, None, None)
            };
        let (nvos47_size, nvos47_status, nvos47_length) = if m >= 550 {
            (48, 40, Some(32))
        } else {
            (40, 32, None)
        };
        let memory_alloc_size = if m >= 545 { 128 } else { 120 };
        let numa_info_size = if m >= 535 {
            crate::params::numa_info::SIZE
        } else {
            crate::params::numa_info::SIZE_BEFORE_535
        };
        let (export_dmabuf_size, export_dmabuf_status, export_dmabuf_mapping_type) =
            export_dmabuf_layout(v);
        let lockless_diagnostic_size = lockless_diagnostic_size(v);
        let export_dmabuf_allow_mmap = if m >= 580 {
            Some(crate::params::export_to_dmabuf_fd::ALLOW_MMAP_OFFSET)
        } else {
            None
        };
        Layout {
            version: v,
            nvos21_size: 32,
            nvos21_status,
            nvos21_params_size,
            nvos64_size,
            nvos64_status,
            nvos64_flags,
            nvos64_params_size,
            nvos64_rights_requested,
            uvm_free_size,
            uvm_free_status,
            uvm_free_length,
            nvos46_size,
            nvos46_dma_offset,
            nvos46_status,
            nvos46_flags2,
            nvos46_kind_override,
            nvos47_size,
            nvos47_status,
            nvos47_length,
            memory_alloc_size,
            numa_info_size,
            export_dmabuf_size,
            export_dmabuf_status,
            export_dmabuf_mapping_type,
            export_dmabuf_allow_mmap,
            lockless_diagnostic_size,
        }
    }

    /// Tells NVOS21 from NVOS64 by the ioctl's `_IOC_SIZE`; `None` when it matches neither.
    pub const fn rm_alloc_layout(&self, ioc_size: u32) -> Option<AllocLayout> {
        if ioc_size == self.nvos21_size {
            Some(AllocLayout {
                kind: AllocStruct::Nvos21,
                size: self.nvos21_size,
                status: self.nvos21_status,
                params_size: self.nvos21_params_size,
                flags: None,
                rights_requested: None,
            })
        } else if ioc_size == self.nvos64_size {
            Some(AllocLayout {
                kind: AllocStruct::Nvos64,
                size: self.nvos64_size,
                status: self.nvos64_status,
                params_size: self.nvos64_params_size,
                flags: self.nvos64_flags,
                rights_requested: self.nvos64_rights_requested,
            })
        } else {
            None
        }
    }

    /// Size and rmStatus offset of UVM command `cmd`'s params for this driver.
    pub const fn uvm_params(&self, cmd: u32) -> Option<UvmParams> {
        crate::uvm::params_for_version(cmd, self.version)
    }

    /// Params size of frontend escape `nr` for this driver: [`crate::escape::params_size`] plus the
    /// band-dependent NVOS46/NVOS47, NUMA_INFO and EXPORT_TO_DMABUF_FD. `None` for RM_ALLOC (two
    /// structs: use [`Layout::rm_alloc_layout`]) and variable-size escapes.
    pub const fn escape_params_size(&self, nr: u32) -> Option<u32> {
        match nr {
            crate::escape::RM_MAP_MEMORY_DMA => Some(self.nvos46_size),
            crate::escape::RM_UNMAP_MEMORY_DMA => Some(self.nvos47_size),
            crate::escape::NUMA_INFO => Some(self.numa_info_size),
            crate::escape::EXPORT_TO_DMABUF_FD => Some(self.export_dmabuf_size),
            crate::escape::RM_LOCKLESS_DIAGNOSTIC => self.lockless_diagnostic_size,
            _ => crate::escape::params_size(nr),
        }
    }
}

/// nv_ioctl_export_to_dma_buf_fd_t (size, status offset, mappingType offset) for driver `v`: the struct
/// grew by 8 bytes at 570.86.15 (`mappingType` after totalSize, and a pad after the handles array).
const fn export_dmabuf_layout(v: DriverVersion) -> (u32, u32, Option<u32>) {
    use crate::params::export_to_dmabuf_fd as p;
    if v.at_least(p::FIRST_570) {
        (p::SIZE, p::STATUS_OFFSET, Some(p::MAPPING_TYPE_OFFSET))
    } else {
        (p::SIZE_BEFORE_570, p::STATUS_OFFSET_BEFORE_570, None)
    }
}

impl Layout {
    /// Whether driver `self.version` lets escape `nr` with `_IOC_SIZE` `ioc_size` through to RM: `None`
    /// before 595.44.02 (no check: every number reaches RM, which answers in the status), else what
    /// 595.44.02's `nv_validate_ioctls` / `rm_validate_ioctls` / `RmValidateIoctl` decide: RM_ALLOC takes
    /// NVOS21 or NVOS64, CARD_INFO and ATTACH_GPUS_TO_FD a non-empty array of their entries, the rest
    /// exactly their struct. Numbers in none of those tables (RM_ADD_VBLANK_CALLBACK,
    /// RM_EXPORT/IMPORT_OBJECT_TO/FROM_FD, unknown ones) are refused.
    pub const fn accepts_escape(&self, nr: u32, ioc_size: u32) -> Option<bool> {
        use crate::escape as e;
        if !self.version.at_least(FIRST_VALIDATING_IOCTLS) {
            return None;
        }
        Some(match nr {
            e::RM_ALLOC => self.rm_alloc_layout(ioc_size).is_some(),
            e::CARD_INFO => {
                ioc_size != 0 && ioc_size.is_multiple_of(crate::params::card_info::ENTRY_SIZE)
            }
            e::ATTACH_GPUS_TO_FD => ioc_size != 0 && ioc_size.is_multiple_of(4),
            e::RM_ADD_VBLANK_CALLBACK | e::RM_EXPORT_OBJECT_TO_FD | e::RM_IMPORT_OBJECT_FROM_FD => {
                false
            }
            _ => match self.escape_params_size(nr) {
                Some(size) => size == ioc_size,
                None => false,
            },
        })
    }
}

/// NV_LOCKLESS_DIAGNOSTIC_PARAMS size for driver `v` (its nvlog params grew to 15412 bytes at 570.86.15,
/// backported to 550.142); `None` before the escape existed (545.23.06).
const fn lockless_diagnostic_size(v: DriverVersion) -> Option<u32> {
    if !v.at_least(crate::escape::FIRST_LOCKLESS_DIAGNOSTIC) {
        None
    } else if v.major >= 570 || (v.major == 550 && v.at_least(DriverVersion::new(550, 142, 0))) {
        Some(15412)
    } else {
        Some(4024)
    }
}

impl Default for Layout {
    fn default() -> Self {
        Layout::DEFAULT
    }
}

/// Where the loaded driver's version is published (first one that exists wins).
#[cfg(feature = "std")]
pub const VERSION_PATHS: [&str; 2] = ["/sys/module/nvidia/version", "/proc/driver/nvidia/version"];

/// The loaded NVIDIA driver's version, from `/sys/module/nvidia/version` or else
/// `/proc/driver/nvidia/version`; `None` when no driver is loaded (or neither file parses).
#[cfg(feature = "std")]
pub fn host_driver_version() -> Option<DriverVersion> {
    VERSION_PATHS.iter().find_map(|path| {
        let text = std::fs::read_to_string(path).ok()?;
        DriverVersion::find_in_text(&text)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_versions() {
        assert_eq!(
            DriverVersion::parse("595.45.04"),
            Some(DriverVersion::new(595, 45, 4))
        );
        assert_eq!(
            DriverVersion::parse("565.77\n"),
            Some(DriverVersion::new(565, 77, 0))
        );
        for bad in [
            "",
            "595",
            "595.",
            ".45",
            "595.45.04.1",
            "59a.45",
            "1.2.3456789",
            "595..4",
        ] {
            assert_eq!(DriverVersion::parse(bad), None, "{bad:?}");
        }
        let proc_text = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build  \
                         (dvs-builder@U16-I2-C04-12-4)  Thu Sep 25 23:47:39 UTC 2025\nGCC version:  gcc 12.2";
        assert_eq!(
            DriverVersion::find_in_text(proc_text),
            Some(DriverVersion::new(580, 95, 5))
        );
        assert_eq!(DEFAULT_VERSION.to_string(), "595.45.04");
        assert!(DriverVersion::new(535, 0, 0) > DriverVersion::new(530, 99, 99));
        for (a, b) in [
            ((570, 86, 15), (570, 86, 15)),
            ((570, 86, 16), (570, 86, 15)),
            ((571, 0, 0), (570, 86, 15)),
            ((570, 86, 14), (570, 86, 15)),
            ((565, 77, 0), (570, 86, 15)),
        ] {
            let (a, b) = (
                DriverVersion::new(a.0, a.1, a.2),
                DriverVersion::new(b.0, b.1, b.2),
            );
            assert_eq!(a.at_least(b), a >= b, "{a} {b}");
        }
    }

    #[test]
    fn bands() {
        let at = |major| Layout::for_version(DriverVersion::new(major, 0, 0));
        assert_eq!(
            (
                at(520).nvos21_status,
                at(530).nvos21_status,
                at(535).nvos21_status
            ),
            (24, 24, 28)
        );
        assert_eq!(
            (
                at(520).nvos64_size,
                at(525).nvos64_size,
                at(535).nvos64_size
            ),
            (40, 40, 48)
        );
        assert_eq!(
            (
                at(520).nvos64_status,
                at(525).nvos64_status,
                at(595).nvos64_status
            ),
            (32, 36, 40)
        );
        assert_eq!(
            (
                at(520).nvos64_flags,
                at(530).nvos64_flags,
                at(535).nvos64_flags
            ),
            (None, Some(32), Some(36))
        );
        assert_eq!((at(580).uvm_free_size, at(590).uvm_free_size), (24, 16));
        assert_eq!((at(575).nvos46_status, at(580).nvos46_status), (48, 56));
        assert_eq!((at(545).nvos47_status, at(550).nvos47_status), (32, 40));
        assert_eq!(
            (at(535).memory_alloc_size, at(545).memory_alloc_size),
            (120, 128)
        );
        assert_eq!(Layout::default(), Layout::for_version(DEFAULT_VERSION));
    }

    /// `nv_validate_ioctls` (kernel-open/nvidia/nv.c) and `RmValidateIoctl`
    /// (src/nvidia/arch/nvalloc/unix/src/escape.c) at 595.44.02; nothing like them at 590.48.01.
    #[test]
    fn escapes_validated_from_595_44_02() {
        use crate::escape as e;
        let old = Layout::for_version(DriverVersion::new(590, 48, 1));
        assert_eq!(old.accepts_escape(e::RM_FREE, 20), None);
        let new = Layout::for_version(DriverVersion::new(595, 44, 2));
        assert_eq!(new.accepts_escape(e::RM_FREE, 16), Some(true));
        assert_eq!(new.accepts_escape(e::RM_FREE, 20), Some(false));
        assert_eq!(new.accepts_escape(e::RM_ALLOC, 32), Some(true));
        assert_eq!(new.accepts_escape(e::RM_ALLOC, 48), Some(true));
        assert_eq!(new.accepts_escape(e::RM_ALLOC, 40), Some(false));
        assert_eq!(new.accepts_escape(e::CARD_INFO, 72 * 32), Some(true));
        assert_eq!(new.accepts_escape(e::CARD_INFO, 0), Some(false));
        assert_eq!(new.accepts_escape(e::ATTACH_GPUS_TO_FD, 12), Some(true));
        assert_eq!(new.accepts_escape(e::RM_MAP_MEMORY_DMA, 64), Some(true));
        assert_eq!(new.accepts_escape(e::RM_MAP_MEMORY_DMA, 56), Some(false));
        assert_eq!(
            new.accepts_escape(e::RM_EXPORT_OBJECT_TO_FD, 16),
            Some(false)
        );
        assert_eq!(new.accepts_escape(0x99, 8), Some(false));
    }

    #[test]
    fn rm_alloc_by_ioc_size() {
        let new = Layout::DEFAULT;
        assert_eq!(
            new.rm_alloc_layout(32).map(|a| (a.kind, a.status)),
            Some((AllocStruct::Nvos21, 28))
        );
        assert_eq!(
            new.rm_alloc_layout(48).map(|a| (a.kind, a.status)),
            Some((AllocStruct::Nvos64, 40))
        );
        assert_eq!(new.rm_alloc_layout(40), None);
        let old = Layout::for_version(DriverVersion::new(525, 147, 5));
        assert_eq!(
            old.rm_alloc_layout(40).map(|a| (a.kind, a.status)),
            Some((AllocStruct::Nvos64, 36))
        );
        assert_eq!(old.rm_alloc_layout(48), None);
        assert_eq!(
            new.escape_params_size(crate::escape::RM_MAP_MEMORY_DMA),
            Some(64)
        );
        assert_eq!(
            old.escape_params_size(crate::escape::RM_UNMAP_MEMORY_DMA),
            Some(40)
        );
    }
}
