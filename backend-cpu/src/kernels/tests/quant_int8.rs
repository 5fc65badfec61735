//! Quantized products with int8 activations (Note [Int8 activations]): the
//! integer products against f64 sums over the rounded rows, and every path
//! of `Op::QuantMatMul` against the float product of the rounded rows.
use super::quant::RandomWeight;
use super::*;
use crate::kernels::quant::Scales;
use crate::kernels::quant_int8::{applies, Int8Dot, Int8Rows};
use kiln_tensor::quant::{round_activation_block, Activations, Codes, Global, QuantSpec, ACTIVATION_BLOCK};
use kiln_tensor::{DType, Layout};

/// The f64 sums of `x` (rows `m x k`) times `w` (rows `n x k`), and of their
/// magnitudes.
fn exact(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<(f64, f64)> {
    let mut out = vec![];
    for i in 0..m {
        for j in 0..n {
            let terms = (0..k).map(|p| x[i * k + p] as f64 * w[j * k + p] as f64);
            out.push(terms.fold((0.0, 0.0), |(s, a), t| (s + t, a + t.abs())));
        }
    }
    out
}

/// `x` rounded as the Note says, through the one rounding function, row by row.
fn rounded(x: &[f32], k: usize) -> Vec<f32> {
    let mut out = vec![];
    for row in x.chunks_exact(k) {
        for b in row.chunks(ACTIVATION_BLOCK) {
            let mut q = vec![0i8; b.len()];
            let d = round_activation_block(b, &mut q);
            out.extend(q.iter().map(|&q| q as f32 * d));
        }
    }
    out
}

/// Note [Integer products of int8 activations]: for each integer format,
/// scale type and block width the integer products serve (narrower than a
/// step, one step, several, wider than the depth), against the f64 sums of
/// the rounded rows times the dequantized weight; depths with and without a
/// partial step and a partial block of `x`; 1 to 7 rows; tile edges of W.
#[test]
fn integer_products_are_the_rounded_rows_times_the_weight() {
    let specs = [
        (QuantSpec::new(Codes::I4, [1, 32], None), "f32"),
        (QuantSpec::new(Codes::I8, [1, 32], None), "f32"),
        (QuantSpec::new(Codes::E2M1, [1, 16], Some(Global::Mul(0.75))), "e4m3"),
        (QuantSpec::new(Codes::E2M1, [1, 32], None), "e8m0"),
        (QuantSpec::new(Codes::I8, [3, 4], None), "f32"),
        (QuantSpec::new(Codes::I4, [2, 8], None), "f32"),
        (QuantSpec::new(Codes::I8, [1, 128], None), "f32"),
        (QuantSpec::new(Codes::I4, [1, 64], None), "f32"),
        (QuantSpec::new(Codes::I8, [1, 1000], None), "f32"),
    ];
    if !applies(&specs[0].0, 64) {
        // Not this CPU: the rounded rows take the float products, which
        // `every_path_computes_the_product_of_the_rounded_rows` checks.
        assert!(!std::arch::is_x86_feature_detected!("avx512vnni") || std::env::var_os("KILN_CPU_BASELINE").is_some());
        return;
    }
    for (spec, scale_kind) in specs {
        for &(n, k) in &[(37usize, 336usize), (9, 330), (5, 64), (6, 16), (4, 10), (8, 1000)] {
            if !applies(&spec, k) {
                // Blocks of 1000 columns narrower than the depth.
                assert!(spec.block[1] == 1000 && k > 1000, "{spec:?}, k {k}");
                continue;
            }
            let weight = RandomWeight::new(&spec, scale_kind, n, k);
            let w = vals::<f32>(&run(Op::Dequantize(spec.clone()), &[&weight.codes_t, &weight.scales_t]));
            let layout = Layout::contiguous(&spec.scales_shape(n, k));
            let input = crate::kernels::Input { buf: &weight.scale_buf, layout: &layout };
            let scales = Scales::new(&input, spec.global).unwrap();
            for m in [1usize, 4, 5, 7] {
                // Rows of mixed magnitudes, so blocks get different scales.
                let x: Vec<f32> =
                    noise(m * k, (m * k) as u64).iter().enumerate().map(|(e, v)| v * (1 + e % 7) as f32).collect();
                let rows = Int8Rows::round(&x, m, k);
                let mut out = vec![f32::NAN; m * n];
                Int8Dot { spec: &spec, codes: &weight.codes, scales: &scales, x: &rows, n }.run(&mut out);
                let xr = rounded(&x, k);
                assert_eq!(rows.values(), xr, "the rows the products use are the Note's rounding");
                for (e, (want, abs)) in exact(&xr, &w, m, n, k).into_iter().enumerate() {
                    // Each lane's sum is exact; one rounding scales it, one adds it to
                    // an accumulator per step (k / 64 + 1), four add the lanes; the
                    // dequantized weight and the rounded row differ from the exact
                    // code times scale by one rounding each: at most k + 8 roundings.
                    let bound = (k + 8) as f64 * 2f64.powi(-24) * abs;
                    let got = out[e] as f64;
                    assert!(
                        (got - want).abs() <= bound,
                        "{spec:?}, k {k}, n {n}, m {m}, output {e}: {got} vs {want} (bound {bound})"
                    );
                }
            }
        }
    }
}

/// `Op::QuantMatMul` with `Activations::Int8`, for 1, 5 and 12 rows (integer
/// products, float products of a few rows, the `gemm` tile), each integer
/// format and FP8 (float products only), float32 and bfloat16 inputs,
/// against `MatMul` of the rounded rows and the dequantized weight; and the
/// rounding is not a no-op: the exact product differs.
#[test]
fn every_path_computes_the_product_of_the_rounded_rows() {
    let _off = batch_invariance(false);
    let (n, k) = (20usize, 200usize);
    for (spec, scale_kind) in [
        (QuantSpec::new(Codes::I4, [1, 32], None), "f32"),
        (QuantSpec::new(Codes::I8, [1, 32], None), "f32"),
        (QuantSpec::new(Codes::E2M1, [1, 32], None), "e8m0"),
        (QuantSpec::new(Codes::E4M3, [1, 16], None), "f32"),
        (QuantSpec::new(Codes::I4, [1, 2], None), "f32"),
    ] {
        let weight = RandomWeight::new(&spec, scale_kind, n, k);
        let int8 = spec.clone().with_activations(Activations::Int8);
        let w = vals::<f32>(&run(Op::Dequantize(spec.clone()), &[&weight.codes_t, &weight.scales_t]));
        for m in [1usize, 5, 12] {
            for dtype in [DType::F32, DType::BF16] {
                let x = f32s(&noise(m * k, 7 + m as u64), &[m, k]).to_dtype(dtype).unwrap();
                let xf = vals::<f32>(&x.to_dtype(DType::F32).unwrap());
                let y = run(Op::QuantMatMul(int8.clone()), &[&x, &weight.codes_t, &weight.scales_t]);
                let y = vals::<f32>(&y.to_dtype(DType::F32).unwrap());
                let exact_y = vals::<f32>(&run(
                    Op::QuantMatMul(spec.clone()),
                    &[&f32s(&xf, &[m, k]), &weight.codes_t, &weight.scales_t],
                ));
                let mut moved = false;
                for (e, ((want, abs), (&got, &ex))) in
                    exact(&rounded(&xf, k), &w, m, n, k).into_iter().zip(y.iter().zip(&exact_y)).enumerate()
                {
                    // k + 8 roundings of the float32 sums (above), and for bfloat16
                    // one rounding of the result to 8 significant bits.
                    let ulp = if dtype == DType::BF16 { 2f64.powi(-8) * want.abs() } else { 0.0 };
                    let bound = (k + 8) as f64 * 2f64.powi(-24) * abs + ulp;
                    assert!(
                        ((got as f64) - want).abs() <= bound,
                        "{spec:?} {dtype}, {m} rows, output {e}: {got} vs {want}"
                    );
                    moved |= ((ex as f64) - want).abs() > bound;
                }
                assert!(moved, "{spec:?} {dtype}, {m} rows: the rounding changed no output");
            }
        }
    }
}

/// A block whose largest magnitude is not finite makes the outputs NaN (the
/// integer products cannot hold it); a block of zeros is 0, not NaN.
#[test]
fn non_finite_rows_give_nan_and_zero_rows_zero() {
    let _off = batch_invariance(false);
    let (n, k) = (4usize, 128usize);
    let spec = QuantSpec::new(Codes::I4, [1, 32], None).with_activations(Activations::Int8);
    let weight = RandomWeight::new(&spec, "f32", n, k);
    let mut x = vec![0f32; 3 * k];
    x[k + 40] = f32::INFINITY;
    x[2 * k + 100] = f32::NAN;
    let y = vals::<f32>(&run(Op::QuantMatMul(spec), &[&f32s(&x, &[3, k]), &weight.codes_t, &weight.scales_t]));
    assert!(y[..n].iter().all(|&v| v == 0.0), "{y:?}");
    assert!(y[n..].iter().all(|v| v.is_nan()), "{y:?}");
}

/// A product over no columns is zeros on every path, with int8 activations
/// and without.
#[test]
fn products_of_zero_depth_are_zeros() {
    let _off = batch_invariance(false);
    for spec in [QuantSpec::new(Codes::I8, [1, 32], None), QuantSpec::new(Codes::E4M3, [1, 32], None)] {
        let codes = RandomWeight::new(&spec, "f32", 3, 0);
        for activations in [Activations::Exact, Activations::Int8] {
            let spec = spec.clone().with_activations(activations);
            for m in [1usize, 12] {
                let x = f32s(&[], &[m, 0]);
                let y = vals::<f32>(&run(Op::QuantMatMul(spec.clone()), &[&x, &codes.codes_t, &codes.scales_t]));
                assert_eq!(y, vec![0.0; m * 3], "{spec:?}, {m} rows");
            }
        }
    }
}
