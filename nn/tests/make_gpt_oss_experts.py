"""Writes random gpt-oss MXFP4 expert tensors and transformers' dequantization of them.

    python make_gpt_oss_experts.py OUT.safetensors

OUT gets `gate_up_proj_blocks` [E, 2I, H/32, 16] and `down_proj_blocks` [E, H, I/32, 16]
(uint8), their `*_scales` (uint8 E8M0 exponents), and `gate_up_proj` [E, H, 2I] and
`down_proj` [E, I, H]: what transformers' `convert_moe_packed_tensors` makes of
them in float32 (the layout of its GptOssExperts, inputs first).
"""
import sys

import torch
from safetensors.torch import save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

g = torch.Generator().manual_seed(0)
E, H, I = 3, 64, 96
out = {}
for name, rows, cols in [("gate_up_proj", 2 * I, H), ("down_proj", H, I)]:
    blocks = torch.randint(0, 256, (E, rows, cols // 32, 16), generator=g, dtype=torch.int32).to(torch.uint8)
    scales = torch.randint(118, 136, (E, rows, cols // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    out[f"{name}_blocks"] = blocks
    out[f"{name}_scales"] = scales
    out[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).contiguous()
save_file(out, sys.argv[1])
print(E, H, I)
