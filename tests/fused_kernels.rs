//! Fused kernels against the op-by-op definitions they replace, on every
//! registered device. Scaled dot-product attention against its definition (matmul, mask,
//! softmax, matmul) on every registered device: values, gradients (first and
//! second order), grouped-query heads, causal masks with a KV-cache offset,
//! strided inputs, half precision and errors; and the fused rotary embedding
//! against transformers' unfused expression; the fused cross-entropy gradient
//! against the differentiable composite used under `create_graph`; fused RMS
//! normalisation against its expression.
mod common;
use kiln::autograd::{gradcheck, GradcheckOptions};
use kiln::prelude::*;
use kiln::tensor::Op;

/// Every device, the PJRT one in each of its modes (see `common::devices_in_every_mode`).
fn devices() -> impl Iterator<Item = Device> {
    common::devices_in_every_mode()
}

use common::ramp as input;

/// The definition, with key/value heads repeated for grouped-query attention.
fn reference(q: &Tensor, k: &Tensor, v: &Tensor, causal: bool, scale: f64) -> Result<Tensor> {
    let (b, h, t) = (q.shape()[0], q.shape()[1], q.shape()[2]);
    let (hk, s) = (k.shape()[1], k.shape()[2]);
    let rep = |x: &Tensor| -> Result<Tensor> {
        let c = x.shape()[3];
        x.unsqueeze(2)?.broadcast_to(&[b, hk, h / hk, s, c])?.reshape(&[b as isize, h as isize, s as isize, c as isize])
    };
    let z = q.matmul(&rep(k)?.transpose(-1, -2)?)?.mul(scale)?;
    let z = if causal {
        let hide: Vec<bool> = (0..t).flat_map(|i| (0..s).map(move |j| j + t > i + s)).collect();
        z.masked_fill(&Tensor::from_vec(hide, &[t, s])?.to_device(q.device())?, f64::NEG_INFINITY)?
    } else {
        z
    };
    z.softmax(-1)?.matmul(&rep(v)?)
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.shape(), b.shape());
    let (a, b) = (a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
    a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

/// `(B, H, Hk, T, S, D, Dv)`: plain, grouped-query, decode-like, a KV-cache
/// offset, and query/key counts that cross the kernel's 64-row blocks.
const CASES: [(usize, usize, usize, usize, usize, usize, usize); 6] = [
    (1, 1, 1, 4, 4, 3, 3),
    (2, 4, 2, 5, 5, 3, 2),
    (1, 3, 1, 1, 6, 4, 4),
    (2, 2, 2, 3, 7, 2, 5),
    (1, 2, 1, 70, 70, 8, 8),
    (1, 1, 1, 65, 130, 4, 3),
];

#[test]
fn forward_matches_the_definition() {
    for dev in devices() {
        for (ci, &(b, h, hk, t, s, d, dv)) in CASES.iter().enumerate() {
            for causal in [false, true] {
                for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 2e-5)] {
                    let q = input(&[b, h, t, d], 1 + ci as u64, dtype, dev);
                    let k = input(&[b, hk, s, d], 2 + ci as u64, dtype, dev);
                    let v = input(&[b, hk, s, dv], 3 + ci as u64, dtype, dev);
                    let scale = 0.7;
                    let out = q.scaled_dot_product_attention(&k, &v, causal, Some(scale)).unwrap();
                    assert_eq!(out.shape(), [b, h, t, dv]);
                    let want = reference(
                        &q.to_dtype(DType::F64).unwrap(),
                        &k.to_dtype(DType::F64).unwrap(),
                        &v.to_dtype(DType::F64).unwrap(),
                        causal,
                        scale,
                    )
                    .unwrap();
                    let diff = max_diff(&out, &want);
                    assert!(diff < tol, "case {ci} causal {causal} {dtype}: max diff {diff}");
                }
            }
        }
    }
}

#[test]
fn strided_inputs_and_default_scale() {
    for dev in devices() {
        // Heads taken from [B, T, H, D] projections by a transpose, as a model does.
        let q = input(&[2, 6, 3, 4], 7, DType::F64, dev).transpose(1, 2).unwrap();
        let k = input(&[2, 6, 3, 4], 8, DType::F64, dev).transpose(1, 2).unwrap();
        let v = input(&[2, 6, 3, 5], 9, DType::F64, dev).transpose(1, 2).unwrap();
        assert!(!q.is_contiguous());
        let out = q.scaled_dot_product_attention(&k, &v, true, None).unwrap();
        let want = reference(&q, &k, &v, true, 0.5).unwrap();
        assert!(max_diff(&out, &want) < 1e-12);
        // 3-D inputs are one batch.
        let out3 = q
            .select(0, 1)
            .unwrap()
            .scaled_dot_product_attention(&k.select(0, 1).unwrap(), &v.select(0, 1).unwrap(), true, None)
            .unwrap();
        assert!(max_diff(&out3, &want.select(0, 1).unwrap()) < 1e-12);
    }
}

#[test]
fn gradients_match_the_definition() {
    for dev in devices() {
        for (ci, &(b, h, hk, t, s, d, dv)) in CASES.iter().enumerate() {
            for causal in [false, true] {
                let leaf = |shape: &[usize], seed: u64| {
                    input(shape, seed, DType::F64, dev).requires_grad_(true).unwrap().clone()
                };
                let (q, k, v) = (leaf(&[b, h, t, d], 11), leaf(&[b, hk, s, d], 12), leaf(&[b, hk, s, dv], 13));
                let w = input(&[b, h, t, dv], 14, DType::F64, dev);
                let fused =
                    q.scaled_dot_product_attention(&k, &v, causal, Some(0.6)).unwrap().mul(&w).unwrap().sum().unwrap();
                let g1 = kiln::autograd::grad(&[&fused], &[&q, &k, &v], None, false, false).unwrap();
                let refd = reference(&q, &k, &v, causal, 0.6).unwrap().mul(&w).unwrap().sum().unwrap();
                let g2 = kiln::autograd::grad(&[&refd], &[&q, &k, &v], None, false, false).unwrap();
                for (i, (a, r)) in g1.iter().zip(&g2).enumerate() {
                    let diff = max_diff(a.as_ref().unwrap(), r.as_ref().unwrap());
                    assert!(diff < 1e-10, "case {ci} causal {causal}: gradient {i} differs by {diff}");
                }
            }
        }
    }
}

#[test]
fn finite_differences_first_and_second_order() {
    for dev in devices() {
        let q = input(&[1, 2, 3, 2], 21, DType::F64, dev);
        let k = input(&[1, 1, 4, 2], 22, DType::F64, dev);
        let v = input(&[1, 1, 4, 3], 23, DType::F64, dev);
        let f = |t: &[Tensor]| t[0].scaled_dot_product_attention(&t[1], &t[2], true, None);
        gradcheck(f, &[q.clone(), k.clone(), v.clone()], GradcheckOptions::default()).unwrap();
        // Second order: the gradient of q (built with create_graph) differentiated again.
        let dq = |t: &[Tensor]| -> Result<Tensor> {
            let _on = kiln::autograd::enable_grad();
            let leaf = |x: &Tensor| -> Result<Tensor> {
                Ok(if x.requires_grad() { x.clone() } else { x.detach().requires_grad_(true)?.clone() })
            };
            let (q, k, v) = (leaf(&t[0])?, leaf(&t[1])?, leaf(&t[2])?);
            let y = q.scaled_dot_product_attention(&k, &v, true, None)?.mul(&v.sum()?)?.sum()?;
            Ok(kiln::autograd::grad(&[&y], &[&q], None, true, true)?[0].clone().expect("a gradient"))
        };
        gradcheck(dq, &[q, k, v], GradcheckOptions::default()).unwrap();
    }
}

#[test]
fn the_primitive_differentiates_its_log_sum_exp() {
    for dev in devices() {
        let leaf =
            |shape: &[usize], seed: u64| input(shape, seed, DType::F64, dev).requires_grad_(true).unwrap().clone();
        let (q, k, v) = (leaf(&[1, 2, 3, 2], 31), leaf(&[1, 2, 5, 2], 32), leaf(&[1, 2, 5, 2], 33));
        let outs = Tensor::apply(Op::Attention { scale: 0.5, causal: true }, &[&q, &k, &v]).unwrap();
        assert_eq!(outs[1].shape(), [1, 2, 3]);
        assert_eq!(outs[1].dtype(), DType::F64);
        let loss = outs[0].sum().unwrap().add(&outs[1].mul(2.0).unwrap().sum().unwrap()).unwrap();
        let g = kiln::autograd::grad(&[&loss], &[&q, &k, &v], None, false, false).unwrap();
        // The same from the definition: lse = logsumexp of the masked, scaled scores.
        let z = q.matmul(&k.transpose(-1, -2).unwrap()).unwrap().mul(0.5).unwrap();
        let hide: Vec<bool> = (0..3).flat_map(|i| (0..5).map(move |j| j > i + 2)).collect();
        let z = z
            .masked_fill(&Tensor::from_vec(hide, &[3, 5]).unwrap().to_device(dev).unwrap(), f64::NEG_INFINITY)
            .unwrap();
        let lse = z.logsumexp(-1, false).unwrap();
        assert!(max_diff(&outs[1], &lse) < 1e-12);
        let want = reference(&q, &k, &v, true, 0.5)
            .unwrap()
            .sum()
            .unwrap()
            .add(&lse.mul(2.0).unwrap().sum().unwrap())
            .unwrap();
        let gw = kiln::autograd::grad(&[&want], &[&q, &k, &v], None, false, false).unwrap();
        for (a, b) in g.iter().zip(&gw) {
            assert!(max_diff(a.as_ref().unwrap(), b.as_ref().unwrap()) < 1e-10);
        }
    }
}

/// bf16 attention and its gradients against the definition in float64 on the
/// same bf16 values, for every shape of `CASES` (grouped heads, a KV offset,
/// query blocks crossed), with and without the causal mask, each error relative
/// to the largest magnitude of its result. The bounds are 1.5x the largest
/// errors measured (out, dq, dk, dv): 0.0046, 0.044, 0.0080, 0.0064 on the
/// CPU's tile way (probabilities and score gradients rounded to bf16, Note
/// [Attention on tiles]); 0.0028, 0.034, 0.0058, 0.0044 widened to float32
/// (`KILN_CPU_AMX=0`, and the PJRT backend). dq's error is the largest: its
/// sums cancel (case 4).
#[test]
fn bf16_values_and_gradients_match_the_definition() {
    for dev in devices() {
        let bounds = [0.0069, 0.066, 0.012, 0.0096];
        for (ci, &(b, h, hk, t, s, d, dv)) in CASES.iter().enumerate() {
            for causal in [false, true] {
                let leaf = |shape: &[usize], seed: u64| {
                    input(shape, seed, DType::BF16, dev).requires_grad_(true).unwrap().clone()
                };
                let (q, k, v) = (leaf(&[b, h, t, d], 51), leaf(&[b, hk, s, d], 52), leaf(&[b, hk, s, dv], 53));
                let w = input(&[b, h, t, dv], 54, DType::F64, dev);
                let out = q.scaled_dot_product_attention(&k, &v, causal, Some(0.6)).unwrap();
                assert_eq!(out.dtype(), DType::BF16);
                let loss = out.to_dtype(DType::F64).unwrap().mul(&w).unwrap().sum().unwrap();
                let got = kiln::autograd::grad(&[&loss], &[&q, &k, &v], None, false, false).unwrap();
                let f = |x: &Tensor| x.detach().to_dtype(DType::F64).unwrap().requires_grad_(true).unwrap().clone();
                let (q64, k64, v64) = (f(&q), f(&k), f(&v));
                let want = reference(&q64, &k64, &v64, causal, 0.6).unwrap();
                let wl = want.mul(&w).unwrap().sum().unwrap();
                let gw = kiln::autograd::grad(&[&wl], &[&q64, &k64, &v64], None, false, false).unwrap();
                let rel = |a: &Tensor, r: &Tensor| {
                    let top = r.to_vec_f64().unwrap().iter().fold(0f64, |m, x| m.max(x.abs()));
                    max_diff(a, r) / top.max(f64::MIN_POSITIVE)
                };
                let errs = [
                    rel(&out, &want),
                    rel(got[0].as_ref().unwrap(), gw[0].as_ref().unwrap()),
                    rel(got[1].as_ref().unwrap(), gw[1].as_ref().unwrap()),
                    rel(got[2].as_ref().unwrap(), gw[2].as_ref().unwrap()),
                ];
                for (i, (e, bound)) in errs.iter().zip(bounds).enumerate() {
                    assert!(*e <= bound, "{dev} case {ci} causal {causal}: result {i} off by {e} (relative)");
                }
            }
        }
    }
}

#[test]
fn half_precision_computes_in_float32() {
    for dev in devices() {
        for dt in [DType::BF16, DType::F16] {
            let q = input(&[1, 2, 9, 8], 41, dt, dev);
            let k = input(&[1, 2, 9, 8], 42, dt, dev);
            let v = input(&[1, 2, 9, 8], 43, dt, dev);
            let out = q.scaled_dot_product_attention(&k, &v, true, None).unwrap();
            assert_eq!(out.dtype(), dt);
            let f = |x: &Tensor| x.to_dtype(DType::F64).unwrap();
            let want = reference(&f(&q), &f(&k), &f(&v), true, 1.0 / 8f64.sqrt()).unwrap();
            // One rounding of the result (values below 2 in magnitude).
            let tol = if dt == DType::BF16 { 2.0 * 2f64.powi(-8) } else { 2.0 * 2f64.powi(-11) };
            assert!(max_diff(&out, &want) <= tol, "{dt}: {}", max_diff(&out, &want));
        }
    }
}

#[test]
fn bad_inputs_are_clear_errors() {
    for dev in devices() {
        let t = |shape: &[usize]| input(shape, 1, DType::F32, dev);
        let msg = |r: Result<Tensor>| r.unwrap_err().to_string();
        let e = msg(t(&[1, 3, 4, 2]).scaled_dot_product_attention(&t(&[1, 2, 4, 2]), &t(&[1, 2, 4, 2]), false, None));
        assert!(e.contains("H a multiple of Hk") && e.contains("[1, 3, 4, 2]"), "{e}");
        let e = msg(t(&[1, 1, 4, 2]).scaled_dot_product_attention(&t(&[1, 1, 4, 3]), &t(&[1, 1, 4, 2]), false, None));
        assert!(e.contains("scaled_dot_product_attention"), "{e}");
        let e = msg(t(&[1, 1, 5, 2]).scaled_dot_product_attention(&t(&[1, 1, 4, 2]), &t(&[1, 1, 4, 2]), true, None));
        assert!(e.contains("causal") && e.contains("T = 5") && e.contains("S = 4"), "{e}");
        let e = msg(t(&[1, 1, 4, 2]).scaled_dot_product_attention(
            &t(&[1, 1, 4, 2]).to_dtype(DType::F64).unwrap(),
            &t(&[1, 1, 4, 2]),
            false,
            None,
        ));
        assert!(e.contains("same dtype"), "{e}");
        let i = t(&[1, 1, 4, 2]).to_dtype(DType::I64).unwrap();
        let e = msg(i.scaled_dot_product_attention(&i, &i, false, None));
        assert!(e.contains("floating point"), "{e}");
        let e = msg(t(&[4, 2]).scaled_dot_product_attention(&t(&[4, 2]), &t(&[4, 2]), false, None));
        assert!(e.contains("[B, H, T, D]"), "{e}");
    }
}

/// transformers' `x * cos + rotate_half(x) * sin`, op by op.
fn rotary_reference(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let h = (x.dim_size(-1)? / 2) as isize;
    let half = h as usize;
    let rot = Tensor::cat(&[&x.narrow(-1, h, half)?.neg()?, &x.narrow(-1, 0, half)?], -1)?;
    x.mul(cos)?.add(&rot.mul(sin)?)
}

#[test]
fn rotary_embedding_matches_the_unfused_expression() {
    for dev in devices() {
        // 30 rows, and 420 rows in several of the kernel's blocks of rows.
        for (dt, (t, d)) in
            [DType::F64, DType::F32, DType::BF16, DType::F16].into_iter().flat_map(|dt| [(dt, (5, 6)), (dt, (70, 8))])
        {
            // A strided input: heads taken from [B, T, H, d] by a transpose.
            let x = input(&[2, t, 3, d], 51, dt, dev).transpose(1, 2).unwrap();
            let cos = input(&[t, d], 52, dt, dev);
            let sin = input(&[t, d], 53, dt, dev);
            let got = x.rotary_embedding(&cos, &sin).unwrap();
            let want = rotary_reference(&x, &cos, &sin).unwrap();
            assert_eq!(got.shape(), [2, 3, t, d]);
            if dev.kind() == kiln::DeviceKind::Tpu && kiln::tpu::mode() == kiln::tpu::Mode::Defer {
                // Under DeferAndFuse the unfused reference itself is fused, and XLA may
                // contract its products and sum into fused multiply-adds: one rounding fewer.
                let (g, w) = (got.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
                let ulp = if dt == DType::F64 {
                    1e-15
                } else if dt == DType::F32 {
                    1e-6
                } else {
                    1e-2
                };
                assert!(g.iter().zip(&w).all(|(a, b)| (a - b).abs() <= ulp * (1.0 + b.abs())), "{dt}");
            } else {
                // The same products and sum, rounded the same way: identical bits.
                assert_eq!(got.to_vec_f64().unwrap(), want.to_vec_f64().unwrap(), "{dt}");
            }
        }
        let x = input(&[2, 3, 4], 54, DType::F64, dev);
        let (cos, sin) = (input(&[3, 4], 55, DType::F64, dev), input(&[3, 4], 56, DType::F64, dev));
        let f = |t: &[Tensor]| t[0].rotary_embedding(&t[1], &t[2]);
        gradcheck(f, &[x.clone(), cos.clone(), sin.clone()], GradcheckOptions::default()).unwrap();
        let e = x.rotary_embedding(&cos.narrow(0, 0, 2).unwrap(), &sin).unwrap_err().to_string();
        assert!(e.contains("rotary_embedding") && e.contains("cos, sin [T, d]"), "{e}");
        let e = input(&[3, 5], 1, DType::F64, dev)
            .rotary_embedding(&input(&[3, 5], 2, DType::F64, dev), &input(&[3, 5], 3, DType::F64, dev))
            .unwrap_err()
            .to_string();
        assert!(e.contains("d even"), "{e}");
    }
}

#[test]
fn fused_cross_entropy_gradient_matches_the_composite() {
    use kiln::tensor::CrossEntropy;
    for dev in devices() {
        for (shape, tshape, targets) in
            [(vec![4, 7], vec![4], vec![0i64, 6, -100, 3]), (vec![2, 5, 3], vec![2, 3], vec![4, 0, -100, 1, 2, 3])]
        {
            for dt in [DType::F64, DType::F32, DType::BF16] {
                for reduction in [Reduction::Mean, Reduction::Sum, Reduction::None] {
                    for label_smoothing in [0.0, 0.3] {
                        let opts = CrossEntropy { ignore_index: Some(-100), reduction, label_smoothing };
                        let x = input(&shape, 61, dt, dev).requires_grad_(true).unwrap().clone();
                        let t = Tensor::from_slice(&targets, &tshape).unwrap().to_device(dev).unwrap();
                        let loss = x.cross_entropy_with(&t, opts).unwrap();
                        let up = input(loss.shape(), 62, loss.dtype(), dev);
                        let y = loss.mul(&up).unwrap().sum().unwrap();
                        // Without create_graph: the fused kernel.
                        let fused = kiln::autograd::grad(&[&y], &[&x], None, true, false).unwrap()[0].clone().unwrap();
                        // With create_graph: the differentiable composite.
                        let comp = kiln::autograd::grad(&[&y], &[&x], None, false, true).unwrap()[0].clone().unwrap();
                        assert_eq!(fused.dtype(), dt);
                        let tol = match dt {
                            DType::F64 => 1e-14,
                            DType::F32 => 1e-6,
                            _ => 1e-2,
                        };
                        let diff = max_diff(&fused, &comp);
                        assert!(diff <= tol, "{shape:?} {dt} {reduction:?} eps {label_smoothing}: {diff}");
                    }
                }
            }
        }
        // Targets are checked by the kernel too.
        let x = input(&[2, 3], 63, DType::F32, dev);
        let bad = Tensor::apply1(
            Op::CrossEntropyBackward { smoothing: 0.0 },
            &[
                &x,
                &Tensor::new([0i64, 3]).unwrap().to_device(dev).unwrap(),
                &Tensor::ones(&[2], DType::F32).unwrap().to_device(dev).unwrap(),
            ],
        );
        assert!(bad.unwrap_err().to_string().contains("out of bounds"));
    }
}

#[test]
fn fused_rms_norm_matches_the_unfused_expression() {
    for dev in devices() {
        for (dt, tol) in [(DType::F64, 1e-14), (DType::F32, 1e-6)] {
            for d in [1usize, 5, 37, 384] {
                let x = input(&[3, 4, d], 71, dt, dev).requires_grad_(true).unwrap().clone();
                let w = input(&[d], 72, dt, dev).requires_grad_(true).unwrap().clone();
                let y = x.rms_norm(Some(&w), 1e-5).unwrap();
                let want = {
                    let r = x.mul(&x).unwrap().mean_dim(-1, true).unwrap().add(1e-5).unwrap().rsqrt().unwrap();
                    x.mul(&r).unwrap().mul(&w).unwrap()
                };
                assert!(max_diff(&y, &want) <= tol, "{dt} d {d}: {}", max_diff(&y, &want));
                let up = input(&[3, 4, d], 73, dt, dev);
                let l1 = y.mul(&up).unwrap().sum().unwrap();
                let l2 = want.mul(&up).unwrap().sum().unwrap();
                let g1 = kiln::autograd::grad(&[&l1], &[&x, &w], None, false, false).unwrap();
                let g2 = kiln::autograd::grad(&[&l2], &[&x, &w], None, false, false).unwrap();
                for (a, b) in g1.iter().zip(&g2) {
                    let (a, b) = (a.as_ref().unwrap(), b.as_ref().unwrap());
                    assert!(max_diff(a, b) <= tol * 100.0, "{dt} d {d}: gradient differs by {}", max_diff(a, b));
                }
            }
        }
        // First and second order by finite differences (the second through create_graph's composite).
        let x = input(&[2, 3], 74, DType::F64, dev);
        let w = input(&[3], 75, DType::F64, dev);
        gradcheck(
            |t: &[Tensor]| t[0].rms_norm(Some(&t[1]), 1e-5),
            &[x.clone(), w.clone()],
            GradcheckOptions::default(),
        )
        .unwrap();
        gradcheck(|t: &[Tensor]| t[0].rms_norm(None, 1e-5), std::slice::from_ref(&x), GradcheckOptions::default())
            .unwrap();
        let dx = |t: &[Tensor]| -> Result<Tensor> {
            let _on = kiln::autograd::enable_grad();
            let x = if t[0].requires_grad() { t[0].clone() } else { t[0].detach().requires_grad_(true)?.clone() };
            let y = x.rms_norm(Some(&t[1]), 1e-5)?.mul(&x)?.sum()?;
            Ok(kiln::autograd::grad(&[&y], &[&x], None, true, true)?[0].clone().expect("a gradient"))
        };
        gradcheck(dx, &[x, w], GradcheckOptions::default()).unwrap();
    }
}

#[test]
fn silu_mul_matches_silu_times() {
    for dev in devices() {
        for dt in [DType::F64, DType::F32] {
            let a = input(&[3, 33], 81, dt, dev);
            let b = input(&[3, 33], 82, dt, dev);
            // The same operations in the same order: identical bits.
            assert_eq!(
                a.silu_mul(&b).unwrap().to_vec_f64().unwrap(),
                a.silu().unwrap().mul(&b).unwrap().to_vec_f64().unwrap()
            );
        }
        let a = input(&[2, 5], 83, DType::BF16, dev);
        let b = input(&[2, 5], 84, DType::BF16, dev);
        let f = |x: &Tensor| x.to_dtype(DType::F64).unwrap();
        let want = f(&a).silu().unwrap().mul(&f(&b)).unwrap();
        assert!(max_diff(&a.silu_mul(&b).unwrap(), &want) <= 4.0 * 2f64.powi(-8));
        // Broadcasting, and integers promote to float.
        let row = input(&[1, 5], 85, DType::F32, dev);
        assert_eq!(a.to_dtype(DType::F32).unwrap().silu_mul(&row).unwrap().shape(), [2, 5]);
        let i = Tensor::new([1i64, 2]).unwrap().to_device(dev).unwrap();
        assert_eq!(i.silu_mul(&i).unwrap().dtype(), DType::F32);
        // Gradients to second order.
        let (x, y) = (input(&[2, 3], 86, DType::F64, dev), input(&[2, 3], 87, DType::F64, dev));
        gradcheck(|t: &[Tensor]| t[0].silu_mul(&t[1]), &[x.clone(), y.clone()], GradcheckOptions::default()).unwrap();
        let dx = |t: &[Tensor]| -> Result<Tensor> {
            let _on = kiln::autograd::enable_grad();
            let leaf = |v: &Tensor| -> Result<Tensor> {
                Ok(if v.requires_grad() { v.clone() } else { v.detach().requires_grad_(true)?.clone() })
            };
            let (x, y) = (leaf(&t[0])?, leaf(&t[1])?);
            let l = x.silu_mul(&y)?.mul(&y)?.sum()?;
            let g = kiln::autograd::grad(&[&l], &[&x, &y], None, true, true)?;
            g[0].clone().expect("dx").add(&g[1].clone().expect("dy"))
        };
        gradcheck(dx, &[x, y], GradcheckOptions::default()).unwrap();
    }
}

#[test]
fn logsumexp_over_one_dim_matches_the_definition() {
    for dev in devices() {
        for dt in [DType::F64, DType::F32] {
            let x = input(&[3, 37, 2], 91, dt, dev);
            for dim in [0isize, 1, 2] {
                let got = x.logsumexp(dim, false).unwrap();
                let want = x.to_dtype(DType::F64).unwrap().exp().unwrap().sum_dim(dim, false).unwrap().log().unwrap();
                assert!(max_diff(&got, &want) < 1e-5, "{dt} dim {dim}");
                assert_eq!(x.logsumexp(dim, true).unwrap().ndim(), 3);
            }
        }
        let inf = f64::INFINITY;
        let x = Tensor::from_vec(vec![-inf, -inf, 1.0, inf, 0.0, f64::NAN], &[3, 2]).unwrap().to_device(dev).unwrap();
        let v = x.logsumexp(1, false).unwrap().to_vec_f64().unwrap();
        assert_eq!(v[0], -inf);
        assert_eq!(v[1], inf);
        assert!(v[2].is_nan());
        let empty = Tensor::zeros(&[2, 0], DType::F32).unwrap().to_device(dev).unwrap();
        assert_eq!(empty.logsumexp(1, false).unwrap().to_vec_f64().unwrap(), vec![-inf, -inf]);
        let x = input(&[2, 4], 92, DType::F64, dev);
        gradcheck(|t: &[Tensor]| t[0].logsumexp(1, false), std::slice::from_ref(&x), GradcheckOptions::default())
            .unwrap();
    }
}

#[test]
fn the_rms_norm_primitive_differentiates_its_rstd() {
    for dev in devices() {
        let leaf =
            |shape: &[usize], seed: u64| input(shape, seed, DType::F64, dev).requires_grad_(true).unwrap().clone();
        let (x, w) = (leaf(&[2, 3, 5], 101), leaf(&[5], 102));
        let outs = Tensor::apply(Op::RmsNorm { eps: 1e-5 }, &[&x, &w]).unwrap();
        let loss = outs[0].sum().unwrap().add(&outs[1].mul(3.0).unwrap().sum().unwrap()).unwrap();
        let g = kiln::autograd::grad(&[&loss], &[&x, &w], None, false, false).unwrap();
        // The same from the definition.
        let r = x.mul(&x).unwrap().mean_dim(-1, true).unwrap().add(1e-5).unwrap().rsqrt().unwrap();
        assert!(max_diff(&outs[1], &r.squeeze_dim(-1).unwrap()) < 1e-14);
        let want = x.mul(&r).unwrap().mul(&w).unwrap().sum().unwrap().add(&r.mul(3.0).unwrap().sum().unwrap()).unwrap();
        let gw = kiln::autograd::grad(&[&want], &[&x, &w], None, false, false).unwrap();
        for (a, b) in g.iter().zip(&gw) {
            assert!(max_diff(a.as_ref().unwrap(), b.as_ref().unwrap()) < 1e-12);
        }
    }
}

/// The CPU kernel's in-place way for decoding rows (batch invariance off)
/// against its gathered way (checked above against attention), at head
/// sizes past one vector of lanes, with grouped heads, one sequence alone
/// (its heads split across threads) and many at once.
#[test]
fn paged_attention_direct_rows_equal_gathered_rows() {
    let _one = common::batch_invariance(false);
    let (h, hk, d, bs, blocks) = (6usize, 3usize, 24usize, 4usize, 64usize);
    let kc = input(&[blocks, bs, hk, d], 1, DType::F32, Device::Cpu);
    let vc = input(&[blocks, bs, hk, d], 2, DType::F32, Device::Cpu);
    let meta = |v: Vec<i64>, shape: &[usize]| Tensor::from_vec(v, shape).unwrap();
    // (context length, new rows); block tables walk the pool backwards from different starts.
    for seqs in [vec![(37usize, 2usize)], vec![(5, 1), (37, 4), (16, 1), (1, 1), (29, 3), (30, 0)]] {
        let mb = 10;
        let tables: Vec<i64> =
            (0..seqs.len()).flat_map(|s| (0..mb).map(move |j| ((blocks - 1 - j * 3 - s) % blocks) as i64)).collect();
        let lens: Vec<i64> = seqs.iter().map(|s| s.0 as i64).collect();
        let mut starts = vec![0i64];
        for s in &seqs {
            starts.push(starts.last().unwrap() + s.1 as i64);
        }
        let n = *starts.last().unwrap() as usize;
        let q = input(&[n, h, d], 3, DType::F32, Device::Cpu);
        let (tb, ln, st) =
            (meta(tables, &[seqs.len(), mb]), meta(lens, &[seqs.len()]), meta(starts, &[seqs.len() + 1]));
        let run = |invariant: bool| {
            kiln::tensor::set_batch_invariant(invariant);
            q.paged_attention(&kc, &vc, &tb, &ln, &st, None).unwrap().to_vec::<f32>().unwrap()
        };
        let (gathered, direct) = (run(true), run(false));
        let err = gathered.iter().zip(&direct).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(err < 1e-5, "{seqs:?}: direct rows differ from gathered rows by {err}");
    }
}

/// A pool holding the keys (or values) `x [L, Hk, D]` of each sequence at the
/// positions its block table gives, the other rows filled with noise.
fn paged_pool(seqs: &[Tensor], tables: &[Vec<i64>], blocks: usize, bs: usize, dev: Device) -> Tensor {
    let (hk, d) = (seqs[0].shape()[1], seqs[0].shape()[2]);
    let pool = input(&[blocks, bs, hk, d], 99, DType::F32, Device::Cpu);
    for (x, t) in seqs.iter().zip(tables) {
        for p in 0..x.shape()[0] {
            let slot = pool.select(0, t[p / bs] as isize).unwrap().select(0, (p % bs) as isize).unwrap();
            slot.copy_(&x.select(0, p as isize).unwrap()).unwrap();
        }
    }
    pool.to_device(dev).unwrap()
}

/// Paged attention (Note [Paged attention]) equals causal attention over each
/// sequence's contiguous keys, for prefill chunks, single decoded tokens and
/// sequences with no new rows packed together, grouped-query heads, blocks out
/// of order and shared between sequences; bit for bit on the CPU with batch
/// invariance on. Bad metadata is an error naming the value, on every device.
#[test]
fn paged_attention_matches_contiguous_attention() {
    // On before the reference is computed.
    let _one = common::batch_invariance(true);
    let (h, hk, d, bs, blocks) = (4usize, 2usize, 8usize, 4usize, 12usize);
    // (context length, new rows, block table)
    let seqs: Vec<(usize, usize, Vec<i64>)> = vec![
        (7, 7, vec![3, 0]),
        (9, 1, vec![5, 1, 7]),
        (6, 0, vec![2, 4]),
        (10, 3, vec![5, 1, 8]),
        (1, 1, vec![11, 0, 0]),
    ];
    let mb = 3;
    let keys: Vec<Tensor> =
        seqs.iter().enumerate().map(|(i, s)| input(&[s.0, hk, d], 10 + i as u64, DType::F32, Device::Cpu)).collect();
    let vals: Vec<Tensor> =
        seqs.iter().enumerate().map(|(i, s)| input(&[s.0, hk, d], 20 + i as u64, DType::F32, Device::Cpu)).collect();
    // Sequences 1 and 3 share their first two blocks: the same keys there.
    for p in 0..2 * bs {
        keys[3].select(0, p as isize).unwrap().copy_(&keys[1].select(0, p as isize).unwrap()).unwrap();
        vals[3].select(0, p as isize).unwrap().copy_(&vals[1].select(0, p as isize).unwrap()).unwrap();
    }
    let n: usize = seqs.iter().map(|s| s.1).sum();
    let q = input(&[n, h, d], 7, DType::F32, Device::Cpu);
    let mut starts = vec![0i64];
    for s in &seqs {
        starts.push(starts.last().unwrap() + s.1 as i64);
    }
    let table: Vec<i64> = seqs.iter().flat_map(|s| (0..mb).map(|j| s.2.get(j).copied().unwrap_or(0))).collect();
    let lens: Vec<i64> = seqs.iter().map(|s| s.0 as i64).collect();
    // The reference: each sequence's rows through the fused causal attention.
    let mut want = vec![];
    for (i, s) in seqs.iter().enumerate() {
        if s.1 == 0 {
            continue;
        }
        let qs = q.narrow(0, starts[i] as isize, s.1).unwrap().transpose(0, 1).unwrap().unsqueeze(0).unwrap();
        let k4 = keys[i].permute(&[1, 0, 2]).unwrap().unsqueeze(0).unwrap();
        let v4 = vals[i].permute(&[1, 0, 2]).unwrap().unsqueeze(0).unwrap();
        let o = qs.scaled_dot_product_attention(&k4, &v4, true, None).unwrap();
        want.push(o.squeeze_dim(0).unwrap().transpose(0, 1).unwrap());
    }
    let want = Tensor::cat(&want.iter().collect::<Vec<_>>(), 0).unwrap();
    let tables: Vec<Vec<i64>> = seqs.iter().map(|s| s.2.clone()).collect();
    for dev in devices() {
        let kc = paged_pool(&keys, &tables, blocks, bs, dev);
        let vc = paged_pool(&vals, &tables, blocks, bs, dev);
        let meta = |v: &[i64], shape: &[usize]| Tensor::from_vec(v.to_vec(), shape).unwrap().to_device(dev).unwrap();
        let (tb, ln, st) =
            (meta(&table, &[seqs.len(), mb]), meta(&lens, &[seqs.len()]), meta(&starts, &[seqs.len() + 1]));
        let qd = q.to_device(dev).unwrap();
        let got = qd.paged_attention(&kc, &vc, &tb, &ln, &st, None).unwrap();
        assert_eq!(got.shape(), &[n, h, d]);
        let (g, w) = (got.to_vec::<f32>().unwrap(), want.to_vec::<f32>().unwrap());
        if dev == Device::Cpu {
            assert!(
                g.iter().zip(&w).all(|(a, b)| a.to_bits() == b.to_bits()),
                "cpu: not bit for bit the fused kernel's rows"
            );
        } else {
            let err = g.iter().zip(&w).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(err < 1e-5, "{dev:?}: max error {err}");
        }
        // Bad metadata: a block past the pool, a context longer than its table,
        // starts that do not end at N.
        let mut bad_table = table.clone();
        bad_table[mb] = blocks as i64;
        let e = qd
            .paged_attention(&kc, &vc, &meta(&bad_table, &[seqs.len(), mb]), &ln, &st, None)
            .and_then(|t| t.to_vec::<f32>());
        common::assert_err(e, &["block 12", "out of bounds"]);
        let mut long = lens.clone();
        long[0] = (mb * bs + 1) as i64;
        let e =
            qd.paged_attention(&kc, &vc, &tb, &meta(&long, &[seqs.len()]), &st, None).and_then(|t| t.to_vec::<f32>());
        common::assert_err(e, &["context length 13"]);
        let mut short = starts.clone();
        *short.last_mut().unwrap() -= 1;
        let e = qd
            .paged_attention(&kc, &vc, &tb, &ln, &meta(&short, &[seqs.len() + 1]), None)
            .and_then(|t| t.to_vec::<f32>());
        common::assert_err(e, &["query_start"]);
    }
    // Batch invariance off: decoding rows read the cache in place (the direct
    // way of the CPU kernel), within rounding of the fused kernel.
    kiln::tensor::set_batch_invariant(false);
    let kc = paged_pool(&keys, &tables, blocks, bs, Device::Cpu);
    let vc = paged_pool(&vals, &tables, blocks, bs, Device::Cpu);
    let meta = |v: &[i64], shape: &[usize]| Tensor::from_vec(v.to_vec(), shape).unwrap();
    let (tb, ln, st) = (meta(&table, &[seqs.len(), mb]), meta(&lens, &[seqs.len()]), meta(&starts, &[seqs.len() + 1]));
    let got = q.paged_attention(&kc, &vc, &tb, &ln, &st, None).unwrap().to_vec::<f32>().unwrap();
    let err = got.iter().zip(&want.to_vec::<f32>().unwrap()).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(err < 1e-5, "direct decoding rows: max error {err}");
    // No gradient: a clear error rather than a silent zero.
    let qg = q.detach();
    qg.requires_grad_(true).unwrap();
    let kc = paged_pool(&keys, &tables, blocks, bs, Device::Cpu);
    let meta = |v: &[i64], shape: &[usize]| Tensor::from_vec(v.to_vec(), shape).unwrap();
    let e = qg.paged_attention(
        &kc,
        &kc,
        &meta(&table, &[seqs.len(), mb]),
        &meta(&lens, &[seqs.len()]),
        &meta(&starts, &[seqs.len() + 1]),
        None,
    );
    common::assert_err(e, &["no gradient"]);
}

/// bf16 paged attention on the CPU gives, bit for bit, the rows the fused
/// kernel gives each sequence alone: a prompt of 70 rows (two of the
/// kernel's blocks of query rows) over 75 cached positions and one decoded
/// row, grouped-query heads, blocks out of order (on tiles where the CPU has
/// AMX, widened to float32 elsewhere: the same way on both sides).
#[test]
fn bf16_paged_attention_gives_the_fused_kernels_rows() {
    let (h, hk, d, bs, blocks, mb) = (4usize, 2usize, 16usize, 8usize, 13usize, 10usize);
    // (context length, new rows, block table)
    let seqs: Vec<(usize, usize, Vec<i64>)> = vec![(75, 70, vec![9, 3, 0, 7, 1, 8, 2, 6, 4, 5]), (9, 1, vec![12, 10])];
    let bf = |shape: &[usize], seed: u64| input(shape, seed, DType::BF16, Device::Cpu).to_dtype(DType::F32).unwrap();
    let keys: Vec<Tensor> = seqs.iter().enumerate().map(|(i, s)| bf(&[s.0, hk, d], 60 + i as u64)).collect();
    let vals: Vec<Tensor> = seqs.iter().enumerate().map(|(i, s)| bf(&[s.0, hk, d], 70 + i as u64)).collect();
    let n: usize = seqs.iter().map(|s| s.1).sum();
    let q = input(&[n, h, d], 80, DType::BF16, Device::Cpu);
    let starts = [0i64, seqs[0].1 as i64, n as i64];
    let mut want = vec![];
    for (i, s) in seqs.iter().enumerate() {
        let qs = q.narrow(0, starts[i] as isize, s.1).unwrap().transpose(0, 1).unwrap().unsqueeze(0).unwrap();
        let four = |x: &Tensor| x.to_dtype(DType::BF16).unwrap().permute(&[1, 0, 2]).unwrap().unsqueeze(0).unwrap();
        let o = qs.scaled_dot_product_attention(&four(&keys[i]), &four(&vals[i]), true, None).unwrap();
        want.push(o.squeeze_dim(0).unwrap().transpose(0, 1).unwrap());
    }
    let want = Tensor::cat(&want.iter().collect::<Vec<_>>(), 0).unwrap();
    let tables: Vec<Vec<i64>> = seqs.iter().map(|s| s.2.clone()).collect();
    let pool = |x: &[Tensor]| paged_pool(x, &tables, blocks, bs, Device::Cpu).to_dtype(DType::BF16).unwrap();
    let table: Vec<i64> = seqs.iter().flat_map(|s| (0..mb).map(|j| s.2.get(j).copied().unwrap_or(0))).collect();
    let meta = |v: &[i64], shape: &[usize]| Tensor::from_vec(v.to_vec(), shape).unwrap();
    let lens: Vec<i64> = seqs.iter().map(|s| s.0 as i64).collect();
    let got = q
        .paged_attention(
            &pool(&keys),
            &pool(&vals),
            &meta(&table, &[2, mb]),
            &meta(&lens, &[2]),
            &meta(&starts, &[3]),
            None,
        )
        .unwrap();
    assert_eq!((got.shape(), got.dtype()), (&[n, h, d][..], DType::BF16));
    let bits = |t: &Tensor| {
        t.contiguous().unwrap().to_vec::<half::bf16>().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>()
    };
    assert!(bits(&got) == bits(&want), "not bit for bit the fused kernel's rows");
}
