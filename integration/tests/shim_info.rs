//! `-info`: containerd 2.x asks a shim for its runtime info (options on stdin) before it uses it. Baton answers
//! as containerd's Go runc shim does: name, version, the options echoed, and the OCI features of the runc the
//! options pick (`runc features`). Runs the built shim directly: containerd 1.6 and its Go shim predate `-info`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use baton_integration::shim_binary::{self, BATON_RUNTIME};
use baton_integration::{api, skip};
use containerd_client::types::RuntimeInfo;
use prost::Message;

/// Type URL containerd's typeurl registry gives runtime-spec's `features.Features`.
const FEATURES_TYPE_URL: &str =
    "types.containerd.io/opencontainers/runtime-spec/1/features/Features";

/// The Baton shim and runc, or `None` after announcing why the test cannot run.
fn prerequisites() -> Option<(PathBuf, PathBuf)> {
    if shim_binary::runtime_under_test() != BATON_RUNTIME {
        skip::not_applicable("-info: containerd 1.6's Go shim has no -info action to compare with");
        return None;
    }
    let Some(runc) = skip::which("runc") else {
        skip::announce("`runc` not found on PATH: install Debian package runc");
        return None;
    };
    let shim = shim_binary::baton_shim_binary().expect("the Baton shim");
    Some((shim, runc))
}

/// Runs `shim -info` with `stdin`.
fn info(shim: &Path, stdin: &[u8]) -> Output {
    let mut child = Command::new(shim)
        .arg("-info")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the shim");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(stdin)
        .expect("write options");
    child.wait_with_output().expect("wait for the shim")
}

#[test]
fn shim_info_reports_the_features_of_the_chosen_runc() {
    let Some((shim, runc)) = prerequisites() else {
        return;
    };
    let options = api::runtime_options_toml(&format!("BinaryName = \"{}\"\n", runc.display()));
    let out = info(&shim, &options.encode_to_vec());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "-info failed: {stderr}");
    let answer = RuntimeInfo::decode(out.stdout.as_slice()).expect("-info prints a RuntimeInfo");
    assert_eq!(answer.name, BATON_RUNTIME);
    let version = answer.version.expect("a version");
    assert!(!version.version.is_empty(), "empty version");
    assert_eq!(answer.options, Some(options), "options are echoed");
    let features = answer.features.expect("runc's features");
    assert_eq!(features.type_url, FEATURES_TYPE_URL);
    let reported: serde_json::Value =
        serde_json::from_slice(&features.value).expect("features are JSON");
    let runc_features = Command::new(&runc)
        .arg("features")
        .output()
        .expect("runc features");
    let expected: serde_json::Value =
        serde_json::from_slice(&runc_features.stdout).expect("runc features prints JSON");
    assert_eq!(reported, expected);
}

#[test]
fn shim_info_with_a_missing_runc_is_a_clear_error() {
    let Some((shim, _)) = prerequisites() else {
        return;
    };
    let missing = "/nonexistent/baton-test-runc";
    let options = api::runtime_options_toml(&format!("BinaryName = \"{missing}\"\n"));
    let out = info(&shim, &options.encode_to_vec());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(1),
        "-info with a missing runc must fail cleanly: {stderr}"
    );
    assert!(
        stderr.contains(missing) && stderr.contains("BinaryName"),
        "the error must name the binary and the option: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(
        !stderr.contains("Other("),
        "a message for containerd's log, not Rust debug output: {stderr}"
    );
}
