#!/usr/bin/env python3
"""kiln's compiled training step vs JAX `jit` on the same XLA:CPU compiler.

Runs, in the same run and each in its own process:
  * kiln-bench train --device tpu --mode compiled: the whole step (zero_grad,
    forward, loss, backward, AdamW) captured by kiln::compile into one program
    and run through the XLA:CPU PJRT plugin;
  * kiln-bench train --device cpu: kiln's own CPU backend;
  * the same step written in JAX and compiled with jax.jit (XLA:CPU), below.
Then prints tokens/s and the ratios kiln-compiled / JAX and kiln-compiled /
kiln-cpu (> 1: kiln-compiled is faster), and writes one JSON line per run.

The JAX model is Hugging Face's LlamaForCausalLM written in jax.numpy: RMSNorm
in float32, rotate_half RoPE, causal softmax attention, SiLU-gated MLP, untied
lm_head, no biases; weights ~ normal(0, 0.02) (norm weights 1). A step is
forward + mean next-token cross entropy of logits[:, :-1] vs ids[:, 1:] +
gradient + AdamW exactly as torch.optim.AdamW (lr 1e-3, betas (0.9, 0.95),
eps 1e-8, weight decay 0.1 on every parameter) + reading the loss as a float;
parameters and optimizer state are donated to the jitted step. One fixed batch
of token ids is reused by every step. tokens/s = batch * seq / median step.

Usage:
    scripts/setup-jax-venv
    $HOME/.cache/kiln/jax-venv/bin/python benches/compare_jax_train.py \\
        [--preset llama-16m] [--batch 8] [--seq 256] [--steps 8] [--warmup 2] \\
        [--kiln-bin target/release/kiln-bench] [--skip-kiln] [--cache-dir DIR] [--out PATH]

With --cache-dir, JAX uses its persistent compilation cache there and the JAX
row reports compile_s, the time of `lower(...).compile()` (an XLA compile, or a
load from that cache).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PRESETS = {
    "llama-16m": dict(vocab=8192, hidden=384, inter=1024, layers=6, heads=6, kv_heads=6, eps=1e-5, theta=10000.0),
    "llama-tiny": dict(vocab=256, hidden=64, inter=128, layers=2, heads=4, kv_heads=2, eps=1e-5, theta=10000.0),
}


def jax_train(preset, batch, seq, steps, warmup, threads, cache_dir=None):
    os.environ.setdefault(
        "XLA_FLAGS", f"--xla_cpu_multi_thread_eigen=true intra_op_parallelism_threads={threads}"
    )
    import jax
    import jax.numpy as jnp

    if cache_dir:
        # JAX's persistent compilation cache, for every program however small or fast to compile.
        jax.config.update("jax_compilation_cache_dir", cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)

    c = PRESETS[preset]
    d, hd = c["hidden"], c["hidden"] // c["heads"]
    key = jax.random.PRNGKey(0)

    def normal(k, shape):
        return 0.02 * jax.random.normal(k, shape, jnp.float32)

    keys = iter(jax.random.split(key, 8 + 8 * c["layers"]))
    params = {
        "embed": normal(next(keys), (c["vocab"], d)),
        "norm": jnp.ones((d,), jnp.float32),
        "lm_head": normal(next(keys), (c["vocab"], d)),
        "layers": [
            {
                "in_norm": jnp.ones((d,), jnp.float32),
                "q": normal(next(keys), (c["heads"] * hd, d)),
                "k": normal(next(keys), (c["kv_heads"] * hd, d)),
                "v": normal(next(keys), (c["kv_heads"] * hd, d)),
                "o": normal(next(keys), (d, c["heads"] * hd)),
                "post_norm": jnp.ones((d,), jnp.float32),
                "gate": normal(next(keys), (c["inter"], d)),
                "up": normal(next(keys), (c["inter"], d)),
                "down": normal(next(keys), (d, c["inter"])),
            }
            for _ in range(c["layers"])
        ],
    }
    ids = jax.random.randint(next(keys), (batch, seq), 0, c["vocab"], jnp.int32)

    inv_freq = 1.0 / (c["theta"] ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    pos = jnp.arange(seq, dtype=jnp.float32)
    freqs = jnp.outer(pos, inv_freq)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb), jnp.sin(emb)

    def rms(x, w):
        v = jnp.mean(x * x, axis=-1, keepdims=True)
        return x * jax.lax.rsqrt(v + c["eps"]) * w

    def rot(x):
        h = x.shape[-1] // 2
        return jnp.concatenate([-x[..., h:], x[..., :h]], axis=-1)

    mask = jnp.tril(jnp.ones((seq, seq), bool))

    def forward(p, ids):
        x = p["embed"][ids]
        g = c["heads"] // c["kv_heads"]
        for l in p["layers"]:
            h = rms(x, l["in_norm"])
            q = (h @ l["q"].T).reshape(batch, seq, c["heads"], hd).transpose(0, 2, 1, 3)
            k = (h @ l["k"].T).reshape(batch, seq, c["kv_heads"], hd).transpose(0, 2, 1, 3)
            v = (h @ l["v"].T).reshape(batch, seq, c["kv_heads"], hd).transpose(0, 2, 1, 3)
            q, k = q * cos + rot(q) * sin, k * cos + rot(k) * sin
            k, v = jnp.repeat(k, g, axis=1), jnp.repeat(v, g, axis=1)
            s = (q @ k.transpose(0, 1, 3, 2)) / jnp.sqrt(jnp.float32(hd))
            s = jnp.where(mask, s, -jnp.inf)
            a = jax.nn.softmax(s, axis=-1) @ v
            x = x + a.transpose(0, 2, 1, 3).reshape(batch, seq, -1) @ l["o"].T
            h = rms(x, l["post_norm"])
            x = x + (jax.nn.silu(h @ l["gate"].T) * (h @ l["up"].T)) @ l["down"].T
        return rms(x, p["norm"]) @ p["lm_head"].T

    def loss_fn(p, ids):
        logits = forward(p, ids)[:, :-1]
        t = ids[:, 1:]
        lse = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0]
        return jnp.mean(lse - picked)

    lr, b1, b2, eps, wd = 1e-3, 0.9, 0.95, 1e-8, 0.1
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    state = (zeros, jax.tree_util.tree_map(jnp.zeros_like, params), jnp.zeros((), jnp.float32))

    def step(p, st, ids):
        loss, g = jax.value_and_grad(loss_fn)(p, ids)
        m, v, t = st
        t = t + 1
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        m = jax.tree_util.tree_map(lambda m, g: m + (1 - b1) * (g - m), m, g)
        v = jax.tree_util.tree_map(lambda v, g: b2 * v + (1 - b2) * g * g, v, g)
        p = jax.tree_util.tree_map(
            lambda p, m, v: p * (1 - lr * wd) - (lr / bc1) * m / (jnp.sqrt(v) / jnp.sqrt(bc2) + eps), p, m, v
        )
        return p, (m, v, t), loss

    jstep = jax.jit(step, donate_argnums=(0, 1))
    t0 = time.perf_counter()
    lowered = jstep.lower(params, state, ids)
    t1 = time.perf_counter()
    jstep = lowered.compile()  # XLA compile, or a load from the persistent cache
    compile_only_s = time.perf_counter() - t1
    params, state, loss = jstep(params, state, ids)
    first_loss = float(loss)
    compile_s = time.perf_counter() - t0
    times, losses = [], [first_loss]
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        params, state, loss = jstep(params, state, ids)
        losses.append(float(loss))
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return {
        "bench": "train",
        "impl": f"jax {jax.__version__} jit",
        "preset": preset,
        "batch": batch,
        "seq": seq,
        "steps": steps,
        "tokens_per_s": round(batch * seq / med, 1),
        "median_step_ms": round(med * 1e3, 2),
        "first_call_s": round(compile_s, 2),
        "lower_s": round(t1 - t0, 3),
        "compile_s": round(compile_only_s, 3),
        "loss_first": round(losses[0], 4),
        "loss_last": round(losses[-1], 4),
    }


def kiln(bin_path, preset, batch, seq, steps, warmup, device, mode):
    cmd = [bin_path, "train", "--preset", preset, "--batch", str(batch), "--seq", str(seq),
           "--steps", str(steps), "--warmup", str(warmup), "--device", device]
    if mode:
        cmd += ["--mode", mode]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr}")
    line = [l for l in out.stdout.splitlines() if l.startswith("{")][-1]
    r = json.loads(line)
    r["impl"] = f"kiln {device}" + (f" {mode}" if mode else "")
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-16m", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--kiln-bin", default="target/release/kiln-bench")
    ap.add_argument("--skip-kiln", action="store_true")
    ap.add_argument("--cache-dir", help="JAX persistent compilation cache directory (reports its compile_s)")
    ap.add_argument("--jax-only-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.jax_only_child:
        print(json.dumps(jax_train(a.preset, a.batch, a.seq, a.steps, a.warmup, a.threads, a.cache_dir)))
        return
    rows = []
    if not a.skip_kiln:
        # kiln-compiled traces its first two calls (replays once two traces agree).
        rows.append(kiln(a.kiln_bin, a.preset, a.batch, a.seq, a.steps, max(a.warmup, 2), "tpu", "compiled"))
        rows.append(kiln(a.kiln_bin, a.preset, a.batch, a.seq, a.steps, a.warmup, "cpu", None))
    child = subprocess.run(
        [sys.executable, __file__, "--jax-only-child", "--preset", a.preset, "--batch", str(a.batch), "--seq",
         str(a.seq), "--steps", str(a.steps), "--warmup", str(a.warmup), "--threads", str(a.threads)]
        + (["--cache-dir", a.cache_dir] if a.cache_dir else []),
        capture_output=True, text=True,
    )
    if child.returncode != 0:
        sys.exit(f"the JAX run failed:\n{child.stderr}")
    rows.append(json.loads(child.stdout.strip().splitlines()[-1]))
    print(f"{'impl':<24} {'tokens/s':>10} {'step ms':>9} {'loss first':>11} {'loss last':>10}")
    for r in rows:
        step = r.get("median_step_ms")
        print(f"{r['impl']:<24} {r['tokens_per_s']:>10.1f} {step:>9.2f} {r['loss_first']:>11.4f} {r['loss_last']:>10.4f}")
    by = {r["impl"]: r for r in rows}
    jaxr = next(r for r in rows if r["impl"].startswith("jax"))
    if "kiln tpu compiled" in by:
        k = by["kiln tpu compiled"]
        ratios = {
            "kiln_compiled_over_jax": round(k["tokens_per_s"] / jaxr["tokens_per_s"], 3),
            "kiln_compiled_over_kiln_cpu": round(k["tokens_per_s"] / by["kiln cpu"]["tokens_per_s"], 3),
        }
        print(json.dumps(ratios))
        rows.append(ratios)
    if a.out:
        with open(a.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
