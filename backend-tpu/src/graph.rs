//! The capture graph of a function on a mesh (`kiln::compile` there,
//! `capture.rs`), the one home of building it from ops: what a PJRT storage
//! holds (a ready buffer, shards, or a slot of the graph), and a `Graph`'s
//! verbs (read a tensor into it, append an op, an in-place write or a
//! redistribution). It knows neither the backend nor capture. DeferAndFuse,
//! on one device and on meshes, records kiln-tensor's pending programs
//! instead (Note \[Deferred programs\] in kiln-tensor's `defer.rs`).
pub mod mesh;

use crate::lower::{self, Builder, Check, Sharding, Val};
use crate::pjrt::Buffer;
use kiln_tensor::capture::{describe_creation, HostLog, HostValues};
use kiln_tensor::{DType, Device, DeviceMesh, Error, Meta, Op, Result, Storage, StorageData, Tensor};
use mesh::Shards;
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};

/// Where a graph parameter's buffer came from (what a captured program reads again on replay).
#[derive(Debug, Clone)]
pub enum ParamSrc {
    /// The buffer a storage held when the graph first read it.
    Storage(Weak<Storage>),
    /// The value of a creation op (`full`, `arange`), as bytes.
    Constant(Vec<u8>),
}

// Note [Capture graphs]
// ~~~~~~~~~~~~~~~~~~~~~
// While a function on a mesh is traced, every op, in-place write and
// redistribution on that mesh appends to the thread's capture graph, whatever
// the mode, and its outputs are storages holding a `Slot` of the graph: a
// value that exists only inside the traced program. An op reads its inputs'
// values in the graph (an earlier slot, or ready shards added as a parameter
// with their sharding), appends its lowering with its inputs constrained and
// its results placed (`lower/mesh.rs`), and returns storages holding new
// slots. An in-place write appends the write's lowering and points the
// storage at the new slot, so every view sees it. Capture (`capture.rs`)
// turns the graph into one SPMD program whose results are the slots still
// held; a slot that escapes the traced function is an error when read.

/// The default number of ops after which a pending program runs (`KILN_TPU_DEFER_MAX_OPS`).
pub const DEFAULT_MAX_OPS: usize = 4096;

static NEXT_GRAPH: AtomicU64 = AtomicU64::new(1);

/// A value of a capture graph, held by the storage of a traced tensor.
#[derive(Debug)]
pub struct Slot {
    pub graph: u64,
    pub device: Device,
    pub index: usize,
    /// The storage's sharding and n-d shape.
    pub sharding: Option<(Sharding, Vec<usize>)>,
    /// A redistribution's result placed on a sub-mesh: that mesh.
    pub view: OnceLock<kiln_tensor::DeviceMesh>,
}

/// The capture graph of a function on a mesh.
pub struct Graph {
    pub id: u64,
    pub device: Device,
    pub builder: Builder,
    /// Ready shards the graph reads, in argument order, with their flat
    /// values and sources.
    pub params: Vec<(Arc<Shards>, Val, ParamSrc)>,
    /// Outputs appended so far (flat values) and the slots waiting for them.
    pub outs: Vec<(Val, Weak<Slot>)>,
    /// The storage each output was made for (a new result, or the target of an in-place write).
    pub sinks: Vec<Weak<Storage>>,
    /// Device-side checks of the ops appended since the last run, with the
    /// op's name and its inputs (for the error message).
    pub checks: Vec<(Val, Check, &'static str, Vec<Tensor>)>,
    pub ops: usize,
    /// The argument of each creation-op value (dtype and bytes) the graph has,
    /// so that equal values share one argument (Note [Shared constants] in `lower/program.rs`).
    constants: HashMap<(DType, Vec<u8>), Val>,
    /// A capture graph's record of the host values entering it.
    pub host: Option<HostLog>,
    /// A capture graph's storages written while tracing, with what they held
    /// before: put back when the trace fails.
    pub saved: Vec<(Weak<Storage>, PjrtBuffer)>,
    /// The outputs' padded n-d values and shardings (parallel to `outs`).
    pub out_nd: Vec<Option<(Val, Sharding)>>,
    /// The bytes the `all_to_all`s of the local regions appended send between
    /// devices (counted when a capture graph's program runs).
    pub all_to_all_bytes: u64,
}

impl Graph {
    pub fn new(device: Device) -> Graph {
        Graph {
            id: NEXT_GRAPH.fetch_add(1, Ordering::Relaxed),
            device,
            builder: Builder::new(&[]).0,
            params: vec![],
            outs: vec![],
            sinks: vec![],
            checks: vec![],
            ops: 0,
            constants: HashMap::new(),
            host: None,
            saved: vec![],
            out_nd: vec![],
            all_to_all_bytes: 0,
        }
    }

    /// The argument holding a creation-op value (`bytes` of type `dtype`),
    /// made on first use by `upload` (Note [Shared constants] in `lower/program.rs`).
    pub fn constant(
        &mut self,
        bytes: Vec<u8>,
        dtype: DType,
        upload: impl FnOnce(&[u8]) -> Result<Arc<Shards>>,
    ) -> Result<Val> {
        let key = (dtype, bytes);
        if let Some(v) = self.constants.get(&key) {
            return Ok(v.clone());
        }
        let arg = upload(&key.1)?;
        let v = self.param(&arg, dtype, ParamSrc::Constant(key.1.clone()))?;
        self.constants.insert(key, v.clone());
        Ok(v)
    }

    /// The flat value of ready shards in the graph (a parameter, added once).
    pub fn param(&mut self, arg: &Arc<Shards>, dtype: DType, src: ParamSrc) -> Result<Val> {
        let raw = match self.params.iter().position(|(a, _, _)| Arc::ptr_eq(a, arg)) {
            Some(i) => self.params[i].1.clone(),
            None => {
                let v = lower::mesh::shard_arg(&mut self.builder, &arg.sharding, &arg.shape, dtype)?;
                self.params.push((arg.clone(), v.clone(), src));
                v
            }
        };
        Ok(lower::mesh::flat_value(&mut self.builder, &raw, &arg.sharding, &arg.shape))
    }

    /// Records a flat output value and returns the slot that will hold it;
    /// in a mesh graph, with the storage's sharding and n-d shape (the padded
    /// n-d value is what the program returns).
    pub fn output(&mut self, v: Val, sharding: Option<(Sharding, Vec<usize>)>) -> Arc<Slot> {
        let (v, nd) = match &sharding {
            // A partial sum is declared unreduced where it is made, and later ops
            // read it reduced (as a one-op program reads its arguments): Shardy
            // wants both transitions spelled out.
            Some((s, shape)) if !s.unreduced.is_empty() => {
                let x = self.builder.reshape(&v, shape);
                let u = self.builder.reshard(&x, s);
                let r = self.builder.reshard(&u, &s.reduced());
                let flat = self.builder.reshape(&r, &[v.ty.numel()]);
                (flat, Some((lower::mesh::padded(&mut self.builder, &u, shape, s), s.clone())))
            }
            Some((s, shape)) => {
                let nd = lower::mesh::padded(&mut self.builder, &v, shape, s);
                (v, Some((nd, s.clone())))
            }
            None => (v, None),
        };
        let slot = Arc::new(Slot {
            graph: self.id,
            device: self.device,
            index: self.outs.len(),
            sharding,
            view: OnceLock::new(),
        });
        self.outs.push((v, Arc::downgrade(&slot)));
        self.out_nd.push(nd);
        self.sinks.push(Weak::new());
        slot
    }

    /// A graph recording a traced function.
    pub fn new_capture(device: Device, policy: HostValues) -> Graph {
        let mut g = Graph::new(device);
        g.host = Some(HostLog::new(policy));
        g
    }
}

impl Graph {
    /// The value of a storage's data inside the graph: an earlier output of it,
    /// or a ready buffer as a parameter (whose source, for capture, is `storage`).
    pub(crate) fn value_of(&mut self, data: &PjrtBuffer, storage: &Arc<Storage>) -> Result<Val> {
        match data {
            PjrtBuffer::Deferred(slot) if slot.graph == self.id => Ok(self.outs[slot.index].0.clone()),
            PjrtBuffer::Deferred(_) => Err(escaped_value_error()),
            PjrtBuffer::Sharded(s) => self.param(s, storage.dtype(), ParamSrc::Storage(Arc::downgrade(storage))),
            PjrtBuffer::Ready(_) => Err(err(format!("a tensor on one device in the graph of {}", self.device))),
        }
    }

    /// Appends `op`'s lowering; returns the output storages (holding new
    /// slots). `upload` makes the buffer of a
    /// creation op's value (Note [Shared constants] in `lower/program.rs`).
    pub fn append_op(
        &mut self,
        op: &Op,
        inputs: &[&Tensor],
        outs: &[Meta],
        device: Device,
        upload: &Upload<'_>,
    ) -> Result<Vec<Arc<Storage>>> {
        let mut in_shardings = vec![];
        let (results, checks) = if let Some(values) = lower::creation_args(op) {
            if let Some(log) = &mut self.host {
                log.value(kiln_tensor::trace::in_constant_scope(), || describe_creation(op))?;
            }
            let mut args = Vec::with_capacity(values.len());
            for (bytes, dt) in values {
                args.push(self.constant(bytes, dt, |b| upload(b, dt))?);
            }
            (vec![lower::creation_lower(&mut self.builder, op, &args)?], vec![])
        } else {
            let mut vals = Vec::with_capacity(inputs.len());
            for (i, t) in inputs.iter().enumerate() {
                let data = data_of(t)?;
                let flat = self.value_of(&data, t.storage())?;
                let v = lower::read_view(&mut self.builder, &flat, t.layout())?;
                vals.push(match mesh::storage_sharding(&data) {
                    Some((s, shape)) => {
                        let (v, need) =
                            lower::mesh::constrain(&mut self.builder, op, i, v, &s, &shape, t.layout(), false);
                        in_shardings.push((t.shape().to_vec(), need));
                        v
                    }
                    None => v,
                });
            }
            lower::lower_op(&mut self.builder, op, &vals, outs)?
        };
        lower::check_results(op, &results, outs)?;
        let mut storages = Vec::with_capacity(outs.len());
        for (i, (r, m)) in results.iter().zip(outs).enumerate() {
            let n = r.ty.numel();
            let flat = self.builder.reshape(r, &[n]);
            let sharding = match device {
                Device::Mesh(_) => {
                    let mesh = kiln_tensor::DeviceMesh::of_device(device)?;
                    let s = lower::mesh::result_sharding(&self.builder, op, &in_shardings, i, r, &m.shape, &mesh);
                    Some((s, m.shape.to_vec()))
                }
                _ => None,
            };
            let slot = self.output(flat, sharding);
            let st = Arc::new(Storage::new(
                StorageData::Device(Box::new(PjrtBuffer::Deferred(slot.clone()))),
                m.dtype,
                n,
                device,
            ));
            self.sinks[slot.index] = Arc::downgrade(&st);
            storages.push(st);
        }
        self.ops += 1;
        for (v, c) in checks {
            self.checks.push((v, c, op.name(), inputs.iter().map(|t| (*t).clone()).collect()));
        }
        Ok(storages)
    }

    /// Appends the write of `src` into the memory `dst` views: the storage then
    /// holds the new slot, so every view sees it (a capture graph remembers what
    /// the storage held before, to put it back when the trace fails).
    pub fn append_assign(&mut self, dst: &Tensor, src: &Tensor) -> Result<()> {
        let device = dst.device();
        let src_flat = self.value_of(&data_of(src)?, src.storage())?;
        let s = lower::read_view(&mut self.builder, &src_flat, src.layout())?;
        let mut w = dst.storage().write();
        let before = data_in(&w, device)?;
        let dst_flat = self.value_of(&before, dst.storage())?;
        let sharding = mesh::storage_sharding(&before).map(|(s, shape)| (s.reduced(), shape));
        let own = matches!(&before, PjrtBuffer::Deferred(s) if s.graph == self.id);
        let target = Arc::downgrade(dst.storage());
        if self.host.is_some() && !own && !self.saved.iter().any(|(s, _)| Weak::ptr_eq(s, &target)) {
            self.saved.push((target, before));
        }
        let new = match device {
            Device::Mesh(_) => {
                let mesh = kiln_tensor::DeviceMesh::of_device(device)?;
                lower::mesh::write_view(&mut self.builder, &dst_flat, dst.layout(), &s, &mesh)?
            }
            _ => lower::write_view(&mut self.builder, &dst_flat, dst.layout(), &s)?,
        };
        let slot = self.output(new, sharding);
        self.sinks[slot.index] = Arc::downgrade(dst.storage());
        *w = StorageData::Device(Box::new(PjrtBuffer::Deferred(slot)));
        drop(w);
        self.ops += 1;
        Ok(())
    }

    /// Appends `t`'s view as a new storage of a mesh graph whose value carries
    /// `target` (a redistribution: the partitioner moves the data).
    pub fn append_reshard(&mut self, t: &Tensor, target: Sharding, view: DeviceMesh) -> Result<Arc<Storage>> {
        let flat = self.value_of(&data_of(t)?, t.storage())?;
        let v = lower::read_view(&mut self.builder, &flat, t.layout())?;
        let n = t.numel();
        let flat = self.builder.reshape(&v, &[n]);
        let slot = self.output(flat, Some((target, t.shape().to_vec())));
        let _ = slot.view.set(view);
        let st = Arc::new(Storage::new(
            StorageData::Device(Box::new(PjrtBuffer::Deferred(slot.clone()))),
            t.dtype(),
            n,
            t.device(),
        ));
        self.sinks[slot.index] = Arc::downgrade(&st);
        self.ops += 1;
        Ok(st)
    }
}

/// Makes the shards of a creation op's value (bytes of a dtype), replicated.
pub type Upload<'a> = dyn Fn(&[u8], DType) -> Result<Arc<Shards>> + 'a;

fn err(msg: impl Into<String>) -> Error {
    Error::backend("pjrt", msg)
}

/// What a storage holds, when it is this backend's.
pub(crate) fn data_in(d: &StorageData, device: Device) -> Result<PjrtBuffer> {
    match d {
        StorageData::Device(d) => d
            .as_any()
            .downcast_ref::<PjrtBuffer>()
            .cloned()
            .ok_or_else(|| err(format!("a tensor on {device} holds another backend's buffer"))),
        StorageData::Host(_) => Err(err(format!("a tensor on {device} holds host memory"))),
        StorageData::Traced | StorageData::Pending => Err(d.not_here("pjrt")),
    }
}

/// Whether a storage's data (`data`, a clone of it) reaches its buffers
/// only through the storage: a ready buffer or shards (whose other holders
/// the caller counts), never a slot of a capture graph.
pub(crate) fn only_the_storage_reaches(data: &PjrtBuffer) -> bool {
    match data {
        PjrtBuffer::Ready(_) | PjrtBuffer::Sharded(_) => true,
        PjrtBuffer::Deferred(_) => false,
    }
}

/// What `t`'s storage holds, once a deferred program computing it has run
/// (Note \[Deferred programs\] in kiln-tensor's `defer.rs`).
pub(crate) fn data_of(t: &Tensor) -> Result<PjrtBuffer> {
    kiln_tensor::defer::settle(t.storage())?;
    data_in(&t.storage().read(), t.device())
}

thread_local! {
    static ACTIVE: RefCell<Option<Graph>> = const { RefCell::new(None) };
}

/// Runs `f` on the thread's capture graph when one is active for `device`.
pub(crate) fn with_capture<R>(device: Device, f: impl FnOnce(&mut Graph) -> R) -> Option<R> {
    ACTIVE.with(|a| match a.borrow_mut().as_mut() {
        Some(g) if g.device == device => Some(f(g)),
        _ => None,
    })
}

/// Whether this thread is tracing a function.
pub fn is_tracing() -> bool {
    ACTIVE.with(|a| a.borrow().is_some())
}

pub(crate) fn escaped_value_error() -> Error {
    Error::invalid(
        "compile",
        "a tensor computed inside a function traced by kiln::compile was used outside it; return it from the function (or keep it in state that outlives the call)",
    )
}

/// The error for reading tensor data while tracing.
pub(crate) fn read_while_tracing(what: &str, t: &Tensor) -> Error {
    Error::invalid(
        "compile",
        format!(
            "{what}() of a tensor of shape {:?} inside a function traced by kiln::compile reads its data, which does not exist while tracing; return the tensor from the function and read it after the call",
            t.shape()
        ),
    )
}

/// Makes `g` the thread's capture graph (a trace begins).
pub(crate) fn begin_capture(g: Graph) {
    ACTIVE.with(|a| *a.borrow_mut() = Some(g));
}

/// Takes the thread's capture graph (the trace ends).
pub(crate) fn end_capture() -> Option<Graph> {
    ACTIVE.with(|a| a.borrow_mut().take())
}

/// What a storage on a PJRT device holds.
#[derive(Debug, Clone)]
pub enum PjrtBuffer {
    /// A device buffer.
    Ready(Arc<Buffer>),
    /// A value of the thread's capture graph (a tensor inside a traced function on a mesh).
    Deferred(Arc<Slot>),
    /// One shard per device of a mesh (a tensor on a mesh device, `dist.rs`).
    Sharded(Arc<mesh::Shards>),
}

impl PjrtBuffer {
    /// The device buffer of a tensor on one device.
    pub fn ready(&self) -> Option<Arc<Buffer>> {
        match self {
            PjrtBuffer::Ready(b) => Some(b.clone()),
            PjrtBuffer::Deferred(_) | PjrtBuffer::Sharded(_) => None,
        }
    }
}

impl kiln_tensor::DeviceBuffer for PjrtBuffer {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
    fn share(&self) -> Option<Box<dyn kiln_tensor::DeviceBuffer>> {
        Some(Box::new(self.clone()))
    }
}
