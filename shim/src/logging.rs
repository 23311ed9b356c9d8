//! Logging through `tracing`: the shim server writes to containerd's shim log (the `log` fifo in
//! the bundle, which containerd reads into its own log); `start`/`delete` write to stderr, which
//! containerd also logs. `-debug` lowers the level to DEBUG. Records of the `log` crate (used by
//! the containerd-shim and runc crates) are forwarded too.

use std::{fs::OpenOptions, sync::Mutex};

use tracing::Level;

fn level(debug: bool) -> Level {
    if debug { Level::DEBUG } else { Level::INFO }
}

/// Logs to the `log` fifo in the working directory (the bundle), or stderr if it is missing.
pub fn init_server(debug: bool) {
    let builder = tracing_subscriber::fmt()
        .with_max_level(level(debug))
        .with_ansi(false)
        .with_target(false);
    let result = match OpenOptions::new().write(true).open("log") {
        Ok(fifo) => builder.with_writer(Mutex::new(fifo)).try_init(),
        Err(_) => builder.with_writer(std::io::stderr).try_init(),
    };
    if let Err(e) = result {
        eprintln!("logging setup failed: {e}");
    }
}

/// Logs to stderr (for the `start` and `delete` actions).
pub fn init_stderr(debug: bool) {
    let result = tracing_subscriber::fmt()
        .with_max_level(if debug { Level::DEBUG } else { Level::WARN })
        .with_ansi(false)
        .with_writer(std::io::stderr)
        .try_init();
    if let Err(e) = result {
        eprintln!("logging setup failed: {e}");
    }
}
