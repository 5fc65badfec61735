//! Block-quantized weights in StableHLO (Note [Quantized weights] in
//! kiln-tensor): the codes and scales stay packed on the device and are
//! decoded inside the program, so XLA fuses the decoding into the dot that
//! consumes it and the float32 weight exists only inside the fusion.
use super::{Builder, Lit, Val};
use kiln_tensor::quant::{Activations, Codes, Global, QuantSpec, ACTIVATION_BLOCK};
use kiln_tensor::DType;

fn bitcast(b: &mut Builder, x: &Val, to: DType) -> Val {
    b.op("stablehlo.bitcast_convert", &[x], vec![], x.ty.with_dtype(to))
}

fn int_op(b: &mut Builder, name: &str, x: &Val, v: i64) -> Val {
    let c = b.splat_like(Lit::I(v), x);
    b.binary(name, x, &c)
}

/// E2M1 codes (int32, 0..16) to their float32 values: `m * 0.5` for a zero
/// exponent, else `2^(e - 1) * (1 + m / 2)` built from its bits; bit 3 negates
/// (code 8 is -0.0).
fn e2m1(b: &mut Builder, n: &Val) -> Val {
    let e = int_op(b, "shift_right_logical", n, 1);
    let e = int_op(b, "and", &e, 3);
    let m = int_op(b, "and", n, 1);
    let exp = int_op(b, "add", &e, 126);
    let exp = int_op(b, "shift_left", &exp, 23);
    let man = int_op(b, "shift_left", &m, 22);
    let bits = b.or(&exp, &man);
    let normal = bitcast(b, &bits, DType::F32);
    let mf = b.convert_raw(&m, DType::F32);
    let half = b.splat_like(Lit::F(0.5), &mf);
    let sub = b.mul(&mf, &half);
    let is_sub = b.compare_lit("EQ", &e, Lit::I(0));
    let mag = b.select(&is_sub, &sub, &normal);
    let s = int_op(b, "and", n, 8);
    let neg = b.compare_lit("NE", &s, Lit::I(0));
    let negated = b.unary("negate", &mag);
    b.select(&neg, &negated, &mag)
}

/// The element values `[out, in]` (float32) of the codes.
fn codes_f32(b: &mut Builder, spec: &QuantSpec, codes: &Val) -> Val {
    match spec.codes {
        Codes::E4M3 | Codes::I8 => b.convert_raw(codes, DType::F32),
        Codes::E2M1 => {
            let n = nibbles(b, codes);
            e2m1(b, &n)
        }
        Codes::I4 => {
            let n = nibbles(b, codes);
            let f = b.convert_raw(&n, DType::F32);
            let eight = b.splat_like(Lit::F(8.0), &f);
            b.sub(&f, &eight)
        }
    }
}

/// The 4-bit codes of a uint8 tensor `[out, in / 2]` as int32 `[out, in]`,
/// element `2j` from byte `j`'s low nibble.
fn nibbles(b: &mut Builder, codes: &Val) -> Val {
    let (n, half) = (codes.shape()[0], codes.shape()[1]);
    let c = b.convert_raw(codes, DType::I32);
    let lo = int_op(b, "and", &c, 15);
    let hi = int_op(b, "shift_right_logical", &c, 4);
    let lo = b.reshape(&lo, &[n, half, 1]);
    let hi = b.reshape(&hi, &[n, half, 1]);
    let both = b.concat(&[&lo, &hi], 2);
    b.reshape(&both, &[n, half * 2])
}

/// The effective block scales (float32, `[rows, cols]`): decoded, then
/// combined with the global scale.
fn scales_f32(b: &mut Builder, spec: &QuantSpec, scales: &Val) -> Val {
    let s = match scales.dtype() {
        DType::U8 => {
            // E8M0: 2^(b - 127) is the float32 with exponent field b; b = 0 is
            // the subnormal 2^-127 and 255 is NaN.
            let i = b.convert_raw(scales, DType::I32);
            let bits = int_op(b, "shift_left", &i, 23);
            let v = bitcast(b, &bits, DType::F32);
            let zero = b.compare_lit("EQ", &i, Lit::I(0));
            let tiny = b.splat_like(Lit::F(2f64.powi(-127)), &v);
            let v = b.select(&zero, &tiny, &v);
            let nan_code = b.compare_lit("EQ", &i, Lit::I(255));
            let nan = b.splat_like(Lit::F(f64::NAN), &v);
            b.select(&nan_code, &nan, &v)
        }
        _ => b.convert_raw(scales, DType::F32),
    };
    match spec.global {
        None => s,
        Some(Global::Mul(g)) => {
            let g = b.splat_like(Lit::F(g as f64), &s);
            b.mul(&s, &g)
        }
        Some(Global::Div(g)) => {
            // A true division, as the reference computes it: behind the barrier XLA
            // cannot turn `s / g` into `s * (1 / g)`, which rounds differently.
            let g = b.splat_like(Lit::F(g as f64), &s);
            let g = b.op("stablehlo.optimization_barrier", &[&g], vec![], g.ty.clone());
            b.div(&s, &g)
        }
    }
}

/// `Op::Dequantize`: the float32 weight `[out, in]`, `code * scale` per element.
pub fn dequantize(b: &mut Builder, spec: &QuantSpec, codes: &Val, scales: &Val) -> Val {
    let w = codes_f32(b, spec, codes);
    let (n, k) = (w.shape()[0], w.shape()[1]);
    let s = scales_f32(b, spec, scales);
    let (r, c) = (s.shape()[0], s.shape()[1]);
    // A block larger than the weight covers all of it (one partial block).
    let (b0, b1) = (spec.block[0].min(n.max(1)), spec.block[1].min(k.max(1)));
    // Each scale covers a b0 x b1 block: broadcast, flatten, cut the partial blocks off.
    let s = b.broadcast(&s, &[r, b0, c, b1], &[0, 2]);
    let s = b.reshape(&s, &[r * b0, c * b1]);
    let s = b.slice(&s, &[0, 0], &[n, k], &[1, 1]);
    b.mul(&w, &s)
}

/// `Op::QuantMatMul`: `x [..., in] @ W.T`, float32 accumulation, rounded to `out`.
pub fn quant_matmul(b: &mut Builder, spec: &QuantSpec, x: &Val, codes: &Val, scales: &Val, out: DType) -> Val {
    let w = dequantize(b, spec, codes, scales);
    let x = b.convert_raw(x, DType::F32);
    let x = match spec.activations {
        Activations::Exact => x,
        Activations::Int8 => round_activations(b, &x),
    };
    let r = x.ty.rank();
    let y = b.dot_general(&x, &w, &[], &[], &[r - 1], &[1]);
    b.convert_raw(&y, out)
}

/// Float32 rows `[..., k]` rounded to int8 per block of `ACTIVATION_BLOCK`
/// columns and scaled back (Note [Int8 activations]): `q * d` with `d = amax /
/// 127`, `q = round(x / d)` ties away from zero, 0 where `d` is 0 (a
/// non-finite `amax` makes the whole block NaN through `d`).
fn round_activations(b: &mut Builder, x: &Val) -> Val {
    let shape = x.shape().to_vec();
    let (r, k) = (shape.len(), shape[shape.len() - 1]);
    let nb = k.div_ceil(ACTIVATION_BLOCK);
    // Zeros pad the last block: they change no block's largest magnitude.
    let mut high = vec![0; r];
    high[r - 1] = nb * ACTIVATION_BLOCK - k;
    let padded = b.pad(x, Lit::F(0.0), &vec![0; r], &high);
    let mut blocks = shape.clone();
    blocks[r - 1] = nb;
    blocks.push(ACTIVATION_BLOCK);
    let xb = b.reshape(&padded, &blocks);
    let mag = b.unary("abs", &xb);
    let amax = b.reduce(&mag, Lit::F(0.0), &[r], "nan_maximum");
    let c127 = b.splat_like(Lit::F(127.0), &amax);
    let d = b.div(&amax, &c127);
    let dims: Vec<usize> = (0..r).collect();
    let d = b.broadcast(&d, &blocks, &dims);
    let ratio = b.div(&xb, &d);
    let q = b.unary("round_nearest_afz", &ratio);
    let zero_d = b.compare_lit("EQ", &d, Lit::F(0.0));
    let zero = b.splat_like(Lit::F(0.0), &q);
    let q = b.select(&zero_d, &zero, &q);
    let xr = b.mul(&q, &d);
    let mut flat = shape.clone();
    flat[r - 1] = nb * ACTIVATION_BLOCK;
    let xr = b.reshape(&xr, &flat);
    let start = vec![0; r];
    b.slice(&xr, &start, &shape, &vec![1; r])
}
