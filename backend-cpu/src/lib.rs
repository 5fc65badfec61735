//! kiln-cpu: the CPU backend. Kernels for every primitive of `kiln_tensor::Op`,
//! working directly on strided views of host memory.
mod backend;
mod kernels;

pub use backend::CpuBackend;

use kiln_tensor::DeviceKind;
use std::sync::Once;

static REGISTER: Once = Once::new();

/// Registers the CPU backend for `Device::Cpu` (idempotent).
pub fn register() {
    REGISTER.call_once(|| kiln_tensor::register_backend(DeviceKind::Cpu, Box::new(CpuBackend::new())));
}

// Registers at program start so `Tensor::zeros(..)` works without an explicit call.
#[ctor::ctor]
fn auto_register() {
    register();
}
