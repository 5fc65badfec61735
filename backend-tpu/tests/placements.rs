//! Placements over a mesh that keep a captured step's collectives at its
//! recipe's minimum (Note [Placements of results], Note [Partial sums and
//! reduce-scatter]): a partial sum redistributed to its split is one
//! reduce-scatter; a batch split survives reshapes, windows, the embedding
//! lookup, concatenation and gathers. Each is checked in the lowered program
//! and, on the XLA:CPU plugin's four devices, against the host's values.
mod support;

use kiln_tensor::{distribute_tensor, Device, DeviceKind, DeviceMesh, Layout, Op, Placement};
use kiln_tpu::lower::{lower_mesh_program, lower_program, shard, Constants, Sharding};
use support::setup;

fn mesh(shape: &[usize], names: &[&str]) -> DeviceMesh {
    setup();
    kiln_tensor::init_device_mesh(DeviceKind::Tpu, shape, names).unwrap()
}

fn data(n: usize, seed: f32) -> Vec<f32> {
    (0..n).map(|i| ((i as f32 * 0.37 + seed).sin() * 4.0).round() / 4.0).collect()
}

fn host_matmul(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut y = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            y[i * n + j] = (0..k).map(|p| x[i * k + p] * w[p * n + j]).sum();
        }
    }
    y
}

/// `f` captured over `m` and run on `inputs` (host tensors placed by `placements`):
/// its results gathered to the host, and the module its program lowers to.
fn run_captured(
    m: &DeviceMesh,
    inputs: &[(kiln_tensor::Tensor, Vec<Placement>)],
    f: impl FnMut(&[kiln_tensor::Tensor]) -> kiln_tensor::Result<Vec<kiln_tensor::Tensor>>,
) -> (Vec<Vec<f32>>, String) {
    let placed: Vec<_> = inputs.iter().map(|(t, p)| distribute_tensor(t, m, p).unwrap()).collect();
    let mut step = kiln_tensor::capture::compile(m.device(), f);
    let outs = step.call(&placed).unwrap();
    let values = outs.iter().map(|o| o.full_tensor().unwrap().to_vec::<f32>().unwrap()).collect();
    let program = step.program().unwrap();
    let params =
        inputs.iter().map(|(t, p)| (Sharding::from_placements(m, p, t.ndim()).unwrap(), t.shape().to_vec())).collect();
    let text = lower_mesh_program(&program, m, params).unwrap().module.text();
    (values, text)
}

#[test]
fn a_partial_sum_redistributed_to_its_split_is_one_reduce_scatter() {
    let (x, w) = (data(8 * 16, 0.3), data(16 * 4, 1.1));
    let want = host_matmul(&x, &w, 8, 16, 4);
    let xt = kiln_tensor::Tensor::from_vec(x, &[8, 16]).unwrap();
    let wt = kiln_tensor::Tensor::from_vec(w, &[16, 4]).unwrap();
    // On dp=4: the contraction split on both sides, the product scattered by rows.
    let m = mesh(&[4], &["dp"]);
    let inputs = [(xt.clone(), vec![Placement::Shard(1)]), (wt.clone(), vec![Placement::Shard(0)])];
    let (got, text) = run_captured(&m, &inputs, |xs| {
        let y = xs[0].matmul(&xs[1])?;
        Ok(vec![y.redistribute(&DeviceMesh::of_device(y.device())?, &[Placement::Shard(0)])?])
    });
    assert_eq!(got[0], want);
    assert_eq!(text.matches("stablehlo.reduce_scatter").count(), 1, "{text}");
    assert!(text.contains("replica_groups = dense<[[0, 1, 2, 3]]>"), "{text}");
    // On dp=2 x tp=2, partial over dp with rows split over tp: scattered along
    // the columns within each tp row of the mesh (positions 0, 2 and 1, 3).
    let m = mesh(&[2, 2], &["dp", "tp"]);
    let inputs =
        [(xt, vec![Placement::Shard(1), Placement::Shard(0)]), (wt, vec![Placement::Shard(0), Placement::Replicate])];
    let (got, text) = run_captured(&m, &inputs, |xs| {
        let y = xs[0].matmul(&xs[1])?;
        let mesh = DeviceMesh::of_device(y.device())?;
        Ok(vec![y.redistribute(&mesh, &[Placement::Shard(1), Placement::Shard(0)])?])
    });
    assert_eq!(got[0], want);
    assert_eq!(text.matches("stablehlo.reduce_scatter").count(), 1, "{text}");
    assert!(text.contains("replica_groups = dense<[[0, 2], [1, 3]]>"), "{text}");
}

#[test]
fn views_of_a_batch_split_storage_keep_the_split_they_leave_whole() {
    let m = mesh(&[4], &["dp"]);
    let rows = |n: usize| Sharding::from_placements(&m, &[Placement::Shard(0)], n).unwrap();
    let lay = |shape: &[usize], strides: &[usize], offset: usize| {
        Layout::new(shape.into(), strides.iter().copied().collect(), offset)
    };
    let dims = |s: &Sharding| s.dims.clone();
    let dp = vec![0];
    let none: Vec<usize> = vec![];
    let split = rows(3);
    // [8, 256, 384] split on the batch, read as [2048, 384] and as its transpose [384, 2048].
    let flat = shard::view_sharding(&split, &[8, 256, 384], &lay(&[2048, 384], &[384, 1], 0));
    assert_eq!(dims(&flat), [dp.clone(), none.clone()]);
    let t = shard::view_sharding(&split, &[8, 256, 384], &lay(&[384, 2048], &[1, 384], 0));
    assert_eq!(dims(&t), [none.clone(), dp.clone()]);
    // [2048] split in 4 read as [8, 256]: the 8 rows take the split.
    let r = shard::view_sharding(&rows(1), &[2048], &lay(&[8, 256], &[256, 1], 0));
    assert_eq!(dims(&r), [dp.clone(), none.clone()]);
    // A batch of 2 cannot hold 4 pieces: replicated.
    let uneven = shard::view_sharding(&rows(1), &[2048], &lay(&[2, 1024], &[1024, 1], 0));
    assert_eq!(dims(&uneven), [none.clone(), none.clone()]);
    // A split of another dimension is not carried through a reshape.
    let cols = Sharding::from_placements(&m, &[Placement::Shard(1)], 2).unwrap();
    let heads = shard::view_sharding(&cols, &[32, 64], &lay(&[32, 8, 8], &[64, 8, 1], 0));
    assert!(heads.is_replicated(), "{heads:?}");
    // `ids[:, 1:]` of [8, 256] split on the rows keeps them split; a window
    // cutting the split rows does not.
    let w = shard::view_sharding(&rows(2), &[8, 256], &lay(&[8, 255], &[256, 1], 1));
    assert_eq!(dims(&w), [dp.clone(), none.clone()]);
    let cut = shard::view_sharding(&rows(2), &[8, 256], &lay(&[4, 256], &[256, 1], 256));
    assert_eq!(dims(&cut), [none.clone(), none]);
}

#[test]
fn the_embedding_lookup_and_concatenation_keep_the_batch_split() {
    let m = mesh(&[4], &["dp"]);
    let sharding = |p: Placement, n: usize| Sharding::from_placements(&m, &[p], n).unwrap();
    let rep = |n: usize| Sharding::replicated(&m, n);
    // A table split by FSDP on its rows, looked up by split token ids: rows of the ids' split.
    let ins = [(vec![64, 8], sharding(Placement::Shard(0), 2)), (vec![16], sharding(Placement::Shard(0), 1))];
    let table_in = shard::in_sharding(&Op::IndexSelect { dim: 0 }, 0, &ins[0].1, &[64, 8]);
    assert!(table_in.is_replicated(), "the table is read whole along the looked-up dimension");
    let ins = [(vec![64, 8], table_in), ins[1].clone()];
    let out = shard::out_sharding(&Op::IndexSelect { dim: 0 }, &ins, 0, &[16, 8], &m);
    assert_eq!(out.dims, [vec![0], vec![]]);
    // Targets `cat([ids[:, 1:], pad], 1)`: the split rows of the first input.
    let ins = [(vec![8, 15], sharding(Placement::Shard(0), 2)), (vec![8, 1], rep(2))];
    let out = shard::out_sharding(&Op::Cat { dim: 1 }, &ins, 0, &[8, 16], &m);
    assert_eq!(out.dims, [vec![0], vec![]]);
}

#[test]
fn rms_norm_weight_gradients_are_partial_sums_over_the_batch() {
    let m = mesh(&[4], &["dp"]);
    let rows = Sharding::from_placements(&m, &[Placement::Shard(0)], 2).unwrap();
    let rep = |n: usize| Sharding::replicated(&m, n);
    let op = Op::RmsNormBackward { eps: 1e-5 };
    let ins = [(vec![8, 16], rows.clone()), (vec![16], rep(1)), (vec![8], rep(1)), (vec![8, 16], rows)];
    let dw = shard::out_sharding(&op, &ins, 1, &[16], &m);
    assert_eq!((dw.dims, dw.unreduced), (vec![vec![]], vec![0]));
    let dx = shard::out_sharding(&op, &ins, 0, &[8, 16], &m);
    assert_eq!((dx.dims, dx.unreduced), (vec![vec![0], vec![]], vec![]));
    // With an axis that does not split the batch (tensor parallelism): replicated.
    let m = mesh(&[2, 2], &["dp", "tp"]);
    let rows = Sharding::from_placements(&m, &[Placement::Shard(0), Placement::Replicate], 2).unwrap();
    let rep = |n: usize| Sharding::replicated(&m, n);
    let ins = [(vec![8, 16], rows.clone()), (vec![16], rep(1)), (vec![8], rep(1)), (vec![8, 16], rows)];
    assert!(shard::out_sharding(&op, &ins, 1, &[16], &m).is_replicated());
}

#[test]
fn gathers_over_a_mesh_pair_each_index_with_its_batch_row() {
    let m = mesh(&[4], &["dp"]);
    let logits = data(8 * 6, 0.7);
    let idx: Vec<i64> = (0..8).map(|i| (i * 5 % 6) as i64).collect();
    let want: Vec<f32> = (0..8).map(|i| logits[i * 6 + idx[i] as usize]).collect();
    let lt = kiln_tensor::Tensor::from_vec(logits, &[8, 6]).unwrap();
    let it = kiln_tensor::Tensor::from_vec(idx, &[8, 1]).unwrap();
    let inputs = [(lt, vec![Placement::Shard(0)]), (it, vec![Placement::Shard(0)])];
    let (got, text) = run_captured(&m, &inputs, |xs| Ok(vec![xs[0].gather(1, &xs[1])?]));
    assert_eq!(got[0], want);
    assert!(text.contains("operand_batching_dims = [0], start_indices_batching_dims = [0]"), "{text}");
    // On one device the gather keeps its iota coordinates (portable artifacts carry them).
    let mut one =
        kiln_tensor::capture::compile(Device::Tpu(0), |xs: &[kiln_tensor::Tensor]| Ok(vec![xs[0].gather(1, &xs[1])?]));
    let on_one: Vec<_> = inputs.iter().map(|(t, _)| t.to_device(Device::Tpu(0)).unwrap()).collect();
    assert_eq!(one.call(&on_one).unwrap()[0].to_vec::<f32>().unwrap(), want);
    let text = lower_program(&one.program().unwrap(), Constants::Inline).unwrap().module.text();
    assert!(text.contains("stablehlo.gather") && !text.contains("batching_dims"), "{text}");
}
