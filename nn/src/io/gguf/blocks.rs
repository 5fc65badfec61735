//! The tensor types of GGUF files (ggml's `ggml_type`): their ids and block
//! layouts, exact dequantization to float32, and the reference quantizers of
//! the types kiln writes (Note [GGUF blocks]).
//!
// Note [GGUF blocks]
// ~~~~~~~~~~~~~~~~~~
// A quantized GGUF tensor is a sequence of blocks along its innermost
// dimension (the `in` of a weight `[out, in]`), each block `block_size()`
// elements in `type_size()` bytes, all little-endian. f16 scales are exact in
// float32; every value is then computed in float32 in the order of ggml's
// reference `dequantize_row_*` (which the `gguf` Python package follows), so
// dequantization is bit-exact:
//
// | type | block | bytes | layout and value |
// |------|-------|-------|------------------|
// | Q8_0 | 32  | 34  | f16 d, 32 × i8 q: `q * d` |
// | Q4_0 | 32  | 18  | f16 d, 16 bytes: element j in the low nibble of byte j, j + 16 in its high nibble: `(q - 8) * d` |
// | Q4_1 | 32  | 20  | f16 d, f16 m, nibbles as Q4_0: `d * q + m` |
// | Q5_0 | 32  | 22  | f16 d, u32 qh (bit j: the fifth bit of element j), nibbles as Q4_0: `(q - 16) * d` |
// | Q5_1 | 32  | 24  | f16 d, f16 m, qh, nibbles: `d * q + m` |
// | Q2_K | 256 | 84  | 16 bytes of 4-bit scale / 4-bit min per 16, 64 bytes of 2-bit q, f16 d, f16 dmin: `(d * sc) * q - dmin * m` |
// | Q3_K | 256 | 110 | 32-byte high-bit mask, 64 bytes of 2-bit q, 12 bytes of 6-bit scales per 16, f16 d: `(d * (sc - 32)) * (q - 4·!h)` |
// | Q4_K | 256 | 144 | f16 d, f16 dmin, 12 bytes of 6-bit scale and min per 32, 128 bytes of nibbles: `(d * sc) * q - dmin * m` |
// | Q5_K | 256 | 176 | as Q4_K plus a 32-byte high-bit mask before the nibbles |
// | Q6_K | 256 | 210 | 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 × i8 scales per 16, f16 d: `(d * sc) * (q - 32)` |
//
// In the K types a 256-element super-block is walked in halves or chunks:
// Q4_K / Q5_K take 32 bytes of nibbles per 64 elements (low nibbles first,
// then high), Q2_K / Q3_K / Q6_K take their 2-bit fields four to a byte per
// 128 elements (shift 0 for elements 0..32, 2 for 32..64, ...). The 6-bit
// scales of Q4_K / Q5_K pack sub-blocks 0..4 in the low 6 bits of bytes 0..4
// (scales) and 4..8 (mins), and sub-blocks 4..8 in the nibbles of bytes 8..12
// with their top two bits in the top bits of bytes 0..8.
//
// kiln writes F32, F16, BF16, Q8_0 and Q4_0 with ggml's reference quantizers
// (`quantize_row_q8_0_ref`, `quantize_row_q4_0_ref`: the same bytes as
// llama.cpp's converter and the `gguf` package); the other types are read.
use kiln_tensor::half::{bf16, f16};
use kiln_tensor::DType;

/// A GGUF tensor type (ggml's `ggml_type`, with its names and ids).
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    BF16,
    F64,
    I8,
    I16,
    I32,
    I64,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    Q8_K,
    IQ2_XXS,
    IQ2_XS,
    IQ3_XXS,
    IQ1_S,
    IQ4_NL,
    IQ3_S,
    IQ2_S,
    IQ4_XS,
    IQ1_M,
    TQ1_0,
    TQ2_0,
    MXFP4,
    NVFP4,
}

use GgmlType::*;

/// Every type, for lookups by id.
const ALL: [GgmlType; 33] = [
    F32, F16, BF16, F64, I8, I16, I32, I64, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K,
    IQ2_XXS, IQ2_XS, IQ3_XXS, IQ1_S, IQ4_NL, IQ3_S, IQ2_S, IQ4_XS, IQ1_M, TQ1_0, TQ2_0, MXFP4, NVFP4,
];

/// Elements per K super-block.
const QK_K: usize = 256;

impl GgmlType {
    /// ggml's id of the type (the `type` field of a GGUF tensor info).
    pub fn id(self) -> u32 {
        match self {
            F32 => 0,
            F16 => 1,
            Q4_0 => 2,
            Q4_1 => 3,
            Q5_0 => 6,
            Q5_1 => 7,
            Q8_0 => 8,
            Q8_1 => 9,
            Q2_K => 10,
            Q3_K => 11,
            Q4_K => 12,
            Q5_K => 13,
            Q6_K => 14,
            Q8_K => 15,
            IQ2_XXS => 16,
            IQ2_XS => 17,
            IQ3_XXS => 18,
            IQ1_S => 19,
            IQ4_NL => 20,
            IQ3_S => 21,
            IQ2_S => 22,
            IQ4_XS => 23,
            I8 => 24,
            I16 => 25,
            I32 => 26,
            I64 => 27,
            F64 => 28,
            IQ1_M => 29,
            BF16 => 30,
            TQ1_0 => 34,
            TQ2_0 => 35,
            MXFP4 => 39,
            NVFP4 => 40,
        }
    }

    /// The type with ggml id `id`, if kiln knows it.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        ALL.into_iter().find(|t| t.id() == id)
    }

    /// The type named `name` as ggml names it (`"Q4_K"`, `"BF16"`), any case.
    pub fn from_name(name: &str) -> Option<GgmlType> {
        ALL.into_iter().find(|t| t.name().eq_ignore_ascii_case(name))
    }

    /// ggml's name of the type.
    pub fn name(self) -> &'static str {
        match self {
            F32 => "F32",
            F16 => "F16",
            BF16 => "BF16",
            F64 => "F64",
            I8 => "I8",
            I16 => "I16",
            I32 => "I32",
            I64 => "I64",
            Q4_0 => "Q4_0",
            Q4_1 => "Q4_1",
            Q5_0 => "Q5_0",
            Q5_1 => "Q5_1",
            Q8_0 => "Q8_0",
            Q8_1 => "Q8_1",
            Q2_K => "Q2_K",
            Q3_K => "Q3_K",
            Q4_K => "Q4_K",
            Q5_K => "Q5_K",
            Q6_K => "Q6_K",
            Q8_K => "Q8_K",
            IQ2_XXS => "IQ2_XXS",
            IQ2_XS => "IQ2_XS",
            IQ3_XXS => "IQ3_XXS",
            IQ1_S => "IQ1_S",
            IQ4_NL => "IQ4_NL",
            IQ3_S => "IQ3_S",
            IQ2_S => "IQ2_S",
            IQ4_XS => "IQ4_XS",
            IQ1_M => "IQ1_M",
            TQ1_0 => "TQ1_0",
            TQ2_0 => "TQ2_0",
            MXFP4 => "MXFP4",
            NVFP4 => "NVFP4",
        }
    }

    /// Elements per block (1 for the plain types).
    pub fn block_size(self) -> usize {
        match self {
            F32 | F16 | BF16 | F64 | I8 | I16 | I32 | I64 => 1,
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q8_1 | IQ4_NL | MXFP4 => 32,
            NVFP4 => 64,
            Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | Q8_K | IQ2_XXS | IQ2_XS | IQ3_XXS | IQ1_S | IQ3_S | IQ2_S | IQ4_XS
            | IQ1_M | TQ1_0 | TQ2_0 => QK_K,
        }
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        match self {
            I8 => 1,
            F16 | BF16 | I16 => 2,
            F32 | I32 => 4,
            F64 | I64 => 8,
            Q4_0 => 18,
            Q4_1 => 20,
            Q5_0 => 22,
            Q5_1 => 24,
            Q8_0 => 34,
            Q8_1 => 40,
            Q2_K => 84,
            Q3_K => 110,
            Q4_K => 144,
            Q5_K => 176,
            Q6_K => 210,
            Q8_K => 292,
            IQ2_XXS => 66,
            IQ2_XS => 74,
            IQ3_XXS => 98,
            IQ1_S => 50,
            IQ4_NL => 18,
            IQ3_S => 110,
            IQ2_S => 82,
            IQ4_XS => 136,
            IQ1_M => 56,
            TQ1_0 => 54,
            TQ2_0 => 66,
            MXFP4 => 17,
            NVFP4 => 36,
        }
    }

    /// The kiln dtype a tensor of this type reads into: the plain types keep
    /// theirs, the quantized ones dequantize to float32. `None`: kiln cannot
    /// dequantize this type.
    pub fn read_dtype(self) -> Option<DType> {
        match self {
            F32 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q2_K | Q3_K | Q4_K | Q5_K | Q6_K => Some(DType::F32),
            F16 => Some(DType::F16),
            BF16 => Some(DType::BF16),
            F64 => Some(DType::F64),
            I8 => Some(DType::I8),
            I16 => Some(DType::I16),
            I32 => Some(DType::I32),
            I64 => Some(DType::I64),
            Q8_1 | Q8_K | IQ2_XXS | IQ2_XS | IQ3_XXS | IQ1_S | IQ4_NL | IQ3_S | IQ2_S | IQ4_XS | IQ1_M | TQ1_0
            | TQ2_0 | MXFP4 | NVFP4 => None,
        }
    }

    /// Whether kiln writes tensors of this type (F32, F16, BF16, Q8_0, Q4_0).
    pub fn writable(self) -> bool {
        matches!(self, F32 | F16 | BF16 | Q8_0 | Q4_0)
    }

    /// Whether this is a block-quantized type (its values need dequantizing).
    pub fn is_quantized(self) -> bool {
        self.block_size() > 1
    }

    /// Dequantizes whole blocks `bytes` into `out` (`out.len()` =
    /// blocks × block size), bit-exactly (Note [GGUF blocks]). Only for the
    /// block-quantized types that [`GgmlType::read_dtype`] reads.
    pub(crate) fn dequantize(self, bytes: &[u8], out: &mut [f32]) {
        let (bs, ts) = (self.block_size(), self.type_size());
        debug_assert_eq!(bytes.len() / ts * bs, out.len());
        if let Some(g) = self.integer_group() {
            // An integer times its group's scale, one rounding.
            let (mut q, mut sc) = ([0i8; QK_K], [0f32; QK_K / 16]);
            for (b, y) in bytes.chunks_exact(ts).zip(out.chunks_exact_mut(bs)) {
                self.integer_block(b, &mut q[..bs], &mut sc[..bs / g]);
                for (e, y) in y.iter_mut().enumerate() {
                    *y = q[e] as f32 * sc[e / g];
                }
            }
            return;
        }
        let f: fn(&[u8], &mut [f32]) = match self {
            Q4_1 => q4_1,
            Q5_1 => q5_1,
            Q2_K => q2_k,
            Q4_K => q4_k,
            Q5_K => q5_k,
            Q4_0 | Q5_0 | Q8_0 | Q3_K | Q6_K => unreachable!("integer types return above"),
            F32 | F16 | BF16 | F64 | I8 | I16 | I32 | I64 | Q8_1 | Q8_K | IQ2_XXS | IQ2_XS | IQ3_XXS | IQ1_S
            | IQ4_NL | IQ3_S | IQ2_S | IQ4_XS | IQ1_M | TQ1_0 | TQ2_0 | MXFP4 | NVFP4 => {
                unreachable!("dequantize is called for the quantized types read_dtype reads, not {}", self.name())
            }
        };
        for (b, y) in bytes.chunks_exact(ts).zip(out.chunks_exact_mut(bs)) {
            f(b, y);
        }
    }

    /// The group size of the types whose every value is a signed integer
    /// code times its group's scale (Q4_0, Q5_0, Q8_0: 32; Q3_K, Q6_K: 16),
    /// which kiln can keep as int8 / int4 codes with float32 scales exactly.
    pub fn integer_group(self) -> Option<usize> {
        match self {
            Q4_0 | Q5_0 | Q8_0 => Some(32),
            Q3_K | Q6_K => Some(16),
            F32 | F16 | BF16 | F64 | I8 | I16 | I32 | I64 | Q4_1 | Q5_1 | Q8_1 | Q2_K | Q4_K | Q5_K | Q8_K
            | IQ2_XXS | IQ2_XS | IQ3_XXS | IQ1_S | IQ4_NL | IQ3_S | IQ2_S | IQ4_XS | IQ1_M | TQ1_0 | TQ2_0 | MXFP4
            | NVFP4 => None,
        }
    }

    /// The integer codes (`block_size()` of them) and group scales of one
    /// block of an [`GgmlType::integer_group`] type: the value of element
    /// `e` is `q[e] * s[e / group]`, rounded once (the scales are exact:
    /// f16 times a small integer).
    pub(crate) fn integer_block(self, b: &[u8], q: &mut [i8], s: &mut [f32]) {
        match self {
            Q4_0 => {
                s[0] = f16_at(b, 0);
                for (j, q) in q.iter_mut().enumerate() {
                    *q = nibble(&b[2..], j) as i8 - 8;
                }
            }
            Q5_0 => {
                s[0] = f16_at(b, 0);
                let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                for (j, q) in q.iter_mut().enumerate() {
                    *q = five_bits(qh, &b[6..], j) as i8 - 16;
                }
            }
            Q8_0 => {
                s[0] = f16_at(b, 0);
                for (q, &c) in q.iter_mut().zip(&b[2..34]) {
                    *q = c as i8;
                }
            }
            Q3_K => {
                let (hmask, qs, sc) = (&b[..32], &b[32..96], &b[96..108]);
                let d = f16_at(b, 108);
                // 16 six-bit scales: low nibbles from bytes 0..8 (both
                // halves), high two bits from bytes 8..12.
                for (i, s) in s.iter_mut().enumerate() {
                    let lo = if i < 8 { sc[i] & 0x0F } else { sc[i - 8] >> 4 };
                    let hi = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
                    *s = d * ((lo | (hi << 4)) as i8 - 32) as f32;
                }
                for (e, q) in q.iter_mut().enumerate() {
                    let high = (hmask[e % 32] >> (e / 32)) & 1;
                    *q = two_bits(qs, e) as i8 - if high == 0 { 4 } else { 0 };
                }
            }
            Q6_K => {
                let (ql, qh, scales) = (&b[..128], &b[128..192], &b[192..208]);
                let d = f16_at(b, 208);
                for (s, &c) in s.iter_mut().zip(scales) {
                    *s = d * c as i8 as f32;
                }
                for (e, q) in q.iter_mut().enumerate() {
                    let (h, r) = (e / 128, e % 128);
                    let lo = (ql[h * 64 + r % 64] >> (4 * (r / 64))) & 0x0F;
                    *q = (lo | (two_bits(qh, e) << 4)) as i8 - 32;
                }
            }
            F32 | F16 | BF16 | F64 | I8 | I16 | I32 | I64 | Q4_1 | Q5_1 | Q8_1 | Q2_K | Q4_K | Q5_K | Q8_K
            | IQ2_XXS | IQ2_XS | IQ3_XXS | IQ1_S | IQ4_NL | IQ3_S | IQ2_S | IQ4_XS | IQ1_M | TQ1_0 | TQ2_0 | MXFP4
            | NVFP4 => unreachable!("integer_block is called for integer_group types, not {}", self.name()),
        }
    }

    /// The bytes of `x` (whole blocks) stored as this type, with ggml's
    /// reference rounding. Only for the types [`GgmlType::writable`] names.
    pub(crate) fn quantize(self, x: &[f32]) -> Vec<u8> {
        match self {
            F32 => x.iter().flat_map(|v| v.to_le_bytes()).collect(),
            F16 => x.iter().flat_map(|v| f16::from_f32(*v).to_le_bytes()).collect(),
            BF16 => x.iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes()).collect(),
            Q8_0 => x.chunks_exact(32).flat_map(quantize_q8_0).collect(),
            Q4_0 => x.chunks_exact(32).flat_map(quantize_q4_0).collect(),
            F64 | I8 | I16 | I32 | I64 | Q4_1 | Q5_0 | Q5_1 | Q8_1 | Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | Q8_K
            | IQ2_XXS | IQ2_XS | IQ3_XXS | IQ1_S | IQ4_NL | IQ3_S | IQ2_S | IQ4_XS | IQ1_M | TQ1_0 | TQ2_0 | MXFP4
            | NVFP4 => unreachable!("quantize is called for the writable types, not {}", self.name()),
        }
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[inline(always)]
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// The `j`-th of 32 elements stored as nibbles (Q4_0, Q4_1, Q5_0, Q5_1).
#[inline(always)]
fn nibble(qs: &[u8], j: usize) -> u8 {
    if j < 16 {
        qs[j] & 0x0F
    } else {
        qs[j - 16] >> 4
    }
}

fn q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    for (j, y) in y.iter_mut().enumerate() {
        *y = d * nibble(&b[4..], j) as f32 + m;
    }
}

/// The five-bit code `j` of a Q5 block: a nibble and bit `j` of `qh`.
#[inline(always)]
fn five_bits(qh: u32, qs: &[u8], j: usize) -> u8 {
    nibble(qs, j) | ((((qh >> j) & 1) as u8) << 4)
}

fn q5_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    for (j, y) in y.iter_mut().enumerate() {
        *y = d * five_bits(qh, &b[8..], j) as f32 + m;
    }
}

/// The 2-bit field of element `e` (0..256) of a K super-block whose fields
/// sit four to a byte in 32-byte rows per 128 elements (Q2_K's q, Q3_K's low
/// bits, Q6_K's high bits take 64 bytes, two halves, the same way).
#[inline(always)]
fn two_bits(qs: &[u8], e: usize) -> u8 {
    let (h, r) = (e / 128, e % 128);
    (qs[h * 32 + r % 32] >> (2 * (r / 32))) & 3
}

fn q2_k(b: &[u8], y: &mut [f32]) {
    let (scales, qs) = (&b[..16], &b[16..80]);
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    for (e, y) in y.iter_mut().enumerate() {
        let sc = scales[e / 16];
        let dl = d * (sc & 0x0F) as f32;
        let ml = dmin * (sc >> 4) as f32;
        *y = dl * two_bits(qs, e) as f32 - ml;
    }
}

/// The 6-bit scale and min of sub-block `j` (0..8) of Q4_K / Q5_K.
#[inline(always)]
fn scale_min_k4(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

/// The nibble of element `e` (0..256) of a Q4_K / Q5_K super-block: 32 bytes
/// per 64 elements, low nibbles first.
#[inline(always)]
fn k_nibble(qs: &[u8], e: usize) -> u8 {
    (qs[(e / 64) * 32 + e % 32] >> (4 * ((e / 32) % 2))) & 0x0F
}

fn q4_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qs) = (&b[4..16], &b[16..144]);
    for (sub, y) in y.chunks_exact_mut(32).enumerate() {
        let (sc, m) = scale_min_k4(sub, scales);
        let (d1, m1) = (d * sc as f32, dmin * m as f32);
        for (i, y) in y.iter_mut().enumerate() {
            *y = d1 * k_nibble(qs, sub * 32 + i) as f32 - m1;
        }
    }
}

fn q5_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
    for (sub, y) in y.chunks_exact_mut(32).enumerate() {
        let (sc, m) = scale_min_k4(sub, scales);
        let (d1, m1) = (d * sc as f32, dmin * m as f32);
        for (i, y) in y.iter_mut().enumerate() {
            let q = k_nibble(qs, sub * 32 + i) | (((qh[i] >> sub) & 1) << 4);
            *y = d1 * q as f32 - m1;
        }
    }
}

/// ggml's `quantize_row_q8_0_ref` for one block of 32.
fn quantize_q8_0(x: &[f32]) -> Vec<u8> {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut out = f16::from_f32(d).to_le_bytes().to_vec();
    // `roundf`: halves away from zero, as f32::round.
    out.extend(x.iter().map(|v| (v * id).round() as i8 as u8));
    out
}

/// ggml's `quantize_row_q4_0_ref` for one block of 32: the scale is the
/// signed value of largest magnitude (the first one) over -8.
fn quantize_q4_0(x: &[f32]) -> Vec<u8> {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let code = |v: f32| ((v * id + 8.5) as i8).min(15) as u8;
    let mut out = f16::from_f32(d).to_le_bytes().to_vec();
    out.extend((0..16).map(|j| code(x[j]) | (code(x[16 + j]) << 4)));
    out
}
