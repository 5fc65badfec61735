//! Distributed tensors (DTensor's role) as ordinary `Tensor`s: a tensor on a
//! mesh device (`DeviceMesh::device`) holds one shard per device of the mesh,
//! with a placement per mesh axis (see Note [Device meshes] in `mesh.rs`).
//! Ops on such tensors run on every device of the mesh at once; the backend
//! decides the placements of their results.
use crate::{Device, DeviceMesh, Error, Placement, Result, Tensor};

/// `t` placed on `mesh` with one placement per mesh axis (PyTorch's
/// `distribute_tensor`): the result is on `mesh.device()`, each device holding
/// its shard. `t` may be on any device (its data is read once).
///
/// ```no_run
/// use kiln_tensor::{distribute_tensor, init_device_mesh, DType, DeviceKind, Placement, Tensor};
/// let mesh = init_device_mesh(DeviceKind::Tpu, &[4], &["dp"])?;
/// let x = Tensor::arange(0.0, 16.0, 1.0, DType::F32)?.reshape(&[8, 2])?;
/// let dx = distribute_tensor(&x, &mesh, &[Placement::Shard(0)])?; // rows 0-1 on device 0, ...
/// assert_eq!(dx.placements()?, vec![Placement::Shard(0)]);
/// assert_eq!(dx.full_tensor()?.to_vec::<f32>()?, x.to_vec::<f32>()?);
/// # Ok::<(), kiln_tensor::Error>(())
/// ```
pub fn distribute_tensor(t: &Tensor, mesh: &DeviceMesh, placements: &[Placement]) -> Result<Tensor> {
    mesh.check_placements(placements, t.ndim())?;
    mesh.device().backend()?.distribute(t, mesh, placements)
}

impl Tensor {
    /// Whether the tensor is placed on a device mesh.
    pub fn is_distributed(&self) -> bool {
        matches!(self.device(), Device::Mesh(_))
    }

    /// The mesh a distributed tensor is placed on: the (sub-)mesh it was
    /// placed on with [`distribute_tensor`] or [`Tensor::redistribute`], or the
    /// root mesh for results of ops.
    pub fn device_mesh(&self) -> Result<DeviceMesh> {
        self.backend().placements(self).map(|(m, _)| m)
    }

    /// The placement on each axis of [`Tensor::device_mesh`].
    pub fn placements(&self) -> Result<Vec<Placement>> {
        self.backend().placements(self).map(|(_, p)| p)
    }

    /// The same values with other placements on `mesh` (a view of this
    /// tensor's root mesh): the backend moves data between devices as needed
    /// (all-gather, all-reduce of partial sums, all-to-all, slicing).
    pub fn redistribute(&self, mesh: &DeviceMesh, placements: &[Placement]) -> Result<Tensor> {
        self.mesh_op("redistribute")?;
        mesh.check_placements(placements, self.ndim())?;
        self.backend().redistribute(self, mesh, placements)
    }

    /// Each mesh device's shard, in mesh order, as a tensor on that device
    /// (PyTorch's `to_local`, for every device at once: kiln drives all of
    /// them). A shard of an unevenly split dimension has its real size (the
    /// last ones are shorter, or empty); a `Partial` placement's shards are
    /// the partial values.
    pub fn to_local(&self) -> Result<Vec<Tensor>> {
        self.mesh_op("to_local")?;
        self.backend().local_shards(self)
    }

    /// The distributed tensor of global `shape` whose shard on each mesh device
    /// (in mesh order, each on its device and of the size [`Tensor::to_local`]
    /// gives) is `shards[i]` (PyTorch's `DTensor.from_local`).
    pub fn from_local(
        shards: &[Tensor],
        mesh: &DeviceMesh,
        placements: &[Placement],
        shape: &[usize],
    ) -> Result<Tensor> {
        mesh.check_placements(placements, shape.len())?;
        if shards.len() != mesh.devices().len() {
            return Err(Error::invalid(
                "from_local",
                format!("{} shards for a mesh of {} devices: give one per device", shards.len(), mesh.devices().len()),
            ));
        }
        mesh.device().backend()?.from_local(shards, mesh, placements, shape)
    }

    /// The whole value on the mesh's first device, as an ordinary tensor
    /// (PyTorch's `full_tensor`): gathers shards and reduces partial values.
    pub fn full_tensor(&self) -> Result<Tensor> {
        let mesh = self.mesh_op("full_tensor")?;
        let replicated = self.redistribute(&mesh, &vec![Placement::Replicate; mesh.ndim()])?;
        let mut shards = self.backend().local_shards(&replicated)?;
        Ok(shards.swap_remove(0))
    }

    /// The same values on `like`'s device, laid out as `like` is: with its mesh
    /// and placements when `like` is distributed. A tensor that is not yet on
    /// that mesh is cut into shards from its data (no device holds it whole);
    /// one on the mesh is redistributed. This is how loaded checkpoints and
    /// optimizer state take the placements of the parameters they belong to.
    pub fn placed_like(&self, like: &Tensor) -> Result<Tensor> {
        if !like.is_distributed() {
            return self.to_device(like.device());
        }
        let (mesh, placements) = (like.device_mesh()?, like.placements()?);
        if self.device() == like.device() {
            return self.redistribute(&mesh, &placements);
        }
        let t = if self.is_distributed() { self.to_device(Device::Cpu)? } else { self.clone() };
        distribute_tensor(&t, &mesh, &placements)
    }

    /// The root mesh of a distributed tensor (from its device alone: a
    /// deferred value is not computed for it), or the error for `op`.
    fn mesh_op(&self, op: &'static str) -> Result<DeviceMesh> {
        if !self.is_distributed() {
            return Err(Error::device(op, format!("the tensor is on {}, not on a device mesh", self.device())));
        }
        DeviceMesh::of_device(self.device())
    }
}
