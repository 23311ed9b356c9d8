//! The state machine of one process (a container's init or an exec), as the Go runc shim's
//! `init_state.go` / `exec_state.go` define it. [`transition`] is pure: a caller computes the next
//! state, performs the runc call, and commits the state only if the call succeeded, so a failed
//! call leaves the process where it was (rollback by construction).

use std::time::SystemTime;

use containerd_shim::asynchronous::io::IoTasks;
use containerd_shim_protos::api::Status as ApiStatus;
use tokio::sync::watch;

use crate::{
    checkpoint::CriuOpts,
    errors::{Result, ShimError},
    io::StdioSpec,
};

/// Where a process is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Created by `runc create` / `runc exec` not yet run.
    Created,
    /// An exec process whose `runc exec` is running (no pid yet).
    Starting,
    /// Created from a checkpoint: Start restores it.
    CreatedCheckpoint,
    /// Running.
    Running,
    /// Frozen.
    Paused,
    /// Exited (exit status known).
    Stopped,
    /// Deleted; only kept until removed from the table.
    Deleted,
}

impl State {
    /// containerd's status enum.
    pub fn api_status(self) -> ApiStatus {
        match self {
            State::Created | State::Starting | State::CreatedCheckpoint => ApiStatus::CREATED,
            State::Running => ApiStatus::RUNNING,
            State::Paused => ApiStatus::PAUSED,
            State::Stopped | State::Deleted => ApiStatus::STOPPED,
        }
    }

    /// Its name in messages.
    pub fn name(self) -> &'static str {
        match self {
            State::Created => "created",
            State::Starting => "starting",
            State::CreatedCheckpoint => "created (from checkpoint)",
            State::Running => "running",
            State::Paused => "paused",
            State::Stopped => "stopped",
            State::Deleted => "deleted",
        }
    }
}

/// What is asked of a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Start (or restore).
    Start,
    /// Freeze (init only).
    Pause,
    /// Thaw (init only).
    Resume,
    /// Signal.
    Kill,
    /// Add an exec process (asked of the init).
    Exec,
    /// Checkpoint (init only).
    Checkpoint,
    /// Change resources (init only).
    Update,
    /// The process exited.
    Exit,
    /// Delete.
    Delete,
}

impl Op {
    fn verb(self) -> &'static str {
        match self {
            Op::Start => "start",
            Op::Pause => "pause",
            Op::Resume => "resume",
            Op::Kill => "kill",
            Op::Exec => "exec in",
            Op::Checkpoint => "checkpoint",
            Op::Update => "update",
            Op::Exit => "exit",
            Op::Delete => "delete",
        }
    }
}

/// The state after `op` on a process in `from`, or the error for a refused operation.
/// `init` selects the init-process rules (pause, resume, checkpoint, update, exec only exist there).
pub fn transition(id: &str, init: bool, from: State, op: Op) -> Result<State> {
    use {Op::*, State::*};
    let refused = || ShimError::FailedPrecondition {
        id: id.to_string(),
        action: op.verb(),
        state: from.name().to_string(),
    };
    if !init && matches!(op, Pause | Resume | Checkpoint | Update | Exec) {
        return Err(refused());
    }
    // An exec that never started has no pid to signal (Go: "process not created").
    if !init && matches!(from, Created | Starting) && op == Kill {
        return Err(refused());
    }
    let next = match (from, op) {
        (Created, Start) if !init => Starting,
        (Starting, Start) => return Err(refused()),
        (Created | CreatedCheckpoint, Start) => Running,
        (Created | CreatedCheckpoint | Stopped, Delete) => Deleted,
        (Created | Starting | Running | Paused | CreatedCheckpoint, Exit) => Stopped,
        (Stopped, Exit) => Stopped,
        (Created | Running | Paused, Kill) => from,
        (CreatedCheckpoint, Kill) => from,
        (Stopped | Deleted, Kill) => {
            return Err(ShimError::ProcessFinished { id: id.to_string() });
        }
        (Running, Pause) => Paused,
        (Paused, Resume) => Running,
        (Created | Running, Exec) => from,
        (Running | Paused, Checkpoint) => from,
        (Created | Running | Paused, Update) => from,
        _ => return Err(refused()),
    };
    Ok(next)
}

/// What watchers of a process's exit ([`Process::exit_tx`]) see.
#[derive(Debug, Clone, Copy, Default)]
pub struct ExitInfo {
    /// Exit status.
    pub status: u32,
    /// When.
    pub at: Option<SystemTime>,
}

/// One process of a container.
pub struct Process {
    /// Container id.
    pub id: String,
    /// Exec id (empty for init).
    pub exec_id: String,
    /// Pid once created (0 before).
    pub pid: u32,
    /// Current state.
    pub state: State,
    /// Stdio as containerd asked.
    pub stdio: StdioSpec,
    /// Copies between pipes/console and containerd's fifos.
    pub io: IoTasks,
    /// The writer into the stdin pipe, which CloseIO closes.
    pub stdin: crate::io::StdinCloser,
    /// Console master for a TTY process.
    pub console: Option<crate::console::Console>,
    /// Exec spec (JSON of an OCI process) for exec processes.
    pub exec_spec: Option<oci_spec::runtime::Process>,
    /// For a container created from a checkpoint: how Start restores it.
    pub restore: Option<CriuOpts>,
    /// Exit, once known and its TaskExit queued; `Wait` subscribes here.
    pub exit_tx: watch::Sender<Option<ExitInfo>>,
    /// Copies of `file://` output, which Delete lets finish.
    pub file_copies: Vec<tokio::task::JoinHandle<()>>,
    /// The output streams being copied, which the exit waits for.
    pub output: crate::io::OutputDrain,
}

impl Process {
    /// A process in the `Created` state (pid set later).
    pub fn new(id: &str, exec_id: &str, stdio: StdioSpec) -> Self {
        Self {
            id: id.to_string(),
            exec_id: exec_id.to_string(),
            pid: 0,
            state: State::Created,
            stdio,
            io: IoTasks::default(),
            stdin: crate::io::StdinCloser::default(),
            console: None,
            exec_spec: None,
            restore: None,
            exit_tx: watch::channel(None).0,
            file_copies: Vec::new(),
            output: crate::io::OutputDrain::default(),
        }
    }

    /// `id` or `id/exec_id`, for messages.
    pub fn name(&self) -> String {
        if self.exec_id.is_empty() {
            self.id.clone()
        } else {
            format!("{}/{}", self.id, self.exec_id)
        }
    }

    /// The next state for `op`, or the refusal.
    pub fn check(&self, op: Op) -> Result<State> {
        transition(&self.name(), self.exec_id.is_empty(), self.state, op)
    }

    /// Exit info if exited.
    pub fn exit_info(&self) -> Option<ExitInfo> {
        *self.exit_tx.borrow()
    }

    /// Records the exit (idempotent: the first one wins) and wakes waiters.
    pub fn set_exited(&mut self, status: u32, at: SystemTime) {
        if self.exit_info().is_some() {
            return;
        }
        self.state = self.check(Op::Exit).unwrap_or(State::Stopped);
        self.exit_tx.send_replace(Some(ExitInfo {
            status,
            at: Some(at),
        }));
    }
}

#[cfg(test)]
mod tests {
    use containerd_shim_protos::ttrpc;

    use super::*;

    fn t(init: bool, from: State, op: Op) -> Result<State> {
        transition("c1", init, from, op)
    }

    #[test]
    fn init_lifecycle() {
        use {Op::*, State::*};
        assert_eq!(t(true, Created, Start).unwrap(), Running);
        assert_eq!(t(true, CreatedCheckpoint, Start).unwrap(), Running);
        assert_eq!(t(true, Running, Pause).unwrap(), Paused);
        assert_eq!(t(true, Paused, Resume).unwrap(), Running);
        assert_eq!(t(true, Paused, Exit).unwrap(), Stopped);
        assert_eq!(t(true, Stopped, Delete).unwrap(), Deleted);
        assert_eq!(t(true, Created, Delete).unwrap(), Deleted);
        assert_eq!(t(true, Running, Kill).unwrap(), Running);
        assert_eq!(t(true, Running, Exec).unwrap(), Running);
        assert_eq!(t(true, Paused, Checkpoint).unwrap(), Paused);
    }

    #[test]
    fn refusals_are_failed_precondition_or_not_found() {
        use {Op::*, State::*};
        for (from, op) in [
            (Stopped, Pause),
            (Stopped, Resume),
            (Running, Resume),
            (Paused, Pause),
            (Running, Start),
            (Running, Delete),
            (Paused, Delete),
            (Stopped, Exec),
            (Paused, Exec),
            (Stopped, Start),
            (Stopped, Update),
            (Created, Checkpoint),
            (Deleted, Start),
        ] {
            let err = t(true, from, op).unwrap_err();
            assert!(
                matches!(err, ShimError::FailedPrecondition { .. }),
                "{from:?} {op:?}: {err:?}"
            );
        }
        assert!(matches!(
            t(true, Stopped, Kill),
            Err(ShimError::ProcessFinished { .. })
        ));
    }

    #[test]
    fn exec_processes_cannot_pause_or_checkpoint() {
        use {Op::*, State::*};
        assert_eq!(t(false, Created, Start).unwrap(), Starting);
        assert_eq!(
            t(false, Starting, Start).unwrap_err().code(),
            ttrpc::Code::FAILED_PRECONDITION
        );
        assert_eq!(t(false, Starting, Exit).unwrap(), Stopped);
        assert!(t(false, Starting, Delete).is_err());
        for op in [Pause, Resume, Checkpoint, Update, Exec] {
            assert!(t(false, Running, op).is_err(), "{op:?}");
        }
    }

    /// Killing an exec that was created but never started must not signal pid 0 (the shim's
    /// own process group): it is refused as the Go shim refuses it.
    #[test]
    fn kill_of_an_exec_without_a_pid_is_a_failed_precondition() {
        use {Op::*, State::*};
        for from in [Created, Starting] {
            let err = t(false, from, Kill).unwrap_err();
            assert_eq!(
                err.code(),
                ttrpc::Code::FAILED_PRECONDITION,
                "{from:?}: {err}"
            );
        }
        assert_eq!(t(false, Running, Kill).unwrap(), Running);
        assert_eq!(
            t(true, Created, Kill).unwrap(),
            Created,
            "an init has a pid once created"
        );
    }

    #[test]
    fn exit_is_recorded_once_and_wakes_waiters() {
        let mut p = Process::new("c1", "e1", StdioSpec::default());
        let mut rx = p.exit_tx.subscribe();
        p.state = State::Running;
        p.set_exited(7, SystemTime::now());
        p.set_exited(9, SystemTime::now());
        assert_eq!(p.state, State::Stopped);
        assert!(rx.has_changed().unwrap());
        assert_eq!(rx.borrow_and_update().unwrap().status, 7);
        assert_eq!(p.name(), "c1/e1");
    }
}
