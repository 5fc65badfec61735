"""Loads a quantized checkpoint directory with transformers and compressed-tensors
and writes the weights transformers ends up with, as float32.

    python check_quantized_with_transformers.py DIR OUT.safetensors

The load is the one the quantized fixtures record for compressed-tensors:
`AutoModelForCausalLM.from_pretrained(DIR, dtype=torch.bfloat16,
quantization_config=CompressedTensorsConfig(dequantize=True))`, which
decompresses every quantized Linear to bfloat16. Exits non-zero (with the
loader's message) when transformers refuses the directory.
"""
import sys

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
from transformers.utils.quantization_config import CompressedTensorsConfig

d, out = sys.argv[1], sys.argv[2]
m = AutoModelForCausalLM.from_pretrained(
    d, dtype=torch.bfloat16, quantization_config=CompressedTensorsConfig(dequantize=True)
)
# Weights, and the fused expert tensors of a mixture of experts (`experts.gate_up_proj`, `experts.down_proj`).
weights = {
    k: v.detach().float().contiguous()
    for k, v in m.state_dict().items()
    if k.endswith(".weight") or k.endswith("_proj")
}
save_file(weights, out)
print(len(weights), "weights")
