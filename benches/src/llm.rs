//! Model-level benchmarks: `train` (a full AdamW step of a small Llama), `infer`
//! (its forward pass), `decode` (greedy decoding with the KV cache), and
//! `autograd` (backward / forward time of a matmul-heavy graph).
//!
//! `benches/compare_torch_train.py` runs the same steps in PyTorch. Each
//! benchmark prints one JSON line (its last line is the result); `peak_rss_mb`
//! is the process's peak resident memory (`VmHWM`) when the line is printed.
use crate::finetune::Finetune;
use crate::report::{sig4, Line};
use crate::timing::median;
use kiln::autograd::no_grad;
use kiln::nn::models::{causal_lm_loss, PretrainedOptions, QuantizedLoad};
use kiln::nn::optim::{AdamW, AdamWConfig, Optimizer};
use kiln::nn::{LlamaConfig, LlamaForCausalLM, Module};
use kiln::prelude::*;
use kiln::tensor::on_compute_threads;
use kiln::tensor::quant::Activations;
use serde_json::json;
use std::collections::HashMap;
use std::time::Instant;

/// What the model benchmarks run.
#[derive(Debug, Clone)]
pub struct LlmArgs {
    pub device: Device,
    pub preset: String,
    pub batch: usize,
    pub seq: usize,
    /// Timed steps (after `warmup` untimed ones).
    pub steps: usize,
    pub warmup: usize,
    pub prompt: usize,
    pub new_tokens: usize,
    /// `decode` only: `f32`, `bf16`, or a kept-quantized scheme (`fp8`, `nvfp4`, ...).
    pub weights: String,
    /// `decode` only: what the kept-quantized weights' products do to their
    /// input (Note [Int8 activations]).
    pub activations: Activations,
    /// `train` only: `f32`, or `bf16-mixed` / `f16-mixed` (see `MixedPrecisionPolicy`).
    pub precision: String,
    /// `train` only: the step captured by `kiln::compile` (capturable AdamW).
    pub compiled: bool,
    /// `train` only: a mesh spec (`dp=4`) and a recipe (`fsdp`), see `kiln::nn::parallel`.
    pub parallel: Option<(String, String)>,
    /// `train` only: full fine-tuning, LoRA or QLoRA (`crate::finetune`).
    pub finetune: Finetune,
}

/// The model presets, as Hugging Face `config.json` values.
pub fn preset(name: &str) -> std::result::Result<LlamaConfig, String> {
    let v = match name {
        // 16M-ish parameters besides the embeddings: the reference model.
        "llama-16m" => json!({
            "model_type": "llama", "vocab_size": 8192, "hidden_size": 384, "intermediate_size": 1024,
            "num_hidden_layers": 6, "num_attention_heads": 6, "num_key_value_heads": 6,
            "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "hidden_act": "silu", "initializer_range": 0.02, "tie_word_embeddings": false,
        }),
        // llama-16m's shape as Qwen3-MoE: 8 experts, 2 per token, each half
        // llama-16m's MLP width, so a token's active parameters match it (plus
        // Qwen3's q/k norms and the router).
        "qwen3-moe-16m" => json!({
            "model_type": "qwen3_moe", "vocab_size": 8192, "hidden_size": 384, "intermediate_size": 1024,
            "num_hidden_layers": 6, "num_attention_heads": 6, "num_key_value_heads": 6, "head_dim": 64,
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 512, "norm_topk_prob": true,
            "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "hidden_act": "silu", "initializer_range": 0.02, "tie_word_embeddings": false,
        }),
        // Qwen3-0.6B's shapes with random weights: its decoder's f32 weights
        // (about 1.8 GB besides the tied 0.6 GB embedding) are many times a CPU's
        // L3, so decoding it is bound by memory bandwidth.
        "qwen3-0.6b" => json!({
            "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
            "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
            "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "hidden_act": "silu", "initializer_range": 0.02, "tie_word_embeddings": true,
        }),
        // A tiny model for smoke runs and tests.
        "llama-tiny" => json!({
            "model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "hidden_act": "silu", "initializer_range": 0.02, "tie_word_embeddings": false,
        }),
        other => {
            return Err(format!(
                "unknown preset {other:?} (expected llama-16m, qwen3-moe-16m, qwen3-0.6b or llama-tiny)"
            ))
        }
    };
    LlamaConfig::from_json(&v).map_err(|e| e.to_string())
}

/// Peak resident memory of this process in MiB (Linux `VmHWM`; NaN elsewhere).
pub fn peak_rss_mb() -> f64 {
    proc_status_mb("VmHWM:")
}

/// A memory line of `/proc/self/status` (`VmHWM:`, `VmRSS:`) in MiB; NaN
/// where there is none.
pub fn proc_status_mb(field: &str) -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|kb| kb.parse::<f64>().ok()))
        })
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

fn line(bench: &str, a: &LlmArgs) -> Line {
    // How the ops ran: captured, the PJRT backend's mode, or one by one on the CPU.
    let mode = match (a.compiled, a.device, &a.parallel) {
        (true, ..) => "compiled",
        (false, Device::Tpu(_) | Device::Mesh(_), _) | (false, _, Some(_)) => kiln::tpu::mode().name(),
        (false, _, None) => "eager",
    };
    Line::new(bench, "float32", &a.device.to_string()).set("preset", a.preset.as_str()).set("mode", mode)
}

/// Random token ids `[b, t]` in `[0, vocab)`, from the global generator.
pub fn random_ids(b: usize, t: usize, vocab: usize, device: Device) -> Result<Tensor> {
    Tensor::randint(0, vocab as i64, &[b, t], (DType::I64, device))
}

/// Runs `f` `warmup` times untimed and `steps` times timed; seconds per timed call, sorted.
fn time_steps(warmup: usize, steps: usize, mut f: impl FnMut() -> Result<()>) -> Result<Vec<f64>> {
    for _ in 0..warmup {
        f()?;
    }
    let mut t = Vec::with_capacity(steps);
    for _ in 0..steps.max(1) {
        let t0 = Instant::now();
        f()?;
        t.push(t0.elapsed().as_secs_f64());
    }
    t.sort_by(f64::total_cmp);
    Ok(t)
}

/// `train`: zero_grad + forward + backward + AdamW step + reading the loss.
pub fn train(a: &LlmArgs) -> Result<Line> {
    let cfg = preset(&a.preset).map_err(|e| Error::invalid("kiln-bench", e))?;
    if let Some((spec, _)) = a.parallel.as_ref().filter(|(_, r)| r == "cp") {
        return train_context_parallel(a, &cfg, spec);
    }
    let recipe = match &a.parallel {
        Some((spec, r)) => {
            Some((kiln::nn::parallel::parse_mesh(spec, a.device.kind())?, kiln::nn::parallel::Recipe::parse(r)?))
        }
        None => None,
    };
    let device = recipe.as_ref().map_or(a.device, |(m, _)| m.device());
    let mut model = LlamaForCausalLM::new(&cfg, (DType::F32, device))?;
    // A mixture of experts trains with its experts stacked, as train_llama holds them.
    model.stack_experts()?;
    model.set_mixed_precision(kiln::nn::precision::MixedPrecisionPolicy::parse(&a.precision)?)?;
    if a.finetune != Finetune::Full && recipe.is_some() {
        return Err(Error::invalid("kiln-bench", "--finetune lora|qlora runs on one device"));
    }
    crate::finetune::prepare(&mut model, &a.finetune)?;
    if let Some((mesh, r)) = &recipe {
        r.apply(&mut model, mesh)?;
    }
    model.train(true);
    let adamw = AdamWConfig { lr: 1e-3, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1, amsgrad: false };
    let mut opt = AdamW::new(model.named_trainable_parameters(), adamw)?;
    opt.set_capturable(a.compiled)?;
    let ids = random_ids(a.batch, a.seq, cfg.vocab_size, Device::Cpu)?;
    let ids = match &recipe {
        Some((mesh, r)) => r.place_batch(&ids, mesh)?,
        None => ids.to_device(device)?,
    };
    let mut losses = vec![];
    if a.compiled {
        let a = LlmArgs { device, ..a.clone() };
        let l = train_compiled(&a, &model, &mut opt, std::slice::from_ref(&ids), |logits, xs| {
            causal_lm_loss(logits, &xs[0], None)
        })?;
        return match &recipe {
            Some((mesh, r)) => {
                let l = memory_line(l, &model, &opt, mesh, &format!("{r:?}"))?;
                collective_minimum(l, &model, &cfg, mesh, r, a.batch * a.seq, &a.precision)
            }
            None => crate::finetune::fields(l, &mut model, &a.finetune),
        };
    }
    // On a PJRT device: the executable cache's counters over the timed steps.
    let pjrt = a.device.kind() == kiln::DeviceKind::Tpu;
    let stats = |on: bool| if on { kiln::tpu::stats().ok() } else { None };
    let (mut calls, mut after_warmup) = (0usize, None);
    // The steps run on the compute threads, as a decoding loop does (Note
    // [Loops on the compute threads]): each op forks to threads still awake.
    let times = on_compute_threads(a.device, || {
        time_steps(a.warmup, a.steps, || {
            if calls == a.warmup {
                after_warmup = stats(pjrt);
                // The profile covers the timed steps (the first ones fault their memory in).
                kiln::tensor::profile::take();
            }
            calls += 1;
            opt.zero_grad();
            let logits = model.forward(&ids, None)?;
            let loss = causal_lm_loss(&logits, &ids, None)?;
            loss.backward()?;
            opt.step()?;
            losses.push(loss.item_f64()?);
            Ok(())
        })
    })?;
    if kiln::tensor::profile::enabled() {
        eprintln!("kernel time per op over the {} timed steps:\n{}", a.steps, kiln::tensor::profile::report(40));
    }
    let mut l = train_line(a, &times, &losses);
    if let (Some(s0), Some(s1)) = (after_warmup, stats(pjrt)) {
        let lookups = (s1.hits + s1.compiles) - (s0.hits + s0.compiles);
        let compiles = s1.compiles - s0.compiles;
        l = l
            .set("pjrt_programs_per_step", sig4((s1.executions - s0.executions) as f64 / a.steps as f64))
            .set("pjrt_compiles_timed_steps", compiles)
            .set("pjrt_compiles_total", s1.compiles)
            .set("pjrt_cache_hit_rate", sig4((lookups - compiles) as f64 / lookups.max(1) as f64))
            .set("pjrt_compile_s", sig4(s1.compile_secs))
            .set("pjrt_disk_hits", s1.disk_hits)
            .set("pjrt_disk_load_s", sig4(s1.load_secs));
    }
    crate::finetune::fields(l, &mut model, &a.finetune)
}

/// Per-device bytes of parameters, gradients and AdamW state of a model on a
/// mesh (the largest over devices), against the same model on one device.
fn memory_line(l: Line, model: &LlamaForCausalLM, opt: &AdamW, mesh: &kiln::DeviceMesh, recipe: &str) -> Result<Line> {
    let n = mesh.devices().len();
    let (mut per_device, mut whole) = (vec![0usize; n], 0usize);
    let mut add = |t: &Tensor| -> Result<()> {
        whole += t.numel() * t.dtype().size_in_bytes();
        for (i, s) in t.to_local()?.iter().enumerate() {
            per_device[i] += s.numel() * s.dtype().size_in_bytes();
        }
        Ok(())
    };
    for (name, p) in model.named_parameters() {
        add(&p)?;
        if let Some(g) = p.grad() {
            add(&g)?;
        }
        if let Some(st) = opt.state(&name) {
            add(&st.exp_avg)?;
            add(&st.exp_avg_sq)?;
        }
    }
    let worst = per_device.iter().copied().max().unwrap_or(0);
    Ok(l.set("mesh", mesh.to_string())
        .set("parallel", recipe)
        .set("state_mb_per_device", sig4(worst as f64 / (1 << 20) as f64))
        .set("state_mb_unsharded", sig4(whole as f64 / (1 << 20) as f64))
        .set("state_fraction_per_device", sig4(worst as f64 / whole.max(1) as f64)))
}

/// The collective bytes per device and step (results, as
/// `benches/collectives.py` counts them) that DDP's and FSDP's step cannot do
/// without, by kind:
/// - every gradient reduced once: all-reduced (DDP) or reduce-scattered to
///   its shard (FSDP), except the input embedding's, whose rows only the
///   step's tokens touch: its token gradients (`tokens x hidden`) and the
///   token ids are all-gathered and added into a whole table on each device
///   (fewer bytes than reducing a table of `vocab x hidden` whenever there
///   are fewer tokens than vocabulary rows, and the same lowering otherwise);
/// - FSDP gathers every parameter for the forward, and again for the backward
///   each matrix the backward reads (the weights are resharded after the
///   forward, FSDP2's default; the norms' gathered weights are small and kept).
/// - the loss's sum and the number of counted tokens are all-reduced (an f32
///   and an i64), with the two index checks' flags (the embedding's ids and
///   the targets in range: a bool each).
///
/// Other recipes print no minimum.
fn collective_minimum(
    l: Line,
    model: &LlamaForCausalLM,
    cfg: &LlamaConfig,
    mesh: &kiln::DeviceMesh,
    recipe: &kiln::nn::parallel::Recipe,
    tokens: usize,
    precision: &str,
) -> Result<Line> {
    use kiln::nn::parallel::Recipe;
    let (mut reduced, mut sharded, mut params, mut matrices) = (0usize, 0usize, 0usize, 0usize);
    for (name, p) in model.named_parameters() {
        let bytes = p.dtype().size_in_bytes();
        let whole = p.numel() * bytes;
        params += whole;
        let embedding = name.ends_with("embed_tokens.weight") && !cfg.tie_word_embeddings;
        if !embedding {
            reduced += whole;
            sharded += p.to_local()?.iter().map(|s| s.numel() * bytes).max().unwrap_or(0);
            if p.ndim() == 2 {
                matrices += whole;
            }
        }
    }
    // f32 token gradients and i64 ids (a mixed-precision step prints no minimum).
    let token_grads = tokens * (cfg.hidden_size * 4 + 8);
    let scalars = 4 + 8 + 2;
    if precision != "f32" {
        return Ok(l);
    }
    Ok(match recipe {
        Recipe::Ddp if mesh.ndim() == 1 => l
            .set("min_all_reduce_bytes", reduced + scalars)
            .set("min_reduce_scatter_bytes", 0)
            .set("min_all_gather_bytes", token_grads),
        Recipe::Fsdp if mesh.ndim() == 1 => l
            .set("min_all_reduce_bytes", scalars)
            .set("min_reduce_scatter_bytes", sharded)
            .set("min_all_gather_bytes", params + matrices + token_grads),
        _ => l,
    })
}

/// The line of a `train` run: throughput from the sorted step times, first and last loss, peak RSS.
fn train_line(a: &LlmArgs, times: &[f64], losses: &[f64]) -> Line {
    let step = median(times);
    line("train", a)
        .set("precision", a.precision.clone())
        .set("batch", a.batch)
        .set("seq", a.seq)
        .set("steps", a.steps)
        .set("tokens_per_s", sig4((a.batch * a.seq) as f64 / step))
        .set("median_step_ms", sig4(step * 1e3))
        .set("min_step_ms", sig4(times[0] * 1e3))
        .set("loss_first", sig4(losses[0]))
        .set("loss_last", sig4(*losses.last().expect("at least one step")))
        .set("peak_rss_mb", sig4(peak_rss_mb()))
}

/// `train` with the whole step (zero_grad, forward, loss, backward, AdamW)
/// captured by `kiln::compile` into one program.
/// `train --mesh cp=N --parallel cp --mode compiled`: the step with every
/// sequence split over N devices (ring attention, TorchTitan's load-balanced
/// order), the parameters replicated. XLA's dump of the step
/// (`benches/program_memory.py`) gives its memory per device against the
/// one-device step's.
fn train_context_parallel(a: &LlmArgs, cfg: &LlamaConfig, spec: &str) -> Result<Line> {
    use kiln::nn::parallel::{parse_mesh, replicate, ContextParallel};
    if !a.compiled {
        return Err(Error::invalid("kiln-bench", "--parallel cp runs the captured step: add --mode compiled"));
    }
    let mesh = parse_mesh(spec, a.device.kind())?;
    let cp = ContextParallel::new(&mesh, "cp", true)?;
    let mut model = LlamaForCausalLM::new(cfg, (DType::F32, Device::Tpu(0)))?;
    replicate(&mut model, cp.mesh())?;
    model.set_context_parallel(Some(cp.clone()));
    model.train(true);
    let adamw = AdamWConfig { lr: 1e-3, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1, amsgrad: false };
    let mut opt = AdamW::new(model.named_parameters(), adamw)?;
    opt.set_capturable(true)?;
    let ids = random_ids(a.batch, a.seq, cfg.vocab_size, Device::Cpu)?;
    let inputs = [cp.shard_sequence(&ids)?, cp.next_token_targets(&ids)?];
    let a = LlmArgs { device: mesh.device(), ..a.clone() };
    let l = train_compiled(&a, &model, &mut opt, &inputs, |logits, xs| cp.loss(logits, &xs[1]))?;
    Ok(l.set("mesh", mesh.to_string()).set("parallel", "cp"))
}

/// The captured training step on `inputs` (the token ids first), with `loss`
/// of the logits and the inputs.
fn train_compiled(
    a: &LlmArgs,
    model: &LlamaForCausalLM,
    opt: &mut AdamW,
    inputs: &[Tensor],
    loss: impl Fn(&Tensor, &[Tensor]) -> Result<Tensor>,
) -> Result<Line> {
    let mut losses = vec![];
    let before = kiln::tpu::stats().ok();
    let mut step = kiln::compile(a.device, |xs: &[Tensor]| {
        opt.zero_grad();
        let logits = model.forward(&xs[0], None)?;
        let loss = loss(&logits, xs)?;
        loss.backward()?;
        opt.step()?;
        Ok(vec![loss])
    });
    let mut calls = 0usize;
    let times = time_steps(a.warmup, a.steps, || {
        if calls == a.warmup {
            kiln::tensor::profile::take();
        }
        calls += 1;
        let out = step.call(inputs)?;
        losses.push(out[0].item_f64()?);
        Ok(())
    })?;
    if kiln::tensor::profile::enabled() {
        eprintln!("kernel time per op over the {} timed steps:\n{}", a.steps, kiln::tensor::profile::report(40));
    }
    let s = step.stats().clone();
    let stats = kiln::tpu::stats().ok();
    let mut l = train_line(a, &times, &losses)
        .set("mode", "compiled")
        .set("calls", s.calls)
        .set("traces", s.traces)
        .set("replays", s.replays)
        .set("retraces", s.retraces)
        .set("host_value_traces", s.host_value_traces);
    if let (Some(b), Some(e)) = (before, stats) {
        l = l
            .set("pjrt_compiles", e.compiles - b.compiles)
            .set("pjrt_compile_s", sig4(e.compile_secs - b.compile_secs))
            .set("pjrt_disk_hits", e.disk_hits - b.disk_hits)
            .set("pjrt_disk_load_s", sig4(e.load_secs - b.load_secs));
    }
    Ok(l)
}

/// `infer`: the forward pass over the whole batch (logits at every position), no grad.
pub fn infer(a: &LlmArgs) -> Result<Line> {
    let cfg = preset(&a.preset).map_err(|e| Error::invalid("kiln-bench", e))?;
    let model = LlamaForCausalLM::new(&cfg, (DType::F32, a.device))?;
    let ids = random_ids(a.batch, a.seq, cfg.vocab_size, a.device)?;
    let _g = no_grad();
    let times = time_steps(a.warmup, a.steps, || {
        let logits = model.forward(&ids, None)?;
        logits.backend().synchronize(logits.device())
    })?;
    let t = median(&times);
    Ok(line("infer", a)
        .set("batch", a.batch)
        .set("seq", a.seq)
        .set("steps", a.steps)
        .set("tokens_per_s", sig4((a.batch * a.seq) as f64 / t))
        .set("median_ms", sig4(t * 1e3))
        .set("peak_rss_mb", sig4(peak_rss_mb())))
}

/// `decode`: batch 1, greedy, one token at a time through the KV cache; the
/// prefill of the prompt is not timed.
pub fn decode(a: &LlmArgs) -> Result<Line> {
    let (cfg, dtype, mut model) = decode_model(a)?;
    let (scheme, head) = match a.weights.strip_suffix("+head") {
        Some(s) => (s, true),
        None => (a.weights.as_str(), false),
    };
    if a.weights.starts_with("gguf:") {
        // As the file has it (Q8_0 / Q4_0 kept packed).
    } else if !matches!(scheme, "f32" | "bf16") {
        let scheme = kiln::nn::quantize::QuantScheme::parse(scheme)?;
        kiln::nn::quantize::quantize_model(&mut model, scheme)?;
        if head {
            kiln::nn::quantize::quantize_lm_head(&mut model, scheme)?;
        }
    } else if head {
        return Err(Error::invalid("kiln-bench", format!("--weights {}: +head needs a quantized scheme", a.weights)));
    }
    if a.activations != Activations::Exact {
        kiln::nn::quantize::set_quantized_activations(&mut model, a.activations)?;
    }
    // Resident bytes of the weights per parameter (quantized weights count their elements).
    let (mut bytes, mut params) = (0usize, 0usize);
    for (_, p) in model.named_parameters() {
        bytes += p.numel() * p.dtype().size_in_bytes();
        params += p.numel();
    }
    for (_, lin) in model.linears_mut() {
        if let Some((_, codes, scales)) = lin.quantized_weight() {
            bytes += codes.numel() * codes.dtype().size_in_bytes() + scales.numel() * scales.dtype().size_in_bytes();
            params += lin.weight.numel();
        }
    }
    // Bytes a decoding step reads: every weight once, but of an embedding
    // table that is not also the LM head, one row.
    let embed = cfg.vocab_size * cfg.hidden_size * dtype.size_in_bytes();
    let head_reads_embedding = cfg.tie_word_embeddings && model.output_weight().is_some();
    let read_per_token = if head_reads_embedding { bytes } else { bytes - embed };
    let prompt = random_ids(1, a.prompt, cfg.vocab_size, a.device)?;
    let _g = no_grad();
    // The profile covers the decoding runs, not the random weights' making.
    kiln::tensor::profile::take();
    let DecodeRuns { times, sleeps, .. } =
        if a.compiled { decode_compiled(a, &model, &prompt)? } else { decode_eager(a, &model, &prompt)? };
    if kiln::tensor::profile::enabled() {
        eprintln!(
            "kernel time per op over all {} runs (prefills included):\n{}",
            a.warmup + a.steps,
            kiln::tensor::profile::report(30)
        );
    }
    let t = median(&times);
    let tok_s = a.new_tokens as f64 / t;
    let mut out = line("decode", a).set("dtype", dtype.to_string());
    if a.device == Device::Cpu {
        // The memory roofline: bytes read per token over the read bandwidth
        // measured now, in this process (a sum over 1 GiB).
        let gbps = read_bandwidth_gbps()?;
        out = out
            .set("weight_gb_per_token", sig4(read_per_token as f64 / 1e9))
            .set("read_gbps", sig4(gbps))
            .set("roofline_tokens_per_s", sig4(gbps * 1e9 / read_per_token as f64))
            .set("roofline_fraction", sig4(tok_s * read_per_token as f64 / (gbps * 1e9)));
    }
    Ok(out
        .set("weights", a.weights.clone())
        .set(
            "activations",
            match a.activations {
                Activations::Exact => "exact",
                Activations::Int8 => "int8",
            },
        )
        .set("weight_bytes_per_param", sig4(bytes as f64 / params as f64))
        .set("batch", 1)
        .set("prompt", a.prompt)
        .set("new_tokens", a.new_tokens)
        .set("steps", a.steps)
        .set("tokens_per_s", sig4(tok_s))
        .set("thread_sleeps_per_token", sig4(median(&sleeps)))
        .set("median_ms", sig4(t * 1e3))
        .set("peak_rss_mb", sig4(peak_rss_mb())))
}

/// What the timed decoding runs measured.
struct DecodeRuns {
    /// Seconds per run, sorted.
    times: Vec<f64>,
    /// Thread sleeps per token, sorted.
    sleeps: Vec<f64>,
    /// The tokens the last run decoded (the tests compare the two ways').
    #[cfg_attr(not(test), allow(dead_code))]
    tokens: Vec<i64>,
}

/// Decoding runs of `forward_cached`, op by op, the loop where generate()
/// runs it (Note [Loops on the compute threads] in kiln-tensor).
fn decode_eager(a: &LlmArgs, model: &LlamaForCausalLM, prompt: &Tensor) -> Result<DecodeRuns> {
    decode_runs(
        a,
        || {
            let mut cache = model.new_cache(a.prompt + a.new_tokens);
            let next = model.forward_cached(prompt, None, &mut cache, true)?.argmax(Some(-1), false)?;
            next.to_vec::<i64>()?;
            Ok((cache, next))
        },
        |(cache, next), tokens| {
            for _ in 0..a.new_tokens {
                *next = model.forward_cached(next, None, cache, true)?.argmax(Some(-1), false)?;
                // Reading the token is part of a decoding step (it decides when to stop).
                tokens.extend(next.to_vec::<i64>()?);
            }
            Ok(())
        },
    )
}

/// `warmup + steps` decoding runs: `prefill` untimed, then `decode` timed,
/// on the compute threads (where generate() runs its loop, Note [Loops on
/// the compute threads] in kiln-tensor), writing the tokens it decodes.
fn decode_runs<S: Send>(
    a: &LlmArgs,
    mut prefill: impl FnMut() -> Result<S>,
    mut decode: impl FnMut(&mut S, &mut Vec<i64>) -> Result<()> + Send,
) -> Result<DecodeRuns> {
    let (mut times, mut sleeps, mut tokens) = (Vec::new(), Vec::new(), Vec::new());
    for run in 0..a.warmup + a.steps.max(1) {
        let mut state = prefill()?;
        let (t0, s0) = (Instant::now(), thread_sleeps());
        tokens.clear();
        on_compute_threads(a.device, || decode(&mut state, &mut tokens))?;
        if run >= a.warmup {
            times.push(t0.elapsed().as_secs_f64());
            sleeps.push(thread_sleeps_since(&s0) as f64 / a.new_tokens as f64);
        }
    }
    sleeps.sort_by(f64::total_cmp);
    times.sort_by(f64::total_cmp);
    Ok(DecodeRuns { times, sleeps, tokens })
}

/// [`decode_eager`]'s measure for the step captured by `kiln::compile`: the
/// paged decoding step (`forward_decode`, the serving engine's), whose
/// inputs are all tensors of fixed shapes, so one program serves every
/// position. The prompt goes through the same program a token at a time
/// (untimed), which also traces and warms it.
fn decode_compiled(a: &LlmArgs, model: &LlamaForCausalLM, prompt: &Tensor) -> Result<DecodeRuns> {
    use kiln::nn::serve::{DecodeBatch, PagedKvCache};
    const BLOCK: usize = 16;
    let total = a.prompt + a.new_tokens;
    let width = total.div_ceil(BLOCK);
    let cache = std::sync::Arc::new(PagedKvCache::new(model, width, BLOCK, model.dtype())?);
    let rope = model.model.rotary().tables(0, width * BLOCK, model.dtype(), a.device)?;
    let (m, c) = (model.clone(), cache.clone());
    let mut step = kiln::compile(a.device, move |x: &[Tensor]| -> Result<Vec<Tensor>> {
        Ok(vec![m.forward_decode(&DecodeBatch::from_inputs(x)?, &rope, &c)?.argmax(Some(-1), false)?])
    })
    .error_on_retrace(true);
    let table = Tensor::from_vec((0..width as i64).collect::<Vec<_>>(), &[1, width])?.to_device(a.device)?;
    let ids = prompt.to_vec::<i64>()?;
    // Token `tok` at position `p`: the next token.
    let step = std::sync::Mutex::new(move |tok: i64, p: usize| -> Result<i64> {
        let t = |v: i64| -> Result<Tensor> { Tensor::from_vec(vec![v], &[1])?.to_device(a.device) };
        let out = step.call(&[t(tok)?, t(p as i64)?, t(p as i64)?, table.clone(), t(p as i64 + 1)?])?;
        Ok(out[0].to_vec::<i64>()?[0])
    });
    let run_step = |tok: i64, p: usize| -> Result<i64> {
        let mut f = step.lock().map_err(|_| Error::invalid("decode", "a decoding step panicked"))?;
        f(tok, p)
    };
    decode_runs(
        a,
        || ids.iter().enumerate().try_fold(0, |_, (p, &tok)| run_step(tok, p)),
        |next, tokens| {
            for p in a.prompt..total {
                *next = run_step(*next, p)?;
                tokens.push(*next);
            }
            Ok(())
        },
    )
}

/// The model `decode` runs: the preset's with random weights in `--weights`'
/// dtype, or a GGUF file's (`--weights gguf:PATH`: its Q8_0 / Q4_0 matrices
/// kept packed, float16 / bfloat16 files computed in bfloat16).
fn decode_model(a: &LlmArgs) -> Result<(LlamaConfig, DType, LlamaForCausalLM)> {
    if let Some(path) = a.weights.strip_prefix("gguf:") {
        let f = kiln::nn::io::gguf::GgufFile::open(path)?;
        let half = f.info("blk.0.attn_q.weight").is_some_and(|i| {
            matches!(i.ggml_type, kiln::nn::io::gguf::GgmlType::BF16 | kiln::nn::io::gguf::GgmlType::F16)
        });
        let dtype = if half { DType::BF16 } else { DType::F32 };
        let opts = PretrainedOptions::new(dtype, a.device).with_quantized(QuantizedLoad::Keep);
        let model = LlamaForCausalLM::from_gguf_with(path, &opts)?;
        return Ok((model.config().clone(), dtype, model));
    }
    let cfg = preset(&a.preset).map_err(|e| Error::invalid("kiln-bench", e))?;
    let dtype = if a.weights == "bf16" { DType::BF16 } else { DType::F32 };
    let model = LlamaForCausalLM::new(&cfg, (dtype, a.device))?;
    Ok((cfg, dtype, model))
}

/// Times each of the process's threads (by id) has gone to sleep so far
/// (its voluntary context switches; Linux only, none elsewhere): each is a
/// wake-up to come.
fn thread_sleeps() -> HashMap<String, u64> {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return HashMap::new();
    };
    tasks
        .filter_map(|t| {
            let t = t.ok()?;
            let status = std::fs::read_to_string(t.path().join("status")).ok()?;
            let line = status.lines().find(|l| l.starts_with("voluntary_ctxt_switches:"))?;
            Some((t.file_name().to_string_lossy().into_owned(), line.split_whitespace().nth(1)?.parse().ok()?))
        })
        .collect()
}

/// The sleeps since `before` of the threads alive at both readings: a
/// thread that ended in between (another test's, a finished helper) takes
/// its count with it, so totals over all threads may shrink.
fn thread_sleeps_since(before: &HashMap<String, u64>) -> u64 {
    thread_sleeps().into_iter().filter_map(|(tid, n)| Some(n.saturating_sub(*before.get(&tid)?))).sum()
}

/// The CPU's read bandwidth in GB/s: the best of 5 sums over 1 GiB of f32,
/// which no cache holds.
fn read_bandwidth_gbps() -> Result<f64> {
    let n = 1usize << 28;
    let x = Tensor::ones(&[n], (DType::F32, Device::Cpu))?;
    let times = (0..5)
        .map(|_| {
            let t0 = Instant::now();
            x.sum()?.item_f64()?;
            Ok(t0.elapsed().as_secs_f64())
        })
        .collect::<Result<Vec<f64>>>()?;
    Ok((n * 4) as f64 / times.into_iter().fold(f64::INFINITY, f64::min) / 1e9)
}

/// `autograd`: an MLP of four `[512, 1024] @ [1024, 1024]` layers with GELU,
/// timed forward only and forward + backward; reports backward / forward.
pub fn autograd(a: &LlmArgs) -> Result<Line> {
    let (rows, width, layers) = (512, 1024, 4);
    let o = (DType::F32, a.device);
    let ws: Vec<Tensor> = (0..layers)
        .map(|_| {
            let w = Tensor::randn(&[width, width], o)?.mul(1.0 / (width as f64).sqrt())?;
            w.requires_grad_(true)?;
            Ok(w)
        })
        .collect::<Result<_>>()?;
    let x = Tensor::randn(&[rows, width], o)?;
    let forward = || -> Result<Tensor> {
        let mut h = x.clone();
        for w in &ws {
            h = h.matmul(w)?.gelu()?;
        }
        h.sum()
    };
    let fwd = time_steps(a.warmup, a.steps, || forward()?.item_f64().map(|_| ()))?;
    let both = time_steps(a.warmup, a.steps, || {
        let y = forward()?;
        y.backward()?;
        for w in &ws {
            w.zero_grad();
        }
        y.item_f64().map(|_| ())
    })?;
    let (f, fb) = (median(&fwd), median(&both));
    let flops = (2 * rows * width * width * layers) as f64;
    Ok(Line::new("autograd", "float32", &a.device.to_string())
        .set("graph", format!("{layers} x ([{rows}, {width}] @ [{width}, {width}] + gelu), sum"))
        .set("forward_ms", sig4(f * 1e3))
        .set("forward_backward_ms", sig4(fb * 1e3))
        .set("backward_forward_ratio", sig4((fb - f) / f))
        .set("forward_gflops", sig4(flops / f / 1e9))
        .set("peak_rss_mb", sig4(peak_rss_mb())))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn tiny() -> LlmArgs {
        LlmArgs {
            device: Device::Cpu,
            preset: "llama-tiny".into(),
            batch: 2,
            seq: 8,
            steps: 2,
            warmup: 0,
            prompt: 4,
            new_tokens: 3,
            weights: "f32".into(),
            activations: Activations::Exact,
            precision: "f32".into(),
            compiled: false,
            finetune: Finetune::Full,
            parallel: None,
        }
    }

    /// Held by the tests that draw from the global random generator and
    /// compare what they drew: the tests of one binary run on several threads.
    pub(crate) fn rng_lock() -> std::sync::MutexGuard<'static, ()> {
        static RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());
        RNG.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn num(l: &Line, k: &str) -> f64 {
        l.get(k).and_then(|v| v.as_f64()).unwrap_or_else(|| panic!("no number {k}"))
    }

    #[test]
    fn model_benchmarks_run_and_report() -> Result<()> {
        let _rng = rng_lock();
        kiln::init();
        let t = train(&tiny())?;
        // A fresh model on random tokens starts near the uniform loss ln(vocab).
        assert!((num(&t, "loss_first") - 256f64.ln()).abs() < 0.5, "loss {}", num(&t, "loss_first"));
        assert!(num(&t, "tokens_per_s") > 0.0);
        assert!(num(&infer(&tiny())?, "tokens_per_s") > 0.0);
        assert!(num(&decode(&tiny())?, "tokens_per_s") > 0.0);
        let d = decode(&LlmArgs { compiled: true, ..tiny() })?;
        assert!(num(&d, "tokens_per_s") > 0.0);
        assert_eq!(d.get("mode").and_then(|v| v.as_str()), Some("compiled"));
        let nv = decode(&LlmArgs { weights: "nvfp4".into(), ..tiny() })?;
        let bpp = num(&nv, "weight_bytes_per_param");
        assert!(bpp > 0.5 && bpp < 4.0, "NVFP4 decoder weights beside f32 embeddings: {bpp}");
        let q4 = decode(&LlmArgs { weights: "q4_0".into(), activations: Activations::Int8, ..tiny() })?;
        assert_eq!(q4.get("activations").and_then(|v| v.as_str()), Some("int8"));
        let e = decode(&LlmArgs { activations: Activations::Int8, ..tiny() }).err().map(|e| e.to_string());
        let e = e.unwrap_or_default();
        assert!(e.contains("keeps no weight quantized"), "{e}");
        assert!(preset("llama-16m").is_ok() && preset("gpt").is_err());
        // The eager line names how its ops ran.
        assert_eq!(t.get("mode").and_then(|v| v.as_str()), Some("eager"));
        Ok(())
    }

    /// The minimum `measure_parallel.sh` prints beside the measured bytes,
    /// against llama-tiny's parameters counted by hand: every gradient but
    /// the input embedding's reduced (whole under DDP, a quarter under FSDP
    /// on dp=4), the embedding's token gradients and ids gathered, FSDP's
    /// parameters gathered for the forward and its matrices again for the backward.
    #[test]
    fn the_collective_minimum_counts_llama_tiny_by_hand() -> Result<()> {
        use kiln::nn::parallel::{parse_mesh, Recipe};
        let _rng = rng_lock();
        kiln::init_device(Device::Tpu(0))?;
        let cfg = preset("llama-tiny").map_err(|e| Error::invalid("test", e))?;
        let mesh = parse_mesh("dp=4", kiln::DeviceKind::Tpu)?;
        // Per layer: q, o [64, 64]; k, v [32, 64]; gate, up [128, 64]; down [64, 128]; two norms [64].
        let layer_matrices = 2 * 4096 + 2 * 2048 + 3 * 8192;
        let matrices = 2 * layer_matrices + 256 * 64; // and the untied head
        let reduced = matrices + 2 * 2 * 64 + 64; // and the norms
        let params = reduced + 256 * 64; // and the embedding
        let tokens = 2 * 8 * (64 * 4 + 8);
        let line = |r: Recipe| -> Result<Line> {
            let mut model = LlamaForCausalLM::new(&cfg, (DType::F32, mesh.device()))?;
            r.apply(&mut model, &mesh)?;
            collective_minimum(line("train", &tiny()), &model, &cfg, &mesh, &r, 2 * 8, "f32")
        };
        let ddp = line(Recipe::Ddp)?;
        assert_eq!(num(&ddp, "min_all_reduce_bytes"), (reduced * 4 + 14) as f64);
        assert_eq!(num(&ddp, "min_all_gather_bytes"), tokens as f64);
        let fsdp = line(Recipe::Fsdp)?;
        assert_eq!(num(&fsdp, "min_reduce_scatter_bytes"), reduced as f64);
        assert_eq!(num(&fsdp, "min_all_gather_bytes"), (params * 4 + matrices * 4 + tokens) as f64);
        assert_eq!(num(&fsdp, "min_all_reduce_bytes"), 14.0);
        Ok(())
    }

    /// `train --mesh cp=4 --parallel cp`: the step with the sequence split
    /// over four devices (ring attention) starts from the one-device step's
    /// loss and takes the same first step (same seed: same weights, same tokens).
    #[test]
    fn the_context_parallel_step_is_the_one_device_step() -> Result<()> {
        let _rng = rng_lock();
        kiln::init_device(Device::Tpu(0))?;
        let a = LlmArgs { device: Device::Tpu(0), compiled: true, batch: 1, seq: 16, steps: 2, ..tiny() };
        kiln::manual_seed(3);
        let one = train(&a)?;
        kiln::manual_seed(3);
        let cp = train(&LlmArgs { parallel: Some(("cp=4".into(), "cp".into())), ..a.clone() })?;
        // The lines round to four significant digits: equal up to one unit of the last.
        for k in ["loss_first", "loss_last"] {
            assert!((num(&one, k) - num(&cp, k)).abs() <= 1.01e-3, "{k}: {} vs {}", num(&one, k), num(&cp, k));
        }
        assert_eq!(cp.get("parallel").and_then(|v| v.as_str()), Some("cp"));
        let eager = train(&LlmArgs { compiled: false, parallel: Some(("cp=4".into(), "cp".into())), ..a });
        let e = eager.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.contains("add --mode compiled"), "{e}");
        Ok(())
    }

    /// The captured decoding step (the paged step, fused on the CPU) decodes
    /// the tokens the eager loop decodes.
    #[test]
    fn compiled_decoding_decodes_the_eager_tokens() -> Result<()> {
        let _rng = rng_lock();
        kiln::init();
        let a = LlmArgs { new_tokens: 12, ..tiny() };
        let (_, _, model) = decode_model(&a)?;
        let prompt = random_ids(1, a.prompt, model.config().vocab_size, a.device)?;
        let _g = no_grad();
        let eager = decode_eager(&a, &model, &prompt)?.tokens;
        let compiled = decode_compiled(&a, &model, &prompt)?.tokens;
        assert_eq!(eager.len(), 12);
        assert_eq!(eager, compiled);
        Ok(())
    }

    /// The memory-bound preset has Qwen3-0.6B's shapes: about 596M parameters
    /// with the embedding tied, 440M of them in the decoder layers.
    #[test]
    fn the_qwen3_preset_has_the_real_models_shapes() {
        let c = preset("qwen3-0.6b").unwrap();
        let (h, q, kv) = (c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim);
        let layer = h * q * 2 + h * kv * 2 + 3 * h * c.intermediate_size + 2 * h + 2 * c.head_dim;
        let total = c.vocab_size * h + c.num_hidden_layers * layer + h;
        assert!(c.tie_word_embeddings && c.head_dim == 128 && q == 2048, "{c:?}");
        assert!((590_000_000..600_000_000).contains(&total), "{total} parameters");
    }
}
