//! Control commands that CUDA 580 issues and NVIDIA's open headers do not define
//! (`src/common/sdk/nvidia/inc/ctrl/**` has no `#define` for them at any tag from 515.43.04 to 595.45.04).
//! Seen on the H200 (/work/shared/gpu/580.159.04/README.md, "Not named").
//!
//! Two are named by RM's own export table (`src/nvidia/generated/g_subdevice_nvoc.c`, 515 .. 595: the
//! handler `subdeviceCtrlCmdGpuAcquireComputeModeReservation` and its release, params size 0). The others
//! are opaque to the open driver and get the name of the part NVIDIA does publish:
//! - GSS-legacy commands (bit 15 set, `RM_GSS_LEGACY_MASK` in
//!   `src/nvidia/interface/deprecated/rmapi_deprecated.h`): on a GSP client RM forwards them to the GSP
//!   firmware as they are (`RmGssLegacyRpcCmd`, `rmapi_deprecated_control.c`). Their interface byte (bits
//!   15:8) is named in `ctrl/ctrl2080/ctrl2080base.h` (e.g. `NV2080_CTRL_CLK_LEGACY_NON_PRIVILEGED` 0x90);
//!   the name here is that interface's followed by the message id in hex.
//! - Commands of `NV2081_BINAPI` (`class/cl2081.h`): RM passes them on unread (`binapiControl_IMPL`,
//!   `src/nvidia/src/kernel/rmapi/binary_api.c`; the export table of the class is empty); named
//!   `NV2081_BINAPI_CTRL_` and the command's low 16 bits.
//!
//! The interface numbers have not changed from 515 to 595, so the names hold for every supported driver.

/// `subdeviceCtrlCmdGpuAcquireComputeModeReservation` (no params). libcuda calls it when it creates a
/// context (recording: /work/shared/gpu/580.159.04/pytorch-1gib.jsonl; park-program.jsonl.gz, where the
/// resume in thread 462 calls it again).
pub const NV2080_CTRL_CMD_GPU_ACQUIRE_COMPUTE_MODE_RESERVATION: u32 = 0x20800145;
/// `subdeviceCtrlCmdGpuReleaseComputeModeReservation` (no params).
pub const NV2080_CTRL_CMD_GPU_RELEASE_COMPUTE_MODE_RESERVATION: u32 = 0x20800146;
/// GPU interface, legacy non-privileged (0x81), message 0x59: 332 bytes of params, at every cuInit
/// (recordings: pytorch-1gib.jsonl, and each `cuda-checkpoint` run in park-program.jsonl.gz).
pub const NV2080_CTRL_GPU_LEGACY_NON_PRIVILEGED_59: u32 = 0x20808159;
/// GPU interface, legacy non-privileged (0x81), message 0x62: 1 byte, at every cuInit (same recordings).
pub const NV2080_CTRL_GPU_LEGACY_NON_PRIVILEGED_62: u32 = 0x20808162;
/// Clock interface, legacy non-privileged (0x90), message 0x01: 8 bytes (recording: pytorch-1gib.jsonl).
pub const NV2080_CTRL_CLK_LEGACY_NON_PRIVILEGED_01: u32 = 0x20809001;
/// Clock interface, legacy non-privileged (0x90), message 0x09: 8 bytes (same recording).
pub const NV2080_CTRL_CLK_LEGACY_NON_PRIVILEGED_09: u32 = 0x20809009;
/// Clock interface, legacy non-privileged (0x90), message 0x38: 4 bytes (recordings: pytorch-1gib.jsonl,
/// park-program.jsonl.gz).
pub const NV2080_CTRL_CLK_LEGACY_NON_PRIVILEGED_38: u32 = 0x20809038;
/// Clock interface, legacy non-privileged (0x90), message 0x64: 520 bytes (recording: pytorch-1gib.jsonl).
pub const NV2080_CTRL_CLK_LEGACY_NON_PRIVILEGED_64: u32 = 0x20809064;
/// Performance interface, legacy non-privileged (0xa0), message 0x26: 532 bytes (same recording).
pub const NV2080_CTRL_PERF_LEGACY_NON_PRIVILEGED_26: u32 = 0x2080a026;
/// Performance interface, legacy non-privileged (0xa0), message 0x84: 4 bytes (same recording).
pub const NV2080_CTRL_PERF_LEGACY_NON_PRIVILEGED_84: u32 = 0x2080a084;
/// Power-management interface, legacy non-privileged (0xa6), message 0x12. Listed by the H200 README for a
/// park; not in the committed recordings.
pub const NV2080_CTRL_PMGR_LEGACY_NON_PRIVILEGED_12: u32 = 0x2080a612;
/// Power-management interface, legacy non-privileged (0xa6), message 0x18 (as message 0x12).
pub const NV2080_CTRL_PMGR_LEGACY_NON_PRIVILEGED_18: u32 = 0x2080a618;
/// Power-management interface, legacy non-privileged (0xa6), message 0x1d (as message 0x12).
pub const NV2080_CTRL_PMGR_LEGACY_NON_PRIVILEGED_1D: u32 = 0x2080a61d;
/// `NV2081_BINAPI` command 0x0108: 992 bytes, at every cuInit (recordings: pytorch-1gib.jsonl,
/// park-program.jsonl.gz).
pub const NV2081_BINAPI_CTRL_0108: u32 = 0x20810108;

/// Every command above.
pub const ALL: [u32; 14] = [
    NV2080_CTRL_CMD_GPU_ACQUIRE_COMPUTE_MODE_RESERVATION,
    NV2080_CTRL_CMD_GPU_RELEASE_COMPUTE_MODE_RESERVATION,
    NV2080_CTRL_GPU_LEGACY_NON_PRIVILEGED_59,
    NV2080_CTRL_GPU_LEGACY_NON_PRIVILEGED_62,
    NV2080_CTRL_CLK_LEGACY_NON_PRIVILEGED_01,
    NV2080_CTRL_CLK_LEGACY_NON_PRIVILEGED_09,
    NV2080_CTRL_CLK_LEGACY_NON_PRIVILEGED_38,
    NV2080_CTRL_CLK_LEGACY_NON_PRIVILEGED_64,
    NV2080_CTRL_PERF_LEGACY_NON_PRIVILEGED_26,
    NV2080_CTRL_PERF_LEGACY_NON_PRIVILEGED_84,
    NV2080_CTRL_PMGR_LEGACY_NON_PRIVILEGED_12,
    NV2080_CTRL_PMGR_LEGACY_NON_PRIVILEGED_18,
    NV2080_CTRL_PMGR_LEGACY_NON_PRIVILEGED_1D,
    NV2081_BINAPI_CTRL_0108,
];

/// `RM_GSS_LEGACY_MASK`: the bit of a command's interface byte that makes it a GSS-legacy call.
pub const GSS_LEGACY_MASK: u32 = 0x8000;

/// Whether RM treats `cmd` as a GSS-legacy call (`IsGssLegacyCall`): forwarded unread to the GSP firmware on
/// a GSP client.
#[inline(always)]
pub const fn is_gss_legacy(cmd: u32) -> bool {
    cmd & GSS_LEGACY_MASK != 0
}

/// The name of a command above.
pub fn name(cmd: u32) -> Option<&'static str> {
    Some(match cmd {
        NV2080_CTRL_CMD_GPU_ACQUIRE_COMPUTE_MODE_RESERVATION => {
            "NV2080_CTRL_CMD_GPU_ACQUIRE_COMPUTE_MODE_RESERVATION"
        }
        NV2080_CTRL_CMD_GPU_RELEASE_COMPUTE_MODE_RESERVATION => {
            "NV2080_CTRL_CMD_GPU_RELEASE_COMPUTE_MODE_RESERVATION"
        }
        NV2080_CTRL_GPU_LEGACY_NON_PRIVILEGED_59 => "NV2080_CTRL_GPU_LEGACY_NON_PRIVILEGED_59",
        NV2080_CTRL_GPU_LEGACY_NON_PRIVILEGED_62 => "NV2080_CTRL_GPU_LEGACY_NON_PRIVILEGED_62",
        NV2080_CTRL_CLK_LEGACY_NON_PRIVILEGED_01 => "NV2080_CTRL_CLK_LEGACY_NON_PRIVILEGED_01",
        NV2080_CTRL_CLK_LEGACY_NON_PRIVILEGED_09 => "NV2080_CTRL_CLK_LEGACY_NON_PRIVILEGED_09",
        NV2080_CTRL_CLK_LEGACY_NON_PRIVILEGED_38 => "NV2080_CTRL_CLK_LEGACY_NON_PRIVILEGED_38",
        NV2080_CTRL_CLK_LEGACY_NON_PRIVILEGED_64 => "NV2080_CTRL_CLK_LEGACY_NON_PRIVILEGED_64",
        NV2080_CTRL_PERF_LEGACY_NON_PRIVILEGED_26 => "NV2080_CTRL_PERF_LEGACY_NON_PRIVILEGED_26",
        NV2080_CTRL_PERF_LEGACY_NON_PRIVILEGED_84 => "NV2080_CTRL_PERF_LEGACY_NON_PRIVILEGED_84",
        NV2080_CTRL_PMGR_LEGACY_NON_PRIVILEGED_12 => "NV2080_CTRL_PMGR_LEGACY_NON_PRIVILEGED_12",
        NV2080_CTRL_PMGR_LEGACY_NON_PRIVILEGED_18 => "NV2080_CTRL_PMGR_LEGACY_NON_PRIVILEGED_18",
        NV2080_CTRL_PMGR_LEGACY_NON_PRIVILEGED_1D => "NV2080_CTRL_PMGR_LEGACY_NON_PRIVILEGED_1D",
        NV2081_BINAPI_CTRL_0108 => "NV2081_BINAPI_CTRL_0108",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ctrl;

    /// The legacy interfaces of `ctrl/ctrl2080/ctrl2080base.h` (580.142; the same at 515.43.04 and
    /// 595.45.04): `NV2080_CTRL_<NAME>` = `NV2080_CTRL_<BASE> | NVxxxx_CTRL_LEGACY_NON_PRIVILEGED` (0x80).
    const LEGACY_INTERFACES: [(&str, u32); 4] = [
        ("GPU_LEGACY_NON_PRIVILEGED", 0x81),
        ("CLK_LEGACY_NON_PRIVILEGED", 0x90),
        ("PERF_LEGACY_NON_PRIVILEGED", 0xa0),
        ("PMGR_LEGACY_NON_PRIVILEGED", 0xa6),
    ];

    /// A GSS-legacy name says its command: `NV2080_CTRL_<interface>_<message id in hex>`.
    #[test]
    fn a_legacy_name_spells_its_interface_and_message() {
        let mut legacy = 0;
        for cmd in ALL.into_iter().filter(|&c| is_gss_legacy(c)) {
            let n = name(cmd).unwrap();
            let rest = n.strip_prefix("NV2080_CTRL_").expect(n);
            let (interface, message) = rest.rsplit_once('_').expect(n);
            let (_, byte) = LEGACY_INTERFACES
                .into_iter()
                .find(|(i, _)| *i == interface)
                .unwrap_or_else(|| panic!("{n}: not a legacy interface of ctrl2080base.h"));
            assert_eq!((cmd >> 8) & 0xff, byte, "{n}");
            assert_eq!(u32::from_str_radix(message, 16), Ok(cmd & 0xff), "{n}");
            assert_eq!(ctrl::class_of(cmd), crate::class::NV20_SUBDEVICE_0, "{n}");
            legacy += 1;
        }
        assert_eq!(legacy, 11);
        assert!(!is_gss_legacy(
            NV2080_CTRL_CMD_GPU_ACQUIRE_COMPUTE_MODE_RESERVATION
        ));
        assert_eq!(
            ctrl::class_of(NV2081_BINAPI_CTRL_0108),
            crate::class::NV2081_BINAPI
        );
    }

    /// The 13 commands /work/shared/gpu/580.159.04/README.md lists as not named, named now for 580.159.04
    /// and every other supported driver.
    #[test]
    fn the_commands_the_h200_showed_unnamed_have_names() {
        for cmd in [
            0x20800145, 0x20808159, 0x20808162, 0x20809001, 0x20809009, 0x20809038, 0x20809064,
            0x2080a026, 0x2080a084, 0x20810108, 0x2080a612, 0x2080a618, 0x2080a61d,
        ] {
            for v in [(515, 43, 4), (570, 86, 15), (580, 159, 4), (595, 45, 4)] {
                let v = crate::layout::DriverVersion::new(v.0, v.1, v.2);
                assert!(ctrl::name_for(cmd, v).is_some(), "{cmd:#x} at {v}");
            }
        }
        assert_eq!(
            ctrl::name(0x20800145),
            Some("NV2080_CTRL_CMD_GPU_ACQUIRE_COMPUTE_MODE_RESERVATION")
        );
    }

    #[test]
    fn no_command_here_is_also_in_the_published_list() {
        for cmd in ALL {
            assert!(!ctrl::ALL.contains(&cmd), "{cmd:#x}");
        }
    }
}
