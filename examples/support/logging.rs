//! The examples' default subscriber for kiln's `tracing` events: stderr,
//! colours only on a terminal, filtered by `RUST_LOG` and the `KILN_LOG_*`
//! variables (`kiln::logging::filter_directives`). Included by path.
use std::io::IsTerminal;

/// Installs the subscriber (once, at the start of `main`).
pub fn init() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(kiln::logging::filter_directives()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
}
