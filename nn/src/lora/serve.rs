//! Serving several LoRA adapters at once: adapters loaded into numbered slots
//! of their layers ([`load_served_adapter`]) and a routing of a forward's
//! packed rows to slots ([`with_routing`]), which every adapted `Linear`
//! applies as one product per adapter over its rows (Note [Serving adapters]).
use super::{select, LoraAdapter, LoraConfig, ADAPTER_WEIGHTS_FILE, PEFT_PREFIX};
use crate::io::load_safetensors;
use crate::module::Module;
use kiln_tensor::{DType, Device, Error, Result, Tensor};
use std::cell::RefCell;
use std::path::Path;
use std::rc::Rc;

// Note [Serving adapters]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A server answers requests for several adapters and for the base model in
// one step, as Punica's SGMV and S-LoRA do, without merging any adapter into
// the weights. Each adapter lives in a numbered slot of the layers it
// adapts (`Linear::add_served_adapter`); they are data, not parameters (no
// gradient, not in `named_parameters` or `state_dict`). A forward over the
// packed token rows of a step runs under a routing: for each slot, the rows
// of the sequences that asked for it. Every adapted layer computes its base
// product for all rows, then for each slot gathers that slot's rows, applies
// `B(scaling * A(x))` to them and adds the result back into those rows
// (`index_add`): one pair of products per adapter, sized by its rows. Rows of
// the base model are left alone, so a request gets exactly what its adapter
// alone gives, which the tests check against the merged model's
// `generate()`. The KV cache's prefix sharing keys its blocks by the adapter
// too (keys and values differ under an adapter on k_proj / v_proj).

/// Which packed rows of a forward go through which adapter slot.
#[derive(Debug, Clone)]
pub struct AdapterRouting {
    rows: usize,
    /// Per slot with rows: the slot and its rows (int64 `[n]`).
    groups: Vec<(usize, Tensor)>,
}

impl AdapterRouting {
    /// The routing of rows whose adapter slots are `slots` (`None`: the
    /// base model), with the row indices on `device`; `None` when no row has
    /// an adapter.
    pub fn new(slots: &[Option<usize>], device: Device) -> Result<Option<AdapterRouting>> {
        let mut by_slot: std::collections::BTreeMap<usize, Vec<i64>> = Default::default();
        for (row, s) in slots.iter().enumerate() {
            if let Some(s) = s {
                by_slot.entry(*s).or_default().push(row as i64);
            }
        }
        if by_slot.is_empty() {
            return Ok(None);
        }
        let groups = by_slot
            .into_iter()
            .map(|(s, rows)| {
                let n = rows.len();
                Ok((s, Tensor::from_vec(rows, &[n])?.to_dtype(DType::I64)?.to_device(device)?))
            })
            .collect::<Result<_>>()?;
        Ok(Some(AdapterRouting { rows: slots.len(), groups }))
    }

    /// `y` (the base output `[..., out]` of input `x` `[..., in]`, whose
    /// leading dimensions hold the rows) plus each routed slot's adapter in
    /// `served` applied to its rows.
    pub(crate) fn apply(&self, y: &Tensor, x: &Tensor, served: &[(usize, LoraAdapter)]) -> Result<Tensor> {
        // The rows are the input's leading dimensions flattened (`[N, in]` packed, or `[B, T, in]`).
        let (d_in, d_out) = (x.shape().last().copied().unwrap_or(0), y.shape().last().copied().unwrap_or(0));
        if x.ndim() < 2 || x.numel() != self.rows * d_in {
            return Err(Error::shape(
                "lora routing",
                format!(
                    "a routed forward's adapted layers take {} rows, got an input of shape {:?}; adapters on a \
                     layer that sees other rows (lm_head) cannot be served",
                    self.rows,
                    x.shape()
                ),
            ));
        }
        let x = x.reshape_to(&[self.rows, d_in])?;
        let mut out = y.reshape_to(&[self.rows, d_out])?;
        for (slot, rows) in &self.groups {
            let Some((_, a)) = served.iter().find(|(s, _)| s == slot) else { continue };
            let delta = a.delta(&x.index_select(0, rows)?)?;
            out = if delta.dtype() == out.dtype() {
                out.index_add(0, rows, &delta)?
            } else {
                out.to_dtype(delta.dtype())?.index_add(0, rows, &delta)?.to_dtype(y.dtype())?
            };
        }
        out.reshape_to(y.shape())
    }
}

thread_local! {
    static ROUTING: RefCell<Option<Rc<AdapterRouting>>> = const { RefCell::new(None) };
}

/// Runs `f` with `routing` in force on this thread (the previous routing
/// back afterwards, also when `f` panics): every `Linear` with served
/// adapters adds, to the rows of each slot, that slot's adapter.
pub fn with_routing<R>(routing: Option<AdapterRouting>, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<Rc<AdapterRouting>>);
    impl Drop for Restore {
        fn drop(&mut self) {
            let prev = self.0.take();
            ROUTING.with(|r| *r.borrow_mut() = prev);
        }
    }
    let prev = ROUTING.with(|r| r.replace(routing.map(Rc::new)));
    let _restore = Restore(prev);
    f()
}

/// The routing in force on this thread, if any.
pub(crate) fn routing() -> Option<Rc<AdapterRouting>> {
    ROUTING.with(|r| r.borrow().clone())
}

/// Loads the PEFT adapter in `dir` into slot `slot` of the layers its
/// configuration selects (on their devices, as data: nothing trains), for
/// [`with_routing`]. Strict: every adapter matrix must be in the file with
/// its shape, the file must hold nothing else, and `modules_to_save`,
/// adapters on `lm_head` and a slot already taken are refused; nothing is
/// loaded unless every check passes. Returns the configuration.
pub fn load_served_adapter(model: &mut dyn Module, dir: impl AsRef<Path>, slot: usize) -> Result<LoraConfig> {
    let dir = dir.as_ref();
    let err = |m: String| Error::invalid("load_served_adapter", format!("{}: {m}", dir.display()));
    let config = super::load_adapter_config(dir)?;
    let mut state = load_safetensors(dir.join(ADAPTER_WEIGHTS_FILE))?;
    if config.use_dora {
        return Err(err("DoRA adapters rescale the whole weight: serve them merged (lora::merge_and_unload)".into()));
    }
    if !config.modules_to_save.is_empty() {
        return Err(err("an adapter with modules_to_save replaces whole modules: serve it merged".into()));
    }
    let (selected, mut problems) = select(model, &config)?;
    if selected.iter().any(|n| n == "lm_head" || n.ends_with(".lm_head")) {
        problems.push("adapters on lm_head cannot be served (it sees the logits rows, not the token rows)".into());
    }
    let mut adapters = vec![];
    model.visit_linears_mut("", &mut |n, l| {
        if !selected.iter().any(|s| s == n) {
            return Ok(());
        }
        if l.served_adapters().iter().any(|(s, _)| *s == slot) {
            problems.push(format!("{n}: slot {slot} is taken"));
            return Ok(());
        }
        let key = |m: &str| format!("{PEFT_PREFIX}{n}.{m}.weight");
        match (state.remove(&key("lora_A")), state.remove(&key("lora_B"))) {
            (Some(a), Some(b)) => {
                let (r, scaling) = config.rank_and_scaling(n)?;
                if a.shape() != [r, l.in_features()] || b.shape() != [l.out_features(), r] {
                    problems.push(format!(
                        "{n}: lora_A {:?} and lora_B {:?} do not fit rank {r} on a layer {} -> {}",
                        a.shape(),
                        b.shape(),
                        l.in_features(),
                        l.out_features()
                    ));
                } else {
                    let dev = l.weight.device();
                    let dtype = if l.weight.dtype() == DType::F64 { DType::F64 } else { DType::F32 };
                    let put = |t: Tensor| t.to_dtype(dtype)?.to_device(dev);
                    adapters.push((n.to_string(), LoraAdapter::from_weights(put(a)?, put(b)?, scaling, 0.0)?));
                }
            }
            _ => problems.push(format!("{n}: lora_A or lora_B is missing from the file")),
        }
        Ok(())
    })?;
    problems.extend(state.keys().map(|k| format!("unexpected {k}")));
    if !problems.is_empty() {
        return Err(err(problems.join("; ")));
    }
    // The walk visits the layers in the order they were collected.
    let mut adapters = adapters.into_iter().peekable();
    model.visit_linears_mut("", &mut |n, l| {
        if let Some((_, a)) = adapters.next_if(|(name, _)| name == n) {
            l.add_served_adapter(slot, a)?;
        }
        Ok(())
    })?;
    Ok(config)
}
