//! Token data for training: tokenizers (byte-level by default, or a Hugging
//! Face `tokenizer.json`), a train/validation split, a loader of `[B, T+1]`
//! int64 batches with seeded shuffling and epochs whose position can be saved
//! and restored, and a generated corpus with a measurable skill (multi-digit
//! addition) for training demos.
//!
//! ```
//! use kiln::nn::data::{ByteTokenizer, TokenLoader, Tokenizer};
//! let tokens = ByteTokenizer.encode("hello, world! hello, world!")?;
//! let mut loader = TokenLoader::new(tokens, 2, 4)?.with_seed(7);
//! let batch = loader.next_batch()?; // [2, 5]: inputs are [:, :4], targets [:, 1:]
//! assert_eq!(batch.shape(), &[2, 5]);
//! let (inputs, targets) = kiln::nn::data::inputs_targets(&batch)?;
//! assert_eq!((inputs.shape(), targets.shape()), (&[2, 4][..], &[2, 4][..]));
//! # Ok::<(), kiln::Error>(())
//! ```
use kiln_tensor::random::Xoshiro256;
use kiln_tensor::{Error, Result, Tensor};
use std::path::Path;

#[cfg(feature = "chat")]
pub mod sft;

// ---- tokenizers ----------------------------------------------------------------------------------

/// Text to token ids and back.
pub trait Tokenizer: Send + Sync {
    /// The token ids of `text` (no special tokens added).
    fn encode(&self, text: &str) -> Result<Vec<u32>>;
    /// The text of `ids` (invalid UTF-8 is replaced by U+FFFD).
    fn decode(&self, ids: &[u32]) -> Result<String>;
    /// The number of distinct ids (the model's vocabulary must be at least this big).
    fn vocab_size(&self) -> usize;
}

/// One token per byte of the UTF-8 text: vocabulary 256, works on any text.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ByteTokenizer;

impl Tokenizer for ByteTokenizer {
    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(text.bytes().map(u32::from).collect())
    }
    fn decode(&self, ids: &[u32]) -> Result<String> {
        let bytes = ids
            .iter()
            .map(|&i| {
                u8::try_from(i)
                    .map_err(|_| Error::invalid("ByteTokenizer::decode", format!("token id {i} is not a byte")))
            })
            .collect::<Result<Vec<u8>>>()?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
    fn vocab_size(&self) -> usize {
        256
    }
}

/// A Hugging Face tokenizer read from a `tokenizer.json` file (BPE, WordPiece,
/// Unigram, ...), through the `tokenizers` crate with its pure-Rust regex engine.
#[cfg(feature = "hf-tokenizers")]
pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
}

#[cfg(feature = "hf-tokenizers")]
impl HfTokenizer {
    /// Reads a `tokenizer.json` file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<HfTokenizer> {
        let path = path.as_ref();
        let inner = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| Error::invalid("HfTokenizer", format!("cannot read the tokenizer {}: {e}", path.display())))?;
        Ok(HfTokenizer { inner })
    }
    /// Parses the contents of a `tokenizer.json` file.
    pub fn from_json(json: &str) -> Result<HfTokenizer> {
        let inner: tokenizers::Tokenizer =
            json.parse().map_err(|e| Error::invalid("HfTokenizer", format!("cannot parse the tokenizer JSON: {e}")))?;
        Ok(HfTokenizer { inner })
    }
    /// The tokenizer stored in a GGUF file (a byte-level BPE: Llama 3,
    /// Qwen2/3, GPT-2; Note [GGUF tokenizers]).
    pub fn from_gguf(path: impl AsRef<Path>) -> Result<HfTokenizer> {
        let f = crate::io::gguf::GgufFile::open(path)?;
        HfTokenizer::from_json(&crate::io::gguf::tokenizer_json(&f)?.to_string())
    }
}

#[cfg(feature = "hf-tokenizers")]
impl Tokenizer for HfTokenizer {
    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| Error::invalid("HfTokenizer::encode", format!("cannot tokenize: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }
    fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner.decode(ids, false).map_err(|e| Error::invalid("HfTokenizer::decode", format!("{e}")))
    }
    fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

/// The tokenizer at `path` (a `tokenizer.json`), or the byte-level one when `path` is `None`.
pub fn load_tokenizer(path: Option<&Path>) -> Result<Box<dyn Tokenizer>> {
    match path {
        None => Ok(Box::new(ByteTokenizer)),
        #[cfg(feature = "hf-tokenizers")]
        Some(p) => Ok(Box::new(HfTokenizer::from_file(p)?)),
        #[cfg(not(feature = "hf-tokenizers"))]
        Some(p) => Err(Error::invalid(
            "load_tokenizer",
            format!("cannot read {}: kiln-nn was built without the `hf-tokenizers` feature", p.display()),
        )),
    }
}

/// Reads a text file and tokenizes it.
pub fn read_tokens(path: impl AsRef<Path>, tokenizer: &dyn Tokenizer) -> Result<Vec<u32>> {
    let path = path.as_ref();
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::invalid("read_tokens", format!("cannot read {}: {e}", path.display())))?;
    tokenizer.encode(&text)
}

/// Splits a token stream into a training part and a validation part: the last
/// `val_fraction` of the tokens (rounded down) are validation, as nanoGPT does.
pub fn train_val_split(tokens: &[u32], val_fraction: f64) -> Result<(Vec<u32>, Vec<u32>)> {
    if !(0.0..1.0).contains(&val_fraction) {
        return Err(Error::invalid("train_val_split", format!("val_fraction must be in [0, 1), got {val_fraction}")));
    }
    let n_val = (tokens.len() as f64 * val_fraction) as usize;
    let (a, b) = tokens.split_at(tokens.len() - n_val);
    Ok((a.to_vec(), b.to_vec()))
}

// ---- a small seeded generator --------------------------------------------------------------------

/// A small deterministic generator (xoshiro256** seeded through splitmix64)
/// for data order and corpus generation, independent of kiln's global one so
/// that model initialisation and data order do not disturb each other.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeededRng(Xoshiro256);

impl SeededRng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> SeededRng {
        SeededRng(Xoshiro256::seeded(seed))
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }
    /// Uniform in `0..n` (`n > 0`), without modulo bias.
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "SeededRng::below(0)");
        let zone = u64::MAX - u64::MAX % n;
        loop {
            let x = self.next_u64();
            if x < zone {
                return x % n;
            }
        }
    }
    /// Shuffles `v` in place (Fisher-Yates).
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            v.swap(i, j);
        }
    }
}

/// Mixes two values into a seed (for a per-epoch generator).
fn mix(a: u64, b: u64) -> u64 {
    SeededRng::new(a ^ b.wrapping_mul(0xD1B5_4A32_D192_ED03)).next_u64()
}

// ---- the loader ----------------------------------------------------------------------------------

/// Where a [`TokenLoader`] is: enough to continue exactly where it stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoaderState {
    /// The shuffling seed.
    pub seed: u64,
    /// The current epoch (0-based).
    pub epoch: u64,
    /// Batches already taken in the current epoch.
    pub batch: u64,
}

impl LoaderState {
    /// As JSON (`{"seed": .., "epoch": .., "batch": ..}`; the seed as a string, since
    /// JSON numbers lose 64-bit precision in many readers).
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({ "seed": self.seed.to_string(), "epoch": self.epoch, "batch": self.batch })
    }
    /// Reads [`LoaderState::to_json`].
    pub fn from_json(v: &serde_json::Value) -> Result<LoaderState> {
        let bad = || Error::invalid("LoaderState", format!("expected {{seed, epoch, batch}}, got {v}"));
        let seed = match &v["seed"] {
            serde_json::Value::String(s) => s.parse().map_err(|_| bad())?,
            x => x.as_u64().ok_or_else(bad)?,
        };
        Ok(LoaderState {
            seed,
            epoch: v["epoch"].as_u64().ok_or_else(bad)?,
            batch: v["batch"].as_u64().ok_or_else(bad)?,
        })
    }
}

/// Batches of token windows for language-model training.
///
/// The token stream is cut into `windows()` non-overlapping windows of `seq`
/// tokens, each taken with the token that follows it (`seq + 1` tokens, so
/// that inputs are `[:, :seq]` and next-token targets `[:, 1:]`). An epoch
/// visits every window once, in an order shuffled by a generator seeded with
/// `(seed, epoch)`, `batch` windows per batch (a last incomplete batch is
/// dropped); after the last batch the next epoch starts. The position is a
/// [`LoaderState`], so a resumed run sees exactly the batches the interrupted
/// one would have seen.
#[derive(Debug, Clone)]
pub struct TokenLoader {
    tokens: Vec<u32>,
    batch: usize,
    seq: usize,
    shuffle: bool,
    state: LoaderState,
    /// Window order of `state.epoch` (empty until first needed).
    order: Vec<usize>,
}

impl TokenLoader {
    /// A shuffling loader (seed 0) of `[batch, seq + 1]` batches over `tokens`.
    /// Fails when the tokens do not fill one batch.
    pub fn new(tokens: Vec<u32>, batch: usize, seq: usize) -> Result<TokenLoader> {
        if batch == 0 || seq == 0 {
            return Err(Error::invalid(
                "TokenLoader",
                format!("batch and seq must be positive, got {batch} and {seq}"),
            ));
        }
        let windows = tokens.len().saturating_sub(1) / seq;
        if windows < batch {
            return Err(Error::invalid(
                "TokenLoader",
                format!(
                    "{} tokens make {windows} windows of {seq}+1 tokens, fewer than one batch of {batch}; use more text or a smaller batch/seq",
                    tokens.len()
                ),
            ));
        }
        Ok(TokenLoader {
            tokens,
            batch,
            seq,
            shuffle: true,
            state: LoaderState { seed: 0, epoch: 0, batch: 0 },
            order: vec![],
        })
    }
    /// Sets the shuffling seed (and restarts at epoch 0).
    pub fn with_seed(mut self, seed: u64) -> TokenLoader {
        self.state = LoaderState { seed, epoch: 0, batch: 0 };
        self.order.clear();
        self
    }
    /// Turns shuffling on or off (off: windows in text order every epoch).
    pub fn with_shuffle(mut self, shuffle: bool) -> TokenLoader {
        self.shuffle = shuffle;
        self.order.clear();
        self
    }
    /// The token stream.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
    /// Number of windows of `seq + 1` tokens.
    pub fn windows(&self) -> usize {
        (self.tokens.len() - 1) / self.seq
    }
    /// Batches per epoch (the incomplete last one is dropped).
    pub fn batches_per_epoch(&self) -> usize {
        self.windows() / self.batch
    }
    /// `(batch, seq)`.
    pub fn batch_shape(&self) -> (usize, usize) {
        (self.batch, self.seq)
    }
    /// The current epoch (0-based).
    pub fn epoch(&self) -> u64 {
        self.state.epoch
    }
    /// The position, for checkpoints.
    pub fn state(&self) -> LoaderState {
        self.state
    }
    /// Continues from a saved position.
    pub fn set_state(&mut self, state: LoaderState) -> Result<()> {
        if state.batch as usize > self.batches_per_epoch() {
            return Err(Error::invalid(
                "TokenLoader::set_state",
                format!("batch {} is past the end of an epoch of {} batches", state.batch, self.batches_per_epoch()),
            ));
        }
        self.state = state;
        self.order.clear();
        Ok(())
    }

    fn window_order(&mut self) -> &[usize] {
        if self.order.is_empty() {
            self.order = (0..self.windows()).collect();
            if self.shuffle {
                SeededRng::new(mix(self.state.seed, self.state.epoch)).shuffle(&mut self.order);
            }
        }
        &self.order
    }

    fn make_batch(&self, starts: impl Iterator<Item = usize>) -> Result<Tensor> {
        let w = self.seq + 1;
        let mut data = Vec::with_capacity(self.batch * w);
        let mut rows = 0;
        for s in starts {
            data.extend(self.tokens[s * self.seq..s * self.seq + w].iter().map(|&t| t as i64));
            rows += 1;
        }
        Tensor::from_vec(data, &[rows, w])
    }

    /// The next `[batch, seq + 1]` int64 batch (moving to the next epoch when one ends).
    pub fn next_batch(&mut self) -> Result<Tensor> {
        if self.state.batch as usize >= self.batches_per_epoch() {
            self.state.epoch += 1;
            self.state.batch = 0;
            self.order.clear();
        }
        let b = self.state.batch as usize * self.batch;
        let batch = self.batch;
        let order = self.window_order()[b..b + batch].to_vec();
        self.state.batch += 1;
        self.make_batch(order.into_iter())
    }

    /// Every window once, in text order, `batch` at a time (the last batch may be
    /// smaller): for evaluation. Does not move the loader.
    pub fn sequential_batches(&self) -> impl Iterator<Item = Result<Tensor>> + '_ {
        let n = self.windows();
        (0..n.div_ceil(self.batch)).map(move |i| self.make_batch(i * self.batch..((i + 1) * self.batch).min(n)))
    }
}

/// Inputs `[:, :-1]` and targets `[:, 1:]` of a `[B, T+1]` batch (views).
pub fn inputs_targets(batch: &Tensor) -> Result<(Tensor, Tensor)> {
    if batch.ndim() != 2 || batch.shape()[1] < 2 {
        return Err(Error::shape(
            "inputs_targets",
            format!("expected a [B, T+1] batch with T >= 1, got shape {:?}", batch.shape()),
        ));
    }
    let t = batch.shape()[1] - 1;
    Ok((batch.narrow(1, 0, t)?, batch.narrow(1, 1, t)?))
}

// ---- the addition corpus -------------------------------------------------------------------------

/// Multi-digit addition problems written as text, `"123+456=579\n"`: a corpus
/// whose learned skill is measurable (exact-match accuracy of the answers).
///
/// Operands are uniform in `0..10^digits`. A fixed share of all operand pairs
/// (chosen by a hash of the pair and the seed) is held out: never in the
/// training text, used only for evaluation, so accuracy measures
/// generalisation, not memorisation.
///
/// ```
/// use kiln::nn::data::AdditionTask;
/// let task = AdditionTask::new(3, 0);
/// assert_eq!(AdditionTask::line(123, 456), "123+456=579\n");
/// let text = task.training_text(100);
/// assert_eq!(text.lines().count(), 100);
/// let held = task.held_out_problems(20);
/// assert!(held.iter().all(|&(a, b)| task.is_held_out(a, b)));
/// assert!(text.lines().all(|l| !held.iter().any(|&(a, b)| l == format!("{a}+{b}={}", a + b))));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdditionTask {
    /// Maximum number of digits of each operand.
    pub digits: u32,
    /// Seed of the problem sampling and of the held-out split.
    pub seed: u64,
    /// Share of operand pairs held out for evaluation, in percent (default 10).
    pub held_out_percent: u64,
}

impl AdditionTask {
    /// Problems with operands of up to `digits` digits (1..=9), 10% held out.
    pub fn new(digits: u32, seed: u64) -> AdditionTask {
        AdditionTask { digits: digits.clamp(1, 9), seed, held_out_percent: 10 }
    }
    /// One problem with its answer and a newline: `"a+b=c\n"`.
    pub fn line(a: u64, b: u64) -> String {
        format!("{a}+{b}={}\n", a + b)
    }
    /// The prompt of a problem: `"a+b="`.
    pub fn prompt(a: u64, b: u64) -> String {
        format!("{a}+{b}=")
    }
    /// The expected completion of [`AdditionTask::prompt`]: the sum's digits.
    pub fn answer(a: u64, b: u64) -> String {
        (a + b).to_string()
    }
    /// Whether a generated completion is right: its text up to the first newline (or the end) is the sum.
    pub fn is_correct(a: u64, b: u64, completion: &str) -> bool {
        completion.split('\n').next() == Some(Self::answer(a, b).as_str())
    }
    fn limit(&self) -> u64 {
        10u64.pow(self.digits)
    }
    /// Whether `(a, b)` belongs to the held-out evaluation set.
    pub fn is_held_out(&self, a: u64, b: u64) -> bool {
        mix(self.seed ^ 0xA5A5_5A5A, a.wrapping_mul(0x1_0000_0001).wrapping_add(b)) % 100 < self.held_out_percent
    }
    fn sample(&self, rng: &mut SeededRng, held_out: bool) -> (u64, u64) {
        loop {
            let (a, b) = (rng.below(self.limit()), rng.below(self.limit()));
            if self.is_held_out(a, b) == held_out {
                return (a, b);
            }
        }
    }
    /// `n` training problems (never held-out ones), one per line.
    pub fn training_text(&self, n: usize) -> String {
        let mut rng = SeededRng::new(mix(self.seed, 1));
        (0..n)
            .map(|_| {
                let (a, b) = self.sample(&mut rng, false);
                Self::line(a, b)
            })
            .collect()
    }
    /// `n` distinct held-out problems `(a, b)` (fewer if the held-out set is smaller), always the same for a seed.
    pub fn held_out_problems(&self, n: usize) -> Vec<(u64, u64)> {
        let total = self.limit() * self.limit();
        let want = (n as u64).min(total * self.held_out_percent / 100) as usize;
        let mut rng = SeededRng::new(mix(self.seed, 2));
        let mut seen = std::collections::HashSet::new();
        let mut out = Vec::with_capacity(want);
        let mut tries = 0u64;
        while out.len() < want && tries < total.saturating_mul(100) {
            tries += 1;
            let p = self.sample(&mut rng, true);
            if seen.insert(p) {
                out.push(p);
            }
        }
        out
    }
}
