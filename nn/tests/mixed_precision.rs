//! bf16 mixed precision (autocast) against PyTorch's
//! `torch.autocast(device_type="cpu", dtype=torch.bfloat16)` training of the
//! llama fixture (`shared/fixtures/llama/golden_amp_bf16.safetensors`): the
//! loss curve of 10 AdamW steps on the CPU and on PJRT (strict, defer,
//! compiled), float32 master weights and gradients, bfloat16 products.
mod support;

use kiln::nn::io::load_safetensors;
use kiln::nn::models::{causal_lm_loss, LlamaForCausalLM};
use kiln::nn::module::Module;
use kiln::nn::optim::{AdamW, AdamWConfig, Optimizer};
use kiln::nn::parallel::{fully_shard_with, Recipe};
use kiln::nn::precision::MixedPrecisionPolicy;
use kiln::prelude::*;
use support::fixture_dir;

/// The bound on |kiln - PyTorch| per step of the loss curve: golden_amp_bf16.json's
/// suggested bound (4x the spread between two PyTorch attention kernels, at least 0.02).
fn bound() -> f64 {
    let text = std::fs::read_to_string(fixture_dir("llama").join("golden_amp_bf16.json")).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["suggested_bound_abs"].as_f64().unwrap()
}

/// The loss before each of 10 AdamW steps and after the last, the forward under
/// autocast to bf16, plus the first logits; optionally the step compiled, or
/// the model sharded FSDP-style over two devices with the policy.
fn curve(dev: Device, compiled: bool, fsdp: bool) -> (Vec<f64>, Tensor) {
    let dir = fixture_dir("llama");
    let ids = load_safetensors(dir.join("golden.safetensors")).unwrap()["input_ids"].clone();
    let policy = MixedPrecisionPolicy { output_dtype: None, ..MixedPrecisionPolicy::bf16_mixed() };
    let (mut model, ids) = if fsdp {
        let mesh = kiln::init_device_mesh(kiln::DeviceKind::Tpu, &[2], &["dp"]).unwrap();
        let mut m = LlamaForCausalLM::from_pretrained(&dir, DType::F32, mesh.device()).unwrap();
        fully_shard_with(&mut m, &mesh, policy).unwrap();
        (m, Recipe::Fsdp.place_batch(&ids, &mesh).unwrap())
    } else {
        (LlamaForCausalLM::from_pretrained(&dir, DType::F32, dev).unwrap(), ids.to_device(dev).unwrap())
    };
    model.train(true);
    let cfg = AdamWConfig { lr: 1e-3, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1, amsgrad: false };
    let mut opt = AdamW::new(model.named_parameters(), cfg).unwrap();
    opt.set_capturable(compiled).unwrap();
    let forward = |m: &LlamaForCausalLM| -> kiln::Result<(Tensor, Tensor)> {
        let logits = if fsdp {
            m.forward(&ids, None)? // the model's policy
        } else {
            let _amp = kiln::tensor::autocast(DType::BF16)?;
            m.forward(&ids, None)?
        };
        let loss = causal_lm_loss(&logits.to_dtype(DType::F32)?, &ids, None)?;
        Ok((logits, loss))
    };
    let (first, _) = forward(&model).unwrap();
    let first = first.detach().to_device(Device::Cpu).unwrap();
    let mut losses = vec![];
    if compiled {
        let mut step = kiln::compile(dev, |_: &[Tensor]| {
            opt.zero_grad();
            let (_, loss) = forward(&model)?;
            loss.backward()?;
            opt.step()?;
            Ok(vec![loss])
        });
        for _ in 0..10 {
            losses.push(step.call(&[]).unwrap()[0].item::<f32>().unwrap() as f64);
        }
        assert!(step.stats().replays >= 7, "{:?}", step.stats());
    } else {
        for _ in 0..10 {
            opt.zero_grad();
            let (_, loss) = forward(&model).unwrap();
            loss.backward().unwrap();
            opt.step().unwrap();
            losses.push(loss.item::<f32>().unwrap() as f64);
        }
    }
    let _g = kiln::autograd::no_grad();
    losses.push(forward(&model).unwrap().1.item::<f32>().unwrap() as f64);
    for (n, p) in model.named_parameters() {
        assert_eq!(p.dtype(), DType::F32, "{n}: master weights stay float32");
    }
    (losses, first)
}

fn check(dev: Device, compiled: bool, fsdp: bool, what: &str) {
    let g = load_safetensors(fixture_dir("llama").join("golden_amp_bf16.safetensors")).unwrap();
    let want: Vec<f64> = g["amp.loss_curve"].to_vec_f64().unwrap();
    let f32_curve: Vec<f64> = g["f32.loss_curve"].to_vec_f64().unwrap();
    let (got, logits) = curve(dev, compiled, fsdp);
    assert_eq!(logits.dtype(), DType::BF16, "{what}: the logits come out of a bf16 product");
    let b = bound();
    for (i, (a, w)) in got.iter().zip(&want).enumerate() {
        assert!((a - w).abs() <= b, "{what}: step {i}: loss {a} vs PyTorch autocast {w} (bound {b})");
        assert!((a - f32_curve[i]).abs() <= b, "{what}: step {i}: loss {a} vs the f32 run {}", f32_curve[i]);
    }
    let worst = got.iter().zip(&want).map(|(a, w)| (a - w).abs()).fold(0.0, f64::max);
    let l = logits.to_dtype(DType::F32).unwrap().to_vec_f64().unwrap();
    let lw = g["amp.logits"].to_vec_f64().unwrap();
    let lmax = l.iter().zip(&lw).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
    eprintln!("{what}: max |loss - PyTorch autocast| {worst:.2e}, max |first logits diff| {lmax:.2e}");
    assert!(lmax < 0.1, "{what}: first logits differ from PyTorch autocast's by {lmax}");
}

#[test]
fn bf16_autocast_training_matches_pytorch_on_the_cpu() {
    check(Device::Cpu, false, false, "cpu");
}

#[test]
fn bf16_autocast_training_matches_pytorch_on_pjrt() {
    support::register_tpu();
    for mode in [kiln::tpu::Mode::Strict, kiln::tpu::Mode::Defer] {
        kiln::tpu::set_mode(mode);
        check(Device::Tpu(0), false, false, mode.name());
    }
    kiln::tpu::set_mode(kiln::tpu::Mode::Strict);
    check(Device::Tpu(0), true, false, "compiled");
    check(Device::Tpu(0), false, true, "FSDP over 2 devices with the policy");
}

#[test]
fn autocast_rules() {
    let w = Tensor::ones(&[4, 4], DType::F32).unwrap();
    let x = Tensor::ones(&[2, 4], DType::F32).unwrap();
    {
        let _amp = kiln::tensor::autocast(DType::BF16).unwrap();
        let y = x.linear(&w, Some(&Tensor::ones(&[4], DType::F32).unwrap())).unwrap();
        assert_eq!(y.dtype(), DType::BF16, "linear runs in bf16, its bias too");
        assert_eq!(y.softmax(-1).unwrap().dtype(), DType::F32);
        assert_eq!(y.sum().unwrap().dtype(), DType::F32);
        assert_eq!(y.add(&x).unwrap().dtype(), DType::F32, "other ops promote as usual");
        let d = Tensor::ones(&[2, 4], DType::F64).unwrap();
        assert_eq!(d.matmul(&Tensor::ones(&[4, 4], DType::F64).unwrap()).unwrap().dtype(), DType::F64);
        {
            let _inner = kiln::tensor::autocast(DType::F16).unwrap();
            assert_eq!(x.matmul(&w).unwrap().dtype(), DType::F16);
        }
        assert_eq!(x.matmul(&w).unwrap().dtype(), DType::BF16, "the outer scope comes back");
    }
    assert_eq!(x.matmul(&w).unwrap().dtype(), DType::F32);
    assert!(kiln::tensor::autocast(DType::I32).is_err());
    // Gradients of float32 leaves are float32.
    let p = Tensor::ones(&[4, 4], DType::F32).unwrap();
    p.requires_grad_(true).unwrap();
    let loss = {
        let _amp = kiln::tensor::autocast(DType::BF16).unwrap();
        x.matmul(&p).unwrap().sum().unwrap()
    };
    loss.backward().unwrap();
    assert_eq!(p.grad().unwrap().dtype(), DType::F32);
}
