"""Loads a model directory kiln saved with transformers and writes what it computes.

    python check_moe_with_transformers.py DIR IN.safetensors OUT.safetensors

`AutoModelForCausalLM.from_pretrained(DIR, dtype=float32, attn_implementation="eager")`
with its loading report: exits non-zero, naming them, when any key is missing,
unexpected or mis-shaped (transformers only warns about those). IN holds
`input_ids` and optionally `attention_mask`. OUT gets `logits`, `loss` (with
`labels = input_ids`, the router's auxiliary loss included when the config's
`output_router_logits` is set), `aux_loss` when there is one, and
`grad.<name>` for every parameter after `loss.backward()`, under
transformers' in-memory names (its experts fused: `experts.gate_up_proj`
[E, 2I, H], `experts.down_proj` [E, H, I]). The model's class name is printed.
"""
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

d, in_path, out = sys.argv[1], sys.argv[2], sys.argv[3]
m, info = AutoModelForCausalLM.from_pretrained(
    d, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
)
problems = {k: v for k, v in info.items() if v}
if problems:
    print(f"check_moe_with_transformers: {problems}", file=sys.stderr)
    sys.exit(1)
m.eval()
inputs = load_file(in_path)
ids = inputs["input_ids"]
result = m(ids, attention_mask=inputs.get("attention_mask"), labels=ids)
result.loss.backward()
tensors = {"logits": result.logits.detach().contiguous(), "loss": result.loss.detach()}
if getattr(result, "aux_loss", None) is not None:
    tensors["aux_loss"] = result.aux_loss.detach().float()
for name, p in m.named_parameters():
    if p.grad is not None:
        tensors[f"grad.{name}"] = p.grad.contiguous()
save_file(tensors, out)
print(type(m).__name__)
