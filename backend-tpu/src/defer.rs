//! DeferAndFuse: in this mode ops on PJRT tensors append to a pending graph
//! per device instead of running; at a sync point the graph becomes one
//! StableHLO module, compiled once per structure and executed, and the
//! deferred results are filled in (see Note [Deferred buffers]).
use crate::host_values::{HostLog, HostValues};
use crate::lower::{Builder, Check, Ty, Val};
use crate::pjrt::Buffer;
use kiln_tensor::Storage;
use kiln_tensor::{DType, Result, Tensor};
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

// Note [Deferred buffers]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A storage on a PJRT device holds a `PjrtBuffer`: a ready device buffer, or,
// under DeferAndFuse, a `Slot` of the device's pending graph: an output that
// will exist once the graph runs. A deferred op reads its inputs' values in
// the graph (a previous op's output, or a ready buffer added as a program
// parameter), appends its lowering, and returns storages holding new slots.
// An in-place write appends the write's lowering and points the storage at
// the new slot, so every view sees it, as in the eager modes.
//
// The graph runs when a result is needed: reading data, `synchronize` /
// `kiln_tpu::sync()`, an op in another mode reading a deferred input, an op
// with a device-side check (its error must surface at the call), or the size
// limit. Only slots still referenced by some storage become program outputs
// (the rest is dead code XLA removes). A parameter whose buffer nothing but
// the graph holds any more (its storage was overwritten in place) is donated
// to an output of its type (`tf.aliasing_output`), so XLA updates it in place.
// The module text is the executable cache's key: the same sequence of ops on
// the same shapes compiles once, and the values of creation ops are program
// arguments, so a changing scalar never recompiles.

/// The default number of ops after which a pending graph runs (`KILN_TPU_DEFER_MAX_OPS`).
pub const DEFAULT_MAX_OPS: usize = 4096;

static NEXT_GRAPH: AtomicU64 = AtomicU64::new(1);

/// Graph ids with this bit set belong to capture graphs (`capture.rs`).
pub const CAPTURE_BIT: u64 = 1 << 63;

/// A deferred output: filled with its buffer when its graph runs.
#[derive(Debug)]
pub struct Slot {
    pub graph: u64,
    pub device: usize,
    pub index: usize,
    pub filled: OnceLock<Arc<Buffer>>,
}

/// The pending graph of one device.
pub struct Graph {
    pub id: u64,
    pub device: usize,
    pub builder: Builder,
    /// Ready buffers the graph reads, in argument order, with their values and sources.
    pub params: Vec<(Arc<Buffer>, Val, ParamSrc)>,
    /// Outputs appended so far (flat values) and the slots waiting for them.
    pub outs: Vec<(Val, Weak<Slot>)>,
    /// The storage each output was made for (a new result, or the target of an in-place write).
    pub sinks: Vec<Weak<Storage>>,
    /// Device-side checks of the ops appended since the last run, with the
    /// op's name and its inputs (for the error message).
    pub checks: Vec<(Val, Check, &'static str, Vec<Tensor>)>,
    pub ops: usize,
    /// The argument of each creation-op value (dtype and bytes) the graph has,
    /// so that equal values share one argument (Note [Shared constants]).
    constants: HashMap<(DType, Vec<u8>), Val>,
    /// A capture graph's record of the host values entering it.
    pub host: Option<HostLog>,
    /// A capture graph's storages written while tracing, with what they held
    /// before: put back when the trace fails.
    pub saved: Vec<(Weak<Storage>, PjrtBuffer)>,
}

// Note [Shared constants]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A creation op's value (`full`'s fill, `arange`'s start and step) is an
// argument of the program, not a literal in its text, so that one executable
// serves every value (see `lower::creation_module`). A graph sees the same
// values again and again: a captured AdamW step makes `beta1`, `1 - beta2`,
// `eps` and the like once per parameter, a scalar operand (`x * 0.5`) is a
// `full` too. Equal values (same dtype, same bytes) therefore share one
// argument: the captured llama-16m training step went from 689 scalar
// arguments to 66, and its optimized XLA module (which a warm start rebuilds
// from its serialized form) from 10000 instructions to 9376. A value that
// differs between two traces of a captured function still shows up as a
// changed constant or a changed program, so the capture's stability check is
// unaffected.

impl Graph {
    pub fn new(device: usize) -> Graph {
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
        }
    }

    /// The argument holding a creation-op value (`bytes` of type `dtype`),
    /// made on first use by `upload` (Note [Shared constants]).
    pub fn constant(
        &mut self,
        bytes: Vec<u8>,
        dtype: DType,
        upload: impl FnOnce(&[u8]) -> Result<Arc<Buffer>>,
    ) -> Result<Val> {
        let key = (dtype, bytes);
        if let Some(v) = self.constants.get(&key) {
            return Ok(v.clone());
        }
        let buf = upload(&key.1)?;
        let v = self.param(&buf, ParamSrc::Constant(key.1.clone()));
        self.constants.insert(key, v.clone());
        Ok(v)
    }

    /// The value of a ready buffer in the graph (a parameter, added once).
    pub fn param(&mut self, buf: &Arc<Buffer>, src: ParamSrc) -> Val {
        if let Some((_, v, _)) = self.params.iter().find(|(b, _, _)| Arc::ptr_eq(b, buf)) {
            return v.clone();
        }
        let v = self.builder.add_arg(Ty::new(&[buf.numel()], buf.dtype()));
        self.params.push((buf.clone(), v.clone(), src));
        v
    }

    /// Records a flat output value and returns the slot that will hold it.
    pub fn output(&mut self, v: Val) -> Arc<Slot> {
        let slot =
            Arc::new(Slot { graph: self.id, device: self.device, index: self.outs.len(), filled: OnceLock::new() });
        self.outs.push((v, Arc::downgrade(&slot)));
        self.sinks.push(Weak::new());
        slot
    }

    /// A graph recording a traced function (its slots never run as such).
    pub fn new_capture(device: usize, policy: HostValues) -> Graph {
        let mut g = Graph::new(device);
        g.id |= CAPTURE_BIT;
        g.host = Some(HostLog::new(policy));
        g
    }

    pub fn is_empty(&self) -> bool {
        self.outs.is_empty() && self.checks.is_empty()
    }
}

/// What a storage on a PJRT device holds.
#[derive(Debug, Clone)]
pub enum PjrtBuffer {
    /// A device buffer.
    Ready(Arc<Buffer>),
    /// An output of a pending graph (DeferAndFuse).
    Deferred(Arc<Slot>),
}

impl PjrtBuffer {
    /// The device buffer, when it exists: a ready one, or a deferred slot whose graph has run.
    pub fn ready(&self) -> Option<Arc<Buffer>> {
        match self {
            PjrtBuffer::Ready(b) => Some(b.clone()),
            PjrtBuffer::Deferred(s) => s.filled.get().cloned(),
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
}

/// The program output types of the live outputs, for execution.
pub fn out_meta(vals: &[Val]) -> Vec<(DType, Vec<usize>)> {
    vals.iter().map(|v| (v.dtype(), v.shape().to_vec())).collect()
}
