//! The op groups of the conformance suite through `kiln::compile` on the PJRT
//! device: each case is a function of its inputs, run on the CPU and as a
//! compiled function on `tpu:0` three times (two traces, then a replay, with
//! fresh input values each time), results compared; in-place cases also
//! compare the state they update. Views, in-place writes through views,
//! indexing, reductions, sorting, matmul, composites and autograd inside the
//! traced function are covered.
mod common;

use kiln::prelude::*;

type Case = fn(&[Tensor]) -> Result<Vec<Tensor>>;

/// Deterministic values of `shape`, different per `seed`, in about [-2, 2].
fn input(shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| {
            let x = (i as u64 * 2654435761 + seed * 40503 + 7) % 1000;
            (x as f32 / 1000.0 - 0.5) * 4.0
        })
        .collect();
    Tensor::from_vec(v, shape).unwrap()
}

fn ids(shape: &[usize], high: i64, seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<i64> = (0..n).map(|i| ((i as u64 * 7 + seed * 3) % high as u64) as i64).collect();
    Tensor::from_vec(v, shape).unwrap()
}

fn close(got: &Tensor, want: &Tensor, what: &str) {
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    let (g, w) = (got.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        let ok = (a.is_nan() && b.is_nan()) || (a - b).abs() <= 1e-5 + 1e-5 * b.abs();
        assert!(ok, "{what}: element {i}: got {a}, want {b}\n got {g:?}\nwant {w:?}");
    }
}

/// Runs `f` eagerly on the CPU and compiled on tpu:0, three calls with new inputs each.
fn check(name: &str, make_inputs: impl Fn(u64) -> Vec<Tensor>, f: Case) {
    let tpu = Device::Tpu(0);
    // The cases' scalars are literals: constants of their traces.
    let mut compiled = kiln::compile(tpu, f).host_values(kiln::HostValues::Constant);
    for call in 0..3u64 {
        let cpu_in = make_inputs(call);
        // Copied before the CPU run: in-place cases write into their inputs.
        let tpu_in: Vec<Tensor> = cpu_in.iter().map(|t| t.to_device(tpu).unwrap()).collect();
        let want = f(&cpu_in).unwrap_or_else(|e| panic!("{name} on cpu: {e}"));
        let got = compiled.call(&tpu_in).unwrap_or_else(|e| panic!("{name} compiled, call {call}: {e}"));
        assert_eq!(got.len(), want.len(), "{name}: number of outputs");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            close(g, w, &format!("{name}, call {call}, output {i}"));
        }
        // In-place cases write into their inputs: those must agree too.
        for (i, (g, w)) in tpu_in.iter().zip(&cpu_in).enumerate() {
            close(g, w, &format!("{name}, call {call}, input {i} after the call"));
        }
    }
    let s = compiled.stats();
    assert_eq!((s.calls, s.traces, s.replays, s.retraces), (3, 2, 1, 0), "{name}: {s:?}");
}

fn two(shape: &[usize]) -> impl Fn(u64) -> Vec<Tensor> + '_ {
    move |s| vec![input(shape, s), input(shape, s + 100)]
}

#[test]
fn elementwise_and_broadcasting() {
    common::devices();
    check(
        "add_mul_broadcast",
        |s| vec![input(&[3, 4], s), input(&[4], s + 1)],
        |x| Ok(vec![x[0].add(&x[1])?.mul(&x[0])?, x[0].sub(2.5)?.div(&x[1].abs()?.add(1.0)?)?]),
    );
    check(
        "unary_math",
        |s| vec![input(&[2, 5], s)],
        |x| {
            let a = &x[0];
            Ok(vec![a.exp()?, a.tanh()?, a.sigmoid()?, a.abs()?.sqrt()?, a.sin()?, a.gelu()?, a.silu()?, a.erf()?])
        },
    );
    check("compare_where_clamp", two(&[6]), |x| {
        let m = x[0].gt(&x[1])?;
        Ok(vec![Tensor::where_cond(&m, &x[0], &x[1])?, x[0].clamp(Some(-1.0), Some(0.5))?, m.to_dtype(DType::F32)?])
    });
    check(
        "integer_math",
        |s| vec![ids(&[5], 9, s).sub(4).unwrap(), ids(&[5], 3, s + 1).add(1).unwrap()],
        |x| Ok(vec![x[0].floor_divide(&x[1])?, x[0].remainder(&x[1])?, x[0].mul(&x[1])?]),
    );
}

#[test]
fn reductions_and_softmax() {
    common::devices();
    check(
        "sum_mean_max",
        |s| vec![input(&[3, 4, 5], s)],
        |x| {
            let (m, i) = x[0].max_dim(1, false)?;
            Ok(vec![x[0].sum()?, x[0].mean_dim(2, true)?, m, i, x[0].argmax(Some(0), false)?, x[0].var(2, 1, false)?])
        },
    );
    check(
        "softmax_family",
        |s| vec![input(&[4, 7], s)],
        |x| Ok(vec![x[0].softmax(-1)?, x[0].log_softmax(0)?, x[0].logsumexp(1, false)?, x[0].cumsum(1)?]),
    );
    check(
        "sort_topk",
        |s| vec![input(&[3, 6], s)],
        |x| {
            let (v, i) = x[0].sort(1, true)?;
            let (tv, ti) = x[0].topk(2, 1, true, true)?;
            Ok(vec![v, i, tv, ti])
        },
    );
}

#[test]
fn views_and_in_place_writes() {
    common::devices();
    check(
        "views",
        |s| vec![input(&[4, 6], s)],
        |x| {
            let a = &x[0];
            Ok(vec![
                a.t()?.contiguous()?,
                a.narrow(1, 2, 3)?.exp()?,
                a.reshape(&[2, 12])?.sum_dim(1, false)?,
                a.diagonal(0, 0, 1)?.mul(2.0)?,
                a.unsqueeze(0)?.expand(&[2, 4, 6])?.sum_dim(0, false)?,
                a.permute(&[1, 0])?.narrow(0, 1, 2)?.tril(0)?,
            ])
        },
    );
    // Writes through views into the inputs: the function updates its arguments in place.
    check("in_place_through_views", two(&[3, 4]), |x| {
        x[0].narrow(1, 1, 2)?.add_(&x[1].narrow(1, 0, 2)?)?;
        x[1].select(0, 2)?.mul_(3.0)?;
        x[1].t()?.narrow(0, 0, 1)?.fill_(-1.0)?;
        Ok(vec![x[0].sum()?, x[1].mul(&x[0])?])
    });
}

#[test]
fn indexing_matmul_and_composites() {
    common::devices();
    check(
        "gather_scatter_index",
        |s| vec![input(&[4, 5], s), ids(&[4, 3], 5, s), ids(&[3], 4, s + 2)],
        |x| {
            Ok(vec![
                x[0].gather(1, &x[1])?,
                x[0].scatter_add(1, &x[1], &x[0].narrow(1, 0, 3)?)?,
                x[0].index_select(0, &x[2])?,
                Tensor::embedding(&x[0], &x[2])?,
            ])
        },
    );
    check(
        "matmul_cat_stack",
        |s| vec![input(&[2, 3, 4], s), input(&[2, 4, 5], s + 1)],
        |x| {
            let p = x[0].matmul(&x[1])?;
            Ok(vec![Tensor::cat(&[&p, &p.neg()?], 2)?, Tensor::stack(&[&x[0], &x[0]], 0)?.sum_dim(0, false)?])
        },
    );
    check(
        "norms_and_losses",
        |s| vec![input(&[6, 8], s), ids(&[6], 8, s)],
        |x| {
            Ok(vec![
                x[0].layer_norm(&[8], None, None, 1e-5)?,
                x[0].rms_norm(Some(&Tensor::ones(&[8], (DType::F32, x[0].device()))?), 1e-6)?,
                x[0].cross_entropy(&x[1], None, Reduction::Mean)?,
            ])
        },
    );
}

#[test]
fn autograd_inside_the_traced_function() {
    common::devices();
    check(
        "grad_of_a_small_network",
        |s| vec![input(&[4, 3], s), input(&[3, 2], s + 5)],
        |x| {
            let w = x[1].detach();
            w.requires_grad_(true)?;
            let y = x[0].matmul(&w)?.tanh()?.pow(2.0)?.sum()?;
            y.backward()?;
            Ok(vec![y.detach(), w.grad().expect("a gradient")])
        },
    );
}

#[test]
fn returned_views_of_results() {
    common::devices();
    // A returned view holds its storage twice (itself and its base): it is
    // still a result, not state.
    check(
        "reshaped_argmax_and_transposed_product",
        |s| vec![input(&[2, 3], s)],
        |x| Ok(vec![x[0].argmax(Some(-1), true)?.reshape(&[2])?, x[0].mul(2.0)?.t()?]),
    );
}
