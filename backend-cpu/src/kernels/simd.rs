//! Runtime CPU-feature dispatch for hot loops, and vectorisable f32 math.
//!
//! A hot loop is written once, as a `Kernel` whose `run` is `#[inline(always)]`;
//! `dispatch` calls it through a `#[target_feature]` wrapper chosen once per
//! process from the features the CPU reports (AVX-512, AVX2+FMA, or baseline
//! x86-64), so LLVM vectorises the same source for each instruction set.
//! `FMA` tells the loop whether fused multiply-add is available.
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicU8, Ordering};

/// Instruction-set levels the hot loops are compiled for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Level {
    Baseline = 1,
    Avx2 = 2,
    Avx512 = 3,
}

static LEVEL: AtomicU8 = AtomicU8::new(0);

/// The best level this CPU supports (detected once).
pub(crate) fn level() -> Level {
    match LEVEL.load(Ordering::Relaxed) {
        1 => Level::Baseline,
        2 => Level::Avx2,
        3 => Level::Avx512,
        _ => {
            let l = detect();
            LEVEL.store(l as u8, Ordering::Relaxed);
            l
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Level {
    if std::env::var_os("KILN_CPU_BASELINE").is_some() {
        return Level::Baseline;
    }
    let avx2 = is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
        && is_x86_feature_detected!("bmi1")
        && is_x86_feature_detected!("bmi2");
    let avx512 = avx2
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512dq")
        && is_x86_feature_detected!("avx512vl");
    if avx512 {
        Level::Avx512
    } else if avx2 {
        Level::Avx2
    } else {
        Level::Baseline
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> Level {
    Level::Baseline
}

/// A loop body compiled once per [`Level`]. Implementations mark `run` `#[inline(always)]`.
pub(crate) trait Kernel {
    type Out;
    fn run<const FMA: bool>(self) -> Self::Out;
}

/// Runs `k` compiled for the best instruction set of this CPU.
#[inline]
pub(crate) fn dispatch<K: Kernel>(k: K) -> K::Out {
    #[cfg(target_arch = "x86_64")]
    match level() {
        // SAFETY: `level()` returns `Avx512` only after `is_x86_feature_detected!` confirmed
        // every feature `run_avx512` enables (avx512f/bw/dq/vl, avx2, fma, f16c, bmi1/2).
        Level::Avx512 => return unsafe { run_avx512(k) },
        // SAFETY: `Avx2` is returned only after avx2, fma, f16c, bmi1 and bmi2 were detected.
        Level::Avx2 => return unsafe { run_avx2(k) },
        Level::Baseline => {}
    }
    k.run::<false>()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,avx,fma,f16c,bmi1,bmi2,sse4.1,sse4.2,ssse3")]
unsafe fn run_avx512<K: Kernel>(k: K) -> K::Out {
    k.run::<true>()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx,fma,f16c,bmi1,bmi2,sse4.1,sse4.2,ssse3")]
unsafe fn run_avx2<K: Kernel>(k: K) -> K::Out {
    k.run::<true>()
}

/// `a * b + c`, fused when the instruction set has FMA.
#[inline(always)]
pub(crate) fn fmadd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// `exp(x)` for f32, branch-free so loops of it vectorise; within 1 ulp of the
/// correctly rounded result over the whole range, subnormal results included.
///
/// Cody-Waite reduction `x = n ln2 + r` (|r| <= ln2/2), a degree-6 polynomial for
/// `exp(r)` (SLEEF's coefficients), and the scaling by `2^n` done in two halves so
/// results that underflow into subnormals are rounded once, correctly.
// The constants are the published ones, digit for digit.
#[allow(clippy::excessive_precision)]
#[inline(always)]
pub(crate) fn exp_f32<const FMA: bool>(x: f32) -> f32 {
    // Adding 1.5 * 2^23 rounds to an integer kept in the low mantissa bits.
    const MAGIC: f32 = 12_582_912.0;
    const LN2_HI: f32 = 0.693_359_375;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Beyond these bounds the result is inf / 0 anyway; NaN fails both tests and passes through.
    let x = if x < -104.0 { -104.0 } else { x };
    let x = if x > 89.0 { 89.0 } else { x };
    let t = fmadd::<FMA>(x, std::f32::consts::LOG2_E, MAGIC);
    let n = t - MAGIC;
    let r = fmadd::<FMA>(n, -LN2_HI, x);
    let r = fmadd::<FMA>(n, -LN2_LO, r);
    let mut p = 1.985_276_2e-4_f32;
    p = fmadd::<FMA>(p, r, 1.393_043_6e-3);
    p = fmadd::<FMA>(p, r, 8.333_361e-3);
    p = fmadd::<FMA>(p, r, 4.166_648_5e-2);
    p = fmadd::<FMA>(p, r, 1.666_666_7e-1);
    p = fmadd::<FMA>(p, r, 0.5);
    let y = fmadd::<FMA>(p, r * r, r) + 1.0;
    let ni = (t.to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32);
    let n1 = ni >> 1;
    let n2 = ni.wrapping_sub(n1);
    let s1 = f32::from_bits((n1.wrapping_add(127) as u32) << 23);
    let s2 = f32::from_bits((n2.wrapping_add(127) as u32) << 23);
    y * s1 * s2
}

/// `1 / (1 + exp(-x))`, PyTorch's formula.
#[inline(always)]
pub(crate) fn sigmoid_f32<const FMA: bool>(x: f32) -> f32 {
    1.0 / (1.0 + exp_f32::<FMA>(-x))
}

/// `tanh(x)` for f32, branch-free: an odd polynomial (Cephes) for |x| < 0.625,
/// `1 - 2 / (exp(2|x|) + 1)` above; sign restored at the end. Within 2 ulp.
#[allow(clippy::excessive_precision)]
#[inline(always)]
pub(crate) fn tanh_f32<const FMA: bool>(x: f32) -> f32 {
    let a = x.abs();
    let s = a * a;
    let mut p = -5.704_988_7e-3_f32;
    p = fmadd::<FMA>(p, s, 2.063_908_9e-2);
    p = fmadd::<FMA>(p, s, -5.373_971_6e-2);
    p = fmadd::<FMA>(p, s, 1.333_144_2e-1);
    p = fmadd::<FMA>(p, s, -3.333_328_2e-1);
    let small = fmadd::<FMA>(p * s, a, a);
    let large = 1.0 - 2.0 / (exp_f32::<FMA>(a + a) + 1.0);
    let r = if a < 0.625 { small } else { large };
    r.copysign(x)
}

/// An elementwise op of one operand, computed in `F`.
pub(crate) trait UnOp<F>: Copy + Send + Sync {
    fn f<const FMA: bool>(self, x: F) -> F;
}

/// An elementwise op of two operands, computed in `F`.
pub(crate) trait BinOp<F>: Copy + Send + Sync {
    fn f<const FMA: bool>(self, a: F, b: F) -> F;
}

/// `out[i] = op(x[i])`, writing as many outputs as there are inputs.
pub(crate) struct MapUnary<'a, F, K> {
    pub op: K,
    pub x: &'a [F],
    pub out: &'a mut [MaybeUninit<F>],
}

impl<F: Copy, K: UnOp<F>> Kernel for MapUnary<'_, F, K> {
    type Out = ();
    #[inline(always)]
    fn run<const FMA: bool>(self) {
        let op = self.op;
        for (o, &x) in self.out.iter_mut().zip(self.x) {
            o.write(op.f::<FMA>(x));
        }
    }
}

/// `out[i] = op(a[i], b[i])`, writing as many outputs as there are inputs.
pub(crate) struct MapBinary<'a, F, K> {
    pub op: K,
    pub a: &'a [F],
    pub b: &'a [F],
    pub out: &'a mut [MaybeUninit<F>],
}

impl<F: Copy, K: BinOp<F>> Kernel for MapBinary<'_, F, K> {
    type Out = ();
    #[inline(always)]
    fn run<const FMA: bool>(self) {
        let op = self.op;
        for ((o, &a), &b) in self.out.iter_mut().zip(self.a).zip(self.b) {
            o.write(op.f::<FMA>(a, b));
        }
    }
}

/// Applies a unary op over a slice with the best instruction set, writing all of
/// `out` (of `x`'s length: checked, as callers rely on every output being written).
#[inline]
pub(crate) fn map_unary<F: Copy, K: UnOp<F>>(op: K, x: &[F], out: &mut [MaybeUninit<F>]) {
    assert_eq!(x.len(), out.len(), "map_unary: lengths differ");
    dispatch(MapUnary { op, x, out })
}

/// Applies a binary op over two slices with the best instruction set, writing all
/// of `out` (of the inputs' length: checked, as for `map_unary`).
#[inline]
pub(crate) fn map_binary<F: Copy, K: BinOp<F>>(op: K, a: &[F], b: &[F], out: &mut [MaybeUninit<F>]) {
    assert!(a.len() == out.len() && b.len() == out.len(), "map_binary: lengths differ");
    dispatch(MapBinary { op, a, b, out })
}
