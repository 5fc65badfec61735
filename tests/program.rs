//! kiln's program representation run by a backend's default `compile` (the
//! interpreter), without any plugin: state updated in place, the functional
//! meaning of writes (a value read after its storage was written is the old
//! value), views of values, and arguments checked.
use kiln::prelude::*;
use kiln::tensor::ir::{ParamKind, Program, ResultKind};
use kiln::tensor::{Shape, UnaryOp, ViewOp};
use kiln::{Meta, Op};

fn sv(x: &[usize]) -> Shape {
    x.into()
}

fn flat(v: &[f32]) -> Tensor {
    Tensor::from_slice(v, &[v.len()]).unwrap()
}

fn run(p: &Program, args: &[Tensor]) -> Vec<Tensor> {
    let exe = Device::Cpu.backend().unwrap().compile(p, Device::Cpu).unwrap();
    exe.run(args).unwrap()
}

/// `%0` state [4]; `%2` a view of it; `%3 = copy_(%0[1:3], %1)` updates
/// `%0`; `%4 = neg(%2)` reads the view of the value before the write, `%5 =
/// neg(%3)` the value after.
fn write_then_read_old() -> Program {
    let mut p = Program::new();
    let s = p.add_param(ParamKind::State, Meta::new(&[4], DType::F32));
    let x = p.add_param(ParamKind::Input(0), Meta::new(&[2], DType::F32));
    let r = p.push(Op::View(ViewOp::Reshape(sv(&[2, 2]))), &[s]).unwrap()[0];
    let w = p.push(Op::Assign { shape: sv(&[2]), strides: sv(&[1]), offset: 1 }, &[s, x]).unwrap()[0];
    let old = p.push(Op::Unary(UnaryOp::Neg), &[r]).unwrap()[0];
    let new = p.push(Op::Unary(UnaryOp::Neg), &[w]).unwrap()[0];
    p.add_result(w, ResultKind::Update(0));
    p.add_result(old, ResultKind::Fresh);
    p.add_result(new, ResultKind::Fresh);
    p
}

#[test]
fn an_update_writes_the_state_and_earlier_reads_see_the_old_value() {
    let p = write_then_read_old();
    p.verify().unwrap();
    let state = flat(&[1.0, 2.0, 3.0, 4.0]);
    let x = flat(&[-7.0, -8.0]);
    let v0 = state.storage().version();
    let out = run(&p, &[state.clone(), x.clone()]);
    assert_eq!(state.to_vec::<f32>().unwrap(), [1.0, -7.0, -8.0, 4.0], "the state is written");
    assert!(state.storage().version() > v0, "and its version moved");
    assert!(out[0].shares_storage(&state), "an update's result is the state itself");
    assert_eq!(out[1].shape(), [2, 2]);
    assert_eq!(out[1].to_vec::<f32>().unwrap(), [-1.0, -2.0, -3.0, -4.0], "read before the write: the old value");
    assert_eq!(out[2].to_vec::<f32>().unwrap(), [-1.0, 7.0, 8.0, -4.0]);
    assert_eq!(x.to_vec::<f32>().unwrap(), [-7.0, -8.0], "an input not updated is left alone");
}

#[test]
fn an_input_not_updated_is_never_written_in_place() {
    // `%1 = copy_(%0, ..)` with `%0` an input the program does not update: a copy is written.
    let mut p = Program::new();
    let s = p.add_param(ParamKind::Input(0), Meta::new(&[3], DType::F32));
    let one = p.push(Op::Full { shape: sv(&[1]), value: Scalar::Float(9.0), dtype: DType::F32 }, &[]).unwrap()[0];
    let w = p.push(Op::Assign { shape: sv(&[1]), strides: sv(&[1]), offset: 2 }, &[s, one]).unwrap()[0];
    p.add_result(w, ResultKind::Fresh);
    let x = flat(&[1.0, 2.0, 3.0]);
    let out = run(&p, std::slice::from_ref(&x));
    assert_eq!(out[0].to_vec::<f32>().unwrap(), [1.0, 2.0, 9.0]);
    assert_eq!(x.to_vec::<f32>().unwrap(), [1.0, 2.0, 3.0]);
}

#[test]
fn views_index_the_values_row_major_elements() {
    // A transposed read of a [2, 3] value, then as_strided of that (non-contiguous) value.
    let mut p = Program::new();
    let s = p.add_param(ParamKind::Input(0), Meta::new(&[6], DType::F32));
    let m = p.push(Op::View(ViewOp::Reshape(sv(&[2, 3]))), &[s]).unwrap()[0];
    let t = p.push(Op::View(ViewOp::Permute(sv(&[1, 0]))), &[m]).unwrap()[0];
    // The value t is [[0, 3], [1, 4], [2, 5]]; its row-major elements 1..5 with stride 2: 3, 4.
    let a = p.push(Op::View(ViewOp::AsStrided { shape: sv(&[2]), strides: sv(&[2]), offset: 1 }), &[t]).unwrap()[0];
    p.add_result(t, ResultKind::Fresh);
    p.add_result(a, ResultKind::Fresh);
    let out = run(&p, &[flat(&[0.0, 1.0, 2.0, 3.0, 4.0, 5.0])]);
    assert_eq!(out[0].to_vec::<f32>().unwrap(), [0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
    assert_eq!(out[1].to_vec::<f32>().unwrap(), [3.0, 4.0]);
}

#[test]
fn arguments_of_the_wrong_type_or_count_are_refused() {
    let p = write_then_read_old();
    let exe = Device::Cpu.backend().unwrap().compile(&p, Device::Cpu).unwrap();
    let e = exe.run(&[flat(&[1.0; 4])]).map(|_| ()).unwrap_err().to_string();
    assert!(e.contains("takes 2 arguments, got 1"), "{e}");
    let e = exe.run(&[flat(&[1.0; 5]), flat(&[1.0; 2])]).map(|_| ()).unwrap_err().to_string();
    assert!(e.contains("argument %0 is [5] float32 on cpu, the program expects [4] float32 on cpu"), "{e}");
    // A program that does not verify is not compiled.
    let mut bad = p.clone();
    bad.params[0].kind = ParamKind::Constant;
    let e = Device::Cpu.backend().unwrap().compile(&bad, Device::Cpu).map(|_| ()).unwrap_err().to_string();
    assert!(e.contains("updates the constant"), "{e}");
}
