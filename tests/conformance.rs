//! The conformance suite: every op group of the `Tensor` API, written once and run
//! on every registered device (`kiln::registered_devices()`). A backend that
//! registers itself runs these tests unchanged; each failure names the device.
//!
//! Inputs are built on the CPU and moved with `.to_device(dev)`; results are read
//! back with `to_vec*`. Expected values and error messages follow PyTorch.
mod common;

#[path = "conformance/composite.rs"]
mod composite;
#[path = "conformance/concurrency.rs"]
mod concurrency;
#[path = "conformance/creation.rs"]
mod creation;
#[path = "conformance/display.rs"]
mod display;
#[path = "conformance/elementwise.rs"]
mod elementwise;
#[path = "conformance/errors.rs"]
mod errors;
#[path = "conformance/indexing.rs"]
mod indexing;
#[path = "conformance/inplace.rs"]
mod inplace;
#[path = "conformance/linalg.rs"]
mod linalg;
#[path = "conformance/operators.rs"]
mod operators;
#[path = "conformance/random.rs"]
mod random;
#[path = "conformance/reductions.rs"]
mod reductions;
#[path = "conformance/views.rs"]
mod views;

use kiln::prelude::*;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Every device the suite runs on: the devices of all registered backends.
pub fn devices() -> Vec<Device> {
    common::devices()
}

/// Runs `f` once per device; a failure (an `Err` or a panic) names the device.
pub fn on_devices(f: impl Fn(Device) -> Result<()>) {
    common::for_each_device_and_mode(|dev, mode| match catch_unwind(AssertUnwindSafe(|| f(dev))) {
        Ok(Ok(())) => {}
        Ok(Err(e)) => panic!("on device {dev} ({mode}): unexpected error: {e}"),
        Err(p) => {
            let msg = common::panic_text(&*p);
            panic!("on device {dev} ({mode}): {msg}");
        }
    });
}

/// A tensor from nested arrays (`[[1.0f32, 2.0], [3.0, 4.0]]`) on `dev`.
pub fn t<D: kiln::tensor::TensorData>(data: D, dev: Device) -> Tensor {
    Tensor::new(data).and_then(|x| x.to_device(dev)).expect("building a test tensor")
}

/// `0, 1, ..., n-1` as float32 in the given shape, on `dev`.
pub fn iota(shape: &[usize], dev: Device) -> Tensor {
    let n: usize = shape.iter().product();
    Tensor::arange(0.0, n as f64, 1.0, (DType::F32, dev))
        .and_then(|x| x.reshape_to(shape))
        .expect("building a test tensor")
}
