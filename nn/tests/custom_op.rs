//! The Llama and Qwen3 fixtures with every decoder block's residual add and
//! post-attention norm replaced by the custom op `add_rms_norm`
//! (`examples/support`, Note [Custom ops]): logits, loss and every gradient
//! against the golden files, and against the same model with the built-in
//! ops, on the CPU and on the PJRT device in Strict and DeferAndFuse mode;
//! AdamW steps 1 and 10 with the training step captured by `kiln::compile`;
//! greedy generation.
#[path = "../../examples/support/add_rms_norm.rs"]
mod add_rms_norm;
mod support;

use kiln::nn::generate::{generate, Sampling};
use kiln::nn::io::load_safetensors;
use kiln::nn::models::{causal_lm_loss, LlamaForCausalLM};
use kiln::nn::module::Module;
use kiln::nn::optim::{AdamW, AdamWConfig, Optimizer};
use kiln::prelude::*;
use std::collections::BTreeMap;
use support::{assert_close, fixture_dir, tolerance};

/// The tests run one at a time: one counts the custom op's calls in the
/// (process-wide) profile.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn golden(name: &str) -> BTreeMap<String, Tensor> {
    load_safetensors(fixture_dir(name).join("golden.safetensors")).expect("golden.safetensors")
}

fn load(name: &str, dev: Device, fused: bool) -> LlamaForCausalLM {
    let mut m = LlamaForCausalLM::from_pretrained(fixture_dir(name), DType::F32, dev).expect("from_pretrained");
    if fused {
        m.set_residual_norm(Some(add_rms_norm::residual_norm()));
    }
    m
}

/// Logits, loss and gradients of the fused model against the golden file
/// and against the built-in model (which the fixtures already hold to it).
fn check_forward_backward(name: &str, dev: Device) {
    let g = golden(name);
    let ids = g["input_ids"].to_device(dev).unwrap();
    let what = format!("{name} with add_rms_norm on {dev}");
    let (fused, plain) = (load(name, dev, true), load(name, dev, false));
    let loss = support::check_logits_and_loss(&what, name, &fused, &ids, &g);
    let want = causal_lm_loss(&plain.forward(&ids, None).unwrap(), &ids, None).unwrap();
    assert_close(&format!("{what}: loss vs built-in"), &loss, &want, 1e-6, 1e-6);
    loss.backward().unwrap();
    want.backward().unwrap();
    let (ga, gr) = tolerance(name, "grad");
    let plain_params: BTreeMap<String, Tensor> = plain.named_parameters().into_iter().collect();
    let params = fused.named_parameters();
    assert_eq!(params.len(), g.keys().filter(|k| k.starts_with("grad.")).count());
    let mut worst = 0f64;
    for (n, p) in &params {
        let got = p.grad().unwrap_or_else(|| panic!("{what}: {n} has no gradient"));
        worst = worst.max(assert_close(&format!("{what} grad.{n}"), &got, &g[&format!("grad.{n}")], ga, gr));
        let built_in = plain_params[n].grad().unwrap();
        assert_close(&format!("{what} grad.{n} vs built-in"), &got, &built_in, 1e-6, 1e-5);
    }
    println!("{what}: gradients within {worst:.2e} of the golden ones");
}

#[test]
fn fixtures_on_the_cpu() {
    let _s = serial();
    for name in ["llama", "qwen3"] {
        check_forward_backward(name, Device::Cpu);
    }
    // The blocks did run the custom op: once per layer in a forward.
    let model = load("llama", Device::Cpu, true);
    let ids = golden("llama")["input_ids"].clone();
    kiln::tensor::profile::enable(true);
    model.forward(&ids, None).unwrap();
    let rows = kiln::tensor::profile::take();
    kiln::tensor::profile::enable(false);
    let calls: u64 = rows.iter().filter(|r| r.op == "add_rms_norm").map(|r| r.calls).sum();
    assert_eq!(calls as usize, model.config().num_hidden_layers, "{rows:?}");
}

#[test]
fn fixtures_on_tpu_strict_and_defer() {
    let _s = serial();
    support::register_tpu();
    for mode in [kiln::tpu::Mode::Strict, kiln::tpu::Mode::Defer] {
        kiln::tpu::with_mode(mode, || {
            for name in ["llama", "qwen3"] {
                check_forward_backward(name, Device::Tpu(0));
            }
        });
    }
}

/// AdamW steps 1 and 10 and the loss curve, every step (zero_grad, forward,
/// loss, backward, capturable AdamW) captured by `kiln::compile` on `tpu:0`;
/// then greedy generation.
#[test]
fn compiled_training_steps_and_generation() {
    let _s = serial();
    support::register_tpu();
    let dev = Device::Tpu(0);
    for name in ["llama", "qwen3"] {
        let g = golden(name);
        let model = load(name, dev, true);
        let ids = g["input_ids"].to_device(dev).unwrap();
        let cfg = AdamWConfig { lr: 1e-3, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1, amsgrad: false };
        let mut opt = AdamW::new(model.named_parameters(), cfg).unwrap();
        opt.set_capturable(true).unwrap();
        let mut step = kiln::compile(dev, |_: &[Tensor]| {
            opt.zero_grad();
            let loss = causal_lm_loss(&model.forward(&ids, None)?, &ids, None)?;
            loss.backward()?;
            opt.step()?;
            Ok(vec![loss])
        });
        let mut curve = vec![];
        for i in 1..=10 {
            curve.push(step.call(&[]).unwrap()[0].item::<f32>().unwrap());
            if i == 1 {
                support::check_params(name, &model.named_parameters(), &g, "adamw_step1");
            }
        }
        let s = step.stats();
        assert_eq!(s.retraces, 0, "{s:?}");
        assert!(s.replays >= 7, "the step replays once its trace is stable: {s:?}");
        drop(step);
        let e10 = support::check_params(name, &model.named_parameters(), &g, "adamw_step10");
        let (ca, cr) = tolerance(name, "loss_curve");
        let got = Tensor::from_vec(curve, &[10]).unwrap();
        assert_close(&format!("{name} loss curve"), &got, &g["loss_curve"].narrow(0, 0, 10).unwrap(), 4.0 * ca, cr);
        println!("{name} with add_rms_norm, compiled AdamW: step 10 within {e10:.2e}");

        let fresh = load(name, dev, true);
        let prompt = g["generate.prompt"].to_device(dev).unwrap();
        let new = g["generate.output"].shape()[1] - prompt.shape()[1];
        let out = generate(&fresh, &prompt, new, &Sampling::greedy()).unwrap();
        assert_eq!(out.to_vec::<i64>().unwrap(), g["generate.output"].to_vec::<i64>().unwrap(), "{name}: generation");
    }
}
