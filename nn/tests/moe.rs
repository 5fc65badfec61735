//! Qwen3-MoE beyond the fixture (`hf_fixtures.rs` holds the fixture itself):
//! the configuration (both spellings of the expert count, transformers'
//! defaults and its sparse-layer rule, refused values), a model with dense and
//! sparse layers that transformers loads from what kiln saves and computes
//! the same logits with, routing weights, zero gradients for experts no token
//! chose, shape errors, and stacked experts (the same function, saved and
//! loaded under the Hub's per-expert names).
mod support;

use kiln::nn::io::save_safetensors;
use kiln::nn::layers::{from_hub_layout, to_hub_layout, FeedForward, SparseMoeBlock};
use kiln::nn::models::{causal_lm_loss, LlamaConfig, LlamaForCausalLM, ModelType};
use kiln::nn::module::Module;
use kiln::prelude::*;
use std::collections::BTreeMap;
use support::{assert_close, rng_lock, temp_dir};

fn moe_config(extra: &str) -> LlamaConfig {
    LlamaConfig::from_json_str(&format!(
        r#"{{"model_type": "qwen3_moe", "vocab_size": 50, "hidden_size": 32, "intermediate_size": 40,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "moe_intermediate_size": 24, "rms_norm_eps": 1e-6, "rope_theta": 10000.0 {extra}}}"#
    ))
    .unwrap()
}

#[test]
fn the_configuration_follows_transformers() {
    let c = moe_config("");
    assert_eq!(c.model_type, ModelType::Qwen3Moe);
    assert_eq!(c.class_name(), "Qwen3MoeForCausalLM");
    assert!(c.qk_norm());
    let m = c.moe.as_ref().unwrap();
    // Qwen3MoeConfig's defaults.
    assert_eq!((m.num_experts, m.num_experts_per_tok, m.norm_topk_prob), (128, 8, false));
    assert_eq!((m.decoder_sparse_step, m.router_aux_loss_coef), (1, 0.001));
    assert!((0..4).all(|l| c.is_sparse_layer(l)));

    let a = moe_config(r#", "num_experts": 6, "num_experts_per_tok": 2"#);
    let b = moe_config(r#", "num_local_experts": 6, "num_experts_per_tok": 2"#);
    assert_eq!(a.moe, b.moe, "num_experts and num_local_experts are one field");
    let e = LlamaConfig::from_json_str(
        &serde_json::to_string(&{
            let mut v = a.to_json(DType::F32);
            v["num_local_experts"] = 5.into();
            v
        })
        .unwrap(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("num_experts (6) and num_local_experts (5) disagree"), "{e}");

    // Sparse every second layer, except layer 3: layer 1 only (layer index + 1 divisible by 2);
    // repeated, dense-anyway and out-of-range entries of mlp_only_layers change nothing.
    let c = moe_config(
        r#", "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 2, "mlp_only_layers": [3, 3, 0, 99]"#,
    );
    assert_eq!((0..4).map(|l| c.is_sparse_layer(l)).collect::<Vec<_>>(), [false, true, false, false]);
    assert_eq!(c.num_sparse_layers(), 1);
    // A hostile layer count is refused by arithmetic, without visiting each layer.
    let e = LlamaConfig::from_json_str(&format!(
        r#"{{"model_type": "qwen3_moe", "vocab_size": 50, "hidden_size": 32, "intermediate_size": 40,
            "num_hidden_layers": {}, "num_attention_heads": 4, "head_dim": 8}}"#,
        u64::MAX / 2
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("more parameters than fit in memory"), "{e}");

    for (extra, msg) in [
        (r#", "num_experts": 4, "num_experts_per_tok": 5"#, "num_experts_per_tok must be in 1..=4"),
        (r#", "num_experts": 4, "num_experts_per_tok": 0"#, "num_experts_per_tok must be in 1..=4"),
        (r#", "decoder_sparse_step": 0"#, "decoder_sparse_step must be positive"),
        (r#", "mlp_only_layers": 3"#, "mlp_only_layers must be a list"),
        (r#", "mlp_only_layers": [-1]"#, "mlp_only_layers must hold layer indices"),
    ] {
        let text = format!(
            r#"{{"model_type": "qwen3_moe", "vocab_size": 50, "hidden_size": 32, "intermediate_size": 40,
                "num_hidden_layers": 4, "num_attention_heads": 4, "head_dim": 8 {extra}}}"#
        );
        let e = LlamaConfig::from_json_str(&text).unwrap_err().to_string();
        assert!(e.contains(msg), "{extra}: {e}");
    }
}

#[test]
fn parameter_count_and_names_cover_dense_and_sparse_layers() {
    let _rng = rng_lock();
    kiln::manual_seed(4);
    let c = moe_config(r#", "num_experts": 3, "num_experts_per_tok": 2, "decoder_sparse_step": 2"#);
    let m = LlamaForCausalLM::new(&c, DType::F32).unwrap();
    assert_eq!(Some(m.num_parameters()), c.num_parameters());
    let names: Vec<String> = m.state_dict().into_keys().collect();
    for n in ["model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.gate.weight"] {
        assert!(names.contains(&n.to_string()), "{n}");
    }
    for e in 0..3 {
        for p in ["gate_proj", "up_proj", "down_proj"] {
            assert!(names.contains(&format!("model.layers.3.mlp.experts.{e}.{p}.weight")));
        }
    }
    assert!(!names.iter().any(|n| n.starts_with("model.layers.2.mlp.experts")));
    assert!(matches!(m.model.layers[0].mlp, FeedForward::Dense(_)));
    assert!(matches!(m.model.layers[1].mlp, FeedForward::Sparse(_)));
}

/// A model the fixture does not cover (dense and sparse layers, no
/// renormalisation, top-3 of 5 experts, tied embeddings), saved by kiln and
/// loaded by transformers with no key missing or left over: the same logits.
#[test]
fn transformers_loads_what_kiln_saves_and_computes_the_same_logits() {
    let _rng = rng_lock();
    kiln::manual_seed(5);
    let c = moe_config(
        r#", "num_experts": 5, "num_experts_per_tok": 3, "norm_topk_prob": false, "decoder_sparse_step": 1,
            "mlp_only_layers": [2], "tie_word_embeddings": true, "initializer_range": 0.2"#,
    );
    let modules = LlamaForCausalLM::new(&c, DType::F32).unwrap();
    let ids = Tensor::randint(0, 50, &[2, 7], DType::I64).unwrap();
    // Stacked experts (one parameter per projection) compute what the per-expert modules do,
    // and save under the Hub's per-expert names.
    let mut m = modules.clone();
    m.stack_experts().unwrap();
    let names: Vec<String> = m.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert!(names.contains(&"model.layers.0.mlp.experts.down_proj".to_string()), "{names:?}");
    assert!(!names.iter().any(|n| n.contains("experts.0")), "{names:?}");
    assert_close("stacked", &m.forward(&ids, None).unwrap(), &modules.forward(&ids, None).unwrap(), 1e-6, 1e-6);
    let dir = temp_dir("moe-to-transformers");
    m.save_pretrained(&dir).unwrap();
    let theirs = transformers_run(&dir, &ids, None);
    let mine = m.forward(&ids, None).unwrap();
    let e = assert_close("logits vs transformers", &mine, &theirs["logits"], 2e-5, 1e-5);
    println!("kiln-saved Qwen3-MoE in transformers: max abs logit difference {e:.2e}");

    // And kiln reads back what it wrote.
    let back = LlamaForCausalLM::from_pretrained(&dir, DType::F32, Device::Cpu).unwrap();
    assert_eq!(back.config().moe, c.moe);
    assert_close("reloaded", &back.forward(&ids, None).unwrap(), &mine, 0.0, 0.0);
}

/// What transformers computes for the model in `dir` on `ids` (see
/// tests/check_moe_with_transformers.py).
fn transformers_run(dir: &std::path::Path, ids: &Tensor, mask: Option<&Tensor>) -> BTreeMap<String, Tensor> {
    let python = support::python_with_transformers();
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/check_moe_with_transformers.py");
    let mut inputs = BTreeMap::from([("input_ids".to_string(), ids.clone())]);
    if let Some(m) = mask {
        inputs.insert("attention_mask".into(), m.clone());
    }
    let in_file = dir.join("inputs.safetensors");
    save_safetensors(&in_file, &inputs, None).unwrap();
    let out_file = dir.join("transformers.safetensors");
    let out = std::process::Command::new(&python).arg(&script).arg(dir).arg(&in_file).arg(&out_file).output().unwrap();
    assert!(out.status.success(), "transformers refused it:\n{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "Qwen3MoeForCausalLM");
    kiln::nn::io::load_safetensors(&out_file).unwrap()
}

/// With `output_router_logits` the training loss adds the router's
/// load-balancing loss as transformers does (padding left out of the
/// balance), and every gradient, the router's and the experts', is
/// transformers' (whose experts are fused in memory: `gate_up_proj` is each
/// expert's gate and up weights stacked).
#[test]
fn the_router_aux_loss_and_its_gradients_match_transformers() {
    let _rng = rng_lock();
    kiln::manual_seed(8);
    let c = moe_config(
        r#", "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": true, "num_hidden_layers": 3,
            "output_router_logits": true, "router_aux_loss_coef": 0.05, "initializer_range": 0.2"#,
    );
    let m = LlamaForCausalLM::new(&c, DType::F32).unwrap();
    let dir = temp_dir("moe-aux-loss");
    m.save_pretrained(&dir).unwrap();
    let ids = Tensor::randint(0, 50, &[2, 7], DType::I64).unwrap();
    let mask = Tensor::new([[1i64, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0]]).unwrap();
    let theirs = transformers_run(&dir, &ids, Some(&mask));

    let (loss, logits) = m.training_loss(&ids, Some(&mask)).unwrap();
    assert_close("logits", &logits, &theirs["logits"], 2e-5, 1e-5);
    assert_close("loss with the aux loss", &loss, &theirs["loss"], 2e-6, 1e-6);
    let (_, router) = m.forward_with_router_logits(&ids, Some(&mask)).unwrap();
    assert_eq!(router.len(), 3, "one per sparse layer");
    let aux = kiln::nn::models::load_balancing_loss(&router, 4, 2, Some(&mask)).unwrap();
    let e_aux = assert_close("aux loss", &aux, &theirs["aux_loss"], 1e-6, 1e-6);
    // Without the mask the balance counts every token: another value.
    let unmasked = kiln::nn::models::load_balancing_loss(&router, 4, 2, None).unwrap();
    assert!((unmasked.item::<f32>().unwrap() - aux.item::<f32>().unwrap()).abs() > 1e-6);
    let lb = kiln::nn::models::load_balancing_loss;
    assert!(lb(&router, 4, 5, None).unwrap_err().to_string().contains("top_k (5) is more than the 4 experts"));
    assert!(lb(&router, 5, 2, None).unwrap_err().to_string().contains("expected [14, 5]"));
    assert!(lb(&router, 4, 2, Some(&ids.narrow(1, 0, 3).unwrap())).unwrap_err().to_string().contains("for 14 routed"));
    assert!(lb(&[], 4, 2, None).unwrap_err().to_string().contains("no router logits"));

    loss.backward().unwrap();
    let grads: BTreeMap<String, Tensor> =
        m.named_parameters().into_iter().map(|(n, p)| (n, p.grad().expect("a gradient"))).collect();
    let stacked = |names: &dyn Fn(usize) -> Vec<String>| -> Tensor {
        let per: Vec<Tensor> = (0..4)
            .map(|e| {
                let parts: Vec<&Tensor> = names(e).iter().map(|n| &grads[n]).collect::<Vec<_>>();
                Tensor::cat(&parts, 0).unwrap().unsqueeze(0).unwrap()
            })
            .collect();
        Tensor::cat(&per.iter().collect::<Vec<_>>(), 0).unwrap()
    };
    let mut worst = 0f64;
    let mut compared = 0;
    for (name, want) in &theirs {
        let Some(n) = name.strip_prefix("grad.") else { continue };
        let got = if let Some(layer) = n.strip_suffix(".mlp.experts.gate_up_proj") {
            stacked(&|e| {
                vec![
                    format!("{layer}.mlp.experts.{e}.gate_proj.weight"),
                    format!("{layer}.mlp.experts.{e}.up_proj.weight"),
                ]
            })
        } else if let Some(layer) = n.strip_suffix(".mlp.experts.down_proj") {
            stacked(&|e| vec![format!("{layer}.mlp.experts.{e}.down_proj.weight")])
        } else {
            grads.get(n).unwrap_or_else(|| panic!("kiln has no parameter {n}")).clone()
        };
        worst = worst.max(assert_close(&format!("grad {n}"), &got, want, 1e-5, 1e-4));
        compared += 1;
    }
    assert!(compared >= 20, "{compared} gradients compared");
    println!("Qwen3-MoE with the aux loss vs transformers: aux loss {e_aux:.2e}, gradients {worst:.2e}");
}

#[test]
fn routing_weights_and_unchosen_experts() {
    let _rng = rng_lock();
    kiln::manual_seed(6);
    let block = SparseMoeBlock::new(16, 8, 6, 2, true, 0.5, DType::F32).unwrap();
    // One token: it chooses two of six experts, so four get no token at all.
    let x = Tensor::randn(&[1, 1, 16], DType::F32).unwrap();
    let (logits, w, idx) = block.route(&x.reshape(&[1, 16]).unwrap()).unwrap();
    assert_eq!((logits.shape(), w.shape(), idx.shape()), (&[1, 6][..], &[1, 2][..], &[1, 2][..]));
    let w = w.to_vec::<f32>().unwrap();
    assert!((w[0] + w[1] - 1.0).abs() < 1e-6 && w[0] >= w[1], "{w:?}");
    let chosen = idx.to_vec::<i64>().unwrap();
    // The output is the chosen experts' outputs weighted by the routing weights.
    let experts = block.experts.modules().unwrap();
    let want = experts[chosen[0] as usize]
        .forward(&x)
        .unwrap()
        .mul(w[0] as f64)
        .unwrap()
        .add(&experts[chosen[1] as usize].forward(&x).unwrap().mul(w[1] as f64).unwrap())
        .unwrap();
    let y = block.forward(&x).unwrap();
    assert_close("two experts", &y, &want, 1e-6, 1e-6);

    y.sum().unwrap().backward().unwrap();
    for (e, expert) in experts.iter().enumerate() {
        let g = expert.up_proj.weight.grad().unwrap_or_else(|| panic!("expert {e} has no gradient"));
        let nonzero = g.to_vec::<f32>().unwrap().iter().any(|&v| v != 0.0);
        assert_eq!(nonzero, chosen.contains(&(e as i64)), "expert {e}: chosen {chosen:?}");
    }
    assert!(block.gate.weight.grad().is_some());

    // No tokens: an empty output, every expert on an empty group.
    let none = block.forward(&Tensor::zeros(&[2, 0, 16], DType::F32).unwrap()).unwrap();
    assert_eq!(none.shape(), &[2, 0, 16]);
    let e = block.forward(&Tensor::zeros(&[2, 15], DType::F32).unwrap()).unwrap_err().to_string();
    assert!(e.contains("expected [..., 16]"), "{e}");
    let parts = SparseMoeBlock::from_parts(block.gate.clone(), experts[..5].to_vec(), 2, true);
    assert!(parts.unwrap_err().to_string().contains("the router scores 6 experts, the block has 5"));
    let parts = SparseMoeBlock::from_parts(block.gate.clone(), experts.to_vec(), 7, true);
    assert!(parts.unwrap_err().to_string().contains("top_k must be in 1..=6"));

    // Stacked, each expert's gradient is its slice of the stacked one's.
    let mut stacked = block.clone();
    stacked.stack_experts().unwrap();
    let s = stacked.experts.stacked().unwrap();
    stacked.forward(&x).unwrap().sum().unwrap().backward().unwrap();
    assert_close("stacked forward", &stacked.forward(&x).unwrap(), &y, 1e-6, 1e-6);
    let g = s.up_proj.grad().unwrap();
    for (e, expert) in experts.iter().enumerate() {
        let want = expert.up_proj.weight.grad().unwrap();
        assert_close(&format!("expert {e}'s stacked gradient"), &g.select(0, e as isize).unwrap(), &want, 1e-6, 1e-6);
    }
}

#[test]
fn a_moe_model_trains() {
    let _rng = rng_lock();
    kiln::manual_seed(7);
    let c = moe_config(r#", "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": true"#);
    let m = LlamaForCausalLM::new(&c, DType::F32).unwrap();
    let ids = Tensor::randint(0, 50, &[2, 9], DType::I64).unwrap();
    let loss = causal_lm_loss(&m.forward(&ids, None).unwrap(), &ids, None).unwrap();
    loss.backward().unwrap();
    let missing: Vec<String> =
        m.named_parameters().into_iter().filter(|(_, p)| p.grad().is_none()).map(|(n, _)| n).collect();
    assert!(missing.is_empty(), "parameters without a gradient: {missing:?}");
}

#[test]
fn hub_layout_round_trips_stacked_weights() {
    let w = Tensor::arange(0.0, 24.0, 1.0, DType::F32).unwrap().reshape(&[2, 3, 4]).unwrap();
    let mut state = BTreeMap::new();
    state.insert("m.layers.0.mlp.experts.up_proj".to_string(), w.clone());
    state.insert("m.layers.0.mlp.gate.weight".to_string(), w.select(0, 0).unwrap());
    let hub = to_hub_layout(state.clone()).unwrap();
    let names: Vec<&str> = hub.keys().map(|k| k.as_str()).collect();
    assert_eq!(
        names,
        [
            "m.layers.0.mlp.experts.0.up_proj.weight",
            "m.layers.0.mlp.experts.1.up_proj.weight",
            "m.layers.0.mlp.gate.weight"
        ]
    );
    assert_eq!(
        hub["m.layers.0.mlp.experts.1.up_proj.weight"].to_vec::<f32>().unwrap(),
        (12..24).map(|v| v as f32).collect::<Vec<_>>()
    );
    let back = from_hub_layout(hub.clone(), &state).unwrap();
    assert_eq!(back.len(), 2);
    assert_eq!(back["m.layers.0.mlp.experts.up_proj"].to_vec::<f32>().unwrap(), w.to_vec::<f32>().unwrap());
    // A missing expert is named.
    let mut short = hub;
    short.remove("m.layers.0.mlp.experts.1.up_proj.weight");
    let e = from_hub_layout(short, &state).unwrap_err().to_string();
    assert!(e.contains("m.layers.0.mlp.experts.1.up_proj.weight is missing"), "{e}");
}
