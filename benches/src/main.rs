//! kiln-bench: kiln's benchmarks, printed as one JSON object per line.
//!
//! `kiln-bench matmul --sizes 1024,4096`, `kiln-bench ops`, `kiln-bench train`,
//! `infer`, `decode` and `autograd`; see `--help`. `benches/compare_torch.py`
//! (matmul, ops) and `benches/compare_torch_train.py` (train, infer, decode) run
//! this binary and the same measurements in PyTorch, and print the ratios.
mod finetune;
mod kv_cache;
mod llm;
mod pipeline;
mod report;
mod serve_load;
mod speculative;
mod suites;
mod timing;

use kiln::prelude::*;
use kiln::tensor::quant::Activations;
use std::process::ExitCode;
use suites::Config;
use timing::Plan;

const HELP: &str = "\
kiln-bench: kiln benchmarks; one JSON object per line on stdout

USAGE:
    kiln-bench matmul [--sizes N,N,...] [--dtype D] [--linear] [options]
    kiln-bench ops    [--dim D] [--only NAME,...] [options]
    kiln-bench all    [options]           (matmul, then ops)
    kiln-bench chain  [--dim D] --device tpu
    kiln-bench serve  [--device DEV]      (timed calls on request, see below)
    kiln-bench train  [--preset P] [--batch B] [--seq T] [--steps N] [--warmup W]
    kiln-bench infer  [--preset P] [--batch B] [--seq T] [--steps N] [--warmup W]
    kiln-bench decode [--preset P] [--prompt P] [--new-tokens N] [--steps N] [--warmup W] [--weights W]
                      [--activations A]
    kiln-bench autograd [--steps N] [--warmup W]
    kiln-bench pipeline [--preset P] [--ranks N] [--microbatches M] [--batch B] [--seq T] [--mode compiled]
    kiln-bench serve-load [--preset P] [--requests N] [--gap-ms G] [--seed S] [--kv-mb M] [--only LIST] [--repeat R]
    kiln-bench kv-cache --checkpoint DIR [--checkpoint DIR ...] [--new-tokens N] [--seed S]
    kiln-bench spec-decode --checkpoint DIR [--draft DIR] --data FILE [--requests N] [--prompt P]
                      [--new-tokens N] [--k K] [--seed S]

BENCHMARKS:
    matmul   square n x n x n float32 matmul of random matrices: gflops (2 n^3 / median time)
    ops      on D*D float32 elements (default D = 4096, 16M elements), GB/s = bytes / median time:
               add, mul            two flat tensors          bytes = 3 x 4 x N
               exp                 one flat tensor           bytes = 2 x 4 x N
               add_transposed      a.t() + b, [D, D]         bytes = 3 x 4 x N
               add_broadcast       [D, D] + [D]              bytes = 4 x (2 N + D)
               to_bf16, to_f32     flat f32 -> bf16, back    bytes = 6 x N
               sum, max            all elements -> 0-d       bytes = 4 x N
               sum_dim             [D, D] over the last dim  bytes = 4 x (N + D)
               softmax             [D, D] over the last dim  bytes = 2 x 4 x N
             and add_latency: us_per_op of `add` on two 1-element tensors
             (median over runs of 1000 ops each)
    serve    reads requests from stdin, one per line, and answers each with one line:
               matmul N [C]    {\"bench\": \"matmul\", \"n\": N, \"secs\": [S, ...]}
               op NAME D [C]   {\"bench\": NAME, \"d\": D, \"secs\": [S, ...]} (an `ops`
                               benchmark; add_latency: seconds per add)
             the seconds of each of C (default 1) back-to-back calls (inputs made on a
             size's first request); for drivers that alternate kiln and another library
             a few calls at a time (compare_torch.py)
    chain    ten elementwise ops on D*D float32 elements on a PJRT device, timed in Strict
             mode (ten programs) and in DeferAndFuse mode (one fused program) in the same run;
             chain_ratio gives defer_speedup_over_strict
    train    one training step of a randomly initialised Llama on random tokens: zero_grad,
             forward, next-token cross entropy, backward, AdamW (lr 1e-3, betas (0.9, 0.95),
             weight decay 0.1), reading the loss; tokens_per_s = B x T / median step
    infer    the forward pass (logits at every position, no grad): tokens_per_s = B x T / median
    decode   batch 1, greedy decoding with the KV cache after an untimed prefill of a random
             prompt: tokens_per_s = new tokens / median decoding time
    autograd 4 x ([512, 1024] @ [1024, 1024] + gelu), summed: forward and forward+backward
             times and backward_forward_ratio = (forward+backward - forward) / forward
    pipeline the preset trained by each pipeline schedule (gpipe, 1f1b, interleaved with 2 stages
             per rank) over N ranks (--device tpu: tpu:0..N, default 4; cpu: all on the CPU) with
             M microbatches (default 8): median_step_ms; bubble_theory ((p-1)/(m+p-1), and
             (p-1)/(vm+p-1) interleaved), bubble_schedule_uniform_costs (the order's timeline,
             backward twice a forward) and bubble_schedule_measured_costs (the same timeline with
             each action's time from one step where every action runs alone: devices sharing
             the machine's cores cannot overlap for real); bytes_between_stages against
             bytes_minimum (each boundary's activations and their gradients);
             peak_microbatches_held_per_rank
    serve-load the serving engine (continuous batching, paged KV cache) under N requests (default
             64) of 16-512 prompt and 16-256 new tokens arriving as a Poisson stream (mean gap
             G ms, default 50), against the same requests through generate() one at a time;
             then a workload whose prompts share a 256-token system prompt, with and without
             prefix sharing; and (adapters) the plain workload with four rank-16 LoRA adapters
             on every decoder Linear served beside the base model, each of the five taking every
             fifth request (lora_adapters_vs_base). Lines: tokens_per_s, ttft_p50_ms,
             ttft_p99_ms; --only engine,sequential,shared,adapters,structured,kv-bf16,kv-fp8 (the
             plain workload over a bfloat16 or float8 KV cache); each system runs R times (default 3) in turns with the
             others, and its run of median tokens/s is reported; --write-workload FILE
             saves the requests for benches/compare_serve_load.py (transformers'
             continuous batching on them)
             Presets: llama-16m (vocab 8192, hidden 384, 6 layers, 6 heads, MLP 1024, untied
             lm_head, f32; the default) and llama-tiny. Each line has peak_rss_mb.
    kv-cache each checkpoint (in float32, then bfloat16) with a random prompt filling its context
             but N tokens (--new-tokens, default 64), then N greedy tokens over its own dtype's KV
             cache, fed again through each narrower cache (bfloat16, float16, float8 e4m3):
             max_logit_diff_rel (largest logit difference over the largest logit), mean_kl,
             top1_agreement over the decoded positions, bytes_per_token and memory_ratio
    spec-decode  speculative decoding on a byte-level checkpoint: N windows of P bytes of FILE
             continued by --new-tokens tokens, greedy then sampled (temperature 0.8), served
             one at a time and all at once, without speculation, with prompt lookup (k = --k,
             default 4) and with the --draft checkpoint: tokens_per_s, speedup,
             acceptance_rate, tokens_per_verifying_step

OPTIONS:
    --device DEV       cpu (default), tpu, tpu:N
    --mode MODE        the PJRT backend's mode (--device tpu): strict (default), debug, defer;
                       or compiled (train and decode on any device: the whole step captured by
                       kiln::compile, capturable AdamW; decode captures the paged step the serving
                       engine runs); a mode the device or benchmark cannot honour is an error.
                       Model lines name the mode they ran in (eager on the CPU)
    --sizes LIST       matmul sizes (default 1024,4096): N (N x N x N) or MxKxN ([M, K] @ [K, N])
    --dtype D          matmul element type: float32 (default), bfloat16, float16, float64
    --linear           matmul: b is a [N, K] weight transposed (a Linear's x @ W.T), not [K, N]
    --dim D            side of the [D, D] tensors of `ops` (default 4096)
    --only LIST        run only the ops whose names contain one of these words
    --target-secs S    time the timed runs of one benchmark take (default 2 for ops, 3 for matmul)
    --min-runs N       fewest timed runs (default 3)
    --max-runs N       most timed runs (default 1000)
    --preset P         model of train/infer/decode (default llama-16m): llama-16m, qwen3-moe-16m,
                       llama-tiny, or qwen3-0.6b (Qwen3-0.6B's shapes, random weights: weights many
                       times the L3, for memory-bound decoding)
    --batch B, --seq T batch and sequence length of train/infer (default 8 and 256)
    --steps N          timed steps of train/infer/decode/autograd (default 8; decode 3)
    --warmup W         untimed steps before them (default 2; decode 1)
    --prompt P         decode: prompt length (default 64)
    --new-tokens N     decode: tokens generated (default 64)
    --precision P      train: f32 (default), or bf16-mixed / f16-mixed (autocast forward, float32
                       master weights, gradients and AdamW state)
    --finetune F       train: full (default), lora (adapters of rank --lora-r, alpha 2r, on every
                       decoder Linear; the rest frozen) or qlora (the same over decoder weights kept
                       quantized as --qlora-scheme, default nvfp4); the line adds trainable_params,
                       optimizer_state_mb, weights_mb and rss_mb (resident after the steps)
    --lora-r R         train --finetune lora|qlora: the adapters' rank (default 16)
    --qlora-scheme S   train --finetune qlora: nvfp4 (default), mxfp4, fp8, fp8-channel, q8_0, q4_0
    --weights W        decode: the decoder Linear weights as f32 (default), bf16 (the whole model in
                       bf16), or kept quantized: fp8 (128x128 blocks), fp8-channel, nvfp4, mxfp4,
                       q8_0, q4_0
                       (activations f32), and with a `+head` suffix (nvfp4+head) the LM head too,
                       as llama.cpp's quantized files have it; q8_0 / q4_0 are GGUF's formats;
                       gguf:PATH decodes a GGUF file's model (Q8_0 / Q4_0 kept packed, the
                       preset ignored); the line has weight_bytes_per_param
    --activations A    decode with kept-quantized weights: exact (default: the input as it is) or
                       int8 (each input row rounded to int8 per 32 elements first, llama.cpp's
                       way, so integer codes multiply as integers); the line names it
    -h, --help         this text

METHOD:
    Each benchmark calls the op once untimed, warms up (0.2 s, at most 10 calls),
    picks runs = clamp(target / warm-up median, min, max), and reports the median
    (and min) of the timed runs. A call is the whole out-of-place op: output
    allocation and release included, then a device synchronize.
    A benchmark that fails prints {\"bench\": ..., \"error\": ...}; the exit code is 1.

EXAMPLES:
    cargo run --release -p kiln-bench -- matmul --sizes 1024,4096 --device cpu
    cargo run --release -p kiln-bench -- ops --only add,softmax
    cargo run --release -p kiln-bench -- train --preset llama-16m --batch 8 --seq 256 --steps 8 --device cpu
";

struct Args {
    cmd: String,
    device: Device,
    mode: Option<kiln::tpu::Mode>,
    compiled: bool,
    sizes: Vec<[usize; 3]>,
    dtype: DType,
    linear: bool,
    dim: usize,
    only: Vec<String>,
    target_s: Option<f64>,
    min_runs: usize,
    max_runs: usize,
    preset: String,
    batch: usize,
    seq: usize,
    steps: Option<usize>,
    warmup: Option<usize>,
    prompt: usize,
    new_tokens: usize,
    weights: String,
    activations: Activations,
    precision: String,
    finetune: String,
    lora_r: usize,
    qlora_scheme: String,
    /// `train --mesh SPEC --parallel R`.
    mesh: Option<String>,
    parallel: Option<String>,
    /// `pipeline`.
    ranks: usize,
    microbatches: usize,
    /// `serve-load`.
    requests: usize,
    gap_ms: f64,
    seed: u64,
    kv_mb: usize,
    /// `kv-cache`: the checkpoints measured; `spec-decode`: the target.
    checkpoints: Vec<std::path::PathBuf>,
    /// `spec-decode`: the draft checkpoint, the text, tokens proposed per step.
    draft: Option<std::path::PathBuf>,
    data: Option<std::path::PathBuf>,
    spec_k: usize,
    write_workload: Option<String>,
    repeat: usize,
}

/// `--sizes`: each entry `N` (a square product) or `MxKxN`.
fn parse_sizes(v: &str) -> std::result::Result<Vec<[usize; 3]>, String> {
    v.split(',')
        .filter(|s| !s.is_empty())
        .map(|s| {
            let d: Vec<usize> = parse_list("--sizes", &s.replace('x', ","))?;
            match d[..] {
                [n] => Ok([n; 3]),
                [m, k, n] => Ok([m, k, n]),
                _ => Err(format!("--sizes: {s:?} is neither N nor MxKxN")),
            }
        })
        .collect()
}

fn parse_list<T: std::str::FromStr>(flag: &str, v: &str) -> std::result::Result<Vec<T>, String> {
    v.split(',')
        .filter(|s| !s.is_empty())
        .map(|s| s.trim().parse::<T>().map_err(|_| format!("{flag}: cannot parse {s:?}")))
        .collect()
}

/// A positive integer flag value.
fn int(flag: &str, v: &str) -> std::result::Result<usize, String> {
    match v.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("{flag} needs a positive integer, got {v:?}")),
    }
}

fn parse_args(argv: &[String]) -> std::result::Result<Option<Args>, String> {
    let mut a = Args {
        cmd: String::new(),
        device: Device::Cpu,
        mode: None,
        compiled: false,
        sizes: vec![[1024; 3], [4096; 3]],
        dtype: DType::F32,
        linear: false,
        dim: 4096,
        only: vec![],
        target_s: None,
        min_runs: 3,
        max_runs: 1000,
        preset: "llama-16m".into(),
        batch: 8,
        seq: 256,
        steps: None,
        warmup: None,
        prompt: 64,
        new_tokens: 64,
        weights: "f32".into(),
        activations: Activations::Exact,
        precision: "f32".into(),
        finetune: "full".into(),
        lora_r: 16,
        qlora_scheme: "nvfp4".into(),
        mesh: None,
        parallel: None,
        requests: 64,
        gap_ms: 50.0,
        seed: 0,
        kv_mb: 1024,
        checkpoints: vec![],
        draft: None,
        data: None,
        spec_k: 4,
        write_workload: None,
        repeat: 3,
        ranks: 4,
        microbatches: 8,
    };
    let mut it = argv.iter();
    while let Some(arg) = it.next() {
        // `--flag=value` and `--flag value` both work.
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) if f.starts_with("--") => (f, Some(v.to_string())),
            _ => (arg.as_str(), None),
        };
        let mut value = || -> std::result::Result<String, String> {
            inline.clone().or_else(|| it.next().cloned()).ok_or_else(|| format!("{flag} needs a value"))
        };
        match flag {
            "-h" | "--help" | "help" => return Ok(None),
            "--device" => a.device = Device::parse(&value()?).map_err(|e| e.to_string())?,
            "--mode" => {
                let v = value()?;
                if v == "compiled" {
                    a.compiled = true;
                } else {
                    a.mode = Some(
                        kiln::tpu::Mode::parse(&v)
                            .ok_or(format!("--mode {v}: expected strict, debug, defer or compiled"))?,
                    )
                }
            }
            "--sizes" => a.sizes = parse_sizes(&value()?)?,
            "--linear" => a.linear = true,
            "--dtype" => {
                let v = value()?;
                a.dtype = DType::from_name(&v)
                    .ok_or(format!("--dtype {v}: expected float32, bfloat16, float16 or float64"))?
            }
            "--dim" => a.dim = value()?.parse().map_err(|_| "--dim needs an integer".to_string())?,
            "--only" => a.only = parse_list("--only", &value()?)?,
            "--target-secs" => {
                a.target_s = Some(value()?.parse().map_err(|_| "--target-secs needs a number".to_string())?)
            }
            "--min-runs" => a.min_runs = value()?.parse().map_err(|_| "--min-runs needs an integer".to_string())?,
            "--max-runs" => a.max_runs = value()?.parse().map_err(|_| "--max-runs needs an integer".to_string())?,
            "--preset" => a.preset = value()?,
            "--batch" => a.batch = int("--batch", &value()?)?,
            "--seq" => a.seq = int("--seq", &value()?)?,
            "--steps" => a.steps = Some(int("--steps", &value()?)?),
            "--warmup" => a.warmup = Some(value()?.parse().map_err(|_| "--warmup needs an integer".to_string())?),
            "--prompt" => a.prompt = int("--prompt", &value()?)?,
            "--new-tokens" => a.new_tokens = int("--new-tokens", &value()?)?,
            "--weights" => a.weights = value()?,
            "--activations" => {
                a.activations = match value()?.as_str() {
                    "exact" => Activations::Exact,
                    "int8" => Activations::Int8,
                    v => return Err(format!("--activations: exact or int8, got {v:?}")),
                }
            }
            "--precision" => a.precision = value()?,
            "--finetune" => a.finetune = value()?,
            "--lora-r" => a.lora_r = value()?.parse().map_err(|_| "--lora-r needs a count".to_string())?,
            "--qlora-scheme" => a.qlora_scheme = value()?,
            "--mesh" => a.mesh = Some(value()?),
            "--parallel" => a.parallel = Some(value()?),
            "--requests" => a.requests = int("--requests", &value()?)?,
            "--gap-ms" => a.gap_ms = value()?.parse().map_err(|_| "--gap-ms needs a number".to_string())?,
            "--seed" => a.seed = value()?.parse().map_err(|_| "--seed needs an integer".to_string())?,
            "--kv-mb" => a.kv_mb = int("--kv-mb", &value()?)?,
            "--checkpoint" => a.checkpoints.push(value()?.into()),
            "--draft" => a.draft = Some(value()?.into()),
            "--data" => a.data = Some(value()?.into()),
            "--k" => a.spec_k = int("--k", &value()?)?,
            "--write-workload" => a.write_workload = Some(value()?),
            "--repeat" => a.repeat = int("--repeat", &value()?)?,
            "--ranks" => a.ranks = int("--ranks", &value()?)?,
            "--microbatches" => a.microbatches = int("--microbatches", &value()?)?,
            c if !c.starts_with('-') && a.cmd.is_empty() => a.cmd = c.to_string(),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if a.cmd.is_empty() {
        return Err(
            "missing benchmark name (matmul, ops, all, chain, serve, serve-load, kv-cache, spec-decode, train, infer, decode, autograd or pipeline)"
                .into(),
        );
    }
    if a.dim == 0 || a.sizes.iter().flatten().any(|&d| d == 0) {
        return Err("sizes must be positive".into());
    }
    // A mode the device or the benchmark cannot honour is an error, never ignored.
    if let (Some(m), false) = (a.mode, matches!(a.device, Device::Tpu(_))) {
        return Err(format!(
            "--mode {}: strict, debug and defer are the PJRT backend's modes (--device tpu); on {} ops run one by one (eager) unless --mode compiled",
            m.name(),
            a.device
        ));
    }
    if a.activations != Activations::Exact && a.cmd != "decode" {
        return Err(format!("--activations: only decode takes it, not {}", a.cmd));
    }
    if a.compiled && !matches!(a.cmd.as_str(), "train" | "decode" | "pipeline") {
        return Err(format!(
            "--mode compiled: {} runs eagerly (train and decode capture their step with kiln::compile)",
            a.cmd
        ));
    }
    Ok(Some(a))
}

fn main() -> ExitCode {
    kiln::init();
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let args = match parse_args(&argv) {
        Ok(Some(a)) => a,
        Ok(None) => {
            print!("{HELP}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("kiln-bench: {e}\n\n{HELP}");
            return ExitCode::from(2);
        }
    };
    if let Err(e) = kiln::init_device(args.device) {
        eprintln!("kiln-bench: {e}");
        return ExitCode::from(2);
    }
    if let Some(m) = args.mode {
        kiln::tpu::set_mode(m);
    }
    kiln::manual_seed(0);
    let cfg = |default_target: f64| Config {
        device: args.device,
        plan: Plan {
            target_s: args.target_s.unwrap_or(default_target),
            min_runs: args.min_runs,
            max_runs: args.max_runs,
        },
        filter: args.only.clone(),
    };
    let failed = match args.cmd.as_str() {
        "matmul" => suites::matmul(&cfg(3.0), &args.sizes, args.dtype, args.linear),
        "ops" => suites::ops(&cfg(2.0), args.dim),
        "chain" => suites::chain(&cfg(2.0), args.dim),
        "serve" => suites::serve(&cfg(3.0)),
        "serve-load" => {
            let a = serve_load::ServeLoadArgs {
                preset: args.preset.clone(),
                requests: args.requests,
                gap_ms: args.gap_ms,
                seed: args.seed,
                kv_mb: args.kv_mb,
                only: args.only.clone(),
                write_workload: args.write_workload.clone(),
                repeat: args.repeat,
            };
            match serve_load::serve_load(&a) {
                Ok(()) => 0,
                Err(e) => {
                    report::Line::new("serve-load", "float32", "cpu").set("error", e.to_string()).emit();
                    1
                }
            }
        }
        "kv-cache" => {
            let a = kv_cache::KvCacheArgs {
                checkpoints: args.checkpoints.clone(),
                new_tokens: args.new_tokens,
                seed: args.seed,
            };
            match kv_cache::kv_cache(&a) {
                Ok(()) => 0,
                Err(e) => {
                    report::Line::new("kv-cache", "float32", "cpu").set("error", e.to_string()).emit();
                    1
                }
            }
        }
        "spec-decode" => {
            let (Some(target), Some(data)) = (args.checkpoints.first(), &args.data) else {
                eprintln!("kiln-bench: spec-decode needs --checkpoint DIR and --data FILE");
                return ExitCode::from(2);
            };
            let a = speculative::SpecArgs {
                target: target.clone(),
                draft: args.draft.clone(),
                data: data.clone(),
                requests: args.requests,
                prompt: args.prompt,
                new_tokens: args.new_tokens,
                k: args.spec_k,
                seed: args.seed,
            };
            match speculative::spec_decode(&a) {
                Ok(()) => 0,
                Err(e) => {
                    report::Line::new("spec-decode", "float32", "cpu").set("error", e.to_string()).emit();
                    1
                }
            }
        }
        "all" => suites::matmul(&cfg(3.0), &args.sizes, args.dtype, args.linear) + suites::ops(&cfg(2.0), args.dim),
        cmd @ ("train" | "infer" | "decode" | "autograd" | "pipeline") => {
            if let Err(e) = llm::preset(&args.preset) {
                eprintln!("kiln-bench: {e}");
                return ExitCode::from(2);
            }
            let decode = cmd == "decode";
            let a = llm::LlmArgs {
                device: args.device,
                preset: args.preset.clone(),
                batch: args.batch,
                seq: args.seq,
                steps: args.steps.unwrap_or(if decode { 3 } else { 8 }),
                warmup: args.warmup.unwrap_or(if decode { 1 } else { 2 }),
                prompt: args.prompt,
                new_tokens: args.new_tokens,
                weights: args.weights.clone(),
                activations: args.activations,
                precision: args.precision.clone(),
                compiled: args.compiled,
                finetune: match finetune::Finetune::parse(&args.finetune, args.lora_r, &args.qlora_scheme) {
                    Ok(f) => f,
                    Err(e) => {
                        eprintln!("kiln-bench: {e}");
                        return ExitCode::from(2);
                    }
                },
                parallel: match (&args.mesh, &args.parallel) {
                    (Some(m), Some(p)) => Some((m.clone(), p.clone())),
                    (None, None) => None,
                    _ => {
                        eprintln!("kiln-bench: --mesh and --parallel go together");
                        return ExitCode::from(2);
                    }
                },
            };
            if cmd == "pipeline" {
                return match pipeline::pipeline(&a, args.ranks, args.microbatches) {
                    Ok(lines) => {
                        lines.into_iter().for_each(report::Line::emit);
                        ExitCode::SUCCESS
                    }
                    Err(e) => {
                        report::Line::new(cmd, "float32", &args.device.to_string()).set("error", e.to_string()).emit();
                        ExitCode::FAILURE
                    }
                };
            }
            let r = match cmd {
                "train" => llm::train(&a),
                "infer" => llm::infer(&a),
                "decode" => llm::decode(&a),
                _ => llm::autograd(&a),
            };
            match r {
                Ok(line) => {
                    line.emit();
                    0
                }
                Err(e) => {
                    report::Line::new(cmd, "float32", &args.device.to_string()).set("error", e.to_string()).emit();
                    1
                }
            }
        }
        other => {
            eprintln!(
                "kiln-bench: unknown benchmark {other:?} (expected matmul, ops, all, chain, serve, train, infer, decode, autograd or pipeline)\n\n{HELP}"
            );
            return ExitCode::from(2);
        }
    };
    if failed > 0 {
        eprintln!("kiln-bench: {failed} benchmark(s) failed (see the \"error\" lines)");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> std::result::Result<Option<Args>, String> {
        parse_args(&s.split_whitespace().map(String::from).collect::<Vec<_>>())
    }

    #[test]
    fn parses_flags_in_both_forms() {
        let a = args("matmul --sizes 64,128 --device=cpu --target-secs 0.5").unwrap().unwrap();
        assert_eq!(a.cmd, "matmul");
        assert_eq!(a.sizes, vec![[64; 3], [128; 3]]);
        assert_eq!(a.device, Device::Cpu);
        assert_eq!(a.target_s, Some(0.5));
        assert!(args("--help").unwrap().is_none());
        assert!(args("matmul --sizes x").is_err());
        let a = args("matmul --sizes 8x16x32 --dtype bfloat16 --linear").unwrap().unwrap();
        assert_eq!((a.sizes, a.dtype, a.linear), (vec![[8, 16, 32]], DType::BF16, true));
        assert!(args("matmul --sizes 8x16").is_err());
        assert!(args("matmul --dtype int9").is_err());
        assert!(args("ops --bogus").is_err());
        assert!(args("").is_err());
        let a = args("train --preset llama-tiny --batch 2 --seq 16 --steps 3").unwrap().unwrap();
        assert_eq!((a.batch, a.seq, a.steps, a.preset.as_str()), (2, 16, Some(3), "llama-tiny"));
        assert!(args("train --batch 0").is_err());
    }

    #[test]
    fn a_mode_the_run_cannot_honour_is_an_error() {
        let e = args("train --device cpu --mode defer").err().unwrap_or_default();
        assert!(e.contains("PJRT backend's modes") && e.contains("on cpu"), "{e}");
        let e = args("infer --device cpu --mode compiled").err().unwrap_or_default();
        assert!(e.contains("infer runs eagerly"), "{e}");
        assert!(args("decode --device cpu --mode compiled").unwrap().unwrap().compiled);
        let a = args("train --device cpu --mode compiled").unwrap().unwrap();
        assert!(a.compiled && a.mode.is_none());
        let a = args("train --device tpu --mode defer").unwrap().unwrap();
        assert_eq!(a.mode, Some(kiln::tpu::Mode::Defer));
    }

    #[test]
    fn activations_are_decode_s_and_named() {
        assert_eq!(args("decode --activations int8").unwrap().unwrap().activations, Activations::Int8);
        assert_eq!(args("decode").unwrap().unwrap().activations, Activations::Exact);
        let e = args("decode --activations int4").err().unwrap_or_default();
        assert!(e.contains("exact or int8"), "{e}");
        let e = args("train --activations int8").err().unwrap_or_default();
        assert!(e.contains("only decode takes it"), "{e}");
    }
}
