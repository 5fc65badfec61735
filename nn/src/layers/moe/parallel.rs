//! Expert parallelism: a sparse block whose stacked experts are split over
//! one axis of a device mesh runs as per-device code (`kiln::local_map`),
//! tokens sent to their experts' devices and back with `all_to_all`.
use super::experts::StackedExperts;
use kiln_autograd::local_map;
use kiln_tensor::collective::all_to_all;
use kiln_tensor::{DType, DeviceMesh, Error, Placement, Result, Tensor};

// Note [Expert parallelism]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// With the experts' stacked weights (Note [Stacked experts]) split over a
// mesh axis `ep` of size P (`Shard(0)`: device d holds experts
// d*L..(d+1)*L, L = E/P), a block runs inside a local region whose tokens
// are split over every axis of the mesh (the batch is). The router runs
// before the region, on the whole batch. Per device, on its n tokens and
// their n*k routing slots:
// 1. sort the slots by expert (stable), count them per expert and per
//    destination device (`dest = expert / L`), and place each sorted slot's
//    token row at its destination's next free row of a send buffer
//    `[P, C, hidden]`;
// 2. `all_to_all` the buffer and the per-expert counts over `ep`: device d
//    receives from each device s the rows s sent to d's experts, sorted by
//    expert, and how many each expert got;
// 3. order the received rows by local expert (rows past the counts go last)
//    and run the SwiGLU as three grouped products with the local experts'
//    weights (Note [Grouped experts]), rows past the groups giving zeros;
// 4. put the results back in received order, `all_to_all` them back, and
//    add each slot's result, scaled by its routing weight, into its token
//    in sorted-slot order (so each token's experts are added in expert
//    order, as on one device).
// Static shapes need a fixed capacity C per destination. It is dropless:
// C = n*k, the most one device can send to one destination (every slot of
// every token there), so nothing is ever dropped and the result is the
// one-device block's. The price is bytes: each all_to_all moves P*C rows per
// device where the routing needs n*k on average, P times the minimum.
// Everything is autograd ops, collectives included, so the backward pass is
// the same exchange reversed, inside the gradient region of `local_map`.

/// Where a block's experts are split: the whole mesh (tokens are split over
/// every axis of it) and the axis the experts are split over.
#[derive(Debug, Clone)]
pub(crate) struct ExpertParallel {
    pub mesh: DeviceMesh,
    pub axis: String,
}

impl ExpertParallel {
    /// Checks that `experts` split evenly over `axis` of `mesh`.
    pub fn new(mesh: &DeviceMesh, axis: &str, experts: usize) -> Result<ExpertParallel> {
        let mesh = mesh.root();
        let p = mesh.axis_size(axis).map_err(|_| {
            Error::invalid(
                "expert parallelism",
                format!("the mesh {mesh} has no axis {axis:?} to split the experts over"),
            )
        })?;
        if p == 0 || !experts.is_multiple_of(p) {
            return Err(Error::invalid(
                "expert parallelism",
                format!("{experts} experts do not split evenly over the {p} devices of axis {axis:?}"),
            ));
        }
        Ok(ExpertParallel { mesh, axis: axis.to_string() })
    }

    /// The placements of the stacked weights: experts split over the axis,
    /// whole on every other axis.
    pub fn weight_placements(&self) -> Vec<Placement> {
        self.mesh
            .axis_names()
            .iter()
            .map(|a| if *a == self.axis { Placement::Shard(0) } else { Placement::Replicate })
            .collect()
    }

    /// The experts on tokens `x: [N, hidden]` routed to `idx` (`[N, k]`,
    /// int64) with `weights` (`[N, k]`), as Note [Expert parallelism] says.
    pub fn forward(&self, experts: &StackedExperts, x: &Tensor, weights: &Tensor, idx: &Tensor) -> Result<Tensor> {
        let n = x.shape()[0];
        if n == 0 {
            return Tensor::zeros(x.shape(), (x.dtype(), x.device()));
        }
        let k = idx.shape()[1];
        let p = self.mesh.axis_size(&self.axis)?;
        let local = experts.gate_proj.shape()[0] / p;
        // Tokens split evenly over every device: padding tokens (zero rows,
        // routed to expert 0 with weight 0) make up a last uneven block.
        let devices = self.mesh.devices().len();
        let pad = (devices - n % devices) % devices;
        let padded = |t: &Tensor| -> Result<Tensor> {
            if pad == 0 {
                return Ok(t.clone());
            }
            let mut shape = t.shape().to_vec();
            shape[0] = pad;
            let z = Tensor::zeros(&shape, (t.dtype(), t.device()))?;
            Tensor::cat(&[t, &z], 0)
        };
        let tokens = vec![Placement::Shard(0); self.mesh.ndim()];
        let w = self.weight_placements();
        let axis = self.axis.clone();
        let body = move |b: &[Tensor]| -> Result<Vec<Tensor>> {
            Ok(vec![exchange(&b[0], &b[1], &b[2], [&b[3], &b[4], &b[5]], k, p, local, &axis)?])
        };
        let [g, u, d] = experts.weights();
        let inputs = [&padded(x)?, &padded(weights)?, &padded(idx)?, g, u, d];
        let places = [tokens.clone(), tokens.clone(), tokens.clone(), w.clone(), w.clone(), w];
        let out = local_map(body, &self.mesh, &places, &[tokens], &inputs)?.remove(0);
        if pad == 0 {
            Ok(out)
        } else {
            out.narrow(0, 0, n)
        }
    }
}

/// One device's part of the block (steps 1-4 of Note [Expert parallelism]):
/// its tokens `x: [n, hidden]`, their routing `weights` and expert `idx`
/// (`[n, k]`), and its `local` experts' stacked weights, with `p` devices on
/// `axis`.
#[allow(clippy::too_many_arguments)]
fn exchange(
    x: &Tensor,
    weights: &Tensor,
    idx: &Tensor,
    w: [&Tensor; 3],
    k: usize,
    p: usize,
    local: usize,
    axis: &str,
) -> Result<Tensor> {
    let (n, hidden) = (x.shape()[0], x.shape()[1]);
    let dev = x.device();
    let int = (DType::I64, dev);
    let slots = n * k;
    let cap = slots;
    // 1. Slots sorted by expert; each one's row of the send buffer.
    let experts = idx.reshape_to(&[slots])?;
    let (sorted, order) = experts.sort_stable(0, false)?;
    let token = order.floor_divide(k as i64)?;
    let counts = Tensor::zeros(&[p * local], int)?.index_add(0, &experts, &Tensor::ones(&[slots], int)?)?;
    let per_dest = counts.reshape_to(&[p, local])?.sum_dim(1, false)?;
    let first = per_dest.cumsum(0)?.sub(&per_dest)?;
    let dest = sorted.floor_divide(local as i64)?;
    let within = Tensor::arange(0.0, slots as f64, 1.0, int)?.sub(&first.index_select(0, &dest)?)?;
    let row = dest.mul(cap as i64)?.add(&within)?;
    let send = Tensor::zeros(&[p * cap, hidden], (x.dtype(), dev))?.index_add(0, &row, &x.index_select(0, &token)?)?;
    // 2. Rows and counts to the experts' devices.
    let recv = all_to_all(&send.reshape_to(&[p, cap, hidden])?, 0, 0, axis)?;
    let got = all_to_all(&counts.reshape_to(&[p, local])?, 0, 0, axis)?;
    // 3. Received rows by local expert (key = the expert, `local` for rows past the counts).
    let ends = got.cumsum(1)?.reshape_to(&[p, 1, local])?;
    let at = Tensor::arange(0.0, cap as f64, 1.0, int)?.reshape_to(&[1, cap, 1])?;
    let key = at.ge(&ends)?.to_dtype(DType::I64)?.sum_dim(2, false)?;
    let (_, by_expert) = key.reshape_to(&[p * cap])?.sort_stable(0, false)?;
    let rows = recv.reshape_to(&[p * cap, hidden])?.index_select(0, &by_expert)?;
    let sizes = got.sum_dim(0, false)?;
    let y = super::grouped_swiglu(&rows, w, &sizes)?;
    // 4. Back in received order, back to the tokens' devices, into the tokens.
    let back = Tensor::zeros(&[p * cap, hidden], (y.dtype(), dev))?.index_add(0, &by_expert, &y)?;
    let back = all_to_all(&back.reshape_to(&[p, cap, hidden])?, 0, 0, axis)?;
    let mine = back.reshape_to(&[p * cap, hidden])?.index_select(0, &row)?;
    let scale = weights.reshape_to(&[slots])?.index_select(0, &order)?;
    let mine = mine.mul(&scale.unsqueeze(-1)?)?;
    Tensor::zeros(&[n, hidden], (mine.dtype(), dev))?.index_add(0, &token, &mine)
}
