//! Headless Chromium (Debian's `chromium` package, installed by tools/setup.sh) for the tests of pages Baton
//! writes: the DOM after the page's scripts ran, and a screenshot. Started with the flags this machine needs
//! (no sandbox as root, no GPU, none of the background connections the closed network refuses) and a fresh
//! profile each time.
use std::{
    path::{Path, PathBuf},
    process::Command,
};

/// Where Debian puts it.
pub const CHROMIUM: &str = "/usr/bin/chromium";

/// Why headless Chromium cannot run here, if it cannot.
pub fn missing_browser() -> Option<String> {
    (!Path::new(CHROMIUM).exists()).then(|| {
        format!("{CHROMIUM} not found: install Debian's chromium package (tools/setup.sh does)")
    })
}

fn headless(profile: &Path) -> Command {
    let mut cmd = Command::new(CHROMIUM);
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        // Time for the page's script to draw before the DOM is dumped or the picture taken.
        "--virtual-time-budget=5000",
    ])
    .arg(format!("--user-data-dir={}", profile.display()));
    cmd
}

fn file_url(page: &Path) -> anyhow::Result<String> {
    Ok(format!("file://{}", std::fs::canonicalize(page)?.display()))
}

/// The page's DOM after its scripts ran (`--dump-dom`).
pub fn dump_dom(page: &Path) -> anyhow::Result<String> {
    let profile = tempfile::tempdir()?;
    let out = headless(profile.path())
        .arg("--dump-dom")
        .arg(file_url(page)?)
        .output()?;
    anyhow::ensure!(
        out.status.success(),
        "chromium --dump-dom {} failed: {}\n{}",
        page.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A PNG screenshot of the page at `width`x`height`; returns its path.
pub fn screenshot(page: &Path, png: &Path, width: u32, height: u32) -> anyhow::Result<PathBuf> {
    let profile = tempfile::tempdir()?;
    let out = headless(profile.path())
        .arg(format!("--screenshot={}", png.display()))
        .arg(format!("--window-size={width},{height}"))
        .arg(file_url(page)?)
        .output()?;
    anyhow::ensure!(
        out.status.success() && png.exists(),
        "chromium --screenshot {} failed: {}\n{}",
        page.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(png.to_owned())
}
