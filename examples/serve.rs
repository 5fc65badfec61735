//! An OpenAI-compatible server for a Llama / Qwen3 directory, on the
//! continuous-batching engine (`kiln::nn::serve`).
//!
//! ```sh
//! cargo run --release --example train_llama            # writes runs/train_llama
//! cargo run --release --example serve                  # serves it on 127.0.0.1:8000
//! cargo run --release --example serve -- --model DIR --port 8080
//! cargo run --release --example finetune               # writes a LoRA adapter into runs/finetune/adapter
//! cargo run --release --example serve -- --lora chat=runs/finetune/adapter   # base and adapter, by `model`
//! curl http://127.0.0.1:8000/v1/completions -H 'content-type: application/json' \
//!      -d '{"model": "train_llama", "prompt": "ROMEO:", "max_tokens": 32}'
//! ```
//!
//! It reads `config.json` and the weights, `tokenizer.json` if there is one
//! (else byte-level tokens, as `train_llama` trains), and the chat template of
//! `tokenizer_config.json`. It prints `listening on http://ADDR` once it
//! accepts connections (`--port 0` picks a free port).
#[path = "support/logging.rs"]
mod logging;
use kiln::nn::layers::parse_kv_cache_dtype;
use kiln::nn::models::LlamaForCausalLM;
use kiln::nn::serve::openai::{router, serve, ServerLimits, ServerState};
use kiln::nn::serve::{EngineConfig, Speculation};
use kiln::prelude::*;
use std::path::PathBuf;
use std::sync::Arc;

const USAGE: &str = "\
serve: an OpenAI-compatible HTTP server for a Llama / Qwen3 checkpoint

USAGE: cargo run --release --example serve -- [OPTIONS]

  --model DIR|REPO_ID      config.json + weights, or a repo id in the Hugging Face cache [default: runs/train_llama]
  --name NAME              the model name clients use [default: the repo id or the directory's name]
  --host ADDR              [default: 127.0.0.1]
  --port N                 0 picks a free one [default: 8000]
  --dtype f32|bf16         [default: f32]
  --kv-cache-mb N          the KV cache's memory [default: 256]
  --kv-cache-dtype T       auto|float32|bfloat16|float16|fp8|fp8_e5m2: how the KV
                           cache stores keys and values (fp8: e4m3 with a scale
                           per position and head) [default: auto, the model's]
  --block-size N           positions per KV block [default: 16]
  --speculative-ngram K    speculative decoding by prompt lookup: propose the K tokens that
                           followed the latest earlier occurrence of the last 1 to 3 tokens
  --draft-model DIR        speculative decoding with DIR's smaller model (same tokenizer)
                           proposing --num-speculative-tokens tokens [default: 4]
  --max-num-seqs N         sequences run at once [default: 64]
  --max-batched-tokens N   tokens per model step [default: 2048]
  --max-queue N            waiting requests before 429s [default: 1024]
  --no-prefix-sharing      compute shared prompt prefixes again for every request
  --lora NAME=DIR          also serve the PEFT LoRA adapter in DIR to requests whose model is NAME,
                           batched with the others (repeatable)
  --batch-invariant        every request's tokens are what generate() gives it alone
                           (kiln::tensor::set_batch_invariant; slower single-sequence decode)
  --api-key KEY            /v1 routes want `Authorization: Bearer KEY` [default: $KILN_API_KEY, else none]
  --request-timeout-s N    a request's generation may take this long [default: 600]
  --idle-timeout-s N       close a connection idle (no request header) this long [default: 60]
  --max-connections N      open connections at once; more wait [default: 512]
  --max-prompt-tokens N    longest prompt accepted [default: the context]
  --max-output-tokens N    most tokens generated per choice [default: the context]
  --max-body-kb N          largest request body [default: 8192]
";

fn fail(msg: &str) -> ! {
    eprintln!("serve: {msg}\n\n{USAGE}");
    std::process::exit(2)
}

fn main() {
    logging::init();
    if let Err(e) = run() {
        eprintln!("serve: {e}");
        std::process::exit(1);
    }
}

fn run() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let mut dir = PathBuf::from("runs/train_llama");
    let (mut name, mut host, mut port, mut dtype) = (None, "127.0.0.1".to_string(), 8000u16, DType::F32);
    let mut cfg = EngineConfig::default();
    let mut kv_mb = 256usize;
    let (mut draft, mut draft_k) = (None::<PathBuf>, 4usize);
    let mut adapters: Vec<(String, PathBuf)> = vec![];
    let mut limits = ServerLimits { api_key: std::env::var("KILN_API_KEY").ok(), ..Default::default() };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--help" | "-h" => {
                print!("{USAGE}");
                return Ok(());
            }
            "--no-prefix-sharing" => {
                cfg.prefix_sharing = false;
                continue;
            }
            "--batch-invariant" => {
                kiln::tensor::set_batch_invariant(true);
                continue;
            }
            _ => {}
        }
        let v = it.next().unwrap_or_else(|| fail(&format!("{flag} needs a value")));
        let num = |v: &str| v.parse::<usize>().unwrap_or_else(|_| fail(&format!("{flag}: {v:?} is not a number")));
        match flag.as_str() {
            "--model" => dir = PathBuf::from(v),
            "--name" => name = Some(v),
            "--host" => host = v,
            "--port" => port = u16::try_from(num(&v)).unwrap_or_else(|_| fail("--port must be below 65536")),
            "--dtype" => dtype = DType::from_name(&v).unwrap_or_else(|| fail(&format!("unknown dtype {v:?}"))),
            "--kv-cache-mb" => kv_mb = num(&v),
            "--kv-cache-dtype" => {
                cfg.kv_cache_dtype = parse_kv_cache_dtype(&v).unwrap_or_else(|e| fail(&e.to_string()))
            }
            "--block-size" => cfg.block_size = num(&v),
            "--speculative-ngram" => cfg.speculative = Some(Speculation::NGram { k: num(&v), n_min: 1, n_max: 3 }),
            "--draft-model" => draft = Some(PathBuf::from(v)),
            "--num-speculative-tokens" => draft_k = num(&v),
            "--max-num-seqs" => cfg.max_num_seqs = num(&v),
            "--max-batched-tokens" => cfg.max_batched_tokens = num(&v),
            "--max-queue" => cfg.max_queue = num(&v),
            "--api-key" => limits.api_key = Some(v),
            "--request-timeout-s" => limits.request_timeout = std::time::Duration::from_secs(num(&v) as u64),
            "--idle-timeout-s" => limits.idle_timeout = std::time::Duration::from_secs(num(&v) as u64),
            "--max-connections" => limits.max_connections = num(&v),
            "--max-prompt-tokens" => limits.max_prompt_tokens = Some(num(&v)),
            "--max-output-tokens" => limits.max_output_tokens = Some(num(&v)),
            "--max-body-kb" => limits.max_body_bytes = num(&v) << 10,
            "--lora" => {
                let (n, d) = v.split_once('=').unwrap_or_else(|| fail(&format!("--lora {v}: expected NAME=DIR")));
                adapters.push((n.to_string(), PathBuf::from(d)));
            }
            other => fail(&format!("unknown option {other}")),
        }
    }
    if !dir.join("config.json").exists() {
        fail(&format!(
            "{} has no config.json (train a model first: cargo run --release --example train_llama)",
            dir.display()
        ));
    }
    cfg.kv_cache_bytes = kv_mb << 20;
    if let Some(d) = draft {
        let model = Box::new(LlamaForCausalLM::from_pretrained(&d, dtype, Device::Cpu)?);
        cfg.speculative = Some(Speculation::Draft { model, k: draft_k });
    }
    let state = ServerState::from_dir_with_adapters(&dir, dtype, cfg, name, &adapters).map_err(|e| e.to_string())?;
    let stats = state.engine.metrics().engine;
    eprintln!(
        "serve: {} from {}; KV cache {} blocks; context {} tokens; chat template {}",
        state.model_name,
        dir.display(),
        stats.kv_blocks_total,
        state.engine.max_context(),
        if state.chat.from_model { "from the model" } else { "plain (the model has none)" }
    );
    for (n, d) in &adapters {
        eprintln!("serve: LoRA adapter {n} from {}", d.display());
    }
    let loopback = host.parse::<std::net::IpAddr>().is_ok_and(|a| a.is_loopback()) || host == "localhost";
    if !loopback && limits.api_key.is_none() {
        eprintln!("serve: warning: listening on {host} without --api-key: anyone who reaches it can use it");
    }
    let mut state = state;
    state.limits = limits.clone();
    let state = Arc::new(state);
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind((host.as_str(), port)).await?;
        println!("listening on http://{}", listener.local_addr()?);
        use std::io::Write;
        std::io::stdout().flush()?;
        serve(listener, router(state), &limits).await
    })?;
    Ok(())
}
