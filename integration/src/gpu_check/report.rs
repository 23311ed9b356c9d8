//! The kit's findings: `report.json` in the output folder, written again after each part so that a run cut
//! short (a failure, a device session's end) leaves what it measured, and the table printed at the end (also
//! kept as `table.md`). Every part says whether it passed, failed (and what was seen), was unavailable on
//! this machine (and why), or was not run.
use std::path::Path;

use anyhow::Result;
use serde::Serialize;

use super::{checkpoint::CheckpointResult, machine::Machine, table, trace_run::TraceResult};

/// How a part ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Everything it checks held.
    Passed,
    /// Something it checks did not hold, or a step failed: `problems` says what, with what was seen.
    Failed,
    /// This machine lacks what it needs (a program, a library): `problems` says what.
    Unavailable,
    /// Not reached: `problems` says why.
    NotRun,
}

/// One part of the run and what it found (as far as it got).
#[derive(Clone, Debug, Serialize)]
pub struct Part<T> {
    /// How it ended.
    pub status: Status,
    /// What failed, or why it was unavailable or not run; empty when it passed.
    pub problems: Vec<String>,
    /// What it measured, also when it failed part of the way.
    #[serde(flatten)]
    pub found: Option<T>,
}

impl<T> Part<T> {
    /// A part not reached.
    pub fn not_run(why: impl Into<String>) -> Self {
        Self {
            status: Status::NotRun,
            problems: vec![why.into()],
            found: None,
        }
    }

    /// A part this machine cannot run.
    pub fn unavailable(why: impl Into<String>) -> Self {
        Self {
            status: Status::Unavailable,
            problems: vec![why.into()],
            found: None,
        }
    }

    /// A part that ran: passed when nothing went wrong.
    pub fn ran(found: Option<T>, problems: Vec<String>) -> Self {
        Self {
            status: if problems.is_empty() {
                Status::Passed
            } else {
                Status::Failed
            },
            problems,
            found,
        }
    }
}

/// The run as a whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Overall {
    /// Every part ran and passed.
    Passed,
    /// A part failed.
    Failed,
    /// None failed, but some could not run here.
    Partial,
}

impl Overall {
    /// The kit's exit status: 0 passed, 1 failed, 3 partial.
    pub fn exit_code(self) -> i32 {
        match self {
            Overall::Passed => 0,
            Overall::Failed => 1,
            Overall::Partial => 3,
        }
    }
}

/// Everything one run found.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// Run on the FUSE mock, not a GPU.
    pub mock: bool,
    /// `--quick`: smaller sizes, one park/resume per way.
    pub quick: bool,
    /// The driver version the trace was decoded with.
    pub driver_version: String,
    /// The GPUs (`nvidia-smi`) and PyTorch; none on the mock.
    pub machine: Option<Machine>,
    /// The trace part.
    pub trace: Part<TraceResult>,
    /// The checkpoint part, with the seeds' loop in each park.
    pub checkpoint: CheckpointResult,
    /// The run as a whole.
    pub overall: Overall,
    /// `part: problem` for each failed part.
    pub failed: Vec<String>,
    /// `part: why` for each part unavailable or not run.
    pub not_measured: Vec<String>,
}

impl Report {
    /// Works out the overall result from the parts, then writes `report.json` and `table.md` into `out`.
    pub fn write(&mut self, out: &Path) -> Result<()> {
        self.judge();
        std::fs::write(
            out.join("report.json"),
            serde_json::to_string_pretty(self)? + "\n",
        )?;
        std::fs::write(out.join("table.md"), self.table())?;
        Ok(())
    }

    /// The table: one row per figure.
    pub fn table(&self) -> String {
        table::render(self)
    }

    fn judge(&mut self) {
        let mut parts = vec![("trace".to_owned(), self.trace.status, &self.trace.problems)];
        for w in &self.checkpoint.ways {
            let name = w.found.as_ref().map_or("?", |f| f.way.as_str());
            parts.push((format!("checkpoint via {name}"), w.status, &w.problems));
        }
        self.failed.clear();
        self.not_measured.clear();
        for (name, status, problems) in parts {
            let target = match status {
                Status::Passed => continue,
                Status::Failed => &mut self.failed,
                Status::Unavailable | Status::NotRun => &mut self.not_measured,
            };
            target.extend(problems.iter().map(|p| format!("{name}: {p}")));
        }
        self.overall = if !self.failed.is_empty() {
            Overall::Failed
        } else if !self.not_measured.is_empty() {
            Overall::Partial
        } else {
            Overall::Passed
        };
    }
}
