//! Composites written once in terms of primitives and other tensor ops:
//! softmax, log_softmax, cumsum, tril/triu, sort/argsort/topk, embedding,
//! rms_norm, layer_norm, dropout and cross_entropy.
//!
//! Half-precision inputs (bf16, f16) compute the numerically delicate parts in
//! float32 and cast the result back, as PyTorch does with its `opmath` type.
use crate::error::fmt_shape;
use crate::reduce::reshape_result;
use crate::{wrap_dim, DType, Error, Op, Result, Shape, Tensor};
use smallvec::SmallVec;
use std::sync::Arc;

/// How a loss reduces its per-element values (PyTorch's `reduction=`).
///
/// Also parses from PyTorch's strings: `"mean".parse::<Reduction>()?`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reduction {
    /// The mean over the elements that count (for cross entropy: the targets
    /// that are not ignored).
    #[default]
    Mean,
    /// The sum.
    Sum,
    /// No reduction: one value per element.
    None,
}

impl std::str::FromStr for Reduction {
    type Err = Error;
    fn from_str(s: &str) -> Result<Reduction> {
        match s {
            "mean" => Ok(Reduction::Mean),
            "sum" => Ok(Reduction::Sum),
            "none" => Ok(Reduction::None),
            _ => {
                Err(Error::invalid("reduction", format!("{s:?} is not a valid value for reduction (mean, sum, none)")))
            }
        }
    }
}

/// float32 for half-precision floats, the dtype itself otherwise.
fn opmath(dt: DType) -> DType {
    match dt {
        DType::F16 | DType::BF16 => DType::F32,
        d => d,
    }
}

fn float_only(op: &'static str, x: &Tensor) -> Result<()> {
    if !x.dtype().is_float() {
        return Err(Error::unsupported_dtype(op, x.dtype()));
    }
    Ok(())
}

/// `x[n, t[n]]` of logits `x [N, C, ...]` at class indices `t`; an index out of
/// range is PyTorch's cross-entropy error ("Target 10 is out of bounds."),
/// not the gather's (the gather checks the indices, on the CPU and on the device).
fn pick_targets(x: &Tensor, t: &Tensor) -> Result<Tensor> {
    let picked = x.gather(1, &t.unsqueeze(1)?).map_err(|e| match &e {
        Error::Index { op: "gather", msg } => {
            let v = msg.strip_prefix("index ").and_then(|m| m.split(' ').next()).unwrap_or("?");
            Error::index("cross_entropy", format!("Target {v} is out of bounds."))
        }
        _ => e,
    })?;
    picked.squeeze_dim(1)
}

/// A 0-d zero of `x`'s dtype and device (keeps `where` from promoting).
fn zero_like(x: &Tensor) -> Result<Tensor> {
    Tensor::zeros(&[], (x.dtype(), x.device()))
}

impl Tensor {
    // ---- softmax ------------------------------------------------------------------

    /// `exp(x) / sum(exp(x))` along `dim`, computed stably (the max is subtracted
    /// first). Like PyTorch, a slice holding `+inf` or made only of `-inf` gives
    /// NaN. Floating dtypes only; bf16/f16 compute in float32.
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let x = Tensor::new([[1000.0f32, 1000.0], [0.0, f32::NEG_INFINITY]])?;
    /// assert_eq!(x.softmax(-1)?.to_vec::<f32>()?, vec![0.5, 0.5, 1.0, 0.0]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn softmax(&self, dim: isize) -> Result<Tensor> {
        if let Some(x) = crate::autocast::widened(self)? {
            return x.softmax(dim);
        }
        float_only("softmax", self)?;
        let d = wrap_dim("softmax", dim, self.ndim())?;
        if self.ndim() == 0 {
            // A 0-d tensor is one slice of one element: every backend's op sees a 1-d one.
            return self.reshape(&[1])?.softmax(0)?.reshape(&[]);
        }
        Tensor::apply1(Op::Softmax { dim: d, log: false }, &[self])
    }

    /// `log(softmax(x))` along `dim`, computed as `(x - max) - log(sum(exp(x - max)))`.
    /// Same NaN rules and dtypes as [`Tensor::softmax`].
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let x = Tensor::new([0.0f32, 0.0])?;
    /// let y = x.log_softmax(0)?.to_vec::<f32>()?;
    /// assert!((y[0] + 2f32.ln()).abs() < 1e-6);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn log_softmax(&self, dim: isize) -> Result<Tensor> {
        if let Some(x) = crate::autocast::widened(self)? {
            return x.log_softmax(dim);
        }
        float_only("log_softmax", self)?;
        let d = wrap_dim("log_softmax", dim, self.ndim())?;
        if self.ndim() == 0 {
            // A 0-d tensor is one slice of one element: every backend's op sees a 1-d one.
            return self.reshape(&[1])?.log_softmax(0)?.reshape(&[]);
        }
        Tensor::apply1(Op::Softmax { dim: d, log: true }, &[self])
    }

    // ---- cumsum ---------------------------------------------------------------------

    /// Inclusive prefix sum along `dim`. Integers and bool accumulate in int64.
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let x = Tensor::new([[1i32, 2, 3], [4, 5, 6]])?;
    /// let c = x.cumsum(1)?;
    /// assert_eq!(c.dtype(), DType::I64);
    /// assert_eq!(c.to_vec::<i64>()?, vec![1, 3, 6, 4, 9, 15]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn cumsum(&self, dim: isize) -> Result<Tensor> {
        if let Some(x) = crate::autocast::widened(self)? {
            return x.cumsum(dim);
        }
        let d = wrap_dim("cumsum", dim, self.ndim())?;
        if self.ndim() == 0 {
            return reshape_result(Tensor::apply1(Op::Cumsum { dim: 0 }, &[&self.reshape(&[1])?])?, &[]);
        }
        Tensor::apply1(Op::Cumsum { dim: d }, &[self])
    }

    // ---- tril, triu ------------------------------------------------------------------

    /// Keeps `[i, j]` where `j - i <= diagonal` over the last two dims (the lower
    /// triangle for `diagonal = 0`), zeros elsewhere. Works on batches.
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let x = Tensor::ones(&[2, 3], DType::F32)?;
    /// assert_eq!(x.tril(0)?.to_vec::<f32>()?, vec![1.0, 0.0, 0.0, 1.0, 1.0, 0.0]);
    /// assert_eq!(x.triu(1)?.to_vec::<f32>()?, vec![0.0, 1.0, 1.0, 0.0, 0.0, 1.0]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn tril(&self, diagonal: i64) -> Result<Tensor> {
        let keep = self.diagonal_offsets("tril")?.le(diagonal)?;
        Tensor::where_cond(&keep, self, &zero_like(self)?)
    }

    /// Keeps `[i, j]` where `j - i >= diagonal` over the last two dims (the upper
    /// triangle for `diagonal = 0`), zeros elsewhere.
    pub fn triu(&self, diagonal: i64) -> Result<Tensor> {
        let keep = self.diagonal_offsets("triu")?.ge(diagonal)?;
        Tensor::where_cond(&keep, self, &zero_like(self)?)
    }

    /// In-place [`Tensor::tril`].
    pub fn tril_(&self, diagonal: i64) -> Result<&Tensor> {
        let _x = self.storage().exclusive();
        let r = self.tril(diagonal)?;
        self.copy_(&r)
    }

    /// In-place [`Tensor::triu`].
    pub fn triu_(&self, diagonal: i64) -> Result<&Tensor> {
        let _x = self.storage().exclusive();
        let r = self.triu(diagonal)?;
        self.copy_(&r)
    }

    /// `j - i` for every position `[i, j]` of the last two dims (int64, `[m, n]`).
    fn diagonal_offsets(&self, op: &'static str) -> Result<Tensor> {
        if self.ndim() < 2 {
            return Err(Error::shape(op, "input tensor must have at least 2 dimensions"));
        }
        let (m, n) = (self.shape()[self.ndim() - 2], self.shape()[self.ndim() - 1]);
        let opts = (DType::I64, self.device());
        let rows = Tensor::arange(0.0, m as f64, 1.0, opts)?.reshape(&[m as isize, 1])?;
        let cols = Tensor::arange(0.0, n as f64, 1.0, opts)?;
        cols.sub(&rows)
    }

    // ---- sort, argsort, topk ----------------------------------------------------------

    fn sort_impl(&self, op: &'static str, dim: isize, descending: bool, stable: bool) -> Result<(Tensor, Tensor)> {
        let d = wrap_dim(op, dim, self.ndim())?;
        if self.ndim() == 0 {
            let (v, i) = self.reshape(&[1])?.sort_impl(op, 0, descending, stable)?;
            return Ok((reshape_result(v, &[])?, reshape_result(i, &[])?));
        }
        let mut out = Tensor::apply(Op::Sort { dim: d, descending, stable }, &[self])?;
        let i = out.pop().expect("sort has two outputs");
        let v = out.pop().expect("sort has two outputs");
        Ok((v, i))
    }

    /// Sorts along `dim`: `(values, indices)` with `indices` (int64) the
    /// positions of the values in `self`. NaN sorts as the largest value. The
    /// order of equal elements is unspecified; see [`Tensor::sort_stable`].
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let x = Tensor::new([3.0f32, 1.0, 2.0])?;
    /// let (v, i) = x.sort(0, true)?;
    /// assert_eq!(v.to_vec::<f32>()?, vec![3.0, 2.0, 1.0]);
    /// assert_eq!(i.to_vec::<i64>()?, vec![0, 2, 1]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn sort(&self, dim: isize, descending: bool) -> Result<(Tensor, Tensor)> {
        self.sort_impl("sort", dim, descending, false)
    }

    /// [`Tensor::sort`] keeping equal elements in their original order.
    pub fn sort_stable(&self, dim: isize, descending: bool) -> Result<(Tensor, Tensor)> {
        self.sort_impl("sort", dim, descending, true)
    }

    /// The indices that sort `self` along `dim` (int64).
    pub fn argsort(&self, dim: isize, descending: bool) -> Result<Tensor> {
        Ok(self.sort_impl("argsort", dim, descending, false)?.1)
    }

    /// The `k` largest (or, with `largest = false`, smallest) elements along
    /// `dim` and their indices. The values always come sorted (`sorted = false`
    /// only allows any order, as in PyTorch).
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let x = Tensor::new([1.0f32, 5.0, 3.0, 4.0])?;
    /// let (v, i) = x.topk(2, -1, true, true)?;
    /// assert_eq!(v.to_vec::<f32>()?, vec![5.0, 4.0]);
    /// assert_eq!(i.to_vec::<i64>()?, vec![1, 3]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn topk(&self, k: usize, dim: isize, largest: bool, sorted: bool) -> Result<(Tensor, Tensor)> {
        let _ = sorted;
        let d = wrap_dim("topk", dim, self.ndim())?;
        if self.ndim() == 0 {
            let (v, i) = self.reshape(&[1])?.topk(k, 0, largest, true)?;
            return Ok((reshape_result(v, &[])?, reshape_result(i, &[])?));
        }
        let mut out = Tensor::apply(Op::TopK { k, dim: d, largest }, &[self])?;
        let i = out.pop().expect("topk has two outputs");
        let v = out.pop().expect("topk has two outputs");
        Ok((v, i))
    }

    // ---- embedding -------------------------------------------------------------------

    /// `torch.nn.functional.embedding(ids, weight)`: the rows of `weight`
    /// (`[num_embeddings, dim]`) at `ids` (an integer tensor of any shape);
    /// the result has shape `ids.shape + [dim]`.
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let w = Tensor::new([[0.0f32, 0.0], [1.0, 1.0], [2.0, 2.0]])?;
    /// let ids = Tensor::new([[2i64, 0]])?;
    /// let e = Tensor::embedding(&w, &ids)?;
    /// assert_eq!(e.shape(), &[1, 2, 2]);
    /// assert_eq!(e.to_vec::<f32>()?, vec![2.0, 2.0, 0.0, 0.0]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn embedding(weight: &Tensor, ids: &Tensor) -> Result<Tensor> {
        if weight.ndim() != 2 {
            return Err(Error::shape(
                "embedding",
                format!("'weight' must be 2-D, got shape {}", fmt_shape(weight.shape())),
            ));
        }
        if !ids.dtype().is_int() {
            return Err(Error::dtype(
                "embedding",
                format!("expected the indices to have an integer dtype (int64 or int32), but got {}", ids.dtype()),
            ));
        }
        let rows = weight.index_select(0, &ids.reshape(&[-1])?)?;
        let mut shape: Shape = ids.shape().into();
        shape.push(weight.shape()[1]);
        // Multi-dim ids pay a copy here (see Note [Results are not views]).
        reshape_result(rows, &shape)
    }

    // ---- normalisation ------------------------------------------------------------------

    /// RMS normalisation (`torch.nn.functional.rms_norm`): `x / sqrt(mean(x^2) + eps)`
    /// over the last dim, or over the last `weight.ndim()` dims when a `weight`
    /// is given (its shape must equal those dims), then times `weight`.
    /// Half-precision inputs compute in float32; the result has `self`'s dtype.
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let x = Tensor::new([[3.0f32, 4.0]])?;
    /// let y = x.rms_norm(None, 0.0)?.to_vec::<f32>()?;       // rms = sqrt(12.5)
    /// assert!((y[0] - 3.0 / 12.5f32.sqrt()).abs() < 1e-6);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn rms_norm(&self, weight: Option<&Tensor>, eps: f64) -> Result<Tensor> {
        if let Some(x) = crate::autocast::widened(self)? {
            return x.rms_norm(weight, eps);
        }
        float_only("rms_norm", self)?;
        let k = weight.map_or(1, |w| w.ndim().max(1));
        let dims = self.trailing_dims("rms_norm", k, weight, "weight")?;
        let full_precision = matches!(self.dtype(), DType::F32 | DType::F64);
        if k == 1 && full_precision && weight.is_none_or(|w| w.ndim() == 1 && w.dtype() == self.dtype()) {
            return self.rms_norm_fused(weight, eps);
        }
        let x = self.to_dtype(opmath(self.dtype()))?;
        let ms = x.mul(&x)?.mean_dim(dims.as_slice(), true)?;
        let mut y = x.mul(&ms.add(eps)?.rsqrt()?)?;
        if let Some(w) = weight {
            y = y.mul(&w.to_dtype(opmath(w.dtype()))?)?;
        }
        y.to_dtype(self.dtype())
    }

    /// [`Tensor::rms_norm`] over the last dim through the fused `Op::RmsNorm`
    /// (float32 and float64 with a weight of the same dtype): one pass forward,
    /// one backward (`Op::RmsNormBackward`, reusing the saved `rstd`), recorded
    /// as one autograd node; with `create_graph` the gradients are composed of
    /// differentiable ops instead.
    fn rms_norm_fused(&self, weight: Option<&Tensor>, eps: f64) -> Result<Tensor> {
        const OP: &str = "rms_norm";
        let d = self.shape()[self.ndim() - 1];
        let ones = match weight {
            Some(_) => None,
            None => Some(Tensor::ones(&[d], (self.dtype(), self.device()))?),
        };
        let w = weight.or(ones.as_ref()).expect("a weight or ones");
        let outs = {
            let _off = crate::GradModeGuard::set(false);
            Tensor::apply(Op::RmsNorm { eps }, &[self, w])?
        };
        let (y, rstd) = (outs[0].clone(), outs[1].clone());
        let backward: crate::CustomBackward = Arc::new(move |grads, edges| {
            let Some(g) = &grads[0] else { return Ok(vec![None; edges.len()]) };
            let x = edges[0].saved(OP, 0)?;
            let w = match &ones {
                Some(o) => o,
                None => edges[1].saved(OP, 1)?,
            };
            let [dx, dw] = rms_norm_grads([x, w, &rstd], g, None, eps)?;
            let mut out = vec![edges[0].requires_grad.then_some(dx)];
            if edges.len() > 1 {
                out.push(edges[1].requires_grad.then_some(dw));
            }
            Ok(out)
        });
        match weight {
            Some(w) => Tensor::record_custom(OP, &[self, w], &[&y], backward),
            None => Tensor::record_custom(OP, &[self], &[&y], backward),
        }
        Ok(y)
    }

    /// Layer normalisation (`torch.nn.functional.layer_norm`) over the trailing
    /// `normalized_shape` dims: `(x - mean) / sqrt(var + eps) * weight + bias`
    /// with the biased variance. Half-precision inputs compute in float32.
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let x = Tensor::new([[1.0f32, 3.0]])?;
    /// let y = x.layer_norm(&[2], None, None, 0.0)?;
    /// assert_eq!(y.to_vec::<f32>()?, vec![-1.0, 1.0]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn layer_norm(
        &self,
        normalized_shape: &[usize],
        weight: Option<&Tensor>,
        bias: Option<&Tensor>,
        eps: f64,
    ) -> Result<Tensor> {
        if let Some(x) = crate::autocast::widened(self)? {
            return x.layer_norm(normalized_shape, weight, bias, eps);
        }
        float_only("layer_norm", self)?;
        let k = normalized_shape.len();
        let n = self.ndim();
        if k > n || self.shape()[n - k..] != *normalized_shape {
            return Err(Error::shape(
                "layer_norm",
                format!(
                    "Given normalized_shape={}, expected input with shape [*, {}], but got input of size{}",
                    fmt_shape(normalized_shape),
                    normalized_shape.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", "),
                    fmt_shape(self.shape())
                ),
            ));
        }
        for (t, what) in [(weight, "weight"), (bias, "bias")] {
            if let Some(t) = t {
                if t.shape() != normalized_shape {
                    return Err(Error::shape(
                        "layer_norm",
                        format!(
                            "Expected {what} to be of same shape as normalized_shape, but got {what} of shape {} and normalized_shape = {}",
                            fmt_shape(t.shape()),
                            fmt_shape(normalized_shape)
                        ),
                    ));
                }
            }
        }
        let x = self.to_dtype(opmath(self.dtype()))?;
        let mut y = if k == 0 {
            // Each element is its own group: (x - x) / sqrt(0 + eps).
            x.sub(&x)?
        } else {
            let dims: SmallVec<[usize; 6]> = (n - k..n).collect();
            let mean = x.mean_dim(dims.as_slice(), true)?;
            let xc = x.sub(&mean)?;
            let var = xc.mul(&xc)?.mean_dim(dims.as_slice(), true)?;
            xc.mul(&var.add(eps)?.rsqrt()?)?
        };
        if let Some(w) = weight {
            y = y.mul(&w.to_dtype(opmath(w.dtype()))?)?;
        }
        if let Some(b) = bias {
            y = y.add(&b.to_dtype(opmath(b.dtype()))?)?;
        }
        y.to_dtype(self.dtype())
    }

    /// The last `k` dims, checking that `t` (if any) has exactly their shape.
    fn trailing_dims(
        &self,
        op: &'static str,
        k: usize,
        t: Option<&Tensor>,
        what: &str,
    ) -> Result<SmallVec<[usize; 6]>> {
        let n = self.ndim();
        if n < k || n == 0 {
            return Err(Error::shape(
                op,
                format!("expected an input with at least {} dims, got shape {}", k.max(1), fmt_shape(self.shape())),
            ));
        }
        if let Some(t) = t {
            if t.ndim() > 0 && t.shape() != &self.shape()[n - k..] {
                return Err(Error::shape(
                    op,
                    format!(
                        "expected {what} of shape {} (the last dims of the input {}), got {}",
                        fmt_shape(&self.shape()[n - k..]),
                        fmt_shape(self.shape()),
                        fmt_shape(t.shape())
                    ),
                ));
            }
        }
        Ok((n - k..n).collect())
    }

    // ---- cross entropy ---------------------------------------------------------------------

    /// Cross entropy of unnormalised `self` (logits `[N, C]`, `[N, C, d1, ...]`
    /// or `[C]`) against class indices `target` (integer, `[N]`,
    /// `[N, d1, ...]` or 0-d): `-log_softmax(self, 1)[n, target[n]]`, reduced.
    /// Targets equal to `ignore_index` contribute nothing, and `Mean` divides by
    /// the number of the others (NaN when there are none, as in PyTorch).
    /// [`Tensor::cross_entropy_with`] also takes label smoothing.
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let logits = Tensor::new([[0.0f32, 0.0], [0.0, 0.0]])?;
    /// let target = Tensor::new([0i64, -100])?;
    /// let loss = logits.cross_entropy(&target, Some(-100), Reduction::Mean)?;
    /// assert!((loss.item::<f32>()? - 2f32.ln()).abs() < 1e-6);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn cross_entropy(&self, target: &Tensor, ignore_index: Option<i64>, reduction: Reduction) -> Result<Tensor> {
        self.cross_entropy_with(target, CrossEntropy { ignore_index, reduction, label_smoothing: 0.0 })
    }

    /// Rotary position embedding as transformers applies it to a query or key:
    /// `self * cos + rotate_half(self) * sin` for `self: [..., T, d]` (`d` even)
    /// and tables `cos, sin: [T, d]`, where `rotate_half(x) = cat(-x[..., d/2:],
    /// x[..., :d/2])`. One fused pass (`Op::Rotary`) that rounds like the
    /// unfused expression; differentiable in all three inputs.
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let x = Tensor::new([[1.0f32, 2.0, 3.0, 4.0]])?;
    /// let (c, s) = (0.5f32, 0.25f32);
    /// let out = x.rotary_embedding(&Tensor::full(&[1, 4], c, DType::F32)?, &Tensor::full(&[1, 4], s, DType::F32)?)?;
    /// assert_eq!(out.to_vec::<f32>()?, [1.0 * c - 3.0 * s, 2.0 * c - 4.0 * s, 3.0 * c + 1.0 * s, 4.0 * c + 2.0 * s]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn rotary_embedding(&self, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        // Mixed dtypes promote, as the unfused `x * cos + rotate_half(x) * sin` does
        // (a bfloat16 query from an autocast projection with float32 tables).
        let dt = DType::promote(DType::promote(self.dtype(), cos.dtype()), sin.dtype());
        if dt != self.dtype() || dt != cos.dtype() || dt != sin.dtype() {
            return self.to_dtype(dt)?.rotary_embedding(&cos.to_dtype(dt)?, &sin.to_dtype(dt)?);
        }
        Tensor::apply1(Op::Rotary, &[self, cos, sin])
    }

    /// `F.cross_entropy` with all its options for class-index targets (see
    /// [`CrossEntropy`]). With label smoothing `ε` over `C` classes the target
    /// distribution is `(1 - ε) onehot + ε / C`: the loss is
    /// `(1 - ε) nll + ε / C * sum_c(-log_softmax)`, reduced like the plain loss.
    ///
    /// The loss is one autograd node with a dedicated gradient rule, `(softmax -
    /// (1 - ε) onehot - ε / C) * g`, zero at ignored targets: differentiating
    /// `log_softmax`, `gather` and `where` one by one would scatter the picked
    /// gradient into a zero tensor of the logits' size, mask it, and run
    /// log_softmax's rule on it: about seven passes over `[N, C]` (the largest
    /// tensor of a language model's step) where this formula needs three.
    ///
    /// ```
    /// use kiln::prelude::*;
    /// use kiln::tensor::CrossEntropy;
    /// let logits = Tensor::new([[2.0f32, 0.0]])?;
    /// let target = Tensor::new([0i64])?;
    /// let opts = CrossEntropy { label_smoothing: 0.2, ..Default::default() };
    /// let loss = logits.cross_entropy_with(&target, opts)?.item::<f32>()?;
    /// let lp = [-(1.0f32 + (-2.0f32).exp()).ln(), -(1.0f32 + 2f32.exp()).ln()];
    /// assert!((loss - (-0.8 * lp[0] - 0.1 * (lp[0] + lp[1]))).abs() < 1e-6);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn cross_entropy_with(&self, target: &Tensor, opts: CrossEntropy) -> Result<Tensor> {
        if let Some(x) = crate::autocast::widened(self)? {
            return x.cross_entropy_with(target, opts);
        }
        const OP: &str = "cross_entropy";
        float_only(OP, self)?;
        if !target.dtype().is_int() {
            return Err(Error::dtype(
                OP,
                format!(
                    "expected target dtype to be an integer dtype (class indices), but got {}; class-probability targets are not supported",
                    target.dtype()
                ),
            ));
        }
        let eps = opts.label_smoothing;
        if !(0.0..=1.0).contains(&eps) {
            return Err(Error::invalid(OP, format!("label_smoothing must be between 0.0 and 1.0. Got: {eps}")));
        }
        if self.ndim() == 1 {
            if target.ndim() != 0 {
                return Err(Error::shape(
                    OP,
                    format!(
                        "logits of shape {} need a 0-d target, got shape {}",
                        fmt_shape(self.shape()),
                        fmt_shape(target.shape())
                    ),
                ));
            }
            let loss = self.unsqueeze(0)?.cross_entropy_with(&target.unsqueeze(0)?, opts)?;
            return if opts.reduction == Reduction::None { reshape_result(loss, &[]) } else { Ok(loss) };
        }
        let mut want: Shape = self.shape().into();
        if self.ndim() >= 2 {
            want.remove(1);
        }
        if self.ndim() < 2 || target.shape() != want.as_slice() {
            return Err(Error::shape(
                OP,
                format!(
                    "expected logits [N, C, ...] and a target of shape {}, got logits {} and target {}",
                    fmt_shape(&want),
                    fmt_shape(self.shape()),
                    fmt_shape(target.shape())
                ),
            ));
        }
        let target = target.to_dtype(DType::I64)?;
        let valid = match opts.ignore_index {
            Some(ii) => Some(target.ne(ii)?),
            None => None,
        };
        // Ignored targets pick class 0 (any valid index); their terms are masked out.
        let safe = match &valid {
            Some(v) => Tensor::where_cond(v, &target, &zero_like(&target)?)?,
            None => target,
        };
        let loss = {
            let _off = crate::GradModeGuard::set(false);
            cross_entropy_forward(self, &safe, valid.as_ref(), opts)?
        };
        let backward: crate::CustomBackward = Arc::new(move |grads, edges| {
            let Some(g) = &grads[0] else { return Ok(vec![None]) };
            let x = edges[0].saved(OP, 0)?;
            Ok(vec![Some(cross_entropy_backward(x, &safe, valid.as_ref(), opts, g)?)])
        });
        Tensor::record_custom(OP, &[self], &[&loss], backward);
        Ok(loss)
    }
}

/// The gradients `[dx, dw]` of `Op::RmsNorm` given `[x, w, rstd]`, the gradient
/// `g` of `y` and optionally `g_rstd` of `rstd`. Uses the fused
/// `Op::RmsNormBackward` unless grad mode is on (a backward with `create_graph`)
/// or `g_rstd` is given: then the gradients are composed of differentiable
/// primitives, with `rstd` recomputed from `x`.
pub fn rms_norm_grads(saved: [&Tensor; 3], g: &Tensor, g_rstd: Option<&Tensor>, eps: f64) -> Result<[Tensor; 2]> {
    let [x, w, rstd] = saved;
    if !crate::is_grad_enabled() && g_rstd.is_none() {
        let r = Tensor::apply(Op::RmsNormBackward { eps }, &[x, w, rstd, g])?;
        return Ok([r[0].clone(), r[1].clone()]);
    }
    let r = x.mul(x)?.mean_dim(-1, true)?.add(eps)?.rsqrt()?;
    let yhat = x.mul(&r)?;
    let gw = g.mul(w)?;
    let mut dx = r.mul(&gw.sub(&yhat.mul(&gw.mul(&yhat)?.mean_dim(-1, true)?)?)?)?;
    if let Some(gr) = g_rstd {
        // d rstd / dx = -rstd³ x / D.
        let d = x.shape()[x.ndim() - 1] as f64;
        let r3 = r.mul(&r)?.mul(&r)?.mul(-1.0 / d)?;
        dx = dx.add(&x.mul(&r3)?.mul(&gr.to_dtype(x.dtype())?.unsqueeze(-1)?)?)?;
    }
    let lead: Vec<isize> = (0..x.ndim() as isize - 1).collect();
    let dw = g.mul(&yhat)?.sum_dim(lead.as_slice(), false)?;
    Ok([dx, dw])
}

/// Options of [`Tensor::cross_entropy_with`], PyTorch's `F.cross_entropy`
/// keyword arguments for class-index targets. The default is PyTorch's:
/// `ignore_index = -100`, mean reduction, no label smoothing.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CrossEntropy {
    /// Targets equal to this contribute nothing (`None`: every target counts).
    pub ignore_index: Option<i64>,
    pub reduction: Reduction,
    /// `ε` in `[0, 1]`: the target distribution is `(1 - ε) onehot + ε / C`.
    pub label_smoothing: f64,
}

impl Default for CrossEntropy {
    fn default() -> Self {
        CrossEntropy { ignore_index: Some(-100), reduction: Reduction::Mean, label_smoothing: 0.0 }
    }
}

/// The number of targets a mean divides by (those not ignored), 0-d of dtype `ct`.
fn target_count(safe: &Tensor, valid: Option<&Tensor>, ct: DType) -> Result<Tensor> {
    match valid {
        Some(v) => v.sum()?.to_dtype(ct),
        None => Tensor::full(&[], safe.numel() as f64, (ct, safe.device())),
    }
}

/// The loss values, computed with grad mode off (the caller records one node).
fn cross_entropy_forward(x: &Tensor, safe: &Tensor, valid: Option<&Tensor>, opts: CrossEntropy) -> Result<Tensor> {
    let mask = |t: Tensor| -> Result<Tensor> {
        match valid {
            Some(v) => Tensor::where_cond(v, &t, &zero_like(&t)?),
            None => Ok(t),
        }
    };
    let eps = opts.label_smoothing;
    let (nll, smooth) = if matches!(x.dtype(), DType::F32 | DType::F64) {
        // -log_softmax(x)[t] = lse(x) - x[t]: one read of the logits, no [N, C] output;
        // sum_c -log_softmax(x) = C lse(x) - sum_c x.
        let lse = x.logsumexp(1, false)?;
        let picked = pick_targets(x, safe)?;
        let nll = mask(lse.sub(&picked)?)?;
        let smooth = if eps > 0.0 {
            let c = x.shape()[1] as f64;
            Some(mask(lse.mul(c)?.sub(&x.sum_dim(&[1isize][..], false)?)?)?)
        } else {
            None
        };
        (nll, smooth)
    } else {
        // Half precision rounds log_softmax like PyTorch before picking.
        let logp = x.log_softmax(1)?;
        let nll = mask(pick_targets(&logp, safe)?.neg()?)?;
        let smooth = if eps > 0.0 { Some(mask(logp.sum_dim(&[1isize][..], false)?.neg()?)?) } else { None };
        (nll, smooth)
    };
    let c = x.shape()[1] as f64;
    // PyTorch's order: (1 - ε) * nll + smooth * (ε / C), after reducing each.
    let combine = |nll: Tensor, smooth: Option<Tensor>| -> Result<Tensor> {
        match smooth {
            Some(s) => nll.mul(1.0 - eps)?.add(&s.mul(eps / c)?),
            None => Ok(nll),
        }
    };
    match opts.reduction {
        Reduction::None => combine(nll, smooth),
        Reduction::Sum => combine(nll.sum()?, smooth.map(|s| s.sum()).transpose()?),
        Reduction::Mean => {
            // The count may exceed what a half float holds exactly: divide in float32.
            let ct = opmath(nll.dtype());
            let count = target_count(safe, valid, ct)?;
            let mean = |t: Tensor| -> Result<Tensor> { t.to_dtype(ct)?.sum()?.div(&count)?.to_dtype(t.dtype()) };
            combine(mean(nll)?, smooth.map(mean).transpose()?)
        }
    }
}

/// The gradient of the loss with respect to the logits: `(softmax - (1 - ε)
/// onehot - ε / C) * w`, with `w` the per-target weight of the reduction times
/// `g`, zero at ignored targets. Normally one fused pass over `[N, C]`
/// (`Op::CrossEntropyBackward`); with grad mode on (a backward with
/// `create_graph`) it is composed of differentiable ops: the softmax, a
/// scatter-add of `-(1 - ε)` at the targets (no one-hot tensor is built), the
/// subtraction of `ε / C` and the product with `w`. Float32 for half precision.
fn cross_entropy_backward(
    x: &Tensor,
    safe: &Tensor,
    valid: Option<&Tensor>,
    opts: CrossEntropy,
    g: &Tensor,
) -> Result<Tensor> {
    let ct = opmath(x.dtype());
    let eps = opts.label_smoothing;
    let g = g.to_dtype(ct)?;
    // Per-target weight, shaped like the target (small next to `d`).
    let w = match opts.reduction {
        Reduction::None => g,
        Reduction::Sum => g.broadcast_to(safe.shape())?,
        Reduction::Mean => g.div(&target_count(safe, valid, ct)?)?.broadcast_to(safe.shape())?,
    };
    // `where`, not a product with the mask: with no valid target the mean's weight is inf.
    let w = match valid {
        Some(v) => Tensor::where_cond(v, &w, &zero_like(&w)?)?,
        None => w,
    };
    if !crate::is_grad_enabled() {
        return Tensor::apply1(Op::CrossEntropyBackward { smoothing: eps }, &[x, safe, &w]);
    }
    let idx = safe.unsqueeze(1)?;
    let hit = Tensor::full(idx.shape(), -(1.0 - eps), (ct, x.device()))?;
    let mut d = x.to_dtype(ct)?.softmax(1)?.scatter_add(1, &idx, &hit)?;
    if eps > 0.0 {
        d = d.sub(eps / x.shape()[1] as f64)?;
    }
    d.mul(&w.unsqueeze(1)?)?.to_dtype(x.dtype())
}
