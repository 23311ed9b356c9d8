//! `baton install` / `baton uninstall`: the Baton runtime entry in containerd's config (version 2 and 3,
//! formatting kept, written atomically with a backup), the agent's systemd unit where systemd runs, the
//! binaries on the host's PATH (for the DaemonSet's install container), and the RuntimeClass to apply.
//!
//! Notes go to stderr; stdout carries only the RuntimeClass (install) or the diff (`--dry-run`), so that
//! `baton install | kubectl apply -f -` works.
mod agent_unit;
mod atomic_file;
mod containerd_config;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use containerd_config::EntrySettings;

/// containerd's config, where its packages put it.
pub const DEFAULT_CONFIG: &str = "/etc/containerd/config.toml";
/// The RuntimeClass that selects Baton (one definition with the Kubernetes manifests).
pub const RUNTIME_CLASS: &str = include_str!("../../../kubernetes/runtimeclass.yaml");
/// The shim's binary, which `--bin-dir` copies from beside this `baton`.
const SHIM_BINARY: &str = "containerd-shim-baton-v1";
/// The link `systemctl enable` makes for the unit (its `WantedBy=multi-user.target`).
const UNIT_WANTS_LINK: &str = "etc/systemd/system/multi-user.target.wants";

/// Who runs the node agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum AgentMode {
    /// A systemd unit, where systemd runs (elsewhere: the shims start it).
    Systemd,
    /// The Kubernetes DaemonSet (tools/kubernetes/): no unit, and shims do not start one.
    Daemonset,
    /// The first shim that needs the agent starts it.
    Shim,
}

/// Arguments of `baton install`.
#[derive(clap::Args, Debug)]
pub struct InstallArgs {
    /// containerd's config file (version 2 or 3).
    #[arg(long, default_value = DEFAULT_CONFIG)]
    config: PathBuf,
    /// Print the change to the config (a diff) and what else would be done; write nothing.
    #[arg(long)]
    dry_run: bool,
    /// Who runs the node agent.
    #[arg(long, value_enum, default_value_t = AgentMode::Systemd)]
    agent: AgentMode,
    /// Also copy this `baton` and the shim beside it into DIR (e.g. /host/usr/local/bin from a DaemonSet).
    #[arg(long, value_name = "DIR")]
    bin_dir: Option<PathBuf>,
    /// The root of the node's file system as seen here (`/host` from the DaemonSet's install container):
    /// where the unit goes and systemd is looked for, and what paths written into the config are relative to
    /// (containerd reads them on the node).
    #[arg(long, default_value = "/")]
    root: PathBuf,
}

/// Arguments of `baton uninstall`.
#[derive(clap::Args, Debug)]
pub struct UninstallArgs {
    /// containerd's config file.
    #[arg(long, default_value = DEFAULT_CONFIG)]
    config: PathBuf,
    /// Print the change to the config (a diff) and what else would be done; write nothing.
    #[arg(long)]
    dry_run: bool,
    /// Also remove `baton` and the shim from DIR (what `install --bin-dir DIR` copied).
    #[arg(long, value_name = "DIR")]
    bin_dir: Option<PathBuf>,
    /// The root of the file system the unit is removed from.
    #[arg(long, default_value = "/")]
    root: PathBuf,
}

/// A line for the user, on stderr.
fn note(line: impl AsRef<str>) {
    eprintln!("baton: {}", line.as_ref());
}

/// The config's real path (a symlink is followed, so that the rename replaces the file, not the link) and
/// its text.
fn read_config(path: &Path) -> Result<(PathBuf, String)> {
    let real = match std::fs::canonicalize(path) {
        Ok(p) => p,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => bail!(
            "{} does not exist: containerd runs on its built-in defaults. Write them out first \
             (`containerd config default > {}`; install does not guess which config version your \
             containerd reads) and run baton install again",
            path.display(),
            path.display()
        ),
        Err(e) => return Err(e).with_context(|| format!("cannot open {}", path.display())),
    };
    let text = std::fs::read_to_string(&real)
        .with_context(|| format!("cannot read {} as text", real.display()))?;
    Ok((real, text))
}

/// Prints the unified diff of the config's change on stdout.
fn print_diff(path: &Path, old: &str, new: &str) {
    let name = path.display().to_string();
    let diff = similar::TextDiff::from_lines(old, new);
    print!(
        "{}",
        diff.unified_diff()
            .context_radius(3)
            .header(&name, &format!("{name} (after)"))
    );
}

/// Writes the edited config (or, dry, prints the diff); says what changed.
fn apply(path: &Path, old: &str, edit: &containerd_config::Edit, dry_run: bool) -> Result<bool> {
    for w in &edit.warnings {
        note(format!("warning: {}: {w}", path.display()));
    }
    if edit.changes.is_empty() {
        return Ok(false);
    }
    let say_changes = || {
        for c in &edit.changes {
            note(format!("{}: {c}", path.display()));
        }
    };
    if dry_run {
        say_changes();
        print_diff(path, old, &edit.text);
        note(format!("--dry-run: {} not written", path.display()));
    } else {
        let backup = atomic_file::replace_with_backup(path, old.as_bytes(), edit.text.as_bytes())?;
        say_changes();
        note(format!(
            "wrote {} (version {}); the previous file is in {}",
            path.display(),
            edit.version.number(),
            backup.display()
        ));
    }
    Ok(true)
}

/// `baton install`.
pub fn install(args: InstallArgs) -> Result<()> {
    let (path, old) = read_config(&args.config)?;
    let unit = args.agent == AgentMode::Systemd && agent_unit::systemd_runs(&args.root);
    let options_file = path.with_file_name(containerd_config::OPTIONS_FILE);
    let settings = EntrySettings {
        agent_socket: baton_agent_api::DEFAULT_SOCKET.to_owned(),
        agent_autostart: !(unit || args.agent == AgentMode::Daemonset),
        options_file: on_node(&args.root, &options_file),
    };
    let edit = containerd_config::add_runtime(&path, &old, &settings)?;
    let changed = apply(&path, &old, &edit, args.dry_run)?;
    let changed = write_options_file(&options_file, &edit, args.dry_run)? || changed;
    if !changed {
        note(format!(
            "{} already has the baton runtime [{}]: nothing changed",
            path.display(),
            edit.version.runtime_table()
        ));
    }
    if let Some(dir) = &args.bin_dir {
        copy_binaries(dir, args.dry_run)?;
    }
    install_agent(&args, unit)?;
    if args.dry_run {
        return Ok(());
    }
    if changed {
        note("restart containerd to load the runtime: systemctl restart containerd");
    }
    note(
        "the RuntimeClass follows on stdout; apply it once per cluster: baton install | kubectl apply -f -",
    );
    print!("{RUNTIME_CLASS}");
    Ok(())
}

/// `path` (seen here) as the node names it: relative to `root` when under it.
fn on_node(root: &Path, path: &Path) -> String {
    match path.strip_prefix(root) {
        Ok(rest) if root != Path::new("/") => Path::new("/").join(rest).display().to_string(),
        _ => path.display().to_string(),
    }
}

/// Writes the options a version 2 config's `ConfigPath` names into `file` (only what is missing there);
/// whether it changed.
fn write_options_file(file: &Path, edit: &containerd_config::Edit, dry_run: bool) -> Result<bool> {
    if edit.file_options.is_empty() {
        return Ok(false);
    }
    let old = match std::fs::read_to_string(file) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", file.display())),
    };
    let (text, changes) = containerd_config::options_file_text(file, &old, &edit.file_options)?;
    if changes.is_empty() {
        return Ok(false);
    }
    for c in &changes {
        note(c);
    }
    if dry_run {
        print_diff(file, &old, &text);
        note(format!("--dry-run: {} not written", file.display()));
    } else {
        atomic_file::write(file, text.as_bytes(), 0o644)?;
        note(format!(
            "wrote {} (containerd 1.x passes the runtime its options through this file only)",
            file.display()
        ));
    }
    Ok(true)
}

/// The agent's part of install: the unit, or what runs the agent instead.
fn install_agent(args: &InstallArgs, unit: bool) -> Result<()> {
    match args.agent {
        AgentMode::Systemd if unit => {
            let verb = if args.dry_run { "would write" } else { "wrote" };
            match agent_unit::install(&args.root, args.dry_run)? {
                agent_unit::Installed::Written(p) => note(format!(
                    "{verb} {}; start it: systemctl daemon-reload && systemctl enable --now {}",
                    p.display(),
                    agent_unit::UNIT_NAME
                )),
                agent_unit::Installed::Unchanged(p) => {
                    note(format!("{} is already installed", p.display()));
                }
            }
            let binary = args.root.join(agent_unit::AGENT_BINARY);
            if !binary.exists() {
                note(format!(
                    "warning: the unit runs /{}, which does not exist: copy baton there \
                     (install -m 755 baton /{}) or pass --bin-dir /usr/local/bin",
                    agent_unit::AGENT_BINARY,
                    agent_unit::AGENT_BINARY
                ));
            }
        }
        AgentMode::Systemd => note(format!(
            "systemd does not run here (no {}): no unit installed. The first shim that needs the agent \
             starts it (agent_autostart); to run it yourself: baton agent --daemon",
            args.root.join("run/systemd/system").display()
        )),
        AgentMode::Daemonset => note(
            "the agent runs as the DaemonSet (tools/kubernetes/baton-agent.yaml): no unit, and shims do \
             not start one (agent_autostart = false)",
        ),
        AgentMode::Shim => note("no unit: the first shim that needs the agent starts it"),
    }
    Ok(())
}

/// This `baton` and the shim beside it.
fn own_binaries() -> Result<[PathBuf; 2]> {
    let me = std::env::current_exe().context("cannot find the running baton binary")?;
    let shim = me.with_file_name(SHIM_BINARY);
    if !shim.is_file() {
        bail!(
            "{} not found beside {}: --bin-dir copies both",
            shim.display(),
            me.display()
        );
    }
    Ok([me, shim])
}

/// Copies `baton` and the shim into `dir` atomically (a running binary there is replaced, not written to).
fn copy_binaries(dir: &Path, dry_run: bool) -> Result<()> {
    for src in own_binaries()? {
        let name = src.file_name().unwrap_or_default();
        let dst = dir.join(name);
        let bytes =
            std::fs::read(&src).with_context(|| format!("cannot read {}", src.display()))?;
        if std::fs::read(&dst).is_ok_and(|b| b == bytes) {
            note(format!("{} is up to date", dst.display()));
        } else if dry_run {
            note(format!("would copy {} to {}", src.display(), dst.display()));
        } else {
            atomic_file::write(&dst, &bytes, 0o755)?;
            note(format!("copied {} to {}", src.display(), dst.display()));
        }
    }
    Ok(())
}

/// `baton uninstall`.
pub fn uninstall(args: UninstallArgs) -> Result<()> {
    let (path, old) = read_config(&args.config)?;
    let edit = containerd_config::remove_runtime(&path, &old)?;
    let mut changed = apply(&path, &old, &edit, args.dry_run)?;
    let options_file = path.with_file_name(containerd_config::OPTIONS_FILE);
    if options_file.exists() {
        if args.dry_run {
            note(format!("would remove {}", options_file.display()));
        } else if atomic_file::remove(&options_file)? {
            note(format!("removed {}", options_file.display()));
        }
        changed = true;
    }
    if !changed {
        note(format!(
            "{} has no baton runtime: nothing changed",
            path.display()
        ));
    }
    let link = args.root.join(UNIT_WANTS_LINK).join(agent_unit::UNIT_NAME);
    if link.symlink_metadata().is_ok() && !args.dry_run {
        atomic_file::remove(&link)?;
    }
    match agent_unit::remove(&args.root, args.dry_run)? {
        Some(p) if args.dry_run => note(format!("would remove {}", p.display())),
        Some(p) => note(format!(
            "removed {}; if the agent runs: systemctl stop {} && systemctl daemon-reload",
            p.display(),
            agent_unit::UNIT_NAME
        )),
        None => {}
    }
    if let Some(dir) = &args.bin_dir {
        for name in [
            agent_unit::AGENT_BINARY
                .rsplit('/')
                .next()
                .unwrap_or("baton"),
            SHIM_BINARY,
        ] {
            let p = dir.join(name);
            if args.dry_run {
                note(format!("would remove {}", p.display()));
            } else if atomic_file::remove(&p)? {
                note(format!("removed {}", p.display()));
            }
        }
    }
    if changed && !args.dry_run {
        note(
            "restart containerd to drop the runtime: systemctl restart containerd; once no node runs \
             Baton: kubectl delete runtimeclass baton",
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use containerd_config::Version;

    /// The RuntimeClass's handler is the runtime install adds, and its line is exactly `handler: NAME`.
    #[test]
    fn the_runtime_class_names_the_runtime_install_writes() {
        let handler = RUNTIME_CLASS
            .lines()
            .find_map(|l| l.strip_prefix("handler: "))
            .unwrap();
        assert_eq!(handler, containerd_config::RUNTIME_NAME);
        assert!(RUNTIME_CLASS.contains("kind: RuntimeClass"));
    }

    #[test]
    fn both_versions_name_their_cri_plugin() {
        assert!(
            Version::V2
                .runtime_table()
                .contains("io.containerd.grpc.v1.cri")
        );
        assert!(
            Version::V3
                .runtime_table()
                .contains("io.containerd.cri.v1.runtime")
        );
    }
}
