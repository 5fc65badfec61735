//! `kiln-bench pipeline`: a Llama preset trained by each pipeline schedule
//! (GPipe, 1F1B, interleaved 1F1B with 2 stages per rank) over `--ranks`
//! devices: step time, the bubble against the schedule's theoretical one,
//! the bytes sent between stages against the minimum, and the microbatches
//! each rank holds at its peak. A preset with fewer layers than two per
//! rank runs with two per rank.
use crate::llm::{peak_rss_mb, preset, random_ids, LlmArgs};
use crate::report::{sig4, Line};
use crate::timing::median;
use kiln::nn::models::causal_lm_loss;
use kiln::nn::optim::{AdamW, AdamWConfig, Optimizer};
use kiln::nn::pipeline::{simulate, simulate_with, Action, LossFn, PipelinePlan, ScheduleKind};
use kiln::nn::LlamaForCausalLM;
use kiln::prelude::*;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

/// One line per schedule for `ranks` ranks (devices `tpu:0..ranks`, or all
/// on the CPU) and `microbatches` microbatches.
pub fn pipeline(a: &LlmArgs, ranks: usize, microbatches: usize) -> Result<Vec<Line>> {
    let mut cfg = preset(&a.preset).map_err(|e| Error::invalid("kiln-bench", e))?;
    // Two stages per rank need layers for them: a shallow preset gets more
    // layers of its shape (the line names the count), the same for every schedule.
    cfg.num_hidden_layers = cfg.num_hidden_layers.max(2 * ranks);
    let devices: Vec<Device> = match a.device {
        Device::Cpu => vec![Device::Cpu; ranks],
        _ => (0..ranks).map(Device::Tpu).collect(),
    };
    for d in &devices {
        kiln::init_device(*d)?;
    }
    let kinds = [(ScheduleKind::GPipe, 1), (ScheduleKind::OneFOneB, 1), (ScheduleKind::Interleaved1F1B, 2)];
    kinds.iter().map(|&(kind, v)| one_schedule(a, &cfg, &devices, kind, v, microbatches)).collect()
}

fn one_schedule(
    a: &LlmArgs,
    cfg: &kiln::nn::LlamaConfig,
    devices: &[Device],
    kind: ScheduleKind,
    stages_per_rank: usize,
    m: usize,
) -> Result<Line> {
    kiln::manual_seed(0);
    let model = LlamaForCausalLM::new(cfg, (DType::F32, Device::Cpu))?;
    let plan = PipelinePlan {
        kind,
        devices: devices.to_vec(),
        stages_per_rank,
        microbatches: m,
        compiled: a.compiled,
        recipe: None,
    };
    let loss_fn: LossFn = Arc::new(|logits: &Tensor, ids: &Tensor| causal_lm_loss(logits, ids, None));
    let mut p = model.pipeline(&plan, loss_fn)?;
    drop(model);
    let adamw = AdamWConfig { lr: 1e-3, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1, amsgrad: false };
    let mut opts: Vec<AdamW> =
        p.stages().iter().map(|s| AdamW::new(s.module().named_parameters(), adamw)).collect::<Result<_>>()?;
    let ids = random_ids(a.batch, a.seq, cfg.vocab_size, Device::Cpu)?;
    let mut step = |p: &mut kiln::nn::pipeline::PipelineSchedule| -> Result<f64> {
        opts.iter_mut().for_each(|o| o.zero_grad());
        let losses = p.step(&ids, &ids)?;
        opts.iter_mut().try_for_each(|o| o.step())?;
        Ok(losses.iter().map(|l| l.item_f64()).sum::<Result<f64>>()? / losses.len() as f64)
    };
    let mut times = vec![];
    for i in 0..a.warmup + a.steps.max(1) {
        let t0 = Instant::now();
        step(&mut p)?;
        if i >= a.warmup {
            times.push(t0.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    let bytes = p.bytes_sent();
    // One more step with every action timed alone: the stages' costs, and the
    // bubble the schedule has with them.
    p.set_profile(true);
    step(&mut p)?;
    let costs: HashMap<Action, f64> = p.action_times().iter().copied().collect();
    p.set_profile(false);
    let orders = p.orders()?;
    let n = p.stages().len();
    let with_costs = simulate_with(&orders, n, |a| costs.get(a).copied().unwrap_or(0.0))?;
    let uniform = simulate(&orders, n, 1.0, 2.0)?;
    // The schedule's ranks: its distinct devices (the interleaved schedule over
    // CPU "ranks" that are one device is one rank).
    let (pr, mv) = (p.ranks() as f64, (m * n / p.ranks()) as f64);
    let theory = (pr - 1.0) / (mv + pr - 1.0);
    // Each boundary between stages on different devices carries every
    // microbatch's activations forward and their gradients back.
    let boundaries = (1..n).filter(|&s| p.stages()[s].device() != p.stages()[s - 1].device()).count();
    let least = (2 * boundaries * a.batch * a.seq * cfg.hidden_size * 4) as u64;
    let mut held = vec![0usize; p.ranks()];
    for s in p.stages() {
        held[s.stage_index() % p.ranks()] += s.peak_held_microbatches();
    }
    let name = match kind {
        ScheduleKind::GPipe => "gpipe",
        ScheduleKind::OneFOneB => "1f1b",
        ScheduleKind::Interleaved1F1B => "interleaved",
    };
    Ok(Line::new("pipeline", "float32", &format!("{}x{}", devices.len(), devices[0]))
        .set("schedule", name)
        .set("mode", if a.compiled { "compiled" } else { "eager" })
        .set("preset", a.preset.clone())
        .set("layers", cfg.num_hidden_layers)
        .set("stages", n)
        .set("microbatches", m)
        .set("median_step_ms", sig4(median(&times) * 1e3))
        .set("tokens_per_s", sig4((a.batch * a.seq) as f64 / median(&times)))
        .set("bubble_theory", sig4(theory))
        .set("bubble_schedule_uniform_costs", sig4(uniform.bubble_fraction()))
        .set("bubble_schedule_measured_costs", sig4(with_costs.bubble_fraction()))
        .set("bytes_between_stages", bytes)
        .set("bytes_minimum", least)
        .set("peak_microbatches_held_per_rank", held)
        .set("peak_rss_mb", sig4(peak_rss_mb())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llm::tests::{num, tiny};

    #[test]
    fn every_schedule_reports_its_bubble_bytes_and_held_microbatches() -> Result<()> {
        let _rng = crate::llm::tests::rng_lock();
        kiln::init();
        let lines = pipeline(&LlmArgs { batch: 4, compiled: true, ..tiny() }, 2, 2)?;
        assert_eq!(lines.len(), 3);
        for l in &lines {
            assert_eq!(num(l, "bubble_theory"), num(l, "bubble_schedule_uniform_costs"));
            let measured = num(l, "bubble_schedule_measured_costs");
            assert!((0.0..1.0).contains(&measured) && num(l, "median_step_ms") > 0.0, "{measured}");
            // All stages on the CPU: nothing crosses between devices.
            assert_eq!((num(l, "bytes_between_stages"), num(l, "bytes_minimum")), (0.0, 0.0));
        }
        let held = |l: &Line| l.get("peak_microbatches_held_per_rank").cloned();
        assert_eq!(held(&lines[0]), Some(serde_json::json!([2, 2])), "GPipe holds every microbatch");
        assert_eq!(held(&lines[1]), Some(serde_json::json!([2, 1])), "1F1B holds p - r on rank r");
        assert_eq!(num(&lines[0], "bubble_theory"), crate::report::sig4(1.0 / 3.0));
        // Interleaving over stages that share the CPU is one rank: no bubble at all.
        assert_eq!(num(&lines[2], "bubble_schedule_measured_costs"), 0.0);
        Ok(())
    }
}
