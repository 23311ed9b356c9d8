//! The freezer against this kernel's cgroups (root): a child in a fresh v1 freezer cgroup and one in a fresh v2
//! cgroup under the cgroup2 mount (cgroup.freeze needs no controller), sleeping and spinning. Frozen is checked
//! on the processes themselves: their threads stop running (/proc/PID/task/*/schedstat stays the same) and, in
//! v1, sit in the refrigerator (state D); thawed, they run again.
use std::{
    path::{Path, PathBuf},
    process::{Child, Stdio},
    time::{Duration, Instant},
};

use baton_cgroups::freezer::{CgroupVersion, Freezer, FreezerState, Roots};

const TIMEOUT: Duration = Duration::from_secs(5);

/// A cgroup of this test's own with one child process in it; thawed, emptied and removed on drop.
struct Fixture {
    dir: PathBuf,
    child: Child,
}

impl Fixture {
    /// `python3 -c script` in a new cgroup under `root`, or `None` (after the prerequisite rule) when this host
    /// lacks what the test needs.
    fn start(version: CgroupVersion, name: &str, script: &str) -> Option<Self> {
        if !procfs::process::Process::myself()
            .and_then(|p| p.status())
            .is_ok_and(|s| s.euid == 0)
        {
            baton_prereq::missing("the freezer tests need root (they create cgroups)");
            return None;
        }
        let roots = Roots::detect().expect("read mountinfo");
        let root = match version {
            CgroupVersion::V1 => roots.v1_freezer,
            CgroupVersion::V2 => roots.v2,
        };
        let Some(root) = root else {
            baton_prereq::missing(&format!("no cgroup {version} freezer hierarchy is mounted"));
            return None;
        };
        let dir = baton_cgroups::create(
            &root,
            &format!("baton-freezer-test-{}-{name}", std::process::id()),
        )
        .expect("create the test cgroup");
        let child = baton_cgroups::command_in(
            &dir,
            Path::new("/usr/bin/python3"),
            &["-c".into(), script.into()],
        )
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn python3 (Debian package python3)");
        let fixture = Self { dir, child };
        let pid = fixture.pid();
        wait_until("the child is in its cgroup and started its threads", || {
            std::fs::read_to_string(fixture.dir.join("cgroup.procs"))
                .is_ok_and(|procs| procs.lines().any(|l| l == pid.to_string()))
                && std::fs::read_to_string(format!("/proc/{pid}/comm"))
                    .is_ok_and(|c| c.trim() == "python3")
                && threads(pid).len() > script.matches("Thread(").count().min(1)
        });
        Some(fixture)
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = std::fs::write(self.dir.join("freezer.state"), "THAWED");
        let _ = std::fs::write(self.dir.join("cgroup.freeze"), "0");
        let _ = self.child.kill();
        let _ = self.child.wait();
        // A forked child may still be exiting: the cgroup can be removed once it is empty.
        let deadline = Instant::now() + TIMEOUT;
        while baton_cgroups::remove(&self.dir).is_err() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}

const SLEEPERS: &str = "import threading, time\n\
def tick():\n    while True: time.sleep(0.001)\n\
for _ in range(3): threading.Thread(target=tick, daemon=True).start()\n\
tick()\n";
const SPINNERS: &str = "import threading\n\
def spin():\n    while True: pass\n\
for _ in range(3): threading.Thread(target=spin, daemon=True).start()\n\
spin()\n";

fn threads(pid: u32) -> Vec<PathBuf> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| d.flatten().map(|e| e.path()).collect())
        .unwrap_or_default()
}

/// What the threads have run so far, summed: (ns on a CPU, number of times scheduled), from schedstat.
fn progress(pid: u32) -> (u64, u64) {
    threads(pid).iter().fold((0, 0), |(ns, runs), t| {
        let s = std::fs::read_to_string(t.join("schedstat")).unwrap_or_default();
        let f: Vec<u64> = s
            .split_whitespace()
            .filter_map(|v| v.parse().ok())
            .collect();
        (
            ns + f.first().copied().unwrap_or(0),
            runs + f.get(2).copied().unwrap_or(0),
        )
    })
}

fn states(pid: u32) -> Vec<char> {
    threads(pid)
        .iter()
        .filter_map(|t| {
            let stat = std::fs::read_to_string(t.join("stat")).ok()?;
            stat.rsplit_once(") ")?.1.chars().next()
        })
        .collect()
}

fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + TIMEOUT;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Frozen: the threads do not run over a window in which 1 ms sleepers would be scheduled about 200 times and
/// spinners would use 50 ms of CPU. The kernel counts a task frozen just before it switches out, and a frozen
/// task can be woken spuriously and go straight back into the freezer: one such schedule of microseconds per
/// thread, and two more, are tolerated. In v1 the threads sit in the refrigerator (state D).
///
/// The window starts once every thread is off its CPU (their CPU time unchanged for longer than a
/// scheduler tick, which is how often schedstat's figure moves for a running thread): a thread that was
/// running when it entered the freezer has the time since the scheduler's last update of it added when it
/// switches out, after the freezer already says FROZEN (seen in CI: 0 new schedules, 1.4 ms). Threads that
/// keep running never get there, and the wait fails.
fn assert_stopped(pid: u32, version: CgroupVersion) {
    const LONGER_THAN_A_TICK: Duration = Duration::from_millis(12);
    let (mut last, mut since) = (progress(pid).0, Instant::now());
    wait_until("the frozen threads are off their CPUs", || {
        let now = progress(pid).0;
        if now != last {
            (last, since) = (now, Instant::now());
        }
        since.elapsed() > LONGER_THAN_A_TICK
    });
    let (ns, runs) = progress(pid);
    let tolerated = threads(pid).len() as u64 + 2;
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(50) {
        let (ns_now, runs_now) = progress(pid);
        assert!(
            runs_now - runs <= tolerated && ns_now - ns < 1_000_000,
            "{version}: frozen threads ran: {} schedules, {} ns",
            runs_now - runs,
            ns_now - ns
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    if version == CgroupVersion::V1 {
        assert!(
            states(pid).iter().all(|s| *s == 'D'),
            "v1 frozen threads are in D: {:?}",
            states(pid)
        );
    }
}

fn assert_runs(pid: u32) {
    let before = progress(pid);
    wait_until("the thawed threads run again", || progress(pid) != before);
}

fn cycle(version: CgroupVersion, name: &str, script: &str) {
    let Some(fx) = Fixture::start(version, name, script) else {
        return;
    };
    let f = Freezer::open(&fx.dir, version).expect("open the freezer");
    assert_runs(fx.pid());
    for _ in 0..3 {
        let took = f.freeze_blocking(TIMEOUT).expect("freeze");
        assert_eq!(
            f.state().expect("state"),
            FreezerState::Frozen,
            "after {took:?}"
        );
        assert_stopped(fx.pid(), version);
        f.thaw_blocking(TIMEOUT).expect("thaw");
        assert_eq!(f.state().expect("state"), FreezerState::Thawed);
        assert_runs(fx.pid());
    }
}

#[test]
fn v1_freezes_and_thaws_sleeping_threads() {
    cycle(CgroupVersion::V1, "v1-sleep", SLEEPERS);
}

#[test]
fn v1_freezes_and_thaws_spinning_threads() {
    cycle(CgroupVersion::V1, "v1-spin", SPINNERS);
}

#[test]
fn v2_freezes_and_thaws_sleeping_threads() {
    cycle(CgroupVersion::V2, "v2-sleep", SLEEPERS);
}

#[test]
fn v2_freezes_and_thaws_spinning_threads() {
    cycle(CgroupVersion::V2, "v2-spin", SPINNERS);
}

/// The async API on a current-thread runtime, many quick cycles (notifications are rate-limited then): each
/// freeze is confirmed, and the processes really stop.
#[test]
fn async_cycles_confirm_every_freeze_in_v1_and_v2() {
    for version in [CgroupVersion::V1, CgroupVersion::V2] {
        let Some(fx) = Fixture::start(version, &format!("async-{version}"), SLEEPERS) else {
            return;
        };
        let f = Freezer::open(&fx.dir, version).expect("open the freezer");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            for _ in 0..200 {
                f.freeze(TIMEOUT).await.expect("freeze");
                assert_eq!(f.state().expect("state"), FreezerState::Frozen);
                f.thaw(TIMEOUT).await.expect("thaw");
            }
            f.freeze(TIMEOUT).await.expect("freeze");
        });
        assert_stopped(fx.pid(), version);
        f.thaw_blocking(TIMEOUT).expect("thaw");
        assert_runs(fx.pid());
    }
}

/// Where runc puts a container on this hybrid host (a v1 freezer cgroup and a v2 one), the v1 freezer is the one
/// chosen; with only the v2 cgroup, the v2 one.
#[test]
fn for_pid_finds_the_freezer_runc_would_use() {
    let Some(v2) = Fixture::start(CgroupVersion::V2, "locate", SLEEPERS) else {
        return;
    };
    let own_v1 = baton_cgroups::of_pid(std::process::id())
        .unwrap_or_default()
        .into_iter()
        .find(|cg| cg.controllers.iter().any(|c| c == "freezer"))
        .map(|cg| cg.pathname);
    if own_v1.as_deref().is_none_or(|p| p == "/") {
        let f = Freezer::for_pid(v2.pid()).expect("locate");
        assert_eq!(
            (f.version(), f.path()),
            (CgroupVersion::V2, v2.dir.as_path())
        );
    }
    let roots = Roots::detect().expect("mountinfo");
    let v1_root = roots.v1_freezer.expect("a v1 freezer");
    let v1_dir = baton_cgroups::create(
        &v1_root,
        &format!("baton-freezer-test-{}-locate", std::process::id()),
    )
    .expect("create v1 cgroup");
    baton_cgroups::move_pid(&v1_dir, v2.pid()).expect("join the v1 freezer cgroup");
    let f = Freezer::for_pid(v2.pid()).expect("locate");
    assert_eq!(
        (f.version(), f.path()),
        (CgroupVersion::V1, v1_dir.as_path())
    );
    drop(v2);
    let _ = baton_cgroups::remove(&v1_dir);
}

/// A v1 cgroup whose tasks keep forking (what defeats a single write): the freeze still completes (FROZEN is
/// written again on every re-read, and a stuck freeze is thawed and retried, as runc does).
#[test]
fn v1_freezes_a_cgroup_that_keeps_forking() {
    let forker = "import os\nwhile True:\n    pid = os.fork()\n    if pid == 0: os._exit(0)\n    os.waitpid(pid, 0)\n";
    let Some(fx) = Fixture::start(CgroupVersion::V1, "v1-fork", forker) else {
        return;
    };
    let f = Freezer::open(&fx.dir, CgroupVersion::V1).expect("open the freezer");
    for _ in 0..20 {
        f.freeze_blocking(TIMEOUT).expect("freeze a forking cgroup");
        assert_eq!(f.state().expect("state"), FreezerState::Frozen);
        f.thaw_blocking(TIMEOUT).expect("thaw");
    }
}
