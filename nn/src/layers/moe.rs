//! Qwen3-MoE's sparse mixture-of-experts block (`Qwen3MoeSparseMoeBlock`),
//! and [`FeedForward`], a decoder layer's MLP: dense SwiGLU or sparse experts.
use super::mlp::silu_gate;
use super::{Linear, SwiGluMlp};
use crate::module::{join_name, Module};
use kiln_tensor::trace::ConstantScope;
use kiln_tensor::{DType, DeviceMesh, Error, Result, Tensor, TensorOptions};

mod experts;
mod parallel;

pub(crate) use experts::is_stacked_expert;
pub use experts::{from_hub_layout, to_hub_layout, Experts, StackedExperts};
use parallel::ExpertParallel;

// Note [Grouped experts]
// ~~~~~~~~~~~~~~~~~~~~~~
// A sparse block's expert products run as grouped products (Note [Grouped
// products] in kiln-tensor) over the routing slots sorted by expert: dropless
// (every slot is computed, no capacity), and every shape static (`N * top_k`
// rows, whatever the router chose), so the same code runs eagerly on either
// backend and traces into one program under `kiln::compile`; the group sizes
// are data. The products take each projection's `[E, out, in]` weights
// transposed: the stacked parameter (Note [Stacked experts]), or the
// experts' own `[out, in]` parameters stacked for the forward pass, so each
// expert's gradient arrives as its own.
// Each token's expert outputs are added in expert order, as transformers
// adds them. Experts kept quantized have no float weight to stack: they run
// one at a time on host-grouped rows (eager only).

/// A router and SwiGLU experts (`Qwen3MoeSparseMoeBlock`): each token goes
/// to the `top_k` experts its router gives the highest probability (softmax
/// over experts in float32, as transformers computes it), renormalised to
/// sum to 1 when `norm_topk_prob`, and its output is the experts' outputs
/// weighted by those probabilities.
///
/// Parameters as the Hub's checkpoints name them: `gate.weight`
/// (`[num_experts, hidden]`) and `experts.{e}.{gate,up,down}_proj.weight`;
/// after [`SparseMoeBlock::stack_experts`], `experts.{gate,up,down}_proj`
/// (`[num_experts, out, in]`, Note [Stacked experts]).
///
/// ```
/// use kiln::prelude::*;
/// use kiln::nn::layers::SparseMoeBlock;
/// kiln::manual_seed(0);
/// let moe = SparseMoeBlock::new(8, 16, 4, 2, true, 0.02, DType::F32)?;
/// let y = moe.forward(&Tensor::randn(&[2, 3, 8], DType::F32)?)?;
/// assert_eq!(y.shape(), &[2, 3, 8]);
/// # Ok::<(), kiln::Error>(())
/// ```
#[derive(Debug, Clone, Module)]
#[module(crate = "crate")]
pub struct SparseMoeBlock {
    /// The router, `[num_experts, hidden]`, no bias.
    pub gate: Linear,
    /// The experts, each a SwiGLU MLP `hidden -> moe_intermediate -> hidden`.
    pub experts: Experts,
    #[module(skip)]
    top_k: usize,
    #[module(skip)]
    norm_topk_prob: bool,
    /// Where the experts are split (Note [Expert parallelism]).
    #[module(skip)]
    parallel: Option<ExpertParallel>,
}

impl SparseMoeBlock {
    /// A block with `N(0, std²)` router and expert weights.
    pub fn new(
        hidden: usize,
        intermediate: usize,
        num_experts: usize,
        top_k: usize,
        norm_topk_prob: bool,
        std: f64,
        opts: impl Into<TensorOptions>,
    ) -> Result<SparseMoeBlock> {
        let opts = opts.into();
        let gate = Linear::new_normal(hidden, num_experts, false, std, opts)?;
        let experts =
            (0..num_experts).map(|_| SwiGluMlp::new(hidden, intermediate, false, std, opts)).collect::<Result<_>>()?;
        SparseMoeBlock::from_parts(gate, experts, top_k, norm_topk_prob)
    }

    /// A block from its router and experts; the router must have one row per
    /// expert, every expert the router's width, and `top_k` must be in
    /// `1..=experts`.
    pub fn from_parts(
        gate: Linear,
        experts: Vec<SwiGluMlp>,
        top_k: usize,
        norm_topk_prob: bool,
    ) -> Result<SparseMoeBlock> {
        let bad = |msg: String| Err(Error::shape("SparseMoeBlock", msg));
        if gate.out_features() != experts.len() {
            return bad(format!("the router scores {} experts, the block has {}", gate.out_features(), experts.len()));
        }
        if top_k == 0 || top_k > experts.len() {
            return bad(format!("top_k must be in 1..={}, got {top_k}", experts.len()));
        }
        let hidden = gate.in_features();
        if let Some((e, _)) = experts
            .iter()
            .enumerate()
            .find(|(_, m)| m.gate_proj.in_features() != hidden || m.down_proj.out_features() != hidden)
        {
            return bad(format!("expert {e} does not map width {hidden} to itself"));
        }
        Ok(SparseMoeBlock { gate, experts: Experts::Modules(experts), top_k, norm_topk_prob, parallel: None })
    }

    /// Stacks float experts' weights into one parameter per projection
    /// (`experts.{gate,up,down}_proj`, `[num_experts, out, in]`; Note
    /// [Stacked experts]): the same function with fewer copies, and the
    /// layout expert parallelism splits. Each stacked weight requires grad
    /// when the experts' did. Experts kept quantized or with biases stay as
    /// they are (an error); stacked ones are left alone.
    pub fn stack_experts(&mut self) -> Result<()> {
        let Experts::Modules(modules) = &self.experts else { return Ok(()) };
        if !self.runs_on_device() {
            return Err(Error::invalid(
                "stack_experts",
                "experts kept quantized or with biases cannot be stacked into one weight per projection",
            ));
        }
        let _g = kiln_autograd::no_grad();
        let requires_grad = modules.first().is_some_and(|m| m.gate_proj.weight.requires_grad());
        let [gate_proj, up_proj, down_proj] = self.projection_weights()?.map(|w| w.detach());
        for w in [&gate_proj, &up_proj, &down_proj] {
            w.requires_grad_(requires_grad)?;
        }
        let stacked = StackedExperts { gate_proj, up_proj, down_proj };
        self.experts = Experts::Stacked(stacked);
        Ok(())
    }

    /// Splits the experts over `axis` of `mesh` (expert parallelism, Note
    /// [Expert parallelism]): stacks them (see
    /// [`SparseMoeBlock::stack_experts`]) and places their weights
    /// `Shard(0)` on that axis, whole on the mesh's others; the block then
    /// runs per device with its tokens split over every axis of the mesh.
    /// The number of experts must be a multiple of the axis' size.
    pub fn parallelize_experts(&mut self, mesh: &DeviceMesh, axis: &str) -> Result<()> {
        let ep = ExpertParallel::new(mesh, axis, self.experts.len())?;
        self.stack_experts()?;
        let placements = ep.weight_placements();
        let root = ep.mesh.clone();
        crate::parallel::distribute_module(&mut self.experts, &root, |_, _| placements.clone())?;
        self.parallel = Some(ep);
        Ok(())
    }

    /// GShard's capacity factor for an expert-parallel block (Note [Expert
    /// parallelism]): each device sends each destination at most
    /// `ceil(factor * slots / devices)` of its `slots` routing slots, and
    /// drops the rest (a dropped slot adds nothing to its token). `None`
    /// (the default) is dropless: the one-device block's result. The factor
    /// must be positive and finite, and the block split over a mesh.
    pub fn set_capacity_factor(&mut self, factor: Option<f64>) -> Result<()> {
        let Some(ep) = self.parallel.as_mut() else {
            return Err(Error::invalid(
                "set_capacity_factor",
                "a capacity factor bounds what expert parallelism exchanges: split the experts over a mesh first",
            ));
        };
        if let Some(f) = factor.filter(|f| !f.is_finite() || *f <= 0.0) {
            return Err(Error::invalid(
                "set_capacity_factor",
                format!("the capacity factor must be positive, got {f}"),
            ));
        }
        ep.capacity_factor = factor;
        Ok(())
    }

    /// Experts per token.
    pub fn top_k(&self) -> usize {
        self.top_k
    }

    /// The router on tokens `x: [N, hidden]`: its logits `[N, experts]` (in
    /// `x`'s dtype), and per token the `top_k` routing weights (in `x`'s
    /// dtype, renormalised when `norm_topk_prob`) and expert indices (int64),
    /// highest probability first.
    pub fn route(&self, x: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let _c = ConstantScope::enter();
        let logits = self.gate.forward(x)?;
        // transformers: softmax(router_logits, dtype=torch.float), whatever the input dtype.
        let probs = logits.to_dtype(DType::F32)?.softmax(-1)?;
        let (top, idx) = probs.topk(self.top_k, -1, true, true)?;
        let top = if self.norm_topk_prob { top.div(&top.sum_dim(-1, true)?)? } else { top };
        let weights = top.to_dtype(logits.dtype())?;
        Ok((logits, weights, idx))
    }

    /// The block on `x: [..., hidden]`.
    ///
    /// Dropless, with static shapes (Note [Grouped experts]): the `N * top_k`
    /// routing slots are sorted by expert on the device, their tokens'
    /// rows gathered, each of the SwiGLU's three products run for every
    /// expert at once as one [`Tensor::grouped_mm`] over the sorted rows,
    /// and the rows scaled by their routing weights and added back into
    /// their tokens. Every expert's weights take part, so an expert no token
    /// chose gets a zero gradient rather than none. Nothing is read on the
    /// host, so a step holding the block compiles to one program.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(self.forward_with_router_logits(x)?.0)
    }

    /// [`SparseMoeBlock::forward`], also returning the router logits
    /// (`[N, experts]` for the `N` tokens of `x`, in `x`'s dtype), which the
    /// load-balancing loss reads.
    pub fn forward_with_router_logits(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        let _c = ConstantScope::enter();
        let shape = x.shape().to_vec();
        let hidden = self.gate.in_features();
        if shape.last() != Some(&hidden) {
            return Err(Error::shape("SparseMoeBlock", format!("expected [..., {hidden}], got {shape:?}")));
        }
        let n = shape.iter().product::<usize>() / hidden.max(1);
        let x2 = x.reshape_to(&[n, hidden])?;
        let (logits, weights, idx) = self.route(&x2)?;
        let out = if let (Some(ep), Experts::Stacked(s)) = (&self.parallel, &self.experts) {
            ep.forward(s, &x2, &weights, &idx)?
        } else if self.runs_on_device() {
            self.grouped_experts(&x2, &weights, &idx)?
        } else {
            self.experts_one_by_one(&x2, &weights, &idx)?
        };
        Ok((out.reshape_to(&shape)?, logits))
    }

    /// Whether the block runs without reading data on the host (so it can be
    /// traced and compiled): every expert is three bias-free Linears not kept
    /// quantized, which the grouped products take stacked (Note [Grouped
    /// experts]).
    pub fn runs_on_device(&self) -> bool {
        match &self.experts {
            Experts::Stacked(_) => true,
            Experts::Modules(m) => m.iter().all(|m| {
                [&m.gate_proj, &m.up_proj, &m.down_proj].iter().all(|l| !l.is_quantized() && l.bias.is_none())
            }),
        }
    }

    /// The experts through grouped products (Note [Grouped experts]).
    fn grouped_experts(&self, x2: &Tensor, weights: &Tensor, idx: &Tensor) -> Result<Tensor> {
        let (n, hidden) = (x2.shape()[0], x2.shape()[1]);
        let (k, e) = (self.top_k, self.experts.len());
        let dev = x2.device();
        let slots = idx.reshape_to(&[n * k])?;
        // Slots by expert; within an expert by token (a stable sort of slot order).
        let (_, order) = slots.sort_stable(0, false)?;
        let tokens = order.floor_divide(k as i64)?;
        let ones = Tensor::ones(&[n * k], (DType::I64, dev))?;
        let sizes = Tensor::zeros(&[e], (DType::I64, dev))?.index_add(0, &slots, &ones)?;
        let rows = x2.index_select(0, &tokens)?;
        let [g, u, d] = self.projection_weights()?;
        let y = grouped_swiglu(&rows, [&g, &u, &d], &sizes)?;
        let w = weights.reshape_to(&[n * k])?.index_select(0, &order)?;
        let y = y.mul(&w.unsqueeze(-1)?)?;
        Tensor::zeros(&[n, hidden], (y.dtype(), dev))?.index_add(0, &tokens, &y)
    }

    /// Each projection's `[E, out, in]` weights: the stacked parameters, or
    /// the experts' own stacked (a copy, through which gradients reach them).
    fn projection_weights(&self) -> Result<[Tensor; 3]> {
        match &self.experts {
            Experts::Stacked(s) => Ok(s.weights().map(|w| w.clone())),
            Experts::Modules(m) => {
                let stack = |w: fn(&SwiGluMlp) -> &Tensor| Tensor::stack(&m.iter().map(w).collect::<Vec<_>>(), 0);
                Ok([stack(|m| &m.gate_proj.weight)?, stack(|m| &m.up_proj.weight)?, stack(|m| &m.down_proj.weight)?])
            }
        }
    }

    /// Experts kept quantized (or with biases) one at a time: tokens grouped
    /// on the host, each expert run on its gathered rows. Eager only: the
    /// routing is read back.
    fn experts_one_by_one(&self, x2: &Tensor, weights: &Tensor, idx: &Tensor) -> Result<Tensor> {
        let Experts::Modules(experts) = &self.experts else {
            return Err(Error::invalid("SparseMoeBlock", "stacked experts run as grouped products"));
        };
        let (n, hidden) = (x2.shape()[0], x2.shape()[1]);
        let k = self.top_k;
        let chosen = idx.to_vec::<i64>()?;
        let weights = weights.reshape_to(&[n * k])?;
        let dev = x2.device();
        // Each expert's tokens and routing slots in transformers' order
        // (`torch.where(expert_mask[e])`: by top-k slot, then by token).
        let mut groups: Vec<(Vec<i64>, Vec<i64>)> = vec![(vec![], vec![]); experts.len()];
        for j in 0..k {
            for t in 0..n {
                let slot = t * k + j;
                let e = usize::try_from(chosen[slot]).ok().filter(|&e| e < experts.len()).ok_or_else(|| {
                    Error::invalid("SparseMoeBlock", format!("the router chose expert {}", chosen[slot]))
                })?;
                groups[e].0.push(t as i64);
                groups[e].1.push(slot as i64);
            }
        }
        let mut out = Tensor::zeros(&[n, hidden], (x2.dtype(), dev))?;
        for (expert, (tokens, slots)) in experts.iter().zip(groups) {
            let m = tokens.len();
            let tokens = Tensor::from_vec(tokens, &[m])?.to_device(dev)?;
            let slots = Tensor::from_vec(slots, &[m])?.to_device(dev)?;
            let y = expert.forward(&x2.index_select(0, &tokens)?)?;
            let y = y.mul(&weights.index_select(0, &slots)?.unsqueeze(-1)?)?;
            out = out.index_add(0, &tokens, &y)?;
        }
        Ok(out)
    }
}

/// The experts' SwiGLU on `rows` grouped by expert (`sizes`, Note [Grouped
/// experts]): three grouped products with each projection's `[E, out, in]`
/// weights; rows past the last group give zeros.
fn grouped_swiglu(rows: &Tensor, w: [&Tensor; 3], sizes: &Tensor) -> Result<Tensor> {
    let [wg, wu, wd] = w;
    let g = rows.grouped_mm(&wg.transpose(-1, -2)?, sizes)?;
    let u = rows.grouped_mm(&wu.transpose(-1, -2)?, sizes)?;
    silu_gate(&g, &u)?.grouped_mm(&wd.transpose(-1, -2)?, sizes)
}

/// A decoder layer's MLP: Llama's and Qwen3's dense SwiGLU, or Qwen3-MoE's
/// sparse experts (both named `mlp.*`).
#[derive(Debug, Clone)]
pub enum FeedForward {
    /// `mlp.{gate,up,down}_proj`.
    Dense(SwiGluMlp),
    /// `mlp.gate` and `mlp.experts.{e}.*` (or `mlp.experts.*` stacked).
    Sparse(SparseMoeBlock),
}

impl FeedForward {
    /// The MLP on `x: [..., hidden]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            FeedForward::Dense(m) => m.forward(x),
            FeedForward::Sparse(m) => m.forward(x),
        }
    }

    /// The dense MLP, if this is one.
    pub fn as_dense(&self) -> Option<&SwiGluMlp> {
        match self {
            FeedForward::Dense(m) => Some(m),
            FeedForward::Sparse(_) => None,
        }
    }

    /// The sparse block, if this is one.
    pub fn as_sparse(&self) -> Option<&SparseMoeBlock> {
        match self {
            FeedForward::Sparse(m) => Some(m),
            FeedForward::Dense(_) => None,
        }
    }

    /// The sparse block, mutably, if this is one.
    pub fn as_sparse_mut(&mut self) -> Option<&mut SparseMoeBlock> {
        match self {
            FeedForward::Sparse(m) => Some(m),
            FeedForward::Dense(_) => None,
        }
    }

    /// Whether a weight of the MLP is kept quantized.
    pub fn is_quantized(&self) -> bool {
        let swiglu = |m: &SwiGluMlp| [&m.gate_proj, &m.up_proj, &m.down_proj].iter().any(|l| l.is_quantized());
        match self {
            FeedForward::Dense(m) => swiglu(m),
            FeedForward::Sparse(b) => {
                b.gate.is_quantized() || b.experts.modules().is_some_and(|m| m.iter().any(swiglu))
            }
        }
    }

    /// Every Linear with its name under the MLP (`gate_proj`, `gate`,
    /// `experts.3.up_proj`, ...; stacked experts are not Linears).
    pub fn linears_mut(&mut self) -> Vec<(String, &mut Linear)> {
        fn swiglu<'a>(prefix: &str, m: &'a mut SwiGluMlp, out: &mut Vec<(String, &'a mut Linear)>) {
            out.push((join_name(prefix, "gate_proj"), &mut m.gate_proj));
            out.push((join_name(prefix, "up_proj"), &mut m.up_proj));
            out.push((join_name(prefix, "down_proj"), &mut m.down_proj));
        }
        let mut out = vec![];
        match self {
            FeedForward::Dense(m) => swiglu("", m, &mut out),
            FeedForward::Sparse(b) => {
                out.push(("gate".to_string(), &mut b.gate));
                for (e, m) in b.experts.modules_mut().into_iter().flatten().enumerate() {
                    swiglu(&format!("experts.{e}"), m, &mut out);
                }
            }
        }
        out
    }

    fn module(&self) -> &dyn Module {
        match self {
            FeedForward::Dense(m) => m,
            FeedForward::Sparse(m) => m,
        }
    }

    fn module_mut(&mut self) -> &mut dyn Module {
        match self {
            FeedForward::Dense(m) => m,
            FeedForward::Sparse(m) => m,
        }
    }
}

// An enum holds one module or the other: its visitors are the variant's.
impl Module for FeedForward {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        self.module().visit_params(prefix, f)
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor) -> Result<()>) -> Result<()> {
        self.module_mut().visit_params_mut(prefix, f)
    }

    fn visit_linears_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Linear) -> Result<()>) -> Result<()> {
        self.module_mut().visit_linears_mut(prefix, f)
    }

    fn train(&mut self, on: bool) {
        self.module_mut().train(on)
    }

    fn is_training(&self) -> bool {
        self.module().is_training()
    }
}
