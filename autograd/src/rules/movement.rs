//! Gradient rules of the views.
use super::*;

/// `Op::View`: the gradient reaches the input through the inverse view (or a strided scatter).
pub(super) fn view(ctx: &Ctx<'_>, g: &Tensor, out: &mut [Option<Tensor>], v: &ViewOp) -> Result<()> {
    if !ctx.needs(0) {
        return Ok(());
    }
    let in_shape = ctx.shape(0).to_vec();
    out[0] = Some(match v {
        ViewOp::Reshape(_) | ViewOp::Squeeze(_) => g.reshape_to(&in_shape)?,
        ViewOp::Unsqueeze(d) => g.squeeze_dim(*d as isize)?,
        ViewOp::Permute(p) => {
            let mut inv = vec![0isize; p.len()];
            for (i, &d) in p.iter().enumerate() {
                inv[d] = i as isize;
            }
            g.permute(&inv)?
        }
        ViewOp::Expand(shape) => {
            let lead = shape.len() - in_shape.len();
            let mut dims: Vec<usize> = (0..lead).collect();
            for (i, &d) in in_shape.iter().enumerate() {
                if d == 1 && shape[lead + i] != 1 {
                    dims.push(lead + i);
                }
            }
            sum_dims(g, &dims, true)?.reshape_to(&in_shape)?
        }
        ViewOp::Slice { .. } | ViewOp::Select { .. } | ViewOp::Diagonal { .. } => {
            // These views never overlap themselves: the gradient is `g` written into
            // zeros at the view's positions (PyTorch's slice_scatter), one pass.
            let l = v.apply(&Layout::contiguous(&in_shape))?;
            let z = zeros(&in_shape, g.dtype(), g)?;
            let op = Op::Assign { shape: l.shape().into(), strides: l.strides().into(), offset: l.offset() };
            prim(op, &[&z, g])?
        }
        ViewOp::AsStrided { shape, strides, offset } => {
            // Both layouts index the input's storage.
            let inp = ctx.edges[0].value.layout().clone();
            let view = Layout::new(shape.clone(), strides.iter().copied().collect(), *offset);
            // Both were bounds-checked against the storage when the view was made.
            let span = |l: &Layout| {
                l.storage_extent().ok_or_else(|| kiln_tensor::Error::index("as_strided", "a view's extent overflows"))
            };
            let extent = span(&view)?.max(span(&inp)?);
            strided_backward(g, &view, &inp, extent)?
        }
    });
    Ok(())
}
