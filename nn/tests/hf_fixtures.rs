//! Llama and Qwen3 against the golden fixtures made with PyTorch and Hugging
//! Face transformers (`shared/fixtures`): logits, loss, every activation,
//! every gradient and greedy generation, from both `config.json` layouts, plus
//! the bf16 checkpoint computed in f32 and in bf16.
mod support;

use kiln::nn::generate::{generate, Sampling};
use kiln::nn::io::{load_checkpoint_dir, load_safetensors};
use kiln::nn::models::{causal_lm_loss, LlamaConfig, LlamaForCausalLM};
use kiln::nn::module::Module;
use kiln::prelude::*;
use std::collections::BTreeMap;
use support::{assert_close, fixture_dir, rng_lock, tolerance};

fn golden(name: &str) -> BTreeMap<String, Tensor> {
    load_safetensors(fixture_dir(name).join("golden.safetensors")).expect("golden.safetensors")
}

/// The fixture model, its config read from `config_file`.
fn load(name: &str, config_file: &str, dtype: DType) -> LlamaForCausalLM {
    load_on(name, config_file, dtype, Device::Cpu)
}

fn load_on(name: &str, config_file: &str, dtype: DType, dev: Device) -> LlamaForCausalLM {
    let dir = fixture_dir(name);
    if config_file == "config.json" {
        return LlamaForCausalLM::from_pretrained(&dir, dtype, dev).expect("from_pretrained");
    }
    let cfg = LlamaConfig::from_file(dir.join(config_file)).expect("config");
    let w = load_checkpoint_dir(&dir, Some(dtype), dev).expect("weights");
    LlamaForCausalLM::from_weights(&cfg, &w, dtype, dev).expect("from_weights")
}

/// Forward with activations, loss, backward: everything checked against the golden file.
fn check_model(name: &str, config_file: &str, dev: Device) {
    let g = golden(name);
    let model = load_on(name, config_file, DType::F32, dev);
    let ids = &g["input_ids"].to_device(dev).unwrap();
    let (logits, acts) = model.forward_with_activations(ids, None).unwrap();
    let (la, lr) = tolerance(name, "logits");
    let e_logits = assert_close(&format!("{name} logits"), &logits, &g["logits"], la, lr);

    let (aa, ar) = tolerance(name, "activations");
    let want_acts: Vec<&String> = g.keys().filter(|k| k.starts_with("act.")).collect();
    assert!(!want_acts.is_empty());
    let mut e_acts = 0f64;
    for k in want_acts {
        let got = acts.get(k).unwrap_or_else(|| panic!("{name}: activation {k} not captured"));
        e_acts = e_acts.max(assert_close(&format!("{name} {k}"), got, &g[k], aa, ar));
    }
    assert_eq!(acts.len(), g.keys().filter(|k| k.starts_with("act.")).count(), "same activation names");

    let loss = causal_lm_loss(&logits, ids, Some(-100)).unwrap();
    let (sa, sr) = tolerance(name, "loss");
    let e_loss = assert_close(&format!("{name} loss"), &loss, &g["loss"], sa, sr);

    loss.backward().unwrap();
    let (ga, gr) = tolerance(name, "grad");
    let mut e_grad = 0f64;
    let params = model.named_parameters();
    assert_eq!(params.len(), g.keys().filter(|k| k.starts_with("grad.")).count(), "one gradient per parameter");
    for (n, p) in &params {
        let want = g.get(&format!("grad.{n}")).unwrap_or_else(|| panic!("{name}: no golden grad.{n}"));
        let got = p.grad().unwrap_or_else(|| panic!("{name}: {n} has no gradient"));
        e_grad = e_grad.max(assert_close(&format!("{name} grad.{n}"), &got, want, ga, gr));
    }
    println!(
        "{name} ({config_file}, {dev}): max abs err logits {e_logits:.2e}, loss {e_loss:.2e}, activations {e_acts:.2e}, grads {e_grad:.2e}"
    );
}

fn check_generate(name: &str, config_file: &str, dev: Device) {
    let g = golden(name);
    let model = load_on(name, config_file, DType::F32, dev);
    let prompt = &g["generate.prompt"].to_device(dev).unwrap();
    let want = g["generate.output"].to_vec::<i64>().unwrap();
    let new = g["generate.output"].shape()[1] - prompt.shape()[1];
    let cached = generate(&model, prompt, new, &Sampling::greedy()).unwrap();
    assert_eq!(cached.shape(), g["generate.output"].shape());
    assert_eq!(cached.to_vec::<i64>().unwrap(), want, "{name}: greedy generation with KV cache");
    let recomputed = generate(&model, prompt, new, &Sampling::greedy().with_cache(false)).unwrap();
    assert_eq!(recomputed.to_vec::<i64>().unwrap(), want, "{name}: greedy generation without cache");
}

#[test]
fn llama_matches_transformers() {
    check_model("llama", "config.json", Device::Cpu);
}

#[test]
fn llama_hf4_config_matches_transformers() {
    check_model("llama", "config.hf4.json", Device::Cpu);
}

#[test]
fn qwen3_matches_transformers() {
    check_model("qwen3", "config.json", Device::Cpu);
}

#[test]
fn qwen3_hf4_config_matches_transformers() {
    check_model("qwen3", "config.hf4.json", Device::Cpu);
}

#[test]
fn qwen3_moe_matches_transformers() {
    check_model("qwen3_moe", "config.json", Device::Cpu);
    check_model("qwen3_moe", "config.hf4.json", Device::Cpu);
}

#[test]
fn qwen3_moe_greedy_generation() {
    check_generate("qwen3_moe", "config.json", Device::Cpu);
}

#[test]
fn qwen3_moe_adamw_steps_match_torch() {
    check_adamw("qwen3_moe", Device::Cpu);
}

#[test]
fn llama_greedy_generation() {
    check_generate("llama", "config.json", Device::Cpu);
    check_generate("llama", "config.hf4.json", Device::Cpu);
}

#[test]
fn qwen3_greedy_generation() {
    check_generate("qwen3", "config.json", Device::Cpu);
    check_generate("qwen3", "config.hf4.json", Device::Cpu);
}

#[test]
fn sampled_generation_with_cache_equals_recomputation() {
    let _rng = rng_lock();
    let model = load("qwen3", "config.json", DType::F32);
    let prompt = golden("qwen3")["generate.prompt"].clone();
    let s = Sampling::sample(0.9).with_top_k(20).with_top_p(0.9).with_seed(7);
    let a = generate(&model, &prompt, 6, &s).unwrap().to_vec::<i64>().unwrap();
    let b = generate(&model, &prompt, 6, &s.clone().with_cache(false)).unwrap().to_vec::<i64>().unwrap();
    let c = generate(&model, &prompt, 6, &s).unwrap().to_vec::<i64>().unwrap();
    assert_eq!(a, b, "cache vs recomputation");
    assert_eq!(a, c, "same seed, same tokens");
}

#[test]
fn both_config_layouts_parse_alike() {
    for name in ["llama", "qwen3", "llama_bf16"] {
        let dir = fixture_dir(name);
        let mut a = LlamaConfig::from_file(dir.join("config.json")).unwrap();
        let mut b = LlamaConfig::from_file(dir.join("config.hf4.json")).unwrap();
        a.raw = None;
        b.raw = None;
        assert_eq!(a, b, "{name}");
    }
}

// The bf16 fixture was made with `model.to(torch.bfloat16)`, which also rounds
// transformers' `inv_freq` buffer to bf16 (the later `.float()` keeps the
// rounding). kiln, like transformers' `from_pretrained(dtype=...)`, keeps the
// frequencies in float32, so these tests round them to reproduce the fixture,
// and check the unrounded model against a bound on that difference.
#[test]
fn bf16_weights_in_f32_match() {
    let g = golden("llama_bf16");
    let mut model = load("llama_bf16", "config.json", DType::F32);
    assert_eq!(model.dtype(), DType::F32);
    let ids = &g["input_ids"];
    let want = &g["logits_f32_from_bf16_weights"];
    let (a, r) = tolerance("llama_bf16", "logits_f32_from_bf16_weights");
    let exact_rope = model.forward(ids, None).unwrap();
    let e_exact = assert_close("llama_bf16 f32 logits, float32 inv_freq", &exact_rope, want, 1e-3, 0.0);
    model.model.rotary_mut().round_inv_freq(DType::BF16);
    let logits = model.forward(ids, None).unwrap();
    let e = assert_close("llama_bf16 f32 logits", &logits, want, a, r);
    let loss = causal_lm_loss(&logits, ids, None).unwrap();
    let e_loss = assert_close("llama_bf16 f32 loss", &loss, &g["loss_f32_from_bf16_weights"], 5e-6, 1e-6);
    println!(
        "llama_bf16 f32 compute: max abs err logits {e:.2e} ({e_exact:.2e} with float32 inv_freq), loss {e_loss:.2e}"
    );
}

#[test]
fn bf16_compute_matches_within_bf16_tolerance() {
    let g = golden("llama_bf16");
    let mut model = load("llama_bf16", "config.hf4.json", DType::BF16);
    assert_eq!(model.dtype(), DType::BF16);
    model.model.rotary_mut().round_inv_freq(DType::BF16);
    let logits = model.forward(&g["input_ids"], None).unwrap();
    assert_eq!(logits.dtype(), DType::BF16);
    let (a, r) = tolerance("llama_bf16", "logits_bf16");
    let e = assert_close("llama_bf16 bf16 logits", &logits, &g["logits_bf16"], a, r);
    let loss = causal_lm_loss(&logits, &g["input_ids"], None).unwrap();
    let e_loss = assert_close("llama_bf16 bf16 loss", &loss, &g["loss_bf16"], 2e-2, 1e-2);
    println!("llama_bf16 bf16 compute: max abs err logits {e:.2e}, loss {e_loss:.2e}");
    // The bounds above would pass float32 compute (0.055 from PyTorch's bf16
    // logits); this does not (measured: 1843 of 8192 equal, 1415 for float32).
    let f32_logits = &g["logits_f32_from_bf16_weights"];
    support::assert_nearer_than_f32("llama_bf16 bf16 compute", &logits, &g["logits_bf16"], f32_logits);
}

/// `tolerances.json` for an AdamW key: `(atol, rtol, small_grad_threshold, small_grad_atol)`.
/// Parameters after AdamW steps vs golden (see `support::check_params`).
fn check_params(name: &str, model: &LlamaForCausalLM, g: &BTreeMap<String, Tensor>, what: &str) -> f64 {
    support::check_params(name, &model.named_parameters(), g, what)
}

/// One backward, one AdamW step, nine more on the same batch (the fixture's `train_suite`).
fn check_adamw(name: &str, dev: Device) {
    check_adamw_with(name, dev, false)
}

/// With `compiled`, every step (zero_grad, forward, loss, backward, capturable
/// AdamW) runs through `kiln::compile`.
fn check_adamw_with(name: &str, dev: Device, compiled: bool) {
    use kiln::nn::optim::{AdamW, AdamWConfig, Optimizer};
    let g = golden(name);
    let model = load_on(name, "config.json", DType::F32, dev);
    let ids = &g["input_ids"].to_device(dev).unwrap();
    let cfg = AdamWConfig { lr: 1e-3, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1, amsgrad: false };
    let mut opt = AdamW::new(model.named_parameters(), cfg).unwrap();
    opt.set_capturable(compiled).unwrap();
    let loss_of = |m: &LlamaForCausalLM| causal_lm_loss(&m.forward(ids, None).unwrap(), ids, None).unwrap();
    let mut curve = vec![];
    let mut e1 = 0.0;
    if compiled {
        let mut step = kiln::compile(dev, |_: &[Tensor]| {
            opt.zero_grad();
            let loss = causal_lm_loss(&model.forward(ids, None)?, ids, None)?;
            loss.backward()?;
            opt.step()?;
            Ok(vec![loss])
        });
        for i in 1..=10 {
            curve.push(step.call(&[]).unwrap()[0].item::<f32>().unwrap());
            if i == 1 {
                e1 = check_params(name, &model, &g, "adamw_step1");
            }
        }
        let s = step.stats();
        assert_eq!((s.calls, s.retraces), (10, 0));
        assert!(s.replays >= 7, "the step is replayed once its trace is stable: {s:?}");
    } else {
        for step in 1..=10 {
            opt.zero_grad();
            let loss = loss_of(&model);
            loss.backward().unwrap();
            opt.step().unwrap();
            curve.push(loss.item::<f32>().unwrap());
            if step == 1 {
                e1 = check_params(name, &model, &g, "adamw_step1");
            }
        }
    }
    {
        let _ng = kiln::autograd::no_grad();
        curve.push(loss_of(&model).item::<f32>().unwrap());
    }
    let e10 = check_params(name, &model, &g, "adamw_step10");
    let (mut ca, cr) = tolerance(name, "loss_curve");
    if dev != Device::Cpu {
        // After the first step the curve depends on the sign of gradient
        // elements that are zero up to rounding: Adam moves each such weight by
        // about +-lr whatever the gradient's size. On the PJRT device one llama
        // element (gate_proj, |grad| ~ 7e-9, inside the gradient tolerance)
        // rounds to the other sign than in PyTorch, which moves the 10-step
        // curve by about 1e-5 (PyTorch's own f32 curve is 5e-7 from f64). The
        // parameters themselves are held to the fixture's tolerances above.
        ca *= 4.0;
    }
    let got = Tensor::from_vec(curve, &[11]).unwrap();
    let e_curve = assert_close(&format!("{name} loss_curve"), &got, &g["loss_curve"], ca, cr);
    let dev = if compiled { format!("{dev}, compiled") } else { dev.to_string() };
    println!("{name} AdamW ({dev}): max abs err step1 {e1:.2e}, step10 {e10:.2e}, loss curve {e_curve:.2e}");
}

#[test]
fn llama_adamw_steps_match_torch() {
    check_adamw("llama", Device::Cpu);
}

#[test]
fn qwen3_adamw_steps_match_torch() {
    check_adamw("qwen3", Device::Cpu);
}

/// The same fixtures on the PJRT device (XLA:CPU plugin), in one mode:
/// logits, loss, activations, gradients, generation, AdamW steps and the loss curve.
fn check_on_tpu(mode: kiln::tpu::Mode) {
    support::register_tpu();
    let dev = Device::Tpu(0);
    kiln::tpu::with_mode(mode, || {
        for name in ["llama", "qwen3", "qwen3_moe"] {
            check_model(name, "config.json", dev);
            check_generate(name, "config.json", dev);
            check_adamw(name, dev);
        }
    });
}

#[test]
fn tpu_strict_matches_transformers() {
    check_on_tpu(kiln::tpu::Mode::Strict);
}

#[test]
fn tpu_debug_matches_transformers() {
    check_on_tpu(kiln::tpu::Mode::Debug);
}

#[test]
fn tpu_compiled_training_steps_match_transformers() {
    support::register_tpu();
    for name in ["llama", "qwen3", "qwen3_moe"] {
        check_adamw_with(name, Device::Tpu(0), true);
    }
}

#[test]
fn tpu_defer_matches_transformers() {
    check_on_tpu(kiln::tpu::Mode::Defer);
    kiln::tpu::sync().unwrap();
}

/// What [`dropout_run`] saw after each step: losses, the generator's states,
/// the parameters' bits (when asked for).
type Run = (Vec<f32>, Vec<Vec<i64>>, Vec<Vec<Vec<u32>>>);

/// Ten AdamW steps of the llama fixture with attention dropout on (p = 0.1),
/// from `seed`: the losses, the default generator's state and (with
/// `params`) every parameter's bits after each step.
fn dropout_run(dev: Device, compiled: bool, seed: u64, params: bool) -> Run {
    use kiln::nn::optim::{AdamW, AdamWConfig, Optimizer};
    let dir = support::fixture_dir("llama");
    let mut cfg = LlamaConfig::from_file(dir.join("config.json")).expect("config");
    cfg.attention_dropout = 0.1;
    let w = load_checkpoint_dir(&dir, Some(DType::F32), dev).expect("weights");
    let mut model = LlamaForCausalLM::from_weights(&cfg, &w, DType::F32, dev).expect("from_weights");
    model.train(true);
    let ids = &golden("llama")["input_ids"].to_device(dev).unwrap();
    let adamw = AdamWConfig { lr: 1e-3, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1, amsgrad: false };
    let mut opt = AdamW::new(model.named_parameters(), adamw).unwrap();
    opt.set_capturable(true).unwrap();
    let handles: Vec<Tensor> = model.named_parameters().into_iter().map(|(_, p)| p).collect();
    kiln::manual_seed(seed);
    let gen = kiln::default_generator(dev).unwrap();
    let mut step = move |_: &[Tensor]| -> Result<Vec<Tensor>> {
        opt.zero_grad();
        let loss = causal_lm_loss(&model.forward(ids, None)?, ids, None)?;
        loss.backward()?;
        opt.step()?;
        Ok(vec![loss])
    };
    let (mut losses, mut states, mut bits) = (vec![], vec![], vec![]);
    let mut record = |out: Vec<Tensor>| {
        losses.push(out[0].item::<f32>().unwrap());
        states.push(gen.get_state().unwrap().to_vec::<i64>().unwrap());
        if params {
            let of = |p: &Tensor| p.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
            bits.push(handles.iter().map(of).collect());
        }
    };
    if compiled {
        let mut c = kiln::compile(dev, step);
        for _ in 0..10 {
            record(c.call(&[]).unwrap());
        }
        let s = c.stats();
        assert_eq!((s.calls, s.retraces, s.host_value_traces), (10, 0, 0), "{s:?}");
        assert!(s.replays >= 7, "the step with dropout is replayed: {s:?}");
        if dev == Device::Cpu {
            let text = c.program().unwrap().to_string();
            let head: Vec<&str> = text.lines().take(4).collect();
            println!("the captured step ({} lines):\n{}\n  ...", text.lines().count(), head.join("\n"));
            assert!(text.contains("random_bits(") && text.contains("generator") && text.contains("updates"), "{text}");
        }
    } else {
        for _ in 0..10 {
            record(step(&[]).unwrap());
        }
    }
    (losses, states, bits)
}

#[test]
fn cpu_compiled_steps_with_dropout_equal_eager_step_by_step() {
    let _r = rng_lock();
    let (eager, eager_states, eager_params) = dropout_run(Device::Cpu, false, 7, true);
    let (compiled, compiled_states, compiled_params) = dropout_run(Device::Cpu, true, 7, true);
    // The program runs the eager kernels on the same data: equal bit for bit, step by step.
    assert_eq!(compiled_states, eager_states);
    let b = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(b(&compiled), b(&eager), "compiled {compiled:?}\n   eager {eager:?}");
    for (step, (c, e)) in compiled_params.iter().zip(&eager_params).enumerate() {
        assert!(c == e, "the parameters differ after step {}", step + 1);
    }
    let (other, _, _) = dropout_run(Device::Cpu, true, 8, false);
    assert_ne!(b(&other), b(&eager), "another seed draws other masks");
}

#[test]
fn tpu_compiled_steps_with_dropout_draw_the_eager_masks() {
    support::register_tpu();
    let _r = rng_lock();
    let dev = Device::Tpu(0);
    let (eager, eager_states, _) = dropout_run(dev, false, 7, false);
    let (compiled, compiled_states, _) = dropout_run(dev, true, 7, false);
    let (cpu, cpu_states, _) = dropout_run(Device::Cpu, false, 7, false);
    let (other, _, _) = dropout_run(dev, false, 8, false);
    // The generator advances the same way, step by step, everywhere.
    assert_eq!(compiled_states, eager_states);
    assert_eq!(cpu_states, eager_states);
    let close = |a: &[f32], b: &[f32], tol: f32| a.iter().zip(b).all(|(x, y)| (x - y).abs() <= tol * (1.0 + y.abs()));
    // Same masks: the same losses to float rounding (a different mask moves a loss by ~1e-2).
    assert!(close(&compiled, &eager, 2e-5), "compiled {compiled:?}\n   eager {eager:?}");
    assert!(close(&cpu, &eager, 2e-5), "cpu {cpu:?}\n   tpu {eager:?}");
    assert!(!close(&other, &eager, 1e-3), "another seed, other masks: {other:?} vs {eager:?}");
    println!("llama with dropout, 10 steps: compiled {compiled:?}, eager {eager:?}");
}
