//! `kv-cache`: what a narrower KV cache costs in accuracy and saves in
//! memory (Note [KV cache dtypes] in kiln-tensor), for checkpoints on disk.
//!
//! For each checkpoint a prompt of random tokens fills its context up to
//! `--new-tokens` from the end; the model then decodes greedily over its own
//! dtype's cache, and the same tokens are fed again (teacher forcing)
//! through incremental decoding over each narrower cache. At every decoded
//! position the logits are compared with the reference cache's: the largest
//! difference relative to the largest logit, the mean KL divergence of the
//! next-token distributions, and how often the top token agrees. The bytes
//! per token are the cache's over all layers, keys and values.
use crate::report::{sig4, Line};
use kiln::nn::data::SeededRng;
use kiln::nn::layers::row_bytes;
use kiln::nn::models::LlamaForCausalLM;
use kiln::prelude::*;
use std::path::PathBuf;

/// Options of `kv-cache`.
pub struct KvCacheArgs {
    pub checkpoints: Vec<PathBuf>,
    pub new_tokens: usize,
    pub seed: u64,
}

/// The logits `[vocab]` (float32) at each position from the prompt's last
/// on, feeding `tokens` one at a time after the prompt.
fn logits_along(m: &LlamaForCausalLM, prompt: &[i64], tokens: &[i64], kv: Option<DType>) -> Result<Vec<Vec<f32>>> {
    let _g = kiln::autograd::no_grad();
    let cap = prompt.len() + tokens.len();
    let mut cache = match kv {
        Some(dt) => m.new_cache_with_dtype(cap, dt)?,
        None => m.new_cache(cap),
    };
    let row = |t: Tensor| -> Result<Vec<f32>> { t.to_dtype(DType::F32)?.to_vec::<f32>() };
    let p = Tensor::from_vec(prompt.to_vec(), &[1, prompt.len()])?;
    let mut out = vec![row(m.forward_cached(&p, None, &mut cache, true)?)?];
    for &t in tokens {
        out.push(row(m.forward_cached(&Tensor::from_vec(vec![t], &[1, 1])?, None, &mut cache, true)?)?);
    }
    Ok(out)
}

fn argmax(v: &[f32]) -> usize {
    v.iter().enumerate().fold(0, |b, (i, x)| if *x > v[b] { i } else { b })
}

fn log_softmax(v: &[f32]) -> Vec<f64> {
    let m = v.iter().fold(f32::NEG_INFINITY, |a, &x| a.max(x)) as f64;
    let lse = m + v.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
    v.iter().map(|&x| x as f64 - lse).collect()
}

/// One line per checkpoint and cache dtype.
pub fn kv_cache(a: &KvCacheArgs) -> Result<()> {
    for dir in &a.checkpoints {
        let m = LlamaForCausalLM::from_pretrained(dir, DType::F32, Device::Cpu)?;
        for model_dtype in [DType::F32, DType::BF16] {
            let mut m = m.clone();
            if model_dtype != DType::F32 {
                kiln::nn::Module::to_dtype(&mut m, model_dtype)?;
            }
            one_model(a, dir, &m)?;
        }
    }
    Ok(())
}

fn one_model(a: &KvCacheArgs, dir: &std::path::Path, m: &LlamaForCausalLM) -> Result<()> {
    let c = m.config();
    let ctx = c.max_position_embeddings;
    if a.new_tokens + 1 >= ctx {
        return Err(Error::invalid("kv-cache", format!("--new-tokens {} leaves no prompt in {ctx}", a.new_tokens)));
    }
    let mut rng = SeededRng::new(a.seed);
    let prompt: Vec<i64> = (0..ctx - a.new_tokens).map(|_| rng.below(c.vocab_size as u64) as i64).collect();
    // The reference: greedy tokens over the model's own cache.
    let mut tokens = vec![];
    let reference = {
        let mut cache = m.new_cache(ctx);
        let _g = kiln::autograd::no_grad();
        let p = Tensor::from_vec(prompt.clone(), &[1, prompt.len()])?;
        let mut l = m.forward_cached(&p, None, &mut cache, true)?.to_dtype(DType::F32)?.to_vec::<f32>()?;
        for _ in 0..a.new_tokens {
            tokens.push(argmax(&l) as i64);
            let t = Tensor::from_vec(vec![*tokens.last().unwrap()], &[1, 1])?;
            l = m.forward_cached(&t, None, &mut cache, true)?.to_dtype(DType::F32)?.to_vec::<f32>()?;
        }
        logits_along(m, &prompt, &tokens, None)?
    };
    let per_token = |kv: DType| 2 * c.num_hidden_layers * c.num_key_value_heads * row_bytes(kv, c.head_dim);
    let narrower: Vec<DType> = [DType::BF16, DType::F16, DType::F8E4M3FN]
        .into_iter()
        .filter(|&kv| kv != m.dtype() && kiln::nn::layers::check_kv_dtype(m.dtype(), kv).is_ok())
        .collect();
    for kv in narrower {
        let got = logits_along(m, &prompt, &tokens, Some(kv))?;
        let (mut worst, mut kl, mut agree) = (0f64, 0f64, 0usize);
        for (g, r) in got.iter().zip(&reference) {
            let largest = r.iter().fold(0f32, |x, v| x.max(v.abs())) as f64;
            let d = g.iter().zip(r).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max) as f64;
            worst = worst.max(d / largest);
            let (lg, lr) = (log_softmax(g), log_softmax(r));
            kl += lr.iter().zip(&lg).map(|(p, q)| p.exp() * (p - q)).sum::<f64>();
            agree += usize::from(argmax(g) == argmax(r));
        }
        let n = got.len();
        Line::new("kv-cache", &m.dtype().to_string(), "cpu")
            .set("checkpoint", dir.display().to_string())
            .set("kv_cache_dtype", kv.to_string())
            .set("context", ctx)
            .set("positions_compared", n)
            .set("bytes_per_token", per_token(kv))
            .set("bytes_per_token_model_dtype", per_token(m.dtype()))
            .set("memory_ratio", sig4(per_token(kv) as f64 / per_token(m.dtype()) as f64))
            .set("max_logit_diff_rel", sig4(worst))
            .set("mean_kl", sig4(kl / n as f64))
            .set("top1_agreement", sig4(agree as f64 / n as f64))
            .emit();
    }
    Ok(())
}
