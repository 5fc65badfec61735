//! Elementwise math: unary ops, binary ops, comparisons and `where`.
//!
//! Floats are computed in their compute type (f32 for f32/bf16/f16, f64) by
//! slice kernels dispatched on CPU features, and 16-bit results are rounded
//! once; integers compute in their own type with wrapping; bool ops are logical.
use super::elem::{Compute, Elem, FloatElem, IntElem, Kind};
use super::iter::Nest;
use super::map::{fmap, map1, map2, map3};
use super::simd::{map_binary, map_unary, BinOp, UnOp};
use super::{buf, Input};
use half::{bf16, f16};
use kiln_tensor::{with_dtype, BinaryOp, CmpOp, DType, Error, HostBuffer, Layout, Result, UnaryOp};
use std::mem::MaybeUninit;

// ---- float op bodies ---------------------------------------------------------

macro_rules! unop {
    ($($name:ident => |$x:ident| $body:expr;)*) => {$(
        #[derive(Clone, Copy)]
        struct $name;
        impl<F: Compute> UnOp<F> for $name {
            #[inline(always)]
            fn f<const FMA: bool>(self, $x: F) -> F {
                $body
            }
        }
    )*};
}

unop! {
    Neg => |x| -x;
    Abs => |x| x.abs();
    // PyTorch: (0 < x) - (x < 0), so NaN and -0.0 give 0.
    Sign => |x| (if x > F::ZERO { F::ONE } else { F::ZERO }) - (if x < F::ZERO { F::ONE } else { F::ZERO });
    Exp => |x| x.exp_::<FMA>();
    Log => |x| x.ln();
    Log1p => |x| x.ln_1p();
    Expm1 => |x| x.exp_m1();
    Sqrt => |x| x.sqrt();
    Rsqrt => |x| F::ONE / x.sqrt();
    Recip => |x| F::ONE / x;
    Tanh => |x| x.tanh_::<FMA>();
    Sigmoid => |x| x.sigmoid_::<FMA>();
    Silu => |x| x * x.sigmoid_::<FMA>();
    SiluGrad => |x| {
        let s = x.sigmoid_::<FMA>();
        s * (F::ONE + x * (F::ONE - s))
    };
    Sin => |x| x.sin();
    Cos => |x| x.cos();
    Erf => |x| x.erf_();
    Floor => |x| x.floor();
    Ceil => |x| x.ceil();
    Round => |x| x.round_even();
    Trunc => |x| x.trunc();
    Identity => |x| x;
    Square => |x| x * x;
    Cube => |x| x * x * x;
    RecipSquare => |x| F::ONE / (x * x);
}

macro_rules! binop {
    ($($name:ident => |$a:ident, $b:ident| $body:expr;)*) => {$(
        #[derive(Clone, Copy)]
        struct $name;
        impl<F: Compute> BinOp<F> for $name {
            #[inline(always)]
            fn f<const FMA: bool>(self, $a: F, $b: F) -> F {
                $body
            }
        }
    )*};
}

binop! {
    Add => |a, b| a + b;
    Sub => |a, b| a - b;
    Mul => |a, b| a * b;
    Div => |a, b| a / b;
    FloorDiv => |a, b| floor_div(a, b);
    Remainder => |a, b| {
        let m = a % b;
        if m != F::ZERO && ((b < F::ZERO) != (m < F::ZERO)) { m + b } else { m }
    };
    Fmod => |a, b| a % b;
    Pow => |a, b| a.powf(b);
    // NaN-propagating (a + b is NaN when either is).
    Maximum => |a, b| if a.is_nan() || b.is_nan() { a + b } else if a > b { a } else { b };
    Minimum => |a, b| if a.is_nan() || b.is_nan() { a + b } else if a < b { a } else { b };
    // NaN-ignoring.
    Fmax => |a, b| if a > b || b.is_nan() { a } else { b };
    Fmin => |a, b| if a < b || b.is_nan() { a } else { b };
    Atan2 => |a, b| a.atan2(b);
    SiluMul => |a, b| a * a.sigmoid_::<FMA>() * b;
    SiluGradMul => |a, b| {
        let s = a.sigmoid_::<FMA>();
        s * (F::ONE + a * (F::ONE - s)) * b
    };
}

/// PyTorch's `div_floor_floating`: floor division that agrees with Python's `//`,
/// including the signed zero of an exact zero quotient.
#[inline(always)]
fn floor_div<F: Compute>(a: F, b: F) -> F {
    if b == F::ZERO {
        return a / b;
    }
    let m = a % b;
    let mut div = (a - m) / b;
    if m != F::ZERO && ((b < F::ZERO) != (m < F::ZERO)) {
        div = div - F::ONE;
    }
    if div != F::ZERO {
        let fl = div.floor();
        if div - fl > F::HALF {
            fl + F::ONE
        } else {
            fl
        }
    } else {
        F::ZERO.copysign_(a / b)
    }
}

// ---- unary -------------------------------------------------------------------

/// Runs a unary op.
pub(crate) fn unary(op: UnaryOp, x: &Input<'_>) -> Result<HostBuffer> {
    let dt = x.dtype();
    match op {
        UnaryOp::Not => return with_dtype!(dt, T => Ok(buf(map1::<T, bool>(x, 1, |v| !v.truthy())?))),
        UnaryOp::IsNan => return with_dtype!(dt, T => Ok(buf(map1::<T, bool>(x, 1, |v| v.is_nan_())?))),
        UnaryOp::IsInf => return with_dtype!(dt, T => Ok(buf(map1::<T, bool>(x, 1, |v| v.cast_f64().is_infinite())?))),
        _ => {}
    }
    Ok(match dt {
        DType::F32 => buf(float_unary::<f32>(op, x)?),
        DType::F64 => buf(float_unary::<f64>(op, x)?),
        DType::BF16 => buf(float_unary::<bf16>(op, x)?),
        DType::F16 => buf(float_unary::<f16>(op, x)?),
        DType::F8E5M2 | DType::F8E4M3FN => return Err(Error::unsupported_dtype(op.name(), dt)),
        DType::U8 => buf(int_unary::<u8>(op, x)?),
        DType::I8 => buf(int_unary::<i8>(op, x)?),
        DType::I16 => buf(int_unary::<i16>(op, x)?),
        DType::I32 => buf(int_unary::<i32>(op, x)?),
        DType::I64 => buf(int_unary::<i64>(op, x)?),
        DType::Bool => match op {
            UnaryOp::Abs | UnaryOp::Sign | UnaryOp::Floor | UnaryOp::Ceil | UnaryOp::Round | UnaryOp::Trunc => {
                buf(map1::<bool, bool>(x, 1, |v| v)?)
            }
            _ => return Err(Error::unsupported_dtype(op.name(), dt)),
        },
    })
}

fn float_unary<T: FloatElem>(op: UnaryOp, x: &Input<'_>) -> Result<Vec<T>> {
    let cost = unary_cost(op).ok_or_else(|| Error::backend("cpu", format!("{} is not a float op", op.name())))?;
    fmap::<T, 1>([x], cost, &|[a], out| unary_slice(op, a, out))
}

/// Element-operations per element of a float unary op, `None` for the ops
/// that are not float ops (`logical_not`, `isnan`, `isinf`).
pub(crate) fn unary_cost(op: UnaryOp) -> Option<usize> {
    use UnaryOp as U;
    Some(match op {
        U::Neg | U::Abs | U::Sign | U::Floor | U::Ceil | U::Round | U::Trunc => 1,
        U::Sqrt | U::Rsqrt | U::Recip => 2,
        U::Exp => 4,
        U::Sigmoid => 5,
        U::Tanh | U::Silu => 6,
        U::Log | U::Log1p | U::Expm1 | U::SiluGrad | U::Sin | U::Cos | U::Erf => 8,
        U::Not | U::IsNan | U::IsInf => return None,
    })
}

/// `out[i] = op(x[i])` for a float op of [`unary_cost`] (the one home of the
/// float unary ops' arithmetic: eager ops and fused groups both run it). An
/// op that is not a float op writes nothing: callers check `unary_cost` first.
pub(crate) fn unary_slice<C: Compute>(op: UnaryOp, x: &[C], out: &mut [MaybeUninit<C>]) {
    use UnaryOp as U;
    match op {
        U::Neg => map_unary(Neg, x, out),
        U::Abs => map_unary(Abs, x, out),
        U::Sign => map_unary(Sign, x, out),
        U::Exp => map_unary(Exp, x, out),
        U::Log => map_unary(Log, x, out),
        U::Log1p => map_unary(Log1p, x, out),
        U::Expm1 => map_unary(Expm1, x, out),
        U::Sqrt => map_unary(Sqrt, x, out),
        U::Rsqrt => map_unary(Rsqrt, x, out),
        U::Recip => map_unary(Recip, x, out),
        U::Tanh => map_unary(Tanh, x, out),
        U::Sigmoid => map_unary(Sigmoid, x, out),
        U::Silu => map_unary(Silu, x, out),
        U::SiluGrad => map_unary(SiluGrad, x, out),
        U::Sin => map_unary(Sin, x, out),
        U::Cos => map_unary(Cos, x, out),
        U::Erf => map_unary(Erf, x, out),
        U::Floor => map_unary(Floor, x, out),
        U::Ceil => map_unary(Ceil, x, out),
        U::Round => map_unary(Round, x, out),
        U::Trunc => map_unary(Trunc, x, out),
        U::Not | U::IsNan | U::IsInf => {}
    }
}

fn int_unary<T: IntElem>(op: UnaryOp, x: &Input<'_>) -> Result<Vec<T>> {
    use UnaryOp as U;
    match op {
        U::Neg => map1::<T, T>(x, 1, |v| v.wneg()),
        U::Abs => map1::<T, T>(x, 1, |v| v.wabs()),
        U::Sign => map1::<T, T>(x, 1, |v| v.sign()),
        U::Floor | U::Ceil | U::Round | U::Trunc => map1::<T, T>(x, 1, |v| v),
        _ => Err(Error::unsupported_dtype(op.name(), T::DTYPE)),
    }
}

// ---- binary ------------------------------------------------------------------

/// Runs a binary op on inputs of equal shape and dtype.
pub(crate) fn binary(op: BinaryOp, a: &Input<'_>, b: &Input<'_>) -> Result<HostBuffer> {
    let dt = a.dtype();
    if dt != b.dtype() {
        return Err(Error::dtype(op.name(), format!("expected equal dtypes, got {dt} and {}", b.dtype())));
    }
    if op.is_logical() {
        return logical(op, a, b);
    }
    Ok(match dt {
        DType::F32 => buf(float_binary::<f32>(op, a, b)?),
        DType::F64 => buf(float_binary::<f64>(op, a, b)?),
        DType::BF16 => buf(float_binary::<bf16>(op, a, b)?),
        DType::F16 => buf(float_binary::<f16>(op, a, b)?),
        DType::F8E5M2 | DType::F8E4M3FN => return Err(Error::unsupported_dtype(op.name(), dt)),
        DType::U8 => buf(int_binary::<u8>(op, a, b)?),
        DType::I8 => buf(int_binary::<i8>(op, a, b)?),
        DType::I16 => buf(int_binary::<i16>(op, a, b)?),
        DType::I32 => buf(int_binary::<i32>(op, a, b)?),
        DType::I64 => buf(int_binary::<i64>(op, a, b)?),
        DType::Bool => buf(bool_binary(op, a, b)?),
    })
}

/// `logical_and` / `or` / `xor`: inputs of other dtypes are first mapped to their
/// truth values, so the op itself is compiled for bool only.
fn logical(op: BinaryOp, a: &Input<'_>, b: &Input<'_>) -> Result<HostBuffer> {
    let truth = |x: &Input<'_>| -> Result<Option<HostBuffer>> {
        Ok(match x.dtype() {
            DType::Bool => None,
            dt => Some(HostBuffer::Bool(with_dtype!(dt, T => map1::<T, bool>(x, 1, |v| v.truthy())?))),
        })
    };
    let (ta, tb) = (truth(a)?, truth(b)?);
    let (la, lb) = (Layout::contiguous(a.layout.shape()), Layout::contiguous(b.layout.shape()));
    let a = ta.as_ref().map_or(*a, |buf| Input { buf, layout: &la });
    let b = tb.as_ref().map_or(*b, |buf| Input { buf, layout: &lb });
    Ok(buf(match op {
        BinaryOp::And => map2::<bool, bool, bool>(&a, &b, 1, |x, y| x & y)?,
        BinaryOp::Or => map2::<bool, bool, bool>(&a, &b, 1, |x, y| x | y)?,
        _ => map2::<bool, bool, bool>(&a, &b, 1, |x, y| x ^ y)?,
    }))
}

/// The value of an input that broadcasts one element everywhere (all strides 0), if it does.
fn broadcast_scalar<T: Elem>(x: &Input<'_>) -> Result<Option<T>> {
    let l = x.layout;
    if l.numel() > 0 && l.shape().iter().zip(l.strides()).all(|(&d, &s)| d == 1 || s == 0) {
        return Ok(Some(x.slice::<T>()?[l.offset()]));
    }
    Ok(None)
}

fn float_binary<T: FloatElem>(op: BinaryOp, a: &Input<'_>, b: &Input<'_>) -> Result<Vec<T>> {
    macro_rules! go1 {
        ($k:expr) => {
            fmap::<T, 1>([a], 2, &|[x], out| map_unary($k, x, out))
        };
    }
    if op == BinaryOp::Pow {
        // A scalar exponent takes PyTorch's `pow(Tensor, Scalar)` shortcuts.
        if let Some(e) = broadcast_scalar::<T>(b)? {
            match e.cast_f64() {
                1.0 => return go1!(Identity),
                2.0 => return go1!(Square),
                3.0 => return go1!(Cube),
                0.5 => return go1!(Sqrt),
                -0.5 => return go1!(Rsqrt),
                -1.0 => return go1!(Recip),
                -2.0 => return go1!(RecipSquare),
                _ => {}
            }
        }
    }
    let cost = binary_cost(op).ok_or_else(|| match op {
        BinaryOp::And | BinaryOp::Or | BinaryOp::Xor => Error::backend("cpu", format!("{} is a logical op", op.name())),
        _ => Error::unsupported_dtype(op.name(), T::DTYPE),
    })?;
    fmap::<T, 2>([a, b], cost, &|[x, y], out| binary_slice(op, x, y, out))
}

/// Element-operations per element of a float binary op, `None` for the ops
/// that are not float ops (logical and bitwise ones).
pub(crate) fn binary_cost(op: BinaryOp) -> Option<usize> {
    use BinaryOp as B;
    Some(match op {
        B::Add | B::Sub | B::Mul | B::Div | B::Maximum | B::Minimum | B::Fmax | B::Fmin => 1,
        B::SiluMul => 6,
        B::FloorDiv | B::Remainder | B::Fmod | B::Pow | B::Atan2 | B::SiluGradMul => 8,
        B::And | B::Or | B::Xor | B::BitwiseAnd | B::BitwiseOr | B::BitwiseXor | B::LeftShift | B::RightShift => {
            return None
        }
    })
}

/// `out[i] = op(a[i], b[i])` for a float op of [`binary_cost`] (one home, as
/// [`unary_slice`]); `pow` here is the general power, without the scalar
/// exponent's shortcuts. Other ops write nothing: callers check first.
pub(crate) fn binary_slice<C: Compute>(op: BinaryOp, a: &[C], b: &[C], out: &mut [MaybeUninit<C>]) {
    use BinaryOp as B;
    match op {
        B::Add => map_binary(Add, a, b, out),
        B::Sub => map_binary(Sub, a, b, out),
        B::Mul => map_binary(Mul, a, b, out),
        B::Div => map_binary(Div, a, b, out),
        B::FloorDiv => map_binary(FloorDiv, a, b, out),
        B::Remainder => map_binary(Remainder, a, b, out),
        B::Fmod => map_binary(Fmod, a, b, out),
        B::Pow => map_binary(Pow, a, b, out),
        B::Maximum => map_binary(Maximum, a, b, out),
        B::Minimum => map_binary(Minimum, a, b, out),
        B::Fmax => map_binary(Fmax, a, b, out),
        B::Fmin => map_binary(Fmin, a, b, out),
        B::Atan2 => map_binary(Atan2, a, b, out),
        B::SiluMul => map_binary(SiluMul, a, b, out),
        B::SiluGradMul => map_binary(SiluGradMul, a, b, out),
        B::And | B::Or | B::Xor | B::BitwiseAnd | B::BitwiseOr | B::BitwiseXor | B::LeftShift | B::RightShift => {}
    }
}

/// True when any element of `x` satisfies `pred`.
pub(crate) fn any_elem<T: Elem>(x: &Input<'_>, pred: impl Fn(T) -> bool) -> Result<bool> {
    let v = x.slice::<T>()?;
    let l = x.layout;
    let nest = Nest::new(l.shape(), [l.strides()], [l.offset()]);
    let [s] = nest.inner_strides();
    let mut found = false;
    nest.for_each_run(0, nest.numel(), |[o], len| {
        if !found {
            found = (0..len).any(|j| pred(v[o + j * s]));
        }
    });
    Ok(found)
}

fn zero_division(op: BinaryOp) -> Error {
    Error::invalid(op.name(), "ZeroDivisionError: integer division or modulo by zero")
}

fn int_binary<T: IntElem>(op: BinaryOp, a: &Input<'_>, b: &Input<'_>) -> Result<Vec<T>> {
    use BinaryOp as B;
    if matches!(op, B::Div | B::FloorDiv | B::Remainder | B::Fmod) && any_elem::<T>(b, |v| v == T::of_i64(0))? {
        return Err(zero_division(op));
    }
    if op == B::Pow && T::SIGNED && any_elem::<T>(b, |v| v.is_neg())? {
        return Err(Error::invalid("pow", "Integers to negative integer powers are not allowed."));
    }
    let (zero, one) = (T::of_i64(0), T::of_i64(1));
    match op {
        B::Add => map2::<T, T, T>(a, b, 1, |x, y| x.add_(y)),
        B::Sub => map2::<T, T, T>(a, b, 1, |x, y| x.wsub(y)),
        B::Mul => map2::<T, T, T>(a, b, 1, |x, y| x.mul_(y)),
        B::Div => map2::<T, T, T>(a, b, 2, |x, y| x.wdiv(y)),
        // PyTorch's div_floor_integer: truncate, then step down when the signs differ and it was inexact.
        B::FloorDiv => map2::<T, T, T>(a, b, 2, |x, y| {
            let (q, r) = (x.wdiv(y), x.wrem(y));
            if r != zero && x.is_neg() != y.is_neg() {
                q.wsub(one)
            } else {
                q
            }
        }),
        B::Remainder => map2::<T, T, T>(a, b, 2, |x, y| {
            let m = x.wrem(y);
            if m != zero && m.is_neg() != y.is_neg() {
                m.add_(y)
            } else {
                m
            }
        }),
        B::Fmod => map2::<T, T, T>(a, b, 2, |x, y| x.wrem(y)),
        B::Pow => map2::<T, T, T>(a, b, 4, |x, y| x.wpow(y.cast_i64() as u64)),
        B::Maximum | B::Fmax => map2::<T, T, T>(a, b, 1, |x, y| if x > y { x } else { y }),
        B::Minimum | B::Fmin => map2::<T, T, T>(a, b, 1, |x, y| if x < y { x } else { y }),
        B::BitwiseAnd => map2::<T, T, T>(a, b, 1, |x, y| x.band(y)),
        B::BitwiseOr => map2::<T, T, T>(a, b, 1, |x, y| x.bor(y)),
        B::BitwiseXor => map2::<T, T, T>(a, b, 1, |x, y| x.bxor(y)),
        B::LeftShift => map2::<T, T, T>(a, b, 1, |x, y| x.shl(y)),
        B::RightShift => map2::<T, T, T>(a, b, 1, |x, y| x.shr(y)),
        B::Atan2 | B::SiluMul | B::SiluGradMul | B::And | B::Or | B::Xor => {
            Err(Error::unsupported_dtype(op.name(), T::DTYPE))
        }
    }
}

/// Bool arithmetic as PyTorch does it: the values are 0 and 1, results are `!= 0`.
fn bool_binary(op: BinaryOp, a: &Input<'_>, b: &Input<'_>) -> Result<Vec<bool>> {
    use BinaryOp as B;
    if matches!(op, B::Div | B::FloorDiv | B::Remainder | B::Fmod) && any_elem::<bool>(b, |v| !v)? {
        return Err(zero_division(op));
    }
    match op {
        B::Add | B::Maximum | B::Fmax => map2::<bool, bool, bool>(a, b, 1, |x, y| x | y),
        B::Mul | B::Minimum | B::Fmin => map2::<bool, bool, bool>(a, b, 1, |x, y| x & y),
        // x / 1 and x // 1 are x; x % 1 is 0.
        B::Div | B::FloorDiv => map2::<bool, bool, bool>(a, b, 1, |x, _| x),
        B::Remainder | B::Fmod => map2::<bool, bool, bool>(a, b, 1, |_, _| false),
        // 0 ** 0 = 1, 0 ** 1 = 0, 1 ** y = 1.
        B::Pow => map2::<bool, bool, bool>(a, b, 1, |x, y| x | !y),
        B::BitwiseAnd => map2::<bool, bool, bool>(a, b, 1, |x, y| x & y),
        B::BitwiseOr => map2::<bool, bool, bool>(a, b, 1, |x, y| x | y),
        B::BitwiseXor => map2::<bool, bool, bool>(a, b, 1, |x, y| x ^ y),
        B::Sub | B::Atan2 | B::SiluMul | B::SiluGradMul | B::And | B::Or | B::Xor | B::LeftShift | B::RightShift => {
            Err(Error::unsupported_dtype(op.name(), DType::Bool))
        }
    }
}

// ---- compare and where -------------------------------------------------------

macro_rules! cmp_fn {
    ($name:ident, $op:tt) => {
        #[inline(always)]
        fn $name<T: Elem>(a: T, b: T) -> bool {
            // 16-bit floats compare as their (exact) f32 values.
            if T::KIND == Kind::Half {
                a.cast_f32() $op b.cast_f32()
            } else {
                a $op b
            }
        }
    };
}
cmp_fn!(eq, ==);
cmp_fn!(lt, <);
cmp_fn!(le, <=);

/// Runs a comparison (output bool; every comparison with NaN is false except `ne`).
pub(crate) fn compare(op: CmpOp, a: &Input<'_>, b: &Input<'_>) -> Result<HostBuffer> {
    if a.dtype() != b.dtype() {
        return Err(Error::dtype(op.name(), format!("expected equal dtypes, got {} and {}", a.dtype(), b.dtype())));
    }
    // a > b is b < a and a >= b is b <= a: four kernels per dtype.
    with_dtype!(a.dtype(), T => {
        let v = match op {
            CmpOp::Eq => map2::<T, T, bool>(a, b, 1, eq::<T>)?,
            CmpOp::Ne => map2::<T, T, bool>(a, b, 1, |x, y| !eq(x, y))?,
            CmpOp::Lt => map2::<T, T, bool>(a, b, 1, lt::<T>)?,
            CmpOp::Le => map2::<T, T, bool>(a, b, 1, le::<T>)?,
            CmpOp::Gt => map2::<T, T, bool>(b, a, 1, lt::<T>)?,
            CmpOp::Ge => map2::<T, T, bool>(b, a, 1, le::<T>)?,
        };
        Ok(buf(v))
    })
}

/// `where(cond, a, b)`.
pub(crate) fn where_(c: &Input<'_>, a: &Input<'_>, b: &Input<'_>) -> Result<HostBuffer> {
    if c.dtype() != DType::Bool || a.dtype() != b.dtype() {
        return Err(Error::dtype(
            "where",
            format!("expected a bool condition and equal dtypes, got {}, {} and {}", c.dtype(), a.dtype(), b.dtype()),
        ));
    }
    with_dtype!(a.dtype(), T => Ok(buf(map3::<bool, T, T, T>(c, a, b, 1, |k, x, y| if k { x } else { y })?)))
}
