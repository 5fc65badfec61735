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
//! linked; [`init`] registers it explicitly (idempotent).

pub use kiln_autograd as autograd;
pub use kiln_cpu as cpu;
pub use kiln_nn as nn;
pub use kiln_tensor as tensor;
pub use kiln_tensor::{
    is_grad_enabled, manual_seed, register_backend, registered_devices, set_grad_enabled, Backend, DType, Device,
    DeviceKind, Error, Layout, Op, Operand, Result, Scalar, Tensor, TensorOptions,
};

/// Registers the built-in backends (the CPU one). Called automatically at
/// start-up; calling it again does nothing.
pub fn init() {
    kiln_cpu::register();
}

/// `use kiln::prelude::*;` brings the everyday names into scope.
pub mod prelude {
    pub use kiln_autograd::TensorAutograd;
    pub use kiln_tensor::{s, DType, Device, Dims, Error, IndexItem, Reduction, Result, Scalar, Tensor, TensorOptions};
}
