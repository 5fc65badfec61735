//! The eager execution modes of the PJRT backend, chosen per thread (API) or
//! per process (`KILN_TPU_MODE`), and Debug mode's NaN/Inf trap.
use std::cell::Cell;
use std::sync::OnceLock;

/// How ops on PJRT tensors run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// Each op dispatches one cached executable asynchronously; the host waits
    /// only when it reads data (or calls `synchronize`). Failures of
    /// asynchronous work, index checks included, surface at that point.
    Strict,
    /// Each op waits for completion; index ops are bounds-checked before the
    /// call returns, and the NaN/Inf trap (if on) checks every float output.
    Debug,
    /// DeferAndFuse: ops are recorded into a pending program per device, which runs as
    /// one compiled program at the next sync point (reading data, `sync()`, an
    /// op with a device-side check, or `KILN_TPU_DEFER_MAX_OPS` ops).
    Defer,
}

impl Mode {
    /// `strict`, `debug` or `defer`: what [`Mode::parse`] reads.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Strict => "strict",
            Mode::Debug => "debug",
            Mode::Defer => "defer",
        }
    }

    /// Parses `strict`, `debug` or `defer` (case-insensitive).
    pub fn parse(s: &str) -> Option<Mode> {
        match s.to_ascii_lowercase().as_str() {
            "strict" => Some(Mode::Strict),
            "debug" => Some(Mode::Debug),
            "defer" => Some(Mode::Defer),
            _ => None,
        }
    }
}

fn env_mode() -> Mode {
    static M: OnceLock<Mode> = OnceLock::new();
    *M.get_or_init(|| match std::env::var("KILN_TPU_MODE") {
        Ok(s) => Mode::parse(&s).unwrap_or_else(|| {
            let msg = format!("KILN_TPU_MODE={s:?} is not a mode (strict, debug, defer); using strict");
            // A misconfiguration is said even where no subscriber listens.
            if tracing::dispatcher::get_default(|d| d.is::<tracing::subscriber::NoSubscriber>()) {
                eprintln!("kiln: {msg}");
            } else {
                tracing::warn!(target: "kiln::pjrt", "{msg}");
            }
            Mode::Strict
        }),
        Err(_) => Mode::Strict,
    })
}

thread_local! {
    static MODE: Cell<Option<Mode>> = const { Cell::new(None) };
    static NAN_TRAP: Cell<Option<bool>> = const { Cell::new(None) };
}

/// The mode of the current thread: the last [`set_mode`] on it, else `KILN_TPU_MODE`, else Strict.
pub fn mode() -> Mode {
    MODE.with(|m| m.get()).unwrap_or_else(env_mode)
}

/// Sets the mode of the current thread.
pub fn set_mode(m: Mode) {
    MODE.with(|c| c.set(Some(m)));
}

/// Whether Debug mode traps NaN/Inf outputs on this thread: the last
/// [`set_nan_trap`], else `KILN_TPU_NAN_TRAP=1`.
pub fn nan_trap() -> bool {
    NAN_TRAP.with(|c| c.get()).unwrap_or_else(|| std::env::var("KILN_TPU_NAN_TRAP").is_ok_and(|v| v == "1"))
}

/// Turns Debug mode's NaN/Inf trap on or off for the current thread.
pub fn set_nan_trap(on: bool) {
    NAN_TRAP.with(|c| c.set(Some(on)));
}

/// Runs `f` with the current thread in mode `m`, restoring the previous setting after.
pub fn with_mode<R>(m: Mode, f: impl FnOnce() -> R) -> R {
    let prev = MODE.with(|c| c.replace(Some(m)));
    struct Restore(Option<Mode>);
    impl Drop for Restore {
        fn drop(&mut self) {
            MODE.with(|c| c.set(self.0));
        }
    }
    let _r = Restore(prev);
    f()
}
