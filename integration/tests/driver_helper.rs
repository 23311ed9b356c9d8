//! The driver helper on a real node (issue 29, item 4): a shim whose binary `baton install` replaced under it
//! (its /proc/PID/exe then reads "... (deleted)") still starts its helper, and the shim's log says which
//! library file the helper loaded. End to end: real containerd, runc, the Baton shim and agent, the FUSE mock
//! driver, the fake libcuda as the node's driver library; the cuda-checkpoint program is not there, so only
//! the helper can park the trainer. (Where the library is looked for and the version check against the kernel
//! module are unit tests of `shim/src/driver_library.rs`: no driver here.)
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use baton_integration::{
    cuda::{CudaRig, Trainer, WITHIN},
    shim_binary::{BATON_SHIM_NAME, baton_shim_binary},
};
use serde_json::{Value, json};

/// Replaces the shim program in `dir` by a fresh copy of `binary`, as an install does (write aside, rename
/// over): running shims keep the old file, now deleted.
fn install_shim(dir: &std::path::Path, binary: &std::path::Path) {
    let aside = dir.join(format!("{BATON_SHIM_NAME}.new"));
    std::fs::copy(binary, &aside).unwrap();
    std::fs::rename(&aside, dir.join(BATON_SHIM_NAME)).unwrap();
}

#[test]
fn a_shim_whose_binary_was_replaced_still_parks_through_its_helper_and_names_the_library() {
    let Some(rig) = CudaRig::start("helper-deleted-exe") else {
        return;
    };
    let binary = baton_shim_binary().unwrap();
    let shim_dir = rig.gpu.env.shim_dir();
    // A file of its own (the harness links the build's), so that replacing it deletes what the shim runs.
    std::fs::remove_file(shim_dir.join(BATON_SHIM_NAME)).unwrap();
    install_shim(&shim_dir, &binary);
    // `baton install` puts `baton` beside the shim, which starts the agent from there.
    std::os::unix::fs::symlink(binary.with_file_name("baton"), shim_dir.join("baton")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let library = baton_integration::trace_env::fake_libcuda_in(dir.path()).unwrap();
    let options = Some(baton_integration::api::runtime_options_toml(&format!(
        "cuda_driver_path = \"{}\"\ncuda_checkpoint_path = \"/nonexistent/cuda-checkpoint\"\n",
        library.display()
    )));
    let mut trainer = rig.create_with("trainer", &Trainer::default(), &[], options);
    rig.gpu.env.api().unwrap().start("trainer", "").unwrap();
    assert!(
        baton_integration::agent::wait_until(WITHIN, || rig.gpu.status("trainer")["gpu"]
            == json!("held")),
        "{}",
        rig.gpu.status("trainer")
    );
    install_shim(&shim_dir, &binary);
    let shims = rig.gpu.env.shims();
    assert_eq!(shims.len(), 1, "{shims:?}");
    let exe = std::fs::read_link(format!("/proc/{}/exe", shims[0].pid)).unwrap();
    assert!(
        exe.to_string_lossy().ends_with("(deleted)"),
        "the shim runs a replaced binary: {}",
        exe.display()
    );

    let (steps, outcome) = rig.baton_json(&["preempt", "trainer"]);
    assert_eq!(
        outcome["preemption"]["state"],
        json!("parked"),
        "{outcome}: {steps:?}"
    );
    let (steps, outcome) = rig.baton_json(&["resume", "trainer"]);
    assert_eq!(outcome["preemption"], Value::Null, "{outcome}: {steps:?}");
    let line = trainer.wait_line("restored checksum");
    assert!(line.ends_with("intact"), "{line}");
    let log = std::fs::read_to_string(rig.gpu.env.containerd().log_path()).unwrap();
    let said = format!("the CUDA driver helper loaded {}", library.display());
    assert!(log.contains(&said), "the shim's log says {said:?}:\n{log}");
}
