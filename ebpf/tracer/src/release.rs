//! Confirming that what a process removed from the driver has really been released by the kernel.
//!
//! A close, a close_range, a dup2/dup3 over an NVIDIA fd, an munmap, an exec and a thread's exit are seen at
//! their syscall (or tracepoint), before the kernel runs the driver's release of the file: the last `fput`
//! defers it to task work, which runs before the thread returns to user space, and an exiting thread drops
//! its files after `sched_process_exit`. So each such removal leaves its thread *awaiting* here until one of:
//! - a `Confirm` record: the probes saw the thread enter its next traced syscall (it returned to user space,
//!   past its task work) or switch out dead (past `exit_task_work`);
//! - /proc shows the same (for a thread whose next syscall is not a traced one, that never makes another, or
//!   whose record was lost): the thread is gone or a zombie, it is outside any syscall or inside another one
//!   than the removal's, or it ran in user space since. The first check comes 0.1 ms after the removal.
//!
//! A container is released when the GPU holds no state of it *and* none of the removals that released its
//! state awaits confirmation (removals of files that carried none do not hold it back).
use std::collections::{HashMap, hash_map::Entry};

/// How a removal was confirmed complete.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConfirmKind {
    /// The thread entered its next traced syscall (a probe saw it).
    Returned,
    /// The thread switched out dead (a probe saw it).
    Exited,
    /// /proc showed the thread gone, dead, out of its syscall, or running in user space.
    Proc,
}

impl ConfirmKind {
    /// The name used in events and traces.
    pub fn label(self) -> &'static str {
        match self {
            Self::Returned => "syscall_return",
            Self::Exited => "thread_dead",
            Self::Proc => "proc",
        }
    }
}

/// The confirmation that completed a container's release.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Confirmation {
    /// When it was seen, CLOCK_MONOTONIC ns.
    pub t_ns: u64,
    /// How.
    pub kind: ConfirmKind,
}

/// The syscalls (x86_64 and aarch64 numbers through libc) each kind of removal comes from.
pub mod syscalls {
    /// close, or dup2/dup3 over an NVIDIA fd.
    pub const CLOSE: &[i64] = &[libc::SYS_close, libc::SYS_dup3, DUP2];
    /// close_range.
    pub const CLOSE_RANGE: &[i64] = &[libc::SYS_close_range];
    /// munmap.
    pub const MUNMAP: &[i64] = &[libc::SYS_munmap];
    /// mmap(MAP_FIXED) over a mapping.
    pub const MMAP: &[i64] = &[libc::SYS_mmap];
    /// mremap.
    pub const MREMAP: &[i64] = &[libc::SYS_mremap];
    /// execve, execveat.
    pub const EXEC: &[i64] = &[libc::SYS_execve, libc::SYS_execveat];
    /// ioctl.
    pub const IOCTL: &[i64] = &[libc::SYS_ioctl];
    /// open, openat, openat2.
    pub const OPEN: &[i64] = &[libc::SYS_openat, libc::SYS_openat2, OPEN_PLAIN];
    /// dup, dup2, dup3, fcntl.
    pub const DUP: &[i64] = &[libc::SYS_dup, libc::SYS_dup3, DUP2, libc::SYS_fcntl];
    /// madvise.
    pub const MADVISE: &[i64] = &[libc::SYS_madvise];

    /// The syscalls a call the probes keep in flight (`Sys`) may be.
    pub fn of(call: baton_probe_common::Sys) -> &'static [i64] {
        use baton_probe_common::Sys;
        match call {
            Sys::Ioctl => IOCTL,
            Sys::Open => OPEN,
            Sys::Dup => DUP,
            Sys::Mmap => MMAP,
            Sys::Close => CLOSE,
            Sys::Munmap => MUNMAP,
            Sys::CloseRange => CLOSE_RANGE,
            Sys::Mremap => MREMAP,
            Sys::Madvise => MADVISE,
        }
    }
    #[cfg(target_arch = "x86_64")]
    const DUP2: i64 = libc::SYS_dup2;
    #[cfg(not(target_arch = "x86_64"))]
    const DUP2: i64 = libc::SYS_dup3;
    #[cfg(target_arch = "x86_64")]
    const OPEN_PLAIN: i64 = libc::SYS_open;
    #[cfg(not(target_arch = "x86_64"))]
    const OPEN_PLAIN: i64 = libc::SYS_openat;
}

/// /proc checks of an awaiting thread: every `FIRST_CHECK_NS` for the first `FAST_CHECKS_NS` after its
/// removal, then at doubling intervals up to `MAX_CHECK_NS`. The probes confirm a thread only at its next
/// traced syscall, so a thread that goes on with others (a write, a futex wait) is confirmed here, and within
/// the signal's millisecond: it shows inside that other syscall. A check reads two small /proc files.
const FIRST_CHECK_NS: u64 = 50_000;
const FAST_CHECKS_NS: u64 = 1_000_000;
const MAX_CHECK_NS: u64 = 100_000_000;

#[derive(Clone, Debug)]
struct Awaiting {
    pid: u32,
    cgroup_id: u64,
    marked_ns: u64,
    /// The thread is exiting: only its death confirms it.
    exiting: bool,
    /// The syscalls its removals may have been made by: a thread seen inside another one returned from
    /// them. Empty when one of them is not known (an exit): then no syscall confirms it.
    syscalls: Vec<i64>,
    next_check_ns: u64,
    step_ns: u64,
    /// User time of the thread at the first /proc check.
    utime: Option<u64>,
    /// Its removals released GPU state (a file that carried clients with state, a UVM registration or
    /// unknown contents): only those keep a container from being released.
    frees_state: bool,
}

impl Awaiting {
    /// The thread removed more before its first removal was confirmed (an munmap, then a close): each
    /// removal's release must be past, so the thread is confirmed only by what confirms them all. Inside
    /// one of either removal's syscalls it is not past; an unknown set (an exit) stays unknown; the latest
    /// removal's time counts, and user time and the check pace start again from it.
    fn removed_again(&mut self, ts_ns: u64, exiting: bool, syscalls: &[i64]) {
        self.exiting |= exiting;
        if self.syscalls.is_empty() || syscalls.is_empty() {
            self.syscalls.clear();
        } else {
            for nr in syscalls {
                if !self.syscalls.contains(nr) {
                    self.syscalls.push(*nr);
                }
            }
        }
        if ts_ns >= self.marked_ns {
            self.marked_ns = ts_ns;
            self.utime = None;
            self.step_ns = FIRST_CHECK_NS;
            self.next_check_ns = ts_ns + FIRST_CHECK_NS;
        }
    }
}

/// Threads whose removals await confirmation, and each container's last removal and confirmation.
#[derive(Debug, Default)]
pub struct Releases {
    awaiting: HashMap<u32, Awaiting>,
    last_removal: HashMap<u64, u64>,
    last_confirm: HashMap<u64, Confirmation>,
    confirmed_by_proc: u64,
}

impl Releases {
    /// Thread `tid` of `pid` in cgroup `cgroup_id` removed NVIDIA files at `ts_ns`, by one of `syscalls`
    /// (empty for an exit, or when unknown). Whether that released GPU state is said after the mirror has
    /// applied it ([`Releases::freed_state`]).
    pub fn removed(
        &mut self,
        tid: u32,
        pid: u32,
        cgroup_id: u64,
        ts_ns: u64,
        exiting: bool,
        syscalls: &'static [i64],
    ) {
        match self.awaiting.entry(tid) {
            Entry::Vacant(v) => {
                v.insert(Awaiting {
                    pid,
                    cgroup_id,
                    marked_ns: ts_ns,
                    exiting,
                    syscalls: syscalls.to_vec(),
                    next_check_ns: ts_ns + FIRST_CHECK_NS,
                    step_ns: FIRST_CHECK_NS,
                    utime: None,
                    frees_state: false,
                });
            }
            Entry::Occupied(mut o) => o.get_mut().removed_again(ts_ns, exiting, syscalls),
        }
    }

    /// Thread `tid` of `pid` in cgroup `cgroup_id` began at `ts_ns` a call by one of `syscalls` whose record
    /// the probes lost: what it does is unknown (it may open, map or free anything), so it holds its
    /// container's release back like a removal of GPU state until the thread is seen past it.
    pub fn call_lost(
        &mut self,
        tid: u32,
        pid: u32,
        cgroup_id: u64,
        ts_ns: u64,
        syscalls: &'static [i64],
    ) {
        self.removed(tid, pid, cgroup_id, ts_ns, false, syscalls);
        if let Some(a) = self.awaiting.get_mut(&tid) {
            a.frees_state = true;
        }
    }

    /// The removal process `pid` made at `ts_ns` released GPU state: its threads marked until then keep its
    /// container from being released until they are confirmed (an exit's release runs in whichever of its
    /// threads drops the fd table last, which need not be the one whose record said so), and that is its last
    /// removal.
    pub fn freed_state(&mut self, pid: u32, cgroup_id: u64, ts_ns: u64) {
        self.last_removal.insert(cgroup_id, ts_ns);
        for a in self
            .awaiting
            .values_mut()
            .filter(|a| a.pid == pid && a.marked_ns <= ts_ns)
        {
            a.frees_state = true;
        }
    }

    /// The threads of exiting process `pid` that /proc still lists alive await their death too: the one
    /// that drops the last reference to the fd table runs the files' releases, and it may not have reached
    /// its own exit tracepoint yet.
    pub fn process_exiting(&mut self, pid: u32, cgroup_id: u64, ts_ns: u64) {
        let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            return;
        };
        for tid in dir
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        {
            if !matches!(
                thread_state(pid, tid),
                ThreadState::Gone | ThreadState::Dead
            ) {
                self.removed(tid, pid, cgroup_id, ts_ns, true, &[]);
            }
        }
    }

    /// A confirmation for `tid` (from a probe, or from [`Releases::check_proc`]); returns the (pid, cgroup)
    /// it completed, if the thread awaited one.
    pub fn confirmed(&mut self, tid: u32, kind: ConfirmKind, ts_ns: u64) -> Option<(u32, u64)> {
        let a = self.awaiting.get(&tid)?;
        if a.exiting && kind == ConfirmKind::Returned {
            // Back from the exit_group syscall's entry: not yet past its exit.
            return None;
        }
        let a = self.awaiting.remove(&tid)?;
        if kind == ConfirmKind::Proc {
            self.confirmed_by_proc += 1;
        }
        self.last_confirm
            .insert(a.cgroup_id, Confirmation { t_ns: ts_ns, kind });
        Some((a.pid, a.cgroup_id))
    }

    /// Threads of container `cgroup_id` whose removals released GPU state and are not confirmed yet.
    pub fn unconfirmed(&self, cgroup_id: u64) -> usize {
        self.awaiting
            .values()
            .filter(|a| a.cgroup_id == cgroup_id && a.frees_state)
            .count()
    }

    /// Whether a thread of `pid` still awaits.
    pub fn pid_awaits(&self, pid: u32) -> bool {
        self.awaiting.values().any(|a| a.pid == pid)
    }

    /// When a removal last released GPU state of container `cgroup_id` (record time).
    pub fn last_removal_ns(&self, cgroup_id: u64) -> Option<u64> {
        self.last_removal.get(&cgroup_id).copied()
    }

    /// The last confirmation of container `cgroup_id`.
    pub fn last_confirmation(&self, cgroup_id: u64) -> Option<Confirmation> {
        self.last_confirm.get(&cgroup_id).copied()
    }

    /// Removals confirmed by /proc rather than by a probe (lost records, threads with no next syscall).
    pub fn confirmed_by_proc(&self) -> u64 {
        self.confirmed_by_proc
    }

    /// When the next /proc check is due, if any thread awaits.
    pub fn next_check_ns(&self) -> Option<u64> {
        self.awaiting.values().map(|a| a.next_check_ns).min()
    }

    /// Checks in /proc the threads whose check is due at `now_ns`; returns those /proc shows past their
    /// release, for the caller to confirm with [`ConfirmKind::Proc`]. The others are checked again later,
    /// less and less often.
    pub fn check_proc(&mut self, now_ns: u64) -> Vec<ProcConfirmed> {
        let mut past = Vec::new();
        for (tid, a) in self.awaiting.iter_mut() {
            if a.next_check_ns > now_ns {
                continue;
            }
            let state = thread_state(a.pid, *tid);
            let done = match state {
                ThreadState::Gone | ThreadState::Dead => true,
                _ if a.exiting => false,
                ThreadState::OutOfSyscall => true,
                ThreadState::InSyscall(nr)
                    if !a.syscalls.is_empty() && !a.syscalls.contains(&nr) =>
                {
                    true
                }
                ThreadState::InSyscall(_) => false,
                ThreadState::Alive { utime } => {
                    let ran_in_user = a.utime.is_some_and(|u| utime > u);
                    a.utime.get_or_insert(utime);
                    ran_in_user
                }
            };
            if done {
                past.push(ProcConfirmed {
                    tid: *tid,
                    pid: a.pid,
                    cgroup_id: a.cgroup_id,
                    marked_ns: a.marked_ns,
                });
            } else {
                if now_ns.saturating_sub(a.marked_ns) >= FAST_CHECKS_NS {
                    a.step_ns = (a.step_ns * 2).min(MAX_CHECK_NS);
                }
                a.next_check_ns = now_ns + a.step_ns;
            }
        }
        past
    }

    /// Forgets everything about container `cgroup_id`.
    pub fn forget_cgroup(&mut self, cgroup_id: u64) {
        self.awaiting.retain(|_, a| a.cgroup_id != cgroup_id);
        self.last_removal.remove(&cgroup_id);
        self.last_confirm.remove(&cgroup_id);
    }
}

/// A thread that /proc shows past its release.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProcConfirmed {
    /// The thread.
    pub tid: u32,
    /// Its process.
    pub pid: u32,
    /// Its container.
    pub cgroup_id: u64,
    /// When its removal was seen.
    pub marked_ns: u64,
}

/// What /proc says of a thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ThreadState {
    /// No such thread any more (reaped: past its exit).
    Gone,
    /// A zombie or dead: past `exit_task_work`.
    Dead,
    /// Not inside a syscall: back in user space.
    OutOfSyscall,
    /// Blocked inside syscall `nr`.
    InSyscall(i64),
    /// Running, or inside the syscall that made the removal: its user time so far, in clock ticks.
    Alive {
        /// `utime` of /proc/PID/task/TID/stat.
        utime: u64,
    },
}

fn thread_state(pid: u32, tid: u32) -> ThreadState {
    let task = procfs::process::Process::new(pid as i32).and_then(|p| p.task_from_tid(tid as i32));
    let Ok(stat) = task.and_then(|t| t.stat()) else {
        return ThreadState::Gone;
    };
    if matches!(stat.state, 'Z' | 'X' | 'x') {
        return ThreadState::Dead;
    }
    // "-1 sp pc": blocked or preempted outside any syscall; "nr args...": blocked in syscall nr;
    // "running": can't tell. (procfs does not read this file.)
    let syscall =
        std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/syscall")).unwrap_or_default();
    match syscall.split_whitespace().next().map(str::parse::<i64>) {
        Some(Ok(-1)) => ThreadState::OutOfSyscall,
        Some(Ok(nr)) => ThreadState::InSyscall(nr),
        _ => ThreadState::Alive { utime: stat.utime },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_removal_is_pending_until_its_thread_is_confirmed() {
        let mut r = Releases::default();
        r.removed(11, 10, 5, 1_000, false, &[3]);
        assert_eq!(
            r.unconfirmed(5),
            0,
            "a removal that released no GPU state holds nothing back"
        );
        r.freed_state(10, 5, 1_000);
        r.removed(12, 10, 5, 2_000, true, &[]);
        r.freed_state(10, 5, 2_000);
        assert_eq!(r.unconfirmed(5), 2);
        assert_eq!(r.last_removal_ns(5), Some(2_000));
        assert_eq!(r.confirmed(99, ConfirmKind::Returned, 3_000), None);
        assert_eq!(r.confirmed(11, ConfirmKind::Returned, 3_000), Some((10, 5)));
        // An exiting thread entering exit_group is not past its exit.
        assert_eq!(r.confirmed(12, ConfirmKind::Returned, 3_500), None);
        assert!(r.pid_awaits(10));
        assert_eq!(r.confirmed(12, ConfirmKind::Exited, 4_000), Some((10, 5)));
        assert_eq!(r.unconfirmed(5), 0);
        assert_eq!(
            r.last_confirmation(5),
            Some(Confirmation {
                t_ns: 4_000,
                kind: ConfirmKind::Exited
            })
        );
        assert_eq!(r.next_check_ns(), None);
    }

    #[test]
    fn a_lost_call_holds_its_container_back_until_its_thread_is_past_it() {
        let me = std::process::id();
        let (tid, tx, reader) = thread_blocked_in_read();
        let mut r = Releases::default();
        // A read stands in for the lost call's syscall: inside it, the thread is not past it.
        r.call_lost(tid, me, 4, 1_000, &[libc::SYS_read]);
        assert_eq!(r.unconfirmed(4), 1, "what the call does is unknown");
        assert_eq!(r.last_removal_ns(4), None, "a lost call is no removal");
        assert_eq!(r.check_proc(1_000 + FIRST_CHECK_NS), vec![]);
        end_thread(tid, tx, reader);
        let past = r.check_proc(u64::MAX / 2);
        assert_eq!(past.len(), 1);
        assert_eq!(r.confirmed(tid, ConfirmKind::Proc, 5_000), Some((me, 4)));
        assert_eq!(r.unconfirmed(4), 0);
    }

    #[test]
    fn each_call_in_flight_names_its_syscalls() {
        use baton_probe_common::Sys;
        for v in 1..=9 {
            let call = Sys::from_u8(v).unwrap();
            assert!(!syscalls::of(call).is_empty(), "{call:?}");
        }
        assert_eq!(Sys::from_u8(0), None);
        assert_eq!(Sys::from_u8(10), None);
        assert!(syscalls::of(Sys::Open).contains(&libc::SYS_openat));
        assert!(syscalls::of(Sys::Dup).contains(&libc::SYS_fcntl));
    }

    #[test]
    fn proc_confirms_a_thread_that_is_gone_and_backs_off_for_one_that_is_not() {
        let mut r = Releases::default();
        // No such pid: gone.
        r.removed(u32::MAX - 1, u32::MAX - 1, 7, 0, true, &[]);
        // This test's own thread, inside a syscall of this very read or running: not confirmed while
        // exiting is claimed for it.
        let me = std::process::id();
        r.removed(me, me, 8, 0, true, &[]);
        r.freed_state(me, 8, 0);
        assert_eq!(r.check_proc(FIRST_CHECK_NS - 1), vec![]);
        let past = r.check_proc(FIRST_CHECK_NS);
        assert_eq!(past.len(), 1);
        assert_eq!((past[0].tid, past[0].cgroup_id), (u32::MAX - 1, 7));
        assert_eq!(
            r.confirmed(past[0].tid, ConfirmKind::Proc, FIRST_CHECK_NS),
            Some((u32::MAX - 1, 7))
        );
        assert_eq!(r.unconfirmed(8), 1);
        assert_eq!(
            r.next_check_ns(),
            Some(2 * FIRST_CHECK_NS),
            "checked often at first"
        );
        r.check_proc(FAST_CHECKS_NS);
        assert_eq!(
            r.next_check_ns(),
            Some(FAST_CHECKS_NS + 2 * FIRST_CHECK_NS),
            "then less and less often"
        );
        assert_eq!(r.confirmed_by_proc(), 1);
    }

    /// A thread of this test blocked in `read` on a pipe until the returned write end is written or dropped.
    fn thread_blocked_in_read() -> (u32, std::io::PipeWriter, std::thread::JoinHandle<()>) {
        use std::io::Read;
        let (mut rx, tx) = std::io::pipe().unwrap();
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let reader = std::thread::spawn(move || {
            tid_tx.send(nix::unistd::gettid().as_raw() as u32).unwrap();
            let mut byte = [0u8; 1];
            let _ = rx.read(&mut byte);
        });
        let tid = tid_rx.recv().unwrap();
        // Ready when the kernel shows it inside read (no fixed sleep).
        let me = std::process::id();
        while thread_state(me, tid) != ThreadState::InSyscall(libc::SYS_read) {
            std::thread::yield_now();
        }
        (tid, tx, reader)
    }

    /// Lets the thread of [`thread_blocked_in_read`] return and end; returns once /proc shows it gone (or dead).
    /// Joining is not enough: the joiner is woken in the thread's exit (CLONE_CHILD_CLEARTID) while /proc may
    /// still show it alive inside `exit`, a syscall no removal names.
    fn end_thread(tid: u32, tx: std::io::PipeWriter, reader: std::thread::JoinHandle<()>) {
        drop(tx);
        reader.join().unwrap();
        let me = std::process::id();
        while !matches!(thread_state(me, tid), ThreadState::Gone | ThreadState::Dead) {
            std::thread::yield_now();
        }
    }

    #[test]
    fn a_second_removal_before_the_first_is_confirmed_merges_both_syscall_sets() {
        let me = std::process::id();
        let (tid, tx, reader) = thread_blocked_in_read();
        let mut r = Releases::default();
        // The thread unmapped, then (its munmap unconfirmed) made a removal by the syscall it now sits in:
        // that syscall's release may still be running, so /proc seeing it there confirms neither.
        r.removed(tid, me, 9, 1_000, false, syscalls::MUNMAP);
        r.removed(tid, me, 9, 5_000, false, &[libc::SYS_read]);
        r.freed_state(me, 9, 5_000);
        assert_eq!(
            r.check_proc(5_000 + FIRST_CHECK_NS),
            vec![],
            "confirmed inside the second removal's syscall"
        );
        assert_eq!(r.unconfirmed(9), 1);
        assert_eq!(r.last_removal_ns(9), Some(5_000));
        // Out of read (it returns and the thread ends): past both.
        end_thread(tid, tx, reader);
        let past = r.check_proc(u64::MAX / 2);
        assert_eq!(past.len(), 1, "not confirmed once past both removals");
        assert_eq!(past[0].marked_ns, 5_000, "the latest removal's time counts");
    }

    #[test]
    fn an_unknown_syscall_set_stays_unknown_when_merged() {
        let me = std::process::id();
        let (tid, tx, reader) = thread_blocked_in_read();
        let mut r = Releases::default();
        r.removed(tid, me, 9, 1_000, false, syscalls::MUNMAP);
        r.removed(tid, me, 9, 2_000, false, &[]);
        assert_eq!(r.check_proc(2_000 + FIRST_CHECK_NS), vec![]);
        end_thread(tid, tx, reader);
        assert_eq!(r.check_proc(u64::MAX / 2).len(), 1);
    }
}
