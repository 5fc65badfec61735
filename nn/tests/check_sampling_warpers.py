"""transformers' sampling warpers on logits kiln wrote, for nn/tests/sampling.rs.

Usage: check_sampling_warpers.py IN.safetensors CONFIGS.json OUT.safetensors

IN holds `logits` [B, V] (float32). CONFIGS is a list of
{"name", "temperature", "top_k", "top_p", "min_p"}. For each, the logits go
through the warpers transformers' `generate` builds for sampling, in its order
(GenerationMixin._get_logits_processor: temperature, top-k, top-p, min-p),
and OUT gets `<name>` = the warped scores (-inf where a token is removed).
"""
import json
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

logits = load_file(sys.argv[1])["logits"]
out = {}
for c in json.load(open(sys.argv[2])):
    warpers = LogitsProcessorList()
    # The conditions _get_logits_processor adds each warper under.
    if c["temperature"] != 1.0:
        warpers.append(TemperatureLogitsWarper(c["temperature"]))
    if c["top_k"] != 0:
        warpers.append(TopKLogitsWarper(top_k=c["top_k"], min_tokens_to_keep=1))
    if c["top_p"] < 1.0:
        warpers.append(TopPLogitsWarper(top_p=c["top_p"], min_tokens_to_keep=1))
    if c["min_p"] > 0.0:
        warpers.append(MinPLogitsWarper(min_p=c["min_p"], min_tokens_to_keep=1))
    ids = torch.zeros((logits.shape[0], 1), dtype=torch.long)
    out[c["name"]] = warpers(ids, logits.clone()).contiguous()
save_file(out, sys.argv[3])
