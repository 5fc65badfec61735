//! Elementwise math: unary ops, binary ops with broadcasting and PyTorch type
//! promotion (scalars included), comparisons, logical ops, `where`, `clamp`,
//! activations, and the `std::ops` operators.
use crate::trace::{self, HostScalar};
use crate::{BinaryOp, CmpOp, DType, Error, Op, Result, Scalar, Tensor, UnaryOp};
use std::ops;

/// The second operand of a binary op: a tensor, a Python-like scalar, or a
/// watched host scalar. `x.add(&y)`, `x.add(2.5)`, `x.mul(3)`, `x.mul(&lr)` all work.
#[derive(Debug, Clone, Copy)]
pub enum Operand<'a> {
    Tensor(&'a Tensor),
    Scalar(Scalar),
    /// A float the compiled functions reading it watch (see [`HostScalar`]).
    Host(&'a HostScalar),
}

impl<'a> From<&'a HostScalar> for Operand<'a> {
    fn from(h: &'a HostScalar) -> Self {
        Operand::Host(h)
    }
}

impl<'a> From<&'a Tensor> for Operand<'a> {
    fn from(t: &'a Tensor) -> Self {
        Operand::Tensor(t)
    }
}
impl From<Scalar> for Operand<'_> {
    fn from(s: Scalar) -> Self {
        Operand::Scalar(s)
    }
}
macro_rules! operand_from {
    ($($t:ty),*) => {$(
        impl From<$t> for Operand<'_> {
            fn from(x: $t) -> Self {
                Operand::Scalar(Scalar::from(x))
            }
        }
    )*};
}
operand_from!(f64, f32, i64, i32, u8, usize, bool);

/// PyTorch's `result_type` over tensors and scalars: dimensioned tensors win over
/// 0-d tensors, which win over scalars, unless a lower-priority operand is of a
/// higher category (bool < int < float).
pub fn result_type(ops: &[Operand<'_>]) -> DType {
    let mut dim: Option<DType> = None;
    let mut zero: Option<DType> = None;
    let mut wrapped: Option<DType> = None;
    let merge = |slot: &mut Option<DType>, d: DType| *slot = Some(slot.map_or(d, |s| DType::promote(s, d)));
    for o in ops {
        match o {
            Operand::Tensor(t) if t.ndim() > 0 => merge(&mut dim, t.dtype()),
            Operand::Tensor(t) => merge(&mut zero, t.dtype()),
            Operand::Scalar(s) => merge(&mut wrapped, s.dtype()),
            Operand::Host(_) => merge(&mut wrapped, DType::F32),
        }
    }
    // PyTorch's combine_categories.
    fn combine(higher: Option<DType>, lower: Option<DType>) -> Option<DType> {
        match (higher, lower) {
            (None, l) => l,
            (h, None) => h,
            (Some(h), Some(_)) if h.is_float() => Some(h),
            (Some(h), Some(l)) if h == DType::Bool || l.is_float() => Some(DType::promote(h, l)),
            (h, _) => h,
        }
    }
    combine(dim, combine(zero, wrapped)).unwrap_or(DType::F32)
}

impl Tensor {
    /// Materialises a scalar operand of `op` as a 0-d tensor of `dtype` on this
    /// tensor's device (a host value of the caller, see Note [Host values]; a
    /// [`HostScalar`] enters as a watched, declared constant).
    pub(crate) fn operand_tensor(&self, op: &'static str, o: Operand<'_>, dtype: DType) -> Result<Tensor> {
        match o {
            Operand::Tensor(t) => t.to_dtype(dtype),
            Operand::Scalar(s) => trace::scalar_use(op, || Tensor::full(&[], s, (dtype, self.device()))),
            Operand::Host(h) => {
                let v = h.get();
                trace::constant(|| Tensor::full(&[], v, (dtype, self.device())))
            }
        }
    }

    /// Broadcasts two tensors to a common shape (free stride-0 views).
    pub fn broadcast_pair(op: &'static str, a: &Tensor, b: &Tensor) -> Result<(Tensor, Tensor)> {
        if a.shape() == b.shape() {
            return Ok((a.clone(), b.clone()));
        }
        let shape = crate::broadcast_shapes(op, a.shape(), b.shape())?;
        Ok((a.broadcast_to(&shape)?, b.broadcast_to(&shape)?))
    }

    /// Runs a binary primitive on `self` and `other` computed in `compute` dtype after
    /// broadcasting; `compute` defaults to the promoted type.
    pub(crate) fn binary_in(&self, op: BinaryOp, other: Operand<'_>, compute: DType) -> Result<Tensor> {
        let a = self.to_dtype(compute)?;
        let b = self.operand_tensor(op.name(), other, compute)?;
        let (a, b) = Tensor::broadcast_pair(op.name(), &a, &b)?;
        Tensor::apply1(Op::Binary(op), &[&a, &b])
    }

    fn binary(&self, op: BinaryOp, other: Operand<'_>) -> Result<Tensor> {
        let dt = result_type(&[Operand::Tensor(self), other]);
        self.binary_in(op, other, dt)
    }

    fn unary(&self, op: UnaryOp) -> Result<Tensor> {
        Tensor::apply1(Op::Unary(op), &[self])
    }

    /// A float op on an int/bool tensor first promotes to float32 (like `torch.exp(int_tensor)`).
    fn unary_float(&self, op: UnaryOp) -> Result<Tensor> {
        self.to_dtype(self.dtype().to_float())?.unary(op)
    }

    // ---- binary arithmetic ------------------------------------------------------

    /// `self + other` with broadcasting and type promotion.
    pub fn add<'o>(&self, other: impl Into<Operand<'o>>) -> Result<Tensor> {
        self.binary(BinaryOp::Add, other.into())
    }
    pub fn sub<'o>(&self, other: impl Into<Operand<'o>>) -> Result<Tensor> {
        self.binary(BinaryOp::Sub, other.into())
    }
    pub fn mul<'o>(&self, other: impl Into<Operand<'o>>) -> Result<Tensor> {
        self.binary(BinaryOp::Mul, other.into())
    }
    /// True division: integer inputs give float32, like PyTorch's `/`.
    pub fn div<'o>(&self, other: impl Into<Operand<'o>>) -> Result<Tensor> {
        let o = other.into();
        let dt = result_type(&[Operand::Tensor(self), o]).to_float();
        self.binary_in(BinaryOp::Div, o, dt)
    }
    /// `torch.div(a, b, rounding_mode="trunc")`.
    pub fn div_trunc<'o>(&self, other: impl Into<Operand<'o>>) -> Result<Tensor> {
        let o = other.into();
        let dt = result_type(&[Operand::Tensor(self), o]);
        if dt.is_float() {
            self.binary_in(BinaryOp::Div, o, dt)?.trunc()
        } else {
            self.binary_in(BinaryOp::Div, o, dt)
        }
    }
    /// Floor division, Python's `//` (`torch.floor_divide`, `rounding_mode="floor"`).
    pub fn floor_divide<'o>(&self, other: impl Into<Operand<'o>>) -> Result<Tensor> {
        self.binary(BinaryOp::FloorDiv, other.into())
    }
    /// Remainder with the sign of the divisor (Python's `%`).
    pub fn remainder<'o>(&self, other: impl Into<Operand<'o>>) -> Result<Tensor> {
        self.binary(BinaryOp::Remainder, other.into())
    }
    /// Remainder with the sign of the dividend (C's `fmod`).
    pub fn fmod<'o>(&self, other: impl Into<Operand<'o>>) -> Result<Tensor> {
        self.binary(BinaryOp::Fmod, other.into())
    }
    pub fn pow<'o>(&self, exponent: impl Into<Operand<'o>>) -> Result<Tensor> {
        self.binary(BinaryOp::Pow, exponent.into())
    }
    /// Elementwise maximum, propagating NaN.
    pub fn maximum(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Maximum, other.into())
    }
    pub fn minimum(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Minimum, other.into())
    }
    /// Elementwise maximum, ignoring NaN when the other value is a number.
    pub fn fmax(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Fmax, other.into())
    }
    pub fn fmin(&self, other: &Tensor) -> Result<Tensor> {
        self.binary(BinaryOp::Fmin, other.into())
    }
    /// `silu(self) * other` (the SwiGLU gate, `F.silu(gate) * up`) in one pass,
    /// with broadcasting; floating dtypes (integers promote to float32). The
    /// product is computed before rounding, so half-precision results can
    /// differ by one rounding from `self.silu()?.mul(other)`.
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let a = Tensor::new([1.0f64, -2.0])?;
    /// let b = Tensor::new([3.0f64, 0.5])?;
    /// let want = a.silu()?.mul(&b)?.to_vec::<f64>()?;
    /// assert_eq!(a.silu_mul(&b)?.to_vec::<f64>()?, want);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn silu_mul(&self, other: &Tensor) -> Result<Tensor> {
        let o = Operand::Tensor(other);
        let dt = result_type(&[Operand::Tensor(self), o]).to_float();
        self.binary_in(BinaryOp::SiluMul, o, dt)
    }
    pub fn atan2(&self, other: &Tensor) -> Result<Tensor> {
        let o = Operand::Tensor(other);
        let dt = result_type(&[Operand::Tensor(self), o]).to_float();
        self.binary_in(BinaryOp::Atan2, o, dt)
    }

    // ---- logical and comparison -------------------------------------------------

    pub fn logical_and<'o>(&self, other: impl Into<Operand<'o>>) -> Result<Tensor> {
        self.binary(BinaryOp::And, other.into())
    }
    pub fn logical_or<'o>(&self, other: impl Into<Operand<'o>>) -> Result<Tensor> {
        self.binary(BinaryOp::Or, other.into())
    }
    pub fn logical_xor<'o>(&self, other: impl Into<Operand<'o>>) -> Result<Tensor> {
        self.binary(BinaryOp::Xor, other.into())
    }
    /// Bitwise and of integer (or bool) tensors (`torch.bitwise_and`, `&`).
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let x = Tensor::new([12i64, 10, -1])?;
    /// assert_eq!(x.bitwise_and(6i64)?.to_vec::<i64>()?, vec![4, 2, 6]);
    /// assert_eq!(x.bitwise_right_shift(1i64)?.to_vec::<i64>()?, vec![6, 5, -1]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn bitwise_and<'o>(&self, other: impl Into<Operand<'o>>) -> Result<Tensor> {
        self.binary(BinaryOp::BitwiseAnd, other.into())
    }
    /// Bitwise or (`torch.bitwise_or`, `|`).
    pub fn bitwise_or<'o>(&self, other: impl Into<Operand<'o>>) -> Result<Tensor> {
        self.binary(BinaryOp::BitwiseOr, other.into())
    }
    /// Bitwise exclusive or (`torch.bitwise_xor`, `^`).
    pub fn bitwise_xor<'o>(&self, other: impl Into<Operand<'o>>) -> Result<Tensor> {
        self.binary(BinaryOp::BitwiseXor, other.into())
    }
    /// `self << other` on integers (`torch.bitwise_left_shift`); shifting by a
    /// negative amount or by the bit width or more gives 0.
    pub fn bitwise_left_shift<'o>(&self, other: impl Into<Operand<'o>>) -> Result<Tensor> {
        self.binary(BinaryOp::LeftShift, other.into())
    }
    /// `self >> other` on integers (`torch.bitwise_right_shift`), arithmetic for
    /// signed dtypes; shifting by a negative amount or by the bit width or more
    /// gives what a shift by `width - 1` gives.
    pub fn bitwise_right_shift<'o>(&self, other: impl Into<Operand<'o>>) -> Result<Tensor> {
        self.binary(BinaryOp::RightShift, other.into())
    }
    pub fn logical_not(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Not)
    }

    fn compare(&self, op: CmpOp, other: Operand<'_>) -> Result<Tensor> {
        let dt = result_type(&[Operand::Tensor(self), other]);
        let a = self.to_dtype(dt)?;
        let b = self.operand_tensor(op.name(), other, dt)?;
        let (a, b) = Tensor::broadcast_pair(op.name(), &a, &b)?;
        Tensor::apply1(Op::Compare(op), &[&a, &b])
    }
    pub fn eq<'o>(&self, other: impl Into<Operand<'o>>) -> Result<Tensor> {
        self.compare(CmpOp::Eq, other.into())
    }
    pub fn ne<'o>(&self, other: impl Into<Operand<'o>>) -> Result<Tensor> {
        self.compare(CmpOp::Ne, other.into())
    }
    pub fn lt<'o>(&self, other: impl Into<Operand<'o>>) -> Result<Tensor> {
        self.compare(CmpOp::Lt, other.into())
    }
    pub fn le<'o>(&self, other: impl Into<Operand<'o>>) -> Result<Tensor> {
        self.compare(CmpOp::Le, other.into())
    }
    pub fn gt<'o>(&self, other: impl Into<Operand<'o>>) -> Result<Tensor> {
        self.compare(CmpOp::Gt, other.into())
    }
    pub fn ge<'o>(&self, other: impl Into<Operand<'o>>) -> Result<Tensor> {
        self.compare(CmpOp::Ge, other.into())
    }

    /// `torch.where(cond, a, b)`: elements of `a` where `cond` is true, else of `b`
    /// (tensors or scalars, broadcast together, dtypes promoted).
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let x = Tensor::new([1.0f32, -2.0, 3.0])?;
    /// let y = Tensor::where_cond(&x.gt(0.0)?, &x, 0.0)?;
    /// assert_eq!(y.to_vec::<f32>()?, vec![1.0, 0.0, 3.0]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn where_cond<'o>(cond: &Tensor, a: impl Into<Operand<'o>>, b: impl Into<Operand<'o>>) -> Result<Tensor> {
        let (a, b) = (a.into(), b.into());
        if cond.dtype() != DType::Bool {
            return Err(Error::dtype(
                "where",
                format!(
                    "where expected condition to be a boolean tensor, but got a tensor with dtype {}",
                    cond.dtype()
                ),
            ));
        }
        let dt = result_type(&[a, b]);
        let ta = cond.operand_tensor("where", a, dt)?;
        let tb = cond.operand_tensor("where", b, dt)?;
        let shape = crate::broadcast_shapes("where", cond.shape(), ta.shape())?;
        let shape = crate::broadcast_shapes("where", &shape, tb.shape())?;
        let (c, ta, tb) = (cond.broadcast_to(&shape)?, ta.broadcast_to(&shape)?, tb.broadcast_to(&shape)?);
        Tensor::apply1(Op::Where, &[&c, &ta, &tb])
    }

    /// Clamps into `[min, max]` (either bound optional); NaN stays NaN.
    ///
    /// Bounds are scalars and follow PyTorch's type promotion: on an integer
    /// tensor, a whole bound (`2.0`) acts like a Python int and keeps the dtype,
    /// a fractional or non-finite bound (`2.5`) acts like a Python float and
    /// promotes the result to float32.
    ///
    /// ```
    /// use kiln::prelude::*;
    /// let i = Tensor::new([-5i64, 0, 5])?;
    /// assert_eq!(i.clamp(Some(-1.0), Some(2.0))?.dtype(), DType::I64);
    /// assert_eq!(i.clamp(Some(-1.5), None)?.to_vec::<f32>()?, vec![-1.5, 0.0, 5.0]);
    /// # Ok::<(), kiln::Error>(())
    /// ```
    pub fn clamp(&self, min: Option<f64>, max: Option<f64>) -> Result<Tensor> {
        if min.is_none() && max.is_none() {
            return Err(Error::invalid("clamp", "at least one of 'min' or 'max' must not be None"));
        }
        let whole = |v: &f64| v.is_finite() && v.fract() == 0.0;
        let promote = !self.dtype().is_float() && !min.iter().chain(max.iter()).all(whole);
        let x = if promote { self.to_dtype(DType::F32)? } else { self.clone() };
        let s = |v: f64| if x.dtype().is_float() { Scalar::Float(v) } else { Scalar::Int(v as i64) };
        let mut out = x.clone();
        if let Some(lo) = min {
            out = out.maximum(&x.operand_tensor("clamp", Operand::Scalar(s(lo)), x.dtype())?)?;
        }
        if let Some(hi) = max {
            out = out.minimum(&x.operand_tensor("clamp", Operand::Scalar(s(hi)), x.dtype())?)?;
        }
        Ok(out)
    }
    /// `torch.clamp` with tensor bounds.
    pub fn clamp_tensor(&self, min: Option<&Tensor>, max: Option<&Tensor>) -> Result<Tensor> {
        let mut out = self.clone();
        if let Some(lo) = min {
            out = out.maximum(lo)?;
        }
        if let Some(hi) = max {
            out = out.minimum(hi)?;
        }
        Ok(out)
    }

    // ---- unary ---------------------------------------------------------------------

    pub fn neg(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Neg)
    }
    pub fn abs(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Abs)
    }
    pub fn sign(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Sign)
    }
    pub fn exp(&self) -> Result<Tensor> {
        self.unary_float(UnaryOp::Exp)
    }
    pub fn log(&self) -> Result<Tensor> {
        self.unary_float(UnaryOp::Log)
    }
    pub fn log1p(&self) -> Result<Tensor> {
        self.unary_float(UnaryOp::Log1p)
    }
    pub fn expm1(&self) -> Result<Tensor> {
        self.unary_float(UnaryOp::Expm1)
    }
    pub fn sqrt(&self) -> Result<Tensor> {
        self.unary_float(UnaryOp::Sqrt)
    }
    pub fn rsqrt(&self) -> Result<Tensor> {
        self.unary_float(UnaryOp::Rsqrt)
    }
    pub fn reciprocal(&self) -> Result<Tensor> {
        self.unary_float(UnaryOp::Recip)
    }
    pub fn tanh(&self) -> Result<Tensor> {
        self.unary_float(UnaryOp::Tanh)
    }
    pub fn sigmoid(&self) -> Result<Tensor> {
        self.unary_float(UnaryOp::Sigmoid)
    }
    pub fn sin(&self) -> Result<Tensor> {
        self.unary_float(UnaryOp::Sin)
    }
    pub fn cos(&self) -> Result<Tensor> {
        self.unary_float(UnaryOp::Cos)
    }
    pub fn erf(&self) -> Result<Tensor> {
        self.unary_float(UnaryOp::Erf)
    }
    pub fn floor(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Floor)
    }
    pub fn ceil(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Ceil)
    }
    /// Rounds half to even, like `torch.round`.
    pub fn round(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Round)
    }
    pub fn trunc(&self) -> Result<Tensor> {
        self.unary(UnaryOp::Trunc)
    }
    pub fn isnan(&self) -> Result<Tensor> {
        self.unary(UnaryOp::IsNan)
    }
    pub fn isinf(&self) -> Result<Tensor> {
        self.unary(UnaryOp::IsInf)
    }
    pub fn square(&self) -> Result<Tensor> {
        self.mul(self)
    }
    /// `max(x, 0)`, keeping NaN.
    pub fn relu(&self) -> Result<Tensor> {
        let zero = Tensor::zeros(&[], (self.dtype(), self.device()))?;
        self.maximum(&zero)
    }
    /// `x * sigmoid(x)`.
    pub fn silu(&self) -> Result<Tensor> {
        self.unary_float(UnaryOp::Silu)
    }
    /// Exact GELU: `x/2 * (1 + erf(x/sqrt(2)))`.
    pub fn gelu(&self) -> Result<Tensor> {
        let x = self.to_dtype(self.dtype().to_float())?;
        let e = x.mul(std::f64::consts::FRAC_1_SQRT_2)?.erf()?.add(1.0)?;
        x.mul(0.5)?.mul(&e)
    }
    /// GELU with the tanh approximation (`approximate='tanh'`).
    pub fn gelu_tanh(&self) -> Result<Tensor> {
        let x = self.to_dtype(self.dtype().to_float())?;
        let k = (2.0 / std::f64::consts::PI).sqrt();
        let inner = x.mul(&x.mul(&x)?.mul(0.044715)?.add(1.0)?)?.mul(k)?;
        x.mul(0.5)?.mul(&inner.tanh()?.add(1.0)?)
    }
}

// ---- std::ops operators -------------------------------------------------------------
//
// The operators panic on error (mismatched shapes, devices or dtypes) with the same
// message the `Result` methods return. Use the methods (`a.add(&b)?`) to handle errors.

macro_rules! bin_operator {
    ($trait:ident, $method:ident, $f:ident) => {
        impl ops::$trait<&Tensor> for &Tensor {
            type Output = Tensor;
            fn $method(self, rhs: &Tensor) -> Tensor {
                Tensor::$f(&self, rhs).unwrap_or_else(|e| panic!("{e}"))
            }
        }
        impl ops::$trait<Tensor> for &Tensor {
            type Output = Tensor;
            fn $method(self, rhs: Tensor) -> Tensor {
                Tensor::$f(&self, &rhs).unwrap_or_else(|e| panic!("{e}"))
            }
        }
        impl ops::$trait<&Tensor> for Tensor {
            type Output = Tensor;
            fn $method(self, rhs: &Tensor) -> Tensor {
                Tensor::$f(&self, rhs).unwrap_or_else(|e| panic!("{e}"))
            }
        }
        impl ops::$trait<Tensor> for Tensor {
            type Output = Tensor;
            fn $method(self, rhs: Tensor) -> Tensor {
                Tensor::$f(&self, &rhs).unwrap_or_else(|e| panic!("{e}"))
            }
        }
        bin_operator!(@scalar $trait, $method, $f, f64, f32, i64, i32);
    };
    (@scalar $trait:ident, $method:ident, $f:ident, $($s:ty),*) => {$(
        impl ops::$trait<$s> for &Tensor {
            type Output = Tensor;
            fn $method(self, rhs: $s) -> Tensor {
                Tensor::$f(&self, rhs).unwrap_or_else(|e| panic!("{e}"))
            }
        }
        impl ops::$trait<$s> for Tensor {
            type Output = Tensor;
            fn $method(self, rhs: $s) -> Tensor {
                Tensor::$f(&self, rhs).unwrap_or_else(|e| panic!("{e}"))
            }
        }
        impl ops::$trait<&Tensor> for $s {
            type Output = Tensor;
            fn $method(self, rhs: &Tensor) -> Tensor {
                rhs.operand_tensor(stringify!($f), Operand::Scalar(Scalar::from(self)), result_type(&[Operand::Tensor(rhs), Operand::Scalar(Scalar::from(self))]))
                    .and_then(|l| Tensor::$f(&l, rhs))
                    .unwrap_or_else(|e| panic!("{e}"))
            }
        }
        impl ops::$trait<Tensor> for $s {
            type Output = Tensor;
            fn $method(self, rhs: Tensor) -> Tensor {
                self.$method(&rhs)
            }
        }
    )*};
}
bin_operator!(Add, add, add);
bin_operator!(Sub, sub, sub);
bin_operator!(Mul, mul, mul);
bin_operator!(Div, div, div);
bin_operator!(Rem, rem, remainder);

impl ops::Neg for &Tensor {
    type Output = Tensor;
    fn neg(self) -> Tensor {
        Tensor::neg(self).unwrap_or_else(|e| panic!("{e}"))
    }
}
impl ops::Neg for Tensor {
    type Output = Tensor;
    fn neg(self) -> Tensor {
        Tensor::neg(&self).unwrap_or_else(|e| panic!("{e}"))
    }
}
impl ops::Not for &Tensor {
    type Output = Tensor;
    /// Logical not for bool tensors (`~mask` in PyTorch).
    fn not(self) -> Tensor {
        self.logical_not().unwrap_or_else(|e| panic!("{e}"))
    }
}
impl ops::Not for Tensor {
    type Output = Tensor;
    fn not(self) -> Tensor {
        self.logical_not().unwrap_or_else(|e| panic!("{e}"))
    }
}
