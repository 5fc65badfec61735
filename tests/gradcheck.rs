//! Gradient checking (finite differences in f64) of every primitive and
//! composite, on every registered device: part of the conformance suite.
// Cases pass `&[x.clone()]`: the inputs are reused across many checks.
#![allow(clippy::cloned_ref_to_slice_refs)]
mod common;
use kiln::autograd::{gradcheck, GradcheckOptions};
use kiln::prelude::*;

/// Every device, the PJRT one in each of its modes (see `common::devices_in_every_mode`).
fn devices() -> impl Iterator<Item = Device> {
    common::devices_in_every_mode()
}

/// Deterministic f64 values in roughly [-1.5, 1.5], without ties.
fn vals(n: usize, seed: usize) -> Vec<f64> {
    (0..n).map(|i| (((i * 37 + seed * 101) % 97) as f64 / 97.0 - 0.5) * 3.0 + i as f64 * 1e-3).collect()
}
fn input(shape: &[usize], seed: usize, dev: Device) -> Tensor {
    Tensor::from_vec(vals(shape.iter().product(), seed), shape).unwrap().to_device(dev).unwrap()
}
fn positive(shape: &[usize], seed: usize, dev: Device) -> Tensor {
    input(shape, seed, dev).abs().unwrap().add(0.5).unwrap()
}
fn idx(v: &[i64], shape: &[usize], dev: Device) -> Tensor {
    Tensor::from_slice(v, shape).unwrap().to_device(dev).unwrap()
}

fn check(name: &str, f: impl Fn(&[Tensor]) -> Result<Tensor>, inputs: &[Tensor]) {
    check_with(name, f, inputs, GradcheckOptions::default())
}
fn check_with(name: &str, f: impl Fn(&[Tensor]) -> Result<Tensor>, inputs: &[Tensor], o: GradcheckOptions) {
    if let Err(e) = gradcheck(f, inputs, o) {
        panic!("gradcheck of {name} failed: {e}");
    }
}

#[test]
fn unary_primitives() {
    for d in devices() {
        let x = input(&[2, 3], 1, d);
        let p = positive(&[2, 3], 2, d);
        check("neg", |t| t[0].neg(), &[x.clone()]);
        check("abs", |t| t[0].abs(), &[x.clone()]);
        check("exp", |t| t[0].exp(), &[x.clone()]);
        check("log", |t| t[0].log(), &[p.clone()]);
        check("log1p", |t| t[0].log1p(), &[p.clone()]);
        check("expm1", |t| t[0].expm1(), &[x.clone()]);
        check("sqrt", |t| t[0].sqrt(), &[p.clone()]);
        check("rsqrt", |t| t[0].rsqrt(), &[p.clone()]);
        check("reciprocal", |t| t[0].reciprocal(), &[p.clone()]);
        check("tanh", |t| t[0].tanh(), &[x.clone()]);
        check("sigmoid", |t| t[0].sigmoid(), &[x.clone()]);
        check("sin", |t| t[0].sin(), &[x.clone()]);
        check("cos", |t| t[0].cos(), &[x.clone()]);
        check("erf", |t| t[0].erf(), &[x.clone()]);
        // Piecewise-constant ops have zero gradient away from their jumps.
        let off = input(&[2, 3], 3, d).mul(0.9).unwrap().add(0.27).unwrap();
        for (n, f) in [
            ("sign", Tensor::sign as fn(&Tensor) -> Result<Tensor>),
            ("floor", Tensor::floor),
            ("ceil", Tensor::ceil),
            ("round", Tensor::round),
            ("trunc", Tensor::trunc),
        ] {
            check(n, |t| f(&t[0]), &[off.clone()]);
        }
    }
}

#[test]
fn binary_primitives() {
    for d in devices() {
        let a = input(&[2, 3], 4, d);
        let b = input(&[2, 3], 5, d);
        let p = positive(&[2, 3], 6, d);
        let q = positive(&[2, 3], 7, d).add(1.0).unwrap();
        check("add", |t| t[0].add(&t[1]), &[a.clone(), b.clone()]);
        check("sub", |t| t[0].sub(&t[1]), &[a.clone(), b.clone()]);
        check("mul", |t| t[0].mul(&t[1]), &[a.clone(), b.clone()]);
        check("div", |t| t[0].div(&t[1]), &[a.clone(), q.clone()]);
        check("pow", |t| t[0].pow(&t[1]), &[p.clone(), b.clone()]);
        check("maximum", |t| t[0].maximum(&t[1]), &[a.clone(), b.clone()]);
        check("minimum", |t| t[0].minimum(&t[1]), &[a.clone(), b.clone()]);
        check("fmax", |t| t[0].fmax(&t[1]), &[a.clone(), b.clone()]);
        check("fmin", |t| t[0].fmin(&t[1]), &[a.clone(), b.clone()]);
        check("atan2", |t| t[0].atan2(&t[1]), &[a.clone(), b.clone()]);
        check("remainder", |t| t[0].remainder(&t[1]), &[a.clone(), q.clone()]);
        check("fmod", |t| t[0].fmod(&t[1]), &[a.clone(), q.clone()]);
        // Broadcasting goes through expand's rule.
        let row = input(&[3], 8, d);
        check("broadcast mul", |t| t[0].mul(&t[1]), &[a.clone(), row.clone()]);
        check("scalar pow", |t| t[0].pow(3.0), &[a.clone()]);
        let mask = a.gt(0.0).unwrap();
        check("where", |t| Tensor::where_cond(&t[2], &t[0], &t[1]), &[a.clone(), b.clone(), mask]);
        check_with(
            "cast",
            |t| t[0].to_dtype(DType::F32)?.mul(2.0)?.to_dtype(DType::F64),
            &[a.clone()],
            GradcheckOptions { eps: 1e-3, atol: 1e-3, rtol: 1e-3 },
        );
    }
}

#[test]
fn reductions_and_scans() {
    for d in devices() {
        let x = input(&[2, 3, 4], 9, d);
        check("sum all", |t| t[0].sum(), &[x.clone()]);
        check("sum dims", |t| t[0].sum_dim([0, 2], false), &[x.clone()]);
        check("sum keepdim", |t| t[0].sum_dim(1, true), &[x.clone()]);
        check("mean", |t| t[0].mean_dim(-1, false), &[x.clone()]);
        check("prod", |t| t[0].prod_dim(1, false), &[x.clone()]);
        check("amax", |t| t[0].amax(2, false), &[x.clone()]);
        check("amin", |t| t[0].amin([0, 1], true), &[x.clone()]);
        check("max_dim", |t| Ok(t[0].max_dim(1, false)?.0), &[x.clone()]);
        check("cumsum", |t| t[0].cumsum(1), &[x.clone()]);
        check("var", |t| t[0].var(-1, 1, false), &[x.clone()]);
        check("std", |t| t[0].std(1, 0, true), &[x.clone()]);
        check("logsumexp", |t| t[0].logsumexp(-1, false), &[x.clone()]);
    }
}

#[test]
fn matmul_rules() {
    for d in devices() {
        check("mm", |t| t[0].matmul(&t[1]), &[input(&[3, 4], 1, d), input(&[4, 2], 2, d)]);
        check("batched broadcast", |t| t[0].matmul(&t[1]), &[input(&[2, 1, 3, 4], 3, d), input(&[3, 4, 2], 4, d)]);
        check("vec @ mat", |t| t[0].matmul(&t[1]), &[input(&[4], 5, d), input(&[4, 3], 6, d)]);
        check("mat @ vec", |t| t[0].matmul(&t[1]), &[input(&[3, 4], 7, d), input(&[4], 8, d)]);
        check("dot", |t| t[0].matmul(&t[1]), &[input(&[4], 9, d), input(&[4], 10, d)]);
        check("transposed", |t| t[0].t()?.matmul(&t[1]), &[input(&[4, 3], 11, d), input(&[4, 2], 12, d)]);
    }
}

#[test]
fn views() {
    for d in devices() {
        let x = input(&[3, 4], 13, d);
        check("reshape", |t| t[0].reshape(&[2, 6]), &[x.clone()]);
        check("reshape copy", |t| t[0].t()?.reshape(&[12]), &[x.clone()]);
        check("permute", |t| t[0].permute(&[1, 0]), &[x.clone()]);
        check("expand", |t| t[0].unsqueeze(0)?.expand(&[2, 3, 4]), &[x.clone()]);
        check("narrow", |t| t[0].narrow(1, 1, 2), &[x.clone()]);
        check("slice step", |t| t[0].slice(1, Some(0), None, 2), &[x.clone()]);
        check("select", |t| t[0].select(0, -1), &[x.clone()]);
        check("squeeze", |t| t[0].unsqueeze(1)?.squeeze_dim(1), &[x.clone()]);
        check("diagonal", |t| t[0].diagonal(1, 0, 1), &[x.clone()]);
        check("as_strided", |t| t[0].as_strided(&[2, 2], &[4, 2], Some(1)), &[x.clone()]);
        check("as_strided overlapping", |t| t[0].reshape(&[12])?.as_strided(&[4, 3], &[2, 1], Some(0)), &[x.clone()]);
        check("flatten", |t| t[0].unsqueeze(0)?.flatten(0, 1), &[x.clone()]);
        check("chunk", |t| Ok(t[0].chunk(2, 1)?[1].clone()), &[x.clone()]);
        check("index", |t| t[0].i((.., 1..3)), &[x.clone()]);
        let y = input(&[2, 4], 14, d);
        check("cat", |t| Tensor::cat(&[&t[0], &t[1]], 0), &[x.clone(), y]);
        check("stack", |t| Tensor::stack(&[&t[0], &t[1]], 1), &[x.clone(), input(&[3, 4], 15, d)]);
        check("contiguous", |t| t[0].t()?.contiguous(), &[x.clone()]);
    }
}

#[test]
fn inplace_writes() {
    for d in devices() {
        // A non-leaf written through a view, then used.
        check(
            "copy_ into view",
            |t| {
                let h = t[0].mul(2.0)?;
                h.narrow(1, 1, 2)?.copy_(&t[1].exp()?)?;
                h.mul(&h)
            },
            &[input(&[3, 4], 16, d), input(&[3, 2], 17, d)],
        );
        check(
            "mul_ on view",
            |t| {
                let h = t[0].mul(1.0)?;
                h.select(0, 1)?.mul_(&t[1])?;
                h.sin()
            },
            &[input(&[3, 4], 18, d), input(&[4], 19, d)],
        );
        check(
            "masked_fill_",
            |t| {
                let h = t[0].mul(1.0)?;
                h.masked_fill_(&t[0].gt(0.0)?, 0.5)?;
                h.mul(&t[0])
            },
            &[input(&[3, 4], 20, d)],
        );
    }
}

#[test]
fn indexing_primitives() {
    for d in devices() {
        let x = input(&[3, 4], 21, d);
        let i = idx(&[0, 2, 2, 1, 3, 0], &[3, 2], d);
        check("gather", |t| t[0].gather(1, &i), &[x.clone()]);
        let sel = idx(&[2, 0, 2], &[3], d);
        check("index_select", |t| t[0].index_select(0, &sel), &[x.clone()]);
        let src = input(&[3, 4], 22, d);
        check("index_add", |t| t[0].index_add(0, &sel, &t[1]), &[x.clone(), src.clone()]);
        let si = idx(&[1, 0, 3, 2, 2, 1], &[3, 2], d);
        let s2 = input(&[3, 2], 23, d);
        check("scatter_add", |t| t[0].scatter_add(1, &si, &t[1]), &[x.clone(), s2.clone()]);
        let uniq = idx(&[1, 0, 3, 2, 2, 1], &[3, 2], d);
        check("scatter", |t| t[0].scatter(1, &uniq, &t[1]), &[x.clone(), s2.clone()]);
        check("sort", |t| Ok(t[0].sort(1, true)?.0), &[x.clone()]);
        check("topk", |t| Ok(t[0].topk(2, 1, true, true)?.0), &[x.clone()]);
        check("embedding", |t| Tensor::embedding(&t[0], &idx(&[2, 0, 2], &[3], d)), &[x.clone()]);
        let mask = x.gt(0.0).unwrap();
        check("masked_select", |t| t[0].masked_select(&mask), &[x.clone()]);
    }
}

#[test]
fn composites() {
    for d in devices() {
        let x = input(&[3, 5], 24, d);
        check("softmax", |t| t[0].softmax(-1), &[x.clone()]);
        check("softmax dim0", |t| t[0].softmax(0), &[x.clone()]);
        check("log_softmax", |t| t[0].log_softmax(-1), &[x.clone()]);
        check("silu", |t| t[0].silu(), &[x.clone()]);
        // silu's rule uses the silu_backward primitive: its own rule, through double backward.
        check(
            "silu double backward",
            |t| {
                // The numeric pass runs under no_grad with plain inputs: differentiate a leaf then.
                let _on = kiln::autograd::enable_grad();
                let x = if t[0].requires_grad() { t[0].clone() } else { t[0].detach().requires_grad_(true)?.clone() };
                let y = x.silu()?.sum()?;
                let g = kiln::autograd::grad(&[&y], &[&x], None, true, true)?;
                Ok(g[0].clone().expect("a gradient"))
            },
            &[x.clone()],
        );
        check("gelu", |t| t[0].gelu(), &[x.clone()]);
        check("gelu_tanh", |t| t[0].gelu_tanh(), &[x.clone()]);
        check("relu", |t| t[0].relu(), &[x.clone()]);
        check("clamp", |t| t[0].clamp(Some(-0.5), Some(0.5)), &[x.clone()]);
        let w = input(&[5], 25, d);
        check("rms_norm", |t| t[0].rms_norm(Some(&t[1]), 1e-5), &[x.clone(), w.clone()]);
        let b = input(&[5], 26, d);
        check("layer_norm", |t| t[0].layer_norm(&[5], Some(&t[1]), Some(&t[2]), 1e-5), &[x.clone(), w, b]);
        let target = idx(&[1, -100, 4], &[3], d);
        check(
            "cross_entropy",
            |t| t[0].cross_entropy(&target, Some(-100), kiln::tensor::Reduction::Mean),
            &[x.clone()],
        );
        for reduction in [Reduction::Mean, Reduction::Sum, Reduction::None] {
            let opts = kiln::tensor::CrossEntropy { ignore_index: Some(-100), reduction, label_smoothing: 0.1 };
            check("cross_entropy label_smoothing", |t| t[0].cross_entropy_with(&target, opts), &[x.clone()]);
        }
        let target2d = idx(&[1, 0, 2, 1, 1, 0], &[3, 2], d);
        let x3 = input(&[3, 3, 2], 30, d);
        let opts = kiln::tensor::CrossEntropy { ignore_index: None, reduction: Reduction::Mean, label_smoothing: 0.2 };
        check("cross_entropy [N, C, d]", |t| t[0].cross_entropy_with(&target2d, opts), &[x3]);
        check("tril", |t| t[0].tril(0), &[x.clone()]);
        // Attention: softmax(q k^T / sqrt(d)) v with a causal mask.
        let (q, k, v) = (input(&[2, 4, 3], 27, d), input(&[2, 4, 3], 28, d), input(&[2, 4, 3], 29, d));
        check(
            "attention",
            |t| {
                let s = t[0].matmul(&t[1].transpose(-1, -2)?)?.div(3f64.sqrt())?;
                let mask = Tensor::full(&[4, 4], f64::NEG_INFINITY, (DType::F64, t[0].device()))?.triu(1)?;
                s.add(&mask)?.softmax(-1)?.matmul(&t[2])
            },
            &[q, k, v],
        );
    }
}
