//! `spec-decode`: speculative decoding (Note [Speculative decoding] in
//! kiln-nn) on a checkpoint, against decoding one token per step.
//!
//! The prompts are `--requests` windows of `--prompt` bytes of a text file
//! (`--data`; byte-level checkpoints, such as `train_llama` writes for a
//! text file, read bytes as tokens), each continued by `--new-tokens`
//! tokens, greedy and then sampled (temperature 0.8, seeded). Each system
//! serves the requests one at a time (the latency a single user sees) and
//! then all at once (throughput under continuous batching): without
//! speculation, with prompt lookup (`k`, suffixes of 1 to 3 tokens) and,
//! given `--draft`, with the draft checkpoint (`k`). Lines: tokens_per_s,
//! acceptance rate, tokens per verifying step, and the speedup over the
//! same mode without speculation.
use crate::report::{sig4, Line};
use kiln::nn::data::SeededRng;
use kiln::nn::generate::Sampling;
use kiln::nn::models::LlamaForCausalLM;
use kiln::nn::serve::{Engine, EngineConfig, Request, Speculation};
use kiln::prelude::*;
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Instant;

/// Options of `spec-decode`.
pub struct SpecArgs {
    pub target: PathBuf,
    pub draft: Option<PathBuf>,
    pub data: PathBuf,
    pub requests: usize,
    pub prompt: usize,
    pub new_tokens: usize,
    pub k: usize,
    pub seed: u64,
}

/// Runs `reqs` (all at once, or each alone after the previous one ended):
/// generated tokens, seconds, and the engine's counters.
fn run(
    model: &LlamaForCausalLM,
    spec: Option<Speculation>,
    reqs: &[Request],
    batched: bool,
) -> Result<(usize, f64, kiln::nn::serve::EngineStats)> {
    let mut engine = Engine::new(model.clone(), EngineConfig { speculative: spec, ..Default::default() })?;
    // Warm the kernels and the allocator with one small request.
    engine.add_request(Request::new(reqs[0].prompt[..8.min(reqs[0].prompt.len())].to_vec(), 4))?;
    while engine.has_work() {
        engine.step();
    }
    let before = engine.stats();
    let t0 = Instant::now();
    let groups: Vec<&[Request]> = if batched { vec![reqs] } else { reqs.chunks(1).collect() };
    for g in groups {
        for r in g {
            engine.add_request(r.clone())?;
        }
        while engine.has_work() {
            engine.step();
        }
    }
    let secs = t0.elapsed().as_secs_f64();
    let st = engine.stats();
    let mut d = st.clone();
    d.spec_proposed_tokens -= before.spec_proposed_tokens;
    d.spec_accepted_tokens -= before.spec_accepted_tokens;
    d.spec_verifications -= before.spec_verifications;
    d.spec_emitted_tokens -= before.spec_emitted_tokens;
    Ok(((st.generated_tokens - before.generated_tokens) as usize, secs, d))
}

/// One line per system, sampling and mode.
pub fn spec_decode(a: &SpecArgs) -> Result<()> {
    let model = LlamaForCausalLM::from_pretrained(&a.target, DType::F32, Device::Cpu)?;
    let text =
        std::fs::read(&a.data).map_err(|e| Error::invalid("spec-decode", format!("{}: {e}", a.data.display())))?;
    if text.len() <= a.prompt {
        return Err(Error::invalid("spec-decode", "the data file is shorter than one prompt"));
    }
    let mut rng = SeededRng::new(a.seed);
    let starts: Vec<usize> = (0..a.requests).map(|_| rng.below((text.len() - a.prompt) as u64) as usize).collect();
    let prompts: Vec<Vec<i64>> =
        starts.iter().map(|&s| text[s..s + a.prompt].iter().map(|&b| b as i64).collect()).collect();
    let mut systems: Vec<(&str, Option<Speculation>)> =
        vec![("plain", None), ("ngram", Some(Speculation::NGram { k: a.k, n_min: 1, n_max: 3 }))];
    if let Some(d) = &a.draft {
        let draft = LlamaForCausalLM::from_pretrained(d, DType::F32, Device::Cpu)?;
        systems.push(("draft", Some(Speculation::Draft { model: Box::new(draft), k: a.k })));
    }
    for (sampling_name, sampling) in [("greedy", None), ("sampled", Some(0.8))] {
        let reqs: Vec<Request> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let r = Request::new(p.clone(), a.new_tokens);
                match sampling {
                    Some(t) => r.with_sampling(Sampling::sample(t).with_seed(a.seed + i as u64)),
                    None => r,
                }
            })
            .collect();
        for batched in [false, true] {
            let mode = if batched { "batched" } else { "one-at-a-time" };
            let mut base = HashMap::new();
            for (name, spec) in &systems {
                let (tokens, secs, st) = run(&model, spec.clone(), &reqs, batched)?;
                let tps = tokens as f64 / secs;
                if spec.is_none() {
                    base.insert(mode, tps);
                }
                let mut l = Line::new("spec-decode", "float32", "cpu")
                    .set("system", *name)
                    .set("sampling", sampling_name)
                    .set("mode", mode)
                    .set("requests", reqs.len())
                    .set("generated_tokens", tokens)
                    .set("tokens_per_s", sig4(tps))
                    .set("speedup", sig4(tps / base[mode]));
                if spec.is_some() {
                    l = l
                        .set("k", a.k)
                        .set("acceptance_rate", sig4(st.spec_acceptance_rate().unwrap_or(0.0)))
                        .set("tokens_per_verifying_step", sig4(st.spec_tokens_per_step().unwrap_or(0.0)));
                }
                l.emit();
            }
        }
    }
    Ok(())
}
