//! Reaping children and saying whose each exit is.
//!
//! The shim is a child subreaper: [`reap_children`] reaps every child with `waitpid(-1)` on
//! SIGCHLD and publishes each exit on the crate's monitor. [`route_exit`] then says whose it is,
//! from one table: a container process (its exit goes to the task), or a runc command the shim
//! ran (whose status goes back to that command's caller, never stolen).
//!
//! A process can die before its pid is known (before `runc create` or `runc exec` returns). As in
//! the Go shim, whoever is about to start a process first takes an [`ExitSubscription`]: exits of
//! unknown pids are kept only for the live subscriptions, and [`ExitSubscription::register`]
//! claims the one of its pid. An exit nobody was waiting for is dropped, so a reused pid can never
//! inherit a stranger's status. One mutex covers the table and the subscriptions, so no exit is
//! lost between looking up and registering.

use std::{
    collections::HashMap,
    sync::{LazyLock, Mutex},
    time::SystemTime,
};

use containerd_shim::asynchronous::monitor::monitor_notify_by_pid;
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use tokio::signal::unix::{SignalKind, signal};

/// Which process of which container a pid belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ProcessKey {
    /// Container id.
    pub id: String,
    /// Exec id; empty for the container's init process.
    pub exec_id: String,
}

/// An exit: code and when it was seen.
#[derive(Debug, Clone, Copy)]
pub struct Exit {
    /// Exit code (128 + signal for a signalled process).
    pub code: i32,
    /// When the reaper saw it.
    pub at: SystemTime,
}

#[derive(Debug)]
enum Owner {
    Process(ProcessKey),
    Command,
}

#[derive(Default)]
struct Table {
    owners: HashMap<i32, Owner>,
    /// Exits of unknown pids seen while each subscription lived, by subscription id.
    pending: HashMap<u64, Vec<(i32, Exit)>>,
    next_subscription: u64,
}

static TABLE: LazyLock<Mutex<Table>> = LazyLock::new(Mutex::default);

fn table() -> std::sync::MutexGuard<'static, Table> {
    // A poisoned lock only means a panic elsewhere; the maps are still consistent.
    TABLE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Keeps the exits of not-yet-registered pids from its creation until it is dropped.
#[derive(Debug)]
pub struct ExitSubscription {
    id: u64,
}

impl ExitSubscription {
    /// Starts keeping exits of unknown pids (take it before spawning the process).
    pub fn new() -> Self {
        let mut t = table();
        let id = t.next_subscription;
        t.next_subscription += 1;
        t.pending.insert(id, Vec::new());
        Self { id }
    }

    /// Registers `pid` as `key`'s process. Returns its exit if it died since the subscription
    /// was taken (the pid is then not registered: it will not exit again).
    pub fn register(&self, pid: i32, key: ProcessKey) -> Option<Exit> {
        let mut t = table();
        let early = t
            .pending
            .get(&self.id)
            .and_then(|exits| exits.iter().find(|(p, _)| *p == pid))
            .map(|(_, exit)| *exit);
        if early.is_none() {
            t.owners.insert(pid, Owner::Process(key));
        }
        early
    }
}

impl Drop for ExitSubscription {
    fn drop(&mut self) {
        table().pending.remove(&self.id);
    }
}

/// Registers `pid` as a runc command the shim waits for itself (its exit is not a task's).
pub fn register_command(pid: i32) {
    table().owners.insert(pid, Owner::Command);
}

/// Forgets a process pid (after its container is deleted).
pub fn forget(pid: i32) {
    table().owners.remove(&pid);
}

/// Routes a reaped exit: the process it belongs to, or `None` (a command's, or an unknown pid's,
/// which is kept for the live subscriptions only).
pub fn route_exit(pid: i32, code: i32) -> Option<(ProcessKey, Exit)> {
    let exit = Exit {
        code,
        at: SystemTime::now(),
    };
    let mut t = table();
    match t.owners.remove(&pid) {
        Some(Owner::Process(key)) => Some((key, exit)),
        Some(Owner::Command) => None,
        None => {
            for exits in t.pending.values_mut() {
                exits.push((pid, exit));
            }
            None
        }
    }
}

/// Reaps every child and hands each exit to the crate's monitor (and so to [`route_exit`] and to
/// the runc commands' callers). Children that exited before the SIGCHLD handler was in place (the task
/// started after them) are reaped at once: their signal came when nothing listened, and without that
/// first pass their callers would wait for the next child's exit, or forever.
pub async fn reap_children() {
    let Ok(mut sigchld) = signal(SignalKind::child()) else {
        tracing::error!("cannot watch SIGCHLD: children will not be reaped");
        return;
    };
    loop {
        reap_exited().await;
        if sigchld.recv().await.is_none() {
            return;
        }
    }
}

/// Reaps every child that has exited, without waiting.
async fn reap_exited() {
    loop {
        match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::Exited(pid, code)) => {
                let _ = monitor_notify_by_pid(pid.as_raw(), code).await;
            }
            Ok(WaitStatus::Signaled(pid, sig, _)) => {
                let _ = monitor_notify_by_pid(pid.as_raw(), 128 + sig as i32).await;
            }
            Ok(WaitStatus::StillAlive) | Err(_) => break,
            Ok(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(e: &str) -> ProcessKey {
        ProcessKey {
            id: "c".into(),
            exec_id: e.into(),
        }
    }

    #[test]
    fn exit_before_registration_is_claimed_by_the_subscription() {
        let sub = ExitSubscription::new();
        assert!(route_exit(900_001, 3).is_none());
        let exit = sub.register(900_001, key("e1")).expect("early exit kept");
        assert_eq!(exit.code, 3);
        // An early exit does not register the pid: its next exit is a stranger's.
        assert!(route_exit(900_001, 0).is_none());
        // A pid registered without an early exit is routed.
        assert!(sub.register(900_003, key("e2")).is_none());
        let (k, e) = route_exit(900_003, 5).expect("routed");
        assert_eq!((k, e.code), (key("e2"), 5));
    }

    #[test]
    fn a_reused_pid_does_not_inherit_an_exit_nobody_waited_for() {
        // Process A (pid P) dies while nobody is starting anything: nobody claims its exit.
        assert!(route_exit(900_004, 137).is_none());
        // Later a new process gets the same pid P.
        let sub = ExitSubscription::new();
        assert!(
            sub.register(900_004, key("new")).is_none(),
            "the new process inherited the old one's exit status"
        );
        let (k, e) = route_exit(900_004, 0).expect("its own exit is routed");
        assert_eq!((k, e.code), (key("new"), 0));
    }

    #[test]
    fn exits_kept_for_a_dropped_subscription_are_gone() {
        let sub = ExitSubscription::new();
        assert!(route_exit(900_005, 1).is_none());
        drop(sub);
        let later = ExitSubscription::new();
        assert!(later.register(900_005, key("x")).is_none());
        forget(900_005);
    }

    #[test]
    fn command_exits_are_not_routed_to_tasks() {
        register_command(900_002);
        assert!(route_exit(900_002, 1).is_none());
        // and not kept as an early exit either
        let sub = ExitSubscription::new();
        assert!(sub.register(900_002, key("")).is_none());
        forget(900_002);
    }
}
