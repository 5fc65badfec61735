//! Reference kernels (straightforward strided loops). Every primitive's CPU
//! implementation is dispatched from `exec`.
use kiln_tensor::{
    with_dtype, with_host_buffer, BinaryOp, CmpOp, DType, Element, Error, HostBuffer, HostElement, Layout, Meta, Op,
    Result, UnaryOp,
};

/// A read-only strided input: a host buffer and the layout viewing it.
pub(crate) struct Input<'a> {
    pub buf: &'a HostBuffer,
    pub layout: &'a Layout,
}

/// Storage indices of a layout's elements in row-major order.
pub(crate) fn strided_indices(l: &Layout) -> impl Iterator<Item = usize> + '_ {
    let n = l.numel();
    let nd = l.ndim();
    let mut idx = vec![0usize; nd];
    let mut pos = l.offset();
    let mut i = 0usize;
    std::iter::from_fn(move || {
        if i >= n {
            return None;
        }
        let cur = pos;
        i += 1;
        for d in (0..nd).rev() {
            idx[d] += 1;
            pos += l.strides()[d];
            if idx[d] < l.shape()[d] {
                break;
            }
            pos -= l.strides()[d] * l.shape()[d];
            idx[d] = 0;
        }
        Some(cur)
    })
}

fn gather_vec<T: Copy>(src: &[T], l: &Layout) -> Vec<T> {
    if l.is_contiguous() {
        return src[l.offset()..l.offset() + l.numel()].to_vec();
    }
    strided_indices(l).map(|i| src[i]).collect()
}

/// A contiguous row-major copy of a strided input.
pub(crate) fn materialize(x: &Input<'_>) -> HostBuffer {
    with_host_buffer!(x.buf, v => HostElement::into_buffer(gather_vec(v, x.layout)))
}

/// Writes `src` (same shape and dtype) into `dst` through `dst_layout`.
pub(crate) fn assign(dst: &mut HostBuffer, dst_layout: &Layout, src: &Input<'_>) -> Result<()> {
    let vals = materialize(src);
    macro_rules! go {
        ($T:ty) => {{
            let d = <$T>::slice_mut(dst).ok_or_else(|| Error::backend("cpu", "assign: dtype mismatch"))?;
            let s = <$T>::slice(&vals).unwrap();
            for (k, i) in strided_indices(dst_layout).enumerate() {
                d[i] = s[k];
            }
        }};
    }
    with_dtype!(dst.dtype(), T => go!(T));
    Ok(())
}

/// Indices of non-zero elements, flattened `[n, ndim]`.
pub(crate) fn nonzero(x: &Input<'_>) -> (Vec<i64>, usize) {
    let shape = x.layout.shape().to_vec();
    let vals = materialize(x);
    let mut out = vec![];
    let mut n = 0;
    for k in 0..vals.len() {
        if vals.get_f64(k) != 0.0 {
            n += 1;
            let mut rem = k;
            let mut coord = vec![0i64; shape.len()];
            for d in (0..shape.len()).rev() {
                coord[d] = (rem % shape[d]) as i64;
                rem /= shape[d];
            }
            out.extend(coord);
        }
    }
    (out, n)
}

fn map_f64<T: HostElement>(v: &[T], f: impl Fn(f64) -> f64) -> HostBuffer {
    T::into_buffer(v.iter().map(|&x| T::from_f64(f(x.to_f64()))).collect())
}

fn unary(op: UnaryOp, x: &Input<'_>) -> Result<HostBuffer> {
    let vals = materialize(x);
    let dt = vals.dtype();
    use UnaryOp::*;
    if matches!(op, Not | IsNan | IsInf) {
        let out: Vec<bool> = (0..vals.len())
            .map(|i| {
                let v = vals.get_f64(i);
                match op {
                    Not => v == 0.0,
                    IsNan => v.is_nan(),
                    _ => v.is_infinite(),
                }
            })
            .collect();
        return Ok(HostBuffer::Bool(out));
    }
    if !dt.is_float() {
        let out: Vec<i64> = (0..vals.len())
            .map(|i| {
                let v = vals.get_i64(i);
                match op {
                    Neg => v.wrapping_neg(),
                    Abs => v.wrapping_abs(),
                    Sign => v.signum(),
                    _ => v,
                }
            })
            .collect();
        return Ok(with_dtype!(dt, T => T::into_buffer(out.iter().map(|&v| T::from_i64(v)).collect())));
    }
    let f = |v: f64| -> f64 {
        match op {
            Neg => -v,
            Abs => v.abs(),
            Sign => {
                if v.is_nan() {
                    v
                } else if v > 0.0 {
                    1.0
                } else if v < 0.0 {
                    -1.0
                } else {
                    0.0
                }
            }
            Exp => v.exp(),
            Log => v.ln(),
            Log1p => v.ln_1p(),
            Expm1 => v.exp_m1(),
            Sqrt => v.sqrt(),
            Rsqrt => 1.0 / v.sqrt(),
            Recip => 1.0 / v,
            Tanh => v.tanh(),
            Sigmoid => 1.0 / (1.0 + (-v).exp()),
            Sin => v.sin(),
            Cos => v.cos(),
            Erf => erf(v),
            Floor => v.floor(),
            Ceil => v.ceil(),
            Round => v.round_ties_even(),
            Trunc => v.trunc(),
            Not | IsNan | IsInf => unreachable!(),
        }
    };
    Ok(with_host_buffer!(&vals, v => map_f64(v, f)))
}

/// erf via Abramowitz-Stegun 7.1.26 refined; accurate to ~1e-7 (reference kernel).
fn erf(x: f64) -> f64 {
    // Use the complementary error function series for accuracy: W. J. Cody's rational approximations
    // are overkill here; a high-order Taylor/continued-fraction split is enough for f32 outputs.
    if x.is_nan() {
        return x;
    }
    let ax = x.abs();
    let r = if ax < 2.5 {
        // Taylor series: erf(x) = 2/sqrt(pi) * sum (-1)^n x^(2n+1) / (n! (2n+1))
        let mut sum = 0.0;
        let mut term = ax;
        let x2 = ax * ax;
        let mut n = 0.0;
        loop {
            let t = term / (2.0 * n + 1.0);
            sum += t;
            if t.abs() < 1e-17 * sum.abs() {
                break;
            }
            n += 1.0;
            term *= -x2 / n;
        }
        sum * std::f64::consts::FRAC_2_SQRT_PI
    } else {
        // Continued fraction for erfc.
        let x2 = ax * ax;
        let mut f = 0.0;
        for k in (1..60).rev() {
            f = (k as f64 / 2.0) / (ax + f);
        }
        1.0 - (-x2).exp() / (std::f64::consts::PI.sqrt() * (ax + f))
    };
    if x < 0.0 {
        -r
    } else {
        r
    }
}

fn binary(op: BinaryOp, a: &Input<'_>, b: &Input<'_>, out: &Meta) -> Result<HostBuffer> {
    let (va, vb) = (materialize(a), materialize(b));
    let dt = va.dtype();
    let n = va.len();
    use BinaryOp::*;
    if op.is_logical() {
        let r: Vec<bool> = (0..n)
            .map(|i| {
                let (x, y) = (va.get_f64(i) != 0.0, vb.get_f64(i) != 0.0);
                match op {
                    And => x && y,
                    Or => x || y,
                    _ => x ^ y,
                }
            })
            .collect();
        return Ok(HostBuffer::Bool(r));
    }
    if dt == DType::Bool {
        let r: Vec<bool> = (0..n)
            .map(|i| {
                let (x, y) = (va.get_f64(i) != 0.0, vb.get_f64(i) != 0.0);
                match op {
                    Add | Maximum | Fmax => x || y,
                    Mul | Minimum | Fmin => x && y,
                    _ => x ^ y,
                }
            })
            .collect();
        return Ok(HostBuffer::Bool(r));
    }
    if dt.is_int() {
        let mut r = Vec::with_capacity(n);
        for i in 0..n {
            let (x, y) = (va.get_i64(i), vb.get_i64(i));
            let needs_nonzero = matches!(op, Div | FloorDiv | Remainder | Fmod);
            if needs_nonzero && y == 0 {
                return Err(Error::invalid(op.name(), "ZeroDivisionError: integer division by zero"));
            }
            r.push(match op {
                Add => x.wrapping_add(y),
                Sub => x.wrapping_sub(y),
                Mul => x.wrapping_mul(y),
                Div => x.wrapping_div(y),
                FloorDiv => {
                    let q = x.wrapping_div(y);
                    if (x % y != 0) && ((x < 0) != (y < 0)) {
                        q - 1
                    } else {
                        q
                    }
                }
                Remainder => {
                    let m = x.wrapping_rem(y);
                    if m != 0 && ((m < 0) != (y < 0)) {
                        m + y
                    } else {
                        m
                    }
                }
                Fmod => x.wrapping_rem(y),
                Pow => {
                    if y < 0 {
                        return Err(Error::invalid("pow", "integers to negative integer powers are not allowed"));
                    }
                    x.wrapping_pow(y.min(u32::MAX as i64) as u32)
                }
                Maximum | Fmax => x.max(y),
                Minimum | Fmin => x.min(y),
                Atan2 | And | Or | Xor => unreachable!(),
            });
        }
        return Ok(with_dtype!(out.dtype, T => T::into_buffer(r.iter().map(|&v| T::from_i64(v)).collect())));
    }
    let f = |x: f64, y: f64| -> f64 {
        match op {
            Add => x + y,
            Sub => x - y,
            Mul => x * y,
            Div => x / y,
            FloorDiv => {
                if y == 0.0 {
                    x / y
                } else {
                    let m = x % y;
                    let mut d = (x - m) / y;
                    if m != 0.0 && ((y < 0.0) != (m < 0.0)) {
                        d -= 1.0;
                    }
                    let fd = d.floor();
                    if d - fd > 0.5 {
                        fd + 1.0
                    } else {
                        fd
                    }
                }
            }
            Remainder => {
                let m = x % y;
                if m != 0.0 && ((m < 0.0) != (y < 0.0)) {
                    m + y
                } else {
                    m
                }
            }
            Fmod => x % y,
            Pow => x.powf(y),
            Maximum => {
                if x.is_nan() || y.is_nan() {
                    f64::NAN
                } else {
                    x.max(y)
                }
            }
            Minimum => {
                if x.is_nan() || y.is_nan() {
                    f64::NAN
                } else {
                    x.min(y)
                }
            }
            Fmax => x.max(y),
            Fmin => x.min(y),
            Atan2 => x.atan2(y),
            And | Or | Xor => unreachable!(),
        }
    };
    Ok(with_dtype!(dt, T => T::into_buffer((0..n).map(|i| T::from_f64(f(va.get_f64(i), vb.get_f64(i)))).collect())))
}

fn compare(op: CmpOp, a: &Input<'_>, b: &Input<'_>) -> HostBuffer {
    let (va, vb) = (materialize(a), materialize(b));
    let int = !va.dtype().is_float();
    let r = (0..va.len())
        .map(|i| {
            let ord =
                if int { va.get_i64(i).partial_cmp(&vb.get_i64(i)) } else { va.get_f64(i).partial_cmp(&vb.get_f64(i)) };
            use std::cmp::Ordering::*;
            match (op, ord) {
                (CmpOp::Ne, None) => true,
                (_, None) => false,
                (CmpOp::Eq, Some(o)) => o == Equal,
                (CmpOp::Ne, Some(o)) => o != Equal,
                (CmpOp::Lt, Some(o)) => o == Less,
                (CmpOp::Le, Some(o)) => o != Greater,
                (CmpOp::Gt, Some(o)) => o == Greater,
                (CmpOp::Ge, Some(o)) => o != Less,
            }
        })
        .collect();
    HostBuffer::Bool(r)
}

fn cast(x: &Input<'_>, to: DType) -> HostBuffer {
    let v = materialize(x);
    let n = v.len();
    if v.dtype().is_float() || to.is_float() {
        with_dtype!(to, T => T::into_buffer((0..n).map(|i| T::from_f64(v.get_f64(i))).collect()))
    } else {
        with_dtype!(to, T => T::into_buffer((0..n).map(|i| T::from_i64(v.get_i64(i))).collect()))
    }
}

/// Runs one primitive.
pub(crate) fn exec(op: &Op, ins: &[Input<'_>], outs: &[Meta]) -> Result<Vec<HostBuffer>> {
    Ok(match op {
        Op::Full { shape, value, dtype } => {
            let n = kiln_tensor::numel(shape);
            vec![with_dtype!(*dtype, T => T::into_buffer(vec![value.to_elem::<T>(); n]))]
        }
        Op::Arange { start, step, len, dtype } => {
            vec![
                with_dtype!(*dtype, T => T::into_buffer((0..*len).map(|i| T::from_f64(start + step * i as f64)).collect())),
            ]
        }
        Op::Cast(to) => vec![cast(&ins[0], *to)],
        Op::Copy => vec![materialize(&ins[0])],
        Op::Unary(u) => vec![unary(*u, &ins[0])?],
        Op::Binary(b) => vec![binary(*b, &ins[0], &ins[1], &outs[0])?],
        Op::Compare(c) => vec![compare(*c, &ins[0], &ins[1])],
        Op::Where => {
            let c = materialize(&ins[0]);
            let (a, b) = (materialize(&ins[1]), materialize(&ins[2]));
            let c = c.as_slice::<bool>().unwrap();
            vec![with_host_buffer!(&a, av => {
                let bv = HostElement::slice(&b).unwrap();
                HostElement::into_buffer(av.iter().zip(bv.iter()).zip(c).map(|((x, y), &k)| if k { *x } else { *y }).collect::<Vec<_>>())
            })]
        }
        other => return Err(Error::backend("cpu", format!("no CPU kernel yet for {}", other.name()))),
    })
}

#[allow(dead_code)]
fn _elem<T: Element>() {}
