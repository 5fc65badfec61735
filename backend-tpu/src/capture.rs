//! Capture on PJRT devices (`kiln::compile`'s tracer there, torch.compile's
//! role): a function on PJRT tensors, typically a whole training step,
//! traced into one XLA program that later calls replay (see Note \[Capture\]
//! in kiln-tensor's `capture/mod.rs`).
use crate::backend::PjrtBackend;
use crate::graph::mesh::Shards;
use crate::graph::{self, data_in, data_of, escaped_value_error, Graph, ParamSrc, PjrtBuffer};
use crate::lower::Check;
use crate::lower::Sharding;
use crate::pjrt::{Buffer, Executable};
use crate::stablehlo::Module;
use kiln_tensor::capture::{HostValues, Traced, TracedFn, Tracer};
use kiln_tensor::trace::WatchRead;
use kiln_tensor::{DType, Device, Error, Layout, Result, Storage, StorageData, Tensor};
use std::sync::{Arc, Weak};

pub mod export;

// The PJRT tracer (Note [Capture] in kiln-tensor's `capture/mod.rs` gives
// the rules every tracer follows): every op on the capture device goes into
// the thread's capture graph, whatever the mode (Note [Capture graphs] in
// `graph.rs`), which `build`
// classifies and compiles into one XLA program; state read and written is
// donated, so XLA updates parameters and optimizer state in place. A trace
// that fails puts back the buffers of the storages it wrote.

#[derive(Debug, Clone, PartialEq)]
enum SourceKind {
    Input(usize),
    State,
    Constant,
}

enum Source {
    Input(usize),
    State(Weak<Storage>),
    Constant(Arc<Shards>),
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
    /// The sharding each source had when traced.
    source_shardings: Vec<Sharding>,
    /// The mesh, and each sink's sharding and logical shape.
    mesh: MeshOutputs,
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
    module: Module,
    sources: Vec<SourceKind>,
    constants: Vec<Vec<u8>>,
    state_sinks: Vec<u8>,
}

/// Capture on a PJRT device mesh ([`Backend::tracer`](kiln_tensor::Backend::tracer)):
/// traces into a capture graph, replays its compiled SPMD program.
pub(crate) struct PjrtTracer {
    pub(crate) device: Device,
}

impl Tracer for PjrtTracer {
    fn trace(
        &mut self,
        f: &mut TracedFn<'_>,
        inputs: &[Tensor],
        policy: HostValues,
    ) -> Result<(Box<dyn Traced>, Vec<Tensor>)> {
        let backend = crate::backend()?;
        let (trace, sig, traced_args) = run_trace(backend, self.device, policy, f, inputs)?;
        // This call's own run: the buffers the trace read (state now holds the trace's results).
        let outs = replay(backend, &trace, inputs, self.device, Some(traced_args))?;
        Ok((Box::new(PjrtTrace { trace, sig, device: self.device }), outs))
    }

    fn guard_extra(&self, t: &Tensor) -> Option<String> {
        let (s, shape) = data_of(t).ok().and_then(|d| crate::graph::mesh::storage_sharding(&d))?;
        Some(format!("{} of {shape:?}", s.attr()))
    }
}

/// A trace on a PJRT device: its compiled program and wiring.
struct PjrtTrace {
    trace: Trace,
    sig: Signature,
    device: Device,
}

impl Traced for PjrtTrace {
    fn replay(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        replay(crate::backend()?, &self.trace, inputs, self.device, None)
    }
    fn watches(&self) -> &[WatchRead] {
        &self.trace.watches
    }
    fn host_values(&self) -> &[String] {
        &self.trace.host
    }
    fn difference(&self, prev: &dyn Traced) -> Option<String> {
        match prev.as_any().downcast_ref::<PjrtTrace>() {
            Some(p) if p.sig == self.sig => None,
            Some(p) => Some(difference(&p.sig, &self.sig)),
            None => Some("the previous trace was made by another tracer".into()),
        }
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Runs `f` on the capture graph of `dev` and builds its trace.
fn run_trace(
    backend: &PjrtBackend,
    dev: Device,
    policy: HostValues,
    f: &mut TracedFn<'_>,
    inputs: &[Tensor],
) -> Result<(Trace, Signature, Vec<Arc<Shards>>)> {
    if !matches!(dev, Device::Mesh(_)) {
        return Err(Error::device(
            "compile",
            format!("the PJRT capture graph traces functions on meshes, not on {dev}"),
        ));
    }
    backend.flush(dev)?;
    for t in inputs {
        backend.shards(t)?;
    }
    struct Clear;
    impl Drop for Clear {
        fn drop(&mut self) {
            graph::end_capture();
            kiln_tensor::trace::end_watching();
        }
    }
    graph::begin_capture(Graph::new_capture(dev, policy));
    kiln_tensor::trace::begin_watching();
    let clear = Clear;
    let result = f(inputs);
    let watches = kiln_tensor::trace::end_watching();
    let mut g =
        graph::end_capture().ok_or_else(|| Error::invalid("compile", "the capture graph was taken while tracing"))?;
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
) -> Result<(Trace, Signature, Vec<Arc<Shards>>)> {
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
                        host.orphan(Arc::as_ptr(buf) as usize)?;
                        Source::Constant(buf.clone())
                    }
                }
            }
        });
    }
    let kinds = sources.iter().map(Source::kind).collect();
    let args_bufs: Vec<Arc<Shards>> = params.into_iter().map(|(buf, _, _)| buf).collect();
    // Live outputs and where they go.
    let mut out_vals = vec![];
    let mut sinks = vec![];
    let mut out_slot_index = vec![]; // graph output index of each program output
    let mut out_shardings = vec![]; // a mesh graph's: each program output's sharding and shape
    for (idx, (_, wslot)) in outs.iter().enumerate() {
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
        // A mesh graph returns the padded n-d value, with the slot's sharding.
        let (Some((v, s)), Some((_, shape))) = (&out_nd[idx], &slot.sharding) else {
            return Err(Error::backend("pjrt", "an output of a mesh's capture graph has no sharding"));
        };
        out_vals.push(v.clone());
        out_shardings.push((s.clone(), shape.clone()));
        out_slot_index.push(idx);
    }
    let mut returns = vec![];
    for (i, t) in returned.iter().enumerate() {
        match data_of(t) {
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
        let fits = |j: usize| out_shardings.get(j).is_some_and(|(s, _)| args_bufs[pi].sharding == *s);
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
    let mesh = kiln_tensor::DeviceMesh::of_device(g_device)?;
    let mut shardings: Vec<Sharding> = out_shardings.iter().map(|(s, _)| s.clone()).collect();
    shardings.extend(checks.iter().map(|_| Sharding::replicated(&mesh, 0)));
    let text = b.finish_sharded(&program_outs, &shardings)?;
    let exe = backend.mesh_executable(&text, &mesh)?;
    let mut meta: Vec<(DType, Vec<usize>)> =
        out_shardings.iter().zip(&program_outs).map(|((s, shape), v)| (v.dtype(), s.shard_shape(shape))).collect();
    meta.extend(checks.iter().map(|_| (DType::Bool, vec![])));
    let mesh = MeshOutputs { mesh, outs: out_shardings };
    let n = sinks.len();
    let source_shardings = args_bufs.iter().map(|a| a.sharding.clone()).collect();
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
    Ok((trace, Signature { module: text, sources: kinds, constants, state_sinks }, args_bufs))
}

/// Runs a trace's program on the current inputs and state (or, for the call
/// that traced it, on the buffers the trace read).
fn replay(
    backend: &PjrtBackend,
    t: &Trace,
    inputs: &[Tensor],
    device: Device,
    traced: Option<Vec<Arc<Shards>>>,
) -> Result<Vec<Tensor>> {
    let mut args: Vec<Arc<Shards>> = Vec::with_capacity(t.sources.len());
    // Sources whose buffer is also reachable through a slot someone else holds.
    let mut shared = vec![false; t.sources.len()];
    // A storage's buffer, noting in `shared` whether a slot held elsewhere reaches it too.
    let storage_buffer = |st: &Arc<kiln_tensor::Storage>, shared: &mut bool, k: usize| -> Result<Arc<Shards>> {
        let data = data_in(&st.read(), device)?;
        *shared = !graph::only_the_storage_reaches(&data);
        let s = backend.shards_from(data, device)?;
        if t.source_shardings.get(k) != Some(&s.sharding) {
            return Err(Error::invalid(
                "compile",
                format!(
                    "state read by the compiled function now has another placement ({}) than when it was traced; compile the function again",
                    s.sharding.attr()
                ),
            ));
        }
        Ok(s)
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
        t.donated.iter().filter(|&&i| shared[i] || Arc::strong_count(&args[i]) > 2).map(|&i| i as i64).collect();
    // Each output's data: its shards.
    let MeshOutputs { mesh, outs: shardings } = &t.mesh;
    let mut bufs = backend.launch_mesh(&t.exe, "a compiled function", mesh, &args, &t.out_meta, &non_donatable)?;
    backend.count_all_to_all(t.all_to_all_bytes);
    // Check flags are replicated: the first device's copy is read.
    let flags: Vec<Arc<Buffer>> = bufs.split_off(t.sinks.len()).into_iter().map(|mut f| f.swap_remove(0)).collect();
    // A storage written in place keeps the mesh it was placed on.
    let view_of = |st: &Arc<Storage>| match data_in(&st.read(), device) {
        Ok(PjrtBuffer::Sharded(s)) => s.view.clone(),
        _ => mesh.clone(),
    };
    let datas: Vec<PjrtBuffer> = bufs
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
    drop(args);
    let mut fresh: Vec<Option<Arc<Storage>>> = vec![None; t.sinks.len()];
    for (i, (sink, data)) in t.sinks.iter().zip(datas).enumerate() {
        let len = t.mesh.outs[i].1.iter().product();
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
