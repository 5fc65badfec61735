//! Gradient rules of the indexing primitives.
use super::*;

/// `Op::Scatter`.
pub(super) fn scatter(
    ctx: &Ctx<'_>,
    g: &Tensor,
    out: &mut [Option<Tensor>],
    dim: &usize,
    reduce: &ScatterReduce,
) -> Result<()> {
    let idx = ctx.saved(1)?;
    if ctx.needs(0) {
        out[0] = Some(match reduce {
            ScatterReduce::Add => g.clone(),
            ScatterReduce::Replace => {
                let z = zeros(ctx.shape(2), g.dtype(), g)?;
                prim(Op::Scatter { dim: *dim, reduce: ScatterReduce::Replace }, &[g, idx, &z])?
            }
        });
    }
    if ctx.needs(2) {
        let gs = prim(Op::Gather { dim: *dim }, &[g, idx])?;
        // gather returns the index's shape; src may be larger (only the indexed part is used).
        let src_shape = ctx.shape(2).to_vec();
        out[2] = Some(if gs.shape() == src_shape.as_slice() {
            gs
        } else {
            let z = zeros(&src_shape, g.dtype(), g)?;
            let l = Layout::contiguous(&src_shape);
            let view = Layout::new(gs.shape().into(), l.strides().into(), 0);
            let src_grad = strided_backward(&gs, &view, &l, src_shape.iter().product())?;
            z.add(&src_grad)?
        });
    }
    Ok(())
}
