//! The shardings of results in programs over a mesh: kiln's placement rule
//! per primitive (Note [Placements of results]). The `Sharding` type itself
//! is module data (`stablehlo/sharding.rs`, Note \[Shardings\]).
pub use crate::stablehlo::sharding::{check_mesh, mesh_decl, Sharding};
use kiln_tensor::DeviceMesh;

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
//   RMSNorm's weight gradient (a sum over the batch) is a partial sum over
//   the batch's split where every mesh axis splits the batch (DDP, FSDP),
//   replicated otherwise (with tensor parallelism, spelling out its inputs'
//   batch split, which a partial sum needs, costs more gathers than the
//   small sum saves);
// - `index_select` (the embedding lookup) keeps the split of its table off
//   the selected dimension and, along it, the split of its index (the
//   tokens' batch); `cat` keeps the split its first split input has off the
//   concatenated dimension (the others are cut to it);
// - anything else (scatters, sorting, creation ops, ...) is replicated,
//   which is always correct and costs memory and gathers.
// A partial sum is kept only where Shardy keeps it: straight out of the
// reduction or dot that makes it. A result whose lowering does more after
// the reduction (a convert back to a 16-bit type) or that kiln pads (an
// uneven dimension) is reduced instead (`dist::result_sharding`): Shardy
// reduces an unreduced value before such ops, and declaring the result
// unreduced afterwards would make every device's copy count as a partial.
// Inputs keep their split where the partitioner can compute on it, and are
// gathered where it cannot (a `gather` over a mesh names the index's batch
// dimensions as gather batching dimensions, so that the partitioner keeps
// them split, `lower/index.rs`): XLA partitions a reduction over a split dimension
// only when its body is a plain sum, so kiln's NaN-propagating max and min,
// and softmax and RMSNorm along the normalised dimension, first gather that
// dimension; primitives without a rule take whole (replicated) inputs.
// An input that is a view of its storage (a transpose, a slice, an expand) has
// the split of its storage's dimensions when the view only permutes them or
// reshapes them keeping each split dimension whole (`[8, 256, 384]` split on
// its batch read as `[384, 2048]`: split on the columns), keeps the split of
// the dimensions a window takes whole (`x[:, 1:]`: split on the rows; views
// are cut on the storage's grid, Note [Views of flat buffers], so the window
// reads no neighbour's rows), and counts as replicated otherwise. A partial
// sum redistributed to a split over its partial axes is one reduce-scatter
// (Note [Partial sums and reduce-scatter] in `mesh.rs`).

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
        reshaped_sharding(s, storage_shape, layout)
            .or_else(|| narrowed_sharding(s, storage_shape, layout))
            .unwrap_or_else(|| Sharding::replicated(&s.mesh, shape.len()))
    }
}

/// The sharding of a window of the storage in its own dimensions (`x[:, 1:]`:
/// the storage's strides, an offset inside it): a split dimension the window
/// takes whole keeps its split; a split dimension it cuts counts as
/// replicated. `None` for any other view.
fn narrowed_sharding(s: &Sharding, storage_shape: &[usize], layout: &kiln_tensor::Layout) -> Option<Sharding> {
    let (shape, strides) = (layout.shape(), layout.strides());
    let cs = kiln_tensor::contiguous_strides(storage_shape);
    if shape.len() != storage_shape.len() || s.dims.len() != shape.len() || strides != cs.as_slice() {
        return None;
    }
    let mut rem = layout.offset();
    let mut dims = vec![vec![]; shape.len()];
    for d in 0..shape.len() {
        let start = rem.checked_div(cs[d]).unwrap_or(0);
        rem -= start * cs[d];
        if start + shape[d] > storage_shape[d] {
            return None;
        }
        if start == 0 && shape[d] == storage_shape[d] {
            dims[d] = s.dims[d].clone();
        }
    }
    (rem == 0).then(|| Sharding { mesh: s.mesh.clone(), dims, unreduced: s.unreduced.clone() })
}

/// The sharding of a view that reads every element of its storage once in
/// another shape and order (a reshape, possibly transposed: `x.view(..).t()`)
/// of a storage split on its first (batch) dimension only: that split over
/// axes `A` (even) goes to the view dimension whose top the first dimension
/// is, when that view dimension's length divides into the same pieces and
/// the storage dimensions it merges below it are not split. Each device then
/// holds the same elements under either reading. `None` for any other view
/// (see the Note: it counts as replicated); a split of other dimensions
/// (features split by a matmul) is not carried through reshapes, whose
/// consumers (attention over heads) XLA's partitioner could then split along
/// their reductions.
fn reshaped_sharding(s: &Sharding, storage_shape: &[usize], layout: &kiln_tensor::Layout) -> Option<Sharding> {
    let (shape, strides) = (layout.shape(), layout.strides());
    let n: usize = storage_shape.iter().product();
    let leading_only = s.dims.iter().skip(1).all(|d| d.is_empty());
    if layout.offset() != 0 || layout.numel() != n || s.dims.len() != storage_shape.len() || !leading_only {
        return None;
    }
    // A bijection onto the storage: the view's dimensions, by stride, are contiguous.
    let mut order: Vec<usize> = (0..shape.len()).filter(|&j| shape[j] > 1).collect();
    order.sort_by_key(|&j| std::cmp::Reverse(strides[j]));
    let mut expect = 1;
    for &j in order.iter().rev() {
        if strides[j] != expect {
            return None;
        }
        expect *= shape[j];
    }
    let cs = kiln_tensor::contiguous_strides(storage_shape);
    let mut dims = vec![vec![]; shape.len()];
    for i in (0..storage_shape.len()).filter(|&i| !s.dims[i].is_empty()) {
        let (pieces, top) = (s.splits(i), cs[i] * storage_shape[i]);
        let j = *order.iter().find(|&&j| strides[j] * shape[j] == top)?;
        let merged_split =
            (i + 1..storage_shape.len()).any(|k| cs[k] * storage_shape[k] > strides[j] && !s.dims[k].is_empty());
        if !storage_shape[i].is_multiple_of(pieces) || !shape[j].is_multiple_of(pieces) || merged_split {
            return None;
        }
        dims[j] = s.dims[i].clone();
    }
    Some(Sharding { mesh: s.mesh.clone(), dims, unreduced: s.unreduced.clone() })
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
        // Taken as it lies; the result's sharding is the move.
        Op::Redistribute(_) => s.clone(),
        // Each device takes its blocks as the region's placements cut them.
        Op::LocalMap(r) => kiln_tensor::DeviceMesh::of_device(kiln_tensor::Device::Mesh(r.device))
            .and_then(|m| Sharding::from_placements(&m, r.in_placements.get(input).map_or(&[], |p| p), shape.len()))
            .unwrap_or_else(|_| whole()),
        Op::Reduce { op: ReduceOp::Sum | ReduceOp::Mean, .. } => s.reduced(),
        Op::Reduce { dims, .. } => gather(dims),
        Op::Softmax { dim, .. } | Op::LogSumExp { dim } | Op::Gather { dim } | Op::Cat { dim } => gather(&[*dim]),
        // The table is read whole along the selected dimension; the index keeps its split.
        Op::IndexSelect { dim } if input == 0 => gather(&[*dim]),
        Op::IndexSelect { .. } => s.reduced(),
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
        | Op::Scatter { .. }
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
        | Op::Redistribute(_)
        | Op::LocalMap(_)
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
        // The placements asked for, on the mesh asked for (its root's axes).
        Op::Redistribute(r) => kiln_tensor::DeviceMesh::of_redistribution(r)
            .and_then(|m| Sharding::from_placements(&m, &r.placements, out_shape.len()))
            .unwrap_or(rep),
        // The blocks the region returns, laid out as its placements say.
        Op::LocalMap(r) => kiln_tensor::DeviceMesh::of_device(kiln_tensor::Device::Mesh(r.device))
            .and_then(|m| Sharding::from_placements(&m, r.out_placements.get(out).map_or(&[], |p| p), out_shape.len()))
            .unwrap_or(rep),
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
        // The table's split off `dim`, and along `dim` the index's.
        Op::IndexSelect { dim } => {
            let [(ts, t), (is, i)] = ins else { return rep };
            if *dim >= ts.len() || is.len() != 1 || ts.len() != out_shape.len() {
                return rep;
            }
            let mut dims = t.dims.clone();
            dims[*dim] = i.dims[0].clone();
            split(dims, vec![])
        }
        // The split off `dim` of the first input that has one (the others are cut to it).
        Op::Cat { dim } => {
            let off_dim = |s: &Sharding| s.dims.iter().enumerate().any(|(d, a)| d != *dim && !a.is_empty());
            let Some((_, s)) = ins.iter().find(|(shape, s)| shape.len() == out_shape.len() && off_dim(s)) else {
                return rep;
            };
            let mut dims = s.dims.clone();
            if *dim >= dims.len() {
                return rep;
            }
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
        // RMSNorm's weight gradient sums over the rows: a partial sum over
        // their split when every axis of the mesh splits them (see the Note).
        Op::RmsNormBackward { .. } if out == 1 => {
            let Some((shape, s)) = ins.first() else { return rep };
            let every_axis = (0..mesh.root_shape().len()).all(|a| s.dims[0].contains(&a));
            if shape.len() < 2 || out_shape.len() != 1 || !every_axis {
                return rep;
            }
            split(vec![vec![]], s.dims[0].clone())
        }
        // A batch-wise primitive's outputs of the first input's batch size keep its batch split.
        Op::Attention { .. }
        | Op::AttentionBackward { .. }
        | Op::Rotary
        | Op::CrossEntropyBackward { .. }
        | Op::RmsNormBackward { .. } => {
            let Some((shape, s)) = ins.first() else { return rep };
            let same_batch = out_shape.len() >= 2 && shape.first() == out_shape.first();
            if !same_batch {
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
        | Op::Scatter { .. }
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
