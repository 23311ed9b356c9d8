//! `preempt`, `resume`, `start` and `handoff` on the agent's socket: the agent resolves the container and
//! its CUDA processes (from its ledger), asks the container's shim to act (on the shim's control socket),
//! and streams one timeline: the shim's steps, merged with the agent's own signal (GPU released, GPU
//! acquired). `handoff` starts the second container on the first one's release (overlapped) or once its
//! preemption completed (sequential).
use std::time::Duration;

use baton_agent_api::{
    Client, ContainerRef, EventBody, HandoffOrder, HandoffRequest, Outcome, PROTOCOL_VERSION,
    Phase, PreemptPhase, PreemptRequest, PreemptState, Reply, Request, Step, StepLine, Target,
};
use tokio::{
    net::unix::OwnedWriteHalf,
    sync::{broadcast, mpsc, oneshot},
    task::JoinHandle,
};

use super::{
    core::{Command, Note, Resolved, What},
    metrics::events::events,
    registry::Published,
    server::{send_line, send_reply},
    sleep_until_opt,
};
use baton_tracer::now_monotonic_ns;

/// How long after a preemption completed the agent waits for the release signal it has not seen yet.
const RELEASE_GRACE: Duration = Duration::from_secs(2);
/// How long a handoff waits for the release once the first container's preemption completed: past it, the
/// second container is not started, and the first is resumed.
const HANDOFF_RELEASE_WAIT: Duration = Duration::from_secs(10);
/// How long a handoff waits for the second container to open the GPU once started.
const ACQUIRE_WAIT: Duration = Duration::from_secs(10);

/// What a connection needs to run one of these requests.
pub struct Ctx<'a> {
    /// The core's inbox.
    pub commands: &'a mpsc::Sender<Command>,
    /// The event stream.
    pub events: &'a broadcast::Sender<Published>,
    /// The asking process.
    pub peer: u32,
}

/// The steps sent so far, written to the client as they come.
struct Timeline<'w> {
    write: &'w mut OwnedWriteHalf,
    steps: Vec<Step>,
    /// The core, which shows each step to the traces of its container.
    core: mpsc::Sender<Command>,
}

impl<'w> Timeline<'w> {
    /// A timeline whose first step is the request (`asked` at `t_ns`), sent at once.
    async fn open(
        write: &'w mut OwnedWriteHalf,
        core: &mpsc::Sender<Command>,
        c: &ContainerRef,
        t_ns: u64,
        detail: &str,
    ) -> std::io::Result<Self> {
        let mut t = Self {
            write,
            steps: Vec::new(),
            core: core.clone(),
        };
        t.agent_step(c, Phase::Asked, t_ns, None, detail.to_owned())
            .await?;
        Ok(t)
    }

    async fn push(&mut self, step: Step) -> std::io::Result<()> {
        let line = StepLine {
            v: PROTOCOL_VERSION,
            step: step.clone(),
        };
        Note::of_step(&step).send(&self.core);
        self.steps.push(step);
        send_line(self.write, &line).await
    }

    async fn agent_step(
        &mut self,
        c: &ContainerRef,
        phase: Phase,
        t_ns: u64,
        pid: Option<u32>,
        detail: String,
    ) -> std::io::Result<()> {
        let step = Step {
            t_ns,
            container: c.clone(),
            phase,
            pid,
            detail,
            no_cuda_state: Vec::new(),
        };
        self.push(step).await
    }
}

impl Ctx<'_> {
    async fn resolve(&self, target: &Target) -> Result<Resolved, String> {
        let (answer, rx) = oneshot::channel();
        let (reply, _) = oneshot::channel();
        let cmd = Command {
            what: What::Resolve {
                target: target.clone(),
                answer,
            },
            peer_pid: self.peer,
            reply,
        };
        self.commands
            .send(cmd)
            .await
            .map_err(|_| "the agent is stopping".to_owned())?;
        rx.await.map_err(|_| "the agent is stopping".to_owned())?
    }

    async fn set_preemption(&self, outcome: &Outcome) {
        let (reply, _) = oneshot::channel();
        let cmd = Command {
            what: What::SetPreemption {
                container: outcome.container.clone(),
                state: outcome.preemption.clone(),
            },
            peer_pid: self.peer,
            reply,
        };
        let _ = self.commands.send(cmd).await;
    }
}

/// A request to a shim, run in its own task: its steps come on the receiver, its reply from the handle.
struct ShimCall {
    steps: Option<mpsc::UnboundedReceiver<Step>>,
    done: JoinHandle<Result<Reply, String>>,
}

impl ShimCall {
    fn start(r: &Resolved, request: Request) -> Result<Self, String> {
        Self::start_when(r, request, None)
    }

    /// [`ShimCall::start`] that connects at once but sends the request only when `go` fires (a handoff's
    /// second container: the connection is ready before the release, which saves its set-up on the
    /// critical path). Dropping `go` unsent cancels the call.
    fn start_when(
        r: &Resolved,
        request: Request,
        go: Option<oneshot::Receiver<()>>,
    ) -> Result<Self, String> {
        let socket = r.control_socket.clone().ok_or_else(|| {
            format!(
                "the shim of container {} has no control socket (it is older than this agent, or \
                 could not bind it: see its log)",
                r.container.id
            )
        })?;
        let (tx, rx) = mpsc::unbounded_channel();
        let done = tokio::spawn(async move {
            let mut client = Client::connect(std::path::Path::new(&socket))
                .await
                .map_err(|e| format!("cannot reach the container's shim: {e}"))?;
            if let Some(go) = go {
                go.await.map_err(|_| "cancelled".to_owned())?;
            }
            client
                .call_with_steps(request, |s| {
                    let _ = tx.send(s.clone());
                })
                .await
                .map_err(|e| match e {
                    baton_agent_api::ClientError::Refused(e) => e,
                    other => other.to_string(),
                })
        });
        Ok(Self {
            steps: Some(rx),
            done,
        })
    }

    /// The shim's outcome, once its steps ended.
    async fn outcome(&mut self) -> Result<Outcome, String> {
        match (&mut self.done).await {
            Ok(Ok(Reply::Done(o))) => Ok(o),
            Ok(Ok(other)) => Err(format!("unexpected reply from the shim: {other:?}")),
            Ok(Err(e)) => Err(e),
            Err(e) => Err(format!("the request to the shim failed: {e}")),
        }
    }
}

/// The next step of an optional call, or never.
async fn next_step(call: Option<&mut ShimCall>) -> Option<Step> {
    match call.and_then(|c| c.steps.as_mut()) {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

/// Resolves the target of a preempt request and checks it can be preempted.
async fn preemptible(ctx: &Ctx<'_>, target: &Target) -> Result<Resolved, String> {
    let a = ctx.resolve(target).await?;
    if let Some(p) = &a.preemption {
        let state = format!("{:?}", p.state).to_lowercase();
        return Err(format!(
            "container {} is {state} already: `baton resume {}` gives it its GPU back",
            a.container.id, a.container.id
        ));
    }
    if a.pids.is_empty() {
        return Err(format!(
            "container {} holds no GPU (none of its processes owns GPU state: memory, a context): nothing to preempt",
            a.container.id
        ));
    }
    Ok(a)
}

/// `preempt`: forwards to the shim with the CUDA processes, adds the release signal to its timeline.
pub async fn preempt(
    ctx: &Ctx<'_>,
    r: PreemptRequest,
    write: &mut OwnedWriteHalf,
) -> std::io::Result<()> {
    let asked = now_monotonic_ns();
    let mut events = ctx.events.subscribe();
    let a = match preemptible(ctx, &r.target).await {
        Ok(a) => a,
        Err(error) => return send_reply(write, Reply::Error { error }).await,
    };
    let request = Request::Preempt(PreemptRequest {
        target: Target::exact(&a.container),
        pids: a.pids.clone(),
        parked_for: None,
        idle_park: false,
        vram_bytes: Some(a.vram_bytes),
        host_budget_left_bytes: Some(a.host_budget_left),
        again: false,
        ..r.clone()
    });
    let mut call = match ShimCall::start(&a, request) {
        Ok(c) => c,
        Err(error) => return send_reply(write, Reply::Error { error }).await,
    };
    let mut timeline =
        Timeline::open(write, ctx.commands, &a.container, asked, r.mode.label()).await?;
    let mut released = false;
    let mut grace: Option<tokio::time::Instant> = None;
    let mut outcome = None;
    loop {
        tokio::select! {
            step = next_step(Some(&mut call)), if outcome.is_none() => match step {
                Some(s) => timeline.push(s).await?,
                None => {
                    let o = call.outcome().await;
                    grace = Some(tokio::time::Instant::now() + RELEASE_GRACE);
                    outcome = Some(o);
                }
            },
            e = events.recv() => {
                if matches!(e, Err(broadcast::error::RecvError::Closed)) {
                    outcome = Some(Err("the agent is stopping".into()));
                    break;
                }
                if let Some((t, detail)) = released_event(&e, &a.container)
                    && !released
                {
                    released = true;
                    timeline.agent_step(&a.container, Phase::GpuReleased, t, None, detail).await?;
                }
            }
            () = sleep_until_opt(grace) => break,
        }
        if released && outcome.is_some() {
            break;
        }
    }
    let op = Operation {
        name: "preempt",
        mode: r.mode.label(),
    };
    finish(ctx, timeline, outcome, op).await
}

/// Runs `request` (a preempt or a resume) on `r`'s shim with no client to stream to (gap-fill, the agent
/// acting by itself): its steps, in order, and the shim's outcome or why it failed. Each step is handed to
/// `on_step` as it comes (the container's traces show it), after an `asked` step saying who asked (`by`).
/// Counted in the metrics as the same operation asked by a client.
pub async fn run_unattended(
    r: &Resolved,
    request: Request,
    by: &str,
    mut on_step: impl FnMut(&Step),
) -> (Vec<Step>, Result<Outcome, String>) {
    let (name, mode) = match &request {
        Request::Preempt(p) => ("preempt", p.mode.label()),
        _ => ("resume", ""),
    };
    // A park again is asked on a guess (the container looked parked when it acquired): its shim says
    // `asked` itself once it parks something, and a refusal (the container was being resumed) shows nothing
    // and counts as no preemption.
    let again = matches!(&request, Request::Preempt(p) if p.again);
    if !again {
        on_step(&Step {
            t_ns: now_monotonic_ns(),
            container: r.container.clone(),
            phase: Phase::Asked,
            pid: None,
            detail: [mode, "by", by].join(" ").trim_start().to_owned(),
            no_cuda_state: Vec::new(),
        });
    }
    let mut call = match ShimCall::start(r, request) {
        Ok(c) => c,
        Err(e) => return (Vec::new(), Err(e)),
    };
    let mut steps = Vec::new();
    while let Some(s) = next_step(Some(&mut call)).await {
        on_step(&s);
        steps.push(s);
    }
    let outcome = call.outcome().await;
    steps.sort_by_key(|s| s.t_ns);
    if !(again && steps.is_empty()) {
        events().preemption(name, mode, outcome.is_ok(), &steps);
    }
    (steps, outcome)
}

/// Which operation a timeline is of, for the metrics.
struct Operation {
    /// `preempt`, `resume`, `start` or `handoff`.
    name: &'static str,
    /// `park` or `snapshot`; empty for resume and start.
    mode: &'static str,
}

async fn finish(
    ctx: &Ctx<'_>,
    timeline: Timeline<'_>,
    outcome: Option<Result<Outcome, String>>,
    op: Operation,
) -> std::io::Result<()> {
    let Timeline {
        write, mut steps, ..
    } = timeline;
    steps.sort_by_key(|s| s.t_ns);
    let sorted = steps;
    let ok = matches!(outcome, Some(Ok(_)));
    events().preemption(op.name, op.mode, ok, &sorted);
    match outcome {
        Some(Ok(mut o)) => {
            ctx.set_preemption(&o).await;
            o.steps = sorted;
            send_reply(write, Reply::Done(o)).await
        }
        Some(Err(error)) => send_reply(write, Reply::Error { error }).await,
        None => {
            send_reply(
                write,
                Reply::Error {
                    error: "the shim did not answer".into(),
                },
            )
            .await
        }
    }
}

/// The release time and what confirmed it, when `e` is the release of `c`.
fn released_event(
    e: &Result<Published, broadcast::error::RecvError>,
    c: &ContainerRef,
) -> Option<(u64, String)> {
    match e {
        Ok(p) if p.event.container == *c => match &p.event.body {
            EventBody::Released(r) => Some((r.t_released_ns, r.confirmed_by.clone())),
            _ => None,
        },
        _ => None,
    }
}

/// The acquire time and pid, when `e` is `c` opening the GPU.
fn acquired_event(
    e: &Result<Published, broadcast::error::RecvError>,
    c: &ContainerRef,
) -> Option<(u64, u32)> {
    match e {
        Ok(p) if p.event.container == *c => match &p.event.body {
            EventBody::Acquired(a) => Some((a.t_acquired_ns, a.pid)),
            _ => None,
        },
        _ => None,
    }
}

/// `resume` and `start`: forwarded to the container's shim.
pub async fn forward(
    ctx: &Ctx<'_>,
    request: Request,
    write: &mut OwnedWriteHalf,
) -> std::io::Result<()> {
    let target = match &request {
        Request::Resume(t) | Request::Start(t) => t.clone(),
        _ => {
            let error = "only resume and start are forwarded".to_owned();
            return send_reply(write, Reply::Error { error }).await;
        }
    };
    let asked = now_monotonic_ns();
    let r = match ctx.resolve(&target).await {
        Ok(r) => r,
        Err(error) => return send_reply(write, Reply::Error { error }).await,
    };
    let exact = Target::exact(&r.container);
    let is_resume = matches!(request, Request::Resume(_));
    let request = match request {
        Request::Resume(_) => Request::Resume(exact),
        _ => Request::Start(exact),
    };
    let mut call = match ShimCall::start(&r, request) {
        Ok(c) => c,
        Err(error) => return send_reply(write, Reply::Error { error }).await,
    };
    let mut timeline = Timeline::open(write, ctx.commands, &r.container, asked, "").await?;
    while let Some(s) = next_step(Some(&mut call)).await {
        timeline.push(s).await?;
    }
    let outcome = call.outcome().await;
    if outcome.is_err() && is_resume {
        // A failed resume leaves parked only the processes it could not give their GPU back (the shim's
        // `still_parked` steps; a second resume retries them), and the others running.
        let still: Vec<u32> = timeline
            .steps
            .iter()
            .filter(|s| s.phase == Phase::StillParked)
            .filter_map(|s| s.pid)
            .collect();
        let preemption = match (still.is_empty(), r.preemption.clone()) {
            (false, Some(p)) => Some(PreemptState {
                state: PreemptPhase::Parked,
                pids: still,
                ..p
            }),
            _ => None,
        };
        ctx.set_preemption(&Outcome {
            container: r.container.clone(),
            preemption,
            steps: Vec::new(),
        })
        .await;
    }
    let op = Operation {
        name: if is_resume { "resume" } else { "start" },
        mode: "",
    };
    finish(ctx, timeline, Some(outcome), op).await
}

/// Where a handoff is.
struct Handoff {
    a: Resolved,
    b: Resolved,
    order: HandoffOrder,
    a_call: ShimCall,
    a_outcome: Option<Result<Outcome, String>>,
    b_call: Option<ShimCall>,
    /// Sends the prepared start of `b` (its connection is open already).
    b_go: Option<oneshot::Sender<()>>,
    b_prepared: Option<ShimCall>,
    b_outcome: Option<Result<Outcome, String>>,
    released: bool,
    acquired: bool,
    acquire_deadline: Option<tokio::time::Instant>,
    release_deadline: Option<tokio::time::Instant>,
    /// `a` was preempted, and no release came within [`HANDOFF_RELEASE_WAIT`].
    unreleased: bool,
}

impl Handoff {
    /// Sends the prepared start of `b` (once; later calls do nothing).
    fn start_b(&mut self) {
        if let (Some(go), Some(call)) = (self.b_go.take(), self.b_prepared.take()) {
            let _ = go.send(());
            self.b_call = Some(call);
        }
    }

    fn finished(&self) -> bool {
        let a_failed = matches!(self.a_outcome, Some(Err(_)));
        let b_failed = matches!(self.b_outcome, Some(Err(_)));
        // `a` failing after `b` was started (overlapped: on the release) waits for `b`'s answer, so that the
        // reply can say where both are.
        let b_pending = self.b_call.is_some() && self.b_outcome.is_none();
        let a_done = self.a_outcome.is_some() && self.released;
        (a_failed && !b_pending)
            || self.unreleased
            || b_failed
            || (a_done && self.b_outcome.is_some() && self.acquired)
    }

    /// `a` was preempted but its GPU state did not leave: resumes it (`b` was never started), and returns the
    /// reply's error, naming what still holds the GPU and where `a` is.
    async fn roll_back_unreleased(
        &mut self,
        ctx: &Ctx<'_>,
        timeline: &mut Timeline<'_>,
    ) -> std::io::Result<String> {
        let (a, b) = (self.a.container.clone(), self.b.container.clone());
        let held = match ctx.resolve(&Target::exact(&a)).await {
            Ok(r) if !r.pids.is_empty() => format!(
                "pid(s) {:?} still hold GPU state there (processes the preemption did not checkpoint: \
                 started after it was asked, or with no CUDA state the driver can checkpoint)",
                r.pids
            ),
            _ => "the agent saw no release".to_owned(),
        };
        let resumed = match ShimCall::start(&self.a, Request::Resume(Target::exact(&a))) {
            Ok(mut call) => {
                while let Some(s) = next_step(Some(&mut call)).await {
                    timeline.push(s).await?;
                }
                call.outcome().await
            }
            Err(e) => Err(e),
        };
        let now = match resumed {
            Ok(o) => {
                ctx.set_preemption(&o).await;
                "it was resumed".to_owned()
            }
            Err(e) => format!(
                "resuming it failed too ({e}): `baton resume {}` tries again",
                a.id
            ),
        };
        Ok(format!(
            "{} was parked, but its GPU state did not leave within {HANDOFF_RELEASE_WAIT:?}: {held}; {} was \
             not started, and {now}",
            a.id, b.id
        ))
    }

    /// The reply's error when `a`'s preemption failed (`error`), saying what became of `b` when it had been
    /// started already.
    fn a_failed(&self, error: &str, b: Option<&Result<Outcome, String>>) -> String {
        let (a, b_id) = (&self.a.container.id, &self.b.container.id);
        if self.b_call.is_none() {
            return format!("preempting {a}: {error}");
        }
        let b_now = match b {
            Some(Ok(_)) => "is running".to_owned(),
            Some(Err(e)) => format!("did not start either: {e}"),
            None => "has not answered".to_owned(),
        };
        format!(
            "preempting {a} failed after {b_id} was started on its release: {error}; {b_id} {b_now}; the shim \
             rolled {a} back as far as it could (its CUDA processes restored and unlocked, the container \
             thawed), so both may hold the GPU now: `baton status` shows each, and `baton preempt {a}` or a \
             stop of {b_id} settles it"
        )
    }
}

/// `handoff`: preempts `from`, starts or resumes `to` on the release (overlapped) or after the preemption
/// (sequential), and waits for `to` to open the GPU.
pub async fn handoff(
    ctx: &Ctx<'_>,
    h: HandoffRequest,
    write: &mut OwnedWriteHalf,
) -> std::io::Result<()> {
    let asked = now_monotonic_ns();
    let mut events = ctx.events.subscribe();
    let prepared = async {
        let a = preemptible(ctx, &h.from).await?;
        let b = ctx.resolve(&h.to).await?;
        if a.container == b.container {
            return Err("handoff needs two different containers".to_owned());
        }
        if b.control_socket.is_none() {
            return Err(format!(
                "container {} has no shim control socket",
                b.container.id
            ));
        }
        let request = Request::Preempt(PreemptRequest {
            target: Target::exact(&a.container),
            mode: h.mode,
            pids: a.pids.clone(),
            image_path: None,
            parked_for: None,
            idle_park: false,
            vram_bytes: Some(a.vram_bytes),
            host_budget_left_bytes: Some(a.host_budget_left),
            again: false,
        });
        let (b_go, go) = oneshot::channel();
        let b_prepared =
            ShimCall::start_when(&b, Request::Start(Target::exact(&b.container)), Some(go))?;
        let a_call = ShimCall::start(&a, request)?;
        Ok(Handoff {
            b_go: Some(b_go),
            b_prepared: Some(b_prepared),
            a,
            b,
            order: h.order,
            a_call,
            a_outcome: None,
            b_call: None,
            b_outcome: None,
            released: false,
            acquired: false,
            acquire_deadline: None,
            release_deadline: None,
            unreleased: false,
        })
    }
    .await;
    let mut run = match prepared {
        Ok(r) => r,
        Err(error) => return send_reply(write, Reply::Error { error }).await,
    };
    let detail = format!(
        "{} {} -> {}",
        h.order.label(),
        h.mode.label(),
        run.b.container.id
    );
    let mut timeline =
        Timeline::open(write, ctx.commands, &run.a.container, asked, &detail).await?;
    while !run.finished() {
        tokio::select! {
            step = next_step(Some(&mut run.a_call)), if run.a_outcome.is_none() => match step {
                Some(s) => timeline.push(s).await?,
                None => {
                    let o = run.a_call.outcome().await;
                    let ok = o.is_ok();
                    run.a_outcome = Some(o);
                    if ok && !run.released {
                        run.release_deadline =
                            Some(tokio::time::Instant::now() + HANDOFF_RELEASE_WAIT);
                    }
                    // Sequential: once the preemption completed, and its release came.
                    if ok && run.released && run.order == HandoffOrder::Sequential {
                        run.start_b();
                    }
                }
            },
            step = next_step(run.b_call.as_mut()), if run.b_outcome.is_none() => match step {
                Some(s) => timeline.push(s).await?,
                None => {
                    if let Some(call) = run.b_call.as_mut() {
                        run.b_outcome = Some(call.outcome().await);
                        run.acquire_deadline = Some(tokio::time::Instant::now() + ACQUIRE_WAIT);
                    }
                }
            },
            e = events.recv() => {
                if matches!(e, Err(broadcast::error::RecvError::Closed)) {
                    run.a_outcome = Some(Err("the agent is stopping".into()));
                    break;
                }
                if let Some((t, detail)) = released_event(&e, &run.a.container)
                    && !run.released
                {
                    run.released = true;
                    let preempted = matches!(run.a_outcome, Some(Ok(_)));
                    if run.order == HandoffOrder::Overlapped || preempted {
                        run.start_b();
                    }
                    timeline.agent_step(&run.a.container, Phase::GpuReleased, t, None, detail).await?;
                }
                if let Some((t, pid)) = acquired_event(&e, &run.b.container)
                    && !run.acquired
                {
                    run.acquired = true;
                    timeline
                        .agent_step(&run.b.container, Phase::GpuAcquired, t, Some(pid), String::new())
                        .await?;
                }
            }
            () = sleep_until_opt(run.release_deadline.filter(|_| !run.released)) => {
                // The shim checkpointed the CUDA processes it was given, yet the container's GPU state is
                // still there: `b` is not started onto a GPU that `a` holds.
                run.unreleased = true;
            }
            () = sleep_until_opt(run.acquire_deadline) => {
                run.acquired = true;
                let detail = format!("it has not opened the GPU within {ACQUIRE_WAIT:?}");
                let now = now_monotonic_ns();
                timeline.agent_step(&run.b.container, Phase::Done, now, None, detail).await?;
            }
        }
    }
    if run.unreleased {
        let error = run.roll_back_unreleased(ctx, &mut timeline).await?;
        let op = Operation {
            name: "handoff",
            mode: h.mode.label(),
        };
        return finish(ctx, timeline, Some(Err(error)), op).await;
    }
    let outcome = match (run.a_outcome.take(), run.b_outcome.take()) {
        (Some(Err(e)), b) => Some(Err(run.a_failed(&e, b.as_ref()))),
        (_, Some(Err(e))) => Some(Err(format!(
            "{} was preempted, but starting {} failed: {e}",
            run.a.container.id, run.b.container.id
        ))),
        (a, _) => a,
    };
    let op = Operation {
        name: "handoff",
        mode: h.mode.label(),
    };
    finish(ctx, timeline, outcome, op).await
}
