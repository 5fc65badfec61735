//! Fused groups (Note [Fused groups] in kiln-tensor): the groups a program
//! forms, and their results against the same program run an instruction at a
//! time, bit for bit, across block and thread boundaries and with broadcast
//! scalars and strided inputs.
use crate::kernels::CpuFuser;
use kiln_tensor::ir::{Executable, Fuser, Interpreter, ParamKind, Program, ResultKind, Value};
use kiln_tensor::{BinaryOp, DType, Device, Meta, Op, ReduceOp, Result, Scalar, Tensor, UnaryOp, ViewOp};

fn sv(x: &[usize]) -> smallvec::SmallVec<[usize; 6]> {
    x.iter().copied().collect()
}

fn push(p: &mut Program, op: Op, args: &[Value]) -> Value {
    p.push(op, args).unwrap()[0]
}

/// `x [n]` and `y [n]` inputs and state `w [n]`: a chain with a broadcast
/// scalar, a reduction reading a member in the middle (which ends the first
/// group), a second group reading the reduction, and `w` updated in place.
fn chain(n: usize) -> Program {
    let mut p = Program::new();
    let x = p.add_param(ParamKind::Input(0), Meta::new(&[n], DType::F32));
    let y = p.add_param(ParamKind::Input(1), Meta::new(&[n], DType::F32));
    let w = p.add_param(ParamKind::State, Meta::new(&[n], DType::F32));
    let un = |u| Op::Unary(u);
    let bin = |b| Op::Binary(b);
    let a = push(&mut p, bin(BinaryOp::Mul), &[x, y]);
    // A scalar enters between members: `full` and a broadcasting view.
    let s = push(&mut p, Op::Full { shape: sv(&[]), value: Scalar::Float(0.75), dtype: DType::F32 }, &[]);
    let sb = push(&mut p, Op::View(ViewOp::AsStrided { shape: sv(&[n]), strides: sv(&[0]), offset: 0 }), &[s]);
    let b = push(&mut p, bin(BinaryOp::Add), &[a, sb]);
    let c = push(&mut p, un(UnaryOp::Tanh), &[b]);
    let d = push(&mut p, bin(BinaryOp::Sub), &[c, x]);
    let e = push(&mut p, un(UnaryOp::Exp), &[d]);
    // Not fusible: ends the group; reads a member (so `d` is written out).
    let r = push(&mut p, Op::Reduce { op: ReduceOp::Sum, dims: sv(&[0]), keepdim: true }, &[d]);
    let rb = push(&mut p, Op::View(ViewOp::AsStrided { shape: sv(&[n]), strides: sv(&[0]), offset: 0 }), &[r]);
    let f = push(&mut p, bin(BinaryOp::Div), &[e, rb]);
    let g = push(&mut p, un(UnaryOp::Sqrt), &[f]);
    let h = push(&mut p, bin(BinaryOp::SiluMul), &[g, w]);
    let k = push(&mut p, bin(BinaryOp::Maximum), &[h, e]);
    let upd = push(&mut p, Op::Assign { shape: sv(&[n]), strides: sv(&[1]), offset: 0 }, &[w, k]);
    p.add_result(upd, ResultKind::Update(2)).unwrap();
    p.add_result(c, ResultKind::Fresh).unwrap();
    p.add_result(r, ResultKind::Fresh).unwrap();
    p
}

fn args(n: usize, seed: u64) -> Vec<Tensor> {
    kiln_tensor::manual_seed(seed);
    (0..3).map(|_| Tensor::randn(&[n], (DType::F32, Device::Cpu)).unwrap()).collect()
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()
}

/// Runs `p` on copies of `args` through `exe`, returning every result's bits.
fn run(exe: &dyn Executable, args: &[Tensor]) -> Result<Vec<Vec<u32>>> {
    let copies: Vec<Tensor> =
        args.iter().map(|a| Tensor::from_vec(a.to_vec::<f32>()?, a.shape())).collect::<Result<_>>()?;
    Ok(exe.run(&copies)?.iter().map(bits).collect())
}

#[test]
fn a_chain_forms_groups_around_what_cannot_fuse() -> Result<()> {
    let p = chain(5);
    let fused = Interpreter::with_fuser(p.clone(), Device::Cpu, &CpuFuser)?;
    let groups: Vec<_> = fused.groups().cloned().collect();
    assert_eq!(groups.len(), 2, "{groups:?}");
    // mul, add, tanh, sub, exp; then div, sqrt, silu_mul, maximum and the copy into w.
    assert_eq!(groups[0].members.len(), 5);
    assert_eq!(groups[1].members.len(), 5);
    // The copy is w's next value, which may go into w's storage (input 2: e, the sum, w).
    assert_eq!(groups[1].outputs.len(), 1);
    assert_eq!(groups[1].dests, vec![Some(2)]);
    // The first group writes what others read: c (a result), d (the sum's input), e (read later).
    assert_eq!(groups[0].outputs.len(), 3, "{groups:?}");
    // Inputs: x, y, the broadcast scalar; w, the reduction's broadcast and e.
    assert_eq!(groups[0].inputs.len(), 3);
    assert_eq!(groups[1].inputs.len(), 3);
    assert_eq!(groups[0].dests, vec![None; 3]);
    Ok(())
}

#[test]
fn fused_groups_give_the_unfused_bits_on_every_length() -> Result<()> {
    // Lengths around the 1024-element block and large enough to split over threads.
    for (i, n) in [1usize, 7, 1023, 1024, 1025, 3000, 70_001].into_iter().enumerate() {
        let p = chain(n);
        let a = args(n, 7 + i as u64);
        let plain = Interpreter::new(p.clone(), Device::Cpu)?;
        let fused = Interpreter::with_fuser(p, Device::Cpu, &CpuFuser)?;
        assert_eq!(fused.groups().count(), 2);
        let (want, got) = (run(&plain, &a)?, run(&fused, &a)?);
        for (k, (w, g)) in want.iter().zip(&got).enumerate() {
            let bad = w.iter().zip(g).position(|(x, y)| x != y);
            assert!(bad.is_none(), "n = {n}, result {k}: element {bad:?} differs");
        }
    }
    Ok(())
}

#[test]
fn strided_inputs_and_transposed_chains_fuse() -> Result<()> {
    // x [3, 50] read transposed ([50, 3], strides [1, 50]) beside y [50, 3].
    let mut p = Program::new();
    let x = p.add_param(ParamKind::Input(0), Meta::new(&[150], DType::F32));
    let y = p.add_param(ParamKind::Input(1), Meta::new(&[150], DType::F32));
    let xt = push(&mut p, Op::View(ViewOp::AsStrided { shape: sv(&[50, 3]), strides: sv(&[1, 50]), offset: 0 }), &[x]);
    let yv = push(&mut p, Op::View(ViewOp::Reshape(sv(&[50, 3]))), &[y]);
    let a = push(&mut p, Op::Binary(BinaryOp::Mul), &[xt, yv]);
    let b = push(&mut p, Op::Unary(UnaryOp::Sigmoid), &[a]);
    // A view of a member between members: the group must run before it.
    let bv = push(&mut p, Op::View(ViewOp::Reshape(sv(&[50, 3]))), &[b]);
    let c = push(&mut p, Op::Binary(BinaryOp::Sub), &[bv, xt]);
    p.add_result(c, ResultKind::Fresh).unwrap();
    let plain = Interpreter::new(p.clone(), Device::Cpu)?;
    let fused = Interpreter::with_fuser(p, Device::Cpu, &CpuFuser)?;
    // mul and sigmoid, then (after the view) sub.
    assert_eq!(fused.groups().count(), 1);
    let a = args(150, 3);
    assert_eq!(run(&plain, &a[..2])?, run(&fused, &a[..2])?);
    Ok(())
}

/// An optimizer's shape: state `m` read and its next value written, `w`
/// written twice (decay, then the step) and read between, a broadcast scalar.
fn update(n: usize) -> Program {
    let mut p = Program::new();
    let g = p.add_param(ParamKind::Input(0), Meta::new(&[n], DType::F32));
    let w = p.add_param(ParamKind::State, Meta::new(&[n], DType::F32));
    let m = p.add_param(ParamKind::State, Meta::new(&[n], DType::F32));
    let s = push(&mut p, Op::Full { shape: sv(&[]), value: Scalar::Float(0.9), dtype: DType::F32 }, &[]);
    let sb =
        push(&mut p, Op::View(ViewOp::AsStrided { shape: sv(&[2, n / 2]), strides: sv(&[0, 0]), offset: 0 }), &[s]);
    let whole = Op::Assign { shape: sv(&[2, n / 2]), strides: sv(&[n / 2, 1]), offset: 0 };
    let w2 = push(&mut p, Op::View(ViewOp::Reshape(sv(&[2, n / 2]))), &[w]);
    let decayed = push(&mut p, Op::Binary(BinaryOp::Mul), &[w2, sb]);
    let w_next = push(&mut p, whole.clone(), &[w, decayed]);
    let m2 = push(&mut p, Op::View(ViewOp::Reshape(sv(&[2, n / 2]))), &[m]);
    let g2 = push(&mut p, Op::View(ViewOp::Reshape(sv(&[2, n / 2]))), &[g]);
    let mg = push(&mut p, Op::Binary(BinaryOp::Mul), &[m2, sb]);
    let m_new = push(&mut p, Op::Binary(BinaryOp::Add), &[mg, g2]);
    let m_next = push(&mut p, whole.clone(), &[m, m_new]);
    // Reads the decayed w through its storage's new value, then writes w again.
    let wv = push(&mut p, Op::View(ViewOp::Reshape(sv(&[2, n / 2]))), &[w_next]);
    let mv = push(&mut p, Op::View(ViewOp::Reshape(sv(&[2, n / 2]))), &[m_next]);
    let step = push(&mut p, Op::Unary(UnaryOp::Tanh), &[mv]);
    let w_new = push(&mut p, Op::Binary(BinaryOp::Sub), &[wv, step]);
    let w_last = push(&mut p, whole, &[w_next, w_new]);
    // Old m read after its next value is computed, and old w read after the
    // group (by pow, which does not fuse): w's storage must not be written.
    let extra = push(&mut p, Op::Binary(BinaryOp::Mul), &[m2, g2]);
    let old = push(&mut p, Op::Binary(BinaryOp::Pow), &[w2, extra]);
    p.add_result(w_last, ResultKind::Update(1)).unwrap();
    p.add_result(m_next, ResultKind::Update(2)).unwrap();
    p.add_result(old, ResultKind::Fresh).unwrap();
    p
}

#[test]
fn an_update_is_one_group_writing_its_state_in_place() -> Result<()> {
    for (i, n) in [2usize, 8, 2050, 80_000].into_iter().enumerate() {
        let p = update(n);
        let fused = Interpreter::with_fuser(p.clone(), Device::Cpu, &CpuFuser)?;
        let groups: Vec<_> = fused.groups().cloned().collect();
        assert_eq!(groups.len(), 1, "{groups:?}");
        // w, m and the product pow reads; w and m may go into their storages.
        assert_eq!(groups[0].outputs.len(), 3);
        assert_eq!(groups[0].dests.iter().filter(|d| d.is_some()).count(), 2, "{groups:?}");
        let a = args(n, 40 + i as u64);
        let plain = Interpreter::new(p, Device::Cpu)?;
        assert_eq!(run(&plain, &a)?, run(&fused, &a)?, "n = {n}");
    }
    Ok(())
}

#[test]
fn a_group_writes_a_storage_only_where_its_inputs_read_it_element_for_element() -> Result<()> {
    // out = x * 2 + x[0] (x read whole and as a broadcast element), offered x's storage.
    let n = 3000;
    let mut p = Program::new();
    let x = p.add_param(ParamKind::State, Meta::new(&[n], DType::F32));
    let two = push(&mut p, Op::Full { shape: sv(&[]), value: Scalar::Float(2.0), dtype: DType::F32 }, &[]);
    let tb = push(&mut p, Op::View(ViewOp::AsStrided { shape: sv(&[n]), strides: sv(&[0]), offset: 0 }), &[two]);
    let x0 = push(&mut p, Op::View(ViewOp::AsStrided { shape: sv(&[n]), strides: sv(&[0]), offset: 0 }), &[x]);
    let d = push(&mut p, Op::Binary(BinaryOp::Mul), &[x, tb]);
    let e = push(&mut p, Op::Binary(BinaryOp::Add), &[d, x0]);
    let next = push(&mut p, Op::Assign { shape: sv(&[n]), strides: sv(&[1]), offset: 0 }, &[x, e]);
    p.add_result(next, ResultKind::Update(0)).unwrap();
    let plain = Interpreter::new(p.clone(), Device::Cpu)?;
    let fused = Interpreter::with_fuser(p.clone(), Device::Cpu, &CpuFuser)?;
    let groups: Vec<_> = fused.groups().cloned().collect();
    assert_eq!(groups.len(), 1);
    let a = args(n, 5);
    // Written in place, the later blocks would add the new x[0] (2 * x[0] + x[0]).
    assert_eq!(run(&plain, &a[..1])?, run(&fused, &a[..1])?);
    // The kernel itself: refused for the broadcast reader, taken without it.
    let kernel = CpuFuser.compile(&p, &groups[0])?;
    let xs = Tensor::from_vec(a[0].to_vec::<f32>()?, &[n])?;
    let ins: Vec<Tensor> = groups[0].inputs.iter().map(|v| input_view(&p, *v, &xs)).collect::<Result<_>>()?;
    let refs: Vec<&Tensor> = ins.iter().collect();
    let out = kernel.run(&refs, &[Some(&xs)])?;
    assert!(!std::sync::Arc::ptr_eq(&out[0], xs.storage()), "a broadcast reader of the destination was ignored");
    Ok(())
}

/// The tensor the interpreter would hold for `v` when parameter 0 is `x`.
fn input_view(p: &Program, v: Value, x: &Tensor) -> Result<Tensor> {
    match p.def(v) {
        kiln_tensor::ir::Def::Param(_) => Ok(x.clone()),
        kiln_tensor::ir::Def::Inst(i, _) => match &p.insts()[i].op {
            Op::View(ViewOp::AsStrided { shape, strides, offset }) if p.insts()[i].args[0] == p.params()[0].value => {
                x.as_strided(shape, strides, Some(*offset))
            }
            _ => Tensor::full(&[], 2.0, (DType::F32, Device::Cpu))?.as_strided(&[x.numel()], &[0], Some(0)),
        },
    }
}

/// KILN_PROFILE covers interpreted programs: each instruction under its op's
/// name, each fused group as `fused` with its members' names.
#[test]
fn the_profiler_times_instructions_and_fused_groups() -> Result<()> {
    let exe = Interpreter::with_fuser(chain(64), Device::Cpu, &CpuFuser)?;
    let a = args(64, 5);
    kiln_tensor::profile::enable(true);
    let ran = run(&exe, &a);
    let rows = kiln_tensor::profile::take();
    kiln_tensor::profile::enable(false);
    ran?;
    let has = |op: &str, shapes: &str| rows.iter().any(|r| r.op == op && r.shapes == shapes && r.calls >= 1);
    assert!(has("sum", "[64]"), "{rows:?}");
    assert!(has("fused", "mul+add+tanh+sub+exp over 64 elements"), "{rows:?}");
    assert!(has("fused", "div+sqrt+silu_mul+maximum+copy_ over 64 elements"), "{rows:?}");
    Ok(())
}

/// Float32 values where rounding to bfloat16 is delicate: ties (to even,
/// either way), the largest finite value (rounds to infinity), a
/// subnormal, signed zero, infinity and NaN, then random values.
fn delicate(n: usize, seed: u64) -> Vec<f32> {
    let special = [1.003_906_3, 1.011_718_8, -1.003_906_3, f32::MAX, 1e-40, -0.0, f32::INFINITY, f32::NAN];
    let rest = args(n, seed)[0].to_vec::<f32>().unwrap();
    special.iter().copied().chain(rest).take(n).collect()
}

#[test]
fn casts_at_a_groups_edges_keep_the_eager_bits() -> Result<()> {
    // r = widen(a) + x, written as float32 and rounded to bfloat16; the rounded
    // value read back (widened) into s = that * x. One group, every cast inside.
    for (i, n) in [5usize, 1025, 70_001].into_iter().enumerate() {
        let mut p = Program::new();
        let a = p.add_param(ParamKind::Input(0), Meta::new(&[n], DType::BF16));
        let x = p.add_param(ParamKind::Input(1), Meta::new(&[n], DType::F32));
        let wide = push(&mut p, Op::Cast(DType::F32), &[a]);
        let r = push(&mut p, Op::Binary(BinaryOp::Add), &[wide, x]);
        let rb = push(&mut p, Op::Cast(DType::BF16), &[r]);
        let back = push(&mut p, Op::Cast(DType::F32), &[rb]);
        let s = push(&mut p, Op::Binary(BinaryOp::Mul), &[back, x]);
        for v in [r, rb, s] {
            p.add_result(v, ResultKind::Fresh).unwrap();
        }
        let fused = Interpreter::with_fuser(p.clone(), Device::Cpu, &CpuFuser)?;
        let groups: Vec<_> = fused.groups().cloned().collect();
        assert_eq!((groups.len(), groups[0].members.len()), (1, 5), "{groups:?}");
        let xs = delicate(n, 60 + i as u64);
        let args = [
            Tensor::from_vec(xs.iter().rev().copied().collect::<Vec<f32>>(), &[n])?.to_dtype(DType::BF16)?,
            Tensor::from_vec(xs, &[n])?,
        ];
        let plain = Interpreter::new(p, Device::Cpu)?;
        let (want, got) = (plain.run(&args)?, fused.run(&args)?);
        for (k, (w, g)) in want.iter().zip(&got).enumerate() {
            assert_eq!(w.dtype(), g.dtype());
            let bits = |t: &Tensor| -> Result<Vec<u32>> {
                Ok(t.to_dtype(DType::F32)?.to_vec::<f32>()?.iter().map(|v| v.to_bits()).collect())
            };
            let (w, g) = (bits(w)?, bits(g)?);
            let bad = w.iter().zip(&g).position(|(a, b)| a != b);
            assert!(bad.is_none(), "n = {n}, result {k}: element {bad:?} differs");
        }
    }
    Ok(())
}
