#!/usr/bin/env bash
# The parallelism measurements in one run (see the README): the llama-16m
# training step captured by kiln::compile on 4 XLA:CPU devices under DDP, FSDP
# and FSDP x TP, each with
#   - the collectives of its optimized program (count and bytes per step, from
#     XLA's dump, benches/collectives.py) beside the recipe's minimum (DDP and
#     FSDP; kiln-bench prints it, see `collective_minimum` in benches/src/llm.rs),
#   - the per-device bytes of parameters + gradients + AdamW state against the
#     unsharded model (state_fraction_per_device; FSDP's target is 1/N),
#   - tokens/s against the one-device step with the same per-device batch;
# expert parallelism's all_to_all bytes beside the routing's minimum,
# dropless and with capacity factors (hf_check on the qwen3_moe fixture); and
# context parallelism's device memory per device against one device's.
# On a 2-core machine the 4 devices share 2 cores: tokens/s measures the
# partitioning overhead, not a speed-up.
# Usage: benches/measure_parallel.sh [BATCH]   (global batch, default 8; seq 256)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

cargo build --release -p kiln-bench >&2
BIN=target/release/kiln-bench
B="${1:-8}"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
quiet() { grep -v '^WARNING\|^I0000\|^W0000\|^E0000' || true; }
common=(train --preset llama-16m --seq 256 --steps 3 --warmup 2 --device tpu --mode compiled)

echo "== one device, the per-device batch ($((B / 4))) and the global batch ($B)"
for b in $((B / 4)) "$B"; do
    "$BIN" "${common[@]}" --batch "$b" 2>&1 | quiet | tail -1
done

for p in "dp=4 ddp" "dp=4 fsdp" "dp=2,tp=2 fsdp+tp"; do
    set -- $p
    echo "== --mesh $1 --parallel $2, global batch $B"
    rm -rf "$TMP/dump"
    XLA_FLAGS="--xla_dump_to=$TMP/dump --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$" KILN_CACHE_DIR="$TMP/cache" \
        "$BIN" "${common[@]}" --batch "$B" --mesh "$1" --parallel "$2" 2>&1 | quiet | tail -1 | tee "$TMP/line"
    python3 benches/collectives.py "$TMP/dump" "$(cat "$TMP/line")"
done

# Expert parallelism: what the all_to_alls of a training step send beside the
# routing's minimum (the remote slots' rows, four exchanges a step), dropless
# and with GShard's capacity factor, on the qwen3_moe fixture (hf_check prints it).
MOE="${KILN_FIXTURES:-../shared/fixtures}/qwen3_moe"
if [ -d "$MOE" ]; then
    cargo build --release --example hf_check >&2
    for cf in "" "--capacity-factor 2" "--capacity-factor 1.25" "--capacity-factor 1"; do
        echo "== --mesh ep=4 --parallel ep ${cf:-(dropless)}"
        # shellcheck disable=SC2086
        KILN_PJRT_CPU_DEVICES=4 target/release/examples/hf_check --model "$MOE" --input-ids "$MOE/golden.safetensors" \
            --out "$TMP/ep" --steps 3 --device tpu --mesh ep=4 --parallel ep $cf 2>&1 | grep "all_to_all per training step"
    done
else
    echo "== expert parallelism: no fixture at $MOE (set KILN_FIXTURES), skipped"
fi

# Context parallelism: the captured step's device memory (XLA's buffer
# assignment of one device's program, benches/program_memory.py) on one device
# and with every sequence split over cp=4 (ring attention), one sequence of 2,048.
for p in "" "--mesh cp=4 --parallel cp"; do
    echo "== one sequence of 2048 tokens ${p:-on one device}"
    rm -rf "$TMP/dump"
    # shellcheck disable=SC2086
    XLA_FLAGS="--xla_dump_to=$TMP/dump --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$" KILN_CACHE_DIR="$TMP/cache" \
        "$BIN" train --preset llama-16m --seq 2048 --batch 1 --steps 2 --warmup 1 --device tpu --mode compiled $p \
        2>&1 | quiet | tail -1
    python3 benches/program_memory.py "$TMP/dump"
done
