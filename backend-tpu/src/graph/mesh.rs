//! What a storage on a mesh device holds (`Shards`, Note [Distributed
//! storages] in `dist.rs`) and the sharding a storage's data carries.
use super::PjrtBuffer;
use crate::lower::Sharding;
use crate::pjrt::Buffer;
use kiln_tensor::DeviceMesh;
use std::sync::Arc;

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

/// The sharding and n-d shape of a storage on a mesh device (ready or deferred).
pub(crate) fn storage_sharding(data: &PjrtBuffer) -> Option<(Sharding, Vec<usize>)> {
    match data {
        PjrtBuffer::Sharded(s) => Some((s.sharding.clone(), s.shape.clone())),
        PjrtBuffer::Deferred(slot) => slot.sharding.clone(),
        PjrtBuffer::Ready(_) => None,
    }
}
