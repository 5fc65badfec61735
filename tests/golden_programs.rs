//! Golden printed programs (Note [Program text]), traced on the CPU with no
//! plugin: the llama fixture's forward pass, a captured AdamW training step
//! and a custom op. A change to the recorder, the passes or the text form
//! shows up here as a diff; `KILN_BLESS=1` rewrites the files after a change
//! that is meant.
#[path = "../examples/support/add_rms_norm.rs"]
mod add_rms_norm;

use kiln::nn::models::LlamaForCausalLM;
use kiln::nn::optim::{AdamW, AdamWConfig, Optimizer};
use kiln::prelude::*;
use std::path::PathBuf;
use std::sync::Arc;

fn golden_path(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden").join(format!("{name}.txt"))
}

/// `text` against `tests/golden/<name>.txt` (rewritten under `KILN_BLESS=1`).
fn check(name: &str, text: &str) {
    let path = golden_path(name);
    if std::env::var("KILN_BLESS").is_ok_and(|v| v == "1") {
        std::fs::write(&path, format!("{text}\n")).unwrap();
        return;
    }
    let want =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e} (KILN_BLESS=1 writes it)", path.display()));
    let want = want.trim_end_matches('\n');
    if want != text {
        let (line, (w, g)) = want
            .lines()
            .zip(text.lines())
            .enumerate()
            .find(|(_, (w, g))| w != g)
            .unwrap_or((want.lines().count().min(text.lines().count()), ("<end>", "<end>")));
        panic!(
            "{name}: the program differs from {} at line {} ({} vs {} lines):\n  want: {w}\n   got: {g}",
            path.display(),
            line + 1,
            want.lines().count(),
            text.lines().count()
        );
    }
}

/// The printed program of `f`'s stable trace on the CPU (three calls: traced twice, replayed once).
fn program_of(mut f: impl FnMut(&[Tensor]) -> Result<Vec<Tensor>>, inputs: &[Tensor]) -> String {
    let mut c = kiln::compile(Device::Cpu, &mut f);
    for _ in 0..3 {
        c.call(inputs).unwrap();
    }
    assert_eq!(c.stats().replays, 1, "{:?}", c.stats());
    let p = c.program().unwrap();
    p.verify().unwrap();
    p.to_string()
}

#[test]
fn llama_forward() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/llama");
    let model = LlamaForCausalLM::from_pretrained(&dir, DType::F32, Device::Cpu).unwrap();
    let ids = Tensor::from_vec((0..8i64).map(|i| (i * 37) % 256).collect(), &[1, 8]).unwrap();
    let text = program_of(
        |xs: &[Tensor]| {
            let _ng = kiln::autograd::no_grad();
            Ok(vec![model.forward(&xs[0], None)?])
        },
        &[ids],
    );
    assert!(text.contains("%1: i64[8] input 0") || text.contains("i64[8] input 0"), "{text}");
    check("llama_forward", &text);
}

#[test]
fn adamw_training_step() {
    kiln::manual_seed(0);
    let l1 = kiln::nn::layers::Linear::new(4, 8, true, DType::F32).unwrap();
    let l2 = kiln::nn::layers::Linear::new(8, 2, false, DType::F32).unwrap();
    let params: Vec<Tensor> = vec![l1.weight.clone(), l1.bias.clone().unwrap(), l2.weight.clone()];
    let cfg = AdamWConfig { lr: 1e-2, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1, amsgrad: false };
    let mut opt = AdamW::new(params, cfg).unwrap();
    opt.set_capturable(true).unwrap();
    let x = Tensor::from_vec((0..12).map(|i| i as f32 / 12.0).collect(), &[3, 4]).unwrap();
    let y = Tensor::from_vec(vec![0.5f32, -0.5, 1.0, 0.0, -1.0, 0.25], &[3, 2]).unwrap();
    let text = program_of(
        |xs: &[Tensor]| {
            opt.zero_grad();
            let h = l1.forward(&xs[0])?.silu()?;
            let loss = l2.forward(&h)?.sub(&xs[1])?.square()?.mean()?;
            loss.backward()?;
            opt.step()?;
            Ok(vec![loss])
        },
        &[x, y],
    );
    assert!(text.contains("updates"), "{text}");
    check("adamw_training_step", &text);
}

#[test]
fn custom_op() {
    let x = Tensor::from_vec((0..8).map(|i| i as f32).collect(), &[2, 4]).unwrap();
    let r = Tensor::ones(&[2, 4], DType::F32).unwrap();
    let w = Tensor::from_vec(vec![1.0f32, 0.5, 2.0, 1.5], &[4]).unwrap();
    let text = program_of(
        |xs: &[Tensor]| {
            let (sum, y) = add_rms_norm::add_rms_norm(&xs[0], &xs[1], &w, 1e-6)?;
            Ok(vec![sum, y.mul(&xs[0])?])
        },
        &[x, r],
    );
    assert!(text.contains("add_rms_norm("), "{text}");
    check("custom_op", &text);
}

/// A local region's body (Note [Local regions]) as it is recorded before its
/// lowering into the region: one device's block routed to the others with an
/// `all_to_all` over the groups of an axis (here two groups of two devices,
/// as an axis of size 2 in a 2x2 mesh gives), recorded on a CPU stand-in.
#[test]
fn local_region_with_all_to_all() {
    use kiln::tensor::collective::{Collective, CollectiveOp};
    let block = Tensor::from_vec((0..8).map(|i| i as f32).collect(), &[4, 2]).unwrap();
    let exchange =
        CollectiveOp { kind: Collective::AllToAll { split: 0, concat: 1 }, groups: vec![vec![0, 1], vec![2, 3]] };
    let policy = kiln::tensor::capture::HostValues::Constant;
    let mut body = |blocks: &[Tensor]| -> Result<Vec<Tensor>> {
        let routed = Tensor::apply1(kiln::Op::Collective(exchange.clone()), &[&blocks[0].mul(2.0)?])?;
        Ok(vec![routed.sum_dim(1, false)?])
    };
    let region =
        kiln::tensor::capture::record_region(Device::Cpu, policy, std::slice::from_ref(&block), &mut body).unwrap();
    let text = region.program.to_string();
    assert!(text.contains("all_to_all("), "{text}");
    assert!(Arc::ptr_eq(&region.sources[0], block.storage()), "the block is the region's one parameter");
    check("local_region_all_to_all", &text);
}
