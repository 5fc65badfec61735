//! Reductions: sum, mean, prod, max, min (with indices), argmax, argmin, var,
//! std, logsumexp, all, any, count_nonzero, over dims with keepdim.
//!
//! Everything lowers to two primitives, `Op::Reduce` and `Op::ArgReduce`; var,
//! std and logsumexp are composites of them. Dims follow PyTorch: negative dims
//! count from the end, an empty dim list reduces every dim, and a 0-d tensor
//! accepts dim `0` or `-1`.
use crate::error::fmt_shape;
use crate::{wrap_dim, ArgReduceOp, DType, Error, Op, ReduceOp, Result, Shape, Tensor};
use smallvec::SmallVec;

/// Dims argument of reductions: one dim (`-1`), a list (`[0, 2]`), negative dims allowed.
pub trait Dims {
    fn to_dims(&self, op: &'static str, ndim: usize) -> Result<SmallVec<[usize; 6]>>;
}
macro_rules! dims_int {
    ($($t:ty),*) => {$(
        impl Dims for $t {
            fn to_dims(&self, op: &'static str, ndim: usize) -> Result<SmallVec<[usize; 6]>> {
                Ok(smallvec::smallvec![wrap_dim(op, *self as isize, ndim)?])
            }
        }
        impl Dims for [$t] {
            fn to_dims(&self, op: &'static str, ndim: usize) -> Result<SmallVec<[usize; 6]>> {
                let mut v: SmallVec<[usize; 6]> = self.iter().map(|&d| wrap_dim(op, d as isize, ndim)).collect::<Result<_>>()?;
                v.sort_unstable();
                for w in v.windows(2) {
                    if w[0] == w[1] {
                        return Err(crate::Error::invalid(op, format!("dim {} appears multiple times in the list of dims", w[0])));
                    }
                }
                Ok(v)
            }
        }
        impl<const N: usize> Dims for [$t; N] {
            fn to_dims(&self, op: &'static str, ndim: usize) -> Result<SmallVec<[usize; 6]>> {
                self.as_slice().to_dims(op, ndim)
            }
        }
        impl Dims for Vec<$t> {
            fn to_dims(&self, op: &'static str, ndim: usize) -> Result<SmallVec<[usize; 6]>> {
                self.as_slice().to_dims(op, ndim)
            }
        }
        impl Dims for &[$t] {
            fn to_dims(&self, op: &'static str, ndim: usize) -> Result<SmallVec<[usize; 6]>> {
                (*self).to_dims(op, ndim)
            }
        }
    )*};
}
dims_int!(i32, i64, isize, usize);

/// The dims a reduction works on, resolved against one tensor.
///
/// A 0-d tensor is reduced as a one-element 1-D tensor (PyTorch accepts dim `0`
/// or `-1` for it and returns a 0-d result), so the primitive never sees a
/// 0-d input with a dim.
struct Resolved {
    /// The input, reshaped to `[1]` when it was 0-d.
    x: Tensor,
    /// Sorted, unique, never empty (unless the input has no dims at all, which
    /// `resolve` rules out).
    dims: SmallVec<[usize; 6]>,
    /// Shape of the result.
    out_shape: Shape,
}

fn resolve(x: &Tensor, op: &'static str, dims: &dyn Dims, keepdim: bool) -> Result<Resolved> {
    let mut d = dims.to_dims(op, x.ndim())?;
    if x.ndim() == 0 {
        return Ok(Resolved { x: x.reshape(&[1])?, dims: smallvec::smallvec![0], out_shape: Shape::new() });
    }
    if d.is_empty() {
        // PyTorch: an empty dim list reduces every dim.
        d = (0..x.ndim()).collect();
    }
    let out_shape = x
        .shape()
        .iter()
        .enumerate()
        .filter_map(|(i, &s)| {
            if !d.contains(&i) {
                Some(s)
            } else if keepdim {
                Some(1)
            } else {
                None
            }
        })
        .collect();
    Ok(Resolved { x: x.clone(), dims: d, out_shape })
}

// Note [Results are not views]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The result of an op is a fresh tensor, never a view of a temporary (PyTorch's
// `_base` is None), even when the op ends by reshaping what it computed (matmul
// with a 1-D operand or a folded batch, embedding, advanced indexing with a
// multi-dim index, a 0-d input handled as `[1]`, reshape's copy path). Such a
// final reshape goes through `reshape_result`, which makes the reshaped tensor a
// new base over the temporary's storage (PyTorch's `_unsafe_view`): no copy, and
// the aliasing is unobservable because nothing else holds the temporary. Only
// when the temporary's strides forbid a view (never for a primitive's
// contiguous output) does it copy.

/// `t`, an op's fresh temporary, reshaped as the op's result: `t` itself when the
/// shape matches, else a new base over its storage (see Note [Results are not views]).
pub(crate) fn reshape_result(t: Tensor, shape: &[usize]) -> Result<Tensor> {
    if t.shape() == shape {
        return Ok(t);
    }
    if !t.is_view() && t.layout().reshape_view(shape).is_some() {
        return t.view_op_as_base(crate::ViewOp::Reshape(shape.into()));
    }
    t.reshape_to(shape)?.deep_clone()
}

/// `t` with `shape`: `t` itself when the shape already matches, else a reshape
/// (a view when the strides allow). For inputs of further ops, not for results.
pub(crate) fn reshape_input(t: &Tensor, shape: &[usize]) -> Result<Tensor> {
    if t.shape() == shape {
        return Ok(t.clone());
    }
    t.reshape_to(shape)
}

/// Half-precision floats compute composites (var, logsumexp) in float32, like
/// PyTorch's `opmath` type; the result is cast back.
fn upcast(x: &Tensor) -> Result<Tensor> {
    match x.dtype() {
        DType::F16 | DType::BF16 => x.to_dtype(DType::F32),
        _ => Ok(x.clone()),
    }
}

/// All dims of a tensor (for whole-tensor reductions).
fn all_dims(x: &Tensor) -> SmallVec<[usize; 6]> {
    (0..x.ndim()).collect()
}

impl Tensor {
    /// Runs `Op::Reduce` over `dims` (any `Dims`; empty means all).
    fn reduce_op(&self, op: ReduceOp, name: &'static str, dims: &dyn Dims, keepdim: bool) -> Result<Tensor> {
        let r = resolve(self, name, dims, keepdim)?;
        // A 0-d input runs as `[1]`: without keepdim its result is already 0-d.
        let keep = keepdim && self.ndim() > 0;
        let out = Tensor::apply1(Op::Reduce { op, dims: r.dims.clone(), keepdim: keep }, &[&r.x])?;
        reshape_result(out, &r.out_shape)
    }

    /// Reduces every dim to a 0-d tensor.
    fn reduce_all(&self, op: ReduceOp, name: &'static str) -> Result<Tensor> {
        self.reduce_op(op, name, &all_dims(self).as_slice(), false)
    }

    // ---- sum, mean, prod -------------------------------------------------------

    /// Sum of all elements as a 0-d tensor. Integers and bool sum in int64.
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let x = Tensor::new([[1i32, 2], [3, 4]])?;
    /// let s = x.sum()?;
    /// assert_eq!(s.dtype(), DType::I64);
    /// assert_eq!(s.item::<i64>()?, 10);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn sum(&self) -> Result<Tensor> {
        if let Some(x) = crate::autocast::widened(self)? {
            return x.sum();
        }
        self.reduce_all(ReduceOp::Sum, "sum")
    }

    /// Sum over `dims` (one dim or a list; negative dims count from the end; an
    /// empty list reduces all dims). `keepdim` keeps reduced dims as size 1.
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let x = Tensor::new([[1.0f32, 2.0, 3.0], [4.0, 5.0, 6.0]])?;
    /// assert_eq!(x.sum_dim(-1, false)?.to_vec::<f32>()?, vec![6.0, 15.0]);
    /// assert_eq!(x.sum_dim([0, 1], true)?.shape(), &[1, 1]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn sum_dim(&self, dims: impl Dims, keepdim: bool) -> Result<Tensor> {
        if let Some(x) = crate::autocast::widened(self)? {
            return x.sum_dim(dims, keepdim);
        }
        self.reduce_op(ReduceOp::Sum, "sum", &dims, keepdim)
    }

    /// Mean of all elements (floating dtypes only; an integer input is an error, as in PyTorch).
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let x = Tensor::new([1.0f32, 2.0, 6.0])?;
    /// assert_eq!(x.mean()?.item::<f32>()?, 3.0);
    /// assert!(Tensor::new([1i64, 2])?.mean().is_err());
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn mean(&self) -> Result<Tensor> {
        if let Some(x) = crate::autocast::widened(self)? {
            return x.mean();
        }
        self.reduce_all(ReduceOp::Mean, "mean")
    }

    /// Mean over `dims` (see [`Tensor::sum_dim`] for the dims rules).
    pub fn mean_dim(&self, dims: impl Dims, keepdim: bool) -> Result<Tensor> {
        if let Some(x) = crate::autocast::widened(self)? {
            return x.mean_dim(dims, keepdim);
        }
        self.reduce_op(ReduceOp::Mean, "mean", &dims, keepdim)
    }

    /// Product of all elements. Integers and bool multiply in int64.
    pub fn prod(&self) -> Result<Tensor> {
        self.reduce_all(ReduceOp::Prod, "prod")
    }

    /// Product over `dims`.
    pub fn prod_dim(&self, dims: impl Dims, keepdim: bool) -> Result<Tensor> {
        self.reduce_op(ReduceOp::Prod, "prod", &dims, keepdim)
    }

    // ---- max, min ------------------------------------------------------------------

    /// Largest element as a 0-d tensor; NaN propagates. An empty tensor is an error.
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let x = Tensor::new([1.0f32, 5.0, 3.0])?;
    /// assert_eq!(x.max()?.item::<f32>()?, 5.0);
    /// assert!(Tensor::new([1.0f32, f32::NAN])?.max()?.item::<f32>()?.is_nan());
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn max(&self) -> Result<Tensor> {
        self.check_nonempty_all("max")?;
        self.reduce_all(ReduceOp::Max, "max")
    }

    /// Smallest element as a 0-d tensor; NaN propagates.
    pub fn min(&self) -> Result<Tensor> {
        self.check_nonempty_all("min")?;
        self.reduce_all(ReduceOp::Min, "min")
    }

    fn check_nonempty_all(&self, op: &'static str) -> Result<()> {
        if self.numel() == 0 {
            return Err(Error::shape(
                op,
                format!(
                    "Expected reduction dim to be specified for input.numel() == 0. Specify the reduction dim with the 'dim' argument; input shape {}",
                    fmt_shape(self.shape())
                ),
            ));
        }
        Ok(())
    }

    /// `torch.max(x, dim, keepdim)`: the largest values along `dim` and their
    /// indices (int64; the first one on ties; a NaN counts as the largest).
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let x = Tensor::new([[1.0f32, 7.0, 3.0], [9.0, 2.0, 9.0]])?;
    /// let (v, i) = x.max_dim(1, false)?;
    /// assert_eq!(v.to_vec::<f32>()?, vec![7.0, 9.0]);
    /// assert_eq!(i.to_vec::<i64>()?, vec![1, 0]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn max_dim(&self, dim: isize, keepdim: bool) -> Result<(Tensor, Tensor)> {
        let v = self.reduce_op(ReduceOp::Max, "max", &dim, keepdim)?;
        let i = self.arg_reduce(ArgReduceOp::ArgMax, "max", Some(dim), keepdim)?;
        Ok((v, i))
    }

    /// `torch.min(x, dim, keepdim)`: the smallest values along `dim` and their indices.
    pub fn min_dim(&self, dim: isize, keepdim: bool) -> Result<(Tensor, Tensor)> {
        let v = self.reduce_op(ReduceOp::Min, "min", &dim, keepdim)?;
        let i = self.arg_reduce(ArgReduceOp::ArgMin, "min", Some(dim), keepdim)?;
        Ok((v, i))
    }

    /// Largest values over `dims` (no indices); NaN propagates.
    pub fn amax(&self, dims: impl Dims, keepdim: bool) -> Result<Tensor> {
        self.reduce_op(ReduceOp::Max, "amax", &dims, keepdim)
    }

    /// Smallest values over `dims`; NaN propagates.
    pub fn amin(&self, dims: impl Dims, keepdim: bool) -> Result<Tensor> {
        self.reduce_op(ReduceOp::Min, "amin", &dims, keepdim)
    }

    fn arg_reduce(&self, op: ArgReduceOp, name: &'static str, dim: Option<isize>, keepdim: bool) -> Result<Tensor> {
        if self.dtype() == DType::Bool {
            return Err(Error::dtype(name, format!("{name}(): does not support bool input")));
        }
        let d = match dim {
            Some(d) => Some(wrap_dim(name, d, self.ndim())?),
            None => None,
        };
        if self.ndim() == 0 {
            // A 0-d tensor has one element: its index is 0 whatever the dim.
            return Tensor::zeros(&[], (DType::I64, self.device()));
        }
        Tensor::apply1(Op::ArgReduce { op, dim: d, keepdim }, &[self])
    }

    /// Index (int64) of the largest element along `dim`, or of the flattened
    /// tensor when `dim` is `None`. Ties give the first index; NaN counts as the largest.
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let x = Tensor::new([[1.0f32, 7.0], [9.0, 2.0]])?;
    /// assert_eq!(x.argmax(None, false)?.item::<i64>()?, 2);
    /// assert_eq!(x.argmax(Some(-1), false)?.to_vec::<i64>()?, vec![1, 0]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn argmax(&self, dim: Option<isize>, keepdim: bool) -> Result<Tensor> {
        self.arg_reduce(ArgReduceOp::ArgMax, "argmax", dim, keepdim)
    }

    /// Index (int64) of the smallest element along `dim` (or of the flattened tensor).
    pub fn argmin(&self, dim: Option<isize>, keepdim: bool) -> Result<Tensor> {
        self.arg_reduce(ArgReduceOp::ArgMin, "argmin", dim, keepdim)
    }

    // ---- var, std, logsumexp --------------------------------------------------------

    /// Variance over `dims` with `correction` (1 gives the unbiased estimator,
    /// PyTorch's default; 0 the population variance). Floating dtypes only;
    /// half precision computes in float32. When `correction >= n`, the result is
    /// `inf` or NaN, like PyTorch.
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let x = Tensor::new([[1.0f32, 2.0, 3.0, 4.0]])?;
    /// assert_eq!(x.var(-1, 1, false)?.to_vec::<f32>()?, vec![5.0 / 3.0]);
    /// assert_eq!(x.var(-1, 0, true)?.to_vec::<f32>()?, vec![1.25]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn var(&self, dims: impl Dims, correction: usize, keepdim: bool) -> Result<Tensor> {
        self.var_impl("var", &dims, correction, keepdim)
    }

    /// Variance of all elements (0-d result); see [`Tensor::var`].
    pub fn var_all(&self, correction: usize) -> Result<Tensor> {
        self.var_impl("var", &all_dims(self).as_slice(), correction, false)
    }

    /// Standard deviation over `dims`: `sqrt(var(dims, correction))`.
    pub fn std(&self, dims: impl Dims, correction: usize, keepdim: bool) -> Result<Tensor> {
        self.std_impl(&dims, correction, keepdim)
    }

    /// Standard deviation of all elements (0-d result).
    pub fn std_all(&self, correction: usize) -> Result<Tensor> {
        self.std_impl(&all_dims(self).as_slice(), correction, false)
    }

    fn std_impl(&self, dims: &dyn Dims, correction: usize, keepdim: bool) -> Result<Tensor> {
        let v = upcast(self)?.var_impl("std", dims, correction, keepdim)?;
        v.sqrt()?.to_dtype(self.dtype())
    }

    fn var_impl(&self, name: &'static str, dims: &dyn Dims, correction: usize, keepdim: bool) -> Result<Tensor> {
        if !self.dtype().is_float() {
            return Err(Error::dtype(
                name,
                format!("std and var only support floating point and complex dtypes, got {}", self.dtype()),
            ));
        }
        let r = resolve(self, name, dims, keepdim)?;
        let x = upcast(&r.x)?;
        let n: usize = r.dims.iter().map(|&d| x.shape()[d]).product();
        let d = r.dims.as_slice();
        let mean = x.mean_dim(d, true)?;
        let dev = x.sub(&mean)?;
        let ss = reshape_input(&dev.mul(&dev)?.sum_dim(d, keepdim)?, &r.out_shape)?;
        let denom = (n as f64 - correction as f64).max(0.0);
        // Dividing last keeps the result a fresh tensor (see Note [Results are not views]).
        ss.div(denom)?.to_dtype(self.dtype())
    }

    /// `log(sum(exp(x), dims))`, computed stably: the max is subtracted first
    /// (infinite maxima are replaced by 0, so rows of all `-inf` give `-inf` and
    /// rows holding `+inf` give `+inf`, like PyTorch). Integer inputs give float32;
    /// half precision computes in float32.
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let x = Tensor::new([1000.0f32, 1000.0])?;
    /// let y = x.logsumexp(0, false)?.item::<f32>()?;
    /// assert!((y - (1000.0 + 2f32.ln())).abs() < 1e-3);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn logsumexp(&self, dims: impl Dims, keepdim: bool) -> Result<Tensor> {
        if let Some(x) = crate::autocast::widened(self)? {
            return x.logsumexp(dims, keepdim);
        }
        let out_dtype = self.dtype().to_float();
        let r = resolve(self, "logsumexp", &dims, keepdim)?;
        let x = upcast(&r.x.to_dtype(out_dtype)?)?;
        let d = r.dims.as_slice();
        if d.iter().any(|&i| x.shape()[i] == 0) {
            // The sum of nothing is 0, its log -inf.
            return Tensor::full(&r.out_shape, f64::NEG_INFINITY, (out_dtype, self.device()));
        }
        if let [dim] = d {
            // One dim: the fused primitive (two passes per slice instead of six ops).
            let y = Tensor::apply1(Op::LogSumExp { dim: *dim }, &[&r.x.to_dtype(out_dtype)?])?;
            return reshape_input(&y, &r.out_shape);
        }
        let m = x.amax(d, true)?;
        let m = m.masked_fill(&m.isinf()?, 0.0)?;
        let s = reshape_input(&x.sub(&m)?.exp()?.sum_dim(d, true)?.log()?, &r.out_shape)?;
        // Adding the max last keeps the result a fresh tensor (see Note [Results are not views]).
        s.add(&reshape_input(&m, &r.out_shape)?)?.to_dtype(out_dtype)
    }

    // ---- all, any, count_nonzero -----------------------------------------------------

    /// True when every element is non-zero (a 0-d bool; uint8 input gives uint8, like PyTorch).
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let x = Tensor::new([[true, false], [true, true]])?;
    /// assert!(!x.all()?.item::<bool>()?);
    /// assert_eq!(x.all_dim(1, false)?.to_vec::<bool>()?, vec![false, true]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn all(&self) -> Result<Tensor> {
        self.logical_reduce(ReduceOp::All, "all", &all_dims(self).as_slice(), false)
    }

    /// `all` over `dims`.
    pub fn all_dim(&self, dims: impl Dims, keepdim: bool) -> Result<Tensor> {
        self.logical_reduce(ReduceOp::All, "all", &dims, keepdim)
    }

    /// True when any element is non-zero.
    pub fn any(&self) -> Result<Tensor> {
        self.logical_reduce(ReduceOp::Any, "any", &all_dims(self).as_slice(), false)
    }

    /// `any` over `dims`.
    pub fn any_dim(&self, dims: impl Dims, keepdim: bool) -> Result<Tensor> {
        self.logical_reduce(ReduceOp::Any, "any", &dims, keepdim)
    }

    fn logical_reduce(&self, op: ReduceOp, name: &'static str, dims: &dyn Dims, keepdim: bool) -> Result<Tensor> {
        let r = self.reduce_op(op, name, dims, keepdim)?;
        if self.dtype() == DType::U8 {
            return r.to_dtype(DType::U8);
        }
        Ok(r)
    }

    /// Number of non-zero elements (0-d int64).
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let x = Tensor::new([[0.0f32, 1.0], [2.0, 0.0]])?;
    /// assert_eq!(x.count_nonzero()?.item::<i64>()?, 2);
    /// assert_eq!(x.count_nonzero_dim(0)?.to_vec::<i64>()?, vec![1, 1]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn count_nonzero(&self) -> Result<Tensor> {
        self.ne(0)?.sum()
    }

    /// Number of non-zero elements over `dims` (int64).
    pub fn count_nonzero_dim(&self, dims: impl Dims) -> Result<Tensor> {
        let d = dims.to_dims("count_nonzero", self.ndim())?;
        self.ne(0)?.sum_dim(d.as_slice(), false)
    }
}
