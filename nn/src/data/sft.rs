//! Supervised fine-tuning data (feature `chat`): chat conversations in JSONL
//! (`{"messages": [{"role": ..., "content": ...}, ...]}` per line, as TRL
//! reads them) rendered with the model's chat template, labels masked to the
//! assistant turns (`-100` elsewhere), and a loader of batches: one
//! conversation per row, right-padded, or several packed per row with
//! position ids restarting at each (TRL's packing), for
//! [`crate::models::LlamaForCausalLM::forward_packed`].

// Note [Assistant-only labels]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Which characters of a rendered conversation are the assistant's is found
// from the template itself: for assistant message `i`, the conversation up
// to it rendered with the generation prompt ends where its text starts, and
// the conversation through it (without the prompt) ends where its turn
// ends (the end-of-turn marker included, so the model learns to stop). Each
// must be a prefix of the whole rendering, or the template is refused
// rather than guessed at. The text is tokenized piece by piece (the
// pieces between those boundaries), so no token straddles a boundary; a
// tokenizer may merge differently across a boundary than inside one text,
// as when prompt and answer are tokenized apart (the usual practice).
use super::{LoaderState, SeededRng, Tokenizer};
use crate::chat::{ChatTemplate, Message};
use kiln_tensor::{DType, Error, Result, Tensor};
use std::path::Path;

/// The label of a token that is not learned (PyTorch's `ignore_index`).
pub const IGNORE_INDEX: i64 = -100;

/// One tokenized conversation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SftExample {
    /// Its token ids.
    pub input_ids: Vec<u32>,
    /// Per token: its id where the loss learns it (the assistant's turns),
    /// [`IGNORE_INDEX`] elsewhere.
    pub labels: Vec<i64>,
}

/// Reads a JSONL file of conversations: each non-empty line an object with
/// a `messages` list of `{role, content}` (other fields are ignored). A
/// malformed line is an error naming its number.
pub fn read_chat_jsonl(path: impl AsRef<Path>) -> Result<Vec<Vec<Message>>> {
    let path = path.as_ref();
    let err = |m: String| Error::invalid("read_chat_jsonl", format!("{}: {m}", path.display()));
    let text = std::fs::read_to_string(path).map_err(|e| err(format!("cannot read: {e}")))?;
    let mut out = vec![];
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| err(format!("line {}: invalid JSON: {e}", i + 1)))?;
        let messages =
            v.get("messages").cloned().ok_or_else(|| err(format!("line {}: no \"messages\" list", i + 1))).and_then(
                |m| {
                    serde_json::from_value::<Vec<Message>>(m)
                        .map_err(|e| err(format!("line {}: messages must be {{role, content}} objects: {e}", i + 1)))
                },
            )?;
        if messages.is_empty() {
            return Err(err(format!("line {}: an empty conversation", i + 1)));
        }
        out.push(messages);
    }
    if out.is_empty() {
        return Err(err("no conversation in the file".into()));
    }
    Ok(out)
}

/// `messages` rendered with `template` and tokenized, each token labelled
/// with its id inside the assistant's turns and [`IGNORE_INDEX`] elsewhere
/// (Note [Assistant-only labels]); with `assistant_only` false every token
/// is labelled. A conversation without an assistant turn learns nothing.
pub fn tokenize_conversation(
    template: &ChatTemplate,
    tokenizer: &dyn Tokenizer,
    messages: &[Message],
    assistant_only: bool,
) -> Result<SftExample> {
    let full = template.render_conversation(messages, false)?;
    let err = |m: String| Error::invalid("tokenize_conversation", m);
    // Byte spans of the assistant's turns in `full`.
    let mut spans = vec![];
    for (i, m) in messages.iter().enumerate().filter(|(_, m)| m.role == "assistant") {
        let before = template.render_conversation(&messages[..i], true)?;
        let through = template.render_conversation(&messages[..=i], false)?;
        if !through.starts_with(&before) || !full.starts_with(&through) {
            return Err(err(format!(
                "the chat template does not render message {i} ({:?}) as a continuation of the messages before \
                 it, so its turn cannot be told from the rest (Note [Assistant-only labels])",
                m.role
            )));
        }
        spans.push((before.len(), through.len()));
    }
    let mut input_ids = vec![];
    let mut labels = vec![];
    let mut push = |text: &str, learn: bool| -> Result<()> {
        let ids = tokenizer.encode(text)?;
        labels.extend(ids.iter().map(|&t| if learn { t as i64 } else { IGNORE_INDEX }));
        input_ids.extend(ids);
        Ok(())
    };
    let mut at = 0;
    for (a, b) in spans {
        push(&full[at..a], !assistant_only)?;
        push(&full[a..b], true)?;
        at = b;
    }
    push(&full[at..], !assistant_only)?;
    Ok(SftExample { input_ids, labels })
}

/// One batch of supervised fine-tuning.
#[derive(Debug, Clone)]
pub struct SftBatch {
    /// Token ids, int64 `[B, T]` (padding is id 0).
    pub input_ids: Tensor,
    /// Labels, int64 `[B, T]`: the id to learn or [`IGNORE_INDEX`]; the loss
    /// is `causal_lm_loss(logits, labels, Some(IGNORE_INDEX))`.
    pub labels: Tensor,
    /// Unpacked batches: int64 `[B, T]`, 1 for tokens and 0 for padding.
    pub attention_mask: Option<Tensor>,
    /// Packed batches: int64 `[B, T]`, each conversation's positions from 0
    /// (padding continues the last one).
    pub position_ids: Option<Tensor>,
}

/// Batches of tokenized conversations, shuffled per epoch by a seeded
/// generator, with a [`LoaderState`] to resume from. Without packing each
/// row holds one conversation (cut to `seq` tokens) padded on the right;
/// with packing, conversations are laid one after another into rows of
/// `seq` tokens in the epoch's order (one that does not fit the row's
/// remainder starts the next row), and each conversation's first label is
/// ignored so that no row learns across a boundary.
#[derive(Debug, Clone)]
pub struct SftLoader {
    examples: Vec<SftExample>,
    batch: usize,
    seq: usize,
    packing: bool,
    state: LoaderState,
    /// The rows of `state.epoch`: conversation indices (empty until first needed).
    rows: Vec<Vec<usize>>,
}

impl SftLoader {
    /// A loader of `[batch, seq]` batches (seed 0).
    pub fn new(examples: Vec<SftExample>, batch: usize, seq: usize, packing: bool) -> Result<SftLoader> {
        if batch == 0 || seq < 2 {
            return Err(Error::invalid(
                "SftLoader",
                format!("batch must be positive and seq at least 2, got {batch} and {seq}"),
            ));
        }
        if batch.checked_mul(seq).is_none_or(|n| n > isize::MAX as usize / 8) {
            return Err(Error::invalid("SftLoader", format!("a batch of {batch} x {seq} tokens cannot be addressed")));
        }
        if let Some(i) = examples.iter().position(|e| e.input_ids.is_empty() || e.input_ids.len() != e.labels.len()) {
            return Err(Error::invalid(
                "SftLoader",
                format!("example {i} is empty or its labels do not match its ids"),
            ));
        }
        let l = SftLoader {
            examples,
            batch,
            seq,
            packing,
            state: LoaderState { seed: 0, epoch: 0, batch: 0 },
            rows: vec![],
        };
        let rows = l.layout(0).len();
        if rows < batch {
            return Err(Error::invalid(
                "SftLoader",
                format!("{} conversations make {rows} rows, fewer than one batch of {batch}", l.examples.len()),
            ));
        }
        Ok(l)
    }

    /// Sets the shuffling seed (and restarts at epoch 0).
    pub fn with_seed(mut self, seed: u64) -> SftLoader {
        self.state = LoaderState { seed, epoch: 0, batch: 0 };
        self.rows.clear();
        self
    }

    /// Batches per epoch (an incomplete last batch is dropped).
    pub fn batches_per_epoch(&self) -> usize {
        self.layout(self.state.epoch).len() / self.batch
    }

    /// The position, for checkpoints.
    pub fn state(&self) -> LoaderState {
        self.state
    }

    /// Continues from a saved position.
    pub fn set_state(&mut self, state: LoaderState) -> Result<()> {
        self.state = state;
        self.rows.clear();
        if state.batch as usize > self.batches_per_epoch() {
            return Err(Error::invalid("SftLoader", format!("batch {} is past the end of the epoch", state.batch)));
        }
        Ok(())
    }

    /// The rows of `epoch`: the conversations in the epoch's shuffled order,
    /// one per row or packed.
    fn layout(&self, epoch: u64) -> Vec<Vec<usize>> {
        let mut order: Vec<usize> = (0..self.examples.len()).collect();
        SeededRng::new(self.state.seed ^ epoch.wrapping_mul(0x9E37_79B9_7F4A_7C15)).shuffle(&mut order);
        if !self.packing {
            return order.into_iter().map(|i| vec![i]).collect();
        }
        let mut rows: Vec<Vec<usize>> = vec![];
        let mut used = self.seq;
        for i in order {
            let n = self.examples[i].input_ids.len().min(self.seq);
            if used + n > self.seq {
                rows.push(vec![]);
                used = 0;
            }
            rows.last_mut().expect("pushed above").push(i);
            used += n;
        }
        rows
    }

    /// The next batch (the next epoch starts after the last one).
    pub fn next_batch(&mut self) -> Result<SftBatch> {
        if self.rows.is_empty() {
            self.rows = self.layout(self.state.epoch);
        }
        if self.state.batch as usize >= self.rows.len() / self.batch {
            self.state.epoch += 1;
            self.state.batch = 0;
            self.rows = self.layout(self.state.epoch);
        }
        let first = self.state.batch as usize * self.batch;
        self.state.batch += 1;
        let (b, t) = (self.batch, self.seq);
        let (mut ids, mut labels, mut mask, mut pos) =
            (vec![0i64; b * t], vec![IGNORE_INDEX; b * t], vec![0i64; b * t], vec![0i64; b * t]);
        for (r, row) in self.rows[first..first + b].iter().enumerate() {
            let mut at = r * t;
            for &i in row {
                let e = &self.examples[i];
                let n = e.input_ids.len().min(t);
                for k in 0..n {
                    ids[at + k] = e.input_ids[k] as i64;
                    labels[at + k] = if self.packing && k == 0 { IGNORE_INDEX } else { e.labels[k] };
                    mask[at + k] = 1;
                    pos[at + k] = k as i64;
                }
                at += n;
            }
            // Padding continues the last conversation's positions.
            let last = if at > r * t { pos[at - 1] } else { -1 };
            for (k, p) in pos[at..(r + 1) * t].iter_mut().enumerate() {
                *p = last + 1 + k as i64;
            }
        }
        let tensor = |v: Vec<i64>| Tensor::from_vec(v, &[b, t]).and_then(|x| x.to_dtype(DType::I64));
        Ok(SftBatch {
            input_ids: tensor(ids)?,
            labels: tensor(labels)?,
            attention_mask: if self.packing { None } else { Some(tensor(mask)?) },
            position_ids: if self.packing { Some(tensor(pos)?) } else { None },
        })
    }
}
