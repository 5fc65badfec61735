//! Gradient rules of the elementwise primitives.
use super::*;

/// `Op::Unary`.
pub(super) fn unary(ctx: &Ctx<'_>, g: &Tensor, out: &mut [Option<Tensor>], u: &UnaryOp) -> Result<()> {
    if !ctx.needs(0) {
        return Ok(());
    }
    let x = || ctx.saved(0);
    use UnaryOp::*;
    out[0] = match u {
        Neg => Some(g.neg()?),
        Abs => Some(g.mul(&x()?.sign()?)?),
        Sign | Floor | Ceil | Round | Trunc => Some(g.zeros_like()?),
        Exp => Some(g.mul(&x()?.exp()?)?),
        Log => Some(g.div(x()?)?),
        Log1p => Some(g.div(&x()?.add(1.0)?)?),
        Expm1 => Some(g.mul(&x()?.exp()?)?),
        Sqrt => Some(g.div(&x()?.sqrt()?.mul(2.0)?)?),
        Rsqrt => {
            let r = x()?.rsqrt()?;
            Some(g.mul(&r.mul(&r)?.mul(&r)?)?.mul(-0.5)?)
        }
        Recip => {
            let r = x()?.reciprocal()?;
            Some(g.mul(&r.mul(&r)?)?.neg()?)
        }
        Tanh => {
            let t = x()?.tanh()?;
            Some(g.mul(&t.mul(&t)?.neg()?.add(1.0)?)?)
        }
        Sigmoid => {
            let s = x()?.sigmoid()?;
            Some(g.mul(&s.mul(&s.neg()?.add(1.0)?)?)?)
        }
        Silu => Some(g.mul(&prim(Op::Unary(SiluGrad), &[x()?])?)?),
        SiluGrad => Some(g.mul(&silu_second_derivative(x()?)?)?),
        Sin => Some(g.mul(&x()?.cos()?)?),
        Cos => Some(g.mul(&x()?.sin()?.neg()?)?),
        Erf => {
            let x = x()?;
            let e = x.mul(x)?.neg()?.exp()?.mul(std::f64::consts::FRAC_2_SQRT_PI)?;
            Some(g.mul(&e)?)
        }
        Not | IsNan | IsInf => None,
    };
    Ok(())
}

/// `Op::Binary`.
pub(super) fn binary(ctx: &Ctx<'_>, g: &Tensor, out: &mut [Option<Tensor>], b: &BinaryOp) -> Result<()> {
    use BinaryOp::*;
    let (na, nb) = (ctx.needs(0), ctx.needs(1));
    match b {
        Add => {
            out[0] = na.then(|| g.clone());
            out[1] = nb.then(|| g.clone());
        }
        Sub => {
            out[0] = na.then(|| g.clone());
            out[1] = if nb { Some(g.neg()?) } else { None };
        }
        Mul => {
            if na {
                out[0] = Some(g.mul(ctx.saved(1)?)?);
            }
            if nb {
                out[1] = Some(g.mul(ctx.saved(0)?)?);
            }
        }
        Div => {
            let y = ctx.saved(1)?;
            if na {
                out[0] = Some(g.div(y)?);
            }
            if nb {
                let x = ctx.saved(0)?;
                out[1] = Some(g.mul(x)?.div(&y.mul(y)?)?.neg()?);
            }
        }
        FloorDiv => {
            out[0] = if na { Some(g.zeros_like()?) } else { None };
            out[1] = if nb { Some(g.zeros_like()?) } else { None };
        }
        Remainder | Fmod => {
            out[0] = na.then(|| g.clone());
            if nb {
                let (x, y) = (ctx.saved(0)?, ctx.saved(1)?);
                let q = if *b == Remainder { x.floor_divide(y)? } else { x.div(y)?.trunc()? };
                out[1] = Some(g.mul(&q)?.neg()?);
            }
        }
        Pow => {
            let (x, y) = (ctx.saved(0)?, ctx.saved(1)?);
            if na {
                out[0] = Some(g.mul(&y.mul(&x.pow(&y.sub(1.0)?)?)?)?);
            }
            if nb {
                // d/dy x^y = x^y ln x, defined as 0 where x == 0 and y >= 0 (PyTorch's convention).
                let d = x.pow(y)?.mul(&x.log()?)?;
                let zero_mask = x.eq(0.0)?.logical_and(&y.ge(0.0)?)?;
                out[1] = Some(g.mul(&d.masked_fill(&zero_mask, 0.0)?)?);
            }
        }
        Maximum | Minimum => {
            // Ties split the gradient evenly, like PyTorch.
            let (x, y) = (ctx.saved(0)?, ctx.saved(1)?);
            let half = Tensor::where_cond(&x.eq(y)?, &g.mul(0.5)?, g)?;
            let (lose_a, lose_b) = if *b == Maximum { (x.lt(y)?, x.gt(y)?) } else { (x.gt(y)?, x.lt(y)?) };
            if na {
                out[0] = Some(half.masked_fill(&lose_a, 0.0)?);
            }
            if nb {
                out[1] = Some(half.masked_fill(&lose_b, 0.0)?);
            }
        }
        Fmax | Fmin => {
            let (x, y) = (ctx.saved(0)?, ctx.saved(1)?);
            let pick_a = if *b == Fmax { x.ge(y)? } else { x.le(y)? }.logical_or(&y.isnan()?)?;
            if na {
                out[0] = Some(g.masked_fill(&pick_a.logical_not()?, 0.0)?);
            }
            if nb {
                out[1] = Some(g.masked_fill(&pick_a, 0.0)?);
            }
        }
        Atan2 => {
            let (x, y) = (ctx.saved(0)?, ctx.saved(1)?);
            let den = x.mul(x)?.add(&y.mul(y)?)?;
            if na {
                out[0] = Some(g.mul(&y.div(&den)?)?);
            }
            if nb {
                out[1] = Some(g.mul(&x.div(&den)?)?.neg()?);
            }
        }
        SiluMul => {
            // silu(a) * b: da = silu'(a) * (g * b), db = silu(a) * g.
            let (a, b) = (ctx.saved(0)?, ctx.saved(1)?);
            if na {
                out[0] = Some(prim(Op::Binary(SiluGradMul), &[a, &g.mul(b)?])?);
            }
            if nb {
                out[1] = Some(prim(Op::Binary(SiluMul), &[a, g])?);
            }
        }
        SiluGradMul => {
            // silu'(a) * b: da = silu''(a) * b * g, db = silu'(a) * g.
            let (a, b) = (ctx.saved(0)?, ctx.saved(1)?);
            if na {
                out[0] = Some(g.mul(b)?.mul(&silu_second_derivative(a)?)?);
            }
            if nb {
                out[1] = Some(prim(Op::Binary(SiluGradMul), &[a, g])?);
            }
        }
        // Integer and bool ops: nothing to differentiate.
        And | Or | Xor | BitwiseAnd | BitwiseOr | BitwiseXor | LeftShift | RightShift => {}
    }
    Ok(())
}
