//! The /proc reads whose cost grows with what tenants hold (every fd and every maps line of a process: a
//! tenant with a million mappings has 50 MB of maps text, 0.7 s to read here) run on tokio's blocking pool,
//! never on the core's thread: the held containers' periodic check of the mirror ([`super::reconcile`]) and
//! the gate's node-wide look for holders the probes do not follow ([`crate::gate`]). The core hands a read
//! out and goes on serving commands, records, releases and deadlines; the result comes back as a
//! [`Done`] through the core's loop.
//!
//! Bounds: at most two reads at once, one container check and one node scan; each held container is checked
//! once per period however long its check takes (the checks queue), and the gate's questions asked while a
//! scan is out wait for the next one. What a tenant's size costs is its own reads' time on a
//! pool thread: the release path (a released container's own processes, read on the core) and the
//! controller's lease renewals (on a thread of their own) never queue behind it.
use std::{
    collections::{BTreeSet, VecDeque},
    path::PathBuf,
    time::{Duration, Instant},
};

use baton_agent_api::ContainerRef;
use baton_tracer::{ReadTicket, seed::ProcRead};
use tokio::task::JoinSet;

use crate::holders::{NodeScan, ScanRequest, pids_of_cgroup_tree};

/// A read that came back.
pub enum Done {
    /// The processes of a held container, for its mirror check.
    Checked {
        /// The container.
        container: ContainerRef,
        /// The mirror's ticket, taken before the read began.
        ticket: ReadTicket,
        /// What /proc showed of each process.
        reads: Vec<ProcRead>,
        /// How long the read took.
        took: Duration,
    },
    /// The node, for the gate.
    Scanned(NodeScan),
}

/// A container check waiting for a free read.
struct Queued {
    container: ContainerRef,
    ticket: ReadTicket,
    dir: Option<PathBuf>,
    pids: BTreeSet<u32>,
    prefixes: Vec<String>,
}

/// The reads in flight and those waiting for a free one.
#[derive(Default)]
pub struct Offload {
    jobs: JoinSet<Done>,
    /// The containers whose check is in flight or queued.
    checking: BTreeSet<ContainerRef>,
    queued: VecDeque<Queued>,
    /// Whether a container check is in flight.
    check_running: bool,
    /// Whether a node scan is in flight.
    scanning: bool,
}

impl Offload {
    /// Whether container `c`'s check is in flight or queued.
    pub fn is_checking(&self, c: &ContainerRef) -> bool {
        self.checking.contains(c)
    }

    /// Whether a node scan is in flight.
    pub fn is_scanning(&self) -> bool {
        self.scanning
    }

    /// Reads the processes of container `container` (`pids`, and those of its cgroup tree `dir`) from /proc,
    /// now or when a read is free; `ticket` is the mirror's, taken now.
    pub fn check(
        &mut self,
        container: ContainerRef,
        ticket: ReadTicket,
        dir: Option<PathBuf>,
        pids: BTreeSet<u32>,
        prefixes: Vec<String>,
    ) {
        self.checking.insert(container.clone());
        self.queued.push_back(Queued {
            container,
            ticket,
            dir,
            pids,
            prefixes,
        });
        self.start_queued();
    }

    /// Scans the node for `request`; the caller has checked that no scan is out ([`Offload::is_scanning`]).
    pub fn scan(&mut self, request: ScanRequest) {
        debug_assert!(!self.scanning, "one node scan at a time");
        self.scanning = true;
        self.jobs
            .spawn_blocking(move || Done::Scanned(request.run()));
    }

    /// The next read that came back (never, while none is out).
    pub async fn next_done(&mut self) -> Done {
        loop {
            match self.jobs.join_next().await {
                Some(Ok(done)) => {
                    match &done {
                        Done::Checked { container, .. } => {
                            self.checking.remove(container);
                            self.check_running = false;
                        }
                        Done::Scanned(_) => self.scanning = false,
                    }
                    self.start_queued();
                    return done;
                }
                // A read that panicked has ended the agent already (its panic hook); a cancelled one
                // (the core dropped) has no one to tell.
                Some(Err(e)) => tracing::error!("agent: a /proc read failed: {e}"),
                None => std::future::pending::<()>().await,
            }
        }
    }

    /// Starts the next queued check, unless one is running.
    fn start_queued(&mut self) {
        if self.check_running {
            return;
        }
        if let Some(q) = self.queued.pop_front() {
            self.check_running = true;
            self.jobs.spawn_blocking(move || {
                let began = Instant::now();
                let mut pids = q.pids;
                if let Some(dir) = &q.dir {
                    pids.extend(pids_of_cgroup_tree(dir));
                }
                let reads = pids
                    .into_iter()
                    .map(|pid| baton_tracer::seed::read_process(pid, &q.prefixes))
                    .collect();
                Done::Checked {
                    container: q.container,
                    ticket: q.ticket,
                    reads,
                    took: began.elapsed(),
                }
            });
        }
    }
}
