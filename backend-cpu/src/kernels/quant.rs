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
// thread ever exist. Codes decode from their bits without branches or
// tables, so the decoding loops vectorise (the tile work is compiled for the
// CPU's best instruction set). With a few input rows (decoding a
// token) each tile row is one dot product per input row; with more (a
// prompt) the tile is a `gemm` call. Sums run in float32, and the result is
// rounded once to the input's dtype. Where the CPU has AVX-512, products of a
// few rows do not come here: their codes are decoded in the registers (Note
// [Codes decoded in the registers]).
use super::copy::{contiguous, narrow_f32, widen_f32};
use super::iter::{fork_chunks, fork_map};
use super::quant_int8::{self, Int8Dot, Int8Rows};
use super::quant_rowdot::{self, QuantRowDot};
use super::simd::{dispatch, fmadd, Kernel};
use super::{buf, Input};
use gemm::Parallelism;
use half::{bf16, f16};
use kiln_tensor::quant::{e8m0, Activations, Codes, Global, QuantSpec};
use kiln_tensor::{f8e4m3fn, DType, Error, HostBuffer, Result};
use smallvec::SmallVec;
use std::borrow::Cow;

/// Rows of W dequantized at once by one task.
const TILE: usize = 16;
/// At least this many input rows multiply a tile through `gemm`.
const GEMM_ROWS: usize = 8;

/// The bytes of a uint8 or float8 input, borrowed when it is contiguous.
fn bytes<'a>(x: &Input<'a>) -> Result<Cow<'a, [u8]>> {
    Ok(match x.dtype() {
        DType::U8 => contiguous::<u8>(x)?,
        DType::F8E4M3FN => match contiguous::<f8e4m3fn>(x)? {
            // SAFETY: `f8e4m3fn` is `#[repr(transparent)]` over `u8`: the same size,
            // alignment and bits, so the slice reinterpreted has the same length
            // and lifetime and every byte is a valid `u8`.
            Cow::Borrowed(v) => Cow::Borrowed(unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), v.len()) }),
            Cow::Owned(v) => Cow::Owned(v.iter().map(|c| c.to_bits()).collect()),
        },
        DType::I8 => match contiguous::<i8>(x)? {
            // SAFETY: `i8` and `u8` have the same size and alignment and every
            // bit pattern is valid in both; the slice keeps its length and lifetime.
            Cow::Borrowed(v) => Cow::Borrowed(unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), v.len()) }),
            Cow::Owned(v) => Cow::Owned(v.iter().map(|&c| c as u8).collect()),
        },
        d => return Err(Error::dtype("dequantize", format!("expected uint8, int8 or float8_e4m3fn data, got {d}"))),
    })
}

/// The block scales with the global one applied. One-byte scales (E4M3,
/// E8M0) take one of 256 values, so those are computed once per call into a
/// table (the division by a global scale included) and looked up per block.
pub(super) enum Scales<'a> {
    F32(Cow<'a, [f32]>, Option<Global>),
    Table(Cow<'a, [u8]>, Box<[f32; 256]>),
}

impl<'a> Scales<'a> {
    pub(super) fn new(x: &Input<'a>, global: Option<Global>) -> Result<Scales<'a>> {
        let table = |decode: fn(u8) -> f32| {
            let mut t = Box::new([0f32; 256]);
            for (b, v) in t.iter_mut().enumerate() {
                *v = Global::apply(global, decode(b as u8));
            }
            t
        };
        Ok(match x.dtype() {
            DType::F32 => Scales::F32(contiguous::<f32>(x)?, global),
            DType::F8E4M3FN => Scales::Table(bytes(x)?, table(e4m3)),
            DType::U8 => Scales::Table(bytes(x)?, table(e8m0)),
            d => return Err(Error::dtype("dequantize", format!("scales of dtype {d}"))),
        })
    }

    /// Block scale `i`, effective.
    #[inline(always)]
    pub(super) fn get(&self, i: usize) -> f32 {
        match self {
            Scales::F32(v, g) => Global::apply(*g, v[i]),
            Scales::Table(v, t) => t[v[i] as usize],
        }
    }

    /// Asks the CPU to fetch block scales `i..i + n` into its caches (a
    /// hint: it reads nothing and cannot fault).
    #[inline(always)]
    pub(super) fn prefetch(&self, i: usize, n: usize) {
        let (base, size) = match self {
            Scales::F32(v, _) => (v.as_ptr().cast::<u8>(), 4),
            Scales::Table(v, _) => (v.as_ptr(), 1),
        };
        #[cfg(target_arch = "x86_64")]
        for line in (i * size..(i + n) * size).step_by(64) {
            // SAFETY: a prefetch reads nothing and cannot fault, whatever the address.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(base.wrapping_add(line).cast())
            };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (base, size, i, n);
    }

    /// Block scales `i..i + out.len()`, effective, into `out`: one loop per
    /// kind of scale (a copy for float32 scales without a global one).
    #[inline(always)]
    pub(super) fn get_many(&self, i: usize, out: &mut [f32]) {
        let n = out.len();
        match self {
            Scales::F32(v, None) => out.copy_from_slice(&v[i..][..out.len()]),
            Scales::F32(v, g) => {
                for (o, &s) in out.iter_mut().zip(&v[i..][..n]) {
                    *o = Global::apply(*g, s);
                }
            }
            Scales::Table(v, t) => {
                for (o, &b) in out.iter_mut().zip(&v[i..][..n]) {
                    *o = t[b as usize];
                }
            }
        }
    }
}

/// An E4M3 code's value from its bits, branch-free so that loops of it
/// vectorise: the exponent rebiased into an f32 for normal numbers, `m * 2^-9`
/// for subnormals, NaN for 0x7F / 0xFF.
#[inline(always)]
pub(super) fn e4m3(c: u8) -> f32 {
    let c = c as u32;
    let (e, m) = ((c >> 3) & 15, c & 7);
    let normal = f32::from_bits(((e + 120) << 23) | (m << 20));
    let v = if e == 0 { m as f32 * (1.0 / 512.0) } else { normal };
    let v = if c & 0x7F == 0x7F { f32::NAN } else { v };
    f32::from_bits(v.to_bits() | ((c & 0x80) << 24))
}

/// An E2M1 code's value (low 4 bits of `n`) from its bits, branch-free: index
/// `2e + m` is `2^(e-1) * (1 + m/2)`, or `m / 2` when `e` is 0; bit 3 is the sign.
#[inline(always)]
pub(super) fn e2m1_fast(n: u8) -> f32 {
    let n = n as u32;
    let (e, m) = ((n >> 1) & 3, n & 1);
    let bits = if e == 0 { m * 0x3F00_0000 } else { ((e + 126) << 23) | (m << 22) };
    f32::from_bits(bits | ((n & 8) << 28))
}

/// A 4-bit integer code's value (low 4 bits of `n`): `n - 8`.
#[inline(always)]
pub(super) fn i4(n: u8) -> f32 {
    (n & 0xF) as i32 as f32 - 8.0
}

/// Effective scales a register-decoding task keeps on its stack (8 KiB):
/// four rows of W of up to 512 blocks each; more go to the heap.
const SCALES_ON_STACK: usize = 2048;

/// A register-decoding task's buffer of `len` tile scales, zeroed: on the
/// task's stack when it fits, since tasks run on every compute thread and
/// their heap allocations would meet on one lock (Note [Keeping freed memory]).
pub(super) fn tile_scales(len: usize) -> SmallVec<[f32; SCALES_ON_STACK]> {
    smallvec::smallvec![0f32; len]
}

/// A kind of code as a constant parameter: the kernels that decode codes in
/// the registers are compiled once per kind (`K = code_index(codes)`), so a
/// step has no branch on the kind; [`code_of`] gives the kind back.
pub(super) const fn code_index(codes: Codes) -> u8 {
    match codes {
        Codes::E4M3 => 0,
        Codes::E2M1 => 1,
        Codes::I8 => 2,
        Codes::I4 => 3,
    }
}

/// The kind of code `code_index` gave `k` (`k < 4`).
#[inline(always)]
pub(super) const fn code_of(k: u8) -> Codes {
    match k {
        0 => Codes::E4M3,
        1 => Codes::E2M1,
        2 => Codes::I8,
        3 => Codes::I4,
        _ => panic!("code_of: not a code_index"),
    }
}

/// The value of element `e` of a row of codes (one by one, for the edges).
#[inline(always)]
pub(super) fn code_value(codes: Codes, row: &[u8], e: usize) -> f32 {
    match codes {
        Codes::E4M3 => e4m3(row[e]),
        Codes::E2M1 => e2m1_fast((row[e / 2] >> (4 * (e % 2))) & 0xF),
        Codes::I8 => row[e] as i8 as f32,
        Codes::I4 => i4(row[e / 2] >> (4 * (e % 2))),
    }
}

/// Dequantizes rows `r0 .. r0 + dst.len() / inp` of W into `dst` (the
/// products in the order of Note [Quantized weights]).
#[inline(always)]
fn dequant_tile(spec: &QuantSpec, inp: usize, codes: &[u8], scales: &Scales<'_>, r0: usize, dst: &mut [f32]) {
    let cols = inp.div_ceil(spec.block[1]);
    let bc = spec.block[1];
    for (r, out) in dst.chunks_exact_mut(inp).enumerate() {
        let i = r0 + r;
        // Two passes, each a plain loop that vectorises: the codes' values, then
        // each block times its scale.
        match spec.codes {
            Codes::E4M3 => {
                for (o, &c) in out.iter_mut().zip(&codes[i * inp..][..inp]) {
                    *o = e4m3(c);
                }
            }
            Codes::E2M1 => {
                for (o, &b) in out.chunks_exact_mut(2).zip(&codes[i * (inp / 2)..][..inp / 2]) {
                    o[0] = e2m1_fast(b & 0xF);
                    o[1] = e2m1_fast(b >> 4);
                }
            }
            Codes::I8 => {
                for (o, &c) in out.iter_mut().zip(&codes[i * inp..][..inp]) {
                    *o = c as i8 as f32;
                }
            }
            Codes::I4 => {
                for (o, &b) in out.chunks_exact_mut(2).zip(&codes[i * (inp / 2)..][..inp / 2]) {
                    o[0] = i4(b);
                    o[1] = i4(b >> 4);
                }
            }
        }
        let s0 = (i / spec.block[0]) * cols;
        for (g, o) in out.chunks_mut(bc).enumerate() {
            let s = scales.get(s0 + g);
            for v in o {
                *v *= s;
            }
        }
    }
}

/// A dot product in float32 with independent partial sums, so it vectorises.
#[inline(always)]
fn dot<const FMA: bool>(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (ca, cb) = (a.chunks_exact(16), b.chunks_exact(16));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..16 {
            acc[l] = fmadd::<FMA>(x[l], y[l], acc[l]);
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// One tile of the product (Note [Dequantizing inside the product]), compiled
/// for the CPU's best instruction set.
struct Tile<'a> {
    spec: &'a QuantSpec,
    k: usize,
    m: usize,
    codes: &'a [u8],
    scales: &'a Scales<'a>,
    xs: &'a [f32],
    r0: usize,
    rows: usize,
}

impl Kernel for Tile<'_> {
    type Out = Vec<f32>;
    #[inline(always)]
    fn run<const FMA: bool>(self) -> Vec<f32> {
        let Tile { spec, k, m, codes, scales, xs, r0, rows } = self;
        let mut y = vec![0f32; m * rows];
        if k == 0 {
            return y;
        }
        let mut w = vec![0f32; rows * k];
        dequant_tile(spec, k, codes, scales, r0, &mut w);
        // Dot products are row-invariant by construction (Note [Row-invariant
        // products] in matmul.rs): they serve every row count when that is asked for.
        if m < GEMM_ROWS || kiln_tensor::is_batch_invariant() {
            for (i, yr) in y.chunks_exact_mut(rows).enumerate() {
                let xr = &xs[i * k..][..k];
                for (j, o) in yr.iter_mut().enumerate() {
                    *o = dot::<FMA>(xr, &w[j * k..][..k]);
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
    }
}

/// Dequantizing a tile, compiled for the CPU's best instruction set.
struct Dequant<'a> {
    spec: &'a QuantSpec,
    inp: usize,
    codes: &'a [u8],
    scales: &'a Scales<'a>,
    r0: usize,
    dst: &'a mut [f32],
}

impl Kernel for Dequant<'_> {
    type Out = ();
    #[inline(always)]
    fn run<const FMA: bool>(self) {
        dequant_tile(self.spec, self.inp, self.codes, self.scales, self.r0, self.dst)
    }
}

/// `Op::Dequantize`: the float32 weight `[out, in]`.
pub(crate) fn dequantize(spec: &QuantSpec, codes: &Input<'_>, scales: &Input<'_>) -> Result<HostBuffer> {
    let [out, inp] = spec.weight_shape(codes.layout.shape());
    let (c, s) = (bytes(codes)?, Scales::new(scales, spec.global)?);
    let mut w = vec![0f32; out * inp];
    if inp > 0 {
        fork_chunks(&mut w, TILE * inp, 1, &|t, dst| {
            dispatch(Dequant { spec, inp, codes: &c, scales: &s, r0: t * TILE, dst })
        });
    }
    Ok(buf(w))
}

/// `Op::QuantMatMul`: `x [..., in] @ W.T` (Note [Dequantizing inside the product]).
pub(crate) fn quant_matmul(
    spec: &QuantSpec,
    x: &Input<'_>,
    codes: &Input<'_>,
    scales: &Input<'_>,
) -> Result<HostBuffer> {
    let [n, k] = spec.weight_shape(codes.layout.shape());
    let xs: Cow<'_, [f32]> = match x.dtype() {
        DType::F32 => contiguous::<f32>(x)?,
        DType::BF16 => Cow::Owned(widen_f32::<bf16>(x)?),
        DType::F16 => Cow::Owned(widen_f32::<f16>(x)?),
        d => {
            return Err(Error::dtype("quant_matmul", format!("expected a float32, bfloat16 or float16 input, got {d}")))
        }
    };
    let xshape = x.layout.shape();
    let m: usize = xshape[..xshape.len() - 1].iter().product();
    let (c, s) = (bytes(codes)?, Scales::new(scales, spec.global)?);
    let narrow = |out: Vec<f32>| match x.dtype() {
        DType::BF16 => buf(narrow_f32::<bf16>(out)),
        DType::F16 => buf(narrow_f32::<f16>(out)),
        _ => buf(out),
    };
    let few_rows = m < GEMM_ROWS || kiln_tensor::is_batch_invariant();
    // Note [Int8 activations]: the rows rounded once; integer products where
    // the CPU has them, else the rounded rows as float32 below.
    let xs = match spec.activations {
        Activations::Exact => xs,
        Activations::Int8 => {
            let rows = Int8Rows::round(&xs, m, k);
            if few_rows && quant_int8::applies(spec, k) {
                let mut out = vec![0f32; m * n];
                Int8Dot { spec, codes: &c, scales: &s, x: &rows, n }.run(&mut out);
                return Ok(narrow(out));
            }
            Cow::Owned(rows.values())
        }
    };
    // A few rows (every row count for invariant products): codes decoded in
    // the registers where the CPU can (Note [Codes decoded in the registers]).
    if few_rows && quant_rowdot::applies(spec, k) {
        let mut out = vec![0f32; m * n];
        QuantRowDot { spec, codes: &c, scales: &s, x: &xs, m, n, k }.run(&mut out);
        return Ok(narrow(out));
    }
    // Each task: one tile of W's rows, giving the output columns [t * TILE, ...).
    let tiles: Vec<Vec<f32>> = fork_map(n.div_ceil(TILE), &|t| {
        let r0 = t * TILE;
        dispatch(Tile { spec, k, m, codes: &c, scales: &s, xs: &xs, r0, rows: TILE.min(n - r0) })
    });
    let mut out = vec![0f32; m * n];
    for (t, y) in tiles.iter().enumerate() {
        let (c0, rows) = (t * TILE, TILE.min(n - t * TILE));
        for i in 0..m {
            out[i * n + c0..][..rows].copy_from_slice(&y[i * rows..][..rows]);
        }
    }
    Ok(narrow(out))
}
