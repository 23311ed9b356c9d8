//! The golden traces under integration/golden/<driver version>/ (written by `tools/gpu-check`, real GPUs and
//! the mock alike; `.jsonl`, or `.jsonl.gz` for long recordings) replayed through today's decoder and ledger:
//! every ioctl's captured bytes decode to the object the trace holds, nothing in them is unnamed, and the
//! ledger reaches the peak recorded beside each trace (`NAME.expect.json`). No GPU is needed: the bytes are in
//! the files. The H200 recordings (580.159.04) are also checked for what they showed: the calls that used to
//! decode empty, and a park that frees every object and the root client of the parked process.
//!
//! After a deliberate decoder change the traces differ: `BATON_BLESS_GOLDEN=1 cargo test -p baton-integration
//! --test golden_replay` writes them again as today's decoder decodes them (recorded bytes unchanged); review
//! the diff and commit it.
#![allow(
    clippy::unwrap_used,
    reason = "test helpers fail the test by panicking"
)]
use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
};

use baton_integration::gpu_check::{
    count,
    replay::{self, LedgerView, Replay, Replayed},
};
use baton_nvidia::{class, decode::Op, status};
use serde_json::Value;

/// Where the H200's recordings are kept.
const H200: &str = "580.159.04";

fn golden_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("golden")
}

/// `NAME.jsonl` or `NAME.jsonl.gz` -> `NAME.expect.json`.
fn expectation_of(trace: &Path) -> PathBuf {
    let name = trace.file_name().unwrap().to_string_lossy();
    let stem = name
        .strip_suffix(".jsonl.gz")
        .or_else(|| name.strip_suffix(".jsonl"))
        .unwrap();
    trace.with_file_name(format!("{stem}.expect.json"))
}

fn golden_traces() -> Vec<(String, PathBuf)> {
    let mut found = Vec::new();
    for dir in std::fs::read_dir(golden_root()).unwrap() {
        let dir = dir.unwrap().path();
        let version = dir.file_name().unwrap().to_string_lossy().into_owned();
        for file in std::fs::read_dir(&dir).unwrap() {
            let file = file.unwrap().path();
            let name = file.file_name().unwrap().to_string_lossy().into_owned();
            if name.ends_with(".jsonl") || name.ends_with(".jsonl.gz") {
                found.push((version.clone(), file));
            }
        }
    }
    found.sort();
    found
}

/// The H200 recording `name`, replayed.
fn h200(name: &str) -> Replay {
    replay::replay_file(&golden_root().join(H200).join(name), H200).unwrap()
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
            &std::fs::read_to_string(expectation_of(&trace))
                .unwrap_or_else(|e| panic!("{shown} has no .expect.json beside it: {e}")),
        )
        .unwrap();
        assert_eq!(expect["driver_version"], version.as_str(), "{shown}");
        let replayed = replay::replay_file(&trace, &version).unwrap();
        if std::env::var_os("BATON_BLESS_GOLDEN").is_some() && !replayed.differences.is_empty() {
            replay::write_trace(&trace, &replayed.rewritten).unwrap();
            eprintln!(
                "{shown}: written again ({} lines changed)",
                replayed.differences.len()
            );
            continue;
        }
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
        // Nothing unnamed, in the file as tools/gpu-check counts it and in today's decoding of its bytes.
        let counts = count::count_file(&trace).unwrap();
        assert_eq!(counts.unknowns(), 0, "{shown}: {counts:?}");
        assert_eq!(
            replayed.counts.unknowns(),
            0,
            "{shown}: {:?}",
            replayed.counts
        );
        assert_eq!(expect["unknowns"], 0, "{shown}");
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

/// The PyTorch program's peak as NVML measured it per process on the H200 (1 ms poll, the recording's
/// report.json: nvml_peak_bytes); the agent's ledger reached the same when the trace was taken.
const PYTORCH_NVML_PEAK: u64 = 1_950_351_360;

#[test]
fn the_h200_pytorch_program_reaches_the_peak_nvml_measured() {
    let pytorch = h200("pytorch-1gib.jsonl");
    assert_eq!(pytorch.peak_vram_bytes, PYTORCH_NVML_PEAK);
    assert_eq!(pytorch.counts.ioctls, 557);
}

/// What decoded with no field on the H200 (the recording's README): every UVM_MAP_EXTERNAL_ALLOCATION (only
/// the head of its 9264 bytes is captured) and NV_ESC_RM_UPDATE_DEVICE_MAPPING_INFO (no decoder). Now each
/// has its fields: a mapping of a GPU the same process registered with UVM, and a move of a CPU mapping from
/// the address RM_MAP_MEMORY answered to the one the process mmap()ed, with RM's status.
#[test]
fn the_h200_calls_that_decoded_empty_have_their_fields() {
    for name in ["pytorch-1gib.jsonl", "park-program.jsonl.gz"] {
        let trace = h200(name);
        let registered: BTreeSet<&str> = trace
            .events
            .iter()
            .filter(|e| e.object["escape"] == "UVM_REGISTER_GPU")
            .filter_map(|e| e.object["fields"]["gpu_uuid"].as_str())
            .collect();
        assert!(!registered.is_empty(), "{name}");
        let linear: BTreeSet<u64> = ioctls(&trace, "NV_ESC_RM_MAP_MEMORY")
            .filter_map(|e| e.object["fields"]["pLinearAddress"].as_u64())
            .collect();
        let mapped: BTreeSet<u64> = trace
            .events
            .iter()
            .filter(|e| e.kind() == "mmap")
            .filter_map(|e| e.object["addr"].as_u64())
            .collect();

        let mut maps = 0;
        for e in ioctls(&trace, "UVM_MAP_EXTERNAL_ALLOCATION") {
            let f = &e.object["fields"];
            assert!(f["length"].as_u64().is_some_and(|l| l > 0), "{name}: {f}");
            let gpus = f["perGpuAttributes"].as_str().unwrap_or_default();
            assert!(
                registered.iter().any(|uuid| gpus.starts_with(uuid)),
                "{name} line {}: {gpus:?} is no GPU of {registered:?}",
                e.line
            );
            maps += 1;
        }
        let mut updates = 0;
        for e in ioctls(&trace, "NV_ESC_RM_UPDATE_DEVICE_MAPPING_INFO") {
            let f = &e.object["fields"];
            assert_eq!(e.object["status"], status::NV_OK, "{name} line {}", e.line);
            let old = f["pOldCpuAddress"].as_u64().unwrap();
            let new = f["pNewCpuAddress"].as_u64().unwrap();
            assert!(linear.contains(&old), "{name} line {}: {old:#x}", e.line);
            assert!(mapped.contains(&new), "{name} line {}: {new:#x}", e.line);
            updates += 1;
        }
        assert!(
            maps > 0 && updates > 0,
            "{name}: {maps} maps, {updates} updates"
        );
    }
}

/// The re-decoded ioctls of `escape` in `trace`.
fn ioctls<'a>(trace: &'a Replay, escape: &'a str) -> impl Iterator<Item = &'a Replayed> + 'a {
    trace
        .events
        .iter()
        .filter(move |e| e.kind() == "ioctl" && e.object["escape"] == escape)
}

/// The parked process of park-program.jsonl.gz, and the thread the driver's checkpoint ran in.
const PARKED_PID: u64 = 440;
const CHECKPOINT_TID: u64 = 462;
/// The `cuda-checkpoint` runs of that recording: one for the checkpoint, one for the restore.
const CHECKPOINT_RUN: u64 = 466;
const RESTORE_RUN: u64 = 472;

/// The parked process as the recording shows it: its calls in one ledger, the objects it allocated by
/// client, its NVIDIA fds.
#[derive(Default)]
struct Parked {
    ledger: LedgerView,
    handles: BTreeMap<u32, BTreeSet<u32>>,
    fds: BTreeSet<i64>,
}

impl Parked {
    fn follow(&mut self, e: &Replayed) {
        let fd = e.object["fd"].as_i64();
        match (e.kind(), &e.call) {
            ("ioctl", Some((op, status))) => {
                if let &Op::Alloc {
                    client,
                    object,
                    class,
                    ..
                } = op
                {
                    let client = if class::is_root(class) {
                        object
                    } else {
                        client
                    };
                    self.handles.entry(client).or_default().insert(object);
                }
                self.ledger.apply(PARKED_PID as u32, op, *status);
            }
            ("open" | "dup", _) => {
                self.fds.insert(fd.unwrap());
            }
            ("close", _) => {
                self.fds.remove(&fd.unwrap());
            }
            ("close_range", _) => {
                let (first, last) = (e.object["addr"].as_i64(), e.object["len"].as_i64());
                self.fds
                    .retain(|f| !(first.unwrap()..=last.unwrap()).contains(f));
            }
            _ => {}
        }
    }

    /// The client holding the most live objects.
    fn main_client(&self) -> u32 {
        let live = |(c, hs): (&u32, &BTreeSet<u32>)| {
            let n = hs.iter().filter(|h| self.ledger.is_live(*c, **h)).count();
            (n, *c)
        };
        self.handles.iter().map(live).max().unwrap().1
    }

    /// Live objects of `client` other than the client itself.
    fn live_under(&self, client: u32) -> usize {
        self.handles.get(&client).map_or(0, |hs| {
            hs.iter()
                .filter(|&&h| h != client && self.ledger.is_live(client, h))
                .count()
        })
    }
}

/// Park-program.jsonl.gz: the checkpoint runs in a thread of the parked process (pid 440, thread 462) while
/// `cuda-checkpoint --action checkpoint` (pid 466) runs. It frees objects of the process's main client (its
/// own staging buffers among them), then the client itself (RM_FREE with hObjectOld = hRoot), which takes
/// everything still under it: the device, the address spaces, the channels and the video memory (the
/// recording: 43 explicit frees, then the client's with 89 objects and 8.7 GiB still under it). Then it
/// closes its fds: when the checkpoint program exits the process holds no RM object, no video memory and no
/// NVIDIA fd. The restore (pid 472) gives it the same video memory back.
#[test]
fn the_h200_park_frees_every_object_and_the_root_client() {
    let trace = h200("park-program.jsonl.gz");
    let mut parked = Parked::default();
    let mut before_park = None;
    let mut explicit_frees = 0;
    let mut root_free = None;
    let mut after_park = None;
    let mut restored = None;
    for e in &trace.events {
        if e.pid() == CHECKPOINT_RUN && e.kind() == "exec" {
            let main = parked.main_client();
            before_park = Some((main, parked.ledger.vram_bytes(), parked.live_under(main)));
        }
        let free_of = match (&e.call, before_park) {
            (Some((Op::Free { client, object, .. }, _)), Some((main, ..)))
                if e.tid() == CHECKPOINT_TID && *client == main && after_park.is_none() =>
            {
                Some(*object)
            }
            _ => None,
        };
        let main = before_park.map(|(main, ..)| main);
        if free_of.is_some() && free_of == main && root_free.is_none() {
            // The client's own RM_FREE, with what it still holds and the fds still open.
            let held = (parked.live_under(main.unwrap()), parked.ledger.vram_bytes());
            assert!(!parked.fds.is_empty(), "line {}: fds closed first", e.line);
            root_free = Some((e.line, held));
        } else if free_of.is_some() && root_free.is_none() {
            explicit_frees += 1;
        }
        if e.pid() == PARKED_PID {
            parked.follow(e);
        }
        if let (Some(main), Some((line, _))) = (main, root_free)
            && line == e.line
        {
            assert_eq!(parked.live_under(main), 0, "line {line}");
            assert!(!parked.ledger.is_live(main, main), "line {line}");
            assert_eq!(parked.ledger.vram_bytes(), 0, "line {line}");
        }
        if e.pid() == CHECKPOINT_RUN && e.kind() == "exit" {
            after_park = Some((
                parked.ledger.live_objects(),
                parked.ledger.live_by_class(),
                parked.ledger.vram_bytes(),
                parked.fds.clone(),
            ));
        }
        if e.pid() == RESTORE_RUN && e.kind() == "exit" {
            restored = Some(parked.ledger.vram_bytes());
        }
    }
    let (main, vram, objects) = before_park.unwrap();
    // The holder's 8 GiB and CUDA's own buffers, in some hundred objects of its main client.
    assert!(
        vram >= 8 << 30 && objects > 100,
        "{vram} bytes, {objects} objects"
    );
    let (line, (held_objects, held_vram)) =
        root_free.unwrap_or_else(|| panic!("no RM_FREE of client {main:#x} in the park"));
    assert!(explicit_frees > 0, "no object freed before the client");
    assert!(
        held_objects > 0 && held_vram >= 8 << 30,
        "line {line}: the client's free took {held_objects} objects, {held_vram} bytes"
    );
    let (live, by_class, vram_after, fds) = after_park.unwrap();
    assert_eq!(
        (live, by_class, vram_after, fds),
        (0, BTreeMap::new(), 0, BTreeSet::new()),
        "after the park"
    );
    assert_eq!(restored, Some(vram), "the restore");
    assert_eq!(trace.peak_vram_bytes, parked.ledger.peak_vram_bytes());
}
