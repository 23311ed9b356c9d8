//! The "weights" a mock trainer keeps in device memory: a real host buffer filled from a seed, with a
//! CRC-32 taken at startup. A checkpoint moves it to a host save copy and drops the device copy; a restore
//! copies it back and checks the CRC, so a restore that lost or changed data shows.

/// The seed `baton-mock-cuda` fills its weights from.
pub const DEFAULT_SEED: u32 = 0x5eed;

/// Bytes of weights.
pub const WEIGHTS_BYTES: usize = 1024 * 1024;

/// The weights and where they are.
#[derive(Debug)]
pub struct Weights {
    device: Option<Vec<u8>>,
    host_save: Option<Vec<u8>>,
    checksum: u32,
}

/// A restore found different weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("restored checksum MISMATCH: expected {expected:#010x}, got {got:#010x}")]
pub struct Mismatch {
    /// The checksum at startup.
    pub expected: u32,
    /// The checksum of what came back (0 when nothing was saved).
    pub got: u32,
}

impl Weights {
    /// [`WEIGHTS_BYTES`] of weights derived from `seed`, "on the device".
    pub fn new(seed: u32) -> Self {
        let device: Vec<u8> = (0..WEIGHTS_BYTES as u32)
            .map(|i| (i.wrapping_mul(0x9e37_79b1).wrapping_add(seed) >> 24) as u8)
            .collect();
        let checksum = crc32fast::hash(&device);
        Self {
            device: Some(device),
            host_save: None,
            checksum,
        }
    }

    /// The checksum taken at startup.
    pub fn checksum(&self) -> u32 {
        self.checksum
    }

    /// Copies the device weights to the host save and drops the device copy.
    pub fn save_to_host(&mut self) {
        if let Some(device) = self.device.take() {
            self.host_save = Some(device.clone());
        }
    }

    /// Copies the host save back to the device and checks it; returns the checksum when intact.
    pub fn restore_from_host(&mut self) -> Result<u32, Mismatch> {
        let restored = self.host_save.take().unwrap_or_default();
        let got = crc32fast::hash(&restored);
        self.device = Some(restored);
        if got == self.checksum {
            Ok(got)
        } else {
            Err(Mismatch {
                expected: self.checksum,
                got,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_save_and_restore_keeps_the_checksum() {
        let mut weights = Weights::new(7);
        weights.save_to_host();
        assert!(weights.device.is_none(), "the device copy is dropped");
        assert_eq!(weights.restore_from_host(), Ok(weights.checksum()));
    }

    #[test]
    fn a_restore_without_a_save_is_a_mismatch() {
        let mut weights = Weights::new(7);
        weights.device = None;
        assert!(weights.restore_from_host().is_err());
    }
}
