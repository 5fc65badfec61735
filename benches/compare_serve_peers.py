#!/usr/bin/env python3
"""kiln's OpenAI-compatible server against llama.cpp's server and
transformers' continuous batching server, one run, the same model, the same
OpenAI-client load.

The model is a byte-level Llama checkpoint (what `train_llama --data FILE`
writes; default runs/train_llama), copied with a tokenizer every server
reads: a GPT-2 byte-level BPE whose 256 tokens are the bytes in order and
which has no merges, so every server turns text into the byte ids the model
was trained on; the context is raised to --context (RoPE runs at any
position; the measurement is of serving, not of text quality), and the
model has no end token, so every request runs to its `max_tokens`.

Servers, each started, loaded with the workload, measured and stopped in turn:
  kiln          examples/serve, --max-num-seqs --parallel, a KV pool of
                --parallel contexts in float32, then in bfloat16
  llama.cpp     llama-server (scripts/setup-llamacpp-server) on the model
                converted by llama.cpp's convert_hf_to_gguf.py, f32 and
                q8_0 (and bf16), --parallel slots of --context positions (its
                KV cache in float16) with continuous batching
  transformers  `transformers serve --continuous-batching` (float32, CPU)

Workloads (Note [Serve load] in benches/src/serve_load.rs, as text): N
requests with prompts of 16-512 bytes of --data and 16-256 new tokens,
arriving as a Poisson stream of mean gap G ms; and a shared-system-prompt
variant (one 256-byte system prompt, then 16-256 bytes of each request's
own). Each request streams `/v1/completions` (greedy) through the `openai`
client. Reported per server and workload: generated tokens/s over the
makespan, time to first token p50 / p99, inter-token latency p50 / p99 (the
gaps between streamed tokens), and the server's peak resident memory.

Usage (the openai client's environment runs this script):
    PY=$(scripts/setup-openai-venv)
    $PY benches/compare_serve_peers.py --model runs/train_llama --data FILE [options]
Options: --requests N (32), --gap-ms G (100), --seed S (0), --context C (1024),
--threads T (2), --only kiln,llama.cpp,transformers, --llama-types f32,q8_0,
--kiln-bin PATH (target/release/examples/serve, built when missing).
"""
import argparse
import asyncio
import json
import os
import pathlib
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
CACHE = pathlib.Path(os.environ.get("HOME", "/tmp")) / ".cache" / "kiln"


def bytes_to_unicode():
    """GPT-2's byte-to-character map (the ByteLevel pre-tokenizer's)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def prepare(src, dst, context):
    """The model with a byte tokenizer every server reads, at `context` positions."""
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg["max_position_embeddings"] = context
    cfg.pop("eos_token_id", None)
    cfg.pop("bos_token_id", None)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    shutil.copy(src / "model.safetensors", dst / "model.safetensors")
    (dst / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    chars = bytes_to_unicode()
    vocab = {chars[b]: b for b in range(256)}
    tok = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "vocab": vocab, "merges": []},
    }
    (dst / "tokenizer.json").write_text(json.dumps(tok))
    (dst / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": context, "clean_up_tokenization_spaces": False}))
    return dst


def workload(text, n, gap_ms, seed, shared):
    rng = random.Random(seed)
    printable = bytes(b if 32 <= b < 127 or b == 10 else 32 for b in text).decode()
    window = lambda k: (lambda s: printable[s:s + k])(rng.randrange(len(printable) - k))
    system = window(256) if shared else ""
    t, reqs = 0.0, []
    for i in range(n):
        own = rng.randint(16, 256) if shared else rng.randint(16, 512)
        if i > 0:
            t += rng.expovariate(1.0 / (gap_ms / 1e3))
        reqs.append({"prompt": system + window(own), "max_tokens": rng.randint(16, 256), "arrival": t})
    return reqs


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peak_rss_mb(pid):
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def wait_ready(url, proc, timeout=600):
    import httpx
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except Exception:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not come up")


async def one(client, model, r, t0, extra, out):
    await asyncio.sleep(max(0.0, r["arrival"] - (time.perf_counter() - t0)))
    start = time.perf_counter()
    stamps = []
    stream = await client.completions.create(model=model, prompt=r["prompt"], max_tokens=r["max_tokens"],
                                             temperature=0, stream=True, extra_body=extra)
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            stamps.append(time.perf_counter())
    out.append({"start": start, "stamps": stamps, "want": r["max_tokens"]})


async def load(url, model, reqs, extra):
    import openai
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=3600)
    out = []
    t0 = time.perf_counter()
    await asyncio.gather(*(one(client, model, r, t0, extra, out) for r in reqs))
    await client.close()
    return t0, out


def quantile(xs, q):
    xs = sorted(xs)
    return xs[round((len(xs) - 1) * q)] if xs else float("nan")


def measure(name, cmd, env, port, model, reqs, extra):
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(url, proc)
        # One small request first: kernels, allocators and compiled programs warm.
        asyncio.run(load(url, model, [{"prompt": "warm up", "max_tokens": 8, "arrival": 0.0}], extra))
        t0, out = asyncio.run(load(url, model, reqs, extra))
        rss = peak_rss_mb(proc.pid)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    tokens = sum(len(o["stamps"]) for o in out)
    end = max(o["stamps"][-1] for o in out if o["stamps"])
    first = min(r["arrival"] for r in reqs) + t0
    ttft = [o["stamps"][0] - o["start"] for o in out if o["stamps"]]
    itl = [b - a for o in out for a, b in zip(o["stamps"], o["stamps"][1:])]
    short = sum(1 for o in out if len(o["stamps"]) < o["want"])
    return {
        "server": name,
        "tokens": tokens,
        "tokens_per_s": tokens / (end - first),
        "ttft_p50_ms": quantile(ttft, 0.5) * 1e3,
        "ttft_p99_ms": quantile(ttft, 0.99) * 1e3,
        "itl_p50_ms": quantile(itl, 0.5) * 1e3,
        "itl_p99_ms": quantile(itl, 0.99) * 1e3,
        "peak_rss_mb": rss,
        "short_requests": short,
        "log": log.name,
    }


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, text=True, capture_output=True, **kw).stdout.strip()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / "runs" / "train_llama"))
    ap.add_argument("--data", required=True)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--gap-ms", type=float, default=100.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--only", default="kiln,llama.cpp,transformers")
    ap.add_argument("--llama-types", default="f32,q8_0")
    ap.add_argument("--parallel", type=int, default=16)
    ap.add_argument("--kiln-bin", default=str(ROOT / "target" / "release" / "examples" / "serve"))
    a = ap.parse_args()
    only = a.only.split(",")
    work = pathlib.Path(tempfile.mkdtemp(prefix="kiln-peers-"))
    model = prepare(pathlib.Path(a.model), work / "model", a.context)
    text = pathlib.Path(a.data).read_bytes()
    loads = {"plain": workload(text, a.requests, a.gap_ms, a.seed, False),
             "shared-256": workload(text, a.requests, a.gap_ms, a.seed + 1, True)}
    env = dict(os.environ)
    systems = []
    if "kiln" in only:
        if not pathlib.Path(a.kiln_bin).exists():
            subprocess.run(["cargo", "build", "--release", "--example", "serve", "--features", "server"], cwd=ROOT, check=True)
        # A KV pool holding what llama.cpp's slots hold: --parallel contexts.
        cfg = json.loads((model / "config.json").read_text())
        head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head
        for kv, size in [("float32", 4), ("bfloat16", 2)]:
            mb = -(-per_token * size * a.context * a.parallel // (1 << 20)) + 1
            port = free_port()
            cmd = [a.kiln_bin, "--model", str(model), "--name", "m", "--port", str(port), "--max-num-seqs",
                   str(a.parallel), "--kv-cache-mb", str(mb), "--kv-cache-dtype", kv]
            systems.append((f"kiln f32 ({'f32' if size == 4 else 'bf16'} KV)", cmd, port, {}))
    if "llama.cpp" in only:
        server = run([str(ROOT / "scripts" / "setup-llamacpp-server")])
        venv = pathlib.Path(server).parents[3]
        tpy = run([str(ROOT / "scripts" / "setup-transformers-venv")])
        for t in a.llama_types.split(","):
            gguf = work / f"model-{t}.gguf"
            subprocess.run([tpy, str(ROOT / "benches" / "llama_cpp_convert.py"), str(venv / "llama.cpp"), str(model),
                            str(gguf), t, "--keep-vocab"], check=True)
            port = free_port()
            cmd = [server, "-m", str(gguf), "--port", str(port), "--host", "127.0.0.1", "-t", str(a.threads),
                   "--parallel", str(a.parallel), "-c", str(a.context * a.parallel), "--cont-batching", "--no-webui",
                   "-a", "m"]
            systems.append((f"llama.cpp {t}", cmd, port, {"ignore_eos": True}))
    if "transformers" in only:
        tpy = run([str(ROOT / "scripts" / "setup-transformers-venv")])
        subprocess.run([tpy, "-m", "pip", "install", "--quiet", "fastapi", "uvicorn", "openai", "pydantic"], check=True)
        port = free_port()
        cmd = [str(pathlib.Path(tpy).parent / "transformers"), "serve", str(model), "--continuous-batching",
               "--device", "cpu", "--dtype", "float32", "--port", str(port), "--host", "127.0.0.1"]
        systems.append(("transformers f32", cmd, port, {}))
    rows = []
    for name, cmd, port, extra in systems:
        for wname, reqs in loads.items():
            model_name = "m" if not name.startswith("transformers") else str(model)
            try:
                r = measure(name, cmd, env, port, model_name, reqs, extra)
            except Exception as e:
                r = {"server": name, "error": str(e)}
            r["workload"] = wname
            print(json.dumps(r), flush=True)
            rows.append(r)
    print()
    print(f"{'server':<22}{'workload':<12}{'tok/s':>9}{'TTFT p50':>10}{'p99':>8}{'ITL p50':>9}{'p99':>8}{'RSS MB':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['server']:<22}{r['workload']:<12} error: {r['error']}")
            continue
        print(f"{r['server']:<22}{r['workload']:<12}{r['tokens_per_s']:>9.1f}{r['ttft_p50_ms']:>10.0f}{r['ttft_p99_ms']:>8.0f}"
              f"{r['itl_p50_ms']:>9.1f}{r['itl_p99_ms']:>8.1f}{r['peak_rss_mb']:>8.0f}")


if __name__ == "__main__":
    main()
