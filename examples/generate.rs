//! Generates text with a Hugging Face Llama/Qwen3 checkpoint: loads the model
//! directory, turns the prompt into token ids (byte-level, or a given id list),
//! generates with the KV cache and prints the result.
//!
//! ```sh
//! cargo run --release --example generate -- --model ../shared/fixtures/llama --prompt "Hello" --max-new-tokens 16
//! cargo run --release --example generate -- --model DIR --ids 1,15043,29892 --temperature 0.8 --top-p 0.95 --seed 1
//! ```
//!
//! Byte-level prompts suit models whose vocabulary is the 256 byte values (like
//! the test fixtures and kiln's `train_llama`); for other models pass token ids
//! from their tokenizer with `--ids`.
#[path = "support/logging.rs"]
mod logging;
use kiln::nn::generate::{generate, Sampling};
use kiln::nn::models::LlamaForCausalLM;
use kiln::prelude::*;
use std::time::Instant;

const USAGE: &str = "\
generate: continue a prompt with a Hugging Face Llama/Qwen3 checkpoint

USAGE: cargo run --release --example generate -- --model DIR (--prompt TEXT | --ids 1,2,3) [OPTIONS]

  --model DIR|REPO_ID    config.json + model.safetensors (or a sharded index), or a repo id in the Hugging Face cache
  --prompt TEXT          the prompt as bytes (token id = byte value)
  --ids LIST             the prompt as comma-separated token ids
  --max-new-tokens N     tokens to generate [default: 32]
  --temperature X        0 for greedy [default: 0]
  --top-k N              keep the N most likely tokens (0: all) [default: 0]
  --top-p X              nucleus sampling threshold [default: 1.0]
  --seed N               seed of the sampler [default: 0]
  --eos LIST             stop at these token ids (default: the config's eos_token_id)
  --no-cache             recompute the whole sequence each step (slow; for checking)
  --dtype f32|bf16       compute dtype [default: f32]
  --device D             device [default: cpu]
";

fn fail(msg: &str) -> ! {
    eprintln!("generate: {msg}\n\n{USAGE}");
    std::process::exit(2)
}

fn ids_of(list: &str) -> Vec<i64> {
    list.split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| s.trim().parse::<i64>().unwrap_or_else(|_| fail(&format!("{s:?} is not a token id"))))
        .collect()
}

fn main() {
    logging::init();
    if let Err(e) = run() {
        eprintln!("generate: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let mut model_dir = None;
    let mut prompt: Option<Vec<i64>> = None;
    let mut bytes_prompt = false;
    let mut max_new = 32;
    let mut sampling = Sampling::greedy().with_seed(0);
    let mut eos: Option<Vec<i64>> = None;
    let mut dtype = DType::F32;
    let mut device = Device::Cpu;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--help" | "-h" => {
                print!("{USAGE}");
                return Ok(());
            }
            "--no-cache" => {
                sampling.use_cache = false;
                continue;
            }
            _ => {}
        }
        let v = it.next().unwrap_or_else(|| fail(&format!("{flag} needs a value")));
        let num = |v: &str| v.parse::<f64>().unwrap_or_else(|_| fail(&format!("{flag}: {v:?} is not a number")));
        match flag.as_str() {
            "--model" => model_dir = Some(v),
            "--prompt" => {
                prompt = Some(v.bytes().map(i64::from).collect());
                bytes_prompt = true;
            }
            "--ids" => prompt = Some(ids_of(&v)),
            "--max-new-tokens" => max_new = num(&v) as usize,
            "--temperature" => sampling.temperature = num(&v),
            "--top-k" => sampling.top_k = num(&v) as usize,
            "--top-p" => sampling.top_p = num(&v),
            "--seed" => sampling.seed = Some(num(&v) as u64),
            "--eos" => eos = Some(ids_of(&v)),
            "--dtype" => dtype = DType::from_name(&v).unwrap_or_else(|| fail(&format!("unknown dtype {v}"))),
            "--device" => device = Device::parse(&v)?,
            other => fail(&format!("unknown option {other}")),
        }
    }
    let dir = model_dir.unwrap_or_else(|| fail("--model is required"));
    let prompt = prompt.unwrap_or_else(|| fail("give a prompt with --prompt or --ids"));
    if prompt.is_empty() {
        fail("the prompt is empty");
    }
    // Registers the PJRT backend for `--device tpu`; a missing device fails here, naming it.
    kiln::init_device(device)?;
    let t0 = Instant::now();
    let model = LlamaForCausalLM::from_pretrained(&dir, dtype, device)?;
    let vocab = model.config().vocab_size as i64;
    if let Some(bad) = prompt.iter().find(|&&t| t < 0 || t >= vocab) {
        fail(&format!("token id {bad} is outside the vocabulary (0..{vocab})"));
    }
    sampling.eos_token_ids = eos.unwrap_or_else(|| model.config().eos_token_ids.clone());
    eprintln!(
        "loaded {dir} ({} layers, vocab {vocab}) in {:.2}s",
        model.config().num_hidden_layers,
        t0.elapsed().as_secs_f64()
    );

    let n = prompt.len();
    let input = Tensor::from_vec(prompt, &[1, n])?;
    let t = Instant::now();
    let out = generate(&model, &input, max_new, &sampling)?.to_vec::<i64>()?;
    let secs = t.elapsed().as_secs_f64();
    let new = out.len() - n;
    println!("token ids: {out:?}");
    if bytes_prompt || vocab <= 256 {
        let bytes: Vec<u8> = out.iter().map(|&t| t.clamp(0, 255) as u8).collect();
        println!("text: {}", String::from_utf8_lossy(&bytes));
    }
    eprintln!("{new} new tokens in {secs:.2}s ({:.1} tokens/s)", new as f64 / secs.max(1e-9));
    Ok(())
}
