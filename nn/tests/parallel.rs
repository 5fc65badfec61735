//! The llama and qwen3 fixtures trained with every parallelism recipe on the
//! XLA:CPU plugin's devices (`kiln::nn::parallel`): data parallelism, FSDP,
//! tensor parallelism and 2-D FSDP x TP reproduce the single-device golden
//! values (logits, loss, every gradient, the global gradient norm clipping
//! uses, AdamW steps 1 and 10, the loss curve) eagerly (Strict, Debug and
//! DeferAndFuse mode) and with the AdamW steps captured by `kiln::compile`,
//! on four devices and on eight (`kiln::tpu::register_with_cpu_devices(8)`, by this
//! binary before the backend starts); and sharded checkpoints, saved shard by
//! shard and resumed on other meshes, other recipes and one device.
mod support;

use kiln::nn::checkpoint::{load_checkpoint, save_checkpoint, TrainerState, OPTIMIZER_FILE};
use kiln::nn::io::{load_checkpoint_dir, load_safetensors, save_safetensors, INDEX_FILE, SINGLE_FILE};
use kiln::nn::models::{causal_lm_loss, LlamaForCausalLM};
use kiln::nn::module::Module;
use kiln::nn::optim::{AdamW, AdamWConfig, Optimizer};
use kiln::nn::parallel::{fully_shard, llama_tp_plan, parallelize_module, replicate, shard_batch, ParallelStyle};
use kiln::prelude::*;
use kiln::{distribute_tensor, init_device_mesh, DeviceKind, DeviceMesh, Placement};
use std::collections::BTreeMap;
use support::{
    assert_close, assert_golden_grad_norm, check_logits_and_loss, check_params, fixture_dir, nine_more_steps,
    python_with_safetensors, register_tpu_with_devices, temp_dir, tolerance,
};

#[derive(Clone, Copy, Debug, PartialEq)]
enum Recipe {
    Ddp,
    Fsdp,
    Tp,
    FsdpTp,
}

impl Recipe {
    /// The mesh axes the recipe uses.
    fn axes(self) -> &'static [&'static str] {
        match self {
            Recipe::Ddp | Recipe::Fsdp => &["dp"],
            Recipe::Tp => &["tp"],
            Recipe::FsdpTp => &["dp", "tp"],
        }
    }

    /// Parallelizes `model` (on `mesh`) and places the batch `ids` for it.
    fn apply(self, model: &mut LlamaForCausalLM, mesh: &DeviceMesh, ids: &Tensor) -> Tensor {
        match self {
            Recipe::Ddp => {
                replicate(model, mesh).unwrap();
                shard_batch(ids, mesh).unwrap()
            }
            Recipe::Fsdp => {
                fully_shard(model, mesh).unwrap();
                shard_batch(ids, mesh).unwrap()
            }
            Recipe::Tp => {
                parallelize_module(model, mesh, &llama_tp_plan()).unwrap();
                ids.to_device(mesh.device()).unwrap()
            }
            Recipe::FsdpTp => {
                parallelize_module(model, &mesh["tp"], &llama_tp_plan()).unwrap();
                fully_shard(model, &mesh["dp"]).unwrap();
                shard_batch(ids, &mesh["dp"]).unwrap()
            }
        }
    }
}

/// Registers the PJRT backend with eight XLA:CPU devices.
fn eight_devices() {
    register_tpu_with_devices(8);
}

/// Loads fixture `name` onto a mesh of `shape` ("dp" and/or "tp" axes),
/// applies `recipe`, and checks one forward/backward and ten AdamW steps
/// against the golden file.
fn check(name: &str, recipe: Recipe, shape: &[usize], compiled: bool) {
    eight_devices();
    let g = load_safetensors(fixture_dir(name).join("golden.safetensors")).unwrap();
    let mesh = init_device_mesh(DeviceKind::Tpu, shape, recipe.axes()).unwrap();
    let mut model = LlamaForCausalLM::from_pretrained(fixture_dir(name), DType::F32, mesh.device()).unwrap();
    let ids = recipe.apply(&mut model, &mesh, &g["input_ids"]);
    // The recipes' placements, as PyTorch's would report them.
    let params: std::collections::BTreeMap<String, Tensor> = model.named_parameters().into_iter().collect();
    let q = &params["model.layers.0.self_attn.q_proj.weight"];
    let o = &params["model.layers.0.self_attn.o_proj.weight"];
    let root = |t: &Tensor| {
        let (m, p) = (t.device_mesh().unwrap(), t.placements().unwrap());
        let mut r = vec![Placement::Replicate; mesh.ndim()];
        for (i, x) in p.iter().enumerate() {
            r[m.root_axis_of(i)] = *x;
        }
        r
    };
    use Placement::{Replicate, Shard};
    let (wq, wo) = match recipe {
        Recipe::Ddp => (vec![Replicate], vec![Replicate]),
        Recipe::Fsdp => (vec![Shard(0)], vec![Shard(0)]),
        Recipe::Tp => (vec![Shard(0)], vec![Shard(1)]),
        Recipe::FsdpTp => (vec![Shard(0), Shard(0)], vec![Shard(0), Shard(1)]),
    };
    assert_eq!((root(q), root(o)), (wq, wo), "{recipe:?}");

    let what = format!("{name} {recipe:?} {shape:?} {}", if compiled { "compiled" } else { "eager" });
    let loss = check_logits_and_loss(&what, name, &model, &ids, &g);
    loss.backward().unwrap();
    let (ga, gr) = tolerance(name, "grad");
    for (n, p) in model.named_parameters() {
        let grad = p.grad().unwrap_or_else(|| panic!("{what}: {n} got no gradient"));
        assert!(grad.is_distributed());
        assert_close(&format!("{what} grad.{n}"), &grad, &g[&format!("grad.{n}")], ga, gr);
    }

    // Gradient clipping's global norm over sharded gradients equals the norm of the golden ones.
    let norm = kiln::nn::clip::grad_norm(&model.parameters()).unwrap().item::<f32>().unwrap() as f64;
    assert_golden_grad_norm(&what, norm, &g);
    let cfg = AdamWConfig { lr: 1e-3, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1, amsgrad: false };
    let mut opt = AdamW::new(model.named_parameters(), cfg).unwrap();
    opt.set_capturable(compiled).unwrap();
    let mut curve = vec![loss.item::<f32>().unwrap()];
    opt.step().unwrap();
    check_params(name, &model.named_parameters(), &g, "adamw_step1");
    // Optimizer state and parameters keep the recipe's split.
    assert_eq!(root(&params["model.layers.0.self_attn.q_proj.weight"]), root(q));
    curve.extend(nine_more_steps(&what, &model, &mut opt, &ids, mesh.device(), compiled));
    check_params(name, &model.named_parameters(), &g, "adamw_step10");
    let (ca, cr) = tolerance(name, "loss_curve");
    // As on one PJRT device (see hf_fixtures.rs): gradient elements that are
    // zero up to rounding move the curve by about 1e-5 after step 1.
    let ca = ca.max(5e-5);
    let n = curve.len();
    assert_close(&format!("{what} loss curve"), &Tensor::from_vec(curve, &[n]).unwrap(), &g["loss_curve"], ca, cr);
}

#[test]
fn data_parallel_reproduces_the_fixtures() {
    for compiled in [false, true] {
        check("llama", Recipe::Ddp, &[4], compiled);
        check("qwen3", Recipe::Ddp, &[4], compiled);
    }
}

#[test]
fn fsdp_reproduces_the_fixtures() {
    for compiled in [false, true] {
        check("llama", Recipe::Fsdp, &[4], compiled);
        check("qwen3", Recipe::Fsdp, &[4], compiled);
    }
}

#[test]
fn tensor_parallel_reproduces_the_fixtures() {
    for compiled in [false, true] {
        check("llama", Recipe::Tp, &[4], compiled);
        check("qwen3", Recipe::Tp, &[4], compiled);
    }
}

#[test]
fn fsdp_times_tp_reproduces_the_fixtures() {
    for compiled in [false, true] {
        check("llama", Recipe::FsdpTp, &[2, 2], compiled);
        check("qwen3", Recipe::FsdpTp, &[2, 2], compiled);
    }
}

#[test]
fn eight_devices_reproduce_the_fixture() {
    for compiled in [false, true] {
        check("llama", Recipe::FsdpTp, &[4, 2], compiled);
        check("qwen3", Recipe::Fsdp, &[8], compiled);
    }
}

#[test]
fn debug_and_defer_modes_reproduce_the_fixtures() {
    use kiln::tpu::{with_mode, Mode};
    for mode in [Mode::Debug, Mode::Defer] {
        with_mode(mode, || check("llama", Recipe::FsdpTp, &[2, 2], false));
        with_mode(mode, || check("qwen3", Recipe::Ddp, &[4], false));
        kiln::tpu::sync().unwrap();
    }
}

#[test]
fn a_plan_that_matches_nothing_is_an_error() {
    eight_devices();
    let mesh = init_device_mesh(DeviceKind::Tpu, &[4], &["tp"]).unwrap();
    let mut model = LlamaForCausalLM::from_pretrained(fixture_dir("llama"), DType::F32, mesh.device()).unwrap();
    let e = parallelize_module(&mut model, &mesh, &[("model.layers.*.mlp.gate", ParallelStyle::ColwiseParallel)])
        .unwrap_err()
        .to_string();
    assert!(e.contains("matches no module"), "{e}");
    let m2 = init_device_mesh(DeviceKind::Tpu, &[2, 2], &["dp", "tp"]).unwrap();
    let e = parallelize_module(&mut model, &m2, &llama_tp_plan()).unwrap_err().to_string();
    assert!(e.contains("one-axis mesh"), "{e}");
}

/// The llama fixture and an AdamW for it, parallelized by `target` (a recipe
/// and a mesh shape; one device without), with the fixture's batch placed for it.
fn trainer(target: Option<(Recipe, &[usize])>) -> (LlamaForCausalLM, AdamW, Tensor) {
    eight_devices();
    let ids = load_safetensors(fixture_dir("llama").join("golden.safetensors")).unwrap()["input_ids"].clone();
    let (model, ids) = match target {
        Some((recipe, shape)) => {
            let mesh = init_device_mesh(DeviceKind::Tpu, shape, recipe.axes()).unwrap();
            let mut model = LlamaForCausalLM::from_pretrained(fixture_dir("llama"), DType::F32, mesh.device()).unwrap();
            let ids = recipe.apply(&mut model, &mesh, &ids);
            (model, ids)
        }
        None => {
            let d = Device::Tpu(0);
            (LlamaForCausalLM::from_pretrained(fixture_dir("llama"), DType::F32, d).unwrap(), ids.to_device(d).unwrap())
        }
    };
    let cfg = AdamWConfig { lr: 1e-3, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1, amsgrad: false };
    let opt = AdamW::new(model.named_parameters(), cfg).unwrap();
    (model, opt, ids)
}

/// `n` eager training steps; their losses.
fn train(model: &LlamaForCausalLM, opt: &mut AdamW, ids: &Tensor, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            opt.zero_grad();
            let l = causal_lm_loss(&model.forward(ids, None).unwrap(), ids, None).unwrap();
            l.backward().unwrap();
            opt.step().unwrap();
            l.item::<f32>().unwrap()
        })
        .collect()
}

#[test]
fn a_sharded_checkpoint_resumes_on_other_meshes_and_reads_as_a_transformers_llama() {
    // FSDP on four devices: two steps, a checkpoint, three more steps.
    let (model, mut opt, ids) = trainer(Some((Recipe::Fsdp, &[4])));
    train(&model, &mut opt, &ids, 2);
    let weights: BTreeMap<String, Vec<f32>> =
        model.state_dict().into_iter().map(|(n, t)| (n, t.to_vec::<f32>().unwrap())).collect();
    let moments: BTreeMap<String, Vec<f32>> = opt
        .state_dict()
        .unwrap()
        .into_iter()
        .filter(|(n, _)| n.ends_with(".exp_avg"))
        .map(|(n, t)| (n, t.to_vec::<f32>().unwrap()))
        .collect();
    let dir = temp_dir("sharded").join("checkpoint-2");
    let config = std::fs::read_to_string(fixture_dir("llama").join("config.json")).unwrap();
    save_checkpoint(&dir, &model, Some(&config), &opt, &TrainerState::capture(2, None).unwrap()).unwrap();
    let reference = train(&model, &mut opt, &ids, 3);

    // The files hold the whole tensors, in the Hugging Face index layout,
    // with the placements they were saved with recorded.
    assert!(!dir.join(SINGLE_FILE).exists() && dir.join(INDEX_FILE).is_file());
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join(INDEX_FILE)).unwrap()).unwrap();
    let placed = &index["metadata"]["kiln_placements"]["model.layers.0.self_attn.q_proj.weight"];
    assert_eq!(placed, "dp=4 [Shard(dim=0)]", "{index}");
    let stored = load_checkpoint_dir(&dir, None, Device::Cpu).unwrap();
    assert_eq!(stored.len(), weights.len());
    for (n, w) in &weights {
        assert_eq!(&stored[n].to_vec::<f32>().unwrap(), w, "{n}");
    }
    let stored = load_safetensors(dir.join(OPTIMIZER_FILE)).unwrap();
    for (n, m) in &moments {
        assert_eq!(&stored[n].to_vec::<f32>().unwrap(), m, "{n}");
    }
    let py = python_with_safetensors();
    let checker = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/check_hf_checkpoint.py");
    let out = std::process::Command::new(&py).arg(&checker).arg(&dir).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    // Resumed on two devices, on a 2 x 2 FSDP x TP mesh and on one device:
    // the same three losses, with the new placements.
    let (ca, cr) = tolerance("llama", "loss_curve");
    let want = Tensor::from_vec(reference.clone(), &[3]).unwrap();
    for target in [Some((Recipe::Fsdp, &[2][..])), Some((Recipe::FsdpTp, &[2, 2][..])), None] {
        let (mut model, mut opt, ids) = trainer(target);
        let before = model.named_parameters().into_iter().find(|(n, _)| n.ends_with("q_proj.weight")).unwrap().1;
        let placements = before.is_distributed().then(|| before.placements().unwrap());
        let ckpt = load_checkpoint(&dir).unwrap();
        assert_eq!(ckpt.state.step, 2);
        ckpt.restore(&mut model, &mut opt).unwrap();
        for (n, t) in opt.state_dict().unwrap() {
            if n.ends_with("q_proj.weight.exp_avg") {
                assert_eq!(t.is_distributed().then(|| t.placements().unwrap()), placements, "{n} on {target:?}");
            }
        }
        let got = train(&model, &mut opt, &ids, 3);
        assert_close(&format!("resumed on {target:?}"), &Tensor::from_vec(got, &[3]).unwrap(), &want, ca, cr);
    }
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

#[test]
fn distributed_tensors_save_shard_by_shard_as_whole_tensors() {
    eight_devices();
    use Placement::{Partial, Replicate, Shard};
    let m4 = init_device_mesh(DeviceKind::Tpu, &[4], &["dp"]).unwrap();
    let m22 = init_device_mesh(DeviceKind::Tpu, &[2, 2], &["dp", "tp"]).unwrap();
    let x = |shape: &[isize]| {
        let n: isize = shape.iter().product();
        Tensor::arange(0.0, n as f64, 1.0, DType::F32).unwrap().reshape(shape).unwrap()
    };
    let ones = Tensor::ones(&[3, 2], DType::F32).unwrap();
    let partial: Vec<Tensor> = (0..4).map(|i| ones.to_device(Device::Tpu(i)).unwrap()).collect();
    let tensors: BTreeMap<String, Tensor> = [
        // Uneven rows (3, 3, 3, 1), and columns split over both axes of a 2-D mesh (the last pieces empty).
        ("rows", distribute_tensor(&x(&[10, 3]), &m4, &[Shard(0)]).unwrap()),
        ("cols", distribute_tensor(&x(&[2, 5, 3]), &m22, &[Shard(1), Shard(1)]).unwrap()),
        ("both", distribute_tensor(&x(&[5, 7]), &m22, &[Shard(1), Shard(0)]).unwrap()),
        // Split over a sub-mesh, replicated over the other axis.
        ("sub", distribute_tensor(&x(&[6, 2]), &m22["tp"], &[Shard(0)]).unwrap()),
        ("replicated", distribute_tensor(&x(&[4]), &m4, &[Replicate]).unwrap()),
        ("partial", Tensor::from_local(&partial, &m4, &[Partial(kiln::PartialOp::Sum)], &[3, 2]).unwrap()),
        ("scalar", distribute_tensor(&Tensor::scalar(7.5f32, DType::F32).unwrap(), &m4, &[Replicate]).unwrap()),
        ("plain", x(&[2, 2])),
    ]
    .into_iter()
    .map(|(n, t)| (n.to_string(), t))
    .collect();
    let dir = temp_dir("shardwise");
    save_safetensors(dir.join("t.safetensors"), &tensors, None).unwrap();
    let back = load_safetensors(dir.join("t.safetensors")).unwrap();
    for (n, t) in &tensors {
        let want = if t.is_distributed() { t.full_tensor().unwrap() } else { t.clone() };
        assert_eq!(back[n].shape(), want.shape(), "{n}");
        assert_eq!(back[n].to_vec::<f32>().unwrap(), want.to_vec::<f32>().unwrap(), "{n}");
    }
    assert_eq!(back["partial"].to_vec::<f32>().unwrap(), vec![4.0; 6]);
    // Positions off the mesh: an error for the region, no replica.
    let e = m22.local_region(&[5, 7], &[Shard(1), Shard(0)], 4).unwrap_err().to_string();
    assert!(e.contains("device position 4 on a mesh of 4 devices"), "{e}");
    assert!(!m22.is_first_replica(&[Replicate, Replicate], 4));
    // What `to_local` holds is the region `local_region` names.
    let t = &tensors["both"];
    for (pos, local) in t.to_local().unwrap().iter().enumerate() {
        let r = m22.local_region(t.shape(), &t.placements().unwrap(), pos).unwrap();
        let want = x(&[5, 7])
            .narrow(0, r[0].start as isize, r[0].len())
            .unwrap()
            .narrow(1, r[1].start as isize, r[1].len())
            .unwrap();
        assert_eq!(local.to_vec::<f32>().unwrap(), want.contiguous().unwrap().to_vec::<f32>().unwrap(), "{pos}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

const LORA_ADAMW: AdamWConfig =
    AdamWConfig { lr: 1e-3, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1, amsgrad: false };

/// The adapter's trainable parameters under PEFT's names.
fn lora_named(model: &LlamaForCausalLM) -> Vec<(String, Tensor)> {
    model
        .named_trainable_parameters()
        .into_iter()
        .map(|(n, t)| (format!("{}{n}", kiln::nn::lora::PEFT_PREFIX), t))
        .collect()
}

/// PEFT's adapter trained under FSDP, TP and FSDP x TP on four XLA:CPU
/// devices: the fixture's logits, adapter gradients and first AdamW step,
/// with the adapters split like their layers under TP (B along out under a
/// colwise layer, A along in under a rowwise one).
#[test]
fn peft_fixture_under_fsdp_and_tensor_parallelism() {
    use kiln::nn::lora::load_adapter;
    eight_devices();
    let g = load_safetensors(fixture_dir("lora_llama").join("golden.safetensors")).unwrap();
    let root = |t: &Tensor, ndim: usize| {
        let (m, p) = (t.device_mesh().unwrap(), t.placements().unwrap());
        let mut r = vec![Placement::Replicate; ndim];
        for (i, x) in p.iter().enumerate() {
            r[m.root_axis_of(i)] = *x;
        }
        r
    };
    for (shape, axes) in [(&[4usize][..], &["dp"][..]), (&[4], &["tp"]), (&[2, 2], &["dp", "tp"])] {
        let mesh = init_device_mesh(DeviceKind::Tpu, shape, axes).unwrap();
        let mut model = LlamaForCausalLM::from_pretrained(fixture_dir("llama"), DType::F32, mesh.device()).unwrap();
        load_adapter(&mut model, fixture_dir("lora_llama").join("adapter"), true).unwrap();
        let tp = axes.contains(&"tp");
        if tp {
            let m = if axes.len() == 2 { mesh.sub(&["tp"]).unwrap() } else { mesh.clone() };
            parallelize_module(&mut model, &m, &llama_tp_plan()).unwrap();
        }
        let ids = if axes.contains(&"dp") {
            let dp = if axes.len() == 2 { mesh.sub(&["dp"]).unwrap() } else { mesh.clone() };
            fully_shard(&mut model, &dp).unwrap();
            shard_batch(&g["input_ids"], &dp).unwrap()
        } else {
            g["input_ids"].to_device(mesh.device()).unwrap()
        };
        let what = format!("lora_llama on {axes:?} {shape:?}");
        if tp {
            let p: BTreeMap<String, Tensor> = model.named_parameters().into_iter().collect();
            let t = axes.iter().position(|a| *a == "tp").unwrap();
            let on_tp = |n: &str| root(&p[n], axes.len())[t];
            assert_eq!(on_tp("model.layers.0.self_attn.q_proj.lora_B.weight"), Placement::Shard(0), "{what}");
            assert_eq!(on_tp("model.layers.0.self_attn.q_proj.lora_A.weight"), Placement::Replicate, "{what}");
            assert_eq!(on_tp("model.layers.0.self_attn.o_proj.lora_A.weight"), Placement::Shard(1), "{what}");
            assert_eq!(on_tp("model.layers.0.self_attn.o_proj.lora_B.weight"), Placement::Replicate, "{what}");
        }
        let loss = check_logits_and_loss(&what, "llama", &model, &ids, &g);
        loss.backward().unwrap();
        let (ga, gr) = tolerance("llama", "grad");
        for (n, p) in lora_named(&model) {
            assert_close(&format!("{what} grad.{n}"), &p.grad().expect("a gradient"), &g[&format!("grad.{n}")], ga, gr);
        }
        let mut opt = AdamW::new(model.named_trainable_parameters(), LORA_ADAMW).unwrap();
        opt.step().unwrap();
        check_params("llama", &lora_named(&model), &g, "adamw_step1");
    }
}
