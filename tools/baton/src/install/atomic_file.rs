//! Replacing a file atomically: the new contents go to a temporary file in the same directory, are synced,
//! take the old file's mode and owner, and are renamed over it; then the directory is synced. A reader (or
//! containerd starting) sees the old file or the new one, never half of one, and a failure leaves the old
//! file as it was and no temporary file behind.

use std::{
    fs::{self, File},
    io::Write,
    os::unix::fs::{MetadataExt, PermissionsExt},
    path::{Path, PathBuf},
};

use anyhow::{Context, Result};

/// The suffix of the copy `baton install` / `baton uninstall` keep of the file they replace.
pub const BACKUP_SUFFIX: &str = ".baton-backup";

/// The backup of `path`: `path` + [`BACKUP_SUFFIX`], beside it.
pub fn backup_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(BACKUP_SUFFIX);
    PathBuf::from(name)
}

/// The directory `path` is in.
fn parent(path: &Path) -> &Path {
    path.parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// Writes `contents` to `path` atomically, with `mode` (and the owner of the file it replaces, if any).
pub fn write(path: &Path, contents: &[u8], mode: u32) -> Result<()> {
    let dir = parent(path);
    let old = fs::metadata(path).ok();
    let mut tmp = tempfile::Builder::new()
        .prefix(".baton-")
        .tempfile_in(dir)
        .with_context(|| {
            format!(
                "cannot create a temporary file in {} to replace {} (is it read-only, or not yours?); \
                 nothing was changed",
                dir.display(),
                path.display()
            )
        })?;
    let failed = |what: &str| format!("cannot {what} {}; nothing was changed", path.display());
    tmp.write_all(contents)
        .with_context(|| failed("write the new"))?;
    let file = tmp.as_file();
    file.set_permissions(fs::Permissions::from_mode(mode))
        .with_context(|| failed("set the mode of the new"))?;
    if let Some(old) = &old {
        std::os::unix::fs::fchown(file, Some(old.uid()), Some(old.gid()))
            .with_context(|| failed("give the old owner to the new"))?;
    }
    file.sync_all().with_context(|| failed("sync the new"))?;
    tmp.persist(path)
        .map_err(|e| e.error)
        .with_context(|| failed("rename the new file over"))?;
    File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("wrote {} but cannot sync {}", path.display(), dir.display()))
}

/// Replaces the existing file `path` by `contents` atomically, keeping its mode and owner, after an atomic
/// copy of the old contents to [`backup_path`]. Returns the backup's path.
pub fn replace_with_backup(path: &Path, old: &[u8], contents: &[u8]) -> Result<PathBuf> {
    let mode = fs::metadata(path)
        .with_context(|| format!("cannot stat {}", path.display()))?
        .permissions()
        .mode()
        & 0o7777;
    let backup = backup_path(path);
    write(&backup, old, mode)
        .with_context(|| format!("cannot keep a backup of {}", path.display()))?;
    write(path, contents, mode)?;
    Ok(backup)
}

/// Removes `path` and syncs its directory; a missing file is not an error (returns false).
pub fn remove(path: &Path) -> Result<bool> {
    match fs::remove_file(path) {
        Ok(()) => {
            File::open(parent(path))
                .and_then(|d| d.sync_all())
                .with_context(|| {
                    format!("removed {} but cannot sync its directory", path.display())
                })?;
            Ok(true)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e).with_context(|| format!("cannot remove {}", path.display())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replace_keeps_mode_and_a_backup_and_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.toml");
        fs::write(&path, "old\n").unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o640)).unwrap();
        let backup = replace_with_backup(&path, b"old\n", b"new\n").unwrap();
        assert_eq!(fs::read_to_string(&path).unwrap(), "new\n");
        assert_eq!(fs::read_to_string(&backup).unwrap(), "old\n");
        assert_eq!(backup, dir.path().join("config.toml.baton-backup"));
        let mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o640);
        let names: Vec<_> = fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
        assert!(remove(&backup).unwrap());
        assert!(!remove(&backup).unwrap());
    }
}
