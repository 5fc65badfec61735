//! sort and topk.
use super::*;

#[test]
fn sort_is_stable_and_puts_nan_last() {
    let x = f32s(&[3., 1., f32::NAN, 1., 2., 3.], &[6]);
    let (v, i) = run2(Op::Sort { dim: 0, descending: false, stable: true }, &[&x]);
    assert!(same_f32(&vals::<f32>(&v), &[1., 1., 2., 3., 3., f32::NAN]));
    assert_eq!(vals::<i64>(&i), [1, 3, 4, 0, 5, 2]);
    let (v, i) = run2(Op::Sort { dim: 0, descending: true, stable: false }, &[&x]);
    assert!(same_f32(&vals::<f32>(&v), &[f32::NAN, 3., 3., 2., 1., 1.]));
    assert_eq!(vals::<i64>(&i), [2, 0, 5, 4, 1, 3]);
    // Along dim 0 of a matrix (not the last dim), and integers.
    let m = t(vec![3i32, 1, 2, 5, 1, 4], &[3, 2]);
    let (v, i) = run2(Op::Sort { dim: 0, descending: false, stable: true }, &[&m]);
    assert_eq!(vals::<i32>(&v), [1, 1, 2, 4, 3, 5]);
    assert_eq!(vals::<i64>(&i), [2, 0, 1, 2, 0, 1]);
    let (v, _) = run2(Op::Sort { dim: 1, descending: true, stable: true }, &[&m.t().unwrap()]);
    assert_eq!(vals::<i32>(&v), [3, 2, 1, 5, 4, 1]);
}

#[test]
fn topk_sorted_with_lowest_index_ties() {
    let x = f32s(&[1., 5., 3., 5., f32::NAN, 0., 3., 2.], &[2, 4]);
    let (v, i) = run2(Op::TopK { k: 2, dim: 1, largest: true }, &[&x]);
    assert!(same_f32(&vals::<f32>(&v), &[5., 5., f32::NAN, 3.]));
    assert_eq!(vals::<i64>(&i), [1, 3, 0, 2]);
    let (v, i) = run2(Op::TopK { k: 3, dim: 1, largest: false }, &[&x]);
    assert!(same_f32(&vals::<f32>(&v), &[1., 3., 5., 0., 2., 3.]));
    assert_eq!(vals::<i64>(&i), [0, 2, 1, 1, 3, 2]);
    let (v, i) = run2(Op::TopK { k: 1, dim: 0, largest: true }, &[&x]);
    assert!(same_f32(&vals::<f32>(&v), &[f32::NAN, 5., 3., 5.]));
    assert_eq!(vals::<i64>(&i), [1, 0, 0, 0]);
    let (v, _) = run2(Op::TopK { k: 0, dim: 1, largest: true }, &[&x]);
    assert_eq!(v.shape(), &[2, 0]);
    // A long row (selection, then a sort of the top k).
    let n = 50_000;
    let r = noise(n, 8);
    let (v, i) = run2(Op::TopK { k: 5, dim: 0, largest: true }, &[&f32s(&r, &[n])]);
    let mut sorted = r.clone();
    sorted.sort_by(|a, b| b.partial_cmp(a).unwrap());
    assert_eq!(vals::<f32>(&v), sorted[..5]);
    assert!(vals::<i64>(&i).iter().zip(&sorted[..5]).all(|(&j, &w)| r[j as usize] == w));
}

#[test]
fn many_lines_sort_in_parallel_as_one_by_one() {
    // 64 rows of 200: enough work that the lines are split across tasks.
    let (rows, n) = (64, 200);
    let r: Vec<f32> = noise(rows * n, 3).iter().map(|v| (v * 8.0).round()).collect();
    let (v, i) = run2(Op::Sort { dim: 1, descending: false, stable: true }, &[&f32s(&r, &[rows, n])]);
    let (v, i) = (vals::<f32>(&v), vals::<i64>(&i));
    for row in 0..rows {
        let line = &r[row * n..][..n];
        let mut want: Vec<(f32, i64)> = line.iter().enumerate().map(|(j, &x)| (x, j as i64)).collect();
        want.sort_by(|a, b| a.0.partial_cmp(&b.0).unwrap());
        assert_eq!(v[row * n..][..n], want.iter().map(|p| p.0).collect::<Vec<_>>()[..], "row {row}");
        assert_eq!(i[row * n..][..n], want.iter().map(|p| p.1).collect::<Vec<_>>()[..], "row {row}");
    }
}
