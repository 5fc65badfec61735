//! kiln's [`tracing`](https://docs.rs/tracing) events, and the filter that
//! keeps the `KILN_LOG_*` environment variables working under a subscriber.
//!
//! kiln emits events and installs no subscriber: an application sees them
//! through the one it installs (a service's JSON logs, `tracing-subscriber`'s
//! `fmt` on stderr, a test's collector). The targets:
//!
//! | target | level | events |
//! |---|---|---|
//! | `kiln::compile` | trace | an executable found in the in-memory cache |
//! | `kiln::compile` | debug | a program compiled (bytes, partitions, ms); an executable loaded from the on-disk cache (path, read and deserialize ms); an entry evicted by `KILN_CACHE_MAX_MB`; a `kiln::compile` function traced (ms) |
//! | `kiln::compile` | warn | a corrupt or unloadable cache entry (compiled again), a cache entry that could not be written |
//! | `kiln::retrace` | info | a captured function traced again, with the reason; a trace that reads host values and so is never replayed |
//! | `kiln::retrace` | debug | a trace that differs from the previous one for the same inputs |
//! | `kiln::pjrt` | info | the PJRT plugin loaded and its client created (path, API version, platform, devices, ms) |
//! | `kiln::pjrt` | warn | a `KILN_TPU_MODE` that is not a mode (to stderr when no subscriber is installed) |
//! | `kiln::load` | info | a model loaded by `from_pretrained` (directory, parameters, ms) |
//! | `kiln::train` | info | a training checkpoint saved (directory, step, ms) or opened; in the `train_llama` example, each step (loss, lr, grad norm, tokens/s) and each evaluation |
//!
//! The examples install `tracing-subscriber`'s `fmt` subscriber on stderr
//! with [`filter_directives`]:
//!
//! ```no_run
//! tracing_subscriber::fmt()
//!     .with_env_filter(tracing_subscriber::EnvFilter::new(kiln::logging::filter_directives()))
//!     .with_writer(std::io::stderr)
//!     .init();
//! ```

/// Compile and compile-cache events.
pub const COMPILE: &str = "kiln::compile";
/// Retraces of `kiln::compile` functions, with their reasons.
pub const RETRACE: &str = "kiln::retrace";
/// PJRT plugin loading and backend configuration.
pub const PJRT: &str = "kiln::pjrt";
/// Model loading.
pub const LOAD: &str = "kiln::load";
/// Training progress (checkpoints in the library; steps in the examples).
pub const TRAIN: &str = "kiln::train";

/// `EnvFilter` directives for a default subscriber: `RUST_LOG` when set
/// (else `warn`), with `kiln::compile` and `kiln::retrace` at `debug` when
/// `KILN_LOG_COMPILES=1` and `kiln::retrace` at `debug` when
/// `KILN_LOG_RETRACES=1`, as those variables printed before kiln spoke
/// through `tracing`.
pub fn filter_directives() -> String {
    let on = |k: &str| std::env::var(k).is_ok_and(|v| v == "1");
    directives(std::env::var("RUST_LOG").ok().as_deref(), on("KILN_LOG_COMPILES"), on("KILN_LOG_RETRACES"))
}

fn directives(rust_log: Option<&str>, compiles: bool, retraces: bool) -> String {
    let mut d: Vec<String> = match rust_log.map(str::trim).filter(|s| !s.is_empty()) {
        Some(s) => vec![s.to_string()],
        None => vec!["warn".to_string()],
    };
    if compiles {
        d.push(format!("{COMPILE}=debug"));
    }
    if compiles || retraces {
        d.push(format!("{RETRACE}=debug"));
    }
    d.join(",")
}

#[cfg(test)]
mod tests {
    use super::directives;

    #[test]
    fn the_environment_variables_map_to_directives() {
        assert_eq!(directives(None, false, false), "warn");
        assert_eq!(directives(Some(" "), false, false), "warn");
        assert_eq!(directives(None, true, false), "warn,kiln::compile=debug,kiln::retrace=debug");
        assert_eq!(directives(None, false, true), "warn,kiln::retrace=debug");
        assert_eq!(
            directives(Some("info,kiln::train=debug"), false, true),
            "info,kiln::train=debug,kiln::retrace=debug"
        );
    }
}
