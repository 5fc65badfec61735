//! The finetune example's data: a chat file generated from the addition task
//! (`"What is 12 plus 57?"` answered `"69"`), and the held-out accuracy of a
//! model's greedy answers in that chat form.
use kiln::nn::chat::{ChatTemplate, Message};
use kiln::nn::data::{AdditionTask, Tokenizer};
use kiln::nn::models::LlamaForCausalLM;
use kiln::prelude::*;
use std::path::Path;

/// The question of problem `(a, b)`.
pub fn question(a: u64, b: u64) -> String {
    format!("What is {a} plus {b}?")
}

/// Writes `n` training conversations of `task` (never held-out problems) as
/// JSONL into `path`.
pub fn write_addition_chats(path: &Path, task: &AdditionTask, n: usize) -> Result<()> {
    let mut out = String::new();
    for line in task.training_text(n).lines() {
        let (q, sum) = line.split_once('=').ok_or_else(|| Error::invalid("finetune", format!("bad line {line:?}")))?;
        let (a, b) = q.split_once('+').ok_or_else(|| Error::invalid("finetune", format!("bad line {line:?}")))?;
        let (a, b): (u64, u64) = (
            a.parse().map_err(|_| Error::invalid("finetune", "bad operand"))?,
            b.parse().map_err(|_| Error::invalid("finetune", "bad operand"))?,
        );
        let messages = [
            Message { role: "user".into(), content: question(a, b) },
            Message { role: "assistant".into(), content: sum.to_string() },
        ];
        out.push_str(&serde_json::json!({ "messages": messages }).to_string());
        out.push('\n');
    }
    std::fs::write(path, out).map_err(|e| Error::invalid("finetune", format!("cannot write {}: {e}", path.display())))
}

/// The share of `problems` whose greedy answer, generated after the chat
/// prompt of the question, is the sum (up to the first newline), and a few
/// examples.
pub fn chat_accuracy(
    model: &LlamaForCausalLM,
    template: &ChatTemplate,
    tok: &dyn Tokenizer,
    task: &AdditionTask,
    problems: &[(u64, u64)],
) -> Result<(f64, Vec<String>)> {
    let prompts = problems
        .iter()
        .map(|&(a, b)| {
            let prompt = template.render(&[Message { role: "user".into(), content: question(a, b) }])?;
            tok.encode(&prompt)
        })
        .collect::<Result<Vec<_>>>()?;
    let answers = crate::answers::graded_answers(model, tok, task, problems, &prompts)?;
    let examples = problems
        .iter()
        .zip(&answers)
        .take(4)
        .map(|(&(a, b), (shown, ok))| {
            format!(
                "{} -> {shown:?} ({})",
                question(a, b),
                if *ok { "right".into() } else { format!("{} expected", a + b) }
            )
        })
        .collect();
    let right = answers.iter().filter(|(_, ok)| *ok).count();
    Ok((right as f64 / problems.len().max(1) as f64, examples))
}
