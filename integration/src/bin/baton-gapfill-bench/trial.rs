//! One arm's run: the requests at their times, the agent's and the bench's own preemptions and resumes, what
//! each request and the trainer measured.
use super::*;

/// The bench's scheduler of the sequential and orchestrator arms.
#[derive(Default)]
pub(super) struct Sched {
    /// Requests arrived and not yet served.
    pub(super) in_flight: u32,
    /// When the last request was served.
    pub(super) last_end: Option<Instant>,
    /// No request will come any more.
    pub(super) done: bool,
}

/// One arm at one rate, running.
pub(super) struct Trial<'a> {
    pub(super) rig: &'a CudaRig,
    pub(super) arm: Arm,
    pub(super) trainer: String,
    pub(super) server: String,
    pub(super) server_out: PathBuf,
    pub(super) service_steps: u64,
    pub(super) idle: Duration,
    pub(super) sched: Mutex<Sched>,
    pub(super) wake: Condvar,
    /// Request events the agent refused (see [`Trial::end`]).
    pub(super) refused: AtomicUsize,
}

/// One request served: from its arrival to the server's last step for it, and the mean time per step.
pub(super) struct Served {
    pub(super) latency: Duration,
    pub(super) tpot: Option<Duration>,
}

/// What one window of arrivals gave.
pub(super) struct Measured {
    pub(super) t0: u64,
    pub(super) t1: u64,
    pub(super) served: Vec<Result<Served>>,
    pub(super) preemptions: f64,
    pub(super) c: Option<Duration>,
    pub(super) frozen: Option<(u64, Duration)>,
    pub(super) governor: Option<Value>,
}

impl Trial<'_> {
    /// Brings both containers where the arm starts: the server started once and parked, the trainer running
    /// (the arms that hand the GPU over); both running, neither preempted (the room arms). Returns how long
    /// the server's Start took where the agent's gate let it through.
    pub(super) fn settle(&self, cfg: &Config) -> Result<Option<Duration>> {
        let api = self.rig.gpu.env.api()?;
        let start = match self.arm {
            Arm::Overlapped => {
                // The server's Start waits at the gate until the agent parked the trainer; idle, the agent
                // parks the server and resumes the trainer by itself.
                let t = Instant::now();
                api.start(&self.server, "")?;
                Some(t.elapsed())
            }
            Arm::Sequential | Arm::Orchestrator => {
                self.baton(&["preempt", &self.trainer])?;
                api.start(&self.server, "")?;
                self.rig.wait_gpu(&self.server, "held", WITHIN)?;
                self.baton(&["preempt", &self.server])?;
                self.baton(&["resume", &self.trainer])?;
                None
            }
            Arm::Beside | Arm::Governor | Arm::Alone => {
                if self.arm.has_trainer() {
                    // The gate counts room once the agent has NVML's capacity of the GPU.
                    let known = wait_until(WITHIN, || {
                        self.gpu_row()
                            .is_ok_and(|r| r["room"]["capacity_bytes"].as_u64().is_some())
                    });
                    if !known {
                        bail!(
                            "the agent does not know the GPU's memory: {:?}",
                            self.gpu_row()
                        );
                    }
                }
                let t = Instant::now();
                api.start(&self.server, "")?;
                Some(t.elapsed())
            }
        };
        let settled = wait_until(WITHIN, || {
            let trainer_runs = || {
                self.preemption(&self.trainer).is_null()
                    && self.rig.gpu.status(&self.trainer)["gpu"] == json!("held")
            };
            if self.arm.room() {
                self.preemption(&self.server).is_null()
                    && self.rig.gpu.status(&self.server)["gpu"] == json!("held")
                    && (!self.arm.has_trainer() || trainer_runs())
            } else {
                self.preemption(&self.server)["state"] == json!("parked") && trainer_runs()
            }
        });
        if !settled {
            let trainer = if self.arm.has_trainer() {
                self.rig.gpu.status(&self.trainer)
            } else {
                Value::Null
            };
            bail!(
                "the containers did not settle (room arms: both running; the others: the server parked, \
                 the trainer running): {} {trainer}",
                self.rig.gpu.status(&self.server)
            );
        }
        if self.arm == Arm::Governor {
            self.agent_call(json!({
                "op": "governor",
                "target_stretch": cfg.governor_target,
                "window_ms": cfg.governor_window_ms,
            }))?;
        }
        Ok(start)
    }

    pub(super) fn preemption(&self, id: &str) -> Value {
        self.rig.gpu.status(id)["preemption"].clone()
    }

    /// Runs `baton ARGS`, which must succeed.
    pub(super) fn baton(&self, args: &[&str]) -> Result<()> {
        let (out, err, ok) = self.rig.baton(args);
        if !ok {
            bail!("baton {args:?}: {err}{out}");
        }
        Ok(())
    }

    /// One request to the agent on a connection of its own.
    pub(super) fn agent_call(&self, request: Value) -> Result<Value> {
        AgentConn::connect(&self.rig.gpu.env.containerd().agent_socket())?.call(request)
    }

    /// `baton status --json`.
    pub(super) fn agent_status(&self) -> Result<Value> {
        let (out, err, ok) = self.rig.baton(&["status", "--json"]);
        if !ok {
            bail!("baton status: {err}");
        }
        Ok(serde_json::from_str(&out)?)
    }

    /// The agent's gap-fill row of the mock GPU.
    pub(super) fn gpu_row(&self) -> Result<Value> {
        gpu_row_of(&self.agent_status()?)
    }

    /// The controller's confirmed freezes of the trainer and its time frozen, so far.
    pub(super) fn trainer_frozen(&self, status: &Value) -> Option<(u64, u64)> {
        let co = status["controller"]["co_runners"]
            .as_array()?
            .iter()
            .find(|c| c["id"] == json!(self.trainer))?;
        Some((co["freezes"].as_u64()?, co["frozen_ns"].as_u64()?))
    }

    /// Sends the requests due at `due`, each from a thread of its own, and measures the window.
    pub(super) fn drive(&self, cfg: &Config, due: &[Duration]) -> Result<Measured> {
        let watch_trainer = self.arm.room() && self.arm.has_trainer();
        let frozen_before = if watch_trainer {
            self.trainer_frozen(&self.agent_status()?)
        } else {
            None
        };
        let start = Instant::now();
        let t0 = now_monotonic_ns();
        std::thread::scope(|s| {
            let scheduler = self.arm.scheduled().then(|| s.spawn(|| self.schedule()));
            let requests: Vec<_> = due
                .iter()
                .enumerate()
                .map(|(i, at)| {
                    sleep_until(start + *at);
                    let due_ns = t0 + at.as_nanos() as u64;
                    s.spawn(move || self.request(i, due_ns))
                })
                .collect();
            sleep_until(start + cfg.window);
            let t1 = now_monotonic_ns();
            let status = (!self.arm.scheduled()).then(|| self.agent_status());
            let served = requests
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| bail!("a request panicked")))
                .collect();
            self.lock().done = true;
            self.wake.notify_all();
            let (preemptions, c, frozen, governor) = match (scheduler, status) {
                (Some(h), _) => {
                    let cycles = h
                        .join()
                        .unwrap_or_else(|_| bail!("the scheduler panicked"))?;
                    let (p, c) = cycles_in(&cycles, t0, t1);
                    (p, c, None, None)
                }
                (None, Some(status)) => {
                    let status = status?;
                    let (p, c) = agent_figures(cfg, &status)?;
                    // The agent's C is its rate gate's, which outlives a restart: none in a room arm
                    // without a preemption.
                    let c = c.filter(|_| p > 0.0 || !self.arm.room());
                    let frozen = match (frozen_before, self.trainer_frozen(&status)) {
                        (Some((f0, ns0)), Some((f1, ns1))) if watch_trainer => Some((
                            f1.saturating_sub(f0),
                            Duration::from_nanos(ns1.saturating_sub(ns0)),
                        )),
                        _ => None,
                    };
                    let governor = (self.arm == Arm::Governor)
                        .then(|| status["controller"]["governor"].clone());
                    (p, c, frozen, governor)
                }
                (None, None) => (0.0, None, None, None),
            };
            Ok(Measured {
                t0,
                t1,
                served,
                preemptions,
                c,
                frozen,
                governor,
            })
        })
    }

    pub(super) fn lock(&self) -> MutexGuard<'_, Sched> {
        self.sched.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// One request: announced, served by `service_steps` server steps (each told to the agent as a token
    /// in the governor arm), ended; its latency from `due_ns`.
    pub(super) fn request(&self, i: usize, due_ns: u64) -> Result<Served> {
        let from = std::fs::metadata(&self.server_out).map_or(0, |m| m.len());
        let id = format!("{}-r{i}", self.server);
        let mut conn = self.begin(&id)?;
        let tokens = self.arm == Arm::Governor;
        let steps = follow_steps(&self.server_out, from, self.service_steps, |k, t| {
            if let (Some(conn), true) = (conn.as_mut(), tokens) {
                let op = if k == 0 { "first_token" } else { "token" };
                if let Err(e) = conn.call(json!({"op": op, "id": id, "t_ns": t})) {
                    eprintln!("{}: the agent refused {op} of {id}: {e:#}", self.arm.name());
                    self.refused.fetch_add(1, Ordering::Relaxed);
                }
            }
        });
        self.end(&id, conn)?;
        let steps = steps?;
        let (Some(first), Some(last)) = (steps.first(), steps.last()) else {
            bail!("no server step");
        };
        let gaps = steps.len() as u64 - 1;
        Ok(Served {
            latency: Duration::from_nanos(last.saturating_sub(due_ns)),
            tpot: (gaps > 0).then(|| Duration::from_nanos((last - first) / gaps)),
        })
    }

    /// A request arrives: the agent is told (the arms where it decides), or the bench's scheduler.
    pub(super) fn begin(&self, id: &str) -> Result<Option<AgentConn>> {
        if !self.arm.scheduled() {
            let mut conn = AgentConn::connect(&self.rig.gpu.env.containerd().agent_socket())?;
            conn.call(json!({"op": "request_start", "id": id, "server": self.server}))?;
            return Ok(Some(conn));
        }
        self.lock().in_flight += 1;
        self.wake.notify_all();
        Ok(None)
    }

    /// A request was served.
    pub(super) fn end(&self, id: &str, conn: Option<AgentConn>) -> Result<()> {
        if let Some(mut conn) = conn {
            let end = json!({"op": "request_end", "id": id, "server": self.server});
            if let Err(e) = conn.call(end) {
                // The co-runner controller drops open requests after its input silence (1 s by default),
                // which a request waiting for a hand-back can outlast; the idle park saw the end anyway.
                eprintln!(
                    "{}: the agent refused request_end of {id}: {e:#}",
                    self.arm.name()
                );
                self.refused.fetch_add(1, Ordering::Relaxed);
            }
            return Ok(());
        }
        let mut s = self.lock();
        s.in_flight -= 1;
        s.last_end = Some(Instant::now());
        self.wake.notify_all();
        Ok(())
    }

    /// The bench's scheduler: on a request, hands the GPU to the server; once nothing was in flight for the
    /// idle time, hands it back. Each cycle's (preemption asked, trainer resumed), CLOCK_MONOTONIC ns.
    pub(super) fn schedule(&self) -> Result<Vec<(u64, u64)>> {
        let mut cycles = Vec::new();
        loop {
            {
                let s = self.lock();
                let s = self
                    .wake
                    .wait_while(s, |s| s.in_flight == 0 && !s.done)
                    .unwrap_or_else(PoisonError::into_inner);
                if s.in_flight == 0 {
                    return Ok(cycles);
                }
            }
            let asked = now_monotonic_ns();
            self.hand_over(&self.trainer, &self.server)?;
            self.wait_idle();
            self.hand_over(&self.server, &self.trainer)?;
            cycles.push((asked, now_monotonic_ns()));
        }
    }

    /// Waits until no request was in flight for the idle time.
    pub(super) fn wait_idle(&self) {
        let mut s = self.lock();
        loop {
            let quiet = s.last_end.map_or(self.idle, |t| t.elapsed());
            s = match s.in_flight {
                0 if quiet >= self.idle => return,
                0 => {
                    self.wake
                        .wait_timeout(s, self.idle - quiet)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0
                }
                _ => self.wake.wait(s).unwrap_or_else(PoisonError::into_inner),
            };
        }
    }

    /// Parks `from` and resumes `to`: after the park returned (sequential), or once the agent shows `from`'s
    /// GPU memory free, polled every 100 ms (the seed's orchestrator).
    pub(super) fn hand_over(&self, from: &str, to: &str) -> Result<()> {
        if self.arm == Arm::Sequential {
            self.baton(&["preempt", from])?;
            return self.baton(&["resume", to]);
        }
        std::thread::scope(|s| {
            let park = s.spawn(|| self.baton(&["preempt", from]));
            self.rig.poll_until_gpu_free(from, POLL);
            let resumed = self.baton(&["resume", to]);
            park.join()
                .unwrap_or_else(|_| bail!("the preempt thread panicked"))?;
            resumed
        })
    }
}

/// `baton status --json`'s gap-fill row of the mock's `nvidia0`.
pub(super) fn gpu_row_of(status: &Value) -> Result<Value> {
    status["gap_fill"]["gpus"]
        .as_array()
        .and_then(|gpus| gpus.iter().find(|r| r["device"] == json!("nvidia0")))
        .cloned()
        .with_context(|| format!("no gap-fill row for nvidia0: {}", status["gap_fill"]))
}

/// The agent's rate gate for the mock GPU in `status`: preemptions in its window and its mean C.
pub(super) fn agent_figures(cfg: &Config, status: &Value) -> Result<(f64, Option<Duration>)> {
    let row = gpu_row_of(status)?;
    let per_hour = row["preemptions_per_hour"].as_f64().unwrap_or(0.0);
    let c = row["c_s"].as_f64().map(Duration::from_secs_f64);
    Ok((per_hour * cfg.window.as_secs_f64() / 3600.0, c))
}

/// Preemptions asked in `[t0, t1)` and their mean C.
pub(super) fn cycles_in(cycles: &[(u64, u64)], t0: u64, t1: u64) -> (f64, Option<Duration>) {
    let costs: Vec<u64> = cycles
        .iter()
        .filter(|(asked, _)| (t0..t1).contains(asked))
        .map(|(asked, resumed)| resumed - asked)
        .collect();
    let mean = (!costs.is_empty())
        .then(|| Duration::from_nanos(costs.iter().sum::<u64>() / costs.len() as u64));
    (costs.len() as f64, mean)
}

/// Waits until the server printed `steps` `progress` lines after byte `from` of its output, calling
/// `on_step` with each one's index and time as it appears: their times (CLOCK_MONOTONIC ns).
pub(super) fn follow_steps(
    out: &Path,
    from: u64,
    steps: u64,
    mut on_step: impl FnMut(usize, u64),
) -> Result<Vec<u64>> {
    let deadline = Instant::now() + WITHIN;
    let mut file = std::fs::File::open(out)?;
    file.seek(SeekFrom::Start(from))?;
    let mut text = String::new();
    let mut seen = Vec::new();
    while Instant::now() < deadline {
        file.read_to_string(&mut text)?;
        let complete = &text[..text.rfind('\n').map_or(0, |i| i + 1)];
        let times: Vec<u64> = complete
            .lines()
            .filter_map(progress_line)
            .map(|(_, t)| t)
            .take(steps as usize)
            .collect();
        for (k, t) in times.iter().enumerate().skip(seen.len()) {
            on_step(k, *t);
            seen.push(*t);
        }
        if seen.len() as u64 >= steps {
            return Ok(seen);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    bail!("the server did not run {steps} steps within {WITHIN:?}")
}

pub(super) fn sleep_until(t: Instant) {
    std::thread::sleep(t.saturating_duration_since(Instant::now()));
}
