"""PEFT's side of kiln's LoRA tests, on the transformers model of a directory.

    python check_lora_with_peft.py make BASE CONFIG.json IDS.safetensors OUT_DIR
    python check_lora_with_peft.py load BASE ADAPTER_DIR IDS.safetensors OUT.safetensors

`make`: `get_peft_model` with the LoraConfig keyword arguments in CONFIG.json
(seeded; with `init_lora_weights=false` B is re-drawn from N(0, 0.05^2) so the
adapter changes the logits, as `shared/fixtures/gen/make_lora.py` does), saved
with PEFT's `save_pretrained` to OUT_DIR/adapter; OUT_DIR/golden.safetensors
holds `logits`, `loss`, `grad.<name>` of every adapter parameter under the
names of `adapter_model.safetensors`, `adamw_step1.<name>` and a 4-step
`loss_curve` [5] of adapter-only AdamW (lr 1e-3, betas (0.9, 0.95), eps 1e-8,
weight decay 0.1), the model in training mode.

`load`: `PeftModel.from_pretrained(model, ADAPTER_DIR)` in evaluation mode;
writes `logits` and, after `merge_and_unload()`, `merged_logits` to OUT and
prints the adapted module count. Exits non-zero when PEFT refuses the adapter
or reports missing or unexpected keys.
"""
import json
import sys

import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)


def base(d):
    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")


def file_name(n):
    """A parameter's name in adapter_model.safetensors: no adapter name, a saved
    module under its own name, DoRA's magnitude without its `.weight`."""
    n = n.replace(".default", "").replace(".modules_to_save", "")
    return n[: -len(".weight")] if n.endswith("lora_magnitude_vector.weight") else n


def make(d, cfg_path, ids_path, out):
    cfg = json.load(open(cfg_path))
    torch.manual_seed(cfg.pop("seed", 0))
    model = get_peft_model(base(d), LoraConfig(task_type="CAUSAL_LM", **cfg))
    if cfg.get("init_lora_weights", True) is False:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0.0, 0.05)
    model.save_pretrained(f"{out}/adapter")
    ids = load_file(ids_path)["input_ids"]
    model.train()
    named = [(file_name(n), p) for n, p in model.named_parameters() if p.requires_grad]
    gold = {}
    o = model(input_ids=ids, labels=ids)
    gold["logits"] = o.logits.detach().clone()
    gold["loss"] = o.loss.detach().reshape(())
    o.loss.backward()
    for n, p in named:
        gold[f"grad.{n}"] = p.grad.detach().clone()
    opt = torch.optim.AdamW([p for _, p in named], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    curve = [o.loss.item()]
    opt.step()
    for n, p in named:
        gold[f"adamw_step1.{n}"] = p.detach().clone()
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        curve.append(loss.item())
        loss.backward()
        opt.step()
    curve.append(model(input_ids=ids, labels=ids).loss.item())
    gold["loss_curve"] = torch.tensor(curve, dtype=torch.float32)
    save_file({k: v.contiguous() for k, v in gold.items()}, f"{out}/golden.safetensors")
    print(sum(p.numel() for _, p in named))


def load(d, adapter, ids_path, out):
    model = PeftModel.from_pretrained(base(d), adapter)
    model.eval()
    # PEFT only warns about keys it did not load: check every tensor arrived.
    want = load_file(f"{adapter}/adapter_model.safetensors")
    got = get_peft_model_state_dict(model)
    if set(got) != set(want):
        sys.exit(f"PEFT holds {sorted(set(got) ^ set(want))} differently from the file")
    for k, v in want.items():
        if not torch.equal(got[k], v):
            sys.exit(f"{k} differs after loading")
    ids = load_file(ids_path)["input_ids"]
    adapted = sum(1 for n, _ in model.named_modules() if n.endswith("lora_A"))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        merged = model.merge_and_unload()(input_ids=ids).logits
    save_file({"logits": logits.contiguous(), "merged_logits": merged.contiguous()}, out)
    print(adapted)


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    {"make": make, "load": load}[cmd](*args)
