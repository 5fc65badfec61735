//! Block-quantized weights: the formats of quantized checkpoints (FP8 with
//! block, channel or tensor scales; MXFP4; NVFP4), described by [`QuantSpec`]
//! (the payload of `Op::Dequantize` and `Op::QuantMatMul`), and their exact
//! dequantization. The CPU kernel, the StableHLO lowering and the checkpoint
//! loader all use these definitions.
//!
// Note [Quantized weights]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// A quantized weight `W [out, in]` (`y = x @ W.T`, as `Linear` stores it) is
// two tensors:
//
// * `codes`: the elements. FP8 (`Codes::E4M3`): a float8_e4m3fn tensor
//   `[out, in]`. FP4 (`Codes::E2M1`): a uint8 tensor `[out, in / 2]`, two
//   E2M1 codes per byte, element `2j` in the low nibble and `2j + 1` in the
//   high one (compressed-tensors' and ModelOpt's order). An E2M1 code is a
//   sign bit (bit 3) and an index into `[0, 0.5, 1, 1.5, 2, 3, 4, 6]`.
//   8-bit integers (`Codes::I8`, GGUF's Q8_0): an int8 tensor `[out, in]`,
//   the code its own value. 4-bit integers (`Codes::I4`, GGUF's Q4_0): a
//   uint8 tensor `[out, in / 2]` packed as E2M1 is, a nibble `q` standing
//   for `q - 8` (GGUF's own order, `j` and `j + 16` in a byte, is repacked
//   on load).
// * `scales [ceil(out / block[0]), ceil(in / block[1])]`, one per block of
//   `block[0]` rows by `block[1]` columns (the last blocks may be partial):
//   float32, float8_e4m3fn (NVFP4's group scales) or uint8 holding E8M0
//   exponents, `2^(b - 127)` (MXFP4; 255 is NaN).
//
// plus an optional per-tensor float32 `global` that combines with every block
// scale before it multiplies: `Global::Mul` (ModelOpt's `weight_scale_2`) or
// `Global::Div` (compressed-tensors' `weight_global_scale`). So
//
//     W[i, j] = code(i, j) * (scale(i / b0, j / b1) ⊙ global)
//
// evaluated in float32 in exactly this order, which is the order the
// reference implementations use: FP8 and MXFP4 products are exact, NVFP4's
// round once in the scale and once in the product, and any other order could
// differ by an ulp. Tensor-wise FP8 is `block = [out, in]`, channel-wise
// `[1, in]`, DeepSeek-style `[128, 128]`, NVFP4 `[1, 16]`, MXFP4 `[1, 32]`.
//
// Resident size per weight: 8 bits (+ one scale per block) for FP8, 4 + 8/16
// = 4.5 bits for NVFP4, 4 + 8/32 = 4.25 for MXFP4, 8 + 32/32 = 9 bits for
// Q8_0 and 4 + 32/32 = 5 for Q4_0 (their f16 scales held as float32, exactly).
use crate::{f8e4m3fn, DType, Error, Result};

/// How the element codes are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Codes {
    /// float8_e4m3fn, one per byte, `[out, in]`.
    E4M3,
    /// FP4 E2M1, two per byte (low nibble first), `[out, in / 2]`.
    E2M1,
    /// 8-bit integers, `[out, in]` (GGUF's Q8_0).
    I8,
    /// 4-bit integers `q - 8`, two per byte (low nibble first), `[out, in / 2]` (GGUF's Q4_0).
    I4,
}

impl Codes {
    /// Whether two codes share a byte.
    pub fn packed_in_nibbles(self) -> bool {
        match self {
            Codes::E4M3 | Codes::I8 => false,
            Codes::E2M1 | Codes::I4 => true,
        }
    }

    /// The value of each of the 16 nibbles of a 4-bit code (`None` for byte codes).
    pub fn nibble_values(self) -> Option<[f32; 16]> {
        match self {
            Codes::E4M3 | Codes::I8 => None,
            Codes::E2M1 => Some(std::array::from_fn(|c| {
                let v = E2M1_VALUES[c & 7];
                if c & 8 != 0 {
                    -v
                } else {
                    v
                }
            })),
            Codes::I4 => Some(std::array::from_fn(|c| c as f32 - 8.0)),
        }
    }
}

/// How the per-tensor global scale combines with each block scale.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Global {
    /// `scale * g` (ModelOpt's `weight_scale_2`).
    Mul(f32),
    /// `scale / g` (compressed-tensors' `weight_global_scale`).
    Div(f32),
}

impl Global {
    /// A block scale combined with the (optional) global one: `s * g` or `s / g`.
    #[inline(always)]
    pub fn apply(global: Option<Global>, s: f32) -> f32 {
        match global {
            None => s,
            Some(Global::Mul(g)) => s * g,
            Some(Global::Div(g)) => s / g,
        }
    }
}

/// The layout of a quantized weight (Note [Quantized weights]), and how its
/// products treat their input (Note [Int8 activations]).
#[derive(Debug, Clone, PartialEq)]
pub struct QuantSpec {
    pub codes: Codes,
    /// Rows and columns of `W` that one scale covers.
    pub block: [usize; 2],
    pub global: Option<Global>,
    /// What `quant_matmul` does to `x` first ([`Activations::Exact`] unless
    /// asked: [`QuantSpec::with_activations`]).
    pub activations: Activations,
}

// Note [Int8 activations]
// ~~~~~~~~~~~~~~~~~~~~~~~
// With `Activations::Int8` a quantized product first rounds each row of its
// input to 8-bit integers, as llama.cpp does for its integer formats (its
// Q8_0 activations): each block of `ACTIVATION_BLOCK` (32) consecutive
// elements of a row (the last block of a row may be shorter) has the scale
// `d = amax / 127` (one float32 division; `amax` the block's largest |x|),
// and each element becomes `q * d` with `q = round(x / d)` (one float32
// division, ties away from zero; |q| <= 127), 0 where `d` is 0, and NaN
// throughout a block whose `amax` is not finite. The product is then
// `round8(x) @ dequantize(W).T`, summed in float32: every device and kernel
// computes that value and differs only in float32 rounding (the order of the
// sums, and whether `q * d` is rounded before it multiplies: the integer
// products never round it).
// bfloat16 and float16 inputs are widened (exactly) before they are rounded.
//
// Why: with `x` as small integers, the products of integer codes (`I8`,
// `I4`, and `E2M1`, whose values are integers once doubled) are integer
// multiply-adds, 64 per instruction with AVX512-VNNI (`vpdpbusd`), where
// float32 products take 16 and the codes must first become floats: where
// decoding codes, not reading them, bounds a decoding step, this is the
// cheaper product. The cost
// is accuracy: each input element moves by up to `d / 2` (0.4% of its
// block's largest element), so `Exact` stays the default and `Int8` is asked
// for by name (`quantize::set_quantized_activations`, `Linear::set_activations`).
// Rounding has no useful derivative: a product with `Int8` activations
// refuses to differentiate its input (inference only).

/// How a quantized product treats its input rows (Note [Int8 activations]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Activations {
    /// Used as they are: the product is `x @ dequantize(W).T`.
    #[default]
    Exact,
    /// Rounded to 8-bit integers per block of [`ACTIVATION_BLOCK`] columns
    /// first: the product is `round8(x) @ dequantize(W).T`.
    Int8,
}

/// Elements of a row that share one scale under [`Activations::Int8`].
pub const ACTIVATION_BLOCK: usize = 32;

/// One block of a row rounded as Note [Int8 activations] says: the codes
/// `q` (written to `q`, as long as `x`) and the scale `d` (NaN where the
/// block's largest magnitude is not finite; then every `q` is 0).
pub fn round_activation_block(x: &[f32], q: &mut [i8]) -> f32 {
    let amax = x.iter().fold(0f32, |m, v| if v.abs() > m || v.is_nan() { v.abs() } else { m });
    if !amax.is_finite() {
        q.fill(0);
        return f32::NAN;
    }
    let d = amax / 127.0;
    for (q, &v) in q.iter_mut().zip(x) {
        *q = if d == 0.0 { 0 } else { (v / d).round() as i8 };
    }
    d
}

/// The values of the 8 non-negative E2M1 codes (bit 3 of a code is the sign;
/// code 8 is -0.0).
pub const E2M1_VALUES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// An E8M0 exponent's value, `2^(b - 127)` (255 is NaN).
#[inline(always)]
pub fn e8m0(b: u8) -> f32 {
    match b {
        255 => f32::NAN,
        // 2^-127 is an f32 subnormal: 0x0040_0000.
        0 => f32::from_bits(0x0040_0000),
        _ => f32::from_bits((b as u32) << 23),
    }
}

impl QuantSpec {
    /// A layout whose products use their input as it is ([`Activations::Exact`]).
    pub fn new(codes: Codes, block: [usize; 2], global: Option<Global>) -> QuantSpec {
        QuantSpec { codes, block, global, activations: Activations::Exact }
    }

    /// The same layout, its products treating their input as `activations` says.
    pub fn with_activations(self, activations: Activations) -> QuantSpec {
        QuantSpec { activations, ..self }
    }

    /// `[out, in]` → the shape of the scales tensor.
    pub fn scales_shape(&self, out: usize, inp: usize) -> [usize; 2] {
        [out.div_ceil(self.block[0]), inp.div_ceil(self.block[1])]
    }

    /// The logical `[out, in]` of codes of shape `codes`.
    pub fn weight_shape(&self, codes: &[usize]) -> [usize; 2] {
        if self.codes.packed_in_nibbles() {
            [codes[0], codes[1] * 2]
        } else {
            [codes[0], codes[1]]
        }
    }

    /// The dtype of the codes tensor.
    pub fn codes_dtype(&self) -> DType {
        match self.codes {
            Codes::E4M3 => DType::F8E4M3FN,
            Codes::E2M1 | Codes::I4 => DType::U8,
            Codes::I8 => DType::I8,
        }
    }

    /// Checks codes and scales of a weight `[out, in]` against this layout:
    /// dtypes, shapes, block sizes (`op` names the caller in errors).
    pub fn check(&self, op: &'static str, codes: (DType, &[usize]), scales: (DType, &[usize])) -> Result<[usize; 2]> {
        if self.block[0] == 0 || self.block[1] == 0 {
            return Err(Error::invalid(op, format!("block sizes must be positive, got {:?}", self.block)));
        }
        if codes.0 != self.codes_dtype() || codes.1.len() != 2 {
            return Err(Error::dtype(
                op,
                format!(
                    "{:?} codes must be a 2-D {} tensor, got {} {:?}",
                    self.codes,
                    self.codes_dtype(),
                    codes.0,
                    codes.1
                ),
            ));
        }
        let [out, inp] = self.weight_shape(codes.1);
        if self.codes.packed_in_nibbles() && !self.block[1].is_multiple_of(2) {
            return Err(Error::invalid(op, format!("4-bit groups must hold whole bytes, got {:?}", self.block)));
        }
        if !matches!(scales.0, DType::F32 | DType::F8E4M3FN | DType::U8) {
            return Err(Error::dtype(
                op,
                format!("scales must be float32, float8_e4m3fn or uint8 (E8M0), got {}", scales.0),
            ));
        }
        let want = self.scales_shape(out, inp);
        if scales.1 != want {
            return Err(Error::shape(
                op,
                format!(
                    "a weight [{out}, {inp}] in blocks of {:?} needs scales of shape {want:?}, got {:?}",
                    self.block, scales.1
                ),
            ));
        }
        Ok([out, inp])
    }
}

/// The stored block scales: float32 values, or the bytes of float8_e4m3fn or
/// E8M0 ones.
#[derive(Debug, Clone, Copy)]
pub enum ScaleData<'a> {
    F32(&'a [f32]),
    E4M3(&'a [u8]),
    E8M0(&'a [u8]),
}

/// Block scales decoded to float32 and combined with the global scale, in the
/// order of Note [Quantized weights].
pub fn effective_scales(spec: &QuantSpec, scales: ScaleData<'_>) -> Vec<f32> {
    let raw: Vec<f32> = match scales {
        ScaleData::F32(v) => v.to_vec(),
        ScaleData::E4M3(b) => b.iter().map(|&c| f8e4m3fn::from_bits(c).to_f32()).collect(),
        ScaleData::E8M0(b) => b.iter().map(|&c| e8m0(c)).collect(),
    };
    raw.into_iter().map(|s| Global::apply(spec.global, s)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Note [Int8 activations]: `d = amax / 127`, ties away from zero, zero
    /// blocks 0, non-finite blocks NaN.
    #[test]
    fn activation_blocks_round_as_the_note_says() {
        let mut q = [0i8; 6];
        assert_eq!(round_activation_block(&[127.0, 0.5, -0.5, 1.5, -63.5, 0.0], &mut q), 1.0);
        assert_eq!(q, [127, 1, -1, 2, -64, 0]);
        let mut q = [0i8; 3];
        assert_eq!(round_activation_block(&[-254.0, 1.0, 3.0], &mut q), 2.0);
        assert_eq!(q, [-127, 1, 2]);
        assert_eq!(round_activation_block(&[0.0, -0.0, 0.0], &mut q), 0.0);
        assert_eq!(q, [0, 0, 0]);
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut q = [5i8; 3];
            assert!(round_activation_block(&[1.0, bad, 2.0], &mut q).is_nan());
            assert_eq!(q, [0, 0, 0]);
        }
    }

    #[test]
    fn e8m0_decodes() {
        assert_eq!(e8m0(127), 1.0);
        assert_eq!(e8m0(120), 2f32.powi(-7));
        assert_eq!(e8m0(0), 2f32.powi(-127));
        assert_eq!(e8m0(254), 2f32.powi(127));
        assert!(e8m0(255).is_nan());
    }
}
