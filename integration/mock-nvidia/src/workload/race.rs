//! A tenant that rewrites its own RM params after the driver answered: while one thread makes the calls,
//! a second one watches each call's status field and, once the driver has written it (the copy-out), rewrites
//! the params before the syscall's exit, where the probes read them. The status is the only word of the
//! driver's answer a tracer on a kernel without kprobes can read, and it lives in the caller's memory
//! (/work/shared/reference/machine.md; nvidia-driver.md section 2).
//!
//! - [`race_allocs`]: N video-memory allocations (RM_ALLOC, NVOS21) the driver makes, each rewritten to read
//!   as refused (`NV_ERR_INSUFFICIENT_RESOURCES`) and, with `shrink`, its memory-allocation params' size to 0.
//! - [`race_frees`]: N RM_FREEs of handles that do not exist, which the driver refuses, each rewritten to
//!   read as an NV_OK free of one of the live allocations.
//!
//! The watcher spins until it has rewritten every call (each once), so the counts it returns are exact;
//! whether the exit's read came before or after a rewrite is the race itself.
use std::{
    os::fd::RawFd,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicU32, Ordering},
    },
};

use baton_nvidia::{class, escape, ioc, layout::Layout, params, status};

use super::WorkloadError;

/// What the params' status word holds until the driver writes its answer over it.
const UNANSWERED: u32 = 0xffff_ffff;

/// The handle of the `i`-th racing allocation (`RA` + i).
pub fn race_handle(i: u32) -> u32 {
    0x5241_0000 + i
}

/// The handle each racing free names at first: nothing has it (`FR` + i).
fn bogus_handle(i: u32) -> u32 {
    0x4652_0000 + i
}

/// Params structs of one kind, `n` of them, as 32-bit words the kernel and the watcher may both write.
struct Slots {
    words: Box<[AtomicU32]>,
    stride: usize,
}

impl Slots {
    fn new(n: usize, bytes: u32) -> Self {
        let stride = bytes as usize / 4;
        Self {
            words: (0..n * stride).map(|_| AtomicU32::new(0)).collect(),
            stride,
        }
    }

    fn word(&self, slot: usize, offset: u32) -> &AtomicU32 {
        &self.words[slot * self.stride + offset as usize / 4]
    }

    fn set_u64(&self, slot: usize, offset: u32, value: u64) {
        self.word(slot, offset)
            .store(value as u32, Ordering::SeqCst);
        self.word(slot, offset + 4)
            .store((value >> 32) as u32, Ordering::SeqCst);
    }

    fn ptr(&self, slot: usize) -> *mut u8 {
        self.words[slot * self.stride..].as_ptr().cast_mut().cast()
    }
}

/// Sends escape `nr` on `fd` with the params in `slots`' slot `slot`.
fn send(fd: RawFd, nr: u32, slots: &Slots, slot: usize) -> Result<(), WorkloadError> {
    let cmd = ioc::iowr(ioc::NV_IOCTL_MAGIC, nr, (slots.stride * 4) as u32);
    // SAFETY: the slot is `stride * 4` live bytes, the size the command encodes; its words are atomics, so
    // the kernel's copy-out and the watcher's writes are both plain stores to memory that allows them.
    let r = unsafe { libc::ioctl(fd, cmd as libc::Ioctl, slots.ptr(slot)) };
    if r < 0 {
        return Err(WorkloadError::Ioctl {
            path: format!("fd {fd}").into(),
            call: escape::name(nr).unwrap_or("escape").to_owned(),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// Runs `calls` calls (`call(i)`) while a second thread applies `rewrite(i)` once to each call whose status
/// word (`status(i)`) the driver has answered; returns how many were rewritten (all, once the calls end).
fn race(
    count: usize,
    status: impl Fn(usize) -> u32 + Send + 'static,
    rewrite: impl Fn(usize) + Send + 'static,
    mut call: impl FnMut(usize) -> Result<(), WorkloadError>,
) -> Result<u64, WorkloadError> {
    let stop = Arc::new(AtomicBool::new(false));
    // The caller on the first CPU it may use, the watcher on another where there is one: the watcher then
    // spins beside the call instead of waiting for the caller's CPU (best effort: the rewrite is a race).
    let before = affinity();
    let cpus = before.as_ref().map(cpus_of).unwrap_or_default();
    pin_to(cpus.first().copied());
    let watcher = {
        let stop = Arc::clone(&stop);
        let other = cpus.get(1).copied();
        std::thread::spawn(move || {
            pin_to(other);
            let mut done = vec![false; count];
            let mut rewritten = 0u64;
            loop {
                // Read `stop` first: a pass after every call returned sees each answer.
                let last = stop.load(Ordering::SeqCst);
                for (i, d) in done.iter_mut().enumerate() {
                    if !*d && status(i) != UNANSWERED {
                        rewrite(i);
                        *d = true;
                        rewritten += 1;
                    }
                }
                if last {
                    return rewritten;
                }
                std::hint::spin_loop();
            }
        })
    };
    let result = (0..count).try_for_each(&mut call);
    stop.store(true, Ordering::SeqCst);
    let rewritten = watcher.join().unwrap_or(0);
    if let Some(set) = before {
        set_affinity(&set);
    }
    result.map(|()| rewritten)
}

/// The calling thread's CPU set.
fn affinity() -> Option<libc::cpu_set_t> {
    // SAFETY: `cpu_set_t` is plain data for which all zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a live cpu_set_t of the size passed; pid 0 is the calling thread.
    let r = unsafe { libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut set) };
    (r == 0).then_some(set)
}

/// Sets the calling thread's CPU set (errors are ignored: pinning only helps the race).
fn set_affinity(set: &libc::cpu_set_t) {
    // SAFETY: `set` is a live cpu_set_t of the size passed; pid 0 is the calling thread.
    let _ = unsafe { libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), set) };
}

/// The CPUs in `set`.
fn cpus_of(set: &libc::cpu_set_t) -> Vec<usize> {
    (0..libc::CPU_SETSIZE as usize)
        // SAFETY: `c` is below CPU_SETSIZE, the set's size.
        .filter(|c| unsafe { libc::CPU_ISSET(*c, set) })
        .collect()
}

/// Pins the calling thread to `cpu`, when there is one.
fn pin_to(cpu: Option<usize>) {
    let Some(cpu) = cpu else {
        return;
    };
    // SAFETY: `cpu_set_t` is plain data for which all zeroes is the empty set; `cpu` comes from
    // `cpus_of`, below CPU_SETSIZE.
    let set = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        set
    };
    set_affinity(&set);
}

/// `count` allocations of `bytes` of video memory under `device` of `client` through ctl file `fd`, at
/// [`race_handle`]`(i)`, each rewritten after the driver's answer to read as refused (and, with `shrink`,
/// as of 0 bytes). Returns how many were rewritten.
pub fn race_allocs(
    fd: RawFd,
    client: u32,
    device: u32,
    count: u32,
    bytes: u64,
    shrink: bool,
) -> Result<u64, WorkloadError> {
    let layout = Layout::DEFAULT;
    let n = count as usize;
    let calls = Arc::new(Slots::new(n, layout.nvos21_size));
    let memory = Arc::new(Slots::new(n, layout.memory_alloc_size));
    for i in 0..n {
        let w = |offset, value| calls.word(i, offset).store(value, Ordering::SeqCst);
        w(params::rm_alloc::H_ROOT_OFFSET, client);
        w(params::rm_alloc::H_OBJECT_PARENT_OFFSET, device);
        w(params::rm_alloc::H_OBJECT_NEW_OFFSET, race_handle(i as u32));
        w(
            params::rm_alloc::H_CLASS_OFFSET,
            class::NV01_MEMORY_LOCAL_USER,
        );
        calls.set_u64(
            i,
            params::rm_alloc::P_ALLOC_PARMS_OFFSET,
            memory.ptr(i) as u64,
        );
        if let Some(offset) = layout.nvos21_params_size {
            w(offset, layout.memory_alloc_size);
        }
        w(layout.nvos21_status, UNANSWERED);
        memory.set_u64(i, params::memory_alloc::SIZE_OFFSET, bytes);
    }
    let status_word = layout.nvos21_status;
    let (c, m) = (Arc::clone(&calls), Arc::clone(&memory));
    let status = move |i| c.word(i, status_word).load(Ordering::SeqCst);
    let c = Arc::clone(&calls);
    let rewrite = move |i| {
        if shrink {
            m.set_u64(i, params::memory_alloc::SIZE_OFFSET, 0);
        }
        c.word(i, status_word)
            .store(status::NV_ERR_INSUFFICIENT_RESOURCES, Ordering::SeqCst);
    };
    race(n, status, rewrite, |i| {
        send(fd, escape::RM_ALLOC, &calls, i)
    })
}

/// `count` RM_FREEs through ctl file `fd` of handles under `device` of `client` that do not exist, each
/// rewritten after the driver's refusal to read as an NV_OK free of [`race_handle`]`(i)`. Returns how many
/// were rewritten.
pub fn race_frees(fd: RawFd, client: u32, device: u32, count: u32) -> Result<u64, WorkloadError> {
    use params::nvos00;
    let n = count as usize;
    let calls = Arc::new(Slots::new(n, nvos00::SIZE));
    for i in 0..n {
        let w = |offset, value| calls.word(i, offset).store(value, Ordering::SeqCst);
        w(nvos00::H_ROOT_OFFSET, client);
        w(nvos00::H_OBJECT_PARENT_OFFSET, device);
        w(nvos00::H_OBJECT_OLD_OFFSET, bogus_handle(i as u32));
        w(nvos00::STATUS_OFFSET, UNANSWERED);
    }
    let c = Arc::clone(&calls);
    let status = move |i| c.word(i, nvos00::STATUS_OFFSET).load(Ordering::SeqCst);
    let c = Arc::clone(&calls);
    let rewrite = move |i: usize| {
        c.word(i, nvos00::H_OBJECT_OLD_OFFSET)
            .store(race_handle(i as u32), Ordering::SeqCst);
        c.word(i, nvos00::STATUS_OFFSET)
            .store(status::NV_OK, Ordering::SeqCst);
    };
    race(n, status, rewrite, |i| send(fd, escape::RM_FREE, &calls, i))
}
