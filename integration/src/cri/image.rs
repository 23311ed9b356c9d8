//! Container images made from a local folder, with no registry: a docker-archive tar (`manifest.json`, the
//! image config and one uncompressed layer) that `ctr images import` reads.

use std::path::{Path, PathBuf};

use serde_json::json;
use sha2::{Digest, Sha256};

/// Errors writing an image archive.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read or written.
    #[error("writing image {image} ({path}): {source}")]
    Io {
        /// The image's name.
        image: String,
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
}

/// An image to build: its name, the folder that becomes its only layer, and the command it runs.
#[derive(Debug, Clone)]
pub struct ImageSpec<'a> {
    /// A fully qualified reference (`registry/name:tag`), so that no normalisation renames it.
    pub name: &'a str,
    /// The folder whose contents become the image's root (symlinks kept as symlinks).
    pub rootfs: &'a Path,
    /// The image's entrypoint.
    pub entrypoint: &'a [&'a str],
}

/// The OCI architecture name of this machine (`amd64`, `arm64`, or Rust's name for others).
fn oci_architecture() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

/// The lower-case hex SHA-256 of `bytes` (a content digest without its `sha256:`).
pub(crate) fn hex_sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The uncompressed layer tar of `rootfs`.
fn layer_tar(rootfs: &Path) -> std::io::Result<Vec<u8>> {
    let mut builder = tar::Builder::new(Vec::new());
    builder.follow_symlinks(false);
    builder.append_dir_all(".", rootfs)?;
    builder.into_inner()
}

/// Writes `image` as a docker-archive tar at `archive`.
pub fn write_docker_archive(image: &ImageSpec<'_>, archive: &Path) -> Result<(), Error> {
    let io = |path: &Path| {
        let (image, path) = (image.name.to_string(), path.to_path_buf());
        move |source| Error::Io {
            image,
            path,
            source,
        }
    };
    let layer = layer_tar(image.rootfs).map_err(io(image.rootfs))?;
    let layer_digest = hex_sha256(&layer);
    let config = json!({
        "architecture": oci_architecture(),
        "os": "linux",
        "config": {
            "Entrypoint": image.entrypoint,
            "Env": [crate::rootfs::CONTAINER_PATH],
            "WorkingDir": "/",
        },
        "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{layer_digest}")]},
    })
    .to_string()
    .into_bytes();
    let config_name = format!("{}.json", hex_sha256(&config));
    let layer_name = format!("{layer_digest}/layer.tar");
    let manifest = json!([{
        "Config": config_name,
        "RepoTags": [image.name],
        "Layers": [layer_name],
    }])
    .to_string()
    .into_bytes();
    let file = std::fs::File::create(archive).map_err(io(archive))?;
    let mut out = tar::Builder::new(file);
    for (name, data) in [
        (config_name.as_str(), &config),
        (layer_name.as_str(), &layer),
        ("manifest.json", &manifest),
    ] {
        let mut header = tar::Header::new_gnu();
        header.set_size(data.len() as u64);
        header.set_mode(0o644);
        header.set_cksum();
        out.append_data(&mut header, name, data.as_slice())
            .map_err(io(archive))?;
    }
    out.into_inner().map_err(io(archive))?;
    Ok(())
}
