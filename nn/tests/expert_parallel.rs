//! Expert parallelism (`--parallel ep` / `fsdp+ep`) on four XLA:CPU devices:
//! the qwen3_moe fixture reproduced with the experts split over `ep` (logits,
//! loss, every gradient under the Hub's names, AdamW steps 1 and 10, the
//! loss curve, greedy generation) in Strict, Debug and DeferAndFuse mode and
//! with the training steps captured by `kiln::compile`;
//! an unseen mixture of experts (two experts per device, token counts that
//! do not split evenly, one token, none) equal to the same model on the CPU, saved from the
//! mesh and read back; the bytes the exchange sends; and the errors.
mod support;

use kiln::nn::generate::{generate, Sampling};
use kiln::nn::io::load_safetensors;
use kiln::nn::layers::to_hub_layout;
use kiln::nn::models::{causal_lm_loss, LlamaConfig, LlamaForCausalLM};
use kiln::nn::module::Module;
use kiln::nn::optim::{AdamW, AdamWConfig, Optimizer};
use kiln::nn::parallel::{parse_mesh, Recipe};
use kiln::prelude::*;
use kiln::tpu::{with_mode, Mode};
use kiln::{DeviceKind, Placement};
use std::collections::BTreeMap;
use support::{
    assert_close, check_logits_and_loss, check_params, fixture_dir, nine_more_steps, register_tpu_with_devices,
    rng_lock, temp_dir, tolerance,
};

fn four_devices() {
    register_tpu_with_devices(4);
}

/// Named parameters (or their gradients) under the Hub's per-expert names.
fn hub(named: Vec<(String, Tensor)>) -> Vec<(String, Tensor)> {
    to_hub_layout(named.into_iter().collect()).unwrap().into_iter().collect()
}

fn all_to_all_bytes() -> u64 {
    kiln::tpu::stats().unwrap().all_to_all_bytes
}

/// How `check_fixture` runs after the first gradient.
#[derive(Clone, Copy, PartialEq)]
enum Then {
    /// Ten AdamW steps, eagerly.
    Steps,
    /// Ten AdamW steps, steps 2-10 captured by `kiln::compile`.
    CompiledSteps,
    /// Greedy generation.
    Generate,
}

/// The qwen3_moe fixture under `recipe` on the mesh `spec`: every golden value.
fn check_fixture(spec: &str, recipe: Recipe, then: Then) {
    four_devices();
    // The tests of this binary run one at a time: one of them counts the bytes all of them send.
    let _one = rng_lock();
    let name = "qwen3_moe";
    let g = load_safetensors(fixture_dir(name).join("golden.safetensors")).unwrap();
    let mesh = parse_mesh(spec, DeviceKind::Tpu).unwrap();
    let mut model = LlamaForCausalLM::from_pretrained(fixture_dir(name), DType::F32, mesh.device()).unwrap();
    recipe.apply(&mut model, &mesh).unwrap();
    let what = format!("{name} {recipe:?} on {spec}");
    // The experts are split over "ep" (and, with FSDP, their rows over "dp").
    let params: BTreeMap<String, Tensor> = model.named_parameters().into_iter().collect();
    let up = &params["model.layers.1.mlp.experts.up_proj"];
    assert_eq!(up.shape(), &[4, 48, 64]);
    let want = match recipe {
        Recipe::Ep => vec![Placement::Shard(0)],
        _ => vec![Placement::Shard(1), Placement::Shard(0)],
    };
    assert_eq!(up.placements().unwrap(), want, "{what}");

    let ids = recipe.place_batch(&g["input_ids"], &mesh).unwrap();
    let loss = check_logits_and_loss(&what, name, &model, &ids, &g);
    loss.backward().unwrap();
    let (ga, gr) = tolerance(name, "grad");
    let grads = model.named_parameters().into_iter().map(|(n, p)| {
        let grad = p.grad().unwrap_or_else(|| panic!("{what}: {n} got no gradient"));
        (n, grad)
    });
    let grads = hub(grads.collect());
    assert_eq!(grads.len(), g.keys().filter(|k| k.starts_with("grad.")).count(), "{what}: every golden gradient");
    for (n, grad) in &grads {
        assert_close(&format!("{what} grad.{n}"), grad, &g[&format!("grad.{n}")], ga, gr);
    }
    if then != Then::Generate {
        let cfg = AdamWConfig { lr: 1e-3, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1, amsgrad: false };
        let mut opt = AdamW::new(model.named_parameters(), cfg).unwrap();
        let compiled = then == Then::CompiledSteps;
        opt.set_capturable(compiled).unwrap();
        let mut curve = vec![loss.item::<f32>().unwrap()];
        opt.step().unwrap();
        check_params(name, &hub(model.named_parameters()), &g, "adamw_step1");
        let before = all_to_all_bytes();
        curve.extend(nine_more_steps(&what, &model, &mut opt, &ids, mesh.device(), compiled));
        // Every step's program ran its exchanges (counted per run, replays included), and the
        // last loss's forward its forward ones.
        assert!(all_to_all_bytes() > before, "{what}");
        check_params(name, &hub(model.named_parameters()), &g, "adamw_step10");
        let (ca, cr) = tolerance(name, "loss_curve");
        let n = curve.len();
        let curve = Tensor::from_vec(curve, &[n]).unwrap();
        assert_close(&format!("{what} loss curve"), &curve, &g["loss_curve"], ca.max(5e-5), cr);
    } else {
        // Greedy generation from the fixture's weights (its two prompts, split over the devices).
        let prompt = recipe.place_batch(&g["generate.prompt"], &mesh).unwrap();
        let new = g["generate.output"].shape()[1] - prompt.shape()[1];
        let out = generate(&model, &prompt, new, &Sampling::greedy()).unwrap();
        assert_eq!(out.to_vec::<i64>().unwrap(), g["generate.output"].to_vec::<i64>().unwrap(), "{what}");
    }
}

#[test]
fn expert_parallelism_reproduces_the_fixture() {
    check_fixture("ep=4", Recipe::Ep, Then::Steps);
    check_fixture("ep=4", Recipe::Ep, Then::CompiledSteps);
    with_mode(Mode::Debug, || check_fixture("ep=4", Recipe::Ep, Then::Generate));
}

#[test]
fn fsdp_times_expert_parallelism_reproduces_the_fixture() {
    check_fixture("dp=2,ep=2", Recipe::FsdpEp, Then::Steps);
    check_fixture("dp=2,ep=2", Recipe::FsdpEp, Then::CompiledSteps);
    with_mode(Mode::Defer, || check_fixture("dp=2,ep=2", Recipe::FsdpEp, Then::Generate));
}

fn unseen_config(experts: usize) -> LlamaConfig {
    LlamaConfig::from_json_str(&format!(
        r#"{{"model_type": "qwen3_moe", "vocab_size": 40, "hidden_size": 24, "intermediate_size": 32,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 6,
            "moe_intermediate_size": 20, "num_experts": {experts}, "num_experts_per_tok": 3,
            "norm_topk_prob": false, "mlp_only_layers": [1], "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "initializer_range": 0.3}}"#
    ))
    .unwrap()
}

#[test]
fn an_unseen_mixture_of_experts_under_ep_equals_one_device_and_saves_in_the_hub_layout() {
    four_devices();
    let _rng = rng_lock();
    kiln::manual_seed(11);
    // Eight experts, three per token, two per device; one dense layer; 15 tokens on 4 devices.
    let cfg = unseen_config(8);
    let one = LlamaForCausalLM::new(&cfg, DType::F32).unwrap();
    let ids = Tensor::randint(0, 40, &[3, 5], DType::I64).unwrap();
    let mesh = parse_mesh("ep=4", DeviceKind::Tpu).unwrap();
    let mut ep = one.clone();
    Recipe::Ep.apply(&mut ep, &mesh).unwrap();

    let want = causal_lm_loss(&one.forward(&ids, None).unwrap(), &ids, None).unwrap();
    want.backward().unwrap();
    let before = all_to_all_bytes();
    let dist_ids = Recipe::Ep.place_batch(&ids, &mesh).unwrap();
    let logits = ep.forward(&dist_ids, None).unwrap();
    // Two sparse layers, each sending rows [4 devices, 4 tokens * 3 slots, 24] f32 and
    // counts [4, 2] int64, three quarters of each to other devices, from every device.
    let (rows, counts) = (4 * 12 * 24 * 4, 4 * 2 * 8);
    assert_eq!(all_to_all_bytes() - before, (2 * 4 * (2 * rows + counts) * 3 / 4) as u64);
    let got = causal_lm_loss(&logits, &dist_ids, None).unwrap();
    assert_close("loss", &got, &want, 1e-5, 1e-5);
    assert_close("logits", &logits, &one.forward(&ids, None).unwrap(), 1e-5, 1e-5);
    // The backward sends each exchange's gradient back once and recomputes
    // no forward exchange: the rows twice per sparse layer, no counts.
    let before = all_to_all_bytes();
    got.backward().unwrap();
    assert_eq!(all_to_all_bytes() - before, (2 * 4 * (2 * rows) * 3 / 4) as u64);
    let grads = hub(ep.named_parameters().into_iter().map(|(n, p)| (n, p.grad().unwrap())).collect());
    let grads: BTreeMap<String, Tensor> = grads.into_iter().collect();
    assert_eq!(grads.len(), one.named_parameters().len());
    for (n, p) in one.named_parameters() {
        assert_close(&format!("grad {n}"), &grads[&n], &p.grad().unwrap(), 1e-5, 1e-4);
    }

    // One token (three padding ones) and none, through a block alone.
    let (mine, theirs) = (ep.model.layers[0].mlp.as_sparse().unwrap(), one.model.layers[0].mlp.as_sparse().unwrap());
    let x = Tensor::randn(&[1, 24], DType::F32).unwrap();
    let got = mine.forward(&x.to_device(mesh.device()).unwrap()).unwrap();
    assert_close("one token", &got, &theirs.forward(&x).unwrap(), 1e-5, 1e-5);
    let none = mine.forward(&Tensor::zeros(&[0, 24], (DType::F32, mesh.device())).unwrap()).unwrap();
    assert_eq!(none.shape(), &[0, 24]);

    // Saved from the mesh under the Hub's names, read back on the CPU.
    let dir = temp_dir("ep-save");
    ep.save_pretrained(&dir).unwrap();
    let back = LlamaForCausalLM::from_pretrained(&dir, DType::F32, Device::Cpu).unwrap();
    assert!(back.named_parameters().iter().any(|(n, _)| n == "model.layers.2.mlp.experts.7.down_proj.weight"));
    assert_close("reloaded", &back.forward(&ids, None).unwrap(), &one.forward(&ids, None).unwrap(), 0.0, 0.0);
    let _ = std::fs::remove_dir_all(&dir);
}

/// One sparse block on tokens `x` with GShard's token dropping, on the host:
/// each group of `block` tokens (one device's) sends each of the `p` expert
/// devices at most `cap` of its slots, in the order of its slots sorted by
/// expert; the block's output and the router's weights as the block computes
/// them, with every expert's SwiGLU from its Hub-named weights.
fn dropping_block(
    block: &kiln::nn::layers::SparseMoeBlock,
    x: &Tensor,
    per_device: usize,
    p: usize,
    cap: usize,
) -> Tensor {
    let (_, weights, idx) = block.route(x).unwrap();
    let params: BTreeMap<String, Tensor> = hub(block.named_parameters()).into_iter().collect();
    let (n, k) = (idx.shape()[0], idx.shape()[1]);
    let experts = params.keys().filter(|n| n.ends_with(".gate_proj.weight") && n.starts_with("experts.")).count();
    let local = experts / p;
    let idx_host = idx.to_vec::<i64>().unwrap();
    let mut keep = vec![0f32; n * k];
    for start in (0..n).step_by(per_device) {
        let slots: Vec<usize> = (start * k..((start + per_device).min(n)) * k).collect();
        let mut sorted = slots.clone();
        sorted.sort_by_key(|&s| idx_host[s]); // stable: slot order within an expert
        let mut sent = vec![0; p];
        for s in sorted {
            let dest = idx_host[s] as usize / local;
            if sent[dest] < cap {
                keep[s] = 1.0;
            }
            sent[dest] += 1;
        }
    }
    let keep = Tensor::from_vec(keep, &[n, k]).unwrap();
    let weights = weights.mul(&keep).unwrap();
    let mut out = x.zeros_like().unwrap();
    for e in 0..experts {
        let w = |proj: &str| params[&format!("experts.{e}.{proj}.weight")].clone();
        let g = x.matmul(&w("gate_proj").t().unwrap()).unwrap();
        let u = x.matmul(&w("up_proj").t().unwrap()).unwrap();
        let y = g.silu().unwrap().mul(&u).unwrap().matmul(&w("down_proj").t().unwrap()).unwrap();
        let chose = idx.eq(e as f64).unwrap().to_dtype(DType::F32).unwrap();
        let scale = weights.mul(&chose).unwrap().sum_dim(1, true).unwrap();
        out = out.add(&y.mul(&scale).unwrap()).unwrap();
    }
    out
}

#[test]
fn a_capacity_factor_drops_the_slots_past_each_destinations_capacity() {
    four_devices();
    let _rng = rng_lock();
    kiln::manual_seed(5);
    // Eight experts, three per token, two per device; 16 tokens, 4 per device: 12 slots each.
    let one = LlamaForCausalLM::new(&unseen_config(8), DType::F32).unwrap();
    let mesh = parse_mesh("ep=4", DeviceKind::Tpu).unwrap();
    let mut ep = one.clone();
    Recipe::Ep.apply(&mut ep, &mesh).unwrap();
    let theirs = one.model.layers[0].mlp.as_sparse().unwrap().clone();
    let x = Tensor::randn(&[16, 24], DType::F32).unwrap();
    let run = |factor: Option<f64>| {
        let mut m = ep.clone();
        m.set_expert_capacity_factor(factor).unwrap();
        let block = m.model.layers[0].mlp.as_sparse().unwrap().clone();
        let xd = x.to_device(mesh.device()).unwrap().detach();
        xd.requires_grad_(true).unwrap();
        let before = all_to_all_bytes();
        let y = block.forward(&xd).unwrap();
        let sent = all_to_all_bytes() - before;
        y.mul(&y).unwrap().sum().unwrap().backward().unwrap();
        (y, xd.grad().unwrap(), sent)
    };
    let reference = |cap: usize| {
        let xr = x.detach();
        xr.requires_grad_(true).unwrap();
        let y = dropping_block(&theirs, &xr, 4, 4, cap);
        y.mul(&y).unwrap().sum().unwrap().backward().unwrap();
        (y, xr.grad().unwrap())
    };
    // Rows [4 destinations, cap, 24] f32 (twice) and counts [4, 2] int64, three quarters sent away.
    let bytes = |cap: usize| (4 * (2 * 4 * cap * 24 * 4 + 4 * 2 * 8) * 3 / 4) as u64;
    // Dropless (and a factor of at least the device count): the one-device block.
    for factor in [None, Some(4.0)] {
        let (y, gx, sent) = run(factor);
        let (want, want_gx) = reference(12);
        assert_close("dropless", &y, &theirs.forward(&x).unwrap(), 1e-5, 1e-5);
        assert_close("dropless reference", &y, &want, 1e-5, 1e-5);
        assert_close("dropless d/dx", &gx, &want_gx, 1e-5, 1e-4);
        assert_eq!(sent, bytes(12));
    }
    // A factor of 1: 3 rows per destination; some slots dropped, the bytes a quarter.
    let (y, gx, sent) = run(Some(1.0));
    let (want, want_gx) = reference(3);
    assert!(want.sub(&theirs.forward(&x).unwrap()).unwrap().abs().unwrap().max().unwrap().item_f64().unwrap() > 1e-3);
    assert_close("factor 1", &y, &want, 1e-5, 1e-5);
    assert_close("factor 1 d/dx", &gx, &want_gx, 1e-5, 1e-4);
    assert_eq!(sent, bytes(3));
    // 15 tokens: the last device's padding token takes no capacity from its three real ones.
    let x15 = x.narrow(0, 0, 15).unwrap();
    let mut m = ep.clone();
    m.set_expert_capacity_factor(Some(1.0)).unwrap();
    let block = m.model.layers[0].mlp.as_sparse().unwrap().clone();
    let y = block.forward(&x15.to_device(mesh.device()).unwrap()).unwrap();
    assert_close("15 tokens, factor 1", &y, &dropping_block(&theirs, &x15, 4, 4, 3), 1e-5, 1e-5);
    // Bad factors, and a block that is not split over a mesh.
    let mut m = ep.clone();
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        let e = m.set_expert_capacity_factor(Some(bad)).unwrap_err().to_string();
        assert!(e.contains("the capacity factor must be positive"), "{e}");
    }
    let e = one.clone().set_expert_capacity_factor(Some(1.0)).unwrap_err().to_string();
    assert!(e.contains("split the experts over a mesh first"), "{e}");
    let mut cfg = unseen_config(8).to_json(DType::F32);
    cfg["model_type"] = "llama".into();
    let mut dense = LlamaForCausalLM::new(&LlamaConfig::from_json(&cfg).unwrap(), DType::F32).unwrap();
    let e = dense.set_expert_capacity_factor(Some(1.0)).unwrap_err().to_string();
    assert!(e.contains("no mixture-of-experts layer"), "{e}");
}

#[test]
fn expert_parallelism_refuses_what_it_cannot_split() {
    four_devices();
    let _one = rng_lock();
    let mesh = parse_mesh("ep=4", DeviceKind::Tpu).unwrap();
    // Six experts on four devices.
    let mut m = LlamaForCausalLM::new(&unseen_config(6), DType::F32).unwrap();
    let e = Recipe::Ep.apply(&mut m, &mesh).unwrap_err().to_string();
    assert!(e.contains("6 experts do not split evenly over the 4 devices of axis \"ep\""), "{e}");
    // A dense model has no experts.
    let mut cfg = unseen_config(8).to_json(DType::F32);
    cfg["model_type"] = "llama".into();
    let mut dense = LlamaForCausalLM::new(&LlamaConfig::from_json(&cfg).unwrap(), DType::F32).unwrap();
    let e = Recipe::Ep.apply(&mut dense, &mesh).unwrap_err().to_string();
    assert!(e.contains("no mixture-of-experts layer"), "{e}");
    // The recipe needs its axis.
    let dp = parse_mesh("dp=4", DeviceKind::Tpu).unwrap();
    let mut m = LlamaForCausalLM::new(&unseen_config(8), DType::F32).unwrap();
    let e = Recipe::Ep.apply(&mut m, &dp).unwrap_err().to_string();
    assert!(e.contains("needs a mesh axis named \"ep\""), "{e}");
}
