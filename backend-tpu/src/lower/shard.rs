//! Shardings: a mesh and per-axis placements as Shardy's annotations
//! (`sdy.mesh`, `#sdy.sharding`), and how a tensor of a given sharding is cut
//! into the shards each device holds (see Note \[Shardings\]).
use kiln_tensor::{DeviceMesh, Error, PartialOp, Placement, Result};

// Note [Shardings]
// ~~~~~~~~~~~~~~~~
// A program over a mesh is one SPMD module: its arguments and results carry
// `#sdy.sharding<@mesh, [{"dp"}, {}]>` (per tensor dimension, the mesh axes it
// is split over, major to minor), and XLA's partitioner (Shardy) turns it into
// one program per device, inserting the collectives. The mesh is declared once
// per module, `sdy.mesh @mesh = <["dp"=2, "tp"=2]>`, always the root mesh
// (Note [Device meshes]): a placement on a sub-mesh only names its axes, and
// every other axis of the root replicates.
//
// Placements map to a sharding as PyTorch's DTensor defines them: `Shard(d)`
// on mesh axis a adds a to dimension d's axes, in mesh-axis order (so
// `[Shard(0), Shard(0)]` on ("dp", "tp") splits dim 0 over dp then tp, the
// major one first); `Partial(sum)` is Shardy's `unreduced` axis (each device
// holds a partial sum); `Replicate` names nothing.
//
// Each device holds a shard of the same shape: dimension d of size n over
// axes of total size k is cut into chunks of ceil(n / k), and the last chunks
// are padded (f32[10] over 4 devices is f32[3] on each, the last holding one
// real element). kiln pads the global value itself: a sharded program value
// has the padded shape (ceil(n / k) k), so the partitioner always splits
// evenly, and the program slices the logical value out of it and pads its
// results back. (Left to Shardy, an uneven dimension may be split over a
// sub-axis instead: f32[10] over 4 devices came back as f32[5] shards.) The
// device at mesh coordinates c holds chunk index sum over d's axes of c[a]
// times the sizes of the axes after a.

/// A tensor's sharding over a root mesh.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Sharding {
    pub mesh: DeviceMesh,
    /// Per tensor dimension, the root-mesh axes it is split over, major to minor.
    pub dims: Vec<Vec<usize>>,
    /// Root-mesh axes over which the value is a partial sum.
    pub unreduced: Vec<usize>,
}

impl Sharding {
    /// The sharding of `placements` (one per axis of `mesh`, which may be a
    /// sub-mesh) for a tensor of `ndim` dimensions.
    pub fn from_placements(mesh: &DeviceMesh, placements: &[Placement], ndim: usize) -> Result<Sharding> {
        mesh.check_placements(placements, ndim)?;
        let mut dims = vec![vec![]; ndim];
        let mut unreduced = vec![];
        for (i, p) in placements.iter().enumerate() {
            let a = mesh.root_axis_of(i);
            match p {
                Placement::Shard(d) => dims[*d].push(a),
                Placement::Partial(_) => unreduced.push(a),
                Placement::Replicate => {}
            }
        }
        Ok(Sharding { mesh: mesh.root(), dims, unreduced })
    }

    /// A value replicated on every device of `mesh`.
    pub fn replicated(mesh: &DeviceMesh, ndim: usize) -> Sharding {
        Sharding { mesh: mesh.root(), dims: vec![vec![]; ndim], unreduced: vec![] }
    }

    /// The number of pieces dimension `d` is cut into.
    pub fn splits(&self, d: usize) -> usize {
        self.dims[d].iter().map(|&a| self.mesh.root_shape()[a]).product()
    }

    /// The shape of each device's shard of a tensor of `shape` (padded, see the Note).
    pub fn shard_shape(&self, shape: &[usize]) -> Vec<usize> {
        shape.iter().enumerate().map(|(d, &n)| n.div_ceil(self.splits(d))).collect()
    }

    /// The global shape a program carries for a tensor of `shape`: each
    /// dimension padded to a multiple of its number of pieces (see the Note).
    pub fn padded_shape(&self, shape: &[usize]) -> Vec<usize> {
        shape.iter().enumerate().map(|(d, &n)| n.div_ceil(self.splits(d)) * self.splits(d)).collect()
    }

    /// The chunk of each dimension the mesh's `device`-th device (row-major) holds.
    pub fn chunk_index(&self, device: usize) -> Vec<usize> {
        let c = self.mesh.coordinates(device);
        let sizes = self.mesh.root_shape();
        self.dims.iter().map(|axes| axes.iter().fold(0, |idx, &a| idx * sizes[a] + c[a])).collect()
    }

    /// The bytes of the mesh's `device`-th device's shard of a row-major tensor
    /// of `shape` (`bytes`, elements of `elem` bytes): the chunk it holds of
    /// every dimension, padded with zeros to the shard shape.
    pub fn shard_bytes(&self, bytes: &[u8], elem: usize, shape: &[usize], device: usize) -> Vec<u8> {
        let local = self.shard_shape(shape);
        let mut out = vec![0u8; local.iter().product::<usize>() * elem];
        self.walk(shape, device, |g, l, n| {
            out[l * elem..(l + n) * elem].copy_from_slice(&bytes[g * elem..(g + n) * elem]);
        });
        out
    }

    /// Writes the mesh's `device`-th device's shard (`shard`, of the shard
    /// shape) into its place in the row-major tensor `out` of `shape`; the
    /// padding is dropped.
    pub fn unshard_into(&self, shard: &[u8], elem: usize, shape: &[usize], device: usize, out: &mut [u8]) {
        self.walk(shape, device, |g, l, n| {
            out[g * elem..(g + n) * elem].copy_from_slice(&shard[l * elem..(l + n) * elem]);
        });
    }

    /// Calls `f(global offset, local offset, run length)` for every run of the
    /// last dimension inside device `device`'s chunk (offsets in elements).
    fn walk(&self, shape: &[usize], device: usize, mut f: impl FnMut(usize, usize, usize)) {
        let local = self.shard_shape(shape);
        let chunk = self.chunk_index(device);
        let nd = shape.len();
        // The part of each dimension's chunk inside the tensor: [start, start + len).
        let start: Vec<usize> = (0..nd).map(|d| (chunk[d] * local[d]).min(shape[d])).collect();
        let len: Vec<usize> = (0..nd).map(|d| (shape[d] - start[d]).min(local[d])).collect();
        if len.contains(&0) {
            return;
        }
        if nd == 0 {
            f(0, 0, 1);
            return;
        }
        let gstr = kiln_tensor::contiguous_strides(shape);
        let lstr = kiln_tensor::contiguous_strides(&local);
        let mut idx = vec![0usize; nd - 1];
        loop {
            let (mut g, mut l) = (start[nd - 1], 0);
            for d in 0..nd - 1 {
                g += (start[d] + idx[d]) * gstr[d];
                l += idx[d] * lstr[d];
            }
            f(g, l, len[nd - 1]);
            // Odometer over the outer dimensions.
            let mut d = nd - 1;
            loop {
                if d == 0 {
                    return;
                }
                d -= 1;
                idx[d] += 1;
                if idx[d] < len[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
    }

    /// `#sdy.sharding<@mesh, [{"dp"}, {}]>` (with `unreduced={...}` for partial sums).
    pub fn attr(&self) -> String {
        format!("#sdy.sharding<{}>", self.body())
    }

    /// The sharding without its `#sdy.sharding` wrapper, as `sdy.sharding_constraint` takes it.
    pub fn body(&self) -> String {
        let names = self.mesh.root_axis_names();
        let axes = |v: &[usize]| v.iter().map(|&a| format!("\"{}\"", names[a])).collect::<Vec<_>>().join(", ");
        let dims: Vec<String> = self.dims.iter().map(|d| format!("{{{}}}", axes(d))).collect();
        let mut s = format!("@mesh, [{}]", dims.join(", "));
        if !self.unreduced.is_empty() {
            let mut u = self.unreduced.clone();
            u.sort_unstable();
            s.push_str(&format!(", unreduced={{{}}}", axes(&u)));
        }
        s
    }

    /// Whether every device holds the whole value.
    pub fn is_replicated(&self) -> bool {
        self.dims.iter().all(|d| d.is_empty()) && self.unreduced.is_empty()
    }
}

/// The module-level mesh declaration of a program over `mesh`'s root.
pub fn mesh_decl(mesh: &DeviceMesh) -> String {
    let axes: Vec<String> =
        mesh.root_axis_names().iter().zip(mesh.root_shape()).map(|(n, s)| format!("\"{n}\"={s}")).collect();
    format!("sdy.mesh @mesh = <[{}]>", axes.join(", "))
}

/// Checks that a sharding is over `mesh`'s root (every value of one program is on one mesh).
pub fn check_mesh(s: &Sharding, mesh: &DeviceMesh) -> Result<()> {
    if s.mesh.same_root(mesh) {
        return Ok(());
    }
    Err(Error::device(
        "pjrt",
        format!("expected all tensors to be on the same device mesh, but found {} and {}", s.mesh, mesh.root()),
    ))
}

impl Sharding {
    /// The placements of this sharding on `mesh` (a view of its root), or
    /// `None` when it uses an axis the view does not expose.
    pub fn placements_on(&self, mesh: &DeviceMesh) -> Option<Vec<Placement>> {
        let view: Vec<usize> = (0..mesh.ndim()).map(|i| mesh.root_axis_of(i)).collect();
        let used = self.dims.iter().flatten().chain(&self.unreduced);
        if used.clone().any(|a| !view.contains(a)) {
            return None;
        }
        Some(
            view.iter()
                .map(|a| {
                    if self.unreduced.contains(a) {
                        return Placement::Partial(PartialOp::Sum);
                    }
                    match self.dims.iter().position(|d| d.contains(a)) {
                        Some(d) => Placement::Shard(d),
                        None => Placement::Replicate,
                    }
                })
                .collect(),
        )
    }

    /// The same split without partial sums (what a value becomes once reduced).
    pub fn reduced(&self) -> Sharding {
        Sharding { mesh: self.mesh.clone(), dims: self.dims.clone(), unreduced: vec![] }
    }

    /// The real (unpadded) shape of the mesh's `device`-th device's shard of a tensor of `shape`.
    pub fn real_shard_shape(&self, shape: &[usize], device: usize) -> Vec<usize> {
        let local = self.shard_shape(shape);
        let chunk = self.chunk_index(device);
        (0..shape.len()).map(|d| shape[d].saturating_sub(chunk[d] * local[d]).min(local[d])).collect()
    }
}

// Note [Placements of results]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Any sharding of a result is correct: the partitioner moves data to make the
// program compute the same values whatever the annotations say. So kiln
// chooses result placements by its own rules, per primitive, to keep data
// where it is and to give the placements PyTorch's DTensor gives, rather than
// reading back what the partitioner would have propagated:
// - elementwise ops, casts and copies keep the split of the first input of
//   the result's shape (partial sums are reduced first);
// - a sum over a split dimension leaves a partial sum over its axes
//   (`Partial(sum)`, as DTensor); other reductions over a split dimension
//   replicate it; kept dimensions keep their split;
// - a matmul keeps the rows' split of its left operand and the columns' split
//   of its right one, and a contraction split over the same axes on both
//   sides leaves a partial sum over them;
// - softmax, log-softmax, RMSNorm and logsumexp keep the split of every
//   dimension but the normalised one, and gather the split of its index off
//   the gathered dimension (cross-entropy reads the logits in place);
// - the fused primitives that work row by row (attention and its gradient,
//   rotary embedding, the cross-entropy gradient, RMSNorm's gradient) keep
//   the split of their inputs' first (batch) dimension and read the rest of
//   those inputs, and their other inputs (weights, rotary tables), whole;
//   RMSNorm's weight gradient (a sum over the batch) is replicated;
// - anything else (indexing, sorting, attention, creation ops, ...) is
//   replicated, which is always correct and costs memory and gathers.
// A partial sum is kept only where Shardy keeps it: straight out of the
// reduction or dot that makes it. A result whose lowering does more after
// the reduction (a convert back to a 16-bit type) or that kiln pads (an
// uneven dimension) is reduced instead (`dist::result_sharding`): Shardy
// reduces an unreduced value before such ops, and declaring the result
// unreduced afterwards would make every device's copy count as a partial.
// Inputs keep their split where the partitioner can compute on it, and are
// gathered where it cannot: XLA partitions a reduction over a split dimension
// only when its body is a plain sum, so kiln's NaN-propagating max and min,
// and softmax and RMSNorm along the normalised dimension, first gather that
// dimension; primitives without a rule take whole (replicated) inputs.
// An input that is a view of its storage (a transpose, a slice, an expand) has
// the split of its storage's dimensions when the view only permutes them, and
// counts as replicated otherwise.

/// The sharding of the view `shape` / `strides` / `offset` of a storage of
/// `storage_shape` with sharding `s` (see the Note).
pub fn view_sharding(s: &Sharding, storage_shape: &[usize], layout: &kiln_tensor::Layout) -> Sharding {
    let cs = kiln_tensor::contiguous_strides(storage_shape);
    let (shape, strides) = (layout.shape(), layout.strides());
    let mut dims = vec![vec![]; shape.len()];
    let mut used = vec![false; storage_shape.len()];
    let permutes = layout.offset() == 0
        && shape.len() == storage_shape.len()
        && (0..shape.len()).all(|j| {
            let found = (0..storage_shape.len())
                .find(|&i| !used[i] && storage_shape[i] == shape[j] && (cs[i] == strides[j] || shape[j] == 1));
            match found {
                Some(i) => {
                    used[i] = true;
                    dims[j] = s.dims[i].clone();
                    true
                }
                None => false,
            }
        });
    if permutes {
        Sharding { mesh: s.mesh.clone(), dims, unreduced: s.unreduced.clone() }
    } else {
        Sharding::replicated(&s.mesh, shape.len())
    }
}

/// The sharding input `s` (of `shape`) must have when `op` reads it (see the Note).
pub fn in_sharding(op: &kiln_tensor::Op, input: usize, s: &Sharding, shape: &[usize]) -> Sharding {
    use kiln_tensor::{Op, ReduceOp};
    let gather = |dims: &[usize]| {
        let mut t = s.reduced();
        for &d in dims {
            if d < t.dims.len() {
                t.dims[d].clear();
            }
        }
        t
    };
    let whole = || Sharding::replicated(&s.mesh, shape.len());
    match op {
        Op::Unary(_) | Op::Binary(_) | Op::Compare(_) | Op::Where | Op::Cast(_) | Op::Copy | Op::MatMul => s.reduced(),
        Op::Reduce { op: ReduceOp::Sum | ReduceOp::Mean, .. } => s.reduced(),
        Op::Reduce { dims, .. } => gather(dims),
        Op::Softmax { dim, .. } | Op::LogSumExp { dim } | Op::Gather { dim } => gather(&[*dim]),
        Op::RmsNorm { .. } if !shape.is_empty() => gather(&[shape.len() - 1]),
        Op::Attention { .. }
        | Op::AttentionBackward { .. }
        | Op::Rotary
        | Op::CrossEntropyBackward { .. }
        | Op::RmsNormBackward { .. } => match batch_inputs(op) {
            Some(b) if b.contains(&input) && !shape.is_empty() => gather(&(1..shape.len()).collect::<Vec<_>>()),
            _ => whole(),
        },
        // Read whole: the partitioner cannot split these (or kiln has no rule for them yet).
        Op::RmsNorm { .. }
        | Op::Full { .. }
        | Op::Arange { .. }
        | Op::RandomBits { .. }
        | Op::ArgReduce { .. }
        | Op::Cumsum { .. }
        | Op::GroupedMatMul
        | Op::View(_)
        | Op::Cat { .. }
        | Op::Scatter { .. }
        | Op::IndexSelect { .. }
        | Op::IndexAdd { .. }
        | Op::Sort { .. }
        | Op::TopK { .. }
        | Op::Assign { .. }
        | Op::Collective(_)
        | Op::Dequantize(_)
        | Op::QuantMatMul(_)
        | Op::PagedAttention { .. }
        | Op::Custom(_) => whole(),
    }
}

/// The inputs of a fused primitive that work row by row along their first
/// (batch) dimension, which may stay split (Note [Placements of results]); its
/// other inputs (weights, rotary tables) are read whole.
fn batch_inputs(op: &kiln_tensor::Op) -> Option<&'static [usize]> {
    use kiln_tensor::Op;
    match op {
        Op::Attention { .. } => Some(&[0, 1, 2]),
        Op::AttentionBackward { .. } => Some(&[0, 1, 2, 3, 4, 5]),
        Op::Rotary => Some(&[0]),
        Op::CrossEntropyBackward { .. } => Some(&[0, 1, 2]),
        Op::RmsNormBackward { .. } => Some(&[0, 2, 3]),
        Op::Full { .. }
        | Op::Arange { .. }
        | Op::RandomBits { .. }
        | Op::Unary(_)
        | Op::Binary(_)
        | Op::Compare(_)
        | Op::Where
        | Op::Cast(_)
        | Op::Copy
        | Op::Reduce { .. }
        | Op::ArgReduce { .. }
        | Op::Softmax { .. }
        | Op::RmsNorm { .. }
        | Op::LogSumExp { .. }
        | Op::Cumsum { .. }
        | Op::MatMul
        | Op::GroupedMatMul
        | Op::View(_)
        | Op::Cat { .. }
        | Op::Gather { .. }
        | Op::Scatter { .. }
        | Op::IndexSelect { .. }
        | Op::IndexAdd { .. }
        | Op::Sort { .. }
        | Op::TopK { .. }
        | Op::Assign { .. }
        | Op::Collective(_)
        | Op::Dequantize(_)
        | Op::QuantMatMul(_)
        | Op::PagedAttention { .. }
        | Op::Custom(_) => None,
    }
}

/// The sharding kiln gives output `out` (of `out_shape`) of `op`, from its inputs'
/// shapes and the shardings `in_sharding` gave them (reduced: no partial sums),
/// per Note [Placements of results].
pub fn out_sharding(
    op: &kiln_tensor::Op,
    ins: &[(Vec<usize>, Sharding)],
    out: usize,
    out_shape: &[usize],
    mesh: &DeviceMesh,
) -> Sharding {
    use kiln_tensor::{Op, ReduceOp};
    let rep = Sharding::replicated(mesh, out_shape.len());
    let split = |dims: Vec<Vec<usize>>, unreduced: Vec<usize>| {
        let mut seen = vec![];
        let mut dims = dims;
        // A mesh axis splits one dimension at most: later uses are dropped.
        for d in dims.iter_mut() {
            d.retain(|a| !seen.contains(a));
            seen.extend(d.iter().copied());
        }
        let unreduced = unreduced.into_iter().filter(|a| !seen.contains(a)).collect();
        Sharding { mesh: mesh.root(), dims, unreduced }
    };
    match op {
        Op::Unary(_) | Op::Binary(_) | Op::Compare(_) | Op::Where | Op::Cast(_) | Op::Copy => {
            ins.iter().find(|(shape, s)| shape == out_shape && !s.is_replicated()).map_or(rep, |(_, s)| s.clone())
        }
        Op::Reduce { op: r, dims, keepdim } if out == 0 => {
            let Some((shape, s)) = ins.first() else { return rep };
            let mut kept = vec![];
            let mut partial = vec![];
            for d in 0..shape.len() {
                if dims.contains(&d) {
                    if *r == ReduceOp::Sum {
                        partial.extend(s.dims[d].iter().copied());
                    }
                    if *keepdim {
                        kept.push(vec![]);
                    }
                } else {
                    kept.push(s.dims[d].clone());
                }
            }
            if kept.len() != out_shape.len() {
                return rep;
            }
            split(kept, partial)
        }
        Op::MatMul => {
            let [(ls, l), (rs, r)] = ins else { return rep };
            if ls.len() < 2 || rs.len() < 2 || out_shape.len() < 2 {
                return rep;
            }
            let n = out_shape.len();
            let mut dims = vec![vec![]; n];
            // Batch dimensions of the left operand when it has the result's batch shape.
            if ls.len() == n && ls[..n - 2] == out_shape[..n - 2] {
                dims[..n - 2].clone_from_slice(&l.dims[..n - 2]);
            }
            dims[n - 2] = l.dims[ls.len() - 2].clone();
            dims[n - 1] = r.dims[rs.len() - 1].clone();
            let (lk, rk) = (&l.dims[ls.len() - 1], &r.dims[rs.len() - 2]);
            let partial = if lk == rk { lk.clone() } else { vec![] };
            split(dims, partial)
        }
        Op::LogSumExp { dim } => {
            let Some((_, s)) = ins.first() else { return rep };
            let mut dims = s.dims.clone();
            if *dim >= dims.len() || dims.len() != out_shape.len() + 1 {
                return rep;
            }
            dims.remove(*dim);
            split(dims, vec![])
        }
        // Gather's result has the index's shape: it keeps the index's split off `dim`.
        Op::Gather { dim } => {
            let Some((shape, s)) = ins.get(1) else { return rep };
            if shape != out_shape || *dim >= shape.len() {
                return rep;
            }
            let mut dims = s.dims.clone();
            dims[*dim] = vec![];
            split(dims, vec![])
        }
        Op::Softmax { dim, .. } if out == 0 => {
            let Some((shape, s)) = ins.first() else { return rep };
            if shape != out_shape {
                return rep;
            }
            let mut dims = s.dims.clone();
            dims[*dim] = vec![];
            split(dims, vec![])
        }
        // A batch-wise primitive's outputs of the first input's batch size keep its batch split.
        Op::Attention { .. }
        | Op::AttentionBackward { .. }
        | Op::Rotary
        | Op::CrossEntropyBackward { .. }
        | Op::RmsNormBackward { .. } => {
            let Some((shape, s)) = ins.first() else { return rep };
            let same_batch = out_shape.len() >= 2 && shape.first() == out_shape.first();
            if !same_batch || matches!(op, Op::RmsNormBackward { .. } if out == 1) {
                return rep;
            }
            let mut dims = vec![vec![]; out_shape.len()];
            dims[0] = s.dims[0].clone();
            split(dims, vec![])
        }
        Op::RmsNorm { .. } if out == 1 => {
            // rstd `[...]`: the split of every dimension but the normalised one.
            let Some((shape, s)) = ins.first() else { return rep };
            if shape.len() != out_shape.len() + 1 {
                return rep;
            }
            split(s.dims[..out_shape.len()].to_vec(), vec![])
        }
        Op::RmsNorm { .. } if out == 0 => {
            let Some((shape, s)) = ins.first() else { return rep };
            if shape != out_shape || shape.is_empty() {
                return rep;
            }
            let mut dims = s.dims.clone();
            dims[shape.len() - 1] = vec![];
            split(dims, vec![])
        }
        // Replicated: no rule keeps a split through these (yet).
        Op::Reduce { .. }
        | Op::Softmax { .. }
        | Op::RmsNorm { .. }
        | Op::Full { .. }
        | Op::Arange { .. }
        | Op::RandomBits { .. }
        | Op::ArgReduce { .. }
        | Op::Cumsum { .. }
        | Op::GroupedMatMul
        | Op::View(_)
        | Op::Cat { .. }
        | Op::Scatter { .. }
        | Op::IndexSelect { .. }
        | Op::IndexAdd { .. }
        | Op::Sort { .. }
        | Op::TopK { .. }
        | Op::Assign { .. }
        | Op::Collective(_)
        | Op::Dequantize(_)
        | Op::QuantMatMul(_)
        | Op::PagedAttention { .. }
        | Op::Custom(_) => rep,
    }
}
