//! Two GPUs on one node, end to end (real containerd, runc, the Baton shim and agent, the FUSE mock driver
//! with two GPUs, the mock CUDA workload): the GPU-free gate keys on each GPU device a container sees, so a
//! container that sees both GPUs and works on the first keeps a Start that sees only the first waiting, and
//! lets one that sees only the second start at once. Both GPUs' files are the mock's own, told apart by the
//! file, not by its name in the container (the second GPU's is the server's /dev/nvidia0).
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use std::time::{Duration, Instant};

use baton_integration::cuda::{CudaRig, Trainer};

#[test]
fn a_start_that_sees_only_the_second_gpu_is_not_kept_waiting_by_a_holder_of_the_first() {
    let Some(rig) = CudaRig::start_with("multi-gpu", |o| baton_mock_nvidia::driver::MountOptions {
        gpus: 2,
        ..o
    }) else {
        return;
    };
    // A co-runner the agent never preempts, seeing both GPUs and working on the first.
    let second = format!(
        "type=bind,src={}/nvidia1,dst=/dev/nvidia1,options=rbind:rw",
        rig.gpu.mock_dir.path().display()
    );
    let co_runner = [("baton.io/role", "co-runner")];
    let _trainer = rig.run_with(
        "trainer",
        &Trainer::default(),
        &co_runner,
        &["--mount", &second],
    );
    rig.wait_held("trainer");

    let server = [
        ("baton.io/role", "latency-critical"),
        ("baton.io/wait-gpu-free", "30s"),
    ];
    let on_second = Trainer {
        gpu: 1,
        ..Trainer::default()
    };
    let _second = rig.create("second", &on_second, &server);
    let asked = Instant::now();
    rig.gpu.env.api().unwrap().start("second", "").unwrap();
    assert!(
        asked.elapsed() < Duration::from_secs(20),
        "the Start on the second GPU was not kept waiting: {:?}",
        asked.elapsed()
    );
    rig.wait_held("second");

    let short = [
        ("baton.io/role", "latency-critical"),
        ("baton.io/wait-gpu-free", "1s"),
    ];
    let _first = rig.create("first", &Trainer::default(), &short);
    let err = rig
        .gpu
        .env
        .api()
        .unwrap()
        .start("first", "")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("still held by container trainer") && !err.contains("container second"),
        "a Start on the first GPU waits for its holder alone: {err}"
    );
    assert_eq!(rig.task_status("trainer").as_deref(), Some("RUNNING"));
}
