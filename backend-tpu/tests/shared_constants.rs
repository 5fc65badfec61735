//! Equal creation-op values of one deferred graph share one program argument
//! (Note [Shared constants]). A test binary of its own: it counts the programs
//! the backend obtains, which other tests would disturb.
mod support;

use kiln_tensor::{DType, Device, Tensor};
use kiln_tpu::{with_mode, Mode};
use support::setup;

const TPU: Device = Device::Tpu(0);

/// Programs compiled or loaded from disk so far (not those found in memory).
fn programs() -> u64 {
    let s = kiln_tpu::stats().unwrap();
    s.compiles + s.disk_hits
}

#[test]
fn equal_scalars_of_a_graph_share_one_argument() {
    setup();
    let x = Tensor::arange(0.0, 4.0, 1.0, (DType::F32, TPU)).unwrap();
    kiln_tpu::sync().unwrap();
    let run = |a: f64, b: f64| with_mode(Mode::Defer, || x.mul(a).unwrap().add(b).unwrap().to_vec::<f32>().unwrap());
    let p0 = programs();
    assert_eq!(run(0.5, 0.5), [0.5, 1.0, 1.5, 2.0]);
    let p1 = programs();
    assert_eq!(run(0.5, 0.25), [0.25, 0.75, 1.25, 1.75]);
    let p2 = programs();
    assert_eq!(run(3.0, 3.0), [3.0, 6.0, 9.0, 12.0]);
    let p3 = programs();
    // Two equal scalars are one argument, two different ones two: different
    // programs. Other equal values reuse the first program.
    assert_eq!((p1 - p0, p2 - p1, p3 - p2), (1, 1, 0));
}
