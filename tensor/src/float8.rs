//! The 8-bit floating-point element types PyTorch has, `float8_e4m3fn`
//! ([`f8e4m3fn`]) and `float8_e5m2` ([`f8e5m2`]), with PyTorch's conversions.
//!
// Note [float8 conversions]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// Both types are one byte: a sign bit, then exponent and mantissa bits.
//
// * e4m3fn: 4 exponent bits (bias 7), 3 mantissa bits, "fn" = finite with NaN:
//   no infinities, 0x7F and 0xFF are NaN, the largest value is 448 (0x7E), the
//   smallest subnormal 2^-9.
// * e5m2: 5 exponent bits (bias 15), 2 mantissa bits: the top byte of an IEEE
//   half, with infinities (0x7C) and NaNs, largest finite 57344.
//
// Decoding is exact (every value is an f32). Encoding follows c10's
// `Float8_e4m3fn` / `Float8_e5m2` constructors, which is what `tensor.to(dtype)`
// does: the value is first an f32 (an f64 rounds to f32 first, as PyTorch's
// casts do), then rounds to nearest, ties to even, and is *not* saturating:
// e4m3fn gives NaN for |x| >= 480 (everything that would round past 448) and
// for infinities; e5m2 gives ±inf for |x| >= 65536 (the values that round past
// 57344) and NaN for NaN. Saturating conversions (the scaled-matmul recipes
// clamp to ±448 first) are the caller's `clamp`. The sign of zero and of NaN
// is kept.
//
// The rounding works on the f32 bits: for normal results, adding half an ulp
// of the target minus one (plus the lowest kept mantissa bit, for ties to even)
// and truncating rounds to nearest even, and a carry out of the mantissa bumps
// the exponent, as it should. Subnormal results are rounded by the FPU: adding
// a power of two large enough that the target's subnormal step is the f32 ulp
// makes the f32 addition do the rounding (ties to even), and the low bits of
// the sum are the code.

/// `float8_e4m3fn`: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinity;
/// 0x7F / 0xFF are NaN; largest finite 448.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct f8e4m3fn(u8);

/// `float8_e5m2`: 1 sign, 5 exponent (bias 15), 2 mantissa bits (the top byte
/// of an IEEE half); infinities and NaNs; largest finite 57344.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct f8e5m2(u8);

/// f32 bit-pattern arithmetic shared by both encoders.
#[inline(always)]
fn encode(x: f32, mant_bits: u32, bias: i32, overflow_at: u32, overflow_code: u8, nan_code: u8) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let abs = bits & 0x7FFF_FFFF;
    let shift = 23 - mant_bits;
    let code = if abs > 0x7F80_0000 {
        nan_code
    } else if abs >= overflow_at {
        overflow_code
    } else if abs < ((127 - bias + 1) as u32) << 23 {
        // Subnormal or zero in the target (Note [float8 conversions]): the
        // target's smallest subnormal 2^(1 - bias - mant_bits) becomes the f32
        // ulp of 2^(1 - bias - mant_bits + 23).
        let magic = ((127 - bias + 1 + shift as i32) as u32) << 23;
        let sum = f32::from_bits(abs) + f32::from_bits(magic);
        (sum.to_bits() - magic) as u8
    } else {
        let odd = (abs >> shift) & 1;
        let rebiased = abs - (((127 - bias) as u32) << 23);
        ((rebiased + (1 << (shift - 1)) - 1 + odd) >> shift) as u8
    };
    code | sign
}

impl f8e4m3fn {
    /// Largest finite value, 448.
    pub const MAX: f8e4m3fn = f8e4m3fn(0x7E);
    pub const NAN: f8e4m3fn = f8e4m3fn(0x7F);
    pub const ZERO: f8e4m3fn = f8e4m3fn(0);
    pub const ONE: f8e4m3fn = f8e4m3fn(0x38);

    pub const fn from_bits(b: u8) -> Self {
        f8e4m3fn(b)
    }
    pub const fn to_bits(self) -> u8 {
        self.0
    }
    /// PyTorch's conversion (Note [float8 conversions]): round to nearest even;
    /// |x| >= 480, infinities and NaN give NaN.
    #[inline]
    pub fn from_f32(x: f32) -> Self {
        // 480 = 0x43F0_0000: the first value that rounds past 448.
        f8e4m3fn(encode(x, 3, 7, 0x43F0_0000, 0x7F, 0x7F))
    }
    /// Through f32, as PyTorch's casts from float64 go.
    pub fn from_f64(x: f64) -> Self {
        Self::from_f32(x as f32)
    }
    /// The exact value.
    #[inline]
    pub fn to_f32(self) -> f32 {
        E4M3_TABLE[self.0 as usize]
    }
    pub fn to_f64(self) -> f64 {
        self.to_f32() as f64
    }
    pub fn is_nan(self) -> bool {
        self.0 & 0x7F == 0x7F
    }
}

impl f8e5m2 {
    /// Largest finite value, 57344.
    pub const MAX: f8e5m2 = f8e5m2(0x7B);
    pub const INFINITY: f8e5m2 = f8e5m2(0x7C);
    pub const NAN: f8e5m2 = f8e5m2(0x7F);
    pub const ZERO: f8e5m2 = f8e5m2(0);
    pub const ONE: f8e5m2 = f8e5m2(0x3C);

    pub const fn from_bits(b: u8) -> Self {
        f8e5m2(b)
    }
    pub const fn to_bits(self) -> u8 {
        self.0
    }
    /// PyTorch's conversion (Note [float8 conversions]): round to nearest even;
    /// |x| >= 65536 and infinities give ±inf, NaN gives NaN.
    #[inline]
    pub fn from_f32(x: f32) -> Self {
        // 65536 = 0x4780_0000: the first value that rounds past 57344.
        f8e5m2(encode(x, 2, 15, 0x4780_0000, 0x7C, 0x7F))
    }
    pub fn from_f64(x: f64) -> Self {
        Self::from_f32(x as f32)
    }
    /// The exact value.
    #[inline]
    pub fn to_f32(self) -> f32 {
        half::f16::from_bits((self.0 as u16) << 8).to_f32()
    }
    pub fn to_f64(self) -> f64 {
        self.to_f32() as f64
    }
    pub fn is_nan(self) -> bool {
        self.0 & 0x7F > 0x7C
    }
}

/// Every e4m3fn code's value.
static E4M3_TABLE: [f32; 256] = {
    let mut t = [0f32; 256];
    let mut i = 0;
    while i < 256 {
        let e = ((i >> 3) & 0xF) as i32;
        let m = (i & 7) as u32;
        let v = if i & 0x7F == 0x7F {
            f32::NAN
        } else if e == 0 {
            // m/8 * 2^-6 = m * 2^-9, exact in f32.
            m as f32 * (1.0 / 512.0)
        } else {
            // (1 + m/8) * 2^(e-7): build the f32 bits directly.
            f32::from_bits((((e - 7 + 127) as u32) << 23) | (m << 20))
        };
        t[i] = if i & 0x80 != 0 { -v } else { v };
        i += 1;
    }
    t
};

macro_rules! f8_common {
    ($t:ident, $name:ident) => {
        impl PartialOrd for $t {
            fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
                self.to_f32().partial_cmp(&o.to_f32())
            }
        }
        impl std::fmt::Debug for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                std::fmt::Debug::fmt(&self.to_f32(), f)
            }
        }
        impl std::fmt::Display for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                std::fmt::Display::fmt(&self.to_f32(), f)
            }
        }
        impl From<$t> for f32 {
            fn from(x: $t) -> f32 {
                x.to_f32()
            }
        }
        impl crate::Element for $t {
            const DTYPE: crate::DType = crate::DType::$name;
            #[inline(always)]
            fn to_f64(self) -> f64 {
                $t::to_f64(self)
            }
            #[inline(always)]
            fn from_f64(v: f64) -> Self {
                $t::from_f64(v)
            }
            #[inline(always)]
            fn to_i64(self) -> i64 {
                self.to_f32() as i64
            }
            #[inline(always)]
            fn from_i64(v: i64) -> Self {
                $t::from_f32(v as f32)
            }
        }
    };
}
f8_common!(f8e4m3fn, F8E4M3FN);
f8_common!(f8e5m2, F8E5M2);

#[cfg(test)]
mod tests {
    use super::*;

    /// A reference encoder by search: the nearest code (ties to the even code)
    /// among the finite ones and `beyond`, the code one step past the largest
    /// finite value (e4m3fn's NaN 0x7F standing for 480, e5m2's inf 0x7C for
    /// 65536), which is where PyTorch's bit rounding carries into.
    fn nearest(x: f32, decode: impl Fn(u8) -> f32, beyond: (u8, f32)) -> u8 {
        let mut best: Option<(u8, f64)> = None;
        let sign = if x.is_sign_negative() { 0x80 } else { 0 };
        let candidates = (0..=255u8).map(|c| (c, decode(c))).chain([(beyond.0 | sign, beyond.1.copysign(x))]);
        for (c, v) in candidates {
            if !v.is_finite() || (v == 0.0 && v.is_sign_negative() != x.is_sign_negative()) {
                continue;
            }
            let d = (v as f64 - x as f64).abs();
            best = match best {
                Some((b, bd)) if bd < d || (bd == d && b & 1 == 0) => Some((b, bd)),
                _ => Some((c, d)),
            };
        }
        best.map(|(c, _)| c).unwrap()
    }

    fn samples() -> Vec<f32> {
        let mut v = vec![0.0, -0.0, 1.0, 448.0, 464.0, 464.01, 479.99, 480.0, 57344.0, 61440.0, 65535.0, 65536.0];
        // Every code's value, the midpoints between neighbours and points just off them.
        for c in 0..=255u8 {
            for x in [f8e4m3fn(c).to_f32(), f8e5m2(c).to_f32()] {
                if x.is_finite() {
                    v.extend([x, x * 1.0625, x * 0.9375, x * 1.03125, x * 0.96875]);
                    v.push(f32::from_bits(x.to_bits().wrapping_add(1)));
                }
            }
        }
        let mut s = 0x1234_5678u32;
        for _ in 0..20000 {
            s = s.wrapping_mul(1664525).wrapping_add(1013904223);
            v.push(f32::from_bits(s & 0xBFFF_FFFF) * 1e-30);
            v.push((s as i32 as f32) * 1e-5);
        }
        v
    }

    #[test]
    fn e4m3fn_rounds_to_nearest_even_and_overflows_to_nan() {
        for x in samples() {
            let got = f8e4m3fn::from_f32(x);
            if x.is_nan() || x.abs() >= 480.0 {
                assert!(got.is_nan(), "{x:e} gave {got:?}");
            } else {
                assert_eq!(got.to_bits(), nearest(x, |c| f8e4m3fn(c).to_f32(), (0x7F, 480.0)), "{x:e}");
            }
        }
        assert!(f8e4m3fn::from_f32(f32::INFINITY).is_nan());
        assert_eq!(f8e4m3fn::from_f32(464.0).to_f32(), 448.0);
        assert!(f8e4m3fn::from_f32(465.0).is_nan());
        assert_eq!(f8e4m3fn::from_f32(-0.0).to_bits(), 0x80);
        assert_eq!(f8e4m3fn::from_f32(2f32.powi(-10)).to_bits(), 0, "half the smallest subnormal ties to 0");
        assert_eq!(f8e4m3fn::from_f32(3.0 * 2f32.powi(-10)).to_bits(), 2);
        assert_eq!(f8e4m3fn::MAX.to_f32(), 448.0);
        assert_eq!(f8e4m3fn::ONE.to_f32(), 1.0);
    }

    #[test]
    fn e5m2_rounds_to_nearest_even_and_overflows_to_infinity() {
        for x in samples() {
            let got = f8e5m2::from_f32(x);
            if x.is_nan() {
                assert!(got.is_nan());
            } else if x.abs() >= 65536.0 {
                assert_eq!(got.to_f32(), f32::INFINITY.copysign(x), "{x:e}");
            } else {
                assert_eq!(got.to_bits(), nearest(x, |c| f8e5m2(c).to_f32(), (0x7C, 65536.0)), "{x:e}");
            }
        }
        assert_eq!(
            f8e5m2::from_f32(61440.0).to_f32(),
            f32::INFINITY,
            "the tie past the largest value rounds to even: inf"
        );
        assert_eq!(f8e5m2::from_f32(f32::NEG_INFINITY).to_bits(), 0xFC);
        assert!(f8e5m2::from_f32(f32::NAN).is_nan());
        assert_eq!(f8e5m2::MAX.to_f32(), 57344.0);
        assert_eq!(f8e5m2::ONE.to_f32(), 1.0);
    }

    #[test]
    fn every_code_round_trips() {
        for c in 0..=255u8 {
            let a = f8e4m3fn(c);
            if !a.is_nan() {
                assert_eq!(f8e4m3fn::from_f32(a.to_f32()), a);
            }
            let b = f8e5m2(c);
            if !b.is_nan() {
                assert_eq!(f8e5m2::from_f32(b.to_f32()), b);
            }
        }
    }
}
