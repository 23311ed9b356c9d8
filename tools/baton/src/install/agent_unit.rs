//! The agent's systemd unit (`baton-agent.service`, one definition in tools/systemd/): where systemd runs,
//! `baton install` writes it into /etc/systemd/system and `baton uninstall` removes it. `--root` puts both
//! under another directory (tests; a host file system mounted elsewhere).

use std::path::{Path, PathBuf};

use anyhow::Result;

use super::atomic_file;

/// The unit's name.
pub const UNIT_NAME: &str = "baton-agent.service";
/// The unit's text.
pub const UNIT: &str = include_str!("../../../systemd/baton-agent.service");
/// Where the administrator's units live, under the root.
const UNIT_DIR: &str = "etc/systemd/system";
/// Present exactly when systemd is the init system (sd_booted(3)).
const SYSTEMD_RUNNING: &str = "run/systemd/system";
/// The program the unit runs (its `ExecStart`).
pub const AGENT_BINARY: &str = "usr/local/bin/baton";

/// Whether systemd runs on the system at `root`.
pub fn systemd_runs(root: &Path) -> bool {
    root.join(SYSTEMD_RUNNING).is_dir()
}

/// The unit's path under `root`.
pub fn unit_path(root: &Path) -> PathBuf {
    root.join(UNIT_DIR).join(UNIT_NAME)
}

/// What installing the unit did.
#[derive(Debug, PartialEq, Eq)]
pub enum Installed {
    /// Written (it was missing or different).
    Written(PathBuf),
    /// Already there with this text.
    Unchanged(PathBuf),
}

/// Writes the unit under `root` unless it is already there as it should be (`dry_run`: only says which).
pub fn install(root: &Path, dry_run: bool) -> Result<Installed> {
    let path = unit_path(root);
    if std::fs::read_to_string(&path).is_ok_and(|t| t == UNIT) {
        return Ok(Installed::Unchanged(path));
    }
    if !dry_run {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)
                .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", dir.display()))?;
        }
        atomic_file::write(&path, UNIT.as_bytes(), 0o644)?;
    }
    Ok(Installed::Written(path))
}

/// Removes the unit under `root`; returns its path if it was there.
pub fn remove(root: &Path, dry_run: bool) -> Result<Option<PathBuf>> {
    let path = unit_path(root);
    let present = path.exists();
    if dry_run || !present {
        return Ok(present.then_some(path));
    }
    Ok(atomic_file::remove(&path)?.then_some(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_unit_runs_the_agent_binary_it_names() {
        let exec = UNIT
            .lines()
            .find_map(|l| l.strip_prefix("ExecStart="))
            .unwrap();
        assert_eq!(exec, format!("/{AGENT_BINARY} agent"));
    }

    #[test]
    fn install_twice_then_remove() {
        let root = tempfile::tempdir().unwrap();
        assert!(!systemd_runs(root.path()));
        let path = unit_path(root.path());
        assert_eq!(
            install(root.path(), true).unwrap(),
            Installed::Written(path.clone())
        );
        assert!(!path.exists());
        assert_eq!(
            install(root.path(), false).unwrap(),
            Installed::Written(path.clone())
        );
        assert_eq!(std::fs::read_to_string(&path).unwrap(), UNIT);
        assert_eq!(
            install(root.path(), false).unwrap(),
            Installed::Unchanged(path.clone())
        );
        assert_eq!(remove(root.path(), false).unwrap(), Some(path.clone()));
        assert!(!path.exists());
        assert_eq!(remove(root.path(), false).unwrap(), None);
    }
}
