//! Speculative decoding (Note [Speculative decoding]): proposals by prompt
//! lookup or by a draft model, and their verification against the target's
//! distributions.
use super::engine::{Engine, Seq, StepOutput};
use super::kv::{PagedBatch, PagedKvCache, SeqChunk};
use super::request::FinishReason;
use crate::generate::{warp_logits, Sampling};
use crate::models::LlamaForCausalLM;
use kiln_tensor::{DType, Error, Generator, Result, Tensor};

// Note [Speculative decoding]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A decoding sequence may get up to `k` proposed tokens `d1..dk` before its
// step: the `k` tokens that followed the latest earlier occurrence of its
// last `n` tokens (prompt lookup, `n` from `n_max` down to `n_min`), or `k`
// tokens a smaller draft model sharing the tokenizer decodes ahead. The
// target model then runs `[last, d1..dk]` as one chunk of the step (beside
// every other sequence's work), with the logits of all `k + 1` rows: row
// `j` is the target's distribution `p_j` for the token after `d_j`, exactly
// as decoding one token at a time would compute it (Note [Batch invariance]).
//
// Verification keeps the output distributed as the target's alone
// (Leviathan et al., "Fast Inference from Transformers via Speculative
// Decoding"; Chen et al.): `d_j`, drawn from the proposer's `q_j`, is kept
// with probability `min(1, p_j(d_j) / q_j(d_j))`; the first one refused is
// replaced by a draw from `max(0, p_j - q_j)` normalised, and when all `k`
// are kept a last token is drawn from `p_k`. A prompt lookup's proposal is
// certain (`q_j` puts all its mass on `d_j`): `d_j` is kept with probability
// `p_j(d_j)`, and a refused one is replaced by a draw from `p_j` without
// `d_j`. Greedy requests keep `d_j` while it is the argmax of `p_{j-1}`'s
// logits, so their tokens are exactly non-speculative decoding's. `p_j` is
// the request's own distribution: its penalties and bias over the tokens
// before that row, then its temperature, top-k, top-p and min-p; requests
// with a grammar or logprobs decode one token at a time.
//
// Each step emits between 1 and `k + 1` tokens for the sequence. The keys and
// values the chunk wrote for refused tokens lie past the sequence's length
// and are overwritten as it grows; blocks are registered for sharing only
// up to its kept tokens. The draft model keeps its own paged pool under the
// target's block ids: before proposing it catches up on the tokens it has
// not seen (the prompt, or the last kept tokens) in one chunk, then decodes
// `k - 1` steps. Its keys and values only shape proposals, never outputs:
// wherever they are stale (a block another sequence shares), verification
// still keeps the target's distribution, only the acceptance rate changes.

/// How the engine proposes tokens for its model to verify (Note
/// [Speculative decoding]).
#[derive(Clone)]
pub enum Speculation {
    /// Prompt lookup: the `k` tokens that followed the latest earlier
    /// occurrence of the sequence's last `n` tokens, the longest `n` from
    /// `n_max` down to `n_min` that occurs.
    NGram {
        /// Tokens proposed per step.
        k: usize,
        /// The shortest suffix looked up.
        n_min: usize,
        /// The longest suffix looked up.
        n_max: usize,
    },
    /// A smaller model with the target's tokenizer (and vocabulary), decoding
    /// `k` tokens ahead; its KV pool has the target's number of blocks.
    Draft {
        /// The draft model, on the target's device.
        model: Box<LlamaForCausalLM>,
        /// Tokens proposed per step.
        k: usize,
    },
}

impl std::fmt::Debug for Speculation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Speculation::NGram { k, n_min, n_max } => write!(f, "NGram {{ k: {k}, n: {n_min}..={n_max} }}"),
            Speculation::Draft { k, .. } => write!(f, "Draft {{ k: {k} }}"),
        }
    }
}

impl Speculation {
    /// Tokens proposed per step.
    pub fn k(&self) -> usize {
        match self {
            Speculation::NGram { k, .. } | Speculation::Draft { k, .. } => *k,
        }
    }

    /// Checks the settings against the target `model`.
    pub(crate) fn check(&self, model: &LlamaForCausalLM) -> Result<()> {
        let op = "Speculation";
        if self.k() == 0 {
            return Err(Error::invalid(op, "k must be at least 1"));
        }
        match self {
            Speculation::NGram { n_min, n_max, .. } if *n_min == 0 || n_min > n_max => {
                Err(Error::invalid(op, format!("expected 1 <= n_min <= n_max, got {n_min} and {n_max}")))
            }
            Speculation::NGram { .. } => Ok(()),
            Speculation::Draft { model: d, .. } => {
                let (v, dv) = (model.config().vocab_size, d.config().vocab_size);
                if v != dv || d.device() != model.device() {
                    return Err(Error::invalid(
                        op,
                        format!(
                            "the draft model must share the target's vocabulary and device: vocabularies {dv} and \
                             {v}, devices {} and {}",
                            d.device(),
                            model.device()
                        ),
                    ));
                }
                Ok(())
            }
        }
    }
}

/// Prompt lookup: the (at most `k`) tokens that followed the latest earlier
/// occurrence of the last `n` tokens of `tokens`, for the longest `n` from
/// `n_max` down to `n_min` that occurs; empty when none does.
pub fn ngram_proposal(tokens: &[i64], k: usize, n_min: usize, n_max: usize) -> Vec<i64> {
    let len = tokens.len();
    for n in (n_min.max(1)..=n_max.min(len.saturating_sub(1))).rev() {
        let suffix = &tokens[len - n..];
        // The latest start before the suffix itself.
        if let Some(s) = (0..len - n).rev().find(|&s| &tokens[s..s + n] == suffix) {
            let from = s + n;
            return tokens[from..(from + k).min(len)].to_vec();
        }
    }
    vec![]
}

/// A draft model and its paged pool (block ids shared with the target's).
pub(crate) struct Drafter {
    model: LlamaForCausalLM,
    cache: PagedKvCache,
}

/// One sequence's part of a draft round.
pub(crate) struct DraftSeq<'a> {
    /// Its tokens (prompt and kept output).
    pub tokens: &'a [i64],
    /// Positions the draft has cached.
    pub computed: &'a mut usize,
    /// Its blocks (covering `tokens.len() + k` positions).
    pub blocks: &'a [usize],
    /// Tokens to propose.
    pub k: usize,
    pub sampling: &'a Sampling,
    pub generator: Option<&'a Generator>,
}

/// A proposal: the tokens and, for sampled requests, the distribution each
/// was drawn from (`[vocab]` probabilities).
pub(crate) struct Proposal {
    pub tokens: Vec<i64>,
    pub q: Option<Vec<Vec<f32>>>,
}

impl Drafter {
    pub fn new(model: LlamaForCausalLM, num_blocks: usize, block_size: usize) -> Result<Drafter> {
        let cache = PagedKvCache::new(&model, num_blocks, block_size, model.dtype())?;
        Ok(Drafter { model, cache })
    }

    /// The proposals of `seqs`, decoded together: a first step catching each
    /// up on its unseen tokens (and giving its first proposal), then one
    /// token per step.
    pub fn propose(&self, seqs: &mut [DraftSeq<'_>]) -> Result<Vec<Proposal>> {
        let bs = self.cache.block_size();
        let mut out: Vec<Proposal> =
            seqs.iter().map(|s| Proposal { tokens: vec![], q: (!s.sampling.is_greedy()).then(Vec::new) }).collect();
        let rounds = seqs.iter().map(|s| s.k).max().unwrap_or(0);
        for round in 0..rounds {
            let active: Vec<usize> = (0..seqs.len()).filter(|&i| seqs[i].k > round).collect();
            // Each active sequence's unseen tokens: its own, then its proposals so far.
            let feed: Vec<Vec<i64>> = active
                .iter()
                .map(|&i| {
                    let s = &seqs[i];
                    let mut all: Vec<i64> = s.tokens.to_vec();
                    all.extend(&out[i].tokens);
                    all[*s.computed..].to_vec()
                })
                .collect();
            let chunks: Vec<SeqChunk<'_>> = active
                .iter()
                .zip(&feed)
                .map(|(&i, f)| SeqChunk { tokens: f, start: *seqs[i].computed, blocks: seqs[i].blocks, logits: 1 })
                .collect();
            let batch = PagedBatch::new(&chunks, bs, self.model.device())?;
            let logits = self.model.forward_paged(&batch, &self.cache)?;
            // The greedy choices of every row at once.
            let best = logits.argmax(Some(-1), false)?.to_vec::<i64>()?;
            for (row, (&i, f)) in active.iter().zip(&feed).enumerate() {
                let s = &mut seqs[i];
                *s.computed += f.len();
                let (tok, q) = match s.generator {
                    None => (best[row], None),
                    Some(g) => {
                        let l = logits.narrow(0, row as isize, 1)?;
                        let q = warp_logits(&l, s.sampling)?.softmax(-1)?.to_vec::<f32>()?;
                        let u = g.rand(&[1], DType::F64)?.to_vec::<f64>()?[0];
                        (draw(&q, u) as i64, Some(q))
                    }
                };
                out[i].tokens.push(tok);
                if let (Some(all), Some(q)) = (out[i].q.as_mut(), q) {
                    all.push(q);
                }
            }
        }
        Ok(out)
    }
}

impl Engine {
    /// Gives the decoding sequences of `plan` their proposals (Note
    /// [Speculative decoding]), within the step's token budget, their
    /// remaining tokens and the free blocks: each proposal is appended to
    /// the sequence's tokens and its chunk grows by as many.
    pub(super) fn speculate(&mut self, plan: &mut [(usize, usize)]) -> Result<()> {
        let Some(spec) = &self.cfg.speculative else { return Ok(()) };
        let (k_max, lookup) = match spec {
            Speculation::NGram { k, n_min, n_max } => (*k, Some((*n_min, *n_max))),
            Speculation::Draft { k, .. } => (*k, None),
        };
        let bs = self.cache.block_size();
        let mut budget = self.cfg.max_batched_tokens.saturating_sub(plan.iter().map(|p| p.1).sum());
        let mut chosen: Vec<(usize, usize)> = vec![];
        for (pi, &(i, chunk)) in plan.iter().enumerate() {
            let s = &mut self.running[i];
            let decoding = chunk == 1 && s.computed + 1 == s.tokens.len();
            // Grammars and logprobs take one token at a time; the draft model has no adapters.
            if !decoding
                || s.constraint.is_some()
                || s.req.logprobs.is_some()
                || (lookup.is_none() && s.adapter.is_some())
            {
                continue;
            }
            let left = s.req.max_new_tokens.saturating_sub(s.generated());
            let mut k = k_max.min(budget).min(left.saturating_sub(1));
            if let (Some((lo, hi)), true) = (lookup, k > 0) {
                let p = ngram_proposal(&s.tokens, k, lo, hi);
                k = p.len();
                s.proposal = Some(Proposal { tokens: p, q: None });
            }
            if k == 0 || !Engine::grow(&mut self.blocks, s, s.tokens.len() + k, bs) {
                s.proposal = None;
                continue;
            }
            budget -= k;
            chosen.push((pi, k));
        }
        if let Some(drafter) = &self.drafter {
            let mut at: Vec<Option<&mut Seq>> = self.running.iter_mut().map(Some).collect();
            let mut seqs: Vec<DraftSeq<'_>> = chosen
                .iter()
                .map(|&(pi, k)| {
                    let s = at[plan[pi].0].take().expect("one plan entry per sequence");
                    DraftSeq {
                        tokens: &s.tokens,
                        computed: &mut s.draft_computed,
                        blocks: &s.blocks,
                        k,
                        sampling: &s.req.sampling,
                        generator: s.generator.as_ref(),
                    }
                })
                .collect();
            let proposals = drafter.propose(&mut seqs)?;
            for (&(pi, _), p) in chosen.iter().zip(proposals) {
                self.running[plan[pi].0].proposal = Some(p);
            }
        }
        for &(pi, _) in &chosen {
            let s = &mut self.running[plan[pi].0];
            let p = s.proposal.as_ref().expect("proposed above");
            s.tokens.extend_from_slice(&p.tokens);
            plan[pi].1 = 1 + p.tokens.len();
        }
        Ok(())
    }

    /// Verifies every proposal of the plan against its rows of `logits`
    /// (taken): for each plan entry with one, the number of tokens proposed
    /// and the tokens to emit (the kept proposals, then the model's own).
    #[allow(clippy::type_complexity)]
    pub(super) fn verify(
        &mut self,
        plan: &[(usize, usize)],
        logits: &mut [Option<Tensor>],
    ) -> Result<Vec<Option<(usize, Vec<i64>)>>> {
        let mut verified = vec![None; plan.len()];
        for (k, &(i, _)) in plan.iter().enumerate() {
            let s = &mut self.running[i];
            let Some(p) = s.proposal.take() else { continue };
            let l = logits[k].take().ok_or_else(|| Error::invalid("serve", "a proposal without its logits"))?;
            let (n, base) = (p.tokens.len(), s.tokens.len() - p.tokens.len());
            // Row j is the distribution of the token after the first base + j
            // tokens: processed row by row (penalties count the tokens before it).
            let l = match super::logits::processes(&s.req) {
                false => l,
                true => {
                    let rows = (0..=n)
                        .map(|j| {
                            super::logits::process(&l.narrow(0, j as isize, 1)?, &s.req, &s.tokens[..base + j], None)
                        })
                        .collect::<Result<Vec<_>>>()?;
                    Tensor::cat(&rows.iter().collect::<Vec<_>>(), 0)?
                }
            };
            let (kept, next) = match &s.generator {
                None => verify_greedy(&p.tokens, &l.argmax(Some(-1), false)?.to_vec::<i64>()?),
                Some(g) => {
                    let probs = probabilities(&l, &s.req.sampling)?;
                    let probs: Vec<Vec<f32>> = probs.chunks(probs.len() / (n + 1)).map(<[f32]>::to_vec).collect();
                    let u = g.rand(&[n + 1], DType::F64)?.to_vec::<f64>()?;
                    verify_sampled(&p.tokens, &probs, p.q.as_deref(), &u)
                }
            };
            self.stats.spec_proposed_tokens += n as u64;
            self.stats.spec_accepted_tokens += kept as u64;
            self.stats.spec_verifications += 1;
            let mut tokens = p.tokens[..kept].to_vec();
            tokens.push(next);
            verified[k] = Some((n, tokens));
        }
        Ok(verified)
    }

    /// Running sequence `i` after verifying `proposed` tokens: its tokens
    /// back to before the proposal, its cached positions to the kept ones,
    /// then `tokens` emitted one by one until one ends it; its new full
    /// blocks registered.
    pub(super) fn accept(
        &mut self,
        i: usize,
        (proposed, tokens): (usize, Vec<i64>),
        out: &mut Vec<StepOutput>,
    ) -> Result<Option<FinishReason>> {
        let s = &mut self.running[i];
        let base = s.tokens.len() - proposed;
        s.tokens.truncate(base);
        s.computed = base + tokens.len() - 1;
        s.draft_computed = s.draft_computed.min(s.computed);
        for t in tokens {
            self.stats.spec_emitted_tokens += 1;
            if let Some(why) = self.emit(i, t, None, out)? {
                return Ok(Some(why));
            }
        }
        self.register_blocks(i);
        Ok(None)
    }
}

/// The index `u` (uniform in `[0, 1)`) falls on in the distribution `p`
/// (weights, not necessarily normalised): the inverse of its cumulative sum.
fn draw(p: &[f32], u: f64) -> usize {
    let total: f64 = p.iter().map(|&x| x as f64).sum();
    let mut acc = 0.0;
    let target = u * total;
    for (i, &x) in p.iter().enumerate() {
        acc += x as f64;
        if target < acc && x > 0.0 {
            return i;
        }
    }
    // Rounding left `target` at the total: the last token with mass.
    p.iter().rposition(|&x| x > 0.0).unwrap_or(0)
}

/// Sampled verification (Note [Speculative decoding]) of `drafts` against
/// the target's distributions `p` (`drafts.len() + 1` rows of `[vocab]`
/// probabilities), with the draft's distributions `q` (none: a certain
/// proposal) and uniform draws `u` (`drafts.len() + 1` in `[0, 1)`): the
/// number of drafts kept and the token that follows them.
pub(crate) fn verify_sampled(drafts: &[i64], p: &[Vec<f32>], q: Option<&[Vec<f32>]>, u: &[f64]) -> (usize, i64) {
    for (j, &d) in drafts.iter().enumerate() {
        let pd = p[j][d as usize] as f64;
        let qd = q.map_or(1.0, |q| q[j][d as usize] as f64);
        if u[j] * qd < pd {
            continue;
        }
        // Refused: a draw from max(0, p - q), normalised.
        let residual: Vec<f32> = match q {
            Some(q) => p[j].iter().zip(&q[j]).map(|(a, b)| (a - b).max(0.0)).collect(),
            None => p[j].iter().enumerate().map(|(t, &a)| if t == d as usize { 0.0 } else { a }).collect(),
        };
        let r = if residual.iter().any(|&x| x > 0.0) { &residual } else { &p[j] };
        return (j, draw(r, u[drafts.len()]) as i64);
    }
    (drafts.len(), draw(&p[drafts.len()], u[drafts.len()]) as i64)
}

/// Greedy verification: the drafts kept while each is the target's choice
/// `best` of the row before it, and the target's choice after them.
pub(crate) fn verify_greedy(drafts: &[i64], best: &[i64]) -> (usize, i64) {
    let kept = drafts.iter().zip(best).take_while(|(d, b)| d == b).count();
    (kept, best[kept])
}

/// The probabilities a sampled request draws its next tokens from, row
/// after row (`R * vocab`), given its processed logits `[R, vocab]`.
pub(crate) fn probabilities(logits: &Tensor, s: &Sampling) -> Result<Vec<f32>> {
    warp_logits(logits, s)?.softmax(-1)?.to_vec::<f32>()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_lookup_takes_the_latest_longest_match() {
        let t = [1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3];
        // "2 3" last occurred at 5..7, followed by 4 5 7.
        assert_eq!(ngram_proposal(&t, 3, 1, 3), vec![4, 5, 7]);
        // The longest match wins: "7 2 3" never occurred before; "2 3" did.
        assert_eq!(ngram_proposal(&t, 8, 2, 4), vec![4, 5, 7, 2, 3]);
        assert_eq!(ngram_proposal(&[5, 6, 7], 2, 1, 2), Vec::<i64>::new());
        assert_eq!(ngram_proposal(&[], 2, 1, 2), Vec::<i64>::new());
    }

    #[test]
    fn verification_keeps_refuses_and_draws_the_rest() {
        let p = vec![vec![0.5, 0.5, 0.0], vec![0.0, 0.25, 0.75], vec![1.0, 0.0, 0.0]];
        // A certain proposal of 1 then 2: kept with p = 0.5, then 0.75.
        assert_eq!(verify_sampled(&[1, 2], &p, None, &[0.4, 0.7, 0.0]), (2, 0));
        // The second refused (u = 0.8 >= 0.75): the rest of p[1] without token 2 is token 1.
        assert_eq!(verify_sampled(&[1, 2], &p, None, &[0.4, 0.8, 0.99]), (1, 1));
        // A draft's q: token 0 with q = 1 against p = 0.5: kept iff u < 0.5; refused, max(0, p - q) is token 1.
        let q = vec![vec![1.0, 0.0, 0.0]];
        assert_eq!(verify_sampled(&[0], &p[..2], Some(&q), &[0.6, 0.3]), (0, 1));
        assert_eq!(verify_sampled(&[0], &p[..2], Some(&q), &[0.4, 0.3]), (1, 2));
        assert_eq!(verify_greedy(&[3, 4, 5], &[3, 4, 6, 1]), (2, 6));
        assert_eq!(verify_greedy(&[], &[7]), (0, 7));
    }
}
