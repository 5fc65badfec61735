//! Block-quantized weights (Note [Quantized weights] in kiln-tensor):
//! `dequantize`, and `quant_matmul`, the weight-only product that never holds
//! the dequantized weight.
//!
// Note [Dequantizing inside the product]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// `quant_matmul` cuts W's rows (the output columns) into tiles of `TILE`
// rows; each task dequantizes one tile into a float32 scratch buffer (a few
// rows: it stays in cache) and multiplies the input with it, then moves to the
// next tile. So the weight streams from memory in its packed form, 4.5 or 8
// bits per element instead of 16 or 32, and only `TILE x in` floats per
// thread ever exist. Decoding goes through 256-entry tables: one float per
// FP8 byte, a pair of floats per FP4 byte. With a few input rows (decoding a
// token) each tile row is one dot product per input row; with more (a
// prompt) the tile is a `gemm` call. Sums run in float32, and the result is
// rounded once to the input's dtype.
use super::copy::materialize_vec;
use super::elem::Elem;
use super::{buf, Input};
use gemm::Parallelism;
use half::{bf16, f16};
use kiln_tensor::quant::{e2m1, effective_scales, Codes, QuantSpec, ScaleData};
use kiln_tensor::{f8e4m3fn, DType, Error, HostBuffer, Result};
use rayon::prelude::*;

/// Rows of W dequantized at once by one task.
const TILE: usize = 16;
/// At least this many input rows multiply a tile through `gemm`.
const GEMM_ROWS: usize = 8;

/// The codes as bytes and the effective float32 scales of a quantized weight.
fn parts(spec: &QuantSpec, codes: &Input<'_>, scales: &Input<'_>) -> Result<(Vec<u8>, Vec<f32>)> {
    let codes = match codes.dtype() {
        DType::U8 => materialize_vec::<u8>(codes)?,
        DType::F8E4M3FN => materialize_vec::<f8e4m3fn>(codes)?.iter().map(|c| c.to_bits()).collect(),
        d => return Err(Error::dtype("dequantize", format!("codes of dtype {d}"))),
    };
    let scales = match scales.dtype() {
        DType::F32 => effective_scales(spec, ScaleData::F32(&materialize_vec::<f32>(scales)?)),
        DType::F8E4M3FN => {
            let b: Vec<u8> = materialize_vec::<f8e4m3fn>(scales)?.iter().map(|c| c.to_bits()).collect();
            effective_scales(spec, ScaleData::E4M3(&b))
        }
        DType::U8 => effective_scales(spec, ScaleData::E8M0(&materialize_vec::<u8>(scales)?)),
        d => return Err(Error::dtype("dequantize", format!("scales of dtype {d}"))),
    };
    Ok((codes, scales))
}

/// Decoding tables: a float per FP8 byte, two per FP4 byte (low nibble first).
struct Tables {
    e4m3: [f32; 256],
    e2m1: [[f32; 2]; 256],
}

static TABLES: std::sync::LazyLock<Tables> = std::sync::LazyLock::new(|| {
    let mut t = Tables { e4m3: [0.0; 256], e2m1: [[0.0; 2]; 256] };
    for b in 0..256usize {
        t.e4m3[b] = f8e4m3fn::from_bits(b as u8).to_f32();
        t.e2m1[b] = [e2m1(b as u8 & 0xF), e2m1(b as u8 >> 4)];
    }
    t
});

/// Dequantizes rows `r0 .. r0 + dst.len() / inp` of W into `dst` (the
/// products exactly as `kiln_tensor::quant::dequantize_rows` forms them).
fn dequant_tile(spec: &QuantSpec, inp: usize, codes: &[u8], scales: &[f32], r0: usize, dst: &mut [f32]) {
    let t = &*TABLES;
    let cols = inp.div_ceil(spec.block[1]);
    let bc = spec.block[1];
    for (r, out) in dst.chunks_exact_mut(inp).enumerate() {
        let i = r0 + r;
        let srow = &scales[(i / spec.block[0]) * cols..][..cols];
        match spec.codes {
            Codes::E4M3 => {
                let crow = &codes[i * inp..][..inp];
                for ((o, c), &s) in out.chunks_mut(bc).zip(crow.chunks(bc)).zip(srow) {
                    for (o, &c) in o.iter_mut().zip(c) {
                        *o = t.e4m3[c as usize] * s;
                    }
                }
            }
            Codes::E2M1 => {
                let crow = &codes[i * (inp / 2)..][..inp / 2];
                for ((o, c), &s) in out.chunks_mut(bc).zip(crow.chunks(bc / 2)).zip(srow) {
                    for (o, &b) in o.chunks_exact_mut(2).zip(c) {
                        let [lo, hi] = t.e2m1[b as usize];
                        o[0] = lo * s;
                        o[1] = hi * s;
                    }
                }
            }
        }
    }
}

/// `Op::Dequantize`: the float32 weight `[out, in]`.
pub(crate) fn dequantize(spec: &QuantSpec, codes: &Input<'_>, scales: &Input<'_>) -> Result<HostBuffer> {
    let [out, inp] = spec.weight_shape(codes.layout.shape());
    let (c, s) = parts(spec, codes, scales)?;
    let mut w = vec![0f32; out * inp];
    if inp > 0 {
        w.par_chunks_mut(TILE * inp).enumerate().for_each(|(t, dst)| dequant_tile(spec, inp, &c, &s, t * TILE, dst));
    }
    Ok(buf(w))
}

/// A dot product in float32 with independent partial sums, so it vectorises.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..16 {
            acc[l] += x[l] * y[l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// `Op::QuantMatMul`: `x [..., in] @ W.T` (Note [Dequantizing inside the product]).
pub(crate) fn quant_matmul(
    spec: &QuantSpec,
    x: &Input<'_>,
    codes: &Input<'_>,
    scales: &Input<'_>,
) -> Result<HostBuffer> {
    let [n, k] = spec.weight_shape(codes.layout.shape());
    let xs: Vec<f32> = match x.dtype() {
        DType::F32 => materialize_vec::<f32>(x)?,
        DType::BF16 => materialize_vec::<bf16>(x)?.iter().map(|v| v.cast_f32()).collect(),
        DType::F16 => materialize_vec::<f16>(x)?.iter().map(|v| v.cast_f32()).collect(),
        d => {
            return Err(Error::dtype("quant_matmul", format!("expected a float32, bfloat16 or float16 input, got {d}")))
        }
    };
    let xshape = x.layout.shape();
    let m: usize = xshape[..xshape.len() - 1].iter().product();
    let (c, s) = parts(spec, codes, scales)?;
    // Each task: one tile of W's rows, giving the output columns [t * TILE, ...).
    let tiles: Vec<Vec<f32>> = (0..n.div_ceil(TILE))
        .into_par_iter()
        .map(|t| {
            let (r0, rows) = (t * TILE, TILE.min(n - t * TILE));
            let mut w = vec![0f32; rows * k];
            let mut y = vec![0f32; m * rows];
            if k == 0 {
                return y;
            }
            dequant_tile(spec, k, &c, &s, r0, &mut w);
            if m < GEMM_ROWS {
                for (i, yr) in y.chunks_exact_mut(rows).enumerate() {
                    let xr = &xs[i * k..][..k];
                    for (j, o) in yr.iter_mut().enumerate() {
                        *o = dot(xr, &w[j * k..][..k]);
                    }
                }
            } else {
                // SAFETY: y is m x rows (row stride `rows`), xs is m x k (row stride k),
                // w is rows x k read as its transpose k x rows (row stride 1, column
                // stride k); every index gemm forms lies inside those buffers, which
                // do not overlap, and gemm runs on this thread only.
                unsafe {
                    gemm::gemm(
                        m,
                        rows,
                        k,
                        y.as_mut_ptr(),
                        1,
                        rows as isize,
                        false,
                        xs.as_ptr(),
                        1,
                        k as isize,
                        w.as_ptr(),
                        k as isize,
                        1,
                        0.0,
                        1.0,
                        false,
                        false,
                        false,
                        Parallelism::None,
                    )
                }
            }
            y
        })
        .collect();
    let mut out = vec![0f32; m * n];
    for (t, y) in tiles.iter().enumerate() {
        let (c0, rows) = (t * TILE, TILE.min(n - t * TILE));
        for i in 0..m {
            out[i * n + c0..][..rows].copy_from_slice(&y[i * rows..][..rows]);
        }
    }
    Ok(match x.dtype() {
        DType::BF16 => buf(out.into_iter().map(bf16::of_f32).collect::<Vec<_>>()),
        DType::F16 => buf(out.into_iter().map(f16::of_f32).collect::<Vec<_>>()),
        _ => buf(out),
    })
}
