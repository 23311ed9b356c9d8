//! Driver version bands: the workload built for a band (NVOS21/NVOS64 sizes and status offsets, UVM
//! params) runs cleanly against a mock of the same version, and a mismatched pair fails.

mod common;

use baton_nvidia::class;
use common::{Mock, skip};

/// One version per band of the RM_ALLOC structs: <= 520, 525-530, >= 535.
const BANDS: [&str; 3] = ["520.61.05", "530.41.03", "595.45.04"];

#[test]
fn each_band_runs_against_a_mock_of_the_same_version() {
    if skip("each_band_runs_against_a_mock_of_the_same_version") {
        return;
    }
    for version in BANDS {
        let mock = Mock::mount(version, 4096);
        let finished = mock.run_workload(&mock.workload(version));
        assert!(finished.status.success(), "{version}: {finished:#?}");
        let summary = finished.summary.expect("summary");
        assert!(summary.all_ok(), "{version}: {:?}", summary.failed_statuses);
        assert_eq!(summary.driver_version, version);
        assert_eq!(summary.allocs_of(class::NV01_ROOT_CLIENT), 1, "{version}");
        // UVM_MM_INITIALIZE only exists from 535 on.
        let mm_initialize = summary.uvm_commands.contains_key("UVM_MM_INITIALIZE");
        assert_eq!(
            mm_initialize,
            version.starts_with("595"),
            "{version}: {:?}",
            summary.uvm_commands
        );
        let state = mock.idle_state();
        assert_eq!(state.driver_version, version);
        assert!(state.is_idle(), "{version}: {:#?}", state.files);
        assert_eq!(state.totals.failed_statuses, 0, "{version}");
    }
}

#[test]
fn a_workload_of_another_band_fails() {
    if skip("a_workload_of_another_band_fails") {
        return;
    }
    let mock = Mock::mount("595.45.04", 4096);
    let finished = mock.run_workload(&mock.workload("520.61.05"));
    assert!(
        !finished.status.success(),
        "a 40-byte NVOS64 must be refused by a 595 driver"
    );
    assert!(
        !finished.lines.iter().any(|l| l == "phase setup-done"),
        "{:?}",
        finished.lines
    );
    let state = mock.idle_state();
    assert!(state.is_idle() && state.totals.allocs == 0, "{state:#?}");
}

#[test]
fn version_check_refuses_a_different_version_of_the_same_band() {
    if skip("version_check_refuses_a_different_version_of_the_same_band") {
        return;
    }
    let mock = Mock::mount("595.45.04", 4096);
    let finished = mock.run_workload(&mock.workload("590.44.01"));
    assert!(
        !finished.status.success(),
        "CHECK_VERSION_STR is strict: {finished:#?}"
    );
    assert!(!finished.lines.iter().any(|l| l == "phase setup-done"));
    assert!(mock.idle_state().is_idle());
}
