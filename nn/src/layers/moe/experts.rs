//! A sparse block's experts in their two layouts (one SwiGLU module per
//! expert, or each projection's weights stacked), and the conversion of
//! state dicts between the stacked layout and the Hub's per-expert names.
use crate::layers::SwiGluMlp;
use crate::module::{Module, ModuleField};
use kiln_tensor::{Error, Result, Tensor};
use std::collections::BTreeMap;

// Note [Stacked experts]
// ~~~~~~~~~~~~~~~~~~~~~~
// The Hub stores each expert as its own three Linears
// (`experts.{e}.{gate,up,down}_proj.weight`), and a block loads them so
// (`Experts::Modules`): quantized and biased experts exist only in that form.
// `SparseMoeBlock::stack_experts` turns float experts into one parameter per
// projection, `experts.{gate,up,down}_proj` of shape `[E, out, in]` (each
// expert's weight at its index, as transformers 5 holds experts in memory):
// the grouped products read them without stacking copies every forward, and
// expert parallelism shards them over the experts. The on-disk layout does
// not change: `to_hub_layout` splits stacked entries of a state dict back
// into the per-expert names (saving, comparing gradients with transformers'),
// and `from_hub_layout` stacks per-expert entries for a model that holds
// stacked parameters (resuming a checkpoint).

/// The three projections' names, as both layouts spell them.
const PROJECTIONS: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];

/// Each projection's weights of every expert, stacked along a new first
/// dimension (`[experts, out, in]`; Note [Stacked experts]).
#[derive(Debug, Clone, Module)]
#[module(crate = "crate")]
pub struct StackedExperts {
    /// `[experts, intermediate, hidden]`.
    pub gate_proj: Tensor,
    /// `[experts, intermediate, hidden]`.
    pub up_proj: Tensor,
    /// `[experts, hidden, intermediate]`.
    pub down_proj: Tensor,
}

impl StackedExperts {
    /// The three weights in `gate, up, down` order.
    pub fn weights(&self) -> [&Tensor; 3] {
        [&self.gate_proj, &self.up_proj, &self.down_proj]
    }
}

/// The experts of a sparse block (Note [Stacked experts]).
#[derive(Debug, Clone)]
pub enum Experts {
    /// One SwiGLU MLP per expert, named `{e}.{gate,up,down}_proj.weight` (and
    /// `.bias`): the Hub's layout, and the only one for experts kept
    /// quantized or with biases.
    Modules(Vec<SwiGluMlp>),
    /// Each projection's weights stacked, named `{gate,up,down}_proj`.
    Stacked(StackedExperts),
}

impl Experts {
    /// The number of experts.
    pub fn len(&self) -> usize {
        match self {
            Experts::Modules(m) => m.len(),
            Experts::Stacked(s) => s.gate_proj.shape().first().copied().unwrap_or(0),
        }
    }

    /// Whether there are no experts.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The per-expert modules, in the `Modules` layout.
    pub fn modules(&self) -> Option<&[SwiGluMlp]> {
        match self {
            Experts::Modules(m) => Some(m),
            Experts::Stacked(_) => None,
        }
    }

    /// The per-expert modules, mutably, in the `Modules` layout.
    pub fn modules_mut(&mut self) -> Option<&mut Vec<SwiGluMlp>> {
        match self {
            Experts::Modules(m) => Some(m),
            Experts::Stacked(_) => None,
        }
    }

    /// The stacked weights, in the `Stacked` layout.
    pub fn stacked(&self) -> Option<&StackedExperts> {
        match self {
            Experts::Stacked(s) => Some(s),
            Experts::Modules(_) => None,
        }
    }
}

// The layout's visitors: the list's (`{e}.…`) or the stacked weights'.
impl Module for Experts {
    fn visit_params(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor)) {
        match self {
            Experts::Modules(m) => m.visit_field(prefix, f),
            Experts::Stacked(s) => s.visit_params(prefix, f),
        }
    }

    fn visit_params_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor) -> Result<()>) -> Result<()> {
        match self {
            Experts::Modules(m) => m.visit_field_mut(prefix, f),
            Experts::Stacked(s) => s.visit_params_mut(prefix, f),
        }
    }

    fn train(&mut self, on: bool) {
        if let Experts::Modules(m) = self {
            m.train_field(on)
        }
    }

    fn is_training(&self) -> bool {
        match self {
            Experts::Modules(m) => m.field_is_training(),
            Experts::Stacked(_) => false,
        }
    }
}

/// The layer name and projection of a stacked expert weight's name
/// (`model.layers.3.mlp.experts.up_proj` -> `("model.layers.3.mlp", "up_proj")`).
fn stacked_name(name: &str) -> Option<(&str, &str)> {
    let (layer, proj) = name.rsplit_once(".experts.").or_else(|| name.strip_prefix("experts.").map(|p| ("", p)))?;
    PROJECTIONS.contains(&proj).then_some((layer, proj))
}

/// Whether `name` is a stacked expert weight's (`….experts.{gate,up,down}_proj`).
pub(crate) fn is_stacked_expert(name: &str) -> bool {
    stacked_name(name).is_some()
}

/// `{layer}.experts.{e}.{proj}.weight` (no leading dot for an empty layer).
fn hub_name(layer: &str, e: usize, proj: &str) -> String {
    crate::module::join_name(layer, &format!("experts.{e}.{proj}.weight"))
}

/// A state dict in the Hub's layout: each stacked expert weight
/// (`….experts.{gate,up,down}_proj`, `[E, out, in]`) split into its
/// experts' `….experts.{e}.{proj}.weight` (views of it); other entries as
/// they are (Note [Stacked experts]).
pub fn to_hub_layout(state: BTreeMap<String, Tensor>) -> Result<BTreeMap<String, Tensor>> {
    let mut out = BTreeMap::new();
    for (name, t) in state {
        match stacked_name(&name) {
            Some((layer, proj)) if t.ndim() == 3 => {
                for e in 0..t.shape()[0] {
                    out.insert(hub_name(layer, e, proj), t.select(0, e as isize)?);
                }
            }
            _ => {
                out.insert(name, t);
            }
        }
    }
    Ok(out)
}

/// `state` (in the Hub's layout) for a model whose parameters are `params`:
/// for each stacked expert weight among `params`, its experts' per-expert
/// entries stacked into one (every expert must be there, with one shape);
/// other entries as they are. The inverse of [`to_hub_layout`].
pub fn from_hub_layout(
    mut state: BTreeMap<String, Tensor>,
    params: &BTreeMap<String, Tensor>,
) -> Result<BTreeMap<String, Tensor>> {
    for (name, p) in params {
        let Some((layer, proj)) = stacked_name(name).filter(|_| p.ndim() == 3) else { continue };
        if state.contains_key(name) {
            continue;
        }
        let n = p.shape()[0];
        let parts = (0..n)
            .map(|e| {
                let key = hub_name(layer, e, proj);
                state.remove(&key).ok_or_else(|| {
                    Error::invalid(
                        "load_state_dict",
                        format!("{key} is missing: the model stacks {n} experts' weights into {name}"),
                    )
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let refs: Vec<&Tensor> = parts.iter().collect();
        let stacked = Tensor::stack(&refs, 0)
            .map_err(|e| Error::invalid("load_state_dict", format!("stacking the experts of {name}: {e}")))?;
        state.insert(name.clone(), stacked);
    }
    Ok(state)
}
