//! What the decoder could not name in a `baton trace --json` file: escapes (`UNKNOWN(0x...)`), classes
//! (`hClass`), control commands (`cmd`) and statuses (every other named value), each with its raw value and
//! how often it came. The goal on a real driver is none; the golden traces are checked against it.
use std::{collections::BTreeMap, io::Read, path::Path};

use anyhow::{Context, Result};
use serde::Serialize;
use serde_json::Value;

/// The counts of one trace.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Counts {
    /// Events in the trace.
    pub events: u64,
    /// `ioctl` events.
    pub ioctls: u64,
    /// Calls by escape or UVM command name.
    pub calls: BTreeMap<String, u64>,
    /// Escapes the decoder has no name for, by raw command.
    pub unknown_escapes: BTreeMap<String, u64>,
    /// Classes with no name, by value.
    pub unknown_classes: BTreeMap<String, u64>,
    /// Control commands with no name, by value.
    pub unknown_controls: BTreeMap<String, u64>,
    /// Statuses with no name, by value.
    pub unknown_statuses: BTreeMap<String, u64>,
}

impl Counts {
    /// Unknowns of every kind together.
    pub fn unknowns(&self) -> u64 {
        [
            &self.unknown_escapes,
            &self.unknown_classes,
            &self.unknown_controls,
            &self.unknown_statuses,
        ]
        .iter()
        .flat_map(|m| m.values())
        .sum()
    }
}

/// Counts the trace in file `path` (one JSON object per line; gzipped when its name ends in `.gz`).
pub fn count_file(path: &Path) -> Result<Counts> {
    count(&read_trace(path)?)
}

/// The text of the trace in file `path`, gunzipped when its name ends in `.gz` (long recordings are kept so).
pub fn read_trace(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    if path.extension().is_none_or(|e| e != "gz") {
        return String::from_utf8(bytes)
            .with_context(|| format!("{} is not UTF-8", path.display()));
    }
    let mut text = String::new();
    flate2::read::GzDecoder::new(bytes.as_slice())
        .read_to_string(&mut text)
        .with_context(|| format!("gunzipping {}", path.display()))?;
    Ok(text)
}

/// The objects of a trace `text` (one JSON object per line; blank lines skipped), each with its line number;
/// an error names the line that is not JSON.
pub fn objects(text: &str) -> impl Iterator<Item = Result<(usize, Value)>> + '_ {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(n, line)| {
            serde_json::from_str(line)
                .map(|v| (n + 1, v))
                .with_context(|| format!("line {}: {line}", n + 1))
        })
}

/// Counts the trace `text` (one JSON object per line).
pub fn count(text: &str) -> Result<Counts> {
    let mut counts = Counts::default();
    for object in objects(text) {
        let (_, event) = object?;
        counts.add(&event);
    }
    Ok(counts)
}

impl Counts {
    /// Counts one event object of a trace.
    pub fn add(&mut self, event: &Value) {
        self.events += 1;
        if event["event"] != "ioctl" {
            return;
        }
        self.ioctls += 1;
        let escape = event["escape"].as_str().unwrap_or_default();
        *self.calls.entry(escape.to_owned()).or_default() += 1;
        if escape.starts_with("UNKNOWN(") {
            *self.unknown_escapes.entry(escape.to_owned()).or_default() += 1;
        }
        let Some(fields) = event["fields"].as_object() else {
            return;
        };
        for (name, value) in fields {
            let (Some(raw), true) = (value["value"].as_u64(), value["name"].is_null()) else {
                continue;
            };
            let by_kind = match name.as_str() {
                "hClass" => &mut self.unknown_classes,
                "cmd" => &mut self.unknown_controls,
                _ => &mut self.unknown_statuses,
            };
            *by_kind.entry(format!("{raw:#x}")).or_default() += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unnamed_escapes_classes_controls_and_statuses_are_counted_by_value() {
        let trace = [
            r#"{"event":"open","name":"nvidiactl"}"#,
            r#"{"event":"ioctl","escape":"NV_ESC_RM_ALLOC","fields":{"hClass":{"value":65,"name":"NV01_ROOT"},"status":{"value":0,"name":"NV_OK"}}}"#,
            r#"{"event":"ioctl","escape":"NV_ESC_RM_ALLOC","fields":{"hClass":{"value":48879,"name":null},"status":{"value":4242,"name":null}}}"#,
            r#"{"event":"ioctl","escape":"NV_ESC_RM_CONTROL","fields":{"cmd":{"value":305419896,"name":null}}}"#,
            r#"{"event":"ioctl","escape":"UNKNOWN(0xc0104699)"}"#,
        ]
        .join("\n");
        let c = count(&trace).unwrap();
        assert_eq!((c.events, c.ioctls), (5, 4));
        assert_eq!(c.calls["NV_ESC_RM_ALLOC"], 2);
        assert_eq!(c.unknown_classes["0xbeef"], 1);
        assert_eq!(c.unknown_statuses["0x1092"], 1);
        assert_eq!(c.unknown_controls["0x12345678"], 1);
        assert_eq!(c.unknown_escapes["UNKNOWN(0xc0104699)"], 1);
        assert_eq!(c.unknowns(), 4);
    }

    #[test]
    fn a_gzipped_trace_is_read_as_its_text() {
        use std::io::Write;
        let dir = tempfile::tempdir().unwrap();
        let trace = r#"{"event":"ioctl","escape":"UNKNOWN(0xc0104699)"}"#.to_owned() + "\n";
        let gz = dir.path().join("t.jsonl.gz");
        let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        encoder.write_all(trace.as_bytes()).unwrap();
        std::fs::write(&gz, encoder.finish().unwrap()).unwrap();
        let plain = dir.path().join("t.jsonl");
        std::fs::write(&plain, &trace).unwrap();
        assert_eq!(read_trace(&gz).unwrap(), trace);
        assert_ne!(std::fs::read(&gz).unwrap(), trace.as_bytes());
        assert_eq!(count_file(&gz).unwrap().unknowns(), 1);
        assert_eq!(read_trace(&plain).unwrap(), trace);
        let e = read_trace(&plain.with_extension("jsonl.gz.missing")).unwrap_err();
        assert!(format!("{e:#}").contains("reading"), "{e:#}");
    }

    #[test]
    fn a_line_that_is_not_json_says_which() {
        let e = count("{\"event\":\"close\"}\nnot json").unwrap_err();
        assert!(format!("{e:#}").contains("line 2"), "{e:#}");
    }
}
