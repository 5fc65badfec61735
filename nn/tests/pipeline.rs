//! Pipeline parallelism (`kiln::nn::pipeline`): the llama and qwen3 fixtures
//! split into stages and trained by the GPipe, 1F1B and interleaved 1F1B
//! schedules reproduce the one-device golden values (logits, loss, every
//! gradient, the global gradient norm, AdamW steps 1 and 10, the loss
//! curve), op by op and with each stage captured as programs of its own, on
//! the CPU backend, on two XLA:CPU devices, and split between the two.
mod support;

use kiln::nn::models::{causal_lm_loss, LlamaForCausalLM};
use kiln::nn::module::Module;
use kiln::nn::optim::{AdamW, AdamWConfig, Optimizer};
use kiln::nn::pipeline::{LossFn, PipelineSchedule, PipelineStage, ScheduleKind};
use kiln::prelude::*;
use std::collections::BTreeSet;
use std::sync::Arc;
use support::{assert_close, assert_golden_grad_norm, check_params, fixture_dir, register_tpu_with_devices, tolerance};

fn loss_fn() -> LossFn {
    Arc::new(|logits: &Tensor, ids: &Tensor| causal_lm_loss(logits, ids, None))
}

/// The fixture `name` cut at `split_points`, stage `i` on `devices[i]`,
/// run by a `kind` schedule over `microbatches` microbatches.
fn pipeline(
    name: &str,
    split_points: &[usize],
    devices: &[Device],
    kind: ScheduleKind,
    microbatches: usize,
    compiled: bool,
) -> PipelineSchedule {
    let model = LlamaForCausalLM::from_pretrained(fixture_dir(name), DType::F32, Device::Cpu).unwrap();
    let stages = model.pipeline_stages(split_points).unwrap();
    let n = stages.len();
    assert_eq!(n, devices.len());
    let stages = stages
        .into_iter()
        .zip(devices)
        .enumerate()
        .map(|(i, (mut s, &d))| {
            s.to_device(d).unwrap();
            let mut stage = PipelineStage::new(s, i, n, d).unwrap();
            stage.set_compiled(compiled);
            stage
        })
        .collect();
    PipelineSchedule::new(kind, stages, microbatches, loss_fn()).unwrap()
}

/// Checks one pipelined step and ten AdamW steps against fixture `name`'s golden values.
fn check(name: &str, split_points: &[usize], devices: &[Device], kind: ScheduleKind, compiled: bool) {
    let p = pipeline(name, split_points, devices, kind, 2, compiled);
    let what = format!("{name} {kind:?} on {devices:?}{}", if compiled { " compiled" } else { "" });
    verify(name, p, &what, devices, compiled);
}

/// [`check`]'s checks on the pipeline `p` of fixture `name`, whose stages sit on `devices`.
fn verify(name: &str, mut p: PipelineSchedule, what: &str, devices: &[Device], compiled: bool) {
    let g = kiln::nn::io::load_safetensors(fixture_dir(name).join("golden.safetensors")).unwrap();
    let ids = &g["input_ids"];
    let (la, lr) = tolerance(name, "logits");
    assert_close(&format!("{what} logits"), &p.forward(ids).unwrap(), &g["logits"], la, lr);

    let copied = || kiln::tpu::stats().map_or(0, |s| s.device_copy_bytes);
    let before = copied();
    let losses = p.step(ids, ids).unwrap();
    // Between PJRT devices, activations and gradients go device to device:
    // [1, 16, 64] f32 per microbatch and boundary, each way.
    let boundaries = devices.windows(2).filter(|w| w[0] != w[1]).count() as u64;
    assert_eq!(p.bytes_sent(), boundaries * 2 * 2 * 16 * 64 * 4, "{what}");
    if devices.iter().all(|d| matches!(d, Device::Tpu(_))) {
        // A tied embedding's gradient goes to the first stage's device and its sum back.
        let tied: u64 = p
            .named_parameters()
            .iter()
            .filter(|(n, _)| p.tied_parameters().contains(n))
            .map(|(_, t)| 2 * 4 * t.numel() as u64)
            .sum();
        assert_eq!(copied() - before, p.bytes_sent() + tied, "{what}: every transfer is a device copy");
    }
    let mean = |ls: &[Tensor]| ls.iter().map(|l| l.item::<f32>().unwrap()).sum::<f32>() / ls.len() as f32;
    let loss = mean(&losses);
    let (sa, sr) = tolerance(name, "loss");
    assert_close(&format!("{what} loss"), &Tensor::scalar(loss, DType::F32).unwrap(), &g["loss"], sa, sr);
    let (ga, gr) = tolerance(name, "grad");
    for s in p.stages() {
        // Every copy of a tied parameter carries the whole gradient.
        for (n, t) in s.module().named_parameters() {
            let grad = t.grad().unwrap_or_else(|| panic!("{what}: {n} got no gradient"));
            assert_close(
                &format!("{what} grad.{n} (stage {})", s.stage_index()),
                &grad,
                &g[&format!("grad.{n}")],
                ga,
                gr,
            );
        }
    }
    assert_golden_grad_norm(what, p.clip_grad_norm_(f64::INFINITY).unwrap(), &g);

    let cfg = AdamWConfig { lr: 1e-3, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1, amsgrad: false };
    let mut opts: Vec<AdamW> =
        p.stages().iter().map(|s| AdamW::new(s.module().named_parameters(), cfg).unwrap()).collect();
    let mut curve = vec![loss];
    opts.iter_mut().for_each(|o| o.step().unwrap());
    check_params(name, &p.named_parameters(), &g, "adamw_step1");
    for _ in 1..10 {
        opts.iter_mut().for_each(|o| o.zero_grad());
        curve.push(mean(&p.step(ids, ids).unwrap()));
        opts.iter_mut().for_each(|o| o.step().unwrap());
    }
    let logits = p.forward(ids).unwrap();
    curve.push(causal_lm_loss(&logits, &ids.to_device(logits.device()).unwrap(), None).unwrap().item::<f32>().unwrap());
    check_params(name, &p.named_parameters(), &g, "adamw_step10");
    let (ca, cr) = tolerance(name, "loss_curve");
    let ca = ca.max(5e-5);
    assert_close(&format!("{what} loss curve"), &Tensor::from_vec(curve, &[11]).unwrap(), &g["loss_curve"], ca, cr);
    if compiled {
        for s in p.stages() {
            let (f, b) = s.capture_stats().unwrap();
            assert_eq!((f.retraces, b.retraces), (0, 0), "{what} stage {}: {f:?} {b:?}", s.stage_index());
            // One program per stage and phase: traced twice (the second trace confirms the first), then replayed.
            let forwards = if s.stage_index() + 1 == p.stages().len() { 0 } else { 2 };
            assert_eq!((f.traces, b.traces), (forwards, 2), "{what} stage {}: {f:?} {b:?}", s.stage_index());
            assert!(b.replays >= 15, "{what} stage {}: the backward replays once stable: {b:?}", s.stage_index());
        }
        // MPMD: the first stage's programs (embedding, no loss) are not the last's (the loss, in backward).
        let (first, last) = (p.stages()[0].programs().unwrap(), p.stages().last().unwrap().programs().unwrap());
        assert!(first.0.is_some() && last.0.is_none(), "{what}: the last stage's forward is its backward program's");
        let (a, b) = (first.1.to_string(), last.1.to_string());
        assert!(a.contains("embedding") || a.contains("index_select") || a.contains("gather"), "{what}: {a}");
        assert!(b.contains("cross_entropy") && !a.contains("cross_entropy"), "{what}: the loss is the last stage's");
    }
}

#[test]
fn schedules_on_the_cpu_reproduce_the_fixtures() {
    let cpu2 = [Device::Cpu, Device::Cpu];
    for compiled in [false, true] {
        for name in ["llama", "qwen3"] {
            check(name, &[2], &cpu2, ScheduleKind::GPipe, compiled);
            check(name, &[1], &cpu2, ScheduleKind::OneFOneB, compiled);
        }
    }
}

#[test]
fn schedules_on_two_pjrt_devices_reproduce_the_fixtures() {
    register_tpu_with_devices(8);
    let two = [Device::Tpu(0), Device::Tpu(1)];
    let four = [Device::Tpu(0), Device::Tpu(1), Device::Tpu(0), Device::Tpu(1)];
    for compiled in [false, true] {
        for name in ["llama", "qwen3"] {
            check(name, &[2], &two, ScheduleKind::GPipe, compiled);
            check(name, &[1], &two, ScheduleKind::OneFOneB, compiled);
            check(name, &[1, 2, 3], &four, ScheduleKind::Interleaved1F1B, compiled);
        }
    }
}

#[test]
fn a_pipeline_split_between_the_cpu_and_a_pjrt_device_reproduces_the_fixtures() {
    register_tpu_with_devices(8);
    for compiled in [false, true] {
        check("llama", &[1], &[Device::Cpu, Device::Tpu(0)], ScheduleKind::OneFOneB, compiled);
        check("qwen3", &[2], &[Device::Tpu(1), Device::Cpu], ScheduleKind::GPipe, compiled);
    }
}

#[test]
fn balanced_splits_weigh_the_output_projection() {
    use kiln::nn::pipeline::balanced_split_points;
    let cfg = |vocab: usize| {
        kiln::nn::LlamaConfig::from_json_str(&format!(
            r#"{{"model_type": "llama", "vocab_size": {vocab}, "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 4}}"#
        ))
        .unwrap()
    };
    // Small vocabulary: layers split evenly; a head as costly as three layers moves layers forward.
    assert_eq!(balanced_split_points(&cfg(64), 2).unwrap(), vec![4]);
    assert_eq!(balanced_split_points(&cfg(64), 4).unwrap(), vec![2, 4, 6]);
    // A layer costs 4 * 64 * 64 + 3 * 64 * 128 = 40960 multiply-adds per token, a head of 1920
    // tokens three layers' worth: 3 + 4 + (1 + 3) layers, where ignoring the head gives [3, 6].
    assert_eq!(balanced_split_points(&cfg(1920), 3).unwrap(), vec![3, 7]);
    assert!(balanced_split_points(&cfg(64), 10).is_err());
    assert!(balanced_split_points(&cfg(64), 0).is_err());
}

#[test]
fn bad_pipelines_are_errors() {
    let model = LlamaForCausalLM::from_pretrained(fixture_dir("llama"), DType::F32, Device::Cpu).unwrap();
    for bad in [&[2, 1][..], &[1, 1], &[4]] {
        let e = model.pipeline_stages(bad).unwrap_err().to_string();
        assert!(e.contains("split points"), "{bad:?}: {e}");
    }
    let stages = model.pipeline_stages(&[1]).unwrap();
    // A stage whose parameters are elsewhere.
    let e = PipelineStage::new(stages[0].clone(), 0, 2, Device::Tpu(0)).unwrap_err().to_string();
    assert!(e.contains("stage 0 runs on tpu:0"), "{e}");
    let e = PipelineStage::new(stages[0].clone(), 2, 2, Device::Cpu).unwrap_err().to_string();
    assert!(e.contains("not below num_stages"), "{e}");
    // Stages out of order, and a batch that does not split.
    let mk = |i: usize| PipelineStage::new(stages[i].clone(), i, 2, Device::Cpu).unwrap();
    let e = PipelineSchedule::new(ScheduleKind::GPipe, vec![mk(1), mk(0)], 2, loss_fn()).unwrap_err().to_string();
    assert!(e.contains("says it is stage"), "{e}");
    let mut p = PipelineSchedule::new(ScheduleKind::OneFOneB, vec![mk(0), mk(1)], 2, loss_fn()).unwrap();
    let ids = Tensor::zeros(&[3, 8], DType::I64).unwrap();
    let e = p.step(&ids, &ids).unwrap_err().to_string();
    assert!(e.contains("does not split into 2 equal microbatches"), "{e}");
    // A captured stage recomputes its forward: dropout in training would draw other numbers.
    let cfg = kiln::nn::LlamaConfig::from_json_str(
        r#"{"model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "attention_dropout": 0.1}"#,
    )
    .unwrap();
    let mut dropping = LlamaForCausalLM::new(&cfg, DType::F32).unwrap();
    dropping.train(true);
    let ids = Tensor::zeros(&[2, 4], DType::I64).unwrap();
    for compiled in [false, true] {
        let mut stages: Vec<PipelineStage> = dropping
            .pipeline_stages(&[1])
            .unwrap()
            .into_iter()
            .enumerate()
            .map(|(i, s)| PipelineStage::new(s, i, 2, Device::Cpu).unwrap())
            .collect();
        stages.iter_mut().for_each(|s| s.set_compiled(compiled));
        let mut p = PipelineSchedule::new(ScheduleKind::GPipe, stages, 2, loss_fn()).unwrap();
        match compiled {
            false => assert_eq!(p.step(&ids, &ids).unwrap().len(), 2),
            true => {
                let e = p.step(&ids, &ids).unwrap_err().to_string();
                assert!(e.contains("draws random numbers"), "{e}");
            }
        }
    }
    // The interleaved schedule wants stage s on the device of rank s % p.
    register_tpu_with_devices(8);
    let stages4 = model.pipeline_stages(&[1, 2, 3]).unwrap();
    let devs = [Device::Tpu(0), Device::Tpu(1), Device::Tpu(1), Device::Tpu(0)];
    let staged: Vec<PipelineStage> = stages4
        .into_iter()
        .zip(devs)
        .enumerate()
        .map(|(i, (mut s, d))| {
            s.to_device(d).unwrap();
            PipelineStage::new(s, i, 4, d).unwrap()
        })
        .collect();
    let e = PipelineSchedule::new(ScheduleKind::Interleaved1F1B, staged, 2, loss_fn()).unwrap_err().to_string();
    assert!(e.contains("runs stage 2 on rank 0"), "{e}");
}

#[test]
fn pp_times_fsdp_times_tp_and_pp_times_ddp_on_eight_devices_reproduce_the_fixtures() {
    use kiln::nn::parallel::Recipe;
    use kiln::nn::pipeline::PipelinePlan;
    use kiln::{DeviceKind, DeviceMesh, Placement};
    register_tpu_with_devices(8);
    // pp = 2 ranks, each a 2 x 2 (dp, tp) mesh of four devices.
    let meshes: Vec<DeviceMesh> = (0..2)
        .map(|r| DeviceMesh::new(DeviceKind::Tpu, &[4 * r, 4 * r + 1, 4 * r + 2, 4 * r + 3], &[2, 2], &["dp", "tp"]))
        .collect::<kiln::Result<_>>()
        .unwrap();
    let devices: Vec<Device> = meshes.iter().map(DeviceMesh::device).collect();
    let runs = [
        ("llama", Recipe::FsdpTp, ScheduleKind::OneFOneB, false),
        ("qwen3", Recipe::FsdpTp, ScheduleKind::GPipe, false),
        ("llama", Recipe::FsdpTp, ScheduleKind::GPipe, true),
        ("qwen3", Recipe::FsdpTp, ScheduleKind::OneFOneB, true),
        ("llama", Recipe::Ddp, ScheduleKind::GPipe, false),
        ("qwen3", Recipe::Ddp, ScheduleKind::OneFOneB, true),
    ];
    for (name, recipe, kind, compiled) in runs {
        let model = LlamaForCausalLM::from_pretrained(fixture_dir(name), DType::F32, Device::Cpu).unwrap();
        let plan = PipelinePlan {
            kind,
            devices: devices.clone(),
            stages_per_rank: 1,
            microbatches: 2,
            compiled,
            recipe: Some(recipe),
        };
        let p = model.pipeline(&plan, loss_fn()).unwrap();
        // Each stage's parameters are split over its rank's own mesh by the recipe.
        for (i, s) in p.stages().iter().enumerate() {
            let q = s.module().named_parameters().into_iter().find(|(n, _)| n.ends_with("q_proj.weight")).unwrap().1;
            assert_eq!(q.device_mesh().unwrap().root().devices(), meshes[i].devices());
            let want = match recipe {
                Recipe::FsdpTp => vec![Placement::Shard(0), Placement::Shard(0)],
                _ => vec![Placement::Replicate],
            };
            assert_eq!(q.placements().unwrap(), want, "{name} {recipe:?} stage {i}");
        }
        let what =
            format!("{name} {kind:?} pp=2 x {recipe:?} on (dp=2, tp=2){}", if compiled { " compiled" } else { "" });
        verify(name, p, &what, &devices, compiled);
    }
}

#[test]
fn pipelined_checkpoints_resume_on_other_layouts() {
    use kiln::nn::checkpoint::{load_checkpoint, TrainerState};
    use kiln::nn::pipeline::{restore_pipeline, save_pipeline_checkpoint};
    // qwen3 ties its embedding and head: the two copies' state must come back on both stages.
    let name = "qwen3";
    let g = kiln::nn::io::load_safetensors(fixture_dir(name).join("golden.safetensors")).unwrap();
    let ids = &g["input_ids"];
    let cfg = AdamWConfig { lr: 1e-3, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1, amsgrad: false };
    let fresh = || LlamaForCausalLM::from_pretrained(fixture_dir(name), DType::F32, Device::Cpu).unwrap();
    let plain_steps = |model: &LlamaForCausalLM, opt: &mut AdamW, n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| {
                opt.zero_grad();
                let l = causal_lm_loss(&model.forward(ids, None).unwrap(), ids, None).unwrap();
                l.backward().unwrap();
                opt.step().unwrap();
                l.item::<f32>().unwrap()
            })
            .collect()
    };
    let piped_steps = |p: &mut PipelineSchedule, opts: &mut [AdamW], n: usize| -> Vec<f32> {
        (0..n)
            .map(|_| {
                opts.iter_mut().for_each(|o| o.zero_grad());
                let ls = p.step(ids, ids).unwrap();
                opts.iter_mut().for_each(|o| o.step().unwrap());
                ls.iter().map(|l| l.item::<f32>().unwrap()).sum::<f32>() / ls.len() as f32
            })
            .collect()
    };
    let stage_opts = |p: &PipelineSchedule| -> Vec<AdamW> {
        p.stages().iter().map(|s| AdamW::new(s.module().named_parameters(), cfg).unwrap()).collect()
    };
    // Six steps without a pipeline: the reference.
    let model = fresh();
    let mut opt = AdamW::new(model.named_parameters(), cfg).unwrap();
    let reference = plain_steps(&model, &mut opt, 6);
    // Three steps on two stages, saved in the unpipelined layout.
    let mut p = pipeline(name, &[1], &[Device::Cpu, Device::Cpu], ScheduleKind::OneFOneB, 2, false);
    let mut opts = stage_opts(&p);
    let mut first = piped_steps(&mut p, &mut opts, 3);
    let dir = support::temp_dir("pipeline-checkpoint").join("checkpoint-3");
    let refs: Vec<&dyn Optimizer> = opts.iter().map(|o| o as &dyn Optimizer).collect();
    save_pipeline_checkpoint(&dir, &p, None, &refs, &TrainerState::capture(3, None).unwrap()).unwrap();
    let ckpt = load_checkpoint(&dir).unwrap();
    assert!(
        !ckpt.model_state().unwrap().contains_key("lm_head.weight"),
        "the tied head is saved once, as the Hub has it"
    );
    // Each stage's weights are in files of their own, listed per stage in the index.
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join(kiln::nn::io::INDEX_FILE)).unwrap()).unwrap();
    let pieces = index["metadata"]["kiln_pieces"].as_array().unwrap();
    assert_eq!(pieces.len(), 2, "{index}");
    let mut earlier = BTreeSet::new();
    for (stage, files) in p.stages().iter().zip(pieces) {
        let files: Vec<&str> = files.as_array().unwrap().iter().map(|f| f.as_str().unwrap()).collect();
        let held: BTreeSet<String> =
            files.iter().flat_map(|f| kiln::nn::io::load_safetensors(dir.join(f)).unwrap().into_keys()).collect();
        // The tied head's copy on the last stage is the first stage's embedding: saved there.
        let own: BTreeSet<String> = stage
            .module()
            .named_parameters()
            .into_iter()
            .map(|(n, _)| n)
            .filter(|n| earlier.insert(n.clone()))
            .collect();
        assert_eq!(held, own, "the files {files:?} of a stage hold exactly its parameters, a tied one once");
    }
    let (ca, cr) = tolerance(name, "loss_curve");
    let check = |what: &str, got: Vec<f32>| {
        let n = got.len();
        let want = Tensor::from_vec(reference[6 - n..].to_vec(), &[n]).unwrap();
        assert_close(what, &Tensor::from_vec(got, &[n]).unwrap(), &want, ca.max(5e-5), cr);
    };
    first.extend(piped_steps(&mut p, &mut opts, 3));
    check("six pipelined steps", first);
    // Resumed without a pipeline, and on three stages under GPipe.
    let mut model = fresh();
    let mut opt = AdamW::new(model.named_parameters(), cfg).unwrap();
    ckpt.restore(&mut model, &mut opt).unwrap();
    check("resumed unpipelined", plain_steps(&model, &mut opt, 3));
    let mut p3 = pipeline(name, &[1, 2], &[Device::Cpu; 3], ScheduleKind::GPipe, 2, true);
    let mut opts3 = stage_opts(&p3);
    let mut refs3: Vec<&mut dyn Optimizer> = opts3.iter_mut().map(|o| o as &mut dyn Optimizer).collect();
    restore_pipeline(&ckpt, &p3, &mut refs3).unwrap();
    check("resumed on three stages", piped_steps(&mut p3, &mut opts3, 3));
    // A state that does not fit the model is refused before anything is written.
    let mut bad = p3.state_dict();
    bad.insert("extra.weight".into(), Tensor::zeros(&[1], DType::F32).unwrap());
    let e = p3.load_state_dict(&bad).unwrap_err().to_string();
    assert!(e.contains("unexpected extra.weight"), "{e}");
    let _ = std::fs::remove_dir_all(dir.parent().unwrap());
}

#[test]
fn gradients_accumulate_across_steps_until_zeroed() {
    // Two steps on the same batch without zero_grad: every gradient, a tied
    // one's copies included, is twice the golden one (PyTorch's accumulation).
    let g = kiln::nn::io::load_safetensors(fixture_dir("qwen3").join("golden.safetensors")).unwrap();
    let ids = &g["input_ids"];
    let (ga, gr) = tolerance("qwen3", "grad");
    for compiled in [false, true] {
        let mut p = pipeline("qwen3", &[2], &[Device::Cpu, Device::Cpu], ScheduleKind::GPipe, 2, compiled);
        p.step(ids, ids).unwrap();
        p.step(ids, ids).unwrap();
        for s in p.stages() {
            for (n, t) in s.module().named_parameters() {
                let want = g[&format!("grad.{n}")].mul(2.0).unwrap();
                assert_close(
                    &format!("twice grad.{n} (stage {})", s.stage_index()),
                    &t.grad().unwrap(),
                    &want,
                    2.0 * ga,
                    gr,
                );
            }
        }
    }
}
