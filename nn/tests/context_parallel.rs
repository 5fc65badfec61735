//! Context parallelism (`kiln::nn::parallel::ContextParallel`): the llama
//! and qwen3 fixtures with every sequence split over a `cp` axis of 4 XLA:CPU
//! devices and attention computed as ring attention reproduce the
//! one-device golden values (logits, loss, every gradient, AdamW steps 1 and
//! 10, the loss curve), in TorchTitan's load-balanced order and in plain
//! order, op by op and with the training step captured by `kiln::compile`.
mod support;

use kiln::nn::models::LlamaForCausalLM;
use kiln::nn::module::Module;
use kiln::nn::optim::{AdamW, AdamWConfig, Optimizer};
use kiln::nn::parallel::{replicate, ContextParallel};
use kiln::prelude::*;
use kiln::{init_device_mesh, DeviceKind};
use support::{assert_close, check_params, fixture_dir, register_tpu_with_devices, tolerance};

fn check(name: &str, load_balance: bool, compiled: bool) {
    register_tpu_with_devices(8);
    let what = format!(
        "{name} cp=4{}{}",
        if load_balance { " balanced" } else { "" },
        if compiled { " compiled" } else { "" }
    );
    let g = kiln::nn::io::load_safetensors(fixture_dir(name).join("golden.safetensors")).unwrap();
    let ids = &g["input_ids"];
    let mesh = init_device_mesh(DeviceKind::Tpu, &[4], &["cp"]).unwrap();
    let cp = ContextParallel::new(&mesh, "cp", load_balance).unwrap();
    let mut model = LlamaForCausalLM::from_pretrained(fixture_dir(name), DType::F32, Device::Cpu).unwrap();
    replicate(&mut model, &mesh).unwrap();
    model.set_context_parallel(Some(cp.clone()));
    let x = cp.shard_sequence(ids).unwrap();
    let logits = model.forward(&x, None).unwrap();
    let (la, lr) = tolerance(name, "logits");
    assert_close(&format!("{what} logits"), &cp.unshard_sequence(&logits).unwrap(), &g["logits"], la, lr);
    let loss = cp.causal_lm_loss(&logits, ids).unwrap();
    let (sa, sr) = tolerance(name, "loss");
    assert_close(&format!("{what} loss"), &loss, &g["loss"], sa, sr);
    loss.backward().unwrap();
    let (ga, gr) = tolerance(name, "grad");
    for (n, p) in model.named_parameters() {
        let grad = p.grad().unwrap_or_else(|| panic!("{what}: {n} got no gradient"));
        assert_close(&format!("{what} grad.{n}"), &grad, &g[&format!("grad.{n}")], ga, gr);
    }
    let cfg = AdamWConfig { lr: 1e-3, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1, amsgrad: false };
    let mut opt = AdamW::new(model.named_parameters(), cfg).unwrap();
    opt.set_capturable(compiled).unwrap();
    opt.step().unwrap();
    check_params(name, &model.named_parameters(), &g, "adamw_step1");
    let mut curve = vec![loss.item::<f32>().unwrap()];
    let step = |opt: &mut AdamW| -> kiln::Result<Tensor> {
        opt.zero_grad();
        let l = cp.causal_lm_loss(&model.forward(&x, None)?, ids)?;
        l.backward()?;
        opt.step()?;
        Ok(l)
    };
    if compiled {
        let mut c = kiln::compile(mesh.device(), |_: &[Tensor]| Ok(vec![step(&mut opt)?]));
        for _ in 1..10 {
            curve.push(c.call(&[]).unwrap()[0].item::<f32>().unwrap());
        }
        let s = c.stats();
        assert!(s.retraces == 0 && s.replays >= 7, "{what}: {s:?}");
    } else {
        for _ in 1..10 {
            curve.push(step(&mut opt).unwrap().item::<f32>().unwrap());
        }
    }
    check_params(name, &model.named_parameters(), &g, "adamw_step10");
    curve.push(cp.causal_lm_loss(&model.forward(&x, None).unwrap(), ids).unwrap().item::<f32>().unwrap());
    let (ca, cr) = tolerance(name, "loss_curve");
    assert_close(
        &format!("{what} loss curve"),
        &Tensor::from_vec(curve, &[11]).unwrap(),
        &g["loss_curve"],
        ca.max(5e-5),
        cr,
    );
}

#[test]
fn ring_attention_over_four_devices_reproduces_the_fixtures() {
    check("llama", true, false);
    check("qwen3", false, false);
}

#[test]
fn a_captured_context_parallel_step_reproduces_the_fixtures() {
    check("llama", false, true);
    check("qwen3", true, true);
}

#[test]
fn sequences_that_do_not_split_and_bad_meshes_are_errors() {
    register_tpu_with_devices(8);
    let mesh = init_device_mesh(DeviceKind::Tpu, &[4], &["cp"]).unwrap();
    let cp = ContextParallel::new(&mesh, "cp", true).unwrap();
    // Balanced: 2 chunks per device, chunk i and 2cp - 1 - i on device i.
    assert_eq!(cp.order(16).unwrap(), vec![0, 1, 14, 15, 2, 3, 12, 13, 4, 5, 10, 11, 6, 7, 8, 9]);
    let e = cp.order(12).unwrap_err().to_string();
    assert!(e.contains("does not split into 8 equal chunks"), "{e}");
    let plain = ContextParallel::new(&mesh, "cp", false).unwrap();
    assert_eq!(plain.order(12).unwrap(), (0..12).collect::<Vec<_>>());
    let m2 = init_device_mesh(DeviceKind::Tpu, &[2, 2], &["dp", "cp"]).unwrap();
    assert!(ContextParallel::new(&m2, "cp", true).is_err());
    assert!(ContextParallel::new(&mesh, "sp", true).is_err());
    // A padding mask or a KV cache has no meaning under a split sequence.
    let mut model = LlamaForCausalLM::from_pretrained(fixture_dir("llama"), DType::F32, Device::Cpu).unwrap();
    replicate(&mut model, &mesh).unwrap();
    model.set_context_parallel(Some(cp.clone()));
    let ids = cp.shard_sequence(&Tensor::zeros(&[1, 16], DType::I64).unwrap()).unwrap();
    let mask = Tensor::ones(&[1, 16], (DType::I64, mesh.device())).unwrap();
    let e = model.forward(&ids, Some(&mask)).unwrap_err().to_string();
    assert!(e.contains("no padding mask"), "{e}");
}
