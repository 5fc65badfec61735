//! What happens to a step's logits before a token is chosen (Note [Logit
//! processing]), and the log-probabilities reported with it.
use super::request::{Request, TokenLogprobs};
use kiln_tensor::{DType, Error, Result, Tensor};
use std::collections::HashMap;

// Note [Logit processing]
// ~~~~~~~~~~~~~~~~~~~~~~~
// A request's logits `[1, vocab]` go through, in this order (vLLM's):
// `logit_bias` added; the repetition penalty (transformers'
// `RepetitionPenaltyLogitsProcessor`: over the prompt and the output, a
// positive logit divided by it, a negative one multiplied); the frequency
// and presence penalties (OpenAI's definition: over the output only,
// `logit -= count * frequency + (count > 0) * presence`); the grammar's mask
// (disallowed tokens set to -inf, last, so nothing brings one back). Then
// temperature, top-k, top-p and min-p as `generate` applies them
// (`warp_logits`). All of it in float32 on the host, as transformers'
// processors compute on float32 logits, and only for requests that ask for
// any of it: the rest keep their logits untouched on the device.
//
// Reported log-probabilities are those of the model's distribution,
// `log_softmax` of the logits before any of this (vLLM's default,
// `raw_logprobs`): what the model thinks of the token, whatever steered the
// choice.

/// Whether `req` changes its logits before choosing.
pub(crate) fn processes(req: &Request) -> bool {
    !req.penalties.is_off() || !req.logit_bias.is_empty() || req.grammar.is_some()
}

/// `logits` (`[1, vocab]`) after `req`'s bias and penalties (Note [Logit
/// processing]), given the sequence's tokens so far (the request's prompt,
/// then what it generated): what the engine samples from.
/// An error when `logits` is not `[1, vocab]` of a floating dtype or `req`
/// does not fit that vocabulary (a bias token outside it, a NaN penalty).
pub fn process_logits(logits: &Tensor, req: &Request, tokens: &[i64]) -> Result<Tensor> {
    req.check(vocab_of(logits)?, usize::MAX, true, true)?;
    process(logits, req, tokens, None)
}

/// The vocabulary of `logits`, or an error unless they are `[1, vocab]` of a floating dtype.
fn vocab_of(logits: &Tensor) -> Result<usize> {
    if logits.ndim() != 2 || logits.shape()[0] != 1 || !logits.dtype().is_float() {
        return Err(Error::shape(
            "serve",
            format!("expected logits [1, vocab] of a floating dtype, got {:?} {}", logits.shape(), logits.dtype()),
        ));
    }
    Ok(logits.shape()[1])
}

/// [`process_logits`], then every token `allowed` (a bit set over the
/// vocabulary) leaves out set to -inf.
pub(crate) fn process(logits: &Tensor, req: &Request, tokens: &[i64], allowed: Option<&[u32]>) -> Result<Tensor> {
    vocab_of(logits)?;
    let device = logits.device();
    let mut x = logits.to_dtype(DType::F32)?.to_device(kiln_tensor::Device::Cpu)?.to_vec::<f32>()?;
    let v = x.len();
    for &(t, b) in &req.logit_bias {
        x[t as usize] += b;
    }
    let p = &req.penalties;
    if p.repetition != 1.0 {
        let mut seen = vec![false; v];
        for &t in tokens.iter().filter(|&&t| (t as usize) < v) {
            if !std::mem::replace(&mut seen[t as usize], true) {
                let l = &mut x[t as usize];
                *l = if *l < 0.0 { *l * p.repetition } else { *l / p.repetition };
            }
        }
    }
    if p.presence != 0.0 || p.frequency != 0.0 {
        let mut counts: HashMap<i64, u32> = HashMap::new();
        for &t in &tokens[req.prompt.len().min(tokens.len())..] {
            *counts.entry(t).or_default() += 1;
        }
        for (t, c) in counts.into_iter().filter(|&(t, _)| (t as usize) < v) {
            x[t as usize] -= c as f32 * p.frequency + p.presence;
        }
    }
    if let Some(mask) = allowed {
        for (i, l) in x.iter_mut().enumerate() {
            if !super::grammar::allows(mask, i) {
                *l = f32::NEG_INFINITY;
            }
        }
    }
    Tensor::from_vec(x, &[1, v])?.to_device(device)
}

/// The log-probability of `token` and the `top` most likely tokens' under
/// `logits` (`[1, vocab]`, unprocessed).
pub(crate) fn logprobs(logits: &Tensor, token: i64, top: usize) -> Result<TokenLogprobs> {
    let lp = logits.to_dtype(DType::F32)?.log_softmax(-1)?;
    let chosen = lp.narrow(1, token as isize, 1)?.to_vec::<f32>()?[0];
    let top = if top == 0 {
        vec![]
    } else {
        let (vals, ids) = lp.topk(top, -1, true, true)?;
        ids.to_vec::<i64>()?.into_iter().zip(vals.to_vec::<f32>()?).collect()
    };
    Ok(TokenLogprobs { logprob: chosen, top })
}
