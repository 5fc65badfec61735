//! Trains a small Llama from scratch with kiln, on the CPU, offline.
//!
//! With no arguments it learns multi-digit addition from problems kiln generates
//! itself (`"12+57=69\n"`, byte-level tokens; `--digits 3` for `"123+456=579\n"`)
//! and reports the exact-match accuracy of its greedy answers on held-out
//! problems it never saw (49% in a measured run of the default 1,500 steps, which
//! took 62 s on 2 cores; chance is about 1%; more `--steps` learn more):
//!
//! ```sh
//! cargo run --release --example train_llama
//! cargo run --release --example train_llama -- --data ../shared/data/tinyshakespeare.txt --steps 1000
//! cargo run --release --example train_llama -- --resume          # continue the run in --out
//! KILN_PJRT_CPU_DEVICES=4 cargo run --release --example train_llama -- \
//!     --device tpu --mesh dp=2,tp=2 --parallel fsdp+tp             # on a mesh of 4 PJRT devices
//! KILN_PJRT_CPU_DEVICES=4 cargo run --release --example train_llama -- \
//!     --experts 8 --device tpu --mesh ep=4 --parallel ep            # a mixture of experts, split
//! cargo run --release --example train_llama -- --help
//! ```
//!
//! It shows a progress bar (loss, tokens/s, ETA), writes `loss.csv` and
//! `loss.png`, saves checkpoints (`checkpoint-{step}/`: `config.json` +
//! `model.safetensors` in the Hugging Face layout, plus optimizer and training
//! state) and the final model (`config.json` + `model.safetensors`) into `--out`.
//! A resumed run continues bit for bit where the interrupted one stopped, on
//! the same mesh or another one (its sharded checkpoint is resharded on load).
#[path = "../support/answers.rs"]
mod answers;
mod args;
mod log;
#[path = "../support/logging.rs"]
mod logging;

use answers::graded_answers;
use args::{arg_err, Args, USAGE};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kiln::nn::checkpoint::{
    checkpoint_dir, latest_checkpoint, load_checkpoint, prune_checkpoints, save_checkpoint, TrainerState,
};
use kiln::nn::clip::clip_grad_norm_;
use kiln::nn::data::{load_tokenizer, read_tokens, train_val_split, AdditionTask, TokenLoader, Tokenizer};
use kiln::nn::generate::{generate, Sampling};
use kiln::nn::models::{causal_lm_loss, LlamaConfig, LlamaForCausalLM};
use kiln::nn::module::Module;
use kiln::nn::optim::{decay_groups, AdamW, AdamWConfig, Optimizer};
use kiln::nn::parallel::replicate;
use kiln::nn::pipeline::{restore_pipeline, save_pipeline_checkpoint, LossFn, PipelineSchedule};
use kiln::nn::schedule::LrSchedule;
use kiln::prelude::*;
use log::{plot, read_log, write_log, Row};
use serde_json::json;
use std::collections::BTreeMap;
use std::time::Instant;

// ---- data -------------------------------------------------------------------------------------

/// What the model trains on, and how it is evaluated.
struct Data {
    tokenizer: Box<dyn Tokenizer>,
    train: TokenLoader,
    val: Option<TokenLoader>,
    /// The addition task and its held-out problems, when training on it.
    addition: Option<(AdditionTask, Vec<(u64, u64)>)>,
    description: String,
}

/// Entropy (nats per token) of the unigram distribution of `tokens`: the loss of
/// the best model that ignores context.
fn unigram_entropy(tokens: &[u32]) -> f64 {
    let mut counts: BTreeMap<u32, u64> = BTreeMap::new();
    for &t in tokens {
        *counts.entry(t).or_default() += 1;
    }
    let n = tokens.len() as f64;
    counts.values().map(|&c| c as f64 / n).map(|p| -p * p.ln()).sum()
}

fn load_data(args: &Args) -> Result<Data> {
    let tokenizer = load_tokenizer(args.tokenizer.as_deref())?;
    let (train_tokens, val_tokens, addition, what) = match &args.data {
        Some(path) => {
            let tokens = read_tokens(path, &*tokenizer)?;
            let (train, val) = train_val_split(&tokens, 0.1)?;
            let what = format!("{} ({} tokens; 90% train, 10% validation)", path.display(), tokens.len());
            (train, val, None, what)
        }
        None => {
            let task = AdditionTask::new(args.digits, args.seed);
            // Enough distinct problems that the model cannot memorise them: about one epoch of the run.
            let line_len = 3.0 * args.digits as f64 + 3.0;
            let n = ((args.steps as f64 * (args.batch * args.grad_accum) as f64 * args.seq as f64 / line_len) as usize)
                .max(20_000);
            let train = tokenizer.encode(&task.training_text(n))?;
            let held = task.held_out_problems(1000);
            let val_text: String = held.iter().map(|&(a, b)| AdditionTask::line(a, b)).collect();
            let val = tokenizer.encode(&val_text)?;
            let what = format!(
                "addition of numbers below {} ({n} generated training problems, {} held out for evaluation)",
                10u64.pow(task.digits),
                held.len()
            );
            (train, val, Some((task, held)), what)
        }
    };
    let entropy = unigram_entropy(&train_tokens);
    let train = TokenLoader::new(train_tokens, args.batch, args.seq)?.with_seed(args.seed);
    let val = TokenLoader::new(val_tokens, args.batch, args.seq).ok().map(|l| l.with_shuffle(false));
    let description = format!("{what}; unigram entropy {entropy:.3} nats/token");
    Ok(Data { tokenizer, train, val, addition, description })
}

// ---- pipelines --------------------------------------------------------------------------------

/// One pipelined training step over `batches` (the micro-batches of
/// `--grad-accum`, each split into the pipeline's microbatches): gradients
/// accumulate (each micro-batch counting 1 / grad_accum), are clipped by the
/// global norm across stages, and every stage's AdamW steps. Returns the mean
/// loss and the norm before clipping.
fn pipelined_step(p: &mut PipelineSchedule, opts: &mut [AdamW], batches: &[Tensor], clip: f64) -> Result<(f64, f64)> {
    let mut loss = 0.0;
    for b in batches {
        let losses = p.step(b, b)?;
        loss += losses.iter().map(|l| l.item_f64()).sum::<Result<f64>>()? / losses.len() as f64;
    }
    let k = batches.len() as f64;
    if k > 1.0 {
        // Each step's gradients are its microbatches' mean: k steps summed, over k.
        let _g = kiln::autograd::no_grad();
        for s in p.stages() {
            for t in s.module().parameters() {
                if let Some(g) = t.grad() {
                    g.mul_(&Tensor::scalar(1.0 / k, (g.dtype(), g.device()))?)?;
                }
            }
        }
    }
    let grad_norm = p.clip_grad_norm_(clip)?;
    for o in opts.iter_mut() {
        o.step()?;
        o.zero_grad();
    }
    Ok((loss / k, grad_norm))
}

/// Copies the pipeline's parameters into `model` (on its own devices), for
/// evaluation, generation and the final save.
fn sync_from_pipeline(model: &mut LlamaForCausalLM, p: &PipelineSchedule) -> Result<()> {
    let device = model.device();
    let state = p.state_dict().into_iter().map(|(n, t)| Ok((n, t.to_device(device)?))).collect::<Result<_>>()?;
    model.load_state_dict(&state, true)?;
    Ok(())
}

// ---- evaluation -------------------------------------------------------------------------------

/// Mean loss over (up to `max_batches` of) the validation windows.
fn validation_loss(model: &LlamaForCausalLM, val: &TokenLoader, max_batches: usize) -> Result<f64> {
    let _g = kiln::autograd::no_grad();
    let (mut total, mut n) = (0.0, 0.0);
    for batch in val.sequential_batches().take(max_batches) {
        let batch = batch?.to_device(model.device())?;
        let loss = causal_lm_loss(&model.forward(&batch, None)?, &batch, None)?;
        let w = batch.shape()[0] as f64;
        total += loss.item_f64()? * w;
        n += w;
    }
    Ok(total / n.max(1.0))
}

/// Exact-match accuracy of greedy answers to held-out problems, with its
/// split by operand length and labelled examples.
struct AdditionReport {
    accuracy: f64,
    /// `(digits of the longer operand, right, problems)`, by digits.
    by_digits: Vec<(u32, usize, usize)>,
    /// The first problems in held-out order (a random sample: held-out
    /// problems are drawn at random), each with its answer and a label.
    examples: Vec<String>,
}

/// Greedy answers to held-out `problems` (prompts `"\n{a}+{b}="`, a newline
/// first as problems appear in the training stream, batched by length).
fn addition_accuracy(
    model: &LlamaForCausalLM,
    tok: &dyn Tokenizer,
    task: &AdditionTask,
    problems: &[(u64, u64)],
) -> Result<AdditionReport> {
    let prompts = problems
        .iter()
        .map(|&(a, b)| tok.encode(&format!("\n{}", AdditionTask::prompt(a, b))))
        .collect::<Result<Vec<_>>>()?;
    // Each problem's answer (up to its first newline) and whether it is right, in problem order.
    let answers = graded_answers(model, tok, task, problems, &prompts)?;
    let digits = |n: u64| n.checked_ilog10().unwrap_or(0) + 1;
    let mut by_digits: BTreeMap<u32, (usize, usize)> = BTreeMap::new();
    for (&(a, b), (_, ok)) in problems.iter().zip(&answers) {
        let e = by_digits.entry(digits(a.max(b))).or_default();
        e.0 += *ok as usize;
        e.1 += 1;
    }
    let examples = problems
        .iter()
        .zip(&answers)
        .take(8)
        .map(|(&(a, b), (shown, ok))| {
            let label = if *ok { "right".to_string() } else { format!("wrong, {} expected", a + b) };
            format!("{a}+{b}={shown} ({label})")
        })
        .collect();
    let right = answers.iter().filter(|(_, ok)| *ok).count();
    Ok(AdditionReport {
        accuracy: right as f64 / problems.len().max(1) as f64,
        by_digits: by_digits.into_iter().map(|(d, (r, n))| (d, r, n)).collect(),
        examples,
    })
}

// ---- training ---------------------------------------------------------------------------------

fn model_config(args: &Args, vocab: usize) -> Result<LlamaConfig> {
    if args.experts > 0 {
        // Qwen3-MoE: every layer's MLP a sparse block of SwiGLU experts.
        return LlamaConfig::from_json(&json!({
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "vocab_size": vocab,
            "hidden_size": args.hidden,
            "intermediate_size": args.intermediate,
            "moe_intermediate_size": args.moe_intermediate,
            "num_experts": args.experts,
            "num_experts_per_tok": args.experts_per_token,
            "norm_topk_prob": true,
            "num_hidden_layers": args.layers,
            "num_attention_heads": args.heads,
            "num_key_value_heads": args.kv_heads,
            "head_dim": args.hidden / args.heads.max(1),
            "max_position_embeddings": args.seq.max(256),
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "initializer_range": 0.02,
            "tie_word_embeddings": false,
        }));
    }
    LlamaConfig::from_json(&json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": args.hidden,
        "intermediate_size": args.intermediate,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads,
        "num_key_value_heads": args.kv_heads,
        "max_position_embeddings": args.seq.max(256),
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "tie_word_embeddings": false,
    }))
}

fn run(mut args: Args) -> Result<()> {
    // A resumed run takes its settings from its checkpoint.
    let resume_from = if args.resume { latest_checkpoint(&args.out)? } else { None };
    let checkpoint = match &resume_from {
        Some(dir) => {
            let c = load_checkpoint(dir)?;
            args.adopt(&c.state.extra["args"])?;
            Some(c)
        }
        None => {
            if args.resume {
                println!("no checkpoint in {}: starting a new run", args.out.display());
            }
            None
        }
    };
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let parallel = args.parallelism()?;
    // Where the step's tensors live: the mesh, or the one device.
    let context = args.context_parallelism()?;
    let device = match (&parallel, &context) {
        (Some((m, _)), _) => m.device(),
        (None, Some(cp)) => cp.mesh().device(),
        (None, None) => args.device,
    };
    match &parallel {
        Some((mesh, recipe)) => println!("kiln train_llama on {mesh} ({recipe:?}; {threads} host threads)"),
        None => println!("kiln train_llama on {} ({threads} threads)", args.device),
    }
    kiln::manual_seed(args.seed);
    let mut data = load_data(&args)?;
    println!("data: {}", data.description);
    let cfg = model_config(&args, data.tokenizer.vocab_size())?;
    let mut model = LlamaForCausalLM::new(&cfg, (DType::F32, args.device))?;
    // One stacked parameter per projection of the experts, whatever the recipe,
    // so that optimizer state resumes under any of them (checkpoints keep the Hub's names).
    model.stack_experts()?;
    model.set_mixed_precision(args.precision)?;
    if let Some(p) = &args.precision {
        println!(
            "precision: forward under autocast to {} (master weights and gradients float32)",
            p.param_dtype.map_or("float32".into(), |d| d.to_string())
        );
    }
    if let Some(cp) = &context {
        // Initialised on one device, then replicated over the cp devices.
        replicate(&mut model, cp.mesh())?;
        model.set_context_parallel(Some(cp.clone()));
        println!("context parallel: every sequence split over {} (load-balanced order), ring attention", cp.mesh());
    }
    if let Some((mesh, recipe)) = &parallel {
        // Initialised on one device (the same weights as a one-device run), then placed.
        recipe.apply(&mut model, mesh)?;
        if args.capacity_factor.is_some() {
            model.set_expert_capacity_factor(args.capacity_factor)?;
        }
        for (n, p) in model.named_parameters().iter().filter(|(n, _)| n.contains("layers.0.") || !n.contains("layers"))
        {
            let placements: Vec<String> = p.placements()?.iter().map(|x| x.to_string()).collect();
            println!("  {n}: {:?} on {} as [{}]", p.shape(), p.device_mesh()?, placements.join(", "));
        }
    }
    model.train(true);
    let mlp = match &cfg.moe {
        Some(m) if m.num_experts > 0 => format!(
            "{} experts of width {} ({} per token)",
            m.num_experts, m.moe_intermediate_size, m.num_experts_per_tok
        ),
        _ => format!("MLP {}", cfg.intermediate_size),
    };
    println!(
        "model: {}, {} layers, hidden {}, {} heads ({} KV), {mlp}, vocab {}: {} parameters",
        cfg.class_name(),
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.vocab_size,
        model.num_parameters()
    );
    let adamw =
        AdamWConfig { lr: args.lr, betas: (0.9, 0.95), eps: 1e-8, weight_decay: args.weight_decay, amsgrad: false };
    let mut opt = AdamW::new(decay_groups(model.named_parameters(), args.weight_decay), adamw)?;
    if args.compiled && !args.pipelined {
        if args.device.kind() != kiln::DeviceKind::Tpu {
            return Err(arg_err("--mode compiled needs a PJRT device (--device tpu)"));
        }
        // The learning rate and step count stay on the device: the schedule
        // writes them between steps, the captured step reads them.
        opt.set_capturable(true)?;
    }
    // --parallel pp: the model cut into stages on their devices, one AdamW per
    // stage; the model itself is brought up to date for evaluation and the end.
    let mut pipe = match args.pipeline_plan()? {
        Some(plan) => {
            let loss_fn: LossFn =
                std::sync::Arc::new(|logits: &Tensor, ids: &Tensor| causal_lm_loss(logits, ids, None));
            let p = model.pipeline(&plan, loss_fn)?;
            let opts = p
                .stages()
                .iter()
                .map(|s| AdamW::new(decay_groups(s.module().named_parameters(), args.weight_decay), adamw))
                .collect::<Result<Vec<_>>>()?;
            println!(
                "pipeline: {:?}, {} stages on {:?}, {} microbatches{}",
                plan.kind,
                p.stages().len(),
                plan.devices,
                plan.microbatches,
                if plan.compiled { ", each stage captured" } else { "" }
            );
            Some((p, opts))
        }
        None => None,
    };
    let schedule = LrSchedule::Cosine { warmup: args.warmup, total: args.steps, min_lr_ratio: 0.1 };
    let csv_path = args.out.join("loss.csv");
    let mut step = 0u64;
    let mut rows = vec![];
    if let Some(c) = &checkpoint {
        match &mut pipe {
            Some((p, opts)) => {
                let mut refs: Vec<&mut dyn Optimizer> = opts.iter_mut().map(|o| o as &mut dyn Optimizer).collect();
                restore_pipeline(c, p, &mut refs)?;
            }
            None => c.restore(&mut model, &mut opt)?,
        }
        if let Some(l) = c.state.loader {
            data.train.set_state(l)?;
        }
        step = c.state.step;
        rows = read_log(&csv_path, step);
        println!("resumed from {} at step {step}", c.dir.display());
    } else if args.out.join("loss.csv").exists() && !args.resume {
        println!("note: {} holds an earlier run; its files will be replaced", args.out.display());
    }
    std::fs::create_dir_all(&args.out).map_err(|e| arg_err(format!("cannot create {}: {e}", args.out.display())))?;
    let config_json = serde_json::to_string_pretty(&cfg.to_json(DType::F32)).map_err(|e| arg_err(e.to_string()))?;
    let tokens_per_step = (args.batch * args.grad_accum * args.seq) as f64;

    let bar = ProgressBar::new(args.steps).with_position(step);
    if !console_is_tty() {
        bar.set_draw_target(ProgressDrawTarget::hidden());
    }
    bar.set_style(
        ProgressStyle::with_template("{bar:28.cyan/blue} {pos}/{len} {msg} [{elapsed_precise}, ETA {eta}]")
            .map_err(|e| arg_err(e.to_string()))?
            .progress_chars("=> "),
    );
    let start = Instant::now();
    let start_step = step;
    let mut final_accuracy = None;
    let report = |line: String| {
        if bar.is_hidden() {
            println!("{line}");
        } else {
            bar.println(line);
        }
    };
    // One training step: the micro-batches' gradients accumulate in `.grad`
    // (each loss scaled by 1 / grad_accum, so the step sees their mean), then
    // clipping, AdamW and zero_grad. Returns the mean loss and the gradient norm.
    // The model and optimizer sit in RefCells: with --mode compiled the captured
    // step holds them between calls, while evaluation and checkpoints borrow them.
    // `--grad-accum` and `--clip` are fixed for the run: the step declares them
    // constants (kiln::constant), so a compiled step may replay them.
    let model = std::cell::RefCell::new(model);
    let opt = std::cell::RefCell::new(opt);
    let train_step = |batches: &[Tensor]| -> Result<Vec<Tensor>> {
        let model = model.borrow();
        let mut opt = opt.borrow_mut();
        let mut loss_sum: Option<Tensor> = None;
        // Under context parallelism each micro-batch comes with its next-token targets.
        for batch in batches.chunks(if context.is_some() { 2 } else { 1 }) {
            let logits = model.forward(&batch[0], None)?;
            let loss = match &context {
                Some(cp) => cp.loss(&logits, &batch[1])?,
                None => causal_lm_loss(&logits, &batch[0], None)?,
            };
            kiln::constant(|| loss.div(args.grad_accum as f64))?.backward()?;
            let l = loss.detach();
            loss_sum = Some(match loss_sum {
                None => l,
                Some(s) => s.add(&l)?,
            });
        }
        let loss = kiln::constant(|| loss_sum.expect("at least one micro-batch").div(args.grad_accum as f64))?;
        let grad_norm = kiln::constant(|| clip_grad_norm_(&opt.params(), args.clip))?;
        opt.step()?;
        opt.zero_grad();
        Ok(vec![loss, grad_norm])
    };
    let mut compiled = args.compiled.then(|| kiln::compile(device, train_step));
    let place = |batch: Tensor| -> Result<Vec<Tensor>> {
        match (&parallel, &context) {
            (_, Some(cp)) => Ok(vec![cp.shard_sequence(&batch)?, cp.next_token_targets(&batch)?]),
            (Some((mesh, recipe)), None) => Ok(vec![recipe.place_batch(&batch, mesh)?]),
            (None, None) => Ok(vec![batch.to_device(args.device)?]),
        }
    };
    while step < args.steps {
        let (lr, loss, grad_norm) = match &mut pipe {
            Some((p, opts)) => {
                let mut lr = args.lr;
                for o in opts.iter_mut() {
                    lr = args.lr * schedule.apply(o, step);
                }
                let batches = (0..args.grad_accum).map(|_| data.train.next_batch()).collect::<Result<Vec<_>>>()?;
                let (loss, grad_norm) = pipelined_step(p, opts, &batches, args.clip)?;
                (lr, loss, grad_norm)
            }
            None => {
                let lr = args.lr * schedule.apply(&mut *opt.borrow_mut(), step);
                let batches =
                    (0..args.grad_accum).map(|_| place(data.train.next_batch()?)).collect::<Result<Vec<_>>>()?.concat();
                let out = match &mut compiled {
                    Some(c) => c.call(&batches)?,
                    None => train_step(&batches)?,
                };
                (lr, out[0].item_f64()?, out[1].item_f64()?)
            }
        };
        step += 1;
        if !loss.is_finite() {
            return Err(arg_err(format!("the loss became {loss} at step {step}; try a smaller --lr")));
        }
        let tps = tokens_per_step * (step - start_step) as f64 / start.elapsed().as_secs_f64();
        rows.push(Row { step, loss, lr, grad_norm, tokens_per_sec: tps, ..Default::default() });
        tracing::info!(target: "kiln::train", step, loss, lr, grad_norm, tokens_per_sec = tps, "trained a step");
        bar.set_position(step);
        bar.set_message(format!("loss {loss:.4} | {tps:.0} tok/s | lr {lr:.2e}"));
        if step.is_multiple_of(args.eval_every) || step == args.steps {
            let mut model = model.borrow_mut();
            if let Some((p, _)) = &pipe {
                sync_from_pipeline(&mut model, p)?;
            }
            model.eval();
            // Evaluation (whole validation sequences, generation with a KV cache) runs unsplit.
            model.set_context_parallel(None);
            let mut line = format!("step {step:>6}  train loss {loss:.4}");
            if let Some(val) = &data.val {
                let v = validation_loss(&model, val, 16)?;
                rows.last_mut().expect("pushed above").val_loss = Some(v);
                line += &format!("  val loss {v:.4}");
            }
            if let Some((task, held)) = &data.addition {
                // Every held-out problem at the end, a sample of them on the way.
                let n = if step == args.steps { held.len() } else { 200.min(held.len()) };
                let report = addition_accuracy(&model, &*data.tokenizer, task, &held[..n])?;
                let acc = report.accuracy;
                if step == args.steps {
                    final_accuracy = Some(report);
                }
                rows.last_mut().expect("pushed above").accuracy = Some(acc);
                line += &format!("  held-out accuracy {:.1}% ({n} problems)", 100.0 * acc);
            }
            let row = rows.last().expect("pushed above");
            tracing::info!(
                target: "kiln::train",
                step,
                val_loss = row.val_loss,
                accuracy = row.accuracy,
                "evaluated"
            );
            report(format!("{line}  [{tps:.0} tok/s]"));
            model.set_context_parallel(context.clone());
            model.train(true);
        }
        if step.is_multiple_of(args.save_every) || step == args.steps {
            // The log first: a checkpoint never gets ahead of loss.csv (a resume
            // keeps the rows up to its step and trains the rest again).
            write_log(&csv_path, &rows)?;
            let state = TrainerState::capture(step, Some(data.train.state()))?
                .with_extra(json!({ "args": args.run_settings() }));
            match &pipe {
                Some((p, opts)) => {
                    let refs: Vec<&dyn Optimizer> = opts.iter().map(|o| o as &dyn Optimizer).collect();
                    save_pipeline_checkpoint(checkpoint_dir(&args.out, step), p, Some(&config_json), &refs, &state)?
                }
                None => save_checkpoint(
                    checkpoint_dir(&args.out, step),
                    &*model.borrow(),
                    Some(&config_json),
                    &*opt.borrow(),
                    &state,
                )?,
            }
            prune_checkpoints(&args.out, 2)?;
        }
    }
    if let Some(c) = &compiled {
        let s = c.stats();
        println!(
            "kiln::compile: {} steps, {} traced, {} replayed, {} retraces, {} traced for host values",
            s.calls, s.traces, s.replays, s.retraces, s.host_value_traces
        );
    }
    drop(compiled);
    let mut model = model.into_inner();
    model.set_context_parallel(None);
    if let Some((p, _)) = &pipe {
        sync_from_pipeline(&mut model, p)?;
    }
    bar.finish_and_clear();
    let secs = start.elapsed().as_secs_f64();

    // The final model, in the Hugging Face layout, and the loss curve.
    model.eval();
    model.save_pretrained(&args.out)?;
    write_log(&csv_path, &rows)?;
    let png = args.out.join("loss.png");
    let title = match &data.addition {
        Some((task, _)) => format!("kiln: Llama learning {}-digit addition", task.digits),
        None => format!("kiln: Llama on {}", args.data.as_ref().map_or(String::new(), |d| d.display().to_string())),
    };
    if let Err(e) = plot(&png, &rows, &title) {
        eprintln!("warning: could not draw {}: {e}", png.display());
    }
    if step > start_step {
        println!(
            "trained steps {}..{step} in {secs:.1} s ({:.0} tokens/s)",
            start_step + 1,
            tokens_per_step * (step - start_step) as f64 / secs
        );
    }
    if let Some(r) = rows.last() {
        println!("final train loss {:.4}", r.loss);
    }
    if let Some((task, held)) = &data.addition {
        let report = match final_accuracy {
            Some(r) => r,
            None => addition_accuracy(&model, &*data.tokenizer, task, held)?,
        };
        println!("held-out accuracy (exact match, greedy): {:.1}% of {} problems", 100.0 * report.accuracy, held.len());
        let split: Vec<String> = report
            .by_digits
            .iter()
            .map(|(d, r, n)| format!("{d}-digit {:.1}% of {n}", 100.0 * *r as f64 / *n as f64))
            .collect();
        println!("  by the longer operand: {}", split.join(", "));
        println!("  a random sample of the held-out problems:");
        for e in &report.examples {
            println!("    {e}");
        }
    } else {
        let prompt = data.tokenizer.encode("\n")?;
        let ids = Tensor::from_vec(prompt.iter().map(|&t| t as i64).collect::<Vec<_>>(), &[1, prompt.len()])?;
        let out =
            generate(&model, &ids.to_device(device)?, 300, &Sampling::sample(0.8).with_top_k(40).with_seed(args.seed))?;
        let new: Vec<u32> = out.to_vec::<i64>()?[prompt.len()..].iter().map(|&t| t as u32).collect();
        println!("sample (temperature 0.8, top-k 40):\n{}", data.tokenizer.decode(&new)?);
    }
    println!("wrote {} (config.json, model.safetensors, checkpoint-{step}/, loss.csv, loss.png)", args.out.display());
    Ok(())
}

fn console_is_tty() -> bool {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal()
}

fn main() {
    logging::init();
    let args = match Args::parse(std::env::args().skip(1)) {
        Ok(Some(a)) => a,
        Ok(None) => {
            print!("{USAGE}");
            return;
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(args) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
