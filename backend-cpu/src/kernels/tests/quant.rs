//! Block-quantized weights: `Op::Dequantize` (partial blocks, the global
//! scale, every code of each format) and `Op::QuantMatMul` against it.
use super::*;
use kiln_tensor::quant::{e8m0, Codes, Global, QuantSpec, E2M1_VALUES};
use kiln_tensor::{f8e4m3fn, HostBuffer};

fn host(b: HostBuffer, shape: &[usize]) -> Tensor {
    crate::register();
    Tensor::from_host(b, shape, kiln_tensor::Device::Cpu).unwrap()
}

fn e4m3(v: &[f32], shape: &[usize]) -> Tensor {
    host(HostBuffer::F8E4M3FN(v.iter().map(|&x| f8e4m3fn::from_f32(x)).collect()), shape)
}

#[test]
fn partial_blocks_and_groups_dequantize() {
    // FP8 [3, 5] in blocks of [2, 4]: scales [2, 2], the last row and column blocks partial.
    let spec = QuantSpec::new(Codes::E4M3, [2, 4], None);
    let codes = e4m3(&(0..15).map(|i| i as f32).collect::<Vec<_>>(), &[3, 5]);
    let scales = f32s(&[1.0, 10.0, 100.0, 1000.0], &[2, 2]);
    let w = run(Op::Dequantize(spec), &[&codes, &scales]);
    assert_eq!(
        vals::<f32>(&w),
        [0.0, 1.0, 2.0, 3.0, 40.0, 5.0, 6.0, 7.0, 8.0, 90.0, 1000.0, 1100.0, 1200.0, 1300.0, 14000.0]
    );
    // NVFP4 [1, 4] in groups of 2, the global dividing: effective scales 8/4 and 2/4.
    let spec = QuantSpec::new(Codes::E2M1, [1, 2], Some(Global::Div(4.0)));
    let w = run(Op::Dequantize(spec), &[&t(vec![0x72u8, 0xA1], &[1, 2]), &f32s(&[8.0, 2.0], &[1, 2])]);
    assert_eq!(vals::<f32>(&w), [2.0, 12.0, 0.25, -0.5]);
}

#[test]
fn every_code_decodes() {
    // E2M1: every byte, low nibble first; bit 3 of a nibble is the sign (code 8 is -0.0).
    let spec = QuantSpec::new(Codes::E2M1, [1, 2], None);
    let packed: Vec<u8> = (0..=255).collect();
    let w = run(Op::Dequantize(spec), &[&t(packed, &[256, 1]), &f32s(&[1.0; 256], &[256, 1])]);
    let w = vals::<f32>(&w);
    for b in 0..256usize {
        for (k, n) in [b & 0xF, b >> 4].into_iter().enumerate() {
            let v = if n & 8 != 0 { -E2M1_VALUES[n & 7] } else { E2M1_VALUES[n & 7] };
            assert_eq!(w[2 * b + k].to_bits(), v.to_bits(), "byte {b:#x}, nibble {k}");
        }
    }
    // E4M3: every code, scale 1.
    let spec = QuantSpec::new(Codes::E4M3, [1, 1], None);
    let codes = host(HostBuffer::F8E4M3FN((0..=255).map(f8e4m3fn::from_bits).collect()), &[256, 1]);
    let w = vals::<f32>(&run(Op::Dequantize(spec), &[&codes, &f32s(&[1.0; 256], &[256, 1])]));
    for (c, g) in w.iter().enumerate() {
        let want = f8e4m3fn::from_bits(c as u8).to_f32();
        assert!(g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()), "code {c:#x}: {g} vs {want}");
    }
    // Int8: every byte, two's complement; int4: every byte, low nibble first, `q - 8`.
    let spec = QuantSpec::new(Codes::I8, [1, 1], None);
    let codes = host(HostBuffer::I8((0..=255u8).map(|b| b as i8).collect()), &[256, 1]);
    let w = vals::<f32>(&run(Op::Dequantize(spec), &[&codes, &f32s(&[1.0; 256], &[256, 1])]));
    for (b, g) in w.iter().enumerate() {
        assert_eq!(*g, b as u8 as i8 as f32, "int8 code {b:#x}");
    }
    let spec = QuantSpec::new(Codes::I4, [1, 2], None);
    let packed: Vec<u8> = (0..=255).collect();
    let w = vals::<f32>(&run(Op::Dequantize(spec), &[&t(packed, &[256, 1]), &f32s(&[0.5; 256], &[256, 1])]));
    for b in 0..256usize {
        for (k, n) in [b & 0xF, b >> 4].into_iter().enumerate() {
            assert_eq!(w[2 * b + k], (n as f32 - 8.0) * 0.5, "int4 byte {b:#x}, nibble {k}");
        }
    }
    // E8M0 scales: every exponent (0 is 2^-127, 255 NaN), times code 1.0 (0x2 | 0x2 << 4).
    let spec = QuantSpec::new(Codes::E2M1, [1, 2], None);
    let scales = t((0..=255u8).collect::<Vec<_>>(), &[256, 1]);
    let w = vals::<f32>(&run(Op::Dequantize(spec), &[&t(vec![0x22u8; 256], &[256, 1]), &scales]));
    for e in 0..256usize {
        let want = e8m0(e as u8);
        assert!(w[2 * e].to_bits() == want.to_bits() || (want.is_nan() && w[2 * e].is_nan()), "exponent {e}");
    }
}

#[test]
fn the_quantized_product_is_the_dequantized_one() {
    let _off = super::batch_invariance(false);
    let (n, k) = (37, 24);
    let e4 = QuantSpec::new(Codes::E4M3, [16, 8], None);
    let e4_codes = e4m3(&(0..n * k).map(|i| ((i * 7 % 29) as f32 - 14.0) * 0.5).collect::<Vec<_>>(), &[n, k]);
    let i8_codes = host(HostBuffer::I8(bytes(n * k, 4).into_iter().map(|b| b as i8).collect()), &[n, k]);
    let i4_codes = t(bytes(n * k / 2, 5), &[n, k / 2]);
    let with = |codes: Codes| QuantSpec { codes, ..e4.clone() };
    for (spec, codes) in [(e4.clone(), e4_codes), (with(Codes::I8), i8_codes), (with(Codes::I4), i4_codes)] {
        product_matches_dequantized(&spec, &codes, k);
    }
}

/// `QuantMatMul` with 1, 5 and 12 rows (dot products and the `gemm` tile)
/// against `MatMul` with the dequantized weight.
fn product_matches_dequantized(spec: &QuantSpec, codes: &Tensor, k: usize) {
    let scales = f32s(&(0..9).map(|i| 0.25 + i as f32 * 0.125).collect::<Vec<_>>(), &[3, 3]);
    let w = run(Op::Dequantize(spec.clone()), &[codes, &scales]);
    for m in [1usize, 5, 12] {
        let x = f32s(&(0..m * k).map(|i| ((i * 5 % 17) as f32 - 8.0) * 0.1).collect::<Vec<_>>(), &[m, k]);
        let y = vals::<f32>(&run(Op::QuantMatMul(spec.clone()), &[&x, codes, &scales]));
        let want = vals::<f32>(&run(Op::MatMul, &[&x, &w.t().unwrap()]));
        for (g, w) in y.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-4 * (1.0 + w.abs()), "{:?}, {m} rows: {g} vs {w}", spec.codes);
        }
    }
}

/// Deterministic pseudo-random bytes.
pub(super) fn bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (s >> 40) as u8
        })
        .collect()
}

/// A random quantized weight `n x k` of `spec` with scales of `scale_kind`
/// (`f32`, `e4m3` or `e8m0`): its codes' bytes and tensor, its scales'
/// buffer and tensor. E4M3 codes avoid NaN.
pub(super) struct RandomWeight {
    pub codes: Vec<u8>,
    pub codes_t: Tensor,
    pub scale_buf: HostBuffer,
    pub scales_t: Tensor,
}

impl RandomWeight {
    pub fn new(spec: &QuantSpec, scale_kind: &str, n: usize, k: usize) -> RandomWeight {
        let e4m3_codes = |n: usize| bytes(n, 1).into_iter().map(|b| if b & 0x7F == 0x7F { b ^ 1 } else { b }).collect();
        let [sr, sc] = spec.scales_shape(n, k);
        let (codes, codes_t) = match spec.codes {
            Codes::E4M3 => {
                let c: Vec<u8> = e4m3_codes(n * k);
                (c.clone(), host(HostBuffer::F8E4M3FN(c.into_iter().map(f8e4m3fn::from_bits).collect()), &[n, k]))
            }
            Codes::E2M1 | Codes::I4 => {
                let c = bytes(n * k / 2, 2);
                (c.clone(), t(c, &[n, k / 2]))
            }
            Codes::I8 => {
                let c = bytes(n * k, 2);
                (c.clone(), host(HostBuffer::I8(c.into_iter().map(|b| b as i8).collect()), &[n, k]))
            }
        };
        let sv = bytes(sr * sc, 3);
        let (scale_buf, scales_t) = match scale_kind {
            "f32" => {
                let v: Vec<f32> = sv.iter().map(|&b| 0.5 + b as f32 / 128.0).collect();
                (HostBuffer::F32(v.clone()), f32s(&v, &[sr, sc]))
            }
            // E4M3 scales between 2^-3 and 2^4 (exponent field 4..11), E8M0 around 1.
            "e4m3" => {
                let v: Vec<f8e4m3fn> = sv.iter().map(|&b| f8e4m3fn::from_bits(0x20 + b % 0x40)).collect();
                (HostBuffer::F8E4M3FN(v.clone()), host(HostBuffer::F8E4M3FN(v), &[sr, sc]))
            }
            _ => {
                let v: Vec<u8> = sv.iter().map(|&b| 120 + b % 16).collect();
                (HostBuffer::U8(v.clone()), t(v, &[sr, sc]))
            }
        };
        RandomWeight { codes, codes_t, scale_buf, scales_t }
    }
}

/// Note [Codes decoded in the registers]: with wide steps and without, for
/// each format and scale type, against the f64 sums over the dequantized
/// weight: depths with and without a remainder after the wide and the
/// 16-element steps, partial blocks of rows and columns, 1 to 7 rows.
#[test]
fn codes_decoded_in_the_registers_are_the_dequantized_weight() {
    use crate::kernels::quant::Scales;
    use crate::kernels::quant_rowdot::{applies, QuantRowDot};
    use kiln_tensor::Layout;
    for (spec, scale_kind) in [
        (QuantSpec::new(Codes::E4M3, [128, 128], None), "f32"),
        (QuantSpec::new(Codes::E4M3, [3, 48], None), "f32"),
        (QuantSpec::new(Codes::E4M3, [1, 1000], None), "f32"),
        (QuantSpec::new(Codes::E2M1, [1, 16], Some(Global::Mul(0.75))), "e4m3"),
        (QuantSpec::new(Codes::E2M1, [1, 32], None), "e8m0"),
        (QuantSpec::new(Codes::I8, [1, 32], None), "f32"),
        (QuantSpec::new(Codes::I4, [1, 32], None), "f32"),
    ] {
        for &(n, k) in &[(37usize, 336usize), (9, 330), (5, 64), (6, 16), (4, 10)] {
            if !applies(&spec, k) {
                // Only the wide blocks of 1000 columns wider than some depths stay out.
                assert!(spec.block[1] % 16 != 0 && spec.block[1] < k, "{spec:?}, k {k}");
                continue;
            }
            let RandomWeight { codes, codes_t, scale_buf, scales_t } = RandomWeight::new(&spec, scale_kind, n, k);
            let [sr, sc] = spec.scales_shape(n, k);
            let w = vals::<f32>(&run(Op::Dequantize(spec.clone()), &[&codes_t, &scales_t]));
            let layout = Layout::contiguous(&[sr, sc]);
            let scales = Scales::new(&crate::kernels::Input { buf: &scale_buf, layout: &layout }, spec.global).unwrap();
            for m in [1usize, 4, 5, 7] {
                let x = noise(m * k, (m * k) as u64);
                let job = QuantRowDot { spec: &spec, codes: &codes, scales: &scales, x: &x, m, n, k };
                let wide =
                    [false, true].into_iter().filter(|&w| !w || std::arch::is_x86_feature_detected!("avx512vbmi"));
                for wide in wide {
                    let mut out = vec![f32::NAN; m * n];
                    job.run_steps(wide, &mut out);
                    for i in 0..m {
                        for j in 0..n {
                            let terms = (0..k).map(|p| x[i * k + p] as f64 * w[j * k + p] as f64);
                            let (want, abs) = terms.fold((0.0, 0.0), |(s, a), t| (s + t, a + t.abs()));
                            // k f32 roundings of the running sums, each within 2^-24 of `abs`.
                            let bound = k as f64 * 2f64.powi(-24) * abs;
                            let got = out[i * n + j] as f64;
                            assert!(
                                (got - want).abs() <= bound,
                                "{spec:?}, wide {wide}, k {k}, n {n}, m {m}, ({i}, {j}): {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// An E4M3 NaN code (0x7F, 0xFF) makes its output NaN, in a wide step, a
/// 16-element step and the remainder alike; the other columns stay finite.
#[test]
fn nan_codes_give_nan_products() {
    let _off = super::batch_invariance(false);
    let (n, k) = (4usize, 90usize);
    let spec = QuantSpec::new(Codes::E4M3, [1, 16], None);
    let mut c = vec![0x38u8; n * k];
    c[k + 5] = 0x7F;
    c[2 * k + 70] = 0xFF;
    c[3 * k + 88] = 0x7F;
    let codes = host(HostBuffer::F8E4M3FN(c.into_iter().map(f8e4m3fn::from_bits).collect()), &[n, k]);
    let scales = f32s(&vec![1.0; n * 6], &[n, 6]);
    let y = vals::<f32>(&run(Op::QuantMatMul(spec), &[&f32s(&noise(k, 9), &[1, k]), &codes, &scales]));
    assert!(y[0].is_finite() && y[1..].iter().all(|v| v.is_nan()), "{y:?}");
}
