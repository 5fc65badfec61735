//! Converts a Hugging Face Llama or Qwen3 checkpoint into a GGUF file that
//! llama.cpp runs (and kiln reads back with `LlamaForCausalLM::from_gguf`):
//! the matrices as `--type`, the norms in F32, the directory's
//! `tokenizer.json` (a byte-level BPE) as `tokenizer.ggml.*` when present.
//!
//! ```sh
//! cargo run --release --example to_gguf -- HF_DIR OUT.gguf [--type f32|f16|bf16|q8_0|q4_0]
//! ```
use kiln::nn::io::gguf::{tokenizer_metadata, GgmlType};
use kiln::nn::models::LlamaForCausalLM;
use kiln::prelude::*;
use std::path::PathBuf;

const USAGE: &str = "usage: to_gguf HF_DIR OUT.gguf [--type f32|f16|bf16|q8_0|q4_0]  (default f16)";

fn main() {
    let mut positional = vec![];
    let mut ty = GgmlType::F16;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--type" => {
                let v = args.next().unwrap_or_default();
                ty = match GgmlType::from_name(&v).filter(|t| t.writable()) {
                    Some(t) => t,
                    None => fail(&format!("--type {v:?}: one of f32, f16, bf16, q8_0, q4_0")),
                };
            }
            "-h" | "--help" => {
                println!("{USAGE}");
                return;
            }
            _ => positional.push(PathBuf::from(a)),
        }
    }
    let [dir, out] = positional.as_slice() else { fail(USAGE) };
    if let Err(e) = convert(dir, out, ty) {
        fail(&e.to_string());
    }
}

fn convert(dir: &PathBuf, out: &PathBuf, ty: GgmlType) -> Result<()> {
    let model = LlamaForCausalLM::from_pretrained(dir, DType::F32, Device::Cpu)?;
    let tok = dir.join("tokenizer.json");
    let metadata = if tok.is_file() {
        let text =
            std::fs::read_to_string(&tok).map_err(|e| Error::invalid("to_gguf", format!("{}: {e}", tok.display())))?;
        let json =
            serde_json::from_str(&text).map_err(|e| Error::invalid("to_gguf", format!("{}: {e}", tok.display())))?;
        tokenizer_metadata(&json)?
    } else {
        vec![]
    };
    model.save_gguf(out, ty, &metadata)?;
    println!("wrote {} ({ty} matrices{})", out.display(), if metadata.is_empty() { ", no tokenizer" } else { "" });
    Ok(())
}

fn fail(msg: &str) -> ! {
    eprintln!("to_gguf: {msg}");
    std::process::exit(2)
}
