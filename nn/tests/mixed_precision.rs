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
    let (got, logits) = curve(dev, compiled, fsdp);
    assert_eq!(logits.dtype(), DType::BF16, "{what}: the logits come out of a bf16 product");
    // The loss curve cannot tell autocast from float32 (PyTorch's two
    // differ by at most 3.2e-3, as much as its autocast with two attention
    // kernels): it checks that training follows PyTorch's, within the
    // fixture's suggested bound. The products are checked below, and the
    // first logits here.
    let b = bound();
    for (i, (a, w)) in got.iter().zip(&want).enumerate() {
        assert!((a - w).abs() <= b, "{what}: step {i}: loss {a} vs PyTorch autocast {w} (bound {b})");
    }
    let worst = got.iter().zip(&want).map(|(a, w)| (a - w).abs()).fold(0.0, f64::max);
    eprintln!("{what}: max |loss - PyTorch autocast| {worst:.2e}");
    // The first logits, against the fixture's own spread (measured: 2124 of
    // 8192 equal to PyTorch's autocast logits, 1408 for its float32 ones).
    let f32_logits = &load_safetensors(fixture_dir("llama").join("golden.safetensors")).unwrap()["logits"];
    support::assert_nearer_than_f32(&format!("{what} first logits"), &logits, &g["amp.logits"], f32_logits);
}

#[test]
fn bf16_autocast_training_matches_pytorch_on_the_cpu() {
    check(Device::Cpu, false, false, "cpu");
}

/// The loss and every parameter's gradient of one autocast step of the
/// llama fixture on the CPU, eager or captured (the fourth call, a replay).
fn step_grads(compiled: bool) -> Vec<Tensor> {
    let dir = fixture_dir("llama");
    let ids = load_safetensors(dir.join("golden.safetensors")).unwrap()["input_ids"].clone();
    let mut model = LlamaForCausalLM::from_pretrained(&dir, DType::F32, Device::Cpu).unwrap();
    model.train(true);
    let params = model.named_parameters();
    let step = |_: &[Tensor]| -> kiln::Result<Vec<Tensor>> {
        model.zero_grad();
        let logits = {
            let _amp = kiln::tensor::autocast(DType::BF16)?;
            model.forward(&ids, None)?
        };
        let loss = causal_lm_loss(&logits.to_dtype(DType::F32)?, &ids, None)?;
        loss.backward()?;
        let grads =
            params.iter().map(|(n, p)| p.grad().ok_or_else(|| kiln::Error::invalid("test", format!("{n}: no grad"))));
        std::iter::once(Ok(loss)).chain(grads).collect()
    };
    if !compiled {
        return step(&[]).unwrap();
    }
    let mut c = kiln::compile(Device::Cpu, step);
    let out = (0..4).map(|_| c.call(&[]).unwrap()).last().unwrap();
    assert!(c.stats().replays >= 2, "{:?}", c.stats());
    out
}

/// A captured step replays with the CPU's folded casts and fused groups
/// (Note [Folded casts] in kiln-cpu, Note [Fused groups] in kiln-tensor),
/// which promise the eager ops' bits: the loss and the gradients of an
/// autocast step, whose rotary embeddings and loss sit between casts, are
/// the eager step's exactly.
#[test]
fn a_compiled_bf16_step_on_the_cpu_gives_the_eager_bits() {
    let (eager, compiled) = (step_grads(false), step_grads(true));
    assert_eq!(eager.len(), compiled.len());
    for (k, (e, c)) in eager.iter().zip(&compiled).enumerate() {
        let bits = |t: &Tensor| t.to_vec::<f32>().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let (e, c) = (bits(e), bits(c));
        let bad = e.iter().zip(&c).position(|(a, b)| a != b);
        assert!(bad.is_none(), "output {k} (0: the loss, then the gradients) differs at element {bad:?}");
    }
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

/// `x` (float32, CPU) rounded to bfloat16 and back: the values a bfloat16 product reads.
fn bf16_values(x: &Tensor) -> Tensor {
    x.to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap()
}

/// The bfloat16 values of `t` as integers in the order of the values, one
/// apart for neighbouring bfloat16 numbers (a bfloat16 is the high half of its
/// float32; negative values count down from zero).
fn bf16_ordinals(t: &Tensor) -> Vec<i32> {
    assert_eq!(t.dtype(), DType::BF16, "an autocast product is bfloat16");
    let v = t.to_device(Device::Cpu).unwrap().to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
    v.iter()
        .map(|x| {
            let bits = (x.to_bits() >> 16) as i32;
            if bits & 0x8000 != 0 {
                -(bits & 0x7fff)
            } else {
                bits
            }
        })
        .collect()
}

/// Each autocast product (matmul, a batched matmul, linear) is the bfloat16
/// rounding of the float32-accumulated product of its operands rounded to
/// bfloat16, within one bfloat16 ulp: the float32 sums' order is the
/// kernel's (XLA's on PJRT; on the CPU, AMX tiles sum in another order than
/// the float32 product, which shows in a few double roundings), in every mode and captured by
/// `kiln::compile` in every mode; and it is not the product of the float32
/// operands rounded at the end (those agree in about half of the elements,
/// the right ones in all or nearly all). A bias joins the rounded product
/// in bfloat16 (Note [Autocast]).
#[test]
fn autocast_products_round_their_operands_to_bf16() {
    support::register_tpu();
    let g = kiln::Generator::new(Device::Cpu).unwrap().manual_seed(17).unwrap();
    let x = g.randn(&[3, 24, 96], DType::F32).unwrap();
    let w = g.randn(&[80, 96], DType::F32).unwrap();
    let b = g.randn(&[80], DType::F32).unwrap();
    let y = g.randn(&[3, 96, 40], DType::F32).unwrap();
    let ops = |x: &Tensor, w: &Tensor, b: &Tensor, y: &Tensor| -> kiln::Result<Vec<Tensor>> {
        let _amp = kiln::tensor::autocast(DType::BF16)?;
        Ok(vec![x.matmul(&w.t()?)?, x.matmul(y)?, x.linear(w, None)?, x.linear(w, Some(b))?])
    };
    // References on the CPU without autocast, from the float32 products of
    // the given operands: rounded to bfloat16 (and the rounded bias added in
    // bfloat16). `want` from the operands rounded first, `from_f32` from
    // the float32 operands (a float32 computation cast at the end).
    let products = |x: &Tensor, w: &Tensor, b: &Tensor, y: &Tensor| -> Vec<Vec<i32>> {
        let bf16 = |t: Tensor| t.to_dtype(DType::BF16).unwrap();
        let xw = bf16(x.matmul(&w.t().unwrap()).unwrap());
        let with_bias = xw.add(&bf16(b.clone())).unwrap();
        [xw.clone(), bf16(x.matmul(y).unwrap()), xw, with_bias].iter().map(bf16_ordinals).collect()
    };
    let want = products(&bf16_values(&x), &bf16_values(&w), &bf16_values(&b), &bf16_values(&y));
    let from_f32 = products(&x, &w, &b, &y);
    let names = ["matmul x @ w.T", "batched matmul", "linear", "linear with bias"];
    let check = |what: &str, got: Vec<Tensor>| {
        let most = 1;
        for ((name, g), (w, f)) in names.iter().zip(got.iter().map(bf16_ordinals)).zip(want.iter().zip(&from_f32)) {
            let ulps = g.iter().zip(w).map(|(a, b)| (a - b).abs()).max().unwrap();
            let exact = g.iter().zip(w).filter(|(a, b)| a == b).count();
            let as_f32 = g.iter().zip(f).filter(|(a, b)| a == b).count();
            eprintln!("{what} {name}: {exact}/{} exact, max {ulps} ulp; {as_f32} as the rounded f32 product", g.len());
            assert!(ulps <= most, "{what} {name}: {ulps} bf16 ulps from the product of bf16 operands");
            assert!(exact > as_f32, "{what} {name}: closer to the float32 product rounded at the end");
        }
    };
    check("cpu", ops(&x, &w, &b, &y).unwrap());
    let dev = Device::Tpu(0);
    let on = |t: &Tensor| t.to_device(dev).unwrap();
    let (xd, wd, bd, yd) = (on(&x), on(&w), on(&b), on(&y));
    for mode in [kiln::tpu::Mode::Strict, kiln::tpu::Mode::Debug, kiln::tpu::Mode::Defer] {
        kiln::tpu::set_mode(mode);
        check(mode.name(), ops(&xd, &wd, &bd, &yd).unwrap());
        let mut f = kiln::compile(dev, |a: &[Tensor]| ops(&a[0], &a[1], &a[2], &a[3]));
        for _ in 0..3 {
            let got = f.call(&[xd.clone(), wd.clone(), bd.clone(), yd.clone()]).unwrap();
            check(&format!("compiled, {}", mode.name()), got);
        }
        assert!(f.stats().replays >= 1, "{:?}", f.stats());
    }
    kiln::tpu::set_mode(kiln::tpu::Mode::Strict);
}
