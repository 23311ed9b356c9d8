//! The analog's arms (server alone, co-runner free, the agent's shield and governor, the seed's SIGSTOP
//! shield), one run of each at a load, and their figures as ratios to the server alone.
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use nix::sys::signal::Signal;
use serde_json::{Value, json};

use super::{
    generator::{self, Load, RequestRecord},
    rig::{AnalogRig, ProxyShield},
};

/// One way of running the server beside (or without) the co-runner.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arm {
    /// No co-runner (run before it starts).
    Alone,
    /// The co-runner runs unchecked.
    Free,
    /// The proxy SIGSTOPs the co-runner from a request's start to its first token (the 000 seed's method).
    SigstopShield,
    /// The agent's prefill shield, fed by the proxy.
    Shield,
    /// The agent's shield and decode governor at this target stretch.
    Governor(f64),
}

impl Arm {
    /// Its name in the tables.
    pub fn name(self) -> String {
        match self {
            Arm::Alone => "server alone".into(),
            Arm::Free => "co-runner free".into(),
            Arm::SigstopShield => "SIGSTOP shield (seed)".into(),
            Arm::Shield => "shield (agent)".into(),
            Arm::Governor(t) => format!("governor {t} (agent)"),
        }
    }

    /// Whether it needs the agent's co-runner controller.
    pub fn uses_agent(self) -> bool {
        matches!(self, Arm::Shield | Arm::Governor(_))
    }

    fn proxy_shield(self) -> ProxyShield {
        match self {
            Arm::Alone | Arm::Free => ProxyShield::Forward,
            Arm::SigstopShield => ProxyShield::Sigstop,
            Arm::Shield | Arm::Governor(_) => ProxyShield::Agent,
        }
    }
}

/// What a run of an arm measured.
#[derive(Clone, Debug)]
pub struct ArmRun {
    /// Which arm.
    pub arm: Arm,
    /// The requests' figures.
    pub figures: Figures,
    /// The co-runner's units per second over the run (`None` alone).
    pub co_runner_rate: Option<f64>,
    /// The agent's controller at the end of the run (`status`'s `controller`), for the agent's arms.
    pub controller: Option<Value>,
}

/// Percentiles of one arm's requests.
#[derive(Clone, Debug, Default)]
pub struct Figures {
    /// Requests measured.
    pub requests: usize,
    /// Requests that failed (not in the figures).
    pub failed: usize,
    /// Total latency, p50.
    pub latency_p50: Duration,
    /// Total latency, p95.
    pub latency_p95: Duration,
    /// Latency to the first token, p50.
    pub first_token_p50: Duration,
    /// Latency to the first token, p95.
    pub first_token_p95: Duration,
    /// Every gap between tokens, p95.
    pub gap_p95: Duration,
    /// The mean gap of each request (TPOT), p95.
    pub tpot_p95: Duration,
}

impl Figures {
    /// The figures of `records` (failed ones counted apart).
    pub fn of(records: &[RequestRecord]) -> Self {
        let ok: Vec<&RequestRecord> = records.iter().filter(|r| r.error.is_none()).collect();
        let totals: Vec<Duration> = ok.iter().map(|r| r.total).collect();
        let firsts: Vec<Duration> = ok.iter().filter_map(|r| r.first_token()).collect();
        let gaps: Vec<Duration> = ok.iter().flat_map(|r| r.gaps()).collect();
        let tpots: Vec<Duration> = ok.iter().filter_map(|r| r.tpot()).collect();
        Self {
            requests: ok.len(),
            failed: records.len() - ok.len(),
            latency_p50: percentile(totals.clone(), 0.5),
            latency_p95: percentile(totals, 0.95),
            first_token_p50: percentile(firsts.clone(), 0.5),
            first_token_p95: percentile(firsts, 0.95),
            gap_p95: percentile(gaps, 0.95),
            tpot_p95: percentile(tpots, 0.95),
        }
    }
}

/// The `p` quantile (0 to 1, nearest rank) of `v`; zero when empty.
pub fn percentile(mut v: Vec<Duration>, p: f64) -> Duration {
    v.sort_unstable();
    let rank = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len().max(1));
    v.get(rank - 1).copied().unwrap_or_default()
}

/// One run of an arm: its measured requests and the co-runner's progress over them.
#[derive(Clone, Debug, Default)]
pub struct Sample {
    /// The requests that arrived after the warm-up.
    pub records: Vec<RequestRecord>,
    /// The co-runner's units of work over the measured part (0 without a co-runner).
    pub units: u64,
    /// The measured part's length, s.
    pub secs: f64,
    /// The agent's controller at its end (`status`'s `controller`), for the agent's arms.
    pub controller: Option<Value>,
}

impl ArmRun {
    /// The figures of `samples` of `arm` together (runs of it alternated with the other arms' in rounds, so
    /// that a change in the machine's load falls on every arm alike).
    pub fn of(arm: Arm, samples: &[Sample]) -> Self {
        let records: Vec<RequestRecord> = samples.iter().flat_map(|s| s.records.clone()).collect();
        let secs: f64 = samples.iter().map(|s| s.secs).sum();
        let units: u64 = samples.iter().map(|s| s.units).sum();
        Self {
            arm,
            figures: Figures::of(&records),
            co_runner_rate: (arm != Arm::Alone && secs > 0.0).then(|| units as f64 / secs),
            controller: samples.iter().rev().find_map(|s| s.controller.clone()),
        }
    }
}

/// Runs `arm` once at `load` ([`sample_arm`]) and gives its figures.
pub fn run_arm(rig: &AnalogRig, arm: Arm, load: &Load, warmup: Duration) -> Result<ArmRun> {
    let run = ArmRun::of(arm, &[sample_arm(rig, arm, load, warmup)?]);
    if run.figures.requests == 0 {
        bail!("{}: no request succeeded", arm.name());
    }
    Ok(run)
}

/// Runs `arm` at `load`: the proxy in front of the server, the generator's requests through it for
/// `warmup` (not measured: the governor learns) plus `load.duration`, the co-runner's progress read over
/// the measured part. The server alone: the co-runner, if started, is SIGSTOPped meanwhile. Leaves the
/// co-runner running.
pub fn sample_arm(rig: &AnalogRig, arm: Arm, load: &Load, warmup: Duration) -> Result<Sample> {
    let co_runner_up = rig.co_runner_units().is_ok();
    if arm == Arm::Alone && co_runner_up {
        rig.signal_co_runner(Signal::SIGSTOP)?;
    }
    if let Arm::Governor(target) = arm {
        rig.governor_on(target)?;
    }
    let proxy = rig.proxy(arm.proxy_shield())?;
    let all = Load {
        duration: warmup + load.duration,
        ..load.clone()
    };
    let progress = || {
        let units = if co_runner_up {
            rig.co_runner_units().unwrap_or(0)
        } else {
            0
        };
        (Instant::now(), units)
    };
    let (records, (t0, u0), (t1, u1)) = std::thread::scope(|s| {
        let generated = s.spawn(|| generator::run(proxy.socket(), &all));
        // The measured window starts when the warm-up's arrivals end.
        std::thread::sleep(warmup);
        let from = progress();
        let records = generated.join();
        (records, from, progress())
    });
    let Ok(records) = records else {
        bail!("the request generator panicked");
    };
    let controller = match arm.uses_agent() {
        true => Some(rig.agent_call(json!({"op": "status"}))?["controller"].take()),
        false => None,
    };
    if let Arm::Governor(_) = arm {
        rig.governor_off()?;
    }
    let errors = proxy.errors();
    drop(proxy);
    if co_runner_up {
        rig.wait_co_runner_running()?;
    }
    let records: Vec<RequestRecord> = records
        .into_iter()
        .filter(|r| r.arrival >= warmup)
        .collect();
    if records.iter().all(|r| r.error.is_some()) {
        bail!(
            "{}: no request succeeded; the proxy said:\n{errors}",
            arm.name()
        );
    }
    Ok(Sample {
        records,
        units: u1.saturating_sub(u0),
        secs: t1.duration_since(t0).as_secs_f64(),
        controller,
    })
}

/// The co-runner's progress over `window` with no request.
pub fn solo_sample(rig: &AnalogRig, window: Duration) -> Result<Sample> {
    let (t0, u0) = (Instant::now(), rig.co_runner_units()?);
    std::thread::sleep(window);
    let (t1, u1) = (Instant::now(), rig.co_runner_units()?);
    Ok(Sample {
        units: u1.saturating_sub(u0),
        secs: t1.duration_since(t0).as_secs_f64(),
        ..Sample::default()
    })
}

/// The co-runner's units per second over `window` with no request.
pub fn solo_rate(rig: &AnalogRig, window: Duration) -> Result<f64> {
    rate(&[solo_sample(rig, window)?])
}

/// Units per second over `samples` together.
pub fn rate(samples: &[Sample]) -> Result<f64> {
    let secs: f64 = samples.iter().map(|s| s.secs).sum();
    anyhow::ensure!(secs > 0.0, "no time measured");
    Ok(samples.iter().map(|s| s.units).sum::<u64>() as f64 / secs)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn ratio(d: Duration, base: Duration) -> f64 {
    d.as_secs_f64() / base.as_secs_f64().max(1e-9)
}

/// A table of `runs` against `alone`, the co-runner's share against `solo` units/s (Markdown).
pub fn table(alone: &Figures, runs: &[ArmRun], solo: f64) -> String {
    let mut out = format!(
        "server alone: latency p50 {:.1} ms, p95 {:.1} ms; first token p95 {:.1} ms; token gap p95 {:.2} ms; TPOT p95 {:.2} ms\n\n",
        ms(alone.latency_p50),
        ms(alone.latency_p95),
        ms(alone.first_token_p95),
        ms(alone.gap_p95),
        ms(alone.tpot_p95)
    );
    out.push_str(
        "| arm | requests | latency p50 | latency p95 | first token p95 | token gap p95 | TPOT p95 | co-runner share |\n",
    );
    out.push_str("|---|---|---|---|---|---|---|---|\n");
    for run in runs {
        let f = &run.figures;
        let share = run.co_runner_rate.map_or("-".into(), |r| {
            format!("{:.1}%", 100.0 * r / solo.max(1e-9))
        });
        let failed = if f.failed > 0 {
            format!(" ({} failed)", f.failed)
        } else {
            String::new()
        };
        out.push_str(&format!(
            "| {} | {}{failed} | {:.2}x | {:.2}x | {:.2}x | {:.2}x | {:.2}x | {share} |\n",
            run.arm.name(),
            f.requests,
            ratio(f.latency_p50, alone.latency_p50),
            ratio(f.latency_p95, alone.latency_p95),
            ratio(f.first_token_p95, alone.first_token_p95),
            ratio(f.gap_p95, alone.gap_p95),
            ratio(f.tpot_p95, alone.tpot_p95),
        ));
    }
    out
}

/// One line on what the controller did in an agent arm: the governor's estimate and share, the co-runner's
/// freezes.
pub fn controller_line(run: &ArmRun) -> Option<String> {
    let c = run.controller.as_ref()?;
    let co = &c["co_runners"][0];
    let governor = match &c["governor"] {
        Value::Null => String::new(),
        g => format!(
            "measured stretch {:.2}, run share {:.2} ({} gaps running, {} frozen); ",
            g["stretch"].as_f64().unwrap_or(f64::NAN),
            g["run_share"].as_f64().unwrap_or(f64::NAN),
            g["gaps_running"],
            g["gaps_frozen"]
        ),
    };
    Some(format!(
        "{}: {governor}co-runner {} freezes, longest {:.1} ms, last freeze {:.2} ms / thaw {:.2} ms to confirm",
        run.arm.name(),
        co["freezes"],
        co["longest_frozen_ns"].as_f64().unwrap_or(0.0) / 1e6,
        co["last_freeze_ns"].as_f64().unwrap_or(f64::NAN) / 1e6,
        co["last_thaw_ns"].as_f64().unwrap_or(f64::NAN) / 1e6,
    ))
}
