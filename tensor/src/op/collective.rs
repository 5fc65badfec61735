//! The payload of `Op::Collective`: which exchange, over which groups of
//! mesh devices, its typing and its adjoint (Note [Local regions] in `collective.rs`).
use crate::{Error, Meta, Result};
use smallvec::{smallvec, SmallVec};

/// A collective over the devices of one mesh axis, inside a local region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Collective {
    /// Every device gets the sum of the group's blocks.
    AllReduce,
    /// Every device gets the group's blocks concatenated along `dim`.
    AllGather { dim: usize },
    /// The group's blocks are summed, and device i keeps the i-th of the
    /// sum's equal pieces along `dim`.
    ReduceScatter { dim: usize },
    /// Each block is cut into equal pieces along `split`; device i gets piece
    /// i of every device's block, concatenated along `concat` in group order.
    AllToAll { split: usize, concat: usize },
    /// Device `s` sends its block to device `t` for each `(s, t)` (indices
    /// along the axis); a device nothing is sent to gets zeros.
    Permute { pairs: Vec<(usize, usize)> },
}

/// [`Collective`] over concrete groups: the primitive `Op::Collective`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CollectiveOp {
    pub kind: Collective,
    /// The groups of mesh positions (row-major device order of the root mesh,
    /// the program's partition ids) that exchange blocks, each in axis order.
    pub groups: Vec<Vec<usize>>,
}

impl CollectiveOp {
    /// The op's name.
    pub fn name(&self) -> &'static str {
        match self.kind {
            Collective::AllReduce => "all_reduce",
            Collective::AllGather { .. } => "all_gather",
            Collective::ReduceScatter { .. } => "reduce_scatter",
            Collective::AllToAll { .. } => "all_to_all",
            Collective::Permute { .. } => "permute",
        }
    }

    /// The number of devices in each group.
    pub fn group_size(&self) -> usize {
        self.groups.first().map_or(1, |g| g.len())
    }

    /// The output's shape and dtype for an input block `x`.
    pub fn infer(&self, x: &Meta) -> Result<SmallVec<[Meta; 2]>> {
        let name = self.name();
        let n = self.group_size();
        if x.dtype == crate::DType::Bool
            && !matches!(self.kind, Collective::AllGather { .. } | Collective::Permute { .. })
        {
            return Err(Error::dtype(name, "sums of bool blocks are not defined; convert to an integer dtype first"));
        }
        let rank = x.shape.len();
        let check_dim = |d: usize| {
            if d >= rank {
                Err(Error::index(name, format!("dimension {d} of a block with {rank} dimension(s)")))
            } else {
                Ok(())
            }
        };
        let divisible = |d: usize| {
            if !x.shape[d].is_multiple_of(n) {
                Err(Error::shape(
                    name,
                    format!("dimension {d} of a {:?} block does not split into {n} equal pieces", x.shape.as_slice()),
                ))
            } else {
                Ok(())
            }
        };
        let mut shape = x.shape.clone();
        match &self.kind {
            Collective::AllReduce => {}
            Collective::AllGather { dim } => {
                check_dim(*dim)?;
                shape[*dim] *= n;
            }
            Collective::ReduceScatter { dim } => {
                check_dim(*dim)?;
                divisible(*dim)?;
                shape[*dim] /= n;
            }
            Collective::AllToAll { split, concat } => {
                check_dim(*split)?;
                check_dim(*concat)?;
                divisible(*split)?;
                shape[*split] /= n;
                shape[*concat] *= n;
            }
            Collective::Permute { pairs } => {
                let (mut from, mut to) = (vec![false; n], vec![false; n]);
                for &(s, t) in pairs {
                    if s >= n || t >= n {
                        return Err(Error::index(name, format!("pair ({s}, {t}) on an axis of {n} devices")));
                    }
                    if std::mem::replace(&mut from[s], true) || std::mem::replace(&mut to[t], true) {
                        return Err(Error::invalid(
                            name,
                            format!("device {s} sends, or device {t} receives, twice in {pairs:?}"),
                        ));
                    }
                }
            }
        }
        Ok(smallvec![Meta { shape, dtype: x.dtype }])
    }

    /// The collective that carries gradients back: its adjoint.
    pub fn adjoint(&self) -> CollectiveOp {
        let kind = match &self.kind {
            Collective::AllReduce => Collective::AllReduce,
            Collective::AllGather { dim } => Collective::ReduceScatter { dim: *dim },
            Collective::ReduceScatter { dim } => Collective::AllGather { dim: *dim },
            Collective::AllToAll { split, concat } => Collective::AllToAll { split: *concat, concat: *split },
            Collective::Permute { pairs } => {
                Collective::Permute { pairs: pairs.iter().map(|&(s, t)| (t, s)).collect() }
            }
        };
        CollectiveOp { kind, groups: self.groups.clone() }
    }
}
