//! Gradient rules of the reductions.
use super::*;

/// `Op::Reduce`.
pub(super) fn reduce(
    ctx: &Ctx<'_>,
    g: &Tensor,
    out: &mut [Option<Tensor>],
    op: &ReduceOp,
    dims: &SmallVec<[usize; 6]>,
    keepdim: &bool,
) -> Result<()> {
    if !ctx.needs(0) {
        return Ok(());
    }
    let shape = ctx.shape(0).to_vec();
    let all_dims: Vec<usize> = if dims.is_empty() { vec![] } else { dims.to_vec() };
    let gi = unreduce(g, &all_dims, *keepdim, &shape)?;
    out[0] = match op {
        ReduceOp::Sum => Some(gi),
        ReduceOp::Mean => {
            let count: usize = all_dims.iter().map(|&d| shape[d]).product();
            Some(gi.div(count as f64)?)
        }
        ReduceOp::Prod => {
            // Exact with zeros: d prod / d x_i is the product of the other elements.
            let x = ctx.saved(0)?;
            let keep = |t: &Tensor| t.broadcast_to(&shape);
            let is_zero = x.eq(0.0)?;
            let reduce = Op::Reduce { op: ReduceOp::Prod, dims: dims.clone(), keepdim: true };
            let p_nz = keep(&prim(reduce, &[&Tensor::where_cond(&is_zero, 1.0, x)?])?)?;
            let zc = keep(&sum_dims(&is_zero.to_dtype(DType::I64)?, &all_dims, true)?)?;
            let one_zero = Tensor::where_cond(&is_zero, &p_nz, 0.0)?;
            let d = Tensor::where_cond(&zc.eq(0)?, &p_nz.div(x)?, &Tensor::where_cond(&zc.eq(1)?, &one_zero, 0.0)?)?;
            Some(gi.mul(&d)?)
        }
        ReduceOp::Max | ReduceOp::Min => {
            // Ties share the gradient evenly (amax/amin semantics).
            let x = ctx.saved(0)?;
            let m = prim(Op::Reduce { op: *op, dims: dims.clone(), keepdim: true }, &[x])?;
            let mask = x.eq(&m.broadcast_to(&shape)?)?.to_dtype(g.dtype())?;
            let cnt = sum_dims(&mask, &all_dims, true)?;
            Some(gi.mul(&mask)?.div(&cnt.broadcast_to(&shape)?)?)
        }
        ReduceOp::Any | ReduceOp::All => None,
    };
    Ok(())
}
