//! `add_rms_norm`, a custom op written outside kiln's op set: the residual
//! add and RMS normalisation of a decoder block fused into one op, with its
//! CPU kernel, its StableHLO lowering and its gradient (Note [Custom ops]).
//! Shared by `examples/custom_op.rs` and the tests.
#![allow(dead_code)]
use kiln::nn::layers::RmsNorm;
use kiln::nn::models::ResidualNorm;
use kiln::tensor::custom::mlir_type;
use kiln::{CustomOp, DType, Error, HostBuffer, HostElement, HostInput, Lowering, Meta, Result, Tensor};
use std::sync::Arc;

const NAME: &str = "add_rms_norm";

/// `(h, y)` with `h = x + residual` and `y = h / sqrt(mean(h², -1) + eps) * weight`
/// over the last dim; inputs `x`, `residual` (one shape) and `weight [D]`,
/// float32 or float64.
pub struct AddRmsNorm {
    pub eps: f64,
}

/// What the CPU kernel needs of its element types.
trait Real: HostElement + Into<f64> {
    fn of(v: f64) -> Self;
}
impl Real for f32 {
    fn of(v: f64) -> f32 {
        v as f32
    }
}
impl Real for f64 {
    fn of(v: f64) -> f64 {
        v
    }
}

/// One pass per row: `h` rounded to the dtype, the mean square of the
/// rounded `h` accumulated in f64, `y = (h * rstd) * w` rounded once.
fn rows<T: Real>(ins: &[HostInput<'_>], eps: f64) -> Result<Vec<HostBuffer>> {
    let (x, r, w) = (ins[0].contiguous::<T>()?, ins[1].contiguous::<T>()?, ins[2].contiguous::<T>()?);
    let d = w.len();
    let (mut h, mut y) = (Vec::with_capacity(x.len()), Vec::with_capacity(x.len()));
    for (xr, rr) in x.chunks_exact(d).zip(r.chunks_exact(d)) {
        let start = h.len();
        h.extend(xr.iter().zip(rr).map(|(&a, &b)| T::of(a.into() + b.into())));
        let ss: f64 = h[start..].iter().map(|&v| v.into() * v.into()).sum();
        let rstd = 1.0 / (ss / d as f64 + eps).sqrt();
        y.extend(h[start..].iter().zip(w.iter()).map(|(&v, &wv)| T::of(v.into() * rstd * wv.into())));
    }
    Ok(vec![T::into_buffer(h), T::into_buffer(y)])
}

impl CustomOp for AddRmsNorm {
    fn name(&self) -> &'static str {
        NAME
    }

    fn infer(&self, inputs: &[Meta]) -> Result<Vec<Meta>> {
        let [x, r, w] = inputs else {
            return Err(Error::invalid(NAME, format!("takes x, residual and weight, got {} inputs", inputs.len())));
        };
        let d = x.shape.last().copied().unwrap_or(0);
        if d == 0 || x.shape != r.shape || w.shape.as_slice() != [d] {
            let msg = format!(
                "needs x and residual of one shape [..., D > 0] and weight [D], got {:?}, {:?}, {:?}",
                x.shape, r.shape, w.shape
            );
            return Err(Error::shape(NAME, msg));
        }
        if !matches!(x.dtype, DType::F32 | DType::F64) || r.dtype != x.dtype || w.dtype != x.dtype {
            let msg =
                format!("needs float32 or float64 inputs of one dtype, got {}, {}, {}", x.dtype, r.dtype, w.dtype);
            return Err(Error::dtype(NAME, msg));
        }
        Ok(vec![x.clone(), x.clone()])
    }

    fn cpu(&self, inputs: &[HostInput<'_>], _outputs: &[Meta]) -> Result<Vec<HostBuffer>> {
        match inputs[0].dtype() {
            DType::F64 => rows::<f64>(inputs, self.eps),
            _ => rows::<f32>(inputs, self.eps),
        }
    }

    /// The same arithmetic in StableHLO (pretty form), on `%arg0..%arg2`.
    fn stablehlo(&self, inputs: &[Meta], _outputs: &[Meta]) -> Result<Lowering> {
        let (x, dt) = (&inputs[0].shape, inputs[0].dtype);
        let rank = x.len();
        let (t, row, s) = (mlir_type(x, dt), mlir_type(&x[..rank - 1], dt), mlir_type(&[], dt));
        let (w, lead) = (mlir_type(&x[rank - 1..], dt), (0..rank - 1).map(|i| i.to_string()).collect::<Vec<_>>());
        let (d, eps, last) = (x[rank - 1] as f64, self.eps, rank - 1);
        Ok(Lowering::Function(format!(
            "    %h = stablehlo.add %arg0, %arg1 : {t}
    %sq = stablehlo.multiply %h, %h : {t}
    %zero = stablehlo.constant dense<0.0> : {s}
    %ss = stablehlo.reduce(%sq init: %zero) applies stablehlo.add across dimensions = [{last}] : ({t}, {s}) -> {row}
    %n = stablehlo.constant dense<{d:.1}> : {row}
    %eps = stablehlo.constant dense<{eps:.17e}> : {row}
    %ms = stablehlo.divide %ss, %n : {row}
    %var = stablehlo.add %ms, %eps : {row}
    %rstd = stablehlo.rsqrt %var : {row}
    %rb = stablehlo.broadcast_in_dim %rstd, dims = [{}] : ({row}) -> {t}
    %wb = stablehlo.broadcast_in_dim %arg2, dims = [{last}] : ({w}) -> {t}
    %xn = stablehlo.multiply %h, %rb : {t}
    %y = stablehlo.multiply %xn, %wb : {t}
    return %h, %y : {t}, {t}",
            lead.join(", ")
        )))
    }

    /// With `n = h * rstd`: `dh = gh + rstd * (gy w - n mean(gy w n))`, the
    /// same for `x` and `residual`; `dw = sum(gy n)` over the rows.
    fn backward(&self, inputs: &[Tensor], outputs: &[Tensor], grads: &[Option<Tensor>]) -> Result<Vec<Option<Tensor>>> {
        let (w, h) = (&inputs[2], &outputs[0]);
        let rstd = h.square()?.mean_dim(-1, true)?.add(self.eps)?.rsqrt()?;
        let n = h.mul(&rstd)?;
        let (mut dh, mut dw) = (grads[0].clone(), None);
        if let Some(gy) = &grads[1] {
            let gw = gy.mul(w)?;
            let dy = rstd.mul(&gw.sub(&n.mul(&gw.mul(&n)?.mean_dim(-1, true)?)?)?)?;
            dh = Some(match dh {
                Some(g) => g.add(&dy)?,
                None => dy,
            });
            let (gn, lead) = (gy.mul(&n)?, (0..h.ndim() - 1).collect::<Vec<usize>>());
            dw = Some(if lead.is_empty() { gn } else { gn.sum_dim(lead.as_slice(), false)? });
        }
        Ok(vec![dh.clone(), dh, dw])
    }
}

/// `add_rms_norm(x, residual, weight, eps)`: `(x + residual, norm)`.
pub fn add_rms_norm(x: &Tensor, residual: &Tensor, weight: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let op: Arc<dyn CustomOp> = Arc::new(AddRmsNorm { eps });
    let mut out = Tensor::apply_custom(&op, &[x, residual, weight])?;
    let y = out.pop().expect("two outputs");
    Ok((out.pop().expect("two outputs"), y))
}

/// The op as a Llama block's residual add and post-attention norm
/// (`LlamaForCausalLM::set_residual_norm`). Dtypes the op does not take
/// (bfloat16 models) keep the built-in ops.
pub fn residual_norm() -> ResidualNorm {
    ResidualNorm(Arc::new(|x: &Tensor, a: &Tensor, norm: &RmsNorm| {
        if matches!(x.dtype(), DType::F32 | DType::F64) && norm.weight.dtype() == x.dtype() {
            add_rms_norm(x, a, &norm.weight, norm.eps)
        } else {
            let h = x.add(a)?;
            Ok((h.clone(), norm.forward(&h)?))
        }
    }))
}
