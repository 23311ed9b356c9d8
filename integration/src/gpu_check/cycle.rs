//! One way's measurement, step by step: the holder started and its memory checked against `--gib`, then
//! each cycle: a server registered and waiting on the gate, the park (lock, checkpoint), `released` awaited
//! for a bounded time after the checkpoint call returned, the server started when the gate opens and
//! stopped once it serves, the resume (restore, unlock) and the weights summed again. A step that fails
//! ends the way (a failed checkpoint is unlocked first, so the holder can exit); a check that does not hold
//! is recorded and the cycle goes on.
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow};
use baton_agent_api::now_monotonic_ns;
use baton_nvidia::cuda_checkpoint::Action;
use serde_json::Value;

use super::{
    checkpoint::{Cycle, HolderFigures, Session, WayResult, Worker, signed_s},
    gate::Gate,
    nvml_poll,
    watched::{STARTED, Watched, fds_on},
    ways::Way,
};
use crate::agent::{container_status, container_status_when};

/// The goal: `released` within this long of the checkpoint call's return (issue 28, item 9).
pub const RELEASE_GOAL_MS: f64 = 100.0;

/// Device memory a PyTorch process holds beyond its tensors: its CUDA context. On the H200 the traced
/// program's ledger peak was 1,950,351,360 bytes for 1,207,959,552 of tensors, 742,391,808 for the rest
/// (/work/shared/gpu/580.159.04/report.json); a holder may hold up to this much more than `--gib`.
const CONTEXT_ALLOWANCE: u64 = 1 << 30;

/// How long the ledger may take to show the holder's memory once it said it was ready.
const LEDGER_SETTLES: Duration = Duration::from_secs(3);

/// How much longer than `released` the gate may take to open.
const GATE_AFTER_RELEASE: Duration = Duration::from_secs(1);

impl Session<'_> {
    /// The holder, then its cycles; an `Err` is the step that ended the way.
    pub(super) fn hold_and_cycle(
        &mut self,
        name: &str,
        way: &mut Way,
        found: &mut WayResult,
        problems: &mut Vec<String>,
    ) -> Result<()> {
        let (rig, b) = (self.rig, &self.rig.bounds);
        let slug = name.replace(' ', "-");
        let id = format!("hold-{slug}");
        let mut holder = Watched::start(rig, self.conn, &id, &rig.holder_program())
            .context("starting the holder")?;
        if let Some(p) = self.poller {
            p.follow(holder.pid());
        }
        holder.go()?;
        let ready = if rig.mock { "phase holding" } else { "ready" };
        let (_, ready) = holder
            .line_starting(ready, b.within(b.program_ready))
            .context("the holder did not get ready")?;
        let before = field(&ready, "checksum");
        found.holder = Some(self.holder_figures(&id, &holder, &ready, problems));
        let expect_workers = found.holder.as_ref().map_or(0, |h| h.workers.len());
        for n in 1..=rig.cycles {
            if b.expired() {
                problems.push(format!(
                    "cycles {n} to {}: not run, --time-limit reached",
                    rig.cycles
                ));
                break;
            }
            let mut cycle = Cycle {
                n,
                ..Cycle::default()
            };
            let mut noted = Vec::new();
            let step = self.cycle(
                &id,
                &slug,
                &mut holder,
                way,
                before.as_deref(),
                &mut cycle,
                &mut noted,
            );
            if expect_workers > 0 && holder.other_pids().len() < expect_workers {
                noted.push("the forked worker did not live through the park and resume".to_owned());
            }
            let prefix = if rig.cycles > 1 {
                format!("cycle {n}: ")
            } else {
                String::new()
            };
            problems.extend(noted.into_iter().map(|p| format!("{prefix}{p}")));
            found.cycles.push(cycle);
            step.with_context(|| format!("{prefix}the park and resume stopped"))?;
        }
        match holder.finish(b.within(b.exit)) {
            Ok(true) => {}
            Ok(false) => problems.push(format!(
                "the holder exited with a failure; {}",
                holder.stderr_tail()
            )),
            Err(e) => problems.push(format!("{e:#}")),
        }
        let _ = holder.unregister(self.conn);
        Ok(())
    }

    /// What the holder holds once ready, by the ledger, NVML and PyTorch, and the workers it forked; a
    /// holder that does not hold `--gib` (plus its CUDA context) is a problem.
    fn holder_figures(
        &mut self,
        id: &str,
        holder: &Watched,
        ready: &str,
        problems: &mut Vec<String>,
    ) -> HolderFigures {
        let rig = self.rig;
        let want = rig.gib << 30;
        let fits = |bytes: u64| bytes >= want && bytes < want + CONTEXT_ALLOWANCE;
        let status =
            container_status_when(self.socket, id, rig.bounds.within(LEDGER_SETTLES), |s| {
                s["vram_bytes"].as_u64().is_some_and(fits)
            })
            .unwrap_or_else(|last| last);
        let figures = HolderFigures {
            pid: holder.pid(),
            ledger_bytes: status["vram_bytes"].as_u64(),
            ledger_peak_bytes: status["peak_vram_bytes"].as_u64(),
            nvml_bytes: self
                .poller
                .and_then(|p| p.snapshot().iter().rev().find_map(|s| s.process_bytes)),
            torch_reserved_bytes: field(ready, "reserved").and_then(|r| r.parse().ok()),
            workers: holder
                .other_pids()
                .into_iter()
                .map(|pid| Worker {
                    pid,
                    nvidia_fds: fds_on(pid, &rig.trace_prefix()),
                })
                .collect(),
        };
        let gib = rig.gib;
        match figures.ledger_bytes {
            Some(b) if fits(b) => {}
            Some(b) => problems.push(format!(
                "the holder of --gib {gib} holds {b} bytes by the ledger, not {gib} GiB plus at most 1 GiB of \
                 CUDA context"
            )),
            None => problems.push(format!("the agent shows no device memory for the holder: {status}")),
        }
        if let Some(n) = figures.nvml_bytes.filter(|n| !fits(*n)) {
            problems.push(format!(
                "the holder of --gib {gib} holds {n} bytes by NVML, not {gib} GiB plus at most 1 GiB of CUDA \
                 context"
            ));
        }
        if let Some(r) = figures.torch_reserved_bytes.filter(|r| *r != want) {
            problems.push(format!(
                "PyTorch keeps {r} bytes reserved in the holder, not exactly {gib} GiB"
            ));
        }
        if rig.worker.is_ok() {
            match figures.workers.as_slice() {
                [] => problems.push("the holder forked no worker that stayed".to_owned()),
                workers if workers.iter().any(|w| w.nvidia_fds == 0) => problems.push(format!(
                    "a forked worker holds no NVIDIA fd (the H200's held 31): {workers:?}"
                )),
                _ => {}
            }
        }
        figures
    }

    /// One park and resume with the seeds' loop; `Err` ends the way, `noted` gets the checks that failed.
    #[allow(
        clippy::too_many_arguments,
        reason = "one cycle's state, kept in the session's caller"
    )]
    fn cycle(
        &mut self,
        id: &str,
        slug: &str,
        holder: &mut Watched,
        way: &mut Way,
        before: Option<&str>,
        c: &mut Cycle,
        noted: &mut Vec<String>,
    ) -> Result<()> {
        let (rig, b) = (self.rig, &self.rig.bounds);
        let pid = holder.pid();
        // The seeds' loop: a server registered and waiting on the gate before the park is asked for.
        let server_id = format!("serve-{slug}-{}", c.n);
        let gate_timeout = b.call * 2 + b.release + Duration::from_secs(5);
        let waiting = Watched::start(rig, self.conn, &server_id, &rig.server_program())
            .map_err(|e| format!("cannot start the server: {e:#}"))
            .and_then(|server| {
                Gate::ask(self.socket, &server_id, gate_timeout)
                    .map(|gate| (server, gate))
                    .map_err(|e| format!("cannot ask the agent's gate: {e}"))
            });
        let call = |way: &mut Way, action| way.call(action, pid, b.lock_timeout, b.within(b.call));
        let requested = now_monotonic_ns();
        let locked = call(way, Action::Lock).map_err(|e| anyhow!(e))?;
        let returned = match call(way, Action::Checkpoint) {
            Ok(t) => t,
            Err(e) => {
                let undone = call(way, Action::Unlock)
                    .err()
                    .map_or_else(String::new, |u| {
                        format!("; unlocking it again failed too: {u}")
                    });
                return Err(anyhow!("{e}{undone}"));
            }
        };
        c.lock_s = Some(signed_s(locked, requested));
        c.checkpoint_s = Some(signed_s(returned, locked));
        c.park_s = Some(signed_s(returned, requested));
        let window_end = Instant::now() + b.within(b.release);
        let pids: Vec<u32> = std::iter::once(pid).chain(holder.other_pids()).collect();
        self.await_release(id, &pids, requested, returned, window_end, c, noted);
        match waiting {
            Ok((mut server, gate)) => {
                self.serve(&mut server, &gate, requested, window_end, c, noted);
                let _ = server.unregister(self.conn);
            }
            Err(why) => noted.push(format!("the seeds' loop did not run: {why}")),
        }
        c.request_to_nvml_free_s = self.nvml_free_after(requested);
        let resuming = Instant::now();
        call(way, Action::Restore).map_err(|e| anyhow!(e))?;
        call(way, Action::Unlock).map_err(|e| anyhow!(e))?;
        c.resume_s = Some(resuming.elapsed().as_secs_f64());
        // The mock checks its own weights at the restore (a mismatch fails it); PyTorch's are summed again.
        c.intact = Some(if rig.mock {
            true
        } else {
            holder.send_line("check")?;
            let (_, line) = holder.line_starting("checksum", b.within(b.program_ready))?;
            let after = line.split_whitespace().nth(1);
            if after != before {
                noted.push(format!(
                    "the weights changed across the park and resume: checksum {before:?} before, {after:?} after"
                ));
            }
            after == before
        });
        Ok(())
    }

    /// `released` of the holder after `requested`, until `window_end`: its time from the checkpoint call's
    /// return (signed), or a problem with what the agent shows instead.
    #[allow(
        clippy::too_many_arguments,
        reason = "one cycle's state, kept in the session's caller"
    )]
    fn await_release(
        &mut self,
        id: &str,
        pids: &[u32],
        requested: u64,
        returned: u64,
        window_end: Instant,
        c: &mut Cycle,
        noted: &mut Vec<String>,
    ) {
        let after_request = |e: &Value| e["t_released_ns"].as_u64() >= Some(requested);
        match self.events.first(id, "released", after_request, window_end) {
            Ok((_, event)) => {
                let t = event["t_released_ns"].as_u64().unwrap_or(0);
                let ms = signed_s(t, returned) * 1e3;
                c.request_to_released_s = Some(signed_s(t, requested));
                c.checkpoint_return_to_released_ms = Some(ms);
                c.confirmed_by = event["confirmed_by"].as_str().map(str::to_owned);
                if ms > RELEASE_GOAL_MS {
                    noted.push(format!(
                        "`released` came {ms:+.1} ms after the checkpoint call returned (goal: within \
                         {RELEASE_GOAL_MS} ms)"
                    ));
                }
            }
            Err(_) => {
                let seen = container_status(self.socket, id)
                    .ok()
                    .flatten()
                    .map_or_else(|| "nothing (not watched)".to_owned(), |s| describe(&s));
                let kinds = self.events.kinds_since(id, requested);
                let kernel = kernel_view(pids, &self.rig.trace_prefix());
                noted.push(format!(
                    "no `released` within {:?} of the checkpoint call's return; the agent shows {seen}; its \
                     events since the park request: {kinds:?}; /proc shows {kernel}",
                    self.rig.bounds.release
                ));
            }
        }
    }

    /// Starts the server once the gate opens (waited for until [`GATE_AFTER_RELEASE`] after `window_end`),
    /// then stops it once it serves.
    fn serve(
        &mut self,
        server: &mut Watched,
        gate: &Gate,
        requested: u64,
        window_end: Instant,
        c: &mut Cycle,
        noted: &mut Vec<String>,
    ) {
        let (rig, b) = (self.rig, &self.rig.bounds);
        let opened = match gate.opened_by(window_end + GATE_AFTER_RELEASE) {
            Ok(o) => o,
            Err(Some(why)) => {
                noted.push(format!("the server's gate did not open: {why}"));
                return;
            }
            Err(None) => {
                noted.push(format!(
                    "the server's gate was still shut {:?} after the checkpoint call returned",
                    b.release + GATE_AFTER_RELEASE
                ));
                return;
            }
        };
        c.request_to_gate_open_s = Some(signed_s(opened.arrived_ns, requested));
        if opened.t_free_ns < requested {
            noted.push(format!(
                "the gate opened {:.1} ms before the park was asked for: the agent did not count the holder \
                 as holding the GPU",
                signed_s(requested, opened.t_free_ns) * 1e3
            ));
        }
        let started = server
            .go()
            .and_then(|()| server.line_starting(STARTED, b.within(b.exit)));
        match started {
            Ok((t, _)) => c.request_to_server_start_s = Some(signed_s(t, requested)),
            Err(e) => {
                noted.push(format!("the server did not start: {e:#}"));
                return;
            }
        }
        match server.line_starting(rig.serving_line(), b.within(b.program_ready)) {
            Ok((t, _)) => c.request_to_server_serving_s = Some(signed_s(t, requested)),
            Err(e) => noted.push(format!("the server did not serve: {e:#}")),
        }
        match server.finish(b.within(b.exit)) {
            Ok(true) => {}
            Ok(false) => noted.push(format!(
                "the server exited with a failure; {}",
                server.stderr_tail()
            )),
            Err(e) => noted.push(format!("{e:#}")),
        }
    }

    /// From `requested` to NVML's device memory having dropped by 90% of what the holder held.
    fn nvml_free_after(&self, requested: u64) -> Option<f64> {
        let samples = self.poller?.snapshot();
        let baseline = nvml_poll::device_bytes_before(&samples, requested)?;
        let held = self.rig.gib << 30;
        let below = baseline.saturating_sub(held / 10 * 9);
        nvml_poll::first_device_below_ns(&samples, requested, below).map(|t| signed_s(t, requested))
    }
}

/// The value of `key=VALUE` in a line of the holder (`ready checksum=N reserved=N worker=PID`).
fn field(line: &str, key: &str) -> Option<String> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
        .map(str::to_owned)
}

/// What the kernel shows of `pids`: their open fds and mappings of files whose path starts with `prefix`.
fn kernel_view(pids: &[u32], prefix: &str) -> String {
    let each: Vec<String> = pids
        .iter()
        .map(|pid| {
            let mappings = std::fs::read_to_string(format!("/proc/{pid}/maps"))
                .map(|m| m.lines().filter(|l| l.contains(prefix)).count())
                .unwrap_or(0);
            format!(
                "pid {pid} ({} NVIDIA fds, {mappings} NVIDIA mappings)",
                fds_on(*pid, prefix)
            )
        })
        .collect();
    format!("[{}]", each.join(", "))
}

/// The agent's view of a container, in a line: what holds it.
fn describe(status: &Value) -> String {
    let processes: Vec<String> = status["processes"]
        .as_array()
        .map(|ps| {
            ps.iter()
                .map(|p| {
                    format!(
                        "pid {} ({} fds, {} mappings)",
                        p["pid"], p["fds"], p["mappings"]
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    format!(
        "gpu {}, {} NVIDIA fds, {} mappings, {} unconfirmed, {} live objects, {} bytes; processes: [{}]",
        status["gpu"],
        status["nvidia_fds"],
        status["mappings"],
        status["unconfirmed"],
        status["live_objects"],
        status["vram_bytes"],
        processes.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_holders_ready_line_gives_its_fields() {
        let line = "ready checksum=-123 reserved=8589934592 worker=77";
        assert_eq!(field(line, "checksum").as_deref(), Some("-123"));
        assert_eq!(field(line, "reserved").as_deref(), Some("8589934592"));
        assert_eq!(field(line, "worker").as_deref(), Some("77"));
        assert_eq!(field(line, "work"), None);
        assert_eq!(field("phase holding", "checksum"), None);
    }

    #[test]
    fn the_agents_view_names_each_holding_process() {
        let status = serde_json::json!({
            "gpu": "held", "nvidia_fds": 0, "mappings": 31, "unconfirmed": 0, "live_objects": 0,
            "vram_bytes": 0, "processes": [{"pid": 440, "fds": 0, "mappings": 31}],
        });
        assert_eq!(
            describe(&status),
            "gpu \"held\", 0 NVIDIA fds, 31 mappings, 0 unconfirmed, 0 live objects, 0 bytes; processes: \
             [pid 440 (0 fds, 31 mappings)]"
        );
    }
}
