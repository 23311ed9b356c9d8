//! The `start` action's reply, made readable by every containerd.
//!
//! containerd-shim 0.12 answers a legacy (non-bootstrap) start with JSON
//! `{"address":..,"protocol":"ttrpc","version":3}`, which containerd 1.6 cannot parse (it dials the
//! whole JSON text as an address). A plain address is understood by 1.6, 1.7 and 2.x (which then
//! use Task API v2, which the server also serves), so a legacy JSON reply is reduced to its
//! address. The 2.3 bootstrap reply (protobuf) passes through unchanged.

use std::io::{Read, Write};

/// What to print for the crate's reply `raw`.
pub fn translate_reply(raw: &[u8]) -> Vec<u8> {
    if raw.first() == Some(&b'{')
        && let Ok(v) = serde_json::from_slice::<serde_json::Value>(raw)
        && let Some(address) = v["address"].as_str()
    {
        return address.as_bytes().to_vec();
    }
    raw.to_vec()
}

/// Runs `start` with stdout captured, then prints the translated reply.
pub fn run_start(start: impl FnOnce()) -> std::io::Result<()> {
    // Both close on exec: the shim server spawned by `start` must not inherit containerd's
    // stdout pipe, or containerd never sees EOF on it.
    let saved = std::os::fd::AsFd::as_fd(&std::io::stdout()).try_clone_to_owned()?;
    let (reader, writer) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    nix::unistd::dup2_stdout(&writer)?;
    drop(writer);
    let collector = std::thread::spawn(move || {
        let mut raw = Vec::new();
        let _ = std::fs::File::from(reader).read_to_end(&mut raw);
        raw
    });
    start();
    nix::unistd::dup2_stdout(&saved)?;
    let raw = collector
        .join()
        .map_err(|_| std::io::Error::other("start reply reader panicked"))?;
    let mut out = std::io::stdout();
    out.write_all(&translate_reply(&raw))?;
    out.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn legacy_json_becomes_a_plain_address() {
        let raw = br#"{"address":"unix:///run/containerd/s/abc","protocol":"ttrpc","version":3}"#;
        assert_eq!(translate_reply(raw), b"unix:///run/containerd/s/abc");
        let proto = [0x08u8, 0x03, 0x12, 0x01, b'x'];
        assert_eq!(translate_reply(&proto), proto);
    }
}
