//! The copy of device memory a checkpoint keeps until the restore, in the parked process's own memory:
//! allocated and written (every page touched) as the copy goes, so that it is charged to the process and
//! to its memory cgroup. On the H200 a holder of 4 GiB of VRAM in a cgroup with memory.max 2 GiB got
//! CUDA error 304 from the checkpoint and the kernel OOM-killed it (/work/shared/gpu/580.159.04/README.md,
//! "Memory cgroups"); here a memory limit below the copy makes the kernel kill the process the same way.
//! An allocation that fails outright is an error naming the size, never hidden.

use std::collections::TryReserveError;

use super::control::OPERATING_SYSTEM;

/// The byte the copy is written with (any non-zero byte: every page is really written).
const PATTERN: u8 = 0xa5;

/// Host memory holding a checkpoint's copy of device memory.
#[derive(Debug)]
pub struct HostCopy {
    bytes: Vec<u8>,
    size: usize,
}

/// The host memory for the copy could not be allocated.
#[derive(Debug, thiserror::Error)]
#[error(
    "{OPERATING_SYSTEM}: cannot allocate {size} bytes of host memory for the copy of device memory: \
     {source} (give the container more memory, or hold less video memory)"
)]
pub struct HostCopyError {
    /// The bytes asked for.
    pub size: usize,
    /// Why the allocator refused.
    pub source: TryReserveError,
}

impl HostCopy {
    /// Reserves `size` bytes (nothing is written yet, so nothing is charged yet).
    pub fn allocate(size: usize) -> Result<Self, HostCopyError> {
        let mut bytes = Vec::new();
        bytes
            .try_reserve_exact(size)
            .map_err(|source| HostCopyError { size, source })?;
        Ok(Self { bytes, size })
    }

    /// Writes the copy up to `done` of its bytes (at most its size), touching every page up to there.
    pub fn fill_to(&mut self, done: usize) {
        let done = done.min(self.size);
        let have = self.bytes.len();
        if done <= have {
            return;
        }
        // A memset, not a byte loop: a debug build (tests, the demo) writes gigabytes in a moment this way.
        // SAFETY: `try_reserve_exact(size)` made room for `size >= done` bytes, so `[have, done)` is inside
        // the allocation; `write_bytes` initialises exactly those bytes before `set_len` exposes them.
        unsafe {
            std::ptr::write_bytes(self.bytes.as_mut_ptr().add(have), PATTERN, done - have);
            self.bytes.set_len(done);
        }
    }

    /// Bytes written so far.
    pub fn written(&self) -> usize {
        self.bytes.len()
    }

    /// Bytes the whole copy takes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Whether the written bytes still hold what was written (what a restore copies back): one byte of every
    /// page, and the last one, are looked at.
    pub fn intact(&self) -> bool {
        self.bytes.iter().step_by(4096).all(|byte| *byte == PATTERN)
            && self.bytes.last().is_none_or(|byte| *byte == PATTERN)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_copy_is_written_as_it_goes_and_never_past_its_size() {
        let mut copy = HostCopy::allocate(3 * 4096).expect("12 KiB");
        assert_eq!(copy.written(), 0);
        copy.fill_to(4096);
        assert_eq!(copy.written(), 4096);
        copy.fill_to(1 << 20);
        assert_eq!((copy.written(), copy.size()), (3 * 4096, 3 * 4096));
        assert!(copy.intact());
    }

    #[test]
    fn an_allocation_that_cannot_be_made_says_so() {
        let error = HostCopy::allocate(usize::MAX).expect_err("no machine has that much");
        let message = error.to_string();
        assert!(message.starts_with(OPERATING_SYSTEM), "{message}");
        assert!(message.contains(&usize::MAX.to_string()), "{message}");
    }
}
