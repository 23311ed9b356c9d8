//! Builds the kernel-side probes (ebpf/probes) for bpfel-unknown-none with aya-build and leaves the object in
//! OUT_DIR, where src/probes.rs embeds it. A plain `cargo build` of this crate therefore rebuilds the probes.
//!
//! The probes need `-Z build-std=core`. The workspace is pinned to a stable toolchain, so the probes are built
//! with that same toolchain and `RUSTC_BOOTSTRAP=1` (aya-build honours it), with bpf-linker on PATH
//! (tools/setup.sh builds it against the toolchain's own LLVM).
use std::{env, fs, path::Path};

fn main() -> anyhow::Result<()> {
    let toolchain = pinned_toolchain()?;
    // SAFETY: build scripts are single-threaded at this point; the variable is read by aya-build and
    // inherited by the cargo it spawns for the probes.
    unsafe { env::set_var("RUSTC_BOOTSTRAP", "1") };
    if which_bpf_linker().is_none() {
        anyhow::bail!(
            "bpf-linker not found on PATH: run tools/setup.sh (it builds bpf-linker against the pinned \
             toolchain's LLVM and links it into ~/.cargo/bin)"
        );
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../probes");
    let root = root
        .to_str()
        .ok_or_else(|| anyhow::anyhow!("non-UTF-8 path {}", root.display()))?;
    aya_build::build_ebpf(
        [aya_build::Package {
            name: "baton-probes",
            root_dir: root,
            ..Default::default()
        }],
        aya_build::Toolchain::Custom(&toolchain),
    )?;
    for dep in ["../common/src", "../nvidia/src"] {
        println!(
            "cargo:rerun-if-changed={}/{dep}",
            env!("CARGO_MANIFEST_DIR")
        );
    }
    Ok(())
}

/// The channel named in the workspace's rust-toolchain.toml.
fn pinned_toolchain() -> anyhow::Result<String> {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../rust-toolchain.toml");
    println!("cargo:rerun-if-changed={}", file.display());
    let text = fs::read_to_string(&file)?;
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("channel"))
        .filter_map(|l| l.split('"').nth(1))
        .map(str::to_owned)
        .next()
        .ok_or_else(|| anyhow::anyhow!("{} names no channel", file.display()))
}

fn which_bpf_linker() -> Option<std::path::PathBuf> {
    env::split_paths(&env::var_os("PATH")?)
        .map(|d| d.join("bpf-linker"))
        .find(|p| p.is_file())
}
