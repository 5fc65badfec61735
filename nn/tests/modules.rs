//! The `Module` trait and the layers: Hugging Face names, state dicts and their
//! load errors, dtype/device moves, save/load roundtrips (single file, sharded,
//! tied weights once), malformed checkpoint files, RoPE scaling, padding masks
//! and the KV cache.
mod support;

use kiln::nn::io::{load_safetensors, save_safetensors, SafetensorsFile};
use kiln::nn::layers::{Linear, RopeScaling, RotaryEmbedding};
use kiln::nn::models::{LlamaConfig, LlamaForCausalLM};
use kiln::nn::module::Module;
use kiln::prelude::*;
use std::collections::BTreeMap;
use support::{assert_close, fixture_dir, rng_lock, temp_dir};

fn fixture_model(name: &str) -> LlamaForCausalLM {
    LlamaForCausalLM::from_pretrained(fixture_dir(name), DType::F32, Device::Cpu).unwrap()
}

fn tiny_config(model_type: &str, tied: bool) -> LlamaConfig {
    LlamaConfig::from_json_str(&format!(
        r#"{{"model_type": "{model_type}", "vocab_size": 40, "hidden_size": 16, "intermediate_size": 24,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": {tied}}}"#
    ))
    .unwrap()
}

#[test]
fn parameter_names_are_hugging_face_names() {
    let llama = fixture_model("llama");
    let file = SafetensorsFile::open(fixture_dir("llama/model.safetensors")).unwrap();
    let names: Vec<String> = llama.state_dict().into_keys().collect();
    assert_eq!(names, file.names());
    assert_eq!(llama.num_parameters(), 156_096);
    let first = &llama.named_parameters()[0].0;
    assert_eq!(first, "model.embed_tokens.weight");
    assert!(names.contains(&"model.layers.0.self_attn.q_proj.weight".to_string()));
    assert!(names.contains(&"lm_head.weight".to_string()));

    let qwen = fixture_model("qwen3");
    let names: Vec<String> = qwen.state_dict().into_keys().collect();
    assert!(!names.contains(&"lm_head.weight".to_string()), "tied lm_head is not a separate parameter");
    assert!(names.contains(&"model.layers.2.self_attn.q_norm.weight".to_string()));
    assert!(names.contains(&"model.layers.2.self_attn.k_norm.weight".to_string()));
    assert_eq!(qwen.num_parameters(), 139_760);
    assert_eq!(names, SafetensorsFile::open(fixture_dir("qwen3/model.safetensors")).unwrap().names());
    assert!(qwen.output_weight().unwrap().same(&qwen.model.embed_tokens.weight));
}

#[test]
fn load_state_dict_reports_missing_unexpected_and_mis_shaped() {
    let _rng = rng_lock();
    kiln::manual_seed(1);
    let mut m = LlamaForCausalLM::new(&tiny_config("llama", false), DType::F32).unwrap();
    let before = m.model.norm.weight.to_vec::<f32>().unwrap();
    let mut sd = m.state_dict();
    sd.remove("model.norm.weight");
    sd.insert("model.extra.weight".into(), Tensor::zeros(&[3], DType::F32).unwrap());
    sd.insert("lm_head.weight".into(), Tensor::zeros(&[40, 15], DType::F32).unwrap());
    let err = m.load_state_dict(&sd, true).unwrap_err().to_string();
    assert!(err.contains("Missing key(s) in state_dict: \"model.norm.weight\""), "{err}");
    assert!(err.contains("Unexpected key(s) in state_dict: \"model.extra.weight\""), "{err}");
    assert!(err.contains("size mismatch for lm_head.weight: copying a param with shape [40, 15]"), "{err}");
    assert_eq!(m.model.norm.weight.to_vec::<f32>().unwrap(), before, "a failed load writes nothing");

    // Non-strict: missing and unexpected are returned, shapes must still match.
    sd.insert("lm_head.weight".into(), Tensor::zeros(&[40, 16], DType::F32).unwrap());
    let keys = m.load_state_dict(&sd, false).unwrap();
    assert_eq!(keys.missing_keys, vec!["model.norm.weight".to_string()]);
    assert_eq!(keys.unexpected_keys, vec!["model.extra.weight".to_string()]);
    assert_eq!(m.lm_head.as_ref().unwrap().weight.to_vec::<f32>().unwrap(), vec![0.0; 640]);
}

#[test]
fn load_state_dict_copies_into_the_same_tensors() {
    let _rng = rng_lock();
    kiln::manual_seed(2);
    let cfg = tiny_config("qwen3", true);
    let mut a = LlamaForCausalLM::new(&cfg, DType::F32).unwrap();
    let b = LlamaForCausalLM::new(&cfg, DType::F32).unwrap();
    let handle = a.model.embed_tokens.weight.clone();
    a.load_state_dict(&b.state_dict(), true).unwrap();
    assert!(handle.same(&a.model.embed_tokens.weight), "the parameter keeps its identity");
    assert_eq!(handle.to_vec::<f32>().unwrap(), b.model.embed_tokens.weight.to_vec::<f32>().unwrap());
    assert!(handle.requires_grad());
}

#[test]
fn dtype_moves_keep_requires_grad_and_grads_clear() {
    let _rng = rng_lock();
    kiln::manual_seed(3);
    let mut m = LlamaForCausalLM::new(&tiny_config("llama", true), DType::F32).unwrap();
    let ids = Tensor::new([[1i64, 2, 3, 4]]).unwrap();
    m.forward(&ids, None).unwrap().sum().unwrap().backward().unwrap();
    assert!(m.parameters().iter().all(|p| p.grad().is_some()));
    m.zero_grad();
    assert!(m.parameters().iter().all(|p| p.grad().is_none()));
    m.to_dtype(DType::BF16).unwrap();
    assert!(m.parameters().iter().all(|p| p.dtype() == DType::BF16 && p.requires_grad() && p.is_leaf()));
    assert_eq!(m.forward(&ids, None).unwrap().dtype(), DType::BF16);
    m.to_device(Device::Cpu).unwrap();
    m.requires_grad_(false).unwrap();
    assert!(m.parameters().iter().all(|p| !p.requires_grad()));
    assert!(m.to_dtype(DType::I64).is_err());
    m.train(false);
    assert!(!m.is_training());
    m.train(true);
    assert!(m.is_training());
}

#[test]
fn linear_init_is_kaiming_uniform_and_seeded() {
    let _rng = rng_lock();
    kiln::manual_seed(4);
    let a = Linear::new(100, 50, true, DType::F32).unwrap();
    kiln::manual_seed(4);
    let b = Linear::new(100, 50, true, DType::F32).unwrap();
    let w = a.weight.to_vec::<f32>().unwrap();
    assert_eq!(w, b.weight.to_vec::<f32>().unwrap());
    let bound = 1.0 / 10.0;
    assert!(w.iter().all(|x| x.abs() <= bound));
    assert!(w.iter().any(|x| x.abs() > 0.9 * bound), "the whole range is used");
    assert!(a.bias.as_ref().unwrap().to_vec::<f32>().unwrap().iter().all(|x| x.abs() <= bound));
    assert!(a.weight.requires_grad());
}

#[test]
fn new_model_is_seeded_with_hf_like_init() {
    let _rng = rng_lock();
    let cfg = tiny_config("qwen3", false);
    kiln::manual_seed(5);
    let a = LlamaForCausalLM::new(&cfg, DType::F32).unwrap();
    kiln::manual_seed(5);
    let b = LlamaForCausalLM::new(&cfg, DType::F32).unwrap();
    for ((n, x), (_, y)) in a.named_parameters().iter().zip(b.named_parameters()) {
        assert_eq!(x.to_vec::<f32>().unwrap(), y.to_vec::<f32>().unwrap(), "{n}");
        if n.ends_with("norm.weight") {
            assert!(x.to_vec::<f32>().unwrap().iter().all(|&v| v == 1.0), "{n}");
        }
    }
    let std = a.model.embed_tokens.weight.std_all(1).unwrap().item::<f32>().unwrap();
    assert!((std - 0.02).abs() < 0.003, "embedding std {std}");
}

#[test]
fn save_pretrained_roundtrip_single_and_sharded() {
    let ids = Tensor::new([[5i64, 7, 9, 11, 13]]).unwrap();
    for name in ["llama", "qwen3"] {
        let m = fixture_model(name);
        let want = m.forward(&ids, None).unwrap();
        let dir = temp_dir(&format!("save-{name}"));
        m.save_pretrained(&dir).unwrap();
        let saved = load_safetensors(dir.join("model.safetensors")).unwrap();
        assert_eq!(saved.contains_key("lm_head.weight"), name == "llama", "tied weights are saved once");
        let back = LlamaForCausalLM::from_pretrained(&dir, DType::F32, Device::Cpu).unwrap();
        let mut cfg = back.config().clone();
        let mut orig = m.config().clone();
        cfg.raw = None;
        orig.raw = None;
        assert_eq!(cfg, orig);
        assert_eq!(back.forward(&ids, None).unwrap().to_vec::<f32>().unwrap(), want.to_vec::<f32>().unwrap());

        let sdir = temp_dir(&format!("shard-{name}"));
        m.save_pretrained_sharded(&sdir, 40_000).unwrap();
        assert!(sdir.join("model.safetensors.index.json").is_file());
        assert!(!sdir.join("model.safetensors").exists());
        let shards = std::fs::read_dir(&sdir)
            .unwrap()
            .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with("model-"));
        assert!(shards.count() > 1);
        let back = LlamaForCausalLM::from_pretrained(&sdir, DType::F32, Device::Cpu).unwrap();
        assert_eq!(back.forward(&ids, None).unwrap().to_vec::<f32>().unwrap(), want.to_vec::<f32>().unwrap());
        let _ = std::fs::remove_dir_all(&dir);
        let _ = std::fs::remove_dir_all(&sdir);
    }
}

#[test]
fn checkpoint_files_refuse_a_name_twice_and_an_empty_file() {
    use kiln::nn::io::save_checkpoint_files;
    use std::collections::BTreeMap;
    let t = Tensor::zeros(&[2], DType::F32).unwrap();
    let group =
        |names: &[&str]| -> BTreeMap<String, Tensor> { names.iter().map(|n| (n.to_string(), t.clone())).collect() };
    let dir = temp_dir("checkpoint-files");
    let e = save_checkpoint_files(&dir, &[group(&["a", "b"]), group(&["b"])], None).unwrap_err().to_string();
    assert!(e.contains("\"b\" is in two files"), "{e}");
    let e = save_checkpoint_files(&dir, &[group(&["a"]), group(&[])], None).unwrap_err().to_string();
    assert!(e.contains("file 2 of 2 would hold no tensor"), "{e}");
    let e = save_checkpoint_files(&dir, &[], None).unwrap_err().to_string();
    assert!(e.contains("a checkpoint of no files"), "{e}");
    assert!(!dir.join("model.safetensors.index.json").exists(), "nothing is written when refused");
    save_checkpoint_files(&dir, &[group(&["a"]), group(&["b"])], None).unwrap();
    let back = kiln::nn::io::load_checkpoint_dir(&dir, None, Device::Cpu).unwrap();
    assert_eq!(back.keys().collect::<Vec<_>>(), ["a", "b"]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn save_in_bf16_and_reload_from_hf4_config() {
    let mut m = fixture_model("llama");
    m.to_dtype(DType::BF16).unwrap();
    let dir = temp_dir("bf16");
    m.save_pretrained(&dir).unwrap();
    let f = SafetensorsFile::open(dir.join("model.safetensors")).unwrap();
    assert_eq!(f.info("model.norm.weight").unwrap().0, safetensors::Dtype::BF16);
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["dtype"], "bfloat16");
    assert_eq!(cfg["rope_parameters"]["rope_theta"], 500000.0);
    // A config made in code is written in the transformers 4 layout.
    let mut fresh = m.config().clone();
    fresh.raw = None;
    let j = fresh.to_json(DType::F32);
    assert_eq!(j["rope_theta"], 500000.0);
    assert!(j.get("rope_parameters").is_none());
    assert_eq!(LlamaConfig::from_json(&j).unwrap().rope_theta, 500000.0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn malformed_safetensors_give_clear_errors() {
    let dir = temp_dir("bad");
    let good = std::fs::read(fixture_dir("llama/model.safetensors")).unwrap();
    let truncated = dir.join("truncated.safetensors");
    std::fs::write(&truncated, &good[..good.len() / 2]).unwrap();
    let err = SafetensorsFile::open(&truncated).unwrap_err().to_string();
    assert!(err.contains("truncated.safetensors") && err.contains("invalid or truncated"), "{err}");

    let garbage = dir.join("garbage.safetensors");
    let mut bytes = 40u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{this is not json at all, not even close}");
    std::fs::write(&garbage, &bytes).unwrap();
    let err = load_safetensors(&garbage).unwrap_err().to_string();
    assert!(err.contains("garbage.safetensors"), "{err}");

    let huge = dir.join("huge.safetensors");
    std::fs::write(&huge, u64::MAX.to_le_bytes()).unwrap();
    assert!(load_safetensors(&huge).unwrap_err().to_string().contains("huge.safetensors"));

    let tiny = dir.join("tiny.safetensors");
    std::fs::write(&tiny, b"abc").unwrap();
    assert!(load_safetensors(&tiny).unwrap_err().to_string().contains("tiny.safetensors"));
    assert!(load_safetensors(dir.join("missing.safetensors")).unwrap_err().to_string().contains("missing.safetensors"));

    // A checkpoint directory whose weights file is truncated.
    std::fs::copy(fixture_dir("llama/config.json"), dir.join("config.json")).unwrap();
    std::fs::write(dir.join("model.safetensors"), &good[..good.len() - 1]).unwrap();
    let err = LlamaForCausalLM::from_pretrained(&dir, DType::F32, Device::Cpu).unwrap_err().to_string();
    assert!(err.contains("model.safetensors"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn safetensors_roundtrip_of_every_dtype() {
    let dir = temp_dir("dtypes");
    let mut m = BTreeMap::new();
    m.insert("f32".to_string(), Tensor::new([[1.5f32, -2.0], [3.0, 4.25]]).unwrap());
    m.insert("f64".to_string(), Tensor::new([1.0f64, 1e-300]).unwrap());
    m.insert("bf16".to_string(), Tensor::new([1.0f32, 3.0]).unwrap().to_dtype(DType::BF16).unwrap());
    m.insert("f16".to_string(), Tensor::new([0.5f32, 2.0]).unwrap().to_dtype(DType::F16).unwrap());
    m.insert("i64".to_string(), Tensor::new([[1i64, -2, 3]]).unwrap());
    m.insert("i32".to_string(), Tensor::new([7i32]).unwrap());
    m.insert("u8".to_string(), Tensor::new([255u8]).unwrap());
    m.insert("bool".to_string(), Tensor::new([true, false]).unwrap());
    m.insert("scalar".to_string(), Tensor::scalar(2.5, DType::F32).unwrap());
    m.insert("view".to_string(), Tensor::new([[1.0f32, 2.0], [3.0, 4.0]]).unwrap().t().unwrap());
    let path = dir.join("all.safetensors");
    save_safetensors(&path, &m, None).unwrap();
    let back = load_safetensors(&path).unwrap();
    assert_eq!(back.len(), m.len());
    for (k, t) in &m {
        assert_eq!(back[k].dtype(), t.dtype(), "{k}");
        assert_eq!(back[k].shape(), t.shape(), "{k}");
        assert_eq!(back[k].to_vec_f64().unwrap(), t.to_vec_f64().unwrap(), "{k}");
    }
    // Conversion on load: floats to the requested dtype, ints untouched.
    let f = SafetensorsFile::open(&path).unwrap();
    assert_eq!(f.tensor("bf16", Some(DType::F32), Device::Cpu).unwrap().to_vec::<f32>().unwrap(), vec![1.0, 3.0]);
    assert_eq!(f.tensor("i64", Some(DType::F32), Device::Cpu).unwrap().dtype(), DType::I64);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn from_weights_lists_every_problem() {
    let cfg = LlamaConfig::from_file(fixture_dir("qwen3/config.json")).unwrap();
    let mut w = load_safetensors(fixture_dir("qwen3/model.safetensors")).unwrap();
    w.remove("model.layers.1.self_attn.q_norm.weight");
    w.insert("model.layers.0.mlp.up_proj.weight".into(), Tensor::zeros(&[3, 3], DType::F32).unwrap());
    w.insert("bogus".into(), Tensor::zeros(&[1], DType::F32).unwrap());
    // Ignored like transformers does: a tied model's lm_head, RoPE buffers.
    w.insert("lm_head.weight".into(), Tensor::zeros(&[256, 64], DType::F32).unwrap());
    w.insert("model.layers.0.self_attn.rotary_emb.inv_freq".into(), Tensor::zeros(&[4], DType::F32).unwrap());
    let err = LlamaForCausalLM::from_weights(&cfg, &w, DType::F32, Device::Cpu).unwrap_err().to_string();
    assert!(err.contains("Missing key(s) in state_dict: \"model.layers.1.self_attn.q_norm.weight\""), "{err}");
    assert!(err.contains("Unexpected key(s) in state_dict: \"bogus\"."), "{err}");
    assert!(err.contains("size mismatch for model.layers.0.mlp.up_proj.weight"), "{err}");
    assert!(!err.contains("lm_head") && !err.contains("inv_freq"), "{err}");
}

#[test]
fn llama3_rope_scaling_follows_transformers() {
    // Llama 3.1's settings; head_dim 128, theta 500000.
    let s = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 8192,
    };
    let plain = RotaryEmbedding::new(128, 500000.0, &RopeScaling::Default).unwrap();
    let scaled = RotaryEmbedding::new(128, 500000.0, &s).unwrap();
    let two_pi = 2.0 * std::f32::consts::PI;
    for (&f, &g) in plain.inv_freq().iter().zip(scaled.inv_freq()) {
        let wavelen = two_pi / f;
        if wavelen < 8192.0 / 4.0 {
            assert_eq!(f, g, "high frequencies are kept");
        } else if wavelen > 8192.0 {
            assert!((g - f / 8.0).abs() <= 1e-6 * f, "low frequencies are divided by the factor");
        } else {
            assert!(g < f && g > f / 8.0, "the band between is interpolated");
        }
    }
    assert_eq!(plain.inv_freq()[0], 1.0);
    assert!((plain.inv_freq()[1] - 500000f32.powf(-2.0 / 128.0)).abs() < 1e-7);

    // The config parser reads the same scheme from both layouts.
    let base = r#""model_type": "llama", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 131072"#;
    let rope = r#""rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192"#;
    let hf4 =
        LlamaConfig::from_json_str(&format!("{{{base}, \"rope_theta\": 500000.0, \"rope_scaling\": {{{rope}}}}}"))
            .unwrap();
    let hf5 =
        LlamaConfig::from_json_str(&format!("{{{base}, \"rope_parameters\": {{\"rope_theta\": 500000.0, {rope}}}}}"))
            .unwrap();
    assert_eq!(hf4.rope_scaling, s);
    assert_eq!(hf5.rope_scaling, s);
    assert_eq!(hf4.rope_theta, hf5.rope_theta);
    assert!(LlamaConfig::from_json_str(&format!(
        "{{{base}, \"rope_scaling\": {{\"rope_type\": \"yarn\", \"factor\": 2.0}}}}"
    ))
    .unwrap_err()
    .to_string()
    .contains("yarn"));
}

#[test]
fn right_padding_does_not_change_real_positions() {
    let m = fixture_model("qwen3");
    let ids = Tensor::new([[3i64, 14, 15, 92, 65, 0, 0], [2, 71, 82, 81, 82, 84, 59]]).unwrap();
    let mask = Tensor::new([[1i64, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]]).unwrap();
    let padded = m.forward(&ids, Some(&mask)).unwrap();
    let alone = m.forward(&Tensor::new([[3i64, 14, 15, 92, 65]]).unwrap(), None).unwrap();
    assert_close(
        "padded row",
        &padded.select(0, 0).unwrap().narrow(0, 0, 5).unwrap(),
        &alone.select(0, 0).unwrap(),
        1e-5,
        1e-5,
    );
    let full = m.forward(&ids.narrow(0, 1, 1).unwrap(), None).unwrap();
    assert_close("unpadded row", &padded.select(0, 1).unwrap(), &full.select(0, 0).unwrap(), 1e-5, 1e-5);
}

#[test]
fn kv_cache_chunks_equal_the_full_forward() {
    let m = fixture_model("llama");
    let ids = Tensor::new([[1i64, 5, 9, 200, 3, 17, 44, 8, 250, 0], [7, 7, 7, 1, 2, 3, 4, 5, 6, 7]]).unwrap();
    let full = m.forward(&ids, None).unwrap();
    let _g = kiln::autograd::no_grad();
    let mut cache = m.new_cache(2); // grows past its first capacity
    let mut parts = vec![];
    for (start, len) in [(0, 4), (4, 1), (5, 3), (8, 2)] {
        parts.push(m.forward_cached(&ids.narrow(1, start, len).unwrap(), None, &mut cache, false).unwrap());
    }
    assert_eq!(cache.len(), 10);
    let refs: Vec<&Tensor> = parts.iter().collect();
    let chunked = Tensor::cat(&refs, 1).unwrap();
    assert_close("cached logits", &chunked, &full, 1e-5, 1e-5);
}
