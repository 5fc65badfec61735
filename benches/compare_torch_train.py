#!/usr/bin/env python3
"""kiln vs PyTorch on a small Llama: training, inference and decoding.

Runs `kiln-bench train|infer|decode --preset P ...` (through
`cargo run --release -p kiln-bench --`, or --kiln-bin), takes the last JSON
line each prints, runs the same three measurements in PyTorch, then prints a
table with ratios and writes one JSON line per benchmark.

The PyTorch model is a plain-torch re-implementation of Hugging Face's
LlamaForCausalLM (transformers is not needed): RMSNorm computed in float32,
rotate_half RoPE, causal attention through
torch.nn.functional.scaled_dot_product_attention(is_causal=True) (what
transformers uses by default on CPU), SiLU-gated MLP, untied lm_head, no
biases. Weights ~ normal(0, 0.02) (RMSNorm weights 1), token ids uniform in
[0, vocab), both seeded; one fixed batch of ids is reused by every step.

Benchmarks (each PyTorch one in its own process, so that its peak RSS,
getrusage(RUSAGE_SELF).ru_maxrss at the end, is its own):
    train   a step = zero_grad + forward + mean next-token cross entropy of
            logits[:, :-1] vs ids[:, 1:] + backward + AdamW step (lr 1e-3,
            betas (0.9, 0.95), weight_decay 0.1 on every parameter, eps 1e-8)
            + reading the loss as a float.
            tokens/s = batch * seq / median step time.
    infer   forward of the whole [batch, seq] batch without autograd, logits
            for every position. tokens/s = batch * seq / median forward time.
    decode  batch 1, greedy, with a preallocated KV cache of prompt + new
            tokens. Prefill of the prompt (and its argmax) is not timed; the
            timed part is new_tokens steps, each a forward of one token through
            the cache, argmax of its logits and reading the token id.
            tokens/s = new_tokens / median time of the timed part.
Each benchmark runs `warmup` untimed repetitions, then `steps` timed ones, and
reports the median. Ratios are kiln / PyTorch tokens/s: > 1 means kiln is faster.
Peak RSS is in MiB, for the whole process (for PyTorch it includes the
interpreter and libtorch, reported separately as `base_rss_mb`).

Run it on an otherwise idle machine: when other work keeps the cores busy,
threads that wait on each other (PyTorch's OpenMP pool in particular) slow down
by large and erratic factors, decoding most (many small ops per token).

Usage (PyTorch in its own virtual environment):
    scripts/setup-torch-venv
    $HOME/.cache/kiln/torch-venv/bin/python benches/compare_torch_train.py [options]

    # only PyTorch, short:
    .../python benches/compare_torch_train.py --skip-kiln --steps 2 --warmup 1

Options: --preset, --batch, --seq (train/infer), --prompt, --new-tokens
(decode), --steps / --warmup (default 8 / 2 for train and infer, 3 / 1 for
decode; when given they apply to all three), --only train,infer,decode,
--precision f32|bf16-mixed (train), --threads, --kiln-bin PATH, --kiln-device,
--skip-kiln, --out PATH.
"""
import argparse
import contextlib
import json
import math
import os
import pathlib
import platform
import resource
import statistics
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent

# Model shapes, by kiln-bench --preset name. Everything not listed is shared:
# no biases, untied lm_head, SiLU-gated MLP, float32.
PRESETS = {
    "llama-16m": {
        "vocab_size": 8192,
        "hidden_size": 384,
        "num_hidden_layers": 6,
        "num_attention_heads": 6,
        "num_key_value_heads": 6,
        "head_dim": 64,
        "intermediate_size": 1024,
        "rope_theta": 1e4,
        "rms_norm_eps": 1e-5,
        "initializer_range": 0.02,
    },
}

BENCHES = ["train", "infer", "decode"]
# (steps, warmup) when --steps / --warmup are not given.
DEFAULT_REPS = {"train": (8, 2), "infer": (8, 2), "decode": (3, 1)}

SEED = 0
LR = 1e-3
BETAS = (0.9, 0.95)
WEIGHT_DECAY = 0.1
ADAM_EPS = 1e-8


def sig4(x):
    return float(f"{x:.4g}")


def peak_rss_mb():
    """Peak resident set size of this process so far, in MiB."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return r / (1024 * 1024) if sys.platform == "darwin" else r / 1024


def reps(args, bench):
    steps, warmup = DEFAULT_REPS[bench]
    return (max(args.steps if args.steps is not None else steps, 1),
            max(args.warmup if args.warmup is not None else warmup, 0))


# ----------------------------------------------------------------------------
# The PyTorch side: a Llama in plain torch, and the three measurements. Run in
# a child process (`--torch-worker BENCH`), which prints one JSON line.
# ----------------------------------------------------------------------------

def build_model(torch, cfg, max_positions, device):
    nn = torch.nn
    F = torch.nn.functional

    class RMSNorm(nn.Module):
        def __init__(self, dim, eps):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim))
            self.eps = eps

        def forward(self, x):
            dtype = x.dtype
            x = x.to(torch.float32)
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
            return self.weight * x.to(dtype)

    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            c, h, kv, d = (cfg["hidden_size"], cfg["num_attention_heads"],
                           cfg["num_key_value_heads"], cfg["head_dim"])
            self.h, self.kv, self.d = h, kv, d
            self.q_proj = nn.Linear(c, h * d, bias=False)
            self.k_proj = nn.Linear(c, kv * d, bias=False)
            self.v_proj = nn.Linear(c, kv * d, bias=False)
            self.o_proj = nn.Linear(h * d, c, bias=False)

        def forward(self, x, cos, sin, cache, past):
            b, t, _ = x.shape
            q = self.q_proj(x).view(b, t, self.h, self.d).transpose(1, 2)
            k = self.k_proj(x).view(b, t, self.kv, self.d).transpose(1, 2)
            v = self.v_proj(x).view(b, t, self.kv, self.d).transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            if cache is not None:
                kc, vc = cache
                kc[:, :, past:past + t] = k
                vc[:, :, past:past + t] = v
                k, v = kc[:, :, :past + t], vc[:, :, :past + t]
            if self.kv != self.h:
                k = k.repeat_interleave(self.h // self.kv, dim=1)
                v = v.repeat_interleave(self.h // self.kv, dim=1)
            # As transformers' sdpa attention: causal when the query has more
            # than one position (prefill / training), none for one new token.
            assert t == 1 or past == 0, "multi-token steps only from an empty cache"
            o = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, scale=self.d ** -0.5)
            return self.o_proj(o.transpose(1, 2).reshape(b, t, self.h * self.d))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            c, i = cfg["hidden_size"], cfg["intermediate_size"]
            self.gate_proj = nn.Linear(c, i, bias=False)
            self.up_proj = nn.Linear(c, i, bias=False)
            self.down_proj = nn.Linear(i, c, bias=False)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class DecoderLayer(nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
            self.self_attn = Attention()
            self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
            self.mlp = MLP()

        def forward(self, x, cos, sin, cache, past):
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, past)
            return x + self.mlp(self.post_attention_layernorm(x))

    class LlamaForCausalLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
            self.layers = nn.ModuleList(DecoderLayer() for _ in range(cfg["num_hidden_layers"]))
            self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
            self.lm_head = nn.Linear(cfg["hidden_size"], cfg["vocab_size"], bias=False)
            # RoPE tables, [max_positions, head_dim], rotate_half layout.
            d = cfg["head_dim"]
            inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
            freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
            self.register_buffer("cos", emb.cos(), persistent=False)
            self.register_buffer("sin", emb.sin(), persistent=False)
            std = cfg["initializer_range"]
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m.weight, mean=0.0, std=std)

        def new_cache(self, batch, capacity):
            shape = (batch, cfg["num_key_value_heads"], capacity, cfg["head_dim"])
            return [(self.cos.new_zeros(shape), self.cos.new_zeros(shape)) for _ in self.layers]

        def forward(self, ids, cache=None, past=0, last_only=False):
            """Logits [b, t, vocab], or [b, 1, vocab] for the last position with `last_only`."""
            t = ids.shape[1]
            cos, sin = self.cos[past:past + t], self.sin[past:past + t]
            x = self.embed_tokens(ids)
            for i, layer in enumerate(self.layers):
                x = layer(x, cos, sin, cache[i] if cache is not None else None, past)
            if last_only:
                x = x[:, -1:]
            return self.lm_head(self.norm(x))

    return LlamaForCausalLM().to(device)


def torch_worker(args):
    bench = args.torch_worker
    try:
        import torch
    except ImportError:
        sys.exit("compare_torch_train: PyTorch is not importable by " + sys.executable +
                 "\nrun scripts/setup-torch-venv, then "
                 "$HOME/.cache/kiln/torch-venv/bin/python benches/compare_torch_train.py")
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    rss_base = peak_rss_mb()
    cfg = PRESETS[args.preset]
    dev = args.torch_device
    steps, warmup = reps(args, bench)
    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)

    torch.manual_seed(SEED)
    max_pos = args.prompt + args.new_tokens if bench == "decode" else args.seq
    model = build_model(torch, cfg, max_pos, dev)
    vocab = cfg["vocab_size"]
    batch = 1 if bench == "decode" else args.batch
    seq = args.prompt if bench == "decode" else args.seq
    ids = torch.randint(0, vocab, (batch, seq), device=dev)

    rec = {"bench": bench, "dtype": "float32", "device": dev, "preset": args.preset}
    times = []
    if bench == "train" and args.precision == "bf16-mixed":
        rec["dtype"] = "bf16-mixed"
        amp = lambda: torch.autocast(device_type=dev.split(":")[0], dtype=torch.bfloat16)
    else:
        amp = contextlib.nullcontext
    if bench == "train":
        opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS,
                                weight_decay=WEIGHT_DECAY, eps=ADAM_EPS)
        losses = []
        for i in range(warmup + steps):
            t0 = time.perf_counter()
            opt.zero_grad()
            with amp():
                logits = model(ids)
                loss = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), ids[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            losses.append(loss.item())
            dt = time.perf_counter() - t0
            if i >= warmup:
                times.append(dt)
            print(f"  torch train step {i}: {dt * 1e3:.1f} ms, loss {losses[-1]:.4f}",
                  file=sys.stderr, flush=True)
        med = statistics.median(times)
        rec.update(batch=batch, seq=seq, steps=steps, tokens_per_s=sig4(batch * seq / med),
                   median_step_ms=sig4(med * 1e3), loss_first=sig4(losses[0]),
                   loss_last=sig4(losses[-1]))
    elif bench == "infer":
        model.eval()
        with torch.inference_mode():
            for i in range(warmup + steps):
                t0 = time.perf_counter()
                logits = model(ids)
                sync()
                dt = time.perf_counter() - t0
                del logits
                if i >= warmup:
                    times.append(dt)
        med = statistics.median(times)
        rec.update(batch=batch, seq=seq, steps=steps, tokens_per_s=sig4(batch * seq / med),
                   median_ms=sig4(med * 1e3))
    elif bench == "decode":
        model.eval()
        n_new = args.new_tokens
        with torch.inference_mode():
            for i in range(warmup + steps):
                cache = model.new_cache(1, args.prompt + n_new)
                # Prefill, untimed: the prompt, and the first token from its last logits.
                tok = int(model(ids, cache, 0, last_only=True)[0, -1].argmax())
                sync()
                t0 = time.perf_counter()
                for j in range(n_new):
                    x = torch.tensor([[tok]], device=dev)
                    # Reading the token is part of a step (it decides when to stop).
                    tok = int(model(x, cache, args.prompt + j, last_only=True)[0, -1].argmax())
                dt = time.perf_counter() - t0
                if i >= warmup:
                    times.append(dt)
        med = statistics.median(times)
        rec.update(batch=1, prompt=args.prompt, new_tokens=n_new, steps=steps,
                   tokens_per_s=sig4(n_new / med), median_ms=sig4(med * 1e3))
    rec.update(peak_rss_mb=sig4(peak_rss_mb()), base_rss_mb=sig4(rss_base),
               threads=torch.get_num_threads(), torch_version=torch.__version__,
               params=sum(p.numel() for p in model.parameters()))
    print(json.dumps(rec), flush=True)


# ----------------------------------------------------------------------------
# The driver: runs kiln-bench and the PyTorch workers, compares.
# ----------------------------------------------------------------------------

def last_json(stdout, bench):
    """The last JSON line of `stdout` that is a record of `bench`, or None."""
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("bench") == bench:
                return rec
    return None


def bench_flags(args, bench):
    steps, warmup = reps(args, bench)
    flags = ["--preset", args.preset]
    if bench == "decode":
        flags += ["--prompt", str(args.prompt), "--new-tokens", str(args.new_tokens)]
    else:
        flags += ["--batch", str(args.batch), "--seq", str(args.seq)]
    if bench == "train":
        flags += ["--precision", args.precision]
    return flags + ["--steps", str(steps), "--warmup", str(warmup)]


def run_kiln(args, bench):
    """Runs one kiln-bench benchmark; returns its last JSON line (or an error record)."""
    base = [args.kiln_bin] if args.kiln_bin else ["cargo", "run", "--release", "-q", "-p", "kiln-bench", "--"]
    cmd = base + [bench] + bench_flags(args, bench) + ["--device", args.kiln_device]
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    # stderr passes through (cargo's build output, kiln-bench's progress).
    p = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True)
    rec = last_json(p.stdout, bench)
    if rec is None:
        return {"bench": bench, "error": f"kiln-bench exited with code {p.returncode} and printed no result"}
    print(f"  kiln {bench}: {rec.get('tokens_per_s', rec.get('error'))} tokens/s", file=sys.stderr, flush=True)
    return rec


def run_torch(args, bench):
    """Runs one PyTorch benchmark in a fresh process; returns its JSON line."""
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--torch-worker", bench,
           *bench_flags(args, bench), "--threads", str(args.threads), "--torch-device", args.torch_device]
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    p = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True)
    rec = last_json(p.stdout, bench)
    if p.returncode != 0 or rec is None:
        sys.exit(f"compare_torch_train: the PyTorch {bench} worker failed (exit code {p.returncode})")
    print(f"  torch {bench}: {rec['tokens_per_s']} tokens/s, peak {rec['peak_rss_mb']} MB",
          file=sys.stderr, flush=True)
    return rec


def shape_of(rec):
    if rec["bench"] == "decode":
        return f"{rec['prompt']}+{rec['new_tokens']}"
    return f"{rec['batch']}x{rec['seq']}"


def compare(kiln, ref):
    rows = []
    for t in ref:
        k = kiln.get(t["bench"], {})
        kv, tv = k.get("tokens_per_s"), t["tokens_per_s"]
        ratio = kv / tv if kv and tv else None
        row = {
            "bench": t["bench"], "preset": t["preset"], "shape": shape_of(t), "dtype": t["dtype"],
            "unit": "tokens/s", "kiln": kv, "torch": tv, "ratio": sig4(ratio) if ratio else None,
            "ratio_meaning": "kiln/torch tokens/s",
            "kiln_median_ms": k.get("median_step_ms", k.get("median_ms")),
            "torch_median_ms": t.get("median_step_ms", t.get("median_ms")),
            "kiln_peak_rss_mb": k.get("peak_rss_mb"), "torch_peak_rss_mb": t["peak_rss_mb"],
            "torch_base_rss_mb": t["base_rss_mb"], "steps": t["steps"],
        }
        if t["bench"] == "train":
            row.update(kiln_loss_first=k.get("loss_first"), kiln_loss_last=k.get("loss_last"),
                       torch_loss_first=t["loss_first"], torch_loss_last=t["loss_last"])
        if "error" in k:
            row["kiln_error"] = k["error"]
        elif not k:
            row["kiln_missing"] = True
        rows.append(row)
    return rows


def fmt(v, spec):
    return "-" if v is None else format(v, spec)


def print_table(rows, header):
    print(header)
    cols = ["benchmark", "shape", "kiln tok/s", "PyTorch tok/s", "ratio", "kiln peak MB", "PyTorch peak MB"]
    table = []
    for r in rows:
        kv = "ERROR" if "kiln_error" in r else fmt(r["kiln"], ".1f")
        table.append([r["bench"], r["shape"], kv, fmt(r["torch"], ".1f"),
                      "-" if r["ratio"] is None else f"{r['ratio']:.2f}x",
                      fmt(r["kiln_peak_rss_mb"], ".0f"), fmt(r["torch_peak_rss_mb"], ".0f")])
    w = [max(len(c), *(len(row[i]) for row in table)) if table else len(c) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w[i]) if i < 2 else c.rjust(w[i]) for i, c in enumerate(cols)))
    print("  ".join("-" * x for x in w))
    for row in table:
        print("  ".join(v.ljust(w[i]) if i < 2 else v.rjust(w[i]) for i, v in enumerate(row)))
    print("\nratio = kiln/PyTorch tokens/s: > 1 means kiln is faster. Peak MB is the peak RSS of the "
          "whole process (PyTorch's includes ~{:.0f} MB of interpreter and libtorch)."
          .format(min(r["torch_base_rss_mb"] for r in rows)))
    for r in rows:
        if r["bench"] == "train":
            print(f"train loss (first -> last; ln(vocab) = {math.log(PRESETS[r['preset']]['vocab_size']):.3f}): "
                  f"kiln {fmt(r['kiln_loss_first'], '.4f')} -> {fmt(r['kiln_loss_last'], '.4f')}, "
                  f"PyTorch {r['torch_loss_first']:.4f} -> {r['torch_loss_last']:.4f}")
        if "kiln_error" in r:
            print(f"kiln {r['bench']}: {r['kiln_error']}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-16m", choices=sorted(PRESETS), help="model (default llama-16m)")
    ap.add_argument("--batch", type=int, default=8, help="train/infer batch size (default 8)")
    ap.add_argument("--seq", type=int, default=256, help="train/infer sequence length (default 256)")
    ap.add_argument("--prompt", type=int, default=64, help="decode prompt length (default 64)")
    ap.add_argument("--new-tokens", type=int, default=64, help="decode: tokens generated, timed (default 64)")
    ap.add_argument("--steps", type=int, default=None,
                    help="timed repetitions (default 8 for train and infer, 3 for decode)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed repetitions first (default 2 for train and infer, 1 for decode)")
    ap.add_argument("--precision", default="f32", choices=["f32", "bf16-mixed"],
                    help="train: f32, or bf16-mixed (kiln-bench --precision bf16-mixed against "
                         "torch.autocast(device, bfloat16) around forward and loss; default f32)")
    ap.add_argument("--only", default="", help="comma-separated subset of train,infer,decode")
    ap.add_argument("--threads", type=int, default=os.cpu_count(),
                    help="torch.set_num_threads (default: the number of cores)")
    ap.add_argument("--kiln-device", default="cpu", help="kiln-bench --device (default cpu)")
    ap.add_argument("--torch-device", default="cpu", help="PyTorch device (default cpu)")
    ap.add_argument("--kiln-bin", default=None,
                    help="a built kiln-bench binary to run instead of `cargo run --release -p kiln-bench --`")
    ap.add_argument("--skip-kiln", action="store_true", help="run only the PyTorch side")
    ap.add_argument("--out", default=str(REPO / "target" / "kiln-bench" / "compare_torch_train.jsonl"),
                    help="where to write the JSON lines (default target/kiln-bench/compare_torch_train.jsonl)")
    ap.add_argument("--torch-worker", choices=BENCHES, help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.torch_worker:
        return torch_worker(args)

    only = [s.strip() for s in args.only.split(",") if s.strip()] or BENCHES
    bad = [s for s in only if s not in BENCHES]
    if bad:
        ap.error(f"--only: unknown benchmark(s) {', '.join(bad)}; choose from {', '.join(BENCHES)}")
    benches = [b for b in BENCHES if b in only]

    kiln = {} if args.skip_kiln else {b: run_kiln(args, b) for b in benches}
    ref = [run_torch(args, b) for b in benches]

    rows = compare(kiln, ref)
    tv = ref[0]["torch_version"]
    header = (f"{args.preset}: kiln ({args.kiln_device}) vs PyTorch {tv} ({args.torch_device}, "
              f"{ref[0]['threads']} thread{'s' if ref[0]['threads'] != 1 else ''}) on {platform.machine()}, {os.cpu_count()} cores")
    print()
    print_table(rows, header)

    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as fh:
        for r in rows:
            fh.write(json.dumps({**r, "torch_version": tv, "threads": ref[0]["threads"]}) + "\n")
    print(f"\nJSON lines: {out}")
    if args.skip_kiln:
        return 0
    return 1 if any("kiln_error" in r or r.get("kiln_missing") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
