//! Which runtime the shim tests exercise, and where its shim binary comes from.
//!
//! Tests in package `baton-integration` cannot use `CARGO_BIN_EXE_*` of another package, so the harness builds
//! the shim itself, once per test process: `cargo build -p containerd-shim-baton-v1` in this workspace, with the
//! caller's `CARGO_TARGET_DIR` (or `<workspace>/target`), then uses `<target>/debug/containerd-shim-baton-v1`.
//! `BATON_SHIM_BIN=/abs/path` skips the build and uses that binary. `BATON_TEST_RUNTIME=io.containerd.runc.v2`
//! runs the same tests against Debian's Go shim (to tell harness failures from shim failures); in strict mode
//! (tools/dev test, CI) only together with `BATON_COMPARE_RUNTIME=1` ([`baton_prereq::check_runtime_switch`]).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// Runtime type of Baton's shim.
pub const BATON_RUNTIME: &str = "io.containerd.baton.v1";
/// Binary name containerd looks up on PATH for [`BATON_RUNTIME`].
pub const BATON_SHIM_NAME: &str = "containerd-shim-baton-v1";
/// Cargo package of the shim.
const SHIM_PACKAGE: &str = "containerd-shim-baton-v1";

/// Errors finding or building the shim binary.
#[derive(Debug, thiserror::Error, Clone)]
pub enum Error {
    /// `cargo build` could not be run or failed.
    #[error("building the shim with `{command}` failed: {detail}")]
    Build {
        /// The command line run.
        command: String,
        /// Its stderr tail or spawn error.
        detail: String,
    },
    /// The binary is not where it should be.
    #[error(
        "shim binary not found at {path}: build it with `cargo build -p {SHIM_PACKAGE}` or set BATON_SHIM_BIN"
    )]
    Missing {
        /// Where it was looked for.
        path: PathBuf,
    },
}

/// The runtime type the tests run against: `BATON_TEST_RUNTIME`, or `io.containerd.baton.v1`. In strict mode
/// another runtime fails the test unless `BATON_COMPARE_RUNTIME=1` asks for it.
pub fn runtime_under_test() -> String {
    let runtime = std::env::var(baton_prereq::RUNTIME_ENV)
        .ok()
        .filter(|value| !value.is_empty())
        .unwrap_or_else(|| BATON_RUNTIME.to_string());
    baton_prereq::check_runtime_switch(&runtime, BATON_RUNTIME);
    runtime
}

/// The workspace root (the folder above this package).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// Cargo's target folder for this workspace: `CARGO_TARGET_DIR` (relative to the workspace) or `<workspace>/target`.
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) => workspace_root().join(dir),
        None => workspace_root().join("target"),
    }
}

/// The Baton shim binary (debug profile), built once per process (see the module docs).
pub fn baton_shim_binary() -> Result<PathBuf, Error> {
    static BUILT: OnceLock<Result<PathBuf, Error>> = OnceLock::new();
    BUILT.get_or_init(|| locate_or_build(false)).clone()
}

/// The Baton shim binary built with the release profile (for benchmarks), once per process.
pub fn baton_shim_release_binary() -> Result<PathBuf, Error> {
    static BUILT: OnceLock<Result<PathBuf, Error>> = OnceLock::new();
    BUILT.get_or_init(|| locate_or_build(true)).clone()
}

fn locate_or_build(release: bool) -> Result<PathBuf, Error> {
    if let Some(path) = std::env::var_os("BATON_SHIM_BIN") {
        let path = PathBuf::from(path);
        return if path.is_file() {
            Ok(path)
        } else {
            Err(Error::Missing { path })
        };
    }
    let profile = build_package(SHIM_PACKAGE, release)?;
    let path = target_dir().join(profile).join(BATON_SHIM_NAME);
    if path.is_file() {
        Ok(path)
    } else {
        Err(Error::Missing { path })
    }
}

/// Runs `cargo build -p package` (with `--release` when `release`) in this workspace and target folder;
/// returns the profile folder name (`debug` or `release`) the binaries land in.
pub fn build_package(package: &str, release: bool) -> Result<&'static str, Error> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    let manifest = workspace_root().join("Cargo.toml");
    let mut command = Command::new(&cargo);
    let profile = if release { "release" } else { "debug" };
    command
        .args(["build", "--quiet", "-p", package, "--manifest-path"])
        .arg(&manifest)
        .args(release.then_some("--release"))
        .env("CARGO_TARGET_DIR", target_dir());
    let shown = format!(
        "{cargo} build -p {package} --{profile} --manifest-path {}",
        manifest.display()
    );
    let output = command.output().map_err(|error| Error::Build {
        command: shown.clone(),
        detail: error.to_string(),
    })?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(30).collect();
        return Err(Error::Build {
            command: shown,
            detail: tail.into_iter().rev().collect::<Vec<_>>().join("\n"),
        });
    }
    Ok(profile)
}
