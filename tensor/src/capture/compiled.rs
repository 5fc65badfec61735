//! `Compiled`, what `kiln::compile` returns on every device: guards, the
//! trace-until-stable rule, replays, retraces and their reasons, host-value
//! warnings and the counters (Note \[Capture\]). How a trace is recorded and
//! replayed is the device's [`Tracer`].
use super::{changed_watch, CaptureStats, HostValues};
use crate::ir::Program;
use crate::trace::WatchRead;
use crate::{DType, Device, Error, Result, Tensor};
use std::panic::Location;

/// A device's way of tracing a function and replaying the trace:
/// [`Backend::tracer`](crate::Backend::tracer).
pub trait Tracer: Send {
    /// Runs `f` on `inputs` (the call's own run) while recording it; returns
    /// the trace and the call's results.
    fn trace(
        &mut self,
        f: &mut TracedFn<'_>,
        inputs: &[Tensor],
        policy: HostValues,
    ) -> Result<(Box<dyn Traced>, Vec<Tensor>)>;
    /// What an input's guard keeps besides its shape, dtype and layout (a
    /// tensor's placement on a mesh), and how to say it.
    fn guard_extra(&self, _t: &Tensor) -> Option<String> {
        None
    }
}

/// The function being traced.
pub type TracedFn<'a> = dyn FnMut(&[Tensor]) -> Result<Vec<Tensor>> + 'a;

/// One trace of a function, ready to be replayed.
pub trait Traced: Send {
    /// Runs the trace's program on `inputs` and the state it reads now.
    fn replay(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>>;
    /// The watched values the function read while traced, and what they held.
    fn watches(&self) -> &[WatchRead];
    /// The undeclared host values of the function's own code that entered the program.
    fn host_values(&self) -> &[String];
    /// Why this trace would not replay as `prev` (another program, other
    /// wiring or other constants), or `None` when it is the same.
    fn difference(&self, prev: &dyn Traced) -> Option<String>;
    /// The trace's program, when it has one in kiln's representation.
    fn program(&self) -> Option<&Program> {
        None
    }
    /// What a replay on `inputs` would pass the program: one tensor per
    /// parameter (an input's storage, state as it is now, a constant), when
    /// the trace has a program.
    fn program_args(&self, _inputs: &[Tensor]) -> Option<Result<Vec<Tensor>>> {
        None
    }
    /// For [`Traced::difference`]'s downcast.
    fn as_any(&self) -> &dyn std::any::Any;
}

/// One input's guard: what the traced program assumes about it.
#[derive(Debug, Clone, PartialEq)]
struct Guard {
    shape: Vec<usize>,
    dtype: DType,
    strides: Vec<usize>,
    offset: usize,
    storage_len: usize,
    device: Device,
    /// The tracer's own part (a placement on a mesh).
    extra: Option<String>,
}

impl Guard {
    fn of(t: &Tensor, tracer: &dyn Tracer) -> Guard {
        Guard {
            shape: t.shape().to_vec(),
            dtype: t.dtype(),
            strides: t.layout().strides().to_vec(),
            offset: t.layout().offset(),
            storage_len: t.storage().len(),
            device: t.device(),
            extra: tracer.guard_extra(t),
        }
    }
    fn describe(&self) -> String {
        match &self.extra {
            Some(x) => format!("{:?} {} on {} as {x}", self.shape, self.dtype, self.device),
            None => format!("{:?} {} on {}", self.shape, self.dtype, self.device),
        }
    }
}

enum EntryState {
    /// Traced, not yet twice the same way: the last trace.
    Warming(Box<dyn Traced>),
    /// Replayed on every call.
    Ready(Box<dyn Traced>),
}

impl EntryState {
    fn trace(&self) -> &dyn Traced {
        match self {
            EntryState::Warming(t) | EntryState::Ready(t) => &**t,
        }
    }
}

struct Entry {
    guard: Vec<Guard>,
    state: EntryState,
}

/// A function compiled by [`compile`]: call it like the function.
pub struct Compiled<F> {
    f: F,
    device: Device,
    tracer: Option<Box<dyn Tracer>>,
    entries: Vec<Entry>,
    stats: CaptureStats,
    error_on_retrace: bool,
    host_values: HostValues,
    verify: bool,
    /// Where `compile` was called, for the messages.
    site: &'static Location<'static>,
    /// Whether the "keeps tracing because of host values" warning was given.
    warned: bool,
    /// The entry of the last trace (for [`Compiled::program`]).
    last: Option<usize>,
}

/// Captures `f`, a function of tensors on `device` returning tensors, as
/// torch.compile does: traced the first time it sees its inputs' shapes,
/// dtypes and layouts, replayed once two traces agree (Note \[Capture\] in
/// `capture/mod.rs`). On a backend with a compiler (PJRT) the trace becomes
/// one compiled program; elsewhere (the CPU) a [`Program`] that the backend's
/// `compile` runs (Note \[Programs\]).
///
/// Random numbers drawn inside are fresh on every call, replays included:
/// the generator's state is state the program reads and advances. Host
/// values of the function's own code (here the dropout probability and the
/// step size) are frozen into a replayed program, so they are declared
/// constants with `kiln_tensor::constant`; without it the function would be
/// traced on every call (see [`HostValues`] and Note \[Host values\]).
///
/// ```
/// use kiln::prelude::*;
/// use kiln::constant;
/// let w = Tensor::ones(&[4], DType::F32)?;
/// let mut step = kiln::compile(Device::Cpu, |xs: &[Tensor]| {
///     let h = constant(|| xs[0].dropout(0.1, true))?; // a new mask every call
///     w.sub_(&constant(|| h.mul(0.1))?)?; // state updated in place
///     Ok(vec![w.sum()?])
/// });
/// for _ in 0..5 {
///     let x = Tensor::ones(&[4], DType::F32)?;
///     let total = step.call(&[x])?;
///     println!("{}", total[0].item::<f32>()?);
/// }
/// assert_eq!(step.stats().host_value_traces, 0);
/// assert_eq!(step.stats().replays, 3);
/// println!("{}", step.program()?);
/// # Ok::<(), kiln::Error>(())
/// ```
#[track_caller]
pub fn compile<F>(device: Device, f: F) -> Compiled<F>
where
    F: FnMut(&[Tensor]) -> Result<Vec<Tensor>>,
{
    Compiled {
        f,
        device,
        tracer: None,
        entries: vec![],
        stats: CaptureStats::default(),
        error_on_retrace: false,
        host_values: HostValues::default(),
        verify: std::env::var("KILN_COMPILE_VERIFY").is_ok_and(|v| v == "1"),
        site: Location::caller(),
        warned: false,
        last: None,
    }
}

/// [`Backend::capture`](crate::Backend::capture): library code's way to [`compile`].
impl super::super::Captured for Compiled<crate::CaptureFn> {
    fn call(&mut self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        Compiled::call(self, inputs)
    }
    fn counts(&self) -> (u64, u64) {
        (self.stats.traces, self.stats.replays)
    }
}

impl<F> Compiled<F>
where
    F: FnMut(&[Tensor]) -> Result<Vec<Tensor>>,
{
    /// Makes a retrace (a guard failing after a trace was cached) an error instead of a log line.
    pub fn error_on_retrace(mut self, on: bool) -> Self {
        self.error_on_retrace = on;
        self
    }

    /// What to do with host values of the function's own code (see
    /// [`HostValues`] and Note \[Host values\]); `HostValues::Retrace` by default.
    pub fn host_values(mut self, policy: HostValues) -> Self {
        self.host_values = policy;
        self
    }

    /// Traces every call, also once a trace is stable, and fails (after
    /// running the call) when the program differs from the stable trace's:
    /// a check that the function depends on nothing a replay cannot see.
    /// Also on with `KILN_COMPILE_VERIFY=1`.
    pub fn verify(mut self, on: bool) -> Self {
        self.verify = on;
        self
    }

    /// The counters: calls, traces, replays, retraces and the last retrace's reason.
    pub fn stats(&self) -> &CaptureStats {
        &self.stats
    }

    /// The device the function runs on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The program of the last trace, printable with `{}` (Note \[Program
    /// text\]); an error before the first call, or where the device's tracer
    /// keeps no program in kiln's representation.
    pub fn program(&self) -> Result<Program> {
        self.last_trace()?.program().cloned().ok_or_else(|| self.no_program())
    }

    /// The arguments a replay of the last trace on `inputs` would pass its
    /// program (one per parameter: an input's storage, state as it is now, a
    /// constant), whole and flat: with [`Compiled::program`], the program
    /// can be run elsewhere (`Backend::compile` of another device).
    pub fn program_args(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        self.last_trace()?.program_args(inputs).ok_or_else(|| self.no_program())?
    }

    fn last_trace(&self) -> Result<&dyn Traced> {
        match self.last {
            Some(i) => Ok(self.entries[i].state.trace()),
            None => Err(Error::invalid("compile", "the function has not been traced yet; call it first")),
        }
    }

    fn no_program(&self) -> Error {
        Error::invalid(
            "compile",
            format!("the tracer of {} keeps no program in kiln's representation yet", self.device),
        )
    }

    /// Runs `run` on the function, the device and the host-value policy,
    /// counted as a call that traces (export's way in).
    pub fn with_function<R>(
        &mut self,
        run: impl FnOnce(&mut TracedFn<'_>, Device, HostValues) -> Result<R>,
    ) -> Result<R> {
        self.stats.calls += 1;
        self.stats.traces += 1;
        run(&mut self.f, self.device, self.host_values)
    }

    fn tracer(&mut self) -> Result<&mut dyn Tracer> {
        if self.tracer.is_none() {
            self.tracer = Some(self.device.backend()?.tracer(self.device)?);
        }
        match self.tracer.as_mut() {
            Some(t) => Ok(&mut **t),
            None => Err(no_tracer()),
        }
    }

    /// Runs the function: replays its program when a stable trace matches the
    /// inputs, else traces it (see Note \[Capture\]). Called inside another
    /// traced function, it runs inline, as part of that trace.
    pub fn call(&mut self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        for (i, t) in inputs.iter().enumerate() {
            if t.device() != self.device {
                return Err(Error::device(
                    "compile",
                    format!("input {i} is on {}, the compiled function runs on {}", t.device(), self.device),
                ));
            }
        }
        self.stats.calls += 1;
        // Called while another function is traced: its ops belong to that
        // trace, so the function runs inline (a replay here would be left
        // out of the outer program, as JAX inlines a nested jit).
        if crate::trace::is_tracing() {
            return (self.f)(inputs);
        }
        let tracer = self.tracer()?;
        let guard: Vec<Guard> = inputs.iter().map(|t| Guard::of(t, &*tracer)).collect();
        let pos = self.entries.iter().position(|e| e.guard == guard);
        let mut verifying = false;
        if let Some(p) = pos {
            if let EntryState::Ready(trace) = &self.entries[p].state {
                match changed_watch(trace.watches()) {
                    None if !self.verify => {
                        self.stats.replays += 1;
                        return trace.replay(inputs);
                    }
                    None => verifying = true,
                    Some(reason) => self.retrace(reason)?,
                }
            }
        } else if let Some(prev) = self.entries.iter().rev().find(|e| matches!(e.state, EntryState::Ready(..))) {
            let reason = retrace_reason(&prev.guard, &guard);
            self.retrace(reason)?;
        }
        self.stats.traces += 1;
        let t = std::time::Instant::now();
        let policy = self.host_values;
        let Some(tracer) = self.tracer.as_mut() else { return Err(no_tracer()) };
        let (trace, outs) = tracer.trace(&mut self.f, inputs, policy)?;
        tracing::debug!(
            target: "kiln::compile",
            trace = self.stats.traces,
            inputs = inputs.len(),
            ms = t.elapsed().as_secs_f64() * 1e3,
            "traced the captured function"
        );
        self.note_host_values(&*trace);
        let replayable = trace.host_values().is_empty();
        match pos {
            Some(p) => {
                let difference = trace.difference(self.entries[p].state.trace());
                if verifying {
                    if let Some(d) = difference {
                        self.entries[p].state = EntryState::Warming(trace);
                        self.last = Some(p);
                        return Err(Error::invalid(
                            "compile",
                            format!(
                                "verify: call {} traced another program than the stable trace ({d}); without verify it would have replayed the stable trace, returning stale values",
                                self.stats.calls
                            ),
                        ));
                    }
                }
                if let (Some(d), true) = (&difference, replayable) {
                    tracing::debug!(
                        target: "kiln::retrace",
                        trace = self.stats.traces,
                        difference = %d,
                        "the trace differs from the previous one; tracing again next call"
                    );
                }
                self.entries[p].state = if difference.is_none() && replayable {
                    EntryState::Ready(trace)
                } else {
                    EntryState::Warming(trace)
                };
                self.last = Some(p);
            }
            None => {
                self.entries.push(Entry { guard, state: EntryState::Warming(trace) });
                self.last = Some(self.entries.len() - 1);
            }
        }
        Ok(outs)
    }

    /// Counts and reports a trace that read host values of the function's own code.
    fn note_host_values(&mut self, trace: &dyn Traced) {
        let Some(first) = trace.host_values().first() else { return };
        self.stats.host_value_traces += 1;
        self.stats.last_host_value = Some(first.clone());
        tracing::info!(
            target: "kiln::retrace",
            trace = self.stats.traces,
            host_value = %first,
            more = trace.host_values().len() - 1,
            "the trace reads host values of the function's own code, so it is not replayed \
             (HostValues::Retrace); declare constants with kiln::constant, or pass changing values as inputs \
             or kiln::HostScalar"
        );
        if self.stats.host_value_traces >= 2 && !self.warned {
            self.warned = true;
            tracing::warn!(
                target: "kiln::retrace",
                compiled_at = %self.site,
                host_value = %first,
                traces = self.stats.host_value_traces,
                "the function compiled at {} is traced on every call and never replayed, as slow as eager code, \
                 because it reads a host value of its own ({first}); declare it with kiln::constant(|| ..) if it \
                 never changes, read it through a kiln::HostScalar, or pass it as an input tensor",
                self.site
            );
        }
    }

    /// Counts and logs a retrace (or refuses it).
    fn retrace(&mut self, reason: String) -> Result<()> {
        self.stats.retraces += 1;
        self.stats.last_retrace = Some(reason.clone());
        tracing::info!(target: "kiln::retrace", reason = %reason, retraces = self.stats.retraces, "retracing");
        if self.error_on_retrace {
            return Err(Error::invalid("compile", format!("retrace refused (error_on_retrace is set): {reason}")));
        }
        Ok(())
    }
}

fn no_tracer() -> Error {
    Error::invalid("compile", "the device's tracer is missing")
}

fn retrace_reason(prev: &[Guard], now: &[Guard]) -> String {
    if prev.len() != now.len() {
        return format!("the number of inputs changed from {} to {}", prev.len(), now.len());
    }
    for (i, (a, b)) in prev.iter().zip(now).enumerate() {
        if a != b {
            if a.shape != b.shape || a.dtype != b.dtype || a.device != b.device || a.extra != b.extra {
                return format!("input {i} changed from {} to {}", a.describe(), b.describe());
            }
            return format!(
                "input {i} changed layout from strides {:?} offset {} to strides {:?} offset {}",
                a.strides, a.offset, b.strides, b.offset
            );
        }
    }
    "no cached trace matches".into()
}
