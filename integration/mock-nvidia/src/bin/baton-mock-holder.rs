//! `baton-mock-holder`: a scripted holder of NVIDIA device files, for tests of the release signal. It reads
//! one command per line on stdin and answers `ok ...` or `err ...` on stdout. Times (`T`) are
//! CLOCK_MONOTONIC ns taken right after the call returned to user space.
//!
//! Commands: `open NAME` (close-on-exec, as CUDA opens) and `open-inherit NAME` -> `ok FD`; `alloc FD [MIB]`
//! (an RM root client on nvidiactl with a device and MIB (1) MiB of video memory: GPU state) and `alloc-client FD`
//! (a client alone: handles only) -> `ok HANDLE STATUS`; `free-client FD HANDLE` -> `ok STATUS T`; `mmap FD`
//! and `map FD PAGES` -> `ok ADDR`; `over-anon ADDR PAGES` (an anonymous PROT_NONE MAP_FIXED over it, as
//! the real driver's checkpoint does) and `over-memfd ADDR PAGES` -> `ok T`; `unmap ADDR PAGES` -> `ok T`;
//! `mremap ADDR OLD NEW [move]` -> `ok NEWADDR T`; `shm-over ADDR PAGES` (a SysV segment attached with
//! SHM_REMAP over it, which the probes do not see) -> `ok T`; `dontfork ADDR PAGES` -> `ok`; `munmap ADDR`,
//! `close FD`, `close-range FIRST LAST`, `dup2 OLD NEW` -> `ok T`; `dup FD` -> `ok NEWFD`; `fork` (a child
//! that keeps every inherited fd and waits) -> `ok PID`; `child-exit PID` -> `ok`; `thread-close FD` (a new
//! thread closes FD, then spins in user space with no syscall until `stop-spin`) -> `ok T`; `threads N`
//! (N parked threads) -> `ok`; `exec` (re-executes itself: close-on-exec fds go) -> `ok T` from the new
//! program; `forge FD` (fakes a successful RM_FREE of its client in params the driver refuses, unmaps an
//! anonymous mapping, closes a non-NVIDIA fd) -> `ok`; `stamp` -> `ok T`; `exit CODE`; `openat2 NAME` ->
//! `ok FD`; `flash-threads N` (N threads that exit at once, one after the other) -> `ok`; `flood FD N` (N
//! ioctls), `flood-dup FD N` (N dups of FD, each closed) -> `ok`; `keep-dups FD N` (raises RLIMIT_NOFILE
//! as far as it may, then keeps N dups of FD, as a tenant filling the probes' fd map would) -> `ok KEPT`; `reuse-dup FIRST THEN ROUNDS KEEP` (each
//! round opens and closes FIRST, opens THEN under the same number, keeps KEEP dups of it) -> `ok KEPT`; `fork-receiver` (a child forked before
//! any open, driven over a socket pair: `workload::receiver`) -> `ok PID`; `send-fd PID FD` (FD passed to it
//! with SCM_RIGHTS) -> `ok N`; `child-open PID NAME` and `child-open-state PID NAME` (GPU state allocated through it, as
//! `alloc` does) -> `ok FD` (of the child); `child-close PID` (the child
//! closes all it holds) -> `ok T`; `grab-fd PID FD` (pidfd_getfd of the child's FD) -> `ok NEWFD`; `ring-file FD`
//! (FD registered as a fixed file of a new io_uring) -> `ok RINGFD`; `clone-files` (a receiver child that
//! shares this process's fd table) -> `ok PID`; `child-exit-now PID` (the child exits, reaped) -> `ok T`; `exec-map PATH` (re-executes; the new program maps PATH before anything else) ->
//! `ok T ADDR`; `map-below ADDR HEXNAME` (creates /tmp/NAME, NAME the bytes HEXNAME spells, which need not be
//! UTF-8, and maps it shared at the lowest free address from 256 MiB up, below ADDR) -> `ok ADDR`; `anon-maps N` (N anonymous mappings of its own that do not merge, as a tenant with a
//! long /proc maps has; needs `vm.max_map_count` above N) -> `ok LINES` (of its maps now); `munmap-raw ADDR
//! LEN` (munmap of LEN bytes, failing or not) -> `ok ERRNO T` (0: it succeeded); `ioctl-threads FD N` (N more
//! threads that make RM_CONTROL calls on FD back to back, as a tenant's busy threads would) -> `ok`, and
//! `stop-ioctl-threads` (they end) -> `ok CALLS`; `callers TAG N` (N more parked threads in group TAG, made
//! one after the other) -> `ok`, `go TAG ioctl FD` or `go TAG map FD` (each makes that one call, a mapping
//! of a page kept; answered once each is inside it or past it) -> `ok INSIDE`, `join TAG` -> `ok MAPPED`;
//! `close-async FD` (a thread closes FD; answered once it is inside the close) -> `ok` (see
//! `workload::callers`); `race-alloc FD N
//! KIB` (a client and a device on FD, then N allocations of KIB KiB of video memory while a second thread
//! rewrites each, once the driver answered, to read as refused and of 0 bytes: `workload::race`) -> `ok
//! CLIENT DEVICE REWRITTEN`; `race-free FD CLIENT DEVICE N` (N refused frees rewritten to read as NV_OK
//! frees of the raced allocations) -> `ok REWRITTEN`.
use std::{
    collections::HashMap,
    io::{BufRead, Write},
    os::fd::{FromRawFd, IntoRawFd, OwnedFd, RawFd},
    path::PathBuf,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

use anyhow::{Context, anyhow, bail};
use baton_mock_nvidia::{
    wire::put_u32,
    workload::{
        callers::{self, Callers},
        calls,
        nvfile::NvFile,
        race,
        receiver::{self, Receiver, now_ns},
    },
};
use baton_nvidia::{class, escape, ioc, layout::Layout, params::nvos00};
use nix::{
    fcntl::{OFlag, open},
    sys::{mman, stat::Mode},
    unistd::{ForkResult, Pid, dup, dup2_raw, fork},
};

/// Set in the environment of the re-executed program.
const EXECED_ENV: &str = "BATON_HOLDER_EXECED";
/// Set (to a path) for a re-executed program that maps that file before anything else.
const MAP_AT_START_ENV: &str = "BATON_HOLDER_MAP_AT_START";
/// Bytes of each device mapping.
const MAP_LEN: usize = 4096;

#[derive(clap::Parser)]
struct Args {
    /// Folder with the NVIDIA device files.
    #[arg(long, default_value = "/dev")]
    dev_dir: PathBuf,
}

struct Holder {
    dev_dir: PathBuf,
    /// Children from `fork`: pid -> write end of the pipe they wait on.
    children: HashMap<i32, OwnedFd>,
    /// Children from `fork-receiver`, by pid.
    receivers: HashMap<i32, Receiver>,
    spinning: Arc<AtomicBool>,
    /// Threads that call the driver together (`ioctl-threads`, `callers`).
    callers: Callers,
}

fn main() -> anyhow::Result<()> {
    let args: Args = clap::Parser::parse();
    if std::env::var_os(EXECED_ENV).is_some() {
        let t = now_ns();
        match std::env::var_os(MAP_AT_START_ENV) {
            Some(path) => match map_at_start(&PathBuf::from(path)) {
                Ok(addr) => say(&format!("ok {t} 0x{addr:x}")),
                Err(e) => say(&format!("err {e:#}")),
            },
            None => say(&format!("ok {t}")),
        }
    }
    let mut holder = Holder {
        dev_dir: args.dev_dir,
        children: HashMap::new(),
        receivers: HashMap::new(),
        spinning: Arc::new(AtomicBool::new(false)),
        callers: Callers::default(),
    };
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let line = line.context("reading a command")?;
        let words: Vec<&str> = line.split_whitespace().collect();
        if words.is_empty() {
            continue;
        }
        match holder.run(&words) {
            Ok(reply) => say(&format!(
                "ok{}{reply}",
                if reply.is_empty() { "" } else { " " }
            )),
            Err(e) => say(&format!("err {e:#}")),
        }
    }
    Ok(())
}

impl Holder {
    fn run(&mut self, words: &[&str]) -> anyhow::Result<String> {
        let arg = |i: usize| -> anyhow::Result<&str> {
            words
                .get(i)
                .copied()
                .ok_or_else(|| anyhow!("{} needs {} argument(s)", words[0], i))
        };
        let num = |i: usize| -> anyhow::Result<i64> {
            let s = arg(i)?;
            let v = match s.strip_prefix("0x") {
                Some(hex) => i64::from_str_radix(hex, 16),
                None => s.parse(),
            };
            v.with_context(|| format!("{s:?} is not a number"))
        };
        Ok(match words[0] {
            "open" => self.open(arg(1)?, true)?.to_string(),
            "open-inherit" => self.open(arg(1)?, false)?.to_string(),
            "openat2" => self.openat2(arg(1)?)?.to_string(),
            "flash-threads" => {
                for _ in 0..num(1)? {
                    std::thread::spawn(|| {})
                        .join()
                        .map_err(|_| anyhow!("a thread panicked"))?;
                }
                String::new()
            }
            "flood-dup" => {
                let fd = num(1)? as RawFd;
                for _ in 0..num(2)? {
                    // SAFETY: a raw number the script manages; the copy is closed at once.
                    let copy = dup(unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) })?;
                    drop(copy);
                }
                String::new()
            }
            "keep-dups" => keep_dups(num(1)? as RawFd, num(2)? as u64)?.to_string(),
            "anon-maps" => anon_maps(num(1)? as usize)?.to_string(),
            "map-below" => format!("0x{:x}", map_below(num(1)? as usize, arg(2)?)?),
            "reuse-dup" => self
                .reuse_dup(arg(1)?, arg(2)?, num(3)? as usize, num(4)? as usize)?
                .to_string(),
            "flood" => {
                let (fd, n) = (num(1)? as RawFd, num(2)?);
                let cmd = ioc::iowr(ioc::NV_IOCTL_MAGIC, escape::RM_CONTROL, nvos00::SIZE);
                let mut params = vec![0u8; nvos00::SIZE as usize];
                for _ in 0..n {
                    // SAFETY: `params` is a live buffer of the size the command encodes.
                    let _ = unsafe { libc::ioctl(fd, cmd as libc::c_ulong, params.as_mut_ptr()) };
                }
                String::new()
            }
            "ioctl-threads" => {
                self.callers.start_busy(num(1)? as RawFd, num(2)? as usize);
                String::new()
            }
            "stop-ioctl-threads" => self.callers.stop_busy()?.to_string(),
            "callers" => {
                self.callers.park(arg(1)?, num(2)? as usize)?;
                String::new()
            }
            "go" => self.callers.go(arg(1)?, arg(2)?, arg(3)?)?.to_string(),
            "join" => self.callers.join(arg(1)?)?.to_string(),
            "close-async" => {
                callers::close_async(num(1)? as RawFd)?;
                String::new()
            }
            "munmap-raw" => {
                let errno = munmap_raw(num(1)? as usize, num(2)? as usize);
                format!("{errno} {}", now_ns())
            }
            "alloc" => {
                let mib = if words.len() > 2 { num(2)? as u64 } else { 1 };
                self.alloc(num(1)? as RawFd, mib << 20)?
            }
            "alloc-client" => self.alloc_client(num(1)? as RawFd)?,
            "race-alloc" => self.race_alloc(num(1)? as RawFd, num(2)? as u32, num(3)? as u64)?,
            "race-free" => {
                let (fd, client, device) = (num(1)? as RawFd, num(2)? as u32, num(3)? as u32);
                race::race_frees(fd, client, device, num(4)? as u32)?.to_string()
            }
            "free-client" => self.free_client(num(1)? as RawFd, num(2)? as u32)?,
            "mmap" => format!("0x{:x}", map(num(1)? as RawFd)?),
            "map" => format!("0x{:x}", map_pages(num(1)? as RawFd, num(2)? as usize)?),
            "over-anon" => {
                over_anon(num(1)? as usize, num(2)? as usize)?;
                now_ns().to_string()
            }
            "over-memfd" => {
                over_memfd(num(1)? as usize, num(2)? as usize)?;
                now_ns().to_string()
            }
            "unmap" => {
                unmap_pages(num(1)? as usize, num(2)? as usize)?;
                now_ns().to_string()
            }
            "shm-over" => {
                shm_over(num(1)? as usize, num(2)? as usize)?;
                now_ns().to_string()
            }
            "mremap" => {
                let to = remap(
                    num(1)? as usize,
                    num(2)? as usize,
                    num(3)? as usize,
                    words.get(4) == Some(&"move"),
                )?;
                format!("0x{to:x} {}", now_ns())
            }
            "dontfork" => {
                dont_fork(num(1)? as usize, num(2)? as usize)?;
                String::new()
            }
            "munmap" => {
                unmap(num(1)? as usize)?;
                now_ns().to_string()
            }
            "close" => {
                nix::unistd::close(num(1)? as RawFd)?;
                now_ns().to_string()
            }
            "close-range" => {
                // SAFETY: close_range only closes fds of this process; none is owned by a Rust object.
                let r = unsafe {
                    libc::syscall(libc::SYS_close_range, num(1)? as u32, num(2)? as u32, 0u32)
                };
                if r != 0 {
                    bail!("close_range: {}", std::io::Error::last_os_error());
                }
                now_ns().to_string()
            }
            "dup" => {
                // SAFETY: the fd stays open (a raw number the script manages).
                let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(num(1)? as RawFd) };
                dup(fd)?.into_raw_fd().to_string()
            }
            "dup2" => {
                // SAFETY: as above.
                let old = unsafe { std::os::fd::BorrowedFd::borrow_raw(num(1)? as RawFd) };
                // SAFETY: the target number is the script's to replace.
                let new = unsafe { dup2_raw(old, num(2)? as RawFd) }?;
                let _ = new.into_raw_fd();
                now_ns().to_string()
            }
            "fork" => self.fork()?.to_string(),
            "fork-receiver" => {
                let r = Receiver::fork(&self.dev_dir)?;
                let pid = r.pid;
                self.receivers.insert(pid, r);
                pid.to_string()
            }
            "clone-files" => {
                let r = Receiver::clone_files(&self.dev_dir)?;
                let pid = r.pid;
                self.receivers.insert(pid, r);
                pid.to_string()
            }
            "child-exit-now" => {
                let pid = num(1)? as i32;
                self.receivers
                    .remove(&pid)
                    .ok_or_else(|| anyhow!("no receiver child {pid}"))?
                    .exit()?;
                now_ns().to_string()
            }
            "send-fd" => self.receiver(num(1)?)?.send_fd(num(2)? as RawFd)?,
            "child-open" => self.receiver(num(1)?)?.ask(&format!("open {}", arg(2)?))?,
            "child-open-state" => self
                .receiver(num(1)?)?
                .ask(&format!("open-state {}", arg(2)?))?,
            "child-close" => self.receiver(num(1)?)?.ask("close")?,
            "grab-fd" => receiver::grab_fd(num(1)? as i32, num(2)? as RawFd)?.to_string(),
            "ring-file" => receiver::ring_with_file(num(1)? as RawFd)?.to_string(),
            "child-exit" => {
                let pid = num(1)? as i32;
                self.children
                    .remove(&pid)
                    .ok_or_else(|| anyhow!("no child {pid}"))?;
                nix::sys::wait::waitpid(Pid::from_raw(pid), None)?;
                String::new()
            }
            "thread-close" => self.thread_close(num(1)? as RawFd)?.to_string(),
            "stop-spin" => {
                self.spinning.store(false, Ordering::SeqCst);
                String::new()
            }
            "threads" => {
                for _ in 0..num(1)? {
                    std::thread::spawn(|| {
                        loop {
                            std::thread::park();
                        }
                    });
                }
                String::new()
            }
            "exec" => self.exec(None)?,
            "exec-map" => self.exec(Some(arg(1)?))?,
            "forge" => self.forge(num(1)? as RawFd)?,
            "stamp" => now_ns().to_string(),
            "exit" => std::process::exit(num(1)? as i32),
            other => bail!("unknown command {other:?}"),
        })
    }

    /// Re-executes this program (close-on-exec fds go); with `map`, the new program opens that file and maps
    /// it first thing, so that it reuses the fd number of a closed NVIDIA fd while the exec is fresh.
    fn exec(&self, map: Option<&str>) -> anyhow::Result<String> {
        let exe = std::fs::read_link("/proc/self/exe")?;
        let mut cmd = std::process::Command::new(exe);
        cmd.arg("--dev-dir").arg(&self.dev_dir).env(EXECED_ENV, "1");
        if let Some(path) = map {
            cmd.env(MAP_AT_START_ENV, path);
        }
        let err = std::os::unix::process::CommandExt::exec(&mut cmd);
        bail!("exec: {err}")
    }

    /// Opens device `name` with openat2 (close-on-exec).
    fn openat2(&self, name: &str) -> anyhow::Result<RawFd> {
        let path = std::ffi::CString::new(
            self.dev_dir
                .join(name)
                .into_os_string()
                .into_encoded_bytes(),
        )?;
        // struct open_how { u64 flags; u64 mode; u64 resolve; }
        let how: [u64; 3] = [(libc::O_RDWR | libc::O_CLOEXEC) as u64, 0, 0];
        // SAFETY: `path` is NUL-terminated and `how` is an open_how of the size passed; both outlive the call.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_openat2,
                libc::AT_FDCWD,
                path.as_ptr(),
                how.as_ptr(),
                std::mem::size_of_val(&how),
            )
        };
        if fd < 0 {
            bail!("openat2 {name}: {}", std::io::Error::last_os_error());
        }
        Ok(fd as RawFd)
    }

    fn open(&self, name: &str, cloexec: bool) -> anyhow::Result<RawFd> {
        let mut flags = OFlag::O_RDWR;
        if cloexec {
            flags |= OFlag::O_CLOEXEC;
        }
        let path = self.dev_dir.join(name);
        let fd = open(&path, flags, Mode::empty())
            .with_context(|| format!("open {}", path.display()))?;
        Ok(fd.into_raw_fd())
    }

    /// `rounds` times: opens `first` and closes it, opens `then` (which gets the same fd number), keeps `keep`
    /// dups of it and closes it: the kernel reuses the number at once, while the agent is still applying the
    /// records of the number's earlier file. Answers how many dups are kept (all of file `then`).
    fn reuse_dup(
        &self,
        first: &str,
        then: &str,
        rounds: usize,
        keep: usize,
    ) -> anyhow::Result<usize> {
        let mut kept = 0;
        for _ in 0..rounds {
            nix::unistd::close(self.open(first, true)?)?;
            let fd = self.open(then, true)?;
            for _ in 0..keep {
                // SAFETY: `fd` is open until the close below; the dup is kept, as a raw number.
                let copy = dup(unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) })?;
                let _ = copy.into_raw_fd();
                kept += 1;
            }
            nix::unistd::close(fd)?;
        }
        Ok(kept)
    }

    /// An RM root client on `fd` (nvidiactl), with a device and `bytes` of video memory under it: GPU state in
    /// the ledger. Answers the client's handle and the first status that is not NV_OK (else 0).
    fn alloc(&self, fd: RawFd, bytes: u64) -> anyhow::Result<String> {
        let (handle, status) = receiver::alloc_gpu_state(fd, &self.dev_dir, bytes)?;
        Ok(format!("0x{handle:x} {status}"))
    }

    /// An RM root client alone on `fd` (a handle: no GPU state).
    fn alloc_client(&self, fd: RawFd) -> anyhow::Result<String> {
        let file = self.borrow_file(fd);
        let layout = Layout::DEFAULT;
        let r = calls::rm_alloc(
            &file,
            &layout,
            calls::AllocForm::Nvos21,
            [0, 0, 0],
            class::NV01_ROOT_CLIENT,
            None,
        );
        let _ = file.into_fd().into_raw_fd();
        let a = r?;
        Ok(format!("0x{:x} {}", a.handle, a.status))
    }

    /// A client and a device on `fd`, then `count` raced allocations of `kib` KiB (`workload::race`).
    fn race_alloc(&self, fd: RawFd, count: u32, kib: u64) -> anyhow::Result<String> {
        let file = self.borrow_file(fd);
        let layout = Layout::DEFAULT;
        let form = calls::AllocForm::Nvos21;
        let made = (|| {
            let c = calls::rm_alloc(&file, &layout, form, [0; 3], class::NV01_ROOT_CLIENT, None)?;
            let ids = [c.handle, c.handle, 0x4855_0001];
            let d = calls::rm_alloc(&file, &layout, form, ids, class::NV01_DEVICE_0, None)?;
            Ok::<_, baton_mock_nvidia::workload::WorkloadError>((c, d))
        })();
        let _ = file.into_fd().into_raw_fd();
        let (client, device) = made?;
        if client.status != 0 || device.status != 0 {
            bail!("the client or device was refused: {client:?} {device:?}");
        }
        let rewritten =
            race::race_allocs(fd, client.handle, device.handle, count, kib << 10, true)?;
        Ok(format!(
            "0x{:x} 0x{:x} {rewritten}",
            client.handle, device.handle
        ))
    }

    /// RM_FREE of client `client` (and everything under it) through `fd`: answers the status and the time.
    fn free_client(&self, fd: RawFd, client: u32) -> anyhow::Result<String> {
        let file = self.borrow_file(fd);
        let r = calls::rm_free(&file, client, 0, client);
        let t = now_ns();
        let _ = file.into_fd().into_raw_fd();
        Ok(format!("{} {t}", r?))
    }

    /// Pretends to free everything while keeping the files: an RM_FREE of client 0xc1d00001 whose params say
    /// NV_OK, sent with a magic the driver refuses (so it never writes the real status back); an munmap of
    /// an anonymous mapping; a close of a non-NVIDIA fd.
    fn forge(&self, fd: RawFd) -> anyhow::Result<String> {
        let mut params = vec![0u8; nvos00::SIZE as usize];
        put_u32(&mut params, nvos00::H_ROOT_OFFSET, 0xc1d0_0001);
        put_u32(&mut params, nvos00::H_OBJECT_OLD_OFFSET, 0xc1d0_0001);
        put_u32(&mut params, nvos00::STATUS_OFFSET, 0);
        let cmd = ioc::iowr(b'G', escape::RM_FREE, nvos00::SIZE);
        // SAFETY: `params` is a live buffer of the size the command encodes; the fd is the script's.
        let _ = unsafe { libc::ioctl(fd, cmd as libc::c_ulong, params.as_mut_ptr()) };
        // SAFETY: a fresh anonymous mapping, unmapped at once; nothing refers to it.
        let anon = unsafe {
            mman::mmap_anonymous(
                None,
                std::num::NonZeroUsize::new(MAP_LEN).context("length")?,
                mman::ProtFlags::PROT_READ,
                mman::MapFlags::MAP_PRIVATE,
            )
        }?;
        unmap(anon.as_ptr() as usize)?;
        let null = open("/dev/null", OFlag::O_RDONLY, Mode::empty())?;
        drop(null);
        Ok(String::new())
    }

    fn receiver(&self, pid: i64) -> anyhow::Result<&Receiver> {
        self.receivers
            .get(&(pid as i32))
            .ok_or_else(|| anyhow!("no receiver child {pid}"))
    }

    fn fork(&mut self) -> anyhow::Result<i32> {
        let (read, write) = nix::unistd::pipe()?;
        // SAFETY: the child only reads its pipe and exits; it touches no lock another thread may hold.
        match unsafe { fork() }? {
            ForkResult::Child => {
                drop(write);
                let mut buf = [0u8; 1];
                // Blocks until the parent drops the write end (`child-exit`) or dies.
                let _ = nix::unistd::read(&read, &mut buf);
                // SAFETY: leaves at once without running the parent's atexit handlers or destructors.
                unsafe { libc::_exit(0) }
            }
            ForkResult::Parent { child } => {
                drop(read);
                self.children.insert(child.as_raw(), write);
                Ok(child.as_raw())
            }
        }
    }

    /// A thread closes `fd` and then spins with no syscall (not even for the time, which may be one: this
    /// thread stamps nothing, the main thread does once it sees the close done): only /proc can tell that
    /// the closing thread returned to user space.
    fn thread_close(&self, fd: RawFd) -> anyhow::Result<u64> {
        let closed = Arc::new(AtomicBool::new(false));
        let (done, spin) = (closed.clone(), self.spinning.clone());
        spin.store(true, Ordering::SeqCst);
        std::thread::spawn(move || {
            // SAFETY: the script hands this fd over to the thread, which closes it.
            drop(unsafe { OwnedFd::from_raw_fd(fd) });
            done.store(true, Ordering::SeqCst);
            while spin.load(Ordering::Relaxed) {
                std::hint::spin_loop();
            }
        });
        while !closed.load(Ordering::SeqCst) {
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
        Ok(now_ns())
    }

    fn borrow_file(&self, fd: RawFd) -> NvFile {
        // SAFETY: the fd is open and owned by the script; `into_fd` hands it back unclosed.
        NvFile::from_fd(unsafe { OwnedFd::from_raw_fd(fd) }, &self.dev_dir)
    }
}

/// Opens `path` (any file) and maps it shared.
fn map_at_start(path: &std::path::Path) -> anyhow::Result<usize> {
    let fd = open(path, OFlag::O_RDWR, Mode::empty())
        .with_context(|| format!("open {}", path.display()))?;
    map(fd.into_raw_fd())
}

fn map(fd: RawFd) -> anyhow::Result<usize> {
    // SAFETY: a fresh shared mapping of the device file at an address the kernel picks; nothing aliases it.
    let addr = unsafe {
        mman::mmap(
            None,
            std::num::NonZeroUsize::new(MAP_LEN).context("length")?,
            mman::ProtFlags::PROT_READ | mman::ProtFlags::PROT_WRITE,
            mman::MapFlags::MAP_SHARED,
            std::os::fd::BorrowedFd::borrow_raw(fd),
            0,
        )
    }
    .context("mmap")?;
    Ok(addr.as_ptr() as usize)
}

/// A shared mapping of `pages` pages of the device file `fd` where the kernel picks.
fn map_pages(fd: RawFd, pages: usize) -> anyhow::Result<usize> {
    // SAFETY: a fresh shared mapping of the device file at an address the kernel picks; nothing aliases it.
    let addr = unsafe {
        mman::mmap(
            None,
            std::num::NonZeroUsize::new(pages * MAP_LEN).context("length")?,
            mman::ProtFlags::PROT_READ | mman::ProtFlags::PROT_WRITE,
            mman::MapFlags::MAP_SHARED,
            std::os::fd::BorrowedFd::borrow_raw(fd),
            0,
        )
    }
    .context("mmap")?;
    Ok(addr.as_ptr() as usize)
}

/// What the real driver's checkpoint does to a device mapping (recording:
/// /work/shared/gpu/580.159.04/maps-parked.txt): an anonymous PROT_NONE reservation MAP_FIXED over it.
fn over_anon(addr: usize, pages: usize) -> anyhow::Result<()> {
    let at = std::num::NonZeroUsize::new(addr).context("address 0")?;
    // SAFETY: the script replaces a range it mapped itself; no Rust object lives in those pages.
    unsafe {
        mman::mmap_anonymous(
            Some(at),
            std::num::NonZeroUsize::new(pages * MAP_LEN).context("length")?,
            mman::ProtFlags::PROT_NONE,
            mman::MapFlags::MAP_PRIVATE | mman::MapFlags::MAP_FIXED,
        )
    }
    .context("mmap MAP_FIXED anonymous")?;
    Ok(())
}

/// A memfd's pages mapped MAP_FIXED over `[addr, addr + pages)`.
fn over_memfd(addr: usize, pages: usize) -> anyhow::Result<()> {
    let len = pages * MAP_LEN;
    let memfd = nix::sys::memfd::memfd_create(c"holder", nix::sys::memfd::MFdFlags::MFD_CLOEXEC)
        .context("memfd_create")?;
    nix::unistd::ftruncate(&memfd, len as i64).context("ftruncate")?;
    // SAFETY: the script replaces a range it mapped itself; no Rust object lives in those pages.
    unsafe {
        mman::mmap(
            Some(std::num::NonZeroUsize::new(addr).context("address 0")?),
            std::num::NonZeroUsize::new(len).context("length")?,
            mman::ProtFlags::PROT_READ,
            mman::MapFlags::MAP_SHARED | mman::MapFlags::MAP_FIXED,
            &memfd,
            0,
        )
    }
    .context("mmap MAP_FIXED of a memfd")?;
    Ok(())
}

/// A System V shared memory segment attached with SHM_REMAP over `[addr, addr + pages)`: it replaces what
/// was mapped there through a syscall the probes do not follow (only the agent's /proc check sees it go).
fn shm_over(addr: usize, pages: usize) -> anyhow::Result<()> {
    let len = pages * MAP_LEN;
    // SAFETY: shmget creates a private segment of `len` bytes; it takes no pointer.
    let id = unsafe { libc::shmget(libc::IPC_PRIVATE, len, libc::IPC_CREAT | 0o600) };
    if id < 0 {
        bail!("shmget: {}", std::io::Error::last_os_error());
    }
    // SAFETY: attaches the segment over a range the script mapped itself; no Rust object lives there.
    let at = unsafe { libc::shmat(id, addr as *const libc::c_void, libc::SHM_REMAP) };
    let failed = at as isize == -1;
    let error = std::io::Error::last_os_error();
    // SAFETY: marks the segment for removal once detached; takes no pointer that outlives the call.
    unsafe { libc::shmctl(id, libc::IPC_RMID, std::ptr::null_mut()) };
    if failed {
        bail!("shmat(SHM_REMAP): {error}");
    }
    Ok(())
}

/// Creates `/tmp/NAME` (NAME: the bytes `hex_name` spells) and maps its one page shared at the lowest free
/// page-aligned address from 256 MiB up that is below `below` (`MAP_FIXED_NOREPLACE`, one MiB apart): a
/// mapping whose line comes before `below`'s in /proc/PID/maps. Returns its address.
fn map_below(below: usize, hex_name: &str) -> anyhow::Result<usize> {
    use std::os::unix::ffi::OsStrExt;
    let name = (0..hex_name.len())
        .step_by(2)
        .map(|i| {
            let pair = hex_name
                .get(i..i + 2)
                .context("an odd number of hex digits")?;
            u8::from_str_radix(pair, 16).with_context(|| format!("{pair:?} is not hex"))
        })
        .collect::<anyhow::Result<Vec<u8>>>()?;
    let path = std::path::Path::new("/tmp").join(std::ffi::OsStr::from_bytes(&name));
    std::fs::write(&path, vec![0u8; MAP_LEN]).with_context(|| format!("creating {path:?}"))?;
    let file = std::fs::File::options()
        .read(true)
        .write(true)
        .open(&path)?;
    let mut at = 256usize << 20;
    while at + MAP_LEN <= below {
        // SAFETY: MAP_FIXED_NOREPLACE maps only where nothing is mapped; the mapping is kept until exit.
        let mapped = unsafe {
            mman::mmap(
                std::num::NonZeroUsize::new(at),
                std::num::NonZeroUsize::new(MAP_LEN).context("length")?,
                mman::ProtFlags::PROT_READ | mman::ProtFlags::PROT_WRITE,
                mman::MapFlags::MAP_SHARED | mman::MapFlags::MAP_FIXED_NOREPLACE,
                &file,
                0,
            )
        };
        if let Ok(addr) = mapped {
            return Ok(addr.as_ptr() as usize);
        }
        at += 1 << 20;
    }
    bail!("no free address below 0x{below:x}")
}

/// munmap of `pages` pages at `addr`.
fn unmap_pages(addr: usize, pages: usize) -> anyhow::Result<()> {
    let ptr = std::ptr::NonNull::new(addr as *mut libc::c_void).context("address 0")?;
    // SAFETY: the script unmaps what it mapped; no Rust object lives in those pages.
    unsafe { mman::munmap(ptr, pages * MAP_LEN) }.context("munmap")?;
    Ok(())
}

/// mremap of `[addr, addr + old)` pages to `new` pages: in place, or (`moving`) to a fresh address reserved
/// first, where it goes with MREMAP_FIXED. Returns where it is now.
fn remap(addr: usize, old: usize, new: usize, moving: bool) -> anyhow::Result<usize> {
    let (old_len, new_len) = (old * MAP_LEN, new * MAP_LEN);
    let ptr = std::ptr::NonNull::new(addr as *mut libc::c_void).context("address 0")?;
    let to = if moving {
        // SAFETY: a fresh anonymous reservation nothing refers to, replaced by the move below.
        let target = unsafe {
            mman::mmap_anonymous(
                None,
                std::num::NonZeroUsize::new(new_len).context("length")?,
                mman::ProtFlags::PROT_NONE,
                mman::MapFlags::MAP_PRIVATE,
            )
        }
        .context("reserving the target")?;
        // SAFETY: moves a range the script mapped onto the reservation it just made.
        unsafe {
            mman::mremap(
                ptr,
                old_len,
                new_len,
                mman::MRemapFlags::MREMAP_MAYMOVE | mman::MRemapFlags::MREMAP_FIXED,
                Some(target),
            )
        }
    } else {
        // SAFETY: resizes in place a range the script mapped.
        unsafe { mman::mremap(ptr, old_len, new_len, mman::MRemapFlags::empty(), None) }
    }
    .context("mremap")?;
    Ok(to.as_ptr() as usize)
}

/// MADV_DONTFORK over `pages` pages at `addr`: a forked child does not get them.
fn dont_fork(addr: usize, pages: usize) -> anyhow::Result<()> {
    let ptr = std::ptr::NonNull::new(addr as *mut libc::c_void).context("address 0")?;
    // SAFETY: advice on a range the script mapped; it changes no memory.
    unsafe { mman::madvise(ptr, pages * MAP_LEN, mman::MmapAdvise::MADV_DONTFORK) }
        .context("madvise")?;
    Ok(())
}

/// munmap of `len` bytes at `addr` as the script says, whatever they are (an unaligned address, a length
/// past the address space): the errno it failed with, or 0.
fn munmap_raw(addr: usize, len: usize) -> i32 {
    // SAFETY: the script unmaps what it names; a call the kernel refuses changes nothing, and no Rust object
    // lives in the script's mappings.
    if unsafe { libc::munmap(addr as *mut libc::c_void, len) } == 0 {
        0
    } else {
        std::io::Error::last_os_error().raw_os_error().unwrap_or(-1)
    }
}

fn unmap(addr: usize) -> anyhow::Result<()> {
    let ptr = std::ptr::NonNull::new(addr as *mut libc::c_void).context("address 0")?;
    // SAFETY: the script unmaps what it mapped; no Rust object lives in those pages.
    unsafe { mman::munmap(ptr, MAP_LEN) }.context("munmap")?;
    Ok(())
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Keeps `n` dups of `fd` open (as raw numbers), as a tenant filling the probes' fd map would: RLIMIT_NOFILE
/// raised as far as the process may (its hard limit too where it may), and where one process cannot hold
/// them all, children forked for the rest (each keeps its share, then waits until the holder goes). Returns
/// how many were kept (each process stops at its first error).
/// Gives this process `n` anonymous mappings of its own (one reservation whose every other page is made
/// read-only, so that no two neighbours merge), kept until it exits: a tenant whose /proc maps is long (a
/// million lines are 50 MB of text). Returns how many lines its maps has now; fails with what to raise when
/// the node's `vm.max_map_count` is lower than that.
fn anon_maps(n: usize) -> anyhow::Result<usize> {
    let page = 4096usize;
    let len = n.checked_mul(page).context("too many mappings")?;
    // SAFETY: a fresh anonymous reservation the kernel places; never unmapped (kept until exit).
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if base == libc::MAP_FAILED {
        bail!("mmap of {len} bytes: {}", std::io::Error::last_os_error());
    }
    for i in (0..n).step_by(2) {
        // SAFETY: a page inside the reservation made above.
        let r = unsafe {
            libc::mprotect(
                base.cast::<u8>().add(i * page).cast(),
                page,
                libc::PROT_READ,
            )
        };
        if r != 0 {
            bail!(
                "mprotect after {i} mappings: {} (raise vm.max_map_count above {n})",
                std::io::Error::last_os_error()
            );
        }
    }
    let maps = std::fs::read("/proc/self/maps")?;
    Ok(maps.iter().filter(|b| **b == b'\n').count())
}

fn keep_dups(fd: RawFd, n: u64) -> anyhow::Result<u64> {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let want = n + 1024;
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    if setrlimit(Resource::RLIMIT_NOFILE, want, want.max(hard)).is_err() {
        setrlimit(Resource::RLIMIT_NOFILE, want.min(hard), hard)?;
    }
    let (soft, _) = getrlimit(Resource::RLIMIT_NOFILE)?;
    // What one process can hold beside the fds it has already.
    let per_process = soft.saturating_sub(64).max(1);
    if per_process >= n {
        return Ok(dup_n(fd, n));
    }
    let mut kept = 0;
    while kept < n {
        let share = per_process.min(n - kept);
        let (read, write) = nix::unistd::pipe()?;
        // SAFETY: the child only dups, writes one line to a pipe and waits for its parent's death; it does
        // not return into this program.
        match unsafe { fork() }? {
            ForkResult::Child => {
                drop(read);
                // SAFETY: prctl with plain integer arguments.
                unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) };
                let got = dup_n(fd, share);
                let _ = nix::unistd::write(&write, format!("{got}\n").as_bytes());
                loop {
                    // SAFETY: waits for a signal; the parent's death kills it.
                    unsafe { libc::pause() };
                }
            }
            ForkResult::Parent { .. } => {
                drop(write);
                let mut line = String::new();
                std::io::BufReader::new(std::fs::File::from(read)).read_line(&mut line)?;
                let got: u64 = line.trim().parse().context("a flooding child's count")?;
                kept += got;
                if got < share {
                    break;
                }
            }
        }
    }
    Ok(kept)
}

/// Makes `n` dups of `fd` and keeps them (as raw numbers); stops at the first error. How many it made.
fn dup_n(fd: RawFd, n: u64) -> u64 {
    let mut kept = 0;
    for _ in 0..n {
        // SAFETY: `fd` is a raw number the script keeps open; each copy is kept, as a raw number.
        match dup(unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) }) {
            Ok(copy) => {
                let _ = copy.into_raw_fd();
                kept += 1;
            }
            Err(_) => break,
        }
    }
    kept
}
