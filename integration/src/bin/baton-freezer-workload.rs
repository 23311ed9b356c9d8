//! `baton-freezer-workload`: the process the freezer benchmark freezes. `--mode sleep` threads sleep 1 ms at a
//! time, `--mode spin` threads never block; each counts its rounds. With `--progress FILE` the main thread
//! writes the total count there every 10 ms (so an observer can see that the threads stopped).
//!
//! `baton-freezer-workload --mode sleep|spin --threads N [--progress FILE]`
use std::{
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use anyhow::{Context, Result, bail};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let spin = match value("--mode").as_deref() {
        Some("spin") => true,
        Some("sleep") => false,
        other => bail!("--mode sleep|spin, not {other:?}"),
    };
    let threads: usize = value("--threads")
        .unwrap_or_else(|| "1".into())
        .parse()
        .context("--threads N")?;
    let counter = Arc::new(AtomicU64::new(0));
    // The main thread is one of the N (it reports progress between its rounds when asked to).
    for _ in 1..threads.max(1) {
        let counter = counter.clone();
        std::thread::spawn(move || work(spin, &counter));
    }
    match value("--progress") {
        Some(file) => loop {
            std::thread::sleep(Duration::from_millis(10));
            std::fs::write(&file, counter.load(Ordering::Relaxed).to_string())
                .with_context(|| format!("write {file}"))?;
        },
        None => {
            work(spin, &counter);
            Ok(())
        }
    }
}

fn work(spin: bool, counter: &AtomicU64) {
    loop {
        if spin {
            for _ in 0..1000 {
                std::hint::spin_loop();
            }
        } else {
            std::thread::sleep(Duration::from_millis(1));
        }
        counter.fetch_add(1, Ordering::Relaxed);
    }
}
