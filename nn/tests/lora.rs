//! LoRA adapters against PEFT: the `lora_llama` and `lora_qwen3` fixtures
//! (PEFT's own adapter directories, its logits, loss, adapter gradients,
//! first AdamW step and 10-step loss curve, the base frozen) on the CPU and
//! on PJRT (strict and compiled); PEFT's selection rules, files, merging.
mod support;

use kiln::nn::lora::{
    adapter_state_dict, inject_adapter, load_adapter, merge_adapter, merge_and_unload, save_adapter, unmerge_adapter,
    LoraConfig, LoraInit, TargetModules, PEFT_PREFIX,
};
use kiln::nn::models::{causal_lm_loss, LlamaForCausalLM};
use kiln::nn::module::Module;
use kiln::nn::optim::{AdamW, AdamWConfig, Optimizer};
use kiln::prelude::*;
use std::collections::BTreeMap;
use support::{assert_close, check_logits_and_loss, check_params, fixture_dir, tolerance};

const ADAMW: AdamWConfig = AdamWConfig { lr: 1e-3, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1, amsgrad: false };

fn golden(fixture: &str) -> BTreeMap<String, Tensor> {
    kiln::nn::io::load_safetensors(fixture_dir(fixture).join("golden.safetensors")).unwrap()
}

/// The adapter's trainable parameters under PEFT's names.
fn peft_named(model: &LlamaForCausalLM) -> Vec<(String, Tensor)> {
    model.named_trainable_parameters().into_iter().map(|(n, t)| (format!("{PEFT_PREFIX}{n}"), t)).collect()
}

/// PEFT's adapter on its base: logits, loss, every adapter gradient, AdamW
/// step 1 and the 10-step loss curve of adapter-only training.
fn check_fixture(fixture: &str, base: &str, dev: Device, compiled: bool) {
    let what = format!("{fixture} on {dev}{}", if compiled { " compiled" } else { "" });
    let g = golden(fixture);
    let mut model = LlamaForCausalLM::from_pretrained(fixture_dir(base), DType::F32, dev).unwrap();
    load_adapter(&mut model, fixture_dir(fixture).join("adapter"), true).unwrap();
    model.train(true);
    let ids = &g["input_ids"].to_device(dev).unwrap();
    let trainable = peft_named(&model);
    let grads: Vec<&String> = g.keys().filter(|k| k.starts_with("grad.")).collect();
    assert_eq!(trainable.len(), grads.len(), "{what}: one trainable tensor per adapter matrix");
    let n: usize = trainable.iter().map(|(_, t)| t.numel()).sum();
    let want_n = serde_json::from_str::<serde_json::Value>(
        &std::fs::read_to_string(fixture_dir(fixture).join("golden.json")).unwrap(),
    )
    .unwrap()["trainable_params"]
        .as_u64()
        .unwrap();
    assert_eq!(n as u64, want_n, "{what}: PEFT's trainable parameter count");

    let loss = check_logits_and_loss(&what, base, &model, ids, &g);
    loss.backward().unwrap();
    let (ga, gr) = tolerance(base, "grad");
    for (n, p) in &trainable {
        assert_close(&format!("{what} grad.{n}"), &p.grad().expect("a gradient"), &g[&format!("grad.{n}")], ga, gr);
    }
    model.visit_params("", &mut |n, p| {
        assert!(p.requires_grad() || p.grad().is_none(), "{what}: the frozen {n} got a gradient")
    });

    let mut opt = AdamW::new(model.named_trainable_parameters(), ADAMW).unwrap();
    opt.set_capturable(compiled).unwrap();
    opt.step().unwrap();
    let e1 = check_params(base, &peft_named(&model), &g, "adamw_step1");
    let mut curve = vec![loss.item::<f32>().unwrap()];
    curve.extend(support::nine_more_steps(&what, &model, &mut opt, ids, dev, compiled));
    let (ca, cr) = tolerance(base, "loss_curve");
    let got = Tensor::from_vec(curve, &[11]).unwrap();
    let e = assert_close(&format!("{what} loss_curve"), &got, &g["loss_curve"], ca, cr);
    println!("{what}: AdamW step 1 max abs err {e1:.2e}, loss curve {e:.2e}");
}

#[test]
fn peft_fixtures_on_the_cpu() {
    check_fixture("lora_llama", "llama", Device::Cpu, false);
    check_fixture("lora_qwen3", "qwen3", Device::Cpu, false);
}

#[test]
fn peft_fixtures_on_pjrt_strict_and_compiled() {
    support::register_tpu();
    let dev = Device::Tpu(0);
    kiln::tpu::with_mode(kiln::tpu::Mode::Strict, || {
        check_fixture("lora_llama", "llama", dev, false);
        check_fixture("lora_qwen3", "qwen3", dev, false);
    });
    check_fixture("lora_llama", "llama", dev, true);
    check_fixture("lora_qwen3", "qwen3", dev, true);
}

/// Runs `check_lora_with_peft.py` with `args`; its stdout.
fn peft(args: &[&std::ffi::OsStr]) -> String {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/check_lora_with_peft.py");
    let out = std::process::Command::new(support::python_with_transformers()).arg(script).args(args).output().unwrap();
    assert!(out.status.success(), "check_lora_with_peft.py failed:\n{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap()
}

/// A Llama no test has seen: other sizes and seed, saved by kiln.
fn unseen_base(dir: &std::path::Path) {
    let cfg = kiln::nn::models::LlamaConfig::from_json_str(
        r#"{"model_type": "llama", "vocab_size": 96, "hidden_size": 48, "intermediate_size": 80,
            "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 8,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": false}"#,
    )
    .unwrap();
    kiln::manual_seed(11);
    let mut m = LlamaForCausalLM::new(&cfg, DType::F32).unwrap();
    // Weights of the fixtures' scale (N(0, 1/fan_in)), so that errors show.
    {
        let _g = kiln::autograd::no_grad();
        m.visit_params_mut("", &mut |_, p| {
            let fan_in = *p.shape().last().unwrap() as f64;
            let t =
                if p.ndim() == 2 { Tensor::randn(p.shape(), DType::F32)?.mul(1.0 / fan_in.sqrt())? } else { p.clone() };
            p.copy_(&t).map(|_| ())
        })
        .unwrap();
    }
    m.save_pretrained(dir).unwrap();
}

/// An adapter PEFT makes from `config` (its LoraConfig arguments) on `base`,
/// reproduced by kiln after loading PEFT's files; then kiln's trained adapter
/// loaded by PEFT, whose logits and merged logits equal kiln's.
fn check_against_peft(tag: &str, base: &std::path::Path, tol: &str, config: serde_json::Value) {
    let _g = support::rng_lock();
    let dir = support::temp_dir(&format!("lora-peft-{tag}"));
    let ids = {
        kiln::manual_seed(5);
        let vocab = LlamaForCausalLM::from_pretrained(base, DType::F32, Device::Cpu).unwrap().config().vocab_size;
        Tensor::randint(0, vocab as i64, &[2, 12], DType::I64).unwrap()
    };
    let ids_file = dir.join("ids.safetensors");
    kiln::nn::io::save_safetensors(&ids_file, &BTreeMap::from([("input_ids".to_string(), ids.clone())]), None).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let count: usize = peft(&[
        "make".as_ref(),
        base.as_os_str(),
        dir.join("config.json").as_os_str(),
        ids_file.as_os_str(),
        dir.as_os_str(),
    ])
    .trim()
    .parse()
    .unwrap();
    let g = kiln::nn::io::load_safetensors(dir.join("golden.safetensors")).unwrap();

    let mut model = LlamaForCausalLM::from_pretrained(base, DType::F32, Device::Cpu).unwrap();
    let cfg = load_adapter(&mut model, dir.join("adapter"), true).unwrap();
    model.train(true);
    let trainable = peft_named(&model);
    assert_eq!(trainable.iter().map(|(_, t)| t.numel()).sum::<usize>(), count, "{tag}: trainable parameters");
    let loss = check_logits_and_loss(tag, tol, &model, &ids, &g);
    loss.backward().unwrap();
    let (ga, gr) = tolerance(tol, "grad");
    for (n, p) in &trainable {
        assert_close(&format!("{tag} grad.{n}"), &p.grad().expect("a gradient"), &g[&format!("grad.{n}")], ga, gr);
    }
    let mut opt = AdamW::new(model.named_trainable_parameters(), ADAMW).unwrap();
    opt.step().unwrap();
    check_params(tol, &peft_named(&model), &g, "adamw_step1");
    let mut curve = vec![loss.item::<f32>().unwrap()];
    for _ in 0..3 {
        opt.zero_grad();
        let l = causal_lm_loss(&model.forward(&ids, None).unwrap(), &ids, None).unwrap();
        l.backward().unwrap();
        opt.step().unwrap();
        curve.push(l.item::<f32>().unwrap());
    }
    model.eval();
    let logits = model.forward(&ids, None).unwrap();
    curve.push(causal_lm_loss(&logits, &ids, None).unwrap().item::<f32>().unwrap());
    let (ca, cr) = tolerance(tol, "loss_curve");
    assert_close(&format!("{tag} loss_curve"), &Tensor::from_vec(curve, &[5]).unwrap(), &g["loss_curve"], ca, cr);

    // kiln's trained adapter, in PEFT's hands.
    let ours = dir.join("ours");
    save_adapter(&ours, &model, &cfg).unwrap();
    let out = dir.join("peft_logits.safetensors");
    peft(&["load".as_ref(), base.as_os_str(), ours.as_os_str(), ids_file.as_os_str(), out.as_os_str()]);
    let theirs = kiln::nn::io::load_safetensors(&out).unwrap();
    let (la, lr) = tolerance(tol, "logits");
    assert_close(&format!("{tag}: PEFT on kiln's adapter"), &logits, &theirs["logits"], la, lr);
    merge_and_unload(&mut model).unwrap();
    assert!(model.state_dict().keys().all(|k| !k.contains("lora_")), "{tag}: no adapter is left");
    let merged = model.forward(&ids, None).unwrap();
    assert_close(&format!("{tag}: merged"), &merged, &theirs["merged_logits"], la, lr);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn unseen_base_with_rslora_and_a_regex_matches_peft() {
    let base = support::temp_dir("lora-unseen-base");
    unseen_base(&base);
    let config = serde_json::json!({"seed": 1, "r": 4, "lora_alpha": 12, "use_rslora": true,
        "target_modules": ".*\\.(q_proj|v_proj|down_proj)", "lora_dropout": 0.0, "init_lora_weights": false});
    check_against_peft("unseen-rslora-regex", &base, "llama", config);
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn rank_and_alpha_patterns_and_exclusions_match_peft() {
    let config = serde_json::json!({"seed": 2, "r": 6, "lora_alpha": 16,
        "target_modules": ["q_proj", "k_proj", "gate_proj", "up_proj"], "rank_pattern": {"gate_proj": 3},
        "alpha_pattern": {"up_proj": 4}, "exclude_modules": ["model.layers.1.self_attn.k_proj"],
        "init_lora_weights": false});
    check_against_peft("patterns", &fixture_dir("qwen3"), "qwen3", config);
}

#[test]
fn all_linear_with_a_saved_head_matches_peft() {
    let config = serde_json::json!({"seed": 3, "r": 2, "lora_alpha": 5, "target_modules": "all-linear",
        "modules_to_save": ["lm_head"], "init_lora_weights": "gaussian"});
    check_against_peft("all-linear-head", &fixture_dir("llama"), "llama", config);
}

fn fixture_model(name: &str) -> LlamaForCausalLM {
    LlamaForCausalLM::from_pretrained(fixture_dir(name), DType::F32, Device::Cpu).unwrap()
}

fn names(v: &[&str]) -> TargetModules {
    TargetModules::Names(v.iter().map(|s| s.to_string()).collect())
}

#[test]
fn a_selection_kiln_cannot_honour_is_refused_and_changes_nothing() {
    let _g = support::rng_lock();
    let mut model = fixture_model("qwen3");
    let before = model.named_trainable_parameters().len();
    let refuse = |model: &mut LlamaForCausalLM, c: LoraConfig, want: &str| {
        let e = inject_adapter(model, &c).unwrap_err().to_string();
        assert!(e.contains(want), "{e}");
        assert_eq!(model.named_trainable_parameters().len(), before, "a refused injection freezes nothing");
        assert!(model.state_dict().keys().all(|k| !k.contains("lora_")), "a refused injection adds nothing");
    };
    refuse(
        &mut model,
        LoraConfig::new(4, names(&["mlp"])),
        "model.layers.0.mlp matches target_modules but is not a Linear",
    );
    refuse(
        &mut model,
        LoraConfig::new(4, names(&["q_norm"])),
        "self_attn.q_norm matches target_modules but is not a Linear",
    );
    refuse(&mut model, LoraConfig::new(4, names(&["nothing"])), "matched no module");
    refuse(&mut model, LoraConfig::new(4, TargetModules::Regex("(".into())), "does not compile");
    let mut c = LoraConfig::new(4, names(&["q_proj"]));
    c.modules_to_save = vec!["score".into()];
    refuse(&mut model, c, "modules_to_save names \"score\"");
    let mut c = LoraConfig::new(4, names(&["q_proj"]));
    c.rank_pattern = [("q_proj".to_string(), 2), ("self_attn.q_proj".to_string(), 3)].into_iter().collect();
    refuse(&mut model, c, "both match model.layers.0.self_attn.q_proj with different values");
    inject_adapter(&mut model, &LoraConfig::new(4, names(&["q_proj"]))).unwrap();
    let e = inject_adapter(&mut model, &LoraConfig::new(4, names(&["q_proj"]))).unwrap_err().to_string();
    assert!(e.contains("model.layers.0.self_attn.q_proj already has an adapter"), "{e}");
    let e = model.save_pretrained(support::temp_dir("lora-save-refused")).unwrap_err().to_string();
    assert!(e.contains("lora::save_adapter"), "{e}");
    // An adapter file short of a tensor is refused, and the model is left as it was.
    let mut model = fixture_model("llama");
    let dir = support::temp_dir("lora-short-file");
    let src = fixture_dir("lora_llama").join("adapter");
    std::fs::copy(src.join("adapter_config.json"), dir.join("adapter_config.json")).unwrap();
    let mut weights = kiln::nn::io::load_safetensors(src.join("adapter_model.safetensors")).unwrap();
    let gone = "base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight";
    weights.remove(gone).unwrap();
    kiln::nn::io::save_safetensors(dir.join("adapter_model.safetensors"), &weights, None).unwrap();
    let before = model.named_trainable_parameters().len();
    let e = load_adapter(&mut model, &dir, true).unwrap_err().to_string();
    assert!(e.contains(&format!("missing {gone}")), "{e}");
    assert_eq!(model.named_trainable_parameters().len(), before, "the parameters that trained still train");
    assert!(model.state_dict().keys().all(|k| !k.contains("lora_")), "no adapter is left");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn adapter_configs_with_fields_kiln_would_ignore_are_refused() {
    let ok = serde_json::json!({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
        "peft_version": "0.21.2", "loftq_config": {}, "layers_pattern": null, "use_dora": false});
    let c = LoraConfig::from_json(&ok).unwrap();
    assert_eq!((c.r, c.lora_alpha, c.init_lora_weights), (4, 8.0, LoraInit::Default));
    assert_eq!(LoraConfig::from_json(&c.to_json()).unwrap(), c, "to_json reads back as itself");
    for (field, value, want) in [
        ("fan_in_fan_out", serde_json::json!(true), "\"fan_in_fan_out\": true is not supported"),
        ("use_qalora", serde_json::json!(true), "\"use_qalora\": true is not supported"),
        ("layers_to_transform", serde_json::json!([0]), "\"layers_to_transform\" = [0] is not supported"),
        ("bias", serde_json::json!("all"), "bias \"all\""),
        ("init_lora_weights", serde_json::json!("pissa"), "init_lora_weights \"pissa\""),
        ("peft_type", serde_json::json!("IA3"), "only LORA"),
        ("lora_dropout", serde_json::json!(1.0), "lora_dropout must be in [0, 1)"),
        ("r", serde_json::json!(0), "at least 1"),
    ] {
        let mut v = ok.clone();
        v[field] = value;
        let e = LoraConfig::from_json(&v).unwrap_err().to_string();
        assert!(e.contains(want), "{field}: {e}");
    }
}

#[test]
fn merging_folds_the_adapter_into_the_weights_and_back() {
    let _g = support::rng_lock();
    let ids = &golden("lora_llama")["input_ids"];
    let mut model = fixture_model("llama");
    let base_logits = model.forward(ids, None).unwrap();
    let w0 = &model.model.layers[1].self_attn.q_proj.weight;
    let w0 = Tensor::from_vec(w0.to_vec::<f32>().unwrap(), w0.shape()).unwrap(); // a copy, not a view
    load_adapter(&mut model, fixture_dir("lora_llama").join("adapter"), false).unwrap();
    assert!(model.named_trainable_parameters().is_empty(), "loaded for inference: nothing trains");
    let adapted = model.forward(ids, None).unwrap();
    let (la, lr) = tolerance("llama", "logits");
    assert!(support::compare(&adapted, &base_logits, la, lr).0 > 100.0 * la, "the adapter changes the logits");
    assert_eq!(merge_adapter(&mut model).unwrap(), 12, "q, k, v and o of three layers");
    assert!(merge_adapter(&mut model).unwrap_err().to_string().contains("already merged"));
    assert_close("merged", &model.forward(ids, None).unwrap(), &adapted, la, lr);
    let w = model.model.layers[1].self_attn.q_proj.weight.clone();
    assert!(support::compare(&w, &w0, 1e-3, 0.0).0 > 1e-3, "the weight holds the update");
    unmerge_adapter(&mut model).unwrap();
    assert_close("unmerged weight", &w, &w0, 1e-6, 0.0);
    assert_close("unmerged", &model.forward(ids, None).unwrap(), &adapted, la, lr);
    assert!(unmerge_adapter(&mut model).unwrap_err().to_string().contains("not merged"));
    let state = adapter_state_dict(&model, &LoraConfig::new(16, names(&["q_proj"])));
    assert_eq!(state.len(), 24, "A and B of twelve layers: {:?}", state.keys().next());
}

#[test]
fn fresh_adapters_start_as_the_identity_and_drop_out_while_training() {
    let _g = support::rng_lock();
    kiln::manual_seed(0);
    let ids = &golden("lora_llama")["input_ids"];
    let mut model = fixture_model("llama");
    let base = model.forward(ids, None).unwrap();
    let mut c = LoraConfig::new(8, names(&["v_proj", "down_proj"]));
    c.lora_dropout = 0.5;
    inject_adapter(&mut model, &c).unwrap();
    // B starts at zero: the model is unchanged, and every B gets a gradient (A none).
    assert_eq!(model.forward(ids, None).unwrap().to_vec::<f32>().unwrap(), base.to_vec::<f32>().unwrap());
    model.train(true);
    causal_lm_loss(&model.forward(ids, None).unwrap(), ids, None).unwrap().backward().unwrap();
    for (n, p) in model.named_trainable_parameters() {
        let nonzero = p.grad().unwrap().to_vec::<f32>().unwrap().iter().any(|&x| x != 0.0);
        assert_eq!(nonzero, n.contains("lora_B"), "{n}");
    }
    // With B non-zero, dropout makes two training forwards differ; evaluation is deterministic.
    let _ng = kiln::autograd::no_grad();
    model.visit_params("", &mut |n, p| {
        if n.contains("lora_B") {
            p.copy_(&Tensor::randn(p.shape(), DType::F32).unwrap()).unwrap();
        }
    });
    let (a, b) = (model.forward(ids, None).unwrap(), model.forward(ids, None).unwrap());
    assert!(support::compare(&a, &b, 1e-3, 0.0).0 > 1e-3, "dropout is active while training");
    model.eval();
    let (a, b) = (model.forward(ids, None).unwrap(), model.forward(ids, None).unwrap());
    assert_eq!(a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
}

/// Asserts that `got` is as near the float64 result `exact` as the float32
/// computation `f32_ref` is, up to 4x (f32 products summed in another order
/// differ by a few roundings; a wrong scale or a lost gradient by far more):
/// the tolerance is the measured spread of float32, floored at one float32
/// rounding of the largest element. Returns the worst error.
fn within_f32_spread(what: &str, got: &Tensor, f32_ref: &Tensor, exact: &Tensor) -> f64 {
    let v = |t: &Tensor| t.to_dtype(DType::F64).unwrap().to_device(Device::Cpu).unwrap().to_vec::<f64>().unwrap();
    let (g, r, x) = (v(got), v(f32_ref), v(exact));
    let worst = |a: &[f64]| a.iter().zip(&x).map(|(a, b)| (a - b).abs()).fold(0f64, f64::max);
    let scale = x.iter().fold(0f64, |m, a| m.max(a.abs()));
    let (e, spread) = (worst(&g), worst(&r).max(scale * f32::EPSILON as f64));
    assert!(e <= 4.0 * spread, "{what}: {e:.3e} from float64, float32's own spread {spread:.3e}");
    e
}

/// QLoRA: an adapter over a kept-quantized base (codes and scales resident,
/// the base product dequantizing block by block) trains as the same adapter
/// over the base dequantized exactly: logits, adapter gradients and three
/// AdamW steps, on the CPU and on PJRT, in each quantized format, held to
/// float32's own spread around the float64 computation.
#[test]
fn qlora_over_kept_quantized_weights_equals_lora_over_the_dequantized_base() {
    use kiln::nn::models::{PretrainedOptions, QuantizedLoad};
    let _g = support::rng_lock();
    support::register_tpu();
    let mut worst = 0f64;
    for (format, dev) in
        [("fp8_block", Device::Cpu), ("ct_mxfp4", Device::Cpu), ("ct_nvfp4", Device::Cpu), ("ct_nvfp4", Device::Tpu(0))]
    {
        let dir = fixture_dir("quant").join(format);
        let ids = &kiln::nn::io::load_safetensors(dir.join("golden.safetensors")).unwrap()["input_ids"];
        let run = |quantized: QuantizedLoad, dtype: DType, dev: Device| -> (Tensor, Vec<(String, Tensor)>, Tensor) {
            let opts = PretrainedOptions::new(dtype, dev).with_quantized(quantized);
            let mut model = LlamaForCausalLM::from_pretrained_with(&dir, &opts).unwrap();
            kiln::manual_seed(9);
            let mut c = LoraConfig::new(8, TargetModules::Regex(r".*\.(q_proj|v_proj|up_proj|down_proj)".into()));
            c.lora_alpha = 16.0;
            c.init_lora_weights = LoraInit::Random;
            inject_adapter(&mut model, &c).unwrap();
            let ids = &ids.to_device(dev).unwrap();
            let logits = model.forward(ids, None).unwrap();
            causal_lm_loss(&logits, ids, None).unwrap().backward().unwrap();
            let grads = model.named_trainable_parameters().into_iter().map(|(n, p)| (n, p.grad().unwrap())).collect();
            let mut opt = AdamW::new(model.named_trainable_parameters(), ADAMW).unwrap();
            let mut curve = vec![];
            for _ in 0..3 {
                opt.step().unwrap();
                opt.zero_grad();
                let l = causal_lm_loss(&model.forward(ids, None).unwrap(), ids, None).unwrap();
                l.backward().unwrap();
                curve.push(l.to_dtype(DType::F64).unwrap().item::<f64>().unwrap());
            }
            (logits, grads, Tensor::from_vec(curve, &[3]).unwrap())
        };
        let (kl, kg, kc) = run(QuantizedLoad::Keep, DType::F32, dev);
        let (dl, dg, dc) = run(QuantizedLoad::Dequantize { round_to: None }, DType::F32, dev);
        let (xl, xg, xc) = run(QuantizedLoad::Dequantize { round_to: None }, DType::F64, Device::Cpu);
        let what = format!("QLoRA {format} on {dev}");
        worst = worst.max(within_f32_spread(&format!("{what} logits"), &kl, &dl, &xl));
        assert_eq!((kg.len(), dg.len()), (2 * 4 * 2, 2 * 4 * 2), "A and B of four layers in two decoder layers");
        for ((n, k), ((_, d), (_, x))) in kg.iter().zip(dg.iter().zip(&xg)) {
            worst = worst.max(within_f32_spread(&format!("{what} grad {n}"), k, d, x));
        }
        within_f32_spread(&format!("{what} losses after AdamW steps"), &kc, &dc, &xc);
    }
    println!("QLoRA against LoRA on the dequantized base: worst abs diff from float64 {worst:.2e}");
}

#[test]
fn dora_matches_peft() {
    let config = serde_json::json!({"seed": 4, "r": 4, "lora_alpha": 8, "use_dora": true,
        "target_modules": ["q_proj", "v_proj", "o_proj", "up_proj"], "init_lora_weights": false});
    check_against_peft("dora", &fixture_dir("llama"), "llama", config);
}

#[test]
fn dora_merges_and_unmerges() {
    let _g = support::rng_lock();
    kiln::manual_seed(2);
    let ids = &golden("lora_llama")["input_ids"];
    let mut model = fixture_model("llama");
    let w = model.model.layers[0].self_attn.v_proj.weight.clone();
    let w0 = Tensor::from_vec(w.to_vec::<f32>().unwrap(), w.shape()).unwrap();
    let mut c = LoraConfig::new(4, names(&["v_proj", "down_proj"]));
    c.use_dora = true;
    c.init_lora_weights = LoraInit::Random;
    inject_adapter(&mut model, &c).unwrap();
    // m starts at the row norms of the adapted weight: the layer's output is unchanged until m or the adapter moves.
    let adapted = model.forward(ids, None).unwrap();
    {
        let _ng = kiln::autograd::no_grad();
        model.visit_params("", &mut |n, p| {
            if n.ends_with("lora_magnitude_vector") {
                p.mul_(1.5).unwrap();
            }
        });
    }
    let scaled = model.forward(ids, None).unwrap();
    let (la, lr) = tolerance("llama", "logits");
    assert!(support::compare(&scaled, &adapted, la, lr).0 > 100.0 * la, "the magnitude scales the layers");
    // A DoRA layer's weight cannot be quantized under it (DoRA reads the dense weight).
    let mut q = model.clone();
    let e = kiln::nn::quantize::quantize_model(&mut q, kiln::nn::quantize::QuantScheme::Fp8Channel).unwrap_err();
    assert!(e.to_string().contains("has a DoRA adapter or a merged one"), "{e}");
    merge_adapter(&mut model).unwrap();
    assert_close("DoRA merged", &model.forward(ids, None).unwrap(), &scaled, la, lr);
    unmerge_adapter(&mut model).unwrap();
    assert_close("DoRA unmerged weight", &w, &w0, 1e-6, 0.0);
    assert_close("DoRA unmerged", &model.forward(ids, None).unwrap(), &scaled, la, lr);
}

/// QLoRA under bf16 autocast (`bf16-mixed`: the forward's products in
/// bfloat16, the adapters, their gradients and AdamW state in float32): the
/// adapter gradients are float32, and as near the float64 computation as
/// LoRA's over the dequantized base under the same autocast are (up to 2x,
/// tensor by tensor: bfloat16's own spread).
#[test]
fn qlora_trains_under_bf16_autocast() {
    use kiln::nn::models::{PretrainedOptions, QuantizedLoad};
    use kiln::nn::precision::MixedPrecisionPolicy;
    let _g = support::rng_lock();
    let dir = fixture_dir("quant").join("ct_nvfp4");
    let ids = &kiln::nn::io::load_safetensors(dir.join("golden.safetensors")).unwrap()["input_ids"];
    let grads = |quantized: QuantizedLoad, dtype: DType, policy: Option<&str>| -> Vec<(String, Tensor)> {
        let opts = PretrainedOptions::new(dtype, Device::Cpu).with_quantized(quantized);
        let mut model = LlamaForCausalLM::from_pretrained_with(&dir, &opts).unwrap();
        model.set_mixed_precision(policy.and_then(|p| MixedPrecisionPolicy::parse(p).unwrap())).unwrap();
        kiln::manual_seed(9);
        let mut c = LoraConfig::new(8, TargetModules::AllLinear);
        c.init_lora_weights = LoraInit::Random;
        inject_adapter(&mut model, &c).unwrap();
        causal_lm_loss(&model.forward(ids, None).unwrap(), ids, None).unwrap().backward().unwrap();
        model.named_trainable_parameters().into_iter().map(|(n, p)| (n, p.grad().unwrap())).collect()
    };
    let bf16 = grads(QuantizedLoad::Keep, DType::F32, Some("bf16-mixed"));
    let dense_bf16 = grads(QuantizedLoad::Dequantize { round_to: None }, DType::F32, Some("bf16-mixed"));
    let exact = grads(QuantizedLoad::Dequantize { round_to: None }, DType::F64, None);
    let rel = |g: &Tensor, x: &Tensor| {
        let (g, x) = (g.to_vec_f64().unwrap(), x.to_vec_f64().unwrap());
        let num: f64 = g.iter().zip(&x).map(|(a, b)| (a - b) * (a - b)).sum::<f64>().sqrt();
        num / x.iter().map(|b| b * b).sum::<f64>().sqrt()
    };
    let mut worst = 0f64;
    for (((n, g), (_, d)), (_, x)) in bf16.iter().zip(&dense_bf16).zip(&exact) {
        assert_eq!(g.dtype(), DType::F32, "{n}: the adapter's gradient is float32");
        let (e, spread) = (rel(g, x), rel(d, x));
        worst = worst.max(e);
        assert!(e <= 2.0 * spread, "{n}: relative L2 error {e:.3e}; dense LoRA under bf16 autocast {spread:.3e}");
    }
    println!("QLoRA under bf16 autocast: worst relative L2 error of an adapter gradient {worst:.2e}");
}
