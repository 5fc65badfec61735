"""Loads a model directory kiln saved with transformers and writes its logits.

    python check_moe_with_transformers.py DIR IDS.safetensors OUT.safetensors

`AutoModelForCausalLM.from_pretrained(DIR, dtype=float32, attn_implementation="eager")`
with its loading report: exits non-zero, naming them, when any key is missing,
unexpected or mis-shaped (transformers only warns about those). Then the
logits of the `input_ids` in IDS go to OUT as `logits`; the model's class
name is printed.
"""
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

d, ids_path, out = sys.argv[1], sys.argv[2], sys.argv[3]
m, info = AutoModelForCausalLM.from_pretrained(
    d, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
)
problems = {k: v for k, v in info.items() if v}
if problems:
    print(f"check_moe_with_transformers: {problems}", file=sys.stderr)
    sys.exit(1)
m.eval()
ids = load_file(ids_path)["input_ids"]
with torch.no_grad():
    logits = m(ids).logits
save_file({"logits": logits.contiguous()}, out)
print(type(m).__name__)
