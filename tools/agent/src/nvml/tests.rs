//! The cross-checker without NVML: a query stands in for it, held or answering as each test needs, so that
//! the order, the bound of one query at a time, the dropping of the oldest and the time bound show.
use std::sync::{
    Mutex as StdMutex,
    atomic::{AtomicUsize, Ordering},
    mpsc as std_mpsc,
};

use tokio::sync::mpsc;

use super::*;

/// The release numbered `seq` of container `c`, by pid `seq`.
fn pending(seq: u64) -> Pending {
    Pending {
        container: ContainerRef {
            id: "c".into(),
            namespace: "n".into(),
        },
        owner: 1,
        released_seq: seq,
        t_released_ns: seq * 10,
        pids: vec![u32::try_from(seq).unwrap_or(u32::MAX)],
    }
}

/// A query that tells `started` each time it starts, waits for a word on `go`, and lists every pid it is
/// asked about as still running (so that the answer shows which release it was for).
#[derive(Clone)]
struct HeldQuery {
    started: mpsc::UnboundedSender<u32>,
    go: Arc<StdMutex<std_mpsc::Receiver<()>>>,
    running: Arc<AtomicUsize>,
    most_at_once: Arc<AtomicUsize>,
}

impl HeldQuery {
    fn new() -> (Self, mpsc::UnboundedReceiver<u32>, std_mpsc::Sender<()>) {
        let (started, started_rx) = mpsc::unbounded_channel();
        let (go_tx, go) = std_mpsc::channel();
        let q = Self {
            started,
            go: Arc::new(StdMutex::new(go)),
            running: Arc::new(AtomicUsize::new(0)),
            most_at_once: Arc::new(AtomicUsize::new(0)),
        };
        (q, started_rx, go_tx)
    }

    fn answer(&self, pids: &BTreeSet<u32>) -> NvmlView {
        let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.most_at_once.fetch_max(now, Ordering::SeqCst);
        let _ = self.started.send(pids.iter().copied().next().unwrap_or(0));
        let _ = self
            .go
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .recv();
        self.running.fetch_sub(1, Ordering::SeqCst);
        NvmlView::Seen(NvmlSeen {
            processes: pids
                .iter()
                .map(|&pid| NvmlProcess {
                    device: 0,
                    pid,
                    used_bytes: Some(1),
                })
                .collect(),
            devices: vec![],
        })
    }
}

/// A checker over `query` whose checks arrive on the returned receiver.
fn checker(
    capacity: usize,
    bound: Duration,
    query: HeldQuery,
) -> (Checker, mpsc::UnboundedReceiver<Checked>) {
    let (tx, rx) = mpsc::unbounded_channel();
    let c = Checker::spawn(
        capacity,
        bound,
        move |pids: &BTreeSet<u32>| query.answer(pids),
        move |checked| {
            let ok = tx.send(checked).is_ok();
            async move { ok }
        },
    );
    (c, rx)
}

/// Waits for the query to start, and returns the pid it was asked about.
async fn started(rx: &mut mpsc::UnboundedReceiver<u32>) -> u32 {
    rx.recv().await.unwrap_or(0)
}

fn pids_listed(c: &Checked) -> Vec<u32> {
    match &c.view {
        NvmlView::Seen(s) => s.processes.iter().map(|p| p.pid).collect(),
        NvmlView::Missing(_) => vec![],
    }
}

#[tokio::test]
async fn each_release_is_checked_in_order_one_query_at_a_time() {
    let (query, mut started_rx, go) = HeldQuery::new();
    let most = Arc::clone(&query.most_at_once);
    let (c, mut out) = checker(8, Duration::from_secs(30), query);
    for seq in 1..=3 {
        assert!(c.push(pending(seq)).is_none());
    }
    for seq in 1..=3u32 {
        assert_eq!(started(&mut started_rx).await, seq);
        go.send(()).unwrap();
        let checked = out.recv().await.unwrap();
        assert_eq!(checked.pending.released_seq, u64::from(seq));
        assert_eq!(pids_listed(&checked), [seq], "the answer for its own pids");
        assert!(checked.t_asked_ns > 0);
        let (container, owner, event) = checked.into_event();
        assert_eq!((container.id.as_str(), owner), ("c", 1));
        assert_eq!(event.t_released_ns, u64::from(seq) * 10);
    }
    assert_eq!(most.load(Ordering::SeqCst), 1, "never two queries at once");
}

#[tokio::test]
async fn a_flood_drops_the_oldest_waiting_release() {
    let (query, mut started_rx, go) = HeldQuery::new();
    let (c, mut out) = checker(2, Duration::from_secs(30), query);
    assert!(c.push(pending(1)).is_none());
    // Release 1 is with NVML; 2 and 3 wait; 4 makes room by dropping 2, the oldest waiting.
    assert_eq!(started(&mut started_rx).await, 1);
    assert!(c.push(pending(2)).is_none());
    assert!(c.push(pending(3)).is_none());
    let dropped = c.push(pending(4)).unwrap();
    assert_eq!(dropped.pending.released_seq, 2);
    assert_eq!(dropped.view, NvmlView::Missing(NvmlMissing::Dropped));
    assert_eq!((dropped.t_asked_ns, dropped.took_ns), (0, 0));
    let mut answered = Vec::new();
    for _ in 0..3 {
        go.send(()).unwrap();
        answered.push(out.recv().await.unwrap().pending.released_seq);
    }
    assert_eq!(answered, [1, 3, 4]);
}

#[tokio::test]
async fn a_query_past_its_bound_times_out_and_the_next_waits_for_it() {
    let (query, mut started_rx, go) = HeldQuery::new();
    let most = Arc::clone(&query.most_at_once);
    let bound = Duration::from_millis(50);
    let (c, mut out) = checker(8, bound, query);
    c.push(pending(1));
    assert_eq!(started(&mut started_rx).await, 1);
    // NVML does not answer: release 1 times out, and release 2 is not asked while that query runs.
    let first = out.recv().await.unwrap();
    assert_eq!(first.pending.released_seq, 1);
    assert_eq!(first.view, NvmlView::Missing(NvmlMissing::TimedOut));
    assert_eq!(first.took_ns, 50_000_000);
    c.push(pending(2));
    let second = out.recv().await.unwrap();
    assert_eq!(second.pending.released_seq, 2);
    assert_eq!(second.view, NvmlView::Missing(NvmlMissing::TimedOut));
    // NVML answers the stale query at last; release 3 is asked and answered.
    go.send(()).unwrap();
    c.push(pending(3));
    assert_eq!(started(&mut started_rx).await, 3);
    go.send(()).unwrap();
    let third = out.recv().await.unwrap();
    assert_eq!(third.pending.released_seq, 3);
    assert_eq!(pids_listed(&third), [3]);
    assert_eq!(most.load(Ordering::SeqCst), 1, "never two queries at once");
}
