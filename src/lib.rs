//! kiln: a Rust-first tensor framework with PyTorch's semantics: one `Tensor`
//! type whose dtype and device are runtime values, views that alias their base,
//! in-place ops that write through views, and clear errors.
//!
//! ```
//! use kiln::prelude::*;
//! let a = Tensor::new([[1.0f32, 2.0], [3.0, 4.0]])?;
//! let b = a.t()?;                        // a view: no copy
//! let c = a.matmul(&b)?;                 // [[5, 11], [11, 25]]
//! assert_eq!(c.to_vec::<f32>()?, vec![5.0, 11.0, 11.0, 25.0]);
//! # Ok::<(), kiln::Error>(())
//! ```
//!
//! The CPU backend (`kiln-cpu`) is registered automatically when this crate is
//! linked; [`init`] registers it explicitly (idempotent). The PJRT backend
//! (`kiln-tpu`, `Device::Tpu(n)`) loads a plugin, so it is registered on
//! request: [`tpu::register`].

pub mod logging;

pub use kiln_autograd as autograd;
pub use kiln_autograd::local_map;
pub use kiln_cpu as cpu;
pub use kiln_nn as nn;
pub use kiln_tensor as tensor;
pub use kiln_tensor::{
    constant, default_generator, distribute_tensor, init_device_mesh, is_grad_enabled, manual_seed, register_backend,
    registered_devices, set_grad_enabled, Backend, CustomOp, DType, Device, DeviceKind, DeviceMesh, Error, Generator,
    HostBuffer, HostElement, HostInput, HostScalar, Layout, Lowering, Meta, Op, Operand, PartialOp, Placement, Result,
    Scalar, Tensor, TensorOptions,
};
pub use kiln_tpu as tpu;

pub mod export;
pub use export::export;

/// Registers the built-in backends (the CPU one). Called automatically at
/// start-up; calling it again does nothing.
pub fn init() {
    kiln_cpu::register();
}

/// Makes `device` usable: registers the built-in backend serving it (the CPU
/// backend, or the PJRT backend for `Device::Tpu(n)`, which loads its plugin:
/// see [`tpu::register`]) and checks that the device exists.
///
/// ```no_run
/// kiln::init_device(kiln::Device::Tpu(0))?;
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn init_device(device: Device) -> Result<()> {
    match device.kind() {
        DeviceKind::Cpu => kiln_cpu::register(),
        DeviceKind::Tpu => kiln_tpu::register()?,
        DeviceKind::PrivateUse1 => {}
    }
    device.backend().map(|_| ())
}

/// Captures a function of tensors into one program (torch.compile's role),
/// on any device: see [`tensor::capture::compile`].
pub use kiln_tensor::capture::{compile, CaptureStats, Compiled, HostValues};

/// `use kiln::prelude::*;` brings the everyday names into scope.
pub mod prelude {
    pub use kiln_autograd::TensorAutograd;
    pub use kiln_tensor::{s, DType, Device, Dims, Error, IndexItem, Reduction, Result, Scalar, Tensor, TensorOptions};
}
