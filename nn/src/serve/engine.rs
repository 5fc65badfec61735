//! The engine's core: a queue of requests and a scheduler that runs one model
//! step per iteration over every running sequence (Note [Iteration-level
//! scheduling]). Single-threaded; `handle.rs` runs it on its own thread.
use super::blocks::Blocks;
use super::decode::{ChunkProgram, DecodeProgram};
use super::grammar::{self, Constraint, GrammarCompiler};
use super::kv::PagedKvCache;
use super::logits;
use super::request::{Event, FinishReason, Request, TokenLogprobs};
use super::speculative::{Drafter, Proposal, Speculation};
pub use super::stats::{EngineStats, TTFT_WINDOW};
use crate::generate::choose;
use crate::models::LlamaForCausalLM;
use kiln_tensor::{on_compute_threads, DType, Error, Generator, Result, Tensor};
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

// Note [Iteration-level scheduling]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Each `step` packs, within a budget of `max_batched_tokens` tokens, every
// running sequence's next piece of work into one forward pass
// (`LlamaForCausalLM::forward_paged`): one token for a sequence that is
// decoding, a chunk of the prompt for one that is prefilling (a long prompt
// takes several steps, so it never stalls the decoding of the others).
// Running sequences go first, in the order they were admitted; then waiting
// requests are admitted while there is budget, room (`max_num_seqs`) and KV
// blocks. A sequence that finishes gives its blocks back at once and its
// place to the next waiting one (Orca's iteration-level scheduling, vLLM's
// continuous batching).
//
// When a running sequence needs a block and none is left, the sequence
// admitted last is preempted: its blocks are freed and it goes back to the
// front of the queue with the tokens it has generated, to be recomputed as a
// longer prompt when blocks free up (vLLM's recompute preemption). Its
// sampler's state travels with it, so what it generates next is unchanged.
// A request that could never fit is refused when it is submitted.

// Note [Shared prompts wait]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// Requests that arrive together with the same prompt prefix (the `n`
// choices of one OpenAI request, or many users of one system prompt) would
// each compute the prefix if admitted in the same step, since blocks are
// registered for sharing only once computed. So a waiting request whose
// prompt shares at least one full block with a running sequence that has
// not yet computed those blocks waits (later requests may go ahead of it)
// until that sequence has; it then takes the blocks (Note [Prefix sharing])
// and computes only the rest. The wait is bounded by the other's prefill,
// which would otherwise have been done twice.

/// A function from token ids to text, for stop strings.
pub type Detokenizer = Arc<dyn Fn(&[i64]) -> String + Send + Sync>;

/// Whether a stop string appears in the text of `generated`, checked after
/// each token: a stop string new with the last token lies in the text of the
/// last tokens, so only a window is decoded (doubled until its text is longer
/// than every stop string with a margin for a character cut at its start),
/// which keeps the check linear in the output's length, not quadratic.
fn ends_in_stop(d: &Detokenizer, generated: &[i64], stops: &[String]) -> bool {
    let need = stops.iter().map(|s| s.len()).max().unwrap_or(0) + 8;
    let mut w = need.min(generated.len());
    loop {
        let text = d(&generated[generated.len() - w..]);
        if stops.iter().any(|x| text.contains(x.as_str())) {
            return true;
        }
        if text.len() >= need || w == generated.len() {
            return false;
        }
        w = (w * 2).min(generated.len());
    }
}

/// How the engine is sized.
#[derive(Clone)]
pub struct EngineConfig {
    /// Positions per KV block.
    pub block_size: usize,
    /// The KV pool's size in bytes (keys and values of every layer).
    pub kv_cache_bytes: usize,
    /// The dtype the KV pool stores (none: the model's): bfloat16 or float16
    /// under a float32 model, float8 with a scale per row (Note [KV cache
    /// dtypes] in kiln-tensor) hold two to four times the tokens in the same
    /// bytes.
    pub kv_cache_dtype: Option<DType>,
    /// At most this many sequences run at once.
    pub max_num_seqs: usize,
    /// At most this many tokens go through the model per step (decoded tokens
    /// and prompt chunks together). The default, 2048, is what vLLM's
    /// OpenAI server uses outside large GPUs: a larger chunk finishes queued
    /// prompts in fewer steps (each step reads every weight once more), at
    /// the price of a longer pause for the decoding sequences of a step that
    /// carries it.
    pub max_batched_tokens: usize,
    /// Share the KV blocks of identical prompt prefixes (Note [Prefix sharing]).
    pub prefix_sharing: bool,
    /// At most this many requests wait (the handle refuses more).
    pub max_queue: usize,
    /// Turns text back into tokens' text for stop strings.
    pub detokenizer: Option<Detokenizer>,
    /// Compiles requests' grammars (Note [Constrained decoding]); without
    /// one, a request with a grammar is refused.
    pub grammars: Option<Arc<dyn GrammarCompiler>>,
    /// Proposes tokens for the model to verify, several per step (Note
    /// [Speculative decoding]); none: one token per step.
    pub speculative: Option<Speculation>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            block_size: 16,
            kv_cache_bytes: 256 << 20,
            kv_cache_dtype: None,
            max_num_seqs: 64,
            max_batched_tokens: 2048,
            prefix_sharing: true,
            max_queue: 1024,
            detokenizer: None,
            grammars: None,
            speculative: None,
        }
    }
}

impl std::fmt::Debug for EngineConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineConfig")
            .field("block_size", &self.block_size)
            .field("kv_cache_bytes", &self.kv_cache_bytes)
            .field("kv_cache_dtype", &self.kv_cache_dtype)
            .field("max_num_seqs", &self.max_num_seqs)
            .field("max_batched_tokens", &self.max_batched_tokens)
            .field("prefix_sharing", &self.prefix_sharing)
            .field("max_queue", &self.max_queue)
            .field("detokenizer", &self.detokenizer.is_some())
            .field("grammars", &self.grammars.is_some())
            .field("speculative", &self.speculative)
            .finish()
    }
}

/// A sequence in the engine.
pub(super) struct Seq {
    pub(super) id: u64,
    pub(super) req: Request,
    /// Prompt and generated tokens.
    pub(super) tokens: Vec<i64>,
    /// Positions whose keys and values are in the cache.
    pub(super) computed: usize,
    pub(super) blocks: Vec<usize>,
    /// Hashes of the registered full blocks, in order.
    hashes: Vec<u64>,
    pub(super) generator: Option<Generator>,
    arrival: Instant,
    first_token: Option<Instant>,
    /// The adapter slot it is served with (Note [Serving adapters]).
    pub(super) adapter: Option<usize>,
    /// Its grammar's state (Note [Constrained decoding]).
    pub(super) constraint: Option<Box<dyn Constraint>>,
    /// Positions the draft model has cached (Note [Speculative decoding]).
    pub(super) draft_computed: usize,
    /// This step's proposal, appended to `tokens` until it is verified.
    pub(super) proposal: Option<Proposal>,
}

impl Seq {
    pub(super) fn generated(&self) -> usize {
        self.tokens.len() - self.req.prompt.len()
    }

    /// The parent hash of the first block: blocks are shared between
    /// sequences of one adapter only (their keys and values differ).
    fn root_hash(&self) -> u64 {
        self.adapter.map_or(0, |a| 0x9E37_79B9_7F4A_7C15u64.wrapping_mul(a as u64 + 1) | 1)
    }

    /// The parent hash of block `j`.
    fn parent_hash(&self, j: usize) -> u64 {
        if j == 0 {
            self.root_hash()
        } else {
            self.hashes[j - 1]
        }
    }
}

/// What a step produced for one request.
#[derive(Debug, Clone, PartialEq)]
pub struct StepOutput {
    /// The request.
    pub id: u64,
    /// A token or the end.
    pub event: Event,
}

/// The serving engine's core (see the module docs).
pub struct Engine {
    pub(super) model: LlamaForCausalLM,
    pub(super) cache: Arc<PagedKvCache>,
    /// The captured decode step, on backends that capture.
    pub(super) decode: Option<DecodeProgram>,
    /// The captured prompt-chunk step, on backends that capture.
    pub(super) chunk: Option<ChunkProgram>,
    pub(super) blocks: Blocks,
    waiting: VecDeque<Seq>,
    pub(super) running: Vec<Seq>,
    pub(super) cfg: EngineConfig,
    next_id: u64,
    pub(super) stats: EngineStats,
    /// The draft model of `Speculation::Draft`.
    pub(super) drafter: Option<Drafter>,
    max_context: usize,
    /// The names of the served adapters, by slot.
    pub(super) adapters: Vec<String>,
}

impl Engine {
    /// An engine for `model` with a KV pool of `cfg.kv_cache_bytes`.
    pub fn new(model: LlamaForCausalLM, cfg: EngineConfig) -> Result<Engine> {
        if cfg.max_num_seqs == 0 || cfg.max_batched_tokens == 0 || cfg.block_size == 0 {
            return Err(Error::invalid(
                "Engine",
                format!(
                    "max_num_seqs, max_batched_tokens and block_size must be positive, got {}, {} and {}",
                    cfg.max_num_seqs, cfg.max_batched_tokens, cfg.block_size
                ),
            ));
        }
        let kv_dtype = cfg.kv_cache_dtype.unwrap_or(model.dtype());
        let cache = Arc::new(PagedKvCache::with_budget(&model, cfg.kv_cache_bytes, cfg.block_size, kv_dtype)?);
        let bs = cfg.block_size;
        // With a captured decode step, the pool's last block is the scratch
        // block of padded rows (Note [Step programs]).
        let (n, max_pos) = (cache.num_blocks(), model.config().max_position_embeddings);
        let width = max_pos.min((n - 1) * bs).div_ceil(bs);
        // Mixture-of-experts blocks with experts kept quantized read their
        // routing on the host, which a captured program cannot: such a model
        // decodes eagerly.
        let host_routed = model.model.layers.iter().any(|l| l.mlp.as_sparse().is_some_and(|b| !b.runs_on_device()));
        let decode = match n {
            1 => None,
            _ if host_routed => None,
            _ => DecodeProgram::new(&model, &cache, width, n - 1, cfg.max_num_seqs)?,
        };
        let usable = if decode.is_some() { n - 1 } else { n };
        let blocks = Blocks::new(usable, cfg.prefix_sharing);
        let max_context = max_pos.min(usable * bs);
        let chunk = match decode {
            Some(_) => ChunkProgram::new(&model, &cache, max_context, n - 1, cfg.max_batched_tokens)?,
            None => None,
        };
        let stats = EngineStats { kv_blocks_total: usable, ..Default::default() };
        let drafter = match &cfg.speculative {
            None => None,
            Some(sp) => {
                sp.check(&model)?;
                match sp {
                    Speculation::Draft { model: d, .. } => Some(Drafter::new((**d).clone(), n, bs)?),
                    Speculation::NGram { .. } => None,
                }
            }
        };
        Ok(Engine {
            model,
            cache,
            drafter,
            decode,
            chunk,
            blocks,
            waiting: VecDeque::new(),
            running: vec![],
            cfg,
            next_id: 0,
            stats,
            max_context,
            adapters: vec![],
        })
    }

    /// Loads the PEFT adapter in `dir` to serve requests that name it
    /// (`Request::with_adapter(name)`), batched with the others (Note
    /// [Serving adapters]). A name already loaded is an error.
    pub fn load_adapter(&mut self, name: &str, dir: impl AsRef<std::path::Path>) -> Result<()> {
        if self.adapters.iter().any(|a| a == name) {
            return Err(Error::invalid("Engine::load_adapter", format!("an adapter named {name:?} is loaded already")));
        }
        crate::lora::load_served_adapter(&mut self.model, dir, self.adapters.len())?;
        self.adapters.push(name.to_string());
        Ok(())
    }

    /// The names of the adapters served, in the order they were loaded.
    pub fn adapters(&self) -> &[String] {
        &self.adapters
    }

    /// The model served.
    pub fn model(&self) -> &LlamaForCausalLM {
        &self.model
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// The longest prompt + new tokens a request may ask for.
    pub fn max_context(&self) -> usize {
        self.max_context
    }

    /// Counters and gauges.
    pub fn stats(&self) -> EngineStats {
        let (decode_traces, decode_replays) = self.decode.as_ref().map_or((0, 0), |d| d.counts());
        let (chunk_traces, chunk_replays) = self.chunk.as_ref().map_or((0, 0), |d| d.counts());
        EngineStats {
            waiting: self.waiting.len(),
            running: self.running.len(),
            kv_blocks_used: self.blocks.used(),
            decode_traces,
            chunk_traces,
            chunk_replays,
            decode_replays,
            ..self.stats.clone()
        }
    }

    /// Queues a request (checked first); returns its id.
    pub fn add_request(&mut self, req: Request) -> Result<u64> {
        let cfg = &self.cfg;
        req.check(
            self.model.config().vocab_size,
            self.max_context(),
            cfg.detokenizer.is_some(),
            cfg.grammars.is_some(),
        )?;
        let adapter = match &req.adapter {
            None => None,
            Some(name) => Some(self.adapters.iter().position(|a| a == name).ok_or_else(|| {
                Error::invalid(
                    "Engine::add_request",
                    format!("no adapter named {name:?} is loaded (loaded: {:?})", self.adapters),
                )
            })?),
        };
        // `check` has refused a grammar without a compiler.
        let constraint = match (&req.grammar, &self.cfg.grammars) {
            (Some(g), Some(c)) => Some(c.compile(g)?),
            _ => None,
        };
        let id = self.next_id;
        self.next_id += 1;
        let device = self.model.device();
        let generator = if req.sampling.is_greedy() {
            None
        } else {
            // Seeded as `generate` seeds; without a seed, from the request id and the clock.
            let seed = req.sampling.seed.unwrap_or_else(|| {
                let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
                (t.as_nanos() as u64) ^ id.wrapping_mul(0x9E37_79B9_7F4A_7C15)
            });
            Some(Generator::new(device)?.manual_seed(seed)?)
        };
        let tokens = req.prompt.clone();
        self.waiting.push_back(Seq {
            id,
            req,
            tokens,
            computed: 0,
            blocks: vec![],
            hashes: vec![],
            generator,
            arrival: Instant::now(),
            first_token: None,
            adapter,
            constraint,
            draft_computed: 0,
            proposal: None,
        });
        Ok(id)
    }

    /// Whether any request is waiting or running.
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Requests waiting.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Drops a request, freeing its blocks; true if it was there.
    pub fn abort(&mut self, id: u64) -> bool {
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            let s = self.waiting.remove(i).expect("position found");
            self.free(s);
            return true;
        }
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let s = self.running.remove(i);
            self.free(s);
            return true;
        }
        false
    }

    fn free(&mut self, s: Seq) {
        for &b in &s.blocks {
            self.blocks.release(b);
        }
    }

    /// Frees the blocks of running sequence `i` and queues it first.
    fn preempt(&mut self, i: usize) {
        let mut s = self.running.remove(i);
        for &b in &s.blocks {
            self.blocks.release(b);
        }
        s.blocks.clear();
        s.hashes.clear();
        s.computed = 0;
        s.draft_computed = 0;
        self.stats.preemptions += 1;
        self.waiting.push_front(s);
    }

    /// Gives `s` blocks to hold `upto` positions; false if the pool is out.
    pub(super) fn grow(blocks: &mut Blocks, s: &mut Seq, upto: usize, bs: usize) -> bool {
        let need = upto.div_ceil(bs).saturating_sub(s.blocks.len());
        if need > blocks.available() {
            return false;
        }
        for _ in 0..need {
            s.blocks.push(blocks.allocate().expect("availability checked"));
        }
        true
    }

    /// Takes the shared blocks of `s`'s longest registered prefix (never its
    /// last token, whose logits are needed).
    fn match_prefix(&mut self, s: &mut Seq) {
        let bs = self.cache.block_size();
        while (s.hashes.len() + 1) * bs < s.tokens.len() {
            let j = s.hashes.len();
            let parent = s.parent_hash(j);
            match self.blocks.lookup(parent, &s.tokens[j * bs..(j + 1) * bs]) {
                Some((b, h)) => {
                    s.blocks.push(b);
                    s.hashes.push(h);
                }
                None => break,
            }
        }
        s.computed = s.hashes.len() * bs;
        self.stats.prefix_hit_tokens += s.computed as u64;
    }

    /// Whether the waiting `s` should wait for a running sequence that is
    /// computing blocks `s` could share (Note [Shared prompts wait]).
    fn awaits_shared_prefix(&self, s: &Seq) -> bool {
        let bs = self.cache.block_size();
        if !self.cfg.prefix_sharing || s.computed > 0 || !s.blocks.is_empty() || s.tokens.len() <= bs {
            return false;
        }
        self.running.iter().any(|r| {
            if r.tokens.len() < bs || r.root_hash() != s.root_hash() || r.tokens[..bs] != s.tokens[..bs] {
                return false;
            }
            // The full blocks `s` could take from `r` (never its own last token).
            let common = r.tokens.iter().zip(&s.tokens[..s.tokens.len() - 1]).take_while(|(a, b)| a == b).count();
            r.computed < common / bs * bs
        })
    }

    /// Plans a step: `(index in running, tokens to run)`, admitting waiting
    /// requests and preempting where the pool runs out.
    fn schedule(&mut self, out: &mut Vec<StepOutput>) -> Vec<(usize, usize)> {
        let bs = self.cache.block_size();
        let mut budget = self.cfg.max_batched_tokens;
        let mut plan = vec![];
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let s = &mut self.running[i];
            let chunk = (s.tokens.len() - s.computed).min(budget);
            let upto = s.computed + chunk;
            if Self::grow(&mut self.blocks, s, upto, bs) {
                plan.push((i, chunk));
                budget -= chunk;
                i += 1;
            } else if self.running.len() > i + 1 {
                let last = self.running.len() - 1;
                self.preempt(last);
            } else if i == 0 {
                // Alone and still out of blocks: nothing else holds any but idle
                // prefix blocks, which `available` counts, so it can never fit.
                let s = self.running.remove(0);
                let msg = format!("the KV cache ({} blocks of {bs}) cannot hold this sequence", self.blocks.total());
                out.push(StepOutput { id: s.id, event: Event::Finished(FinishReason::Error(msg)) });
                self.free(s);
            } else {
                break;
            }
        }
        let mut j = 0;
        while budget > 0 && self.running.len() < self.cfg.max_num_seqs && j < self.waiting.len() {
            if self.awaits_shared_prefix(&self.waiting[j]) {
                j += 1;
                continue;
            }
            let mut s = self.waiting.remove(j).expect("index checked");
            if s.computed == 0 && s.blocks.is_empty() {
                self.match_prefix(&mut s);
            }
            let chunk = (s.tokens.len() - s.computed).min(budget);
            let upto = s.computed + chunk;
            if !Self::grow(&mut self.blocks, &mut s, upto, bs) {
                // Not now: give the shared blocks back and keep its place.
                self.stats.prefix_hit_tokens -= s.computed as u64;
                for &b in &s.blocks {
                    self.blocks.release(b);
                }
                s.blocks.clear();
                s.hashes.clear();
                s.computed = 0;
                self.waiting.insert(j, s);
                break;
            }
            plan.push((self.running.len(), chunk));
            budget -= chunk;
            self.running.push(s);
        }
        plan
    }

    /// Runs one iteration (Note [Iteration-level scheduling]) and returns the
    /// tokens and ends it produced. A failure of the model step ends every
    /// sequence of the step with `FinishReason::Error` and its message (the
    /// other requests go on). The step's ops run on the model device's compute
    /// threads (Note [Loops on the compute threads] in kiln-tensor).
    pub fn step(&mut self) -> Vec<StepOutput> {
        let device = self.model.device();
        on_compute_threads(device, || self.step_here())
    }

    fn step_here(&mut self) -> Vec<StepOutput> {
        let mut out = vec![];
        let mut plan = self.schedule(&mut out);
        if plan.is_empty() {
            return out;
        }
        self.stats.steps += 1;
        let before = out.len();
        if let Err(e) = self.run(&mut plan, &mut out) {
            // `run` removes nothing before it has succeeded: every sequence of
            // the plan is still running (some may be half updated), and each
            // ends with the error instead of this step's tokens.
            out.truncate(before);
            let mut ids: Vec<usize> = plan.iter().map(|&(i, _)| i).filter(|&i| i < self.running.len()).collect();
            ids.sort_unstable();
            ids.dedup();
            for &i in ids.iter().rev() {
                let s = self.running.remove(i);
                out.push(StepOutput { id: s.id, event: Event::Finished(FinishReason::Error(e.to_string())) });
                self.free(s);
            }
        }
        out
    }

    fn run(&mut self, plan: &mut [(usize, usize)], out: &mut Vec<StepOutput>) -> Result<()> {
        let bs = self.cache.block_size();
        self.speculate(plan)?;
        for &(i, chunk) in plan.iter() {
            let s = &self.running[i];
            for p in (s.computed..s.computed + chunk).step_by(bs) {
                self.blocks.check_writable(s.blocks[p / bs])?;
            }
        }
        let (mut logits, masks) = self.logits_and_masks(plan)?;
        let verified = self.verify(plan, &mut logits)?;
        // Note [Logit processing]: the raw logits stay for the logprobs.
        let mut raw: Vec<Option<Tensor>> = vec![None; plan.len()];
        let mut dead: Vec<Option<String>> = vec![None; plan.len()];
        let vocab = self.model.config().vocab_size;
        for (k, &(i, _)) in plan.iter().enumerate() {
            let (s, Some(l)) = (&self.running[i], &logits[k]) else { continue };
            if s.req.logprobs.is_some() {
                raw[k] = Some(l.clone());
            }
            let mask = masks[k].as_deref();
            if mask.is_some_and(|m| !(0..vocab).any(|t| grammar::allows(m, t))) {
                dead[k] = Some("the grammar allows no token of the model's vocabulary here".into());
                logits[k] = None;
            } else if logits::processes(&s.req) {
                logits[k] = Some(logits::process(l, &s.req, &s.tokens, mask)?);
            }
        }
        let greedy = self.greedy_tokens(plan, &logits)?;
        let mut done = vec![];
        let steps = plan.iter().zip(logits).zip(greedy).zip(raw).zip(dead).zip(verified);
        for (((((&(i, chunk), l), greedy), raw), dead), verified) in steps {
            let s = &mut self.running[i];
            let prefill = chunk.min(s.req.prompt.len().saturating_sub(s.computed));
            self.stats.prefill_tokens += prefill as u64;
            s.computed += chunk;
            if let Some(tokens) = verified {
                if let Some(why) = self.accept(i, tokens, out)? {
                    done.push((i, why));
                }
                continue;
            }
            self.register_blocks(i);
            let s = &mut self.running[i];
            if let Some(msg) = dead {
                done.push((i, FinishReason::Error(msg)));
                continue;
            }
            let Some(l) = l.filter(|_| s.computed == s.tokens.len()) else { continue };
            let tok = match greedy {
                Some(t) => t,
                None => {
                    let gen = match &s.generator {
                        Some(g) => g.clone(),
                        None => kiln_tensor::generator::default_generator(self.model.device())?,
                    };
                    choose(&l, &s.req.sampling, &gen)?.to_vec::<i64>()?[0]
                }
            };
            let lp = match (raw, s.req.logprobs) {
                (Some(r), Some(top)) => Some(logits::logprobs(&r, tok, top)?),
                _ => None,
            };
            if let Some(why) = self.emit(i, tok, lp, out)? {
                done.push((i, why));
            }
        }
        for (i, why) in done.into_iter().rev() {
            let s = self.running.remove(i);
            out.push(StepOutput { id: s.id, event: Event::Finished(why) });
            self.free(s);
        }
        Ok(())
    }

    /// Registers the full blocks of running sequence `i` that its computed
    /// positions cover (Note [Prefix sharing]).
    pub(super) fn register_blocks(&mut self, i: usize) {
        let bs = self.cache.block_size();
        let s = &mut self.running[i];
        while s.hashes.len() < s.computed / bs {
            let j = s.hashes.len();
            let parent = s.parent_hash(j);
            let h = self.blocks.register(s.blocks[j], parent, &s.tokens[j * bs..(j + 1) * bs]);
            s.hashes.push(h);
        }
    }

    /// Appends `tok` to running sequence `i` and streams it: counts it, and
    /// returns how the sequence ends if it does with this token (a stop
    /// token or string, its grammar complete, its length reached).
    pub(super) fn emit(
        &mut self,
        i: usize,
        tok: i64,
        lp: Option<TokenLogprobs>,
        out: &mut Vec<StepOutput>,
    ) -> Result<Option<FinishReason>> {
        let s = &mut self.running[i];
        s.tokens.push(tok);
        self.stats.generated_tokens += 1;
        if s.first_token.is_none() {
            let now = Instant::now();
            s.first_token = Some(now);
            let t = now - s.arrival;
            self.stats.ttft_count += 1;
            self.stats.ttft_sum += t;
            if self.stats.ttft_recent.len() == TTFT_WINDOW {
                self.stats.ttft_recent.pop_front();
            }
            self.stats.ttft_recent.push_back(t);
        }
        out.push(StepOutput { id: s.id, event: Event::Token(tok, lp) });
        // A stop token the grammar takes as text (a byte-level model whose
        // end token is a byte) extends the output (Note [Constrained decoding]).
        let stop_token = s.req.stop_token_ids.contains(&tok) && s.constraint.as_ref().is_none_or(|c| c.is_end(tok));
        let stop = stop_token
            || (!s.req.stop_strings.is_empty()
                && self
                    .cfg
                    .detokenizer
                    .as_ref()
                    .is_some_and(|d| ends_in_stop(d, &s.tokens[s.req.prompt.len()..], &s.req.stop_strings)));
        if let Some(c) = s.constraint.as_mut().filter(|_| !stop_token) {
            c.advance(tok)?;
        }
        Ok(if stop || s.constraint.as_ref().is_some_and(|c| c.is_finished()) {
            Some(FinishReason::Stop)
        } else if s.generated() >= s.req.max_new_tokens {
            Some(FinishReason::Length)
        } else {
            None
        })
    }
}
