//! Manual collectives for code written per device (JAX's `shard_map`,
//! PyTorch's `local_map` with functional collectives): inside a local region
//! (`kiln::local_map`), tensors are each device's local block, and
//! [`all_reduce`], [`all_gather`], [`reduce_scatter`], [`all_to_all`] and
//! [`permute`] exchange blocks between the devices along one mesh axis. They
//! are primitives (`Op::Collective`), so autograd differentiates through them
//! (see Note [Local regions]).
use crate::op::Op;
use crate::{DeviceMesh, Error, Result, Tensor};
use std::cell::RefCell;

// Note [Local regions]
// ~~~~~~~~~~~~~~~~~~~~
// `local_map(f, mesh, in_placements, out_placements, inputs)` runs `f` once
// per device on that device's block of each input, as SPMD code: kiln traces
// `f` once on stand-ins for the blocks and runs the trace on every device of
// the mesh as one program, the body of a Shardy `manual_computation` whose
// operands carry `in_placements` and whose results carry `out_placements`
// (inside a function `kiln::compile` traces, that computation becomes part
// of the captured program, over the function's whole mesh).
// Inside the body nothing is partitioned: each device computes on its block,
// and the collectives below are the only communication, lowered to
// StableHLO's `all_reduce`, `all_gather`, `reduce_scatter`, `all_to_all` and
// `collective_permute` over the groups of devices that differ only along the
// named axis. Ops that check their operands on the device (indices, group
// sizes, divisors) check every device's block: each device's flags come out
// of the program and any failing one is the region's error. The region's
// mesh is thread-local while `f` is traced, which is how a collective finds
// its groups; outside a region a collective is an error. Gradients: each collective's rule is another collective (the sum's
// adjoint is a sum, a gather's is a reduce-scatter, an all-to-all's is the
// reverse all-to-all, a permutation's is the inverse one), and `local_map`
// as a whole is differentiated by a second region that recomputes `f` and
// runs backward inside it, so the gradient program is SPMD too. A
// `Replicate` output is read from the first device; for gradients it counts
// as the mean of its copies (each device's cotangent is divided by the number
// of copies) and a replicated input's gradient is the sum of the devices'
// (an `all_reduce` inside the gradient region), which is exact whenever the
// copies of a replicated output are equal, as they must be.

pub use crate::op::collective::{Collective, CollectiveOp};

thread_local! {
    static REGION: RefCell<Vec<DeviceMesh>> = const { RefCell::new(Vec::new()) };
}

/// Marks the thread as tracing the body of a local region over `mesh` until
/// the guard drops (backends call this around the trace of `local_map`'s function).
pub fn enter_local_region(mesh: &DeviceMesh) -> LocalRegionGuard {
    REGION.with(|r| r.borrow_mut().push(mesh.clone()));
    LocalRegionGuard(())
}

/// Leaves the local region on drop.
pub struct LocalRegionGuard(());

impl Drop for LocalRegionGuard {
    fn drop(&mut self) {
        REGION.with(|r| r.borrow_mut().pop());
    }
}

/// The mesh of the local region being traced on this thread, if any.
pub fn local_region_mesh() -> Option<DeviceMesh> {
    REGION.with(|r| r.borrow().last().cloned())
}

/// The groups of mesh positions along `axis` of `mesh`: the devices whose
/// coordinates differ only on that axis, each group in axis order.
pub fn axis_groups(mesh: &DeviceMesh, axis: &str) -> Result<Vec<Vec<usize>>> {
    let names = mesh.root_axis_names();
    let a = names.iter().position(|n| *n == axis).ok_or_else(|| {
        Error::invalid("collective", format!("the mesh has no axis {axis:?}; its axes are {names:?}"))
    })?;
    let mut groups: Vec<(Vec<usize>, Vec<usize>)> = vec![];
    for pos in 0..mesh.devices().len() {
        let mut key = mesh.coordinates(pos);
        key[a] = 0;
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, g)) => g.push(pos),
            None => groups.push((key, vec![pos])),
        }
    }
    Ok(groups.into_iter().map(|(_, g)| g).collect())
}

fn collective(t: &Tensor, kind: Collective, axis: &str) -> Result<Tensor> {
    let op = CollectiveOp { kind, groups: vec![] };
    let mesh = local_region_mesh().ok_or_else(|| {
        Error::invalid(
            op.name(),
            "collectives exchange the blocks of a local region: call them inside the function given to kiln::local_map",
        )
    })?;
    let op = CollectiveOp { groups: axis_groups(&mesh, axis)?, ..op };
    Ok(Tensor::apply(Op::Collective(op), &[t])?.remove(0))
}

/// The sum of the blocks of every device along `axis` (`psum`), on each of them.
pub fn all_reduce(t: &Tensor, axis: &str) -> Result<Tensor> {
    collective(t, Collective::AllReduce, axis)
}

/// The blocks of the devices along `axis`, concatenated along `dim` in axis order.
pub fn all_gather(t: &Tensor, dim: usize, axis: &str) -> Result<Tensor> {
    collective(t, Collective::AllGather { dim }, axis)
}

/// The sum of the blocks along `axis`, of which device i keeps piece i along `dim`.
pub fn reduce_scatter(t: &Tensor, dim: usize, axis: &str) -> Result<Tensor> {
    collective(t, Collective::ReduceScatter { dim }, axis)
}

/// Piece i (along `split`) of every block along `axis` goes to device i,
/// which concatenates what it gets along `concat`.
pub fn all_to_all(t: &Tensor, split: usize, concat: usize, axis: &str) -> Result<Tensor> {
    collective(t, Collective::AllToAll { split, concat }, axis)
}

/// Each `(source, target)` pair (indices along `axis`) sends the source's
/// block to the target (`ppermute`); a device nothing is sent to gets zeros.
pub fn permute(t: &Tensor, pairs: &[(usize, usize)], axis: &str) -> Result<Tensor> {
    collective(t, Collective::Permute { pairs: pairs.to_vec() }, axis)
}
