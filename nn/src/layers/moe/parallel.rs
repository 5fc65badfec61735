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
// d*L..(d+1)*L, L = E/P), a block runs as four local regions whose tokens
// are split over every axis of the mesh (the batch is). The router runs
// before them, on the whole batch. Per device, on its n tokens and their
// n*k routing slots:
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
// Static shapes need a fixed capacity C per destination. By default it is
// dropless: C = n*k, the most one device can send to one destination (every
// slot of every token there), so nothing is ever dropped and the result is
// the one-device block's. The price is bytes: each all_to_all moves P*C rows
// per device where the routing needs n*k on average, P times the minimum. A
// capacity factor f (GShard's; `SparseMoeBlock::set_capacity_factor`) sets
// C = ceil(f * n*k / P): the slots a device routes to one destination past
// C (in expert order) are dropped, adding nothing to their tokens, and the
// exchange moves f times the routing's average. The padding tokens that even
// out the last device's block sort after its real slots and are never sent,
// so they take no capacity.
// The regions: the plan (step 1's bookkeeping and the counts' all_to_all,
// integers only), the dispatch (step 1's buffer and step 2's rows), the
// experts (step 3, no collective) and the combine (step 4). `local_map`
// differentiates a region by recomputing it, which for the dispatch and the
// combine would rerun their all_to_alls; both are linear in what they move,
// so their gradients are written out instead (`linear_region`): the same
// exchange reversed (an all_to_all is its own inverse), once each, with the
// rows that came back kept from the forward for the routing weights'
// gradient. A step then exchanges rows four times: twice forward, twice back.

/// Where a block's experts are split: the whole mesh (tokens are split over
/// every axis of it) and the axis the experts are split over.
#[derive(Debug, Clone)]
pub(crate) struct ExpertParallel {
    pub mesh: DeviceMesh,
    pub axis: String,
    /// GShard's capacity factor (see the Note); `None`: dropless.
    pub capacity_factor: Option<f64>,
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
        Ok(ExpertParallel { mesh, axis: axis.to_string(), capacity_factor: None })
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

    /// The rows each device sends to each destination for `slots` routing
    /// slots over `p` devices: all of them (dropless), or the capacity factor's share.
    fn capacity(&self, slots: usize, p: usize) -> usize {
        match self.capacity_factor {
            None => slots,
            Some(f) => ((f * slots as f64 / p as f64).ceil() as usize).clamp(1, slots),
        }
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
        let (x, weights, idx) = (padded(x)?, padded(weights)?, padded(idx)?);
        let real = padded(&Tensor::ones(&[n], (DType::I64, x.device()))?)?;
        let cap = self.capacity((n + pad) / devices * k, p);
        let shape = Shape { k, p, local, cap };
        let plan = Plan::new(&self.mesh, &self.axis, &idx, &real, shape)?;
        let rows = dispatch(&self.mesh, &self.axis, &x, &plan, shape)?;
        let y = self.experts(experts, &rows, &plan.sizes)?;
        let out = combine(&self.mesh, &self.axis, &y, &weights, &plan, shape)?;
        if pad == 0 {
            Ok(out)
        } else {
            out.narrow(0, 0, n)
        }
    }

    /// Step 3 on every device: the SwiGLU of its local experts over the rows
    /// it received (sorted by expert, `sizes` per expert). No collective
    /// runs here, so the region's backward, which recomputes it, exchanges nothing.
    fn experts(&self, experts: &StackedExperts, rows: &Tensor, sizes: &Tensor) -> Result<Tensor> {
        let tokens = tokens(&self.mesh);
        let w = self.weight_placements();
        let body = |b: &[Tensor]| -> Result<Vec<Tensor>> {
            Ok(vec![super::grouped_swiglu(&b[0], [&b[2], &b[3], &b[4]], &b[1])?])
        };
        let [g, u, d] = experts.weights();
        let places = [tokens.clone(), tokens.clone(), w.clone(), w.clone(), w];
        Ok(local_map(body, &self.mesh, &places, &[tokens], &[rows, sizes, g, u, d])?.remove(0))
    }
}

/// The placements of every per-device block of the block's regions: split
/// over every axis of the mesh (each device its own block).
fn tokens(mesh: &DeviceMesh) -> Vec<Placement> {
    vec![Placement::Shard(0); mesh.ndim()]
}

/// The sizes of one device's exchange: `k` slots per token, `p` devices on
/// the expert axis, `local` experts per device, `cap` rows per destination.
#[derive(Debug, Clone, Copy)]
struct Shape {
    k: usize,
    p: usize,
    local: usize,
    cap: usize,
}

/// Where each routing slot goes (step 1 and the counts of step 2, Note
/// [Expert parallelism]), per device, as blocks of tensors split over the
/// mesh: each sorted slot's `token`, its `row` of the send buffer, whether
/// the capacity `keep`s it (1 or 0, in the tokens' dtype), the slot's
/// position in the router's `order`; the received rows' order `by_expert`
/// and the local experts' `sizes`. Integer work only: nothing to differentiate.
struct Plan {
    token: Tensor,
    row: Tensor,
    keep: Tensor,
    order: Tensor,
    by_expert: Tensor,
    sizes: Tensor,
}

impl Plan {
    /// The plan of tokens routed to `idx`, of which `real` (1 or 0 per
    /// token) marks the tokens that are not padding.
    fn new(mesh: &DeviceMesh, axis: &str, idx: &Tensor, real: &Tensor, s: Shape) -> Result<Plan> {
        let _g = kiln_autograd::no_grad();
        let axis = axis.to_string();
        let body = move |b: &[Tensor]| -> Result<Vec<Tensor>> { plan_block(&b[0], &b[1], s, &axis) };
        let t = tokens(mesh);
        let outs = local_map(body, mesh, &[t.clone(), t.clone()], &vec![t.clone(); 6], &[idx, real])?;
        let [token, row, keep, order, by_expert, sizes]: [Tensor; 6] =
            outs.try_into().map_err(|_| Error::invalid("expert parallelism", "a routing plan has six parts"))?;
        Ok(Plan { token, row, keep, order, by_expert, sizes })
    }
}

/// One device's [`Plan`] from its tokens' expert indices `idx` (`[n, k]`)
/// and which of them are `real` (`[n]`, 1 or 0: padding).
fn plan_block(idx: &Tensor, real: &Tensor, s: Shape, axis: &str) -> Result<Vec<Tensor>> {
    let Shape { k, p, local, cap } = s;
    let dev = idx.device();
    let int = (DType::I64, dev);
    let n = idx.shape()[0];
    let slots = n * k;
    let experts = idx.reshape_to(&[slots])?;
    let real = real.unsqueeze(1)?.expand(&[-1, k as isize])?.reshape_to(&[slots])?;
    // Padding slots sort after every real one (a key past the last expert),
    // take no capacity from real ones and are never sent.
    let padding = real.eq(0.0)?.to_dtype(DType::I64)?;
    let key = experts.add(&padding.mul((p * local) as i64)?)?;
    let (sorted_key, order) = key.sort_stable(0, false)?;
    let sorted = experts.index_select(0, &order)?;
    let token = order.floor_divide(k as i64)?;
    let counts = Tensor::zeros(&[p * local], int)?.index_add(0, &experts, &real)?;
    let per_dest = counts.reshape_to(&[p, local])?.sum_dim(1, false)?;
    let first = per_dest.cumsum(0)?.sub(&per_dest)?;
    let dest = sorted_key.floor_divide(local as i64)?.clamp(None, Some(p as f64 - 1.0))?;
    let within = Tensor::arange(0.0, slots as f64, 1.0, int)?.sub(&first.index_select(0, &dest)?)?;
    // Slots past a destination's capacity are dropped (GShard): they write
    // nothing (`keep` 0) to that destination's last row.
    let kept = within.lt(cap as f64)?.to_dtype(DType::I64)?.mul(&real.index_select(0, &order)?)?;
    let row = dest.mul(cap as i64)?.add(&within.clamp(None, Some(cap as f64 - 1.0))?)?;
    let kept_counts = Tensor::zeros(&[p * local], int)?.index_add(0, &sorted, &kept)?;
    let got = all_to_all(&kept_counts.reshape_to(&[p, local])?, 0, 0, axis)?;
    // The received rows by local expert (key = the expert, `local` for rows past the counts).
    let ends = got.cumsum(1)?.reshape_to(&[p, 1, local])?;
    let at = Tensor::arange(0.0, cap as f64, 1.0, int)?.reshape_to(&[1, cap, 1])?;
    let key = at.ge(&ends)?.to_dtype(DType::I64)?.sum_dim(2, false)?;
    let (_, by_expert) = key.reshape_to(&[p * cap])?.sort_stable(0, false)?;
    let sizes = got.sum_dim(0, false)?;
    Ok(vec![token, row, kept.to_dtype(DType::F32)?, order, by_expert, sizes])
}

/// A region whose gradient is written out rather than recomputed (a linear
/// exchange: `local_map` would rerun its `all_to_all`s to differentiate
/// them). `forward` runs on the blocks of `inputs` (the first `n_diff`
/// differentiable); its first output is differentiable, and `vjp` gets the
/// blocks of `inputs`, of every output, then the first output's gradient,
/// and returns the gradients of the first `n_diff` inputs. Every block is a
/// per-device block ([`tokens`]).
fn linear_region(
    mesh: &DeviceMesh,
    name: &'static str,
    forward: impl Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send + Sync + 'static,
    vjp: impl Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send + Sync + 'static,
    inputs: &[&Tensor],
    n_diff: usize,
    n_out: usize,
) -> Result<Vec<Tensor>> {
    let t = tokens(mesh);
    let backend = mesh.device().backend()?;
    let detached: Vec<Tensor> = inputs.iter().map(|x| x.detach()).collect();
    let outputs = {
        let _g = kiln_autograd::no_grad();
        backend.local_map(mesh, &forward, &detached, &vec![t.clone(); inputs.len()], &vec![t.clone(); n_out])?
    };
    let (mesh, saved) = (mesh.clone(), [detached, outputs.iter().map(|o| o.detach()).collect()].concat());
    let vjp = std::sync::Arc::new(vjp);
    let backward: kiln_tensor::CustomBackward = std::sync::Arc::new(move |grads, edges| {
        let g = match grads.first().cloned().flatten() {
            Some(g) => g,
            None => return Ok(vec![None; edges.len()]),
        };
        let mut args = saved.clone();
        args.push(g);
        let backend = mesh.device().backend()?;
        let vjp = vjp.clone();
        let f = move |b: &[Tensor]| vjp(b);
        let t = tokens(&mesh);
        let got = {
            let _g = kiln_autograd::no_grad();
            backend.local_map(&mesh, &f, &args, &vec![t.clone(); args.len()], &vec![t; edges.len()])?
        };
        Ok(got.into_iter().zip(edges).map(|(g, e)| e.requires_grad.then_some(g)).collect())
    });
    Tensor::record_custom(name, &inputs[..n_diff], &[&outputs[0]], backward);
    Ok(outputs)
}

/// Step 1's send buffer and step 2's exchange: the rows each device
/// receives, ordered by local expert (`[p * cap, hidden]` per device). Its
/// gradient is the same exchange reversed (an `all_to_all` is its own
/// inverse), not a recomputation.
fn dispatch(mesh: &DeviceMesh, axis: &str, x: &Tensor, plan: &Plan, s: Shape) -> Result<Tensor> {
    let Shape { p, cap, .. } = s;
    let (a, b) = (axis.to_string(), axis.to_string());
    let forward = move |v: &[Tensor]| -> Result<Vec<Tensor>> {
        let (x, token, row, keep, by_expert) = (&v[0], &v[1], &v[2], &v[3], &v[4]);
        let hidden = x.shape()[1];
        let rows = x.index_select(0, token)?.mul(&keep.to_dtype(x.dtype())?.unsqueeze(-1)?)?;
        let send = Tensor::zeros(&[p * cap, hidden], (x.dtype(), x.device()))?.index_add(0, row, &rows)?;
        let recv = all_to_all(&send.reshape_to(&[p, cap, hidden])?, 0, 0, &a)?;
        Ok(vec![recv.reshape_to(&[p * cap, hidden])?.index_select(0, by_expert)?])
    };
    let vjp = move |v: &[Tensor]| -> Result<Vec<Tensor>> {
        let (x, token, row, keep, by_expert, g) = (&v[0], &v[1], &v[2], &v[3], &v[4], &v[6]);
        let hidden = x.shape()[1];
        let g_recv = Tensor::zeros(&[p * cap, hidden], (g.dtype(), g.device()))?.index_add(0, by_expert, g)?;
        let g_send = all_to_all(&g_recv.reshape_to(&[p, cap, hidden])?, 0, 0, &b)?.reshape_to(&[p * cap, hidden])?;
        let g_slots = g_send.index_select(0, row)?.mul(&keep.to_dtype(g.dtype())?.unsqueeze(-1)?)?;
        Ok(vec![x.zeros_like()?.index_add(0, token, &g_slots)?])
    };
    let inputs = [x, &plan.token, &plan.row, &plan.keep, &plan.by_expert];
    Ok(linear_region(mesh, "expert_dispatch", forward, vjp, &inputs, 1, 1)?.remove(0))
}

/// Step 4: the experts' rows `y` back to their tokens' devices, scaled by
/// their routing `weights` and added into their tokens. The rows as they
/// came back are kept for the weights' gradient, so the backward sends only
/// the rows' gradient back to the experts (one `all_to_all`).
fn combine(mesh: &DeviceMesh, axis: &str, y: &Tensor, weights: &Tensor, plan: &Plan, s: Shape) -> Result<Tensor> {
    let Shape { k, p, cap, .. } = s;
    let (a, b) = (axis.to_string(), axis.to_string());
    // Inputs: y, weights, token, row, keep, order, by_expert.
    let forward = move |v: &[Tensor]| -> Result<Vec<Tensor>> {
        let (y, weights, token, row, keep, order, by_expert) = (&v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6]);
        let (n, hidden) = (weights.shape()[0], y.shape()[1]);
        let back = y.zeros_like()?.index_add(0, by_expert, y)?;
        let back = all_to_all(&back.reshape_to(&[p, cap, hidden])?, 0, 0, &a)?.reshape_to(&[p * cap, hidden])?;
        let came = back.index_select(0, row)?;
        let scale = weights.reshape_to(&[n * k])?.index_select(0, order)?.mul(&keep.to_dtype(weights.dtype())?)?;
        let mine = came.mul(&scale.to_dtype(came.dtype())?.unsqueeze(-1)?)?;
        let out = Tensor::zeros(&[n, hidden], (mine.dtype(), mine.device()))?.index_add(0, token, &mine)?;
        Ok(vec![out, came])
    };
    let vjp = move |v: &[Tensor]| -> Result<Vec<Tensor>> {
        let (y, weights, token, row, keep, order, by_expert) = (&v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6]);
        let (came, g) = (&v[8], &v[9]);
        let (n, hidden) = (weights.shape()[0], y.shape()[1]);
        let keep = keep.to_dtype(g.dtype())?;
        let g_slots = g.index_select(0, token)?;
        let g_scale = g_slots.mul(came)?.sum_dim(1, false)?.mul(&keep)?;
        let g_weights = Tensor::zeros(&[n * k], (g_scale.dtype(), g.device()))?.index_add(0, order, &g_scale)?;
        let scale = weights.reshape_to(&[n * k])?.index_select(0, order)?.to_dtype(g.dtype())?.mul(&keep)?;
        let g_came = g_slots.mul(&scale.unsqueeze(-1)?)?;
        let g_back = Tensor::zeros(&[p * cap, hidden], (g.dtype(), g.device()))?.index_add(0, row, &g_came)?;
        let g_back = all_to_all(&g_back.reshape_to(&[p, cap, hidden])?, 0, 0, &b)?.reshape_to(&[p * cap, hidden])?;
        let g_y = g_back.index_select(0, by_expert)?.to_dtype(y.dtype())?;
        Ok(vec![g_y, g_weights.reshape_to(&[n, k])?.to_dtype(weights.dtype())?])
    };
    let inputs = [y, weights, &plan.token, &plan.row, &plan.keep, &plan.order, &plan.by_expert];
    Ok(linear_region(mesh, "expert_combine", forward, vjp, &inputs, 2, 2)?.remove(0))
}
