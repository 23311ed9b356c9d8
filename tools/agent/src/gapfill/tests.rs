//! Unit tests of gap-fill's bookkeeping: parking, resuming (and its waits after failures), claims, order.
use baton_agent_api::PreemptState;

use super::*;

fn c(id: &str) -> ContainerRef {
    ContainerRef {
        id: id.into(),
        namespace: "n".into(),
    }
}

fn park(g: &mut GapFill, id: &str, priority: i32, parked_s_ago: u64) {
    g.parked.insert(
        c(id),
        Parked {
            server: c("server"),
            mode: PreemptMode::Park,
            priority,
            devices: BTreeSet::new(),
            bytes: None,
            since_ns: now_monotonic_ns().saturating_sub(parked_s_ago * 1_000_000_000),
            requested_ns: 0,
            resuming: false,
            retry_at: None,
            failed_resumes: 0,
            resume_error: None,
        },
    );
}

fn step(phase: Phase, detail: &str) -> Step {
    Step {
        t_ns: 1,
        container: c("t"),
        phase,
        pid: Some(42),
        detail: detail.into(),
        no_cuda_state: Vec::new(),
    }
}

#[tokio::test]
async fn the_resume_order_is_the_priority_aged_by_the_time_parked_and_one_resumes_at_a_time() {
    let mut g = GapFill::default();
    park(&mut g, "fresh-high", 5, 0);
    park(&mut g, "old-low", 0, 200);
    park(&mut g, "fresh-low", 0, 0);
    let order: Vec<String> = g
        .status()
        .parked
        .iter()
        .map(|p| p.container.id.clone())
        .collect();
    // 0 + 0.1 * 200 s = 20 > 5 > 0.
    assert_eq!(order, ["old-low", "fresh-high", "fresh-low"]);
    assert_eq!(g.next_resume(|_, _, _| false), Some(c("old-low")));
    // One a server still needs is skipped; the next goes first.
    assert_eq!(
        g.next_resume(|co, _, _| *co == c("old-low")),
        Some(c("fresh-high"))
    );
    g.parked.get_mut(&c("old-low")).unwrap().resuming = true;
    assert_eq!(g.next_resume(|_, _, _| false), None, "one resume at a time");
}

#[tokio::test]
async fn a_failed_resume_waits_before_its_retry_and_a_snapshotted_co_runner_is_not_resumed() {
    let mut g = GapFill::default();
    park(&mut g, "snap", 9, 0);
    g.parked.get_mut(&c("snap")).unwrap().mode = PreemptMode::Snapshot;
    park(&mut g, "t", 0, 0);
    g.parked.get_mut(&c("t")).unwrap().resuming = true;
    g.resumed(&c("t"), &[], &Err("injected at restore".into()));
    assert!(g.has_parked());
    assert_eq!(g.next_resume(|_, _, _| false), None);
    let due = g.next_due().unwrap();
    assert!(due > Instant::now() + RETRY_RESUME / 2, "a retry later");
    g.parked.get_mut(&c("t")).unwrap().retry_at = Some(Instant::now());
    g.expire();
    assert_eq!(g.next_resume(|_, _, _| false), Some(c("t")));
    // The second failure in a row waits twice as long, and the status says why.
    g.parked.get_mut(&c("t")).unwrap().resuming = true;
    g.resumed(&c("t"), &[], &Err("injected again".into()));
    let due = g.next_due().unwrap();
    assert!(due > Instant::now() + RETRY_RESUME * 3 / 2, "waits longer");
    let shown = g
        .status()
        .parked
        .into_iter()
        .find(|p| p.container == c("t"));
    let shown = shown.unwrap();
    assert_eq!(shown.failed_resumes, 2);
    assert_eq!(shown.resume_error.as_deref(), Some("injected again"));
}

#[test]
fn the_wait_between_failed_resumes_doubles_up_to_ten_minutes() {
    assert_eq!(retry_resume_after(1), RETRY_RESUME);
    assert_eq!(retry_resume_after(2), RETRY_RESUME * 2);
    assert_eq!(retry_resume_after(3), RETRY_RESUME * 4);
    assert_eq!(retry_resume_after(8), MAX_RETRY_RESUME);
    assert_eq!(retry_resume_after(u32::MAX), MAX_RETRY_RESUME);
}

#[tokio::test]
async fn a_failed_preemption_is_told_once_and_a_co_runner_that_finishes_at_its_resume_is_never_resumed()
 {
    let mut g = GapFill::default();
    let in_flight = || InFlight {
        server: c("server"),
        mode: PreemptMode::Park,
        priority: 0,
        devices: BTreeSet::new(),
        bytes: None,
        requested_ns: 0,
        released: false,
    };
    g.preempting.insert(c("t"), in_flight());
    g.preempted(&c("t"), &[], &Err("pid 42: injected at checkpoint".into()));
    let failures = g.take_failures();
    assert_eq!(failures.len(), 1);
    assert!(failures[0].1.contains("co-runner t") && failures[0].1.contains("injected"));
    assert!(g.take_failures().is_empty());
    assert!(g.parked.is_empty());

    g.preempting.insert(c("t"), in_flight());
    let parked = Outcome {
        container: c("t"),
        preemption: Some(PreemptState {
            state: PreemptPhase::Parked,
            mode: PreemptMode::Park,
            pids: vec![42],
            since_ns: 1,
            image_path: None,
            parked_for: Some(c("server")),
            idle_park: false,
            host_copy_bytes: None,
            raised_limit: None,
            unfrozen: false,
            no_cuda_state: Vec::new(),
        }),
        steps: vec![],
    };
    g.preempted(&c("t"), &[], &Ok(parked));
    assert!(g.has_parked());
    let steps = [step(Phase::Finished, "exit status 7")];
    g.resumed(&c("t"), &steps, &Err("pid 42 exited".into()));
    assert!(!g.has_parked());
    let s = g.status();
    assert_eq!(s.finished.len(), 1);
    assert_eq!(s.finished[0].detail, "pid 42: exit status 7");
}

#[tokio::test]
async fn a_co_runner_resumed_by_an_operator_killed_or_deleted_is_no_longer_the_agents_to_resume() {
    let mut g = GapFill::default();
    park(&mut g, "resumed", 0, 0);
    park(&mut g, "deleted", 0, 0);
    park(&mut g, "killed", 0, 0);
    g.state_pushed(&c("killed"), Some(PreemptPhase::Parked), None);
    assert!(
        g.status().finished[0]
            .detail
            .contains("killed while parked")
    );
    g.state_pushed(&c("resumed"), Some(PreemptPhase::Resuming), None);
    assert!(!g.parked.contains_key(&c("resumed")));
    assert_eq!(
        g.status().finished.len(),
        1,
        "a resume by someone else is no finish"
    );
    g.gone(&c("deleted"));
    assert!(!g.has_parked());
    assert!(
        g.status().finished[1]
            .detail
            .contains("deleted while parked")
    );
}
