//! CPU kernels for every primitive of `kiln_tensor::Op`, dispatched from `exec`.
//!
//! By concern: `iter` (strided loop nests and threading), `map` (elementwise
//! engines), `simd` (CPU-feature dispatch and vectorisable f32 math), `elem`
//! (what kernels need from each element type), `elementwise` (unary, binary,
//! compare, where), `copy` (full, arange, cast, copies, assign, cat), `reduce`
//! (reductions, arg-reductions, cumsum), `softmax` (fused softmax and log_softmax), `matmul` (and `rowdot` and
//! `rowdot_bf16`, its dot-product ways for `x @ W.T`; `grouped`, one product per group of rows),
//! `attention` (fused scaled dot-product attention and its gradients), `rotary`
//! (rotary position embedding), `norm` (RMS normalisation and its gradients), `index` (gather, scatter,
//! index_select, index_add, nonzero), `quant` (block-quantized weights, and
//! `quant_rowdot`, their few-row products with codes decoded in the
//! registers), `paged` (paged KV caches), `sort` (sort, topk) and `random`
//! (Philox random bits).
//!
//! Inputs are read through their strided layouts directly; every output is a
//! fresh contiguous buffer of the shape and dtype `Op::infer` gave.
mod attention;
mod attention_tiles;
mod copy;
mod elem;
mod elementwise;
mod fused;
mod gemm_bf16;
mod grouped;
mod index;
mod iter;
mod map;
mod matmul;
mod norm;
mod paged;
mod quant;
mod quant_int8;
mod quant_rowdot;
mod random;
mod reduce;
mod rotary;
mod rowdot;
mod rowdot_bf16;
mod simd;
mod softmax;
mod sort;
#[cfg(test)]
mod tests;

pub(crate) use copy::{assign, materialize};
pub(crate) use fused::CpuFuser;
pub(crate) use index::nonzero;
pub(crate) use norm::rms_norm_rounded;
pub(crate) use rotary::widened as rotary_widened;
pub(crate) use softmax::{cross_entropy_backward_widened, logsumexp_widened};

use kiln_tensor::{Error, HostBuffer, HostElement, Layout, Meta, Op, Result};

/// A read-only strided input: a host buffer and the layout viewing it (the
/// type custom ops' CPU kernels receive).
pub(crate) use kiln_tensor::HostInput as Input;

/// Runs one primitive on strided inputs, returning one contiguous buffer per output.
pub(crate) fn exec(op: &Op, ins: &[Input<'_>], outs: &[Meta]) -> Result<Vec<HostBuffer>> {
    let name = op.name();
    if op.arity().is_some_and(|n| n != ins.len()) || (matches!(op, Op::Cat { .. }) && ins.is_empty()) {
        return Err(Error::invalid(name, format!("got {} inputs", ins.len())));
    }
    for x in ins {
        x.layout.check_bounds(name, x.buf.len())?;
    }
    let out = |i: usize| -> Result<&Meta> {
        outs.get(i).ok_or_else(|| Error::backend("cpu", format!("{name}: missing output metadata")))
    };
    let bufs = match op {
        Op::Full { shape, value, dtype } => vec![copy::full(shape, *value, *dtype)],
        Op::Arange { start, step, len, dtype } => vec![copy::arange(*start, *step, *len, *dtype)],
        Op::RandomBits { .. } => random::random_bits(&ins[0], out(0)?.shape.iter().product())?,
        Op::Unary(u) => vec![elementwise::unary(*u, &ins[0])?],
        Op::Binary(b) => vec![elementwise::binary(*b, &ins[0], &ins[1])?],
        Op::Compare(c) => vec![elementwise::compare(*c, &ins[0], &ins[1])?],
        Op::Where => vec![elementwise::where_(&ins[0], &ins[1], &ins[2])?],
        Op::Cast(to) => vec![copy::cast(&ins[0], *to)?],
        Op::Copy => vec![materialize(&ins[0])?],
        Op::Reduce { op, dims, keepdim: _ } => vec![reduce::reduce(*op, &ins[0], dims, out(0)?)?],
        Op::ArgReduce { op, dim, keepdim: _ } => vec![reduce::arg_reduce(*op, &ins[0], *dim)?],
        Op::Cumsum { dim } => vec![reduce::cumsum(&ins[0], *dim)?],
        Op::Softmax { dim, log } => vec![softmax::softmax(&ins[0], *dim, *log)?],
        Op::LogSumExp { dim } => vec![softmax::logsumexp(&ins[0], *dim)?],
        Op::MatMul => vec![matmul::matmul(&ins[0], &ins[1], out(0)?)?],
        Op::GroupedMatMul => vec![grouped::grouped_mm(&ins[0], &ins[1], &ins[2], out(0)?)?],
        Op::Dequantize(spec) => vec![quant::dequantize(spec, &ins[0], &ins[1])?],
        Op::QuantMatMul(spec) => vec![quant::quant_matmul(spec, &ins[0], &ins[1], &ins[2])?],
        Op::Rotary => vec![rotary::rotary(&ins[0], &ins[1], &ins[2])?],
        Op::RmsNorm { eps } => norm::rms_norm(&ins[0], &ins[1], *eps)?,
        Op::RmsNormBackward { .. } => norm::rms_norm_backward(ins)?,
        Op::CrossEntropyBackward { smoothing } => {
            vec![softmax::cross_entropy_backward(&ins[0], &ins[1], &ins[2], *smoothing)?]
        }
        Op::Attention { scale, causal } => attention::forward(ins, *scale, *causal)?,
        Op::AttentionBackward { scale, causal } => attention::backward(ins, *scale, *causal)?,
        Op::PagedAttention { scale, .. } => vec![paged::paged_attention(ins, *scale)?],
        Op::Custom(c) => c.cpu(ins, outs)?,
        Op::Cat { dim } => vec![copy::cat(ins, *dim, out(0)?)?],
        Op::Gather { dim } => vec![index::gather(&ins[0], &ins[1], *dim)?],
        Op::Scatter { dim, reduce } => vec![index::scatter(&ins[0], &ins[1], &ins[2], *dim, *reduce)?],
        Op::IndexSelect { dim } => vec![index::index_select(&ins[0], &ins[1], *dim, out(0)?)?],
        Op::IndexAdd { dim } => vec![index::index_add(&ins[0], &ins[1], &ins[2], *dim)?],
        Op::Sort { dim, descending, stable: _ } => {
            // Sorting is always stable: equal keys keep their order, as torch.sort(stable=True).
            let (v, i) = sort::sort(&ins[0], *dim, *descending)?;
            vec![v, i]
        }
        Op::TopK { k, dim, largest } => {
            let (v, i) = sort::topk(&ins[0], *k, *dim, *largest)?;
            vec![v, i]
        }
        Op::Assign { shape, strides, offset } => {
            let view = Layout::new(shape.clone(), strides.iter().copied().collect(), *offset);
            vec![copy::assign_out_of_place(&ins[0], &view, &ins[1])?]
        }
        Op::Collective(c) => {
            return Err(Error::device(
                c.name(),
                "collectives run inside kiln::local_map over a device mesh; the CPU backend has no meshes",
            ))
        }
        Op::LocalMap(_) => {
            return Err(Error::device(
                "local_map",
                "local regions run over device meshes; the CPU backend has no meshes",
            ))
        }
        Op::Redistribute(_) => {
            return Err(Error::device(
                "redistribute",
                "redistribute places tensors on device meshes; the CPU backend has no meshes",
            ))
        }
        Op::View(v) => {
            return Err(Error::backend(
                "cpu",
                format!("view op {} reached the backend; views are layout transforms of the tensor layer", v.name()),
            ))
        }
    };
    if bufs.len() != outs.len() {
        return Err(Error::backend(
            "cpu",
            format!("{name}: kernel produced {} outputs, {} expected", bufs.len(), outs.len()),
        ));
    }
    for (b, m) in bufs.iter().zip(outs) {
        if b.dtype() != m.dtype || b.len() != kiln_tensor::numel(&m.shape) {
            return Err(Error::backend(
                "cpu",
                format!(
                    "{name}: kernel produced {} x {} but {:?} x {} was expected",
                    b.len(),
                    b.dtype(),
                    m.shape.as_slice(),
                    m.dtype
                ),
            ));
        }
    }
    Ok(bufs)
}

/// Wraps a typed vector into a `HostBuffer`.
pub(crate) fn buf<T: HostElement>(v: Vec<T>) -> HostBuffer {
    T::into_buffer(v)
}
