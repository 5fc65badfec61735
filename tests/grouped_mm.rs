//! `grouped_mm` (Note [Grouped products]) against its definition, one `mm`
//! per group, on every device and PJRT mode: both forms, empty groups, rows
//! past the last group, groups that cross the lowering's tiles, half
//! precision, gradients (against the definition's, gradcheck of both forms in
//! float64), bad group sizes as errors, and a compiled program that replays
//! for new group sizes without retracing.
mod common;
use common::assert_err;
use kiln::autograd::{gradcheck, GradcheckOptions};
use kiln::prelude::*;

use common::ramp as input;

fn sizes(s: &[i64], dev: Device) -> Tensor {
    Tensor::from_vec(s.to_vec(), &[s.len()]).unwrap().to_device(dev).unwrap()
}

/// The definition: one `mm` per group, zero rows (or slices) elsewhere.
fn reference(a: &Tensor, b: &Tensor, s: &[i64]) -> Result<Tensor> {
    let mut start = 0usize;
    if b.ndim() == 3 {
        let (m, n) = (a.shape()[0], b.shape()[2]);
        let mut parts = vec![];
        for (g, &len) in s.iter().enumerate() {
            parts.push(a.narrow(0, start as isize, len as usize)?.mm(&b.select(0, g as isize)?)?);
            start += len as usize;
        }
        parts.push(Tensor::zeros(&[m - start, n], (a.dtype(), a.device()))?);
        Tensor::cat(&parts.iter().collect::<Vec<_>>(), 0)
    } else {
        let mut parts = vec![];
        for &len in s {
            let (x, y) = (a.narrow(1, start as isize, len as usize)?, b.narrow(0, start as isize, len as usize)?);
            parts.push(if len == 0 {
                Tensor::zeros(&[a.shape()[0], b.shape()[1]], (a.dtype(), a.device()))?
            } else {
                x.mm(&y)?
            });
            start += len as usize;
        }
        Tensor::stack(&parts.iter().collect::<Vec<_>>(), 0)
    }
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.shape(), b.shape());
    let (a, b) = (a.to_vec_f64().unwrap(), b.to_vec_f64().unwrap());
    a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

/// One bfloat16 rounding of the largest value (the definition and the
/// lowering round the float32 product once each, perhaps on either side).
fn bf16_tol(want: &Tensor) -> f64 {
    want.to_vec_f64().unwrap().iter().fold(0.0f64, |m, v| m.max(v.abs())) / 128.0
}

/// `(M, K, N, group sizes)`: one group, an empty group in the middle and at
/// the ends, rows past the last group, and groups crossing 32-row tiles.
fn cases() -> Vec<(usize, usize, usize, Vec<i64>)> {
    vec![
        (4, 3, 2, vec![4]),
        (7, 5, 3, vec![0, 3, 0, 2, 2]),
        (6, 2, 4, vec![1, 2, 0]),
        (100, 9, 7, vec![33, 0, 1, 30, 31, 0]),
        (70, 4, 5, vec![64, 6]),
    ]
}

#[test]
fn both_forms_match_one_mm_per_group_on_every_device() {
    for dev in common::devices_in_every_mode() {
        for (i, (m, k, n, s)) in cases().into_iter().enumerate() {
            let g = s.len();
            for dtype in [DType::F32, DType::BF16] {
                let tol = 1e-5;
                let a = input(&[m, k], i as u64, dtype, dev);
                let w = input(&[g, k, n], i as u64 + 7, dtype, dev);
                let got = a.grouped_mm(&w, &sizes(&s, dev)).unwrap();
                let want =
                    reference(&a.to_device(Device::Cpu).unwrap(), &w.to_device(Device::Cpu).unwrap(), &s).unwrap();
                assert_eq!(got.dtype(), dtype);
                // bf16 rounds the float32 product once, like mm: equal up to one rounding of it.
                let tol = if dtype == DType::BF16 { bf16_tol(&want) } else { tol };
                assert!(max_diff(&got, &want) <= tol, "{dev} {dtype} rows case {i}: {}", max_diff(&got, &want));
                // The contracting form: a [K, M] with b [M, N].
                let at = input(&[k, m], i as u64 + 3, dtype, dev);
                let b = input(&[m, n], i as u64 + 5, dtype, dev);
                let got = at.grouped_mm(&b, &sizes(&s, dev)).unwrap();
                assert_eq!(got.shape(), &[g, k, n]);
                let want =
                    reference(&at.to_device(Device::Cpu).unwrap(), &b.to_device(Device::Cpu).unwrap(), &s).unwrap();
                let tol = if dtype == DType::BF16 { bf16_tol(&want) } else { 1e-5 };
                assert!(max_diff(&got, &want) <= tol, "{dev} {dtype} contracting case {i}: {}", max_diff(&got, &want));
            }
        }
    }
}

#[test]
fn gradients_match_the_definition_and_empty_groups_get_zeros() {
    for dev in common::devices_in_every_mode() {
        for (i, (m, k, n, s)) in cases().into_iter().enumerate() {
            let g = s.len();
            let run = |grouped: bool, contracting: bool| -> Vec<Tensor> {
                let (sa, sb) = if contracting { (vec![k, m], vec![m, n]) } else { (vec![m, k], vec![g, k, n]) };
                let d = if grouped { dev } else { Device::Cpu };
                let (a, b) = (input(&sa, i as u64, DType::F32, d), input(&sb, i as u64 + 1, DType::F32, d));
                a.requires_grad_(true).unwrap();
                b.requires_grad_(true).unwrap();
                let y = if grouped { a.grouped_mm(&b, &sizes(&s, d)).unwrap() } else { reference(&a, &b, &s).unwrap() };
                let up = input(y.shape(), i as u64 + 2, DType::F32, d);
                y.mul(&up).unwrap().sum().unwrap().backward().unwrap();
                vec![a.grad().unwrap(), b.grad().unwrap()]
            };
            for contracting in [false, true] {
                let (got, want) = (run(true, contracting), run(false, contracting));
                for (j, (x, y)) in got.iter().zip(&want).enumerate() {
                    assert!(max_diff(x, y) <= 1e-5, "{dev} case {i} contracting {contracting} grad {j}");
                }
                if !contracting {
                    // An empty group's matrix gets a zero gradient, not none.
                    for (e, _) in s.iter().enumerate().filter(|(_, &l)| l == 0) {
                        assert_eq!(
                            got[1].select(0, e as isize).unwrap().abs().unwrap().sum().unwrap().item::<f32>().unwrap(),
                            0.0
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn gradcheck_in_float64() {
    // Each form's gradient is the other form (and itself), so checking both
    // forms checks every product a second-order gradient is made of.
    let s = sizes(&[2, 0, 3], Device::Cpu);
    let opts = GradcheckOptions::default();
    let pairs = [
        (input(&[6, 3], 1, DType::F64, Device::Cpu), input(&[3, 3, 2], 2, DType::F64, Device::Cpu)),
        (input(&[3, 6], 3, DType::F64, Device::Cpu), input(&[6, 2], 4, DType::F64, Device::Cpu)),
    ];
    for (a, b) in pairs {
        a.requires_grad_(true).unwrap();
        b.requires_grad_(true).unwrap();
        gradcheck(|x| x[0].grouped_mm(&x[1], &s), &[a, b], opts).unwrap();
    }
}

#[test]
fn bad_sizes_and_shapes_are_errors_on_every_device() {
    for dev in common::devices_in_every_mode() {
        let a = input(&[5, 3], 0, DType::F32, dev);
        let w = input(&[2, 3, 4], 1, DType::F32, dev);
        let r = a.grouped_mm(&w, &sizes(&[-1, 2], dev)).and_then(|y| y.to_vec::<f32>());
        assert_err(r, &["grouped_mm", "group_sizes[0] is -1"]);
        let r = a.grouped_mm(&w, &sizes(&[4, 2], dev)).and_then(|y| y.to_vec::<f32>());
        assert_err(r, &["grouped_mm", "sum past the 5 rows"]);
        // Sizes whose int64 sum wraps around to a small number.
        let w3 = input(&[3, 3, 4], 1, DType::F32, dev);
        let r = a.grouped_mm(&w3, &sizes(&[i64::MAX, i64::MAX, 2], dev)).and_then(|y| y.to_vec::<f32>());
        assert_err(r, &["grouped_mm", "sum past the 5 rows"]);
        assert_err(a.grouped_mm(&w, &sizes(&[1, 1, 1], dev)), &["grouped_mm", "for 3 groups"]);
        assert_err(a.grouped_mm(&w.to_dtype(DType::F64).unwrap(), &sizes(&[1, 1], dev)), &["same dtype"]);
        let s32 = sizes(&[1, 1], dev).to_dtype(DType::I32).unwrap();
        assert_err(a.grouped_mm(&w, &s32), &["int64"]);
    }
}

#[test]
fn a_compiled_program_replays_for_new_group_sizes() {
    common::devices();
    let tpu = Device::Tpu(0);
    let mut f = kiln::compile(tpu, |x: &[Tensor]| Ok(vec![x[0].grouped_mm(&x[1], &x[2])?]));
    for (call, s) in [vec![3i64, 0, 37], vec![0, 40, 0], vec![10, 10, 5]].into_iter().enumerate() {
        let (a, w) =
            (input(&[40, 6], call as u64, DType::F32, Device::Cpu), input(&[3, 6, 5], 9, DType::F32, Device::Cpu));
        let want = reference(&a, &w, &s).unwrap();
        let got = f.call(&[a.to_device(tpu).unwrap(), w.to_device(tpu).unwrap(), sizes(&s, tpu)]).unwrap();
        assert!(max_diff(&got[0], &want) <= 1e-5, "call {call}");
    }
    let st = f.stats();
    assert_eq!((st.calls, st.retraces), (3, 0), "{st:?}");
    assert!(st.replays >= 1, "{st:?}");
}
