//! Greedy answers to many prompts at once: prompts of one length batched
//! together (256 at a time), each answer's text up to its first newline.
//! Shared by the train_llama and finetune examples' accuracy reports.
use kiln::nn::data::{AdditionTask, Tokenizer};
use kiln::nn::generate::{generate, Sampling};
use kiln::nn::models::LlamaForCausalLM;
use kiln::prelude::*;
use std::collections::BTreeMap;

/// The greedy continuation of each of `prompts` (token ids), at most
/// `max_new` tokens, decoded and cut at its first newline; in prompt order.
pub fn greedy_answers(
    model: &LlamaForCausalLM,
    tok: &dyn Tokenizer,
    prompts: &[Vec<u32>],
    max_new: usize,
) -> Result<Vec<String>> {
    let mut by_len: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (i, p) in prompts.iter().enumerate() {
        by_len.entry(p.len()).or_default().push(i);
    }
    let newline = tok.encode("\n")?.first().copied().map(i64::from);
    let sampling = Sampling::greedy().with_eos(&newline.into_iter().collect::<Vec<_>>());
    let mut answers = vec![String::new(); prompts.len()];
    for (len, group) in by_len {
        for chunk in group.chunks(256) {
            let ids: Vec<i64> = chunk.iter().flat_map(|&i| prompts[i].iter().map(|&t| t as i64)).collect();
            let prompt = Tensor::from_vec(ids, &[chunk.len(), len])?.to_device(model.device())?;
            let out = generate(model, &prompt, max_new, &sampling)?;
            let width = out.shape()[1];
            let out = out.to_vec::<i64>()?;
            for (row, &i) in chunk.iter().enumerate() {
                let new: Vec<u32> = out[row * width + len..(row + 1) * width].iter().map(|&t| t as u32).collect();
                answers[i] = tok.decode(&new)?.split('\n').next().unwrap_or("").to_string();
            }
        }
    }
    Ok(answers)
}

/// The greedy answer to each addition problem (its prompt in `prompts`) and
/// whether it is the sum: [`greedy_answers`] graded, in problem order.
pub fn graded_answers(
    model: &LlamaForCausalLM,
    tok: &dyn Tokenizer,
    task: &AdditionTask,
    problems: &[(u64, u64)],
    prompts: &[Vec<u32>],
) -> Result<Vec<(String, bool)>> {
    let answers = greedy_answers(model, tok, prompts, task.digits as usize + 2)?;
    Ok(answers
        .into_iter()
        .zip(problems)
        .map(|(text, &(a, b))| {
            let ok = AdditionTask::is_correct(a, b, &text);
            (text, ok)
        })
        .collect())
}
