//! Training tests: 10 AdamW steps of the fixture models against PyTorch's loss
//! curve and parameters (`../shared/fixtures/{llama,qwen3}/golden.safetensors`),
//! a tiny model that learns, and checkpoints: save, resume in a fresh model,
//! optimizer and loader, and get bit-identical losses.
mod support;

use kiln::nn::checkpoint::{
    checkpoint_dir, latest_checkpoint, list_checkpoints, load_checkpoint, prune_checkpoints, save_checkpoint,
    write_dir_atomic, TrainerState,
};
use kiln::nn::clip::clip_grad_norm_;
use kiln::nn::data::{ByteTokenizer, TokenLoader, Tokenizer};
use kiln::nn::io::load_safetensors;
use kiln::nn::models::{causal_lm_loss, LlamaConfig, LlamaForCausalLM};
use kiln::nn::module::Module;
use kiln::nn::optim::{decay_groups, AdamW, AdamWConfig, Optimizer};
use kiln::nn::schedule::LrSchedule;
use kiln::prelude::*;
use std::path::{Path, PathBuf};
use support::{python_with_safetensors, rng_lock, temp_dir};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/fixtures")
}

// ---- the golden fixtures -------------------------------------------------------------------------

/// `tolerances.json` entry `suggested.{key}` of a model: `(atol, rtol, small_grad_atol)`.
fn tolerance(tol: &serde_json::Value, model: &str, key: &str) -> (f32, f32, f32) {
    let t = &tol[model]["suggested"][key];
    let f = |k: &str| t[k].as_f64().unwrap_or(0.0) as f32;
    (f("atol"), f("rtol"), f("small_grad_atol"))
}

/// Checks parameters against `{prefix}.{name}` tensors of the golden file with
/// the fixture's tolerance, widened to `small_grad_atol` where the golden
/// step-1 gradient is tiny but not zero (the README's AdamW caveat: there the
/// update's sign depends on rounding noise). Returns the largest difference.
fn check_params(
    model_name: &str,
    named: &[(String, Tensor)],
    golden: &std::collections::BTreeMap<String, Tensor>,
    prefix: &str,
    (atol, rtol, small_atol): (f32, f32, f32),
) -> f32 {
    let mut worst = 0.0f32;
    for (name, p) in named {
        let want = golden[&format!("{prefix}.{name}")].to_vec::<f32>().unwrap();
        let grad = golden[&format!("grad.{name}")].to_vec::<f32>().unwrap();
        let got = p.to_vec::<f32>().unwrap();
        for i in 0..want.len() {
            let small = grad[i] != 0.0 && grad[i].abs() < 1e-6;
            let a = if small { small_atol } else { atol };
            let d = (got[i] - want[i]).abs();
            assert!(
                d <= a + rtol * want[i].abs(),
                "{model_name} {prefix}.{name}[{i}]: got {}, want {}",
                got[i],
                want[i]
            );
            if !small {
                worst = worst.max(d);
            }
        }
    }
    worst
}

/// Ten AdamW steps on the fixture batch (lr 1e-3, betas (0.9, 0.95), eps 1e-8,
/// weight decay 0.1 on every parameter, one group): the loss before each step
/// and after the last match PyTorch's `loss_curve`, and the parameters after
/// steps 1 and 10 match `adamw_step1.*` / `adamw_step10.*`.
#[test]
fn ten_adamw_steps_match_pytorch_on_the_fixture_models() {
    let root = fixtures();
    let tol: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("tolerances.json")).unwrap()).unwrap();
    for name in ["llama", "qwen3"] {
        let dir = root.join(name);
        let model = LlamaForCausalLM::from_pretrained(&dir, DType::F32, Device::Cpu).unwrap();
        let golden = load_safetensors(dir.join("golden.safetensors")).unwrap();
        let ids = &golden["input_ids"];
        let named = model.named_parameters();
        let cfg = AdamWConfig { lr: 1e-3, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1, amsgrad: false };
        let mut opt = AdamW::new(named.clone(), cfg).unwrap();
        let mut losses = vec![];
        for step in 1..=10 {
            let loss = causal_lm_loss(&model.forward(ids, None).unwrap(), ids, None).unwrap();
            losses.push(loss.item::<f32>().unwrap());
            loss.backward().unwrap();
            opt.step().unwrap();
            opt.zero_grad();
            if step == 1 {
                let w = check_params(name, &named, &golden, "adamw_step1", tolerance(&tol, name, "adamw_step1"));
                eprintln!("{name}: after step 1, max |kiln - torch| = {w:e}");
            }
        }
        losses.push(causal_lm_loss(&model.forward(ids, None).unwrap(), ids, None).unwrap().item::<f32>().unwrap());
        let want = golden["loss_curve"].to_vec::<f32>().unwrap();
        let (atol, rtol, _) = tolerance(&tol, name, "loss_curve");
        for (k, (g, w)) in losses.iter().zip(&want).enumerate() {
            assert!((g - w).abs() <= atol + rtol * w.abs(), "{name} loss_curve[{k}]: got {g}, want {w}");
        }
        assert!(losses[10] < losses[0] - 0.1, "{name}: the loss goes down: {losses:?}");
        let w = check_params(name, &named, &golden, "adamw_step10", tolerance(&tol, name, "adamw_step10"));
        eprintln!("{name}: loss curve {losses:?}; after step 10, max |kiln - torch| = {w:e}");
    }
}

// ---- a tiny model ----------------------------------------------------------------------------------

fn tiny_config(dropout: f64) -> LlamaConfig {
    LlamaConfig::from_json(&serde_json::json!({
        "model_type": "llama", "vocab_size": 256, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "attention_dropout": dropout,
    }))
    .unwrap()
}

const TEXT: &str = "the quick brown fox jumps over the lazy dog. ";

fn loader(batch: usize, seq: usize) -> TokenLoader {
    TokenLoader::new(ByteTokenizer.encode(&TEXT.repeat(20)).unwrap(), batch, seq).unwrap().with_seed(5)
}

/// Model, optimizer (decay groups, warmup + cosine), built from `init_seed`.
fn setup(init_seed: u64, dropout: f64) -> (LlamaForCausalLM, AdamW) {
    kiln::manual_seed(init_seed);
    let mut model = LlamaForCausalLM::new(&tiny_config(dropout), DType::F32).unwrap();
    model.train(true);
    let cfg = AdamWConfig { lr: 1e-2, betas: (0.9, 0.95), weight_decay: 0.1, ..Default::default() };
    let opt = AdamW::new(decay_groups(model.named_parameters(), 0.1), cfg).unwrap();
    (model, opt)
}

const SCHEDULE: LrSchedule = LrSchedule::Cosine { warmup: 2, total: 8, min_lr_ratio: 0.1 };

/// Training steps `from..to`: the loss of each, as bits.
fn train(model: &LlamaForCausalLM, opt: &mut AdamW, data: &mut TokenLoader, from: u64, to: u64) -> Vec<u32> {
    let mut losses = vec![];
    for step in from..to {
        let batch = data.next_batch().unwrap();
        SCHEDULE.apply(opt, step);
        let loss = causal_lm_loss(&model.forward(&batch, None).unwrap(), &batch, None).unwrap();
        loss.backward().unwrap();
        clip_grad_norm_(&opt.params(), 1.0).unwrap();
        opt.step().unwrap();
        opt.zero_grad();
        losses.push(loss.item::<f32>().unwrap().to_bits());
    }
    losses
}

#[test]
fn a_tiny_llama_learns_a_repeated_sentence() {
    let _rng = rng_lock();
    let (model, mut opt) = setup(0, 0.0);
    opt.set_lr(3e-2);
    let mut data = loader(4, 16);
    let mut losses = vec![];
    for _ in 0..40 {
        let batch = data.next_batch().unwrap();
        let loss = causal_lm_loss(&model.forward(&batch, None).unwrap(), &batch, None).unwrap();
        loss.backward().unwrap();
        opt.step().unwrap();
        opt.zero_grad();
        losses.push(loss.item::<f32>().unwrap());
    }
    let (first, last) = (losses[0], *losses.last().unwrap());
    assert!((first - 256f32.ln()).abs() < 0.3, "starts near ln(256): {first}");
    assert!(last < 0.4 * first, "learns: {first} -> {last} ({losses:?})");
}

/// Train 8 steps; or train 4, checkpoint, rebuild everything from another seed,
/// restore, train 4 more: the losses and final weights are bit-identical.
/// Attention dropout is on, so the restored global generator matters too.
#[test]
fn resuming_from_a_checkpoint_reproduces_the_uninterrupted_run() {
    let _rng = rng_lock();
    let (model, mut opt) = setup(0, 0.1);
    let mut data = loader(2, 12);
    let full = train(&model, &mut opt, &mut data, 0, 8);
    let full_weights: Vec<Vec<f32>> = model.parameters().iter().map(|p| p.to_vec::<f32>().unwrap()).collect();

    let out = temp_dir("resume");
    let (model, mut opt) = setup(0, 0.1);
    let mut data = loader(2, 12);
    let first = train(&model, &mut opt, &mut data, 0, 4);
    assert_eq!(first, full[..4]);
    let config = serde_json::to_string(&model.config().to_json(DType::F32)).unwrap();
    let state = TrainerState::capture(4, Some(data.state())).unwrap().with_extra(serde_json::json!({"note": "test"}));
    save_checkpoint(checkpoint_dir(&out, 4), &model, Some(&config), &opt, &state).unwrap();
    let mut model = model;
    model.eval(); // no dropout, for the comparison below
    let logits_at_4 = model.forward(&Tensor::new([[1i64, 2, 3]]).unwrap(), None).unwrap().to_vec::<f32>().unwrap();
    drop((model, opt, data));

    // A fresh process in all but name: other weights, another generator state, a new loader.
    let (mut model, mut opt) = setup(77, 0.1);
    kiln::manual_seed(12345);
    let mut data = loader(2, 12);
    let dir = latest_checkpoint(&out).unwrap().expect("a checkpoint");
    assert_eq!(dir, checkpoint_dir(&out, 4));
    let ckpt = load_checkpoint(&dir).unwrap();
    assert_eq!(ckpt.state.step, 4);
    assert_eq!(ckpt.state.extra["note"], "test");
    ckpt.restore(&mut model, &mut opt).unwrap();
    data.set_state(ckpt.state.loader.unwrap()).unwrap();
    let rest = train(&model, &mut opt, &mut data, 4, 8);
    assert_eq!(rest, full[4..], "losses after resuming");
    let weights: Vec<Vec<f32>> = model.parameters().iter().map(|p| p.to_vec::<f32>().unwrap()).collect();
    assert_eq!(weights, full_weights, "final weights");

    // The checkpoint is also a Hugging Face model directory.
    for f in ["config.json", "model.safetensors", "optimizer.safetensors", "trainer_state.json"] {
        assert!(dir.join(f).is_file(), "{f}");
    }
    let mut pretrained = LlamaForCausalLM::from_pretrained(&dir, DType::F32, Device::Cpu).unwrap();
    pretrained.eval();
    let logits = pretrained.forward(&Tensor::new([[1i64, 2, 3]]).unwrap(), None).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(logits, logits_at_4);
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn checkpoints_are_replaced_atomically_listed_and_pruned() {
    let _rng = rng_lock();
    let out = temp_dir("atomic");
    let (model, opt) = setup(0, 0.0);
    for step in [10, 20, 30] {
        let s = TrainerState::capture(step, None).unwrap();
        save_checkpoint(checkpoint_dir(&out, step), &model, None, &opt, &s).unwrap();
    }
    // Saving the same step again replaces it.
    save_checkpoint(checkpoint_dir(&out, 20), &model, None, &opt, &TrainerState::capture(20, None).unwrap()).unwrap();
    let steps: Vec<u64> = list_checkpoints(&out).unwrap().into_iter().map(|(s, _)| s).collect();
    assert_eq!(steps, [10, 20, 30]);
    // No temporary directories are left behind.
    let names: Vec<String> =
        std::fs::read_dir(&out).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    assert!(names.iter().all(|n| n.starts_with("checkpoint-")), "{names:?}");
    prune_checkpoints(&out, 1).unwrap();
    assert_eq!(latest_checkpoint(&out).unwrap(), Some(checkpoint_dir(&out, 30)));
    assert_eq!(list_checkpoints(&out).unwrap().len(), 1);
    // A failed write leaves the existing directory untouched.
    let target = checkpoint_dir(&out, 30);
    let e = write_dir_atomic(&target, |_| Err(Error::invalid("test", "disk full"))).unwrap_err();
    assert!(e.to_string().contains("disk full"));
    assert!(load_checkpoint(&target).is_ok());
    assert_eq!(std::fs::read_dir(&out).unwrap().count(), 1);
    // An optimizer that never stepped has an empty state; the file still exists.
    assert!(load_checkpoint(&target).unwrap().optimizer_state().unwrap().is_empty());
    // Errors name the file.
    let e = load_checkpoint(out.join("nope")).unwrap_err().to_string();
    assert!(e.contains("trainer_state.json") && e.contains("cannot read"), "{e}");
    assert!(latest_checkpoint(out.join("missing")).unwrap().is_none());
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn trainer_state_round_trips_through_json() {
    let _rng = rng_lock();
    kiln::manual_seed(9);
    let s = TrainerState::capture(17, None).unwrap();
    let back = TrainerState::from_json(&s.to_json()).unwrap();
    assert_eq!(back, s);
    let e = TrainerState::from_json(&serde_json::json!({"format": "x"})).unwrap_err().to_string();
    assert!(e.contains("unknown format"), "{e}");
    // Restoring the generator replays the same draws.
    let a = Tensor::rand(&[4], DType::F32).unwrap().to_vec::<f32>().unwrap();
    s.restore_rng().unwrap();
    assert_eq!(Tensor::rand(&[4], DType::F32).unwrap().to_vec::<f32>().unwrap(), a);
}

// ---- interoperability ------------------------------------------------------------------------------

#[test]
fn a_trained_checkpoint_loads_back_into_kiln_and_into_transformers() {
    let _g = rng_lock();
    kiln::manual_seed(11);
    let cfg = tiny_config(0.0);
    let model = LlamaForCausalLM::new(&cfg, DType::F32).unwrap();
    let mut opt = AdamW::new(model.parameters(), AdamWConfig::default()).unwrap();
    let mut data = loader(2, 16);
    for _ in 0..2 {
        let batch = data.next_batch().unwrap();
        causal_lm_loss(&model.forward(&batch, None).unwrap(), &batch, None).unwrap().backward().unwrap();
        opt.step().unwrap();
        opt.zero_grad();
    }
    let dir = temp_dir("interop");
    model.save_pretrained(&dir).unwrap();

    // Back into kiln: the same logits.
    let probe = data.next_batch().unwrap();
    let back = LlamaForCausalLM::from_pretrained(&dir, DType::F32, Device::Cpu).unwrap();
    let (a, b) = (model.forward(&probe, None).unwrap(), back.forward(&probe, None).unwrap());
    assert_eq!(a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap(), "reloaded model differs");

    // Into Python's safetensors, checked against what transformers' loader needs.
    let py = python_with_safetensors();
    let checker = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/check_hf_checkpoint.py");
    let out = std::process::Command::new(&py).arg(&checker).arg(&dir).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let sums = report["sums"].as_object().unwrap();
    let state = model.state_dict();
    assert_eq!(sums.len(), state.len(), "python sees {:?}", sums.keys().collect::<Vec<_>>());
    for (name, t) in &state {
        let want: f64 = t.to_dtype(DType::F64).unwrap().to_vec::<f64>().unwrap().iter().sum();
        let got = sums[name.as_str()].as_f64().unwrap_or_else(|| panic!("python lacks {name}"));
        assert!((got - want).abs() <= 1e-9 * want.abs().max(1.0), "{name}: python sum {got}, kiln {want}");
    }

    // Into transformers itself: from_pretrained on kiln's directory, with no
    // missing or unexpected key, gives kiln's logits (within the llama
    // fixture's f32 tolerance against transformers).
    let ids_file = dir.join("ids.safetensors");
    let ids = std::collections::BTreeMap::from([("input_ids".to_string(), probe.to_dtype(DType::I64).unwrap())]);
    kiln::nn::io::save_safetensors(&ids_file, &ids, None).unwrap();
    let out_file = dir.join("transformers_logits.safetensors");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/check_dense_with_transformers.py");
    let out = std::process::Command::new(support::python_with_transformers())
        .arg(&script)
        .arg(&dir)
        .arg(&ids_file)
        .arg(&out_file)
        .output()
        .unwrap();
    assert!(out.status.success(), "transformers refused kiln's checkpoint:\n{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "LlamaForCausalLM");
    let theirs = load_safetensors(&out_file).unwrap();
    let (atol, rtol) = support::tolerance("llama", "logits");
    let worst = support::assert_close("transformers on kiln's checkpoint", &a, &theirs["logits"], atol, rtol);
    eprintln!("transformers' logits on kiln's checkpoint: max abs diff {worst:e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn whole_model_gradients_match_finite_differences_in_f64() {
    // Every parameter of a small Llama (GQA, RoPE, SwiGLU, tied-off lm_head), the
    // causal LM loss included: a few entries per tensor against central differences.
    let _g = rng_lock();
    kiln::manual_seed(3);
    let cfg = tiny_config(0.0);
    let model = LlamaForCausalLM::new(&cfg, DType::F64).unwrap();
    let ids = Tensor::randint(0, 256, &[2, 7], DType::I64).unwrap();
    let loss = || causal_lm_loss(&model.forward(&ids, None).unwrap(), &ids, None).unwrap();
    loss().backward().unwrap();
    let eps = 1e-6;
    let mut bad = vec![];
    for (name, p) in model.named_parameters() {
        let grad = p.grad().unwrap_or_else(|| panic!("{name}: no gradient"));
        let g = grad.to_vec::<f64>().unwrap();
        let n = p.numel();
        for j in [0, n / 3, n / 2, n - 1] {
            let flat = p.reshape(&[-1]).unwrap();
            let at = |v: f64| {
                let _ng = kiln::autograd::no_grad();
                flat.i(j as isize).unwrap().fill_(v).unwrap();
                loss().item_f64().unwrap()
            };
            let x0 = flat.i(j as isize).unwrap().item_f64().unwrap();
            let (lp, lm) = (at(x0 + eps), at(x0 - eps));
            let after = flat.i(j as isize).unwrap().item_f64().unwrap();
            let num = (lp - lm) / (2.0 * eps);
            let _ = after;
            at(x0);
            if (num - g[j]).abs() > 1e-6 + 1e-4 * num.abs() {
                bad.push(format!("{name}[{j}]: autograd {} vs numeric {num}", g[j]));
            }
        }
    }
    assert!(bad.is_empty(), "{} mismatches:\n{}", bad.len(), bad.join("\n"));
}

#[test]
fn trainer_state_keeps_the_generator_of_every_device() {
    let _rng = rng_lock();
    support::register_tpu();
    let tpu = Device::Tpu(0);
    kiln::manual_seed(4);
    Tensor::rand(&[3], DType::F32).unwrap();
    Tensor::rand(&[5], (DType::F32, tpu)).unwrap();
    let s = TrainerState::capture(3, None).unwrap();
    assert!(s.generators.iter().any(|(d, _)| *d == tpu) && s.generators.iter().any(|(d, _)| *d == Device::Cpu));
    let json = s.to_json();
    assert!(json["generators"]["tpu:0"].is_array() && json["generators"]["cpu"].is_array(), "{json}");
    let back = TrainerState::from_json(&json).unwrap();
    assert_eq!(back, s);
    let draw = || {
        let a = Tensor::rand(&[6], DType::F32).unwrap().to_vec::<f32>().unwrap();
        let b = Tensor::rand(&[6], (DType::F32, tpu)).unwrap().to_vec::<f32>().unwrap();
        (a, b)
    };
    let first = draw();
    kiln::manual_seed(999);
    back.restore_rng().unwrap();
    assert_eq!(draw(), first, "both devices continue their streams");
    // A state written by the older generator is refused, not silently reseeded.
    let mut old = json.clone();
    old["format"] = serde_json::json!("kiln-trainer-state-1");
    let e = TrainerState::from_json(&old).unwrap_err().to_string();
    assert!(e.contains("older kiln") && e.contains("random stream"), "{e}");
}
