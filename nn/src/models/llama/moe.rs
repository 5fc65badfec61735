//! Qwen3-MoE's training loss: the router logits of a forward pass, and
//! transformers' load-balancing loss (`load_balancing_loss_func`, Switch
//! Transformer's auxiliary loss) added to the language-modelling loss when
//! the configuration asks for it (`output_router_logits`); and the model's
//! sparse blocks' expert layouts (stacked, split over a mesh axis).
use super::{causal_lm_loss, LlamaForCausalLM};
use crate::layers::SparseMoeBlock;
use kiln_tensor::trace::ConstantScope;
use kiln_tensor::{DType, DeviceMesh, Error, Result, Tensor};

impl LlamaForCausalLM {
    /// The sparse mixture-of-experts blocks, in layer order (none for a dense model).
    pub fn sparse_blocks_mut(&mut self) -> Vec<&mut SparseMoeBlock> {
        self.model.layers.iter_mut().filter_map(|l| l.mlp.as_sparse_mut()).collect()
    }

    /// Stacks every sparse block's experts (see [`SparseMoeBlock::stack_experts`]):
    /// parameters `….mlp.experts.{gate,up,down}_proj`; `state_dict` and
    /// `save_pretrained` keep the Hub's per-expert names.
    pub fn stack_experts(&mut self) -> Result<()> {
        self.sparse_blocks_mut().into_iter().try_for_each(|b| b.stack_experts())
    }

    /// Expert parallelism: every sparse block's experts split over `axis` of
    /// `mesh` (see [`SparseMoeBlock::parallelize_experts`]). A dense model
    /// has no experts to split: an error.
    pub fn parallelize_experts(&mut self, mesh: &DeviceMesh, axis: &str) -> Result<()> {
        let blocks = self.sparse_blocks_mut();
        if blocks.is_empty() {
            return Err(Error::invalid(
                "parallelize_experts",
                "the model has no mixture-of-experts layer: expert parallelism needs experts (use ddp or fsdp)",
            ));
        }
        blocks.into_iter().try_for_each(|b| b.parallelize_experts(mesh, axis))
    }

    /// GShard's capacity factor for every expert-parallel block (see
    /// [`SparseMoeBlock::set_capacity_factor`]); `None` restores dropless
    /// routing. A dense model has no experts to bound: an error.
    pub fn set_expert_capacity_factor(&mut self, factor: Option<f64>) -> Result<()> {
        let blocks = self.sparse_blocks_mut();
        if blocks.is_empty() {
            return Err(Error::invalid(
                "set_expert_capacity_factor",
                "the model has no mixture-of-experts layer: a capacity factor bounds what expert parallelism exchanges",
            ));
        }
        blocks.into_iter().try_for_each(|b| b.set_capacity_factor(factor))
    }

    /// Logits `[B, T, vocab]` and the router logits of every sparse layer
    /// (`[B * T, experts]` each, in layer order; none for a dense model).
    pub fn forward_with_router_logits(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
    ) -> Result<(Tensor, Vec<Tensor>)> {
        let mut router = vec![];
        let logits = self.with_policy(|| {
            let h = self.model.forward_taps(input_ids, attention_mask, None, None, Some(&mut router), None)?;
            self.logits(&h)
        })?;
        Ok((logits, router))
    }

    /// The loss transformers' `*ForCausalLM` computes with
    /// `labels = input_ids`: [`causal_lm_loss`] (targets of -100 ignored),
    /// plus `router_aux_loss_coef` times [`load_balancing_loss`] for a
    /// mixture-of-experts model whose configuration sets
    /// `output_router_logits` (padding, where `attention_mask` is 0, left
    /// out of the balance). Also returns the logits.
    pub fn training_loss(&self, input_ids: &Tensor, attention_mask: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
        let aux = self.config().moe.as_ref().filter(|m| m.output_router_logits && m.num_experts > 0);
        let (logits, router) = match aux {
            Some(_) => self.forward_with_router_logits(input_ids, attention_mask)?,
            None => (self.forward(input_ids, attention_mask)?, vec![]),
        };
        let loss = causal_lm_loss(&logits, input_ids, Some(-100))?;
        let Some(m) = aux.filter(|_| !router.is_empty()) else { return Ok((loss, logits)) };
        let aux = load_balancing_loss(&router, m.num_experts, m.num_experts_per_tok, attention_mask)?;
        let _c = ConstantScope::enter();
        Ok((loss.add(&aux.mul(m.router_aux_loss_coef)?)?, logits))
    }
}

/// transformers' `load_balancing_loss_func`: over the router logits of every
/// sparse layer (`[N, experts]` each), `experts * Σ_e f_e · P_e`, where `f_e`
/// is the number of top-`k` assignments to expert `e` per token and `P_e`
/// the mean routing probability of `e`, both over the tokens of all layers
/// (those where `attention_mask`, `[B, T]` with `B * T = N`, is nonzero).
/// Only `P` carries a gradient. Float32.
pub fn load_balancing_loss(
    router_logits: &[Tensor],
    num_experts: usize,
    top_k: usize,
    attention_mask: Option<&Tensor>,
) -> Result<Tensor> {
    let _c = ConstantScope::enter();
    let Some(first) = router_logits.first() else {
        return Err(Error::invalid("load_balancing_loss", "no router logits (the model has no sparse layer)"));
    };
    let dev = first.device();
    let rows = first.shape().first().copied().unwrap_or(0);
    let mask = match attention_mask {
        Some(m) if m.numel() != rows => {
            return Err(Error::shape(
                "load_balancing_loss",
                format!("an attention mask of shape {:?} for {rows} routed tokens", m.shape()),
            ))
        }
        Some(m) => Some(m.reshape(&[rows as isize])?.to_dtype(DType::F32)?),
        None => None,
    };
    // Every shape is checked before anything is allocated from the arguments.
    if let Some(bad) = router_logits.iter().find(|l| l.shape() != [rows, num_experts]) {
        return Err(Error::shape(
            "load_balancing_loss",
            format!("router logits of shape {:?}, expected [{rows}, {num_experts}]", bad.shape()),
        ));
    }
    if top_k > num_experts {
        return Err(Error::invalid(
            "load_balancing_loss",
            format!("top_k ({top_k}) is more than the {num_experts} experts"),
        ));
    }
    let mut counts = Tensor::zeros(&[num_experts], (DType::F32, dev))?;
    let mut probs = Tensor::zeros(&[num_experts], (DType::F32, dev))?;
    // The weight of each token (a column to scale probabilities) and of each
    // top-k slot (to count assignments): the same for every layer.
    let per_row = mask.as_ref().map(|m| m.unsqueeze(-1)).transpose()?;
    let per_slot = match &per_row {
        None => Tensor::ones(&[rows * top_k], (DType::F32, dev))?,
        Some(r) => r.expand(&[rows as isize, top_k as isize])?.reshape(&[-1])?,
    };
    for logits in router_logits {
        let w = logits.softmax(-1)?;
        let (_, chosen) = w.topk(top_k, -1, true, true)?;
        let chosen = chosen.reshape(&[-1])?;
        let w32 = w.to_dtype(DType::F32)?;
        let w32 = match &per_row {
            None => w32,
            Some(r) => w32.mul(r)?,
        };
        counts = counts.index_add(0, &chosen, &per_slot)?;
        probs = probs.add(&w32.sum_dim(0, false)?)?;
    }
    let total = match &mask {
        None => Tensor::full(&[], (rows * router_logits.len()) as f64, (DType::F32, dev))?,
        Some(m) => m.sum()?.mul(router_logits.len() as f64)?,
    };
    let f = counts.div(&total)?;
    let p = probs.div(&total)?;
    f.mul(&p)?.sum()?.mul(num_experts as f64)
}
