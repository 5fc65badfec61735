//! Runs a Hugging Face Llama/Qwen3/Qwen3-MoE checkpoint through kiln and writes what a
//! reference implementation (PyTorch + transformers) can be compared against:
//! logits, the causal-LM loss, every gradient, optionally AdamW steps and
//! greedy generation.
//!
//! ```sh
//! cargo run --release --example hf_check -- --model DIR --input-ids IN.safetensors --out OUT.safetensors \
//!     [--dtype f32|bf16] [--steps N] [--lr 1e-3 --beta1 0.9 --beta2 0.95 --eps 1e-8 --weight-decay 0.1] \
//!     [--generate N] [--device cpu|tpu] [--mode strict|debug|defer|compiled] \
//!     [--mesh dp=2,tp=2 --parallel ddp|fsdp|tp|fsdp+tp|ep|fsdp+ep] [--quantized dequant|dequant-bf16|keep] [--weights-only]
//!     [--mesh pp=2 | --stage-devices cpu,tpu:0] --parallel pp [--schedule gpipe|1f1b|interleaved] [--microbatches N]
//!     [--mesh pp=2,dp=2,tp=2 --parallel pp+fsdp+tp] [--mesh cp=4] [--lora ADAPTER_DIR]
//! ```
//!
//! Reads `input_ids` (int64 `[B, T]`) and, for `--generate`, `generate.prompt`
//! (int64 `[B, P]`) from IN. Writes to OUT: `logits` (f32 `[B, T, V]`), `loss`
//! (f32 scalar, mean next-token cross entropy of `logits[:, :-1]` against
//! `input_ids[:, 1:]`), `grad.<param>` for every parameter from one backward of
//! that loss; with `--steps N`, `loss_curve` (f32 `[N+1]`: the loss before each
//! of N AdamW steps on the same batch, then after the last), `adamw_step1.<param>`
//! and `adamw_step<N>.<param>`; with `--generate N`, `generate.output` (int64
//! `[B, P+N]`, greedy with the KV cache, from the loaded weights).
#[path = "support/logging.rs"]
mod logging;
use kiln::nn::generate::{generate, Sampling};
use kiln::nn::io::{load_safetensors, save_safetensors};
use kiln::nn::layers::to_hub_layout;
use kiln::nn::lora::{load_adapter, PEFT_PREFIX};
use kiln::nn::models::{causal_lm_loss, LlamaForCausalLM, PretrainedOptions, QuantizedLoad};
use kiln::nn::module::Module;
use kiln::nn::optim::{AdamW, AdamWConfig, Optimizer};
use kiln::nn::parallel::{parse_mesh, replicate, ContextParallel, Recipe};
use kiln::nn::pipeline::{LossFn, PipelinePlan, PipelineSchedule, ScheduleKind};
use kiln::nn::precision::MixedPrecisionPolicy;
use kiln::prelude::*;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

const USAGE: &str = "\
hf_check: run a Hugging Face Llama/Qwen3 checkpoint through kiln

USAGE: cargo run --release --example hf_check -- --model DIR --input-ids IN.safetensors --out OUT.safetensors [OPTIONS]

  --model DIR|FILE     config.json + model.safetensors (or a sharded index), or a .gguf file
  --input-ids FILE     safetensors with input_ids (int64 [B, T]) and, for --generate, generate.prompt
  --out FILE           where to write the results (safetensors)
  --dtype f32|bf16     compute dtype [default: f32]
  --steps N            AdamW steps on the batch (writes loss_curve, adamw_step1.*, adamw_stepN.*) [default: 0]
  --lr X --beta1 X --beta2 X --eps X --weight-decay X
                       AdamW hyperparameters [default: 1e-3 0.9 0.95 1e-8 0.1]
  --generate N         greedy-generate N tokens after generate.prompt (writes generate.output)
  --device D           device: cpu, or tpu (the PJRT backend; KILN_PJRT_PLUGIN picks the plugin) [default: cpu]
  --mode M             mode of the PJRT backend: strict, debug or defer, or compiled (AdamW steps 2..N
                       captured by kiln::compile, capturable AdamW) [default: strict, or KILN_TPU_MODE]
  --mesh SPEC          run on a mesh of PJRT devices, e.g. dp=4, dp=2,tp=2 or ep=4 (KILN_PJRT_CPU_DEVICES
                       sets the number of XLA:CPU devices); needs --device tpu and --parallel
  --parallel R         parallelism recipe on the mesh: ddp, fsdp, tp, fsdp+tp, or for a mixture of
                       experts ep (experts split over the mesh's ep axis) or fsdp+ep (on dp=N,ep=M), or
                       pp: pipeline stages, one rank per device of --mesh pp=N or of --stage-devices;
                       pp+ddp, pp+fsdp, pp+tp or pp+fsdp+tp: each rank's stages split over its own
                       mesh (--mesh pp=2,dp=2,tp=2: rank r on devices 4r..4r+3)
  --lora DIR           a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) on
                       the model: only the adapter trains, and grad.* / adamw_step*.* carry the names of
                       adapter_model.safetensors (base_model.model.<module>.lora_A.weight)
  --capacity-factor F  with ep or fsdp+ep: GShard's capacity factor (each device sends each expert
                       device at most F/devices of its routing slots, the rest dropped) [default: dropless]
  --mesh cp=N          context parallelism: every sequence split over N PJRT devices (TorchTitan's
                       load-balanced order), attention as ring attention; the parameters replicated
  --stage-devices L    the pipeline's ranks' devices, e.g. cpu,tpu:0 (stages on different backends)
  --schedule S         the pipeline's schedule: gpipe, 1f1b or interleaved [default: 1f1b]
  --microbatches N     microbatches per pipeline step (must divide the batch) [default: the batch size]
  --stages-per-rank V  stages per rank of the interleaved schedule [default: 2]
  --precision P        f32, or bf16-mixed / f16-mixed: the forward under autocast, parameters, gradients
                       and AdamW state float32 (with --dtype f32) [default: f32]
  --quantized Q        a quantized checkpoint (FP8, MXFP4, NVFP4): dequant (exactly, in float32), dequant-bf16
                       (rounded to bf16 first, as compressed-tensors decompresses) or keep (codes and scales
                       resident, a dequantizing matmul; those weights get no gradient) [default: dequant]
  --weights-only       a checkpoint that quantizes activations too (W8A8, W4A4) runs its quantized weights
                       on float activations (not transformers' forward for it; refused without this flag)
";

struct Args {
    model: PathBuf,
    input: PathBuf,
    out: PathBuf,
    dtype: DType,
    steps: usize,
    adamw: AdamWConfig,
    generate: Option<usize>,
    device: Device,
    /// AdamW steps 2..N run as one program captured by kiln::compile.
    compiled: bool,
    /// The mesh and the recipe (`--mesh`, `--parallel`).
    parallel: Option<(kiln::DeviceMesh, Recipe)>,
    /// `--parallel pp`: the pipeline's plan (the microbatches 0 until the batch is read).
    pipeline: Option<PipelinePlan>,
    /// `--mesh cp=N`: sequences split over N devices, ring attention (load-balanced order).
    context: Option<ContextParallel>,
    quantized: QuantizedLoad,
    /// `--capacity-factor`: GShard's capacity factor for expert parallelism.
    capacity_factor: Option<f64>,
    /// `--lora`: a PEFT adapter directory to load and train.
    lora: Option<PathBuf>,
    weights_only: bool,
    precision: Option<MixedPrecisionPolicy>,
}

fn fail(msg: &str) -> ! {
    eprintln!("hf_check: {msg}\n\n{USAGE}");
    std::process::exit(2)
}

fn parse_args() -> Args {
    let mut model = None;
    let mut input = None;
    let mut out = None;
    let mut dtype = DType::F32;
    let mut steps = 0;
    let mut adamw = AdamWConfig { lr: 1e-3, betas: (0.9, 0.95), eps: 1e-8, weight_decay: 0.1, amsgrad: false };
    let mut gen = None;
    let mut device = Device::Cpu;
    let mut mode = None;
    let mut compiled = false;
    let mut mesh_spec: Option<String> = None;
    let mut recipe = None;
    let mut pipelined = false;
    let mut recipe_is_cp = false;
    let mut stage_recipe = None;
    let mut quantized = QuantizedLoad::Dequantize { round_to: None };
    let mut weights_only = false;
    let mut capacity_factor = None;
    let mut lora = None;
    let mut precision = None;
    let mut stage_devices: Option<Vec<Device>> = None;
    let mut schedule = ScheduleKind::OneFOneB;
    let mut microbatches = 0;
    let mut stages_per_rank = None;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--help" || flag == "-h" {
            print!("{USAGE}");
            std::process::exit(0);
        }
        if flag == "--weights-only" {
            weights_only = true;
            continue;
        }
        let value = it.next().unwrap_or_else(|| fail(&format!("{flag} needs a value")));
        let num = |v: &str| v.parse::<f64>().unwrap_or_else(|_| fail(&format!("{flag}: {v:?} is not a number")));
        let int = |v: &str| v.parse::<usize>().unwrap_or_else(|_| fail(&format!("{flag}: {v:?} is not a count")));
        match flag.as_str() {
            "--model" => model = Some(PathBuf::from(value)),
            "--input-ids" => input = Some(PathBuf::from(value)),
            "--out" => out = Some(PathBuf::from(value)),
            "--dtype" => {
                dtype = match value.as_str() {
                    "f32" | "float32" => DType::F32,
                    "bf16" | "bfloat16" => DType::BF16,
                    v => fail(&format!("--dtype {v}: expected f32 or bf16")),
                }
            }
            "--steps" => steps = int(&value),
            "--lr" => adamw.lr = num(&value),
            "--beta1" => adamw.betas.0 = num(&value),
            "--beta2" => adamw.betas.1 = num(&value),
            "--eps" => adamw.eps = num(&value),
            "--weight-decay" => adamw.weight_decay = num(&value),
            "--generate" => gen = Some(int(&value)),
            "--device" => device = Device::parse(&value).unwrap_or_else(|e| fail(&e.to_string())),
            "--mode" if value == "compiled" => compiled = true,
            "--mode" => {
                mode = Some(
                    kiln::tpu::Mode::parse(&value)
                        .unwrap_or_else(|| fail(&format!("--mode {value}: expected strict, debug, defer or compiled"))),
                )
            }
            "--mesh" => mesh_spec = Some(value),
            "--parallel" if value == "pp" => pipelined = true,
            "--parallel" if value == "cp" => recipe_is_cp = true,
            "--parallel" if value.starts_with("pp+") => {
                pipelined = true;
                stage_recipe = Some(Recipe::parse(&value[3..]).unwrap_or_else(|e| fail(&e.to_string())));
            }
            "--parallel" => recipe = Some(Recipe::parse(&value).unwrap_or_else(|e| fail(&e.to_string()))),
            "--stage-devices" => {
                let devs = value.split(',').map(|d| Device::parse(d.trim()).unwrap_or_else(|e| fail(&e.to_string())));
                stage_devices = Some(devs.collect())
            }
            "--schedule" => schedule = ScheduleKind::parse(&value).unwrap_or_else(|e| fail(&e.to_string())),
            "--microbatches" => microbatches = int(&value),
            "--capacity-factor" => capacity_factor = Some(num(&value)),
            "--lora" => lora = Some(PathBuf::from(value)),
            "--stages-per-rank" => stages_per_rank = Some(int(&value)),
            "--precision" => precision = MixedPrecisionPolicy::parse(&value).unwrap_or_else(|e| fail(&e.to_string())),
            "--quantized" => {
                quantized = match value.as_str() {
                    "dequant" => QuantizedLoad::Dequantize { round_to: None },
                    "dequant-bf16" => QuantizedLoad::Dequantize { round_to: Some(DType::BF16) },
                    "keep" => QuantizedLoad::Keep,
                    v => fail(&format!("--quantized {v}: expected dequant, dequant-bf16 or keep")),
                }
            }
            other => fail(&format!("unknown option {other}")),
        }
    }
    kiln::init_device(device).unwrap_or_else(|e| fail(&e.to_string()));
    if let Some(m) = mode {
        kiln::tpu::set_mode(m);
    }
    let pipeline = pipelined.then(|| {
        let devices = match (&mesh_spec, stage_devices) {
            (Some(spec), None) => pipeline_ranks(spec, stage_recipe.is_some()),
            (None, Some(d)) => d,
            _ => fail("--parallel pp takes --mesh pp=N or --stage-devices LIST"),
        };
        for d in &devices {
            kiln::init_device(*d).unwrap_or_else(|e| fail(&e.to_string()));
        }
        let interleaved = schedule == ScheduleKind::Interleaved1F1B;
        let stages_per_rank = stages_per_rank.unwrap_or(if interleaved { 2 } else { 1 });
        PipelinePlan { kind: schedule, devices, stages_per_rank, microbatches, compiled, recipe: stage_recipe }
    });
    if pipelined {
        mesh_spec = None;
    }
    // `--mesh cp=N` (with `--parallel cp` or alone): context parallelism.
    let context = match (&mesh_spec, recipe_is_cp) {
        (Some(spec), _) if spec.trim().starts_with("cp=") => Some(spec.clone()),
        (_, true) => fail("--parallel cp takes --mesh cp=N"),
        _ => None,
    };
    let context = context.map(|spec| {
        if device.kind() != kiln::DeviceKind::Tpu {
            fail("--mesh cp=N needs --device tpu");
        }
        let mesh = parse_mesh(&spec, kiln::DeviceKind::Tpu).unwrap_or_else(|e| fail(&e.to_string()));
        mesh_spec = None;
        ContextParallel::new(&mesh, "cp", true).unwrap_or_else(|e| fail(&e.to_string()))
    });
    let parallel = match (mesh_spec, recipe) {
        (None, None) => None,
        (Some(spec), Some(r)) => {
            if device.kind() != kiln::DeviceKind::Tpu {
                fail("--mesh needs --device tpu");
            }
            Some((parse_mesh(&spec, kiln::DeviceKind::Tpu).unwrap_or_else(|e| fail(&e.to_string())), r))
        }
        _ => fail("--mesh and --parallel go together"),
    };
    if capacity_factor.is_some() && !matches!(parallel, Some((_, Recipe::Ep | Recipe::FsdpEp))) {
        fail("--capacity-factor applies to expert parallelism: --parallel ep or fsdp+ep");
    }
    if lora.is_some() && (parallel.is_some() || pipeline.is_some() || context.is_some()) {
        fail("--lora runs on one device: adapters under --mesh are not supported by hf_check yet");
    }
    Args {
        model: model.unwrap_or_else(|| fail("--model is required")),
        input: input.unwrap_or_else(|| fail("--input-ids is required")),
        out: out.unwrap_or_else(|| fail("--out is required")),
        dtype,
        steps,
        adamw,
        generate: gen,
        device: parallel.as_ref().map_or(device, |(m, _)| m.device()),
        compiled,
        parallel,
        pipeline,
        context,
        quantized,
        capacity_factor,
        lora,
        weights_only,
        precision,
    }
}

/// The ranks of `--mesh pp=N[,AXIS=SIZE...]`: PJRT devices 0 to N - 1, or
/// with more axes (and a stage recipe) rank r's mesh of those axes over the
/// r-th block of devices (`pp` first, so a block is contiguous).
fn pipeline_ranks(spec: &str, meshes: bool) -> Vec<Device> {
    let mut axes = spec.split(',').map(|a| {
        let (n, v) = a.split_once('=').unwrap_or_else(|| fail(&format!("--mesh {spec}: expected NAME=SIZE,...")));
        let v = v.trim().parse::<usize>().ok().filter(|&v| v > 0);
        (n.trim(), v.unwrap_or_else(|| fail(&format!("--mesh {spec}: {a:?} needs a positive size"))))
    });
    let ranks = match axes.next() {
        Some(("pp", n)) => n,
        _ => fail(&format!("--mesh {spec}: --parallel pp takes a mesh whose first axis is pp, e.g. pp=2,dp=2,tp=2")),
    };
    let (names, shape): (Vec<&str>, Vec<usize>) = axes.unzip();
    match (names.is_empty(), meshes) {
        (true, false) => (0..ranks).map(Device::Tpu).collect(),
        (false, true) => {
            let k: usize = shape.iter().product();
            (0..ranks)
                .map(|r| {
                    let devices: Vec<usize> = (r * k..(r + 1) * k).collect();
                    let mesh = kiln::DeviceMesh::new(kiln::DeviceKind::Tpu, &devices, &shape, &names)
                        .unwrap_or_else(|e| fail(&e.to_string()));
                    mesh.device()
                })
                .collect()
        }
        (true, true) => fail(&format!("--mesh {spec}: a stage recipe (pp+...) needs mesh axes besides pp")),
        (false, false) => {
            fail(&format!("--mesh {spec}: axes besides pp need a stage recipe, e.g. --parallel pp+fsdp+tp"))
        }
    }
}

/// The PJRT backend's counters when `device` is a PJRT device.
fn pjrt_stats(device: Device) -> Option<kiln::tpu::Stats> {
    (device.kind() == kiln::DeviceKind::Tpu).then(|| kiln::tpu::stats().ok()).flatten()
}

/// The fewest bytes a training step must exchange under expert parallelism
/// for this batch's routing: every routing slot whose expert lives on
/// another device along `ep` than its token sends its row there and gets the
/// result back (forward), and the backward pass sends both gradients the
/// other way: four rows of `hidden` elements per remote slot.
fn least_exchange(model: &LlamaForCausalLM, ids: &Tensor, mesh: &kiln::DeviceMesh) -> Result<u64> {
    let _g = kiln::autograd::no_grad();
    let (_, router) = model.forward_with_router_logits(ids, None)?;
    let cfg = model.config();
    let k = cfg.moe.as_ref().map_or(1, |m| m.num_experts_per_tok);
    let root = mesh.root();
    let axis = root.axis_names().iter().position(|a| *a == "ep").unwrap_or(0);
    let p = root.axis_size("ep")?;
    let devices = root.devices().len();
    let row = (cfg.hidden_size * model.dtype().size_in_bytes()) as u64;
    let mut remote = 0u64;
    for logits in &router {
        let (n, e) = (logits.shape()[0], logits.shape()[1]);
        let (_, idx) = logits.to_device(Device::Cpu)?.topk(k, -1, true, true)?;
        // Tokens are split evenly (the last block padded) over every device in mesh order.
        let block = n.div_ceil(devices).max(1);
        for (slot, &expert) in idx.to_vec::<i64>()?.iter().enumerate() {
            let home = root.coordinates((slot / k) / block)[axis];
            remote += u64::from(expert as usize / (e / p) != home);
        }
    }
    Ok(4 * remote * row)
}

/// A float32 CPU copy (never a view of the live tensor: parameters change in place).
fn f32_cpu(t: &Tensor) -> Result<Tensor> {
    t.detach().to_dtype(DType::F32)?.to_device(Device::Cpu)?.deep_clone()
}

fn main() {
    logging::init();
    if let Err(e) = run(parse_args()) {
        eprintln!("hf_check: {e}");
        std::process::exit(1);
    }
}

fn run(a: Args) -> Result<()> {
    let t0 = Instant::now();
    let opts = PretrainedOptions::new(a.dtype, a.device).with_quantized(a.quantized).with_weights_only(a.weights_only);
    let gguf = a.model.is_file() && a.model.extension().is_some_and(|e| e == "gguf");
    let mut model = if gguf {
        // llama.cpp's format: dequantized exactly into --dtype, or with
        // --quantized keep its integer-typed matrices kept packed.
        LlamaForCausalLM::from_gguf_with(&a.model, &opts)?
    } else {
        LlamaForCausalLM::from_pretrained_with(&a.model, &opts)?
    };
    model.set_mixed_precision(a.precision)?;
    if let Some(dir) = &a.lora {
        let c = load_adapter(&mut model, dir, true)?;
        let n: usize = model.named_trainable_parameters().iter().map(|(_, t)| t.numel()).sum();
        eprintln!("LoRA adapter {} (r {}, alpha {}): {n} trainable parameters", dir.display(), c.r, c.lora_alpha);
    }
    // The names the outputs carry: PEFT's for an adapter's parameters.
    let peft = a.lora.is_some();
    let out_name = move |n: String| if peft { format!("{PEFT_PREFIX}{n}") } else { n };
    if let Some((mesh, recipe)) = &a.parallel {
        recipe.apply(&mut model, mesh)?;
        if a.capacity_factor.is_some() {
            model.set_expert_capacity_factor(a.capacity_factor)?;
        }
        eprintln!("parallel: {recipe:?} on {mesh}");
        for (n, p) in model.named_parameters().iter().take(4) {
            let placements: Vec<String> = p.placements()?.iter().map(|x| x.to_string()).collect();
            eprintln!("  {n}: {:?} on {} as [{}]", p.shape(), p.device_mesh()?, placements.join(", "));
        }
    }
    let cfg = model.config();
    eprintln!(
        "loaded {} ({} layers, hidden {}, {} parameters) as {} on {} in {:.2}s",
        a.model.display(),
        cfg.num_hidden_layers,
        cfg.hidden_size,
        model.num_parameters(),
        a.dtype,
        a.device,
        t0.elapsed().as_secs_f64()
    );
    let input = load_safetensors(&a.input)?;
    let get = |k: &str| -> Result<Tensor> {
        let t = input
            .get(k)
            .ok_or_else(|| Error::invalid("hf_check", format!("{} has no tensor {k:?}", a.input.display())))?;
        if t.ndim() != 2 || !t.dtype().is_int() {
            return Err(Error::invalid(
                "hf_check",
                format!("{k} must be an integer [B, T] tensor, got {:?} {}", t.shape(), t.dtype()),
            ));
        }
        let t = t.to_dtype(DType::I64)?;
        match &a.parallel {
            Some((mesh, recipe)) => recipe.place_batch(&t, mesh),
            None => t.to_device(a.device),
        }
    };
    let ids = get("input_ids")?;
    let mut out: BTreeMap<String, Tensor> = BTreeMap::new();

    if let Some(n) = a.generate {
        let prompt = get("generate.prompt")?;
        let t = Instant::now();
        let g = generate(&model, &prompt, n, &Sampling::greedy())?;
        eprintln!("generated {n} tokens for {} rows in {:.2}s", prompt.shape()[0], t.elapsed().as_secs_f64());
        out.insert("generate.output".into(), g.to_device(Device::Cpu)?);
    }

    if let Some(cp) = &a.context {
        run_context_parallel(&a, cp, model, &input_ids_of(&a)?, &mut out)?;
        save_safetensors(&a.out, &out, None)?;
        eprintln!("wrote {} tensors to {} ({:.2}s in all)", out.len(), a.out.display(), t0.elapsed().as_secs_f64());
        return Ok(());
    }
    if let Some(plan) = &a.pipeline {
        run_pipeline(&a, plan, &model, &ids, &mut out)?;
        save_safetensors(&a.out, &out, None)?;
        eprintln!("wrote {} tensors to {} ({:.2}s in all)", out.len(), a.out.display(), t0.elapsed().as_secs_f64());
        return Ok(());
    }

    // transformers' loss with labels = input_ids: for a mixture-of-experts
    // model with output_router_logits, the router's load-balancing loss too.
    let loss_of = |m: &LlamaForCausalLM| -> Result<(Tensor, Tensor)> {
        let (loss, logits) = m.training_loss(&ids, None)?;
        Ok((logits, loss))
    };
    let t = Instant::now();
    let (logits, loss) = loss_of(&model)?;
    loss.backward()?;
    eprintln!("loss {:.6} (forward + backward {:.2}s)", loss.item_f64()?, t.elapsed().as_secs_f64());
    out.insert("logits".into(), f32_cpu(&logits)?);
    out.insert("loss".into(), f32_cpu(&loss)?.reshape(&[])?);
    let mut grads = BTreeMap::new();
    for (n, p) in model.named_trainable_parameters() {
        let g = p.grad().ok_or_else(|| Error::invalid("hf_check", format!("{n} got no gradient")))?;
        grads.insert(n, g);
    }
    // Stacked experts' gradients under the Hub's per-expert names, as the fixtures hold them.
    for (n, g) in to_hub_layout(grads)? {
        out.insert(format!("grad.{}", out_name(n)), f32_cpu(&g)?);
    }

    if a.steps > 0 {
        // The fixture's schedule: the gradient above makes step 1; each later
        // step recomputes it on the same batch; the last loss is measured after.
        let mut opt = AdamW::new(model.named_trainable_parameters(), a.adamw)?;
        if a.compiled {
            opt.set_capturable(true)?;
        }
        let mut curve = vec![loss.item_f64()? as f32];
        opt.step()?;
        let snapshot = |tag: &str, out: &mut BTreeMap<String, Tensor>| -> Result<()> {
            for (n, p) in to_hub_layout(model.named_trainable_parameters().into_iter().collect())? {
                out.insert(format!("{tag}.{}", out_name(n)), f32_cpu(&p)?);
            }
            Ok(())
        };
        snapshot("adamw_step1", &mut out)?;
        let stats0 = pjrt_stats(a.device);
        let t = Instant::now();
        if a.compiled {
            let mut step = kiln::compile(a.device, |_: &[Tensor]| {
                opt.zero_grad();
                let (_, l) = loss_of(&model)?;
                l.backward()?;
                opt.step()?;
                Ok(vec![l])
            });
            for _ in 1..a.steps {
                let l = step.call(&[])?;
                curve.push(l[0].item_f64()? as f32);
            }
            let s = step.stats();
            eprintln!(
                "kiln::compile: {} calls, {} traced, {} replayed, {} retraces, {} traced for host values",
                s.calls, s.traces, s.replays, s.retraces, s.host_value_traces
            );
        } else {
            for _ in 1..a.steps {
                opt.zero_grad();
                let (_, l) = loss_of(&model)?;
                l.backward()?;
                opt.step()?;
                curve.push(l.item_f64()? as f32);
            }
        }
        if a.steps > 1 {
            let per = t.elapsed().as_secs_f64() / (a.steps - 1) as f64;
            eprintln!("training step (forward, backward, AdamW, loss read) {:.2} ms on {}", per * 1e3, a.device);
            if let (Some(s0), Some(s1)) = (stats0, pjrt_stats(a.device)) {
                let (runs, compiles) = (s1.executions - s0.executions, s1.compiles - s0.compiles);
                let lookups = (s1.hits + s1.compiles) - (s0.hits + s0.compiles);
                eprintln!(
                    "PJRT executable cache over steps 2..{}: {runs} programs run, {compiles} compiled, hit rate {:.2}% ({} compiles in all)",
                    a.steps,
                    100.0 * (lookups - compiles) as f64 / lookups.max(1) as f64,
                    s1.compiles
                );
                if let Some((mesh, Recipe::Ep | Recipe::FsdpEp)) = &a.parallel {
                    let sent = (s1.all_to_all_bytes - s0.all_to_all_bytes) / (a.steps - 1) as u64;
                    let least = least_exchange(&model, &ids, mesh)?;
                    eprintln!(
                        "all_to_all per training step: {sent} bytes sent between devices; the routing's minimum {least} bytes ({:.2}x)",
                        sent as f64 / least.max(1) as f64
                    );
                }
            }
        }
        {
            let _g = kiln::autograd::no_grad();
            curve.push(loss_of(&model)?.1.item_f64()? as f32);
        }
        if a.steps > 1 {
            snapshot(&format!("adamw_step{}", a.steps), &mut out)?;
        }
        eprintln!("loss curve: {curve:?}");
        let n = curve.len();
        out.insert("loss_curve".into(), Tensor::from_vec(curve, &[n])?);
    }

    save_safetensors(&a.out, &out, None)?;
    eprintln!("wrote {} tensors to {} ({:.2}s in all)", out.len(), a.out.display(), t0.elapsed().as_secs_f64());
    Ok(())
}

/// `--parallel pp`: the logits, the loss and every gradient of one pipelined
/// step, and with `--steps` the AdamW steps (one optimizer per stage), as
/// the unpipelined run writes them.
fn run_pipeline(
    a: &Args,
    plan: &PipelinePlan,
    model: &LlamaForCausalLM,
    ids: &Tensor,
    out: &mut BTreeMap<String, Tensor>,
) -> Result<()> {
    let mut plan = plan.clone();
    if plan.microbatches == 0 {
        plan.microbatches = ids.shape()[0];
    }
    let loss_fn: LossFn = std::sync::Arc::new(|logits: &Tensor, ids: &Tensor| causal_lm_loss(logits, ids, Some(-100)));
    let mut p = model.pipeline(&plan, loss_fn)?;
    eprintln!(
        "pipeline: {:?}, {} stages on {:?}, {} microbatches{}",
        plan.kind,
        p.stages().len(),
        plan.devices,
        plan.microbatches,
        if plan.compiled { ", each stage captured" } else { "" }
    );
    for s in p.stages() {
        let names: Vec<String> = s.module().named_parameters().into_iter().map(|(n, _)| n).collect();
        let (first, last) = (names.first().cloned().unwrap_or_default(), names.last().cloned().unwrap_or_default());
        eprintln!("  stage {} on {}: {} parameters, {first} .. {last}", s.stage_index(), s.device(), names.len());
    }
    let mean =
        |ls: &[Tensor]| -> Result<f64> { Ok(ls.iter().map(|l| l.item_f64()).sum::<Result<f64>>()? / ls.len() as f64) };
    let t = Instant::now();
    out.insert("logits".into(), f32_cpu(&p.forward(ids)?)?);
    let loss = mean(&p.step(ids, ids)?)?;
    eprintln!(
        "loss {loss:.6} (pipelined forward + backward {:.2}s, {} bytes between stages)",
        t.elapsed().as_secs_f64(),
        p.bytes_sent()
    );
    out.insert("loss".into(), Tensor::scalar(loss as f32, DType::F32)?);
    let grads = p
        .named_parameters()
        .into_iter()
        .map(|(n, t)| {
            Ok((n.clone(), t.grad().ok_or_else(|| Error::invalid("hf_check", format!("{n} got no gradient")))?))
        })
        .collect::<Result<BTreeMap<_, _>>>()?;
    for (n, g) in to_hub_layout(grads)? {
        out.insert(format!("grad.{n}"), f32_cpu(&g)?);
    }
    if a.steps == 0 {
        return Ok(());
    }
    let mut opts: Vec<AdamW> =
        p.stages().iter().map(|s| AdamW::new(s.module().named_parameters(), a.adamw)).collect::<Result<_>>()?;
    let snapshot = |p: &PipelineSchedule, tag: &str, out: &mut BTreeMap<String, Tensor>| -> Result<()> {
        for (n, t) in to_hub_layout(p.named_parameters().into_iter().collect())? {
            out.insert(format!("{tag}.{n}"), f32_cpu(&t)?);
        }
        Ok(())
    };
    let mut curve = vec![loss as f32];
    opts.iter_mut().try_for_each(|o| o.step())?;
    snapshot(&p, "adamw_step1", out)?;
    let t = Instant::now();
    for _ in 1..a.steps {
        opts.iter_mut().for_each(|o| o.zero_grad());
        curve.push(mean(&p.step(ids, ids)?)? as f32);
        opts.iter_mut().try_for_each(|o| o.step())?;
    }
    if a.steps > 1 {
        let per = t.elapsed().as_secs_f64() / (a.steps - 1) as f64;
        eprintln!("pipelined training step (forward, backward, AdamW, loss read) {:.2} ms", per * 1e3);
        snapshot(&p, &format!("adamw_step{}", a.steps), out)?;
    }
    let logits = p.forward(ids)?;
    curve.push(causal_lm_loss(&logits, &ids.to_device(logits.device())?, Some(-100))?.item_f64()? as f32);
    for s in p.stages() {
        if let Some((f, b)) = s.capture_stats() {
            eprintln!(
                "  stage {} programs: forward {} traced / {} replayed, backward {} traced / {} replayed",
                s.stage_index(),
                f.traces,
                f.replays,
                b.traces,
                b.replays
            );
        }
    }
    eprintln!("loss curve: {curve:?}");
    let n = curve.len();
    out.insert("loss_curve".into(), Tensor::from_vec(curve, &[n])?);
    Ok(())
}

/// The batch's token ids on the host (`--mesh cp=N` splits them itself).
fn input_ids_of(a: &Args) -> Result<Tensor> {
    let input = load_safetensors(&a.input)?;
    let t = input
        .get("input_ids")
        .ok_or_else(|| Error::invalid("hf_check", format!("{} has no tensor \"input_ids\"", a.input.display())))?;
    t.to_dtype(DType::I64)
}

/// `--mesh cp=N`: logits, loss and gradients of the batch with every sequence
/// split over the cp devices, and with `--steps` the AdamW steps (captured
/// by `kiln::compile` with `--mode compiled`).
fn run_context_parallel(
    a: &Args,
    cp: &ContextParallel,
    mut model: LlamaForCausalLM,
    ids: &Tensor,
    out: &mut BTreeMap<String, Tensor>,
) -> Result<()> {
    model.to_device(Device::Cpu)?;
    replicate(&mut model, cp.mesh())?;
    model.set_context_parallel(Some(cp.clone()));
    eprintln!("context parallel: every sequence split over {} (load-balanced order), ring attention", cp.mesh());
    let x = cp.shard_sequence(ids)?;
    let t = Instant::now();
    let logits = model.forward(&x, None)?;
    let loss = cp.causal_lm_loss(&logits, ids)?;
    loss.backward()?;
    eprintln!("loss {:.6} (forward + backward {:.2}s)", loss.item_f64()?, t.elapsed().as_secs_f64());
    out.insert("logits".into(), f32_cpu(&cp.unshard_sequence(&logits)?)?);
    out.insert("loss".into(), f32_cpu(&loss)?.reshape(&[])?);
    let grads = model
        .named_parameters()
        .into_iter()
        .map(|(n, p)| {
            Ok((n.clone(), p.grad().ok_or_else(|| Error::invalid("hf_check", format!("{n} got no gradient")))?))
        })
        .collect::<Result<BTreeMap<_, _>>>()?;
    for (n, g) in to_hub_layout(grads)? {
        out.insert(format!("grad.{n}"), f32_cpu(&g)?);
    }
    if a.steps == 0 {
        return Ok(());
    }
    let mut opt = AdamW::new(model.named_parameters(), a.adamw)?;
    opt.set_capturable(a.compiled)?;
    let mut curve = vec![loss.item_f64()? as f32];
    opt.step()?;
    let snapshot = |m: &LlamaForCausalLM, tag: &str, out: &mut BTreeMap<String, Tensor>| -> Result<()> {
        for (n, p) in to_hub_layout(m.named_parameters().into_iter().collect())? {
            out.insert(format!("{tag}.{n}"), f32_cpu(&p)?);
        }
        Ok(())
    };
    snapshot(&model, "adamw_step1", out)?;
    let step = |opt: &mut AdamW| -> Result<Tensor> {
        opt.zero_grad();
        let l = cp.causal_lm_loss(&model.forward(&x, None)?, ids)?;
        l.backward()?;
        opt.step()?;
        Ok(l)
    };
    let t = Instant::now();
    if a.compiled {
        let mut c = kiln::compile(cp.mesh().device(), |_: &[Tensor]| Ok(vec![step(&mut opt)?]));
        for _ in 1..a.steps {
            curve.push(c.call(&[])?[0].item_f64()? as f32);
        }
        let s = c.stats();
        eprintln!(
            "kiln::compile: {} calls, {} traced, {} replayed, {} retraces",
            s.calls, s.traces, s.replays, s.retraces
        );
    } else {
        for _ in 1..a.steps {
            curve.push(step(&mut opt)?.item_f64()? as f32);
        }
    }
    if a.steps > 1 {
        let per = t.elapsed().as_secs_f64() / (a.steps - 1) as f64;
        eprintln!("context-parallel training step (forward, backward, AdamW, loss read) {:.2} ms", per * 1e3);
        snapshot(&model, &format!("adamw_step{}", a.steps), out)?;
    }
    curve.push(cp.causal_lm_loss(&model.forward(&x, None)?, ids)?.item_f64()? as f32);
    eprintln!("loss curve: {curve:?}");
    let n = curve.len();
    out.insert("loss_curve".into(), Tensor::from_vec(curve, &[n])?);
    Ok(())
}
