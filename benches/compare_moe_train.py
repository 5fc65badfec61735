#!/usr/bin/env python3
"""kiln vs transformers on a Qwen3-MoE training step, beside the dense Llama of
the same active parameters.

Runs `kiln-bench train --preset llama-16m` and `--preset qwen3-moe-16m` (the
MoE preset: llama-16m's shape with 8 experts, 2 per token, each half the dense
MLP's width), then the same step in PyTorch with transformers'
Qwen3MoeForCausalLM built from the same config (its default eager experts
loop), and prints tokens/s with ratios. A step is zero_grad + forward + mean
next-token cross entropy + backward + AdamW (lr 1e-3, betas (0.9, 0.95),
weight_decay 0.1, eps 1e-8) + reading the loss; tokens/s = batch * seq /
median step time.

Usage (transformers' venv, see scripts/):
    python benches/compare_moe_train.py --kiln-bin target/release/kiln-bench
"""
import argparse
import json
import statistics
import subprocess
import time

MOE = {
    "model_type": "qwen3_moe", "vocab_size": 8192, "hidden_size": 384, "intermediate_size": 1024,
    "num_hidden_layers": 6, "num_attention_heads": 6, "num_key_value_heads": 6, "head_dim": 64,
    "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 512, "norm_topk_prob": True,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "hidden_act": "silu", "initializer_range": 0.02, "tie_word_embeddings": False,
}


def kiln(bin_, preset, a):
    out = subprocess.run(
        [bin_, "train", "--preset", preset, "--batch", str(a.batch), "--seq", str(a.seq),
         "--steps", str(a.steps), "--warmup", str(a.warmup), "--device", "cpu"],
        check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["tokens_per_s"]


def torch_moe(a):
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(**{k: v for k, v in MOE.items() if k != "model_type"})
    m = Qwen3MoeForCausalLM(cfg).train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq))
    times = []
    for i in range(a.warmup + a.steps):
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits = m(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, cfg.vocab_size), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        loss.item()
        if i >= a.warmup:
            times.append(time.perf_counter() - t)
    return a.batch * a.seq / statistics.median(times)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--kiln-bin", default="target/release/kiln-bench")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    a = p.parse_args()
    dense = kiln(a.kiln_bin, "llama-16m", a)
    moe = kiln(a.kiln_bin, "qwen3-moe-16m", a)
    tmoe = torch_moe(a)
    print(f"{'step':<40}{'tokens/s':>10}")
    print(f"{'kiln llama-16m (dense)':<40}{dense:>10.0f}")
    print(f"{'kiln qwen3-moe-16m':<40}{moe:>10.0f}   {moe / dense:.2f}x dense")
    print(f"{'transformers Qwen3MoeForCausalLM':<40}{tmoe:>10.0f}   kiln/torch {moe / tmoe:.2f}x")
    print(json.dumps({"bench": "moe_train", "kiln_dense": dense, "kiln_moe": moe, "torch_moe": tmoe}))


if __name__ == "__main__":
    main()
