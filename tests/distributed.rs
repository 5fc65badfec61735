//! Distributed tensors on meshes of the XLA:CPU plugin's four devices, in
//! Strict, Debug and DeferAndFuse mode: placing and gathering, shards, ops on distributed
//! tensors against the same ops on the CPU (values and result placements),
//! in-place writes through views, redistribution, autograd, and the errors.
mod common;

use common::devices;
use kiln::prelude::*;
use kiln::tpu::{with_mode, Mode};
use kiln::{distribute_tensor, init_device_mesh, DeviceKind, DeviceMesh, PartialOp, Placement};
use Placement::{Replicate, Shard};

const PARTIAL: Placement = Placement::Partial(PartialOp::Sum);

fn mesh(shape: &[usize], names: &[&str]) -> DeviceMesh {
    devices();
    init_device_mesh(DeviceKind::Tpu, shape, names).unwrap()
}

fn values(n: usize, seed: f32) -> Vec<f32> {
    (0..n).map(|i| ((i as f32 * 0.61 + seed).sin() * 3.0).round() / 4.0).collect()
}

fn tensor(shape: &[usize], seed: f32) -> Tensor {
    Tensor::from_vec(values(shape.iter().product(), seed), shape).unwrap()
}

fn close(got: &Tensor, want: &Tensor) {
    assert_eq!(got.shape(), want.shape());
    let (g, w) = (got.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "element {i}: {a} vs {b}\n{g:?}\n{w:?}");
    }
}

/// Whether `t`'s storage waits for a pending DeferAndFuse program.
fn is_deferred(t: &Tensor) -> bool {
    matches!(&*t.storage().read(), kiln::tensor::StorageData::Pending)
}

/// Runs `f` in Strict, Debug and DeferAndFuse mode.
fn in_every_mode(mut f: impl FnMut(Mode)) {
    for m in [Mode::Strict, Mode::Debug, Mode::Defer] {
        with_mode(m, || f(m));
        kiln::tpu::sync().unwrap();
    }
}

#[test]
fn distribute_then_gather_gives_back_the_tensor() {
    let m1 = mesh(&[4], &["x"]);
    let m2 = mesh(&[2, 2], &["dp", "tp"]);
    let cases: Vec<(&DeviceMesh, Vec<Placement>, Vec<usize>)> = vec![
        (&m1, vec![Shard(0)], vec![8, 3]),
        (&m1, vec![Shard(1)], vec![3, 10]), // uneven: 3, 3, 3, 1
        (&m1, vec![Shard(0)], vec![2, 5]),  // fewer rows than devices
        (&m1, vec![Replicate], vec![5]),
        (&m2, vec![Shard(0), Shard(1)], vec![5, 7]),
        (&m2, vec![Shard(1), Shard(1)], vec![2, 9]),
        (&m2, vec![Replicate, Shard(0)], vec![6]),
    ];
    for (mesh, placements, shape) in cases {
        let t = tensor(&shape, 0.3);
        let d = distribute_tensor(&t, mesh, &placements).unwrap();
        assert_eq!(d.device(), mesh.device());
        assert!(d.is_distributed() && !t.is_distributed());
        assert_eq!(d.shape(), shape.as_slice());
        assert_eq!(d.placements().unwrap(), placements);
        assert_eq!(&d.device_mesh().unwrap(), mesh);
        assert_eq!(d.to_vec::<f32>().unwrap(), t.to_vec::<f32>().unwrap(), "{placements:?} {shape:?}");
        let full = d.full_tensor().unwrap();
        assert_eq!(full.device(), Device::Tpu(mesh.devices()[0]));
        assert_eq!(full.to_vec::<f32>().unwrap(), t.to_vec::<f32>().unwrap());
        assert_eq!(d.to_device(Device::Cpu).unwrap().to_vec::<f32>().unwrap(), t.to_vec::<f32>().unwrap());
    }
}

#[test]
fn local_shards_are_each_devices_part_and_from_local_puts_them_back() {
    let m = mesh(&[4], &["x"]);
    let t = tensor(&[10, 2], 0.9);
    let d = distribute_tensor(&t, &m, &[Shard(0)]).unwrap();
    let local = d.to_local().unwrap();
    let rows = [3, 3, 3, 1];
    let mut start = 0isize;
    for (i, l) in local.iter().enumerate() {
        assert_eq!(l.device(), Device::Tpu(i));
        assert_eq!(l.shape(), &[rows[i], 2]);
        close(l, &t.narrow(0, start, rows[i]).unwrap());
        start += rows[i] as isize;
    }
    let back = Tensor::from_local(&local, &m, &[Shard(0)], &[10, 2]).unwrap();
    assert_eq!(back.to_vec::<f32>().unwrap(), t.to_vec::<f32>().unwrap());
    // Partial shards from_local: the tensor is their sum.
    let parts: Vec<Tensor> = (0..4).map(|i| tensor(&[3], i as f32).to_device(Device::Tpu(i)).unwrap()).collect();
    let p = Tensor::from_local(&parts, &m, &[PARTIAL], &[3]).unwrap();
    assert_eq!(p.placements().unwrap(), vec![PARTIAL]);
    let mut want = vec![0f32; 3];
    for (i, _) in parts.iter().enumerate() {
        for (w, v) in want.iter_mut().zip(values(3, i as f32)) {
            *w += v;
        }
    }
    close(&p.full_tensor().unwrap(), &Tensor::from_vec(want, &[3]).unwrap());
    // A shard of the wrong shape.
    let e = Tensor::from_local(&local, &m, &[Shard(0)], &[12, 2]).unwrap_err().to_string();
    assert!(e.contains("must be [3, 2]") && e.contains("got [1, 2]"), "{e}");
}

#[test]
fn ops_on_distributed_tensors_equal_the_cpu_and_keep_placements() {
    let m = mesh(&[2, 2], &["dp", "tp"]);
    in_every_mode(|mode| {
        let (x, w, b) = (tensor(&[6, 8], 0.1), tensor(&[8, 5], 0.4), tensor(&[8], 0.7));
        let dx = distribute_tensor(&x, &m, &[Shard(0), Replicate]).unwrap();
        let dw = distribute_tensor(&w, &m, &[Replicate, Shard(1)]).unwrap();
        let db = distribute_tensor(&b, &m["tp"], &[Replicate]).unwrap();
        // Elementwise with a broadcast operand and a scalar: the rows stay split.
        let y = dx.add(&db).unwrap().mul(0.5).unwrap().exp().unwrap();
        // Under DeferAndFuse the chain is one pending program over the mesh until read.
        assert_eq!(is_deferred(&y), mode == Mode::Defer);
        close(&y, &x.add(&b).unwrap().mul(0.5).unwrap().exp().unwrap());
        assert_eq!(y.placements().unwrap(), vec![Shard(0), Replicate], "{mode:?}");
        // A matmul: rows of the left operand, columns of the right one.
        let z = dx.matmul(&dw).unwrap();
        close(&z, &x.matmul(&w).unwrap());
        assert_eq!(z.placements().unwrap(), vec![Shard(0), Shard(1)]);
        // A contraction split on both sides leaves a partial sum (as DTensor).
        let xk = distribute_tensor(&x, &m, &[Replicate, Shard(1)]).unwrap();
        let wk = distribute_tensor(&w, &m, &[Replicate, Shard(0)]).unwrap();
        let zk = xk.matmul(&wk).unwrap();
        assert_eq!(zk.placements().unwrap(), vec![Replicate, PARTIAL]);
        close(&zk, &x.matmul(&w).unwrap());
        // A partial sum feeds the next op as its reduced value.
        close(&zk.relu().unwrap(), &x.matmul(&w).unwrap().relu().unwrap());
        // Reductions: a sum over the split dimension is partial, a max replicated there.
        let s = dx.sum_dim(0, false).unwrap();
        assert_eq!(s.placements().unwrap(), vec![PARTIAL, Replicate]);
        close(&s, &x.sum_dim(0, false).unwrap());
        close(&dx.sum_dim(1, true).unwrap(), &x.sum_dim(1, true).unwrap());
        assert_eq!(dx.sum_dim(1, true).unwrap().placements().unwrap(), vec![Shard(0), Replicate]);
        close(&dx.max_dim(0, false).unwrap().0, &x.max_dim(0, false).unwrap().0);
        close(&dx.mean().unwrap(), &x.mean().unwrap());
        // Row-wise softmax keeps the rows split.
        let sm = dx.softmax(-1).unwrap();
        close(&sm, &x.softmax(-1).unwrap());
        assert_eq!(sm.placements().unwrap(), vec![Shard(0), Replicate]);
        // Fused attention works row by row: the batch split stays (and so does its gradient's).
        let (q, k, v) = (tensor(&[4, 2, 5, 8], 0.2), tensor(&[4, 2, 5, 8], 0.6), tensor(&[4, 2, 5, 8], 0.9));
        let place = |t: &Tensor| distribute_tensor(t, &m, &[Shard(0), Replicate]).unwrap();
        let att = place(&q).scaled_dot_product_attention(&place(&k), &place(&v), true, None).unwrap();
        close(&att, &q.scaled_dot_product_attention(&k, &v, true, None).unwrap());
        assert_eq!(att.placements().unwrap(), vec![Shard(0), Replicate]);
        // Views: a transpose reports the permuted split, a slice reads through the storage.
        let t = dx.t().unwrap();
        assert_eq!(t.placements().unwrap(), vec![Shard(1), Replicate]);
        close(&t.add(1.0).unwrap(), &x.t().unwrap().add(1.0).unwrap());
        close(&dx.narrow(0, 1, 4).unwrap().sum().unwrap(), &x.narrow(0, 1, 4).unwrap().sum().unwrap());
        // Indexing, concatenation, comparisons, creation ops on the mesh.
        let idx = Tensor::from_vec(vec![5i64, 0, 3], &[3]).unwrap();
        let di = idx.to_device(m.device()).unwrap();
        close(&dx.index_select(0, &di).unwrap(), &x.index_select(0, &idx).unwrap());
        close(
            &Tensor::cat(&[&dx, &y], 1).unwrap(),
            &Tensor::cat(&[&x, &y.to_device(Device::Cpu).unwrap()], 1).unwrap(),
        );
        let mask = dx.gt(0.0).unwrap();
        close(
            &Tensor::where_cond(&mask, &dx, 0.0).unwrap(),
            &Tensor::where_cond(&x.gt(0.0).unwrap(), &x, 0.0).unwrap(),
        );
        let z = Tensor::zeros(&[3, 2], (DType::F32, m.device())).unwrap();
        assert_eq!(z.placements().unwrap(), vec![Replicate, Replicate]);
        assert_eq!(z.to_vec::<f32>().unwrap(), vec![0.0; 6]);
        // Out-of-range indices are the CPU's error on a mesh too.
        let bad = Tensor::from_vec(vec![6i64], &[1]).unwrap().to_device(m.device()).unwrap();
        let e = dx.index_select(0, &bad).unwrap_err().to_string();
        assert!(e.contains("index 6 is out of bounds for dimension 0 with size 6"), "{e}");
    });
}

#[test]
fn in_place_writes_reach_the_shards_through_views() {
    let m = mesh(&[4], &["x"]);
    in_every_mode(|_| {
        let x = tensor(&[7, 3], 0.2);
        let d = distribute_tensor(&x, &m, &[Shard(0)]).unwrap();
        let want = x.clone().contiguous().unwrap();
        d.add_(1.5).unwrap();
        want.add_(1.5).unwrap();
        // Through a column view and a row slice of the same storage.
        let col = d.narrow(1, 1, 1).unwrap();
        col.mul_(-2.0).unwrap();
        want.narrow(1, 1, 1).unwrap().mul_(-2.0).unwrap();
        d.narrow(0, 2, 3).unwrap().copy_(&Tensor::ones(&[3, 3], (DType::F32, m.device())).unwrap()).unwrap();
        want.narrow(0, 2, 3).unwrap().copy_(&Tensor::ones(&[3, 3], DType::F32).unwrap()).unwrap();
        close(&d, &want);
        assert_eq!(d.placements().unwrap(), vec![Shard(0)], "a write keeps the storage's split");
        close(&col, &want.narrow(1, 1, 1).unwrap());
    });
}

#[test]
fn redistribute_moves_data_between_placements() {
    let m = mesh(&[2, 2], &["dp", "tp"]);
    in_every_mode(|_| redistribute_chain(&m));
}

fn redistribute_chain(m: &DeviceMesh) {
    let m = m.clone();
    let x = tensor(&[5, 6], 0.5);
    let d = distribute_tensor(&x, &m, &[Shard(0), Shard(1)]).unwrap();
    let chain: [[Placement; 2]; 4] =
        [[Shard(1), Shard(0)], [Replicate, Shard(1)], [Shard(0), Shard(0)], [Replicate, Replicate]];
    let mut cur = d;
    for p in chain {
        cur = cur.redistribute(&m, &p).unwrap();
        assert_eq!(cur.placements().unwrap(), p.to_vec());
        assert_eq!(cur.to_vec::<f32>().unwrap(), x.to_vec::<f32>().unwrap(), "{p:?}");
        let rows = cur.to_local().unwrap()[3].shape().to_vec();
        let want: Vec<usize> = match p {
            [Shard(1), Shard(0)] => vec![2, 3],
            [Replicate, Shard(1)] => vec![5, 3],
            [Shard(0), Shard(0)] => vec![0, 6], // 5 rows over 4 devices: 2, 2, 1, 0
            _ => vec![5, 6],
        };
        assert_eq!(rows, want, "{p:?}");
    }
    // A partial sum reduced by redistribution.
    let xk = distribute_tensor(&x, &m, &[Replicate, Shard(1)]).unwrap();
    let s = xk.sum_dim(1, false).unwrap();
    assert_eq!(s.placements().unwrap(), vec![Replicate, PARTIAL]);
    let r = s.redistribute(&m, &[Replicate, Replicate]).unwrap();
    assert_eq!(r.placements().unwrap(), vec![Replicate, Replicate]);
    close(&r, &x.sum_dim(1, false).unwrap());
    // Onto a sub-mesh: the placement names only its axis.
    let on_tp = x.to_device(m.device()).unwrap().redistribute(&m["tp"], &[Shard(0)]).unwrap();
    assert_eq!((on_tp.device_mesh().unwrap(), on_tp.placements().unwrap()), (m["tp"].clone(), vec![Shard(0)]));
    close(&on_tp, &x);
}

#[test]
fn gradients_flow_through_distributed_tensors() {
    let m = mesh(&[4], &["dp"]);
    in_every_mode(|_| {
        let (x, w) = (tensor(&[8, 6], 0.3), tensor(&[6, 4], 0.8));
        let dx = distribute_tensor(&x, &m, &[Shard(0)]).unwrap();
        let dw = distribute_tensor(&w, &m, &[Replicate]).unwrap();
        dw.requires_grad_(true).unwrap();
        let cw = w.clone();
        cw.requires_grad_(true).unwrap();
        let loss = dx.matmul(&dw).unwrap().tanh().unwrap().sum().unwrap();
        let want = x.matmul(&cw).unwrap().tanh().unwrap().sum().unwrap();
        close(&loss, &want);
        loss.backward().unwrap();
        want.backward().unwrap();
        let g = dw.grad().expect("a gradient");
        assert!(g.is_distributed());
        close(&g, &cw.grad().unwrap());
    });
}

#[test]
fn misuse_is_a_clear_error() {
    let m = mesh(&[4], &["x"]);
    let x = tensor(&[4, 2], 0.1);
    let d = distribute_tensor(&x, &m, &[Shard(0)]).unwrap();
    let e = |r: kiln::Result<Tensor>| r.unwrap_err().to_string();
    // A distributed tensor and a one-device tensor in one op.
    let one = x.to_device(Device::Tpu(0)).unwrap();
    assert!(e(d.add(&one)).contains("expected all tensors to be on the same device"));
    // Placements.
    assert!(e(distribute_tensor(&x, &m, &[Shard(2)])).contains("Shard(dim=2) of a tensor with 2 dimension(s)"));
    assert!(e(distribute_tensor(&x, &m, &[Shard(0), Shard(1)])).contains("2 placements for a mesh of 1 axes"));
    assert!(e(distribute_tensor(&x, &m, &[PARTIAL])).contains("no partial values"));
    assert!(e(d.redistribute(&m, &[PARTIAL])).contains("cannot make a Partial placement"));
    // Another mesh than the tensor's, in every mode (deferred, the move is an op of the program).
    let other = mesh(&[2], &["y"]);
    for mode in [Mode::Strict, Mode::Defer] {
        let got = with_mode(mode, || e(d.redistribute(&other, &[Replicate])));
        assert!(got.contains("expected all tensors to be on the same device mesh"), "{mode:?}: {got}");
    }
    assert!(one.placements().unwrap_err().to_string().contains("not a device mesh"));
    assert!(x.to_local().unwrap_err().to_string().contains("not on a device mesh"));
    // Inside a traced function, shards are not traced yet: an error, not a fallback.
    let mut f = kiln::compile(m.device(), |xs: &[Tensor]| Ok(vec![xs[0].to_local()?.remove(0)]));
    let r = f.call(std::slice::from_ref(&d)).map(|_| ());
    assert!(r.unwrap_err().to_string().contains("to_local, from_local and reading data are not traced yet"));
    // A mesh device that does not exist.
    assert!(e(Tensor::zeros(&[1], (DType::F32, Device::Mesh(999)))).contains("no mesh has id 999"));
}

#[test]
fn a_compiled_adamw_step_on_a_mesh_replays_and_matches_the_cpu() {
    use kiln::nn::optim::{AdamW, AdamWConfig, Optimizer};
    let m = mesh(&[2, 2], &["dp", "tp"]);
    let (x, y, w0) = (tensor(&[8, 6], 0.3), tensor(&[8, 3], 0.5), tensor(&[6, 3], 0.8));
    let cfg = AdamWConfig { lr: 0.05, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1, amsgrad: false };
    let loss_of = |w: &Tensor, x: &Tensor, y: &Tensor| -> kiln::Result<Tensor> {
        let d = x.matmul(w)?.sub(y)?;
        d.mul(&d)?.mean()
    };
    // The CPU reference.
    let cw = w0.clone();
    cw.requires_grad_(true).unwrap();
    let mut copt = AdamW::new(vec![cw.clone()], cfg).unwrap();
    // The batch split over dp, the weight's columns over tp.
    let dx = distribute_tensor(&x, &m, &[Shard(0), Replicate]).unwrap();
    let dy = distribute_tensor(&y, &m, &[Shard(0), Replicate]).unwrap();
    let dw = distribute_tensor(&w0, &m, &[Replicate, Shard(1)]).unwrap();
    dw.requires_grad_(true).unwrap();
    let mut opt = AdamW::new(vec![dw.clone()], cfg).unwrap();
    opt.set_capturable(true).unwrap();
    let mut step = kiln::compile(m.device(), |xs: &[Tensor]| {
        opt.zero_grad();
        let loss = loss_of(&dw, &xs[0], &xs[1])?;
        loss.backward()?;
        opt.step()?;
        Ok(vec![loss])
    });
    for i in 0..6 {
        copt.zero_grad();
        let want = loss_of(&cw, &x, &y).unwrap();
        want.backward().unwrap();
        copt.step().unwrap();
        let got = step.call(&[dx.clone(), dy.clone()]).unwrap();
        assert!(got[0].is_distributed());
        close(&got[0], &want);
        close(&dw.detach(), &cw.detach());
        assert_eq!(dw.placements().unwrap(), vec![Replicate, Shard(1)], "step {i}: the parameter keeps its split");
    }
    let s = step.stats();
    assert_eq!((s.calls, s.retraces), (6, 0), "{s:?}");
    assert!(s.replays >= 3, "the step replays once stable: {s:?}");
    // Other placements of an input are another program (a guard), never a stale replay.
    let dx2 = distribute_tensor(&x, &m, &[Replicate, Replicate]).unwrap();
    step.call(&[dx2, dy.clone()]).unwrap();
    assert_eq!(step.stats().retraces, 1);
    assert!(step.stats().last_retrace.as_deref().is_some_and(|r| r.contains("input 0 changed")), "{:?}", step.stats());
}

#[test]
fn empty_nan_huge_and_concurrent_inputs() {
    let m = mesh(&[4], &["x"]);
    in_every_mode(|mode| {
        // Empty: a [0, 3] tensor split over 4 devices, every shard empty.
        let e = Tensor::zeros(&[0, 3], DType::F32).unwrap();
        let d = distribute_tensor(&e, &m, &[Shard(0)]).unwrap();
        assert_eq!(d.add(1.0).unwrap().shape(), &[0, 3]);
        assert_eq!(d.sum().unwrap().item::<f32>().unwrap(), 0.0, "{mode:?}");
        assert_eq!(d.full_tensor().unwrap().shape(), &[0, 3]);
        assert!(d.to_local().unwrap().iter().all(|s| s.shape() == [0, 3]));
        // NaN propagates as on the CPU, through a reduction over the split dimension.
        let x = Tensor::from_vec(vec![1.0f32, f32::NAN, 3.0, -2.0, 5.0, 0.5, 7.0, 8.0], &[8]).unwrap();
        let dx = distribute_tensor(&x, &m, &[Shard(0)]).unwrap();
        assert!(dx.max().unwrap().item::<f32>().unwrap().is_nan());
        assert!(dx.sum().unwrap().item::<f32>().unwrap().is_nan());
        let clean = Tensor::where_cond(&dx.isnan().unwrap(), 0.0, &dx).unwrap();
        assert_eq!(clean.sum().unwrap().item::<f32>().unwrap(), 22.5);
    });
    // Meshes larger than the machine, or than usize counts: errors, never an allocation.
    let e = init_device_mesh(DeviceKind::Tpu, &[1 << 20, 1 << 20], &["a", "b"]).unwrap_err().to_string();
    assert!(e.contains("needs 1099511627776 devices") && e.contains("KILN_PJRT_CPU_DEVICES"), "{e}");
    let e = init_device_mesh(DeviceKind::Tpu, &[1 << 40, 1 << 40], &["a", "b"]).unwrap_err().to_string();
    assert!(e.contains("more than usize::MAX"), "{e}");
    // Two threads on one mesh at once: each gets the CPU's answer.
    std::thread::scope(|s| {
        for seed in [0.1f32, 0.9] {
            let m = &m;
            s.spawn(move || {
                let (x, w) = (tensor(&[8, 6], seed), tensor(&[6, 4], seed + 0.5));
                let dx = distribute_tensor(&x, m, &[Shard(0)]).unwrap();
                let dw = distribute_tensor(&w, m, &[Replicate]).unwrap();
                for _ in 0..10 {
                    close(&dx.matmul(&dw).unwrap().tanh().unwrap(), &x.matmul(&w).unwrap().tanh().unwrap());
                }
            });
        }
    });
}

/// `KILN_COLLECTIVE_TIMEOUT_S` bounds the wait for a program over several
/// devices: in a child process given 0.02 s, a sharded product that takes
/// longer is an error naming the variable (Debug mode waits for it); the same
/// program with the default wait completes.
#[test]
fn the_collective_timeout_bounds_the_wait_for_a_program_over_devices() {
    let out = common::run_ignored_test_in_child(
        "a_long_program_over_two_devices",
        &[("KILN_COLLECTIVE_TIMEOUT_S", "0.02".as_ref()), ("KILN_TEST_EXPECT_TIMEOUT", "1".as_ref())],
        &[],
    );
    assert!(out.contains("TIMED OUT after"), "{out}");
    let out = common::run_ignored_test_in_child("a_long_program_over_two_devices", &[], &["KILN_COLLECTIVE_TIMEOUT_S"]);
    assert!(out.contains("COMPLETED in"), "{out}");
}

#[test]
#[ignore = "a child process of the_collective_timeout_bounds_the_wait_for_a_program_over_devices"]
fn a_long_program_over_two_devices() {
    let m = mesh(&[2], &["x"]);
    // 137 GFLOP per device: about 0.8 s on two cores (0.1 s for an eighth of it).
    let x = distribute_tensor(&Tensor::ones(&[8192, 4096], DType::F32).unwrap(), &m, &[Shard(0)]).unwrap();
    let w = distribute_tensor(&Tensor::ones(&[4096, 4096], DType::F32).unwrap(), &m, &[Replicate]).unwrap();
    let t = std::time::Instant::now();
    let r = with_mode(Mode::Debug, || x.matmul(&w));
    let expect_timeout = std::env::var_os("KILN_TEST_EXPECT_TIMEOUT").is_some();
    match r {
        Err(e) if expect_timeout => {
            let e = e.to_string();
            assert!(e.contains("did not complete within 20ms") && e.contains("KILN_COLLECTIVE_TIMEOUT_S"), "{e}");
            println!("TIMED OUT after {:?}", t.elapsed());
        }
        Ok(y) if !expect_timeout => {
            assert_eq!(y.i((0, 0)).unwrap().item::<f32>().unwrap(), 4096.0);
            println!("COMPLETED in {:?}", t.elapsed());
        }
        other => panic!("expect a timeout: {expect_timeout}, got {:?}", other.map(|_| "a result")),
    }
}

/// DeferAndFuse on a mesh records one pending program (an op chain, a
/// partial sum, an in-place update of sharded state, redistributions onto
/// the mesh and onto a view of it) that runs at the first read, and gives
/// every result the values, mesh and placements Strict mode gives.
#[test]
fn a_deferred_step_over_a_mesh_is_one_program_placed_as_in_strict_mode() {
    let m = mesh(&[2, 2], &["dp", "tp"]);
    let (x, w0) = (tensor(&[4, 6], 0.3), tensor(&[6, 4], 0.9));
    let step = |mode: Mode| {
        with_mode(mode, || {
            let dx = distribute_tensor(&x, &m, &[Shard(0), Replicate]).unwrap();
            let w = distribute_tensor(&w0, &m, &[Replicate, Shard(1)]).unwrap();
            let y = dx.matmul(&w).unwrap().relu().unwrap();
            let s = y.sum_dim(1, false).unwrap();
            let update = w.mul(0.25).unwrap();
            w.sub_(&update).unwrap();
            // Redistributions are ops of the program too, on the mesh or a view of it.
            let gathered = y.redistribute(&m, &[Replicate, Replicate]).unwrap();
            let on_tp = dx.redistribute(&m["tp"], &[Shard(1)]).unwrap();
            let outs = [y, s, w, gathered, on_tp];
            let pending: Vec<bool> = outs.iter().map(is_deferred).collect();
            // The first read runs the one program that computes all of them.
            let first = outs[1].to_vec_f64().unwrap();
            let settled: Vec<bool> = outs.iter().map(is_deferred).collect();
            let placements: Vec<(DeviceMesh, Vec<Placement>)> =
                outs.iter().map(|t| (t.device_mesh().unwrap(), t.placements().unwrap())).collect();
            let values: Vec<Vec<f64>> = outs.iter().map(|t| t.to_vec_f64().unwrap()).collect();
            assert_eq!(first, values[1]);
            (pending, settled, placements, values)
        })
    };
    let (pending, settled, placements, values) = step(Mode::Defer);
    assert_eq!(pending, [true; 5], "every result waits for the pending program");
    assert_eq!(settled, [false; 5], "one read ran the program computing all of them");
    let (_, _, strict_placements, strict_values) = step(Mode::Strict);
    assert_eq!(placements, strict_placements);
    assert_eq!(placements[0].1, vec![Shard(0), Shard(1)]);
    assert_eq!(placements[1].1, vec![Shard(0), PARTIAL]);
    assert_eq!(placements[2].1, vec![Replicate, Shard(1)]);
    assert_eq!(placements[3].1, vec![Replicate, Replicate]);
    assert_eq!(placements[4], (m["tp"].clone(), vec![Shard(1)]));
    for (got, want) in values.iter().zip(&strict_values) {
        assert_eq!(got.len(), want.len());
        for (a, b) in got.iter().zip(want) {
            assert!((a - b).abs() <= 1e-5 * (1.0 + b.abs()), "{got:?} vs {want:?}");
        }
    }
    let want_w: Vec<f64> = w0.to_vec_f64().unwrap().iter().map(|v| v * 0.75).collect();
    assert_eq!(values[2], want_w);
}

/// Inside a function traced on a mesh, the values the trace made report the
/// mesh and placements its program gives them, as the same ops run eagerly
/// report theirs, and the replayed program computes what they compute.
#[test]
fn traced_values_on_a_mesh_know_their_placements() {
    let m = mesh(&[2, 2], &["dp", "tp"]);
    let (x, w) = (tensor(&[4, 6], 0.3), tensor(&[6, 4], 0.9));
    let dx = distribute_tensor(&x, &m, &[Shard(0), Replicate]).unwrap();
    let dw = distribute_tensor(&w, &m, &[Replicate, Shard(1)]).unwrap();
    type Seen = Vec<(Vec<Placement>, Vec<Placement>, DeviceMesh, Vec<Placement>)>;
    let step = |x: &Tensor, seen: &std::sync::Mutex<Seen>| -> kiln::Result<Vec<Tensor>> {
        let y = x.matmul(&dw)?.relu()?;
        let s = y.sum_dim(1, false)?;
        let r = s.redistribute(&m["dp"], &[Shard(0)])?;
        seen.lock().unwrap().push((y.placements()?, s.placements()?, r.device_mesh()?, r.placements()?));
        Ok(vec![r])
    };
    let eager_seen = std::sync::Mutex::new(vec![]);
    let want = step(&dx, &eager_seen).unwrap().remove(0);
    let traced_seen = std::sync::Mutex::new(vec![]);
    let mut f = kiln::compile(m.device(), |xs: &[Tensor]| step(&xs[0], &traced_seen));
    for _ in 0..3 {
        let got = f.call(std::slice::from_ref(&dx)).unwrap().remove(0);
        close(&got, &want);
        assert_eq!((got.device_mesh().unwrap(), got.placements().unwrap()), (m["dp"].clone(), vec![Shard(0)]));
    }
    assert!(f.stats().replays >= 1, "{:?}", f.stats());
    let eager = eager_seen.into_inner().unwrap().remove(0);
    assert_eq!(eager.0, vec![Shard(0), Shard(1)]);
    assert_eq!(eager.1, vec![Shard(0), PARTIAL]);
    let traced = std::mem::take(&mut *traced_seen.lock().unwrap());
    assert!(traced.len() >= 2, "traced twice before the replay");
    for t in traced {
        assert_eq!(t, eager);
    }
    // Other placements of the input: a new trace, whose values lie elsewhere.
    let dx2 = distribute_tensor(&x, &m, &[Replicate, Replicate]).unwrap();
    let eager2_seen = std::sync::Mutex::new(vec![]);
    let want2 = step(&dx2, &eager2_seen).unwrap().remove(0);
    close(&f.call(std::slice::from_ref(&dx2)).unwrap().remove(0), &want2);
    let eager2 = eager2_seen.into_inner().unwrap().remove(0);
    assert_eq!(eager2.0, vec![Replicate, Shard(1)]);
    assert_eq!(traced_seen.into_inner().unwrap(), vec![eager2]);
}
