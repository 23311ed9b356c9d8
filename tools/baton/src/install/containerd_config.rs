//! The Baton runtime entry in containerd's config.toml: adds it to (and removes it from) a version 2
//! (containerd 1.x) or version 3 (containerd 2.x) config with `toml_edit`, which keeps every comment, every
//! other setting and their formatting, so that removing the entry gives back the original bytes.

use std::path::{Path, PathBuf};

use baton_agent_api::option_keys::{
    AGENT_AUTOSTART, AGENT_SOCKET, ANNOTATION_PREFIX, RUNC_BINARY_NAME, RUNC_SYSTEMD_CGROUP,
};
use toml_edit::{Array, DocumentMut, Item, Table, value};

/// The runtime's name in the CRI config: a RuntimeClass's `handler`.
pub const RUNTIME_NAME: &str = "baton";
/// The shim's runtime type (containerd runs `containerd-shim-baton-v1`).
pub const RUNTIME_TYPE: &str = "io.containerd.baton.v1";
/// The runtime whose runc settings Baton's entry copies.
const RUNC_RUNTIME: &str = "runc";

/// A config format containerd reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    /// containerd 1.x: the CRI plugin is `io.containerd.grpc.v1.cri`.
    V2,
    /// containerd 2.x: the CRI runtime plugin is `io.containerd.cri.v1.runtime`.
    V3,
}

impl Version {
    /// The plugin whose `containerd.runtimes` table holds the CRI runtimes.
    pub fn cri_plugin(self) -> &'static str {
        match self {
            Version::V2 => "io.containerd.grpc.v1.cri",
            Version::V3 => "io.containerd.cri.v1.runtime",
        }
    }

    /// The number in the file's `version` key.
    pub fn number(self) -> i64 {
        match self {
            Version::V2 => 2,
            Version::V3 => 3,
        }
    }

    /// The Baton runtime's table, as a TOML header path.
    pub fn runtime_table(self) -> String {
        format!(
            "plugins.\"{}\".containerd.runtimes.{RUNTIME_NAME}",
            self.cri_plugin()
        )
    }

    /// Names the CRI plugin may have in `disabled_plugins`.
    fn cri_names(self) -> [&'static str; 3] {
        ["cri", "io.containerd.grpc.v1.cri", self.cri_plugin()]
    }
}

/// Why a config cannot be edited; each names the file and says what to do.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file is not TOML (the parser's message names the line and column).
    #[error("{path} is not valid TOML, nothing was changed: {message}")]
    NotToml {
        /// The config file.
        path: PathBuf,
        /// The parser's message, with line and column.
        message: String,
    },
    /// No `version`, or version 1, or an unknown one.
    #[error(
        "{path}: {found}: baton install edits version 2 (containerd 1.x) and version 3 (containerd 2.x) \
         configs only. containerd reads a config without `version` as version 1, whose plugin names differ \
         ([plugins.cri]): convert it (`containerd config migrate` on containerd 1.7 or later prints it in the \
         current version), or start again from `containerd config default > {path}`, then run baton install \
         again"
    )]
    UnsupportedVersion {
        /// The config file.
        path: PathBuf,
        /// What the file says ("no `version` key", "version = 1").
        found: String,
    },
    /// A key on the runtime's path holds something other than a table.
    #[error(
        "{path}: `{key}` is not a table (it is {kind}): baton install only edits standard [table] sections \
         there; add the [{table}] section by hand"
    )]
    NotATable {
        /// The config file.
        path: PathBuf,
        /// The dotted key.
        key: String,
        /// What it is instead.
        kind: String,
        /// The table install would have written.
        table: String,
    },
}

/// The file beside a version 2 config that holds the Baton runtime's options (`ConfigPath` names it).
pub const OPTIONS_FILE: &str = "baton-runtime.toml";
/// The key of a CRI runtime's options naming a file of options (the only way containerd 1.x passes a
/// non-runc runtime its options: it sends the shim `ConfigPath` and `TypeUrl`, never the table's other keys).
const CONFIG_PATH: &str = "ConfigPath";

/// What `baton install` puts in the runtime's `options` beyond the runc settings it copies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntrySettings {
    /// The agent's socket.
    pub agent_socket: String,
    /// Whether shims start the agent (false where systemd or a DaemonSet runs it).
    pub agent_autostart: bool,
    /// The options file ([`OPTIONS_FILE`]) as containerd on the node names it: a version 2 config's
    /// `ConfigPath`.
    pub options_file: String,
}

/// The result of an edit: the new text and what changed (empty: nothing, the text is the input).
#[derive(Debug)]
pub struct Edit {
    /// The config's version.
    pub version: Version,
    /// The new file contents.
    pub text: String,
    /// One line per change, for the user.
    pub changes: Vec<String>,
    /// Warnings (e.g. the CRI plugin is disabled).
    pub warnings: Vec<String>,
    /// Version 2: the options the file `ConfigPath` names must hold (empty for version 3, whose table
    /// containerd sends whole, as `config_body`).
    pub file_options: Vec<(&'static str, Item)>,
}

/// Parses `text` (from `path`, for errors) and finds its version.
fn parse(path: &Path, text: &str) -> Result<(DocumentMut, Version), ConfigError> {
    let doc: DocumentMut =
        text.parse()
            .map_err(|e: toml_edit::TomlError| ConfigError::NotToml {
                path: path.to_owned(),
                message: e.to_string().trim_end().to_owned(),
            })?;
    let version = match doc.get("version").and_then(Item::as_integer) {
        Some(2) => Version::V2,
        Some(3) => Version::V3,
        Some(n) => {
            return Err(ConfigError::UnsupportedVersion {
                path: path.to_owned(),
                found: format!("version = {n}"),
            });
        }
        None => {
            return Err(ConfigError::UnsupportedVersion {
                path: path.to_owned(),
                found: match doc.get("version") {
                    Some(v) => format!("version = {} is not a number", v.to_string().trim()),
                    None => "no `version` key".to_owned(),
                },
            });
        }
    };
    Ok((doc, version))
}

/// The warnings any edit of this config carries.
fn warnings(doc: &DocumentMut, version: Version) -> Vec<String> {
    let disabled = doc
        .get("disabled_plugins")
        .and_then(Item::as_array)
        .is_some_and(|a| {
            a.iter()
                .filter_map(|v| v.as_str())
                .any(|name| version.cri_names().contains(&name))
        });
    if disabled {
        vec![
            "disabled_plugins lists the CRI plugin: Kubernetes cannot use any runtime of this containerd \
             (Baton's included) until you remove it from that list"
                .to_owned(),
        ]
    } else {
        Vec::new()
    }
}

/// The `containerd.runtimes` table of the CRI plugin, created (as implicit tables, which print nothing
/// when empty) where `create` and missing.
fn runtimes_table<'d>(
    path: &Path,
    doc: &'d mut DocumentMut,
    version: Version,
    create: bool,
) -> Result<Option<&'d mut Table>, ConfigError> {
    let keys = ["plugins", version.cri_plugin(), "containerd", "runtimes"];
    let mut table = doc.as_table_mut();
    for (depth, key) in keys.iter().enumerate() {
        if !table.contains_key(key) {
            if !create {
                return Ok(None);
            }
            let mut t = Table::new();
            t.set_implicit(true);
            table.insert(key, Item::Table(t));
        }
        let item = table.get_mut(key);
        table = match item {
            Some(Item::Table(t)) => t,
            other => {
                return Err(ConfigError::NotATable {
                    path: path.to_owned(),
                    key: keys[..=depth].join("."),
                    kind: other.map_or("missing", |i| i.type_name()).to_owned(),
                    table: version.runtime_table(),
                });
            }
        };
    }
    Ok(Some(table))
}

/// Indentation of the existing runc entry (containerd's own `config default` indents each level), so that
/// Baton's entry looks like its neighbours.
struct Layout {
    header_prefix: String,
    key_indent: String,
    options_prefix: String,
    option_key_indent: String,
}

impl Layout {
    fn from_sibling(runtimes: &Table) -> Self {
        let runc = runtimes.get(RUNC_RUNTIME).and_then(Item::as_table);
        let header_prefix = runc
            .and_then(|t| t.decor().prefix())
            .and_then(|p| p.as_str())
            .map_or_else(|| "\n".to_owned(), str::to_owned);
        let key_indent = runc.map_or_else(String::new, first_key_indent);
        let options = runc.and_then(|t| t.get("options")).and_then(Item::as_table);
        let options_prefix = options
            .and_then(|t| t.decor().prefix())
            .and_then(|p| p.as_str())
            .map_or_else(|| format!("\n{key_indent}"), str::to_owned);
        let option_key_indent = options.map_or_else(|| key_indent.clone(), first_key_indent);
        Self {
            header_prefix,
            key_indent,
            options_prefix,
            option_key_indent,
        }
    }
}

/// The whitespace before a table's first key (none when it has no keys).
fn first_key_indent(t: &Table) -> String {
    t.iter()
        .find(|(_, item)| item.is_value())
        .and_then(|(k, _)| t.key(k))
        .and_then(|k| k.leaf_decor().prefix())
        .and_then(|p| p.as_str())
        .filter(|p| p.chars().all(|c| c == ' ' || c == '\t'))
        .unwrap_or_default()
        .to_owned()
}

/// Sets `key` in `t` when it is missing, indented by `indent`; says so in `changes`.
fn put_missing(
    t: &mut Table,
    key: &str,
    item: Item,
    indent: &str,
    what: &str,
    changes: &mut Vec<String>,
) {
    if t.contains_key(key) {
        return;
    }
    changes.push(format!("set {what}.{key} = {}", item.to_string().trim()));
    t.insert(key, item);
    if let Some(mut k) = t.key_mut(key) {
        k.leaf_decor_mut().set_prefix(indent);
    }
}

/// The runc settings the Baton entry copies from the node's runc runtime (its cgroup driver must match
/// the kubelet's): `SystemdCgroup` (false when there is no runc entry), and `BinaryName` when set.
fn runc_settings(runtimes: &Table) -> Vec<(&'static str, Item)> {
    let options = runtimes
        .get(RUNC_RUNTIME)
        .and_then(|r| r.get("options"))
        .and_then(Item::as_table);
    let systemd = options
        .and_then(|o| o.get(RUNC_SYSTEMD_CGROUP))
        .and_then(Item::as_bool)
        .unwrap_or(false);
    let mut out = vec![(RUNC_SYSTEMD_CGROUP, value(systemd))];
    if let Some(binary) = options
        .and_then(|o| o.get(RUNC_BINARY_NAME))
        .and_then(Item::as_str)
        .filter(|b| !b.is_empty())
    {
        out.push((RUNC_BINARY_NAME, value(binary)));
    }
    out
}

/// The annotation pattern CRI passes to the shim.
fn annotation_pattern() -> String {
    format!("{ANNOTATION_PREFIX}*")
}

/// Adds the Baton runtime to the config in `text` (read from `path`). An entry already there keeps every
/// option it sets; install only adds what is missing and sets `runtime_type` and the annotation lists, so
/// a second run changes nothing.
pub fn add_runtime(path: &Path, text: &str, settings: &EntrySettings) -> Result<Edit, ConfigError> {
    let (mut doc, version) = parse(path, text)?;
    let warnings = warnings(&doc, version);
    let table_name = version.runtime_table();
    let runtimes =
        runtimes_table(path, &mut doc, version, true)?.ok_or_else(|| ConfigError::NotATable {
            path: path.to_owned(),
            key: "plugins".to_owned(),
            kind: "missing".to_owned(),
            table: table_name.clone(),
        })?;
    let layout = Layout::from_sibling(runtimes);
    let runc = runc_settings(runtimes);
    let mut changes = Vec::new();
    let new_entry = !runtimes.contains_key(RUNTIME_NAME);
    if new_entry {
        let mut t = Table::new();
        t.decor_mut().set_prefix(layout.header_prefix.as_str());
        runtimes.insert(RUNTIME_NAME, Item::Table(t));
    }
    let Some(Item::Table(entry)) = runtimes.get_mut(RUNTIME_NAME) else {
        return Err(ConfigError::NotATable {
            path: path.to_owned(),
            key: table_name.clone(),
            kind: "not a table".to_owned(),
            table: table_name,
        });
    };
    set_entry_keys(entry, &layout, &table_name, &mut changes);
    if !entry.contains_key("options") {
        let mut o = Table::new();
        o.decor_mut().set_prefix(layout.options_prefix.as_str());
        entry.insert("options", Item::Table(o));
    }
    let Some(Item::Table(options)) = entry.get_mut("options") else {
        return Err(ConfigError::NotATable {
            path: path.to_owned(),
            key: format!("{table_name}.options"),
            kind: "not a table".to_owned(),
            table: format!("{table_name}.options"),
        });
    };
    let options_name = format!("{table_name}.options");
    let baton = [
        (AGENT_SOCKET, value(settings.agent_socket.as_str())),
        (AGENT_AUTOSTART, value(settings.agent_autostart)),
    ];
    let indent = &layout.option_key_indent;
    let mut file_options = Vec::new();
    let mut warnings = warnings;
    if version == Version::V2 {
        // containerd 1.x hands the shim only `ConfigPath` of this table: the options go in that file.
        let file = settings.options_file.as_str();
        put_missing(
            options,
            CONFIG_PATH,
            value(file),
            indent,
            &options_name,
            &mut changes,
        );
        match options.get(CONFIG_PATH).and_then(Item::as_str) {
            Some(named) if named == file => file_options = runc.into_iter().chain(baton).collect(),
            named => warnings.push(format!(
                "{options_name}.{CONFIG_PATH} names {named:?}, not {file}: Baton's options ({AGENT_SOCKET}, \
                 {AGENT_AUTOSTART}) must be in that file; add them there by hand"
            )),
        }
    } else {
        for (key, item) in runc.into_iter().chain(baton) {
            put_missing(options, key, item, indent, &options_name, &mut changes);
        }
    }
    if new_entry {
        changes = vec![format!(
            "added [{table_name}] (runtime_type, the baton.io/* annotations, options: {})",
            options
                .iter()
                .map(|(k, _)| k)
                .collect::<Vec<_>>()
                .join(", ")
        )];
    }
    let text = if changes.is_empty() {
        text.to_owned()
    } else {
        doc.to_string()
    };
    Ok(Edit {
        version,
        text,
        changes,
        warnings,
        file_options,
    })
}

/// The options file's text with `options` added where missing (a key already there keeps its value, as in
/// the config), and one line per change; `text` is the file's current text (empty when there is none).
pub fn options_file_text(
    path: &Path,
    text: &str,
    options: &[(&'static str, Item)],
) -> Result<(String, Vec<String>), ConfigError> {
    let mut doc: DocumentMut =
        text.parse()
            .map_err(|e: toml_edit::TomlError| ConfigError::NotToml {
                path: path.to_owned(),
                message: e.to_string(),
            })?;
    let mut changes = Vec::new();
    let what = path.display().to_string();
    for (key, item) in options {
        put_missing(
            doc.as_table_mut(),
            key,
            item.clone(),
            "",
            &what,
            &mut changes,
        );
    }
    let out = if changes.is_empty() && !text.is_empty() {
        text.to_owned()
    } else if text.is_empty() {
        format!(
            "# Options of containerd's `baton` runtime (containerd 1.x passes a runtime's options only \
             through\n# the file its ConfigPath names), written by baton install. Keys: see the README.\n{doc}"
        )
    } else {
        doc.to_string()
    };
    Ok((out, changes))
}

/// `runtime_type` and the annotation lists of the entry: set when missing or wrong.
fn set_entry_keys(entry: &mut Table, layout: &Layout, table: &str, changes: &mut Vec<String>) {
    let indent = &layout.key_indent;
    if entry.get("runtime_type").and_then(Item::as_str) != Some(RUNTIME_TYPE) {
        entry.remove("runtime_type");
        put_missing(
            entry,
            "runtime_type",
            value(RUNTIME_TYPE),
            indent,
            table,
            changes,
        );
    }
    let pattern = annotation_pattern();
    for key in ["pod_annotations", "container_annotations"] {
        match entry.get_mut(key).and_then(Item::as_array_mut) {
            Some(list) if list.iter().any(|v| v.as_str() == Some(pattern.as_str())) => {}
            Some(list) => {
                list.push(pattern.as_str());
                changes.push(format!("added \"{pattern}\" to {table}.{key}"));
            }
            None => {
                entry.remove(key);
                let list = Array::from_iter([pattern.as_str()]);
                put_missing(entry, key, value(list), indent, table, changes);
            }
        }
    }
}

/// Removes the Baton runtime's table (whatever it holds) from the config in `text`; everything else is
/// left byte for byte.
pub fn remove_runtime(path: &Path, text: &str) -> Result<Edit, ConfigError> {
    let (mut doc, version) = parse(path, text)?;
    let warnings = warnings(&doc, version);
    let removed = runtimes_table(path, &mut doc, version, false)?
        .and_then(|r| r.remove(RUNTIME_NAME))
        .is_some();
    let (text, changes) = if removed {
        (
            doc.to_string(),
            vec![format!("removed [{}]", version.runtime_table())],
        )
    } else {
        (text.to_owned(), Vec::new())
    };
    Ok(Edit {
        version,
        text,
        changes,
        warnings,
        file_options: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const V2: &str = include_str!("../../tests/fixtures/containerd-1.6-default.toml");
    const V3: &str = include_str!("../../tests/fixtures/containerd-2-v3.toml");

    fn settings() -> EntrySettings {
        EntrySettings {
            agent_socket: baton_agent_api::DEFAULT_SOCKET.to_owned(),
            agent_autostart: false,
            options_file: format!("/etc/containerd/{OPTIONS_FILE}"),
        }
    }

    fn path() -> &'static Path {
        Path::new("/etc/containerd/config.toml")
    }

    /// The text `added` inserted into `original` in one piece, or None when the edit touched more.
    fn inserted<'a>(original: &str, added: &'a str) -> Option<&'a str> {
        let prefix = original
            .bytes()
            .zip(added.bytes())
            .take_while(|(a, b)| a == b)
            .count();
        let suffix = original
            .bytes()
            .rev()
            .zip(added.bytes().rev())
            .take_while(|(a, b)| a == b)
            .count();
        let prefix = prefix.min(original.len().saturating_sub(suffix));
        (prefix + suffix >= original.len())
            .then(|| &added[prefix..added.len() - (original.len() - prefix)])
    }

    fn entry(doc: &DocumentMut, version: Version) -> &Table {
        doc["plugins"][version.cri_plugin()]["containerd"]["runtimes"][RUNTIME_NAME]
            .as_table()
            .unwrap()
    }

    /// The options as the shim gets them: the table itself (version 3, `config_body`), or the file its
    /// `ConfigPath` names (version 2), written fresh.
    fn delivered(edit: &Edit) -> DocumentMut {
        let text = match edit.version {
            Version::V3 => {
                let doc: DocumentMut = edit.text.parse().unwrap();
                let options = entry(&doc, Version::V3)["options"].as_table().unwrap();
                let mut out = DocumentMut::new();
                for (k, v) in options.iter() {
                    out.insert(k, v.clone());
                }
                return out;
            }
            Version::V2 => options_file_text(path(), "", &edit.file_options).unwrap().0,
        };
        text.parse().unwrap()
    }

    #[test]
    fn version_2_names_the_options_file_and_the_file_gets_the_options() {
        let edit = add_runtime(path(), V2, &settings()).unwrap();
        let doc: DocumentMut = edit.text.parse().unwrap();
        let options = entry(&doc, Version::V2)["options"].as_table().unwrap();
        assert_eq!(
            options.iter().map(|(k, _)| k).collect::<Vec<_>>(),
            [CONFIG_PATH],
            "containerd 1.x sends only ConfigPath: no other key belongs in the table"
        );
        assert_eq!(
            options[CONFIG_PATH].as_str(),
            Some("/etc/containerd/baton-runtime.toml")
        );
        // A file already there keeps its keys and gets what is missing; a second pass changes nothing.
        let mine = "agent_autostart = true # mine\n";
        let (text, changes) = options_file_text(path(), mine, &edit.file_options).unwrap();
        assert!(text.starts_with(mine), "{text}");
        assert!(
            changes.iter().any(|c| c.contains(AGENT_SOCKET)),
            "{changes:?}"
        );
        let (again, none) = options_file_text(path(), &text, &edit.file_options).unwrap();
        assert_eq!((again, none.len()), (text, 0));
        // A ConfigPath of the user's own is kept, and the warning says where the options must go.
        let theirs = V2.replace(
            "[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc]",
            "[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.baton.options]\n  ConfigPath = \"/etc/mine.toml\"\n\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc]",
        );
        let edit = add_runtime(path(), &theirs, &settings()).unwrap();
        assert!(edit.file_options.is_empty());
        assert!(
            edit.warnings.iter().any(|w| w.contains("/etc/mine.toml")),
            "{:?}",
            edit.warnings
        );
    }

    #[test]
    fn both_versions_get_the_entry_in_one_piece_and_lose_it_byte_for_byte() {
        for (original, version) in [(V2, Version::V2), (V3, Version::V3)] {
            let edit = add_runtime(path(), original, &settings()).unwrap();
            assert_eq!(edit.version, version);
            let piece = inserted(original, &edit.text).expect("one contiguous insertion");
            assert!(piece.contains("runtimes.baton]"), "{piece}");
            let doc: DocumentMut = edit.text.parse().unwrap();
            let e = entry(&doc, version);
            assert_eq!(e["runtime_type"].as_str(), Some(RUNTIME_TYPE));
            assert_eq!(e["pod_annotations"][0].as_str(), Some("baton.io/*"));
            assert_eq!(e["container_annotations"][0].as_str(), Some("baton.io/*"));
            let options = delivered(&edit);
            assert_eq!(options[AGENT_AUTOSTART].as_bool(), Some(false));
            assert_eq!(
                options[AGENT_SOCKET].as_str(),
                Some(baton_agent_api::DEFAULT_SOCKET)
            );
            let again = add_runtime(path(), &edit.text, &settings()).unwrap();
            assert!(again.changes.is_empty(), "{:?}", again.changes);
            assert_eq!(again.text, edit.text);
            let removed = remove_runtime(path(), &edit.text).unwrap();
            assert_eq!(removed.text, original);
            assert!(remove_runtime(path(), original).unwrap().changes.is_empty());
        }
    }

    #[test]
    fn runc_cgroup_driver_and_binary_are_copied() {
        let text = "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.runc.options]\n\
                    SystemdCgroup = true\nBinaryName = \"/opt/runc\"\n";
        let edit = add_runtime(path(), text, &settings()).unwrap();
        let o = delivered(&edit);
        assert_eq!(o[RUNC_SYSTEMD_CGROUP].as_bool(), Some(true));
        assert_eq!(o[RUNC_BINARY_NAME].as_str(), Some("/opt/runc"));
    }

    #[test]
    fn a_config_without_the_cri_tables_gets_them_and_gives_them_back() {
        let text =
            "# minimal\nversion = 3\n\n[grpc]\n  address = \"/run/containerd/containerd.sock\"\n";
        let edit = add_runtime(path(), text, &settings()).unwrap();
        let doc: DocumentMut = edit.text.parse().unwrap();
        assert_eq!(
            entry(&doc, Version::V3)["runtime_type"].as_str(),
            Some(RUNTIME_TYPE)
        );
        assert!(edit.text.starts_with(text), "{}", edit.text);
        assert_eq!(remove_runtime(path(), &edit.text).unwrap().text, text);
    }

    #[test]
    fn an_edited_entry_keeps_its_options_and_gets_what_is_missing() {
        let text = "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.baton]\n\
                    runtime_type = \"io.containerd.runc.v2\"\npod_annotations = [\"x/*\"]\n\
                    [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.baton.options]\n\
                    agent_autostart = true # mine\nfreezer = \"signal\"\n";
        let edit = add_runtime(path(), text, &settings()).unwrap();
        let doc: DocumentMut = edit.text.parse().unwrap();
        let e = entry(&doc, Version::V2);
        assert_eq!(e["runtime_type"].as_str(), Some(RUNTIME_TYPE));
        assert_eq!(e["pod_annotations"].as_array().unwrap().len(), 2);
        assert_eq!(e["options"][AGENT_AUTOSTART].as_bool(), Some(true));
        assert_eq!(e["options"]["freezer"].as_str(), Some("signal"));
        assert!(edit.text.contains("agent_autostart = true # mine"));
    }

    #[test]
    fn version_1_and_no_version_say_what_to_do() {
        for text in ["[plugins.cri]\n", "version = 1\n", "version = \"2\"\n"] {
            let err = add_runtime(path(), text, &settings()).unwrap_err();
            assert!(
                matches!(err, ConfigError::UnsupportedVersion { .. }),
                "{err}"
            );
            let msg = err.to_string();
            assert!(msg.contains("/etc/containerd/config.toml"), "{msg}");
            assert!(msg.contains("containerd config migrate"), "{msg}");
        }
    }

    #[test]
    fn not_toml_names_the_file_and_the_line() {
        let err = add_runtime(path(), "version = 2\n\n[plugins\nx = 1\n", &settings()).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("/etc/containerd/config.toml"), "{msg}");
        assert!(msg.contains("line 3"), "{msg}");
    }

    #[test]
    fn a_runtimes_key_that_is_not_a_table_is_refused() {
        let text = "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\"]\ncontainerd = 3\n";
        let err = add_runtime(path(), text, &settings()).unwrap_err();
        assert!(err.to_string().contains("is not a table"), "{err}");
    }

    #[test]
    fn a_disabled_cri_plugin_is_a_warning() {
        let text = "version = 2\ndisabled_plugins = [\"cri\"]\n";
        let edit = add_runtime(path(), text, &settings()).unwrap();
        assert_eq!(edit.warnings.len(), 1);
        assert!(edit.warnings[0].contains("disabled_plugins"));
    }
}
