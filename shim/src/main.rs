//! containerd shim v2 (runtime type io.containerd.baton.v1) that wraps runc and adds Baton's GPU
//! features. `start`, `delete` and `-info` go through the containerd-shim crate; the server (no
//! action) is ours so that it answers both Task API versions. Runs on a single-threaded tokio
//! runtime to keep an idle shim small.

mod agent;
mod binary_logger;
mod checkpoint;
mod console;
mod container;
mod control;
mod cuda_helper;
mod driver_library;
mod errors;
mod events;
#[cfg(test)]
mod fake_runc;
mod info;
mod io;
mod logging;
mod oom;
mod options;
mod preempt;
mod process;
mod reaper;
mod roles;
mod runtime;
mod server;
mod service;
mod shim;
mod start_compat;
mod stats;

/// The runtime type containerd knows this shim by.
pub const RUNTIME_ID: &str = "io.containerd.baton.v1";
/// The shim's version (`-v` and `-info`).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

fn main() {
    let args: Vec<_> = std::env::args_os().collect();
    if args
        .get(1)
        .is_some_and(|a| a == baton_agent_api::driver_helper::HELPER_ARG)
    {
        std::process::exit(cuda_helper::serve(&args[2..]));
    }
    let flags = match containerd_shim::parse(&args[1..]) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("{RUNTIME_ID}: {e}");
            std::process::exit(2);
        }
    };
    if flags.version {
        println!("containerd-shim-baton-v1:\n  Version: {VERSION}");
        return;
    }
    if flags.info {
        // Answered here rather than by the crate, whose errors print as Rust debug output.
        logging::init_stderr(flags.debug);
        if let Err(e) = info::answer(RUNTIME_ID) {
            eprintln!("{RUNTIME_ID}: -info: {e}");
            std::process::exit(1);
        }
        return;
    }
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("{RUNTIME_ID}: cannot start the tokio runtime: {e}");
            std::process::exit(1);
        }
    };
    if flags.action.is_empty() {
        logging::init_server(flags.debug);
        if let Err(e) = runtime.block_on(server::serve(flags)) {
            tracing::error!("shim server failed: {e:#}");
            eprintln!("{RUNTIME_ID}: {e:#}");
            std::process::exit(1);
        }
    } else {
        logging::init_stderr(flags.debug);
        let config = containerd_shim::Config {
            no_setup_logger: true,
            ..Default::default()
        };
        let run = containerd_shim::asynchronous::run::<shim::BatonShim>(RUNTIME_ID, Some(config));
        if flags.action == "start" {
            if let Err(e) = start_compat::run_start(|| runtime.block_on(run)) {
                eprintln!("{RUNTIME_ID}: start: {e}");
                std::process::exit(1);
            }
        } else {
            runtime.block_on(run);
        }
    }
}
