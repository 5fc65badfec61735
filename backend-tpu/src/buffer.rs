//! What a storage on a PJRT device holds (`PjrtBuffer`): one device buffer,
//! or one shard per device of a mesh (`Shards`, Note [Distributed storages]
//! in `dist.rs`), and how the backend reaches it (after a deferred program
//! computing it has run, Note \[Deferred programs\] in kiln-tensor's
//! `defer.rs`). Below the backend: it knows neither programs nor capture.
use crate::lower::Sharding;
use crate::pjrt::Buffer;
use kiln_tensor::{Device, DeviceMesh, Error, Result, StorageData, Tensor};
use std::sync::Arc;

/// What a storage on a PJRT device holds.
#[derive(Debug, Clone)]
pub enum PjrtBuffer {
    /// A device buffer.
    Ready(Arc<Buffer>),
    /// One shard per device of a mesh (a tensor on a mesh device, `dist.rs`).
    Sharded(Arc<Shards>),
}

/// What a storage on a mesh device holds.
#[derive(Debug)]
pub struct Shards {
    /// Each mesh device's shard of the padded value, in mesh order.
    pub bufs: Vec<Arc<Buffer>>,
    /// The split over the root mesh, of the storage's n-d shape.
    pub sharding: Sharding,
    /// The storage's logical shape (its element count is the storage's length).
    pub shape: Vec<usize>,
    /// The mesh the tensor was placed on (reported by `device_mesh`).
    pub view: DeviceMesh,
}

impl PjrtBuffer {
    /// The device buffer of a tensor on one device.
    pub fn ready(&self) -> Option<Arc<Buffer>> {
        match self {
            PjrtBuffer::Ready(b) => Some(b.clone()),
            PjrtBuffer::Sharded(_) => None,
        }
    }
}

impl kiln_tensor::DeviceBuffer for PjrtBuffer {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn as_any_mut(&mut self) -> &mut dyn std::any::Any {
        self
    }
    fn share(&self) -> Option<Box<dyn kiln_tensor::DeviceBuffer>> {
        Some(Box::new(self.clone()))
    }
}

fn err(msg: impl Into<String>) -> Error {
    Error::backend("pjrt", msg)
}

/// What a storage holds, when it is this backend's.
pub(crate) fn data_in(d: &StorageData, device: Device) -> Result<PjrtBuffer> {
    match d {
        StorageData::Device(d) => d
            .as_any()
            .downcast_ref::<PjrtBuffer>()
            .cloned()
            .ok_or_else(|| err(format!("a tensor on {device} holds another backend's buffer"))),
        StorageData::Host(_) => Err(err(format!("a tensor on {device} holds host memory"))),
        StorageData::Traced | StorageData::Pending => Err(d.not_here("pjrt")),
    }
}

/// What `t`'s storage holds, once a deferred program computing it has run
/// (Note \[Deferred programs\] in kiln-tensor's `defer.rs`).
pub(crate) fn data_of(t: &Tensor) -> Result<PjrtBuffer> {
    kiln_tensor::defer::settle(t.storage())?;
    data_in(&t.storage().read(), t.device())
}
