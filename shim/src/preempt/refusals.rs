//! Preemptions refused up front, before anything is locked, because cuda-checkpoint cannot do them or a park
//! would break the job (README, "Support matrix"):
//! - **an MPS client**: cuda-checkpoint fails to lock one with "operation not supported" (seed 000, and
//!   nvidia-driver.md §5). Told by `CUDA_MPS_PIPE_DIRECTORY` in its environment, or by something mounted at
//!   the default pipe directory, `/tmp/nvidia-mps`, in its mount table (how a daemon's pipe directory reaches
//!   a client in another container). An MPS daemon started inside the container at the default directory
//!   shows neither: that park fails at the lock with cuda-checkpoint's error and is rolled back.
//! - **a rank of a distributed job** (`WORLD_SIZE`, as torchrun and PyTorch's env:// set it;
//!   `OMPI_COMM_WORLD_SIZE`; `PMI_SIZE`; above 1): its peers wait on it in every collective, so while it is
//!   locked or parked they hang ("locking one rank hangs the others", nvidia-driver.md §5), and a park
//!   longer than their collective timeout ends the job; locking the ranks of one container one by one hangs
//!   on the first collective in flight. A mapped libnccl is no signal: every PyTorch process maps it
//!   (/work/shared/gpu/580.159.04/maps-running.txt, a single-process holder).
//!
//! Both are read from files the kernel writes, `/proc/PID/environ` and `/proc/PID/mountinfo`; nothing the
//! container declares makes the shim open a path of its choosing, and a process that hides the signal only
//! has its own job broken or its park rolled back.

use std::io::Read;

use crate::{
    container::Container,
    errors::{Result, ShimError},
};

/// The MPS pipe directory a client uses when `CUDA_MPS_PIPE_DIRECTORY` is not set.
const DEFAULT_MPS_PIPE_DIRECTORY: &str = "/tmp/nvidia-mps";

/// The variables that give a distributed job's size (torchrun / PyTorch env://, Open MPI, MPICH and Slurm's
/// PMI).
const WORLD_SIZE_VARIABLES: [&str; 3] = ["WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"];

/// At most this much of a process's environment is read.
const ENVIRON_LIMIT: u64 = 4 << 20;

/// Why a process cannot be preempted.
#[derive(Debug, PartialEq, Eq)]
pub enum Refusal {
    /// An MPS client, and what shows it.
    Mps(String),
    /// A rank of a distributed job: the variable and its value.
    Rank(&'static str, u64),
}

impl Refusal {
    /// The refusal's reason for pid `pid`, with what to do.
    fn reason(&self, pid: u32) -> String {
        match self {
            Self::Mps(shown) => format!(
                "an MPS client (pid {pid}: {shown}): cuda-checkpoint cannot checkpoint an MPS client (it \
                 fails to lock one with \"operation not supported\"); nothing was locked: the container runs \
                 as before. Run it outside MPS to make it preemptible"
            ),
            Self::Rank(var, size) => format!(
                "a rank of a distributed job (pid {pid}: {var}={size}): its peers wait on it in every \
                 collective, and locking one rank hangs the others, so a park would stall or end the job; \
                 nothing was locked: the container runs as before. Leave a distributed job without \
                 baton.io/preemptible and do not preempt it; a single-process job ({var} unset or 1) can be \
                 preempted"
            ),
        }
    }
}

/// What makes the process with environment `environ` (NUL-separated `KEY=VALUE`) and mount table
/// `mountinfo` unpreemptible, if anything.
pub fn refusal_of(environ: &[u8], mountinfo: &str) -> Option<Refusal> {
    let vars: Vec<(&[u8], &[u8])> = environ
        .split(|b| *b == 0)
        .filter_map(|kv| {
            let eq = kv.iter().position(|b| *b == b'=')?;
            Some((&kv[..eq], &kv[eq + 1..]))
        })
        .collect();
    let value = |name: &str| {
        vars.iter()
            .find(|(k, _)| *k == name.as_bytes())
            .map(|(_, v)| *v)
    };
    if let Some(dir) = value("CUDA_MPS_PIPE_DIRECTORY").filter(|v| !v.is_empty()) {
        return Some(Refusal::Mps(format!(
            "CUDA_MPS_PIPE_DIRECTORY={}",
            String::from_utf8_lossy(dir)
        )));
    }
    if mounted_at(mountinfo, DEFAULT_MPS_PIPE_DIRECTORY) {
        return Some(Refusal::Mps(format!(
            "the MPS pipe directory {DEFAULT_MPS_PIPE_DIRECTORY} is mounted"
        )));
    }
    WORLD_SIZE_VARIABLES.into_iter().find_map(|var| {
        let size = std::str::from_utf8(value(var)?).ok()?.trim().parse().ok()?;
        (size > 1).then_some(Refusal::Rank(var, size))
    })
}

/// Whether `mountinfo` (the format of /proc/PID/mountinfo) has a mount at `point`.
fn mounted_at(mountinfo: &str, point: &str) -> bool {
    mountinfo
        .lines()
        .filter_map(|line| line.split(' ').nth(4))
        .any(|p| p == point)
}

/// What makes `pid` unpreemptible, read from /proc (`None` when it is not readable: a process gone
/// meanwhile is the preemption's to find).
fn refusal_of_pid(pid: u32) -> Option<Refusal> {
    let mut environ = Vec::new();
    std::fs::File::open(format!("/proc/{pid}/environ"))
        .and_then(|f| f.take(ENVIRON_LIMIT).read_to_end(&mut environ))
        .ok()?;
    let mountinfo = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap_or_default();
    refusal_of(&environ, &mountinfo)
}

impl Container {
    /// Refuses `action` (a preemption or a checkpoint) of processes `pids` when one of them cannot be
    /// preempted (see the module comment).
    pub(super) fn refuse_unpreemptible(&self, pids: &[u32], action: &'static str) -> Result<()> {
        for &pid in pids {
            if let Some(r) = refusal_of_pid(pid) {
                tracing::info!(id = %self.id, pid, "{action} refused: {r:?}");
                return Err(ShimError::FailedPrecondition {
                    id: self.id.clone(),
                    action,
                    state: r.reason(pid),
                });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTS: &str = "\
612 530 0:52 / / rw,relatime - overlay overlay rw,lowerdir=/l
613 612 0:54 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw
620 612 0:60 / /tmp rw,relatime - tmpfs tmpfs rw
";

    fn env(vars: &[&str]) -> Vec<u8> {
        let mut out = Vec::new();
        for v in vars {
            out.extend_from_slice(v.as_bytes());
            out.push(0);
        }
        out
    }

    #[test]
    fn an_mps_client_is_told_by_its_pipe_directory_variable_or_the_default_directory_mounted() {
        assert_eq!(
            refusal_of(
                &env(&["PATH=/bin", "CUDA_MPS_PIPE_DIRECTORY=/mps/pipe"]),
                MOUNTS
            ),
            Some(Refusal::Mps("CUDA_MPS_PIPE_DIRECTORY=/mps/pipe".into()))
        );
        let mounted =
            format!("{MOUNTS}630 620 0:70 /run/mps /tmp/nvidia-mps rw,relatime - tmpfs tmpfs rw\n");
        assert_eq!(
            refusal_of(&env(&["PATH=/bin"]), &mounted),
            Some(Refusal::Mps(
                "the MPS pipe directory /tmp/nvidia-mps is mounted".into()
            ))
        );
        // Set but empty, a directory of that name deeper down, or a variable that only ends so: no client.
        let deeper = format!("{MOUNTS}630 620 0:70 / /tmp/nvidia-mps/log rw - tmpfs tmpfs rw\n");
        assert_eq!(
            refusal_of(
                &env(&["CUDA_MPS_PIPE_DIRECTORY=", "MY_CUDA_MPS_PIPE_DIRECTORY=/x"]),
                &deeper
            ),
            None
        );
    }

    #[test]
    fn a_rank_of_a_job_of_more_than_one_process_is_told_by_its_world_size() {
        let rank = |vars: &[&str]| refusal_of(&env(vars), MOUNTS);
        assert_eq!(
            rank(&["RANK=1", "WORLD_SIZE=8", "LOCAL_RANK=1"]),
            Some(Refusal::Rank("WORLD_SIZE", 8))
        );
        assert_eq!(
            rank(&["OMPI_COMM_WORLD_SIZE=2"]),
            Some(Refusal::Rank("OMPI_COMM_WORLD_SIZE", 2))
        );
        assert_eq!(rank(&["PMI_SIZE=4"]), Some(Refusal::Rank("PMI_SIZE", 4)));
        // A job of one process, a size that is no number, a name that only contains it: preemptible.
        assert_eq!(rank(&["WORLD_SIZE=1", "RANK=0"]), None);
        assert_eq!(rank(&["WORLD_SIZE=two", "LOCAL_WORLD_SIZE=4"]), None);
        assert_eq!(rank(&[]), None);
        // A value may hold '=' and the last entry may lack its NUL.
        assert_eq!(
            refusal_of(b"A=b=c\0WORLD_SIZE=3", MOUNTS),
            Some(Refusal::Rank("WORLD_SIZE", 3))
        );
    }

    #[test]
    fn each_reason_names_the_pid_what_shows_it_and_what_to_do() {
        let mps = Refusal::Mps("CUDA_MPS_PIPE_DIRECTORY=/p".into()).reason(7);
        assert!(mps.contains("pid 7: CUDA_MPS_PIPE_DIRECTORY=/p"), "{mps}");
        assert!(mps.contains("Run it outside MPS"), "{mps}");
        let rank = Refusal::Rank("WORLD_SIZE", 2).reason(7);
        assert!(rank.contains("pid 7: WORLD_SIZE=2"), "{rank}");
        assert!(rank.contains("without baton.io/preemptible"), "{rank}");
    }

    #[test]
    fn a_process_is_read_from_proc() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .env("WORLD_SIZE", "2")
            .spawn()
            .unwrap();
        // The parent of a vfork-style spawn goes on before the child's new stack holds its environment:
        // read until it does.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let got = loop {
            let environ = std::fs::read(format!("/proc/{}/environ", child.id())).unwrap();
            if !environ.is_empty() || std::time::Instant::now() > deadline {
                break refusal_of_pid(child.id());
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        };
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(got, Some(Refusal::Rank("WORLD_SIZE", 2)));
        // A process gone is the preemption's to find.
        assert_eq!(refusal_of_pid(child.id()), None);
    }
}
