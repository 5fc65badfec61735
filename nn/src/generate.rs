//! Autoregressive generation with a KV cache: greedy decoding, temperature,
//! top-k, top-p and min-p sampling on the model's device, drawn from a generator
//! there (its default one, or one seeded for the call).
use crate::models::LlamaForCausalLM;
use kiln_tensor::generator::default_generator;
use kiln_tensor::trace::ConstantScope;
use kiln_tensor::{on_compute_threads, DType, Error, Generator, Result, Tensor};

/// How each next token is chosen (transformers' order: temperature, then
/// top-k, then top-p, then min-p, then a draw from what is left).
///
/// ```
/// use kiln::nn::generate::Sampling;
/// let greedy = Sampling::greedy();
/// let creative = Sampling::sample(0.8).with_top_k(50).with_top_p(0.95).with_seed(1234);
/// assert!(greedy.is_greedy() && !creative.is_greedy());
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    /// Logits are divided by it before sampling; 0 means greedy (argmax).
    pub temperature: f64,
    /// Keep only the `top_k` most likely tokens (0: no limit).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches
    /// `top_p` (1.0: no limit).
    pub top_p: f64,
    /// Keep only the tokens at least `min_p` times as likely as the most
    /// likely one (0.0: no limit; transformers' `MinPLogitsWarper`).
    pub min_p: f64,
    /// Draws from a generator seeded with it (on the model's device) instead
    /// of the device's default generator: the same seed gives the same tokens
    /// on every device.
    pub seed: Option<u64>,
    /// A row that produced one of these stops; its later positions are filled
    /// with the first of them, and generation ends when every row has stopped.
    pub eos_token_ids: Vec<i64>,
    /// Decode incrementally with a KV cache (the default). Without it, every
    /// step recomputes the whole sequence (same result, for checking).
    pub use_cache: bool,
    /// The dtype the KV cache stores (none: the model's; Note [KV cache
    /// dtypes] in kiln-tensor).
    pub kv_cache_dtype: Option<DType>,
}

impl Default for Sampling {
    fn default() -> Self {
        Sampling::greedy()
    }
}

impl Sampling {
    /// Greedy decoding: always the most likely token (the first on ties).
    pub fn greedy() -> Sampling {
        Sampling {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
            eos_token_ids: vec![],
            use_cache: true,
            kv_cache_dtype: None,
        }
    }

    /// Sampling at `temperature` (> 0) from the whole distribution.
    pub fn sample(temperature: f64) -> Sampling {
        Sampling { temperature, ..Sampling::greedy() }
    }

    /// With top-k filtering.
    pub fn with_top_k(mut self, k: usize) -> Sampling {
        self.top_k = k;
        self
    }

    /// With nucleus (top-p) filtering.
    pub fn with_top_p(mut self, p: f64) -> Sampling {
        self.top_p = p;
        self
    }

    /// With min-p filtering.
    pub fn with_min_p(mut self, p: f64) -> Sampling {
        self.min_p = p;
        self
    }

    /// With a seed for the generator.
    pub fn with_seed(mut self, seed: u64) -> Sampling {
        self.seed = Some(seed);
        self
    }

    /// Stopping on these tokens.
    pub fn with_eos(mut self, ids: &[i64]) -> Sampling {
        self.eos_token_ids = ids.to_vec();
        self
    }

    /// With or without the KV cache.
    pub fn with_cache(mut self, on: bool) -> Sampling {
        self.use_cache = on;
        self
    }

    /// With the KV cache stored in `dtype`.
    pub fn with_kv_cache_dtype(mut self, dtype: DType) -> Sampling {
        self.kv_cache_dtype = Some(dtype);
        self
    }

    /// True when decoding is deterministic argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    fn check(&self) -> Result<()> {
        self.check_for("generate")
    }

    /// Checks temperature, top-p and min-p, errors naming `op`.
    pub(crate) fn check_for(&self, op: &'static str) -> Result<()> {
        if self.temperature.is_nan() || self.temperature < 0.0 || self.temperature.is_infinite() {
            return Err(Error::invalid(op, format!("temperature must be >= 0, got {}", self.temperature)));
        }
        if self.top_p.is_nan() || self.top_p <= 0.0 || self.top_p > 1.0 {
            return Err(Error::invalid(op, format!("top_p must be in (0, 1], got {}", self.top_p)));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(Error::invalid(op, format!("min_p must be in [0, 1], got {}", self.min_p)));
        }
        Ok(())
    }
}

/// Continues each row of `prompt_ids` (`[B, P]`, integer) by up to
/// `max_new_tokens` tokens and returns `[B, P + N]` (int64) where `N` is
/// `max_new_tokens`, or fewer when every row has emitted an end token.
/// Runs without recording gradients.
///
/// ```
/// use kiln::prelude::*;
/// use kiln::nn::generate::{generate, Sampling};
/// use kiln::nn::models::{LlamaConfig, LlamaForCausalLM};
/// let cfg = LlamaConfig::from_json_str(r#"{"model_type": "llama", "vocab_size": 32, "hidden_size": 16,
///     "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2}"#)?;
/// kiln::manual_seed(0);
/// let model = LlamaForCausalLM::new(&cfg, DType::F32)?;
/// let prompt = Tensor::new([[1i64, 2, 3]])?;
/// let out = generate(&model, &prompt, 4, &Sampling::greedy())?;
/// assert_eq!(out.shape(), &[1, 7]);
/// let again = generate(&model, &prompt, 4, &Sampling::greedy().with_cache(false))?;
/// assert_eq!(out.to_vec::<i64>()?, again.to_vec::<i64>()?);
/// # Ok::<(), kiln::Error>(())
/// ```
pub fn generate(
    model: &LlamaForCausalLM,
    prompt_ids: &Tensor,
    max_new_tokens: usize,
    sampling: &Sampling,
) -> Result<Tensor> {
    sampling.check()?;
    if prompt_ids.ndim() != 2 || prompt_ids.shape()[1] == 0 || !prompt_ids.dtype().is_int() {
        return Err(Error::shape(
            "generate",
            format!(
                "expected prompt ids [B, P] with P >= 1 and an integer dtype, got {:?} {}",
                prompt_ids.shape(),
                prompt_ids.dtype()
            ),
        ));
    }
    let _g = kiln_autograd::no_grad();
    let _c = ConstantScope::enter();
    let (b, p) = (prompt_ids.shape()[0], prompt_ids.shape()[1]);
    let device = model.device();
    let generator = match sampling.seed {
        Some(s) => Generator::new(device)?.manual_seed(s)?,
        None => default_generator(device)?,
    };
    let prompt = prompt_ids.to_dtype(DType::I64)?.to_device(device)?;
    let mut rows: Vec<Vec<i64>> = prompt.to_vec::<i64>()?.chunks(p).map(|r| r.to_vec()).collect();
    if b == 0 || max_new_tokens == 0 {
        return prompt.deep_clone();
    }
    // Room for the prompt and a first stretch of tokens; the cache doubles as
    // generation goes on, so memory follows the tokens actually produced.
    let capacity = p.saturating_add(max_new_tokens.min(256));
    let mut cache = match sampling.kv_cache_dtype {
        Some(dt) => model.new_cache_with_dtype(capacity, dt)?,
        None => model.new_cache(capacity),
    };
    let mut finished = vec![false; b];
    let mut next = prompt;
    // One op after another: on the backend's compute threads (Note [Loops
    // on the compute threads] in kiln-tensor).
    on_compute_threads(device, || -> Result<()> {
        for _ in 0..max_new_tokens {
            let logits = if sampling.use_cache {
                model.forward_cached(&next, None, &mut cache, true)?
            } else {
                let len = rows[0].len();
                let all = Tensor::from_vec(rows.concat(), &[b, len])?.to_device(device)?;
                let l = model.forward(&all, None)?;
                l.narrow(1, len as isize - 1, 1)?
            };
            let logits = logits.squeeze_dim(1)?; // [B, V]
            let mut tokens = choose(&logits, sampling, &generator)?.to_vec::<i64>()?;
            for (i, tok) in tokens.iter_mut().enumerate() {
                if finished[i] {
                    *tok = sampling.eos_token_ids[0];
                } else if sampling.eos_token_ids.contains(tok) {
                    finished[i] = true;
                }
                rows[i].push(*tok);
            }
            if !sampling.eos_token_ids.is_empty() && finished.iter().all(|&f| f) {
                break;
            }
            next = Tensor::from_vec(tokens, &[b, 1])?.to_device(device)?;
        }
        Ok(())
    })?;
    let len = rows[0].len();
    Tensor::from_vec(rows.concat(), &[b, len])?.to_device(device)
}

/// The next token of each row of `logits: [B, V]` (int64 `[B]`), computed on
/// the logits' device: greedy argmax, or a draw from the softmax of
/// [`warp_logits`].
pub fn choose(logits: &Tensor, s: &Sampling, generator: &Generator) -> Result<Tensor> {
    check_logits(logits, s)?;
    if s.is_greedy() {
        return logits.argmax(Some(-1), false);
    }
    generator.multinomial(&warp_logits(logits, s)?.softmax(-1)?, 1, true)?.squeeze_dim(-1)
}

fn check_logits(logits: &Tensor, s: &Sampling) -> Result<()> {
    s.check()?;
    if logits.ndim() != 2 || logits.shape()[1] == 0 || !logits.dtype().is_float() {
        return Err(Error::shape(
            "generate",
            format!(
                "expected logits [B, V] with V >= 1 of a floating dtype, got {:?} {}",
                logits.shape(),
                logits.dtype()
            ),
        ));
    }
    Ok(())
}

/// The float32 logits a sampled token is drawn from (`softmax` of them):
/// `logits: [B, V]` divided by the temperature, then every token that
/// top-k, top-p or min-p removes set to `-inf`, as transformers'
/// `TemperatureLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper` and
/// `MinPLogitsWarper` do in that order (ties at a boundary are kept, the most
/// likely token always is). A temperature of 0 is an error here: greedy
/// decoding does not sample.
pub fn warp_logits(logits: &Tensor, s: &Sampling) -> Result<Tensor> {
    check_logits(logits, s)?;
    if s.temperature == 0.0 {
        return Err(Error::invalid(
            "generate",
            "warp_logits: a temperature of 0 is greedy decoding, which has no distribution",
        ));
    }
    let v = logits.shape()[1];
    let masked = f64::NEG_INFINITY;
    let mut x = logits.to_dtype(DType::F32)?.div(s.temperature)?;
    if s.top_k > 0 && s.top_k < v {
        // Keep every token at least as likely as the k-th (transformers' TopKLogitsWarper).
        let kth = x.topk(s.top_k, -1, true, true)?.0.narrow(-1, s.top_k as isize - 1, 1)?;
        x = x.masked_fill(&x.lt(&kth)?, masked)?;
    }
    if s.top_p < 1.0 {
        // transformers' TopPLogitsWarper: sort ascending, drop the tokens whose
        // cumulative probability stays <= 1 - top_p, always keep the most likely.
        let (sorted, order) = x.sort_stable(-1, false)?;
        let cum = sorted.softmax(-1)?.cumsum(-1)?;
        let not_last = Tensor::arange(0.0, v as f64, 1.0, (DType::I64, x.device()))?.lt((v - 1) as i64)?;
        let drop_sorted = cum.le(1.0 - s.top_p)?.logical_and(&not_last)?;
        let drop = Tensor::zeros(x.shape(), (DType::Bool, x.device()))?.scatter(-1, &order, &drop_sorted)?;
        x = x.masked_fill(&drop, masked)?;
    }
    if s.min_p > 0.0 {
        // transformers' MinPLogitsWarper: drop the tokens whose probability is
        // below min_p times the largest (which is always kept).
        let probs = x.softmax(-1)?;
        let top = probs.amax(-1, true)?;
        x = x.masked_fill(&probs.lt(&top.mul(s.min_p)?)?, masked)?;
    }
    Ok(x)
}
