//! Little-endian field access at byte offsets of an ioctl params buffer (x86_64 layout), shared by the
//! mock driver (decoding what arrives through FUSE) and the mock workload (encoding what it sends).
//! Offsets come from `baton-nvidia`; out-of-range accesses read as `None` and write nothing.

/// The `u32` at `offset`, if the buffer holds it.
pub fn get_u32(buf: &[u8], offset: u32) -> Option<u32> {
    let start = usize::try_from(offset).ok()?;
    let bytes = buf.get(start..start.checked_add(4)?)?;
    Some(u32::from_le_bytes(bytes.try_into().ok()?))
}

/// The `u64` at `offset`, if the buffer holds it.
pub fn get_u64(buf: &[u8], offset: u32) -> Option<u64> {
    let start = usize::try_from(offset).ok()?;
    let bytes = buf.get(start..start.checked_add(8)?)?;
    Some(u64::from_le_bytes(bytes.try_into().ok()?))
}

/// Writes `bytes` at `offset`; returns whether the buffer was long enough.
pub fn put_bytes(buf: &mut [u8], offset: u32, bytes: &[u8]) -> bool {
    let Ok(start) = usize::try_from(offset) else {
        return false;
    };
    let Some(end) = start.checked_add(bytes.len()) else {
        return false;
    };
    match buf.get_mut(start..end) {
        Some(slot) => {
            slot.copy_from_slice(bytes);
            true
        }
        None => false,
    }
}

/// Writes a `u32` at `offset`; returns whether the buffer was long enough.
pub fn put_u32(buf: &mut [u8], offset: u32, value: u32) -> bool {
    put_bytes(buf, offset, &value.to_le_bytes())
}

/// Writes a `u64` at `offset`; returns whether the buffer was long enough.
pub fn put_u64(buf: &mut [u8], offset: u32, value: u64) -> bool {
    put_bytes(buf, offset, &value.to_le_bytes())
}

/// Writes a `u16` at `offset`; returns whether the buffer was long enough.
pub fn put_u16(buf: &mut [u8], offset: u32, value: u16) -> bool {
    put_bytes(buf, offset, &value.to_le_bytes())
}

/// Writes a `u8` at `offset`; returns whether the buffer was long enough.
pub fn put_u8(buf: &mut [u8], offset: u32, value: u8) -> bool {
    put_bytes(buf, offset, &[value])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_refuses_out_of_range() {
        let mut buf = [0u8; 12];
        assert!(put_u32(&mut buf, 0, 0xdead_beef));
        assert!(put_u64(&mut buf, 4, 0x0102_0304_0506_0708));
        assert_eq!(get_u32(&buf, 0), Some(0xdead_beef));
        assert_eq!(get_u64(&buf, 4), Some(0x0102_0304_0506_0708));
        assert_eq!(buf[4], 0x08, "little endian");
        assert!(!put_u32(&mut buf, 10, 1));
        assert_eq!(get_u32(&buf, 9), None);
        assert_eq!(get_u64(&buf, u32::MAX), None);
    }
}
