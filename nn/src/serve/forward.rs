//! The model's part of an engine step: the logits of every planned sequence
//! due a token (through the captured decode program where there is one, the
//! rest in one `forward_paged`), the grammar masks computed beside them, and
//! the greedy choices taken from them in one op.
use super::decode::DecodeRow;
use super::engine::{Engine, Seq};
use super::grammar::Constraint;
use super::kv::{PagedBatch, SeqChunk};
use kiln_tensor::{Error, Result, Tensor};

impl Engine {
    /// Runs the model over `plan`: the logits `[1, vocab]` of each entry that
    /// is due a token (`[1 + k, vocab]` for one verifying `k` proposed tokens). Decoding sequences go through the captured decode step
    /// where there is one (Note [Step programs]), the rest in one
    /// `forward_paged`.
    pub(super) fn logits(&mut self, plan: &[(usize, usize)]) -> Result<Vec<Option<Tensor>>> {
        let bs = self.cache.block_size();
        let mut logits: Vec<Option<Tensor>> = vec![None; plan.len()];
        // The captured decode step serves the base model's rows; rows with an
        // adapter run eagerly under a routing (Note [Serving adapters]).
        let decoding = |s: &Seq, chunk: usize| chunk == 1 && s.computed + 1 == s.tokens.len() && s.adapter.is_none();
        let mut eager: Vec<usize> = (0..plan.len()).collect();
        if let Some(program) = &mut self.decode {
            let (dec, rest): (Vec<usize>, Vec<usize>) =
                eager.iter().partition(|&&k| decoding(&self.running[plan[k].0], plan[k].1));
            if !dec.is_empty() {
                let rows: Vec<DecodeRow<'_>> = dec
                    .iter()
                    .map(|&k| {
                        let s = &self.running[plan[k].0];
                        DecodeRow { token: s.tokens[s.computed], position: s.computed, blocks: &s.blocks }
                    })
                    .collect();
                let l = program.run(&rows)?;
                for (j, &k) in dec.iter().enumerate() {
                    logits[k] = Some(l.narrow(0, j as isize, 1)?);
                }
            }
            eager = rest;
        }
        // Prompt chunks of the base model through the captured chunk step,
        // one call per sequence (Note [Step programs]).
        if let Some(program) = &mut self.chunk {
            let (chunks, rest): (Vec<usize>, Vec<usize>) = eager.iter().partition(|&&k| {
                let s = &self.running[plan[k].0];
                s.adapter.is_none() && s.proposal.is_none()
            });
            for k in chunks {
                let (i, chunk) = plan[k];
                let s = &self.running[i];
                let l = program.run(&s.tokens[s.computed..s.computed + chunk], s.computed, &s.blocks)?;
                if s.computed + chunk == s.tokens.len() {
                    logits[k] = Some(l);
                }
            }
            eager = rest;
        }
        if eager.is_empty() {
            return Ok(logits);
        }
        let chunks: Vec<SeqChunk<'_>> = eager
            .iter()
            .map(|&k| {
                let (i, chunk) = plan[k];
                let s = &self.running[i];
                // A sequence due a token wants its last row's logits, one
                // verifying a proposal each proposed token's row too.
                let due = s.computed + chunk == s.tokens.len();
                let rows = if due { 1 + s.proposal.as_ref().map_or(0, |p| p.tokens.len()) } else { 0 };
                SeqChunk {
                    tokens: &s.tokens[s.computed..s.computed + chunk],
                    start: s.computed,
                    blocks: &s.blocks,
                    logits: rows,
                }
            })
            .collect();
        let batch = PagedBatch::new(&chunks, bs, self.model.device())?;
        let routing = if self.adapters.is_empty() {
            None
        } else {
            let slots: Vec<Option<usize>> = eager
                .iter()
                .zip(&chunks)
                .flat_map(|(&k, c)| std::iter::repeat_n(self.running[plan[k].0].adapter, c.tokens.len()))
                .collect();
            crate::lora::AdapterRouting::new(&slots, self.model.device())?
        };
        let l = crate::lora::with_routing(routing, || self.model.forward_paged(&batch, &self.cache))?;
        let mut row = 0;
        for (c, &k) in chunks.iter().zip(&eager) {
            let n = c.logits.min(c.tokens.len());
            if n > 0 {
                logits[k] = Some(l.narrow(0, row as isize, n)?);
                row += n;
            }
        }
        Ok(logits)
    }

    /// [`Engine::logits`], and beside it on a thread of its own, the allowed
    /// tokens of every constrained sequence due a token (Note [Constrained
    /// decoding]), by position in the plan.
    #[allow(clippy::type_complexity)]
    pub(super) fn logits_and_masks(
        &mut self,
        plan: &[(usize, usize)],
    ) -> Result<(Vec<Option<Tensor>>, Vec<Option<Vec<u32>>>)> {
        let mut due: Vec<(usize, usize, Box<dyn Constraint>)> = vec![];
        for (k, &(i, chunk)) in plan.iter().enumerate() {
            let s = &mut self.running[i];
            if s.computed + chunk == s.tokens.len() {
                if let Some(c) = s.constraint.take() {
                    due.push((k, i, c));
                }
            }
        }
        if due.is_empty() {
            return Ok((self.logits(plan)?, vec![None; plan.len()]));
        }
        let (logits, computed) = std::thread::scope(|scope| {
            let masks =
                scope.spawn(move || due.into_iter().map(|(k, i, mut c)| (k, i, c.allowed(), c)).collect::<Vec<_>>());
            let logits = self.logits(plan);
            (logits, masks.join())
        });
        let computed = computed.map_err(|_| Error::invalid("serve", "computing a grammar's mask panicked"))?;
        let mut masks = vec![None; plan.len()];
        let mut failed = None;
        for (k, i, m, c) in computed {
            // Every constraint goes back before any error is returned.
            self.running[i].constraint = Some(c);
            match m {
                Ok(m) => masks[k] = Some(m),
                Err(e) => failed = Some(e),
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok((logits?, masks)),
        }
    }

    /// The next token of every greedy row with logits, by position in the
    /// plan: one argmax over all of them (per row, as `choose` computes it)
    /// instead of one op and one read back per row.
    pub(super) fn greedy_tokens(&self, plan: &[(usize, usize)], logits: &[Option<Tensor>]) -> Result<Vec<Option<i64>>> {
        let (at, rows): (Vec<usize>, Vec<&Tensor>) = plan
            .iter()
            .zip(logits)
            .enumerate()
            .filter(|(_, ((i, _), _))| {
                let s = &self.running[*i];
                s.req.sampling.is_greedy() && s.proposal.is_none()
            })
            .filter_map(|(k, (_, l))| Some((k, l.as_ref()?)))
            .unzip();
        let mut tokens = vec![None; plan.len()];
        if !rows.is_empty() {
            let picked = Tensor::cat(&rows, 0)?.argmax(Some(-1), false)?.to_vec::<i64>()?;
            for (k, t) in at.into_iter().zip(picked) {
                tokens[k] = Some(t);
            }
        }
        Ok(tokens)
    }
}
