//! `serve-load`: the serving engine under a stream of requests, against the
//! same requests through `generate()` one at a time (Note [Serve load]).
use crate::llm::preset;
use crate::report::{sig4, Line};
use kiln::nn::data::SeededRng;
use kiln::nn::generate::{generate, Sampling};
use kiln::nn::models::LlamaForCausalLM;
use kiln::nn::serve::{Engine, EngineConfig, Event};
use kiln::prelude::*;
use serde_json::json;
use std::collections::HashMap;
use std::time::{Duration, Instant};

// Note [Serve load]
// ~~~~~~~~~~~~~~~~~
// A workload is `requests` prompts of 16 to 512 random tokens, each asking
// for 16 to 256 new tokens (greedy, no end token, so every request runs to
// its length), arriving with exponential gaps of mean `gap_ms` (a Poisson
// stream). With `shared_prefix`, every prompt is the same 256-token system
// prompt followed by 16 to 256 tokens of its own. Throughput is the generated
// tokens over the makespan (the first arrival to the last token); the time to
// first token (TTFT) of a request runs from its arrival to its first token.
// The one-at-a-time baseline serves the requests in arrival order through
// `generate()`; its TTFT is the request's wait plus its own prefill and first
// token, measured by a separate `generate()` of one token.
//
// The machines are shared and their memory bandwidth, which bounds both the
// engine and `generate()`, changes from one minute to the next. Each system
// therefore runs `repeat` times, the systems taking turns (engine, one at a
// time, the shared-prompt pair, then again), and the line of a system is its
// run of median throughput, with every run's throughput beside it; ratios
// are of the medians.

/// One request of a workload.
#[derive(Debug, Clone)]
pub struct Req {
    pub prompt: Vec<i64>,
    pub max_new: usize,
    pub arrival: f64,
}

/// The workload of Note [Serve load].
pub fn workload(n: usize, vocab: usize, seed: u64, gap_ms: f64, shared_prefix: Option<usize>) -> Vec<Req> {
    let mut rng = SeededRng::new(seed);
    let mut uniform = |lo: usize, hi: usize| lo + rng.below((hi - lo + 1) as u64) as usize;
    let system: Vec<i64> = (0..shared_prefix.unwrap_or(0)).map(|_| uniform(1, vocab - 1) as i64).collect();
    let mut t = 0.0;
    (0..n)
        .map(|i| {
            let own = if shared_prefix.is_some() { uniform(16, 256) } else { uniform(16, 512) };
            let mut prompt = system.clone();
            prompt.extend((0..own).map(|_| uniform(1, vocab - 1) as i64));
            let max_new = uniform(16, 256);
            if i > 0 {
                let u = (uniform(1, 1_000_000) as f64) / 1_000_001.0;
                t += -(1.0 - u).ln() * gap_ms / 1e3;
            }
            Req { prompt, max_new, arrival: t }
        })
        .collect()
}

/// Throughput and TTFT quantiles of one run.
struct Outcome {
    tokens: usize,
    makespan: f64,
    ttft: Vec<f64>,
}

impl Outcome {
    fn tokens_per_s(&self) -> f64 {
        self.tokens as f64 / self.makespan
    }

    fn line(mut self, name: &str, extra: &[(&str, serde_json::Value)]) -> Line {
        self.ttft.sort_by(f64::total_cmp);
        let q = |p: f64| self.ttft[((self.ttft.len() - 1) as f64 * p).round() as usize];
        let mut l = Line::new("serve-load", "float32", "cpu")
            .set("system", name)
            .set("requests", self.ttft.len())
            .set("generated_tokens", self.tokens)
            .set("makespan_s", sig4(self.makespan))
            .set("tokens_per_s", sig4(self.tokens_per_s()))
            .set("ttft_p50_ms", sig4(q(0.5) * 1e3))
            .set("ttft_p99_ms", sig4(q(0.99) * 1e3));
        for (k, v) in extra {
            l = l.set(k, v.clone());
        }
        l
    }
}

fn sleep_until(t0: Instant, at: f64) {
    let now = t0.elapsed().as_secs_f64();
    if at > now {
        std::thread::sleep(Duration::from_secs_f64(at - now));
    }
}

/// The requests through the engine as they arrive.
/// With `adapters`, request `i` is served by adapter `i % (n + 1) - 1` (the
/// base model for 0): each adapter and the base get an equal share.
fn engine_run(
    model: &LlamaForCausalLM,
    reqs: &[Req],
    cfg: EngineConfig,
    adapters: &[std::path::PathBuf],
    grammar: Option<&kiln::nn::serve::Grammar>,
) -> Result<(Outcome, u64)> {
    let mut engine = Engine::new(model.clone(), cfg)?;
    for (i, d) in adapters.iter().enumerate() {
        engine.load_adapter(&format!("lora{i}"), d)?;
    }
    // Warm the allocator and kernels with one small request.
    engine.add_request(kiln::nn::serve::Request::new(vec![1; 32], 4))?;
    while engine.has_work() {
        engine.step();
    }
    let base_hits = engine.stats().prefix_hit_tokens;
    let t0 = Instant::now();
    let (mut next, mut first) = (0, HashMap::new());
    let mut idx: HashMap<u64, usize> = HashMap::new();
    let (mut tokens, mut last) = (0, 0.0);
    while next < reqs.len() || engine.has_work() {
        if !engine.has_work() {
            sleep_until(t0, reqs[next].arrival);
        }
        let now = t0.elapsed().as_secs_f64();
        while next < reqs.len() && reqs[next].arrival <= now {
            let mut r = kiln::nn::serve::Request::new(reqs[next].prompt.clone(), reqs[next].max_new);
            if let Some(a) = (next % (adapters.len() + 1)).checked_sub(1) {
                r = r.with_adapter(&format!("lora{a}"));
            }
            if let Some(g) = grammar {
                r = r.with_grammar(g.clone());
            }
            let id = engine.add_request(r)?;
            idx.insert(id, next);
            next += 1;
        }
        for o in engine.step() {
            let t = t0.elapsed().as_secs_f64();
            match o.event {
                Event::Token(..) => {
                    tokens += 1;
                    first.entry(o.id).or_insert(t);
                    last = t;
                }
                Event::Finished(kiln::nn::serve::FinishReason::Length) => {}
                Event::Finished(f) => return Err(Error::invalid("serve-load", format!("request ended with {f:?}"))),
            }
        }
    }
    let ttft = idx.iter().map(|(id, &i)| first[id] - reqs[i].arrival).collect();
    if kiln::tensor::profile::enabled() {
        // KILN_PROFILE=1: where the engine's time went, by op.
        eprintln!("engine steps: {}\n{}", engine.stats().steps, kiln::tensor::profile::report(25));
    }
    Ok((Outcome { tokens, makespan: last, ttft }, engine.stats().prefix_hit_tokens - base_hits))
}

/// The requests through `generate()`, one at a time in arrival order.
fn sequential_run(model: &LlamaForCausalLM, reqs: &[Req]) -> Result<Outcome> {
    let ids = |r: &Req| Tensor::from_vec(r.prompt.clone(), &[1, r.prompt.len()]);
    // Each request's own time to its first token.
    let mut alone = vec![];
    generate(model, &ids(&reqs[0])?, 1, &Sampling::greedy())?;
    for r in reqs {
        let t = Instant::now();
        generate(model, &ids(r)?, 1, &Sampling::greedy())?.to_vec::<i64>()?;
        alone.push(t.elapsed().as_secs_f64());
    }
    let t0 = Instant::now();
    let (mut tokens, mut ttft) = (0, vec![]);
    for (r, a) in reqs.iter().zip(&alone) {
        sleep_until(t0, r.arrival);
        let start = t0.elapsed().as_secs_f64();
        let out = generate(model, &ids(r)?, r.max_new, &Sampling::greedy())?;
        tokens += out.shape()[1] - r.prompt.len();
        ttft.push(start - r.arrival + a);
    }
    Ok(Outcome { tokens, makespan: t0.elapsed().as_secs_f64(), ttft })
}

/// `n` random rank-`r` adapters on every decoder Linear of `model` (B drawn
/// too, so they change the outputs), saved in PEFT's format under the temp dir.
fn lora_adapters(model: &LlamaForCausalLM, n: usize, r: usize) -> Result<Vec<std::path::PathBuf>> {
    use kiln::nn::lora::{inject_adapter, save_adapter, LoraConfig, LoraInit, TargetModules};
    let root = std::env::temp_dir().join(format!("kiln-bench-lora-{}", std::process::id()));
    (0..n)
        .map(|i| {
            let mut m = model.clone();
            let mut c = LoraConfig::new(r, TargetModules::AllLinear);
            c.init_lora_weights = LoraInit::Random;
            kiln::manual_seed(100 + i as u64);
            inject_adapter(&mut m, &c)?;
            let dir = root.join(format!("lora{i}"));
            save_adapter(&dir, &m, &c)?;
            Ok(dir)
        })
        .collect()
}

/// Options of `serve-load`.
pub struct ServeLoadArgs {
    pub preset: String,
    pub requests: usize,
    pub gap_ms: f64,
    pub seed: u64,
    pub kv_mb: usize,
    pub only: Vec<String>,
    pub write_workload: Option<String>,
    /// Runs per system (Note [Serve load]).
    pub repeat: usize,
}

/// Runs the workloads and emits one line per system, then the ratios.
pub fn serve_load(a: &ServeLoadArgs) -> Result<()> {
    let cfg = preset(&a.preset).map_err(|e| Error::invalid("kiln-bench", e))?;
    let model = LlamaForCausalLM::new(&cfg, DType::F32)?;
    let plain = workload(a.requests, cfg.vocab_size, a.seed, a.gap_ms, None);
    let shared = workload(a.requests, cfg.vocab_size, a.seed + 1, a.gap_ms, Some(256));
    if let Some(path) = &a.write_workload {
        let w = |reqs: &[Req]| -> serde_json::Value {
            reqs.iter()
                .map(|r| json!({"prompt": r.prompt, "max_new_tokens": r.max_new, "arrival": r.arrival}))
                .collect()
        };
        let body = json!({"config": cfg.to_json(DType::F32), "plain": w(&plain), "shared": w(&shared)});
        std::fs::write(path, body.to_string()).map_err(|e| Error::invalid("kiln-bench", format!("{path}: {e}")))?;
    }
    let want = |name: &str| a.only.is_empty() || a.only.iter().any(|o| o == name);
    let ecfg =
        |sharing: bool| EngineConfig { kv_cache_bytes: a.kv_mb << 20, prefix_sharing: sharing, ..Default::default() };
    // Every run of every system, in turns (Note [Serve load]).
    type Extra = Vec<(&'static str, serde_json::Value)>;
    let mut runs: Vec<(&str, Vec<(Outcome, Extra)>)> = vec![];
    let mut record = |name: &'static str, o: Outcome, extra: Extra| match runs.iter_mut().find(|(n, _)| *n == name) {
        Some((_, v)) => v.push((o, extra)),
        None => runs.push((name, vec![(o, extra)])),
    };
    // `adapters`: four rank-16 LoRA adapters on every decoder Linear, served
    // beside the base model (Note [Serving adapters]).
    let adapter_dirs = if want("adapters") { lora_adapters(&model, 4, 16)? } else { vec![] };
    for _ in 0..a.repeat.max(1) {
        if want("engine") {
            let (o, _) = engine_run(&model, &plain, ecfg(true), &[], None)?;
            record("engine", o, vec![("workload", json!("plain"))]);
        }
        if want("structured") {
            // Every request constrained by a grammar that never completes
            // (so each runs to its length, as the plain ones do): the cost of
            // computing and applying a mask per token (Note [Constrained decoding]).
            let codec = std::sync::Arc::new(kiln::nn::serve::openai::Codec::Bytes);
            let compiler = kiln::nn::serve::structured::LlgCompiler::new(codec, cfg.vocab_size, &[])?;
            let c = EngineConfig { grammars: Some(std::sync::Arc::new(compiler)), ..ecfg(true) };
            let g = kiln::nn::serve::Grammar::Regex("[a-z ,.]+".into());
            let (o, _) = engine_run(&model, &plain, c, &[], Some(&g))?;
            record("engine-structured", o, vec![("workload", json!("plain")), ("grammar", json!("regex [a-z ,.]+"))]);
        }
        // The plain workload over narrower KV caches (Note [KV cache dtypes] in kiln-tensor).
        for (only, name, kv) in
            [("kv-bf16", "engine-kv-bf16", DType::BF16), ("kv-fp8", "engine-kv-fp8", DType::F8E4M3FN)]
        {
            if want(only) {
                let c = EngineConfig { kv_cache_dtype: Some(kv), ..ecfg(true) };
                let (o, _) = engine_run(&model, &plain, c, &[], None)?;
                record(name, o, vec![("workload", json!("plain")), ("kv_cache_dtype", json!(kv.to_string()))]);
            }
        }
        if want("adapters") {
            let (o, _) = engine_run(&model, &plain, ecfg(true), &adapter_dirs, None)?;
            let extra =
                vec![("workload", json!("plain")), ("adapters", json!(adapter_dirs.len())), ("lora_r", json!(16))];
            record("engine-lora", o, extra);
        }
        if want("sequential") {
            record("sequential", sequential_run(&model, &plain)?, vec![("workload", json!("plain"))]);
        }
        if want("shared") {
            for sharing in [true, false] {
                let (o, hits) = engine_run(&model, &shared, ecfg(sharing), &[], None)?;
                let name = if sharing { "engine-prefix-sharing" } else { "engine-no-prefix-sharing" };
                record(name, o, vec![("workload", json!("shared-256")), ("prefix_hit_tokens", json!(hits))]);
            }
        }
    }
    let mut tps = HashMap::new();
    for (name, mut v) in runs {
        v.sort_by(|x, y| x.0.tokens_per_s().total_cmp(&y.0.tokens_per_s()));
        let all: Vec<f64> = v.iter().map(|(o, _)| sig4(o.tokens_per_s())).collect();
        let (o, mut extra) = v.swap_remove(v.len() / 2);
        tps.insert(name.to_string(), o.tokens_per_s());
        extra.push(("runs_tokens_per_s", json!(all)));
        o.line(name, &extra).emit();
    }
    let ratio = |a: &str, b: &str| match (tps.get(a), tps.get(b)) {
        (Some(x), Some(y)) => Some(sig4(x / y)),
        _ => None,
    };
    let mut l = Line::new("serve-load-ratios", "float32", "cpu");
    if let Some(r) = ratio("engine", "sequential") {
        l = l.set("engine_vs_sequential", r);
    }
    if let Some(r) = ratio("engine-prefix-sharing", "engine-no-prefix-sharing") {
        l = l.set("prefix_sharing_vs_none", r);
    }
    if let Some(r) = ratio("engine-lora", "engine") {
        l = l.set("lora_adapters_vs_base", r);
    }
    if let Some(r) = ratio("engine-structured", "engine") {
        l = l.set("structured_vs_plain", r);
    }
    for (name, key) in [("engine-kv-bf16", "kv_bf16_vs_f32"), ("engine-kv-fp8", "kv_fp8_vs_f32")] {
        if let Some(r) = ratio(name, "engine") {
            l = l.set(key, r);
        }
    }
    let keys = ["engine_vs_sequential", "prefix_sharing_vs_none", "lora_adapters_vs_base", "structured_vs_plain"];
    if keys.iter().chain(&["kv_bf16_vs_f32", "kv_fp8_vs_f32"]).any(|k| l.has(k)) {
        l.emit();
    }
    Ok(())
}
