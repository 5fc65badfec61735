//! A graph over a device mesh (Note [Distributed storages] in `dist.rs`):
//! what a mesh storage holds (`Shards`), how a graph reads shards and
//! annotates its values with shardings, and a mesh graph as one SPMD program.
//! Below the backend: the graph's verbs use it, the backend runs its programs.
use super::{Graph, PjrtBuffer, Slot};
use crate::lower::{self, shard, Builder, Check, Module, Sharding, Ty, Val};
use crate::pjrt::Buffer;
use kiln_tensor::{DType, DeviceMesh, Layout, Op, Result, Tensor};
use std::sync::Arc;

/// What a storage on a mesh device holds.
#[derive(Debug)]
pub struct Shards {
    /// Each mesh device's shard of the padded value, in mesh order.
    pub bufs: Vec<Arc<Buffer>>,
    /// The split over the root mesh, of the storage's n-d shape.
    pub sharding: Sharding,
    /// The storage's logical shape (its element count is the storage's length).
    pub shape: Vec<usize>,
    /// The mesh the tensor was placed on (reported by `device_mesh`).
    pub view: DeviceMesh,
}

/// A new argument holding `s`'s shards: its padded global type and sharding.
pub(crate) fn shard_arg(b: &mut Builder, s: &Shards, dtype: DType) -> Result<Val> {
    b.add_sharded_arg(Ty::new(&s.sharding.padded_shape(&s.shape), dtype), s.sharding.clone())
}

/// The flat logical value of the argument `arg` holding `s`'s shards: a
/// partial sum constrained to reduced, kiln's padding sliced off, flattened.
pub(crate) fn flat_value(b: &mut Builder, arg: &Val, s: &Shards) -> Val {
    let mut v = arg.clone();
    if !s.sharding.unreduced.is_empty() {
        v = b.reshard(&v, &s.sharding.reduced());
    }
    if s.sharding.padded_shape(&s.shape) != s.shape {
        let zeros = vec![0; s.shape.len()];
        let ones = vec![1; s.shape.len()];
        v = b.slice(&v, &zeros, &s.shape, &ones);
    }
    let n = s.shape.iter().product();
    b.reshape(&v, &[n])
}

/// The sharding of result `i` (`r`, of `shape`) of `op` in a program over
/// `mesh`: kiln's rule (Note [Placements of results]), except that a partial
/// sum is kept only where Shardy keeps it. Shardy carries unreduced values
/// out of the op that makes them (a reduction, a dot) but reduces them before
/// anything that follows (a convert back to a 16-bit type, the padding of an
/// uneven dimension); declaring such a value unreduced afterwards would leave
/// every device holding the whole sum, and reading it would add them all up.
/// Those results are reduced instead.
pub(crate) fn result_sharding(
    b: &Builder,
    op: &Op,
    ins: &[(Vec<usize>, Sharding)],
    i: usize,
    r: &Val,
    shape: &[usize],
    mesh: &DeviceMesh,
) -> Sharding {
    let s = shard::out_sharding(op, ins, i, shape, mesh);
    let direct = matches!(b.defining_op(r), Some("stablehlo.reduce" | "stablehlo.dot_general"));
    if s.unreduced.is_empty() || (direct && s.padded_shape(shape) == shape) {
        s
    } else {
        s.reduced()
    }
}

/// `lower::write_view` in a program over `mesh`. A write through a strided
/// view is a scatter whose combiner replaces, which the partitioner cannot
/// split (XLA aborts the process on it), so its operands are gathered first;
/// the program's result annotation splits the written value again.
pub(crate) fn write_view(b: &mut Builder, base: &Val, layout: &Layout, src: &Val, mesh: &DeviceMesh) -> Result<Val> {
    if layout.is_contiguous() {
        return lower::write_view(b, base, layout, src);
    }
    let base = b.reshard(base, &Sharding::replicated(mesh, base.ty.rank()));
    let src = b.reshard(src, &Sharding::replicated(mesh, src.ty.rank()));
    lower::write_view(b, &base, layout, &src)
}

/// `v` (any value of `shape`'s element count) as `shape`, padded to `s`'s
/// padded shape: what a program over a mesh returns for a storage.
pub(crate) fn padded(b: &mut Builder, v: &Val, shape: &[usize], s: &Sharding) -> Val {
    let v = b.reshape(v, shape);
    let padded = s.padded_shape(shape);
    if padded == shape {
        return v;
    }
    let high: Vec<usize> = padded.iter().zip(shape).map(|(p, n)| p - n).collect();
    b.pad(&v, lower::Lit::I(0), &vec![0; shape.len()], &high)
}

/// The sharding and n-d shape of a storage on a mesh device (ready or deferred).
pub(crate) fn storage_sharding(data: &PjrtBuffer) -> Option<(Sharding, Vec<usize>)> {
    match data {
        PjrtBuffer::Sharded(s) => Some((s.sharding.clone(), s.shape.clone())),
        PjrtBuffer::Deferred(slot) => slot.sharding.clone(),
        PjrtBuffer::Ready(_) => None,
    }
}

/// The view `v` of `t` (whose storage has `sharding` and `shape`) moved to the
/// sharding `op` needs it in (Note [Placements of results]); also returns that sharding.
pub(crate) fn constrain(
    b: &mut Builder,
    op: &Op,
    input: usize,
    v: Val,
    sharding: &Sharding,
    shape: &[usize],
    t: &Tensor,
) -> (Val, Sharding) {
    let view = shard::view_sharding(sharding, shape, t.layout()).reduced();
    let need = shard::in_sharding(op, input, &view, t.shape());
    // Some lowerings cannot be partitioned along the dimensions they work on:
    // a scatter that replaces (XLA aborts on it) and the NaN-aware max and
    // min (an "unsupported reduction computation"). Their inputs get the
    // sharding they need spelled out even when `view` says they already have
    // it: a view of part of a split storage carries whatever sharding the
    // partitioner propagates through the slicing (a split row sliced out
    // stays split), not `view`. A custom op's function is written for whole
    // tensors, so its inputs are gathered the same way. Other ops take a view
    // as it comes.
    let l = t.layout();
    let whole = l.is_contiguous() && l.offset() == 0 && t.shape() == shape;
    if need == view && (whole || !unsplittable(op)) {
        (v, need)
    } else {
        (b.reshard(&v, &need), need)
    }
}

/// Whether `op`'s lowering cannot be partitioned along the dimensions it
/// works on, so its inputs get their sharding spelled out (see `constrain`).
fn unsplittable(op: &Op) -> bool {
    use kiln_tensor::{ReduceOp, ScatterReduce};
    match op {
        Op::Scatter { reduce: ScatterReduce::Replace, .. }
        | Op::Assign { .. }
        | Op::Reduce { op: ReduceOp::Max | ReduceOp::Min, .. }
        | Op::ArgReduce { .. }
        | Op::LogSumExp { .. }
        | Op::Softmax { .. }
        | Op::Custom(_) => true,
        Op::Scatter { reduce: ScatterReduce::Add, .. }
        | Op::Reduce { .. }
        | Op::Full { .. }
        | Op::Arange { .. }
        | Op::RandomBits { .. }
        | Op::Unary(_)
        | Op::Binary(_)
        | Op::Compare(_)
        | Op::Where
        | Op::Cast(_)
        | Op::Copy
        | Op::Rotary
        | Op::Attention { .. }
        | Op::AttentionBackward { .. }
        | Op::CrossEntropyBackward { .. }
        | Op::RmsNorm { .. }
        | Op::RmsNormBackward { .. }
        | Op::Cumsum { .. }
        | Op::MatMul
        | Op::GroupedMatMul
        | Op::View(_)
        | Op::Cat { .. }
        | Op::Gather { .. }
        | Op::IndexSelect { .. }
        | Op::IndexAdd { .. }
        | Op::Sort { .. }
        | Op::TopK { .. }
        | Op::Collective(_)
        | Op::Dequantize(_)
        | Op::QuantMatMul(_)
        | Op::PagedAttention { .. } => false,
    }
}

impl Graph {
    /// DeferAndFuse's program of a mesh graph (as `Graph::into_program`): live
    /// outputs with their shardings, then check flags; arguments only the graph
    /// still holds are donated to an output of their type and sharding.
    pub(crate) fn into_mesh_program(self) -> Result<Option<MeshGraphProgram>> {
        let mesh = DeviceMesh::of_device(self.device)?;
        let Graph { builder: mut b, params, outs, out_nd, checks, .. } = self;
        let shard_params: Vec<(Arc<Shards>, Val)> = params.into_iter().map(|(a, v, _)| (a, v)).collect();
        let mut live = vec![];
        for ((_, w), nd) in outs.iter().zip(out_nd) {
            if let (Some(slot), Some((v, s))) = (w.upgrade(), nd) {
                live.push((slot, v, s));
            }
        }
        if live.is_empty() && checks.is_empty() {
            return Ok(None);
        }
        let mut taken = vec![false; live.len()];
        for (pi, (sh, v)) in shard_params.iter().enumerate() {
            if Arc::strong_count(sh) == 1 && sh.sharding.unreduced.is_empty() {
                let fits = |j: usize| !taken[j] && live[j].1.ty == v.ty && live[j].2 == sh.sharding;
                if let Some(j) = (0..live.len()).find(|&j| fits(j)) {
                    taken[j] = true;
                    b.alias(pi, j);
                }
            }
        }
        let mut values: Vec<Val> = live.iter().map(|l| l.1.clone()).collect();
        let mut shardings: Vec<Sharding> = live.iter().map(|l| l.2.clone()).collect();
        let mut out_meta: Vec<(DType, Vec<usize>)> = live
            .iter()
            .map(|(slot, v, s)| {
                let shape = slot.sharding.as_ref().map_or(v.shape().to_vec(), |(_, shape)| shape.clone());
                (v.dtype(), s.shard_shape(&shape))
            })
            .collect();
        for (v, ..) in &checks {
            values.push(v.clone());
            shardings.push(Sharding::replicated(&mesh, 0));
            out_meta.push((DType::Bool, vec![]));
        }
        let module = b.finish_sharded(&values, &shardings)?;
        Ok(Some(MeshGraphProgram {
            module,
            args: shard_params.into_iter().map(|(s, _)| s).collect(),
            out_meta,
            slots: live.into_iter().map(|l| l.0).collect(),
            checks: checks.into_iter().map(|(_, c, n, i)| (c, n, i)).collect(),
            mesh,
        }))
    }
}

/// A mesh graph as a program to run (see [`Graph::into_mesh_program`]).
pub(crate) struct MeshGraphProgram {
    pub module: Module,
    pub args: Vec<Arc<Shards>>,
    pub out_meta: Vec<(DType, Vec<usize>)>,
    pub slots: Vec<Arc<Slot>>,
    pub checks: Vec<(Check, &'static str, Vec<Tensor>)>,
    pub mesh: DeviceMesh,
}
