#!/usr/bin/env python3
"""kiln's LoRA training step against PEFT on PyTorch (CPU), one run.

Runs `kiln-bench train --finetune lora --lora-r R --preset P --batch B --seq T`
(and `--finetune full` and `--finetune qlora` for the memory table), then the
same LoRA step in PyTorch: transformers' LlamaForCausalLM with the preset's
config (weights ~ N(0, 0.02), norms 1, seeded), PEFT's `get_peft_model` with
`LoraConfig(r=R, lora_alpha=2R, target_modules="all-linear")`, AdamW (lr 1e-3,
betas (0.9, 0.95), eps 1e-8, weight decay 0.1) over the adapter alone; a step
is zero_grad + forward with labels = ids (next-token cross entropy) + backward
+ AdamW step + reading the loss. tokens/s = B x T / median step; the PyTorch
step runs in its own process so that its peak RSS is its own. Ratios are
kiln / PyTorch tokens/s: > 1 means kiln is faster.

Usage (the transformers venv has torch, transformers and peft):
    scripts/setup-transformers-venv
    $HOME/.cache/kiln/transformers-venv/bin/python benches/compare_peft_train.py \\
        [--preset llama-16m] [--batch 4] [--seq 256] [--lora-r 16] [--steps 8] [--warmup 2] [--kiln-bin PATH]
"""
import argparse
import json
import pathlib
import platform
import resource
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
# kiln-bench's presets (benches/src/llm.rs), as transformers configs.
PRESETS = {
    "llama-16m": dict(vocab_size=8192, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                      num_attention_heads=6, num_key_value_heads=6, max_position_embeddings=1024,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False),
    "llama-tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False),
}


def torch_worker(a):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**PRESETS[a.preset]))
    model = get_peft_model(model, LoraConfig(r=a.lora_r, lora_alpha=2 * a.lora_r, target_modules="all-linear",
                                             lora_dropout=0.0, task_type="CAUSAL_LM"))
    model.train()
    ids = torch.randint(0, PRESETS[a.preset]["vocab_size"], (a.batch, a.seq))
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    times, losses = [], []
    for i in range(a.warmup + a.steps):
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if i >= a.warmup:
            times.append(time.perf_counter() - t)
    times.sort()
    step = times[len(times) // 2]
    print(json.dumps({"bench": "peft_train", "tokens_per_s": a.batch * a.seq / step, "median_step_ms": step * 1e3,
                      "trainable_params": sum(p.numel() for p in trainable), "loss_first": losses[0],
                      "loss_last": losses[-1], "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "torch": torch.__version__, "threads": torch.get_num_threads()}))


def last_json(out):
    lines = [l for l in out.splitlines() if l.startswith("{")]
    return json.loads(lines[-1]) if lines else {"error": "no result"}


def kiln(a, method):
    base = [a.kiln_bin] if a.kiln_bin else ["cargo", "run", "--release", "-q", "-p", "kiln-bench", "--"]
    cmd = base + ["train", "--preset", a.preset, "--batch", str(a.batch), "--seq", str(a.seq), "--steps",
                  str(a.steps), "--warmup", str(a.warmup), "--finetune", method, "--lora-r", str(a.lora_r)]
    return last_json(subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True).stdout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama-16m", choices=sorted(PRESETS))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--kiln-bin")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return torch_worker(a)
    rows = {m: kiln(a, m) for m in ["full", "lora", "qlora"]}
    worker = [sys.executable, __file__, "--worker"] + [f"--{k.replace('_', '-')}={v}" for k, v in
                                                       [("preset", a.preset), ("batch", a.batch), ("seq", a.seq),
                                                        ("lora_r", a.lora_r), ("steps", a.steps),
                                                        ("warmup", a.warmup)]]
    peft = last_json(subprocess.run(worker, stdout=subprocess.PIPE, text=True).stdout)
    print(f"# {a.preset}, batch {a.batch} x seq {a.seq}, LoRA r={a.lora_r} alpha={2 * a.lora_r} on every decoder "
          f"Linear; CPU: {platform.processor() or platform.machine()}")
    print(f"{'run':<14}{'trainable':>12}{'optim MB':>10}{'weights MB':>12}{'peak RSS MB':>13}{'tokens/s':>10}")
    for m, r in rows.items():
        if "error" in r:
            print(f"kiln {m:<9} error: {r['error']}")
            continue
        print(f"kiln {m:<9}{r['trainable_params']:>12}{r['optimizer_state_mb']:>10}{r['weights_mb']:>12}"
              f"{r['peak_rss_mb']:>13}{r['tokens_per_s']:>10}")
    if "error" not in peft:
        print(f"{'peft lora':<14}{peft['trainable_params']:>12}{'':>10}{'':>12}{peft['peak_rss_mb']:>13.1f}"
              f"{peft['tokens_per_s']:>10.1f}")
        if "tokens_per_s" in rows["lora"]:
            ratio = rows["lora"]["tokens_per_s"] / peft["tokens_per_s"]
            print(f"kiln LoRA / PEFT LoRA tokens/s: {ratio:.2f}x (torch {peft['torch']}, {peft['threads']} threads)")
    for m, r in rows.items():
        print(json.dumps({"bench": f"kiln_{m}", **r}))
    print(json.dumps(peft))


if __name__ == "__main__":
    main()
