//! The bench's tables: the exclusive arms against the seed's figures, and the room arms against the exclusive
//! arm and the server alone on the same arrivals.
use std::time::Duration;

use baton_integration::analog::arms::percentile;
use serde_json::Value;

use super::{Arm, Config, Outcome, SEED_C_S, SEED_FIGURES, STEP_MS};

pub(super) fn report(cfg: &Config, solo: f64, results: &[(f64, usize, Outcome)]) {
    println!(
        "\n| req/min | arm | requests | trainer share | 1 - rate*C/3600 | p50 | p95 | preemptions/h | C | C vs \
         sequential | seed: share, p95 |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for (rate, count, o) in results {
        let share = share_of(cfg, solo, o);
        let per_hour = o.preemptions * 3600.0 / cfg.seed_s(cfg.window);
        let c = o.c.map(|c| cfg.seed_s(c));
        let line = c.map_or("-".into(), |c| pct(1.0 - per_hour * c / 3600.0));
        let sequential = find(results, *rate, Arm::Sequential).and_then(|s| s.c);
        let vs = match (o.c, sequential) {
            (Some(a), Some(b)) => ratio(a.as_secs_f64(), b.as_secs_f64()),
            _ => "-".into(),
        };
        println!(
            "| {rate} | {} | {} | {} | {line} | {} | {} | {per_hour:.0} | {} | {vs} | {} |",
            o.arm.name(),
            requests(o, *count),
            share.map_or("-".into(), pct),
            secs(cfg, percentile(o.latencies.clone(), 0.5)),
            secs(cfg, percentile(o.latencies.clone(), 0.95)),
            c.map_or("-".into(), |c| format!("{c:.2} s")),
            seed_figures(*rate, o.arm),
        );
    }
    let refused: usize = results.iter().map(|(_, _, o)| o.refused).sum();
    println!(
        "\nthe seed's C: {:.2} s overlapped, {:.2} s sequential (its orchestrator is its overlapped arm); \
         request events refused by the agent's controller (its input silence passed while the request \
         waited): {refused}",
        SEED_C_S.0, SEED_C_S.1
    );
}

/// The room arms beside the exclusive one (overlapped) and the server alone, at each rate.
pub(super) fn report_room(cfg: &Config, solo: f64, results: &[(f64, usize, Outcome)]) {
    if !cfg.arms.iter().any(|a| a.room()) {
        return;
    }
    println!(
        "\nroom arms against the exclusive arm (overlapped) and the server alone, on the same arrivals:\n\n\
         | req/min | arm | requests | server Start | trainer parks | trainer frozen by the controller | \
         trainer share | share vs exclusive | p50 | p95 | p95 vs exclusive | mean latency vs alone | \
         TPOT vs alone |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let shown = [Arm::Overlapped, Arm::Beside, Arm::Governor, Arm::Alone];
    for (rate, count, o) in results.iter().filter(|(_, _, o)| shown.contains(&o.arm)) {
        let exclusive = find(results, *rate, Arm::Overlapped);
        let alone = find(results, *rate, Arm::Alone);
        let share = share_of(cfg, solo, o);
        let share_vs = match (share, exclusive.and_then(|e| share_of(cfg, solo, e))) {
            (Some(a), Some(b)) => ratio(a, b),
            _ => "-".into(),
        };
        let p95 = |o: &Outcome| percentile(o.latencies.clone(), 0.95).as_secs_f64();
        let frozen = o.frozen.map_or("-".into(), |(n, d)| {
            format!(
                "{n} freezes, {} of the time",
                pct(d.as_secs_f64() / cfg.window.as_secs_f64())
            )
        });
        println!(
            "| {rate} | {} | {} | {} | {} | {frozen} | {} | {share_vs} | {} | {} | {} | {} | {} |",
            o.arm.name(),
            requests(o, *count),
            o.start.map_or("-".into(), |d| format!(
                "{:.0} ms",
                d.as_secs_f64() * 1000.0
            )),
            if o.arm.has_trainer() {
                o.parks.to_string()
            } else {
                "-".into()
            },
            share.map_or("-".into(), pct),
            secs(cfg, percentile(o.latencies.clone(), 0.5)),
            secs(cfg, percentile(o.latencies.clone(), 0.95)),
            exclusive.map_or("-".into(), |e| ratio(p95(o), p95(e))),
            alone.map_or("-".into(), |a| ratio(
                mean(&o.latencies),
                mean(&a.latencies)
            )),
            alone.map_or("-".into(), |a| ratio(mean(&o.tpots), mean(&a.tpots))),
        );
    }
    for (rate, _, o) in results {
        let Some(g) = &o.governor else { continue };
        let ms = |v: &Value| {
            v.as_f64()
                .map_or("-".into(), |ns| format!("{:.2} ms", ns / 1e6))
        };
        println!(
            "\n{} at {rate}/min: the governor (target {}) measured a stretch of {} ({} gaps with the trainer \
             running, mean {}; {} with it frozen, mean {}) and gave it a run share of {} in windows with \
             decoding",
            o.arm.name(),
            g["target_stretch"],
            g["stretch"]
                .as_f64()
                .map_or("- (not measured)".into(), |s| format!("{s:.3}")),
            g["gaps_running"],
            ms(&g["mean_gap_running_ns"]),
            g["gaps_frozen"],
            ms(&g["mean_gap_frozen_ns"]),
            g["run_share"],
        );
    }
    println!(
        "\nserver Start: how long the Start call took (bench clock; the overlapped arm's waits at the gate for \
         the trainer's park). TPOT: a request's mean time per server step (bench clock {STEP_MS} ms). The \
         mock has no compute contention, so the server's steps do not slow beside a running trainer: the \
         ratios to the server alone are the machine's noise and the agent's work, not a GPU's TPOT cost."
    );
}

/// The outcome of `arm` at `rate`.
pub(super) fn find(results: &[(f64, usize, Outcome)], rate: f64, arm: Arm) -> Option<&Outcome> {
    results
        .iter()
        .find(|(r, _, o)| *r == rate && o.arm == arm)
        .map(|(_, _, o)| o)
}

/// The trainer's share of its solo rate (none without a trainer).
pub(super) fn share_of(cfg: &Config, solo: f64, o: &Outcome) -> Option<f64> {
    o.arm
        .has_trainer()
        .then(|| o.steps as f64 / cfg.window.as_secs_f64() / solo)
}

/// `served of count`, with the failures.
pub(super) fn requests(o: &Outcome, count: usize) -> String {
    let failed = if o.failed > 0 {
        format!(" ({} failed)", o.failed)
    } else {
        String::new()
    };
    format!("{}{failed} of {count}", o.latencies.len())
}

pub(super) fn mean(v: &[Duration]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.iter().map(Duration::as_secs_f64).sum::<f64>() / v.len() as f64
}

pub(super) fn ratio(a: f64, b: f64) -> String {
    if a.is_finite() && b.is_finite() && b > 0.0 {
        format!("{:.2}x", a / b)
    } else {
        "-".into()
    }
}

/// The seed's share and p95 of `arm` at `rate`, where it measured them.
pub(super) fn seed_figures(rate: f64, arm: Arm) -> String {
    let Some(&(_, o_share, o_p95, s_share, s_p95)) = SEED_FIGURES.iter().find(|(r, ..)| *r == rate)
    else {
        return "-".into();
    };
    match arm {
        Arm::Sequential => format!("{}, {s_p95} s", pct(s_share)),
        // The seed's overlapped arm polled GPU memory: its orchestrator.
        Arm::Overlapped | Arm::Orchestrator => format!("{}, {o_p95} s", pct(o_share)),
        Arm::Beside | Arm::Governor | Arm::Alone => "-".into(),
    }
}

pub(super) fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

pub(super) fn secs(cfg: &Config, d: Duration) -> String {
    format!("{:.2} s", cfg.seed_s(d))
}
