"""Loads a dense kiln checkpoint directory with transformers and runs it.

    python check_dense_with_transformers.py DIR IDS.safetensors OUT.safetensors

`AutoModelForCausalLM.from_pretrained(DIR, dtype=torch.float32)` with eager
attention, in evaluation mode, on `input_ids` from IDS; writes its `logits` to
OUT and prints the model's class. Exits non-zero (with the loader's message)
when transformers refuses the directory or reports missing or unexpected keys.
"""
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

d, ids_path, out = sys.argv[1:4]
torch.set_num_threads(1)
m, info = AutoModelForCausalLM.from_pretrained(
    d, dtype=torch.float32, attn_implementation="eager", output_loading_info=True
)
problems = {k: v for k, v in info.items() if v}
if problems:
    sys.exit(f"transformers reports {problems}")
m.eval()
with torch.no_grad():
    logits = m(load_file(ids_path)["input_ids"]).logits
save_file({"logits": logits.contiguous()}, out)
print(type(m).__name__)
