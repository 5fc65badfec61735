//! Capture (`kiln_tpu::compile`, torch.compile's role): a function on PJRT
//! tensors, typically a whole training step, traced into one program that
//! later calls replay (see Note [Capture]).
use crate::backend::PjrtBackend;
use crate::dist::Shards;
use crate::graph::{self, data_in, escaped_value_error, out_meta, Arg, Graph, ParamSrc, PjrtBuffer};
use crate::lower::Check;
use crate::lower::Sharding;
use crate::pjrt::{Buffer, Executable};
use kiln_tensor::capture::{changed_watch, CaptureStats, HostValues};
use kiln_tensor::trace::WatchRead;
use kiln_tensor::{DType, Device, Error, Layout, Result, Storage, StorageData, Tensor};
use std::sync::{Arc, Weak};

pub mod export;

// Note [Capture]
// ~~~~~~~~~~~~~~
// `Compiled::call` traces the function the first time it sees a set of input
// shapes, dtypes and layouts (its guard): every op on the capture device goes
// into one graph, whatever the mode (DeferAndFuse's machinery, with the
// thread's capture graph instead of the device's pending one). What the
// program reads is classified by where it came from: an input of the call, a
// storage that exists across calls (parameters, optimizer state: "state"), or
// a creation op's value (a constant). What it writes is classified by the
// storage that holds it at the end: a storage that outlives the call (a
// parameter updated in place, a `.grad`, optimizer state) is state, updated on
// every replay; a result only the returned tensors hold becomes a fresh
// tensor per call. State read and written is donated, so XLA updates
// parameters and optimizer state in place.
//
// A trace is replayed only once it is stable: two consecutive traces with the
// same program text, the same wiring and the same constants. The first call of
// a training step usually creates optimizer state (its program makes zeros);
// the second reads that state; the third traces like the second and is
// cached. Each trace and replay runs the same compiled program.
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
// Reading tensor data inside the traced function is an error (the value does
// not exist yet); so is using a tensor the function computed after the call
// without returning it or storing it in state that outlives the call.

/// One input's guard: what the traced program assumes about it.
#[derive(Debug, Clone, PartialEq)]
struct Guard {
    shape: Vec<usize>,
    dtype: DType,
    strides: Vec<usize>,
    offset: usize,
    storage_len: usize,
    device: Device,
    /// On a mesh: the storage's sharding and n-d shape (other placements are another program).
    sharding: Option<(Sharding, Vec<usize>)>,
}

impl Guard {
    fn of(t: &Tensor) -> Guard {
        Guard {
            shape: t.shape().to_vec(),
            dtype: t.dtype(),
            strides: t.layout().strides().to_vec(),
            offset: t.layout().offset(),
            storage_len: t.storage().len(),
            device: t.device(),
            sharding: data_in(&t.storage().read(), t.device()).ok().and_then(|d| crate::dist::storage_sharding(&d)),
        }
    }
    fn describe(&self) -> String {
        match &self.sharding {
            Some((s, _)) => format!("{:?} {} on {} as {}", self.shape, self.dtype, self.device, s.attr()),
            None => format!("{:?} {} on {}", self.shape, self.dtype, self.device),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
enum SourceKind {
    Input(usize),
    State,
    Constant,
}

enum Source {
    Input(usize),
    State(Weak<Storage>),
    Constant(Arg),
}

impl Source {
    fn kind(&self) -> SourceKind {
        match self {
            Source::Input(i) => SourceKind::Input(*i),
            Source::State(_) => SourceKind::State,
            Source::Constant(_) => SourceKind::Constant,
        }
    }
}

enum Sink {
    /// Written into the storage of input `usize` of each call (the function writes its argument in place).
    Input(usize),
    /// Written into this storage on every replay.
    State(Weak<Storage>),
    /// Returned in a fresh storage.
    Fresh,
}

enum Return {
    /// Output `usize` of the program, viewed through the layout.
    Output(usize, Layout),
    /// A tensor the function returned unchanged (an input or state).
    Same(Tensor),
}

/// A traced, compiled function.
struct Trace {
    exe: Arc<Executable>,
    /// On a mesh: the sharding each source had when traced.
    source_shardings: Vec<Option<Sharding>>,
    /// A trace over a device mesh: the mesh, and each sink's sharding and logical shape.
    mesh: Option<MeshOutputs>,
    sources: Vec<Source>,
    donated: Vec<usize>,
    sinks: Vec<Sink>,
    out_meta: Vec<(DType, Vec<usize>)>,
    returns: Vec<Return>,
    checks: Vec<(Check, &'static str)>,
    /// The watched values the function read, and what they held.
    watches: Vec<WatchRead>,
    /// The undeclared host values of the function's own code that entered the program.
    host: Vec<String>,
    /// The bytes its local regions' `all_to_all`s send between devices per run.
    all_to_all_bytes: u64,
}

/// The mesh of a trace over one, and each output's sharding and logical shape.
struct MeshOutputs {
    mesh: kiln_tensor::DeviceMesh,
    outs: Vec<(Sharding, Vec<usize>)>,
}

/// What must match between consecutive traces for the trace to be replayed.
#[derive(PartialEq)]
struct Signature {
    text: String,
    sources: Vec<SourceKind>,
    constants: Vec<Vec<u8>>,
    state_sinks: Vec<u8>,
}

enum EntryState {
    Warming(Signature),
    Ready(Box<Trace>, Signature),
}

struct Entry {
    guard: Vec<Guard>,
    state: EntryState,
}

/// A function compiled by [`compile`]: call it like the function.
pub struct Compiled<F> {
    f: F,
    device: Device,
    entries: Vec<Entry>,
    stats: CaptureStats,
    error_on_retrace: bool,
    host_values: HostValues,
    verify: bool,
}

/// Captures `f`, a function of PJRT tensors on `device` returning tensors, as
/// torch.compile does: traced into one program the first time it sees its
/// inputs' shapes, replayed afterwards (see Note \[Capture\] in `capture.rs`).
///
/// Random numbers drawn inside are fresh on every call, replays included:
/// the generator's state is a device tensor the program reads and advances.
/// Host values of the function's own code (here the dropout probability and
/// the step size) are frozen into a replayed program, so they are declared
/// constants with `kiln_tensor::constant`; without it the function would be
/// traced on every call (see [`HostValues`] and Note [Host values]).
///
/// ```no_run
/// use kiln_tensor::{constant, Device, DType, Tensor};
/// kiln_tpu::register()?;
/// let dev = Device::Tpu(0);
/// kiln_tensor::manual_seed(0);
/// let w = Tensor::ones(&[4], (DType::F32, dev))?;
/// let mut step = kiln_tpu::compile(dev, |xs: &[Tensor]| {
///     let h = constant(|| xs[0].dropout(0.1, true))?; // a new mask every call
///     w.sub_(&constant(|| h.mul(0.1))?)?; // state updated in place
///     Ok(vec![w.sum()?])
/// });
/// for _ in 0..5 {
///     let x = Tensor::ones(&[4], (DType::F32, dev))?;
///     let total = step.call(&[x])?;
///     println!("{}", total[0].item::<f32>()?);
/// }
/// assert_eq!(step.stats().host_value_traces, 0);
/// # Ok::<(), kiln_tensor::Error>(())
/// ```
pub fn compile<F>(device: Device, f: F) -> Compiled<F>
where
    F: FnMut(&[Tensor]) -> Result<Vec<Tensor>>,
{
    Compiled {
        f,
        device,
        entries: vec![],
        stats: CaptureStats::default(),
        error_on_retrace: false,
        host_values: HostValues::default(),
        verify: std::env::var("KILN_COMPILE_VERIFY").is_ok_and(|v| v == "1"),
    }
}

/// [`Backend::capture`](kiln_tensor::Backend::capture) on PJRT: library code's way to [`compile`].
impl kiln_tensor::Captured for Compiled<kiln_tensor::CaptureFn> {
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
    /// [`HostValues`] and Note [Host values]); `HostValues::Retrace` by default.
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

    /// Runs the function: replays its program when a stable trace matches the
    /// inputs, else traces it (see Note \[Capture\]).
    pub fn call(&mut self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        let backend = crate::backend()?;
        for (i, t) in inputs.iter().enumerate() {
            if t.device() != self.device {
                return Err(Error::device(
                    "compile",
                    format!("input {i} is on {}, the compiled function runs on {}", t.device(), self.device),
                ));
            }
        }
        self.stats.calls += 1;
        let guard: Vec<Guard> = inputs.iter().map(Guard::of).collect();
        let pos = self.entries.iter().position(|e| e.guard == guard);
        let mut verifying = false;
        if let Some(p) = pos {
            if let EntryState::Ready(trace, _) = &self.entries[p].state {
                match changed_watch(&trace.watches) {
                    None if !self.verify => {
                        self.stats.replays += 1;
                        return replay(backend, trace, inputs, self.device, None);
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
        let (trace, sig, traced_args) = self.trace(backend, inputs)?;
        tracing::debug!(
            target: "kiln::compile",
            trace = self.stats.traces,
            inputs = inputs.len(),
            ms = t.elapsed().as_secs_f64() * 1e3,
            "traced the captured function"
        );
        if let Some(first) = trace.host.first() {
            self.stats.host_value_traces += 1;
            self.stats.last_host_value = Some(first.clone());
            tracing::info!(
                target: "kiln::retrace",
                trace = self.stats.traces,
                host_value = %first,
                more = trace.host.len() - 1,
                "the trace reads host values of the function's own code, so it is not replayed \
                 (HostValues::Retrace); declare constants with kiln::constant, or pass changing values as inputs \
                 or kiln::HostScalar"
            );
        }
        // This call's own run: the buffers the trace read (state now holds the trace's results).
        let outs = replay(backend, &trace, inputs, self.device, Some(traced_args))?;
        let replayable = trace.host.is_empty();
        match pos {
            Some(p) => {
                let prev = match &self.entries[p].state {
                    EntryState::Warming(prev) | EntryState::Ready(_, prev) => prev,
                };
                let stable = *prev == sig;
                if verifying && !stable {
                    let d = difference(prev, &sig);
                    self.entries[p].state = EntryState::Warming(sig);
                    return Err(Error::invalid(
                        "compile",
                        format!(
                            "verify: call {} traced another program than the stable trace ({d}); without verify it would have replayed the stable trace, returning stale values",
                            self.stats.calls
                        ),
                    ));
                }
                if !stable && replayable {
                    tracing::debug!(
                        target: "kiln::retrace",
                        trace = self.stats.traces,
                        difference = %difference(prev, &sig),
                        "the trace differs from the previous one; tracing again next call"
                    );
                }
                self.entries[p].state = if stable && replayable {
                    EntryState::Ready(Box::new(trace), sig)
                } else {
                    EntryState::Warming(sig)
                };
            }
            None => self.entries.push(Entry { guard, state: EntryState::Warming(sig) }),
        }
        Ok(outs)
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

    /// Runs the function on the capture graph and builds its trace.
    fn trace(&mut self, backend: &PjrtBackend, inputs: &[Tensor]) -> Result<(Trace, Signature, Vec<Arg>)> {
        let dev = self.device;
        backend.flush(dev)?;
        for t in inputs {
            match dev {
                Device::Mesh(_) => drop(backend.shards(t)?),
                _ => drop(backend.buffer_of(t)?),
            }
        }
        struct Clear;
        impl Drop for Clear {
            fn drop(&mut self) {
                graph::end_capture();
                kiln_tensor::trace::end_watching();
            }
        }
        graph::begin_capture(Graph::new_capture(dev, self.host_values));
        kiln_tensor::trace::begin_watching();
        let clear = Clear;
        let result = (self.f)(inputs);
        let watches = kiln_tensor::trace::end_watching();
        let mut g = graph::end_capture()
            .ok_or_else(|| Error::invalid("compile", "the capture graph was taken while tracing"))?;
        drop(clear);
        let saved = std::mem::take(&mut g.saved);
        let built = result.and_then(|returned| build(backend, g, inputs, &returned, watches));
        if built.is_err() {
            // The storages the failed trace wrote get their buffers back.
            for (w, data) in saved {
                if let Some(st) = w.upgrade() {
                    st.replace(StorageData::Device(Box::new(data)));
                }
            }
        }
        built
    }
}

fn retrace_reason(prev: &[Guard], now: &[Guard]) -> String {
    if prev.len() != now.len() {
        return format!("the number of inputs changed from {} to {}", prev.len(), now.len());
    }
    for (i, (a, b)) in prev.iter().zip(now).enumerate() {
        if a != b {
            if a.shape != b.shape || a.dtype != b.dtype || a.device != b.device || a.sharding != b.sharding {
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

fn difference(a: &Signature, b: &Signature) -> String {
    if a.constants != b.constants {
        let i = a.constants.iter().zip(&b.constants).position(|(x, y)| x != y).unwrap_or(0);
        return format!("a constant computed on the host changed (constant {i}); keep changing values on the device");
    }
    if a.sources != b.sources {
        return "it reads different tensors".into();
    }
    if a.state_sinks != b.state_sinks {
        return "it writes different state".into();
    }
    "its program differs (e.g. state created on the first call)".into()
}

/// Turns a capture graph into a trace: sources, sinks, returns, the program.
#[allow(clippy::type_complexity)]
fn build(
    backend: &PjrtBackend,
    g: Graph,
    inputs: &[Tensor],
    returned: &[Tensor],
    watches: Vec<WatchRead>,
) -> Result<(Trace, Signature, Vec<Arg>)> {
    let Graph {
        builder: mut b,
        params,
        outs,
        out_nd,
        sinks: sink_storages,
        checks,
        id,
        device: g_device,
        host,
        all_to_all_bytes,
        ..
    } = g;
    let mut host = host.expect("a capture graph records host values");
    let mut sources = vec![];
    let mut constants = vec![];
    for (buf, _, src) in &params {
        sources.push(match src {
            ParamSrc::Constant(bytes) => {
                constants.push(bytes.clone());
                Source::Constant(buf.clone())
            }
            ParamSrc::Storage(w) => {
                let input = inputs.iter().position(|t| Weak::ptr_eq(w, &Arc::downgrade(t.storage())));
                match (input, w.upgrade()) {
                    (Some(i), _) => Source::Input(i),
                    (None, Some(_)) => Source::State(w.clone()),
                    // Data uploaded inside the function (a tensor moved to the device there), or a
                    // tensor dropped inside it: a constant of the trace, and a host value unless declared.
                    (None, None) => {
                        host.orphan(buf.addr())?;
                        Source::Constant(buf.clone())
                    }
                }
            }
        });
    }
    let kinds = sources.iter().map(Source::kind).collect();
    let args_bufs: Vec<Arg> = params.into_iter().map(|(buf, _, _)| buf).collect();
    // Live outputs and where they go.
    let mut out_vals = vec![];
    let mut sinks = vec![];
    let mut out_slot_index = vec![]; // graph output index of each program output
    let mut out_shardings = vec![]; // a mesh graph's: each program output's sharding and shape
    for (idx, (val, wslot)) in outs.iter().enumerate() {
        let Some(slot) = wslot.upgrade() else { continue };
        let Some(st) = sink_storages[idx].upgrade() else { continue };
        let holds = matches!(
            data_in(&st.read(), g_device),
            Ok(PjrtBuffer::Deferred(s)) if Arc::ptr_eq(&s, &slot)
        );
        if !holds {
            continue;
        }
        // A returned view holds the storage twice: itself and its base.
        let returned_refs: usize = returned
            .iter()
            .map(|t| [Some(t), t.base()].into_iter().flatten().filter(|x| Arc::ptr_eq(x.storage(), &st)).count())
            .sum();
        // Our upgrade holds one reference; anything beyond the returned tensors is state.
        let state = Arc::strong_count(&st) - 1 > returned_refs;
        let input = inputs.iter().position(|t| Arc::ptr_eq(t.storage(), &st));
        sinks.push(match (input, state) {
            (Some(i), _) => Sink::Input(i),
            (None, true) => Sink::State(Arc::downgrade(&st)),
            (None, false) => Sink::Fresh,
        });
        match &out_nd[idx] {
            // A mesh graph returns the padded n-d value, with the slot's sharding.
            Some((v, s)) => {
                let shape = slot.sharding.as_ref().map(|(_, shape)| shape.clone()).unwrap_or_default();
                out_vals.push(v.clone());
                out_shardings.push((s.clone(), shape));
            }
            None => out_vals.push(val.clone()),
        }
        out_slot_index.push(idx);
    }
    let mut returns = vec![];
    for (i, t) in returned.iter().enumerate() {
        match data_in(&t.storage().read(), t.device()) {
            Ok(PjrtBuffer::Deferred(s)) if s.graph == id => {
                let pos = out_slot_index.iter().position(|&k| k == s.index).ok_or_else(escaped_value_error)?;
                returns.push(Return::Output(pos, t.layout().clone()));
            }
            Ok(PjrtBuffer::Ready(_) | PjrtBuffer::Sharded(_)) => returns.push(Return::Same(t.clone())),
            _ => {
                return Err(Error::invalid(
                    "compile",
                    format!("output {i} of the traced function is not a tensor on {} computed by it", g_device),
                ))
            }
        }
    }
    // State (and inputs) read and written in place are donated.
    let mut donated = vec![];
    for (pi, src) in sources.iter().enumerate() {
        let j = match src {
            Source::State(w) => sinks.iter().position(|s| matches!(s, Sink::State(o) if Weak::ptr_eq(o, w))),
            Source::Input(i) => sinks.iter().position(|s| matches!(s, Sink::Input(k) if k == i)),
            Source::Constant(_) => None,
        };
        // On a mesh, only shards of the same sharding (and not partial) can be updated in place.
        let fits = |j: usize| match (&args_bufs[pi], out_shardings.get(j)) {
            (Arg::Mesh(a), Some((s, _))) => a.sharding == *s,
            (Arg::One(_), None) => true,
            _ => false,
        };
        if let Some(j) = j.filter(|&j| fits(j)) {
            b.alias(pi, j);
            donated.push(pi);
        }
    }
    let state_sinks: Vec<u8> = sinks
        .iter()
        .map(|s| match s {
            Sink::Input(_) => 2,
            Sink::State(_) => 1,
            Sink::Fresh => 0,
        })
        .collect();
    let mut program_outs = out_vals;
    program_outs.extend(checks.iter().map(|c| c.0.clone()));
    let (text, exe, meta, mesh) = match g_device {
        Device::Mesh(_) => {
            let mesh = kiln_tensor::DeviceMesh::of_device(g_device)?;
            let mut shardings: Vec<Sharding> = out_shardings.iter().map(|(s, _)| s.clone()).collect();
            shardings.extend(checks.iter().map(|_| Sharding::replicated(&mesh, 0)));
            let text = b.finish_sharded(&program_outs, &shardings)?;
            let exe = backend.mesh_executable(&text, &mesh)?;
            let mut meta: Vec<(DType, Vec<usize>)> = out_shardings
                .iter()
                .zip(&program_outs)
                .map(|((s, shape), v)| (v.dtype(), s.shard_shape(shape)))
                .collect();
            meta.extend(checks.iter().map(|_| (DType::Bool, vec![])));
            (text, exe, meta, Some(MeshOutputs { mesh, outs: out_shardings }))
        }
        _ => {
            let text = b.finish(&program_outs);
            let exe = backend.executable(&text)?;
            let meta = out_meta(&program_outs);
            (text, exe, meta, None)
        }
    };
    let n = sinks.len();
    let source_shardings = args_bufs
        .iter()
        .map(|a| match a {
            Arg::Mesh(s) => Some(s.sharding.clone()),
            Arg::One(_) => None,
        })
        .collect();
    let trace = Trace {
        exe,
        source_shardings,
        mesh,
        sources,
        donated,
        sinks,
        out_meta: meta,
        returns,
        checks: checks.iter().map(|c| (c.1.clone(), c.2)).collect(),
        watches,
        host: host.undeclared,
        all_to_all_bytes,
    };
    debug_assert_eq!(trace.out_meta.len(), n + trace.checks.len());
    Ok((trace, Signature { text, sources: kinds, constants, state_sinks }, args_bufs))
}

/// Runs a trace's program on the current inputs and state (or, for the call
/// that traced it, on the buffers the trace read).
fn replay(
    backend: &PjrtBackend,
    t: &Trace,
    inputs: &[Tensor],
    device: Device,
    traced: Option<Vec<Arg>>,
) -> Result<Vec<Tensor>> {
    let mut args: Vec<Arg> = Vec::with_capacity(t.sources.len());
    // Sources whose buffer is also reachable through a slot someone else holds.
    let mut shared = vec![false; t.sources.len()];
    // A storage's buffer, noting in `shared` whether a slot held elsewhere reaches it too.
    let storage_buffer = |st: &Arc<kiln_tensor::Storage>, shared: &mut bool, k: usize| -> Result<Arg> {
        let data = data_in(&st.read(), device)?;
        *shared = !graph::only_the_storage_reaches(&data);
        match device {
            Device::Mesh(_) => {
                let s = backend.shards_from(data, device)?;
                if t.source_shardings.get(k).and_then(|x| x.as_ref()) != Some(&s.sharding) {
                    return Err(Error::invalid(
                        "compile",
                        format!(
                            "state read by the compiled function now has another placement ({}) than when it was traced; compile the function again",
                            s.sharding.attr()
                        ),
                    ));
                }
                Ok(Arg::Mesh(s))
            }
            _ => backend.ready_data(data).map(Arg::One),
        }
    };
    for (k, s) in t.sources.iter().take(if traced.is_some() { 0 } else { usize::MAX }).enumerate() {
        args.push(match s {
            Source::Input(i) => storage_buffer(inputs[*i].storage(), &mut shared[k], k)?,
            Source::State(w) => {
                let st = w.upgrade().ok_or_else(|| {
                    Error::invalid(
                        "compile",
                        "the compiled function reads a tensor that no longer exists (state it read when traced was dropped); compile the function again",
                    )
                })?;
                storage_buffer(&st, &mut shared[k], k)?
            }
            Source::Constant(b) => b.clone(),
        });
    }
    if let Some(traced) = traced {
        args = traced;
    }
    // A donated buffer someone else still holds (a storage and this list hold one
    // each), or can still take through a slot they hold, is kept.
    let non_donatable: Vec<i64> =
        t.donated.iter().filter(|&&i| shared[i] || args[i].holders() > 2).map(|&i| i as i64).collect();
    // Each output's data: a buffer, or shards on a mesh.
    let (datas, flags): (Vec<PjrtBuffer>, Vec<Arc<Buffer>>) = match &t.mesh {
        None => {
            let refs: Vec<&Buffer> = args
                .iter()
                .map(|a| match a {
                    Arg::One(b) => Ok(&**b),
                    Arg::Mesh(_) => Err(Error::backend("pjrt", "shards in a one-device program")),
                })
                .collect::<Result<_>>()?;
            let (mut bufs, event) = t.exe.execute_with(&refs, device.index(), &t.out_meta, &non_donatable)?;
            drop(refs);
            backend.count_execution();
            backend.queue_event("a compiled function", event)?;
            let flags = bufs.split_off(t.sinks.len()).into_iter().map(Arc::new).collect();
            (bufs.into_iter().map(|b| PjrtBuffer::Ready(Arc::new(b))).collect(), flags)
        }
        Some(MeshOutputs { mesh, outs: shardings }) => {
            let shards: Vec<Arc<Shards>> = args
                .iter()
                .map(|a| match a {
                    Arg::Mesh(s) => Ok(s.clone()),
                    Arg::One(_) => Err(Error::backend("pjrt", "a one-device buffer in a program over a mesh")),
                })
                .collect::<Result<_>>()?;
            let mut bufs =
                backend.launch_mesh(&t.exe, "a compiled function", mesh, &shards, &t.out_meta, &non_donatable)?;
            backend.count_all_to_all(t.all_to_all_bytes);
            // Check flags are replicated: the first device's copy is read.
            let flags = bufs.split_off(t.sinks.len()).into_iter().map(|mut f| f.swap_remove(0)).collect();
            // A storage written in place keeps the mesh it was placed on.
            let view_of = |st: &Arc<Storage>| match data_in(&st.read(), device) {
                Ok(PjrtBuffer::Sharded(s)) => s.view.clone(),
                _ => mesh.clone(),
            };
            let datas = bufs
                .into_iter()
                .zip(shardings)
                .zip(&t.sinks)
                .map(|((bufs, (sharding, shape)), sink)| {
                    let view = match sink {
                        Sink::Input(k) => view_of(inputs[*k].storage()),
                        Sink::State(w) => w.upgrade().map_or(mesh.clone(), |st| view_of(&st)),
                        Sink::Fresh => mesh.clone(),
                    };
                    let sh = Shards { bufs, sharding: sharding.clone(), shape: shape.clone(), view };
                    PjrtBuffer::Sharded(Arc::new(sh))
                })
                .collect();
            (datas, flags)
        }
    };
    drop(args);
    let mut fresh: Vec<Option<Arc<Storage>>> = vec![None; t.sinks.len()];
    for (i, (sink, data)) in t.sinks.iter().zip(datas).enumerate() {
        let len = match &t.mesh {
            Some(m) => m.outs[i].1.iter().product(),
            None => t.out_meta[i].1.iter().product(),
        };
        let data = StorageData::Device(Box::new(data));
        match sink {
            Sink::Input(k) => {
                let st = inputs[*k].storage();
                st.replace(data);
                st.bump_version();
            }
            Sink::State(w) => {
                if let Some(st) = w.upgrade() {
                    st.replace(data);
                    st.bump_version();
                }
            }
            Sink::Fresh => {
                fresh[i] = Some(Arc::new(Storage::new(data, t.out_meta[i].0, len, device)));
            }
        }
    }
    for (flag, (c, name)) in flags.iter().zip(&t.checks) {
        backend.verify(flag, name, c, &[])?;
    }
    let mut outs = vec![];
    for r in &t.returns {
        outs.push(match r {
            Return::Same(x) => x.clone(),
            Return::Output(i, layout) => match &fresh[*i] {
                Some(st) => Tensor::from_storage(st.clone(), layout.clone())?,
                None => match &t.sinks[*i] {
                    Sink::State(w) => {
                        let st = w.upgrade().ok_or_else(escaped_value_error)?;
                        Tensor::from_storage(st, layout.clone())?
                    }
                    Sink::Input(k) => Tensor::from_storage(inputs[*k].storage().clone(), layout.clone())?,
                    Sink::Fresh => return Err(escaped_value_error()),
                },
            },
        });
    }
    Ok(outs)
}
