//! LoRA / QLoRA fine-tuning of a pretrained Llama or Qwen3 on chat data, with
//! kiln, offline.
//!
//! ```sh
//! cargo run --release --example finetune                    # the main job's model, on generated chats
//! cargo run --release --example finetune -- --model DIR --data chats.jsonl --lora-r 16
//! cargo run --release --example finetune -- --quantize nvfp4      # QLoRA: the base kept in NVFP4
//! cargo run --release --example finetune -- --resume             # continue the run in --out
//! cargo run --release --example finetune -- --help
//! ```
//!
//! The base is `--model` (any Llama/Qwen3 directory), by default the model
//! `train_llama` writes (`runs/train_llama`); on a fresh clone, where there
//! is none yet, a small one is pretrained first on generated addition
//! problems. The data is `--data` (JSONL, `{"messages": [...]}` per line, as
//! TRL reads it), by default chats generated from the same task ("What is 12
//! plus 57?" answered "69"), rendered with the model's chat template, the
//! loss on the assistant's turns only. LoRA adapters (PEFT's defaults,
//! `"all-linear"`) train over the frozen base, with a progress bar, a loss
//! plot, resumable checkpoints (adapter, optimizer and loader state), and
//! write the adapter in PEFT's format into `--out/adapter` (and with
//! `--merge` the merged model into `--out/merged`). On the generated chats
//! it reports the held-out accuracy of the greedy answers before and after.
#[path = "../support/answers.rs"]
mod answers;
#[path = "../train_llama/log.rs"]
mod log;
#[path = "../support/logging.rs"]
mod logging;

mod chats;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kiln::nn::chat::ChatTemplate;
use kiln::nn::checkpoint::{
    checkpoint_dir, latest_checkpoint, load_checkpoint, prune_checkpoints, save_checkpoint_parts, TrainerState,
};
use kiln::nn::clip::clip_grad_norm_;
use kiln::nn::data::sft::{read_chat_jsonl, tokenize_conversation, SftBatch, SftLoader, IGNORE_INDEX};
use kiln::nn::data::{load_tokenizer, AdditionTask, TokenLoader, Tokenizer};
use kiln::nn::lora::{inject_adapter, merge_and_unload, save_adapter, LoraConfig, TargetModules};
use kiln::nn::models::{causal_lm_loss, LlamaConfig, LlamaForCausalLM, PretrainedOptions, QuantizedLoad};
use kiln::nn::module::Module;
use kiln::nn::optim::{AdamW, AdamWConfig, Optimizer};
use kiln::nn::parallel::{parse_mesh, Recipe};
use kiln::nn::precision::MixedPrecisionPolicy;
use kiln::nn::quantize::{quantize_model, QuantScheme};
use kiln::nn::schedule::LrSchedule;
use kiln::prelude::*;
use kiln::{DeviceKind, DeviceMesh};
use log::{plot, read_log, write_log, Row};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::time::Instant;

const USAGE: &str = "\
LoRA / QLoRA fine-tuning of a Llama or Qwen3 model on chat data (see the file's header).

USAGE: cargo run --release --example finetune -- [OPTIONS]

  --model DIR          the base (config.json + model.safetensors) [default: runs/train_llama, pretrained
                       first when absent]
  --data FILE          chats in JSONL ({\"messages\": [{\"role\", \"content\"}, ...]} per line) [default:
                       generated addition chats]
  --out DIR            adapter, checkpoints, loss.csv, loss.png [default: runs/finetune]
  --lora-r R           the adapters' rank [default: 16]
  --lora-alpha A       the scaling's numerator (scaling = A / r) [default: 2r]
  --lora-dropout P     dropout on the adapters' input [default: 0]
  --target-modules T   all-linear, a comma-separated list (q_proj,v_proj), or a regex [default: all-linear]
  --rslora             scaling = A / sqrt(r)
  --dora               DoRA: a trainable magnitude per output row beside each adapter
  --steps N            optimizer steps [default: 600]
  --batch B            conversations (or packed rows) per step [default: 16]
  --seq T              tokens per row (longer conversations are cut) [default: 64]
  --packing            several conversations per row, each attending only to itself
  --all-tokens         learn every token, not only the assistant's turns
  --lr X               peak learning rate (cosine, 10% warmup) [default: 3e-3]
  --clip X             gradient clipping by global norm [default: 1.0]
  --seed S             data order and adapter initialisation [default: 0]
  --device D           cpu, or tpu (the PJRT backend) [default: cpu]
  --mode compiled      each step captured by kiln::compile (not with --packing)
  --mesh SPEC --parallel R   a mesh of PJRT devices (dp=2, tp=2, ...) and a recipe (ddp, fsdp, tp, fsdp+tp)
  --precision P        f32, or bf16-mixed / f16-mixed (the forward under autocast) [default: f32]
  --quantized keep     QLoRA over a quantized checkpoint (FP8, MXFP4, NVFP4) kept quantized
  --quantize S         QLoRA over a dense base quantized in memory: nvfp4, mxfp4, fp8, fp8-channel, q8_0, q4_0
  --merge              also write the merged model (merge_and_unload) into --out/merged
  --save-every N       checkpoint every N steps [default: 100]
  --resume             continue from the latest checkpoint in --out
  --base-steps N       without --model and runs/train_llama: the pretraining steps of the base made
                       first [default: 1500]
";

#[derive(Debug, Clone)]
struct Args {
    model: Option<PathBuf>,
    data: Option<PathBuf>,
    out: PathBuf,
    lora_r: usize,
    lora_alpha: Option<f64>,
    lora_dropout: f64,
    target_modules: String,
    rslora: bool,
    dora: bool,
    steps: u64,
    batch: usize,
    seq: usize,
    packing: bool,
    all_tokens: bool,
    lr: f64,
    clip: f64,
    seed: u64,
    device: Device,
    compiled: bool,
    mesh: Option<String>,
    parallel: Option<String>,
    precision: Option<MixedPrecisionPolicy>,
    keep_quantized: bool,
    quantize: Option<String>,
    merge: bool,
    save_every: u64,
    resume: bool,
    /// Steps of the fallback base's pretraining.
    base_steps: u64,
}

fn arg_err(msg: impl Into<String>) -> Error {
    Error::invalid("options", msg.into())
}

fn parse_args() -> Result<Option<Args>> {
    let mut a = Args {
        model: None,
        data: None,
        out: PathBuf::from("runs/finetune"),
        lora_r: 16,
        lora_alpha: None,
        lora_dropout: 0.0,
        target_modules: "all-linear".into(),
        rslora: false,
        dora: false,
        steps: 600,
        batch: 16,
        seq: 64,
        packing: false,
        all_tokens: false,
        lr: 3e-3,
        clip: 1.0,
        seed: 0,
        device: Device::Cpu,
        compiled: false,
        mesh: None,
        parallel: None,
        precision: None,
        keep_quantized: false,
        quantize: None,
        merge: false,
        save_every: 100,
        resume: false,
        base_steps: 1500,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--help" | "-h" => {
                print!("{USAGE}");
                return Ok(None);
            }
            "--packing" => a.packing = true,
            "--all-tokens" => a.all_tokens = true,
            "--rslora" => a.rslora = true,
            "--dora" => a.dora = true,
            "--merge" => a.merge = true,
            "--resume" => a.resume = true,
            _ => {
                let v = it.next().ok_or_else(|| arg_err(format!("{flag} needs a value")))?;
                let num = |v: &str| v.parse::<f64>().map_err(|_| arg_err(format!("{flag}: {v:?} is not a number")));
                let int = |v: &str| v.parse::<u64>().map_err(|_| arg_err(format!("{flag}: {v:?} is not a count")));
                match flag.as_str() {
                    "--model" => a.model = Some(PathBuf::from(v)),
                    "--data" => a.data = Some(PathBuf::from(v)),
                    "--out" => a.out = PathBuf::from(v),
                    "--lora-r" => a.lora_r = int(&v)? as usize,
                    "--lora-alpha" => a.lora_alpha = Some(num(&v)?),
                    "--lora-dropout" => a.lora_dropout = num(&v)?,
                    "--target-modules" => a.target_modules = v,
                    "--steps" => a.steps = int(&v)?,
                    "--batch" => a.batch = int(&v)? as usize,
                    "--seq" => a.seq = int(&v)? as usize,
                    "--lr" => a.lr = num(&v)?,
                    "--clip" => a.clip = num(&v)?,
                    "--seed" => a.seed = int(&v)?,
                    "--device" => {
                        a.device = Device::parse(&v)?;
                        kiln::init_device(a.device)?; // registers the PJRT backend for tpu
                    }
                    "--mode" if v == "compiled" => a.compiled = true,
                    "--mode" => return Err(arg_err(format!("--mode {v}: only compiled is a mode here"))),
                    "--mesh" => a.mesh = Some(v),
                    "--parallel" => a.parallel = Some(v),
                    "--precision" => a.precision = MixedPrecisionPolicy::parse(&v)?,
                    "--quantized" if v == "keep" => a.keep_quantized = true,
                    "--quantized" => return Err(arg_err(format!("--quantized {v}: expected keep"))),
                    "--quantize" => a.quantize = Some(v),
                    "--save-every" => a.save_every = int(&v)?.max(1),
                    "--base-steps" => a.base_steps = int(&v)?,
                    _ => return Err(arg_err(format!("unknown option {flag} (see --help)"))),
                }
            }
        }
    }
    if a.compiled && a.device == Device::Cpu && a.mesh.is_none() {
        return Err(arg_err("--mode compiled needs a PJRT device (--device tpu)"));
    }
    if a.compiled && a.packing {
        return Err(arg_err("--packing runs eagerly: each packed row's layout is read on the host"));
    }
    if a.mesh.is_some() != a.parallel.is_some() {
        return Err(arg_err("--mesh and --parallel go together"));
    }
    Ok(Some(a))
}

impl Args {
    fn lora_config(&self) -> LoraConfig {
        let targets = match self.target_modules.as_str() {
            "all-linear" => TargetModules::AllLinear,
            t if t.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ',' || c == '.') => {
                TargetModules::Names(t.split(',').map(str::to_string).collect())
            }
            t => TargetModules::Regex(t.to_string()),
        };
        let mut c = LoraConfig::new(self.lora_r, targets);
        c.lora_alpha = self.lora_alpha.unwrap_or(2.0 * self.lora_r as f64);
        c.lora_dropout = self.lora_dropout;
        c.use_rslora = self.rslora;
        c.use_dora = self.dora;
        c.base_model_name_or_path = self.model.as_ref().map(|m| m.display().to_string());
        c
    }
}

// ---- the base model -------------------------------------------------------------------------------

/// `train_llama`'s default model, pretrained for `steps` on addition
/// problems and saved into `dir` (the fallback base of a fresh clone).
fn pretrain_base(dir: &Path, task: &AdditionTask, steps: u64) -> Result<()> {
    let cfg = LlamaConfig::from_json(&json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 192, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
        "initializer_range": 0.02, "tie_word_embeddings": false,
    }))?;
    kiln::manual_seed(0);
    let model = LlamaForCausalLM::new(&cfg, DType::F32)?;
    let tok = kiln::nn::data::ByteTokenizer;
    let mut loader = TokenLoader::new(tok.encode(&task.training_text(40_000))?, 16, 64)?;
    let mut opt = AdamW::new(
        model.named_parameters(),
        AdamWConfig { lr: 3e-3, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1, amsgrad: false },
    )?;
    let schedule = LrSchedule::Cosine { warmup: 50, total: steps, min_lr_ratio: 0.1 };
    let bar = progress(steps, 0)?;
    for step in 0..steps {
        schedule.apply(&mut opt, step);
        let (x, y) = kiln::nn::data::inputs_targets(&loader.next_batch()?)?;
        let logits = model.forward(&x, None)?;
        let v = logits.shape()[2];
        let loss = logits.reshape(&[-1, v as isize])?.cross_entropy(
            &y.reshape(&[-1])?,
            None,
            kiln::tensor::Reduction::Mean,
        )?;
        loss.backward()?;
        clip_grad_norm_(&model.parameters(), 1.0)?;
        opt.step()?;
        opt.zero_grad();
        bar.set_position(step + 1);
        bar.set_message(format!("pretraining loss {:.3}", loss.item_f64()?));
    }
    bar.finish_and_clear();
    model.save_pretrained(dir)
}

/// The base directory: `--model`, else `runs/train_llama`, else a base
/// pretrained here into `--out/base`.
fn base_dir(args: &Args, task: &AdditionTask) -> Result<PathBuf> {
    if let Some(m) = &args.model {
        return Ok(m.clone());
    }
    for dir in [PathBuf::from("runs/train_llama"), args.out.join("base")] {
        if dir.join("config.json").is_file() {
            return Ok(dir);
        }
    }
    let dir = args.out.join("base");
    println!(
        "no model in runs/train_llama (the main job's output): pretraining a small base on addition first ({})",
        dir.display()
    );
    pretrain_base(&dir, task, args.base_steps)?;
    Ok(dir)
}

fn progress(len: u64, at: u64) -> Result<ProgressBar> {
    let bar = ProgressBar::new(len).with_position(at);
    if !std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        bar.set_draw_target(ProgressDrawTarget::hidden());
    }
    bar.set_style(
        ProgressStyle::with_template("{bar:28.cyan/blue} {pos}/{len} {msg} [{elapsed_precise}, ETA {eta}]")
            .map_err(|e| arg_err(e.to_string()))?
            .progress_chars("=> "),
    );
    Ok(bar)
}

// ---- training -------------------------------------------------------------------------------------

/// The batch's tensors on the step's device (split over the mesh's data axis under a recipe).
fn place(b: &SftBatch, device: Device, parallel: &Option<(DeviceMesh, Recipe)>) -> Result<SftBatch> {
    let put = |t: &Tensor| match parallel {
        Some((mesh, r)) => r.place_batch(t, mesh),
        None => t.to_device(device),
    };
    Ok(SftBatch {
        input_ids: put(&b.input_ids)?,
        labels: put(&b.labels)?,
        attention_mask: None,
        position_ids: b.position_ids.clone(),
    })
}

/// The loss of a batch (the mean over its learned tokens): `positions` for
/// packed rows. Padded rows need no mask: their padding is on the right,
/// where causal attention never lets a real token look, and it is not learned.
fn loss_of(model: &LlamaForCausalLM, ids: &Tensor, labels: &Tensor, positions: Option<&Tensor>) -> Result<Tensor> {
    let logits = match positions {
        Some(p) => model.forward_packed(ids, p)?,
        None => model.forward(ids, None)?,
    };
    causal_lm_loss(&logits, labels, Some(IGNORE_INDEX))
}

fn run(args: Args) -> Result<()> {
    let task = AdditionTask::new(2, 0);
    // A resumed run takes its data and adapter settings from its checkpoint.
    let checkpoint = match args.resume.then(|| latest_checkpoint(&args.out)).transpose()?.flatten() {
        Some(dir) => Some(load_checkpoint(dir)?),
        None => {
            if args.resume {
                println!("no checkpoint in {}: starting a new run", args.out.display());
            }
            None
        }
    };
    std::fs::create_dir_all(&args.out).map_err(|e| arg_err(format!("cannot create {}: {e}", args.out.display())))?;
    let base = base_dir(&args, &task)?;
    let data = match &args.data {
        Some(d) => d.clone(),
        None => {
            let path = args.out.join("chats.jsonl");
            chats::write_addition_chats(&path, &task, 20_000)?;
            path
        }
    };
    let tok_file = base.join("tokenizer.json");
    let tokenizer = load_tokenizer(tok_file.is_file().then_some(tok_file.as_path()))?;
    let template = ChatTemplate::for_model(&base)?;
    let conversations = read_chat_jsonl(&data)?;
    let examples = conversations
        .iter()
        .map(|c| tokenize_conversation(&template, &*tokenizer, c, !args.all_tokens))
        .collect::<Result<Vec<_>>>()?;
    let mut loader = SftLoader::new(examples, args.batch, args.seq, args.packing)?.with_seed(args.seed);

    let parallel = match (&args.mesh, &args.parallel) {
        (Some(m), Some(r)) => Some((parse_mesh(m, DeviceKind::Tpu)?, Recipe::parse(r)?)),
        _ => None,
    };
    let device = parallel.as_ref().map_or(args.device, |(m, _)| m.device());
    let quantized =
        if args.keep_quantized { QuantizedLoad::Keep } else { QuantizedLoad::Dequantize { round_to: None } };
    let mut model = LlamaForCausalLM::from_pretrained_with(
        &base,
        &PretrainedOptions::new(DType::F32, device).with_quantized(quantized),
    )?;
    if let Some(s) = &args.quantize {
        quantize_model(&mut model, QuantScheme::parse(s)?)?;
    }
    let held = task.held_out_problems(200);
    let evaluate = args.data.is_none() && parallel.is_none();
    let before =
        if evaluate { Some(chats::chat_accuracy(&model, &template, &*tokenizer, &task, &held)?) } else { None };
    kiln::manual_seed(args.seed);
    let lora = args.lora_config();
    inject_adapter(&mut model, &lora)?;
    model.set_mixed_precision(args.precision)?;
    if let Some((mesh, r)) = &parallel {
        r.apply(&mut model, mesh)?;
    }
    model.train(true);
    let trainable: usize = model.named_trainable_parameters().iter().map(|(_, t)| t.numel()).sum();
    println!(
        "base {} ({} parameters{}), LoRA r={} alpha={} on {:?}: {trainable} trainable ({:.2}%)",
        base.display(),
        model.num_parameters() - trainable,
        if args.keep_quantized || args.quantize.is_some() { ", decoder weights kept quantized: QLoRA" } else { "" },
        lora.r,
        lora.lora_alpha,
        lora.target_modules,
        100.0 * trainable as f64 / model.num_parameters().max(1) as f64
    );
    println!(
        "data {}: {} conversations, {} batches of {} per epoch",
        data.display(),
        conversations.len(),
        loader.batches_per_epoch(),
        args.batch
    );

    let adamw = AdamWConfig { lr: args.lr, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.0, amsgrad: false };
    let mut opt = AdamW::new(model.named_trainable_parameters(), adamw)?;
    opt.set_capturable(args.compiled)?;
    let mut step = 0;
    if let Some(c) = &checkpoint {
        // The adapters' weights (kiln's names), the optimizer, the loader and the generators.
        let weights = c.model_state()?;
        let params: std::collections::BTreeMap<String, Tensor> =
            model.named_trainable_parameters().into_iter().collect();
        if weights.len() != params.len() || params.keys().any(|k| !weights.contains_key(k)) {
            return Err(arg_err(format!("{} holds another adapter than these options make", c.dir.display())));
        }
        let _g = kiln::autograd::no_grad();
        for (n, p) in &params {
            p.copy_(&weights[n])?;
        }
        opt.load_state_dict(c.optimizer_state()?)?;
        c.state.restore_rng()?;
        if let Some(l) = c.state.loader {
            loader.set_state(l)?;
        }
        step = c.state.step;
        println!("resumed from {} at step {step}", c.dir.display());
    }
    let schedule = LrSchedule::Cosine { warmup: args.steps / 10, total: args.steps, min_lr_ratio: 0.1 };
    let mut rows = read_log(&args.out.join("loss.csv"), step);
    let bar = progress(args.steps, step)?;
    let start = Instant::now();
    // One step, eager or captured by kiln::compile: the model and optimizer sit
    // in RefCells, held by the captured step between calls and borrowed by the
    // checkpoints. The clipping bound is fixed for the run (a constant).
    let model = std::cell::RefCell::new(model);
    let opt = std::cell::RefCell::new(opt);
    let train_step = |xs: &[Tensor]| -> Result<Vec<Tensor>> {
        let (model, mut opt) = (model.borrow(), opt.borrow_mut());
        let loss = match xs {
            [ids, labels] => loss_of(&model, ids, labels, None)?,
            [ids, labels, positions] => loss_of(&model, ids, labels, Some(positions))?,
            _ => return Err(arg_err("a step takes ids, labels and, packed, positions")),
        };
        loss.backward()?;
        let norm = kiln::constant(|| clip_grad_norm_(&opt.params(), args.clip))?;
        opt.step()?;
        opt.zero_grad();
        Ok(vec![loss.detach(), norm])
    };
    let mut compiled = args.compiled.then(|| kiln::compile(device, train_step));
    while step < args.steps {
        let t = Instant::now();
        let lr = args.lr * schedule.apply(&mut *opt.borrow_mut(), step);
        let b = place(&loader.next_batch()?, device, &parallel)?;
        let xs = match b.position_ids {
            None => vec![b.input_ids, b.labels],
            Some(pos) => vec![b.input_ids, b.labels, pos],
        };
        let out = match &mut compiled {
            Some(c) => c.call(&xs)?,
            None => train_step(&xs)?,
        };
        let (loss, norm) = (out[0].item_f64()?, out[1].item_f64()?);
        step += 1;
        let tokens_per_sec = (args.batch * args.seq) as f64 / t.elapsed().as_secs_f64();
        rows.push(Row { step, loss, lr, grad_norm: norm, tokens_per_sec, val_loss: None, accuracy: None });
        bar.set_position(step);
        bar.set_message(format!("loss {loss:.4} | {tokens_per_sec:.0} tok/s"));
        if step % args.save_every == 0 || step == args.steps {
            let weights =
                model.borrow().named_trainable_parameters().into_iter().map(|(n, t)| (n, t.detach())).collect();
            let opt_state = opt.borrow().state_dict()?.into_iter().collect();
            let state = TrainerState::capture(step, Some(loader.state()))?;
            save_checkpoint_parts(&checkpoint_dir(&args.out, step), &[weights], None, &opt_state, &state)?;
            prune_checkpoints(&args.out, 2)?;
            write_log(&args.out.join("loss.csv"), &rows)?;
        }
    }
    bar.finish_and_clear();
    if let Some(c) = &compiled {
        let s = c.stats();
        println!(
            "kiln::compile: {} steps, {} traced, {} replayed, {} retraces",
            s.calls, s.traces, s.replays, s.retraces
        );
    }
    drop(compiled);
    let mut model = model.into_inner();
    println!(
        "{} steps in {:.1}s",
        args.steps - rows.first().map_or(0, |r| r.step - 1).min(args.steps),
        start.elapsed().as_secs_f64()
    );
    let title = format!("kiln: LoRA r={} fine-tuning", lora.r);
    if let Err(e) = plot(&args.out.join("loss.png"), &rows, &title) {
        println!("no loss plot: {e}");
    }
    model.eval();
    let adapter = args.out.join("adapter");
    save_adapter(&adapter, &model, &lora)?;
    println!("adapter (PEFT's format) in {}", adapter.display());
    if let Some((acc0, _)) = before {
        let (acc, examples) = chats::chat_accuracy(&model, &template, &*tokenizer, &task, &held)?;
        println!(
            "held-out accuracy of the chat answers (exact match, greedy): {:.1}% before, {:.1}% after",
            100.0 * acc0,
            100.0 * acc
        );
        for e in examples {
            println!("  {e}");
        }
    }
    if args.merge {
        if args.keep_quantized || args.quantize.is_some() || parallel.is_some() {
            return Err(arg_err("--merge writes a dense model: not with a quantized base or a mesh"));
        }
        merge_and_unload(&mut model)?;
        let merged = args.out.join("merged");
        model.save_pretrained(&merged)?;
        println!("merged model in {}", merged.display());
    }
    Ok(())
}

fn main() {
    logging::init();
    let result = parse_args().and_then(|a| match a {
        Some(a) => run(a),
        None => Ok(()),
    });
    if let Err(e) = result {
        eprintln!("finetune: {e}");
        std::process::exit(1);
    }
}
