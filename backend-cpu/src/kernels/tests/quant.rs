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
    let spec = QuantSpec { codes: Codes::E4M3, block: [2, 4], global: None };
    let codes = e4m3(&(0..15).map(|i| i as f32).collect::<Vec<_>>(), &[3, 5]);
    let scales = f32s(&[1.0, 10.0, 100.0, 1000.0], &[2, 2]);
    let w = run(Op::Dequantize(spec), &[&codes, &scales]);
    assert_eq!(
        vals::<f32>(&w),
        [0.0, 1.0, 2.0, 3.0, 40.0, 5.0, 6.0, 7.0, 8.0, 90.0, 1000.0, 1100.0, 1200.0, 1300.0, 14000.0]
    );
    // NVFP4 [1, 4] in groups of 2, the global dividing: effective scales 8/4 and 2/4.
    let spec = QuantSpec { codes: Codes::E2M1, block: [1, 2], global: Some(Global::Div(4.0)) };
    let w = run(Op::Dequantize(spec), &[&t(vec![0x72u8, 0xA1], &[1, 2]), &f32s(&[8.0, 2.0], &[1, 2])]);
    assert_eq!(vals::<f32>(&w), [2.0, 12.0, 0.25, -0.5]);
}

#[test]
fn every_code_decodes() {
    // E2M1: every byte, low nibble first; bit 3 of a nibble is the sign (code 8 is -0.0).
    let spec = QuantSpec { codes: Codes::E2M1, block: [1, 2], global: None };
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
    let spec = QuantSpec { codes: Codes::E4M3, block: [1, 1], global: None };
    let codes = host(HostBuffer::F8E4M3FN((0..=255).map(f8e4m3fn::from_bits).collect()), &[256, 1]);
    let w = vals::<f32>(&run(Op::Dequantize(spec), &[&codes, &f32s(&[1.0; 256], &[256, 1])]));
    for (c, g) in w.iter().enumerate() {
        let want = f8e4m3fn::from_bits(c as u8).to_f32();
        assert!(g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()), "code {c:#x}: {g} vs {want}");
    }
    // E8M0 scales: every exponent (0 is 2^-127, 255 NaN), times code 1.0 (0x2 | 0x2 << 4).
    let spec = QuantSpec { codes: Codes::E2M1, block: [1, 2], global: None };
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
    let spec = QuantSpec { codes: Codes::E4M3, block: [16, 8], global: None };
    let (n, k) = (37, 24);
    let codes = e4m3(&(0..n * k).map(|i| ((i * 7 % 29) as f32 - 14.0) * 0.5).collect::<Vec<_>>(), &[n, k]);
    let scales = f32s(&(0..9).map(|i| 0.25 + i as f32 * 0.125).collect::<Vec<_>>(), &[3, 3]);
    let w = run(Op::Dequantize(spec.clone()), &[&codes, &scales]);
    for m in [1usize, 5, 12] {
        let x = f32s(&(0..m * k).map(|i| ((i * 5 % 17) as f32 - 8.0) * 0.1).collect::<Vec<_>>(), &[m, k]);
        let y = vals::<f32>(&run(Op::QuantMatMul(spec.clone()), &[&x, &codes, &scales]));
        let want = vals::<f32>(&run(Op::MatMul, &[&x, &w.t().unwrap()]));
        for (g, w) in y.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-4 * (1.0 + w.abs()), "{m} rows: {g} vs {w}");
        }
    }
}
