//! The agent's metrics endpoint as its tests and benchmark read it: its address from the agent's log, a
//! scrape with a real HTTP client (ureq), and a strict parser of the OpenMetrics text format that fails on
//! any line it does not understand.
use std::{
    collections::BTreeMap,
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context, bail, ensure};

/// The URL the agent logged for its metrics (`--metrics-addr`, port 0 included), waiting up to `within`.
pub fn url_from_log(log: &Path, within: Duration) -> anyhow::Result<String> {
    let deadline = Instant::now() + within;
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if let Some(at) = text.find("metrics on http://") {
            let rest = &text[at + "metrics on ".len()..];
            let url: String = rest
                .chars()
                .take_while(|c| {
                    c.is_ascii_alphanumeric() || matches!(c, '.' | ':' | '/' | '[' | ']')
                })
                .collect();
            return Ok(url);
        }
        ensure!(
            Instant::now() < deadline,
            "the agent logged no metrics address within {within:?}:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// An HTTP client that returns every status as a response (not as an error).
pub fn client() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(20)))
        .build()
        .into()
}

/// `GET url`: the status, the content type and the body.
pub fn get(agent: &ureq::Agent, url: &str) -> anyhow::Result<(u16, String, String)> {
    let mut r = agent
        .get(url)
        .call()
        .with_context(|| format!("GET {url}"))?;
    let status = r.status().as_u16();
    let content_type = r
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let body = r.body_mut().read_to_string()?;
    Ok((status, content_type, body))
}

/// Scrapes `url` and parses the exposition; an error for any status but 200.
pub fn scrape(agent: &ureq::Agent, url: &str) -> anyhow::Result<Exposition> {
    let (status, content_type, body) = get(agent, url)?;
    ensure!(status == 200, "GET {url}: {status}: {body}");
    ensure!(
        content_type.starts_with("application/openmetrics-text"),
        "GET {url}: content type {content_type:?}"
    );
    Exposition::parse(&body)
}

/// One sample line.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    /// Its name (a family's name and a suffix).
    pub name: String,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// Its value.
    pub value: f64,
}

/// A parsed exposition.
#[derive(Clone, Debug, Default)]
pub struct Exposition {
    /// Family name -> type (`counter`, `gauge`, `histogram`, ...).
    pub types: BTreeMap<String, String>,
    /// Every sample, in order.
    pub samples: Vec<Sample>,
}

/// The sample name suffixes each metric type allows.
fn suffixes(kind: &str) -> &'static [&'static str] {
    match kind {
        "counter" => &["_total", "_created"],
        "histogram" => &["_bucket", "_count", "_sum", "_created"],
        "summary" => &["", "_count", "_sum", "_created"],
        "info" => &["_info"],
        _ => &[""],
    }
}

impl Exposition {
    /// Parses OpenMetrics text strictly: metadata lines, samples of a declared family, `# EOF` last.
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        let mut e = Self::default();
        let mut eof = false;
        for (i, line) in text.lines().enumerate() {
            let n = i + 1;
            ensure!(!eof, "line {n} after # EOF: {line:?}");
            if line == "# EOF" {
                eof = true;
                continue;
            }
            if let Some(meta) = line.strip_prefix("# ") {
                e.metadata(meta)
                    .with_context(|| format!("line {n}: {line:?}"))?;
                continue;
            }
            let sample = parse_sample(line).with_context(|| format!("line {n}: {line:?}"))?;
            ensure!(
                e.family_of(&sample.name).is_some(),
                "line {n}: sample {} of no declared family",
                sample.name
            );
            e.samples.push(sample);
        }
        ensure!(eof, "the exposition does not end with # EOF");
        Ok(e)
    }

    fn metadata(&mut self, meta: &str) -> anyhow::Result<()> {
        let mut words = meta.splitn(3, ' ');
        let (kind, name, rest) = (words.next(), words.next(), words.next());
        let name = name.context("metadata without a name")?;
        ensure!(is_name(name), "bad metric name {name:?}");
        match kind {
            Some("TYPE") => {
                let t = rest.context("TYPE without a type")?;
                ensure!(
                    matches!(
                        t,
                        "counter"
                            | "gauge"
                            | "histogram"
                            | "summary"
                            | "info"
                            | "stateset"
                            | "unknown"
                            | "gaugehistogram"
                    ),
                    "unknown type {t:?}"
                );
                ensure!(
                    self.types.insert(name.to_owned(), t.to_owned()).is_none(),
                    "family {name} declared twice"
                );
            }
            Some("HELP") | Some("UNIT") => {}
            other => bail!("unknown metadata {other:?}"),
        }
        Ok(())
    }

    /// The family a sample name belongs to.
    fn family_of(&self, sample: &str) -> Option<&str> {
        self.types.iter().find_map(|(family, kind)| {
            suffixes(kind)
                .iter()
                .any(|s| sample.strip_prefix(family.as_str()) == Some(s))
                .then_some(family.as_str())
        })
    }

    /// The samples named `name` whose labels include `labels`.
    pub fn matching<'a>(
        &'a self,
        name: &'a str,
        labels: &'a [(&'a str, &'a str)],
    ) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples.iter().filter(move |s| {
            s.name == name
                && labels
                    .iter()
                    .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        })
    }

    /// The one sample named `name` with `labels`; an error when there is none or several.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> anyhow::Result<f64> {
        let found: Vec<&Sample> = self.matching(name, labels).collect();
        match found.as_slice() {
            [one] => Ok(one.value),
            [] => bail!("no sample {name} with {labels:?}"),
            many => bail!("{} samples {name} with {labels:?}: {many:?}", many.len()),
        }
    }

    /// The sum of the samples named `name` with `labels` (0 when there are none).
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.matching(name, labels).map(|s| s.value).sum()
    }
}

fn is_name(s: &str) -> bool {
    let mut chars = s.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_' || c == ':')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
}

/// `name{a="x",b="y"} value`, or `name value`.
fn parse_sample(line: &str) -> anyhow::Result<Sample> {
    let name_end = line.find(['{', ' ']).context("a sample needs a value")?;
    let name = &line[..name_end];
    ensure!(is_name(name), "bad metric name {name:?}");
    let mut rest = &line[name_end..];
    let mut labels = BTreeMap::new();
    if let Some(after) = rest.strip_prefix('{') {
        let (parsed, tail) = parse_labels(after)?;
        labels = parsed;
        rest = tail;
    }
    let value = rest
        .strip_prefix(' ')
        .context("no space before the value")?;
    ensure!(
        !value.contains(' '),
        "timestamps and exemplars are not expected: {value:?}"
    );
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().with_context(|| format!("bad value {v:?}"))?,
    };
    Ok(Sample {
        name: name.to_owned(),
        labels,
        value,
    })
}

/// The labels after `{`, and what follows the closing `}`.
fn parse_labels(mut s: &str) -> anyhow::Result<(BTreeMap<String, String>, &str)> {
    let mut labels = BTreeMap::new();
    loop {
        if let Some(tail) = s.strip_prefix('}') {
            return Ok((labels, tail));
        }
        let eq = s.find('=').context("a label without =")?;
        let key = &s[..eq];
        ensure!(is_name(key) && !key.contains(':'), "bad label name {key:?}");
        let mut chars = s[eq + 1..].char_indices();
        ensure!(
            chars.next().map(|c| c.1) == Some('"'),
            "label {key}: no opening quote"
        );
        let mut value = String::new();
        let end = loop {
            match chars.next() {
                Some((_, '\\')) => match chars.next() {
                    Some((_, '\\')) => value.push('\\'),
                    Some((_, '"')) => value.push('"'),
                    Some((_, 'n')) => value.push('\n'),
                    other => bail!("label {key}: bad escape {other:?}"),
                },
                Some((i, '"')) => break i,
                Some((_, c)) => value.push(c),
                None => bail!("label {key}: no closing quote"),
            }
        };
        ensure!(
            labels.insert(key.to_owned(), value).is_none(),
            "label {key} twice"
        );
        s = &s[eq + 1 + end + 1..];
        if let Some(tail) = s.strip_prefix(',') {
            s = tail;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_strict_parse_of_openmetrics() {
        let text = "# HELP baton_x X.\n# TYPE baton_x counter\nbaton_x_total{a=\"1\",b=\"q\\\"\"} 3\n\
                    # TYPE baton_h histogram\n# UNIT baton_h seconds\nbaton_h_bucket{le=\"+Inf\"} 2\n\
                    baton_h_count 2\nbaton_h_sum 0.5\n# EOF\n";
        let e = Exposition::parse(text).unwrap();
        assert_eq!(e.value("baton_x_total", &[("b", "q\"")]).unwrap(), 3.0);
        assert_eq!(e.value("baton_h_count", &[]).unwrap(), 2.0);
        for bad in [
            "baton_y 1\n# EOF\n",
            "# TYPE baton_x counter\nbaton_x_total 1\n",
            "# TYPE baton_x counter\nbaton_x_total{a=1} 1\n# EOF\n",
            "# TYPE baton_x counter\nbaton_x_total one\n# EOF\n",
            "# EOF\nbaton_x 1\n",
        ] {
            assert!(Exposition::parse(bad).is_err(), "{bad:?}");
        }
    }
}
