//! Context parallelism: a sequence split over the devices of a `cp` mesh
//! axis, attention computed as ring attention (see Note [Ring attention]).
use kiln_autograd::local_map;
use kiln_tensor::collective::permute;
use kiln_tensor::{distribute_tensor, DType, DeviceMesh, Error, Placement, Reduction, Result, Tensor};

// Note [Ring attention]
// ~~~~~~~~~~~~~~~~~~~~~
// Under context parallelism every activation of a layer is split along the
// sequence over the `cp` devices, which is what the partitioner does for
// pointwise work and products with replicated weights. Attention is the one
// place a query needs keys from other devices: `ring_attention` runs as a
// local region (`kiln::local_map`) where each device holds its block of
// queries, keys, values and their positions, and for cp steps scores its
// queries against the key/value block it holds, then passes that block to
// the next device along the axis (`permute`, a ring), keeping an online
// softmax (running max, sum and weighted values, as FlashAttention does).
// After cp steps every query has seen every key once. The causal mask
// compares positions, not block indices, so any order of the sequence over
// the devices gives the same result; `load_balance` uses TorchTitan's order
// (the sequence cut into 2 cp chunks, device i holding chunks i and
// 2 cp - 1 - i), which evens out the unmasked work per device for kernels
// that skip masked blocks. This one computes every block and masks it, so
// the work per device is the same either way; the memory per device is
// 1/cp of the sequence's activations, and attention's scores are one
// [T/cp, T/cp] block at a time.
// Gradients need nothing more: `local_map` differentiates the region by
// recomputing it, and `permute`'s gradient is the reverse ring. The running
// max only stabilises the exponentials (the result does not depend on it),
// so it is a constant of the graph.
// Keys and values travel at their own head count (grouped-query attention
// sends kv_heads, not heads).

/// How a model splits its sequences over a mesh axis (context parallelism).
#[derive(Debug, Clone)]
pub struct ContextParallel {
    mesh: DeviceMesh,
    axis: String,
    load_balance: bool,
}

impl ContextParallel {
    /// Sequences split over `mesh` (one axis, named `axis`), in TorchTitan's
    /// balanced order when `load_balance`.
    pub fn new(mesh: &DeviceMesh, axis: &str, load_balance: bool) -> Result<ContextParallel> {
        if mesh.ndim() != 1 || mesh.axis_names() != [axis] {
            return Err(Error::invalid(
                "context_parallel",
                format!("context parallelism takes a one-axis mesh named {axis:?} (e.g. mesh[\"cp\"]), got {mesh}"),
            ));
        }
        Ok(ContextParallel { mesh: mesh.clone(), axis: axis.to_string(), load_balance })
    }

    /// The mesh the sequence is split over.
    pub fn mesh(&self) -> &DeviceMesh {
        &self.mesh
    }

    /// The devices along the axis.
    pub fn degree(&self) -> usize {
        self.mesh.size()
    }

    /// The sequence positions in the order the devices hold them (device i
    /// the i-th `t / cp` of them); refuses lengths that do not split evenly.
    pub fn order(&self, t: usize) -> Result<Vec<usize>> {
        let cp = self.degree();
        let pieces = if self.load_balance { 2 * cp } else { cp };
        if t == 0 || !t.is_multiple_of(pieces) {
            return Err(Error::shape(
                "context_parallel",
                format!(
                    "a sequence of {t} tokens does not split into {pieces} equal chunks over cp = {cp}{}",
                    if self.load_balance { " (load-balanced: 2 chunks per device)" } else { "" }
                ),
            ));
        }
        if !self.load_balance {
            return Ok((0..t).collect());
        }
        let c = t / pieces;
        Ok((0..cp).flat_map(|i| (i * c..(i + 1) * c).chain((pieces - 1 - i) * c..(pieces - i) * c)).collect())
    }

    /// `t` (`[B, T, ...]`, on the host or any one device) reordered along
    /// dimension 1 and split along it over the mesh: how token ids enter a
    /// context-parallel forward.
    pub fn shard_sequence(&self, t: &Tensor) -> Result<Tensor> {
        if t.ndim() < 2 {
            return Err(Error::shape("context_parallel", format!("expected [B, T, ...], got {:?}", t.shape())));
        }
        let order = self.order(t.shape()[1])?;
        let idx = Tensor::from_vec(order.iter().map(|&i| i as i64).collect::<Vec<_>>(), &[order.len()])?;
        let reordered = t.to_device(kiln_tensor::Device::Cpu)?.index_select(1, &idx)?;
        distribute_tensor(&reordered, &self.mesh, &[Placement::Shard(1)])
    }

    /// The inverse of [`ContextParallel::shard_sequence`] for a result
    /// `[B, T, ...]` of the forward (logits): whole, in sequence order, on the host.
    pub fn unshard_sequence(&self, t: &Tensor) -> Result<Tensor> {
        let whole = if t.is_distributed() { t.full_tensor()? } else { t.clone() };
        let order = self.order(whole.shape()[1])?;
        let mut inverse = vec![0i64; order.len()];
        for (at, &pos) in order.iter().enumerate() {
            inverse[pos] = at as i64;
        }
        let idx = Tensor::from_vec(inverse, &[order.len()])?;
        whole.to_device(kiln_tensor::Device::Cpu)?.index_select(1, &idx)
    }

    /// transformers' causal-LM loss (`labels = input_ids`, mean cross
    /// entropy of each position's logits against the next token) for
    /// `logits` from a context-parallel forward on `shard_sequence(ids)`:
    /// [`ContextParallel::next_token_targets`] then [`ContextParallel::loss`].
    pub fn causal_lm_loss(&self, logits: &Tensor, ids: &Tensor) -> Result<Tensor> {
        self.loss(logits, &self.next_token_targets(ids)?)
    }

    /// The next-token targets of `ids` (`[B, T]`, on the host), made in
    /// sequence order (the last position ignored, -100), then flattened in
    /// the order the devices hold the sequence: `[B * T]` int64, on the
    /// mesh whole (an upload of a whole tensor, which a captured step may
    /// take as an input).
    pub fn next_token_targets(&self, ids: &Tensor) -> Result<Tensor> {
        let _c = kiln_tensor::trace::ConstantScope::enter();
        if ids.ndim() != 2 || ids.shape()[1] < 2 {
            return Err(Error::shape(
                "context_parallel",
                format!("expected ids [B, T] with T >= 2, got {:?}", ids.shape()),
            ));
        }
        let (b, t) = (ids.shape()[0], ids.shape()[1]);
        let ids = ids.to_device(kiln_tensor::Device::Cpu)?.to_dtype(DType::I64)?;
        let last = Tensor::full(&[b, 1], -100i64, DType::I64)?;
        let next = Tensor::cat(&[&ids.narrow(1, 1, t - 1)?, &last], 1)?;
        let order = self.order(t)?;
        let idx = Tensor::from_vec(order.iter().map(|&i| i as i64).collect::<Vec<_>>(), &[t])?;
        next.index_select(1, &idx)?.reshape(&[(b * t) as isize])?.to_device(self.mesh.device())
    }

    /// The mean cross entropy of `logits` (`[B, T, V]` from a
    /// context-parallel forward) against `targets` from
    /// [`ContextParallel::next_token_targets`], ignoring -100 (computed in
    /// float32 for half-precision logits).
    pub fn loss(&self, logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let _c = kiln_tensor::trace::ConstantScope::enter();
        if logits.ndim() != 3 || targets.shape() != [logits.shape()[0] * logits.shape()[1]] {
            return Err(Error::shape(
                "context_parallel",
                format!(
                    "expected logits [B, T, V] and targets [B * T], got {:?} and {:?}",
                    logits.shape(),
                    targets.shape()
                ),
            ));
        }
        let (bt, v) = (targets.shape()[0], logits.shape()[2]);
        let ct = if matches!(logits.dtype(), DType::BF16 | DType::F16) { DType::F32 } else { logits.dtype() };
        logits.to_dtype(ct)?.reshape(&[bt as isize, v as isize])?.cross_entropy(targets, Some(-100), Reduction::Mean)
    }

    /// The positions of the sequence as the devices hold them: int64 `[T]`
    /// on the mesh (replicated; ring attention reads it split). Computed
    /// on the devices from an `arange`, so a captured step holds no upload.
    pub(crate) fn positions(&self, t: usize) -> Result<Tensor> {
        self.order(t)?;
        let j = Tensor::arange(0.0, t as f64, 1.0, (DType::I64, self.mesh.device()))?;
        if !self.load_balance {
            return Ok(j);
        }
        // Token j of the reordered sequence: device i = j / 2c holds chunk i
        // then chunk 2 cp - 1 - i, each c long.
        let (cp, c) = (self.degree() as i64, (t / (2 * self.degree())) as i64);
        let (i, off) = (j.floor_divide(2 * c)?, j.remainder(c)?);
        let first = i.mul(c)?.add(&off)?;
        let second = i.neg()?.add(2 * cp - 1)?.mul(c)?.add(&off)?;
        Tensor::where_cond(&j.floor_divide(c)?.remainder(2)?.eq(0)?, &first, &second)
    }
}

/// Causal attention of `q` (`[B, H, T, d]`) over `k` and `v` (`[B, KV, T, d]`,
/// `H` a multiple of `KV`), all split along `T` over `cp`'s mesh, with
/// `positions` (int64 `[T]`, split likewise) giving each token's position
/// in the sequence: ring attention (Note [Ring attention]). Returns
/// `[B, H, T, d]` split like `q`.
pub fn ring_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    positions: &Tensor,
    cp: &ContextParallel,
    scale: f64,
) -> Result<Tensor> {
    if q.ndim() != 4 || k.ndim() != 4 || k.shape() != v.shape() || !q.shape()[1].is_multiple_of(k.shape()[1]) {
        return Err(Error::shape(
            "ring_attention",
            format!(
                "expected q [B, H, T, d] and k, v [B, KV, T, d], got {:?}, {:?}, {:?}",
                q.shape(),
                k.shape(),
                v.shape()
            ),
        ));
    }
    let n = cp.degree();
    let axis = cp.axis.clone();
    let ring: Vec<(usize, usize)> = (0..n).map(|i| (i, (i + 1) % n)).collect();
    let body = move |x: &[Tensor]| -> Result<Vec<Tensor>> {
        let (q, mut kb, mut vb, qpos) = (&x[0], x[1].clone(), x[2].clone(), &x[3]);
        let mut kpos = qpos.clone();
        let (b, h, t, d) = (q.shape()[0], q.shape()[1], q.shape()[2], q.shape()[3]);
        let kv = kb.shape()[1];
        let g = h / kv;
        let _c = kiln_tensor::trace::ConstantScope::enter();
        // Grouped heads: [B, KV, G*T, d] against each [B, KV, T, d] block.
        let qg = q.mul(scale)?.reshape(&[b as isize, kv as isize, (g * t) as isize, d as isize])?;
        let qp = qpos.unsqueeze(1)?;
        let mut m = Tensor::full(&[b, h, t, 1], -1e30, (q.dtype(), q.device()))?;
        let mut l = Tensor::zeros(&[b, h, t, 1], (q.dtype(), q.device()))?;
        let mut o = Tensor::zeros(&[b, h, t, d], (q.dtype(), q.device()))?;
        for step in 0..n {
            let s = qg.matmul(&kb.transpose(-1, -2)?)?.reshape(&[b as isize, h as isize, t as isize, t as isize])?;
            let visible = qp.ge(&kpos.unsqueeze(0)?)?;
            let s = s.masked_fill(&visible.logical_not()?, -1e30)?;
            let m_new = m.maximum(&s.amax(-1, true)?)?.detach();
            let p = Tensor::where_cond(&visible, &s.sub(&m_new)?.exp()?, 0.0)?;
            let corr = m.sub(&m_new)?.exp()?;
            l = l.mul(&corr)?.add(&p.sum_dim(-1, true)?)?;
            let pv = p
                .reshape(&[b as isize, kv as isize, (g * t) as isize, t as isize])?
                .matmul(&vb)?
                .reshape(&[b as isize, h as isize, t as isize, d as isize])?;
            o = o.mul(&corr)?.add(&pv)?;
            m = m_new;
            if step + 1 < n {
                kb = permute(&kb, &ring, &axis)?;
                vb = permute(&vb, &ring, &axis)?;
                kpos = permute(&kpos, &ring, &axis)?;
            }
        }
        Ok(vec![o.div(&l)?])
    };
    let seq = vec![Placement::Shard(2)];
    local_map(
        body,
        cp.mesh(),
        &[seq.clone(), seq.clone(), seq.clone(), vec![Placement::Shard(0)]],
        &[seq],
        &[q, k, v, positions],
    )
    .map(|mut out| out.remove(0))
}
