//! Lowering over a device mesh (Note [Distributed storages] in `dist.rs`):
//! how a program reads a storage's shards, constrains an op's inputs to the
//! sharding the op needs, places its results (Note [Placements of results]
//! in `shard.rs`) and returns a storage padded to its sharding. Eager mesh
//! ops use these verbs one op at a time; a whole `Program` over a mesh uses
//! them through `Placing`, which follows each value's placement as the
//! program is lowered.
use super::{shard, write_view as write_flat_view, Builder, Lit, Sharding, Ty, Val};
use kiln_tensor::ir::Value;
use kiln_tensor::{DType, DeviceMesh, Layout, Op, Result, ViewOp};

/// A storage's sharding and n-d shape.
pub type ShardedShape = (Sharding, Vec<usize>);

/// The inputs of an op as its placement rule reads them: each one's shape and sharding.
type InputShardings = Vec<(Vec<usize>, Sharding)>;

/// A new argument holding the shards of a storage of `shape` split by `s`:
/// its padded global type and sharding.
pub(crate) fn shard_arg(b: &mut Builder, s: &Sharding, shape: &[usize], dtype: DType) -> Result<Val> {
    b.add_sharded_arg(Ty::new(&s.padded_shape(shape), dtype), s.clone())
}

/// The flat logical value of the argument `arg` holding the shards of a
/// storage of `shape` split by `s`: a partial sum constrained to reduced,
/// kiln's padding sliced off, flattened.
pub(crate) fn flat_value(b: &mut Builder, arg: &Val, s: &Sharding, shape: &[usize]) -> Val {
    let mut v = arg.clone();
    if !s.unreduced.is_empty() {
        v = b.reshard(&v, &s.reduced());
    }
    if s.padded_shape(shape) != shape {
        let zeros = vec![0; shape.len()];
        let ones = vec![1; shape.len()];
        v = b.slice(&v, &zeros, shape, &ones);
    }
    let n = shape.iter().product();
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

// Note [Partial sums and reduce-scatter]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A partial sum moved to a split over its partial axes (FSDP's gradient:
// `redistribute(Partial -> Shard(0))`, DTensor's reduce-scatter) could be left
// to the partitioner as a resharding, but XLA's SPMD partitioner lowers that
// as an all-reduce of the whole value followed by each device's slice, and
// only the GPU and TPU compilers fuse the pair back into a reduce-scatter
// (their `ReduceScatterCreator` pass); XLA:CPU moves the whole gradient. So
// kiln writes the reduce-scatter itself: the partial sum enters a manual
// computation with its unreduced axes in the in-sharding (each device's own
// addend) and leaves as one `stablehlo.reduce_scatter` over exactly those
// axes, along the dimension the target splits. Every compiler then sends
// 1/N of the bytes an all-reduce sends. A target that also moves other
// axes, splits several dimensions, or pads an uneven one takes the general
// path (reduce, then slice).

/// The partial sum `u` (sharding `from`, with unreduced axes, of `shape`)
/// reduce-scattered to `to`, which splits one dimension further over exactly
/// the unreduced axes (the pieces' order: `to`'s): one `stablehlo.reduce_scatter`
/// in a manual computation over the mesh (Note [Partial sums and
/// reduce-scatter]). `None` where `to` is not such a split or a dimension is
/// uneven; the caller then reduces and slices.
pub(crate) fn reduce_scatter(
    b: &mut Builder,
    u: &Val,
    from: &Sharding,
    to: &Sharding,
    shape: &[usize],
) -> Result<Option<Val>> {
    if from.unreduced.is_empty()
        || !to.unreduced.is_empty()
        || from.dims.len() != shape.len()
        || to.dims.len() != shape.len()
    {
        return Ok(None);
    }
    let changed: Vec<usize> = (0..shape.len()).filter(|&d| from.dims[d] != to.dims[d]).collect();
    let [d] = changed[..] else { return Ok(None) };
    let Some(added) = to.dims[d].strip_prefix(from.dims[d].as_slice()) else { return Ok(None) };
    let mut sorted = added.to_vec();
    sorted.sort_unstable();
    let mut partial = from.unreduced.clone();
    partial.sort_unstable();
    let even = from.padded_shape(shape) == shape && to.padded_shape(shape) == shape;
    if sorted != partial || !even {
        return Ok(None);
    }
    let groups = groups_over(&from.mesh, added);
    let block = Ty::new(&from.shard_shape(shape), u.dtype());
    let (mut body, args) = Builder::new(&[block]);
    let op = kiln_tensor::collective::CollectiveOp {
        kind: kiln_tensor::collective::Collective::ReduceScatter { dim: d },
        groups,
    };
    let out = kiln_tensor::Meta::new(&to.shard_shape(shape), u.dtype());
    let scattered = super::collective::lower(&mut body, &op, &args[0], &out);
    let outs = super::manual_computation(
        b,
        &[u],
        std::slice::from_ref(from),
        body,
        &[scattered],
        std::slice::from_ref(to),
        std::slice::from_ref(&u.ty),
    )?;
    Ok(outs.into_iter().next())
}

/// The mesh positions whose coordinates differ only on `axes`, each group
/// in the order of its coordinates on `axes` (the first axis major): the
/// replica groups of a collective over those axes.
fn groups_over(mesh: &DeviceMesh, axes: &[usize]) -> Vec<Vec<usize>> {
    let mut keys: Vec<Vec<usize>> = vec![];
    let mut groups: Vec<Vec<(Vec<usize>, usize)>> = vec![];
    for pos in 0..mesh.devices().len() {
        let c = mesh.coordinates(pos);
        let mut key = c.clone();
        for &a in axes {
            key[a] = 0;
        }
        let rank = axes.iter().map(|&a| c[a]).collect();
        match keys.iter().position(|k| *k == key) {
            Some(g) => groups[g].push((rank, pos)),
            None => {
                keys.push(key);
                groups.push(vec![(rank, pos)]);
            }
        }
    }
    groups
        .into_iter()
        .map(|mut g| {
            g.sort();
            g.into_iter().map(|(_, p)| p).collect()
        })
        .collect()
}

/// `lower::write_view` in a program over `mesh`. A write through a strided
/// view is a scatter whose combiner replaces, which the partitioner cannot
/// split (XLA aborts the process on it), so its operands are gathered first;
/// the program's result annotation splits the written value again.
pub(crate) fn write_view(b: &mut Builder, base: &Val, layout: &Layout, src: &Val, mesh: &DeviceMesh) -> Result<Val> {
    if layout.is_contiguous() {
        return write_flat_view(b, base, layout, src);
    }
    let base = b.reshard(base, &Sharding::replicated(mesh, base.ty.rank()));
    let src = b.reshard(src, &Sharding::replicated(mesh, src.ty.rank()));
    write_flat_view(b, &base, layout, &src)
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
    b.pad(&v, Lit::I(0), &vec![0; shape.len()], &high)
}

/// The sharding `op` needs its input `input` in, when that input is the
/// view `layout` of a storage of `shape` split by `sharding` (Note
/// [Placements of results]); also the view's own sharding.
fn needed(op: &Op, input: usize, sharding: &Sharding, shape: &[usize], layout: &Layout) -> (Sharding, Sharding) {
    let view = shard::view_sharding(sharding, shape, layout).reduced();
    let need = shard::in_sharding(op, input, &view, layout.shape());
    (view, need)
}

/// The value `v`, the view `layout` of a storage of `shape` split by
/// `sharding`, moved to the sharding `op` needs its input `input` in (Note
/// [Placements of results]); also returns that sharding. With `pin`, the
/// sharding is spelled out even where the value has it already.
#[allow(clippy::too_many_arguments)]
pub(crate) fn constrain(
    b: &mut Builder,
    op: &Op,
    input: usize,
    v: Val,
    sharding: &Sharding,
    shape: &[usize],
    layout: &Layout,
    pin: bool,
) -> (Val, Sharding) {
    let (view, need) = needed(op, input, sharding, shape, layout);
    // Some lowerings cannot be partitioned along the dimensions they work on:
    // a scatter that replaces (XLA aborts on it) and the NaN-aware max and
    // min (an "unsupported reduction computation"). Their inputs get the
    // sharding they need spelled out even when `view` says they already have
    // it: a view of part of a split storage carries whatever sharding the
    // partitioner propagates through the slicing (a split row sliced out
    // stays split), not `view`. A custom op's function is written for whole
    // tensors, so its inputs are gathered the same way. Other ops take a view
    // as it comes.
    let whole = layout.is_contiguous() && layout.offset() == 0 && layout.shape() == shape;
    if need == view && (whole || !unsplittable(op)) && !pin {
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
        | Op::LocalMap(_)
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
        | Op::Redistribute(_)
        | Op::Dequantize(_)
        | Op::QuantMatMul(_)
        | Op::PagedAttention { .. } => false,
    }
}

/// Where a value of a program over a mesh lives: the view `layout` of a
/// storage of n-d `shape` split by `sharding`.
#[derive(Clone)]
struct Placed {
    sharding: Sharding,
    shape: Vec<usize>,
    layout: Layout,
    /// A view's sharding as a storage of its own, when a result keeps it (a
    /// view op run as an op, as the eager mesh ops place its result).
    own: Option<Sharding>,
    /// The view of the mesh a redistribution placed the storage on (`None`: the whole mesh).
    view: Option<DeviceMesh>,
}

impl Placed {
    /// Whether the value is its storage's whole content in order (possibly reshaped).
    fn is_storage(&self) -> bool {
        let n: usize = self.shape.iter().product();
        let whole = self.layout.numel() == n;
        whole && (n == 0 || (self.layout.is_contiguous() && self.layout.offset() == 0))
    }
}

/// Where a result of a program over a mesh lies: the storage's sharding and
/// n-d shape, and the view of the mesh it was placed on (`None`: the whole mesh).
#[derive(Debug, Clone)]
pub struct Output {
    pub sharding: Sharding,
    pub shape: Vec<usize>,
    pub view: Option<DeviceMesh>,
}

/// The placements of a `Program`'s values as it is lowered over a mesh
/// (`lower_into` with a mesh): each parameter is a storage's shards, each
/// view reads a storage, each op's inputs are constrained and its results
/// placed by kiln's rules, and each result is returned padded with its
/// storage's sharding, exactly as the eager mesh ops do one op at a time.
pub(crate) struct Placing {
    pub mesh: DeviceMesh,
    /// Each parameter's storage: its sharding and n-d shape.
    pub params: Vec<ShardedShape>,
    placed: Vec<Option<Placed>>,
    /// A partial sum's value as made, before later ops read it reduced (what a result returns).
    unreduced: Vec<Option<Val>>,
}

impl Placing {
    pub fn new(mesh: DeviceMesh, params: Vec<ShardedShape>) -> Placing {
        Placing { mesh, params, placed: vec![], unreduced: vec![] }
    }

    fn set(&mut self, v: Value, p: Placed) {
        let i = v.index();
        if self.placed.len() <= i {
            self.placed.resize(i + 1, None);
            self.unreduced.resize(i + 1, None);
        }
        self.placed[i] = Some(p);
    }

    fn get(&self, v: Value) -> Result<&Placed> {
        self.placed.get(v.index()).and_then(|p| p.as_ref()).ok_or_else(|| {
            kiln_tensor::Error::backend("pjrt", format!("{v} of a program over a mesh has no placement"))
        })
    }

    /// Parameter `i` (value `v`, of `n` elements): its argument, read flat.
    pub fn param(&mut self, b: &mut Builder, i: usize, v: Value, dtype: DType) -> Result<Val> {
        let (s, shape) = self.params.get(i).cloned().ok_or_else(|| {
            kiln_tensor::Error::backend("pjrt", format!("parameter {i} of a program over a mesh has no sharding"))
        })?;
        let arg = shard_arg(b, &s, &shape, dtype)?;
        let flat = flat_value(b, &arg, &s, &shape);
        let n = flat.ty.numel();
        self.set(v, Placed { sharding: s, shape, layout: Layout::contiguous(&[n]), own: None, view: None });
        Ok(flat)
    }

    /// A creation value's argument: one element, replicated.
    pub fn constant_arg(&self, b: &mut Builder, dtype: DType) -> Result<Val> {
        b.add_sharded_arg(Ty::new(&[1], dtype), Sharding::replicated(&self.mesh, 1))
    }

    /// The view `out` of `arg` (of shape `arg_shape`) that `view` makes.
    pub fn view(&mut self, out: Value, arg: Value, arg_shape: &[usize], view: &ViewOp) -> Result<()> {
        let a = self.get(arg)?.clone();
        // A view of a whole storage reads that storage; a view of a view reads the
        // first view as if it were a storage of its own, split as the view is.
        let base = if a.is_storage() {
            a
        } else {
            let s = shard::view_sharding(&a.sharding, &a.shape, &a.layout).reduced();
            Placed {
                sharding: s,
                shape: arg_shape.to_vec(),
                layout: Layout::contiguous(arg_shape),
                own: None,
                view: None,
            }
        };
        let layout = match view {
            ViewOp::AsStrided { shape, strides, offset } => {
                Layout::new(shape.clone(), strides.iter().copied().collect(), *offset)
            }
            other => other.apply(&Layout::contiguous(arg_shape))?,
        };
        let op = Op::View(view.clone());
        let seen = shard::view_sharding(&base.sharding, &base.shape, &base.layout).reduced();
        let ins = [(arg_shape.to_vec(), shard::in_sharding(&op, 0, &seen, arg_shape))];
        let own = shard::out_sharding(&op, &ins, 0, layout.shape(), &self.mesh).reduced();
        self.set(out, Placed { layout, own: Some(own), ..base });
        Ok(())
    }

    /// `op`'s inputs `x` (the values `args`) constrained to the shardings it
    /// needs, and those shardings with the inputs' shapes. An op that leaves
    /// a partial sum (results of types `outs`) gets every input's sharding
    /// spelled out: the partial sum is right only where the partitioner
    /// computes the op on the split inputs, and inside a program it would
    /// otherwise follow what later uses of an input ask for (a gather).
    pub fn inputs(
        &self,
        b: &mut Builder,
        op: &Op,
        args: &[Value],
        x: Vec<Val>,
        outs: &[kiln_tensor::Meta],
    ) -> Result<(Vec<Val>, InputShardings)> {
        let placed: Vec<&Placed> = args.iter().map(|a| self.get(*a)).collect::<Result<_>>()?;
        let ins: InputShardings = placed
            .iter()
            .enumerate()
            .map(|(i, p)| (p.layout.shape().to_vec(), needed(op, i, &p.sharding, &p.shape, &p.layout).1))
            .collect();
        if let (Op::Redistribute(_), [arg]) = (op, args) {
            if let Some(v) = self.scatter_partial(b, op, *arg, &ins)? {
                return Ok((vec![v], ins));
            }
        }
        let partial =
            (0..outs.len()).any(|i| !shard::out_sharding(op, &ins, i, &outs[i].shape, &self.mesh).unreduced.is_empty());
        let mut vals = Vec::with_capacity(x.len());
        for (i, (p, v)) in placed.iter().zip(x).enumerate() {
            vals.push(constrain(b, op, i, v, &p.sharding, &p.shape, &p.layout, partial).0);
        }
        Ok((vals, ins))
    }

    /// The redistribution `op` of the partial sum `arg` (a whole storage) as
    /// one reduce-scatter, when it splits exactly the partial axes (see
    /// [`reduce_scatter`]); `None` otherwise.
    fn scatter_partial(
        &self,
        b: &mut Builder,
        op: &Op,
        arg: Value,
        ins: &[(Vec<usize>, Sharding)],
    ) -> Result<Option<Val>> {
        let p = self.get(arg)?;
        let Some(u) = self.unreduced.get(arg.index()).and_then(|u| u.as_ref()) else { return Ok(None) };
        if !p.is_storage() || p.layout.shape() != p.shape.as_slice() {
            return Ok(None);
        }
        let to = shard::out_sharding(op, ins, 0, &p.shape, &self.mesh);
        reduce_scatter(b, u, &p.sharding, &to, &p.shape)
    }

    /// Places `op`'s results (`results`, the values `outs`) by kiln's rule;
    /// returns the values later ops read (a partial sum, reduced).
    pub fn results(
        &mut self,
        b: &mut Builder,
        op: &Op,
        ins: &[(Vec<usize>, Sharding)],
        outs: impl Iterator<Item = Value>,
        results: Vec<Val>,
    ) -> Result<Vec<Val>> {
        let mut read = Vec::with_capacity(results.len());
        for (i, (v, r)) in outs.zip(results).enumerate() {
            let shape = r.shape().to_vec();
            let s = result_sharding(b, op, ins, i, &r, &shape, &self.mesh);
            let layout = Layout::contiguous(&shape);
            let view = match op {
                Op::Redistribute(r) => Some(DeviceMesh::of_redistribution(r)?),
                _ => None,
            };
            self.set(v, Placed { sharding: s.clone(), shape: shape.clone(), layout, own: None, view });
            // A partial sum is declared unreduced where it is made, and later ops
            // read it reduced (as a one-op program reads its arguments): Shardy
            // wants both transitions spelled out. A redistribution is spelled
            // out where it happens.
            if matches!(op, Op::Redistribute(_)) && s.unreduced.is_empty() {
                read.push(b.reshard(&r, &s));
            } else if s.unreduced.is_empty() {
                read.push(r);
            } else {
                let u = b.reshard(&r, &s);
                read.push(b.reshard(&u, &s.reduced()));
                self.unreduced[v.index()] = Some(u);
            }
        }
        Ok(read)
    }

    /// The write of `src` into the view `layout` of `base` (the value `dst` of
    /// a storage, flat): the storage's next value `out`, reduced.
    pub fn assign(
        &mut self,
        b: &mut Builder,
        out: Value,
        dst: Value,
        flat: &Val,
        layout: &Layout,
        src: &Val,
    ) -> Result<Val> {
        let p = self.get(dst)?.clone();
        if !p.is_storage() {
            return Err(kiln_tensor::Error::backend(
                "pjrt",
                format!("{dst}, written in place, is not a storage's value"),
            ));
        }
        let written = write_view(b, flat, layout, src, &self.mesh)?;
        let sharding = p.sharding.reduced();
        self.set(out, Placed { sharding, own: None, ..p });
        Ok(written)
    }

    /// Where the value `v`, the content of a storage, lies.
    pub fn placed(&self, v: Value) -> Result<Output> {
        let p = self.get(v)?;
        match (p.is_storage(), &p.own) {
            (false, Some(own)) => Ok(Output { sharding: own.clone(), shape: p.layout.shape().to_vec(), view: None }),
            (false, None) => {
                Err(kiln_tensor::Error::backend("pjrt", format!("{v} of a program over a mesh is a view")))
            }
            (true, _) => Ok(Output { sharding: p.sharding.clone(), shape: p.shape.clone(), view: p.view.clone() }),
        }
    }

    /// What the program returns for the value `v` (lowered as `val`), the
    /// content of a storage: its n-d value padded to its sharding, and where
    /// the storage lies.
    pub fn output(&self, b: &mut Builder, v: Value, val: &Val) -> Result<(Val, Output)> {
        let out = self.placed(v)?;
        let val = self.unreduced[v.index()].as_ref().unwrap_or(val);
        Ok((padded(b, val, &out.shape, &out.sharding), out))
    }
}
