//! The golden traces under integration/golden/<driver version>/ (written by `tools/gpu-check`, real GPUs and
//! the mock alike) replayed through today's decoder and ledger: every ioctl's captured bytes decode to the
//! object the trace holds, nothing in them is unnamed, and the ledger reaches the peak recorded beside each
//! trace (`NAME.expect.json`). No GPU is needed: the bytes are in the files.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use std::path::{Path, PathBuf};

use baton_integration::gpu_check::{count, replay};
use serde_json::Value;

fn golden_traces() -> Vec<(String, PathBuf)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("golden");
    let mut found = Vec::new();
    for dir in std::fs::read_dir(&root).unwrap() {
        let dir = dir.unwrap().path();
        let version = dir.file_name().unwrap().to_string_lossy().into_owned();
        for file in std::fs::read_dir(&dir).unwrap() {
            let file = file.unwrap().path();
            if file.extension().is_some_and(|e| e == "jsonl") {
                found.push((version.clone(), file));
            }
        }
    }
    found.sort();
    found
}

#[test]
fn every_golden_trace_decodes_again_to_what_it_holds() {
    let traces = golden_traces();
    // The mock's own trace is kept too, so that there is always at least one.
    assert!(
        traces.iter().any(|(_, f)| f.ends_with("mock-1gib.jsonl")),
        "{traces:?}"
    );
    for (version, trace) in traces {
        let shown = trace.display();
        let expect: Value = serde_json::from_str(
            &std::fs::read_to_string(trace.with_extension("expect.json"))
                .unwrap_or_else(|e| panic!("{shown} has no .expect.json beside it: {e}")),
        )
        .unwrap();
        assert_eq!(expect["driver_version"], version.as_str(), "{shown}");
        let replayed = replay::replay_file(&trace, &version).unwrap();
        assert!(replayed.ioctls > 0, "{shown}: no ioctls");
        assert_eq!(Some(replayed.ioctls), expect["ioctls"].as_u64(), "{shown}");
        assert!(
            replayed.differences.is_empty(),
            "{shown}: {} lines decode differently now; the first (line, recorded, now): {:?}",
            replayed.differences.len(),
            replayed.differences.first()
        );
        assert_eq!(
            Some(replayed.peak_vram_bytes),
            expect["ledger_peak_bytes"].as_u64(),
            "{shown}"
        );
        let counts = count::count_file(&trace).unwrap();
        assert_eq!(counts.unknowns(), 0, "{shown}: {counts:?}");
    }
}

#[test]
fn a_decoder_that_reads_another_offset_is_caught() {
    // The replay is only worth something if a changed decoding shows: the same trace decoded with an old
    // band's layouts (515.43.04) must differ somewhere.
    let (_, trace) = golden_traces()
        .into_iter()
        .find(|(_, f)| f.ends_with("mock-1gib.jsonl"))
        .unwrap();
    let replayed = replay::replay_file(&trace, "515.43.04").unwrap();
    assert!(!replayed.differences.is_empty());
}
