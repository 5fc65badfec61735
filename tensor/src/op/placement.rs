//! How a tensor lies over a device mesh, as primitives see it: the
//! placements of DTensor (`Placement`) and the payload of
//! `Op::Redistribute` (`Redistribution`). The meshes themselves live in
//! `mesh.rs` (Note \[Device meshes\]); a redistribution names its mesh by the
//! mesh device's id and its view's axes, so that primitives need no mesh.
use crate::{Error, Meta, Result};
use smallvec::SmallVec;
use std::fmt;

/// How a tensor is laid over one mesh axis (PyTorch's DTensor placements).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Placement {
    /// Split along tensor dimension `d` over the axis (uneven sizes allowed: the
    /// last shards are shorter, as `torch.chunk` splits).
    Shard(usize),
    /// A full copy on every device of the axis.
    Replicate,
    /// Each device holds a partial value; the tensor is their reduction.
    Partial(PartialOp),
}

/// The reduction that combines the partial values of a [`Placement::Partial`] tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PartialOp {
    Sum,
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Placement::Shard(d) => write!(f, "Shard(dim={d})"),
            Placement::Replicate => write!(f, "Replicate()"),
            Placement::Partial(PartialOp::Sum) => write!(f, "Partial(sum)"),
        }
    }
}

/// The payload of `Op::Redistribute`: the placements the result takes on a
/// view of the input's mesh (`DeviceMesh::redistribution` makes one).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Redistribution {
    /// The mesh device the tensor is on (`Device::Mesh(device)`).
    pub device: usize,
    /// The axes of the view of that mesh the result is placed on, by name.
    pub axes: SmallVec<[String; 4]>,
    /// One placement per axis of the view.
    pub placements: SmallVec<[Placement; 4]>,
}

impl Redistribution {
    /// The result's type: the input's, checked against the placements.
    pub fn infer(&self, input: &Meta) -> Result<Meta> {
        if self.placements.len() != self.axes.len() {
            return Err(Error::invalid(
                "redistribute",
                format!("{} placements for a mesh of {} axes", self.placements.len(), self.axes.len()),
            ));
        }
        for p in &self.placements {
            if let Placement::Shard(d) = p {
                if *d >= input.shape.len() {
                    return Err(Error::shape(
                        "redistribute",
                        format!("{p} of a tensor with {} dimension(s)", input.shape.len()),
                    ));
                }
            }
        }
        Ok(input.clone())
    }
}
