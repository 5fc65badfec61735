//! Hostile input to kiln-nn: configurations whose sizes overflow, describe
//! more memory than exists or disagree with the checkpoint; NaN-producing
//! settings; generation on empty batches and with huge token budgets; and
//! checkpoints written by a process killed at random moments. Each case
//! expects a clear error (its key words written out) or the right value,
//! never a panic, an abort, a hang or a half-written checkpoint that lists.
mod support;

use kiln::nn::checkpoint::{checkpoint_dir, list_checkpoints, load_checkpoint, prune_checkpoints, save_checkpoint};
use kiln::nn::checkpoint::{TrainerState, MANIFEST_FILE};
use kiln::nn::generate::{generate, Sampling};
use kiln::nn::io::load_checkpoint_dir;
use kiln::nn::models::{LlamaConfig, LlamaForCausalLM};
use kiln::nn::optim::{AdamW, AdamWConfig, Optimizer};
use kiln::prelude::*;
use serde_json::{json, Value};
use std::path::PathBuf;

fn base() -> Value {
    json!({
        "model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 32, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    })
}

fn with(edits: Value) -> Value {
    let mut v = base();
    for (k, x) in edits.as_object().unwrap() {
        v[k] = x.clone();
    }
    v
}

fn config_err(edits: Value, parts: &[&str]) {
    let e = LlamaConfig::from_json(&with(edits.clone())).unwrap_err().to_string();
    for p in parts {
        assert!(e.contains(p), "{edits}: {e:?} lacks {p:?}");
    }
}

#[test]
fn configurations_are_checked_before_anything_is_built() {
    config_err(json!({"rope_theta": 0.0}), &["LlamaForCausalLM", "rope_theta must be a finite positive number, got 0"]);
    config_err(json!({"rope_theta": -5.0}), &["rope_theta", "got -5"]);
    config_err(json!({"rope_scaling": {"rope_type": "linear", "factor": 0.0}}), &["the rope factor", "got 0"]);
    config_err(
        json!({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0}}),
        &["high_freq_factor (1) > low_freq_factor (4)"],
    );
    config_err(json!({"rms_norm_eps": -1e-6}), &["rms_norm_eps must be finite and non-negative"]);
    config_err(json!({"attention_dropout": 1.5}), &["attention_dropout must be in [0, 1]"]);
    config_err(json!({"hidden_size": 0}), &["hidden_size must be positive"]);
    config_err(json!({"num_hidden_layers": 0}), &["num_hidden_layers must be positive"]);
    config_err(json!({"head_dim": 5}), &["head_dim must be even"]);
    config_err(json!({"num_key_value_heads": 3}), &["multiple of num_key_value_heads (3)"]);
    config_err(json!({"vocab_size": 1u64 << 62}), &["more parameters than fit in memory"]);
    config_err(
        json!({"num_attention_heads": 1u64 << 40, "num_key_value_heads": 1u64 << 40, "head_dim": 1u64 << 40}),
        &["more parameters"],
    );
    // Messages name the class the configuration builds.
    let e = LlamaConfig::from_json(&with(json!({"model_type": "qwen3", "rms_norm_eps": -1.0}))).unwrap_err();
    assert!(e.to_string().contains("Qwen3ForCausalLM"), "{e}");
    // A configuration edited after loading is checked by the constructors too.
    let mut cfg = LlamaConfig::from_json(&base()).unwrap();
    cfg.rope_theta = f64::NAN;
    assert!(LlamaForCausalLM::new(&cfg, DType::F32).unwrap_err().to_string().contains("rope_theta"));
}

#[test]
fn models_larger_than_memory_are_errors_not_aborts() {
    for edits in [
        json!({"num_hidden_layers": 1u64 << 31}),
        json!({"num_attention_heads": 1u64 << 40, "num_key_value_heads": 1u64 << 40, "head_dim": 8}),
        json!({"head_dim": 1u64 << 31}),
    ] {
        let cfg = LlamaConfig::from_json(&with(edits.clone())).unwrap();
        let e = LlamaForCausalLM::new(&cfg, DType::F32).unwrap_err().to_string();
        assert!(e.contains("LlamaForCausalLM") && e.contains("can't allocate memory"), "{edits}: {e}");
    }
}

/// A small model saved to a directory, to load with other configurations.
fn saved_weights() -> std::collections::BTreeMap<String, Tensor> {
    kiln::manual_seed(3);
    let model = LlamaForCausalLM::new(&LlamaConfig::from_json(&base()).unwrap(), DType::F32).unwrap();
    let dir = support::temp_dir("hostile-weights");
    model.save_pretrained(&dir).unwrap();
    let w = load_checkpoint_dir(&dir, None, Device::Cpu).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    w
}

#[test]
fn configurations_disagreeing_with_the_checkpoint_are_short_errors() {
    let w = saved_weights();
    let load = |edits: Value| {
        let cfg = LlamaConfig::from_json(&with(edits)).unwrap();
        LlamaForCausalLM::from_weights(&cfg, &w, DType::F32, Device::Cpu).unwrap_err().to_string()
    };
    for layers in [3u64, 100_000, 1 << 31] {
        let e = load(json!({"num_hidden_layers": layers}));
        assert!(e.contains(&format!("num_hidden_layers = {layers}, the checkpoint holds 2 decoder layers")), "{e}");
        assert!(e.len() < 400, "a short message: {} bytes", e.len());
    }
    let e = load(json!({"head_dim": 1u64 << 31}));
    assert!(e.contains("size mismatch for model.layers.0.self_attn.q_proj.weight"), "{e}");
    let e = load(json!({"vocab_size": 65}));
    assert!(e.contains("size mismatch for model.embed_tokens.weight") && e.contains("[64, 16]"), "{e}");
    // Long lists of problems are cut after the first few.
    let mut extra = w.clone();
    for i in 0..500 {
        extra.insert(format!("model.extra.{i}"), Tensor::zeros(&[1], DType::F32).unwrap());
    }
    let cfg = LlamaConfig::from_json(&base()).unwrap();
    let e = LlamaForCausalLM::from_weights(&cfg, &extra, DType::F32, Device::Cpu).unwrap_err().to_string();
    assert!(e.contains("Unexpected key(s)") && e.contains("and 492 more"), "{e}");
    assert!(e.len() < 1000, "{} bytes", e.len());
}

#[test]
fn generation_handles_empty_batches_and_huge_budgets() {
    kiln::manual_seed(1);
    let model = LlamaForCausalLM::new(&LlamaConfig::from_json(&base()).unwrap(), DType::F32).unwrap();
    let empty = Tensor::zeros(&[0, 3], DType::I64).unwrap();
    let out = generate(&model, &empty, 5, &Sampling::greedy()).unwrap();
    assert_eq!(out.shape(), &[0, 3]);
    let out = generate(&model, &empty, 5, &Sampling::sample(1.0)).unwrap();
    assert_eq!(out.shape(), &[0, 3]);
    // Every token stops generation: one step, whatever the budget (the KV cache
    // is not sized for the budget up front).
    let prompt = Tensor::new([[1i64, 2, 3], [4, 5, 6]]).unwrap();
    let all: Vec<i64> = (0..64).collect();
    let out = generate(&model, &prompt, 1 << 40, &Sampling::greedy().with_eos(&all)).unwrap();
    assert_eq!(out.shape(), &[2, 4]);
    let out = generate(&model, &prompt, usize::MAX, &Sampling::sample(0.7).with_eos(&all).with_seed(3)).unwrap();
    assert_eq!(out.shape(), &[2, 4]);
}

/// The child of `checkpoints_survive_kill_9`: saves and prunes forever,
/// printing `SAVED <step>` once each checkpoint is complete.
#[test]
#[ignore = "a child process of checkpoints_survive_kill_9"]
fn child_saving_checkpoints_forever() {
    use std::io::Write;
    let out = std::env::var("KILN_HOSTILE_CHECKPOINTS").expect("run by checkpoints_survive_kill_9, with a directory");
    kiln::manual_seed(2);
    let model = LlamaForCausalLM::new(&LlamaConfig::from_json(&base()).unwrap(), DType::F32).unwrap();
    let mut opt = AdamW::new(kiln::nn::module::Module::named_parameters(&model), AdamWConfig::default()).unwrap();
    let ids = Tensor::new([[1i64, 2, 3, 4]]).unwrap();
    let start = list_checkpoints(&out).unwrap().last().map_or(0, |(s, _)| *s);
    for step in start + 1.. {
        opt.zero_grad();
        kiln::nn::models::causal_lm_loss(&model.forward(&ids, None).unwrap(), &ids, None).unwrap().backward().unwrap();
        opt.step().unwrap();
        let state = TrainerState::capture(step, None).unwrap();
        save_checkpoint(checkpoint_dir(&out, step), &model, None, &opt, &state).unwrap();
        prune_checkpoints(&out, 2).unwrap();
        let mut o = std::io::stdout().lock();
        writeln!(o, "SAVED {step}").and_then(|_| o.flush()).unwrap();
    }
}

/// Twelve rounds of a child process that saves checkpoints, killed with
/// SIGKILL a random time after its first save: every round resumes from the
/// last complete checkpoint, every checkpoint the child reported complete
/// survives (or was pruned for a later one), and everything listed loads.
#[test]
fn checkpoints_survive_kill_9() {
    use std::io::BufRead;
    let out: PathBuf = support::temp_dir("hostile-kill");
    let exe = std::env::current_exe().unwrap();
    let mut rng = kiln::tensor::random::Xoshiro256::seeded(11);
    let mut last_saved = 0u64;
    for round in 0..12 {
        let mut child = std::process::Command::new(&exe)
            .args(["--exact", "child_saving_checkpoints_forever", "--ignored", "--nocapture", "--test-threads", "1"])
            .env("KILN_HOSTILE_CHECKPOINTS", &out)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // The child's reports, read on a thread so that the pipe never fills.
        let (tx, rx) = std::sync::mpsc::channel::<u64>();
        let stdout = child.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines().map_while(|l| l.ok()) {
                // libtest's "test child_saving_checkpoints_forever ... " may start the first line.
                if let Some(step) = line.rsplit_once("SAVED ").and_then(|(_, s)| s.trim().parse().ok()) {
                    let _ = tx.send(step);
                }
            }
        });
        let first = match rx.recv_timeout(std::time::Duration::from_secs(120)) {
            Ok(step) => step,
            Err(e) => {
                let _ = child.kill();
                let o = child.wait_with_output().unwrap();
                panic!("round {round}: the child saved nothing ({e}): {}", String::from_utf8_lossy(&o.stderr));
            }
        };
        assert_eq!(first, last_saved + 1, "round {round}: the child resumes after the last complete checkpoint");
        std::thread::sleep(std::time::Duration::from_millis(rng.next_u64() % 400));
        assert!(child.try_wait().unwrap().is_none(), "round {round}: the child exited before it was killed");
        child.kill().unwrap(); // SIGKILL
        let status = child.wait().unwrap();
        assert!(!status.success(), "round {round}: killed, {status}");
        reader.join().unwrap();
        last_saved = first.max(rx.try_iter().max().unwrap_or(first));
        // Every listed checkpoint loads entirely; nothing half-deleted is listed;
        // the last one the child reported complete is there (a later one, begun
        // when it was killed, may be too, if it was complete).
        let listed = list_checkpoints(&out).unwrap();
        let newest = listed.last().map(|(s, _)| *s);
        assert!(
            newest == Some(last_saved) || newest == Some(last_saved + 1),
            "round {round}: the child reported checkpoint-{last_saved} complete, the newest listed is {newest:?}"
        );
        last_saved = newest.unwrap();
        for (step, dir) in listed {
            let c = load_checkpoint(&dir).unwrap_or_else(|e| panic!("round {round}: checkpoint-{step}: {e}"));
            assert_eq!(c.state.step, step);
            assert!(!c.model_state().unwrap().is_empty(), "round {round}: checkpoint-{step} weights");
            c.optimizer_state().unwrap();
            assert!(dir.join(MANIFEST_FILE).is_file());
        }
    }
    // The next save removes what the killed processes left behind.
    let leftovers = |out: &PathBuf| {
        std::fs::read_dir(out)
            .unwrap()
            .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with('.'))
            .count()
    };
    let model = LlamaForCausalLM::new(&LlamaConfig::from_json(&base()).unwrap(), DType::F32).unwrap();
    let opt = AdamW::new(kiln::nn::module::Module::named_parameters(&model), AdamWConfig::default()).unwrap();
    save_checkpoint(checkpoint_dir(&out, 1 << 40), &model, None, &opt, &TrainerState::capture(1, None).unwrap())
        .unwrap();
    assert_eq!(leftovers(&out), 0);
    // A checkpoint missing a file (deleted by hand, a crash of another tool) is not listed, and refuses to load.
    let (_, last) = list_checkpoints(&out).unwrap().pop().unwrap();
    std::fs::remove_file(last.join("optimizer.safetensors")).unwrap();
    assert!(!list_checkpoints(&out).unwrap().iter().any(|(_, d)| *d == last));
    let e = load_checkpoint(&last).unwrap_err().to_string();
    assert!(e.contains("not a complete checkpoint"), "{e}");
    std::fs::remove_dir_all(&out).unwrap();
}
