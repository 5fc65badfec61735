//! gather, scatter, index_select, index_add, cat and nonzero.
use super::*;
use kiln_tensor::{Error, ScatterReduce};

fn idx(v: &[i64], shape: &[usize]) -> Tensor {
    t(v.to_vec(), shape)
}

fn index_err(r: kiln_tensor::Result<Tensor>, want: &str) {
    match r {
        Err(e @ Error::Index { .. }) => assert!(e.to_string().contains(want), "{e}"),
        other => panic!("expected an index error, got {other:?}"),
    }
}

#[test]
fn gather_along_dims() {
    let x = f32s(&[1., 2., 3., 4., 5., 6.], &[2, 3]);
    let g1 = run(Op::Gather { dim: 1 }, &[&x, &idx(&[2, 0, 0, 1, 1, 1], &[2, 3])]);
    assert_eq!(vals::<f32>(&g1), [3., 1., 1., 5., 5., 5.]);
    // Index smaller than the input in the other dim.
    let g0 = run(Op::Gather { dim: 0 }, &[&x, &idx(&[1, 0], &[1, 2])]);
    assert_eq!(vals::<f32>(&g0), [4., 2.]);
    // A transposed input and a transposed index.
    let g = run(Op::Gather { dim: 1 }, &[&x.t().unwrap(), &idx(&[1, 0, 0], &[1, 3]).t().unwrap()]);
    assert_eq!(vals::<f32>(&g), [4., 2., 3.]);
    index_err(
        Tensor::apply1(Op::Gather { dim: 1 }, &[&x, &idx(&[3], &[1, 1])]),
        "index 3 is out of bounds for dimension 1 with size 3",
    );
    index_err(
        Tensor::apply1(Op::Gather { dim: 0 }, &[&x, &idx(&[-1], &[1, 1])]),
        "index -1 is out of bounds for dimension 0 with size 2",
    );
}

#[test]
fn scatter_replace_and_add() {
    let base = f32s(&[0.; 6], &[3, 2]);
    let src = f32s(&[1., 2., 3., 4., 5., 6.], &[3, 2]);
    let add =
        run(Op::Scatter { dim: 0, reduce: ScatterReduce::Add }, &[&base, &idx(&[0, 1, 0, 1, 2, 1], &[3, 2]), &src]);
    assert_eq!(vals::<f32>(&add), [4., 0., 0., 12., 5., 0.]);
    let rep = run(Op::Scatter { dim: 0, reduce: ScatterReduce::Replace }, &[&base, &idx(&[0, 1, 0, 1], &[2, 2]), &src]);
    // Duplicates: the later write wins.
    assert_eq!(vals::<f32>(&rep), [3., 0., 0., 4., 0., 0.]);
    // Index [2, 2] smaller than src [2, 3] along dim 1 into a non-zero base.
    let b2 = f32s(&[1., 1., 1., 1., 1., 1.], &[2, 3]);
    let s2 = f32s(&[10., 20., 30., 40., 50., 60.], &[2, 3]);
    let r = run(Op::Scatter { dim: 1, reduce: ScatterReduce::Add }, &[&b2, &idx(&[2, 2, 0, 1], &[2, 2]), &s2]);
    assert_eq!(vals::<f32>(&r), [1., 1., 31., 41., 51., 1.]);
    // bf16 adds round after each addition.
    let hb = t(bf(&[256.0]), &[1]);
    let hs = t(bf(&[1.0, 1.0]), &[2]);
    let h = run(Op::Scatter { dim: 0, reduce: ScatterReduce::Add }, &[&hb, &idx(&[0, 0], &[2]), &hs]);
    assert_eq!(vals::<bf16>(&h), bf(&[256.0]));
    index_err(
        Tensor::apply1(Op::Scatter { dim: 0, reduce: ScatterReduce::Add }, &[&base, &idx(&[3, 0], &[1, 2]), &src]),
        "index 3 is out of bounds for dimension 0 with size 3",
    );
}

#[test]
fn index_select_and_index_add() {
    let x = t((0..12).collect::<Vec<i32>>(), &[3, 4]);
    let s1 = run(Op::IndexSelect { dim: 1 }, &[&x, &idx(&[3, 0, 3], &[3])]);
    assert_eq!(s1.shape(), &[3, 3]);
    assert_eq!(vals::<i32>(&s1), [3, 0, 3, 7, 4, 7, 11, 8, 11]);
    let s0 = run(Op::IndexSelect { dim: 0 }, &[&x, &idx(&[2, 2, 0], &[3])]);
    assert_eq!(vals::<i32>(&s0), [8, 9, 10, 11, 8, 9, 10, 11, 0, 1, 2, 3]);
    let sc = run(Op::IndexSelect { dim: 0 }, &[&x.t().unwrap(), &idx(&[1], &[])]);
    assert_eq!(vals::<i32>(&sc), [1, 5, 9]);
    // A large embedding-style lookup (threaded row copies).
    let table = f32s(&noise(1000 * 64, 4), &[1000, 64]);
    let ids: Vec<i64> = (0..2000).map(|i| (i * 7919 % 1000) as i64).collect();
    let e = vals::<f32>(&run(Op::IndexSelect { dim: 0 }, &[&table, &idx(&ids, &[2000])]));
    let tv = noise(1000 * 64, 4);
    assert!(ids
        .iter()
        .enumerate()
        .all(|(r, &i)| e[r * 64..(r + 1) * 64] == tv[i as usize * 64..(i as usize + 1) * 64]));
    index_err(
        Tensor::apply1(Op::IndexSelect { dim: 1 }, &[&x, &idx(&[4], &[1])]),
        "index 4 is out of bounds for dimension 1 with size 4",
    );

    let base = f32s(&[1.; 6], &[3, 2]);
    let src = f32s(&[1., 2., 3., 4., 5., 6.], &[3, 2]);
    let a = run(Op::IndexAdd { dim: 0 }, &[&base, &idx(&[2, 0, 2], &[3]), &src]);
    assert_eq!(vals::<f32>(&a), [4., 5., 1., 1., 7., 9.]);
    let a1 = run(Op::IndexAdd { dim: 1 }, &[&base, &idx(&[1], &[1]), &f32s(&[10., 20., 30.], &[3, 1])]);
    assert_eq!(vals::<f32>(&a1), [1., 11., 1., 21., 1., 31.]);
    index_err(
        Tensor::apply1(Op::IndexAdd { dim: 0 }, &[&base, &idx(&[-2, 0, 0], &[3]), &src]),
        "index -2 is out of bounds for dimension 0 with size 3",
    );
}

#[test]
fn cat_strided_inputs() {
    let a = f32s(&[1., 2., 3., 4.], &[2, 2]);
    let b = f32s(&[5., 6., 7., 8., 9., 10.], &[3, 2]).t().unwrap(); // [2, 3]
    let c = run(Op::Cat { dim: 1 }, &[&a, &b]);
    assert_eq!(c.shape(), &[2, 5]);
    assert_eq!(vals::<f32>(&c), [1., 2., 5., 7., 9., 3., 4., 6., 8., 10.]);
    let e = f32s(&[], &[0, 2]);
    let d = run(Op::Cat { dim: 0 }, &[&a, &e, &a.t().unwrap()]);
    assert_eq!(vals::<f32>(&d), [1., 2., 3., 4., 1., 3., 2., 4.]);
    let n = 200_000;
    let big = run(Op::Cat { dim: 0 }, &[&f32s(&noise(n, 1), &[n]), &f32s(&noise(n, 2), &[n])]);
    let v = vals::<f32>(&big);
    assert!(v[..n] == noise(n, 1)[..] && v[n..] == noise(n, 2)[..]);
}

#[test]
fn nonzero_coordinates() {
    let x = f32s(&[0., 1., 0., f32::NAN, 0., 2.], &[2, 3]);
    let nz = x.nonzero().unwrap();
    assert_eq!(nz.shape(), &[3, 2]);
    assert_eq!(vals::<i64>(&nz), [0, 1, 1, 0, 1, 2]);
    let tz = x.t().unwrap().nonzero().unwrap();
    assert_eq!(vals::<i64>(&tz), [0, 1, 1, 0, 2, 1]);
}
