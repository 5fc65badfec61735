//! Activation checkpointing (`torch.utils.checkpoint`): run a function without
//! keeping its intermediate tensors, and recompute them during backward.
use kiln_tensor::generator::{default_generator, default_generators};
use kiln_tensor::{is_grad_enabled, CustomBackward, Error, Generator, Result, Tensor};
use std::sync::Arc;

/// Runs `f(inputs)` without recording its inside; during backward, `f` runs again
/// (with the default generators of the CPU and of the inputs' devices put back
/// where they were, so dropout masks match) to get the gradients. Trades
/// compute for memory: only the inputs are kept.
///
/// ```
/// use kiln::prelude::*;
/// let x = Tensor::new([1.0f32, 2.0])?;
/// x.requires_grad_(true)?;
/// let y = kiln::autograd::checkpoint(|xs| Ok(vec![xs[0].exp()?.mul(&xs[0])?]), &[&x])?;
/// y[0].sum()?.backward()?;
/// // d/dx (x e^x) = e^x (1 + x)
/// let g = x.grad().unwrap().to_vec::<f32>()?;
/// assert!((g[0] - 1f32.exp() * 2.0).abs() < 1e-5);
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn checkpoint<F>(f: F, inputs: &[&Tensor]) -> Result<Vec<Tensor>>
where
    F: Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send + Sync + 'static,
{
    let rng = generator_states(inputs)?;
    let outputs = {
        let _g = crate::no_grad();
        let detached: Vec<Tensor> = inputs.iter().map(|t| t.detach()).collect();
        f(&detached)?
    };
    if !is_grad_enabled() || !inputs.iter().any(|t| t.requires_grad()) {
        return Ok(outputs);
    }
    let f = Arc::new(f);
    let backward: CustomBackward = Arc::new(move |grads, edges| {
        let saved_rng: Vec<(Generator, Tensor)> =
            rng.iter().map(|(g, _)| Ok((g.clone(), g.get_state()?))).collect::<Result<_>>()?;
        restore(&rng)?;
        let _g = crate::enable_grad();
        let fresh: Vec<Tensor> = edges
            .iter()
            .map(|e| {
                if e.value.version() != e.version {
                    return Err(Error::inplace(
                        "checkpoint",
                        "an input of a checkpointed function was modified in place before backward",
                    ));
                }
                let t = e.value.detach();
                if e.requires_grad {
                    t.requires_grad_(true)?;
                }
                Ok(t)
            })
            .collect::<Result<_>>()?;
        let outs = f(&fresh);
        restore(&saved_rng)?;
        let outs = outs?;
        let pairs: Vec<(&Tensor, &Tensor)> = outs
            .iter()
            .zip(grads)
            .filter_map(|(o, g)| g.as_ref().map(|g| (o, g)))
            .filter(|(o, _)| o.requires_grad())
            .collect();
        let wanted: Vec<&Tensor> = fresh.iter().filter(|t| t.requires_grad()).collect();
        if pairs.is_empty() || wanted.is_empty() {
            return Ok(vec![None; edges.len()]);
        }
        let os: Vec<&Tensor> = pairs.iter().map(|p| p.0).collect();
        let gs: Vec<&Tensor> = pairs.iter().map(|p| p.1).collect();
        let mut got = crate::grad(&os, &wanted, Some(&gs), false, false)?.into_iter();
        Ok(fresh.iter().map(|t| if t.requires_grad() { got.next().flatten() } else { None }).collect())
    });
    let out_refs: Vec<&Tensor> = outputs.iter().collect();
    Tensor::record_custom("checkpoint", inputs, &out_refs, backward);
    Ok(outputs)
}

/// The states of the default generators `f` may draw from: the CPU's, the
/// inputs' devices' (made now if they do not exist yet) and any other made so far.
fn generator_states(inputs: &[&Tensor]) -> Result<Vec<(Generator, Tensor)>> {
    default_generator(kiln_tensor::Device::Cpu)?;
    for t in inputs {
        default_generator(t.device())?;
    }
    default_generators().into_iter().map(|g| Ok((g.clone(), g.get_state()?))).collect()
}

fn restore(states: &[(Generator, Tensor)]) -> Result<()> {
    for (g, s) in states {
        g.set_state(s)?;
    }
    Ok(())
}
