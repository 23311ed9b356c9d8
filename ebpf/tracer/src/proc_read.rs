//! The one reader of other processes' /proc entries, with one failure rule for every caller (seeding the
//! probes' mirror, its reconcile, adopt and resync, the agent's node scan and its check before a release):
//! a process that is gone (no `/proc/PID`, `ESRCH`/`ENOENT` once it has exited, or a zombie whose every
//! thread has exited) holds nothing; any other failure makes it [`ProcError::Unreadable`], which the callers
//! count as holding everything (the agent's `Via::Unreadable`) and which never drops what the mirror has.
//!
//! Everything is read as bytes: the kernel prints file names raw (`/proc/PID/maps`, fd links, io_uring
//! fdinfo), and a name need not be UTF-8, so a tenant that maps `/tmp/\xff\xfe` must not end a read. Costs
//! kept: the maps are read line by line through one buffer (a tenant with a million mappings has 50 MB of
//! text, never held whole), a caller may stop a read early ([`ProcDir::for_each_mapping`]), and the fd
//! numbers are listed and each link read on its own (reading a link passes the kernel's ptrace access check:
//! a refusal is seen, where an iterator that skips what it may not read hides it).
//!
//! A zombie thread-group leader whose other threads still run is not gone: its own /proc entries show no fd
//! and no mapping (its `files` and `mm` went with its exit), while the live threads share both. Such a
//! process is read through a live thread's `/proc/TID` (checked on this kernel: /proc/PID/fd and maps are
//! empty, /proc/TID/fd, maps and map_files are whole).
use std::{
    ffi::OsString,
    io::{BufRead, ErrorKind},
    ops::ControlFlow,
    path::PathBuf,
};

/// Why a process's /proc entries gave no answer.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ProcError {
    /// The process is gone (or a zombie with no live thread): it holds nothing.
    #[error("the process is gone")]
    Gone,
    /// It is there, but what it holds could not be read whole: it must count as holding everything.
    #[error("/proc/{pid}/{what}: {why}")]
    Unreadable {
        /// The process.
        pid: u32,
        /// The entry that failed (`fd`, `fd/7`, `maps`, `map_files/...`, `stat`).
        what: String,
        /// Why.
        why: String,
    },
}

/// A live process's /proc entries (those of a live thread when its leader is a zombie).
#[derive(Clone, Debug)]
pub struct ProcDir {
    pid: u32,
    /// `/proc/PID`, or `/proc/TID` of a live thread.
    base: PathBuf,
}

/// One line of /proc/PID/maps: `start-end perms offset MM:mm inode path`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapLine<'a> {
    /// First address.
    pub start: u64,
    /// End (exclusive).
    pub end: u64,
    /// `rwxp` or `rwxs`.
    pub perms: &'a [u8],
    /// The mapped file's device (`makedev` of `MM:mm`).
    pub dev: u64,
    /// The mapped file's inode (0: anonymous).
    pub inode: u64,
    /// The path as the kernel printed it (raw bytes; empty for an anonymous mapping).
    pub path: &'a [u8],
}

impl<'a> MapLine<'a> {
    /// Parses one line (without its newline); `None` when it is not a maps line.
    pub fn parse(line: &'a [u8]) -> Option<Self> {
        let mut rest = line;
        let mut field = || {
            let at = rest.iter().position(|b| *b == b' ')?;
            let f = &rest[..at];
            rest = &rest[at + 1..];
            Some(f)
        };
        let (range, perms, _offset, dev, inode) =
            (field()?, field()?, field()?, field()?, field()?);
        let path = match rest.iter().position(|b| *b != b' ') {
            Some(at) => &rest[at..],
            None => &[][..],
        };
        let (start, end) = split_once(range, b'-')?;
        let (major, minor) = split_once(dev, b':')?;
        Some(Self {
            start: hex(start)?,
            end: hex(end)?,
            perms,
            dev: nix::sys::stat::makedev(hex(major)?, hex(minor)?),
            inode: std::str::from_utf8(inode).ok()?.parse().ok()?,
            path,
        })
    }

    /// Whether it is a shared mapping.
    pub fn shared(&self) -> bool {
        self.perms.get(3) == Some(&b's')
    }

    /// The last component of its path.
    pub fn base_name(&self) -> &'a [u8] {
        base_name(self.path)
    }
}

/// The last component of `path` (bytes).
pub fn base_name(path: &[u8]) -> &[u8] {
    path.rsplit(|b| *b == b'/').next().unwrap_or(path)
}

fn split_once(s: &[u8], sep: u8) -> Option<(&[u8], &[u8])> {
    let at = s.iter().position(|b| *b == sep)?;
    Some((&s[..at], &s[at + 1..]))
}

fn hex(s: &[u8]) -> Option<u64> {
    u64::from_str_radix(std::str::from_utf8(s).ok()?, 16).ok()
}

/// The fields of /proc/PID/stat after the command (which may hold spaces and parentheses): `state` first.
fn stat_fields(text: &[u8]) -> Option<Vec<&[u8]>> {
    let close = text.iter().rposition(|b| *b == b')')?;
    Some(
        text[close + 1..]
            .split(|b| b.is_ascii_whitespace())
            .filter(|f| !f.is_empty())
            .collect(),
    )
}

/// What /proc/PID/stat says of a process: its state letter, its parent and its thread count.
struct Stat {
    state: u8,
    ppid: u32,
    threads: u64,
}

fn read_stat(dir: &str) -> std::io::Result<Option<Stat>> {
    let text = std::fs::read(format!("{dir}/stat"))?;
    let Some(f) = stat_fields(&text) else {
        return Ok(None);
    };
    let num = |i: usize| -> Option<u64> { std::str::from_utf8(f.get(i)?).ok()?.parse().ok() };
    Ok((|| {
        Some(Stat {
            state: *f.first()?.first()?,
            // Fields after the command, from 0: state, ppid, ..., num_threads (the 20th of the line).
            ppid: u32::try_from(num(1)?).ok()?,
            threads: num(17)?,
        })
    })())
}

/// Whether an error of a /proc read means that the thing read is not there (any more).
fn not_there(e: &std::io::Error) -> bool {
    e.kind() == ErrorKind::NotFound || e.raw_os_error() == Some(libc::ESRCH)
}

/// Whether process `pid` holds anything: alive, or a zombie leader with a live thread.
/// (One whose state cannot be read counts as alive.)
pub fn alive(pid: u32) -> bool {
    !matches!(ProcDir::open(pid), Err(ProcError::Gone))
}

/// Every pid on the host (the numeric entries of /proc). An error means the host's processes cannot be
/// listed: the caller must treat them as unreadable.
pub fn all_pids() -> std::io::Result<Vec<u32>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc")? {
        let entry = entry?;
        if let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse().ok()) {
            out.push(pid);
        }
    }
    Ok(out)
}

impl ProcDir {
    /// Process `pid`'s entries: [`ProcError::Gone`] when it has exited (or is a zombie whose threads all
    /// have), [`ProcError::Unreadable`] when its state cannot be read.
    pub fn open(pid: u32) -> Result<Self, ProcError> {
        let dir = format!("/proc/{pid}");
        let unreadable = |why: String| ProcError::Unreadable {
            pid,
            what: "stat".to_owned(),
            why,
        };
        let stat = match read_stat(&dir) {
            Ok(Some(s)) => s,
            Ok(None) => return Err(unreadable("it does not parse".to_owned())),
            Err(e) if not_there(&e) => return Err(ProcError::Gone),
            Err(e) => return Err(unreadable(e.to_string())),
        };
        if !matches!(stat.state, b'Z' | b'X') {
            return Ok(Self {
                pid,
                base: PathBuf::from(dir),
            });
        }
        if stat.threads <= 1 {
            return Err(ProcError::Gone);
        }
        // A zombie leader with live threads: read through one of them.
        let tasks = match std::fs::read_dir(format!("{dir}/task")) {
            Ok(t) => t,
            Err(e) if not_there(&e) => return Err(ProcError::Gone),
            Err(e) => {
                return Err(ProcError::Unreadable {
                    pid,
                    what: "task".to_owned(),
                    why: e.to_string(),
                });
            }
        };
        for entry in tasks.flatten() {
            let Some(tid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            if tid == pid {
                continue;
            }
            let thread = format!("/proc/{tid}");
            if let Ok(Some(s)) = read_stat(&thread)
                && !matches!(s.state, b'Z' | b'X')
            {
                return Ok(Self {
                    pid,
                    base: PathBuf::from(thread),
                });
            }
        }
        Err(ProcError::Gone)
    }

    /// The process.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Whether the process (or the thread read through) is still there: what tells a read that failed
    /// because it exited from one that failed otherwise.
    pub fn still_there(&self) -> bool {
        read_stat(&self.base.to_string_lossy())
            .ok()
            .flatten()
            .is_some_and(|s| !matches!(s.state, b'Z' | b'X'))
    }

    /// Its parent process, when its stat says.
    pub fn parent(&self) -> Option<u32> {
        let stat = read_stat(&format!("/proc/{}", self.pid)).ok()??;
        Some(stat.ppid)
    }

    /// The error of a read of `what` that failed with `e`: gone when the process is, else unreadable.
    fn failed(&self, what: impl Into<String>, e: &std::io::Error) -> ProcError {
        if not_there(e) && !self.still_there() {
            ProcError::Gone
        } else {
            ProcError::Unreadable {
                pid: self.pid,
                what: what.into(),
                why: e.to_string(),
            }
        }
    }

    /// The numbers of its open fds (listing /proc/PID/fd needs no more than root).
    pub fn fd_numbers(&self) -> Result<Vec<i32>, ProcError> {
        let dir = std::fs::read_dir(self.base.join("fd")).map_err(|e| self.failed("fd", &e))?;
        let mut out = Vec::new();
        for entry in dir {
            let entry = entry.map_err(|e| self.failed("fd", &e))?;
            if let Some(fd) = entry.file_name().to_str().and_then(|n| n.parse().ok()) {
                out.push(fd);
            }
        }
        Ok(out)
    }

    /// Where fd `fd` leads (the link's target, raw bytes: a path, or `anon_inode:[io_uring]`, ...); `None`
    /// when it was closed meanwhile.
    pub fn fd_target(&self, fd: i32) -> Result<Option<OsString>, ProcError> {
        match std::fs::read_link(self.fd_link(fd)) {
            Ok(target) => Ok(Some(target.into_os_string())),
            Err(e) if not_there(&e) && self.still_there() => Ok(None),
            Err(e) => Err(self.failed(format!("fd/{fd}"), &e)),
        }
    }

    /// The link of fd `fd` (which `stat` follows to the open file).
    pub fn fd_link(&self, fd: i32) -> PathBuf {
        self.base.join("fd").join(fd.to_string())
    }

    /// What fd `fd` is (its link followed); `None` when it was closed meanwhile.
    pub fn fd_metadata(&self, fd: i32) -> Result<Option<std::fs::Metadata>, ProcError> {
        match std::fs::metadata(self.fd_link(fd)) {
            Ok(m) => Ok(Some(m)),
            Err(e) if not_there(&e) && self.still_there() => Ok(None),
            Err(e) => Err(self.failed(format!("fd/{fd}"), &e)),
        }
    }

    /// What the file mapped at `[start, end)` is (its `map_files` link followed); `None` when it was
    /// unmapped meanwhile.
    pub fn mapping_metadata(
        &self,
        start: u64,
        end: u64,
    ) -> Result<Option<std::fs::Metadata>, ProcError> {
        let what = format!("map_files/{start:x}-{end:x}");
        match std::fs::metadata(self.base.join(&what)) {
            Ok(m) => Ok(Some(m)),
            Err(e) if not_there(&e) && self.still_there() => Ok(None),
            Err(e) => Err(self.failed(what, &e)),
        }
    }

    /// The fdinfo of fd `fd` (raw bytes); `None` when it was closed meanwhile.
    pub fn fdinfo(&self, fd: i32) -> Result<Option<Vec<u8>>, ProcError> {
        match std::fs::read(self.base.join("fdinfo").join(fd.to_string())) {
            Ok(text) => Ok(Some(text)),
            Err(e) if not_there(&e) && self.still_there() => Ok(None),
            Err(e) => Err(self.failed(format!("fdinfo/{fd}"), &e)),
        }
    }

    /// Calls `each` with every line of its maps that `wanted` lets through (it sees the raw line: a cheap
    /// test spares the parse of the lines no caller looks at, most of a process's), in address order, until
    /// it breaks; one buffer, so the text is never held whole. A wanted line that does not parse, or a read
    /// that fails while the process lives, is [`ProcError::Unreadable`]: a read cut short would hide the
    /// mappings after it.
    pub fn for_each_mapping(
        &self,
        wanted: impl Fn(&[u8]) -> bool,
        mut each: impl FnMut(&MapLine<'_>) -> ControlFlow<()>,
    ) -> Result<(), ProcError> {
        let file =
            std::fs::File::open(self.base.join("maps")).map_err(|e| self.failed("maps", &e))?;
        let mut reader = std::io::BufReader::with_capacity(64 * 1024, file);
        let mut line = Vec::with_capacity(256);
        loop {
            line.clear();
            let n = reader
                .read_until(b'\n', &mut line)
                .map_err(|e| self.failed("maps", &e))?;
            if n == 0 {
                return Ok(());
            }
            let text = line.strip_suffix(b"\n").unwrap_or(&line);
            if !wanted(text) {
                continue;
            }
            let Some(m) = MapLine::parse(text) else {
                return Err(ProcError::Unreadable {
                    pid: self.pid,
                    what: "maps".to_owned(),
                    why: format!("a line does not parse: {:?}", String::from_utf8_lossy(text)),
                });
            };
            if each(&m).is_break() {
                return Ok(());
            }
        }
    }
}

/// Whether raw maps line `line` holds `needle` anywhere (a cheap test before the parse).
pub fn mentions(line: &[u8], needle: &[u8]) -> bool {
    memchr::memmem::find(line, needle).is_some()
}

/// Whether raw maps line `line` is a shared mapping (its permissions end in `s`), without parsing it.
pub fn raw_shared(line: &[u8]) -> bool {
    line.iter()
        .position(|b| *b == b' ')
        .and_then(|at| line.get(at + 4))
        == Some(&b's')
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::ffi::OsStrExt;

    #[test]
    fn maps_lines_parse_as_bytes_whatever_their_names() {
        let line = b"7f0000001000-7f0000003000 rw-s 00000000 00:2d 520                        /tmp/\xff\xfe";
        let m = MapLine::parse(line).unwrap();
        assert_eq!(
            (m.start, m.end, m.inode),
            (0x7f00_0000_1000, 0x7f00_0000_3000, 520)
        );
        assert_eq!(m.dev, nix::sys::stat::makedev(0, 0x2d));
        assert!(m.shared());
        assert_eq!(m.path, b"/tmp/\xff\xfe");
        assert_eq!(m.base_name(), b"\xff\xfe");
        assert!(raw_shared(line) && !raw_shared(b"1000-2000 r--p 0 00:00 0 "));
        assert!(mentions(line, b"/tmp/") && !mentions(line, b"nvidia"));
        let anonymous = MapLine::parse(b"1000-2000 ---p 00000000 00:00 0 ").unwrap();
        assert_eq!((anonymous.inode, anonymous.path), (0, &b""[..]));
        let spaced = MapLine::parse(b"1000-2000 rw-s 00000000 00:2d 43 /dev/shm/a b").unwrap();
        assert_eq!(spaced.path, b"/dev/shm/a b");
        assert!(MapLine::parse(b"not a maps line").is_none());
    }

    #[test]
    fn the_stat_fields_start_after_the_command_whatever_it_holds() {
        let f = stat_fields(b"12 (a) b (c)) S 7 12 12 0").unwrap();
        assert_eq!(f[0], b"S");
        assert_eq!(f[1], b"7");
    }

    #[test]
    fn a_mapping_of_a_file_whose_name_is_not_utf8_does_not_end_the_read_of_those_after_it() {
        let dir = tempfile::tempdir().unwrap();
        let odd = dir.path().join(std::ffi::OsStr::from_bytes(b"\xff\xfe"));
        std::fs::write(&odd, vec![0u8; 4096]).unwrap();
        let later = dir.path().join("later");
        std::fs::write(&later, vec![0u8; 4096]).unwrap();
        let map = |p: &std::path::Path| {
            let f = std::fs::File::open(p).unwrap();
            // SAFETY: a fresh shared read-only mapping of a file this test owns; never dereferenced.
            unsafe {
                nix::sys::mman::mmap(
                    None,
                    std::num::NonZeroUsize::new(4096).unwrap(),
                    nix::sys::mman::ProtFlags::PROT_READ,
                    nix::sys::mman::MapFlags::MAP_SHARED,
                    &f,
                    0,
                )
            }
            .unwrap()
        };
        let (a, b) = (map(&odd), map(&later));
        let me = ProcDir::open(std::process::id()).unwrap();
        let mut names = Vec::new();
        me.for_each_mapping(
            |_| true,
            |m| {
                names.push(m.path.to_vec());
                ControlFlow::Continue(())
            },
        )
        .unwrap();
        assert!(names.iter().any(|n| n.ends_with(b"/\xff\xfe")), "{names:?}");
        assert!(names.iter().any(|n| n.ends_with(b"/later")));
        // SAFETY: the two mappings made above, unmapped once.
        unsafe {
            nix::sys::mman::munmap(a, 4096).unwrap();
            nix::sys::mman::munmap(b, 4096).unwrap();
        }
    }

    /// The thread of the child below: sleeps until the child is killed.
    extern "C" fn sleeper(_: *mut libc::c_void) -> *mut libc::c_void {
        loop {
            // SAFETY: pause takes no argument; it returns on a signal, and the loop waits again.
            unsafe { libc::pause() };
        }
    }

    #[test]
    fn a_zombie_leader_whose_thread_lives_is_read_through_that_thread() {
        let file = tempfile::tempfile().unwrap();
        let (read, write) = nix::unistd::pipe().unwrap();
        // SAFETY: the child only makes raw libc calls (pthread_create, write, the exit of its own thread) and
        // never returns into the test harness.
        match unsafe { nix::unistd::fork() }.unwrap() {
            nix::unistd::ForkResult::Child => {
                let mut thread: libc::pthread_t = 0;
                // SAFETY: a new thread running `sleeper`, which takes no argument.
                unsafe {
                    libc::pthread_create(
                        &mut thread,
                        std::ptr::null(),
                        sleeper,
                        std::ptr::null_mut(),
                    );
                    libc::write(
                        std::os::fd::AsRawFd::as_raw_fd(&write),
                        b"x".as_ptr().cast(),
                        1,
                    );
                    // This thread alone ends (exit, not exit_group), with nothing unwound.
                    libc::syscall(libc::SYS_exit, 0);
                }
            }
            nix::unistd::ForkResult::Parent { child } => {
                drop(write);
                let mut b = [0u8; 1];
                nix::unistd::read(&read, &mut b).unwrap();
                let pid = child.as_raw() as u32;
                let fd = std::os::fd::AsRawFd::as_raw_fd(&file);
                // The leader's exit is seen once its stat says so.
                let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
                while std::fs::read_to_string(format!("/proc/{pid}/stat"))
                    .is_ok_and(|s| !s.contains(") Z "))
                {
                    assert!(
                        std::time::Instant::now() < deadline,
                        "the leader did not exit"
                    );
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
                let dir = ProcDir::open(pid);
                let numbers = dir.as_ref().map(ProcDir::fd_numbers).map_err(Clone::clone);
                let _ = nix::sys::signal::kill(child, nix::sys::signal::Signal::SIGKILL);
                let _ = nix::sys::wait::waitpid(child, None);
                let dir = dir.unwrap();
                assert_ne!(dir.base, PathBuf::from(format!("/proc/{pid}")));
                let numbers = numbers.unwrap().unwrap();
                assert!(
                    numbers.contains(&fd),
                    "the inherited fd {fd} is read: {numbers:?}"
                );
            }
        }
    }

    #[test]
    fn a_process_that_exited_is_gone_and_this_one_is_there() {
        assert!(ProcDir::open(std::process::id()).unwrap().still_there());
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        assert_eq!(ProcDir::open(pid).unwrap_err(), ProcError::Gone);
    }
}
