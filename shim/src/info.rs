//! The `-info` action, which containerd 2.x runs before it uses a runtime (options on stdin): the runtime's
//! name and version, the options echoed back, and the OCI features of the runc those options pick (`runc
//! features`, JSON), as containerd's Go runc shim answers.

use std::{path::Path, process::Command};

use containerd_shim_protos::{
    protobuf::{MessageField, well_known_types::any::Any},
    types::introspection::{RuntimeInfo, RuntimeVersion},
};

use crate::{
    errors::{Result, ShimError},
    options::decode_options,
    runtime::RuncGlobal,
};

/// The type URL containerd's typeurl registry gives runtime-spec's `features.Features` (JSON).
pub const FEATURES_TYPE_URL: &str =
    "types.containerd.io/opencontainers/runtime-spec/1/features/Features";

/// What `-info` answers for runtime `runtime_id` given the runtime `options` containerd passed.
pub fn runtime_info(runtime_id: &str, options: Option<&Any>) -> Result<RuntimeInfo> {
    let cfg = decode_options(options)?;
    let global = RuncGlobal::new(&cfg.runc, "", Path::new(""));
    let features = runc_features(&global.binary)?;
    Ok(RuntimeInfo {
        name: runtime_id.to_string(),
        version: MessageField::some(RuntimeVersion {
            version: crate::VERSION.to_string(),
            ..Default::default()
        }),
        options: MessageField::from_option(options.cloned()),
        features: MessageField::from_option(features),
        ..Default::default()
    })
}

/// `runc features` of `binary` as a typeurl Any, or `None` (with a warning) when that runc does not
/// implement the command; an error when the binary cannot be run at all.
fn runc_features(binary: &Path) -> Result<Option<Any>> {
    let output = Command::new(binary).arg("features").output().map_err(|e| {
        ShimError::io(
            format!(
                "run `{} features` (install runc or set BinaryName in the runtime options)",
                binary.display()
            ),
            e,
        )
    })?;
    if !output.status.success() {
        tracing::warn!(
            binary = %binary.display(),
            stderr = %String::from_utf8_lossy(&output.stderr).trim(),
            "`runc features` failed: answering without features"
        );
        return Ok(None);
    }
    let features: serde_json::Value = match serde_json::from_slice(&output.stdout) {
        Ok(features) => features,
        Err(e) => {
            tracing::warn!(binary = %binary.display(), error = %e, "`runc features` printed no JSON");
            return Ok(None);
        }
    };
    let value = serde_json::to_vec(&features)
        .map_err(|e| ShimError::Other(format!("encode runc features: {e}")))?;
    Ok(Some(Any {
        type_url: FEATURES_TYPE_URL.to_string(),
        value,
        ..Default::default()
    }))
}

/// The `-info` action: reads the options (a protobuf `Any`, possibly empty) from stdin and writes the
/// `RuntimeInfo` to stdout. Errors are plain messages for containerd's log.
pub fn answer(runtime_id: &str) -> Result<()> {
    use std::io::{Read, Write};

    use containerd_shim_protos::protobuf::Message;

    let mut input = Vec::new();
    std::io::stdin()
        .read_to_end(&mut input)
        .map_err(|e| ShimError::io("read the runtime options from stdin", e))?;
    let options =
        if input.is_empty() {
            None
        } else {
            Some(Any::parse_from_bytes(&input).map_err(|e| {
                ShimError::InvalidArgument(format!("runtime options on stdin: {e}"))
            })?)
        };
    let info = runtime_info(runtime_id, options.as_ref())?;
    let bytes = info
        .write_to_bytes()
        .map_err(|e| ShimError::Other(format!("encode runtime info: {e}")))?;
    let mut stdout = std::io::stdout();
    stdout
        .write_all(&bytes)
        .and_then(|()| stdout.flush())
        .map_err(|e| ShimError::io("write the runtime info to stdout", e))
}
