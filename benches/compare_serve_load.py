#!/usr/bin/env python3
"""kiln's serving engine vs transformers' continuous batching, same workload.

Runs `kiln-bench serve-load --write-workload FILE` (through
`cargo run --release -p kiln-bench --`, or --kiln-bin): kiln's engine and
`generate()` one request at a time, then the shared-system-prompt workload with
and without prefix sharing (Note [Serve load] in benches/src/serve_load.rs).
Then it serves the same requests (the same prompts, lengths and arrival
times) with transformers' continuous batching (`init_continuous_batching`,
`add_request` as each request arrives) on a LlamaForCausalLM of the same
configuration (random weights, float32, greedy, no end token), and prints one
table: generated tokens/s, time to first token p50 / p99, and ratios.

Usage (transformers in its own virtual environment):
    scripts/setup-transformers-venv
    $HOME/.cache/kiln/transformers-venv/bin/python benches/compare_serve_load.py [options]

Options: --requests N (default 64), --gap-ms G (50), --seed S (0), --preset P,
--repeat R (runs per system, default 3: each line is the run of median
tokens/s, as kiln-bench reports its own), --kiln-bin PATH, --skip-kiln (only
transformers, on a workload written before with --workload FILE), --threads N
(torch threads; default: all cores).
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


def run_kiln(args, workload):
    cmd = [args.kiln_bin] if args.kiln_bin else ["cargo", "run", "--release", "-q", "-p", "kiln-bench", "--"]
    cmd += ["serve-load", "--preset", args.preset, "--requests", str(args.requests), "--gap-ms", str(args.gap_ms),
            "--seed", str(args.seed), "--repeat", str(args.repeat), "--write-workload", workload]
    out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return [json.loads(l) for l in out.splitlines() if l.startswith("{")]


def run_transformers(workload, threads):
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    if threads:
        torch.set_num_threads(threads)
    w = json.load(open(workload))
    c = dict(w["config"])
    for k in ("architectures", "torch_dtype", "dtype", "transformers_version", "model_type"):
        c.pop(k, None)
    c.update(eos_token_id=None, bos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**c)).eval()
    reqs = w["plain"]
    gc = GenerationConfig(do_sample=False, max_new_tokens=max(r["max_new_tokens"] for r in reqs),
                          eos_token_id=None, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=gc)
    manager.start()
    try:
        # Warm up with one small request.
        manager.add_request([1] * 32, request_id="warmup", max_new_tokens=4)
        while (w0 := manager.get_result(timeout=600)) is None or not w0.is_finished():
            pass
        t0 = time.perf_counter()
        for i, r in enumerate(reqs):
            wait = t0 + r["arrival"] - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            manager.add_request(r["prompt"], request_id=f"r{i}", max_new_tokens=r["max_new_tokens"],
                                record_timestamps=True)
        ttft, tokens, last, done = [], 0, 0.0, set()
        while len(done) < len(reqs):
            out = manager.get_result(timeout=3600)
            if out is None or out.error:
                raise SystemExit(f"a transformers request failed: {out and out.error}")
            if not out.is_finished() or out.request_id in done:
                continue
            done.add(out.request_id)
            r = reqs[int(out.request_id[1:])]
            tokens += len(out.generated_tokens)
            ttft.append(out.timestamps[0] - (t0 + r["arrival"]))
            last = max(last, out.timestamps[-1])
    finally:
        manager.stop(block=True)
    ttft.sort()
    q = lambda p: ttft[round((len(ttft) - 1) * p)]
    makespan = last - t0
    return {"bench": "serve-load", "system": "transformers-cb", "workload": "plain", "requests": len(reqs),
            "generated_tokens": tokens, "makespan_s": round(makespan, 3),
            "tokens_per_s": round(tokens / makespan, 1), "ttft_p50_ms": round(q(0.5) * 1e3, 1),
            "ttft_p99_ms": round(q(0.99) * 1e3, 1), "torch_threads": torch.get_num_threads(),
            "transformers": __import__("transformers").__version__, "torch": torch.__version__}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--gap-ms", type=float, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", default="llama-16m")
    p.add_argument("--kiln-bin")
    p.add_argument("--skip-kiln", action="store_true")
    p.add_argument("--workload")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    workload = args.workload or os.path.join(tempfile.mkdtemp(), "workload.json")
    lines = [] if args.skip_kiln else run_kiln(args, workload)
    runs = sorted((run_transformers(workload, args.threads) for _ in range(max(args.repeat, 1))),
                  key=lambda l: l["tokens_per_s"])
    median = runs[len(runs) // 2]
    median["runs_tokens_per_s"] = [l["tokens_per_s"] for l in runs]
    lines.append(median)
    by = {l["system"]: l for l in lines if l.get("bench") == "serve-load"}
    print(f"{'system':28} {'tokens/s':>10} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12}")
    for name, l in by.items():
        print(f"{name:28} {l['tokens_per_s']:>10} {l['ttft_p50_ms']:>12} {l['ttft_p99_ms']:>12}")
    ratio = lambda a, b: round(by[a]["tokens_per_s"] / by[b]["tokens_per_s"], 2) if a in by and b in by else None
    ratios = {"engine_vs_sequential": ratio("engine", "sequential"),
              "engine_vs_transformers_cb": ratio("engine", "transformers-cb"),
              "prefix_sharing_vs_none": ratio("engine-prefix-sharing", "engine-no-prefix-sharing")}
    print("ratios (tokens/s):", json.dumps(ratios))
    for l in lines:
        print(json.dumps(l))
    print(json.dumps({"bench": "serve-load-ratios", **ratios}))


if __name__ == "__main__":
    sys.exit(main())
