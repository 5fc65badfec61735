//! Supervised fine-tuning data: chat conversations rendered with a template
//! and labelled on the assistant's turns only, the loader's padded and packed
//! batches, and packed rows giving each conversation the logits it has alone.
mod support;

use kiln::nn::chat::{ChatTemplate, Message};
use kiln::nn::data::sft::{read_chat_jsonl, tokenize_conversation, SftExample, SftLoader, IGNORE_INDEX};
use kiln::nn::data::{ByteTokenizer, Tokenizer};
use kiln::nn::models::{causal_lm_loss, LlamaForCausalLM};
use kiln::prelude::*;
use support::{assert_close, fixture_dir, tolerance};

const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}\
                      {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

fn msg(role: &str, content: &str) -> Message {
    Message { role: role.into(), content: content.into() }
}

fn conversation() -> Vec<Message> {
    vec![
        msg("system", "be brief"),
        msg("user", "2+2?"),
        msg("assistant", "4"),
        msg("user", "sure?"),
        msg("assistant", "yes"),
    ]
}

/// The labelled text: the runs of tokens whose label is not ignored, decoded.
fn learned(e: &SftExample) -> Vec<String> {
    let mut runs = vec![];
    let mut cur = vec![];
    for (&id, &l) in e.input_ids.iter().zip(&e.labels) {
        if l == IGNORE_INDEX {
            if !cur.is_empty() {
                runs.push(ByteTokenizer.decode(&cur).unwrap());
                cur.clear();
            }
        } else {
            assert_eq!(l, id as i64, "a label is its token");
            cur.push(id);
        }
    }
    if !cur.is_empty() {
        runs.push(ByteTokenizer.decode(&cur).unwrap());
    }
    runs
}

#[test]
fn only_the_assistant_turns_are_learned() {
    let t = ChatTemplate::new(CHATML, true).unwrap();
    let e = tokenize_conversation(&t, &ByteTokenizer, &conversation(), true).unwrap();
    assert_eq!(ByteTokenizer.decode(&e.input_ids).unwrap(), t.render_conversation(&conversation(), false).unwrap());
    // Each answer with its end-of-turn marker: the model learns to stop.
    assert_eq!(learned(&e), ["4<|im_end|>\n", "yes<|im_end|>\n"]);
    let all = tokenize_conversation(&t, &ByteTokenizer, &conversation(), false).unwrap();
    assert!(all.labels.iter().all(|&l| l != IGNORE_INDEX));
    // A template that does not render a conversation as a continuation of its start is refused.
    let counting =
        ChatTemplate::new("{{ messages|length }}{% for m in messages %}{{ m.content }};{% endfor %}", true).unwrap();
    let err = tokenize_conversation(&counting, &ByteTokenizer, &conversation(), true).unwrap_err().to_string();
    assert!(err.contains("continuation"), "{err}");
}

#[test]
fn chat_jsonl_is_read_and_bad_lines_are_named() {
    let dir = support::temp_dir("sft-jsonl");
    let good = dir.join("chats.jsonl");
    std::fs::write(
        &good,
        "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"assistant\", \"content\": \"hello\"}]}\n\n\
         {\"messages\": [{\"role\": \"user\", \"content\": \"a\"}], \"id\": 7}\n",
    )
    .unwrap();
    let chats = read_chat_jsonl(&good).unwrap();
    assert_eq!(chats.len(), 2);
    assert_eq!(chats[0][1], msg("assistant", "hello"));
    for (text, want) in [
        ("{\"messages\": [{\"role\": \"user\"}]}\n", "line 1: messages must be"),
        ("{}\n{\"x\": 1}\n", "line 1: no \"messages\""),
        ("{\"messages\": []}\n", "line 1: an empty conversation"),
        ("not json\n", "line 1: invalid JSON"),
    ] {
        let bad = dir.join("bad.jsonl");
        std::fs::write(&bad, text).unwrap();
        let e = read_chat_jsonl(&bad).unwrap_err().to_string();
        assert!(e.contains(want), "{text:?}: {e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn examples(lens: &[usize]) -> Vec<SftExample> {
    lens.iter()
        .enumerate()
        .map(|(i, &n)| {
            let input_ids: Vec<u32> = (0..n).map(|k| (1 + 17 * i + 5 * k) as u32 % 256).collect();
            // The second half of each is "the answer"; odd ones learn every token.
            let learn = |k: usize| k >= n / 2 || i % 2 == 1;
            let labels =
                input_ids.iter().enumerate().map(|(k, &t)| if learn(k) { t as i64 } else { IGNORE_INDEX }).collect();
            SftExample { input_ids, labels }
        })
        .collect()
}

#[test]
fn packed_batches_restart_positions_and_resume_where_they_stopped() {
    let ex = examples(&[5, 7, 3, 9, 4, 6]);
    let mut l = SftLoader::new(ex.clone(), 2, 12, true).unwrap().with_seed(3);
    let b = l.next_batch().unwrap();
    assert!(b.attention_mask.is_none());
    let (ids, labels, pos) = (
        b.input_ids.to_vec::<i64>().unwrap(),
        b.labels.to_vec::<i64>().unwrap(),
        b.position_ids.as_ref().unwrap().to_vec::<i64>().unwrap(),
    );
    for r in 0..2 {
        let row = r * 12..(r + 1) * 12;
        // Each conversation starts at position 0 with an ignored label, then follows its example.
        let starts: Vec<usize> = row.clone().filter(|&k| pos[k] == 0).collect();
        assert!(!starts.is_empty());
        for &s in &starts {
            assert_eq!(labels[s], IGNORE_INDEX);
            let e = ex.iter().find(|e| e.input_ids[0] as i64 == ids[s]).expect("a conversation starts here");
            for k in 1..e.input_ids.len().min(row.end - s) {
                if pos[s + k] == 0 {
                    break;
                }
                assert_eq!((ids[s + k], labels[s + k]), (e.input_ids[k] as i64, e.labels[k]));
            }
        }
    }
    // A batch too large to address is refused, not overflowed.
    let e = SftLoader::new(ex.clone(), usize::MAX / 2, 4, true).unwrap_err().to_string();
    assert!(e.contains("cannot be addressed"), "{e}");
    // A resumed loader gives the batches the uninterrupted one gives.
    let state = l.state();
    let next: Vec<Vec<i64>> = (0..4).map(|_| l.next_batch().unwrap().input_ids.to_vec::<i64>().unwrap()).collect();
    let mut resumed = SftLoader::new(ex, 2, 12, true).unwrap();
    resumed.set_state(state).unwrap();
    let again: Vec<Vec<i64>> =
        (0..4).map(|_| resumed.next_batch().unwrap().input_ids.to_vec::<i64>().unwrap()).collect();
    assert_eq!(next, again);
}

#[test]
fn a_packed_row_gives_each_conversation_its_own_logits_and_loss() {
    let model = LlamaForCausalLM::from_pretrained(fixture_dir("llama"), DType::F32, Device::Cpu).unwrap();
    let ex = examples(&[5, 7, 6, 4]);
    // Two rows of 12: [5 + 7] and [6 + 4 + 2 padding], in the loader's order.
    let mut l = SftLoader::new(ex.clone(), 2, 12, true).unwrap().with_seed(1);
    let b = l.next_batch().unwrap();
    let logits = model.forward_packed(&b.input_ids, b.position_ids.as_ref().unwrap()).unwrap();
    let pos = b.position_ids.as_ref().unwrap().to_vec::<i64>().unwrap();
    let ids = b.input_ids.to_vec::<i64>().unwrap();
    let (la, lr) = tolerance("llama", "logits");
    let mut seen = 0;
    for r in 0..2 {
        let mut k = 0;
        while k < 12 {
            let e = match ex.iter().find(|e| pos[r * 12 + k] == 0 && e.input_ids[0] as i64 == ids[r * 12 + k]) {
                Some(e) => e,
                None => break, // padding
            };
            let n = e.input_ids.len();
            let alone = Tensor::from_vec(e.input_ids.iter().map(|&t| t as i64).collect(), &[1, n]).unwrap();
            let want = model.forward(&alone, None).unwrap();
            let got = logits.narrow(0, r as isize, 1).unwrap().narrow(1, k as isize, n).unwrap();
            assert_close(&format!("row {r} conversation at {k}"), &got, &want, la, lr);
            k += n;
            seen += 1;
        }
    }
    assert_eq!(seen, 4, "every conversation was found in the packed rows");
    // The packed loss is the mean over every learned token of the batch.
    let loss = causal_lm_loss(&logits, &b.labels, Some(IGNORE_INDEX)).unwrap();
    assert!(loss.item::<f32>().unwrap().is_finite());
    // Padded (unpacked) batches mask padding and learn the same tokens.
    let mut l = SftLoader::new(ex, 2, 8, false).unwrap();
    let b = l.next_batch().unwrap();
    let mask = b.attention_mask.as_ref().unwrap().to_vec::<i64>().unwrap();
    let labels = b.labels.to_vec::<i64>().unwrap();
    assert!(mask.iter().zip(&labels).all(|(&m, &l)| m == 1 || l == IGNORE_INDEX), "padding is never learned");
    let padded = model.forward(&b.input_ids, b.attention_mask.as_ref()).unwrap();
    assert!(causal_lm_loss(&padded, &b.labels, Some(IGNORE_INDEX)).unwrap().item::<f32>().unwrap().is_finite());
}
