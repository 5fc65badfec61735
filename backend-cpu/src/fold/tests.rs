//! Folded casts (Note [Folded casts]): what folds, what does not, and the
//! folded program's results against the program as written, bit for bit, in
//! bfloat16 and float16, on odd shapes and across blocks and threads.
use super::fold_casts;
use crate::kernels::CpuFuser;
use kiln_tensor::ir::{Executable, Interpreter, ParamKind, Program, ResultKind, Value};
use kiln_tensor::{DType, Device, Meta, Op, Result, Tensor, ViewOp};

fn sv(x: &[usize]) -> smallvec::SmallVec<[usize; 6]> {
    x.iter().copied().collect()
}

fn push(p: &mut Program, op: Op, args: &[Value]) -> Value {
    p.push(op, args).unwrap()[0]
}

fn cast(p: &mut Program, x: Value, to: DType) -> Value {
    push(p, Op::Cast(to), &[x])
}

/// Runs `p` as written and folded (then fused, as the backend compiles it) on
/// `args`, and checks that every result has the same bits; returns the
/// folded program.
fn same_bits(p: &Program, args: &[Tensor]) -> Result<Program> {
    let folded = fold_casts(p)?;
    let plain = Interpreter::new(p.clone(), Device::Cpu)?;
    let fused = Interpreter::with_fuser(folded.clone(), Device::Cpu, &CpuFuser)?;
    let (want, got) = (plain.run(args)?, fused.run(args)?);
    assert_eq!(want.len(), got.len());
    for (k, (w, g)) in want.iter().zip(&got).enumerate() {
        assert_eq!((w.dtype(), w.shape()), (g.dtype(), g.shape()), "result {k}");
        let bits = |t: &Tensor| -> Result<Vec<u64>> {
            Ok(t.to_dtype(DType::F64)?.to_vec::<f64>()?.iter().map(|v| v.to_bits()).collect())
        };
        let (w, g) = (bits(w)?, bits(g)?);
        let bad = w.iter().zip(&g).position(|(a, b)| a != b);
        assert!(bad.is_none(), "result {k} differs at element {bad:?}");
    }
    Ok(folded)
}

fn count(p: &Program, name: &str) -> usize {
    p.insts().iter().filter(|i| i.op.name() == name).count()
}

fn randn(shape: &[usize], dt: DType, seed: u64) -> Tensor {
    kiln_tensor::manual_seed(seed);
    Tensor::randn(shape, (DType::F32, Device::Cpu)).unwrap().to_dtype(dt).unwrap()
}

/// A query as an autocast attention layer rotates it: `q [b, t, h * d]` of
/// `dt` viewed as heads, cast to float32, transposed to `[b, h, t, d]`,
/// rotated with float32 tables, and cast back (`round`), or returned as
/// float32 too (`keep`).
fn rotary_program(dt: DType, (b, t, h, d): (usize, usize, usize, usize), keep: bool) -> Program {
    let mut p = Program::new();
    let q = p.add_param(ParamKind::Input(0), Meta::new(&[b, t, h * d], dt));
    let cos = p.add_param(ParamKind::Input(1), Meta::new(&[t, d], DType::F32));
    let sin = p.add_param(ParamKind::Input(2), Meta::new(&[t, d], DType::F32));
    let heads = push(&mut p, Op::View(ViewOp::Reshape(sv(&[b, t, h, d]))), &[q]);
    let wide = cast(&mut p, heads, DType::F32);
    let strides = sv(&[t * h * d, d, h * d, 1]);
    let tr = push(&mut p, Op::View(ViewOp::AsStrided { shape: sv(&[b, h, t, d]), strides, offset: 0 }), &[wide]);
    let r = push(&mut p, Op::Rotary, &[tr, cos, sin]);
    let back = cast(&mut p, r, dt);
    p.add_result(back, ResultKind::Fresh).unwrap();
    if keep {
        p.add_result(r, ResultKind::Fresh).unwrap();
    }
    p
}

#[test]
fn a_rotation_between_casts_reads_and_writes_the_narrow_values() -> Result<()> {
    // Odd sizes; then rows over several 64-row blocks and both threads.
    for (i, dims) in [(1, 5, 3, 6), (4, 70, 3, 64)].into_iter().enumerate() {
        for dt in [DType::BF16, DType::F16] {
            let (b, t, h, d) = dims;
            let p = rotary_program(dt, dims, false);
            let args =
                [randn(&[b, t, h * d], dt, i as u64), randn(&[t, d], DType::F32, 9), randn(&[t, d], DType::F32, 10)];
            let folded = same_bits(&p, &args)?;
            assert_eq!(count(&folded, "rotary_embedding (widened)"), 1, "{folded}");
            assert_eq!(count(&folded, "to") + count(&folded, "rotary_embedding"), 0, "{folded}");
        }
    }
    Ok(())
}

#[test]
fn a_float32_value_something_else_reads_is_kept() -> Result<()> {
    // The rotation is a result too: its float32 value stays, the input cast folds.
    let dims = (2, 7, 2, 8);
    let p = rotary_program(DType::BF16, dims, true);
    let args = [randn(&[2, 7, 16], DType::BF16, 1), randn(&[7, 8], DType::F32, 2), randn(&[7, 8], DType::F32, 3)];
    let folded = same_bits(&p, &args)?;
    assert_eq!((count(&folded, "rotary_embedding (widened)"), count(&folded, "to")), (1, 1), "{folded}");
    // A float32 input (no cast before): the output cast folds alone.
    let mut p = Program::new();
    let x = p.add_param(ParamKind::Input(0), Meta::new(&[3, 7, 8], DType::F32));
    let cos = p.add_param(ParamKind::Input(1), Meta::new(&[7, 8], DType::F32));
    let sin = p.add_param(ParamKind::Input(2), Meta::new(&[7, 8], DType::F32));
    let r = push(&mut p, Op::Rotary, &[x, cos, sin]);
    let back = cast(&mut p, r, DType::BF16);
    p.add_result(back, ResultKind::Fresh).unwrap();
    let args = [randn(&[3, 7, 8], DType::F32, 4), randn(&[7, 8], DType::F32, 5), randn(&[7, 8], DType::F32, 6)];
    let folded = same_bits(&p, &args)?;
    assert_eq!((count(&folded, "rotary_embedding (widened)"), count(&folded, "to")), (1, 0), "{folded}");
    Ok(())
}

/// The loss's shape under autocast: logits `[n, c, inner..]` of `dt` cast to
/// float32 and read by `logsumexp`, `gather` and `cross_entropy_backward`,
/// whose result is cast back to `dt`.
fn loss_program(dt: DType, shape: &[usize]) -> Program {
    let mut p = Program::new();
    let (n, rest) = (shape[0], &shape[2..]);
    let small: Vec<usize> = std::iter::once(n).chain(rest.iter().copied()).collect();
    let mut picked = small.clone();
    picked.insert(1, 1);
    let logits = p.add_param(ParamKind::Input(0), Meta::new(shape, dt));
    let target = p.add_param(ParamKind::Input(1), Meta::new(&small, DType::I64));
    let idx = p.add_param(ParamKind::Input(2), Meta::new(&picked, DType::I64));
    let w = p.add_param(ParamKind::Input(3), Meta::new(&small, DType::F32));
    let wide = cast(&mut p, logits, DType::F32);
    let lse = push(&mut p, Op::LogSumExp { dim: 1 }, &[wide]);
    let g = push(&mut p, Op::Gather { dim: 1 }, &[wide, idx]);
    let grad = push(&mut p, Op::CrossEntropyBackward { smoothing: 0.1 }, &[wide, target, w]);
    let back = cast(&mut p, grad, dt);
    for v in [lse, g, back] {
        p.add_result(v, ResultKind::Fresh).unwrap();
    }
    p
}

#[test]
fn the_loss_reads_narrow_logits_and_rounds_its_gradient() -> Result<()> {
    // Odd sizes, a trailing dim (inner > 1), and rows over both threads.
    for (i, shape) in [vec![7, 33], vec![5, 9, 3], vec![300, 1000]].into_iter().enumerate() {
        for dt in [DType::BF16, DType::F16] {
            let p = loss_program(dt, &shape);
            let c = shape[1];
            let small: Vec<usize> = std::iter::once(shape[0]).chain(shape[2..].iter().copied()).collect();
            let m: usize = small.iter().product();
            let t: Vec<i64> = (0..m).map(|k| ((k * 7 + 3) % c) as i64).collect();
            let mut picked = small.clone();
            picked.insert(1, 1);
            let args = [
                randn(&shape, dt, 20 + i as u64),
                Tensor::from_vec(t.clone(), &small)?,
                Tensor::from_vec(t, &picked)?,
                randn(&small, DType::F32, 30).abs()?,
            ];
            let folded = same_bits(&p, &args)?;
            assert_eq!(count(&folded, "logsumexp (widened)"), 1, "{folded}");
            assert_eq!(count(&folded, "cross_entropy_backward (widened)"), 1, "{folded}");
            // What is left of the casts: the gathered elements' own, `[n, 1, ..]`.
            let casts: Vec<_> = folded.insts().iter().filter(|i| i.op.name() == "to").collect();
            assert_eq!(casts.len(), 1, "{folded}");
            assert_eq!(casts[0].outs[0].shape.as_slice(), picked.as_slice());
        }
    }
    Ok(())
}

#[test]
fn a_normalisation_rounds_its_output_and_keeps_its_rstd() -> Result<()> {
    // Odd sizes, then rows over both threads; `y` cast for a product, `rstd` kept float32.
    for (i, (rows, d)) in [(3usize, 7usize), (2048, 384)].into_iter().enumerate() {
        for dt in [DType::BF16, DType::F16] {
            let mut p = Program::new();
            let x = p.add_param(ParamKind::Input(0), Meta::new(&[rows, d], DType::F32));
            let w = p.add_param(ParamKind::Input(1), Meta::new(&[d], DType::F32));
            let outs = p.push(Op::RmsNorm { eps: 1e-5 }, &[x, w]).unwrap();
            let y = cast(&mut p, outs[0], dt);
            p.add_result(y, ResultKind::Fresh).unwrap();
            p.add_result(outs[1], ResultKind::Fresh).unwrap();
            let args = [randn(&[rows, d], DType::F32, 40 + i as u64), randn(&[d], DType::F32, 41)];
            let folded = same_bits(&p, &args)?;
            assert_eq!((count(&folded, "rms_norm (rounded)"), count(&folded, "to")), (1, 0), "{folded}");
        }
    }
    Ok(())
}
