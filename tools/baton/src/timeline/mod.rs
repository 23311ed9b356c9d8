//! Timelines of a trace: `baton trace --perfetto FILE` (Chrome trace-event JSON, for the Perfetto UI and
//! chrome://tracing) and `--html FILE` (a self-contained page), and `baton timeline` to make them from a saved
//! `baton trace --json` file. Both are built from the `--json` objects (the one event schema, whichever probe
//! set traced): per container, a track per thread with its ioctls as slices, and tracks for the GPU held
//! (from the first NVIDIA file opened to the last one closed), frozen/thawed, preemption phases and the CUDA
//! launches counted per interval.
mod html;
mod model;
mod perfetto;

use std::path::{Path, PathBuf};

use anyhow::Context;

pub use model::Timeline;

/// Where to write the timelines of a trace: `--perfetto FILE` and `--html FILE`.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct Outputs {
    /// Write a timeline of the trace in Chrome trace-event JSON here (open it in the Perfetto UI or
    /// chrome://tracing): per container, its threads' ioctls, the GPU held, frozen/thawed, preemption phases
    /// and its CUDA launches.
    #[arg(long, value_name = "FILE")]
    pub perfetto: Option<PathBuf>,
    /// Write the same timeline as a self-contained HTML page here.
    #[arg(long, value_name = "FILE")]
    pub html: Option<PathBuf>,
}

impl Outputs {
    /// Whether any timeline is asked for.
    pub fn any(&self) -> bool {
        self.perfetto.is_some() || self.html.is_some()
    }

    /// Writes the asked-for files from `timeline`, each atomically (a half-written file is never left).
    pub fn write(&self, timeline: &Timeline) -> anyhow::Result<()> {
        if let Some(path) = &self.perfetto {
            write_atomically(path, &perfetto::render(timeline)?)?;
            eprintln!(
                "baton trace: wrote {} (open it in https://ui.perfetto.dev or chrome://tracing)",
                path.display()
            );
        }
        if let Some(path) = &self.html {
            write_atomically(path, &html::render(timeline)?)?;
            eprintln!(
                "baton trace: wrote {} (a self-contained page)",
                path.display()
            );
        }
        Ok(())
    }
}

/// Writes `bytes` to a temporary file next to `path`, then renames it over `path`.
fn write_atomically(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let mut tmp = tempfile::NamedTempFile::new_in(&dir)
        .with_context(|| format!("cannot write in {}", dir.display()))?;
    std::io::Write::write_all(&mut tmp, bytes)
        .with_context(|| format!("cannot write {}", path.display()))?;
    tmp.persist(path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}

/// `baton timeline`: reads a `baton trace --json` file (one object per line) and writes the timelines.
pub fn convert(input: &Path, outputs: &Outputs) -> anyhow::Result<()> {
    if !outputs.any() {
        anyhow::bail!("nothing to write: give --perfetto FILE and/or --html FILE");
    }
    let text = std::fs::read_to_string(input)
        .with_context(|| format!("cannot read {}", input.display()))?;
    let mut timeline = Timeline::default();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || !line.starts_with('{') {
            // The summary of --summary, or other text lines: not events.
            continue;
        }
        let value: serde_json::Value = serde_json::from_str(line).with_context(|| {
            format!(
                "{}:{}: not a JSON object of `baton trace --json`",
                input.display(),
                n + 1
            )
        })?;
        timeline.add(&value);
    }
    if timeline.is_empty() {
        anyhow::bail!(
            "{} holds no `baton trace --json` events: record one with `baton trace --json -o FILE ...`",
            input.display()
        );
    }
    outputs.write(&timeline)
}
