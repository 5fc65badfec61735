"""Runs a program written by `kiln::export` in IREE instead of PJRT.

usage: run_in_iree.py DIR IN.safetensors OUT.safetensors

Compiles DIR/program.mlir with IREE's StableHLO input for the llvm-cpu
backend, passes the arguments the manifest lists (inputs `input.{i}` from
IN, state and constants from DIR/weights.safetensors, all flat), checks the
device-side checks, and writes the returned tensors as `output.{i}` (each a
view of a flat result: shape, strides and offset from the manifest).
"""
import json
import sys

import iree.compiler as ireec
import iree.runtime as ireert
import numpy as np
from safetensors.numpy import load_file, save_file


def main(dir_, inp, out):
    with open(f"{dir_}/manifest.json") as f:
        m = json.load(f)
    with open(f"{dir_}/{m['program']['file']}") as f:
        text = f.read()
    vmfb = ireec.compile_str(text, input_type="stablehlo", target_backends=["llvm-cpu"])
    config = ireert.Config("local-task")
    ctx = ireert.SystemContext(config=config)
    ctx.add_vm_module(ireert.VmModule.copy_buffer(ctx.instance, vmfb))
    main_fn = ctx.modules.kiln["main"]
    inputs = load_file(inp)
    weights = load_file(f"{dir_}/{m['weights']['file']}")
    args = []
    for a in m["arguments"]:
        if a["kind"] == "input":
            args.append(np.ascontiguousarray(inputs[f"input.{a['index']}"]).reshape(-1))
        else:
            args.append(weights[a["name"]])
    results = main_fn(*args)
    if not isinstance(results, (tuple, list)):
        results = [results]
    results = [np.asarray(r.to_host() if hasattr(r, "to_host") else r).reshape(-1) for r in results]
    for r, spec in zip(results, m["results"]):
        if spec["kind"] == "check" and not bool(r[0]):
            sys.exit(f"check failed: {spec['message']}")
    outs = {}
    for i, o in enumerate(m["outputs"]):
        flat = results[o["result"]]
        item = flat.itemsize
        view = np.lib.stride_tricks.as_strided(
            flat[o["offset"]:], shape=o["shape"], strides=[s * item for s in o["strides"]]
        )
        outs[f"output.{i}"] = np.ascontiguousarray(view)
    save_file(outs, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
