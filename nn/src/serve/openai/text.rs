//! Text in and out of the server: the model's tokenizer (a Hugging Face
//! `tokenizer.json`, or bytes for models trained on them), and the visible text
//! of a generation as it grows (stop strings cut it, incomplete characters wait).
use kiln_tensor::{Error, Result};
use std::path::Path;

/// Token ids to text and back.
pub enum Codec {
    /// A Hugging Face tokenizer.
    Hf(Box<tokenizers::Tokenizer>),
    /// One token per byte (vocabulary 256), as `train_llama` trains by default.
    Bytes,
}

impl Codec {
    /// `dir/tokenizer.json`, or bytes when the directory has none.
    pub fn for_model(dir: &Path) -> Result<Codec> {
        let p = dir.join("tokenizer.json");
        if !p.exists() {
            return Ok(Codec::Bytes);
        }
        let t = tokenizers::Tokenizer::from_file(&p)
            .map_err(|e| Error::invalid("serve", format!("cannot read {}: {e}", p.display())))?;
        Ok(Codec::Hf(Box::new(t)))
    }

    /// The ids of `text`, with the tokenizer's special tokens (a BOS, for
    /// one) when `special`, as transformers' `tokenizer(text)` adds them.
    pub fn encode(&self, text: &str, special: bool) -> Result<Vec<i64>> {
        match self {
            Codec::Bytes => Ok(text.bytes().map(i64::from).collect()),
            Codec::Hf(t) => {
                let enc = t
                    .encode(text, special)
                    .map_err(|e| Error::invalid("serve", format!("cannot tokenize the prompt: {e}")))?;
                Ok(enc.get_ids().iter().map(|&i| i as i64).collect())
            }
        }
    }

    /// The text of `ids`, special tokens left out.
    pub fn decode(&self, ids: &[i64]) -> String {
        match self {
            Codec::Bytes => {
                let b: Vec<u8> = ids.iter().filter_map(|&i| u8::try_from(i).ok()).collect();
                String::from_utf8_lossy(&b).into_owned()
            }
            Codec::Hf(t) => {
                let ids: Vec<u32> = ids.iter().filter_map(|&i| u32::try_from(i).ok()).collect();
                t.decode(&ids, true).unwrap_or_default()
            }
        }
    }

    /// The text of a special token id (`None` for bytes or an unknown id).
    pub fn token_text(&self, id: i64) -> Option<String> {
        match self {
            Codec::Bytes => None,
            Codec::Hf(t) => t.id_to_token(u32::try_from(id).ok()?),
        }
    }
}

/// The text a generation shows so far: everything decoded, cut before the
/// first stop string, less a tail that may still become a stop string or is
/// an incomplete character (U+FFFD while its bytes arrive), until the end.
pub struct Visible {
    stops: Vec<String>,
    sent: usize,
}

impl Visible {
    /// Nothing shown yet.
    pub fn new(stops: &[String]) -> Visible {
        Visible { stops: stops.to_vec(), sent: 0 }
    }

    /// The part of `text` (all the generated text so far) that can be shown
    /// and was not yet; `done` when no more tokens follow.
    pub fn delta(&mut self, text: &str, done: bool) -> String {
        let mut end = text.len();
        if let Some(cut) = self.stops.iter().filter_map(|s| text.find(s.as_str())).min() {
            end = cut;
        } else if !done {
            // Hold back what could be the start of a stop string, and an
            // incomplete character.
            for s in &self.stops {
                for k in (1..s.len()).rev() {
                    if s.is_char_boundary(k) && text.ends_with(&s[..k]) {
                        end = end.min(text.len() - k);
                        break;
                    }
                }
            }
            let trimmed = text[..end].trim_end_matches('\u{FFFD}');
            end = trimmed.len();
        }
        if end <= self.sent {
            return String::new();
        }
        let d = text[self.sent..end].to_string();
        self.sent = end;
        d
    }
}
