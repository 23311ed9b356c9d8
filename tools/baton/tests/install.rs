//! `baton install` / `baton uninstall` run as the real binary on copies of Debian's default containerd 1.6
//! config (`containerd config default`, committed as a fixture) and of a containerd 2.x version 3 config:
//! the runtime table is added in one piece and parses, containerd 1.6 reads the result, a second install
//! is a no-op, uninstall gives back the original bytes, the backup is there; the agent's unit under a
//! temporary root (checked by `systemd-analyze verify` where it is installed); and bad input: a config
//! that is not TOML, a missing one, a read-only directory.

use std::{
    path::{Path, PathBuf},
    process::{Command, Output},
};

use toml_edit::DocumentMut;

const BATON: &str = env!("CARGO_BIN_EXE_baton");
const V2_DEFAULT: &str = include_str!("fixtures/containerd-1.6-default.toml");
const V3_SAMPLE: &str = include_str!("fixtures/containerd-2-v3.toml");
const UNIT: &str = include_str!("../../systemd/baton-agent.service");
const RUNTIME_CLASS: &str = include_str!("../../kubernetes/runtimeclass.yaml");

/// Debian's default with comments an operator added (`containerd config default` writes none).
fn v2_commented() -> String {
    let edited = V2_DEFAULT.replacen(
        "            SystemdCgroup = false\n",
        "            # keep in step with the kubelet's cgroupDriver\n            SystemdCgroup = false # cgroupfs\n",
        1,
    );
    assert_ne!(edited, V2_DEFAULT, "the fixture lost its runc options");
    format!("# /etc/containerd/config.toml: managed by hand\n{edited}")
}

fn baton(args: &[&str]) -> Output {
    let out = Command::new(BATON).args(args).output().expect("run baton");
    eprintln!(
        "baton {}: {}\n{}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A config file in a fresh directory, and a root for the unit where systemd does not run.
struct Node {
    dir: tempfile::TempDir,
    config: PathBuf,
}

impl Node {
    fn with(text: &str) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let config = dir.path().join("config.toml");
        std::fs::write(&config, text).expect("write config");
        Self { dir, config }
    }

    fn config(&self) -> &str {
        self.config.to_str().expect("utf-8 path")
    }

    fn root(&self) -> String {
        let root = self.dir.path().join("root");
        std::fs::create_dir_all(&root).expect("root");
        root.to_str().expect("utf-8 path").to_owned()
    }

    fn read(&self) -> String {
        std::fs::read_to_string(&self.config).expect("read config")
    }

    /// The Baton runtime's options as its shim gets them: the table (version 3, sent whole as `config_body`),
    /// or the file its `ConfigPath` names (version 2: containerd 1.x sends only that), which must be the
    /// `baton-runtime.toml` beside the config.
    fn delivered_options(&self) -> toml_edit::Table {
        let doc: DocumentMut = self.read().parse().expect("TOML");
        let plugins = doc["plugins"].as_table().expect("plugins");
        let (name, _) = plugins
            .iter()
            .find(|(_, p)| {
                p.get("containerd")
                    .and_then(|c| c.get("runtimes"))
                    .and_then(|r| r.get("baton"))
                    .is_some()
            })
            .expect("a baton runtime");
        let options = doc["plugins"][name]["containerd"]["runtimes"]["baton"]["options"]
            .as_table()
            .expect("options")
            .clone();
        if name != "io.containerd.grpc.v1.cri" {
            return options;
        }
        let file = self.dir.path().join("baton-runtime.toml");
        assert_eq!(
            options["ConfigPath"].as_str(),
            Some(file.to_str().expect("utf-8")),
            "version 2: ConfigPath names the options file"
        );
        let text = std::fs::read_to_string(&file).expect("the options file");
        let doc: DocumentMut = text.parse().expect("the options file is TOML");
        doc.as_table().clone()
    }

    fn names(&self) -> Vec<String> {
        let mut names: Vec<_> = std::fs::read_dir(self.dir.path())
            .expect("list")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }
}

/// The text `new` inserted into `old` in one contiguous piece, or None when more changed.
fn inserted<'a>(old: &str, new: &'a str) -> Option<&'a str> {
    let prefix = old
        .bytes()
        .zip(new.bytes())
        .take_while(|(a, b)| a == b)
        .count();
    let suffix = old
        .bytes()
        .rev()
        .zip(new.bytes().rev())
        .take_while(|(a, b)| a == b)
        .count();
    let prefix = prefix.min(old.len().saturating_sub(suffix));
    (prefix + suffix >= old.len()).then(|| &new[prefix..new.len() - (old.len() - prefix)])
}

/// Install, check, install again, uninstall, for one config; returns the installed text.
fn round_trip(original: &str, plugin: &str) -> String {
    let node = Node::with(original);
    let root = node.root();
    let out = baton(&["install", "--config", node.config(), "--root", &root]);
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout), RUNTIME_CLASS);
    assert!(
        stderr(&out).contains("no unit installed"),
        "{}",
        stderr(&out)
    );
    let installed = node.read();
    let piece = inserted(original, &installed).expect("the runtime added in one piece");
    assert!(
        piece.contains(&format!("[plugins.{plugin}.containerd.runtimes.baton]")),
        "{piece}"
    );
    let doc: DocumentMut = installed.parse().expect("the result is TOML");
    let plugin_key = plugin.trim_matches(|c| c == '"' || c == '\'');
    let entry = &doc["plugins"][plugin_key]["containerd"]["runtimes"]["baton"];
    assert_eq!(
        entry["runtime_type"].as_str(),
        Some("io.containerd.baton.v1")
    );
    for key in ["pod_annotations", "container_annotations"] {
        assert_eq!(entry[key][0].as_str(), Some("baton.io/*"), "{key}");
    }
    assert_eq!(
        node.delivered_options()["agent_autostart"].as_bool(),
        Some(true)
    );
    let backup = node.dir.path().join("config.toml.baton-backup");
    assert_eq!(std::fs::read_to_string(&backup).expect("backup"), original);

    let again = baton(&["install", "--config", node.config(), "--root", &root]);
    assert!(again.status.success());
    assert!(
        stderr(&again).contains("nothing changed"),
        "{}",
        stderr(&again)
    );
    assert_eq!(node.read(), installed);

    let out = baton(&["uninstall", "--config", node.config(), "--root", &root]);
    assert!(out.status.success());
    assert_eq!(
        node.read(),
        original,
        "uninstall gives back the original bytes"
    );
    assert_eq!(std::fs::read_to_string(&backup).expect("backup"), installed);
    let out = baton(&["uninstall", "--config", node.config(), "--root", &root]);
    assert!(out.status.success());
    assert!(stderr(&out).contains("nothing changed"), "{}", stderr(&out));
    assert_eq!(
        node.names(),
        ["config.toml", "config.toml.baton-backup", "root"]
    );
    installed
}

#[test]
fn install_and_uninstall_on_debian_default_containerd_config() {
    for original in [V2_DEFAULT.to_owned(), v2_commented()] {
        let installed = round_trip(&original, "\"io.containerd.grpc.v1.cri\"");
        containerd_reads(&installed);
    }
}

#[test]
fn install_and_uninstall_on_a_containerd_2_version_3_config() {
    let installed = round_trip(V3_SAMPLE, "'io.containerd.cri.v1.runtime'");
    // The runc entry's systemd cgroup driver is copied: Baton's runc must use the kubelet's.
    let doc: DocumentMut = installed.parse().expect("TOML");
    let options = &doc["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]["baton"]
        ["options"];
    assert_eq!(options["SystemdCgroup"].as_bool(), Some(true));
    assert!(installed.contains("# the kubelet runs with cgroupDriver: systemd"));
}

/// containerd 1.6 parses the installed config and shows the runtime with its options file.
fn containerd_reads(installed: &str) {
    if Command::new("containerd")
        .arg("--version")
        .output()
        .is_err()
    {
        baton_prereq::missing("containerd is not installed (tools/setup.sh installs it)");
        return;
    }
    let node = Node::with(installed);
    let out = Command::new("containerd")
        .args(["--config", node.config(), "config", "dump"])
        .output()
        .expect("containerd config dump");
    let dump = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let dumped: DocumentMut = dump.parse().expect("containerd's dump is TOML");
    let cri = &dumped["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"];
    assert_eq!(
        cri["baton"]["runtime_type"].as_str(),
        Some("io.containerd.baton.v1")
    );
    assert_eq!(
        cri["baton"]["pod_annotations"][0].as_str(),
        Some("baton.io/*")
    );
    // What containerd 1.x hands the shim: the file of options ConfigPath names (the install's node wrote it
    // beside its config; this copy's config is elsewhere, so only the name is checked here).
    assert!(
        cri["baton"]["options"]["ConfigPath"]
            .as_str()
            .is_some_and(|p| p.ends_with("/baton-runtime.toml")),
        "{}",
        cri["baton"]
    );
    assert_eq!(
        cri["runc"]["runtime_type"].as_str(),
        Some("io.containerd.runc.v2")
    );
}

#[test]
fn dry_run_prints_the_diff_and_writes_nothing() {
    let node = Node::with(V2_DEFAULT);
    let root = node.root();
    let out = baton(&[
        "install",
        "--dry-run",
        "--config",
        node.config(),
        "--root",
        &root,
    ]);
    assert!(out.status.success());
    let diff = String::from_utf8_lossy(&out.stdout);
    assert!(
        diff.contains("+        [plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.baton]"),
        "{diff}"
    );
    assert!(
        diff.contains("+          runtime_type = \"io.containerd.baton.v1\""),
        "{diff}"
    );
    // The options file containerd 1.x passes the shim, shown as a new file.
    assert!(diff.contains("baton-runtime.toml (after)"), "{diff}");
    assert!(
        diff.contains("+agent_socket = \"/run/baton/agent.sock\""),
        "{diff}"
    );
    assert!(
        !diff
            .lines()
            .any(|l| l.starts_with('-') && !l.starts_with("---")),
        "a dry run only adds lines: {diff}"
    );
    assert_eq!(node.read(), V2_DEFAULT);
    assert_eq!(node.names(), ["config.toml", "root"]);
}

#[test]
fn a_config_that_is_not_toml_is_refused_naming_file_and_line() {
    let text = "version = 2\n\n[plugins.\"io.containerd.grpc.v1.cri\"\nsandbox_image = 1\n";
    let node = Node::with(text);
    let root = node.root();
    for cmd in ["install", "uninstall"] {
        let out = baton(&[cmd, "--config", node.config(), "--root", &root]);
        assert!(!out.status.success());
        let err = stderr(&out);
        assert!(
            err.contains(node.config()) && err.contains("not valid TOML"),
            "{err}"
        );
        assert!(err.contains("line 3"), "{err}");
        assert_eq!(node.read(), text);
        assert_eq!(node.names(), ["config.toml", "root"]);
    }
}

#[test]
fn a_version_1_config_says_how_to_convert_it() {
    let node = Node::with("[plugins.cri.containerd]\n  snapshotter = \"overlayfs\"\n");
    let out = baton(&["install", "--config", node.config(), "--root", &node.root()]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("no `version` key") && err.contains("containerd config migrate"),
        "{err}"
    );
}

#[test]
fn a_missing_config_says_how_to_write_one() {
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("config.toml");
    let config = config.to_str().expect("utf-8");
    let out = baton(&["install", "--config", config]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("does not exist") && err.contains("containerd config default"),
        "{err}"
    );
    assert!(!Path::new(config).exists());
}

#[test]
fn a_read_only_config_directory_fails_cleanly() {
    if !nix_is_root() {
        baton_prereq::missing("needs root (a read-only bind mount in a private mount namespace)");
        return;
    }
    let node = Node::with(V2_DEFAULT);
    let root = node.root();
    let dir = node.dir.path().to_str().expect("utf-8").to_owned();
    // A private mount namespace: the directory is read-only for baton only.
    let script = format!(
        "mount --bind {dir} {dir} && mount -o remount,ro,bind {dir} && exec {BATON} install --config {} --root {root}",
        node.config()
    );
    let out = Command::new("unshare")
        .args(["-m", "sh", "-c", &script])
        .output()
        .expect("unshare (util-linux)");
    let err = stderr(&out);
    eprintln!("{err}");
    assert!(!out.status.success());
    assert!(
        err.contains("Read-only file system") && err.contains(node.config()),
        "{err}"
    );
    assert!(err.contains("nothing was changed"), "{err}");
    assert_eq!(node.read(), V2_DEFAULT);
    assert_eq!(
        node.names(),
        ["config.toml", "root"],
        "no backup, no temporary file"
    );
}

fn nix_is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout == b"0\n")
}

/// A root where systemd runs: `run/systemd/system` exists, and the unit's ExecStart program is there.
fn systemd_root(node: &Node) -> String {
    let root = node.root();
    std::fs::create_dir_all(Path::new(&root).join("run/systemd/system")).expect("mkdir");
    let bin = Path::new(&root).join("usr/local/bin");
    std::fs::create_dir_all(&bin).expect("mkdir");
    std::fs::write(bin.join("baton"), "#!/bin/sh\n").expect("stand-in");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(bin.join("baton"), std::fs::Permissions::from_mode(0o755))
        .expect("chmod");
    root
}

#[test]
fn the_agent_unit_is_installed_where_systemd_runs_and_removed() {
    let node = Node::with(V3_SAMPLE);
    let root = systemd_root(&node);
    let out = baton(&["install", "--config", node.config(), "--root", &root]);
    assert!(out.status.success());
    let unit_path = Path::new(&root).join("etc/systemd/system/baton-agent.service");
    assert_eq!(std::fs::read_to_string(&unit_path).expect("unit"), UNIT);
    assert!(stderr(&out).contains("systemctl enable --now baton-agent.service"));
    let doc: DocumentMut = node.read().parse().expect("TOML");
    let options = &doc["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]["baton"]
        ["options"];
    assert_eq!(
        options["agent_autostart"].as_bool(),
        Some(false),
        "systemd runs the agent: shims must not start another"
    );
    check_unit_keys(UNIT);
    systemd_verifies(&root, &unit_path);

    let again = baton(&["install", "--config", node.config(), "--root", &root]);
    assert!(
        stderr(&again).contains("is already installed"),
        "{}",
        stderr(&again)
    );
    // What `systemctl enable` leaves; uninstall removes it with the unit.
    let wants = Path::new(&root).join("etc/systemd/system/multi-user.target.wants");
    std::fs::create_dir_all(&wants).expect("mkdir");
    std::os::unix::fs::symlink(&unit_path, wants.join("baton-agent.service")).expect("link");
    let out = baton(&["uninstall", "--config", node.config(), "--root", &root]);
    assert!(out.status.success());
    assert!(!unit_path.exists());
    assert!(
        wants
            .join("baton-agent.service")
            .symlink_metadata()
            .is_err()
    );
    assert_eq!(node.read(), V3_SAMPLE);
}

/// The unit parses as an INI file with the sections and keys systemd needs to run the agent.
fn check_unit_keys(unit: &str) {
    let mut section = String::new();
    let mut keys = Vec::new();
    for line in unit.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = name.to_owned();
            continue;
        }
        let (key, value) = line.split_once('=').expect("key=value line");
        assert!(!section.is_empty(), "{line} before any section");
        keys.push((section.clone(), key.to_owned(), value.to_owned()));
    }
    let get = |s: &str, k: &str| {
        keys.iter()
            .find(|(sec, key, _)| sec == s && key == k)
            .map(|(_, _, v)| v.as_str())
    };
    assert_eq!(
        get("Service", "ExecStart"),
        Some("/usr/local/bin/baton agent")
    );
    assert_eq!(get("Service", "Type"), Some("simple"));
    assert_eq!(get("Service", "Restart"), Some("always"));
    assert_eq!(get("Install", "WantedBy"), Some("multi-user.target"));
    assert!(get("Unit", "Description").is_some());
}

/// `systemd-analyze verify` (Debian's systemd) accepts the unit under the root and rejects a broken copy.
fn systemd_verifies(root: &str, unit_path: &Path) {
    if Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("systemd-analyze is not installed: the unit was checked as INI only");
        return;
    }
    // The targets the unit names, from the host (copied: symlinks in there are relative to the root).
    let units = Path::new(root).join("usr/lib/systemd");
    std::fs::create_dir_all(&units).expect("mkdir");
    let copied = Command::new("cp")
        .args(["-a", "/usr/lib/systemd/system"])
        .arg(&units)
        .status()
        .expect("cp");
    assert!(copied.success());
    let verify = |path: &Path| {
        let out = Command::new("systemd-analyze")
            .args(["verify", "--man=no", &format!("--root={root}")])
            .arg(path)
            .output()
            .expect("systemd-analyze");
        (out.status.success(), stderr(&out))
    };
    let (ok, err) = verify(unit_path);
    assert!(
        ok && !err.contains("baton-agent"),
        "systemd-analyze verify: {err}"
    );
    let broken = unit_path.with_file_name("baton-broken.service");
    std::fs::write(&broken, UNIT.replace("Type=simple", "Type=sometimes")).expect("write");
    let (_, err) = verify(&broken);
    assert!(
        err.contains("baton-broken.service") && err.contains("sometimes"),
        "{err}"
    );
    std::fs::remove_file(&broken).expect("rm");
}

#[test]
fn bin_dir_copies_baton_and_the_shim_and_uninstall_removes_them() {
    // A copy of baton with a stand-in shim beside it, as in the DaemonSet's image.
    let image = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).expect("tempdir");
    let me = image.path().join("baton");
    std::fs::hard_link(BATON, &me)
        .or_else(|_| std::fs::copy(BATON, &me).map(drop))
        .expect("copy baton");
    std::fs::write(image.path().join("containerd-shim-baton-v1"), "shim\n").expect("shim");
    let node = Node::with(V2_DEFAULT);
    let host_bin = node.dir.path().join("bin");
    std::fs::create_dir(&host_bin).expect("mkdir");
    let host_bin = host_bin.to_str().expect("utf-8");
    let args = [
        "install",
        "--config",
        node.config(),
        "--agent",
        "daemonset",
        "--bin-dir",
        host_bin,
    ];
    let out = Command::new(&me).args(args).output().expect("run baton");
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("DaemonSet"), "{}", stderr(&out));
    let shim = Path::new(host_bin).join("containerd-shim-baton-v1");
    assert_eq!(
        std::fs::read_to_string(&shim).expect("shim copied"),
        "shim\n"
    );
    assert_eq!(
        std::fs::read(Path::new(host_bin).join("baton")).expect("baton copied"),
        std::fs::read(BATON).expect("baton")
    );
    assert_eq!(
        node.delivered_options()["agent_autostart"].as_bool(),
        Some(false)
    );
    let again = Command::new(&me).args(args).output().expect("run baton");
    assert!(
        stderr(&again).contains("is up to date"),
        "{}",
        stderr(&again)
    );

    let root = node.root();
    let out = baton(&[
        "uninstall",
        "--config",
        node.config(),
        "--bin-dir",
        host_bin,
        "--root",
        &root,
    ]);
    assert!(out.status.success());
    assert!(!shim.exists() && !Path::new(host_bin).join("baton").exists());
    assert_eq!(node.read(), V2_DEFAULT);
}
