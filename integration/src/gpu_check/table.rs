//! The kit's table (Markdown, one row per figure), for whatever ran: a part that failed shows what it
//! measured before it failed and what went wrong; one unavailable or not run says why.
use std::{collections::BTreeMap, fmt::Write as _};

use super::{
    checkpoint::{Cycle, WayResult},
    cycle::RELEASE_GOAL_MS,
    report::{Overall, Part, Report, Status},
};

/// Rows being gathered.
type Rows = Vec<(String, String)>;

/// The table of `report`.
pub fn render(report: &Report) -> String {
    let mut rows: Rows = vec![
        ("result".into(), overall(report)),
        ("driver".into(), report.driver_version.clone()),
    ];
    if let Some(m) = &report.machine {
        let gpus = match &m.nvidia_smi_unavailable {
            Some(why) => format!("unknown: {why}"),
            None => m.gpus.join("; "),
        };
        rows.push(("GPUs (nvidia-smi)".into(), gpus));
        let torch = m.torch.clone().or_else(|| m.torch_unavailable.clone());
        rows.push(("PyTorch".into(), torch.unwrap_or_default()));
    }
    trace_rows(&report.trace, &mut rows);
    checkpoint_rows(report, &mut rows);
    for problem in &report.failed {
        rows.push(("FAILED".into(), problem.clone()));
    }
    for why in &report.not_measured {
        rows.push(("not measured".into(), why.clone()));
    }
    let mut out = format!(
        "\n| baton gpu-check{}{} | |\n|---|---|\n",
        if report.mock { " (mock driver)" } else { "" },
        if report.quick { " --quick" } else { "" }
    );
    for (k, v) in rows {
        let _ = writeln!(out, "| {k} | {} |", v.replace('|', "/"));
    }
    out
}

fn overall(report: &Report) -> String {
    match report.overall {
        Overall::Passed => "PASSED".into(),
        Overall::Failed => format!("FAILED ({} problems, listed below)", report.failed.len()),
        Overall::Partial => format!(
            "PARTIAL: nothing failed, {} not measured (listed below)",
            report.not_measured.len()
        ),
    }
}

fn trace_rows(part: &Part<super::trace_run::TraceResult>, rows: &mut Rows) {
    let Some(t) = &part.found else {
        rows.push(("trace".into(), status_line(part.status, &part.problems)));
        return;
    };
    let nvml_why = t.nvml_unavailable.as_deref().unwrap_or("unavailable");
    rows.push(("golden trace".into(), t.golden.display().to_string()));
    if let Some(c) = &t.counts {
        rows.extend([
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
        ]);
    }
    rows.extend([
        (
            "ledger peak GPU memory".into(),
            opt(t.ledger_peak_bytes, mib),
        ),
        (
            "NVML peak for the process".into(),
            t.nvml_peak_bytes.map_or_else(|| nvml_why.to_owned(), mib),
        ),
        (
            "last close -> release confirmed (agent)".into(),
            opt(t.close_to_released_ns, ms),
        ),
        (
            "last close -> `released` at a subscriber".into(),
            opt(t.close_to_event_ns, ms),
        ),
        (
            "last close -> gone from NVML (1 ms poll)".into(),
            t.close_to_nvml_gone_ns
                .map_or_else(|| nvml_why.to_owned(), ms),
        ),
        (
            "trace part".into(),
            status_line(part.status, &part.problems),
        ),
    ]);
}

fn checkpoint_rows(report: &Report, rows: &mut Rows) {
    let c = &report.checkpoint;
    let worker = c.no_worker.as_ref().map_or_else(
        || "with a worker forked after CUDA init".to_owned(),
        |why| format!("no worker ({why})"),
    );
    rows.push((
        "holder".into(),
        format!("{} GiB, {} park/resume per way, {worker}", c.gib, c.cycles),
    ));
    let nvml_why = c
        .nvml_unavailable
        .clone()
        .unwrap_or_else(|| "not seen".into());
    for part in &c.ways {
        let Some(w) = &part.found else { continue };
        let name = &w.way;
        if w.holder.is_none() && w.cycles.is_empty() {
            rows.push((
                format!("checkpoint via {name}"),
                status_line(part.status, &part.problems),
            ));
            continue;
        }
        way_rows(w, c.gib, &nvml_why, report.mock, rows);
        rows.push((
            format!("checkpoint via {name}"),
            status_line(part.status, &part.problems),
        ));
    }
}

fn way_rows(w: &WayResult, gib: u64, nvml_why: &str, mock: bool, rows: &mut Rows) {
    let name = &w.way;
    if let Some(h) = &w.holder {
        let beyond = h
            .ledger_bytes
            .map(|b| {
                format!(
                    " ({} beyond --gib)",
                    mib_signed(b as i128 - (i128::from(gib) << 30))
                )
            })
            .unwrap_or_default();
        rows.push((
            format!("holder's GPU memory, via {name}"),
            format!(
                "ledger {}{beyond}, peak {}; NVML {}; PyTorch reserved {}",
                opt(h.ledger_bytes, mib),
                opt(h.ledger_peak_bytes, mib),
                h.nvml_bytes.map_or_else(|| nvml_why.to_owned(), mib),
                if mock {
                    "none on the mock".into()
                } else {
                    opt(h.torch_reserved_bytes, mib)
                }
            ),
        ));
        let workers: Vec<String> = h
            .workers
            .iter()
            .map(|w| format!("pid {} with {} NVIDIA fds", w.pid, w.nvidia_fds))
            .collect();
        rows.push((
            format!("forked workers, via {name}"),
            if workers.is_empty() {
                "none".into()
            } else {
                workers.join(", ")
            },
        ));
    }
    let g = gib as f64;
    rows.push((
        format!("park / resume {gib} GiB via {name} (median)"),
        match (w.park_s, w.resume_s) {
            (Some(p), Some(r)) => format!(
                "{p:.3} s / {r:.3} s ({:.3} / {:.3} s per GiB)",
                p / g,
                r / g
            ),
            (Some(p), None) => format!("{p:.3} s / not resumed"),
            _ => "not parked".into(),
        },
    ));
    let each = |f: fn(&Cycle) -> Option<f64>, show: fn(f64) -> String| -> String {
        let shown: Vec<String> = w
            .cycles
            .iter()
            .map(|c| f(c).map_or_else(|| "none".into(), show))
            .collect();
        shown.join(", ")
    };
    let rows_of: [(&str, String); 6] = [
        (
            "checkpoint return -> released",
            format!(
                "{} (goal: at most {RELEASE_GOAL_MS} ms)",
                each(
                    |c| c.checkpoint_return_to_released_ms,
                    |v| format!("{v:+.1} ms")
                )
            ),
        ),
        (
            "park request -> released",
            each(|c| c.request_to_released_s, secs),
        ),
        (
            "park request -> gate open",
            each(|c| c.request_to_gate_open_s, secs),
        ),
        (
            "park request -> server started",
            each(|c| c.request_to_server_start_s, secs),
        ),
        (
            "park request -> server serving",
            each(|c| c.request_to_server_serving_s, secs),
        ),
        (
            "park request -> NVML memory free",
            each(|c| c.request_to_nvml_free_s, secs).replace("none", nvml_why),
        ),
    ];
    for (what, value) in rows_of {
        rows.push((format!("{what}, via {name}"), value));
    }
    rows.push((
        format!("weights intact after resume, via {name}"),
        match w.intact {
            Some(true) => "yes".into(),
            Some(false) => "NO".into(),
            None => "not checked".into(),
        },
    ));
}

fn status_line(status: Status, problems: &[String]) -> String {
    let word = match status {
        Status::Passed => return "passed".into(),
        Status::Failed => "FAILED",
        Status::Unavailable => "unavailable",
        Status::NotRun => "not run",
    };
    format!("{word}: {}", problems.join("; "))
}

fn listed(m: &BTreeMap<String, u64>) -> String {
    if m.is_empty() {
        return "0".into();
    }
    let total: u64 = m.values().sum();
    let each: Vec<String> = m.iter().map(|(k, n)| format!("{k} x{n}")).collect();
    format!("{total}: {}", each.join(", "))
}

fn opt(v: Option<u64>, show: fn(u64) -> String) -> String {
    v.map_or_else(|| "not measured".into(), show)
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

fn mib_signed(bytes: i128) -> String {
    format!("{:+.1} MiB", bytes as f64 / (1u64 << 20) as f64)
}

fn ms(ns: u64) -> String {
    format!("{:.3} ms", ns as f64 / 1e6)
}

fn secs(s: f64) -> String {
    format!("{s:.3} s")
}
