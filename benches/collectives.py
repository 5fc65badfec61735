#!/usr/bin/env python3
"""Counts the collectives of the largest optimized module XLA dumped.

Run a program with XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text" (see
benches/measure_parallel.sh), then: benches/collectives.py DIR [LINE]. Prints
one JSON line: per collective kind, the number of ops and the bytes of their
results, from the optimized HLO of the largest module (a captured training
step), as each device runs it. With LINE (kiln-bench train's JSON line, which
carries min_<kind>_bytes for DDP and FSDP), also one line per kind: the
measured bytes beside the recipe's minimum and their ratio.
"""
import glob
import json
import os
import re
import sys

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
BYTES = {"f32": 4, "f64": 8, "bf16": 2, "f16": 2, "s32": 4, "s64": 8, "u32": 4, "u8": 1, "s8": 1, "pred": 1}
SHAPE = re.compile(r"\b(f32|f64|bf16|f16|s32|s64|u32|u8|s8|pred)\[([0-9,]*)\]")
# `%name = TYPE kind(OPERANDS), attrs`; async forms are `kind-start`.
OP = re.compile(r"=\s+(.*?)\s+(" + "|".join(KINDS) + r")(?:-start)?\((.*?)\)(?:,|$)")


def nbytes(text):
    total = 0
    for dtype, dims in SHAPE.findall(text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * BYTES[dtype]
    return total


def compare(stats, line):
    """The measured result bytes of each kind beside the minimum kiln-bench printed."""
    bench = json.loads(line)
    for kind in ("all-reduce", "reduce-scatter", "all-gather"):
        key = "min_" + kind.replace("-", "_") + "_bytes"
        if key not in bench:
            continue
        got = stats.get(kind, {}).get("result_bytes", 0)
        least = bench[key]
        ratio = f"{got / least:.4f}" if least else ("1.0000" if got == 0 else "inf")
        print(f"  {kind:15s} measured {got:>12,d} B   minimum {least:>12,d} B   ratio {ratio}")


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    files = glob.glob(os.path.join(sys.argv[1], "*after_optimizations.txt"))
    if not files:
        sys.exit(f"no *after_optimizations.txt in {sys.argv[1]}")
    module = max(files, key=os.path.getsize)
    stats = {k: {"ops": 0, "result_bytes": 0} for k in KINDS}
    for line in open(module):
        m = OP.search(line)
        if not m:
            continue
        result, kind, _operands = m.groups()
        s = stats[kind]
        s["ops"] += 1
        s["result_bytes"] += nbytes(result)
    stats = {k: v for k, v in stats.items() if v["ops"]}
    print(json.dumps({"module": os.path.basename(module), "collectives": stats}))
    if len(sys.argv) == 3:
        compare(stats, sys.argv[2])


if __name__ == "__main__":
    main()
