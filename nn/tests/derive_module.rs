//! `#[derive(Module)]`: kiln's derived layers and models name and order their
//! parameters exactly as the hand-written visitors they replaced did (written
//! out again here as the reference), and a user's derived struct walks
//! tensors, optional tensors, nested modules, `Vec`s and arrays of modules,
//! tuple fields and generics, honours `skip` and `rename`, and passes the
//! training mode on.
mod support;

use kiln::nn::layers::{Attention, Dropout, Embedding, LayerNorm, Linear, RmsNorm, SwiGluMlp};
use kiln::nn::models::{DecoderLayer, LlamaConfig, LlamaForCausalLM, LlamaModel};
use kiln::nn::module::{join_name, Module};
use kiln::prelude::*;
use std::collections::BTreeMap;
use support::{fixture_dir, rng_lock};

type Seen = Vec<(String, Tensor)>;

// The hand-written visitors the derive replaced, one function per type, in
// their field order (Linear keeps its own visitor: its weight is not a
// parameter while it is kept quantized).
fn linear(l: &Linear, p: &str, out: &mut Seen) {
    l.visit_params(p, &mut |n, t| out.push((n.to_string(), t.clone())));
}
fn tensor(t: &Tensor, p: &str, name: &str, out: &mut Seen) {
    out.push((join_name(p, name), t.clone()));
}
fn rms(n: &RmsNorm, p: &str, out: &mut Seen) {
    tensor(&n.weight, p, "weight", out);
}
fn embedding(e: &Embedding, p: &str, out: &mut Seen) {
    tensor(&e.weight, p, "weight", out);
}
fn attention(a: &Attention, p: &str, out: &mut Seen) {
    linear(&a.q_proj, &join_name(p, "q_proj"), out);
    linear(&a.k_proj, &join_name(p, "k_proj"), out);
    linear(&a.v_proj, &join_name(p, "v_proj"), out);
    linear(&a.o_proj, &join_name(p, "o_proj"), out);
    if let Some(n) = &a.q_norm {
        rms(n, &join_name(p, "q_norm"), out);
    }
    if let Some(n) = &a.k_norm {
        rms(n, &join_name(p, "k_norm"), out);
    }
}
fn mlp(m: &SwiGluMlp, p: &str, out: &mut Seen) {
    linear(&m.gate_proj, &join_name(p, "gate_proj"), out);
    linear(&m.up_proj, &join_name(p, "up_proj"), out);
    linear(&m.down_proj, &join_name(p, "down_proj"), out);
}
fn decoder_layer(l: &DecoderLayer, p: &str, out: &mut Seen) {
    rms(&l.input_layernorm, &join_name(p, "input_layernorm"), out);
    attention(&l.self_attn, &join_name(p, "self_attn"), out);
    rms(&l.post_attention_layernorm, &join_name(p, "post_attention_layernorm"), out);
    mlp(l.mlp.as_dense().expect("a dense model"), &join_name(p, "mlp"), out);
}
fn llama_model(m: &LlamaModel, p: &str, out: &mut Seen) {
    embedding(&m.embed_tokens, &join_name(p, "embed_tokens"), out);
    for (i, l) in m.layers.iter().enumerate() {
        decoder_layer(l, &join_name(p, &format!("layers.{i}")), out);
    }
    rms(&m.norm, &join_name(p, "norm"), out);
}
fn causal_lm(m: &LlamaForCausalLM, out: &mut Seen) {
    llama_model(&m.model, "model", out);
    if let Some(l) = &m.lm_head {
        linear(l, "lm_head", out);
    }
}

/// The derived walk (through both visitors) equals the reference: same names,
/// same order, the very same tensors.
fn assert_same_walk(m: &mut impl Module, reference: &Seen) {
    let derived = m.named_parameters();
    let names = |s: &Seen| s.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    assert_eq!(names(&derived), names(reference));
    for ((n, a), (_, b)) in derived.iter().zip(reference) {
        assert!(a.same(b), "{n} is not the field's tensor");
    }
    let mut mut_names = vec![];
    m.visit_params_mut("", &mut |n, _| {
        mut_names.push(n.to_string());
        Ok(())
    })
    .unwrap();
    assert_eq!(mut_names, names(reference), "visit_params_mut walks as visit_params does");
}

fn config(model_type: &str, tied: bool, bias: bool) -> LlamaConfig {
    LlamaConfig::from_json_str(&format!(
        r#"{{"model_type": "{model_type}", "vocab_size": 40, "hidden_size": 16, "intermediate_size": 24,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": {tied},
            "attention_bias": {bias}, "mlp_bias": {bias}, "attention_dropout": 0.1}}"#
    ))
    .unwrap()
}

#[test]
fn derived_models_walk_as_the_hand_written_visitors_did() {
    let _rng = rng_lock();
    kiln::manual_seed(7);
    for (ty, tied, bias) in
        [("llama", false, false), ("llama", true, true), ("qwen3", true, false), ("qwen3", false, true)]
    {
        let mut m = LlamaForCausalLM::new(&config(ty, tied, bias), DType::F32).unwrap();
        let mut reference = vec![];
        causal_lm(&m, &mut reference);
        assert_eq!(reference.iter().any(|(n, _)| n.ends_with("q_norm.weight")), ty == "qwen3");
        assert_eq!(reference.iter().any(|(n, _)| n.ends_with("o_proj.bias")), bias);
        assert_eq!(reference.iter().any(|(n, _)| n == "lm_head.weight"), !tied);
        assert_same_walk(&mut m, &reference);

        // The parts on their own, under a prefix.
        let layer = &mut m.model.layers[1];
        let mut reference = vec![];
        decoder_layer(layer, "blk", &mut reference);
        let derived: Vec<String> = {
            let mut v = vec![];
            layer.visit_params("blk", &mut |n, _| v.push(n.to_string()));
            v
        };
        assert_eq!(derived, reference.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>());
    }
    // The Hugging Face fixtures: the derived names are the checkpoints' names.
    for name in ["llama", "qwen3"] {
        let mut m = LlamaForCausalLM::from_pretrained(fixture_dir(name), DType::F32, Device::Cpu).unwrap();
        let mut reference = vec![];
        causal_lm(&m, &mut reference);
        assert_same_walk(&mut m, &reference);
    }
}

#[test]
fn derived_layer_norm_holds_what_it_was_built_with() {
    for (affine, bias, want) in
        [(true, true, &["weight", "bias"][..]), (true, false, &["weight"][..]), (false, false, &[][..])]
    {
        let n = LayerNorm::new(8, 1e-5, affine, bias, DType::F32).unwrap();
        let names: Vec<String> = n.named_parameters().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, want);
    }
}

#[test]
fn derived_models_pass_the_training_mode_on() {
    let _rng = rng_lock();
    kiln::manual_seed(8);
    let mut m = LlamaForCausalLM::new(&config("llama", false, false), DType::F32).unwrap();
    m.train(true);
    assert!(m.is_training() && m.model.is_training());
    assert!(m.model.layers.iter().all(|l| l.is_training() && l.self_attn.is_training()));
    m.eval();
    assert!(!m.is_training());
    assert!(m.model.layers.iter().all(|l| !l.self_attn.is_training()));
}

/// A user's module: a parameter under another name, an optional tensor, a
/// nested module, an optional module, a list and an array of modules, a
/// skipped configuration field and a skipped non-parameter tensor.
#[derive(Module)]
struct Block {
    #[module(rename = "scale")]
    gain: Tensor,
    shift: Option<Tensor>,
    proj: Linear,
    head: Option<Linear>,
    experts: Vec<Linear>,
    pair: [RmsNorm; 2],
    drop: Dropout,
    #[module(skip)]
    buffer: Tensor,
    #[module(skip)]
    _eps: f64,
}

/// A tuple struct is named by field index, as `nn.Sequential` names its members.
#[derive(Module)]
struct Seq(Linear, #[module(skip)] usize, Linear);

/// A generic stack of any module, with a dotted rename.
#[derive(Module)]
struct Stack<M> {
    #[module(rename = "model.layers")]
    layers: Vec<M>,
    #[module(skip)]
    _name: &'static str,
}

/// A struct with nothing to visit is a module with no parameters.
#[derive(Module)]
struct Empty {
    #[module(skip)]
    _n: usize,
}

fn block() -> Block {
    let lin = || Linear::new(3, 2, true, DType::F32).unwrap();
    Block {
        gain: Tensor::ones(&[2], DType::F32).unwrap(),
        shift: Some(Tensor::zeros(&[2], DType::F32).unwrap()),
        proj: lin(),
        head: None,
        experts: vec![lin(), lin()],
        pair: [RmsNorm::new(2, 1e-6, DType::F32).unwrap(), RmsNorm::new(2, 1e-6, DType::F32).unwrap()],
        drop: Dropout::new(0.5).unwrap(),
        buffer: Tensor::zeros(&[4], DType::F32).unwrap(),
        _eps: 1e-6,
    }
}

#[test]
fn a_users_derived_module_walks_every_kind_of_field() {
    let _rng = rng_lock();
    kiln::manual_seed(9);
    let mut b = block();
    let names: Vec<String> = b.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        [
            "scale",
            "shift",
            "proj.weight",
            "proj.bias",
            "experts.0.weight",
            "experts.0.bias",
            "experts.1.weight",
            "experts.1.bias",
            "pair.0.weight",
            "pair.1.weight"
        ]
    );
    assert!(b.named_parameters()[0].1.same(&b.gain));
    assert_eq!(b.num_parameters(), 2 + 2 + 3 * (6 + 2) + 2 * 2);

    // An optional module appears once it is there.
    b.head = Some(Linear::new(2, 1, false, DType::F32).unwrap());
    assert!(b.state_dict().contains_key("head.weight"));

    // Everything provided on top of the visitors works through the derived ones.
    let mut sd = b.state_dict();
    sd.insert("experts.1.bias".into(), Tensor::new([5f32, 6.]).unwrap());
    b.load_state_dict(&sd, true).unwrap();
    assert_eq!(b.experts[1].bias.as_ref().unwrap().to_vec::<f32>().unwrap(), [5., 6.]);
    b.to_dtype(DType::BF16).unwrap();
    assert_eq!(b.pair[1].weight.dtype(), DType::BF16);
    assert_eq!(b.buffer.dtype(), DType::F32, "a skipped tensor is not a parameter");
    let err = b.load_state_dict(&BTreeMap::new(), true).unwrap_err().to_string();
    assert!(err.contains("\"experts.0.weight\"") && err.contains("\"scale\""), "{err}");

    // The training mode reaches the dropout inside (a new module is in
    // training mode, as in PyTorch).
    assert!(b.is_training());
    b.eval();
    assert!(!b.is_training() && !b.drop.is_training());
    b.train(true);
    assert!(b.is_training() && b.drop.is_training());
}

#[test]
fn tuple_generic_and_empty_structs_derive_too() {
    let _rng = rng_lock();
    kiln::manual_seed(10);
    let s = Seq(Linear::new(2, 2, false, DType::F32).unwrap(), 7, Linear::new(2, 2, true, DType::F32).unwrap());
    let names: Vec<String> = s.state_dict().into_keys().collect();
    assert_eq!(names, ["0.weight", "2.bias", "2.weight"]);
    assert_eq!(s.1, 7);

    let stack = Stack { layers: vec![block(), block()], _name: "two" };
    let named = stack.named_parameters();
    assert_eq!(named.len(), 20);
    assert_eq!(named[0].0, "model.layers.0.scale");
    assert_eq!(named[19].0, "model.layers.1.pair.1.weight");
    let nested =
        Stack { layers: vec![Stack { layers: vec![Seq(s.0.clone(), 0, s.2.clone())], _name: "in" }], _name: "out" };
    assert_eq!(nested.named_parameters()[0].0, "model.layers.0.model.layers.0.0.weight");

    let mut e = Empty { _n: 3 };
    assert_eq!(e.num_parameters(), 0);
    e.train(true);
    assert!(!e.is_training(), "nothing to put in training mode");
}
