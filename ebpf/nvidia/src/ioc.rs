//! Linux `_IOC` command-number encoding as used by the NVIDIA frontend (`/dev/nvidiactl`, `/dev/nvidiaN`).
//!
//! The Linux driver (`nvidia_ioctl` in `kernel-open/nvidia/nv.c`) never looks at `_IOC_TYPE` nor at the
//! direction bits: it dispatches on `_IOC_NR` alone and copies `_IOC_SIZE` bytes, so a command with
//! another type but an escape's number runs as that escape. (Only the FreeBSD and Solaris frontends answer
//! ENOTTY to a type other than `'F'`.) Up to 590.x a wrong size reaches RM, which answers in the params'
//! status; from 595.44.02 (`nv_validate_ioctls`) an unknown number or a size that is not the escape's
//! fails with -EINVAL before RM sees the call: see [`crate::layout::Layout::accepts_escape`].
//! UVM commands (`/dev/nvidia-uvm`) are *not* encoded this way: see [`crate::uvm`].

/// Ioctl type ("magic") of the NVIDIA frontend: `'F'` (0x46).
pub const NV_IOCTL_MAGIC: u8 = b'F';

/// Bits of the number field.
pub const NRBITS: u32 = 8;
/// Bits of the type field.
pub const TYPEBITS: u32 = 8;
/// Bits of the size field (14 on x86_64 and arm64).
pub const SIZEBITS: u32 = 14;
/// Bits of the direction field.
pub const DIRBITS: u32 = 2;

/// Shift of the number field.
pub const NRSHIFT: u32 = 0;
/// Shift of the type field.
pub const TYPESHIFT: u32 = NRSHIFT + NRBITS;
/// Shift of the size field.
pub const SIZESHIFT: u32 = TYPESHIFT + TYPEBITS;
/// Shift of the direction field.
pub const DIRSHIFT: u32 = SIZESHIFT + SIZEBITS;

/// Direction: no data.
pub const DIR_NONE: u32 = 0;
/// Direction: user writes (kernel reads).
pub const DIR_WRITE: u32 = 1;
/// Direction: user reads (kernel writes).
pub const DIR_READ: u32 = 2;

/// Largest size the 14-bit size field can carry.
pub const SIZE_MAX: u32 = (1 << SIZEBITS) - 1;

/// `_IOC_NR(cmd)`: the escape number (bits 7:0).
#[inline(always)]
pub const fn nr(cmd: u32) -> u32 {
    (cmd >> NRSHIFT) & ((1 << NRBITS) - 1)
}

/// `_IOC_TYPE(cmd)`: the magic (bits 15:8); `'F'` for NVIDIA.
#[inline(always)]
pub const fn type_(cmd: u32) -> u32 {
    (cmd >> TYPESHIFT) & ((1 << TYPEBITS) - 1)
}

/// `_IOC_SIZE(cmd)`: the params size (bits 29:16, 14 bits).
#[inline(always)]
pub const fn size(cmd: u32) -> u32 {
    (cmd >> SIZESHIFT) & SIZE_MAX
}

/// `_IOC_DIR(cmd)`: the direction bits (31:30).
#[inline(always)]
pub const fn dir(cmd: u32) -> u32 {
    (cmd >> DIRSHIFT) & ((1 << DIRBITS) - 1)
}

/// `_IOC(dir, magic, nr, size)`; `size` is truncated to 14 bits, `nr` to 8.
#[inline(always)]
pub const fn ioc(dir: u32, magic: u8, nr: u32, size: u32) -> u32 {
    ((dir & ((1 << DIRBITS) - 1)) << DIRSHIFT)
        | ((magic as u32) << TYPESHIFT)
        | ((nr & ((1 << NRBITS) - 1)) << NRSHIFT)
        | ((size & SIZE_MAX) << SIZESHIFT)
}

/// `_IOWR(magic, nr, size)`: what user space sends for every NVIDIA frontend escape.
#[inline(always)]
pub const fn iowr(magic: u8, nr: u32, size: u32) -> u32 {
    ioc(DIR_READ | DIR_WRITE, magic, nr, size)
}

/// Whether `cmd` carries the NVIDIA magic `'F'`, as NVIDIA's user space always sends it. The driver does
/// not check it (see the module doc); it only tells a frontend escape from a UVM command on an fd of
/// unknown kind.
#[inline(always)]
pub const fn is_nvidia(cmd: u32) -> bool {
    type_(cmd) == NV_IOCTL_MAGIC as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_like_linux() {
        // Values seen from CUDA on 595 (reference md).
        assert_eq!(iowr(NV_IOCTL_MAGIC, 0x29, 16), 0xc010_4629);
        assert_eq!(iowr(NV_IOCTL_MAGIC, 0x2a, 32), 0xc020_462a);
        assert_eq!(iowr(NV_IOCTL_MAGIC, 0x2b, 48), 0xc030_462b);
        assert_eq!(iowr(NV_IOCTL_MAGIC, 0x4e, 56), 0xc038_464e);
    }

    #[test]
    fn splits_fields() {
        let cmd = iowr(NV_IOCTL_MAGIC, 211, 16);
        assert_eq!(nr(cmd), 211);
        assert_eq!(size(cmd), 16);
        assert_eq!(type_(cmd), u32::from(b'F'));
        assert_eq!(dir(cmd), DIR_READ | DIR_WRITE);
        assert!(is_nvidia(cmd));
        assert_eq!(size(iowr(NV_IOCTL_MAGIC, 1, SIZE_MAX)), SIZE_MAX);
    }
}
