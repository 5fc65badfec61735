//! DeferAndFuse runs a chain of ops as one program, and nothing for values
//! nobody holds. A test binary of its own: it counts the backend's
//! executions, which other tests would disturb (its tests take turns).
mod support;

use kiln_tensor::{DType, Device, Tensor};
use kiln_tpu::{with_mode, Mode};
use support::setup;

const TPU: Device = Device::Tpu(0);

/// Held by each test: they count executions.
static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn defer_and_fuse_runs_a_chain_of_ops_as_one_program() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    setup();
    let x = Tensor::arange(0.0, 8.0, 1.0, (DType::F32, TPU)).unwrap();
    let want: Vec<f32> = {
        let mut y = x.clone();
        for _ in 0..10 {
            y = y.mul(0.5).unwrap().exp().unwrap().add(1.0).unwrap().log().unwrap();
        }
        y.to_vec::<f32>().unwrap()
    };
    kiln_tpu::sync().unwrap();
    let before = kiln_tpu::stats().unwrap();
    let got = with_mode(Mode::Defer, || {
        let mut y = x.clone();
        for _ in 0..10 {
            y = y.mul(0.5).unwrap().exp().unwrap().add(1.0).unwrap().log().unwrap();
        }
        let mid = kiln_tpu::stats().unwrap();
        assert_eq!(mid.executions, before.executions, "nothing runs before the result is needed");
        y.to_vec::<f32>().unwrap()
    });
    let after = kiln_tpu::stats().unwrap();
    // The scalar operands are uploaded; the 40 ops run as one program.
    assert_eq!(after.graphs - before.graphs, 1, "{before:?} -> {after:?}");
    assert_eq!(after.executions - before.executions, 1, "{before:?} -> {after:?}");
    assert_eq!(got, want, "fused results equal op-by-op results");
}

#[test]
fn deferred_values_nobody_holds_are_never_computed() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    setup();
    let x = Tensor::arange(0.0, 8.0, 1.0, (DType::F32, TPU)).unwrap();
    kiln_tpu::sync().unwrap();
    let before = kiln_tpu::stats().unwrap();
    let kept = with_mode(Mode::Defer, || {
        let dropped = x.exp().unwrap().mul(3.0).unwrap();
        drop(dropped);
        x.mul(2.0).unwrap()
    });
    kiln_tpu::sync().unwrap();
    let mid = kiln_tpu::stats().unwrap();
    // Only the kept value is a result (the dropped chain is dead code).
    assert_eq!(mid.executions - before.executions, 1, "{before:?} -> {mid:?}");
    assert_eq!(kept.to_vec::<f32>().unwrap(), (0..8).map(|v| 2.0 * v as f32).collect::<Vec<_>>());
    with_mode(Mode::Defer, || drop(x.exp().unwrap()));
    kiln_tpu::sync().unwrap();
    let after = kiln_tpu::stats().unwrap();
    assert_eq!(after.executions - mid.executions, 0, "nothing is live: nothing runs ({mid:?} -> {after:?})");
}

#[test]
fn an_op_that_checks_its_data_runs_in_the_program_of_the_ops_before_it() {
    let _turn = TURN.lock().unwrap_or_else(|e| e.into_inner());
    setup();
    let x = Tensor::arange(0.0, 8.0, 1.0, (DType::F32, TPU)).unwrap();
    let idx = Tensor::from_vec(vec![0i64, 3, 5, 7], &[4]).unwrap().to_device(TPU).unwrap();
    kiln_tpu::sync().unwrap();
    let before = kiln_tpu::stats().unwrap();
    let got = with_mode(Mode::Defer, || {
        let y = x.mul(2.0).unwrap().add(1.0).unwrap();
        // Checked on the device: the program runs now, this op in it.
        let picked = y.index_select(0, &idx).unwrap();
        let mid = kiln_tpu::stats().unwrap();
        assert_eq!(mid.executions - before.executions, 1, "{before:?} -> {mid:?}");
        picked.mul(10.0).unwrap().to_vec::<f32>().unwrap()
    });
    let after = kiln_tpu::stats().unwrap();
    assert_eq!(after.executions - before.executions, 2, "{before:?} -> {after:?}");
    assert_eq!(got, vec![10.0, 70.0, 110.0, 150.0]);
}
