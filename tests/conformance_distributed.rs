//! The conformance suite's op groups on distributed tensors: the same test
//! bodies as `conformance.rs`, run on device meshes of the XLA:CPU plugin's
//! devices instead of single devices, with every input the suite builds
//! (`t`, and `iota`'s flat range) split over the mesh: rows over a 4-device
//! mesh, rows and columns over a 2 x 2 mesh (uneven splits included), in Strict, Debug and
//! DeferAndFuse mode. Tensors the bodies create on the device directly are
//! replicated. Results are read back whole and compared with the same
//! expectations as on one device.
mod common;

#[path = "conformance/composite.rs"]
mod composite;
#[path = "conformance/creation.rs"]
mod creation;
#[path = "conformance/elementwise.rs"]
mod elementwise;
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
use kiln::tpu::Mode;
use kiln::{distribute_tensor, init_device_mesh, DeviceKind, DeviceMesh, Placement};
use std::cell::RefCell;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// How a mesh splits an input of `ndim` dimensions.
type Split = fn(usize) -> Vec<Placement>;

/// The meshes the suite runs on, and how each splits its inputs.
fn meshes() -> Vec<(DeviceMesh, Split)> {
    common::devices();
    let rows: Split = |nd| vec![if nd > 0 { Placement::Shard(0) } else { Placement::Replicate }];
    let grid: Split = |nd| match nd {
        0 => vec![Placement::Replicate, Placement::Replicate],
        1 => vec![Placement::Shard(0), Placement::Replicate],
        n => vec![Placement::Shard(0), Placement::Shard(n - 1)],
    };
    vec![
        (init_device_mesh(DeviceKind::Tpu, &[4], &["x"]).unwrap(), rows),
        (init_device_mesh(DeviceKind::Tpu, &[2, 2], &["dp", "tp"]).unwrap(), grid),
    ]
}

thread_local! {
    /// How `t` and `iota` split inputs on the mesh being tested.
    static SPLIT: RefCell<Option<(DeviceMesh, Split)>> = const { RefCell::new(None) };
}

/// The mesh devices.
pub fn devices() -> Vec<Device> {
    meshes().into_iter().map(|(m, _)| m.device()).collect()
}

/// Runs `f` once per mesh and mode; a failure names the mesh and the mode.
pub fn on_devices(f: impl Fn(Device) -> Result<()>) {
    for (mesh, split) in meshes() {
        for mode in [Mode::Strict, Mode::Debug, Mode::Defer] {
            SPLIT.with(|s| *s.borrow_mut() = Some((mesh.clone(), split)));
            let r = kiln::tpu::with_mode(mode, || {
                let r = catch_unwind(AssertUnwindSafe(|| f(mesh.device())));
                kiln::tpu::sync().expect("the mode's work");
                r
            });
            SPLIT.with(|s| *s.borrow_mut() = None);
            match r {
                Ok(Ok(())) => {}
                Ok(Err(e)) => panic!("on {mesh} ({mode:?}): unexpected error: {e}"),
                Err(p) => {
                    let msg = common::panic_text(&*p);
                    panic!("on {mesh} ({mode:?}): {msg}");
                }
            }
        }
    }
}

/// `x` (on the CPU) on `dev`: split as the mesh under test splits inputs.
fn place(x: Tensor, dev: Device) -> Tensor {
    let split = SPLIT.with(|s| s.borrow().clone());
    match split {
        Some((mesh, placements)) if dev == mesh.device() => {
            distribute_tensor(&x, &mesh, &placements(x.ndim())).expect("placing a test tensor")
        }
        _ => x.to_device(dev).expect("building a test tensor"),
    }
}

/// A tensor from nested arrays on `dev`.
pub fn t<D: kiln::tensor::TensorData>(data: D, dev: Device) -> Tensor {
    place(Tensor::new(data).expect("building a test tensor"), dev)
}

/// `0, 1, ..., n-1` as float32 in the given shape, on `dev`: as on one
/// device, a reshaped view of the (split) flat range.
pub fn iota(shape: &[usize], dev: Device) -> Tensor {
    let n: usize = shape.iter().product();
    let x = Tensor::arange(0.0, n as f64, 1.0, DType::F32).expect("building a test tensor");
    place(x, dev).reshape_to(shape).expect("building a test tensor")
}
