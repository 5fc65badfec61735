//! What a trace costs on a PJRT device, counted with the backend's global
//! counters (`kiln_tpu::stats`): alone in its test binary, so no other test
//! runs programs while it counts.
mod support;

use kiln_tensor::{Device, Tensor};
use support::{setup, vec_on};

/// A trace records the function without running its ops: the first call of
/// a compiled function on `tpu:0` runs one program (the traced one, in
/// whatever mode the backend is in), not one per op, and a trace that the
/// call does not run (it fails) executes nothing.
#[test]
fn a_trace_runs_the_program_once_and_nothing_else() {
    setup();
    let dev = Device::Tpu(0);
    let w = vec_on(vec![1.0, 2.0, 3.0], dev);
    let x = vec_on(vec![0.5, -1.0, 2.0], dev);
    kiln_tpu::sync().unwrap();
    let mut step = kiln_tensor::capture::compile(dev, |xs: &[Tensor]| {
        let h = xs[0].mul(&w)?.tanh()?.exp()?;
        w.add_(&h)?;
        Ok(vec![h.sum()?])
    });
    let before = kiln_tpu::stats().unwrap();
    let out = step.call(std::slice::from_ref(&x)).unwrap();
    kiln_tpu::sync().unwrap();
    let ran = kiln_tpu::stats().unwrap().executions - before.executions;
    assert_eq!(ran, 1, "the first call runs the traced program once");
    let want: f32 = [1.0f32 * 0.5, -2.0, 6.0].iter().map(|v| v.tanh().exp()).sum();
    assert!((out[0].to_vec::<f32>().unwrap()[0] - want).abs() <= 1e-5);
    // A trace that fails (reading data) runs nothing and writes nothing.
    let mut bad = kiln_tensor::capture::compile(dev, |xs: &[Tensor]| {
        w.mul_(&xs[0])?;
        let n = w.sum()?.item::<f32>()?;
        Ok(vec![w.mul(n as f64)?])
    });
    let w_now = w.to_vec::<f32>().unwrap();
    let before = kiln_tpu::stats().unwrap();
    assert!(bad.call(std::slice::from_ref(&x)).is_err());
    assert_eq!(kiln_tpu::stats().unwrap().executions - before.executions, 0, "a failed trace executes nothing");
    assert_eq!(w.to_vec::<f32>().unwrap(), w_now);
}
