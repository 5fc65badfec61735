"""Reads a kiln checkpoint directory the way transformers' loader does and prints
a JSON summary for the Rust test to compare.

Checks what `LlamaForCausalLM.from_pretrained` relies on: `config.json` names the
architecture and sizes; `model.safetensors` parses with safetensors' own reader,
carries the `{"format": "pt"}` metadata transformers requires, and holds exactly
the parameter names transformers' Llama has, with the shapes the config implies.
Prints {"ok": true, "sums": {name: float64 sum}} or exits non-zero naming the problem.
"""
import json
import os
import sys

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file


def fail(msg):
    print(f"check_hf_checkpoint: {msg}", file=sys.stderr)
    sys.exit(1)


d = sys.argv[1]
cfg = json.load(open(f"{d}/config.json"))
if cfg.get("architectures") != ["LlamaForCausalLM"] or cfg.get("model_type") != "llama":
    fail(f"config.json: architectures {cfg.get('architectures')} model_type {cfg.get('model_type')}")
h, v, i = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
nh, nkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
hd = cfg.get("head_dim") or h // nh
# One model.safetensors, or the files model.safetensors.index.json maps each name to.
if os.path.exists(f"{d}/model.safetensors"):
    files = {"model.safetensors": None}
else:
    index = json.load(open(f"{d}/model.safetensors.index.json"))
    files = {}
    for name, file in index["weight_map"].items():
        files.setdefault(file, set()).add(name)
tensors = {}
for file, names in files.items():
    path = f"{d}/{file}"
    with safe_open(path, framework="numpy") as f:
        meta = f.metadata() or {}
    if meta.get("format") not in ("pt", "tf", "flax", "mlx"):
        fail(f"{file}: metadata {meta}: transformers refuses a file without format=pt")
    held = load_file(path)
    if names is not None and set(held) != names:
        fail(f"{file} holds {sorted(held)}, the index maps {sorted(names)} to it")
    tensors.update(held)
want = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
for l in range(cfg["num_hidden_layers"]):
    p = f"model.layers.{l}."
    want.update({
        p + "self_attn.q_proj.weight": (nh * hd, h),
        p + "self_attn.k_proj.weight": (nkv * hd, h),
        p + "self_attn.v_proj.weight": (nkv * hd, h),
        p + "self_attn.o_proj.weight": (h, nh * hd),
        p + "mlp.gate_proj.weight": (i, h),
        p + "mlp.up_proj.weight": (i, h),
        p + "mlp.down_proj.weight": (h, i),
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
    })
if not cfg.get("tie_word_embeddings", True):
    want["lm_head.weight"] = (v, h)
if set(tensors) != set(want):
    fail(f"names differ: missing {sorted(set(want) - set(tensors))}, unexpected {sorted(set(tensors) - set(want))}")
for name, shape in want.items():
    if tensors[name].shape != shape:
        fail(f"{name}: shape {tensors[name].shape}, config implies {shape}")
    if not np.all(np.isfinite(tensors[name])):
        fail(f"{name}: non-finite values")
print(json.dumps({"ok": True, "sums": {k: float(t.astype(np.float64).sum()) for k, t in tensors.items()}}))
