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
        // What was shown holds no stop string and ends in no start of one, so
        // a stop string starts at most its length before the unshown text.
        let longest = self.stops.iter().map(|s| s.len()).max().unwrap_or(0);
        let mut from = self.sent.saturating_sub(longest).min(text.len());
        while !text.is_char_boundary(from) {
            from -= 1;
        }
        if let Some(cut) = self.stops.iter().filter_map(|s| text[from..].find(s.as_str()).map(|i| from + i)).min() {
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
        if end <= self.sent || !text.is_char_boundary(self.sent) {
            return String::new();
        }
        let d = text[self.sent..end].to_string();
        self.sent = end;
        d
    }
}

/// The text of a growing list of tokens, decoded a few tokens at a time (the
/// prefix and read offsets of TGI's and vLLM's incremental detokenizers): each
/// new token decodes with the tokens since the last emitted piece, so the
/// work per token stays small however long the output grows, and a token
/// that ends in an incomplete character waits for the next.
#[derive(Debug, Default)]
pub struct IncrementalText {
    text: String,
    prefix: usize,
    read: usize,
}

impl IncrementalText {
    /// Nothing decoded yet.
    pub fn new() -> IncrementalText {
        IncrementalText::default()
    }

    /// Takes in the tokens added to `tokens` since the last call; `done` when
    /// no more follow (an incomplete character is then kept as U+FFFD).
    pub fn update(&mut self, codec: &Codec, tokens: &[i64], done: bool) {
        if self.read >= tokens.len() {
            return;
        }
        let before = codec.decode(&tokens[self.prefix..self.read]);
        let now = codec.decode(&tokens[self.prefix..]);
        if !done && now.ends_with('\u{FFFD}') {
            return;
        }
        match now.strip_prefix(before.as_str()) {
            Some(new) => self.text.push_str(new),
            // A decoder that rewrites earlier text: decode everything again.
            None => self.text = codec.decode(tokens),
        }
        self.prefix = self.read;
        self.read = tokens.len();
    }

    /// The text so far.
    pub fn text(&self) -> &str {
        &self.text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A SentencePiece-like tokenizer: its decoder drops the space of a first word.
    fn metaspace() -> Codec {
        let json = r#"{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": null, "post_processor": null,
            "decoder": {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always", "split": true},
            "model": {"type": "WordLevel", "unk_token": "<unk>",
                      "vocab": {"\u2581Hello": 0, "\u2581wor": 1, "ld": 2, "!": 3, "\u2581caf": 4, "<unk>": 5}}}"#;
        Codec::Hf(Box::new(json.parse::<tokenizers::Tokenizer>().unwrap()))
    }

    #[test]
    fn incremental_text_equals_decoding_everything() {
        // Bytes: "é" (two bytes) and "€" (three) split across tokens wait for their last byte.
        let bytes: Vec<i64> = "a é€!".bytes().map(i64::from).collect();
        for (codec, tokens) in [(Codec::Bytes, bytes), (metaspace(), vec![0, 1, 2, 3, 4, 1, 2, 2, 0])] {
            let mut inc = IncrementalText::new();
            for n in 1..=tokens.len() {
                inc.update(&codec, &tokens[..n], false);
                let full = codec.decode(&tokens[..n]);
                if full.ends_with('\u{FFFD}') {
                    assert!(full.starts_with(inc.text()), "{:?} vs {full:?}", inc.text());
                } else {
                    assert_eq!(inc.text(), full);
                }
            }
            inc.update(&codec, &tokens, true);
            assert_eq!(inc.text(), codec.decode(&tokens));
        }
        // An incomplete character at the end is kept, as a full decode keeps it.
        let mut inc = IncrementalText::new();
        let cut = [0x61, 0xE2, 0x82];
        inc.update(&Codec::Bytes, &cut, false);
        assert_eq!(inc.text(), "");
        inc.update(&Codec::Bytes, &cut, true);
        assert_eq!(inc.text(), Codec::Bytes.decode(&cut));
    }

    #[test]
    fn visible_text_stops_at_stop_strings_found_late() {
        let mut v = Visible::new(&["STOP".to_string()]);
        let mut text = String::new();
        let mut shown = String::new();
        for piece in ["abc", "ST", "xyz ", "é S", "TO", "P tail"] {
            text.push_str(piece);
            shown.push_str(&v.delta(&text, false));
        }
        shown.push_str(&v.delta(&text, true));
        assert_eq!(shown, "abcSTxyz é ");
    }
}
