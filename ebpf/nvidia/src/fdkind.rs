//! Which NVIDIA device file a file descriptor refers to: from its character-device numbers (in the
//! kernel) or from its base name (user space, `/proc/<pid>/fd` links).
//!
//! Source: `kernel-open/common/inc/nv-chardev-numbers.h`; the UVM and caps majors are dynamic (read them
//! from `/proc/devices`).

/// Major number of the "nvidia" character devices (nvidiactl, nvidiaN, nvidia-modeset).
pub const NV_MAJOR: u32 = 195;
/// Minor of `/dev/nvidiactl`.
pub const CTL_MINOR: u32 = 255;
/// Minor of `/dev/nvidia-modeset`.
pub const MODESET_MINOR: u32 = 254;
/// Largest minor of a `/dev/nvidiaN` device (N = minor).
pub const MAX_DEVICE_MINOR: u32 = 247;
/// Minor of `/dev/nvidia-uvm` (under the dynamic "nvidia-uvm" major).
pub const UVM_MINOR: u32 = 0;
/// Minor of `/dev/nvidia-uvm-tools` (under the dynamic "nvidia-uvm" major).
pub const UVM_TOOLS_MINOR: u32 = 1;
/// Name of the UVM major in `/proc/devices`.
pub const UVM_DEVICES_NAME: &str = "nvidia-uvm";
/// Name of the capabilities major in `/proc/devices`.
pub const CAPS_DEVICES_NAME: &str = "nvidia-caps";

/// The kind of NVIDIA device file behind a file descriptor.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(feature = "std", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "std", serde(rename_all = "kebab-case"))]
pub enum FdKind {
    /// Not an NVIDIA file, or not known.
    Unknown = 0,
    /// `/dev/nvidiactl`.
    Ctl = 1,
    /// `/dev/nvidiaN` (the minor is N).
    Device = 2,
    /// `/dev/nvidia-uvm`.
    Uvm = 3,
    /// `/dev/nvidia-uvm-tools`.
    UvmTools = 4,
    /// `/dev/nvidia-modeset`.
    Modeset = 5,
    /// `/dev/nvidia-caps/nvidia-capN`.
    Caps = 6,
}

impl FdKind {
    /// Whether a file of this kind can carry GPU state: RM clients live on ctl and device files, UVM state on
    /// UVM files. A capability file (`/dev/nvidia-caps/nvidia-capN`) carries none: CUDA opens the MIG
    /// capabilities (cap1, cap2) at init and keeps them open; the driver only checks them when an object is
    /// allocated (recorded on the H200: /work/shared/gpu/580.159.04/README.md, device numbers 241:1 and
    /// 241:2, inherited by a forked worker with the rest). So holding one is not holding the GPU.
    #[inline(always)]
    pub const fn carries_gpu_state(self) -> bool {
        !matches!(self, FdKind::Caps | FdKind::Unknown)
    }

    /// The kind stored as `v` (inverse of `as u8`); unknown values map to [`FdKind::Unknown`].
    #[inline(always)]
    pub const fn from_u8(v: u8) -> FdKind {
        match v {
            1 => FdKind::Ctl,
            2 => FdKind::Device,
            3 => FdKind::Uvm,
            4 => FdKind::UvmTools,
            5 => FdKind::Modeset,
            6 => FdKind::Caps,
            _ => FdKind::Unknown,
        }
    }

    /// Short name of the kind: "unknown", "ctl", "device", "uvm", "uvm-tools", "modeset", "caps".
    pub const fn name(self) -> &'static str {
        match self {
            FdKind::Unknown => "unknown",
            FdKind::Ctl => "ctl",
            FdKind::Device => "device",
            FdKind::Uvm => "uvm",
            FdKind::UvmTools => "uvm-tools",
            FdKind::Modeset => "modeset",
            FdKind::Caps => "caps",
        }
    }

    /// Whether ioctls on this kind are frontend escapes (`_IOC`-encoded, magic 'F').
    #[inline(always)]
    pub const fn is_frontend(self) -> bool {
        matches!(self, FdKind::Ctl | FdKind::Device)
    }

    /// Whether ioctls on this kind are UVM commands (bare numbers).
    #[inline(always)]
    pub const fn is_uvm(self) -> bool {
        matches!(self, FdKind::Uvm | FdKind::UvmTools)
    }
}

/// The device file's base name for `kind` and `minor`: "nvidiactl", "nvidia0", "nvidia-uvm",
/// "nvidia-uvm-tools", "nvidia-modeset", "nvidia-cap3", or "unknown".
#[cfg(feature = "std")]
pub fn label(kind: FdKind, minor: u8) -> String {
    match kind {
        FdKind::Device => format!("nvidia{minor}"),
        FdKind::Caps => format!("nvidia-cap{minor}"),
        FdKind::Ctl => "nvidiactl".to_owned(),
        FdKind::Uvm => "nvidia-uvm".to_owned(),
        FdKind::UvmTools => "nvidia-uvm-tools".to_owned(),
        FdKind::Modeset => "nvidia-modeset".to_owned(),
        FdKind::Unknown => "unknown".to_owned(),
    }
}

/// Classifies a character device by its numbers. `uvm_major` is the dynamic "nvidia-uvm" major from
/// `/proc/devices` (0 when unknown). Returns the kind and the minor (N for nvidiaN).
#[inline(always)]
pub const fn classify_chrdev(major: u32, minor: u32, uvm_major: u32) -> Option<(FdKind, u8)> {
    if major == NV_MAJOR {
        return match minor {
            CTL_MINOR => Some((FdKind::Ctl, CTL_MINOR as u8)),
            MODESET_MINOR => Some((FdKind::Modeset, MODESET_MINOR as u8)),
            0..=MAX_DEVICE_MINOR => Some((FdKind::Device, minor as u8)),
            _ => None,
        };
    }
    if uvm_major != 0 && major == uvm_major {
        return match minor {
            UVM_MINOR => Some((FdKind::Uvm, 0)),
            UVM_TOOLS_MINOR => Some((FdKind::UvmTools, 1)),
            _ => None,
        };
    }
    None
}

/// Parses a decimal number of 1..=3 digits without leading zeros (except "0") that fits in `max`.
const fn parse_small_decimal(digits: &[u8], max: u32) -> Option<u8> {
    let n = digits.len();
    if n == 0 || n > 3 || (n > 1 && digits[0] == b'0') {
        return None;
    }
    let mut value: u32 = 0;
    let mut i = 0;
    while i < n && i < 3 {
        let d = digits[i];
        if !d.is_ascii_digit() {
            return None;
        }
        value = value * 10 + (d - b'0') as u32;
        i += 1;
    }
    if value > max {
        return None;
    }
    Some(value as u8)
}

/// `name` without `prefix` when it starts with it.
const fn strip_prefix<'a>(name: &'a [u8], prefix: &[u8]) -> Option<&'a [u8]> {
    if name.len() < prefix.len() {
        return None;
    }
    let mut i = 0;
    while i < prefix.len() {
        if name[i] != prefix[i] {
            return None;
        }
        i += 1;
    }
    Some(name.split_at(prefix.len()).1)
}

/// Byte-wise equality usable in `const fn`.
const fn bytes_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// Classifies a device file by its base name: "nvidiactl", "nvidia0".."nvidia247", "nvidia-uvm",
/// "nvidia-uvm-tools", "nvidia-modeset", "nvidia-cap0".."nvidia-cap255". Returns the kind and the minor
/// (N for nvidiaN and nvidia-capN, the fixed minor otherwise). Bounded loops only; any other input
/// (including caps numbers above 255) gives `None`.
pub const fn classify_name(name: &[u8]) -> Option<(FdKind, u8)> {
    if bytes_eq(name, b"nvidiactl") {
        return Some((FdKind::Ctl, CTL_MINOR as u8));
    }
    if bytes_eq(name, b"nvidia-modeset") {
        return Some((FdKind::Modeset, MODESET_MINOR as u8));
    }
    if bytes_eq(name, b"nvidia-uvm") {
        return Some((FdKind::Uvm, UVM_MINOR as u8));
    }
    if bytes_eq(name, b"nvidia-uvm-tools") {
        return Some((FdKind::UvmTools, UVM_TOOLS_MINOR as u8));
    }
    if let Some(rest) = strip_prefix(name, b"nvidia-cap") {
        return match parse_small_decimal(rest, 255) {
            Some(n) => Some((FdKind::Caps, n)),
            None => None,
        };
    }
    if let Some(rest) = strip_prefix(name, b"nvidia") {
        return match parse_small_decimal(rest, MAX_DEVICE_MINOR) {
            Some(n) => Some((FdKind::Device, n)),
            None => None,
        };
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capability_files_carry_no_gpu_state() {
        assert!(!FdKind::Caps.carries_gpu_state());
        assert!(FdKind::Ctl.carries_gpu_state() && FdKind::Device.carries_gpu_state());
        assert!(FdKind::Uvm.carries_gpu_state());
    }
    use proptest::prelude::*;

    #[test]
    fn names() {
        assert_eq!(classify_name(b"nvidiactl"), Some((FdKind::Ctl, 255)));
        assert_eq!(classify_name(b"nvidia0"), Some((FdKind::Device, 0)));
        assert_eq!(classify_name(b"nvidia247"), Some((FdKind::Device, 247)));
        assert_eq!(classify_name(b"nvidia248"), None);
        assert_eq!(classify_name(b"nvidia01"), None);
        assert_eq!(classify_name(b"nvidia"), None);
        assert_eq!(classify_name(b"nvidia-uvm"), Some((FdKind::Uvm, 0)));
        assert_eq!(
            classify_name(b"nvidia-uvm-tools"),
            Some((FdKind::UvmTools, 1))
        );
        assert_eq!(
            classify_name(b"nvidia-modeset"),
            Some((FdKind::Modeset, 254))
        );
        assert_eq!(classify_name(b"nvidia-cap3"), Some((FdKind::Caps, 3)));
        assert_eq!(classify_name(b"nvidia-cap256"), None);
        assert_eq!(classify_name(b"nvidia-caps"), None);
        assert_eq!(classify_name(b""), None);
    }

    #[test]
    fn labels_round_trip() {
        for (kind, minor) in [
            (FdKind::Ctl, 255),
            (FdKind::Device, 7),
            (FdKind::Uvm, 0),
            (FdKind::UvmTools, 1),
            (FdKind::Modeset, 254),
            (FdKind::Caps, 12),
        ] {
            assert_eq!(
                classify_name(label(kind, minor).as_bytes()),
                Some((kind, minor))
            );
            assert_eq!(FdKind::from_u8(kind as u8), kind);
        }
        assert_eq!(FdKind::from_u8(99), FdKind::Unknown);
    }

    #[test]
    fn chrdevs() {
        assert_eq!(classify_chrdev(195, 255, 0), Some((FdKind::Ctl, 255)));
        assert_eq!(classify_chrdev(195, 3, 0), Some((FdKind::Device, 3)));
        assert_eq!(classify_chrdev(195, 250, 0), None);
        assert_eq!(classify_chrdev(508, 0, 508), Some((FdKind::Uvm, 0)));
        assert_eq!(classify_chrdev(508, 1, 508), Some((FdKind::UvmTools, 1)));
        assert_eq!(classify_chrdev(508, 0, 0), None);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        #[test]
        fn classify_name_never_panics(name in proptest::collection::vec(any::<u8>(), 0..24)) {
            if let Some((kind, minor)) = classify_name(&name) {
                let expected = label(kind, minor);
                prop_assert_eq!(expected.as_bytes(), &name[..]);
            }
        }

        #[test]
        fn classify_nvidia_like_names(n in 0u32..1000, caps in any::<bool>()) {
            let name = if caps { format!("nvidia-cap{n}") } else { format!("nvidia{n}") };
            let got = classify_name(name.as_bytes());
            let max = if caps { 255 } else { 247 };
            prop_assert_eq!(got.is_some(), n <= max);
        }
    }
}
