//! Lowerings of the elementwise primitives, with PyTorch's numerics spelled
//! out where StableHLO's own ops differ (floor division, remainder, shifts,
//! NaN-propagating max and min).
use super::ops::*;
use super::{Builder, Lit, Val};
use kiln_tensor::{BinaryOp, DType, Result, UnaryOp};

pub(super) fn unary(b: &mut Builder, op: UnaryOp, x: &Val) -> Result<Val> {
    use UnaryOp as U;
    let dt = x.dtype();
    match op {
        U::Not => return Ok(if dt == DType::Bool { b.not(x) } else { b.compare_lit("EQ", x, Lit::I(0)) }),
        U::IsNan => {
            return Ok(if dt.is_float() { b.is_nan(x) } else { b.splat(Lit::B(false), DType::Bool, x.shape()) });
        }
        U::IsInf => {
            if !dt.is_float() {
                return Ok(b.splat(Lit::B(false), DType::Bool, x.shape()));
            }
            let a = b.unary("abs", x);
            return Ok(b.compare_lit("EQ", &a, Lit::F(f64::INFINITY)));
        }
        _ => {}
    }
    if dt == DType::Bool {
        return match op {
            U::Abs | U::Sign | U::Floor | U::Ceil | U::Round | U::Trunc => Ok(x.clone()),
            _ => Err(unsupported(op.name(), dt)),
        };
    }
    if !dt.is_float() {
        return match op {
            U::Neg => Ok(b.unary("negate", x)),
            U::Abs => Ok(b.unary("abs", x)),
            U::Sign => Ok(b.unary("sign", x)),
            U::Floor | U::Ceil | U::Round | U::Trunc => Ok(x.clone()),
            _ => Err(unsupported(op.name(), dt)),
        };
    }
    let f = up(b, x);
    let y = match op {
        U::Neg => b.unary("negate", &f),
        U::Abs => b.unary("abs", &f),
        U::Sign => {
            // (0 < x) - (x < 0): NaN and -0.0 give 0.
            let z = b.splat_like(Lit::F(0.0), &f);
            let p = b.compare("GT", &f, &z);
            let n = b.compare("LT", &f, &z);
            let (pf, nf) = (b.convert_raw(&p, f.dtype()), b.convert_raw(&n, f.dtype()));
            b.sub(&pf, &nf)
        }
        U::Exp => b.unary("exponential", &f),
        U::Log => b.unary("log", &f),
        U::Log1p => b.unary("log_plus_one", &f),
        U::Expm1 => b.unary("exponential_minus_one", &f),
        U::Sqrt => b.unary("sqrt", &f),
        U::Rsqrt => {
            let s = b.unary("sqrt", &f);
            let o = b.splat_like(Lit::F(1.0), &f);
            b.div(&o, &s)
        }
        U::Recip => {
            let o = b.splat_like(Lit::F(1.0), &f);
            b.div(&o, &f)
        }
        U::Tanh => b.unary("tanh", &f),
        U::Sigmoid => b.unary("logistic", &f),
        U::Silu => {
            let s = b.unary("logistic", &f);
            b.mul(&f, &s)
        }
        U::SiluGrad => silu_grad(b, &f),
        U::Sin => b.unary("sine", &f),
        U::Cos => b.unary("cosine", &f),
        U::Erf => b.op("chlo.erf", &[&f], vec![], f.ty.clone()),
        U::Floor => b.unary("floor", &f),
        U::Ceil => b.unary("ceil", &f),
        U::Round => b.unary("round_nearest_even", &f),
        U::Trunc => {
            let z = b.splat_like(Lit::F(0.0), &f);
            let neg = b.compare("LT", &f, &z);
            let (c, fl) = (b.unary("ceil", &f), b.unary("floor", &f));
            b.select(&neg, &c, &fl)
        }
        U::Not | U::IsNan | U::IsInf => unreachable!("handled above"),
    };
    Ok(b.convert_raw(&y, dt))
}

/// `s (1 + x (1 - s))`, `s = sigmoid(x)`.
pub(super) fn silu_grad(b: &mut Builder, f: &Val) -> Val {
    let s = b.unary("logistic", f);
    let o = b.splat_like(Lit::F(1.0), f);
    let oms = b.sub(&o, &s);
    let t = b.mul(f, &oms);
    let t = b.add(&o, &t);
    b.mul(&s, &t)
}

/// PyTorch's truth value (`!= 0`) of any dtype.
pub(super) fn truth(b: &mut Builder, x: &Val) -> Val {
    if x.dtype() == DType::Bool {
        x.clone()
    } else {
        b.compare_lit("NE", x, Lit::I(0))
    }
}

/// `m != 0 && (m < 0) != (d < 0)`: the remainder needs the divisor's sign.
pub(super) fn sign_fix(b: &mut Builder, m: &Val, d: &Val) -> Val {
    let nz = b.compare_lit("NE", m, Lit::I(0));
    let mn = b.compare_lit("LT", m, Lit::I(0));
    let dn = b.compare_lit("LT", d, Lit::I(0));
    let differ = b.compare("NE", &mn, &dn);
    b.and(&nz, &differ)
}

/// PyTorch's shifts, with its rule for amounts outside `[0, width)` spelled
/// out (left: 0; right: the shift by `width - 1`), so no backend's own
/// convention leaks in. Right shifts are arithmetic, logical for uint8.
pub(super) fn shift(b: &mut Builder, left: bool, a0: &Val, b0: &Val) -> Val {
    let width = (a0.dtype().size_in_bytes() * 8) as i64;
    let nonneg = b.compare_lit("GE", b0, Lit::I(0));
    let below = b.compare_lit("LT", b0, Lit::I(width));
    let in_range = b.and(&nonneg, &below);
    if left {
        let s = b.binary("shift_left", a0, b0);
        let zero = b.splat_like(Lit::I(0), a0);
        return b.select(&in_range, &s, &zero);
    }
    let name = if a0.dtype() == DType::U8 { "shift_right_logical" } else { "shift_right_arithmetic" };
    let s = b.binary(name, a0, b0);
    let most = b.splat_like(Lit::I(width - 1), a0);
    let far = b.binary(name, a0, &most);
    b.select(&in_range, &s, &far)
}

pub(super) fn binary(b: &mut Builder, op: BinaryOp, a0: &Val, b0: &Val) -> Result<Val> {
    use BinaryOp as B;
    let dt = a0.dtype();
    if op.is_logical() {
        let (ta, tb) = (truth(b, a0), truth(b, b0));
        return Ok(match op {
            B::And => b.and(&ta, &tb),
            B::Or => b.or(&ta, &tb),
            _ => b.binary("xor", &ta, &tb),
        });
    }
    if dt == DType::Bool {
        return Ok(match op {
            B::Add | B::Maximum | B::Fmax => b.or(a0, b0),
            B::Mul | B::Minimum | B::Fmin => b.and(a0, b0),
            B::Div | B::FloorDiv => a0.clone(),
            B::Remainder | B::Fmod => b.splat_like(Lit::B(false), a0),
            B::Pow => {
                let nb = b.not(b0);
                b.or(a0, &nb)
            }
            B::BitwiseAnd => b.and(a0, b0),
            B::BitwiseOr => b.or(a0, b0),
            B::BitwiseXor => b.binary("xor", a0, b0),
            _ => return Err(unsupported(op.name(), dt)),
        });
    }
    if !dt.is_float() {
        return Ok(match op {
            B::Add => b.add(a0, b0),
            B::Sub => b.sub(a0, b0),
            B::Mul => b.mul(a0, b0),
            B::Div => b.div(a0, b0),
            B::FloorDiv => {
                let q = b.div(a0, b0);
                let r = b.binary("remainder", a0, b0);
                let nz = b.compare_lit("NE", &r, Lit::I(0));
                let an = b.compare_lit("LT", a0, Lit::I(0));
                let bn = b.compare_lit("LT", b0, Lit::I(0));
                let differ = b.compare("NE", &an, &bn);
                let fix = b.and(&nz, &differ);
                let one = b.splat_like(Lit::I(1), a0);
                let q1 = b.sub(&q, &one);
                b.select(&fix, &q1, &q)
            }
            B::Remainder => {
                let m = b.binary("remainder", a0, b0);
                let fix = sign_fix(b, &m, b0);
                let mb = b.add(&m, b0);
                b.select(&fix, &mb, &m)
            }
            B::Fmod => b.binary("remainder", a0, b0),
            B::Pow => b.binary("power", a0, b0),
            B::Maximum | B::Fmax => b.binary("maximum", a0, b0),
            B::Minimum | B::Fmin => b.binary("minimum", a0, b0),
            B::BitwiseAnd => b.and(a0, b0),
            B::BitwiseOr => b.or(a0, b0),
            B::BitwiseXor => b.binary("xor", a0, b0),
            B::LeftShift | B::RightShift => shift(b, op == B::LeftShift, a0, b0),
            _ => return Err(unsupported(op.name(), dt)),
        });
    }
    let (a, c) = (up(b, a0), up(b, b0));
    let y = match op {
        B::Add => b.add(&a, &c),
        B::Sub => b.sub(&a, &c),
        B::Mul => b.mul(&a, &c),
        B::Div => b.div(&a, &c),
        B::FloorDiv => floor_div(b, &a, &c),
        B::Remainder => {
            let m = b.binary("remainder", &a, &c);
            let fix = sign_fix(b, &m, &c);
            let mb = b.add(&m, &c);
            b.select(&fix, &mb, &m)
        }
        B::Fmod => b.binary("remainder", &a, &c),
        B::Pow => b.binary("power", &a, &c),
        B::Maximum => nan_max(b, &a, &c, true),
        B::Minimum => nan_max(b, &a, &c, false),
        B::Fmax | B::Fmin => {
            // NaN-ignoring: a when a wins or b is NaN.
            let dir = if op == B::Fmax { "GT" } else { "LT" };
            let wins = b.compare(dir, &a, &c);
            let bn = b.is_nan(&c);
            let pick = b.or(&wins, &bn);
            b.select(&pick, &a, &c)
        }
        B::Atan2 => b.binary("atan2", &a, &c),
        B::SiluMul => {
            let s = b.unary("logistic", &a);
            let t = b.mul(&a, &s);
            b.mul(&t, &c)
        }
        B::SiluGradMul => {
            let g = silu_grad(b, &a);
            b.mul(&g, &c)
        }
        B::And | B::Or | B::Xor => unreachable!("handled above"),
        B::BitwiseAnd | B::BitwiseOr | B::BitwiseXor | B::LeftShift | B::RightShift => {
            return Err(unsupported(op.name(), dt))
        }
    };
    Ok(b.convert_raw(&y, dt))
}

/// NaN-propagating maximum (or minimum): `a + b` when either is NaN.
pub(super) fn nan_max(b: &mut Builder, a: &Val, c: &Val, max: bool) -> Val {
    let m = b.binary(if max { "maximum" } else { "minimum" }, a, c);
    if !a.dtype().is_float() {
        return m;
    }
    let (an, cn) = (b.is_nan(a), b.is_nan(c));
    let any = b.or(&an, &cn);
    let s = b.add(a, c);
    b.select(&any, &s, &m)
}

/// PyTorch's `div_floor_floating` (Python's `//`, with the sign of an exact zero).
pub(super) fn floor_div(b: &mut Builder, a: &Val, c: &Val) -> Val {
    let m = b.binary("remainder", a, c);
    let am = b.sub(a, &m);
    let div = b.div(&am, c);
    let fix = sign_fix(b, &m, c);
    let one = b.splat_like(Lit::F(1.0), a);
    let d1 = b.sub(&div, &one);
    let div = b.select(&fix, &d1, &div);
    let fl = b.unary("floor", &div);
    let frac = b.sub(&div, &fl);
    let half = b.splat_like(Lit::F(0.5), a);
    let up_ = b.compare("GT", &frac, &half);
    let fl1 = b.add(&fl, &one);
    let rounded = b.select(&up_, &fl1, &fl);
    // An exact zero quotient takes the sign of a / b.
    let q = b.div(a, c);
    let zero = b.splat_like(Lit::F(0.0), a);
    let signed_zero = {
        let qn = b.compare("LT", &q, &zero);
        // -0.0 < 0 is false, so also look at the sign bit through 1/q (-inf for -0.0).
        let inv = b.div(&one, &q);
        let inv_neg = b.compare("LT", &inv, &zero);
        let neg_q = b.or(&qn, &inv_neg);
        let neg_zero = b.splat_like(Lit::F(-0.0), a);
        b.select(&neg_q, &neg_zero, &zero)
    };
    let is_zero = b.compare("EQ", &div, &zero);
    let r = b.select(&is_zero, &signed_zero, &rounded);
    // b == 0: a / b (inf or nan).
    let bz = b.compare("EQ", c, &zero);
    b.select(&bz, &q, &r)
}
