#!/usr/bin/env python3
"""kiln vs llama.cpp: batch-1 greedy decoding on the same shapes and bits.

Writes GGUF files of a preset's shapes (Qwen3-0.6B by default: hidden 1024,
28 layers, 16/8 heads of 128, MLP 3072, vocabulary 151,936, tied embeddings)
with random weights, normal(0, 0.02), through the `gguf` package (llama.cpp's
own writer and quantizers): f32, bf16, Q8_0 and Q4_0, the output matrix (the
tied embedding) at the same type as the rest, as llama.cpp's converter writes
a `--outtype`. llama.cpp (through `llama-cpp-python`, built for this CPU) then
decodes: a prompt of random ids, then `new_tokens` steps of one token each
(the argmax of the last logits), timed after the prompt. kiln runs
`kiln-bench decode` on the same file (`gguf`: Q8_0 / Q4_0 kept packed, as
llama.cpp computes with them), and with the preset's random weights in the
formats that match in bits: f32 - f32, bf16 - bf16, q8_0 and fp8 (8 bits + a
scale per 128 x 128) - Q8_0 (8 bits + a scale per 32), q4_0, nvfp4 (4 bits +
a scale per 16) and mxfp4 (per 32) - Q4_0 (4 bits + a scale per 32), each
with the LM head (the tied embedding) quantized like the rest (`+head`), as
llama.cpp's files have it; `weight_gb_per_token` says what a step reads.
Each quantized format runs twice in kiln: with its input rows as they are, and
with them rounded to int8 per 32 elements (`@int8`: `--activations int8`),
which is what llama.cpp's Q8_0 and Q4_0 products do.

The two alternate, `--rounds` times, and each line reports the median of the
rounds; ratios are kiln / llama.cpp tokens/s (> 1: kiln faster).

Usage:
    PY=$(scripts/setup-llamacpp-venv)
    cargo build --release -p kiln-bench
    $PY benches/compare_llama_cpp.py [--only f32,bf16,q8_0,q4_0] [--rounds 3]
        [--prompt 16] [--new-tokens 32] [--threads 2] [--kiln-bin PATH] [--out PATH]
        [--no-extra-bufts]
"""
import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Qwen3-0.6B's shapes (kiln-bench's `qwen3-0.6b` preset).
SHAPES = dict(vocab=151936, hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, mlp=3072,
              eps=1e-6, rope_theta=1_000_000.0)

# llama.cpp type -> the kiln weights of the same bits.
# "gguf": kiln decodes the very file llama.cpp does (`--weights gguf:PATH`,
# Q8_0 / Q4_0 kept packed).
# "@int8": with `--activations int8`, each row rounded to int8 per 32
# elements before the product, as llama.cpp does for these types (Note
# [Int8 activations]); without it kiln multiplies the rows as they are.
PAIRS = {"f32": ["f32", "gguf"], "bf16": ["bf16", "gguf"],
         "q8_0": ["q8_0+head", "q8_0+head@int8", "gguf", "gguf@int8", "fp8+head"],
         "q4_0": ["q4_0+head", "q4_0+head@int8", "gguf", "gguf@int8", "nvfp4+head", "nvfp4+head@int8",
                  "mxfp4+head", "mxfp4+head@int8"]}


def write_gguf(path, qtype, rng):
    import gguf

    s = SHAPES
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_context_length(4096)
    w.add_embedding_length(s["hidden"])
    w.add_block_count(s["layers"])
    w.add_feed_forward_length(s["mlp"])
    w.add_head_count(s["heads"])
    w.add_head_count_kv(s["kv_heads"])
    w.add_key_length(s["head_dim"])
    w.add_value_length(s["head_dim"])
    w.add_rope_freq_base(s["rope_theta"])
    w.add_layer_norm_rms_eps(s["eps"])
    w.add_file_type({"f32": 0, "bf16": 32, "q8_0": 7, "q4_0": 2}[qtype])
    # No tokenizer: the benchmark feeds token ids.
    w.add_tokenizer_model("none")
    w.add_vocab_size(s["vocab"])
    gtype = {"f32": gguf.GGMLQuantizationType.F32, "bf16": gguf.GGMLQuantizationType.BF16,
             "q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}[qtype]

    def matrix(name, out, inp):
        a = (rng.standard_normal((out, inp), dtype=np.float32) * 0.02).astype(np.float32)
        if qtype == "f32":
            w.add_tensor(name, a)
        else:
            q = gguf.quants.quantize(a, gtype)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gtype)

    def norm(name, n):
        w.add_tensor(name, np.ones(n, dtype=np.float32))

    hd = s["head_dim"]
    matrix("token_embd.weight", s["vocab"], s["hidden"])
    norm("output_norm.weight", s["hidden"])
    for i in range(s["layers"]):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", s["hidden"])
        norm(p + "ffn_norm.weight", s["hidden"])
        norm(p + "attn_q_norm.weight", hd)
        norm(p + "attn_k_norm.weight", hd)
        matrix(p + "attn_q.weight", s["heads"] * hd, s["hidden"])
        matrix(p + "attn_k.weight", s["kv_heads"] * hd, s["hidden"])
        matrix(p + "attn_v.weight", s["kv_heads"] * hd, s["hidden"])
        matrix(p + "attn_output.weight", s["hidden"], s["heads"] * hd)
        matrix(p + "ffn_gate.weight", s["mlp"], s["hidden"])
        matrix(p + "ffn_up.weight", s["mlp"], s["hidden"])
        matrix(p + "ffn_down.weight", s["hidden"], s["mlp"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama_decode(path, args, rng):
    """tokens/s of llama.cpp's batch-1 greedy decode: the median of `steps` runs."""
    import llama_cpp
    from llama_cpp import Llama

    if not args.extra_bufts:
        # llama.cpp's extra CPU buffer types (weights repacked for its AVX-512 and
        # AMX kernels) off: on some CPUs (a Xeon with AMX in a VM) its AMX path
        # crashes in the first decode.
        default = llama_cpp.llama_cpp.llama_model_default_params

        def without_extra_bufts():
            p = default()
            p.use_extra_bufts = False
            return p

        llama_cpp.llama.llama_cpp.llama_model_default_params = without_extra_bufts

    llm = Llama(model_path=str(path), n_ctx=args.prompt + args.new_tokens + 8, n_threads=args.threads,
                n_threads_batch=args.threads, n_batch=args.prompt + args.new_tokens + 8, verbose=False)
    times = []
    for run in range(args.warmup + args.steps):
        llm.reset()
        llm.eval(list(rng.integers(0, SHAPES["vocab"], size=args.prompt)))
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        t0 = time.perf_counter()
        for _ in range(args.new_tokens):
            llm.eval([tok])
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        if run >= args.warmup:
            times.append(time.perf_counter() - t0)
    del llm
    return args.new_tokens / statistics.median(times)


def kiln_decode(weights, args, path):
    weights, _, activations = weights.partition("@")
    if weights == "gguf":
        weights = f"gguf:{path}"
    cmd = [args.kiln_bin, "decode", "--preset", args.preset, "--device", "cpu", "--prompt", str(args.prompt),
           "--new-tokens", str(args.new_tokens), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--weights", weights, "--activations", activations or "exact"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="f32,bf16,q8_0,q4_0")
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--kiln-bin", default=str(ROOT / "target/release/kiln-bench"))
    ap.add_argument("--out")
    ap.add_argument("--no-extra-bufts", dest="extra_bufts", action="store_false",
                    help="llama.cpp without its repacked (AVX-512 / AMX) weight buffers")
    args = ap.parse_args()
    if args.preset != "qwen3-0.6b":
        sys.exit("compare_llama_cpp.py: only the qwen3-0.6b preset has GGUF shapes here")
    rng = np.random.default_rng(0)
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
               platform.processor())
    print(f"# CPU: {cpu}, {args.threads} threads", file=sys.stderr)
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        for qtype in args.only.split(","):
            if qtype not in PAIRS:
                sys.exit(f"compare_llama_cpp.py: unknown type {qtype!r} (one of {', '.join(PAIRS)})")
            path = pathlib.Path(tmp) / f"{args.preset}-{qtype}.gguf"
            write_gguf(path, qtype, rng)
            llama, kiln = [], {w: [] for w in PAIRS[qtype]}
            last = {}
            for _ in range(args.rounds):
                llama.append(llama_decode(path, args, rng))
                for w in PAIRS[qtype]:
                    last[w] = kiln_decode(w, args, path)
                    kiln[w].append(last[w]["tokens_per_s"])
            path.unlink()
            ll = statistics.median(llama)
            for w in PAIRS[qtype]:
                k = statistics.median(kiln[w])
                line = {"bench": "decode_vs_llama_cpp", "preset": args.preset, "llama_cpp_type": qtype,
                        "kiln_weights": w, "kiln_tokens_per_s": round(k, 2), "llama_cpp_tokens_per_s": round(ll, 2),
                        "ratio": round(k / ll, 3), "kiln_roofline_fraction": last[w].get("roofline_fraction"),
                        "kiln_weight_gb_per_token": last[w].get("weight_gb_per_token"),
                        "rounds": args.rounds, "threads": args.threads, "cpu": cpu,
                        "llama_cpp_extra_bufts": args.extra_bufts}
                print(json.dumps(line), flush=True)
                lines.append(line)
    if args.out:
        with open(args.out, "w") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
