//! Who gets a reaped child's exit status.
//!
//! The shim is a child subreaper and the crate's SIGCHLD loop reaps every child with
//! `waitpid(-1)`, publishing each exit on the crate's monitor. This module is the one table that
//! says whose a pid is: a container process (so its exit goes to the task), or a runc command the
//! shim ran (whose status goes back to that command's caller, never stolen). An exit that arrives
//! before its pid is known (a process that dies before `runc create`/`exec` returns) is kept as an
//! early exit and claimed when the pid is registered. One mutex covers both maps, so no exit is
//! lost between looking up and registering.

use std::{
    collections::HashMap,
    sync::{LazyLock, Mutex},
    time::{Duration, Instant},
};

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
    pub at: std::time::SystemTime,
}

#[derive(Debug)]
enum Owner {
    Process(ProcessKey),
    Command,
}

#[derive(Default)]
struct Table {
    owners: HashMap<i32, Owner>,
    early: HashMap<i32, (Exit, Instant)>,
}

/// Unclaimed exits older than this are dropped (pids of processes nobody will register).
const EARLY_EXIT_TTL: Duration = Duration::from_secs(30);

static TABLE: LazyLock<Mutex<Table>> = LazyLock::new(Mutex::default);

fn table() -> std::sync::MutexGuard<'static, Table> {
    // A poisoned lock only means a panic elsewhere; the maps are still consistent.
    TABLE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Registers `pid` as `key`'s process. Returns its exit if it already died.
pub fn register_process(pid: i32, key: ProcessKey) -> Option<Exit> {
    let mut t = table();
    if let Some((exit, _)) = t.early.remove(&pid) {
        return Some(exit);
    }
    t.owners.insert(pid, Owner::Process(key));
    None
}

/// Registers `pid` as a runc command the shim waits for itself (its exit is not a task's).
pub fn register_command(pid: i32) {
    let mut t = table();
    if t.early.remove(&pid).is_none() {
        t.owners.insert(pid, Owner::Command);
    }
}

/// Forgets a process pid (after its container is deleted).
pub fn forget(pid: i32) {
    table().owners.remove(&pid);
}

/// Routes a reaped exit: the process it belongs to, or `None` (a command's, or kept as early).
pub fn route_exit(pid: i32, code: i32) -> Option<(ProcessKey, Exit)> {
    let exit = Exit {
        code,
        at: std::time::SystemTime::now(),
    };
    let mut t = table();
    match t.owners.remove(&pid) {
        Some(Owner::Process(key)) => Some((key, exit)),
        Some(Owner::Command) => None,
        None => {
            let now = Instant::now();
            t.early
                .retain(|_, (_, seen)| now.duration_since(*seen) < EARLY_EXIT_TTL);
            t.early.insert(pid, (exit, now));
            None
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
    fn exit_before_registration_is_claimed() {
        assert!(route_exit(900_001, 3).is_none());
        let exit = register_process(900_001, key("e1")).expect("early exit kept");
        assert_eq!(exit.code, 3);
        // claimed once only
        assert!(register_process(900_001, key("e1")).is_none());
        let (k, e) = route_exit(900_001, 0).unwrap();
        assert_eq!(k, key("e1"));
        assert_eq!(e.code, 0);
    }

    #[test]
    fn command_exits_are_not_routed_to_tasks() {
        register_command(900_002);
        assert!(route_exit(900_002, 1).is_none());
        // and not kept as an early exit either
        assert!(register_process(900_002, key("")).is_none());
        forget(900_002);
    }
}
