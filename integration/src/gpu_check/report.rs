//! The kit's findings: `report.json` in the output folder and the table printed on stdout.
use std::{fmt::Write as _, path::Path};

use anyhow::Result;
use serde::Serialize;

use super::{checkpoint::CheckpointResult, trace_run::TraceResult};

/// Everything one run found.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// Run on the FUSE mock, not a GPU.
    pub mock: bool,
    /// The driver version the trace was decoded with.
    pub driver_version: String,
    /// The trace part.
    pub trace: TraceResult,
    /// The checkpoint part.
    pub checkpoint: CheckpointResult,
}

impl Report {
    /// Writes `report.json` into `out`.
    pub fn write(&self, out: &Path) -> Result<()> {
        std::fs::write(
            out.join("report.json"),
            serde_json::to_string_pretty(self)? + "\n",
        )?;
        Ok(())
    }

    /// The table: one row per figure.
    pub fn table(&self) -> String {
        let t = &self.trace;
        let c = &t.counts;
        let nvml_why = t.nvml_unavailable.as_deref().unwrap_or("unavailable");
        let mut rows: Vec<(String, String)> = vec![
            ("driver".into(), self.driver_version.clone()),
            ("golden trace".into(), t.golden.display().to_string()),
            (
                "events / ioctls".into(),
                format!("{} / {}", c.events, c.ioctls),
            ),
            ("unknown escapes".into(), listed(&c.unknown_escapes)),
            ("unknown classes".into(), listed(&c.unknown_classes)),
            (
                "unknown control commands".into(),
                listed(&c.unknown_controls),
            ),
            ("unknown statuses".into(), listed(&c.unknown_statuses)),
            ("ledger peak GPU memory".into(), mib(t.ledger_peak_bytes)),
            (
                "NVML peak for the process".into(),
                t.nvml_peak_bytes.map_or_else(|| nvml_why.to_owned(), mib),
            ),
            (
                "last close -> release confirmed (agent)".into(),
                ms(t.close_to_released_ns),
            ),
            (
                "last close -> `released` at a subscriber".into(),
                ms(t.close_to_event_ns),
            ),
            (
                "last close -> gone from NVML (1 ms poll)".into(),
                t.close_to_nvml_gone_ns
                    .map_or_else(|| nvml_why.to_owned(), ms),
            ),
        ];
        let gib = self.checkpoint.gib as f64;
        for w in &self.checkpoint.ways {
            let name = &w.way;
            if let Some(why) = &w.unavailable {
                rows.push((
                    format!("checkpoint via {name}"),
                    format!("not measured: {why}"),
                ));
                continue;
            }
            rows.push((
                format!("park / resume {gib} GiB via {name}"),
                format!(
                    "{:.3} s / {:.3} s ({:.3} / {:.3} s per GiB)",
                    w.park_s,
                    w.resume_s,
                    w.park_s / gib,
                    w.resume_s / gib
                ),
            ));
            rows.push((
                format!("park request -> released (agent), via {name}"),
                format!("{:.3} s", w.request_to_released_s),
            ));
            rows.push((
                format!("park request -> NVML memory free, via {name}"),
                w.request_to_nvml_free_s.map_or_else(
                    || {
                        self.checkpoint
                            .nvml_unavailable
                            .clone()
                            .unwrap_or_else(|| "not seen".into())
                    },
                    |s| format!("{s:.3} s"),
                ),
            ));
            rows.push((
                format!("weights intact after resume, via {name}"),
                if w.intact { "yes" } else { "NO" }.into(),
            ));
        }
        let mut out = format!(
            "\n| baton gpu-check{} | |\n|---|---|\n",
            if self.mock { " (mock driver)" } else { "" }
        );
        for (k, v) in rows {
            let _ = writeln!(out, "| {k} | {v} |");
        }
        out
    }
}

fn listed(m: &std::collections::BTreeMap<String, u64>) -> String {
    if m.is_empty() {
        return "0".into();
    }
    let total: u64 = m.values().sum();
    let each: Vec<String> = m.iter().map(|(k, n)| format!("{k} x{n}")).collect();
    format!("{total}: {}", each.join(", "))
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

fn ms(ns: u64) -> String {
    format!("{:.3} ms", ns as f64 / 1e6)
}
