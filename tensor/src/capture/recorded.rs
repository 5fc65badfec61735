//! The default [`Tracer`]: the recorder (Note \[Recording\]) makes a
//! [`Program`], the backend's `compile` readies it (the interpreter unless the
//! backend has a compiler), and replays bind its parameters to the call's
//! inputs and the state they read now.
use super::compiled::{Traced, TracedFn, Tracer};
use super::record::{self, whole, Recording};
use super::tape::Tape;
use super::HostValues;
use crate::ir::{Executable, ParamKind, Program, ResultKind};
use crate::trace::WatchRead;
use crate::{Device, Error, HostBuffer, Layout, Op, Result, Storage, Tensor};
use std::sync::{Arc, Weak};

/// The recorder's tracer for `device` ([`Backend::tracer`](crate::Backend::tracer)'s default).
pub struct RecordingTracer {
    device: Device,
}

impl RecordingTracer {
    pub fn new(device: Device) -> RecordingTracer {
        RecordingTracer { device }
    }
}

/// Where a parameter's value comes from on a replay.
enum Binding {
    Input(usize),
    State(Weak<Storage>),
    Constant(Arc<Storage>),
}

/// How the function's returned tensor `i` is made on a replay.
enum Return {
    /// Result `usize`'s storage, viewed through the layout.
    Output(usize, Layout),
    /// A tensor the function returned unchanged (an input or state).
    Same(Tensor),
}

/// A recorded trace: its program, executable and wiring.
struct RecordedTrace {
    device: Device,
    program: Program,
    exe: Arc<dyn Executable>,
    bindings: Vec<Binding>,
    /// Each result's storage (state it writes; dangling for fresh results).
    sinks: Vec<Weak<Storage>>,
    returns: Vec<Return>,
    /// The bytes of each constant parameter, for the stability check.
    constants: Vec<Vec<u8>>,
    watches: Vec<WatchRead>,
    host: Vec<String>,
}

impl Tracer for RecordingTracer {
    fn trace(
        &mut self,
        f: &mut TracedFn<'_>,
        inputs: &[Tensor],
        policy: HostValues,
    ) -> Result<(Box<dyn Traced>, Vec<Tensor>)> {
        let (trace, returned, _) = record_call(self.device, f, inputs, policy, false)?;
        Ok((Box::new(trace), returned))
    }

    /// A distributed input's mesh and placements: a trace is recorded for them.
    fn guard_extra(&self, t: &Tensor) -> Option<String> {
        if !t.is_distributed() {
            return None;
        }
        let (mesh, placements) = t.backend().placements(t).ok()?;
        Some(format!("{placements:?} on {mesh}"))
    }
}

/// Runs `f` on `inputs` while recording on `device`; the trace, the call's
/// results and (with `snapshot`) each parameter's value when first read.
fn record_call(
    device: Device,
    f: &mut TracedFn<'_>,
    inputs: &[Tensor],
    policy: HostValues,
    snapshot: bool,
) -> Result<(RecordedTrace, Vec<Tensor>, Vec<HostBuffer>)> {
    // Ends the recording and the watching on every path out, a panic included.
    struct Clear(bool);
    impl Drop for Clear {
        fn drop(&mut self) {
            if self.0 {
                record::end();
                crate::trace::end_watching();
            }
        }
    }
    record::begin(device, super::HostLog::new(policy), snapshot);
    crate::trace::begin_watching();
    let mut clear = Clear(true);
    let result = f(inputs);
    clear.0 = false;
    let watches = crate::trace::end_watching();
    let mut rec = record::end().ok_or_else(|| Error::invalid("compile", "the recording was taken while tracing"))?;
    let snapshots = rec.snapshots.take().unwrap_or_default();
    let trace = build(rec, inputs, &result?, watches)?;
    // The call's results and effects are the program's (Note [Recording]).
    let outs = trace.replay(inputs)?;
    Ok((trace, outs, snapshots))
}

/// A function traced into a [`Program`] for export (`kiln::export` from a
/// device whose tracer records programs, such as the CPU).
pub struct ProgramTrace {
    pub program: Program,
    /// Each parameter's value when the function first read it.
    pub values: Vec<HostBuffer>,
    /// Returned tensor `i`: a result of the program viewed through a layout,
    /// or `None` for a tensor the function returned unchanged (an input or state).
    pub returns: Vec<Option<(usize, Layout)>>,
    /// The undeclared host values of the function's own code that entered the program.
    pub host_values: Vec<String>,
}

/// Traces `f` on `inputs` (the call runs, with its effects) into a program,
/// keeping what each parameter held when first read.
pub fn trace_program(
    f: &mut TracedFn<'_>,
    device: Device,
    policy: HostValues,
    inputs: &[Tensor],
) -> Result<(ProgramTrace, Vec<Tensor>)> {
    let (t, outs, values) = record_call(device, f, inputs, policy, true)?;
    let returns = t
        .returns
        .iter()
        .map(|r| match r {
            Return::Output(i, l) => Some((*i, l.clone())),
            Return::Same(_) => None,
        })
        .collect();
    Ok((ProgramTrace { program: t.program, values, returns, host_values: t.host }, outs))
}

/// A function's ops on one device recorded into a program without running
/// them: a local region's body (Note \[Local regions\]), traced once on
/// stand-ins for one device's blocks.
pub struct RecordedRegion {
    /// The program: a parameter is `input i` (the whole storage of input
    /// `i`) or `state` (a tensor made outside the function); the results are
    /// the returned tensors' values, fresh, in order.
    pub program: Program,
    /// The storage each parameter reads.
    pub sources: Vec<Arc<Storage>>,
    /// The undeclared host values of the function's own code that entered the program.
    pub host_values: Vec<String>,
}

/// Records `f`'s ops on `inputs` (on `device`, Note \[Recording\]) into a
/// program whose results are the tensors `f` returns; nothing runs. `f`
/// must not write into a tensor it did not make.
pub fn record_region(
    device: Device,
    policy: HostValues,
    inputs: &[Tensor],
    f: &mut TracedFn<'_>,
) -> Result<RecordedRegion> {
    struct Clear(bool);
    impl Drop for Clear {
        fn drop(&mut self) {
            if self.0 {
                record::end();
            }
        }
    }
    record::begin(device, super::HostLog::new(policy), false);
    let mut clear = Clear(true);
    let returned = f(inputs);
    clear.0 = false;
    let mut rec = record::end().ok_or_else(|| Error::invalid("local_map", "the recording was taken while tracing"))?;
    let returned = returned?;
    let written = |st: &Arc<Storage>| rec.tape.known.get(&st.addr()).is_some_and(|k| k.written);
    if rec.tape.sources.iter().any(written) {
        return Err(Error::invalid(
            "local_map",
            "the function wrote in place into a tensor made outside it (an input): return the new value instead",
        ));
    }
    for (i, t) in returned.iter().enumerate() {
        if t.device() != device {
            return Err(Error::invalid(
                "local_map",
                format!("output {i} of the function is on {}, not on {device}", t.device()),
            ));
        }
        let v = rec.read(t)?;
        rec.tape.program.add_result(v, ResultKind::Fresh)?;
    }
    let Recording { tape: Tape { mut program, sources, .. }, host, .. } = rec;
    for (k, st) in sources.iter().enumerate() {
        if let Some(i) = inputs.iter().position(|t| Arc::ptr_eq(t.storage(), st)) {
            program.set_param_kind(k, ParamKind::Input(i))?;
        }
    }
    Ok(RecordedRegion { program: program.cse().dce(), sources, host_values: host.undeclared })
}

/// Classifies what a recording read and wrote (Note \[Recording\]) and readies its program.
fn build(rec: Recording, inputs: &[Tensor], returned: &[Tensor], watches: Vec<WatchRead>) -> Result<RecordedTrace> {
    let Recording { device, tape: Tape { mut program, sources, known }, mut host, .. } = rec;
    let mut bindings = Vec::with_capacity(sources.len());
    let mut constants = vec![];
    for (k, st) in sources.iter().enumerate() {
        let input = inputs.iter().position(|t| Arc::ptr_eq(t.storage(), st));
        let (kind, binding) = match input {
            Some(i) => (ParamKind::Input(i), Binding::Input(i)),
            // Held by someone besides this list: state that outlives the call.
            None if Arc::strong_count(st) > 1 => {
                let v = program.params()[k].value;
                // A draw reads a copy of the generator's state, taken under its
                // lock (Note [Generators]).
                let copies: Vec<_> = program
                    .insts()
                    .iter()
                    .filter(|i| matches!(i.op, Op::Copy) && i.args[0] == v)
                    .map(|i| i.first)
                    .collect();
                let drawn = program
                    .insts()
                    .iter()
                    .any(|i| matches!(i.op, Op::RandomBits { .. }) && (i.args[0] == v || copies.contains(&i.args[0])));
                let kind = if drawn { ParamKind::Generator } else { ParamKind::State };
                (kind, Binding::State(Arc::downgrade(st)))
            }
            // Uploaded inside the function, or a tensor dropped inside it.
            None => {
                host.orphan(st.addr())?;
                let t = whole(st)?;
                constants.push(t.backend().to_host(&t)?.to_le_bytes());
                (ParamKind::Constant, Binding::Constant(st.clone()))
            }
        };
        program.set_param_kind(k, kind)?;
        bindings.push(binding);
    }
    // The storages made or written that are still alive, in the order their values were made.
    let mut written: Vec<_> = known.values().filter(|k| k.written).collect();
    written.sort_by_key(|k| k.value);
    let mut sinks = vec![];
    for k in written {
        let Some(st) = k.storage.upgrade() else { continue };
        let param = sources.iter().position(|s| Arc::ptr_eq(s, &st));
        // Holders besides this upgrade and the parameter list.
        let holders = Arc::strong_count(&st) - 1 - usize::from(param.is_some());
        // A returned view holds the storage twice: itself and its base.
        let returned_refs: usize = returned
            .iter()
            .map(|t| [Some(t), t.base()].into_iter().flatten().filter(|x| Arc::ptr_eq(x.storage(), &st)).count())
            .sum();
        let kind = match param {
            Some(p) if program.params()[p].kind == ParamKind::Constant => continue,
            Some(p) => ResultKind::Update(p),
            None if holders > returned_refs => ResultKind::State,
            None if returned_refs > 0 => ResultKind::Fresh,
            None => continue,
        };
        program.add_result(k.value, kind)?;
        sinks.push(Arc::downgrade(&st));
    }
    let mut returns = vec![];
    for (i, t) in returned.iter().enumerate() {
        if t.device() != device {
            return Err(Error::invalid(
                "compile",
                format!("output {i} of the traced function is on {}, not on {device}", t.device()),
            ));
        }
        returns.push(match sinks.iter().position(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(t.storage()))) {
            Some(r) => Return::Output(r, t.layout().clone()),
            None => {
                // Data uploaded inside the function and returned as it is: a host value unless declared.
                if host.uploads.iter().any(|u| u.0 == t.storage().addr()) {
                    host.orphan(t.storage().addr())?;
                }
                Return::Same(t.clone())
            }
        });
    }
    let program = program.cse().dce();
    let exe = device.backend()?.compile(&program, device)?;
    Ok(RecordedTrace { device, program, exe, bindings, sinks, returns, constants, watches, host: host.undeclared })
}

/// `t`'s storage when `t` is the whole of a storage nothing else holds, else a copy in a new one.
fn own_storage(t: Tensor, device: Device) -> Result<Arc<Storage>> {
    if t.is_whole_storage() && Arc::strong_count(t.storage()) == 1 {
        return Ok(t.storage().clone());
    }
    Ok(t.backend().exec(&Op::Copy, &[&t], &[t.meta()], device)?.swap_remove(0))
}

impl RecordedTrace {
    /// The program's arguments for a call on `inputs`.
    fn args(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        let gone = || {
            Error::invalid(
                "compile",
                "the compiled function reads a tensor that no longer exists (state it read when traced was dropped); compile the function again",
            )
        };
        self.bindings
            .iter()
            .map(|b| match b {
                Binding::Input(i) => {
                    let t = inputs.get(*i).ok_or_else(|| {
                        Error::invalid("compile", format!("the program reads input {i}, which the call lacks"))
                    })?;
                    whole(t.storage())
                }
                Binding::State(w) => whole(&w.upgrade().ok_or_else(gone)?),
                Binding::Constant(st) => whole(st),
            })
            .collect()
    }
}

impl Traced for RecordedTrace {
    fn replay(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        let args = self.args(inputs)?;
        let outs = self.exe.run(&args)?;
        drop(args);
        let mut storages: Vec<Option<Arc<Storage>>> = Vec::with_capacity(outs.len());
        for ((r, out), sink) in self.program.results().iter().zip(outs).zip(&self.sinks) {
            storages.push(match &r.kind {
                ResultKind::Update(_) => Some(out.storage().clone()),
                ResultKind::State => match sink.upgrade() {
                    Some(st) => {
                        st.replace(own_storage(out, self.device)?.take_data());
                        st.bump_version();
                        Some(st)
                    }
                    None => None,
                },
                ResultKind::Fresh => Some(own_storage(out, self.device)?),
                ResultKind::Check(msg) => {
                    if !out.to_vec::<bool>()?[0] {
                        return Err(Error::invalid("compile", msg.clone()));
                    }
                    None
                }
            });
        }
        self.returns
            .iter()
            .map(|r| match r {
                Return::Same(t) => Ok(t.clone()),
                Return::Output(i, layout) => {
                    let st = storages[*i].clone().ok_or_else(|| {
                        Error::invalid("compile", "a tensor the function returned was dropped before the call ended")
                    })?;
                    Tensor::from_storage(st, layout.clone())
                }
            })
            .collect()
    }

    fn watches(&self) -> &[WatchRead] {
        &self.watches
    }

    fn host_values(&self) -> &[String] {
        &self.host
    }

    fn difference(&self, prev: &dyn Traced) -> Option<String> {
        let Some(prev) = prev.as_any().downcast_ref::<RecordedTrace>() else {
            return Some("the previous trace was made by another tracer".into());
        };
        if self.constants != prev.constants {
            let i = self.constants.iter().zip(&prev.constants).position(|(x, y)| x != y).unwrap_or(0);
            return Some(format!(
                "a constant computed on the host changed (constant {i}); keep changing values on the device"
            ));
        }
        if !self.program.same_as(&prev.program) {
            let (a, b) = (prev.program.to_string(), self.program.to_string());
            let line = a.lines().zip(b.lines()).find(|(x, y)| x != y);
            let creation = |l: &str| l.contains(" = full(") || l.contains(" = arange(");
            return Some(match line {
                Some((x, y)) if creation(x) && creation(y) => format!(
                    "a constant computed on the host changed (`{}` became `{}`); keep changing values on the device",
                    x.trim(),
                    y.trim()
                ),
                Some((x, y)) => format!("its program differs: `{}` became `{}`", x.trim(), y.trim()),
                None => "its program differs (e.g. state created on the first call)".into(),
            });
        }
        None
    }

    fn program(&self) -> Option<&Program> {
        Some(&self.program)
    }

    fn program_args(&self, inputs: &[Tensor]) -> Option<Result<Vec<Tensor>>> {
        Some(self.args(inputs))
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
