//! Capture (`kiln::compile`, torch.compile's role): `Compiled`, the front
//! every device shares (guards, replays, retraces, host values, counters),
//! the `Tracer` a backend provides, and the default one, which records a
//! `Program` (Note \[Recording\]) for any backend.
mod compiled;
mod host_values;
pub(crate) mod record;
mod recorded;

pub use compiled::{compile, Compiled, Traced, TracedFn, Tracer};
pub use host_values::{describe_creation, HostLog, HostValues};
pub use recorded::{trace_program, ProgramTrace, RecordingTracer};

use crate::trace::WatchRead;

/// Counters of a compiled function (see `Compiled::stats`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CaptureStats {
    /// Calls so far.
    pub calls: u64,
    /// Calls that traced the function (and compiled or found its program).
    pub traces: u64,
    /// Calls that replayed a cached trace without running the function.
    pub replays: u64,
    /// Traces caused by a guard that failed (inputs of new shapes, dtypes or layouts).
    pub retraces: u64,
    /// Why the last retrace happened.
    pub last_retrace: Option<String>,
    /// Traces that read host values of the function's own code (under
    /// `HostValues::Retrace`, such a trace is never replayed).
    pub host_value_traces: u64,
    /// The first such host value of the last such trace.
    pub last_host_value: Option<String>,
}

/// The first watch that holds another value than when the trace read it, as a reason.
pub fn changed_watch(watches: &[WatchRead]) -> Option<String> {
    watches.iter().find(|w| w.current() != w.value).map(|w| {
        format!("the watched value {} changed (from {:#x} to {:#x}) since the trace", w.name, w.value, w.current())
    })
}
