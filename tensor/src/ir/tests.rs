//! The program representation without any backend: building, the text
//! form, the verifier and the passes.
use super::*;
use crate::{BinaryOp, DType, Meta, Op, Scalar, UnaryOp, ViewOp};
use smallvec::smallvec;

fn state16() -> (Program, Value) {
    let mut p = Program::new();
    let s = p.add_param(ParamKind::State, Meta::new(&[16], DType::F32));
    (p, s)
}

#[test]
fn prints_the_documented_form() {
    let (mut p, s) = state16();
    let g = p.add_param(ParamKind::Generator, Meta::new(&[2], DType::I64));
    let x = p.add_param(ParamKind::Input(0), Meta::new(&[4, 4], DType::F32));
    let v = p.push(Op::View(ViewOp::Reshape(smallvec![4, 4])), &[s]).unwrap()[0];
    let bits = p.push(Op::RandomBits { shape: smallvec![4] }, &[g]).unwrap();
    let a = p.push(Op::Binary(BinaryOp::Add), &[v, x]).unwrap()[0];
    let half = p.push(Op::Full { shape: smallvec![], value: Scalar::Float(0.1), dtype: DType::F32 }, &[]).unwrap()[0];
    let k = p.push(Op::TopK { k: 2, dim: 1, largest: true }, &[a]).unwrap();
    let w = p.push(Op::Assign { shape: smallvec![4, 4], strides: smallvec![4, 1], offset: 0 }, &[s, a]).unwrap()[0];
    p.add_result(k[0], ResultKind::Fresh).unwrap();
    p.add_result(w, ResultKind::Update(0)).unwrap();
    p.add_result(bits[1], ResultKind::Update(1)).unwrap();
    let _ = half;
    p.verify().unwrap();
    let want = "\
program(%0: f32[16] state, %1: i64[2] generator, %2: f32[4, 4] input 0) {
  %3 = view(%0) {shape=[4, 4]} : f32[4, 4]
  %4, %5 = random_bits(%1) {shape=[4]} : i64[4], i64[2]
  %6 = add(%3, %2) : f32[4, 4]
  %7 = full() {shape=[], value=0.1, dtype=f32} : f32[]
  %8, %9 = topk(%6) {k=2, dim=1, largest=true} : f32[4, 2], i64[4, 2]
  %10 = copy_(%0, %6) {shape=[4, 4], strides=[4, 1], offset=0} : f32[16]
  return %8 fresh, %10 updates %0, %5 updates %1
}";
    assert_eq!(p.to_string(), want);
}

#[test]
fn verify_reruns_inference_on_every_instruction() {
    let (mut p, s) = state16();
    let e = p.push(Op::Unary(UnaryOp::Exp), &[s]).unwrap()[0];
    p.add_result(e, ResultKind::Fresh).unwrap();
    p.verify().unwrap();
    // An instruction declaring other outputs than its operands give.
    let mut bad = p.clone();
    bad.push_typed(Op::Unary(UnaryOp::Exp), &[s], smallvec![Meta::new(&[8], DType::F32)]).unwrap();
    let msg = bad.verify().unwrap_err().to_string();
    assert!(msg.contains("declares outputs f32[8] but its operands give f32[16]"), "{msg}");
    // An update of another type than its parameter, a constant updated, a non-bool check.
    let mut bad = p.clone();
    let c = bad.push(Op::Cast(DType::F64), &[s]).unwrap()[0];
    bad.add_result(c, ResultKind::Update(0)).unwrap();
    assert!(bad.verify().unwrap_err().to_string().contains("of another type"));
    let mut bad = p.clone();
    bad.set_param_kind(0, ParamKind::Constant).unwrap();
    bad.add_result(e, ResultKind::Update(0)).unwrap();
    assert!(bad.verify().unwrap_err().to_string().contains("updates the constant"));
    let mut bad = p.clone();
    bad.add_result(e, ResultKind::Check("x".into())).unwrap();
    assert!(bad.verify().unwrap_err().to_string().contains("not a bool scalar"));
}

#[test]
fn values_a_program_does_not_define_are_refused_where_they_enter() {
    let (mut p, s) = state16();
    let e = p.push(Op::Unary(UnaryOp::Exp), &[s]).unwrap()[0];
    let before = p.clone();
    // An operand not defined (yet): refused by `push_typed`, so no program
    // holds a use before its definition and printing, passes and the
    // interpreter never meet an unknown value.
    let ahead = Value(p.num_values() as u32);
    let msg = p.push_typed(Op::Unary(UnaryOp::Neg), &[ahead], smallvec![Meta::new(&[16], DType::F32)]);
    assert!(msg.unwrap_err().to_string().contains("%2 is not a value of the program"));
    assert!(p.push(Op::Unary(UnaryOp::Neg), &[Value(99)]).is_err());
    assert!(p.add_result(Value(99), ResultKind::Fresh).unwrap_err().to_string().contains("%99 is not a value"));
    let msg = p.add_result(e, ResultKind::Update(3)).unwrap_err().to_string();
    assert!(msg.contains("parameter 3, which does not exist"), "{msg}");
    assert!(p.set_param_kind(1, ParamKind::Constant).is_err());
    assert_eq!(p, before, "a refused verb leaves the program as it was");
    p.add_result(e, ResultKind::Fresh).unwrap();
    p.verify().unwrap();
    assert_eq!(p.dce().to_string(), p.to_string());
}

#[test]
fn a_nan_attribute_is_the_same_program_again() {
    // `fill_(NaN)` traced twice: the ops are unequal by `==` (NaN != NaN) but
    // the same program, or a capture holding one would never be stable.
    let build = |v: f64| {
        let mut p = Program::new();
        let f = p.push(Op::Full { shape: smallvec![2], value: Scalar::Float(v), dtype: DType::F32 }, &[]).unwrap()[0];
        p.add_result(f, ResultKind::Fresh).unwrap();
        p
    };
    assert_ne!(build(f64::NAN), build(f64::NAN));
    assert!(build(f64::NAN).same_as(&build(f64::NAN)));
    assert!(!build(f64::NAN).same_as(&build(1.0)));
    assert!(!build(0.0).same_as(&build(-0.0)), "signed zeros differ");
}

#[test]
fn dce_removes_what_no_result_needs() {
    let (mut p, s) = state16();
    let a = p.push(Op::Unary(UnaryOp::Exp), &[s]).unwrap()[0];
    let dead = p.push(Op::Unary(UnaryOp::Log), &[a]).unwrap()[0];
    let _dead2 = p.push(Op::Unary(UnaryOp::Neg), &[dead]).unwrap()[0];
    let b = p.push(Op::Unary(UnaryOp::Tanh), &[a]).unwrap()[0];
    p.add_result(b, ResultKind::Fresh).unwrap();
    let d = p.dce();
    d.verify().unwrap();
    let names: Vec<&str> = d.insts().iter().map(|i| i.op.name()).collect();
    assert_eq!(names, ["exp", "tanh"]);
    assert_eq!(d.params(), p.params(), "parameters are the signature: kept");
    assert_eq!(
        d.to_string(),
        "program(%0: f32[16] state) {\n  %1 = exp(%0) : f32[16]\n  %2 = tanh(%1) : f32[16]\n  return %2 fresh\n}"
    );
}

#[test]
fn cse_merges_equal_ops_on_equal_operands() {
    let (mut p, s) = state16();
    let a = p.push(Op::Unary(UnaryOp::Exp), &[s]).unwrap()[0];
    let b = p.push(Op::Unary(UnaryOp::Exp), &[s]).unwrap()[0];
    let c = p.push(Op::Unary(UnaryOp::Log), &[s]).unwrap()[0];
    let sum = p.push(Op::Binary(BinaryOp::Add), &[a, b]).unwrap()[0];
    let sum2 = p.push(Op::Binary(BinaryOp::Add), &[b, a]).unwrap()[0];
    // Same name, other attributes: kept apart.
    let full1 = p.push(Op::Full { shape: smallvec![], value: Scalar::Float(1.0), dtype: DType::F32 }, &[]).unwrap()[0];
    let full2 = p.push(Op::Full { shape: smallvec![], value: Scalar::Float(2.0), dtype: DType::F32 }, &[]).unwrap()[0];
    // Equal by `==` on floats, yet other values: kept apart too.
    let zero = p.push(Op::Full { shape: smallvec![], value: Scalar::Float(0.0), dtype: DType::F32 }, &[]).unwrap()[0];
    let negz = p.push(Op::Full { shape: smallvec![], value: Scalar::Float(-0.0), dtype: DType::F32 }, &[]).unwrap()[0];
    for v in [sum, sum2, c, full1, full2, zero, negz] {
        p.add_result(v, ResultKind::Fresh).unwrap();
    }
    let d = p.cse();
    d.verify().unwrap();
    let names: Vec<&str> = d.insts().iter().map(|i| i.op.name()).collect();
    // exp once; with b merged into a, add(a, b) and add(b, a) are both add(a, a): one.
    assert_eq!(names, ["exp", "log", "add", "full", "full", "full", "full"]);
    assert_eq!(d.results()[0].value, d.results()[1].value, "add(a, b) == add(b, a) once b is a");
    assert_ne!(d.results()[3].value, d.results()[4].value);
    assert_ne!(d.results()[5].value, d.results()[6].value, "full(0.0) is not full(-0.0)");
}

#[test]
fn renumbering_makes_equal_programs_equal() {
    // The same computation with parameters added late (as a recorder discovers them).
    let mut a = Program::new();
    let x = a.add_param(ParamKind::Input(0), Meta::new(&[3], DType::F32));
    let e = a.push(Op::Unary(UnaryOp::Exp), &[x]).unwrap()[0];
    let s = a.add_param(ParamKind::State, Meta::new(&[3], DType::F32));
    let m = a.push(Op::Binary(BinaryOp::Mul), &[e, s]).unwrap()[0];
    a.add_result(m, ResultKind::Fresh).unwrap();
    a.verify().unwrap();
    let r = a.renumbered();
    r.verify().unwrap();
    assert_eq!(
        r.to_string(),
        "program(%0: f32[3] input 0, %1: f32[3] state) {\n  %2 = exp(%0) : f32[3]\n  %3 = mul(%2, %1) : f32[3]\n  return %3 fresh\n}"
    );
    assert_eq!(r, r.renumbered());
}

/// A redistribution prints its mesh, view and placements, which tell it
/// apart from another one for `cse`; placements that do not fit the input
/// are refused when it is recorded.
#[test]
fn redistributions_print_their_placements_and_stay_apart() {
    use crate::op::placement::{Placement, Redistribution};
    let (mut p, s) = state16();
    let to = |placement| {
        std::sync::Arc::new(Redistribution {
            device: 3,
            axes: smallvec!["dp".into()],
            placements: smallvec![placement],
        })
    };
    let a = p.push(Op::Redistribute(to(Placement::Shard(0))), &[s]).unwrap()[0];
    let b = p.push(Op::Redistribute(to(Placement::Replicate)), &[s]).unwrap()[0];
    let c = p.push(Op::Redistribute(to(Placement::Shard(0))), &[s]).unwrap()[0];
    for v in [a, b, c] {
        p.add_result(v, ResultKind::Fresh).unwrap();
    }
    let text = p.to_string();
    assert!(text.contains("redistribute(%0) {mesh=3, axes=[dp], placements=[Shard(dim=0)]} : f32[16]"), "{text}");
    let d = p.cse();
    assert_eq!(d.insts().len(), 2, "{d}");
    assert_ne!(d.results()[0].value, d.results()[1].value);
    assert_eq!(d.results()[0].value, d.results()[2].value);
    let e = p.push(Op::Redistribute(to(Placement::Shard(1))), &[s]).unwrap_err().to_string();
    assert!(e.contains("Shard(dim=1) of a tensor with 1 dimension(s)"), "{e}");
}

/// A local region prints as one instruction with its body, a program of its
/// own, indented below it; two regions differ when their bodies do.
#[test]
fn a_local_region_prints_its_body_below_it() {
    use crate::op::placement::Placement;
    use crate::op::region::LocalRegion;
    let mut body = Program::new();
    let block = body.add_param(ParamKind::Input(0), Meta::new(&[4], DType::F32));
    let e = body.push(Op::Unary(UnaryOp::Exp), &[block]).unwrap()[0];
    body.add_result(e, ResultKind::Fresh).unwrap();
    let region = |body: Program| {
        let text: std::sync::Arc<str> = body.to_string().into();
        std::sync::Arc::new(LocalRegion {
            device: 0,
            ins: vec![Meta::new(&[16], DType::F32)],
            in_placements: vec![vec![Placement::Shard(0)]],
            outs: vec![Meta::new(&[16], DType::F32)],
            out_placements: vec![vec![Placement::Shard(0)]],
            checks: false,
            body: std::sync::Arc::new(body),
            text,
        })
    };
    let (mut p, s) = state16();
    let a = p.push(Op::LocalMap(region(body.clone())), &[s]).unwrap()[0];
    let mut other = body.clone();
    let l = other.push(Op::Unary(UnaryOp::Log), &[block]).unwrap()[0];
    other.results.clear();
    other.add_result(l, ResultKind::Fresh).unwrap();
    let b = p.push(Op::LocalMap(region(other)), &[s]).unwrap()[0];
    p.add_result(a, ResultKind::Fresh).unwrap();
    p.add_result(b, ResultKind::Fresh).unwrap();
    let text = p.to_string();
    let want = "  %1 = local_map(%0) {mesh=0, in=[[Shard(dim=0)]], out=[[Shard(dim=0)]], body=";
    assert!(text.contains(want), "{text}");
    assert!(text.contains("\n    program(%0: f32[4] input 0) {\n      %1 = exp(%0) : f32[4]\n"), "{text}");
    assert_eq!(p.cse().insts().len(), 2, "different bodies stay apart");
    // The wrong inputs for the region are refused where it is recorded.
    let (mut q, _) = state16();
    let t = q.add_param(ParamKind::State, Meta::new(&[8], DType::F32));
    let err = q.push(Op::LocalMap(region(body.clone())), &[t]).unwrap_err().to_string();
    assert!(err.contains("the region was recorded for inputs"), "{err}");
    // A region whose placements do not match its inputs is refused too (never indexed past).
    let mut short = (*region(body)).clone();
    short.in_placements.clear();
    let err = p.push(Op::LocalMap(std::sync::Arc::new(short)), &[s]).unwrap_err().to_string();
    assert!(err.contains("needs as many lists of placements, got 0 and 1"), "{err}");
}
