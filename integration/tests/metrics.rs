//! The agent's Prometheus endpoint, end to end: a foreground `baton agent` with `--metrics-addr`, the FUSE
//! mock driver, a mock CUDA workload in a cgroup of its own registered over the agent's socket as a shim
//! registers a CRI container (with its pod's names), scraped with a real HTTP client and parsed strictly.
//! The values are checked against what the workload did (its summary); a flood of connections, idle and
//! garbage requests is bounded and leaves the socket answering.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use std::{
    collections::BTreeMap,
    io::{Read, Write},
    net::TcpStream,
    path::Path,
    process::Child,
    time::{Duration, Instant},
};

use baton_integration::{
    agent::{AgentConn, AgentProcess, wait_until},
    metrics::{Exposition, client, get, scrape, url_from_log},
    procs::rss_bytes,
    skip,
    trace_env::{TraceEnv, missing_trace_prerequisite},
};
use baton_mock_nvidia::driver::DEFAULT_DRIVER_VERSION;
use baton_tracer::cgroups;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(30);
const MIB: f64 = 1024.0 * 1024.0;
/// The labels the registration gives (CRI's pod annotations, as the shim passes them on).
const LABELS: [(&str, &str); 4] = [
    ("namespace", "serving"),
    ("pod", "llm-0"),
    ("container", "server"),
    ("container_id", "trainer-1"),
];

/// The mock driver, an agent with metrics on a free port, and a registered container cgroup whose init
/// is a placeholder (so that the agent watches it before the workload allocates anything).
struct Rig {
    env: TraceEnv,
    agent: AgentProcess,
    url: String,
    http: ureq::Agent,
    _init: ChildGuard,
    _dir: tempfile::TempDir,
}

struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Rig {
    fn start(name: &str) -> Option<Self> {
        if let Some(reason) = missing_trace_prerequisite() {
            skip::missing(&reason);
            return None;
        }
        let env = TraceEnv::start(name, DEFAULT_DRIVER_VERSION).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("agent.log");
        let agent = AgentProcess::start_with(
            &dir.path().join("agent.sock"),
            &log,
            &["--metrics-addr", "127.0.0.1:0"],
        )
        .unwrap();
        let url = url_from_log(&log, WAIT).unwrap();
        env.make_cgroup("trainer").unwrap();
        let cg = cgroups::find_v2_root()
            .unwrap()
            .join(env.cgroup_rel("trainer").trim_start_matches('/'));
        let init = cgroups::command_in(&cg, Path::new("sleep"), &["1000".to_owned()])
            .spawn()
            .unwrap();
        let init = ChildGuard(init);
        // The placeholder is in the cgroup once its shell has moved itself and exec'd sleep.
        assert!(wait_until(WAIT, || {
            std::fs::read_to_string(format!("/proc/{}/cmdline", init.0.id()))
                .is_ok_and(|c| c.starts_with("sleep"))
        }));
        let dev = env.dev_dir().to_owned();
        let mut conn = AgentConn::connect(agent.socket()).unwrap();
        conn.call(json!({
            "op": "register", "id": "trainer-1", "namespace": "metrics-test",
            "cgroup": env.cgroup_rel("trainer"), "init_pid": init.0.id(),
            "devices": [dev.join("nvidiactl"), dev.join("nvidia0")],
            "settings": {"trace_prefix": format!("{}/nvidia", dev.display())},
            "kubernetes": {"namespace": "serving", "pod": "llm-0", "container": "server"},
        }))
        .unwrap();
        Some(Self {
            env,
            agent,
            url,
            http: client(),
            _init: init,
            _dir: dir,
        })
    }

    fn scrape(&self) -> Exposition {
        scrape(&self.http, &self.url).unwrap()
    }

    /// Scrapes until `cond` holds; panics after WAIT with the last exposition.
    fn scrape_until(&self, what: &str, cond: impl Fn(&Exposition) -> bool) -> Exposition {
        let deadline = Instant::now() + WAIT;
        loop {
            let e = self.scrape();
            if cond(&e) {
                return e;
            }
            assert!(Instant::now() < deadline, "{what} never held: {e:#?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The container's value of `name` (the labels of the registration).
    fn mine(e: &Exposition, name: &str) -> f64 {
        e.value(name, &LABELS).unwrap()
    }

    /// Starts the workload holding `vram_mib` and waits until the metrics show all of it.
    fn hold(&mut self, vram_mib: u64) -> usize {
        let w = self.env.spawn_workload("trainer", vram_mib, 4).unwrap();
        self.env
            .workload(w)
            .wait_line("phase holding", WAIT)
            .unwrap();
        let want = vram_mib as f64 * MIB;
        self.scrape_until("the ledger's memory shows in the metrics", |e| {
            e.value("baton_container_gpu_memory_bytes", &LABELS).ok() == Some(want)
        });
        w
    }
}

/// Objects by class name, of the container.
fn objects(e: &Exposition) -> BTreeMap<String, u64> {
    e.matching("baton_container_rm_objects", &LABELS)
        .map(|s| (s.labels["class"].clone(), s.value as u64))
        .collect()
}

#[test]
fn the_metrics_follow_a_known_workload_with_its_pods_labels() {
    let Some(mut rig) = Rig::start("metrics") else {
        return;
    };
    let before = rig.scrape();
    assert_eq!(before.value("baton_watched_containers", &[]).unwrap(), 1.0);
    assert_eq!(before.value("baton_probes_attached", &[]).unwrap(), 1.0);
    assert_eq!(Rig::mine(&before, "baton_container_gpu_memory_bytes"), 0.0);
    assert_eq!(Rig::mine(&before, "baton_container_gpu_held"), 0.0);
    let releases = |e: &Exposition| e.sum("baton_release_confirm_seconds_count", &[]);
    let released_before = releases(&before);

    let w = rig.hold(768);
    let held = rig.scrape();
    assert_eq!(Rig::mine(&held, "baton_container_gpu_held"), 1.0);
    assert_eq!(
        Rig::mine(&held, "baton_container_nvidia_fds"),
        6.0,
        "nvidiactl, nvidia0, two nvidia-uvm fds, and the OS-event nvidia0 fd and its dup"
    );
    assert_eq!(
        Rig::mine(&held, "baton_container_nvidia_mappings"),
        2.0,
        "video memory through nvidia0 and system memory through nvidiactl"
    );
    assert_eq!(Rig::mine(&held, "baton_container_ledger_partial"), 0.0);
    let live = objects(&held);

    // Teardown: every object and file goes, and the release is counted.
    let summary = rig.env.workload(w).finish().unwrap();
    let after = rig.scrape_until("the release is counted", |e| {
        releases(e) > released_before
            && e.value("baton_container_gpu_held", &LABELS).ok() == Some(0.0)
    });
    assert_eq!(Rig::mine(&after, "baton_container_gpu_memory_bytes"), 0.0);
    assert_eq!(
        Rig::mine(&after, "baton_container_gpu_memory_peak_bytes"),
        768.0 * MIB
    );
    assert!(objects(&after).is_empty(), "{:?}", objects(&after));
    assert_eq!(Rig::mine(&after, "baton_container_nvidia_fds"), 0.0);
    assert!(
        after.sum("baton_release_signal_seconds_sum", &[])
            >= after.sum("baton_release_confirm_seconds_sum", &[]),
        "a release is published after it is confirmed"
    );

    // What was live while holding is what the workload allocated, class by class.
    let allocated: BTreeMap<String, u64> = summary
        .allocs_by_class
        .iter()
        .map(|(c, n)| (baton_nvidia::class::name(*c).unwrap().to_owned(), *n))
        .collect();
    assert_eq!(live, allocated);

    // Every call the workload made is counted, under its escape or UVM command.
    let lost = after.value("baton_probe_records_lost_total", &[]).unwrap();
    let mut calls = summary.escapes.clone();
    calls.extend(summary.uvm_commands.clone());
    for (escape, n) in &calls {
        let mut labels = LABELS.to_vec();
        labels.push(("escape", escape));
        let counted = after
            .value("baton_container_ioctls_total", &labels)
            .unwrap();
        if lost == 0.0 {
            assert_eq!(counted, *n as f64, "{escape}");
        } else {
            assert!(counted <= *n as f64, "{escape}");
        }
    }
    let total: u64 = calls.values().sum();
    let counted = after.sum("baton_container_ioctls_total", &LABELS);
    assert!(counted >= total as f64 || lost > 0.0, "{counted} < {total}");
    assert!(summary.all_ok());
    assert_eq!(
        after.sum("baton_container_ioctl_errors_total", &LABELS),
        0.0
    );

    // Unregistered, the container's series go; the event histograms stay.
    let mut conn = AgentConn::connect(rig.agent.socket()).unwrap();
    conn.call(json!({"op": "unregister", "id": "trainer-1", "namespace": "metrics-test"}))
        .unwrap();
    let gone = rig.scrape();
    assert_eq!(gone.value("baton_watched_containers", &[]).unwrap(), 0.0);
    assert_eq!(
        gone.matching("baton_container_gpu_memory_bytes", &[])
            .count(),
        0
    );
    assert_eq!(releases(&gone), releases(&after));
}

/// Connects and sends `bytes` (maybe nothing), keeping the connection open.
fn open(addr: &str, bytes: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(bytes).unwrap();
    s
}

/// What the server sends until it closes (or `within` passes: then `None`).
fn read_to_close(s: &mut TcpStream, within: Duration) -> Option<String> {
    s.set_read_timeout(Some(within)).unwrap();
    let mut out = Vec::new();
    match s.read_to_end(&mut out) {
        Ok(_) => Some(String::from_utf8_lossy(&out).into_owned()),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
            Some(String::from_utf8_lossy(&out).into_owned())
        }
        Err(_) => None,
    }
}

/// The status line's code of a raw request's answer.
fn raw_status(addr: &str, request: &[u8]) -> u16 {
    let mut s = open(addr, request);
    let answer = read_to_close(&mut s, WAIT).expect("the agent closes after answering");
    answer
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no HTTP answer to {request:?}: {answer:?}"))
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

#[test]
fn a_flood_of_metrics_requests_is_bounded_and_the_socket_keeps_answering() {
    let Some(mut rig) = Rig::start("metrics-flood") else {
        return;
    };
    let w = rig.hold(256);
    let addr = rig
        .url
        .trim_start_matches("http://")
        .trim_end_matches("/metrics")
        .to_owned();
    let pid = rig.agent.pid();

    // Wrong method, path or syntax: clear HTTP errors.
    let (status, _, body) = get(&rig.http, &format!("http://{addr}/nope")).unwrap();
    assert_eq!(status, 404, "{body}");
    assert!(body.contains("/metrics"), "{body}");
    let post = rig.http.post(&rig.url).send("x").unwrap();
    assert_eq!(post.status().as_u16(), 405);
    assert_eq!(post.headers()["allow"], "GET, HEAD");
    assert_eq!(raw_status(&addr, b"GARBAGE\r\n\r\n"), 400);
    let mut huge = b"GET /metrics HTTP/1.1\r\nx-pad: ".to_vec();
    huge.extend(std::iter::repeat_n(b'a', 64 * 1024));
    huge.extend(b"\r\n\r\n");
    let code = raw_status(&addr, &huge);
    assert!(code == 431 || code == 400, "an oversized head: {code}");

    // Many scrapes at once are all answered.
    let scrapers: Vec<_> = (0..40)
        .map(|_| {
            let (http, url) = (rig.http.clone(), rig.url.clone());
            std::thread::spawn(move || scrape(&http, &url).map(|_| ()))
        })
        .collect();
    for s in scrapers {
        s.join().unwrap().unwrap();
    }

    // Hundreds of idle (slowloris) connections: the agent holds a bounded number, refuses the rest with
    // 503, and its socket keeps answering.
    let rss_before = rss_bytes(pid as i32).unwrap();
    let fds_before = open_fds(pid);
    let mut idle: Vec<TcpStream> = (0..400)
        .map(|i| {
            let partial: &[u8] = if i % 2 == 0 {
                b"GET /metrics HTTP/1.1\r\nHost: x\r\n"
            } else {
                b""
            };
            open(&addr, partial)
        })
        .collect();
    let mut conn = AgentConn::connect(rig.agent.socket()).unwrap();
    for _ in 0..20 {
        let t = Instant::now();
        let status = conn.call(json!({"op": "status"})).unwrap();
        assert_eq!(status["containers"].as_array().unwrap().len(), 1);
        assert!(
            t.elapsed() < Duration::from_secs(2),
            "status took {:?} during the flood",
            t.elapsed()
        );
        let held = open_fds(pid);
        assert!(
            held <= fds_before + 64 + 8,
            "the agent holds {held} fds during the flood ({fds_before} before)"
        );
    }
    let refused =
        read_to_close(idle.last_mut().unwrap(), WAIT).expect("a refused connection is closed");
    assert!(refused.starts_with("HTTP/1.1 503"), "{refused:?}");
    // The held ones are closed by the agent once their head is overdue.
    let t = Instant::now();
    for s in idle.iter_mut().take(64) {
        let answer = read_to_close(s, WAIT).expect("an idle connection is closed by the agent");
        assert!(
            answer.is_empty() || answer.starts_with("HTTP/1.1 408"),
            "{answer:?}"
        );
    }
    assert!(t.elapsed() < WAIT);
    drop(idle);

    // After the flood: the values are still right, and the agent did not grow.
    let e = rig.scrape();
    assert_eq!(
        Rig::mine(&e, "baton_container_gpu_memory_bytes"),
        256.0 * MIB
    );
    assert!(wait_until(WAIT, || open_fds(pid) <= fds_before + 2));
    let rss_after = rss_bytes(pid as i32).unwrap();
    assert!(
        rss_after < rss_before + 32 * 1024 * 1024,
        "RSS {rss_before} -> {rss_after} bytes"
    );
    rig.env.workload(w).finish().unwrap();
}
