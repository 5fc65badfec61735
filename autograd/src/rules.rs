//! One gradient rule per primitive, in one exhaustive `match`: given the
//! gradients of a node's outputs, build the gradients of its inputs out of
//! tensor ops (so backward is itself made of primitives).
use kiln_tensor::quant::{Activations, QuantSpec};
use kiln_tensor::{
    ArgReduceOp, BinaryOp, DType, Edge, Layout, Op, ReduceOp, Result, ScatterReduce, Shape, Tensor, UnaryOp, ViewOp,
};
use smallvec::SmallVec;

mod elementwise;
mod indexing;
mod movement;
mod reduce;

/// What a rule sees: the node's primitive and input edges.
pub(crate) struct Ctx<'a> {
    pub op: &'a Op,
    pub edges: &'a [Edge],
}

impl Ctx<'_> {
    /// The saved value of input `i`, refusing one modified in place since the op ran.
    pub fn saved(&self, i: usize) -> Result<&Tensor> {
        self.edges[i].saved(self.op.name(), i)
    }
    fn needs(&self, i: usize) -> bool {
        self.edges[i].requires_grad
    }
    fn shape(&self, i: usize) -> &[usize] {
        self.edges[i].value.shape()
    }
    fn dtype(&self, i: usize) -> DType {
        self.edges[i].value.dtype()
    }
}

/// Float32 elements of a quantized weight dequantized at once by a backward:
/// 4 MiB, so that QLoRA's backward never holds a whole large weight in float32.
const DEQUANT_CHUNK_ELEMS: usize = 1 << 20;

/// `g @ W` (float32) for `W [out, in]` quantized as `codes` and `scales`:
/// the rows of `W` dequantized in chunks of whole scale blocks of at most
/// [`DEQUANT_CHUNK_ELEMS`] elements, each chunk's product summed.
fn quant_input_grad(spec: &QuantSpec, g: &Tensor, codes: &Tensor, scales: &Tensor) -> Result<Tensor> {
    let [out, inp] = spec.weight_shape(codes.shape());
    let br = spec.block[0].max(1);
    let rows = (DEQUANT_CHUNK_ELEMS / inp.max(1)).max(br) / br * br;
    let g = g.to_dtype(DType::F32)?;
    let mut dx: Option<Tensor> = None;
    for start in (0..out).step_by(rows.max(1)) {
        let n = rows.min(out - start);
        let c = codes.narrow(0, start as isize, n)?;
        let s = scales.narrow(0, (start / br) as isize, n.div_ceil(br))?;
        let w = prim(Op::Dequantize(spec.clone()), &[&c, &s])?;
        let part = g.narrow(-1, start as isize, n)?.matmul(&w)?;
        dx = Some(match dx {
            None => part,
            Some(d) => d.add(&part)?,
        });
    }
    dx.ok_or_else(|| kiln_tensor::Error::shape("quant_matmul", "a quantized weight with no rows"))
}

fn prim(op: Op, inputs: &[&Tensor]) -> Result<Tensor> {
    Tensor::apply1(op, inputs)
}

fn sum_dims(g: &Tensor, dims: &[usize], keepdim: bool) -> Result<Tensor> {
    if dims.is_empty() {
        return Ok(g.clone());
    }
    prim(Op::Reduce { op: ReduceOp::Sum, dims: dims.iter().copied().collect(), keepdim }, &[g])
}

/// Brings a reduced gradient back to the input shape (undoing `keepdim = false`).
fn unreduce(g: &Tensor, dims: &[usize], keepdim: bool, shape: &[usize]) -> Result<Tensor> {
    let mut g = g.clone();
    if !keepdim {
        for &d in dims {
            g = g.unsqueeze(d as isize)?;
        }
    }
    g.broadcast_to(shape)
}

fn zeros(shape: &[usize], dtype: DType, like: &Tensor) -> Result<Tensor> {
    Tensor::zeros(shape, (dtype, like.device()))
}

/// Flat storage indices (int64) of the elements of `l`, in row-major order of `l`'s shape.
fn layout_indices(l: &Layout, device: kiln_tensor::Device) -> Result<Tensor> {
    let mut idx = Tensor::full(&[], l.offset() as i64, (DType::I64, device))?;
    for (d, (&n, &s)) in l.shape().iter().zip(l.strides()).enumerate() {
        let mut shape: SmallVec<[usize; 6]> = SmallVec::from_elem(1, l.ndim());
        shape[d] = n;
        let r = Tensor::arange(0.0, n as f64, 1.0, (DType::I64, device))?.mul(s as i64)?.reshape_to(&shape)?;
        idx = idx.add(&r)?;
    }
    idx.broadcast_to(l.shape())?.contiguous()
}

/// Gradient of a strided read: scatters (adding, so overlapping views are right)
/// `g` into a zero buffer of `extent` elements at the positions of `view`, then
/// reads it back through `input` (both layouts in the same flat index space).
fn strided_backward(g: &Tensor, view: &Layout, input: &Layout, extent: usize) -> Result<Tensor> {
    let dev = g.device();
    let buf = zeros(&[extent], g.dtype(), g)?;
    let vi = layout_indices(view, dev)?.reshape(&[-1])?;
    let flat = prim(Op::IndexAdd { dim: 0 }, &[&buf, &vi, &g.reshape(&[-1])?])?;
    let ii = layout_indices(input, dev)?.reshape(&[-1])?;
    prim(Op::IndexSelect { dim: 0 }, &[&flat, &ii])?.reshape_to(input.shape())
}

/// `silu''(x) = d/dx [s (1 + x (1 - s))] = s (1 - s) (2 + x (1 - 2 s))`, `s = sigmoid(x)`.
fn silu_second_derivative(x: &Tensor) -> Result<Tensor> {
    let s = x.sigmoid()?;
    let one_minus = s.neg()?.add(1.0)?;
    let inner = x.mul(&s.mul(-2.0)?.add(1.0)?)?.add(2.0)?;
    s.mul(&one_minus)?.mul(&inner)
}

/// Whether the last two dims of `t` are stored column-major (a transposed view).
fn is_transposed(t: &Tensor) -> bool {
    let (s, st) = (t.shape(), t.strides());
    let n = s.len();
    n >= 2 && s[n - 2] > 1 && s[n - 1] > 1 && st[n - 2] == 1 && st[n - 1] >= s[n - 2]
}

fn transpose_last(t: &Tensor) -> Result<Tensor> {
    t.transpose(-1, -2)
}

/// The gradients of the inputs of a primitive node, given the gradients of its outputs.
pub(crate) fn backward(ctx: &Ctx<'_>, grads: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
    let n = ctx.edges.len();
    let mut out: Vec<Option<Tensor>> = vec![None; n];
    if let Op::Custom(c) = ctx.op {
        return custom_backward(ctx, c, grads);
    }
    let g = match grads.first() {
        Some(Some(g)) => g.clone(),
        // Only attention's log-sum-exp output got a gradient: `out`'s is zero.
        _ if matches!(ctx.op, Op::Attention { .. }) && matches!(grads.get(1), Some(Some(_))) => {
            let (q, v) = (ctx.shape(0), ctx.shape(2));
            zeros(&[q[0], q[1], q[2], v[3]], ctx.dtype(0), &ctx.edges[0].value)?
        }
        _ if matches!(ctx.op, Op::RmsNorm { .. }) && matches!(grads.get(1), Some(Some(_))) => {
            zeros(ctx.shape(0), ctx.dtype(0), &ctx.edges[0].value)?
        }
        _ => return Ok(out),
    };
    match ctx.op {
        Op::Full { .. } | Op::Arange { .. } | Op::RandomBits { .. } => {}
        Op::Unary(u) => elementwise::unary(ctx, &g, &mut out, u)?,
        Op::Binary(b) => elementwise::binary(ctx, &g, &mut out, b)?,
        Op::Compare(_) => {}
        Op::Where => {
            let c = ctx.saved(0)?;
            if ctx.needs(1) {
                out[1] = Some(Tensor::where_cond(c, &g, 0.0)?);
            }
            if ctx.needs(2) {
                out[2] = Some(Tensor::where_cond(c, 0.0, &g)?);
            }
        }
        Op::Cast(_) => {
            if ctx.needs(0) {
                out[0] = Some(g.to_dtype(ctx.dtype(0))?);
            }
        }
        Op::Copy => out[0] = ctx.needs(0).then(|| g.clone()),
        Op::Reduce { op, dims, keepdim } => reduce::reduce(ctx, &g, &mut out, op, dims, keepdim)?,
        Op::ArgReduce { op: ArgReduceOp::ArgMax | ArgReduceOp::ArgMin, .. } => {}
        Op::Softmax { dim, log } => {
            if ctx.needs(0) {
                out[0] = Some(softmax_backward(ctx.saved(0)?, &g, *dim, *log)?);
            }
        }
        Op::Rotary => {
            // out = x * cos + R(x) * sin with R(x) = [-x2, x1]; R^T(y) = [y2, -y1], so
            // dx = g * cos + R^T(g * sin) = rotary(g, cos, -swap_halves(sin)).
            let (x, cos, sin) = (ctx.saved(0)?, ctx.saved(1)?, ctx.saved(2)?);
            let n = x.ndim();
            let h = (x.shape()[n - 1] / 2) as isize;
            let swap = |t: &Tensor| Tensor::cat(&[&t.narrow(-1, h, h as usize)?, &t.narrow(-1, 0, h as usize)?], -1);
            if ctx.needs(0) {
                out[0] = Some(prim(Op::Rotary, &[&g, cos, &swap(sin)?.neg()?])?);
            }
            let lead: Vec<usize> = (0..n - 2).collect();
            if ctx.needs(1) {
                out[1] = Some(sum_dims(&g.mul(x)?, &lead, false)?);
            }
            if ctx.needs(2) {
                let rx = Tensor::cat(&[&x.narrow(-1, h, h as usize)?.neg()?, &x.narrow(-1, 0, h as usize)?], -1)?;
                out[2] = Some(sum_dims(&g.mul(&rx)?, &lead, false)?);
            }
        }
        Op::Attention { scale, causal } => {
            // Reached only when the primitive is applied directly (the tensor method records
            // its own node, which keeps `out` and `lse`): recompute them.
            let [q, k, v] = [0, 1, 2].map(|i| ctx.saved(i));
            let (q, k, v) = (q?, k?, v?);
            let outs = {
                let _off = kiln_tensor::GradModeGuard::set(false);
                Tensor::apply(ctx.op.clone(), &[q, k, v])?
            };
            let g_lse = grads.get(1).and_then(|g| g.as_ref());
            let grads = kiln_tensor::attention_grads([q, k, v, &outs[0], &outs[1]], &g, g_lse, *scale, *causal)?;
            for (i, gi) in grads.into_iter().enumerate() {
                if ctx.needs(i) {
                    out[i] = Some(gi);
                }
            }
        }
        Op::RmsNorm { eps } => {
            // Reached only when the primitive is applied directly (`Tensor::rms_norm`
            // records its own node, which keeps rstd): recompute it.
            let (x, w) = (ctx.saved(0)?, ctx.saved(1)?);
            let rstd = {
                let _off = kiln_tensor::GradModeGuard::set(false);
                Tensor::apply(ctx.op.clone(), &[x, w])?.swap_remove(1)
            };
            let g_rstd = grads.get(1).and_then(|g| g.as_ref());
            let grads = kiln_tensor::rms_norm_grads([x, w, &rstd], &g, g_rstd, *eps)?;
            for (i, gi) in grads.into_iter().enumerate() {
                if ctx.needs(i) {
                    out[i] = Some(gi);
                }
            }
        }
        Op::AttentionBackward { .. } | Op::CrossEntropyBackward { .. } | Op::RmsNormBackward { .. } => {
            return Err(kiln_tensor::Error::invalid(
                ctx.op.name(),
                "this fused gradient kernel is not differentiable; a backward with create_graph builds the gradient from differentiable ops instead",
            ));
        }
        Op::LogSumExp { dim } => {
            if ctx.needs(0) {
                let p = prim(Op::Softmax { dim: *dim, log: false }, &[ctx.saved(0)?])?;
                out[0] = Some(p.mul(&g.unsqueeze(*dim as isize)?)?);
            }
        }
        Op::Cumsum { dim } => {
            if ctx.needs(0) {
                // Reverse cumulative sum: total - cumsum(g) + g.
                let total = sum_dims(&g, &[*dim], true)?.broadcast_to(g.shape())?;
                let c = prim(Op::Cumsum { dim: *dim }, &[&g])?;
                out[0] = Some(total.sub(&c)?.add(&g)?);
            }
        }
        Op::MatMul => {
            // Each gradient is computed in the memory order of its input: for an input
            // that is a transposed view (a weight `W` used as `x @ W^T`), the product is
            // formed transposed and handed back as a transposed view, so the gradient
            // reaching `W` is contiguous instead of needing a copy.
            let (a, b) = (ctx.saved(0)?, ctx.saved(1)?);
            if ctx.needs(0) {
                out[0] = Some(if is_transposed(a) {
                    transpose_last(&prim(Op::MatMul, &[b, &transpose_last(&g)?])?)?
                } else {
                    prim(Op::MatMul, &[&g, &transpose_last(b)?])?
                });
            }
            if ctx.needs(1) {
                out[1] = Some(if is_transposed(b) {
                    transpose_last(&prim(Op::MatMul, &[&transpose_last(&g)?, a])?)?
                } else {
                    prim(Op::MatMul, &[&transpose_last(a)?, &g])?
                });
            }
        }
        // Each form's gradients are products of the two forms over the same
        // groups (Note [Grouped products]); the sizes are integers.
        Op::GroupedMatMul => {
            let (a, b, sizes) = (ctx.saved(0)?, ctx.saved(1)?, ctx.saved(2)?);
            let grouped = |x: &Tensor, y: &Tensor| prim(Op::GroupedMatMul, &[x, y, sizes]);
            if b.ndim() == 3 {
                // a [M, K], b [G, K, N], g [M, N]
                if ctx.needs(0) {
                    out[0] = Some(grouped(&g, &transpose_last(b)?)?);
                }
                if ctx.needs(1) {
                    out[1] = Some(grouped(&a.t()?, &g)?);
                }
            } else {
                // a [K, M], b [M, N], g [G, K, N]
                if ctx.needs(0) {
                    out[0] = Some(grouped(b, &transpose_last(&g)?)?.t()?);
                }
                if ctx.needs(1) {
                    out[1] = Some(grouped(&a.t()?, &g)?);
                }
            }
        }
        Op::View(v) => movement::view(ctx, &g, &mut out, v)?,
        Op::Cat { dim } => {
            let mut start = 0;
            for (i, out_i) in out.iter_mut().enumerate() {
                let len = ctx.shape(i)[*dim];
                if ctx.needs(i) {
                    *out_i = Some(g.narrow(*dim as isize, start as isize, len)?);
                }
                start += len;
            }
        }
        Op::Gather { dim } => {
            if ctx.needs(0) {
                let idx = ctx.saved(1)?;
                let z = zeros(ctx.shape(0), g.dtype(), &g)?;
                out[0] = Some(prim(Op::Scatter { dim: *dim, reduce: ScatterReduce::Add }, &[&z, idx, &g])?);
            }
        }
        Op::Scatter { dim, reduce } => indexing::scatter(ctx, &g, &mut out, dim, reduce)?,
        Op::IndexSelect { dim } => {
            if ctx.needs(0) {
                let idx = ctx.saved(1)?;
                let z = zeros(ctx.shape(0), g.dtype(), &g)?;
                out[0] = Some(prim(Op::IndexAdd { dim: *dim }, &[&z, &idx.reshape(&[-1])?, &g])?);
            }
        }
        Op::IndexAdd { dim } => {
            out[0] = ctx.needs(0).then(|| g.clone());
            if ctx.needs(2) {
                out[2] = Some(prim(Op::IndexSelect { dim: *dim }, &[&g, ctx.saved(1)?])?);
            }
        }
        Op::Sort { dim, .. } | Op::TopK { dim, .. } => {
            // Recompute the permutation (deterministic) and send values' gradients back.
            if ctx.needs(0) {
                let x = ctx.saved(0)?;
                let outs = Tensor::apply(ctx.op.clone(), &[x])?;
                let z = zeros(ctx.shape(0), g.dtype(), &g)?;
                out[0] = Some(prim(Op::Scatter { dim: *dim, reduce: ScatterReduce::Add }, &[&z, &outs[1], &g])?);
            }
        }
        Op::Assign { shape, strides, offset } => {
            // Output = base with `src` written at the layout: the base keeps the gradient
            // outside the written region, `src` gets the region.
            let view = Layout::new(shape.clone(), strides.iter().copied().collect(), *offset);
            let g = g.contiguous()?;
            let region: Shape = shape.clone();
            if ctx.needs(1) {
                out[1] = Some(g.as_strided(&region, view.strides(), Some(view.offset()))?.contiguous()?);
            }
            if ctx.needs(0) {
                let z = zeros(&region, g.dtype(), &g)?;
                out[0] = Some(prim(ctx.op.clone(), &[&g, &z])?);
            }
        }
        // Codes and scales are integer / float8 data, never differentiable: only
        // the input of a quantized product gets a gradient, `g @ W` with `W`
        // dequantized a block of rows at a time (a frozen quantized layer under
        // a trainable adapter: QLoRA).
        Op::Dequantize(_) => {}
        Op::QuantMatMul(spec) => {
            if ctx.needs(0) {
                // Note [Int8 activations]: rounding has no useful derivative.
                match spec.activations {
                    Activations::Exact => {}
                    Activations::Int8 => {
                        return Err(kiln_tensor::Error::invalid(
                            "quant_matmul",
                            "a product with int8 activations has no gradient for its input (it serves inference); \
                             use Activations::Exact to train through it",
                        ))
                    }
                }
                let dx = quant_input_grad(spec, &g, ctx.saved(1)?, ctx.saved(2)?)?;
                out[0] = Some(dx.to_dtype(ctx.dtype(0))?);
            }
        }
        // Inference only (`Tensor::paged_attention` refuses inputs that need a
        // gradient); a graph holding it differentiates to an error, never zeros.
        Op::PagedAttention { .. } => {
            return Err(kiln_tensor::Error::invalid(
                "paged_attention",
                "paged attention has no gradient (it serves inference)",
            ));
        }
        // Answered before the gradient of the first output is looked at.
        Op::Custom(_) => {}
        // Recorded outside autograd: `kiln::local_map` gives a region its
        // gradient (the adjoint region), so a graph never holds this op.
        Op::LocalMap(_) => {
            return Err(kiln_tensor::Error::invalid(
                "local_map",
                "a local region's gradient comes from kiln::local_map, not from the region as an op",
            ));
        }
        // The same values: the gradient passes through as it is placed (a
        // distributed leaf's gradient takes the leaf's placements as it accumulates).
        Op::Redistribute(_) => out[0] = Some(g.clone()),
        // A collective's adjoint carries the gradient back (Note [Local regions]).
        Op::Collective(c) => {
            if ctx.needs(0) {
                out[0] = Some(prim(Op::Collective(c.adjoint()), &[&g])?);
            }
        }
    }
    Ok(out)
}

/// A custom op applied through `Tensor::apply` (not `Tensor::apply_custom`,
/// which keeps its outputs): the outputs are recomputed from the saved
/// inputs, then the op's own gradient runs (Note [Custom ops]).
fn custom_backward(
    ctx: &Ctx<'_>,
    c: &kiln_tensor::custom::CustomOpRef,
    grads: &[Option<Tensor>],
) -> Result<Vec<Option<Tensor>>> {
    let inputs = (0..ctx.edges.len()).map(|i| ctx.saved(i).cloned()).collect::<Result<Vec<_>>>()?;
    let outputs = {
        let _off = kiln_tensor::GradModeGuard::set(false);
        Tensor::apply(ctx.op.clone(), &inputs.iter().collect::<Vec<_>>())?.into_vec()
    };
    let needed: Vec<bool> = ctx.edges.iter().map(|e| e.requires_grad).collect();
    c.gradients(&inputs, &outputs, grads, &needed)
}

/// The gradient of `softmax` / `log_softmax` along `dim`, from the input `x`.
///
/// A dedicated rule rather than the gradient of the five primitives softmax used
/// to be made of: with `y = softmax(x)`, `dx = y * (g - sum(g * y))`, and for
/// `log_softmax`, `dx = g - y * sum(g)`. Both are exact cancellations of the
/// max-shift and the normaliser that differentiating `x - max - log(sum(exp))`
/// term by term only reaches through large intermediate terms (the exp of a
/// large logit times the reciprocal of a large sum), and they cost two passes
/// instead of a dozen. `y` is recomputed from `x` (one fused pass) rather than
/// saved. Half precision computes in float32 and rounds once, like PyTorch.
fn softmax_backward(x: &Tensor, g: &Tensor, dim: usize, log: bool) -> Result<Tensor> {
    if x.ndim() == 0 {
        // A single element: softmax is the constant 1 and log_softmax the constant 0.
        return zeros(&[], g.dtype(), g);
    }
    let half = matches!(x.dtype(), DType::BF16 | DType::F16);
    let (x32, g32) = if half { (x.to_dtype(DType::F32)?, g.to_dtype(DType::F32)?) } else { (x.clone(), g.clone()) };
    let y = prim(Op::Softmax { dim, log: false }, &[&x32])?;
    let shape = x.shape();
    let dx = if log {
        g32.sub(&y.mul(&sum_dims(&g32, &[dim], true)?.broadcast_to(shape)?)?)?
    } else {
        y.mul(&g32.sub(&sum_dims(&g32.mul(&y)?, &[dim], true)?.broadcast_to(shape)?)?)?
    };
    if half {
        dx.to_dtype(x.dtype())
    } else {
        Ok(dx)
    }
}
