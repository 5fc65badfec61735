//! Capture (`kiln::compile`, torch.compile's role): `Compiled`, the front
//! every device shares (guards, replays, retraces, host values, counters),
//! the `Tracer` a backend provides, and the default one, which records a
//! `Program` (Note \[Recording\]) for any backend.
mod compiled;
mod host_values;
pub(crate) mod record;
mod recorded;
pub(crate) mod tape;

pub use compiled::{compile, Compiled, Traced, TracedFn, Tracer};
pub use host_values::{describe_creation, HostLog, HostValues};
pub use record::{inspect_recording, is_recording, note_host_values, recording_policy, RecordingView};
pub use recorded::{record_region, trace_program, ProgramTrace, RecordedRegion, RecordingTracer};

use crate::trace::WatchRead;

// Note [Capture]
// ~~~~~~~~~~~~~~
// `Compiled::call` traces the function the first time it sees a set of input
// shapes, dtypes and layouts (its guard): every op on the traced device is
// recorded by the device's tracer (`Backend::tracer`: the recorder of Note
// [Recording] on the CPU and on one PJRT device, the PJRT backend's capture
// graph on a mesh). What the
// program reads is classified by where it came from: an input of the call, a
// storage that exists across calls (parameters, optimizer state: "state"), or
// a creation op's value (a constant). What it writes is classified by the
// storage that holds it at the end: a storage that outlives the call (a
// parameter updated in place, a `.grad`, optimizer state) is state, updated on
// every replay; a result only the returned tensors hold becomes a fresh
// tensor per call. State read and written is updated in place (donated on
// PJRT, so XLA writes parameters and optimizer state where they are).
//
// A trace is replayed only once it is stable: two consecutive traces with the
// same program text, the same wiring and the same constants. The first call of
// a training step usually creates optimizer state (its program makes zeros);
// the second reads that state; the third traces like the second and is
// cached. Each trace and replay runs the same program: a trace records the
// function without running its ops, then runs the program for the call.
//
// A replay does not run the function, so what the program took from the host
// is frozen into it. Note [Host values] (kiln-tensor's `trace.rs`) gives the
// rule: every creation value and upload entering the program is a declared
// constant (`kiln::constant`, and kiln's own layers, losses, optimizers and
// autograd), a watched value, or a host value of the function's own code,
// which the function's `HostValues` policy handles (by default: trace every
// call, never replay). A replay first checks the watches its trace read (a
// module's training mode and dropout probability, an optimizer's settings, a
// `kiln::HostScalar`) and traces again, with the reason logged and counted,
// when one holds another value. Random numbers are no host values: a
// generator's state is a device tensor the program reads and writes (Note
// [Generators]), so every replay draws fresh numbers. `verify(true)` traces
// every call and fails when a stable trace would have been replayed with
// another program, to check a function against the rule.
//
// Reading tensor data inside the traced function is an error (on PJRT the
// value does not exist yet; anywhere, a replay could not repeat what the
// host did with it); on PJRT so is using a tensor the function computed
// after the call without returning it or storing it in state that outlives
// the call. A compiled function called while another is traced runs inline,
// its ops part of the outer trace. A trace that fails puts back what it wrote
// into storages that existed before it.

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
