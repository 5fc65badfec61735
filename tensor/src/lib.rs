//! kiln-tensor: the core of kiln. `DType`, `Layout`, `Storage`, `Device` and the
//! backend registry, the primitive-op IR (`Op`) and the `Tensor` type with its
//! PyTorch-like API. It knows nothing about gradients or concrete backends.
//!
//! The `Tensor` API is split by concern: creation (`create.rs`), conversion
//! (`convert.rs`), movement and views (`movement.rs`), elementwise math
//! (`elementwise.rs`), reductions (`reduce.rs`), linear algebra (`linalg.rs`),
//! indexing (`indexing.rs`), in-place ops (`inplace.rs`), composites
//! (`composite.rs`), random distributions (`random.rs`, on the generators of
//! `generator.rs`) and printing (`display.rs`). `trace.rs` marks what traced
//! functions may take from the host.

pub use half;
/// The ndarray version kiln converts to and from (`Tensor::view_ndarray`, `Tensor::from_ndarray`).
pub use ndarray;

pub mod alloc;
mod attention;
pub mod autocast;
pub mod capture;
pub mod collective;
mod composite;
mod compute_threads;
mod convert;
mod create;
pub mod custom;
pub mod defer;
pub mod device;
mod display;
mod distributed;
pub mod dtype;
mod elementwise;
pub mod error;
pub mod float8;
pub mod generator;
pub mod graph;
pub mod grouped;
mod indexing;
mod inplace;
mod interop;
pub mod invariance;
pub mod ir;
pub mod layout;
mod linalg;
pub mod mesh;
mod movement;
pub mod op;
pub mod paged;
pub mod profile;
pub mod quant;
pub mod random;
mod reduce;
pub mod scalar;
pub mod storage;
mod tensor;
pub mod trace;

pub use attention::attention_grads;
pub use autocast::{autocast, autocast_dtype, AutocastGuard};
pub use composite::{rms_norm_grads, CrossEntropy, Reduction};
pub use compute_threads::on_compute_threads;
pub use convert::{reading_via, TensorData};
pub use create::{default_device, set_default_device, DefaultDeviceGuard, TensorOptions};
pub use custom::{CustomOp, HostInput, Lowering};
pub use device::{
    backend_for, capture, check_assign, is_registered, register_backend, registered_devices, Backend, CaptureFn,
    Captured, Device, DeviceKind, LocalFn, Meta,
};
pub use distributed::distribute_tensor;
pub use dtype::{Category, DType, Element};
pub use elementwise::Operand;
pub use error::{Error, Result};
pub use float8::{f8e4m3fn, f8e5m2};
pub use generator::{default_generator, manual_seed, Generator};
pub use graph::{is_grad_enabled, set_grad_enabled, CustomBackward, Edge, GradModeGuard, Hook, Node, NodeKind, Origin};
pub use indexing::{s, IndexItem, SliceBound, TensorIndex};
pub use interop::NdarrayRef;
pub use invariance::{is_batch_invariant, set_batch_invariant};
pub use layout::{broadcast_shapes, contiguous_strides, numel, wrap_dim, Layout, Shape, Strides};
pub use mesh::{init_device_mesh, DeviceMesh, PartialOp, Placement};
pub use op::{ArgReduceOp, BinaryOp, CmpOp, Op, ReduceOp, ScatterReduce, UnaryOp, ViewOp};
pub use reduce::Dims;
pub use scalar::Scalar;
pub use storage::{DeviceBuffer, HostBuffer, HostElement, Storage, StorageData};
pub use tensor::Tensor;
pub use trace::{constant, HostScalar};
